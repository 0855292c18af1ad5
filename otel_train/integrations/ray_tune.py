"""Ray Tune: every trial result as gauges at Tune's step, trial lifetimes as spans.

Tune calls its callbacks in the driver process (the one that runs ``Tuner.fit()``), not in the trial
workers, so this callback is the one place that sees every trial. It starts otel-train there (rank 0 of a
world of 1) when the user has not. Trial workers need nothing; a trainable that calls `otel_train` itself
runs its own session in its worker.

Every trial writes into the same run, one series per trial: the result key is the tag and ``trial_id`` is
an attribute (``otel_train.log(..., attributes={"trial_id": ...})``), so TensorBoard shows
``tune/loss{trial_id=ab12_00000}`` (the Names contract's suffix).

The step is the one Tune's own loggers use: ``timesteps_total`` when the trainable reports it, else
``training_iteration``, so the curves line up with Tune's TensorBoard output. Values are what Tune's
TensorBoard logger writes: numbers (bools as 0/1, tensors and NumPy scalars converted as `otel_train.log`
converts them), nested dicts flattened with ``/``; NaN and +-inf are kept (a diverged trial stays on its
curve). Anything else (strings, lists) is left out, counted (`left_out`) and warned about once per key.
Each result is a step boundary (`otel_train.step_ended`), so collection follows the trials' results.

Example:
    >>> from otel_train.integrations.ray_tune import OtelTrainCallback  # doctest: +SKIP
    >>> tuner = tune.Tuner(train_fn, run_config=tune.RunConfig(callbacks=[OtelTrainCallback()]))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any

try:
    from ray.tune import Callback
except ImportError as err:
    raise ModuleNotFoundError(
        "otel_train.integrations.ray_tune needs Ray Tune: pip install 'otel-train[ray]'", name="ray",
    ) from err

import otel_train as ot
from otel_train._internal.values import to_float
from otel_train.integrations._hooks import LeftOut, flatten
from otel_train.integrations._session import OwnedSession, session_running

__all__ = ["OtelTrainCallback"]

_logger = logging.getLogger(__name__)

# Result fields that are identifiers or wall-clock stamps, not curves.
_SKIP = frozenset({"config", "pid", "timestamp", "date", "hostname", "node_ip", "trial_id", "experiment_id",
                   "experiment_tag", "done", "should_checkpoint", "trial_resources", "checkpoint_dir_name"})
STEP_KEY = "training_iteration"
TIMESTEPS_KEY = "timesteps_total"  # Tune's loggers' step when reported (`TBXLoggerCallback`)


def _tune_step(result: Mapping[str, Any]) -> Any:
    """The step Tune's own loggers give a result: ``timesteps_total`` if set, else ``training_iteration``."""
    timesteps = result.get(TIMESTEPS_KEY)
    return timesteps if isinstance(timesteps, numbers.Integral) and not isinstance(timesteps, bool) \
        else result.get(STEP_KEY)


def _numbers(result: Mapping[str, Any], left_out: LeftOut | None = None) -> dict[str, float]:
    """The leaves of a (nested) result as floats, keys joined with ``/`` (Tune's `flatten_dict`), converted as
    `otel_train.log` converts (bools 0/1, NaN/+-inf kept). ``None`` (a field Tune fills only when reported) is
    skipped; any other non-number goes to `left_out`."""
    out: dict[str, float] = {}
    for key, value in flatten({k: v for k, v in result.items() if k not in _SKIP}).items():
        if value is None:
            continue
        number = to_float(value) if not isinstance(value, (str, bytes)) else None
        if number is None:
            if left_out is not None:
                left_out.keep({key: value})  # counts and warns once per key
            continue
        out[key] = number
    return out


def _error_message(trial: Any) -> str:
    """The last line of the trial's error (Ray wraps it in a traceback), else where Tune saved it."""
    try:
        # Tune writes the error text next to the trial on the driver before it calls `on_trial_error`.
        with open(trial.error_file, encoding="utf-8", errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    except (OSError, TypeError):
        pass  # no error file (None) or unreadable: the span still says the trial failed
    return f"trial failed (see {getattr(trial, 'error_file', None)})"


class OtelTrainCallback(Callback):
    """A `ray.tune.Callback` writing trial results and trial lifetimes to otel-train.

    Args:
        prefix: Prepended to every result key (``tune/`` groups Tune's fields in one TensorBoard section
            and one ClearML title). Use ``""`` for the bare keys.
        config_attributes: Also put each trial's flat config values on its trial span, so the timeline
            says which hyperparameters a trial ran with.

    Example:
        >>> cb = OtelTrainCallback()  # doctest: +SKIP
        >>> tune.Tuner(fn, run_config=tune.RunConfig(callbacks=[cb])).fit()  # doctest: +SKIP
    """

    def __init__(self, prefix: str = "tune/", config_attributes: bool = True) -> None:
        self.prefix = prefix
        self.config_attributes = config_attributes
        self._session = OwnedSession()
        self._spans: dict[str, Any] = {}
        # Kept through get_state/set_state, so a resumed experiment writes into the same run.
        self._run_id: str | None = None
        self._run_name: str | None = None
        self._last_step: dict[str, int] = {}
        self._left_out = LeftOut("a Ray Tune trial")

    @property
    def left_out(self) -> int:
        """How many result values were not numbers (strings, lists ...) and were left out."""
        return self._left_out.count

    # -- Tune's checkpointed state ----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any] | None:
        return {"run_id": self._run_id, "run_name": self._run_name, "last_step": dict(self._last_step)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._run_id = state.get("run_id")
        self._run_name = state.get("run_name")
        self._last_step = dict(state.get("last_step") or {})

    # -- Tune's events ------------------------------------------------------------------------------------
    def setup(self, *args: Any, **info: Any) -> None:
        # Called after set_state on a restore, so the resumed run id is known here.
        self._start()

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._open_span(trial)

    def on_trial_restore(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._open_span(trial)

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        try:
            self._record(trial, result)
        except Exception:  # never into Tune's loop
            _logger.warning("otel-train: could not record a Ray Tune result", exc_info=True)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._close_span(trial, None)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._close_span(trial, _error_message(trial))

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        for trial_id in list(self._spans):
            self._end(trial_id, "experiment ended before the trial did")
        self._session.close()

    # -- internals ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        if not session_running():
            self._session.ensure(rank=0, local_rank=0, world_size=1, run_name=self._run_name, run_id=self._run_id)
        run = getattr(ot.current_session(), "run", None)
        if run is not None:  # remember what init chose (env or generated) for a resume
            self._run_id = getattr(run, "run_id", self._run_id)
            self._run_name = getattr(run, "run_name", self._run_name)

    def _record(self, trial: Any, result: Mapping[str, Any]) -> None:
        self._start()
        step = _tune_step(result)
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            step = self._last_step.get(trial.trial_id, 0) + 1
        step = int(step)
        self._last_step[trial.trial_id] = step
        values = {self.prefix + key: value for key, value in _numbers(result, self._left_out).items()}
        if values:  # one series per trial: `trial_id` is an attribute (NaN/+-inf kept, as `ot.log` keeps them)
            ot.log(values, step=step, attributes={"trial_id": str(trial.trial_id)})
        ot.step_ended(step)  # a result is a step boundary: collection follows the trials

    def _open_span(self, trial: Any) -> None:
        try:
            self._start()
            if trial.trial_id in self._spans:
                return
            attributes: dict[str, Any] = {"trial_id": str(trial.trial_id),
                                          ot.STEP_ATTRIBUTE: self._last_step.get(trial.trial_id, 0)}
            if self.config_attributes:
                for key, value in _numbers(getattr(trial, "config", None) or {}).items():
                    attributes[f"config/{key}"] = value
            span = ot.get_tracer(__name__).start_span("tune/trial", attributes=attributes)
            self._spans[trial.trial_id] = span
        except Exception:
            _logger.warning("otel-train: could not open the span of a Ray Tune trial", exc_info=True)

    def _close_span(self, trial: Any, error: str | None) -> None:
        try:
            self._end(trial.trial_id, error)
        except Exception:
            _logger.warning("otel-train: could not close the span of a Ray Tune trial", exc_info=True)

    def _end(self, trial_id: str, error: str | None) -> None:
        span = self._spans.pop(trial_id, None)
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("tune/last_iteration", self._last_step.get(trial_id, 0))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
