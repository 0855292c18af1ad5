"""Admission: a refused request changes nothing (retries are exact), a slow run is held in its spool, and
one run's backlog never refuses or slows another run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
from otel_train.sink.runs.router import Overloaded, Router
from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request


class Gates:
    """Backends that block while their run's gate is closed (a stalled backend, per run)."""

    def __init__(self) -> None:
        self.open: dict[str, threading.Event] = {}
        self.backends: list[InMemoryRowExporter] = []

    def gate(self, run_id: str) -> threading.Event:
        return self.open.setdefault(run_id, threading.Event())

    def factory(self) -> Callable[[], list[Any]]:
        gates = self

        class Gated(InMemoryRowExporter):
            def write_metrics(self, rows: Any, histograms: Any) -> None:
                if rows:
                    gates.open.get(rows[0].run.run_id, _ALWAYS).wait(30)
                super().write_metrics(rows, histograms)

        def make() -> list[Any]:
            backend = Gated()
            self.backends.append(backend)
            return [backend]

        return make

    def series(self, run_id: str, name: str) -> list[tuple[int, float]]:
        """(step, value) of every row written for `name` of `run_id`, in write order, duplicates kept."""
        return [(r.step, r.value) for b in self.backends for r in b.metrics
                if r.run.run_id == run_id and r.name == name]


_ALWAYS = threading.Event()
_ALWAYS.set()


def _step_request(run_ids: tuple[str, ...], step: int) -> bytes:
    """One request with a Resource per run: a DELTA counter (+step+1) and a gauge at `step`.

    Concatenated requests are one request (protobuf merges repeated fields): a collector's batch."""
    return b"".join(metrics_request({"train.run.id": run_id}, [
        OtlpPoint("train/tokens", float(step + 1), step=step, kind="sum", time_unix_nano=step + 1),
        OtlpPoint("train/loss", 10.0 * step, step=step, time_unix_nano=step + 1),
    ]) for run_id in run_ids)


def _expected_tokens(steps: int) -> list[tuple[int, float]]:
    total, out = 0.0, []
    for s in range(steps):
        total += s + 1
        out.append((s, total))
    return out


def _drained(router: Router, run_id: str) -> None:
    """Wait until every request of `run_id` was handed to its backends (so the test is not a race)."""
    deadline = time.monotonic() + 10
    while router._runs[run_id].delivery.pending and time.monotonic() < deadline:
        time.sleep(0.002)


def _send_until_taken(router: Router, cache: DecodeCache, body: bytes, unstall: threading.Event,
                      refusals_before_unstall: int) -> int:
    """Retry one request as an OTLP sender does on UNAVAILABLE; unstall the backend after some refusals."""
    refused = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            router.ingest(decode_metrics(parse_metrics(body), cache))
        except Overloaded:
            refused += 1
            if refused >= refusals_before_unstall:
                unstall.set()
            time.sleep(0.002)
            continue
        unstall.clear()
        return refused
    raise AssertionError("the request was never taken")


def test_a_refused_request_changes_nothing_for_any_run_of_it() -> None:
    """Memory-only runs (no spool) with a queue of one: retrying the same bytes after each refusal gives
    exactly one delivery, for the stalled run and for the healthy run batched into the same requests."""
    gates = Gates()
    slow = gates.gate("slow")
    router = Router(gates.factory(), queue_windows=1)
    cache = DecodeCache()
    steps = 12
    refused = 0
    try:
        for step in range(steps):
            refused += _send_until_taken(router, cache, _step_request(("fast", "slow"), step), slow, 4)
    finally:
        slow.set()
        router.close(10)
    assert refused >= 4 and router.refused == refused  # the stall did refuse requests, all counted
    for run_id in ("fast", "slow"):
        assert gates.series(run_id, "train/tokens") == _expected_tokens(steps)
        assert gates.series(run_id, "train/loss") == [(s, 10.0 * s) for s in range(steps)]
    assert router.points_in == 2 * 2 * steps and router.requests == steps


def test_a_stalled_run_is_held_in_its_spool_and_loses_nothing(tmp_path: Path) -> None:
    """With a spool, a run whose backend hangs keeps being accepted (far past its memory queue), and
    once the backend moves everything is written once, in order; the spool is emptied at close."""
    gates = Gates()
    slow = gates.gate("slow")
    router = Router(gates.factory(), queue_windows=2, spool_dir=tmp_path / "spool")
    cache = DecodeCache()
    steps = 40
    try:
        for step in range(steps):
            router.ingest(decode_metrics(parse_metrics(_step_request(("slow",), step)), cache))
        assert router.refused == 0
        assert router.held_bytes > 0  # held for the stalled backend
    finally:
        slow.set()
        router.close(10)
    assert gates.series("slow", "train/tokens") == _expected_tokens(steps)
    assert gates.series("slow", "train/loss") == [(s, 10.0 * s) for s in range(steps)]
    assert router.held_bytes == 0
    assert not list((tmp_path / "spool").rglob("*.seg"))


def test_past_its_budget_a_run_is_refused_at_once_and_other_runs_are_not(tmp_path: Path) -> None:
    gates = Gates()
    slow = gates.gate("slow")
    router = Router(gates.factory(), queue_windows=2, spool_dir=tmp_path / "spool", spool_run_bytes=1,
                    retry_after_s=2.5)
    cache = DecodeCache()
    try:
        router.ingest(decode_metrics(parse_metrics(_step_request(("slow",), 0)), cache))  # held: backend hangs
        router.ingest(decode_metrics(parse_metrics(_step_request(("fast",), 0)), cache))
        _drained(router, "fast")
        with pytest.raises(Overloaded) as refused:
            router.ingest(decode_metrics(parse_metrics(_step_request(("slow",), 1)), cache))
        assert refused.value.retry_after_s == 2.5 and "budget" in str(refused.value)
        # A request for both runs is refused whole: the healthy run's part is not taken either.
        with pytest.raises(Overloaded):
            router.ingest(decode_metrics(parse_metrics(_step_request(("fast", "slow"), 1)), cache))
        for step in range(1, 5):  # the healthy run alone is served
            _drained(router, "fast")
            router.ingest(decode_metrics(parse_metrics(_step_request(("fast",), step)), cache))
    finally:
        slow.set()
        router.close(10)
    assert gates.series("fast", "train/tokens") == _expected_tokens(5)
    assert gates.series("slow", "train/tokens") == _expected_tokens(1)


def test_the_total_budget_refuses_only_runs_that_hold_data(tmp_path: Path) -> None:
    gates = Gates()
    slow = gates.gate("slow")
    router = Router(gates.factory(), queue_windows=2, spool_dir=tmp_path / "spool", spool_total_bytes=1)
    cache = DecodeCache()
    try:
        router.ingest(decode_metrics(parse_metrics(_step_request(("slow",), 0)), cache))
        with pytest.raises(Overloaded, match="all runs"):
            router.ingest(decode_metrics(parse_metrics(_step_request(("slow",), 1)), cache))
        slow.set()
        assert router.flush(10)
        for step in range(1, 3):  # drained: taken again
            _drained(router, "slow")
            router.ingest(decode_metrics(parse_metrics(_step_request(("slow",), step)), cache))
    finally:
        slow.set()
        router.close(10)
    assert gates.series("slow", "train/tokens") == _expected_tokens(3)


def test_a_stalled_run_does_not_slow_requests_of_other_runs_over_http(tmp_path: Path) -> None:
    """Through the HTTP receiver: while one run's backend hangs and its requests are refused, requests of
    other runs are answered 200 (no request waits behind the stalled run: refusals are immediate)."""
    import urllib.error
    import urllib.request

    from otel_train.sink import Sink
    from otel_train.sink.settings import SinkSettings

    gates = Gates()
    slow = gates.gate("slow")
    sink = Sink(SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0", spool_dir=tmp_path / "spool",
                             retry_after_s=3), gates.factory())
    sink.router._run_budget = 1  # the stalled run is refused once it holds one request (test size)
    sink.start()

    def post(body: bytes) -> tuple[int, str | None]:
        req = urllib.request.Request(f"http://127.0.0.1:{sink.http_port}/v1/metrics", data=body,
                                     headers={"Content-Type": "application/x-protobuf"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, None
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Retry-After")

    try:
        codes = [post(_step_request(("slow",), s)) for s in range(4)]
        assert (503, "3") in codes  # refused with the retry hint
        fast = []
        for s in range(10):
            fast.append(post(_step_request(("fast",), s)))
            _drained(sink.router, "fast")
        assert fast == [(200, None)] * 10
    finally:
        slow.set()
        sink.stop()
    assert gates.series("fast", "train/loss") == [(s, 10.0 * s) for s in range(10)]
    health_rejected = sink.rejected.get("overloaded", 0)
    assert health_rejected == sum(1 for c, _ in codes if c == 503)


def test_budgets_queue_and_retry_hint_are_settings() -> None:
    from otel_train.errors import ConfigError
    from otel_train.sink.settings import load_sink_settings

    s = load_sink_settings({"OTEL_TRAIN_SINK_SPOOL_RUN_MB": "64", "OTEL_TRAIN_SINK_SPOOL_TOTAL_MB": "512",
                            "OTEL_TRAIN_SINK_QUEUE_WINDOWS": "8", "OTEL_TRAIN_SINK_RETRY_AFTER_S": "2.5",
                            "OTEL_TRAIN_SINK_SPOOL_DIR": "/var/tmp/held"}, queue_windows="16")
    assert (s.spool_run_mb, s.spool_total_mb, s.queue_windows, s.retry_after_s) == (64, 512, 16, 2.5)
    assert str(s.spool_dir) == "/var/tmp/held"
    with pytest.raises(ConfigError, match=r"OTEL_TRAIN_SINK_SPOOL_TOTAL_MB: 0 is too small; expected an integer >= 1"):
        load_sink_settings({"OTEL_TRAIN_SINK_SPOOL_TOTAL_MB": "0"})
    with pytest.raises(ConfigError, match=r"--retry-after-s: 'soon' is not a number"):
        load_sink_settings({}, retry_after_s="soon")


def test_grpc_refusal_carries_retry_info(tmp_path: Path) -> None:
    """The OTel SDKs read the server's wait from a google.rpc.RetryInfo in the UNAVAILABLE status."""
    import grpc
    from google.rpc import error_details_pb2, status_pb2

    from otel_train.sink import Sink
    from otel_train.sink.settings import SinkSettings

    gates = Gates()
    slow = gates.gate("slow")
    sink = Sink(SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0", queue_windows=1, retry_after_s=1.5),
                gates.factory()).start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}")
        export = channel.unary_unary("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export")
        error = None
        for step in range(4):
            try:
                export(_step_request(("slow",), step), timeout=5)
            except grpc.RpcError as err:
                error = err
                break
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
        details = dict(error.trailing_metadata() or ())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)
        info = error_details_pb2.RetryInfo()
        assert status.code == 14 and status.details[0].Unpack(info)
        assert (info.retry_delay.seconds, info.retry_delay.nanos) == (1, 500_000_000)
        channel.close()
    finally:
        slow.set()
        sink.stop()


def test_runs_whose_names_look_alike_never_share_a_spool(tmp_path: Path) -> None:
    gates = Gates()
    router = Router(gates.factory(), spool_dir=tmp_path / "spool")
    cache = DecodeCache()
    try:
        for step in range(3):
            router.ingest(decode_metrics(parse_metrics(_step_request(("team/a", "team_a"), step)), cache))
        assert len(list((tmp_path / "spool").iterdir())) == 2
    finally:
        router.close(10)
    # each closed with everything written: only its series state is left (for its next request, or a restart)
    left = sorted(sorted(p.name for p in folder.iterdir()) for folder in (tmp_path / "spool").iterdir())
    assert left == [["ledger.journal", "ledger.snapshot"]] * 2
    for run_id in ("team/a", "team_a"):
        assert gates.series(run_id, "train/tokens") == _expected_tokens(3)
