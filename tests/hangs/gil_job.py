"""A single-process job whose step holds the GIL in a C call (libc `sleep` through `ctypes.PyDLL`, which keeps
the GIL) for ``argv[2]`` seconds at step 20, so the hang watchdog's thread cannot run. Run as
``python gil_job.py RUN_DIR SECONDS``."""

from __future__ import annotations

import ctypes
import sys
import time

import otel_train as ot


def hold_the_gil(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)


def main() -> None:
    ot.init(dir=sys.argv[1], run_name="gil", exporters=["jsonl"])
    for i in ot.steps(range(25)):
        with ot.span("compute"):
            time.sleep(0.02)
            if i == 20:
                hold_the_gil(int(sys.argv[2]))
    ot.shutdown()


if __name__ == "__main__":
    main()
