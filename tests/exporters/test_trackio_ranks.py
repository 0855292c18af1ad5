"""Trackio with several ranks started at once (`OTEL_TRAIN_RANKS=all`): one run record, every rank's points once.

Real training processes (RANK/WORLD_SIZE as a launcher sets them) wait for one start signal, then each opens
the run from its exporter process at the same moment, in Trackio's real local store. Trackio keys a run record by
a run id it makes up (a random one unless it resumes a record it finds) and creates the record with its first
write, so ranks starting together made two records of one name: a reader by name saw one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

STEPS = 12
WORLD = 3
RUN_ID = "trackio-ranks"
PROJECT = "otel-trackio-ranks"
SCRIPT = textwrap.dedent("""
    import os, sys, time
    go = sys.argv[1]
    import otel_train as ot
    import trackio  # noqa: F401  (imported before the start, as a warm job has it)
    while not os.path.exists(go):
        time.sleep(0.002)
    ot.init()
    rank = int(os.environ["RANK"])
    for s in ot.steps(range({steps})):
        ot.log({{"train/loss": s + rank / 10}})
    ot.shutdown()
""")

READ = textwrap.dedent("""
    import json, sys
    from trackio.sqlite_storage import SQLiteStorage
    print(json.dumps({"runs": SQLiteStorage.get_run_records(sys.argv[1]),
                      "logs": SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])}, default=str))
""")


def _env(tmp_path: Path, rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_", "OTEL_"))}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), HOME=str(tmp_path / "home"),
               HF_HOME=str(tmp_path / "hf"), TRACKIO_DIR=str(tmp_path / "trackio"),
               OTEL_TRAIN_DIR=str(tmp_path / "runs"), OTEL_TRAIN_RUN_ID=RUN_ID, OTEL_TRAIN_RUN_NAME=RUN_ID,
               OTEL_TRAIN_PROJECT=PROJECT, OTEL_TRAIN_RANKS="all", OTEL_TRAIN_EXPORTERS="trackio",
               OTEL_TRAIN_EXPORT_EVERY="3",
               # the default 10 s hand-off can pass on a loaded host: the store is read once every rank is done
               OTEL_TRAIN_SHUTDOWN_TIMEOUT_S="120")
    return env


def test_ranks_starting_together_share_one_run_and_every_point_lands_once(tmp_path: Path) -> None:
    script, go = tmp_path / "rank.py", tmp_path / "go"
    script.write_text(SCRIPT.format(steps=STEPS))
    procs = [subprocess.Popen([sys.executable, str(script), str(go)], env=_env(tmp_path, rank),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    time.sleep(3)  # every interpreter up and waiting (not an assertion: only makes the race likely)
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "not written" not in err, err[-3000:]
        assert "shutdown timed out" not in err, err[-3000:]

    # Trackio reads TRACKIO_DIR at import: read the store from a process of its own.
    read = subprocess.run([sys.executable, "-c", READ, PROJECT, RUN_ID], env=_env(tmp_path, 0),
                          capture_output=True, text=True, timeout=120, check=True)
    held = json.loads(read.stdout.splitlines()[-1])
    assert [r["name"] for r in held["runs"]] == [RUN_ID], held["runs"]  # one record, not one per rank
    for rank in range(WORLD):
        key = "train/loss" + (f"{{rank={rank}}}" if rank else "")
        points = [(e["step"], e[key]) for e in held["logs"] if key in e]  # a list: a point held twice shows
        assert sorted(points) == [(s, s + rank / 10) for s in range(STEPS)], (rank, points)
