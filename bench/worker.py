"""One benchmark row in its own process: `python bench/worker.py TOOL --steps N --gap-us G --dir D`.

Prints one JSON line (the measurements of `_loop.run_loop` plus `landed`/`expected`). Backends are
isolated under `--dir` by the environment `run.py` sets (HOME, WANDB_*, CLEARML_*, TRACKIO_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _loop import KEYS, Timer, Tool, expected, run_loop

KEYSET = frozenset(KEYS)


def _close_to(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


# -- plain Python: the floor --------------------------------------------------------------------
class Floor(Tool):
    name = "floor"

    def __init__(self, root: Path) -> None:
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]
        self.store: list[tuple[int, dict[str, float]]] = []

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        self.store.append((i, values))

    def landed(self, steps: int) -> int:
        return sum(1 for i, d in self.store for k in KEYS if _close_to(d[k], expected(i, k)))


# -- otel-train ---------------------------------------------------------------------------------
def _counting_exporter() -> Any:
    from otel_train.exporters.base import RowExporter

    class Counting(RowExporter):
        """A backend that keeps nothing: counts the right values it receives."""

        name = "count"
        handles_metrics = True
        handles_spans = True

        def __init__(self) -> None:
            super().__init__(None)
            self.good = 0
            self.spans = 0

        def write_metrics(self, rows: Any, histograms: Any) -> None:
            for r in rows:
                if r.tag in KEYSET and _close_to(r.value, expected(r.step, r.tag)):
                    self.good += 1

        def write_spans(self, rows: Any) -> None:
            self.spans += len(rows)

    return Counting()


class OtelTrain(Tool):
    """`ot.log` + `ot.span` inside `ot.step`, with the named backends (or a counting one)."""

    def __init__(self, root: Path, backends: str) -> None:
        import otel_train as ot

        self.ot = ot
        self.backends = backends
        self.root = root
        self.counter = _counting_exporter() if backends == "count" else None
        if self.counter is None:
            os.environ["OTEL_TRAIN_EXPORTERS"] = backends  # as a job launcher would set it
        self.session = ot.init(exporters=[self.counter] if self.counter is not None else None, dir=root / "runs",
                               run_name="bench", run_id="bench-run", project="bench")
        self.name = "ot" if backends == "count" else f"ot->{backends}"
        self.step = ot.step  # type: ignore[assignment]
        self.region = ot.span  # type: ignore[assignment]
        self._log = ot.log

    def log(self, i: int, values: dict[str, float]) -> None:
        self._log(values)

    def close(self) -> None:
        ex = self.session.exporters[0] if self.session.exporters else None
        task = getattr(ex, "task", None)  # ClearML: the offline folder is gone from the exporter after close
        self.clearml_folder = Path(task.get_offline_mode_folder()) if task is not None else None
        self.ot.shutdown()

    def landed(self, steps: int) -> int | None:
        if self.counter is not None:
            return self.counter.good  # type: ignore[no-any-return]
        first = self.backends.split(",")[0]
        reader = READBACK.get(first)
        global _TOOL
        _TOOL = self
        return reader(self.root, self.session) if reader else None


# -- raw OpenTelemetry SDK ----------------------------------------------------------------------
class RawOtel(Tool):
    """20 synchronous gauges with a `train.step` attribute + 4 SDK spans (BatchSpanProcessor)."""

    name = "raw-otel"

    def __init__(self, root: Path) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics import _Gauge as Gauge  # the SDK exports its sync gauge only so
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            MetricExporter,
            MetricExportResult,
            PeriodicExportingMetricReader,
        )
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        tool = self
        self.good = 0
        self.spans = 0

        class Metrics(MetricExporter):
            def __init__(self) -> None:
                super().__init__(preferred_temporality={Gauge: AggregationTemporality.DELTA})

            def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kw: Any) -> Any:
                for rm in metrics_data.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            if m.name in KEYSET:
                                for p in m.data.data_points:
                                    s = (p.attributes or {}).get("train.step")
                                    if s is not None and _close_to(p.value, expected(s, m.name)):
                                        tool.good += 1
                return MetricExportResult.SUCCESS

            def force_flush(self, timeout_millis: float = 10_000) -> bool:
                return True

            def shutdown(self, timeout_millis: float = 30_000, **kw: Any) -> None:
                pass

        class Spans(SpanExporter):
            def export(self, spans: Any) -> Any:
                tool.spans += len(spans)
                return SpanExportResult.SUCCESS

        # 1 s: the SDK default (60 s) would overflow the cardinality limit with per-step attributes.
        self.reader = PeriodicExportingMetricReader(Metrics(), export_interval_millis=1000)
        self.mp = MeterProvider(metric_readers=[self.reader])
        self.tp = TracerProvider()
        self.tp.add_span_processor(BatchSpanProcessor(Spans()))
        meter = self.mp.get_meter("bench")
        self.gauges = [(k, meter.create_gauge(k)) for k in KEYS]
        self.region = self.tp.get_tracer("bench").start_as_current_span  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        attrs = {"train.step": i}
        for k, g in self.gauges:
            g.set(values[k], attrs)

    def close(self) -> None:
        self.mp.shutdown()
        self.tp.shutdown()

    def landed(self, steps: int) -> int:
        return self.good


# -- TensorBoard's own event writer, tensorboardX -------------------------------------------------
class TBWriter(Tool):
    name = "tb-writer"

    def __init__(self, root: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = root / "tb"
        self.writer = EventFileWriter(str(self.dir))
        self.Event, self.Summary = event_pb2.Event, summary_pb2.Summary
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        V = self.Summary.Value
        summary = self.Summary(value=[V(tag=k, simple_value=v) for k, v in values.items()])
        self.writer.add_event(self.Event(wall_time=time.time(), step=i, summary=summary))

    def close(self) -> None:
        self.writer.close()

    def landed(self, steps: int) -> int:
        return read_tb(self.dir)


class TensorboardX(Tool):
    name = "tensorboardX"

    def __init__(self, root: Path) -> None:
        from tensorboardX import SummaryWriter

        self.dir = root / "tbx"
        self.writer = SummaryWriter(str(self.dir))
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        add = self.writer.add_scalar
        for k, v in values.items():
            add(k, v, i)

    def close(self) -> None:
        self.writer.close()

    def landed(self, steps: int) -> int:
        return read_tb(self.dir)


def read_tb(directory: Path) -> int:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    total = 0
    for events in sorted({p.parent for p in directory.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events), size_guidance={SCALARS: 0})
        acc.Reload()
        tags = set(acc.Tags().get("scalars", []))
        for k in KEYS:
            if k in tags:
                total += sum(1 for e in acc.Scalars(k) if _close_to(e.value, expected(e.step, k)))
    return total


# -- Weights & Biases (offline) ------------------------------------------------------------------
class Wandb(Tool):
    name = "wandb-offline"

    def __init__(self, root: Path) -> None:
        import wandb

        self.root = root
        self.run = wandb.init(project="bench", name="bench-direct", dir=str(root), mode="offline",
                              settings=wandb.Settings(console="off"))
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        self.run.log(values, step=i)

    def close(self) -> None:
        self.run.finish()

    def landed(self, steps: int) -> int:
        return read_wandb(self.root)


def read_wandb(root: Path, session: Any = None) -> int:
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    total = 0
    for path in root.rglob("run-*.wandb"):
        data = path.read_bytes()
        off, pending = 7, b""
        while off + 7 <= len(data):
            left = 32768 - off % 32768
            if left < 7:
                off += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[off:off + 7])
            if kind == 0 and length == 0:
                off += left
                continue
            chunk = data[off + 7:off + 7 + length]
            off += 7 + length
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(pending + chunk if kind == 4 else chunk)
                pending = b""
                if rec.WhichOneof("record_type") == "history":
                    items = {(i.key or "/".join(i.nested_key)): i.value_json for i in rec.history.item}
                    step = int(json.loads(items["_step"]))
                    total += sum(1 for k in KEYS if k in items and _close_to(json.loads(items[k]), expected(step, k)))
            elif kind == 2:
                pending = chunk
            else:
                pending += chunk
    return total


# -- ClearML (offline) ----------------------------------------------------------------------------
class ClearML(Tool):
    def __init__(self, root: Path, subprocess_reporting: bool) -> None:
        from clearml import Task

        self.name = "clearml-offline" + ("" if subprocess_reporting else " (no subprocess)")
        Task.set_offline(True)
        if not subprocess_reporting:
            Task._report_subprocess_enabled = False
        self.task = Task.init(project_name="bench", task_name="bench-direct", reuse_last_task_id=False,
                              auto_connect_frameworks=False, auto_connect_arg_parser=False,
                              auto_connect_streams=False, auto_resource_monitoring=False)
        self.logger = self.task.get_logger()
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        report = self.logger.report_scalar
        for k, v in values.items():
            title, _, series = k.partition("/")
            report(title, series, v, iteration=i)

    def close(self) -> None:
        self.folder = Path(self.task.get_offline_mode_folder())
        self.logger.flush(wait=True)
        self.task.close()

    def landed(self, steps: int) -> int:
        return read_clearml(self.folder)


def read_clearml(folder: Path | None) -> int:
    if folder is None:
        return 0
    total = 0
    path = folder / "metrics.jsonl"
    if not path.exists():
        return 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        for ev in json.loads(line):
            key = f"{ev.get('metric')}/{ev.get('variant')}"
            if key in KEYSET and "iter" in ev and _close_to(ev["value"], expected(ev["iter"], key)):
                total += 1
    return total


# -- MLflow ---------------------------------------------------------------------------------------
class MLflow(Tool):
    def __init__(self, root: Path, synchronous: bool) -> None:
        import mlflow

        self.name = "mlflow (" + ("sync" if synchronous else "async") + ")"
        self.sync = synchronous
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment("bench")
        self.run = mlflow.start_run(run_name="bench-direct")
        self.mlflow = mlflow
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        self.mlflow.log_metrics(values, step=i, synchronous=self.sync)

    def close(self) -> None:
        self.mlflow.end_run()

    def landed(self, steps: int) -> int:
        return read_mlflow(self.uri, self.run.info.run_id)


def read_mlflow(uri: str, run_id: str | None = None, session: Any = None) -> int:
    from mlflow.tracking import MlflowClient

    if session is not None:
        ex = session.exporters[0]
        uri = ex.tracking_uri
    client = MlflowClient(tracking_uri=uri)
    run_ids = [run_id] if run_id else [
        r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    total = 0
    for rid in run_ids:
        for k in KEYS:
            total += sum(1 for m in client.get_metric_history(rid, k) if _close_to(m.value, expected(m.step, k)))
    return total


# -- Trackio --------------------------------------------------------------------------------------
class Trackio(Tool):
    name = "trackio"

    def __init__(self, root: Path) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project="bench", name="bench-direct", embed=False, auto_log_gpu=False,
                                auto_log_cpu=False)
        self.timings: dict[str, float] = {}
        self.region = Timer(self.timings)  # type: ignore[assignment]

    def log(self, i: int, values: dict[str, float]) -> None:
        values.update(self.timings)
        self.trackio.log(values, step=i)

    def close(self) -> None:
        self.trackio.finish()

    def landed(self, steps: int) -> int:
        return read_trackio("bench", "bench-direct")


def read_trackio(project: str, run: str, session: Any = None) -> int:
    from trackio.sqlite_storage import SQLiteStorage

    total = 0
    for row in SQLiteStorage.get_logs(project, run):
        step = row.get("step")
        if step is None:
            continue
        total += sum(1 for k in KEYS if k in row and _close_to(row[k], expected(step, k)))
    return total


_TOOL: Any = None
READBACK: dict[str, Any] = {
    "tensorboard": lambda root, s: read_tb(root / "runs"),
    "wandb": lambda root, s: read_wandb(root / "runs"),
    "clearml": lambda root, s: read_clearml(getattr(_TOOL, "clearml_folder", None)),
    "mlflow": lambda root, s: read_mlflow("", None, s),
    "trackio": lambda root, s: read_trackio("bench", "bench"),
}


def build(tool: str, root: Path) -> Tool:
    if tool == "floor":
        return Floor(root)
    if tool == "ot":
        return OtelTrain(root, "count")
    if tool.startswith("ot:"):
        return OtelTrain(root, tool[3:])
    simple: dict[str, Any] = {
        "raw-otel": RawOtel, "tb-writer": TBWriter, "tensorboardx": TensorboardX, "wandb": Wandb,
        "trackio": Trackio,
        "clearml": lambda r: ClearML(r, True), "clearml-nosub": lambda r: ClearML(r, False),
        "mlflow-sync": lambda r: MLflow(r, True), "mlflow-async": lambda r: MLflow(r, False),
    }
    return simple[tool](root)  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("tool")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gap-us", type=float, default=200.0)
    p.add_argument("--dir", type=Path, required=True)
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tool = build(a.tool, a.dir)
    setup_s = time.perf_counter() - t0
    result = run_loop(tool, a.steps, a.gap_us / 1e6, warmup=a.warmup)
    result["setup_s"] = setup_s
    result["name"] = tool.name
    result["expected"] = result["total_steps"] * len(KEYS)
    try:
        result["landed"] = tool.landed(result["total_steps"])
    except Exception as err:  # a reader that fails is reported, not fatal
        result["landed"] = None
        result["landed_error"] = f"{type(err).__name__}: {err}"
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # some clients keep non-daemon threads alive after close; the numbers are out


if __name__ == "__main__":
    raise SystemExit(main())
