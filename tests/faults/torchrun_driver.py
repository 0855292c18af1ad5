"""A worker of a `torchrun` job for the preemption test: logs `faultkit.SERIES` (+ its rank) at steps 0, 1, ...

Run by ``torchrun --nproc_per_node=2 torchrun_driver.py DIR``: otel-train reads the rank from the variables
torchrun sets. After each step's `ot.log` returns, the step is appended to ``DIR/progress.<rank>``, so the test
knows which steps each worker had logged when the signal came.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import faultkit

import otel_train as ot


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    ot.init(exporters=["jsonl"], dir=out, run_id="tr", run_name="tr", ranks="all", shutdown_timeout_s=20.0,
            export_interval_s=0.05)
    with open(out / f"progress.{rank}", "a", buffering=1) as progress:
        for s in ot.steps(range(100_000)):
            ot.log({tag: faultkit.value(tag, s) + rank for tag in faultkit.SERIES})
            progress.write(f"{s}\n")
            time.sleep(0.02)


if __name__ == "__main__":
    main()
