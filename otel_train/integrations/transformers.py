"""Hugging Face Transformers: a `TrainerCallback` that sends the Trainer's logs and timings to otel-train.

Usage::

    from otel_train.integrations.transformers import OtelTrainCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[OtelTrainCallback()])

`report_to` cannot name it: Transformers maps `report_to` names through a fixed table
(`INTEGRATION_TO_CALLBACK`) with no registration hook, so pass it in ``callbacks=[...]``.

What appears where:

- Every `Trainer.log` call (``logging_steps``, evaluation results, the end-of-training summary) becomes
  gauges at `state.global_step`, named the way Transformers' own TensorBoard callback names them:
  ``eval_loss`` -> ``eval/loss``, ``test_x`` -> ``test/x``, anything else ``x`` -> ``train/x``.
- `TrainingArguments` (and the model's config, when it has one) become the run config.
- Spans: ``train/epoch``; ``train/step`` from `on_step_begin` to `on_step_end`, inside
  ``otel_train.step(n)`` where ``n`` is the `global_step` the step produces (the step its logs carry);
  ``eval`` for each evaluation; ``checkpoint/save`` for each save during training.

Resume: a `Trainer.train(resume_from_checkpoint=...)` restores `state.global_step` = G before
`on_train_begin`; the new attempt's first step is G + 1 (the step its first logs carry), so the run
restarts at N = G + 1 (`init(resume_step=N)` when this callback starts the session, else
`otel_train.resume(N)`): every backend supersedes the earlier attempt's steps >= N, and the checkpoint's
own step G keeps its values.

It calls `otel_train.init()` (env configuration) when the user has not, with the Trainer's process
index, local process index and world size; `OTEL_TRAIN_RANKS` decides which ranks export metrics. A
session it started is flushed at the end of training and shut down at interpreter exit, so a
``trainer.evaluate()`` after ``train()`` lands in the same run.

This module imports ``transformers``; ``import otel_train`` does not.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import otel_train as ot
from otel_train.integrations._hooks import HookSpans, HookStep, numeric
from otel_train.integrations._session import OwnedSession

try:
    from transformers import TrainerCallback
except ImportError as err:
    raise ModuleNotFoundError(
        "otel_train.integrations.transformers needs transformers: pip install 'otel-train[transformers]'",
        name="transformers",
    ) from err

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

__all__ = ["OtelTrainCallback", "metric_names"]

_logger = logging.getLogger(__name__)
_PREFIXES = (("eval_", "eval/"), ("test_", "test/"))


def metric_names(logs: Mapping[str, Any]) -> dict[str, Any]:
    """The numeric entries of a Trainer log, named as Transformers' TensorBoard callback names them.

    Example:
        >>> metric_names({"loss": 0.5, "eval_loss": 0.4, "eval_model_preparation_time": 0.1, "note": "x"})
        {'train/loss': 0.5, 'eval/loss': 0.4, 'eval/model_preparation_time': 0.1}
    """
    out: dict[str, Any] = {}
    for key, value in numeric(logs).items():
        for prefix, group in _PREFIXES:
            if key.startswith(prefix):
                out[group + key[len(prefix):]] = value
                break
        else:
            out["train/" + key] = value
    return out


def _run_config(args: TrainingArguments, model: Any) -> dict[str, Any]:
    """Model config (if any) under the TrainingArguments, as Transformers' W&B callback combines them."""
    config: dict[str, Any] = {}
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if callable(to_dict):
        try:
            config.update(to_dict())
        except Exception:  # a custom config that cannot serialise must not stop training
            _logger.warning("the model's config could not be read; the run config holds TrainingArguments only",
                            exc_info=True)
    config.update(args.to_sanitized_dict())
    return config


class OtelTrainCallback(TrainerCallback):
    """A `TrainerCallback`: logs -> gauges at `state.global_step`, steps and evaluations -> spans.

    Example:
        >>> trainer = Trainer(model, args, callbacks=[OtelTrainCallback()])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._owned = OwnedSession()
        self._spans = HookSpans()
        self._step = HookStep()

    def _ensure(self, args: TrainingArguments, config: Mapping[str, Any] | None = None) -> None:
        self._owned.ensure(rank=args.process_index, local_rank=args.local_process_index,
                           world_size=args.world_size, config=config)

    # -- run ---------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        config = _run_config(args, kwargs.get("model"))
        if state.global_step > 0:  # restored from a checkpoint (a fresh `train()` starts at 0)
            # The first new step is global_step + 1 (`on_step_begin`): the checkpoint's own step keeps its values.
            self._owned.resume_at(state.global_step + 1, rank=args.process_index, local_rank=args.local_process_index,
                                  world_size=args.world_size, config=config)
        else:
            self._ensure(args, config)
        self._owned.add_config(config)  # a session the user started gets it too

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._step.end()
        self._spans.end_all()
        ot.flush()

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._spans.begin("epoch", "train/epoch", state.global_step, {"epoch": int(state.epoch or 0)})

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._spans.end("epoch")
        self._after_step_or_epoch(args, state, control)

    # -- steps -------------------------------------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        produced = state.global_step + 1  # the global_step this optimizer step ends with (its logs carry it)
        self._step.begin(produced)
        self._spans.begin("step", "train/step", produced)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._spans.end("step")
        self._step.end()
        self._after_step_or_epoch(args, state, control)

    def _after_step_or_epoch(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        # The Trainer logs, evaluates, then saves right after `on_step_end`/`on_epoch_end`, and only
        # tells callbacks when evaluation and saving are over; DefaultFlowCallback (which runs first)
        # has already set what it will do.
        if control.should_evaluate:
            self._spans.begin("eval", "eval", state.global_step)
        elif control.should_save:
            self._spans.begin("save", "checkpoint/save", state.global_step)

    # -- evaluation, saving, logs ------------------------------------------------------------------
    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # `trainer.evaluate()` called by the user: the span starts at its first batch's end.
        if not self._spans.is_open("eval"):
            self._ensure(args)
            self._spans.begin("eval", "eval", state.global_step)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._spans.end("eval")
        # With save_strategy="best" the Trainer decides on saving only after this hook.
        if control.should_save and str(args.save_strategy) != "best":
            self._spans.begin("save", "checkpoint/save", state.global_step)

    def on_predict(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: Any, **kwargs: Any
    ) -> None:
        self._spans.end("eval")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._spans.end("save")

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        logs: Mapping[str, Any] | None = None, **kwargs: Any,
    ) -> None:
        if not logs:
            return
        self._ensure(args)
        values = metric_names(logs)
        if values:
            ot.log(values, step=state.global_step)
