"""Fork a tiny training loop many times, signal each at a random or given step, report what landed (JSON).

Run as ``python signal_driver.py OUT SIGNAL REPS SEED [MODE]``; REPS is a count (signal steps drawn from SEED)
or a comma list of the steps themselves. The driver imports otel-train and
TensorBoard once and forks each repetition, so a repetition costs milliseconds, not an interpreter.
Each child logs `faultkit.SERIES` at every step inside a span and reports each finished step on a
pipe; the parent signals it after its step, waits for it to end, and reads JSONL and
TensorBoard back. MODE:

- ``default``: no handler of the user's (the signal's default action ends the process).
- ``chained``: the user installed a handler before `init` (a SLURM requeue handler): it must still run,
  after otel-train flushed; the loop then stops by itself.
- ``composed``: a framework installed its handler after `init` and calls ours (Lightning composes
  handlers so): ours must only flush, and the framework's handler decides (the loop stops by itself).
- ``twice``: as ``default``, the signal sent twice back to back (a launcher that signals the rank and its
  process group).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import faultkit

import otel_train as ot
from otel_train.exporters import jsonl as _jsonl  # noqa: F401  (imported before fork)
from otel_train.exporters import tensorboard as _tb  # noqa: F401

_MAX_STEPS = 5000


def _child(out: Path, name: str, signum: int, mode: str, w: int) -> int:
    stop = {"flag": False, "handler_ran": False}

    def users_handler(sig: int, frame: object) -> None:
        stop["flag"] = stop["handler_ran"] = True

    if mode == "chained":
        signal.signal(signum, users_handler)
    ot.init(exporters=["jsonl", "tensorboard"], dir=out, run_id=name, run_name=name, shutdown_timeout_s=5.0,
            export_interval_s=0.05)
    if mode == "composed":
        ours = signal.getsignal(signum)

        def framework_handler(sig: int, frame: object) -> None:
            users_handler(sig, frame)
            if callable(ours):
                ours(sig, frame)

        signal.signal(signum, framework_handler)
    code = 0
    try:
        for s in ot.steps(range(_MAX_STEPS)):
            with ot.span("step"):
                ot.log({tag: faultkit.value(tag, s) for tag in faultkit.SERIES})
                time.sleep(0.001)
            os.write(w, f"{s}\n".encode())
            if stop["flag"]:
                break
    except KeyboardInterrupt:
        code = 130
    os.write(w, f"handler {int(stop['handler_ran'])}\n".encode())
    atexit._run_exitfuncs()  # a forked child leaves with os._exit: run the interpreter's exit hooks
    return code


def _one(out: Path, rep: int, signum: int, mode: str, at: int) -> dict[str, object]:
    name = f"rep{rep}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 1
        try:
            code = _child(out, name, signum, mode, w)
        finally:
            os._exit(code)
    os.close(w)
    reported: list[int] = []
    at_signal = -1
    handler_ran = False
    sent = 0.0
    buf = b""
    with os.fdopen(r, "rb") as pipe:
        for line in pipe:
            buf = line.strip()
            if buf.startswith(b"handler"):
                handler_ran = buf.endswith(b"1")
                continue
            reported.append(int(buf))
            if not sent and reported[-1] >= at:
                sent = time.monotonic()
                at_signal = reported[-1]
                os.kill(pid, signum)
                if mode == "twice":
                    os.kill(pid, signum)
        _, status = os.waitpid(pid, 0)
    exit_s = time.monotonic() - sent if sent else None
    last = reported[-1] if reported else -1
    landed_jsonl = faultkit.jsonl_points(out, name)
    landed_tb = faultkit.tb_points(out / name)
    spans = faultkit.jsonl_spans(out, name)
    truncated = [s for s in spans if (s.get("attributes") or {}).get("otel_train.truncated")]  # type: ignore[union-attr]
    return {
        "rep": rep, "signal_after_step": at, "reported_at_signal": at_signal, "last_reported": last, "exit_s": exit_s,
        "killed_by": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "handler_ran": handler_ran,
        "jsonl": sorted(landed_jsonl), "tb": sorted(landed_tb),
        "spans": len(spans), "truncated": [(s["name"], s["step"]) for s in truncated],
    }


def main() -> None:
    out, sig_name, reps, seed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "default"
    signum = getattr(signal, sig_name)
    rng = random.Random(seed)
    if "," in reps:
        signal_steps = [int(a) for a in reps.split(",") if a]
    else:
        signal_steps = [rng.randint(0, 40) for _ in range(int(reps))]
    results = [_one(out / f"{sig_name}-{mode}", i, signum, mode, at) for i, at in enumerate(signal_steps)]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
