"""Hugging Face Transformers, resumed: a real `Trainer.train` on the CPU checkpoints every 4 steps and runs to
step 8 in one process; a new process resumes from the checkpoint at step 4 (other data, so other values) and
runs to step 6. TensorBoard (read back with its own reader, which honours the purge) and JSONL
(`resolve_resumes`) then hold exactly what the resumed Trainer's own `log_history` holds: the first attempt's
values up to step 4, the second attempt's from step 5, nothing of the first attempt's steps 5..8."""

from __future__ import annotations

import json
import os
import shutil
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


def _expected(history: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """tag -> every (step, value) a `log_history` holds, named as the callback names them, in logged order."""
    from otel_train.integrations.transformers import metric_names

    out: dict[str, list[tuple[int, float]]] = {}
    for entry in history:
        for tag, v in metric_names({k: v for k, v in entry.items() if k != "step"}).items():
            out.setdefault(tag, []).append((entry["step"], float(v)))
    return out


@pytest.fixture(scope="module")
def first_attempt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first attempt (to step 8, a checkpoint every 4), run once in a process of its own for both cases:
    `out/` holds its checkpoints, `runs/` what it exported; each case resumes from a copy."""
    root = tmp_path_factory.mktemp("hf-first")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_TRAIN_DIR": str(root / "runs"), "OTEL_TRAIN_RUN_NAME": RUN, "OTEL_TRAIN_RUN_ID": RUN,
                "OTEL_TRAIN_EXPORTERS": "tensorboard,jsonl"})
    first = subprocess.run([sys.executable, __file__, str(root / "out")], env=env, capture_output=True, text=True,
                           timeout=300, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    return root


@pytest.mark.parametrize("session", ["callback", "user"])
def test_resume_from_checkpoint_supersedes_the_earlier_attempts_steps(
    first_attempt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session: str
) -> None:
    from backendkit import approx_points  # here: this file is also the first attempt's script
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import otel_train as ot
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl, resolve_resumes

    for folder in ("out", "runs"):  # this case's own copy of the first attempt's checkpoints and run
        shutil.copytree(first_attempt / folder, tmp_path / folder)
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", RUN)
    monkeypatch.setenv("OTEL_TRAIN_RUN_ID", RUN)
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard,jsonl")
    first_steps = [e["step"] for e in json.loads((tmp_path / "out" / "first.json").read_text())]
    assert max(first_steps) == 8

    if session == "user":  # a session already running: the callback declares the resume with `ot.resume`
        ot.init()
    trainer = _trainer(tmp_path / "out", max_steps=6, seed=1)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    ot.shutdown()
    want = _expected(trainer.state.log_history)  # the first attempt's entries up to 4, then this one's
    assert [s for s, _ in want["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in want["train/epoch"]][-2:] == [6, 6]  # twice at the last step: its log, the summary

    run = tmp_path / "runs" / RUN
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, points in want.items():
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == approx_points(points), tag
    # otel-train's own per-step series too: steps 1..6 once each (the first attempt's 7 and 8 purged).
    assert [e.step for e in acc.Scalars("train/step_duration_s")] == [1, 2, 3, 4, 5, 6]

    records = resolve_resumes(read_jsonl(jsonl_path(tmp_path / "runs", RUN, 0)))
    for tag, points in want.items():
        shown = [(r["step"], r["value"]) for r in records if r["type"] == "metric" and r["tag"] == tag]
        assert shown == approx_points(points), tag


def _first_attempt(out: Path) -> None:
    trainer = _trainer(out, max_steps=8, seed=0)
    trainer.train()
    import otel_train as ot

    ot.shutdown()
    (out / "first.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":  # the first attempt, in a process of its own
    _first_attempt(Path(sys.argv[1]))
