"""`GET /runs/<run id>/hangs`: the sink's live roll call from the `train.hang` log records it receives (and when each
rank last sent anything), with the same groups and sentence as ``otel-train hangs RUN_DIR``; a rank that stopped
sending is named; resumed records end it. Last, a real job's watchdog through otel-train's `otlp` backend to a real
sink process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sinkkit import make_sink

from otel_train.cli import main
from otel_train.hangs.hang_file import hang_path, write_hang_file
from otel_train.sink.runs.live_hangs import LiveHangs

RUN = "hung-run"
C10D = "torch/distributed/distributed_c10d.py:2501 in all_reduce"
LOAD = "train.py:41 in load_batch"
MAIN = "train.py:88 in main"
T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sink(tmp_path: Path, clock: Clock) -> Iterator[Any]:
    s = make_sink(tmp_path, ("jsonl",))
    s.hangs = LiveHangs(keep_s=300.0, clock=clock)  # receive times from the test's clock
    try:
        yield s
    finally:
        s.stop()


def _kv(key: str, value: Any) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

    def any_value(v: Any) -> Any:
        if isinstance(v, bool):
            return AnyValue(bool_value=v)
        if isinstance(v, int):
            return AnyValue(int_value=v)
        if isinstance(v, float):
            return AnyValue(double_value=v)
        if isinstance(v, list):
            return AnyValue(array_value=ArrayValue(values=[any_value(x) for x in v]))
        return AnyValue(string_value=v)

    return KeyValue(key=key, value=any_value(value))


def _logs(rank: int, attributes: dict[str, Any], step: int | None = 50, body: str = "") -> bytes:
    """One OTLP log request of rank `rank` of the 4-rank run, as the OTLP exporters encode it."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    attrs = {**attributes, **({"train.step": step} if step is not None else {})}
    record = LogRecord(time_unix_nano=int(T0 * 1e9), severity_number=13, severity_text="WARN",
                       body=AnyValue(string_value=body), attributes=[_kv(k, v) for k, v in attrs.items()])
    resource = {"service.name": "job", "train.run.id": RUN, "train.run.name": RUN, "train.rank": rank,
                "train.world_size": 4, "host.name": f"node{rank}"}
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(
        resource=Resource(attributes=[_kv(k, v) for k, v in resource.items()]),
        scope_logs=[ScopeLogs(log_records=[record])])]).SerializeToString()


def _stuck(rank: int, phase: str, frame: str, user: str, waited_s: float) -> bytes:
    """The watchdog's `train.hang` record of a stuck rank (its attributes: docs/semantic-conventions.md)."""
    return _logs(rank, {"event.name": "train.hang", "train.rank": rank, "train.hang.state": "stuck",
                        "train.hang.phase": phase, "train.hang.spans": ["train", phase], "train.hang.waited_s": waited_s,
                        "train.hang.limit_s": 2.0, "train.hang.usual_s": 0.01, "train.hang.frame": frame,
                        "train.hang.user_frame": user, "train.hang.native": True,
                        "train.hang.threads": "Thread 'MainThread' (1) [main]:\n  " + frame},
                 body=f"otel-train rank {rank}: step 50 has run {waited_s} s")


def _resumed(rank: int, phase: str) -> bytes:
    return _logs(rank, {"event.name": "train.hang", "train.rank": rank, "train.hang.state": "resumed",
                        "train.hang.phase": phase, "train.hang.spans": ["train", phase], "train.hang.waited_s": 20.0})


def _post(sink: Any, body: bytes) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{sink.http_port}/v1/logs", data=body,
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def _get(sink: Any, path: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://127.0.0.1:{sink.http_port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _cli_sentence(tmp_path: Path, ranks: dict[int, tuple[str, str, str, float]],
                  capsys: pytest.CaptureFixture[str]) -> str:
    """What ``otel-train hangs RUN_DIR`` says of the same records written as the ranks' hang files."""
    import time

    now = time.time()
    run_dir = tmp_path / "files"
    for rank, (phase, frame, user, waited_s) in ranks.items():
        latest = {"event.name": "train.hang", "state": "stuck", "time": now, "step": 50, "phase": phase,
                  "spans": ["train", phase], "waited_s": waited_s, "main_frame": frame, "user_frame": user,
                  "native": True}
        write_hang_file(hang_path(run_dir, rank), {"rank": rank, "world_size": 4, "state": "stuck", "step": 50,
                                                   "heartbeat_time": now, "heartbeat_s": 5.0, "latest": latest,
                                                   "history": [latest]})
    assert main(["hangs", str(run_dir)]) == 1
    return capsys.readouterr().out.splitlines()[0]


def test_three_ranks_in_one_frame_and_one_elsewhere_name_the_odd_rank_as_the_cli_does(
        sink: Any, clock: Clock, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    places = {0: ("backward", C10D, MAIN, 212.0), 1: ("data", LOAD, LOAD, 215.0), 2: ("backward", C10D, MAIN, 212.0),
              3: ("backward", C10D, MAIN, 212.0)}
    for rank, place in places.items():
        _post(sink, _stuck(rank, *place))
    code, doc = _get(sink, f"/runs/{RUN}/hangs")
    assert code == 200 and doc["stuck"] is True and doc["suspects"] == [1]
    assert doc["status"] == doc["verdict"] == _cli_sentence(tmp_path, places, capsys)
    assert doc["status"] == (f"ranks [0, 2, 3] have waited 212 s in `backward` at `{C10D}` (from `{MAIN}`); "
                             f"rank [1] has waited 215 s in `data` at `{LOAD}`: rank 1 is where to look")
    assert [(g["ranks"], g["phase"], g["frame"], g["steps"]) for g in doc["groups"]] == [
        ([0, 2, 3], "backward", C10D, [50, 50, 50]), ([1], "data", LOAD, [50])]
    assert doc["run_id"] == RUN and sink.health()["hangs"] == {"runs": 1, "ranks": 4, "runs_stuck": 1}

    with caplog.at_level(logging.WARNING, logger="otel_train.sink.runs.live_hangs"):
        sink.hangs.tick()
        clock.now += 30  # within the minute: not logged again
        sink.hangs.tick()
    assert [r.getMessage() for r in caplog.records] == [
        f"run {RUN!r}: {doc['status']} (GET /runs/{RUN}/hangs; logged at most once a minute while a rank is stuck)"]

    caplog.clear()
    for rank, (phase, *_) in places.items():
        _post(sink, _resumed(rank, phase))
    code, doc = _get(sink, f"/runs/{RUN}/hangs")
    assert code == 200 and doc["stuck"] is False and doc["suspects"] == [] and doc["groups"] == []
    assert doc["status"] == "no rank is stuck (4 running, 0 ended)"
    with caplog.at_level(logging.WARNING, logger="otel_train.sink.runs.live_hangs"):
        sink.hangs.tick()
        sink.hangs.tick()
    assert [r.getMessage() for r in caplog.records] == [f"run {RUN!r} resumed: no rank is stuck (4 running, 0 ended)"]


def test_a_rank_that_stopped_sending_is_named_silent_then_counts_as_ended_once_none_is_stuck(
        sink: Any, clock: Clock) -> None:
    _post(sink, _logs(3, {"note": "rank 3 is alive"}, step=49, body="a plain record"))  # its last word
    clock.now += 150  # rank 3's node is gone; the others wait for it in the all_reduce
    for rank in (0, 1, 2):
        _post(sink, _stuck(rank, "backward", C10D, MAIN, 12.0))
    code, doc = _get(sink, f"/runs/{RUN}/hangs")
    assert code == 200 and doc["stuck"] is True and doc["suspects"] == [3]
    assert doc["status"] == (f"ranks [0, 1, 2] have waited 12 s in `backward` at `{C10D}` (from `{MAIN}`) (in native "
                             "code); rank [3] has sent nothing for 150 s: rank 3 is where to look")
    (silent,) = doc["silent"]
    assert (silent["rank"], silent["host"], silent["state"], silent["step"]) == (3, "node3", "running", 49)

    clock.now += 5
    for rank in (0, 1, 2):
        _post(sink, _resumed(rank, "backward"))
    code, doc = _get(sink, f"/runs/{RUN}/hangs")
    assert doc["stuck"] is False and doc["status"] == "no rank is stuck (3 running, 1 ended)"


def test_a_rank_that_ended_while_stuck_is_no_longer_stuck_and_its_place_is_kept(sink: Any, clock: Clock) -> None:
    """The watchdog's `ended` record (the rank shut down mid-hang): the run is not left stuck, and says where."""
    _post(sink, _stuck(1, "data", LOAD, LOAD, 40.0))
    clock.now += 10
    _post(sink, _logs(1, {"event.name": "train.hang", "train.rank": 1, "train.hang.state": "ended",
                          "train.hang.phase": "data", "train.hang.spans": ["train", "data"],
                          "train.hang.waited_s": 50.0, "train.hang.frame": LOAD, "train.hang.user_frame": LOAD,
                          "train.hang.native": True}))
    code, doc = _get(sink, f"/runs/{RUN}/hangs")
    assert code == 200 and doc["stuck"] is False
    assert doc["status"] == (f"no rank is stuck (0 running, 1 ended, 3 never heard from); the job ended while "
                             f"rank [1] had waited 50 s in `data` at `{LOAD}`")


def test_a_stuck_rank_that_dies_is_named_from_its_last_record(sink: Any, clock: Clock) -> None:
    _post(sink, _stuck(1, "data", LOAD, LOAD, 40.0))
    clock.now += 60
    for rank in (0, 2, 3):
        _post(sink, _stuck(rank, "backward", C10D, MAIN, 50.0))
    assert _get(sink, f"/runs/{RUN}/hangs")[1]["suspects"] == [1]  # quiet, but its next record is not due yet
    clock.now += 3 * 40 + 10 + 1  # past its gap (its last wait) three times and 10 s
    for rank in (0, 2, 3):
        _post(sink, _stuck(rank, "backward", C10D, MAIN, 100.0))
    doc = _get(sink, f"/runs/{RUN}/hangs")[1]
    assert doc["suspects"] == [1] and [s["rank"] for s in doc["silent"]] == [1]
    assert doc["status"].endswith(f"rank [1] has sent nothing for 191 s (last record: in `data` at `{LOAD}`): "
                                  "rank 1 is where to look")


def test_a_rank_the_sink_never_heard_from_is_counted_as_such(sink: Any) -> None:
    for rank in (0, 1, 2):
        _post(sink, _logs(rank, {"note": "alive"}, step=7, body="a plain record"))
    doc = _get(sink, f"/runs/{RUN}/hangs")[1]
    assert doc["missing"] == [3] and doc["running"] == {"0": 7, "1": 7, "2": 7}
    assert doc["status"] == "no rank is stuck (3 running, 0 ended, 1 never heard from)"


def test_the_route_asks_for_the_token_like_runs_and_an_unknown_run_is_404(tmp_path: Path) -> None:
    s = make_sink(tmp_path, ("jsonl",), token="s3cret")
    try:
        assert _get(s, f"/runs/{RUN}/hangs")[0] == 401
        code, doc = _get(s, "/runs/nobody/hangs", token="s3cret")
        assert code == 404 and "nobody" in doc["message"]
    finally:
        s.stop()


def test_runs_are_dropped_after_their_idle_time(sink: Any, clock: Clock) -> None:
    _post(sink, _resumed(0, "data"))
    clock.now += 300 + 3 * 30 + 10 + 1
    sink.hangs.tick()
    assert _get(sink, f"/runs/{RUN}/hangs")[0] == 404 and sink.health()["hangs"]["ranks"] == 0


def test_at_most_max_ranks_entries_are_kept_the_run_heard_from_longest_ago_goes_first(clock: Clock) -> None:
    from otel_train.sink.decode.requests import Decoded
    from otel_train.vocab.run_identity import RunInfo

    hangs = LiveHangs(clock=clock, max_ranks=4)
    for run_id in ("a", "b", "c"):
        decoded = Decoded()
        decoded.runs = {RunInfo(run_id, run_id, rank=r, world_size=2): 5 for r in (0, 1)}
        hangs.take(decoded)
        clock.now += 1
    assert hangs.stats() == {"runs": 2, "ranks": 4, "runs_stuck": 0}
    assert hangs.files("a") is None and hangs.files("c") is not None


JOB = '''
import sys, time
from pathlib import Path
import otel_train as ot

def load_batch(go):  # rank 1's data loading stalls at step 20
    while not go.exists():
        time.sleep(0.05)

def wait_for_peers(go):  # rank 0 waits for rank 1 (a collective)
    while not go.exists():
        time.sleep(0.05)

rank, go = int(sys.argv[1]), Path(sys.argv[2])
ot.init(run_name="live")
for step in ot.steps(range(30)):
    with ot.span("data"):
        if rank == 1 and step == 20:
            load_batch(go)
    with ot.span("backward"):
        if rank == 0 and step == 20:
            wait_for_peers(go)
        time.sleep(0.01)
ot.shutdown()
'''


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_real_jobs_watchdog_through_the_otlp_backend_to_a_real_sink(tmp_path: Path) -> None:
    """Two ranks of a real job (otel-train's `otlp` backend, the watchdog on at 1 s) send to a sink process: it
    names both places while they wait, and no rank once the step ends."""
    from rotel_proc import SinkProcess, wait_until

    sink = SinkProcess(tmp_path / "sink", "--dir", str(tmp_path / "runs"), "--exporters", "jsonl").wait_ready()
    script, go = tmp_path / "train.py", tmp_path / "go"
    script.write_text(JOB)
    env = {**os.environ, "OTEL_TRAIN_EXPORTERS": "otlp", "OTEL_TRAIN_RUN_ID": "live-run", "WORLD_SIZE": "2",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.grpc_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_TRAIN_HANG_AFTER_S": "1", "OTEL_TRAIN_HANG_FACTOR": "2", "OTEL_TRAIN_EXPORT_INTERVAL_S": "0.5",
           "OTEL_TRAIN_EXPORT_PROCESS": "off", "OTEL_TRAIN_QUIET": "1", "OTEL_TRAIN_DIR": str(tmp_path / "job")}
    jobs = [subprocess.Popen([sys.executable, str(script), str(rank), str(go)], cwd=tmp_path,
                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    seen: dict[str, Any] = {}

    def hangs() -> dict[str, Any]:
        try:
            seen.update(sink.get("/runs/live-run/hangs"))
        except urllib.error.HTTPError:  # nothing from the run yet
            pass
        return seen

    try:
        assert wait_until(lambda: len(hangs().get("groups", [])) == 2, 45), (seen, sink.log.read_text()[-3000:])
        places = {tuple(g["ranks"]): (g["phase"], g["frame"]) for g in seen["groups"]}
        assert places[(0,)][0] == "backward" and places[(0,)][1].endswith(" in wait_for_peers")
        assert places[(1,)][0] == "data" and places[(1,)][1].endswith(" in load_batch")
        assert seen["stuck"] is True and seen["status"] == seen["verdict"] and "rank [1] has waited" in seen["status"]
        go.touch()
        for job in jobs:
            output, _ = job.communicate(timeout=60)
            assert job.returncode == 0, output[-3000:]
        assert wait_until(lambda: hangs()["stuck"] is False, 30), seen
        assert seen["status"].startswith("no rank is stuck")
    finally:
        go.touch()
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.communicate()
        sink.stop()
