"""Hugging Face Transformers, resumed: a real `Trainer.train` on the CPU checkpoints every 4 steps and runs to
step 8 in one process; a new process resumes from the checkpoint at step 4 (other data, so other values) and
runs to step 6. TensorBoard (read back with its own reader, which honours the purge) and JSONL
(`resolve_resumes`) then hold exactly what the resumed Trainer's own `log_history` holds: the first attempt's
values up to step 4, the second attempt's from step 5, nothing of the first attempt's steps 5..8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the Transformers integration test needs "
                    "`pip install 'otel-train[transformers]'`")

import torch
from transformers import Trainer, TrainingArguments

RUN = "hf-resume"


class TinyRegressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.layer(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(n)]


def _trainer(out: Path, max_steps: int, seed: int) -> Trainer:
    from otel_train.integrations.transformers import OtelTrainCallback

    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=0.01,
        logging_steps=1, save_strategy="steps", save_steps=4, report_to="none", use_cpu=True, disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=TinyRegressor(), args=args, train_dataset=_data(32, seed), callbacks=[OtelTrainCallback()])


def _expected(history: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """(tag -> step -> value) as the callback names a `log_history` (a later entry of one step wins)."""
    from otel_train.integrations.transformers import metric_names

    out: dict[str, dict[int, float]] = {}
    for entry in history:
        for tag, v in metric_names({k: v for k, v in entry.items() if k != "step"}).items():
            out.setdefault(tag, {})[entry["step"]] = float(v)
    return out


@pytest.mark.parametrize("session", ["callback", "user"])
def test_resume_from_checkpoint_supersedes_the_earlier_attempts_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session: str
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import otel_train as ot
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl, resolve_resumes

    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", RUN)
    monkeypatch.setenv("OTEL_TRAIN_RUN_ID", RUN)
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard,jsonl")
    first = subprocess.run([sys.executable, __file__, str(tmp_path / "out")], capture_output=True, text=True,
                           timeout=300, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    first_steps = {e["step"] for e in json.loads((tmp_path / "out" / "first.json").read_text())}
    assert max(first_steps) == 8

    if session == "user":  # a session already running: the callback declares the resume with `ot.resume`
        ot.init()
    trainer = _trainer(tmp_path / "out", max_steps=6, seed=1)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    ot.shutdown()
    want = _expected(trainer.state.log_history)  # the first attempt's entries up to 4, then this one's
    assert sorted(want["train/loss"]) == [1, 2, 3, 4, 5, 6]

    run = tmp_path / "runs" / RUN
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, values in want.items():
        shown: dict[int, set[float]] = {}
        for e in acc.Scalars(tag):  # `epoch` comes twice at the last step (its log and the summary): same value
            shown.setdefault(e.step, set()).add(e.value)
        assert {s: v.pop() for s, v in shown.items() if len(v) == 1} == pytest.approx(values), tag  # one value a step
        assert sorted(shown) == sorted(values), tag
    # otel-train's own per-step series too: steps 1..6 once each (the first attempt's 7 and 8 purged).
    assert sorted(e.step for e in acc.Scalars("train/step_duration_s")) == [1, 2, 3, 4, 5, 6]

    records = resolve_resumes(read_jsonl(jsonl_path(tmp_path / "runs", RUN, 0)))
    points: dict[str, dict[int, list[float]]] = {}
    for r in records:
        if r["type"] == "metric" and r["tag"] in want:
            points.setdefault(r["tag"], {}).setdefault(r["step"], []).append(r["value"])
    for tag, values in want.items():
        assert all(len(set(v)) == 1 for v in points[tag].values()), tag  # one value a step
        assert {s: v[0] for s, v in points[tag].items()} == pytest.approx(values), tag


def _first_attempt(out: Path) -> None:
    trainer = _trainer(out, max_steps=8, seed=0)
    trainer.train()
    import otel_train as ot

    ot.shutdown()
    (out / "first.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":  # the first attempt, in a process of its own
    _first_attempt(Path(sys.argv[1]))
