"""MMEngine: a hook that reads the runner's message hub, and a visualizer backend.

Importing this module registers `OtelTrainHook` in MMEngine's ``HOOKS`` and `OtelTrainVisBackend` in its
``VISBACKENDS`` registry (``import otel_train`` alone never imports MMEngine). From a config::

    custom_imports = dict(imports=['otel_train.integrations.mmengine'], allow_failed_imports=False)
    custom_hooks = [dict(type='OtelTrainHook')]
    # or: visualizer = dict(type='Visualizer', vis_backends=[dict(type='OtelTrainVisBackend')])

``custom_imports`` is applied by ``Config.fromfile`` only: with a config built in Python (a dict or
``Config(...)``), ``import otel_train.integrations.mmengine`` before building the `Runner`.

The hook writes every train iteration's message-hub scalars (``train/loss``, ``train/lr``, ``train/time`` …)
at MMEngine's own step (``runner.iter + 1``, the step its logger uses), validation metrics as ``val/<name>``,
and spans per train iteration and per validation. The vis backend receives exactly what MMEngine's
`LoggerHook` writes to its other backends (smoothed over its ``interval``). Use one of the two.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

try:
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS, VISBACKENDS
    from mmengine.visualization.vis_backend import BaseVisBackend
except ImportError as err:
    raise ModuleNotFoundError(
        "otel_train.integrations.mmengine needs MMEngine: pip install 'otel-train[mmengine]'", name="mmengine",
    ) from err

import otel_train as ot
from otel_train.integrations._hooks import log_step
from otel_train.integrations._session import OwnedSession

__all__ = ["OtelTrainHook", "OtelTrainVisBackend"]

_logger = logging.getLogger(__name__)


def _placement() -> dict[str, Any]:
    """MMEngine's own rank (its `init_dist` may differ from the launcher's variables)."""
    from mmengine.dist import get_local_rank, get_rank, get_world_size

    try:
        local_rank: int | None = get_local_rank()
    except RuntimeError:  # torch.distributed started without MMEngine's local group: the launcher's env
        local_rank = None
    return {"rank": get_rank(), "local_rank": local_rank, "world_size": get_world_size()}


def _experiment_name() -> str | None:
    """The runner's ``experiment_name``: the Runner names its message hub after it."""
    from mmengine.logging import MessageHub

    try:
        return str(MessageHub.get_current_instance().instance_name) or None
    except Exception:
        return None


def _plain_config(cfg: Any) -> dict[str, Any] | None:
    try:
        return dict(cfg.to_dict()) if cfg is not None else None
    except Exception:
        return None


@HOOKS.register_module()
class OtelTrainHook(Hook):  # type: ignore[misc]
    """Write the message hub's scalars at each train iteration, validation metrics, and spans.

    The priority (``LOW``) places it after MMEngine's `IterTimerHook` and `LoggerHook`
    (``BELOW_NORMAL``), so the iteration's time and loss are already in the message hub.

    Args:
        prefixes: Which message-hub scalars a train iteration writes (keys starting with one of them).
    """

    priority = "LOW"

    def __init__(self, prefixes: tuple[str, ...] = ("train/",)) -> None:
        self.prefixes = tuple(prefixes)
        self._session = OwnedSession()
        self._step: Any = None
        self._span: Any = None
        self._val_span: Any = None

    def before_run(self, runner: Any) -> None:
        try:
            self._session.ensure(config=_plain_config(getattr(runner, "cfg", None)),
                                 run_name=getattr(runner, "experiment_name", None), **_placement())
        except ot.ConfigError:
            raise  # a bad setting fails before training starts
        except Exception:
            _logger.warning("otel-train: could not start for MMEngine", exc_info=True)

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        try:
            self._step = ot.step(runner.iter + 1)
            self._step.__enter__()
            self._span = ot.span("mmengine/train_iter", {"batch_idx": batch_idx, "epoch": runner.epoch})
            self._span.__enter__()
        except Exception:
            _logger.warning("otel-train: before_train_iter failed", exc_info=True)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        try:
            scalars = runner.message_hub.log_scalars
            values = {k: buf.current() for k, buf in scalars.items() if k.startswith(self.prefixes)}
            ot.log(values, step=runner.iter + 1)
        except Exception:
            _logger.warning("otel-train: could not read MMEngine's message hub", exc_info=True)
        self._exit_iter()

    def _exit_iter(self) -> None:
        span, step = self._span, self._step
        self._span = self._step = None
        for scope in (span, step):
            if scope is not None:
                self._exit(scope)

    @staticmethod
    def _exit(scope: Any) -> None:
        try:
            scope.__exit__(None, None, None)
        except Exception:
            _logger.warning("otel-train: could not close a span or step", exc_info=True)

    def before_val_epoch(self, runner: Any) -> None:
        try:
            span = ot.span("mmengine/val", {"epoch": runner.epoch, ot.STEP_ATTRIBUTE: runner.iter})
            span.__enter__()
            self._val_span = span
        except Exception:
            _logger.warning("otel-train: before_val_epoch failed", exc_info=True)

    def after_val_epoch(self, runner: Any, metrics: Mapping[str, Any] | None = None) -> None:
        try:
            if metrics:
                ot.log({f"val/{k}": v for k, v in metrics.items()}, step=runner.iter)
        except Exception:
            _logger.warning("otel-train: could not write MMEngine's validation metrics", exc_info=True)
        span, self._val_span = self._val_span, None
        if span is not None:
            self._exit(span)

    def after_run(self, runner: Any) -> None:
        self._exit_iter()
        self._session.close()


@VISBACKENDS.register_module()
class OtelTrainVisBackend(BaseVisBackend):  # type: ignore[misc]
    """A visualizer backend: what MMEngine's logger writes to TensorBoard/W&B goes to otel-train.

    Args:
        save_dir: Accepted for MMEngine's interface; otel-train writes where `OTEL_TRAIN_DIR` says.
    """

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__(save_dir or "")
        self._session = OwnedSession()
        self._config: dict[str, Any] | None = None

    _env_initialized: bool  # set by BaseVisBackend

    def _init_env(self) -> None:
        self._session.ensure(config=self._config, run_name=_experiment_name(), **_placement())

    def _ready(self) -> None:
        # What MMEngine's `force_init_env` decorator does: start on first use, not at construction.
        if not self._env_initialized:
            self._init_env()
            self._env_initialized = True

    @property
    def experiment(self) -> Any:
        """The otel-train session this backend writes to."""
        self._ready()
        return ot.current_session()

    def add_config(self, config: Any, **kwargs: Any) -> None:
        """Keep the config as the run's config (used when this backend starts the session)."""
        self._config = _plain_config(config)
        self._ready()

    def add_scalar(self, name: str, value: Any, step: int = 0, **kwargs: Any) -> None:
        self._ready()
        log_step({name: value}, step)  # a logged step is a step boundary: collection follows MMEngine's log

    def add_scalars(self, scalar_dict: Mapping[str, Any], step: int = 0, file_path: str | None = None,
                    **kwargs: Any) -> None:
        self._ready()
        log_step(dict(scalar_dict), step)

    def close(self) -> None:
        if self._env_initialized:
            self._session.close()
