"""A value a child process logs without `step=` lands at the step the training process was in when the child
logged it (its latest step entered), in every backend: a child (fork and spawn) logs on the trainer's cue at
known steps while nothing is collected, and JSONL and TensorBoard's own loader are read back as lists."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import readback

from otel_train.exporters.jsonl import jsonl_path
from otel_train.vocab.run_paths import run_folder

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys
    import otel_train as ot

    def child(conn):
        while True:
            cue = conn.recv()
            if cue is None:
                break
            ot.log({"child/x": float(cue)})  # no step: the one the trainer is in now
            ot.flush()  # in a child: sends what it holds now
            conn.send("logged")

    if __name__ == "__main__":
        method, directory = sys.argv[1], sys.argv[2]
        ot.init(exporters="jsonl,tensorboard", dir=directory, run_name=method, run_id=method,
                export_every=1000, export_interval_s=3600)  # the exporter process sees no step until shutdown
        ours, theirs = mp.Pipe()
        proc = mp.get_context(method).Process(target=child, args=(theirs,))
        proc.start()
        for s in ot.steps(range(6)):
            ot.log({"loss": 1.0 / (s + 1)})
            if s in (2, 3, 5):
                ours.send(s)
                assert ours.recv() == "logged"
        ours.send(None)
        proc.join(60)
        ot.shutdown()
""")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_childs_value_without_a_step_lands_at_the_trainers_step(tmp_path: Path, method: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "runs"
    done = subprocess.run([sys.executable, str(script), method, str(directory)], capture_output=True, text=True,
                          timeout=300, check=False, env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    assert done.returncode == 0, done.stderr[-3000:]
    for points in (readback.jsonl(jsonl_path(directory, method, 0)), readback.tensorboard(run_folder(directory, method))):
        child = [p for p in points if p.name.startswith("child/x{worker=")]
        assert sorted((p.step, p.value) for p in child) == [(2, 2.0), (3, 3.0), (5, 5.0)], points
        assert len({p.name for p in child}) == 1


def test_a_forked_child_entering_steps_of_its_own_leaves_the_trainers_step_alone(tmp_path: Path) -> None:
    from otel_train.capture.step import step
    from otel_train.session.child_handoff import ChildHandOff
    from otel_train.ship.workers import open_step_cell, read_step, step_cell_path

    address = str(tmp_path / "workers.sock")
    handoff = ChildHandOff(address)
    try:
        with step(7):
            pid = os.fork()
            if pid == 0:  # the child: steps of its own
                try:
                    with step(99):
                        pass
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
            assert read_step(open_step_cell(step_cell_path(address))) == 7
    finally:
        handoff.release()
    assert not Path(step_cell_path(address)).exists()  # removed at shutdown
