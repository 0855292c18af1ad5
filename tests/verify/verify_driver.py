"""A small training job for the verify tests: ``python verify_driver.py DIR RUN STEPS MODE``.

Logs three plain series, one with an attribute (its own series), a counter through a raw OTel instrument and
a span per step, with every backend named in `OTEL_TRAIN_EXPORTERS`. MODE ``plain`` logs in step order;
``backwards`` also logs `train/loss` once at a step below its last (TensorBoard and W&B skip it, counted);
``fork`` forks a child at steps 5 and 15 that logs `data/x` at that step (its own connection to the run);
``nonfinite`` also logs `train/odd`: NaN, +inf and -inf in turn (backends that store them otherwise: backends.md).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import otel_train as ot


def main() -> None:
    out, run, steps, mode = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ot.init(dir=out, run_id=run, run_name=run, project="verify", shutdown_timeout_s=60.0, export_interval_s=0.05)
    counter = ot.get_meter("verify").create_counter("samples")
    for s in ot.steps(range(steps)):
        ot.log({"train/loss": 1.0 / (s + 1), "train/lr": 0.1 * 0.9**s, "train/acc": s / steps})
        ot.log({"eval/acc": 0.5 + s / 1000}, attributes={"split": "val"})
        counter.add(8)
        if mode == "nonfinite":
            ot.log({"train/odd": (math.nan, math.inf, -math.inf)[s % 3]})
        if mode == "fork" and s in (5, 15):
            ot.flush(timeout_s=30)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    ot.log({"data/x": 100.0 + s}, step=s)
                    ot.flush()
                    code = 0
                finally:
                    os._exit(code)
            os.waitpid(pid, 0)
        with ot.span("step"):
            time.sleep(0.01)  # several windows per run (collections at most every 0.05 s)
    if mode == "backwards":
        ot.log({"train/loss": 7.0}, step=1)
    ot.shutdown()


if __name__ == "__main__":
    main()
