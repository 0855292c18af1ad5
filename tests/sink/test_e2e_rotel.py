"""End to end: training processes -> OTLP -> the real rotel collector -> `python -m otel_train.sink` -> files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rotel_proc import Rotel, SinkProcess
from sinkkit import scalars

TRAIN = """
import json, os, sys, time
from pathlib import Path
import otel_train as ot

steps, rank = int(sys.argv[1]), int(os.environ["RANK"])
pause_at = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else []
ot.init()
durations = []
for i in ot.steps(range(steps)):
    if i in pause_at:  # hand control to the test (it kills / restarts the collector), wait for its go
        Path(f"{sys.argv[3]}/at{i}").touch()
        deadline = time.monotonic() + 60
        while not Path(f"{sys.argv[3]}/go{i}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    t0 = time.perf_counter()
    with ot.span("forward"):
        ot.log({"train/loss": rank * 100.0 + i})
    durations.append(time.perf_counter() - t0)
ot.shutdown()
print(json.dumps({"max_step_s": max(durations)}))
"""


def _trainer(tmp_path: Path, rank: int, world: int, rotel: Rotel, steps: int, *extra: str) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {
        **os.environ,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "OTEL_TRAIN_RUN_ID": "e2e", "OTEL_TRAIN_RUN_NAME": "e2e", "OTEL_TRAIN_EXPORTERS": "otlp",
        "OTEL_TRAIN_RANKS": "all", "OTEL_TRAIN_DIR": str(tmp_path / "unused"),
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rotel.grpc_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    return subprocess.Popen([sys.executable, str(script), str(steps), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_last_steps(sink: SinkProcess, ranks: int, last: int, timeout_s: float = 30.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    run: dict[str, object] = {}
    while time.monotonic() < deadline:
        runs = [r for r in sink.get("/runs")["runs"] if r["run_id"] == "e2e"]
        if runs:
            run = runs[0]
            got = run["ranks"]
            if len(got) == ranks and all(v["last_step"] == last for v in got.values()):  # type: ignore[union-attr]
                return run
        time.sleep(0.1)
    return run


def test_three_ranks_through_rotel_to_tensorboard_and_trace(tmp_path: Path) -> None:
    from otel_train.trace_merge import load_trace

    steps, world = 30, 3
    out = tmp_path / "runs"
    sink = SinkProcess(tmp_path / "sink", "--dir", str(out), "--exporters", "tensorboard,chrome_trace",
                       "--aggregate", "mean,min,max").wait_ready()
    rotel = Rotel(tmp_path / "rotel", sink.grpc_port).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        procs = [_trainer(tmp_path, r, world, rotel, steps) for r in range(world)]
        for p in procs:
            _, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr[-2000:]
        run = _wait_last_steps(sink, world, steps - 1)
        assert run.get("ranks"), f"sink never saw every rank: {run}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        rotel.stop()
        code = sink.stop()
    assert code == 0, sink.log.read_text()[-2000:]
    for rank in range(world):
        loss = scalars(out / "e2e" / f"rank{rank}")["train/loss"]
        assert sorted(loss) == [(s, rank * 100.0 + s) for s in range(steps)]  # every step exactly once
        events = load_trace(out / "e2e" / "trace" / f"rank{rank}.trace.json")
        fwd = [e for e in events if e.get("ph") == "X" and e["name"] == "forward"]
        assert sorted(e["args"]["train.step"] for e in fwd) == list(range(steps))
    agg = scalars(out / "e2e" / "rank0")
    assert sorted(agg["train/loss/mean"]) == [(s, 100.0 + s) for s in range(steps)]
    assert sorted(agg["train/loss/min"]) == [(s, float(s)) for s in range(steps)]
    assert sorted(agg["train/loss/max"]) == [(s, 200.0 + s) for s in range(steps)]
    assert "status" in sink.log.read_text() or "points/s" in sink.log.read_text()


def test_collector_killed_and_restarted_mid_run(tmp_path: Path) -> None:
    steps = 30
    out = tmp_path / "runs"
    sink = SinkProcess(tmp_path / "sink", "--dir", str(out), "--exporters", "tensorboard").wait_ready()
    rotel = Rotel(tmp_path / "rotel", sink.grpc_port).start()
    flags = tmp_path / "flags"
    flags.mkdir()
    proc = _trainer(tmp_path, 0, 1, rotel, steps, "10,20", str(flags))
    try:
        deadline = time.monotonic() + 60
        while not (flags / "at10").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert _wait_last_steps(sink, 1, 9).get("ranks"), "steps 0..9 never reached the sink"
        rotel.kill()  # the collector crashes; steps 10..19 are recorded while it is down
        (flags / "go10").touch()
        while not (flags / "at20").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        rotel.start()
        (flags / "go20").touch()
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-2000:]
        assert _wait_last_steps(sink, 1, steps - 1).get("ranks"), "steps after recovery never arrived"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        rotel.stop()
        assert sink.stop() == 0
    assert json.loads(stdout.strip().splitlines()[-1])["max_step_s"] < 0.5  # training never blocked
    loss = scalars(out / "e2e")["train/loss"]
    got = sorted(s for s, _ in loss)
    assert len(got) == len(set(got))  # nothing twice
    assert got == list(range(steps))  # the outage's steps were kept and retried after recovery
    assert all(v == float(s) for s, v in loss)
