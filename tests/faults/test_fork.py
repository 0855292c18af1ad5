"""`os.fork()` in the middle of a step: the parent's points are intact, the child's reach the run as documented.

A forked child sends through its own connection to the exporter process (`otel_train.ship.workers`): its
metrics are `name{worker=<pid>}`, at the `step=` given, else at the run's latest step as the exporter
process sees it when the child's data arrives (the step before the fork's, or a later one when the
data arrives after the parent moved on); its spans sit on the track `worker <pid> (pid <pid>)`,
without a step (the step the parent was in is not inherited). The child never writes into the parent's
connection or files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from faultkit import SERIES, expected, jsonl_points, jsonl_spans, tb_points, value

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl

STEPS, FORK_AT = 12, (3, 8)


def test_fork_in_the_middle_of_a_step(tmp_path: Path) -> None:
    ot.init(exporters=["jsonl", "tensorboard"], dir=tmp_path, run_id="fork", run_name="fork")
    children: dict[int, int] = {}
    try:
        for s in range(STEPS):
            if s in FORK_AT:
                assert ot.flush(timeout_s=30)  # the exporter process has seen step s-1 end, not s
            with ot.step(s), ot.span("parent_work"):
                if s in FORK_AT:
                    pid = os.fork()
                    if pid == 0:  # the child, inside the parent's step and span
                        code = 1
                        try:
                            ot.log({"data/x": 100.0 + s}, step=s)
                            ot.log({"data/y": 200.0 + s})
                            with ot.span("child_work"):
                                pass
                            ot.flush()
                            code = 0
                        finally:
                            os._exit(code)
                    _, status = os.waitpid(pid, 0)
                    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
                    children[s] = pid
                ot.log({tag: value(tag, s) for tag in SERIES})
    finally:
        ot.shutdown()
    # The parent's points, exactly once, in both backends; its spans too.
    points = jsonl_points(tmp_path, "fork")
    assert len(points) == len(set(points)) and set(points) == expected(range(STEPS))
    assert sorted(tb_points(tmp_path / "fork")) == sorted(expected(range(STEPS), as_f32=True))
    spans = jsonl_spans(tmp_path, "fork")
    assert sorted(sp["step"] for sp in spans if sp["name"] == "parent_work") == list(range(STEPS))
    # The children's points: exactly these, under their own series.
    rows = [r for r in read_jsonl(jsonl_path(tmp_path, "fork", 0)) if r["type"] == "metric" and r["tag"].startswith("data/")]
    assert {(r["tag"], r["step"], r["value"]) for r in rows if r["name"] == "data/x"} == {
        (f"data/x{{worker={pid}}}", s, 100.0 + s) for s, pid in children.items()}
    stamped = {r["tag"]: (r["step"], r["value"]) for r in rows if r["name"] == "data/y"}
    assert len(stamped) == len(rows) - len(children) == len(children)  # each once
    for s, pid in children.items():
        step, val = stamped[f"data/y{{worker={pid}}}"]
        assert val == 200.0 + s and s - 1 <= step < STEPS
    child_spans = [sp for sp in spans if sp["name"] == "child_work"]
    assert sorted(sp["thread_name"] for sp in child_spans) == sorted(f"worker {p} (pid {p})" for p in children.values())
    assert all(sp["step"] is None and sp["attributes"] == {"worker": sp["thread_id"]} for sp in child_spans)


def _pending_then_fork(tmp_path: Path, start_child: Any) -> list[tuple[str, int, float]]:
    """20 steps logged and left uncollected (no window yet), then a child forked: the child collects, records a raw
    OTel counter and flushes what its reader holds; the parent then logs 5 more steps and shuts down."""
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.exporters.jsonl import JsonlExporter

    obj = JsonlExporter(ExporterOptions(directory=tmp_path / "object"))  # an exporter object passed to init
    session = ot.init(exporters=["jsonl", obj], dir=tmp_path, run_id="pend", run_name="pend", export_every=10_000,
                      export_interval_s=3600)
    counter = ot.get_meter().create_counter("raw")
    for s in range(20):
        with ot.step(s):
            ot.log({tag: value(tag, s) for tag in SERIES})
            counter.add(1)
    start_child(session, counter)
    for s in range(20, 25):
        with ot.step(s):
            ot.log({tag: value(tag, s) for tag in SERIES})
    ot.shutdown()
    return jsonl_points(tmp_path, "pend") + [(f"object:{t}", s, v) for t, s, v in jsonl_points(tmp_path / "object",
                                                                                                "pend")]


def _in_child(session: Any, counter: Any) -> None:
    session.reader.force_flush(10_000)  # what its interval or a step end would do later in a long-lived child
    counter.add(5)
    session.reader.force_flush(10_000)


def _check_parent_rows_once(points: list[tuple[str, int, float]], tmp_path: Path) -> None:
    ours = [(t, s, v) for t, s, v in points if not t.startswith("object:")]
    objs = [(t.removeprefix("object:"), s, v) for t, s, v in points if t.startswith("object:")]
    for landed in (ours, objs):
        assert sorted(landed) == sorted(expected(range(25))), "a step written twice or missing"
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    raw = [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path, "pend", 0)) if r.get("name") == "raw"]
    assert raw == [(s, float(s + 1)) for s in range(20)]  # the parent's counter, once per step; none of the child's


def test_forked_child_never_exports_the_parents_pending_rows(tmp_path: Path, monkeypatch: Any) -> None:
    """In-process backends (`OTEL_TRAIN_EXPORT_PROCESS=off`) and an exporter object: a child forked while 20
    steps wait uncollected starts with empty buffers, and exports nothing through the parent's backends."""
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "off")

    def fork(session: Any, counter: Any) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _in_child(session, counter)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

    _check_parent_rows_once(_pending_then_fork(tmp_path, fork), tmp_path)


def test_multiprocessing_fork_child_never_exports_the_parents_pending_rows(tmp_path: Path, monkeypatch: Any) -> None:
    import multiprocessing

    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "off")

    def start(session: Any, counter: Any) -> None:
        proc = multiprocessing.get_context("fork").Process(target=_in_child, args=(session, counter))
        proc.start()
        proc.join(timeout=60)
        assert proc.exitcode == 0

    _check_parent_rows_once(_pending_then_fork(tmp_path, start), tmp_path)
