"""One writer per rank of a run folder; the exporter process frees the terminal; rank gating of child values.

Real training processes (subprocesses) with the real TensorBoard/JSONL backends, read back as lists of
(step, value), so a value written twice or at the wrong run fails the test. A hanging W&B stand-in (imported
from disk by the exporter process) keeps an exporter process draining where a test needs one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from backendkit import alive, wait_exited
from fake_wandb import fake_wandb_env

from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.ship.spool import spool_dir

# One seed of a training job: init, wait until every other writer has init'ed too, then log 300 steps.
SEED = textwrap.dedent("""
    import json, os, sys, time
    import otel_train as ot
    cfg = json.loads(sys.argv[1])
    session = ot.init(exporters=cfg["exporters"], dir=cfg["dir"], run_id=cfg["run"], **cfg.get("kw", {}))
    print("RUN", session.run.run_id, flush=True)
    if session.export_process is not None:
        print("CHILD", session.export_process.pid, flush=True)
    open(cfg["ready"], "w").close()
    while not all(os.path.exists(p) for p in cfg["all_ready"]):
        time.sleep(0.01)
    for step in range(cfg["start"], cfg["start"] + cfg["steps"]):
        with ot.step(step):
            with ot.span("fwd"):
                ot.log({"loss": cfg["seed"] * 1000 + step})
    ot.shutdown()
""")

def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WANDB_", "RANK", "WORLD_SIZE"))}
    env.update(HOME=str(root / "home"), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _seed(root: Path, name: str, cfg: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    script = root / "seed.py"
    script.write_text(SEED)
    cfg = {"ready": str(root / f"{name}.ready"), "all_ready": [str(root / f"{name}.ready")], "start": 0, **cfg}
    return subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _jsonl(directory: Path, run: str, rank: int = 0, name: str = "loss") -> list[tuple[int, float]]:
    path = jsonl_path(directory, run, rank)
    if not path.exists():
        return []
    return [(r["step"], r["value"]) for r in read_jsonl(path) if r["type"] == "metric" and r["name"] == name]


def _tb(run_dir: Path, prefix: str = "loss") -> list[tuple[int, float]]:
    """TensorBoard's points of the tag `prefix`, or of every tag ``prefix{...}`` (a child's series)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t == prefix or t.startswith(prefix + "{")]
    return [(e.step, e.value) for tag in tags for e in acc.Scalars(tag)]


@pytest.mark.timeout(600)  # real processes under a 300 s limit of their own
def test_two_writers_with_one_run_id_get_distinct_runs(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    ready = [str(tmp_path / f"seed{s}.ready") for s in (1, 2)]
    procs = {seed: _seed(tmp_path, f"seed{seed}", {"exporters": "tensorboard,chrome_trace,jsonl", "dir": str(directory),
                                                   "run": "same", "seed": seed, "steps": 300,
                                                   "ready": ready[seed - 1], "all_ready": ready}, _env(tmp_path))
             for seed in (1, 2)}
    runs = {}
    for seed, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        runs[seed] = out.split("RUN ", 1)[1].split()[0]
        if runs[seed] != "same":  # the second writer says which run it writes instead
            assert "run 'same' rank 0 is already written by another process" in err, err[-3000:]
            assert "writes run 'same-2' instead" in err, err[-3000:]
    assert sorted(runs.values()) == ["same", "same-2"]
    for seed, run in runs.items():  # each writer's steps exactly once, in its own run, nothing of the other's
        want = [(step, float(seed * 1000 + step)) for step in range(300)]
        assert _jsonl(directory, run) == want
        assert sorted(_tb(directory / run)) == want
        spans = [r for r in read_jsonl(jsonl_path(directory, run, 0)) if r["type"] == "span" and r["name"] == "fwd"]
        assert sorted(r["step"] for r in spans) == list(range(300))


def test_elastic_restart_waits_for_the_draining_exporter_process_then_continues_the_run(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    base = {"exporters": "wandb,jsonl", "dir": str(directory), "run": "el", "seed": 0, "steps": 20,
            "kw": {"shutdown_timeout_s": 1}}
    # Attempt 1: W&B hangs, so its exporter process keeps draining (4 s) after the training process ends.
    first = _seed(tmp_path, "a1", base, _env(tmp_path, **fake_wandb_env(tmp_path, "hang"), OTEL_TRAIN_DRAIN_TIMEOUT_S="4"))
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    draining = int(out.split("CHILD ", 1)[1].split()[0])
    assert alive(draining)
    # Attempt 2 (torchrun restarted the job): same run id, W&B healthy now, steps 20..39.
    second = _seed(tmp_path, "a2", {**base, "start": 20}, _env(tmp_path, **fake_wandb_env(tmp_path, "record")))
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-3000:]
    assert "still drains" in err and "waiting up to" in err, err[-3000:]
    assert out.split("RUN ", 1)[1].split()[0] == "el"  # the same run, continued, not a mix and not a new run
    assert not alive(draining)
    want = [(step, float(step)) for step in range(40)]
    assert _jsonl(directory, "el") == want
    # What attempt 1's W&B never got was left in the spool; attempt 2's exporter process delivered it once.
    logged = [json.loads(x) for x in (tmp_path / "wandb-out" / "logged.jsonl").read_text().splitlines()]
    assert sorted((e["step"], e["loss"]) for e in logged if "loss" in e) == want


def test_captured_output_ends_when_the_training_process_exits(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    script = tmp_path / "seed.py"
    script.write_text(SEED)
    cfg = {"exporters": "wandb,jsonl", "dir": str(directory), "run": "tee", "seed": 0, "start": 0, "steps": 10,
           "kw": {"shutdown_timeout_s": 1}, "ready": str(tmp_path / "r"), "all_ready": [str(tmp_path / "r")]}
    # The drain (4 s) outlasts the trainer's exit (well under a second) by far: the exporter process is still
    # draining when `subprocess.run` returns, which is what this test needs to see.
    env = _env(tmp_path, **fake_wandb_env(tmp_path, "hang"), OTEL_TRAIN_DRAIN_TIMEOUT_S="4")
    done = subprocess.run([sys.executable, str(script), json.dumps(cfg)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # While the trainer lived, the exporter process's messages reached its logging (stderr) as before ...
    assert "shutdown timed out; data is durable in the spool" in done.stderr
    child = int(done.stdout.split("CHILD ", 1)[1].split()[0])
    # ... and `capture_output` did not wait for the draining exporter process: it still runs.
    assert alive(child)
    wait_exited(child, 60)
    log = (spool_dir(directory, "tee", 0) / "exporter.log").read_text()
    assert "drain deadline reached" in log and "`wandb` behind by" in log, log
    assert _jsonl(directory, "tee") == [(step, float(step)) for step in range(10)]


WORKER_RANKS = textwrap.dedent("""
    import multiprocessing, os, sys
    import otel_train as ot

    def child(rank):
        for i in range(5):
            with ot.span("load"):
                ot.log({"data/item": rank * 100 + i}, step=i)
        ot.flush()

    if __name__ == "__main__":
        ot.init(exporters="tensorboard,chrome_trace,jsonl", dir=sys.argv[1], run_id="ranks")
        rank = int(os.environ["RANK"])
        proc = multiprocessing.get_context("spawn").Process(target=child, args=(rank,))
        proc.start()
        proc.join()
        for step in range(5):
            with ot.step(step):
                ot.log({"loss": rank * 100 + step})
        ot.shutdown()
""")


def test_rank_1_exports_no_child_values_with_ranks_0(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    script = tmp_path / "ranks.py"
    script.write_text(WORKER_RANKS)
    procs = [subprocess.Popen([sys.executable, str(script), str(directory)], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=_env(tmp_path, RANK=str(rank), WORLD_SIZE="2"))
             for rank in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    worker_rows = [(i, float(i)) for i in range(5)]  # rank 0's child values only
    assert _tb(directory / "ranks", "data/item") == worker_rows
    assert _jsonl(directory, "ranks", 0, "data/item") == worker_rows
    assert _tb(directory / "ranks") == [(step, float(step)) for step in range(5)]
    rank1 = list(read_jsonl(jsonl_path(directory, "ranks", 1)))
    assert [r for r in rank1 if r["type"] != "span"] == []  # rank 1: no metrics, its own or its child's ...
    assert sorted(r["name"] for r in rank1 if r["name"] == "load") == ["load"] * 5  # ... but its spans



def test_claims_in_one_process(tmp_path: Path, caplog: Any) -> None:
    import threading

    from otel_train.ship.spool import claim_run, holder, mark_draining

    first = claim_run(tmp_path, "job", "job", 0, wait_s=0)
    other_rank = claim_run(tmp_path, "job", "job", 1, wait_s=0)  # ranks never contend
    second = claim_run(tmp_path, "job", "job", 0, wait_s=5)  # the holder trains: no wait, a distinct run
    assert [(c.run_id, c.run_name) for c in (first, other_rank, second)] == [("job", "job"), ("job", "job"),
                                                                             ("job-2", "job-2")]
    assert "writes run 'job-2' instead" in caplog.text
    assert holder(first.path)["state"] == "training"
    mark_draining(first.fd)  # the holder only drains now: the next claim waits for it, then takes the run
    threading.Timer(0.3, first.release).start()
    third = claim_run(tmp_path, "job", "job", 0, wait_s=60)
    assert (third.run_id, third.path) == ("job", first.path) and "still drains" in caplog.text
    for claim in (other_rank, second, third):
        claim.release()


# The user deletes the run folder (`rm -rf`) in the middle of a run: the file backends notice at their next
# append, say so once, and write what comes after into new files there (what was deleted is gone).
DELETED = textwrap.dedent("""
    import json, os, shutil, sys, time
    import otel_train as ot
    out = sys.argv[1]
    ot.init(exporters=["jsonl", "tensorboard", "chrome_trace"], dir=out, run_id="gone", run_name="gone",
            export_interval_s=0.02)
    for s in ot.steps(range(40)):
        ot.log({"loss": 1.0 / (s + 1), "acc": s * 0.5})
        time.sleep(0.005)
        if s == 19:
            assert ot.flush(timeout_s=30)
            shutil.rmtree(os.path.join(out, "gone"))
    ot.shutdown()
""")


def test_a_run_folder_deleted_mid_run_is_said_once_and_later_steps_land_in_new_files(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
    import readback

    script = tmp_path / "deleted.py"
    script.write_text(DELETED)
    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, str(script), str(out)], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "was deleted while the run wrote to it" in line]
    assert len(said) == 1 and str(out / "gone") in said[0], done.stderr[-3000:]  # once, naming the folder
    want = sorted([("acc", step, step * 0.5) for step in range(20, 40)]
                  + [("loss", step, 1.0 / (step + 1)) for step in range(20, 40)])
    jsonl = [(p.name, p.step, p.value) for p in readback.jsonl(out / "gone" / "rank0.jsonl") if p.name in ("loss", "acc")]
    assert sorted(jsonl) == want  # every later step once, in a file that exists
    tb = [(p.name, p.step, p.value) for p in readback.tensorboard(out / "gone") if p.name in ("loss", "acc")]
    assert sorted(tb) == sorted((n, s, _f32(v)) for n, s, v in want)
    counters = [(p.name, p.value) for p in readback.chrome_counters(out / "gone" / "trace" / "rank0.trace.json")
                if p.name in ("loss", "acc")]
    assert sorted(counters) == sorted((n, v) for n, _, v in want)


def _f32(x: float) -> float:
    import struct

    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def test_verify_after_a_run_folder_was_deleted_checks_what_was_logged_since(tmp_path: Path) -> None:
    """What was deleted is gone, and verify does not pretend otherwise: it checks the steps logged after the
    deletion, whose record started again with the backends' new files."""
    script = tmp_path / "deleted.py"
    script.write_text(DELETED)
    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, str(script), str(out)], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    verify = subprocess.run([sys.executable, "-m", "otel_train.cli", "verify", "--json", str(out / "gone")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
    report = json.loads(verify.stdout)
    checked = {b["backend"]: b for b in report["backends"]}
    assert set(checked) == {"jsonl", "tensorboard", "chrome_trace"}
    assert checked["jsonl"]["status"] == "pass" and checked["jsonl"]["present"] >= 2 * 20  # loss and acc, steps 20-39


# The run folder is deleted while a backend (W&B, hanging) has not yet written anything: the spool folder is
# created again from what the exporter process still holds, so `otel-train replay` delivers every step later.
DELETED_BEHIND = textwrap.dedent("""
    import os, shutil, sys, time
    import otel_train as ot
    out = sys.argv[1]
    session = ot.init(exporters=["wandb", "jsonl"], dir=out, run_id="behind", run_name="behind",
                      export_interval_s=0.02, shutdown_timeout_s=1)
    for s in ot.steps(range(40)):
        ot.log({"train/loss": float(s)})
        time.sleep(0.005)
        if s == 19:
            ot.flush(timeout_s=0.1)  # hands steps 0-19 over; W&B hangs in its first write
            deadline = time.monotonic() + 120  # a loaded machine may still be starting the exporter process
            while session.export_progress().delivered_step.get("jsonl", -1) < 19:  # until JSONL holds steps 0-19
                if time.monotonic() > deadline:
                    sys.exit("JSONL did not hold steps 0-19 within 120 s")
                time.sleep(0.02)
            shutil.rmtree(os.path.join(out, "behind"))
    ot.shutdown()
""")


def test_a_deleted_run_folder_keeps_the_windows_a_backend_still_needs_in_a_spool_replay_reads(
        tmp_path: Path) -> None:
    script, out = tmp_path / "behind.py", tmp_path / "runs"
    script.write_text(DELETED_BEHIND)
    env = _env(tmp_path, **fake_wandb_env(tmp_path, "hang"), OTEL_TRAIN_DRAIN_TIMEOUT_S="2")
    done = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "spool folder" in line and "was deleted" in line]
    assert len(said) == 1 and str(spool_dir(out, "behind", 0)) in said[0], done.stderr[-3000:]
    child = int(done.stderr.split("exporter process (pid ", 1)[1].split(")", 1)[0])
    wait_exited(child, 60)  # drained 2 s, W&B still hanging: the rest waits in the spool
    assert "`wandb` behind by" in (spool_dir(out, "behind", 0) / "exporter.log").read_text()  # its log, again there
    replay = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(out / "behind")],
                            env=_env(tmp_path, **fake_wandb_env(tmp_path, "record")), capture_output=True,
                            text=True, timeout=120, check=False)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    logged = [json.loads(x) for x in (tmp_path / "wandb-out" / "logged.jsonl").read_text().splitlines()]
    assert sorted((e["step"], e["train/loss"]) for e in logged if "train/loss" in e) == [
        (s, float(s)) for s in range(40)]  # every step once, those logged before the deletion included
    assert _jsonl(out, "behind", name="train/loss") == [(s, float(s)) for s in range(20, 40)]  # replay added none
