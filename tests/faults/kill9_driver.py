"""Fork a tiny training loop many times, `kill -9` each at a random or given step, replay, report what landed (JSON).

Run as ``python kill9_driver.py OUT REPS SEED [both]``; REPS is a count (kill steps drawn from SEED) or a
comma list of the kill steps themselves. Like `signal_driver`, the driver imports otel-train and
TensorBoard once and forks each repetition. The driver makes itself a child subreaper, so the exporter
process orphaned by the kill is re-parented to it and can be waited for. Each repetition: the loop logs
`faultkit.SERIES` at every step and flushes every few steps (a flushed step has reached the exporter
process for sure; the others may have); the driver kills it with SIGKILL after its step, waits
for the exporter process to drain and exit on its own, runs ``otel-train replay RUN_DIR`` twice, and
reads JSONL, TensorBoard and the spool's cursors back. With ``both``, the exporter process is killed too,
at once (a job killed as a whole): then replay has the rest to deliver.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
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
from otel_train.cli import main as cli_main
from otel_train.exporters import jsonl as _jsonl  # noqa: F401  (imported before fork)
from otel_train.exporters import tensorboard as _tb  # noqa: F401
from otel_train.ship.spool import Spool, spool_dir

_MAX_STEPS = 5000
_FLUSH_EVERY = 5
_PR_SET_CHILD_SUBREAPER = 36


def _child(out: Path, name: str, w: int) -> None:
    session = ot.init(exporters=["jsonl", "tensorboard"], dir=out, run_id=name, run_name=name,
                      export_interval_s=0.05)
    os.write(w, f"exporter {session.export_process.pid}\n".encode())
    for s in ot.steps(range(_MAX_STEPS)):
        ot.log({tag: faultkit.value(tag, s) for tag in faultkit.SERIES})
        time.sleep(0.001)
        if s % _FLUSH_EVERY == 0:
            ot.flush()
            os.write(w, f"flushed {s}\n".encode())
        else:
            os.write(w, f"step {s}\n".encode())


def _wait_exit(pid: int, within_s: float) -> float | None:
    """Reap `pid` (our child since we are its subreaper); seconds it took, None if it outlived `within_s`."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return time.monotonic() - start
        if done:
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def _replay(run_dir: Path) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(["replay", str(run_dir)])
    return code, buf.getvalue()


def _one(out: Path, rep: int, at: int, both: bool) -> dict[str, object]:
    name = f"rep{rep}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the training process
        os.close(r)
        try:
            _child(out, name, w)
        finally:
            os._exit(1)
    os.close(w)
    exporter, flushed, last = -1, -1, -1
    with os.fdopen(r, "rb") as pipe:
        for line in pipe:
            kind, num = line.split()
            if kind == b"exporter":
                exporter = int(num)
                continue
            last = int(num)
            if kind == b"flushed":
                flushed = last
            if last >= at:
                os.kill(pid, signal.SIGKILL)
                if both:
                    os.kill(exporter, signal.SIGKILL)
                break
        # The loop ran on until the kill landed (on a loaded machine, steps later): what it reported meanwhile
        # is in the pipe, read to its end (the writer is gone).
        for line in pipe:
            kind, num = line.split()
            last = int(num)
            if kind == b"flushed":
                flushed = last
    _, status = os.waitpid(pid, 0)
    drained_s = _wait_exit(exporter, 60.0)  # it drains what reached it, then exits by itself
    spool = Spool(spool_dir(out, name, 0))
    cursors, spooled_seq, spooled_step = dict(spool.cursors), spool.last_seq, spool.last_step
    del spool  # replay opens the spool itself
    replays = [_replay(out / name) for _ in range(2)]
    return {
        "rep": rep, "kill_after_step": at, "last_reported": last, "last_flushed": flushed,
        "killed_by": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, "drained_s": drained_s,
        "spooled_seq": spooled_seq, "spooled_step": spooled_step, "cursors": cursors, "replays": replays,
        "jsonl": faultkit.jsonl_points(out, name), "tb": faultkit.tb_points(out / name),
    }


def main() -> None:
    out, reps, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rng = random.Random(seed)
    if "," in reps:
        kill_steps = [int(a) for a in reps.split(",") if a]
    else:
        kill_steps = [rng.randint(0, 60) for _ in range(int(reps))]
    both = sys.argv[4:] == ["both"]
    results = [_one(out / "kill9", i, at, both) for i, at in enumerate(kill_steps)]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
