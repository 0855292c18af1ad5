"""A session the user started before the framework said where this process runs: adopted while nothing was
exported (leaving no folder of the first run), an error naming the fix once data went out. (Lightning DDP on 2 real
processes: test_lightning_ddp.)"""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.config.settings import load_settings
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.integrations._session import OwnedSession
from otel_train.session.placement import resolve_run_id
from otel_train.session.runtime import Session


def test_nothing_exported_yet_the_session_moves_to_the_frameworks_rank(tmp_path: Path) -> None:
    first = ot.init(exporters="jsonl", dir=tmp_path, run_name="r", config={"lr": 0.1})
    assert OwnedSession().ensure(rank=1, local_rank=1, world_size=2) is False  # the user's session, not ours
    adopted = ot.current_session()
    assert isinstance(adopted, Session)
    assert first.closed and adopted is not first
    assert (adopted.run.rank, adopted.run.local_rank, adopted.run.world_size) == (1, 1, 2)
    assert adopted.settings.run_name == "r" and adopted.settings.config == {"lr": 0.1}  # same settings


def test_the_first_run_of_an_adopted_session_leaves_no_folder(tmp_path: Path) -> None:
    ot.init(exporters="jsonl", dir=tmp_path)  # a run of its own (no job yet): a time-based run id
    first = ot.current_session()
    assert isinstance(first, Session)
    assert [p.name for p in tmp_path.iterdir()] == [first.run.run_id]  # init() made the folder
    moved = ot.set_placement(rank=0, world_size=2)
    assert isinstance(moved, Session) and moved is not first and moved.run.world_size == 2
    assert moved.run.run_id != first.run.run_id
    ot.log({"x": 1.0}, step=0)
    ot.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == [moved.run.run_id]  # only the run that holds data
    assert [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path, moved.run.run_id, 0))
            if r["type"] == "metric" and r["tag"] == "x"] == [(0, 1.0)]


def test_a_first_run_that_holds_data_keeps_its_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ot.init(exporters="jsonl", dir=tmp_path)
    first = ot.current_session()
    assert isinstance(first, Session)
    ot.log({"x": 1.0}, step=0)
    assert ot.flush()
    with caplog.at_level(logging.ERROR, logger="otel_train"):
        assert ot.set_placement(rank=0, world_size=2) is first  # data went out: it stays (and says so)
    ot.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == [first.run.run_id]
    assert [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path, first.run.run_id, 0))
            if r["type"] == "metric" and r["tag"] == "x"] == [(0, 1.0)]


@pytest.mark.parametrize(("env", "rank"), [
    ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, 1),  # Lightning's DDP launcher re-running the script
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "4"}, 1),
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, 3),  # RANK wins
    ({"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4"}, 0),  # another node: unknown without RANK
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "1"}, 0),  # not a rank of this world
    ({}, 0),
])
def test_without_rank_local_rank_on_the_first_node_is_the_rank(tmp_path: Path, env: dict[str, str], rank: int) -> None:
    from otel_train.session.runtime import start

    session = start(load_settings({"OTEL_TRAIN_EXPORTERS": "jsonl", "OTEL_TRAIN_DIR": str(tmp_path)}), env=env)
    try:
        assert isinstance(session, Session) and session.run.rank == rank
    finally:
        session.shutdown()


def test_values_logged_before_the_move_keep_their_run_and_say_so(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    ot.init(exporters="jsonl", dir=tmp_path)
    first = ot.current_session()
    assert isinstance(first, Session)
    ot.log({"x": 1.0}, step=0)  # not exported yet: the move goes ahead, the value goes out with the first session
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        moved = ot.set_placement(rank=0, world_size=2)
    assert isinstance(moved, Session) and moved is not first
    ot.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.run.run_id, moved.run.run_id])
    assert [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path, first.run.run_id, 0))
            if r["type"] == "metric" and r["tag"] == "x"] == [(0, 1.0)]
    expected = (f"otel-train: values logged before the framework set the rank are in run {first.run.run_id!r} "
                "(rank 0), not in the job's run")
    assert [r.getMessage() for r in caplog.records if "before the framework set the rank" in r.getMessage()] == [expected]


def test_after_an_export_it_is_an_error_naming_the_fix(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    session = ot.init(exporters="jsonl", dir=tmp_path, run_name="r")
    ot.log({"x": 1.0}, step=0)
    assert ot.flush()
    with caplog.at_level(logging.ERROR, logger="otel_train"):
        OwnedSession().ensure(rank=1, world_size=2)
    assert ot.current_session() is session and not session.closed and session.run.rank == 0
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "rank=1" in record.getMessage() and "otel_train.init() after the framework" in record.getMessage()


def _child_run_id(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    queue.put(resolve_run_id(load_settings({}), env))


def test_forked_ranks_share_the_run_id_of_their_launcher_and_another_job_on_the_same_port_does_not() -> None:
    ctx = multiprocessing.get_context("fork")  # `multiprocessing.parent_process()` is set as under spawn
    queue = ctx.Queue()
    children = [ctx.Process(target=_child_run_id, args=(queue,)) for _ in range(2)]
    for c in children:
        c.start()
    ids = [queue.get(timeout=60) for _ in children]
    for c in children:
        c.join(timeout=60)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    here = resolve_run_id(load_settings({}), env)  # the parent as a rank too (Lightning's rank 0 starts the others)
    code = ("from otel_train.config.settings import load_settings; from otel_train.session.placement import resolve_run_id; "
            f"print(resolve_run_id(load_settings({{}}), {env!r}))")
    other_job = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               timeout=120).stdout.strip()
    assert ids[0] == ids[1] == here  # the ranks of one job share one run
    assert other_job.startswith("job-") and other_job != here  # another job, same address and port: another run
