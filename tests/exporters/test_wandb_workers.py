"""DataLoader workers' values reach W&B at their step: a real offline W&B run and real DataLoader workers
(`num_workers=2`, `ot.log` in the dataset's `__getitem__`), the `.wandb` file read back.

A worker's value without `step=` gets the step the loop was in when the worker logged it; it reaches the
exporter process after the loop's later windows, and W&B, which cannot go back a step, holds rows a moment
before writing them, so it is written at its step. W&B holds one value per key and step: of a worker's values
for one series at one step it keeps the last, as its own `log` does, and counts the others ("not written").
With `step=` ahead of the loop (each item logged at the step its batch will be, prefetched), the loop's rows
of those steps still land: the worker's rows wait in the hold instead of moving W&B past them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import readback
from backendkit import wandb_files, wandb_records

from otel_train.exporters.jsonl import jsonl_path, read_jsonl

ITEMS = 160

SCRIPT = textwrap.dedent(f"""
    import sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import otel_train as ot

    class Items(Dataset):
        def __len__(self):
            return {ITEMS}

        def __getitem__(self, i):
            ot.log({{"data/item": float(i)}})
            return torch.tensor([float(i)])

    if __name__ == "__main__":
        ot.init(exporters="wandb,jsonl", dir=sys.argv[1], run_name="wk", run_id="wk", export_interval_s=0.02)
        loader = DataLoader(Items(), batch_size=1, num_workers=2, multiprocessing_context="fork")
        for batch in ot.steps(loader):
            ot.log({{"train/loss": float(batch.sum())}})
            time.sleep(0.003)
        ot.shutdown()
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # `shutdown()` returns once W&B holds every step: on a loaded machine the exporter process may still be starting
    # W&B's service at the default 10 s, and the `.wandb` file (and the "not written" count) would come later.
    env["OTEL_TRAIN_SHUTDOWN_TIMEOUT_S"] = "120"
    return env


def _wandb_items(directory: Path) -> list[tuple[int, str, float]]:
    out = []
    for path in wandb_files(directory, "wk", "wk"):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                out += [(items["_step"], k, float(v)) for k, v in items.items() if k.startswith("data/item")]
    return out


def test_every_worker_value_reaches_wandb_once_at_its_step(tmp_path: Path, backend_home: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "runs"
    out = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True, check=False,
                         timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    reference = [(r["step"], r["tag"], r["value"]) for r in read_jsonl(jsonl_path(directory, "wk", 0))
                 if r["type"] == "metric" and r["tag"].startswith("data/item")]
    assert sorted(v for _, _, v in reference) == [float(i) for i in range(ITEMS)]  # JSONL: the steps given
    last: dict[tuple[int, str], float] = {}
    for step, tag, value in reference:  # in arrival order
        last[(step, tag)] = value
    in_wandb = _wandb_items(directory)
    assert max(Counter((s, t) for s, t, _ in in_wandb).values()) == 1
    assert sorted(in_wandb) == sorted((s, t, v) for (s, t), v in last.items())  # every step and series of it
    assert {tag for _, tag, _ in in_wandb} == {"data/item{worker=0}", "data/item{worker=1}"}
    replaced = len(reference) - len(last)  # the values W&B's one-per-step replaced: counted, in rows
    assert (f"{replaced} not written" in out.stderr) if replaced else ("not written" not in out.stderr), \
        out.stderr[-2000:]


AHEAD = textwrap.dedent(f"""
    import sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import otel_train as ot

    class Items(Dataset):
        def __len__(self):
            return {ITEMS}

        def __getitem__(self, i):
            ot.log({{"data/item": float(i)}}, step=i)  # the step its batch will be: ahead of the loop
            return torch.tensor([float(i)])

    if __name__ == "__main__":
        ot.init(exporters="wandb,jsonl", dir=sys.argv[1], run_name="wk", run_id="wk", export_interval_s=0.02)
        loader = DataLoader(Items(), batch_size=1, num_workers=2, multiprocessing_context="fork")
        for batch in ot.steps(loader):
            ot.log({{"train/loss": float(batch.sum())}})
            time.sleep(1.0 if not batch.sum() else 0.003)  # step 0 lingers: the workers' rows get there first
        ot.shutdown()
""")


def test_rows_of_steps_a_worker_logged_ahead_all_land(tmp_path: Path, backend_home: Path) -> None:
    """Each item `i` is logged with `step=i` while the loop is still at an earlier step (prefetch); the loop
    lingers in step 0, so the workers' rows for steps 0-3 reach the exporter process before the loop's."""
    script = tmp_path / "train.py"
    script.write_text(AHEAD)
    directory = tmp_path / "runs"
    out = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True, check=False,
                         timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    points = [p for path in wandb_files(directory, "wk", "wk") for p in readback.wandb(path)]
    loss = sorted((p.step, p.value) for p in points if p.name == "train/loss")
    assert loss == [(i, float(i)) for i in range(ITEMS)]
    items = sorted((p.step, p.value) for p in points if p.name.startswith("data/item{worker="))
    assert items == [(i, float(i)) for i in range(ITEMS)]
    assert "not written" not in out.stderr, out.stderr[-2000:]
