"""DataLoader workers' values reach W&B at their step: a real offline W&B run and real DataLoader workers
(`num_workers=2`, `ot.log` in the dataset's `__getitem__`), the `.wandb` file read back.

A worker's value gets the step of the last window the exporter process had queued when it arrived, and it is
handed to every backend right after that window: W&B, which drops a write to a step older than its last,
never sees it after a later step (the issue: 0-28 of ~380 kept). W&B holds one value per key and step: of a
worker's values for one series at one step it keeps the last, as its own `log` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

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
                         timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
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
    assert "not written" not in out.stderr, out.stderr[-2000:]
