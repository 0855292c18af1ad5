"""Per-backend routing with the real backends: TensorBoard gets everything, an offline W&B run
`train/*` every 5 steps, an offline ClearML session `system/*` only; each read back. Plus the
unmatched-pattern line, config errors, and the same routing through the sink."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from backendkit import events, read_run, tb_scalars

import otel_train as ot
from otel_train.config.settings import load_settings
from otel_train.errors import ConfigError

STEPS = range(12)
BUILTINS = {"train/step_duration_s", "train/time_total_s", "train/iterations"}


@pytest.fixture(autouse=True)
def _clients_start_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's and ClearML's clients can take longer than shutdown's default 10 s to start on a loaded 2-core machine
    (the store is then read before the exporter process has delivered): the routes, not that deadline, are tested
    here."""
    monkeypatch.setenv("OTEL_TRAIN_SHUTDOWN_TIMEOUT_S", "120")


def _wandb_written() -> None:
    """Stop wandb's service process: its offline writer may still hold records after `finish()` returns."""
    import wandb

    wandb.teardown()


def _train(steps: range) -> None:
    for s in ot.steps(steps):
        ot.log({"train/loss": 1.0 / (s + 1), "eval/acc": s / 100, "system/cpu_percent": 50.0 + s})


def test_one_run_three_backends_each_gets_its_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     backend_home: Path) -> None:
    monkeypatch.setenv("OTEL_TRAIN_WANDB_INCLUDE", "train/*")
    monkeypatch.setenv("OTEL_TRAIN_WANDB_EVERY", "5")
    monkeypatch.setenv("OTEL_TRAIN_CLEARML_INCLUDE", "system/*")
    ot.init(exporters=["tensorboard", "wandb", "clearml"], dir=tmp_path / "runs", run_id="route-1")
    _train(STEPS)
    ot.shutdown()
    _wandb_written()

    tb = tb_scalars(tmp_path / "runs" / "route-1")
    tags = {t for t in tb if not t.startswith("otel_train/")}  # minus otel-train's own health (test_self_telemetry)
    assert tags == {"train/loss", "eval/acc", "system/cpu_percent", *BUILTINS}  # everything, built-ins in `train/`
    assert tb["train/loss"] == [(s, pytest.approx(1.0 / (s + 1))) for s in STEPS]
    assert [s for s, _ in tb["train/iterations"]] == list(STEPS)

    [wandb_file] = (tmp_path / "runs" / "route-1" / "wandb").glob("offline-run-*/run-route-1.wandb")
    history = read_run(wandb_file)["history"]
    assert sorted(history) == [0, 5, 10]
    for step, values in history.items():
        assert set(values) == {"train/loss", *BUILTINS}
        assert values["train/loss"] == pytest.approx(1.0 / (step + 1))

    scalars: dict[tuple[str, str], list[tuple[int, float]]] = {}
    [folder] = [p for p in (backend_home / "clearml" / "cache" / "offline").glob("offline-*") if p.is_dir()]
    for ev in events(folder):
        if ev["type"] == "training_stats_scalar":
            scalars.setdefault((ev["metric"], ev["variant"]), []).append((ev["iter"], ev["value"]))
    assert scalars == {("system", "cpu_percent"): [(s, 50.0 + s) for s in STEPS]}


def test_a_misspelt_pattern_is_reported_once_at_shutdown(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OTEL_TRAIN_TENSORBOARD_INCLUDE", "trian/*,eval/*")
    ot.init(exporters=["tensorboard"], dir=run_dir, run_id="typo", routes={"tensorboard": {"exclude": ["debug/*"]}})
    _train(range(3))
    with caplog.at_level(logging.WARNING, logger="otel_train.config.routing"):
        ot.shutdown()
        ot.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "otel_train.config.routing"]
    assert lines == ["OTEL_TRAIN_TENSORBOARD_INCLUDE: pattern 'trian/*' matched no metric",
                     "routes['tensorboard'].exclude: pattern 'debug/*' matched no metric"]
    assert set(tb_scalars(run_dir / "typo")) == {"eval/acc"}


def test_keyword_fields_override_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_WANDB_INCLUDE", "train/*")
    monkeypatch.setenv("OTEL_TRAIN_WANDB_EVERY", "5")
    monkeypatch.setenv("OTEL_TRAIN_CHROME_TRACE_RANKS", "all")
    s = load_settings(routes={"wandb": ot.Route(every=10)})
    assert s.routes["wandb"].include == ("train/*",) and s.routes["wandb"].every == 10
    assert s.routes["wandb"].include_setting == "OTEL_TRAIN_WANDB_INCLUDE"
    assert s.routes["chrome_trace"].ranks == "all"
    assert load_settings(environ={"OTEL_TRAIN_EXPORT_EVERY": "3"}).routes == {}  # a setting, not a route


@pytest.mark.parametrize(("env", "kwargs", "message"), [
    ({"OTEL_TRAIN_WANDV_INCLUDE": "train/*"}, {},
     "OTEL_TRAIN_WANDV_INCLUDE: unknown backend 'WANDV' in the variable name; allowed: OTEL_TRAIN_"),
    ({"OTEL_TRAIN_WANDB_EVERY": "ten"}, {}, "OTEL_TRAIN_WANDB_EVERY: 'ten' is not an integer; expected an integer >= 1"),
    ({"OTEL_TRAIN_WANDB_EVERY": "0"}, {}, "OTEL_TRAIN_WANDB_EVERY: 0 is too small; expected an integer >= 1"),
    ({"OTEL_TRAIN_CLEARML_RANKS": "1"}, {}, "OTEL_TRAIN_CLEARML_RANKS: '1' is not allowed; use `0`"),
    ({"OTEL_TRAIN_WANDB_INCLUDE": " , "}, {}, "OTEL_TRAIN_WANDB_INCLUDE: ' , ' holds no pattern"),
    ({}, {"routes": {"wanb": {"every": 2}}}, "routes['wanb']: unknown exporter 'wanb'; known: "),
    ({}, {"routes": {"wandb": {"evry": 2}}}, "routes['wandb']: unknown key 'evry'; allowed: include, exclude, every"),
    ({}, {"routes": {"wandb": {"every": -1}}}, "every: -1 is too small; expected an integer >= 1"),
    ({"OTEL_TRAIN_WANDB_LOGS": "job*,!"}, {}, "OTEL_TRAIN_WANDB_LOGS: 'job*,!' has a `!` without a pattern"),
])
def test_bad_routing_fails_init_with_one_line(env: dict[str, str], kwargs: dict[str, Any], message: str,
                                              monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        ot.init(exporters=["console"], dir=run_dir, **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_backends_ranks_override_in_process(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 with OTEL_TRAIN_RANKS=0 but OTEL_TRAIN_JSONL_RANKS=all: JSONL gets rank 1, TensorBoard does not."""
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    monkeypatch.setenv("OTEL_TRAIN_JSONL_RANKS", "all")
    ot.init(exporters=["tensorboard", "jsonl"], dir=run_dir, run_id="r", rank=1, world_size=2)
    _train(range(2))
    ot.shutdown()
    names = {r["name"] for r in read_jsonl(jsonl_path(run_dir, "r", 1))
             if r["type"] == "metric" and not r["name"].startswith("otel_train.")}  # minus otel-train's own health
    assert names == {"train/loss", "eval/acc", "system/cpu_percent", "train.step.duration_s", "train.time_total_s",
                     "train.iterations"}  # JSONL keeps the wire names
    assert not list(run_dir.glob("**/events.out.tfevents.*"))


def test_the_sink_routes_its_backends_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Env routing read by the sink (as `otel-train sink` does): TensorBoard `train/*` every 3rd step, rank 0."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl
    from otel_train.sink import Sink, exporter_factory
    from otel_train.sink.settings import SinkSettings

    monkeypatch.setenv("OTEL_TRAIN_TENSORBOARD_INCLUDE", "train/*")
    monkeypatch.setenv("OTEL_TRAIN_TENSORBOARD_EVERY", "3")
    monkeypatch.setenv("OTEL_TRAIN_TENSORBOARD_RANKS", "0")
    run_settings = load_settings(exporters="tensorboard,jsonl", dir=tmp_path / "runs")
    options = ExporterOptions(run_settings.dir, run_settings.project, None, "all", True, run_settings.routes)
    sink = Sink(SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0"),
                exporter_factory(run_settings.exporters, options)).start()
    try:
        sender = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{sink.http_port}/v1/metrics", timeout=5)
        for rank in (0, 1):
            reader = InMemoryMetricReader()
            mp = MeterProvider(metric_readers=[reader], resource=Resource.create(
                {"train.run.id": "s", "train.rank": rank, "train.world_size": 2}))
            meter = mp.get_meter("t")
            gauges = {n: meter.create_gauge(n) for n in ("train/loss", "eval/acc", "train.step.duration_s")}
            for step in range(10):
                for gauge in gauges.values():
                    gauge.set(rank * 100 + step, {"train.step": step})
            sender.export(reader.get_metrics_data())
            mp.shutdown()
        assert sink.flush(10)
    finally:
        sink.stop()
    runs = tmp_path / "runs" / "s"
    tb = tb_scalars(runs)  # rank 0 only: no rank<N> subfolders
    assert tb == {tag: [(s, float(s)) for s in (0, 3, 6, 9)] for tag in ("train/loss", "train/step_duration_s")}
    assert len(list(runs.glob("**/events.out.tfevents.*"))) == 1
    for rank in (0, 1):  # JSONL has no route: every series, every step, wire names
        rows = [r for r in read_jsonl(jsonl_path(tmp_path / "runs", "s", rank)) if r["type"] == "metric"]
        assert {r["name"] for r in rows} == {"train/loss", "eval/acc", "train.step.duration_s"}
        assert len(rows) == 30


def test_log_records_are_routed_by_logger_name_only(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSONL gets the `job` loggers but `job.noisy`, the Chrome trace none (`off`, by keyword); a route on metric
    names and `_EVERY` pick no log records: every step's records still reach JSONL."""
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl
    from otel_train.trace_merge import load_trace

    monkeypatch.setenv("OTEL_TRAIN_JSONL_LOGS", "job*, !job.noisy")
    monkeypatch.setenv("OTEL_TRAIN_JSONL_INCLUDE", "train/*")
    monkeypatch.setenv("OTEL_TRAIN_JSONL_EVERY", "2")
    ot.init(exporters=["jsonl", "chrome_trace"], dir=run_dir, run_id="logs", run_name="logs",
            routes={"chrome_trace": ot.Route(logs="off")})
    for s in ot.steps(range(3)):
        ot.log({"train/loss": 1.0, "eval/acc": 0.5})
        with ot.span("forward"):
            for name in ("job", "job.data", "job.noisy", "other"):
                logging.getLogger(name).warning("%s at %d", name, s)
    ot.shutdown()
    rows = list(read_jsonl(jsonl_path(run_dir, "logs", 0)))
    assert [(r["logger"], r["step"]) for r in rows if r["type"] == "log"] == [
        (name, s) for s in range(3) for name in ("job", "job.data")]
    assert {r["name"] for r in rows if r["type"] == "metric" and not r["name"].startswith("otel_train")} == {
        "train/loss", "train.step.duration_s", "train.time_total_s", "train.iterations"}  # metrics as routed
    assert sorted({r["step"] for r in rows if r["type"] == "metric"}) == [0, 2]
    (trace,) = (run_dir / "logs" / "trace").glob("rank0*.trace.json")
    events = load_trace(trace)
    assert [e for e in events if e.get("cat") == "log"] == [] and any(e.get("ph") == "X" for e in events)


def test_log_routes_parse_and_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_WANDB_LOGS", "off")
    monkeypatch.setenv("OTEL_TRAIN_CLEARML_LOGS", "!transformers*")
    s = load_settings(routes={"jsonl": {"logs": ["job*"]}})
    assert (s.routes["wandb"].logs, s.routes["clearml"].logs, s.routes["jsonl"].logs) == (
        (), ("!transformers*",), ("job*",))
    assert load_settings(routes={"wandb": ot.Route(logs="*")}).routes["wandb"].logs == ("*",)  # keyword wins
