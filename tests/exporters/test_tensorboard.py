"""TensorBoard exporter: read back with TensorBoard's own reader, and once through a real server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from backendkit import approx_points
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import otel_train as ot
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.tensorboard import TensorBoardExporter
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow
from otel_train.vocab.run_identity import RunInfo


def _scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """Every (step, value) of `tag` in file order: a step written twice shows twice."""
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_values_at_steps_through_init(run_dir: Path) -> None:
    ot.init(exporters="tensorboard", dir=run_dir, run_name="tb-run", export_every=3)
    meter = ot.get_meter()
    seen = meter.create_counter("train/samples")
    for i in ot.steps(range(10)):
        ot.log({"train/loss": 10.0 - i, "eval/acc": i / 10})
        seen.add(32, {"train.step": i})
    ot.shutdown()
    path = run_dir / "tb-run"
    assert _scalars(path, "train/loss") == [(i, 10.0 - i) for i in range(10)]
    assert _scalars(path, "eval/acc") == approx_points([(i, i / 10) for i in range(10)])
    assert _scalars(path, "train/samples") == [(i, 32.0 * (i + 1)) for i in range(10)]  # a running total


def test_histograms_and_suffix_tags(tmp_path: Path) -> None:
    run = RunInfo("r", "hist")
    rows = [MetricRow(run, 4, "eval/acc", "eval/acc{split=val}", 0.75, "gauge", 1_000_000_000)]
    hist = HistogramRow(run, 4, "grad/norm", "grad/norm", 6, 21.0, 1.0, 6.0, (2.0, 4.0), (1, 2, 3), 1_000_000_000)
    with TensorBoardExporter(ExporterOptions(directory=tmp_path)) as tb:
        tb.export_window(Window(rows, [hist]))
    acc = EventAccumulator(str(tmp_path / "hist"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/acc{split=val}")] == [(4, 0.75)]
    (h,) = acc.Histograms("grad/norm")
    assert h.step == 4
    assert (h.histogram_value.num, h.histogram_value.sum, h.histogram_value.min, h.histogram_value.max) == (
        6, 21.0, 1.0, 6.0)
    assert list(h.histogram_value.bucket) == [1, 2, 3]
    assert list(h.histogram_value.bucket_limit) == [2.0, 4.0, 6.0]


def test_hparams_are_written_for_the_hparams_plugin(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import metadata

    options = ExporterOptions(directory=tmp_path, hparams={"lr": 0.01, "optim": {"name": "adam"}, "amp": True})
    with TensorBoardExporter(options) as tb:
        tb.export_window(Window([MetricRow(RunInfo("r", "hp"), 0, "loss", "loss", 1.0, "gauge", 0)]))
    acc = EventAccumulator(str(tmp_path / "hp"))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    info = metadata.parse_session_start_info_plugin_data(content)
    assert info.hparams["lr"].number_value == 0.01
    assert info.hparams["optim.name"].string_value == "adam"
    assert info.hparams["amp"].bool_value is True


def test_rank_subfolders_when_all_ranks_export(tmp_path: Path) -> None:
    options = ExporterOptions(directory=tmp_path, ranks="all")
    with TensorBoardExporter(options) as tb:
        rows = [MetricRow(RunInfo("r", "ddp", rank=k, world_size=2), 0, "loss", "loss", float(k), "gauge", 0)
                for k in range(2)]
        tb.export_window(Window(rows))
    assert _scalars(tmp_path / "ddp" / "rank0", "loss") == [(0, 0.0)]
    assert _scalars(tmp_path / "ddp" / "rank1", "loss") == [(0, 1.0)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("load_fast", ["false", "true"], ids=["python-reader", "rust-data-server"])
def test_a_real_tensorboard_server_serves_the_curve(run_dir: Path, tmp_path: Path, load_fast: str) -> None:
    """Both of TensorBoard's readers (Python, and the Rust data server it uses by default) read our
    events, whose summaries are assembled from cached per-tag encodings."""
    ot.init(exporters="tensorboard", dir=run_dir, run_name="served")
    for i in ot.steps(range(5)):
        ot.log({"train/loss": 1.0 / (i + 1), "train/lr": 0.1})
    ot.shutdown()
    port = _free_port()
    log = (tmp_path / "tb.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(run_dir), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", load_fast],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        query = urllib.parse.urlencode({"run": "served", "tag": "train/loss"})
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
        deadline = time.monotonic() + 60
        data = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "tb.log").read_text()
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    data = json.load(resp)
                if data:
                    break
            except OSError:
                pass
            time.sleep(0.25)
        assert data is not None, (tmp_path / "tb.log").read_text()
        assert [(step, round(value, 6)) for _, step, value in data] == [
            (i, round(1.0 / (i + 1), 6)) for i in range(5)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_records_are_framed_as_tensorboards_own_writer_frames_them() -> None:
    import os

    from tensorboard.summary.writer.record_writer import RecordWriter

    from otel_train.exporters.tensorboard import frame_record

    class Collect:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

    for size in (0, 1, 7, 64, 1000, 70_000):
        record = os.urandom(size)
        theirs = Collect()
        RecordWriter(theirs).write(record)
        assert frame_record(record) == theirs.data


def test_writing_does_not_import_tensorboards_summary_package(tmp_path: Path) -> None:
    """Its `tensorboard.summary` (and the TensorFlow stub, NumPy, fsspec) costs most of the backend's start. The
    HParams names written here are the plugin's own."""
    import subprocess
    import sys

    from tensorboard.plugins.hparams import metadata

    from otel_train.exporters import tensorboard

    assert (tensorboard._HPARAMS_PLUGIN, tensorboard._HPARAMS_DATA_VERSION, tensorboard._HPARAMS_SESSION_START_TAG) \
        == (metadata.PLUGIN_NAME, metadata.PLUGIN_DATA_VERSION, metadata.SESSION_START_INFO_TAG)
    code = ("import sys\n"
            "from otel_train.exporters.base import Window\n"
            "from otel_train.exporters.tensorboard import TensorBoardExporter\n"
            "from otel_train.config.exporter_options import ExporterOptions\n"
            "from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow\n"
            "from otel_train.vocab.run_identity import RunInfo\n"
            "run = RunInfo('r1', 'demo')\n"
            "with TensorBoardExporter(ExporterOptions(directory=sys.argv[1], hparams={'lr': 0.1})) as tb:\n"
            "    assert tb.export_window(Window([MetricRow(run, 0, 'loss', 'loss', 1.5, 'gauge', 0)]))\n"
            "print(sorted(m for m in ('tensorboard.summary', 'numpy', 'fsspec') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]"
    assert _scalars(tmp_path / "demo", "loss") == [(0, 1.5)]


def test_values_beyond_float32_are_infinite_like_protobufs(tmp_path: Path) -> None:
    run = RunInfo("r", "big")
    rows = [MetricRow(run, i, "x", "x", v, "gauge", 0) for i, v in enumerate((1e300, -1e300, 3.0e38, float("nan")))]
    with TensorBoardExporter(ExporterOptions(directory=tmp_path)) as tb:
        assert tb.export_window(Window(rows))
    assert [s for s, _ in _scalars(tmp_path / "big", "x")] == [0, 1, 2, 3]
    got = dict(_scalars(tmp_path / "big", "x"))
    assert got[0] == float("inf") and got[1] == float("-inf")
    assert got[2] == pytest.approx(3.0e38, rel=1e-6)
    assert got[3] != got[3]  # NaN


def test_a_failed_append_leaves_no_partial_record_and_the_retry_writes_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk error halfway through a window's append: the file is cut back to its last whole record,
    the exporter retries the window later, and every step is then in the file exactly once."""
    import errno
    import os

    from otel_train.ship import file_append

    run = RunInfo("r", "disk")
    failing = {"on": False}

    def half_then_full(fd: int, data: Any) -> int:  # what the kernel does on a full disk
        if not failing["on"]:
            return os.write(fd, data)
        if len(data) > 1:
            return os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_append, "_write", half_then_full)
    with TensorBoardExporter(ExporterOptions(directory=tmp_path)) as tb:
        assert tb.export_window(Window([MetricRow(run, 0, "loss", "loss", 1.0, "gauge", 0)]))
        (events,) = (tmp_path / "disk").iterdir()
        size = events.stat().st_size
        failing["on"] = True
        assert not tb.export_window(Window([MetricRow(run, s, "loss", "loss", float(s), "gauge", 0)
                                            for s in (1, 2)]))
        assert events.stat().st_size == size  # the half-written window was cut off
        failing["on"] = False
        tb.window_writer._retry_at = 0.0  # skip the backoff wait
        assert tb.export_window(Window([MetricRow(run, 3, "loss", "loss", 3.0, "gauge", 0)]))
    acc = EventAccumulator(str(tmp_path / "disk"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.0), (1, 1.0), (2, 2.0), (3, 3.0)]


def _in_file_order(path: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]  # a list, in the order the file holds them


def test_each_series_is_written_in_step_order_and_a_step_going_back_is_skipped(tmp_path: Path) -> None:
    """One event holds every series of a step: a window whose rows start with another series' later step must still
    write each series in step order (TensorBoard's data server takes a step going back for a restart and hides the
    later steps). A row going back in its own series is skipped and counted, never written."""
    run = RunInfo("r", "order")

    def row(step: int, tag: str, value: float) -> MetricRow:
        return MetricRow(run, step, tag, tag, value, "gauge", 1_000 + step)

    with TensorBoardExporter(ExporterOptions(directory=tmp_path)) as tb:
        assert tb.export_window(Window([row(1, "b", 1.0), row(0, "a", 0.5), row(1, "a", 1.5), row(2, "b", 2.0)]))
        assert tb.export_window(Window([row(3, "a", 3.5), row(2, "a", 99.0), row(4, "a", 4.5)]))
        counts = tb.step_order.counts()
    assert _in_file_order(tmp_path / "order", "a") == [(0, 0.5), (1, 1.5), (3, 3.5), (4, 4.5)]
    assert _in_file_order(tmp_path / "order", "b") == [(1, 1.0), (2, 2.0)]
    assert counts == {"backwards": 1, "dropped": 1}


def test_log_records_are_text_at_their_steps(tmp_path: Path) -> None:
    """The Text plugin's `logs` tag: one Markdown text per step, read back with TensorBoard's own reader; a record
    outside any step at the run's latest, a late one never before a step already written, other ranks left out."""
    run, rank1 = RunInfo("r1", "demo"), RunInfo("r1", "demo", rank=1, world_size=2)
    with TensorBoardExporter(ExporterOptions(directory=tmp_path)) as tb:
        assert tb.export_window(Window(logs=[
            LogRow(run, 2, 0, 13, "WARNING", "loss spiked", "job"),
            LogRow(run, 2, 1, 17, "ERROR", "bad batch", "job", {"exception.stacktrace": "Traceback (x)"}),
            LogRow(run, 5, 2, 13, "WARNING", "slow step", "job"),
            LogRow(rank1, 3, 3, 13, "WARNING", "rank 1 (metrics of rank 0 only)", "job"),
        ]))
        assert tb.export_window(Window(logs=[LogRow(run, None, 4, 21, "FATAL", "uncaught", "otel_train.uncaught"),
                                             LogRow(run, 4, 5, 13, "WARNING", "late", "job")]))
    acc = EventAccumulator(str(tmp_path / "demo"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("logs")]
    assert texts == [
        (2, "**WARNING** job: loss spiked\n\n**ERROR** job: bad batch\n\n```\nTraceback (x)\n```"),
        (5, "**WARNING** job: slow step"),
        (5, "**FATAL** otel_train.uncaught: uncaught\n\n**WARNING** job: late"),
    ]
    assert acc.SummaryMetadata("logs").plugin_data.plugin_name == "text"
