"""The sink fits the machine it runs on: its open-run limit follows the process's file-descriptor limit, a run
it cannot open now is refused retryably (never INTERNAL), `/health` stays reachable, and a request with more
runs than the limit is still taken."""

from __future__ import annotations

from pathlib import Path

import pytest
from rotel_proc import SinkProcess, post_otlp
from sinkkit import scalars

from otel_train.testing import OtlpPoint, metrics_request
from otel_train.vocab.run_paths import run_folder

_FD_LIMIT = 1024  # the common `ulimit -n`

def _one_point(run_id: str, step: int) -> bytes:
    return metrics_request({"train.run.id": run_id, "train.rank": 0}, [OtlpPoint("train/loss", step + 0.5,
                                                                                 step=step)])


def _post_retrying(port: int, body: bytes, statuses: list[int]) -> None:
    """One OTLP/HTTP metrics request, 503 retried (`post_otlp`); every answer is recorded in `statuses`."""
    post_otlp(port, "/v1/metrics", body, statuses=statuses)


# The derived open-run limit; and one set far beyond what the descriptors allow (the descriptors counted
# before each run opens must then keep the sink whole).
@pytest.mark.parametrize("limit", [(), ("--max-open-runs", "1000")], ids=["derived", "set-too-high"])
def test_under_ulimit_1024_many_runs_are_never_refused_with_internal(tmp_path: Path, limit: tuple[str, ...]) -> None:
    sink = SinkProcess(tmp_path, "--exporters", "tensorboard,chrome_trace", "--dir", str(tmp_path / "runs"),
                       "--idle-s", "3600", *limit, fd_limit=_FD_LIMIT).wait_ready()
    statuses: list[int] = []
    healthy: list[int] = []
    health_failures = 0
    try:
        for i in range(600):
            _post_retrying(sink.http_port, _one_point(f"run-{i}", 0), statuses)
            _post_retrying(sink.http_port, _one_point("healthy", i), healthy)
            if i % 50 == 0:
                try:
                    sink.get("/health")
                except OSError:
                    health_failures += 1
        health = sink.settled_health()
    finally:
        assert sink.stop() == 0
    assert sorted(set(statuses)) in ([200], [200, 503]), sorted(set(statuses))
    assert statuses.count(200) == 600
    assert healthy.count(200) == 600 and set(healthy) <= {200, 503}
    assert health_failures == 0
    assert "internal" not in health["rejected"], health["rejected"]
    tb = scalars(run_folder(tmp_path / "runs", "healthy"))
    assert tb["train/loss"] == [(i, i + 0.5) for i in range(600)]


def _jsonl_series(directory: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """run id -> tag -> every (step, value) in file order, from every JSONL file the sink wrote."""
    from otel_train.exporters.jsonl import read_jsonl

    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for path in sorted(directory.glob("*/rank*.jsonl")):
        for rec in read_jsonl(path):
            if rec["type"] == "metric":
                out.setdefault(rec["run_id"], {}).setdefault(rec["tag"], []).append((rec["step"], rec["value"]))
    return out


def test_a_request_with_more_runs_than_the_open_run_limit_is_taken_once(tmp_path: Path) -> None:
    from sinkkit import make_sink

    # One request of 30 runs (a collector's batch), each with 3 steps of a gauge and a DELTA counter; serialized
    # requests concatenated are one request with all their Resources.
    body = b"".join(metrics_request({"train.run.id": f"run-{i}", "train.rank": 0}, [
        p for step in range(3) for p in (OtlpPoint("train/loss", i + step / 10, step=step),
                                         OtlpPoint("train/tokens", 10, step=step, kind="sum"))])
        for i in range(30))
    sink = make_sink(tmp_path, ("jsonl",), max_open_runs=4)
    statuses: list[int] = []
    try:
        _post_retrying(sink.http_port, body, statuses)
        assert sink.flush(60)
        health = sink.health()
    finally:
        sink.stop()
    assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
    assert health["runs_closed"] >= 26  # the limit held: runs were closed to let the next ones in
    series = _jsonl_series(tmp_path / "runs")
    assert sorted(series) == sorted(f"run-{i}" for i in range(30))
    for i in range(30):
        assert series[f"run-{i}"]["train/loss"] == [(step, i + step / 10) for step in range(3)]
        assert series[f"run-{i}"]["train/tokens"] == [(0, 10), (1, 20), (2, 30)]


def test_sigterm_with_a_hung_backend_ends_within_the_shutdown_timeout_and_the_next_start_writes_the_rest(
        tmp_path: Path) -> None:
    import os
    import subprocess

    from otel_train.sink.runs.feed import spool_folder

    runs = tmp_path / "runs"
    hung = run_folder(runs, "hung")
    hung.mkdir(parents=True)
    os.mkfifo(hung / "rank0.jsonl")  # opening it to append blocks until a reader comes: a backend that hangs
    args = ("--exporters", "jsonl", "--dir", str(runs), "--shutdown-timeout-s", "1")
    sink = SinkProcess(tmp_path / "first", *args).wait_ready()
    statuses: list[int] = []
    for step in range(10):
        _post_retrying(sink.http_port, _one_point("hung", step), statuses)
    assert statuses == [200] * 10
    sink.proc.terminate()
    try:
        # the bound is 1 s of writing; the rest of this wait is the interpreter's start and stop on a loaded host
        code = sink.proc.wait(25)
    except subprocess.TimeoutExpired:
        sink.proc.kill()
        raise AssertionError("the sink did not end within its shutdown timeout with a hung backend") from None
    assert code == 0
    assert "stays in the spool" in sink.log.read_text()
    assert (runs / ".sink-spool" / spool_folder("hung")).is_dir()  # what was not written waits there
    (hung / "rank0.jsonl").unlink()
    # the default shutdown timeout here: a second of writing is not always enough for the rest on a loaded host
    again = SinkProcess(tmp_path / "second", "--exporters", "jsonl", "--dir", str(runs)).wait_ready()
    try:
        again.settled_health()
    finally:
        assert again.stop() == 0
    written = _jsonl_series(runs).get("hung", {}).get("train/loss")
    assert written == [(step, step + 0.5) for step in range(10)], (sink.log.read_text()[-3000:],
                                                                    again.log.read_text()[-3000:])
    assert "not fully written" not in again.log.read_text()  # the run's folder stays (its series state): all written


def test_the_descriptor_budget_refuses_a_run_only_near_the_limit() -> None:
    from otel_train.sink.fd_limits import FdBudget, fds_in_use

    in_use = fds_in_use()
    assert in_use is not None
    roomy = FdBudget(limit=(in_use + 1000) * 2)
    assert [roomy.refusal() for _ in range(3)] == [None, None, None]
    tight = FdBudget(limit=in_use + 8)
    refusal = tight.refusal()
    assert refusal is not None and "file descriptors in use" in refusal[0] and refusal[1] >= 1
    assert tight.refused == 1


def test_closed_runs_are_freed_while_no_requests_come(tmp_path: Path) -> None:
    """The sink's own process collects cycles rarely (none while no requests allocate): its housekeeping frees
    what closed runs left behind. Here the collector is off, as it is then."""
    import gc
    import weakref

    from rotel_proc import wait_until
    from sinkkit import make_sink

    sink = make_sink(tmp_path, ("tensorboard", "jsonl"), idle_s=3600)
    gc.disable()
    try:
        for i in range(20):
            statuses: list[int] = []
            _post_retrying(sink.http_port, _one_point(f"run-{i}", 0), statuses)
            assert statuses == [200]
        feeds = [weakref.ref(feed) for feed in list(sink.router._runs.values())]
        assert len(feeds) == 20
        sink.router.idle_s = 0.3  # now: on a loaded machine the first runs could close before all 20 were sent
        assert wait_until(lambda: sink.router.runs_closed == 20, 60)
        assert wait_until(lambda: all(ref() is None for ref in feeds), 60), \
            f"{sum(ref() is not None for ref in feeds)} of 20 closed runs still held"
    finally:
        gc.enable()
        sink.stop()


def test_out_of_descriptors_anyway_is_refused_retryably_over_http(tmp_path: Path) -> None:
    import errno

    from sinkkit import make_sink

    sink = make_sink(tmp_path, ("jsonl",))
    ingest = sink.router.ingest
    calls: list[int] = []

    def first_call_out_of_descriptors(decoded: object) -> None:  # another process took them all, once
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        ingest(decoded)

    sink.router.ingest = first_call_out_of_descriptors
    statuses: list[int] = []
    try:
        _post_retrying(sink.http_port, _one_point("fds", 1), statuses)
        sink.flush(30)
        rejected = sink.health()["rejected"]
    finally:
        sink.stop()
    assert statuses == [503, 200]
    assert rejected == {"overloaded": 1}
    assert _jsonl_series(tmp_path / "runs")["fds"]["train/loss"] == [(1, 1.5)]
