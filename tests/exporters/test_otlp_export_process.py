"""`OTEL_TRAIN_EXPORTERS=otlp` runs in the exporter process (like every named backend), sending to the real
sink over gRPC: every step of every series once, counters exact, spans with their step; a `kill -9` of the
exporter process mid-run sends nothing twice (a DELTA counter re-sent would count twice)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "sink"))  # the sink tests' helpers

from sinkkit import make_sink, scalars

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl

STEPS = 40


@pytest.mark.parametrize("kill_at", [None, 17])
def test_otlp_through_the_exporter_process_to_the_sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        kill_at: int | None) -> None:
    sink = make_sink(tmp_path, ("tensorboard", "jsonl"))
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.grpc_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        session = ot.init(exporters=["otlp"], dir=tmp_path / "local", run_name="op", run_id="op")
        proc = session.export_process
        assert proc is not None and session.exporters == []  # nothing of it in the training process
        tokens = ot.get_meter().create_counter("train.tokens")
        for step in range(STEPS):
            with ot.step(step), ot.span("work"):
                ot.log({"train/loss": 1.0 / (step + 1)})
                tokens.add(10, {"train.step": step})
            time.sleep(0.01)
            if step == kill_at:
                old = proc.pid
                os.kill(old, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while proc.pid == old and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert proc.restarts == 1
        with ot.get_tracer().start_as_current_span("raw", attributes={"train.step": STEPS - 1}) as raw:
            raw.add_event("checkpoint written", {"bytes": 1024})  # a raw OTel span's event crosses both hops
        assert ot.flush(timeout_s=30)
        ot.shutdown()
        assert sink.flush(10)
        assert sink.router.spans_in == STEPS + 1  # each span once
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "op")
    assert got["train/loss"] == [(s, pytest.approx(1.0 / (s + 1))) for s in range(STEPS)]
    assert got["train.tokens"] == [(s, 10.0 * (s + 1)) for s in range(STEPS)]
    (raw_span,) = [r for r in read_jsonl(jsonl_path(tmp_path / "runs", "op", 0)) if r["name"] == "raw"]
    assert [(e["name"], e["attributes"]) for e in raw_span["events"]] == [("checkpoint written", {"bytes": 1024})]
