"""The shutdown summary counts values lost in child processes too: a step refused in a child (a DataLoader worker,
a `multiprocessing` child) is warned once there and never written, and the trainer's summary counts it with the
trainer's own refusals, by cause ("refused at the call"; nothing was dropped).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from otel_train.exporters.jsonl import jsonl_path, read_jsonl

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys
    import otel_train as ot

    def child():
        ot.log({"w": 1.0}, step=2.5)          # refused: not an integer
        ot.log({"w": 2.0, "v": 3.0}, step="x")  # refused: two values
        ot.log({"w": 5.0}, step=3)            # written
        ot.flush()

    if __name__ == "__main__":
        ot.init(exporters="jsonl", dir=sys.argv[1], run_id="cr", run_name="cr")
        with ot.step(1):
            ot.log({"p": 1.0})
        ot.log({"p": 2.0}, step=float("nan"))  # refused in the trainer: one value
        p = mp.get_context(sys.argv[2]).Process(target=child)
        p.start()
        p.join()
        ot.shutdown()
""")


def _run(tmp_path: Path, method: str) -> tuple[str, list[tuple[str, int, float]]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), method], capture_output=True,
                         text=True, check=False, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [(r["tag"], r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path / "runs", "cr", 0))
            if r["type"] == "metric" and r["tag"][0] in "pwv"]
    return out.stderr, rows


def test_values_at_a_step_refused_in_a_child_are_in_the_trainers_summary(tmp_path: Path) -> None:
    err, rows = _run(tmp_path, "fork")
    assert [(tag.split("{")[0], step, value) for tag, step, value in sorted(rows)] == [("p", 1, 1.0), ("w", 3, 5.0)]
    (line,) = [x for x in err.splitlines() if x.startswith("otel-train: ") and " points in " in x]
    assert "; 0 dropped;" in line, line
    assert "; refused at the call: 4 values at a step that is no step;" in line, line  # 1 in the trainer, 3 in the child


FLOOD = textwrap.dedent("""
    import logging, sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    import otel_train as ot

    N = 400  # records per sample: far over the rate limit (OTEL_TRAIN_LOG_RATE=20) in every process
    log = logging.getLogger("flood")
    log.addHandler(logging.NullHandler())  # Python does not print them all; the hook sees them still
    log.propagate = False

    class Samples(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            for k in range(N):
                log.warning("sample %d record %d", i, k)
            return torch.tensor(float(i))

    ot.init(exporters="jsonl", dir=sys.argv[1], run_id="fl", run_name="fl")
    with ot.step(0):
        for k in range(N):
            log.warning("trainer record %d", k)
    for batch in ot.steps(DataLoader(Samples(), batch_size=1, num_workers=2), start=1):
        pass
    ot.shutdown()
""")


def test_log_records_rate_limited_in_dataloader_workers_are_in_the_trainers_summary(tmp_path: Path) -> None:
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRAIN_LOG_RATE"] = "20"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                         check=False, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [r for r in read_jsonl(jsonl_path(tmp_path / "runs", "fl", 0))
               if r["type"] == "log" and r["logger"] == "flood"]
    from_workers = [r for r in records if "worker" in r["attributes"]]
    assert {r["attributes"]["worker"] for r in from_workers} == {0, 1}  # both workers' records arrived
    assert len(records) < 5 * 400  # the limit held in every process
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("otel-train: ") and " points in " in x]
    # Every record logged and not written is counted, the workers' with the trainer's: 400 in the trainer, 4 x 400
    # in the workers.
    dropped = 5 * 400 - len(records)
    assert f"{dropped:,} log records over the rate limit" in line, line
