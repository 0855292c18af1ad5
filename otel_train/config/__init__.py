"""Configuration in one place: the settings read from ``OTEL_TRAIN_*`` and `init()`'s keywords (`settings`), the
parsers of setting values (`values`), what every backend is given (`exporter_options`), which rows go to which
backend (`routing`) and the backends by name (`registry`).

`otel_train.config` keeps the names it always had: `load_settings`, `Settings`, `Route`, `StepSelection`.
"""

from otel_train.config.settings import Route, Settings, StepSelection, load_settings

__all__ = ["Route", "Settings", "StepSelection", "load_settings"]
