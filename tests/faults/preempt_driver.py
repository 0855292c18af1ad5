"""A tiny training loop with every run-based backend, ended by a signal (or not), for the preemption marks.

Run as ``python preempt_driver.py DIR EXPORTERS MODE``: logs `faultkit.SERIES` at steps 0, 1, ... and
prints each finished step on stdout; the test sends the signal after a few steps. MODE:

- ``default``: no handler of the user's (the signal's default action ends the process; SIGINT raises
  `KeyboardInterrupt`, which the loop ends on).
- ``chained``: a SLURM-like requeue handler installed before `init`: it stops the loop, the process
  exits normally.
- ``finish``: runs 5 steps and exits normally (no signal).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import faultkit

import otel_train as ot


def main() -> None:
    out, exporters, mode = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    stop = {"flag": False}

    def requeue_handler(sig: int, frame: object) -> None:
        stop["flag"] = True

    if mode == "chained":
        signal.signal(signal.SIGUSR1, requeue_handler)
    ot.init(exporters=exporters, dir=out, run_id="pre", run_name="pre", project="preempt", shutdown_timeout_s=60.0,
            export_interval_s=0.05)
    steps = 5 if mode == "finish" else 100_000
    try:
        for s in ot.steps(range(steps)):
            ot.log({tag: faultkit.value(tag, s) for tag in faultkit.SERIES})
            with ot.span("step"):
                time.sleep(0.02)
            print(s, flush=True)
            if stop["flag"]:
                break
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
