"""Every place otel-train relies on the OpenTelemetry SDK (or CPython) beyond its public API, in one module.

Some of what otel-train does has no public API in the SDK: a raw OTel point gets the step it was recorded in,
a reader collects on demand even before the first instrument exists, and a forked child drops its copy of the
parent's aggregations. Each such use is one function here. Its docstring says why it is needed and what
happens where a release has moved the internal. The fallback then loses only that feature and logs it once.
Nothing here raises into the training loop: only `check_supported` (the one version gate) and
`proxy_instruments` raise, and both run inside `init()` before it starts any process or thread.

Supported: opentelemetry-api and -sdk `>=1.42,<2`. `pyproject.toml` pins the same range for -proto and the OTLP
exporters, and `tests/test_sdk_compat.py` keeps the pins in step. The floor is 1.42 for two reasons. A meter
provider hands itself to its readers (`MetricReader._set_meter_provider`) only from 1.41 on, and that is how
the reader finds the provider's measurement storage and resource; below it every raw OTel point would take its
window's step. In 1.41 the SDK's own metrics (`otel.sdk.*`) are always on, so every backend would get those
series too; from 1.42 on they are opt-in. The ceiling is the next major: the public API we use is stable
within 1.x (OTel's versioning policy), and each internal below has a fallback. `.ci/run` tests the floor and
the latest release.

Besides the functions, some subclasses use protected members of their OTel base class. These are the
documented way to extend it, or the only way, and each is covered by the tests on the floor and the latest
release. The step-aligned reader overrides `MetricReader._receive_metrics` (the abstract method the SDK
documents for reader subclasses) and `_set_meter_provider` (1.41 on). `global_providers._SessionMeter` calls
`Meter._register_instrument` and reads a proxy's `_name`/`_unit`/`_description`. `global_providers._SessionTracer`
overrides `ProxyTracer._tracer` (the API's own switch point) and reads its constructor arguments back.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import trace as _trace
from opentelemetry.context.context import Context as _Context

from otel_train.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader, MetricsData
    from opentelemetry.sdk.resources import Resource

__all__ = [
    "SDK_REQUIREMENT", "SPAN_KEY", "check_supported", "collect", "context_var", "discard_measurements",
    "empty_after_fork", "intercept_measurements", "provider_resource", "proxy_instruments", "readable_log_record", "reader_options",
    "reader_storage", "register_before_atexit", "supported_problem", "sync_gauge_class", "with_attribute",
]

_logger = logging.getLogger(__name__)

#: The lowest supported release (see the module docstring) and the first unsupported one.
SDK_FLOOR: Final = (1, 42)
SDK_CEILING: Final = (2,)
#: The pip requirement for every OTel package otel-train depends on (`pyproject.toml` says the same).
SDK_REQUIREMENT: Final = ">=1.42,<2"

Consume = Callable[..., None]

# -- the version gate ------------------------------------------------------------------------------------


def _installed(distribution: str) -> str | None:
    """The version of the OTel package Python actually imports (not what some other path's metadata says)."""
    try:
        if distribution == "opentelemetry-sdk":
            from opentelemetry.sdk.version import __version__ as sdk_version

            return sdk_version
        from opentelemetry.version import __version__ as api_version

        return api_version
    except ImportError:
        return None


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(p) for p in match.groups() if p is not None) if match else None


def supported_problem() -> str | None:
    """Why the installed OTel API/SDK cannot run otel-train (one line), or None when it can."""
    for distribution in ("opentelemetry-sdk", "opentelemetry-api"):
        version = _installed(distribution)
        requirement = f"'{distribution}{SDK_REQUIREMENT}'"
        if version is None:
            return f"{distribution} is not installed; otel-train needs {distribution}{SDK_REQUIREMENT}: " \
                   f"pip install {requirement}"
        release = _release(version)
        if release is None or not SDK_FLOOR <= release < SDK_CEILING:
            return (f"{distribution} {version} is installed, otel-train needs {distribution}{SDK_REQUIREMENT}: "
                    f"pip install -U otel-train (or pip install {requirement})")
    return None


def check_supported() -> None:
    """Fail fast on an OTel SDK otel-train cannot run on; `init()` calls it before it starts anything.

    Raises:
        ConfigError: one line naming the installed version and the one needed.
    """
    problem = supported_problem()
    if problem is None:
        try:  # the one internal without a fallback: fail here, before anything starts, not in the session
            proxy_instruments()
        except ImportError as err:
            problem = str(err)
    if problem is not None:
        raise ConfigError(problem)


# -- metrics: reader construction ------------------------------------------------------------------------


def sync_gauge_class() -> type | None:
    """The SDK's synchronous gauge class. A reader's temporality preference has to name it so that DELTA frees
    per-step attribute sets, and the SDK's temporality environment variable skips gauges. The SDK exports the
    class only under the private name `opentelemetry.sdk.metrics._Gauge`. Returns None where that name is
    gone; gauges then keep the SDK's default temporality (CUMULATIVE, one attribute set per step until
    shutdown)."""
    try:
        from opentelemetry.sdk.metrics import _Gauge
    except ImportError:
        _logger.debug("opentelemetry-sdk has no `_Gauge`: synchronous gauges keep their default temporality")
        return None
    return _Gauge


@functools.cache
def _has_cardinality_limits() -> bool:
    import inspect

    from opentelemetry.sdk.metrics.export import MetricReader

    return "cardinality_limits" in inspect.signature(MetricReader.__init__).parameters


def reader_options(temporality: Mapping[type, Any], series_limit: int) -> dict[str, Any]:
    """Keyword arguments for `MetricReader.__init__`: `temporality`, plus a cardinality limit of `series_limit`
    per instrument kind where the SDK has one. From 1.45.2 on, the SDK's default limit of 2000 would fold a
    window's per-step attribute sets into one overflow series. Earlier releases keep every attribute set (the
    keyword does not exist there)."""
    options: dict[str, Any] = {"preferred_temporality": dict(temporality)}
    if _has_cardinality_limits():
        options["cardinality_limits"] = {kind: series_limit for kind in temporality}
    return options


# -- metrics: the reader's view of its provider ----------------------------------------------------------


def provider_resource(meter_provider: Any) -> Resource | None:
    """The resource a meter provider was built with. A reader is handed the provider, and the SDK keeps the
    resource only in the provider's private `_sdk_config`. Returns None where that is gone; the reader then
    keeps the resource it was given (or `Resource.create()`)."""
    from opentelemetry.sdk.resources import Resource

    resource = getattr(getattr(meter_provider, "_sdk_config", None), "resource", None)
    return resource if isinstance(resource, Resource) else None


def reader_storage(meter_provider: Any, reader: MetricReader) -> Any:
    """The SDK's measurement storage for `reader` (`_measurement_consumer._reader_storages[reader]`). Every
    synchronous measurement goes through it, so the reader can stamp a step on it (`intercept_measurements`)
    and empty it after a fork (`empty_after_fork`). Returns None where the layout differs: raw OTel points
    then take the step that ends their window."""
    storages = getattr(getattr(meter_provider, "_measurement_consumer", None), "_reader_storages", None)
    storage = storages.get(reader) if isinstance(storages, Mapping) else None
    if storage is None:
        _logger.debug("no SDK measurement storage found for the reader: raw OTel points take their window's step")
    return storage


def intercept_measurements(storage: Any, wrap: Callable[[Consume], Consume]) -> bool:
    """Replace `storage.consume_measurement` by `wrap(original)`: the wrapper sees each measurement on the
    thread that records it (the one place that knows the step a raw OTel point was recorded in). Returns False,
    changing nothing, where the storage has no such method."""
    consume = getattr(storage, "consume_measurement", None)
    if storage is None or not callable(consume):
        return False
    storage.consume_measurement = wrap(consume)
    return True


def _discard(*args: Any, **kwargs: Any) -> None:
    return None


def discard_measurements(storage: Any) -> None:
    """Make `storage` drop every measurement. A forked child that exports nothing should not keep what raw OTel
    instruments record there."""
    if storage is not None:
        storage.consume_measurement = _discard


def empty_after_fork(storage: Any) -> bool:
    """Drop the SDK's pending aggregations in `storage`, in a forked child. Only one thread runs there, so no
    lock is taken. The locks are replaced because one held by a parent's thread at the fork would block the
    child forever. Returns False where the layout differs (nothing changed; the child keeps the parent's
    pending points)."""
    if storage is None:
        return False
    try:
        storage._lock = threading.RLock()
        for matches in storage._instrument_view_instrument_matches.values():
            for match in matches:
                match._lock = threading.Lock()
                match._attributes_aggregation = {}
    except AttributeError:
        _logger.debug("cannot empty the SDK's storage after fork", exc_info=True)
        return False
    return True


_warned_collect = False


def collect(reader: MetricReader, timeout_millis: float) -> MetricsData | None:
    """Collect `reader` now and return the data without handing it to `_receive_metrics`. This calls the
    collect callback the provider registered (`reader._collect`) because the public `collect()` skips
    `_receive_metrics` when no instrument exists, and the reader must still drain its own buffers then.
    Returns None before a provider registered the reader. Where the callback is gone, it also returns None and
    warns once: raw OTel instruments are then not exported, but `otel_train.log` values and spans still are."""
    global _warned_collect
    if not hasattr(reader, "_collect"):
        if not _warned_collect:
            _warned_collect = True
            _logger.warning("this opentelemetry-sdk has no reader collect callback: raw OTel instruments are not "
                            "exported (otel_train.log values and spans are); otel-train needs "
                            "opentelemetry-sdk%s", SDK_REQUIREMENT)
        return None
    callback: Any = reader._collect  # the SDK annotates it with other argument and return types than it has
    if callback is None:
        return None
    return callback(reader, timeout_millis)  # type: ignore[no-any-return]


def with_attribute(measurement: Any, key: str, value: Any) -> Any:
    """A copy of an SDK `Measurement` with `key=value` added to its attributes. The frozen dataclass is copied
    field by field, not rebuilt, because its `__post_init__` would clean the attributes again and they are
    already clean. Where the layout differs it is rebuilt with `dataclasses.replace`, and where even that
    fails the measurement is returned unchanged (the point then takes its window's step)."""
    attrs = measurement.attributes
    merged = {**attrs, key: value} if attrs else {key: value}
    try:
        stamped = object.__new__(type(measurement))
        fields = stamped.__dict__
        fields.update(measurement.__dict__)
        fields["attributes"] = merged
        return stamped
    except (AttributeError, TypeError):
        import dataclasses

        try:
            return dataclasses.replace(measurement, attributes=merged)
        except (TypeError, ValueError):
            return measurement


# -- the API's proxies (OTel's global meter and tracer follow each session) ----------------------------------


def proxy_instruments() -> dict[str, Any]:
    """The OTel API's proxy instrument classes, by kind (`counter`, `gauge`, ...; the `create_<kind>` methods).
    A proxy re-creates its real instrument whenever `on_meter_set(meter)` is called. That is what lets an
    instrument obtained from OTel's global meter before `init()` (or before the next session) follow the running
    session (`otel_train._internal.global_providers`). The API keeps them private
    (`opentelemetry.metrics._internal.instrument`). Imported here on first use: `opentelemetry.metrics` costs
    ~20 ms, which `import otel_train` does not pay.

    Raises:
        ImportError: where they are gone, naming the API version otel-train needs (`init()` fails with it).
    """
    try:
        from opentelemetry.metrics._internal import instrument as api
    except ImportError as err:  # pragma: no cover - an API that moved them
        raise ImportError(f"opentelemetry-api {_installed('opentelemetry-api')} has no proxy instruments; "
                          f"otel-train needs opentelemetry-api{SDK_REQUIREMENT}") from err
    kinds = {"counter": "_ProxyCounter", "up_down_counter": "_ProxyUpDownCounter", "histogram": "_ProxyHistogram",
             "gauge": "_ProxyGauge", "observable_counter": "_ProxyObservableCounter",
             "observable_gauge": "_ProxyObservableGauge",
             "observable_up_down_counter": "_ProxyObservableUpDownCounter"}
    missing = [name for name in kinds.values() if not hasattr(api, name)]
    if missing:
        raise ImportError(f"opentelemetry-api {_installed('opentelemetry-api')} has no {', '.join(missing)}; "
                          f"otel-train needs opentelemetry-api{SDK_REQUIREMENT}")
    return {kind: getattr(api, name) for kind, name in kinds.items()}


# -- tracing ---------------------------------------------------------------------------------------------

#: The context key under which `trace.set_span_in_context` keeps the current span. Reading and writing it
#: directly saves two context copies per span. It is private to the API (`opentelemetry.trace.propagation`);
#: where that name is gone, the key is read off a context that `set_span_in_context` built.
SPAN_KEY: str
try:
    from opentelemetry.trace.propagation import _SPAN_KEY as SPAN_KEY
except ImportError:  # pragma: no cover - an API without it
    SPAN_KEY = next(iter(_trace.set_span_in_context(_trace.INVALID_SPAN, _Context())))



def context_var() -> ContextVar[_Context] | None:
    """The `ContextVar` that holds OTel's current context, where the API keeps it in its default runtime context
    (`ContextVarsRuntimeContext`, whose variable is private): `ot.span` gets, sets and resets it directly, three
    Python calls fewer a span than `context.get_current`/`attach`/`detach`, which only forward to it. None where
    `OTEL_PYTHON_CONTEXT` chose another runtime context, or the name is gone: then the API's functions."""
    from opentelemetry import context as _context

    try:
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
    except ImportError:  # pragma: no cover - an API that moved it
        return None
    runtime = getattr(_context, "_RUNTIME_CONTEXT", None)
    var = getattr(runtime, "_current_context", None)
    return var if type(runtime) is ContextVarsRuntimeContext and isinstance(var, ContextVar) else None


# -- logs ------------------------------------------------------------------------------------------------


def readable_log_record(resource: Resource, scope: str, *, timestamp: int, severity_number: int,
                        severity_text: str, body: str, attributes: Mapping[str, Any], trace_id: int,
                        span_id: int) -> Any | None:
    """An SDK log record as the SDK's OTLP log exporters take it (`ReadableLogRecord`, 1.39 on). The logs
    signal of the SDK is still under `opentelemetry.sdk._logs` (the API's under `opentelemetry._logs`), so
    these names may move; where they are gone this returns None and the `otlp` backend sends no log records
    (warned once there)."""
    try:
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import TraceFlags
    except ImportError:  # pragma: no cover - a release that moved them
        return None
    severity = SeverityNumber(severity_number) if 0 < severity_number <= 24 else SeverityNumber.UNSPECIFIED
    record = LogRecord(timestamp=timestamp, observed_timestamp=timestamp, trace_id=trace_id, span_id=span_id,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if span_id else TraceFlags.DEFAULT),
                       severity_text=severity_text, severity_number=severity, body=body,
                       attributes=dict(attributes))
    return ReadableLogRecord(record, resource, InstrumentationScope(scope))


# -- CPython -----------------------------------------------------------------------------------------------


def register_before_atexit(hook: Callable[[], None]) -> bool:
    """Run `hook` at interpreter exit before every `atexit` hook, using CPython's private
    `threading._register_atexit` (3.9 on). A backend client's own atexit hook could otherwise close its run
    before otel-train has flushed into it. Returns False where it is missing or the interpreter is already
    exiting; the caller's plain `atexit` hook then does the work, later."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    try:
        register(hook)
    except RuntimeError:  # the interpreter is already shutting down
        return False
    return True
