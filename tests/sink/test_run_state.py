"""The sink's per-run series state survives what a shared service lives through: `kill -9`, a graceful restart,
a least-recently-used close, a request sent twice. Real `otel-train sink` processes, fed the bytes the standard
OTel Python SDK encodes (CUMULATIVE, its default: every export re-sends every past step; and DELTA), read back
from TensorBoard's event files in file order and from JSONL, as lists: a point written twice shows twice."""

from __future__ import annotations

import signal
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import readback
from rotel_proc import Rotel, SinkProcess, wait_until

GAUGES = 20


class _SdkSender:
    """One rank of a training run instrumented with the OTel SDK: `GAUGES` gauges and a counter per step, each
    point with its `train.step`; `body()` is what the SDK's OTLP exporter sends for one collection."""

    def __init__(self, run_id: str, temporality: str) -> None:
        from opentelemetry.sdk.metrics import Counter, MeterProvider
        from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
        from opentelemetry.sdk.resources import Resource

        t = AggregationTemporality.CUMULATIVE if temporality == "cumulative" else AggregationTemporality.DELTA
        self.reader = InMemoryMetricReader(preferred_temporality={Counter: t})
        self.provider = MeterProvider(metric_readers=[self.reader], resource=Resource.create(
            {"service.name": "sdk", "train.run.id": run_id, "train.rank": 0, "train.world_size": 1}))
        meter = self.provider.get_meter("t")
        self.gauges = [meter.create_gauge(f"g{i}") for i in range(GAUGES)]
        self.counter = meter.create_counter("tokens")

    def step(self, step: int) -> bytes:
        from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

        for i, gauge in enumerate(self.gauges):
            gauge.set(_gauge(i, step), {"train.step": step})
        self.counter.add(step + 1, {"train.step": step})
        return bytes(encode_metrics(self.reader.get_metrics_data()).SerializeToString())


def _gauge(i: int, step: int) -> float:
    return i * 1000.0 + step


def _expected(steps: int) -> list[tuple[str, int, float]]:
    gauges = [(f"g{i}", s, _gauge(i, s)) for i in range(GAUGES) for s in range(steps)]
    totals = [("tokens", s, float(sum(range(1, s + 2)))) for s in range(steps)]  # step s adds s + 1
    return sorted(gauges + totals)


def _points(points: list[Any]) -> list[tuple[str, int, float]]:
    return sorted((p.name, p.step, p.value) for p in points if p.name == "tokens" or p.name.startswith("g"))


def _kill(sink: SinkProcess) -> None:
    sink.proc.send_signal(signal.SIGKILL)
    sink.proc.wait(10)


def _send(post: Callable[[bytes], None], body: bytes) -> None:
    """As an OTLP exporter with retries: again after a refusal or a connection error (the sink restarting)."""
    for _ in range(300):
        try:
            post(body)
            return
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    raise AssertionError("the request was never taken")


def _check(runs: Path, run_id: str, steps: int) -> None:
    expected = _expected(steps)
    assert _points(readback.jsonl(runs / run_id / "rank0.jsonl")) == expected
    assert _points(readback.tensorboard(runs / run_id)) == expected  # world size 1: the run folder


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_two_kills_and_a_graceful_restart_write_every_point_once_with_the_right_totals(
        tmp_path: Path, temporality: str) -> None:
    runs = tmp_path / "runs"
    args = ("--exporters", "tensorboard,jsonl", "--dir", str(runs), "--reorder-s", "1")
    sender = _SdkSender("job", temporality)
    steps, restarts = 90, {30: _kill, 55: _kill, 75: lambda s: s.terminate()}
    sink = SinkProcess(tmp_path / "sink0", *args).wait_ready()
    try:
        for step in range(steps):
            _send(sink.post_metrics, sender.step(step))
            stop = restarts.get(step)
            if stop is not None:  # right after an acknowledged request: its rows are in the spool, not all written
                stop(sink)
                sink = SinkProcess(tmp_path / f"sink{step}", *args).wait_ready()
        sink.settled_health()
    finally:
        assert sink.terminate() == 0
    _check(runs, "job", steps)


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_a_sender_through_rotel_across_two_kills_every_point_once(tmp_path: Path, temporality: str) -> None:
    runs = tmp_path / "runs"
    args = ["--exporters", "tensorboard,jsonl", "--dir", str(runs), "--reorder-s", "1"]
    sink = SinkProcess(tmp_path / "sink0", *args).wait_ready()
    sink_port = sink.grpc_port
    rotel = Rotel(tmp_path / "rotel", sink_port).start()
    sender = _SdkSender("job", temporality)
    steps = 60
    try:
        for step in range(steps):
            body = sender.step(step)
            _send(lambda b: _post_to(rotel.http_port, b), body)
            if step in (20, 40):
                time.sleep(0.3)  # rotel has handed the request over
                _kill(sink)
                sink = _SinkOnPort(tmp_path / f"sink{step}", sink_port, *args).wait_ready()
        # rotel retries what the killed sink did not acknowledge; wait for the last step's every point
        last = ("tokens", steps - 1, float(sum(range(1, steps + 1))))
        assert wait_until(lambda: last in _points(readback.jsonl(runs / "job" / "rank0.jsonl")), 60)
        sink.settled_health()
    finally:
        rotel.stop()
        assert sink.terminate() == 0
    if temporality == "cumulative":
        _check(runs, "job", steps)
        return
    # DELTA: a batch rotel retries after a kill may reach the sink after later steps (its retry backoff). That
    # step is written at its own total (JSONL; TensorBoard skips a step that comes after the hold released a
    # later one), and the series' highest step at that moment once more with the whole total (the late DELTA
    # rule): the last step, or one mid-run on a loaded machine; the steps written in between lack it and are not
    # rewritten. Every gauge point once exactly.
    for points, every_step in ((readback.jsonl(runs / "job" / "rank0.jsonl"), True),
                               (readback.tensorboard(runs / "job"), False)):
        got = _points(points)
        assert [p for p in got if p[0] != "tokens"] == [p for p in _expected(steps) if p[0] != "tokens"]
        tokens = [(p.step, p.value) for p in points if p.name == "tokens"]
        assert tokens[-1] == last[1:], tokens  # the series ends at the true total
        assert {s for s, _ in tokens} == set(range(steps)) or not every_step, tokens
        first: dict[int, float] = {}
        for at, (step, value) in enumerate(tokens):
            if step in first:  # a rewrite: of the highest step so far, with a total no lower than before
                assert step == max(s for s, _ in tokens[:at]) and value >= first[step], (at, tokens)
            first.setdefault(step, value)
        assert len(tokens) - len(first) <= 2, tokens  # once per kill at most


def _post_to(http_port: int, body: bytes) -> None:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/metrics", data=body,
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


class _SinkOnPort(SinkProcess):
    """A sink restarted on the gRPC port the collector sends to."""

    def __init__(self, workdir: Path, grpc_port: int, *args: str) -> None:
        super().__init__(workdir, *args, "--grpc", f"127.0.0.1:{grpc_port}")
        self.grpc_port = grpc_port


# -- closes racing requests, and closes of busy runs ------------------------------------------------------------
def _jsonl_points(runs: Path) -> dict[str, list[tuple[str, int, float]]]:
    """run folder -> every metric point of its JSONL files, in file order (a list: a duplicate shows)."""
    out: dict[str, list[tuple[str, int, float]]] = {}
    for path in sorted(runs.glob("*/rank*.jsonl")):
        out.setdefault(path.parent.name, []).extend((p.name, p.step, p.value) for p in readback.jsonl(path))
    return out


def test_thousands_of_one_request_runs_through_rotel_with_few_open_runs_lose_nothing(tmp_path: Path) -> None:
    """Each run's only request reaches the sink in a batch of many runs while the least recently used runs close:
    a request for a run being closed is refused and retried, never written into the spool being removed. Every
    point the sink took (`/health` `points`) is in JSONL, once, each run whole (on a loaded machine the collector
    may still be retrying some runs when the test stops it: those were never taken)."""
    from otel_train.testing import OtlpPoint, metrics_request

    runs_n, points = 1000, 10
    runs = tmp_path / "runs"
    sink = SinkProcess(tmp_path / "sink", "--exporters", "jsonl", "--dir", str(runs), "--max-open-runs", "64",
                       "--backend-threads", "2").wait_ready()
    rotel = Rotel(tmp_path / "rotel", sink.grpc_port).start()
    try:
        for i in range(runs_n):
            body = metrics_request({"train.run.id": f"r{i}"}, [OtlpPoint(f"m{k}", float(i), step=k)
                                                              for k in range(points)])
            _send(lambda b: _post_to(rotel.http_port, b), body)
            time.sleep(0.005)  # rotel's batches (50 ms) hold fewer runs than the sink may open at once
        wait_until(lambda: sink.get("/health")["points"] >= runs_n * points, 20)
    finally:
        rotel.stop()
        taken = sink.get("/health")["points"]
        assert sink.terminate() == 0
    got = _jsonl_points(runs)
    assert taken >= 10 * points and sum(map(len, got.values())) == taken
    wrong = [run for run, pts in got.items() if sorted(pts) != [(f"m{k}", k, float(run[1:])) for k in range(points)]]
    assert wrong == []


def _ingest_all(router: Any, bodies: list[bytes]) -> None:
    from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
    from otel_train.sink.runs.router import Overloaded

    cache = DecodeCache()
    for body in bodies:
        for _ in range(1000):
            try:
                router.ingest(decode_metrics(parse_metrics(body), cache))
                break
            except Overloaded as err:  # a run being closed just then: retried, as a sender does
                time.sleep(err.retry_after_s / 20)
        else:
            raise AssertionError("never taken")


def _router(tmp_path: Path, **kwargs: Any) -> Any:
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.sink import exporter_factory
    from otel_train.sink.runs.router import Router

    options = ExporterOptions(directory=tmp_path / "runs", ranks="all")
    return Router(exporter_factory(("jsonl",), options), spool_dir=tmp_path / "runs" / ".sink-spool", **kwargs)


def _duplicates(points: list[tuple[str, int, float]]) -> int:
    return len(points) - len(set(points))


def test_six_cumulative_runs_over_a_limit_of_four_open_runs_write_each_point_once(tmp_path: Path) -> None:
    """The LRU closes runs between their exports; each export re-sends every past step; a reopened run knows
    what it wrote (before: its table was dropped on close and the whole history written again)."""
    senders = {f"run{i}": _SdkSender(f"run{i}", "cumulative") for i in range(6)}
    router = _router(tmp_path, max_open_runs=4)
    steps = 30
    try:
        for step in range(steps):
            _ingest_all(router, [sender.step(step) for sender in senders.values()])
    finally:
        router.close(30)
    got = _jsonl_points(tmp_path / "runs")
    assert sorted(got) == sorted(senders) and router.runs_closed > 6
    for run_id in senders:
        assert sorted(got[run_id]) == _expected(steps), (run_id, _duplicates(got[run_id]))


def test_two_ranks_of_200_gauges_over_550_steps_are_written_once(tmp_path: Path) -> None:
    """More values than any fixed table per run held (before: cleared when full, then re-sends written again)."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    gauges, steps = 200, 550
    bodies = []
    for rank in (0, 1):
        reader = InMemoryMetricReader()  # CUMULATIVE, the SDK's default: every export re-sends every step
        provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
            {"train.run.id": "wide", "train.rank": rank, "train.world_size": 2}))
        meter = provider.get_meter("t")
        instruments = [meter.create_gauge(f"g{i}") for i in range(gauges)]
        for step in range(steps):
            for i, gauge in enumerate(instruments):
                gauge.set(rank * 1e6 + i * 1000 + step, {"train.step": step})
            if step in (steps // 2, steps - 1):
                bodies.append(bytes(encode_metrics(reader.get_metrics_data()).SerializeToString()))
        bodies.append(bytes(encode_metrics(reader.get_metrics_data()).SerializeToString()))  # at shutdown
        provider.shutdown()
    router = _router(tmp_path)
    try:
        _ingest_all(router, [bodies[0], bodies[3], bodies[1], bodies[4], bodies[2], bodies[5]])
    finally:
        router.close(60)
    points = [p for path in sorted((tmp_path / "runs" / "wide").glob("rank*.jsonl")) for p in readback.jsonl(path)]
    assert len(points) == 2 * gauges * steps and _duplicates([(p.name, p.step, p.value) for p in points]) == 0


# -- a request sent twice ------------------------------------------------------------------------------------
def _traces_body(run_id: str, spans: int) -> bytes:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"train.run.id": run_id}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for step in range(spans):
        with tracer.start_as_current_span("forward", attributes={"train.step": step}):
            pass
    provider.shutdown()
    return bytes(encode_spans(exporter.get_finished_spans()).SerializeToString())


def test_every_request_sent_twice_spans_and_delta_points_are_taken_once(tmp_path: Path) -> None:
    import urllib.request

    runs = tmp_path / "runs"
    sink = SinkProcess(tmp_path / "sink", "--exporters", "jsonl", "--dir", str(runs)).wait_ready()
    sender = _SdkSender("twice", "delta")
    steps = 40
    try:
        for step in range(steps):
            body = sender.step(step)
            sink.post_metrics(body)
            sink.post_metrics(body)  # the acknowledgement was lost: the sender sends it again
        traces = _traces_body("twice", 50)
        for _ in range(2):
            req = urllib.request.Request(f"http://127.0.0.1:{sink.http_port}/v1/traces", data=traces,
                                         headers={"Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
        sink.settled_health()
        runs_doc = sink.get("/runs")["runs"]
    finally:
        assert sink.terminate() == 0
    assert _points(readback.jsonl(runs / "twice" / "rank0.jsonl")) == _expected(steps)
    spans = readback.jsonl_spans(runs / "twice" / "rank0.jsonl")
    assert sorted(s.step for s in spans) == list(range(50))
    assert runs_doc[0]["retries_skipped"] == steps + 50  # a counter point per step, and every span


def test_requests_of_many_new_runs_never_close_their_own_runs_before_writing_them(tmp_path: Path) -> None:
    """A collector's batch of new runs: opening the later ones makes room by closing the least recently used idle
    runs, which must not be the batch's own earlier runs (before: closed, their spool removed, the request
    acknowledged and its rows lost)."""
    from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
    from otel_train.testing import OtlpPoint, metrics_request

    def batch(first: int) -> bytes:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

        req = ExportMetricsServiceRequest()
        for i in range(first, first + 8):
            one = ExportMetricsServiceRequest.FromString(metrics_request({"train.run.id": f"r{i}"}, [
                OtlpPoint("m", float(i), step=0)]))
            req.resource_metrics.extend(one.resource_metrics)
        return bytes(req.SerializeToString())

    router = _router(tmp_path, max_open_runs=8)
    try:
        _ingest_all(router, [batch(i) for i in range(0, 600, 8)])
        assert decode_metrics(parse_metrics(batch(0)), DecodeCache()).points == 8
    finally:
        router.close(60)
    got = _jsonl_points(tmp_path / "runs")
    assert sorted(got) == sorted(f"r{i}" for i in range(600))
    assert all(got[f"r{i}"] == [("m", 0, float(i))] for i in range(600))


def test_a_run_closed_between_its_lookup_and_its_lock_refuses_the_request_whose_retry_lands_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the run is closed (as the LRU or the idle timer would) right after the request looked it up,
    before it took the run's lock. Before: the rows were put into the closed run (its spool removed) and the
    request acknowledged: lost. Now it is refused with a short retry-after, and the retry lands."""
    from otel_train.sink.runs.router import Router
    from otel_train.testing import OtlpPoint, metrics_request

    real = Router._run
    raced: list[str] = []

    def racing(self: Router, run_id: str, *args: Any, **kwargs: Any) -> Any:
        state = real(self, run_id, *args, **kwargs)
        if not raced:
            raced.append(run_id)
            assert self.close_if_idle(state, state.last_seen, "closed by the test")
        return state

    monkeypatch.setattr(Router, "_run", racing)
    router = _router(tmp_path)
    try:
        _ingest_all(router, [metrics_request({"train.run.id": "x"}, [OtlpPoint("m", 1.0, step=s) for s in range(3)])])
        refused = router.refused
    finally:
        router.close(30)
    assert raced == ["x"] and refused == 1
    assert _jsonl_points(tmp_path / "runs") == {"x": [("m", 0, 1.0), ("m", 1, 1.0), ("m", 2, 1.0)]}


def test_a_spool_that_cannot_be_written_refuses_requests_until_it_can_and_each_step_lands_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the run's spool cannot be written (disk full) for a stretch of requests while the run keeps
    sending. Before: acknowledged anyway, from memory only (a crash then lost them). Now each is refused with a
    retry-after, its series state untouched, and lands once when the sender retries after the disk recovered."""
    import errno

    from otel_train.ship.spool import Spool
    from otel_train.testing import OtlpPoint, metrics_request

    real = Spool.append
    failing = [0]

    def full(self: Spool, seq: int, max_step: int, payload: bytes) -> bool:
        if failing[0] > 0:
            failing[0] -= 1
            self._write_failed(OSError(errno.ENOSPC, "No space left on device"))
            return False
        return real(self, seq, max_step, payload)

    monkeypatch.setattr(Spool, "append", full)
    router = _router(tmp_path)
    steps = 40
    try:
        for step in range(steps):
            if step == 10:
                failing[0] = 15  # the next 15 writes fail: retried until the disk has room again
            _ingest_all(router, [metrics_request({"train.run.id": "full"}, [
                *[OtlpPoint(f"g{i}", _gauge(i, step), step=step) for i in range(GAUGES)],
                OtlpPoint("tokens", step + 1, step=step, kind="sum")])])  # DELTA: its total must not double
        refused = router.refused
    finally:
        router.close(30)
    assert refused == 15
    assert sorted(_jsonl_points(tmp_path / "runs")["full"]) == _expected(steps)


def test_a_delta_counter_whose_step_10_comes_after_step_11_ends_at_the_true_total_in_every_backend(
        tmp_path: Path) -> None:
    from otel_train.testing import OtlpPoint, metrics_request

    runs = tmp_path / "runs"
    sink = SinkProcess(tmp_path / "sink", "--exporters", "tensorboard,jsonl", "--dir", str(runs),
                       "--reorder-s", "1").wait_ready()
    try:
        for step in [*range(10), 11, 10]:  # 12 increments of 1; step 10's is late
            sink.post_metrics(metrics_request({"train.run.id": "late"}, [
                OtlpPoint("tokens", 1, step=step, kind="sum", time_unix_nano=step + 1)]))
            time.sleep(0.1 if step == 11 else 0)  # step 11 may be released by the hold before step 10 comes
        health = sink.settled_health()
    finally:
        assert sink.terminate() == 0
    jsonl = [(p.step, p.value) for p in readback.jsonl(runs / "late" / "rank0.jsonl")]
    tensorboard = [(p.step, p.value) for p in readback.tensorboard(runs / "late") if p.name == "tokens"]
    for points in (jsonl, tensorboard):
        top = max(step for step, _ in points)
        assert top == 11 and [v for s, v in points if s == top][-1] == 12.0, (points is jsonl, points[9:])  # the last value at step 11
        assert [v for s, v in points if s == 10] in ([11.0], [])  # TensorBoard skips it if 11 was out already
    assert health["late_delta_points"] == {"late": {"points": 1, "stale_totals": 1}}


def test_runs_count_rows_of_failed_writes_as_failed_not_written(tmp_path: Path) -> None:
    """Fault injection: a backend whose writes fail for its first windows. `/runs` said `written == points`
    (failed writes counted as written); now each backend's rows written, failed, and requests pending."""
    from otel_train.sink.runs.router import Router
    from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request

    class _Failing(InMemoryRowExporter):
        fail = 2

        def export_window(self, window: Any) -> Any:
            if self.fail > 0:
                self.fail -= 1
                return False  # the write did not land (as a backend that gave up on it reports)
            return super().export_window(window)

    backend = _Failing()
    router = Router(lambda: [backend], spool_dir=tmp_path / "spool")
    try:
        _ingest_all(router, [metrics_request({"train.run.id": "f"}, [OtlpPoint("m", 1.0, step=s)]) for s in range(5)])
        assert router.flush(30)
        run = router.summary()["runs"][0]
        totals = router.delivery_totals()
    finally:
        router.close(30)
    assert run["points"] == 5 and run["failed"] >= 1
    assert run["written"] == len(backend.metrics)  # what the backend holds, never a failed write
    assert run["backends"]["memory"] == {"written": run["written"], "failed": run["failed"], "pending": 0}
    # `/health`'s sum over the open runs
    assert totals == {"written": run["written"], "failed": run["failed"], "pending": 0, "runs_behind": 1}


def test_a_torn_journal_keeps_its_whole_records_and_a_damaged_snapshot_never_stops_a_run(tmp_path: Path) -> None:
    from otel_train.sink.runs.feed import spool_folder
    from otel_train.sink.runs.state import RunState
    from otel_train.testing import OtlpPoint, metrics_request

    state = RunState(tmp_path)
    state.append(1, ["one"])
    state.append(2, ["two"])
    whole = state.journal_path.read_bytes()
    state.journal_path.write_bytes(whole[:-3])  # killed in the middle of the second record
    assert state.read(last_seq=2) == (None, [["one"]])
    state.journal_path.write_bytes(whole)
    assert state.read(last_seq=1) == (None, [["one"]])  # the spool never got seq 2: its request was not taken

    def body(step: int) -> bytes:
        return metrics_request({"train.run.id": "d"}, [OtlpPoint("m", 1.0, step=step)])

    folder = tmp_path / "runs" / ".sink-spool" / spool_folder("d")
    folder.mkdir(parents=True)
    (folder / "ledger.snapshot").write_bytes(b"\x93not msgpack at all")
    router = _router(tmp_path)
    try:
        _ingest_all(router, [body(0), body(0), body(1)])
    finally:
        router.close(30)
    assert _jsonl_points(tmp_path / "runs") == {"d": [("m", 0, 1.0), ("m", 1, 1.0)]}


# A run's state files as the previous format wrote them (gauge values as (rank, tag, step) keys): a snapshot
# (seq 1: rank 1's loss at steps 0 and 1) and a journal record (seq 2: loss at step 1 changed to 0.75, acc at 2).
_OLD_SNAPSHOT = (b"\x93\x01\x01\x92\x9a\xff\x00\x00\x00\x00\x00\x00\x00\x00\x90\x8c\xa1T\x92\x90\x90"
                 b"\xa1P\x92\x90\x90\xa1G\x92\x92\x93\x01\xa4loss\x00\x93\x01\xa4loss\x01\x92\xcb?\xe0\x00"
                 b"\x00\x00\x00\x00\x00\xcb?\xd0\x00\x00\x00\x00\x00\x00\xa1C\x92\x90\x90\xa1H\x92\x90\x90"
                 b"\xa1X\x92\x90\x90\xa1L\x92\x90\x90\xa1D\x92\x90\x90\xa1S\x92\x90\x90\xa1W\x92\x90\x90"
                 b"\xa1N\x92\x90\x90\xa1Q\x92\x90\x90")
_OLD_JOURNAL = (b"5\x00\x00\x00\x92\x02\x94\x9a\xff\x00\x00\x00\x00\x00\x00\x00\x00\x90\x91\x93\xa1G\x93"
                b"\x01\xa4loss\x01\xcb?\xe8\x00\x00\x00\x00\x00\x00\x91\x93\x01\xa3acc\x02\x91\xcb?\xf0\x00"
                b"\x00\x00\x00\x00\x00")


def test_state_files_of_the_previous_format_still_load(tmp_path: Path) -> None:
    from otel_train.sink.runs.state import RunState
    from otel_train.sink.runs.temporality import SeriesLedger
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    state = RunState(tmp_path)
    state.snapshot_path.write_bytes(_OLD_SNAPSHOT)
    state.journal_path.write_bytes(_OLD_JOURNAL)
    snapshot, records = state.read(last_seq=2)
    assert snapshot is not None and len(records) == 1
    ledger = SeriesLedger(persistent=True)
    ledger.load(snapshot, records)
    ledger.loaded()
    run = RunInfo("r", "r", rank=1)
    sent = [("loss", 0, 0.5), ("loss", 1, 0.75), ("acc", 2, 1.0), ("loss", 1, 0.25), ("acc", 3, 1.0)]
    written: list[Any] = []
    ledger.gauges([MetricRow(run, step, tag, tag, value, "gauge", 0) for tag, step, value in sent], written.append)
    assert [(r.tag, r.step, r.value) for r in written] == [("loss", 1, 0.25), ("acc", 3, 1.0)]
    # written again in the current format (version 2), it reads back the same
    state.write(2, ledger.dump())
    again = SeriesLedger(persistent=True)
    again.load(*state.read(last_seq=2))
    assert again.dump() == ledger.dump()
