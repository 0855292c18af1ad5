"""`otel-train hangs RUN_DIR`: stuck ranks grouped by place, the odd ones out, stopped ranks; and the settings."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from otel_train.cli import main
from otel_train.config.settings import load_settings
from otel_train.errors import ConfigError
from otel_train.hangs.hang_file import hang_path, read_hang_files, write_hang_file
from otel_train.hangs.roll_call import take_roll_call

C10D = "torch/distributed/distributed_c10d.py:2501 in all_reduce"
LOAD = "train.py:41 in load_batch"


def rank_file(state: str, *, phase: str | None = None, frame: str | None = None, user: str | None = None,
              now: float, heartbeat_age_s: float = 0.0, waited_s: float = 212.0, world: int = 4) -> dict[str, Any]:
    latest = None
    if state == "stuck":
        latest = {"event.name": "train.hang", "state": "stuck", "time": now - heartbeat_age_s, "step": 50,
                  "phase": phase, "spans": ["train", phase], "waited_s": waited_s, "main_frame": frame,
                  "user_frame": user, "native": True, "threads": []}
    return {"rank": 0, "world_size": world, "host": "node7", "state": state, "step": 50,
            "heartbeat_time": now - heartbeat_age_s, "heartbeat_s": 5.0, "latest": latest,
            "history": [latest] if latest else []}


def write_run(run_dir: Path, files: dict[int, dict[str, Any]]) -> None:
    for rank, content in files.items():
        write_hang_file(hang_path(run_dir, rank), {**content, "rank": rank})


def test_the_odd_rank_out_is_named_with_its_frame_and_the_others_common_frame(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now = time.time()
    write_run(tmp_path, {r: rank_file("stuck", phase="backward", frame=C10D, user="train.py:88 in main", now=now)
                         for r in (0, 2, 3)})
    write_run(tmp_path, {1: rank_file("stuck", phase="data", frame=LOAD, user=LOAD, now=now, waited_s=215.0)})
    assert main(["hangs", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"ranks [0, 2, 3] have waited 212 s in `backward` at `{C10D}` (from `train.py:88 in main`); "
                      f"rank [1] has waited 215 s in `data` at `{LOAD}`: rank 1 is where to look")
    assert out[1] == f"  ranks [0, 2, 3]: step 50, in `backward` at `{C10D}` (from `train.py:88 in main`) in native code"
    assert main(["hangs", "--json", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["suspects"] == [1] and [g["ranks"] for g in report["groups"]] == [[0, 2, 3], [1]]


def test_a_rank_that_stopped_writing_is_named_from_its_last_record(tmp_path: Path) -> None:
    now = 10_000.0
    files = {r: rank_file("stuck", phase="backward", frame=C10D, now=now) for r in (0, 1, 2)}
    files[3] = rank_file("stuck", phase="backward", frame=C10D, now=now, heartbeat_age_s=95.0)
    call = take_roll_call(files, now=now)
    assert call.stuck and call.suspects() == [3]
    assert [s.rank for s in call.silent] == [3] and call.groups[0].ranks == [0, 1, 2]
    assert call.verdict().endswith(f"rank [3] has sent nothing for 95 s (last record: in `backward` at `{C10D}`): "
                                   "rank 3 is where to look")
    assert "  rank [3]: possibly dead (host node7; its last heartbeat, 95 s ago, said stuck at step 50) (last record: " \
           f"in `backward` at `{C10D}`)" in call.text("run")


def test_a_run_with_no_stuck_rank_exits_0_and_ranks_without_a_file_are_listed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now = time.time()
    write_run(tmp_path, {0: rank_file("running", now=now), 1: rank_file("ended", now=now, heartbeat_age_s=900.0)})
    assert main(["hangs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "no rank is stuck (1 running, 1 ended, 2 without a hang file)\n"
    assert sorted(read_hang_files(tmp_path)) == [0, 1]


def test_ranks_still_running_while_the_others_are_stuck_are_where_to_look() -> None:
    now = 500.0
    files = {0: rank_file("stuck", phase="backward", frame=C10D, now=now, world=2), 1: rank_file("running", now=now)}
    call = take_roll_call(files, now=now)
    assert call.suspects() == [1]
    assert call.verdict().endswith("rank [1] is not stuck: rank 1 is where to look")


def test_a_folder_without_hang_files_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hangs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("otel-train: error: hangs: no hang files under") and err.count("\n") == 1


@pytest.mark.parametrize(("env", "expected"), [
    ({"OTEL_TRAIN_HANG_AFTER_S": "-1"}, "OTEL_TRAIN_HANG_AFTER_S: '-1' is not allowed; expected a finite number >= 0"),
    ({"OTEL_TRAIN_HANG_AFTER_S": "soon"}, "OTEL_TRAIN_HANG_AFTER_S: 'soon' is not a number"),
    ({"OTEL_TRAIN_HANG_FACTOR": "0.5"}, "OTEL_TRAIN_HANG_FACTOR: '0.5' is not allowed; expected a finite multiple >= 1"),
    ({"OTEL_TRAIN_HANG_FACTOR": "ten"}, "OTEL_TRAIN_HANG_FACTOR: 'ten' is not a number"),
])
def test_bad_hang_settings_fail_in_one_line(env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_hang_settings_default_and_parse() -> None:
    assert (load_settings({}).hang_after_s, load_settings({}).hang_factor) == (60.0, 10.0)
    s = load_settings({"OTEL_TRAIN_HANG_AFTER_S": "0", "OTEL_TRAIN_HANG_FACTOR": "4"})
    assert (s.hang_after_s, s.hang_factor) == (0.0, 4.0)


def test_after_a_job_that_ended_while_stuck_the_odd_rank_out_is_still_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank ended while stuck (the launcher stopped the job): nothing is stuck now (exit 0), and the sentence
    still says where each rank was and which one to look at."""
    now = time.time()
    files = {r: rank_file("stuck", phase="backward", frame=C10D, user="train.py:88 in main", now=now)
             for r in (0, 2, 3)}
    files[1] = rank_file("stuck", phase="data", frame=LOAD, user=LOAD, now=now, waited_s=215.0)
    for content in files.values():
        content["latest"] = {**content["latest"], "state": "ended"}
        content["state"] = "ended"
    write_run(tmp_path, files)
    assert main(["hangs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"no rank is stuck (0 running, 4 ended); the job ended while ranks [0, 2, 3] had waited 212 s "
                      f"in `backward` at `{C10D}` (from `train.py:88 in main`); rank [1] had waited 215 s in `data` "
                      f"at `{LOAD}`: rank 1 is where to look")
    assert out[2] == f"  rank [1]: ended while stuck at step 50, in `data` at `{LOAD}` in native code"
    assert main(["hangs", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["suspects"] == [1] and [g["ranks"] for g in report["ended_stuck"]] == [[0, 2, 3], [1]]
