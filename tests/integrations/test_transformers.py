"""Hugging Face Transformers: a real `Trainer.train` on the CPU with a tiny torch model; values read back
with TensorBoard's reader and compared with the Trainer's own `log_history`; spans from the Chrome trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the Transformers integration test needs "
                    "`pip install 'otel-train[transformers]'`")

import torch
from backendkit import approx_points
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata
from transformers import Trainer, TrainingArguments

import otel_train as ot
from otel_train.integrations.transformers import OtelTrainCallback
from otel_train.trace_merge import load_trace
from otel_train.vocab.semconv import TRAIN_STEP_DURATION, display_name


class TinyRegressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.layer(x)
        loss = torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(n)]


def _scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    """Every point of `tag` as (step, value), in file order: a step written twice shows twice."""
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_train_logs_at_global_steps_config_and_spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "hf")
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard,chrome_trace")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4, learning_rate=0.01,
        logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=TinyRegressor(), args=args, train_dataset=_data(24), eval_dataset=_data(8),
                      callbacks=[OtelTrainCallback()])
    trainer.train()
    trainer.evaluate()  # after train(): the same run
    assert not ot._session.closed
    ot.shutdown()

    run = tmp_path / "runs" / "hf"
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    history = trainer.state.log_history
    train_loss = [(h["step"], h["loss"]) for h in history if "loss" in h]
    eval_loss = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    assert [s for s, _ in train_loss] == [2, 4, 6]
    assert _scalars(acc, "train/loss") == approx_points(train_loss)
    assert _scalars(acc, "train/learning_rate") == approx_points(
        [(h["step"], h["learning_rate"]) for h in history if "learning_rate" in h])
    # evaluations at steps 3 and 6, and the explicit evaluate() at 6: each one a point of its own
    assert [s for s, _ in eval_loss] == [3, 6, 6]
    assert _scalars(acc, "eval/loss") == approx_points(eval_loss)
    assert [s for s, _ in _scalars(acc, "train/train_runtime")] == [6]  # the end-of-training summary, once

    info = metadata.parse_session_start_info_plugin_data(
        acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG])
    assert info.hparams["learning_rate"].number_value == pytest.approx(0.01)
    assert info.hparams["per_device_train_batch_size"].number_value == 4

    spans: dict[str, list[dict[str, Any]]] = {}
    for event in load_trace(run / "trace" / "rank0.trace.json"):
        if event.get("ph") == "X":
            spans.setdefault(event["name"], []).append(event)
    assert [e["args"]["train.step"] for e in spans["train/step"]] == [1, 2, 3, 4, 5, 6]
    assert [e["args"]["train.step"] for e in spans["eval"]] == [3, 6, 6]
    assert [e["args"]["train.step"] for e in spans["checkpoint/save"]] == [3, 6]
    assert len(spans["train/epoch"]) == 1
    # Every step ran inside otel_train.step(n): a step duration at 1..6.
    assert [s for s, _ in _scalars(acc, display_name(TRAIN_STEP_DURATION))] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("name", ["otel_train.integrations.transformers", "otel_train.integrations._hooks"])
def test_docstring_examples(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(("ranks", "exported"), [("0", False), ("all", True)])
def test_trainer_process_index_is_the_rank_and_otel_train_ranks_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: str, exported: bool
) -> None:
    from transformers import TrainerControl, TrainerState

    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RANKS", ranks)
    # What process 1 of a 2-process job sees (set by torch.distributed through Accelerate's state).
    monkeypatch.setattr(TrainingArguments, "process_index", property(lambda self: 1))
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    OtelTrainCallback().on_log(args, TrainerState(global_step=4), TrainerControl(), logs={"loss": 0.5})
    session = ot._session
    assert (session.run.rank, session.run.world_size) == (1, 2)
    assert session.export_metrics is exported
