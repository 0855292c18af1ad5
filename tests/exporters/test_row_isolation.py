"""One bad row never costs a window, and a retried window never writes a row twice: real TensorBoard (read
back with its own reader), JSONL and an offline W&B run (its `.wandb` file), with fault injection.

Every read-back is a list of (step, value) in file order, so a row written twice fails the test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from backendkit import isolated_wandb_env, wandb_files, wandb_records

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import RowExporter, Window
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("iso-run", "iso")
LOSS = [(s, s * 0.25) for s in range(5)]  # exact in float32 (TensorBoard)


def metric(step: Any, tag: str, value: Any, run: RunInfo = RUN, **attrs: Any) -> MetricRow:
    return MetricRow(run, step, tag, tag, value, "gauge", 1_000 + (step if isinstance(step, int) else 0), attrs)


def loss_rows(run: RunInfo = RUN) -> list[MetricRow]:
    return [metric(s, "train/loss", v, run) for s, v in LOSS]


# -- one reader per backend: tag -> [(step, value)] in file order -----------------------------------
def tb_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def jsonl_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_jsonl(jsonl_path(folder, RUN.run_name, 0)):
        if r["type"] == "metric":
            out.setdefault(r["tag"], []).append((r["step"], r["value"]))
    return out


def wandb_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    import json

    out: dict[str, list[tuple[int, float]]] = {}
    for path in wandb_files(folder, RUN.run_name, RUN.run_id):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                for key, v in items.items():
                    if not key.startswith("_"):
                        out.setdefault(key, []).append((items["_step"], v))
    return out


def _tensorboard(d: Path) -> tuple[RowExporter, Callable[[], dict[str, list[tuple[int, float]]]]]:
    from otel_train.exporters.tensorboard import TensorBoardExporter

    return TensorBoardExporter(ExporterOptions(directory=d)), lambda: tb_points(d / RUN.run_name)


def _jsonl(d: Path) -> tuple[RowExporter, Callable[[], dict[str, list[tuple[int, float]]]]]:
    from otel_train.exporters.jsonl import JsonlExporter

    return JsonlExporter(ExporterOptions(directory=d)), lambda: jsonl_points(d)


def _wandb(d: Path) -> tuple[RowExporter, Callable[[], dict[str, list[tuple[int, float]]]]]:
    from otel_train.exporters.wandb import WandbExporter

    def read() -> dict[str, list[tuple[int, float]]]:
        import wandb

        wandb.teardown()  # the service writes the last records of the run file
        return wandb_points(d)

    return WandbExporter(ExporterOptions(directory=d, project="iso")), read


BACKENDS = {"tensorboard": _tensorboard, "jsonl": _jsonl, "wandb": _wandb}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, RowExporter, Callable[[], Any]]]:
    isolated_wandb_env(monkeypatch, tmp_path / "wandb-home")
    exporter, read = BACKENDS[request.param](tmp_path / "runs")
    yield request.param, exporter, read
    exporter.shutdown()


def _warnings(caplog: pytest.LogCaptureFixture, series: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and f"`{series}`" in r.getMessage()]


def test_rows_a_backend_cannot_write_are_skipped_counted_and_warned_once(
        backend: tuple[str, RowExporter, Callable[[], Any]], caplog: pytest.LogCaptureFixture) -> None:
    """A float step (the TensorBoard TypeError of the issue) and a value that is no number: those rows only."""
    _, exporter, read = backend
    bad = [metric(1.0, "bad/step", 3.0), metric(2, "bad/value", "high"), metric(3, "bad/value", object())]
    with caplog.at_level(logging.WARNING):
        assert exporter.export_window(Window([*loss_rows()[:3], *bad, *loss_rows()[3:]]))
    exporter.shutdown()
    points = read()
    assert points["train/loss"] == LOSS  # every good row, once, in order
    assert "bad/step" not in points and "bad/value" not in points
    assert exporter.rows_lost == {"bad_step": 1, "bad_value": 2}
    assert exporter.failures == 0 and exporter.dropped_windows == 0
    assert len(_warnings(caplog, "bad/step")) == 1 and len(_warnings(caplog, "bad/value")) == 1
    assert "bad value" in _warnings(caplog, "bad/value")[0]


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("cannot render")


def _poison(name: str, exporter: RowExporter, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], MetricRow]:
    """Rows that make this backend raise (fault injection), in the backend's own write."""
    if name == "tensorboard":
        real = exporter._value  # type: ignore[attr-defined]

        def value(tag: str) -> bytes:
            if tag == "poison":
                raise ValueError("bad tag")
            return bytes(real(tag))

        monkeypatch.setattr(exporter, "_value", value)
        return lambda step: metric(step, "poison", 1.0)
    if name == "jsonl":  # JSON renders odd attribute values with str(): this one raises
        return lambda step: metric(step, "poison", 1.0, blob=_Unprintable())
    from otel_train.exporters.wandb import WandbExporter

    real_payload = WandbExporter._payload

    def payload(rows: list[Any]) -> dict[str, Any]:
        if any(r.tag == "poison" for r in rows):
            raise ValueError("wandb rejects this key")
        return real_payload(rows)

    monkeypatch.setattr(WandbExporter, "_payload", staticmethod(payload))
    return lambda step: metric(step, "poison", 1.0)


def test_a_row_the_backend_refuses_costs_only_that_row(
        backend: tuple[str, RowExporter, Callable[[], Any]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    name, exporter, read = backend
    poison = _poison(name, exporter, monkeypatch)
    rows = loss_rows()
    with caplog.at_level(logging.WARNING):
        assert exporter.export_window(Window([*rows[:2], poison(2), *rows[2:]]))
        assert exporter.export_window(Window([metric(5, "train/loss", 0.5), poison(5)]))  # the window's last row
    exporter.shutdown()
    points = read()
    assert points["train/loss"] == [*LOSS, (5, 0.5)]  # the rest of each window, exactly once
    assert "poison" not in points
    assert exporter.rows_lost == {"refused": 2}
    warned = _warnings(caplog, "poison")
    assert len(warned) == 1 and "refused by the backend" in warned[0], warned


def test_a_retried_window_never_writes_a_row_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard, two ranks' files: rank 1's append fails once after rank 0's landed; the retry writes
    rank 1 only."""
    from otel_train.exporters import tensorboard

    ranks = [RunInfo("iso-run", "iso", rank=r, world_size=2) for r in (0, 1)]
    exporter = tensorboard.TensorBoardExporter(ExporterOptions(directory=tmp_path, ranks="all"))
    real_flush = tensorboard._EventFile.flush
    failed: list[Path] = []

    def flush(self: Any) -> None:
        if "rank1" in str(self.path) and self._records and not failed:
            failed.append(self.path)
            self._records.clear()
            raise OSError("disk hiccup")
        real_flush(self)

    monkeypatch.setattr(tensorboard._EventFile, "flush", flush)
    assert exporter.export_window(Window([*loss_rows(ranks[0]), *loss_rows(ranks[1])]))
    exporter.shutdown()
    assert failed and exporter.failures == 1 and exporter.rows_lost == {}
    for rank in (0, 1):
        assert tb_points(tmp_path / "iso" / f"rank{rank}")["train/loss"] == LOSS
