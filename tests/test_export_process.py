"""The exporter process: real backends fed from a child, its spool, kills, hand-off, replay.

Training runs in subprocesses (a real `kill -9` / SIGTERM needs its own process); the backends are read
back with their own readers or the read-back helpers of tests/exporters/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from backendkit import events as clearml_events
from backendkit import isolated_wandb_env, read_run, tb_scalars, wait_exited, wandb_files
from fake_wandb import fake_wandb_env
from selected import selected

import otel_train as ot
from otel_train.config.settings import load_settings
from otel_train.errors import ConfigError
from otel_train.exporters.chrome_trace import trace_path
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.trace_merge import load_trace

HERE = Path(__file__).parent

TRAIN = textwrap.dedent("""
    import json, sys, time
    import otel_train as ot
    cfg = json.loads(sys.argv[1])
    session = ot.init(exporters=cfg["exporters"], dir=cfg["dir"], run_name=cfg["run"], run_id=cfg["run"],
                      **cfg.get("kw", {}))
    print("CHILD", getattr(session.export_process, "pid", 0), flush=True)
    for step in range(cfg["steps"]):
        with ot.step(step):
            with ot.span("fwd"):
                ot.log({"train/loss": 1.0 / (step + 1), "train/acc": step / 100})
        if cfg.get("flush_every") and step % cfg["flush_every"] == 0:
            ot.flush()
            print("FLUSHED", step, flush=True)
        time.sleep(cfg.get("sleep", 0))
    if cfg.get("wait"):
        print("READY", flush=True)
        time.sleep(600)
    ot.shutdown()
    if cfg.get("trackio_project"):
        from trackio.sqlite_storage import SQLiteStorage
        print("TRACKIO" + json.dumps(SQLiteStorage.get_logs(cfg["trackio_project"], cfg["run"]), default=str))
""")

def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_TRAIN_", "WANDB_", "MLFLOW_", "CLEARML_", "TRAINS_", "TRACKIO_", "HF_"))}
    env.update(HOME=str(root / "home"), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "wbc"),
               WANDB_CACHE_DIR=str(root / "wbcache"), WANDB_DATA_DIR=str(root / "wbdata"),
               CLEARML_CONFIG_FILE=str(root / "clearml.conf"), CLEARML_CACHE_DIR=str(root / "cache"),
               TRACKIO_DIR=str(root / "trackio"), HF_HOME=str(root / "hf"), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _start(root: Path, cfg: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    script = root / "train.py"
    script.write_text(TRAIN)
    return subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _jsonl_steps(directory: Path, run: str, tag: str = "train/loss") -> list[int]:
    return sorted(r["step"] for r in read_jsonl(jsonl_path(directory, run, 0)) if r["type"] == "metric" and r["tag"] == tag)


def _tb_steps(directory: Path, run: str, tag: str = "train/loss") -> list[int]:
    return sorted(step for step, _ in tb_scalars(directory / run)[tag])


#: Where backends run: the same tests pass in each (`OTEL_TRAIN_EXPORT_PROCESS`).
PLACEMENTS = {"exporter_process": "on", "in_process": "off"}
ALL_STEPS, ALL_RUN = 40, "all-six"


class Finished(NamedTuple):
    code: int
    out: str
    err: str


@pytest.fixture(scope="module")
def every_backend_runs(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path,
                       request: pytest.FixtureRequest) -> Iterator[dict[str, tuple[Path, Future[Finished]]]]:
    """Seven backends, one run per placement, both started together: a run is mostly its processes importing and
    starting backends one at a time, which leaves the second core of a 2-core machine idle."""
    started: dict[str, tuple[Path, subprocess.Popen[str]]] = {}
    for placement in selected(request, "placement", PLACEMENTS):
        root = tmp_path_factory.mktemp(placement)
        directory = root / "runs"
        (directory / "mlruns").mkdir(parents=True)  # MLflow's store, created once per session (tests/conftest.py)
        shutil.copyfile(mlflow_store_template, directory / "mlruns" / "mlflow.db")
        cfg = {"exporters": ["tensorboard", "chrome_trace", "jsonl", "wandb", "mlflow", "trackio", "clearml"],
               "dir": str(directory), "run": ALL_RUN, "steps": ALL_STEPS, "trackio_project": "otel-train",
               "kw": {"shutdown_timeout_s": 120}}  # `shutdown()` returns when every backend has everything
        started[placement] = (root, _start(root, cfg, _env(root, OTEL_TRAIN_EXPORT_PROCESS=PLACEMENTS[placement])))

    def finish(proc: subprocess.Popen[str]) -> Finished:  # read as it comes: a full pipe would stall a run
        out, err = proc.communicate(timeout=300)
        return Finished(proc.returncode, out, err)

    with ThreadPoolExecutor(max_workers=len(PLACEMENTS)) as pool:
        try:
            yield {name: (root, pool.submit(finish, proc)) for name, (root, proc) in started.items()}
        finally:
            for _, proc in started.values():
                if proc.poll() is None:
                    proc.kill()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_backend_in_every_placement(
        every_backend_runs: dict[str, tuple[Path, Future[Finished]]], placement: str) -> None:
    from mlflow.tracking import MlflowClient

    tmp_path, finished = every_backend_runs[placement]
    steps, run, directory = ALL_STEPS, ALL_RUN, tmp_path / "runs"
    code, out, err = finished.result()
    assert code == 0, err[-3000:]
    assert "timed out" not in err
    every = list(range(steps))
    loss = {s: 1.0 / (s + 1) for s in every}

    assert _tb_steps(directory, run) == every
    assert _jsonl_steps(directory, run) == every
    spans = [e for e in load_trace(trace_path(directory, run, 0)) if e.get("ph") == "X" and e["name"] == "fwd"]
    assert len(spans) == steps
    wandb_run = read_run(wandb_files(directory, run, run)[0])
    assert {s: h["train/loss"] for s, h in wandb_run["history"].items()} == pytest.approx(loss)
    client = MlflowClient(f"sqlite:///{(directory / 'mlruns' / 'mlflow.db').resolve()}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("otel-train").experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == every
    logs = json.loads(next(x for x in out.splitlines() if x.startswith("TRACKIO"))[len("TRACKIO"):])
    assert sorted(e["step"] for e in logs if "train/loss" in e) == every
    (folder,) = (tmp_path / "cache" / "offline").glob("*/metrics.jsonl")
    events = clearml_events(folder.parent)
    clearml_steps = [e["iter"] for e in events if e["type"] == "training_stats_scalar"
                     and (e["metric"], e["variant"]) == ("train", "loss")]
    assert sorted(clearml_steps) == every
    assert not list((directory / run / "spool" / "rank0").glob("*.seg"))  # all acknowledged: segments gone


def test_init_errors_are_raised_in_the_training_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_EXPORTERS: unknown exporter 'tensorbord'; known: "):
        ot.init(exporters=["tensorbord"], dir=tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_DIR: cannot write to "):
        ot.init(exporters=["tensorboard"], dir=blocker / "runs")
    # A missing package: before anything starts (a backend that fails to start later: tests/test_backend_start.py).
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_EXPORTERS: exporter 'wandb' needs the `wandb` package, "
                                          r"which is not installed; run: pip install 'otel-train\[wandb\]'$"):
        ot.init(exporters=["jsonl", "wandb"], dir=tmp_path / "runs")
    assert ot._session is None


def test_new_settings_are_validated() -> None:
    s = load_settings({"OTEL_TRAIN_EXPORT_PROCESS": " OFF ", "OTEL_TRAIN_DRAIN_TIMEOUT_S": "5",
                       "OTEL_TRAIN_EXPORT_CPUS": "8-9,12", "OTEL_TRAIN_EXPORT_NICE": "10"})
    assert (s.export_process, s.drain_timeout_s, s.export_cpus, s.export_nice) == ("off", 5.0, (8, 9, 12), 10)
    assert load_settings({}).export_process == "auto" and load_settings({}).drain_timeout_s == 120.0
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_EXPORT_PROCESS: 'maybe' is not allowed; use one of auto, on, off$"):
        load_settings({"OTEL_TRAIN_EXPORT_PROCESS": "maybe"})
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_EXPORT_CPUS: '3-1' is not a CPU list"):
        load_settings({"OTEL_TRAIN_EXPORT_CPUS": "3-1"})
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_EXPORT_NICE: 20 is too large"):
        load_settings({"OTEL_TRAIN_EXPORT_NICE": "20"})


def test_progress_pinning_and_forked_workers(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))[-1:]
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_CPUS", str(cpus[0]))
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_NICE", "3")
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="prog")
    child = session.export_process.pid
    assert os.sched_getaffinity(child) == set(cpus)
    assert os.getpriority(os.PRIO_PROCESS, child) == os.getpriority(os.PRIO_PROCESS, 0) + 3
    for step in range(5):
        with ot.step(step):
            ot.log({"train/loss": float(step)})
    pid = os.fork()  # a DataLoader-style worker: whatever it logs must not reach the exporter process
    if pid == 0:
        with ot.step(1000):
            ot.log({"train/loss": -1.0})
        ot.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    assert ot.flush(timeout_s=30)
    progress = session.export_progress()
    assert progress.delivered == {"jsonl": progress.spooled} and progress.behind() == {}
    assert progress.delivered_step["jsonl"] == 4
    ot.shutdown()
    assert _jsonl_steps(run_dir, "prog") == [0, 1, 2, 3, 4]


def test_a_ready_that_comes_before_init_holds_the_connection_is_heard(run_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter process may say ``ready`` before `init()` has stored its connection (the reply thread is
    already running): that ``ready`` still releases what was logged meanwhile, and the job's values arrive."""
    import threading

    from otel_train.ship.export_process import ExportProcess

    heard = threading.Event()
    on_ready, start = ExportProcess._on_ready, ExportProcess._start

    def noting(self: ExportProcess, conn: Any, last_seq: int) -> None:
        heard.set()
        on_ready(self, conn, last_seq)

    def ready_first(self: ExportProcess, *args: Any) -> Any:
        out = start(self, *args)
        if self.restarts == 0:
            heard.wait(60)  # the child's ready reaches the reply thread before the spawner returns
        return out

    monkeypatch.setattr(ExportProcess, "_on_ready", noting)
    monkeypatch.setattr(ExportProcess, "_start", ready_first)
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="early-ready")
    assert session.export_process is not None  # started off the training thread: this waits for it
    assert heard.is_set()
    for step in range(5):
        with ot.step(step):
            ot.log({"train/loss": float(step)})
    assert ot.flush(timeout_s=30)
    ot.shutdown()
    assert _jsonl_steps(run_dir, "early-ready") == [0, 1, 2, 3, 4]


def test_windows_the_socket_cannot_take_before_ready_wait_in_order_and_go_out_on_ready(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the exporter process is up, a window too big for its socket's free buffer waits in the training
    process (the loop never blocks on it), and everything after it waits behind it; ``ready`` sends them, in order."""
    from otel_train._internal.faults import SLOW_READY

    marker = run_dir / "go"
    monkeypatch.setenv(SLOW_READY, str(marker))  # the child waits for it before it says `ready`
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="held")
    try:
        for step in range(6):
            with ot.step(step):
                ot.log({f"wide/k{i}": float(step) for i in range(4000)})  # ~100 KiB a window
        assert not ot.flush(timeout_s=0.1)  # no child to answer yet
        deadline = time.monotonic() + 30  # a loaded machine may take longer than the flush to hand every window on
        while not session.export_process._held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert session.export_process._held  # not all of them fit in the socket
    finally:
        marker.touch()
    assert ot.flush(timeout_s=60)
    ot.shutdown()
    steps = [r["step"] for r in read_jsonl(jsonl_path(run_dir, "held", 0)) if r.get("tag") == "wide/k0"]
    assert steps == list(range(6))  # each once, in order


def test_child_killed_is_restarted_once_then_in_process(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # TensorBoard: its records carry a CRC, so one torn by the kill is skipped by its reader.
    session = ot.init(exporters=["tensorboard"], dir=run_dir, run_name="kill-child")
    proc = session.export_process
    for round_ in range(3):
        for step in range(round_ * 10, round_ * 10 + 10):
            with ot.step(step):
                ot.log({"train/loss": float(step)})
        if round_ < 2:
            old = proc.pid
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (proc.pid == old and proc.fallback is None) and time.monotonic() < deadline:
                time.sleep(0.02)
    assert ot.flush(timeout_s=30)
    ot.shutdown()
    assert proc.restarts == 1 and proc.fallback is not None
    warnings = [r.getMessage() for r in caplog.records if "exporter process exited" in r.getMessage()]
    assert len(warnings) == 2 and "restarting it once" in warnings[0] and "training process" in warnings[1]
    # Nothing spooled is lost, nothing is written twice (tests/faults/test_child_kill.py counts every point).
    assert _tb_steps(run_dir, "kill-child") == list(range(30))


def test_sigterm_hands_off_within_the_timeout_with_a_hanging_backend(tmp_path: Path) -> None:
    directory, run = tmp_path / "runs", "hang"
    # No record of what was logged: the W&B stand-in writes no W&B store that `otel-train verify` could read back,
    # so replay follows the cursors (and does not report W&B's values as still missing afterwards).
    env = _env(tmp_path, **fake_wandb_env(tmp_path, "hang"), OTEL_TRAIN_DRAIN_TIMEOUT_S="2", OTEL_TRAIN_VERIFY="off")
    cfg = {"exporters": ["wandb", "jsonl"], "dir": str(directory), "run": run, "steps": 20, "wait": True,
           "kw": {"shutdown_timeout_s": 1}}
    proc = _start(tmp_path, cfg, env)
    assert proc.stdout is not None
    child = int(proc.stdout.readline().split()[1])
    assert proc.stdout.readline().strip() == "READY"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    handed_off_s = time.monotonic() - sent
    assert proc.returncode == -signal.SIGTERM
    assert "shutdown timed out; data is durable in the spool; `wandb` behind by" in err
    assert handed_off_s < 1 + 3  # the shutdown timeout, plus the interpreter's own exit
    wait_exited(child, 2 + 10)  # the child never outlives its drain deadline
    assert _jsonl_steps(directory, run) == list(range(20))
    # What W&B never got waits in the spool; `otel-train replay` delivers it once, a second replay nothing.
    replay_env = _env(tmp_path, **fake_wandb_env(tmp_path, "record"))
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(directory / run)],
                              env=replay_env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "every one delivered to every backend" in done.stdout
    logged = [json.loads(x) for x in (tmp_path / "wandb-out" / "logged.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in logged if "train/loss" in e) == list(range(20))
    assert _jsonl_steps(directory, run) == list(range(20))  # jsonl had everything: replay added nothing


HANG_FLUSH = textwrap.dedent("""
    import json, sys, threading, time
    import otel_train as ot
    cfg = json.loads(sys.argv[1])
    session = ot.init(exporters=["wandb", "jsonl"], dir=cfg["dir"], run_name="hang", run_id="hang",
                      shutdown_timeout_s=1)
    for step in range(5):
        with ot.step(step):
            ot.log({"train/loss": float(step)})
    first = ot.flush(timeout_s=0.5)  # W&B hangs in its first write: never everything
    threads = threading.active_count()
    flushed = [ot.flush(timeout_s=0.01) for _ in range(50)]
    after = threading.active_count()
    start = time.monotonic()
    ot.shutdown()
    print(json.dumps({"first": first, "flushed": flushed, "threads": [threads, after],
                      "shutdown_s": time.monotonic() - start}), flush=True)
""")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_hanging_backend_bounds_flush_and_shutdown_in_every_placement(tmp_path: Path, placement: str) -> None:
    """One flush path: with a backend hanging in its write, `ot.flush()` answers False by its deadline and
    starts no thread per call; the other backend has every step; `shutdown()` returns by its timeout."""
    directory = tmp_path / "runs"
    script = tmp_path / "hang.py"
    script.write_text(HANG_FLUSH)
    env = _env(tmp_path, **fake_wandb_env(tmp_path, "hang"), OTEL_TRAIN_EXPORT_PROCESS=PLACEMENTS[placement],
               OTEL_TRAIN_DRAIN_TIMEOUT_S="1")
    done = subprocess.run([sys.executable, str(script), json.dumps({"dir": str(directory)})], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["first"] is False and result["flushed"] == [False] * 50
    threads_before, threads_after = result["threads"]
    assert threads_after <= threads_before  # 50 flushes left no thread behind (before: one each, all hanging)
    assert result["shutdown_s"] < 1 + 4  # bounded by its timeout (1 s), with room for a loaded machine
    assert _jsonl_steps(directory, "hang") == list(range(5))


def test_kill_9_of_the_training_process_loses_nothing_the_child_received(tmp_path: Path) -> None:
    # Where in the hand-off a kill lands is up to timing (training runs on while the kill is sent), not the step
    # chosen: the steps only spread the kills from the first windows (3, 4) to a longer backlog (59), and five
    # runs started together cover that range.
    runs = []
    for rep, kill_at in enumerate((3, 4, 20, 41, 59)):
        root = tmp_path / f"rep{rep}"
        root.mkdir()
        cfg = {"exporters": ["jsonl", "tensorboard"], "dir": str(root / "runs"), "run": f"k{rep}", "steps": 10_000,
               "flush_every": 1, "sleep": 0.002}
        runs.append((root, cfg, kill_at, _start(root, cfg, _env(root))))
    for root, cfg, kill_at, proc in runs:
        assert proc.stdout is not None
        child = int(proc.stdout.readline().split()[1])
        flushed = -1
        while flushed < kill_at:
            flushed = int(proc.stdout.readline().split()[1])
        proc.kill()
        proc.wait(timeout=30)
        wait_exited(child, 60)  # the child drained what it had and exited on its own
        got = _jsonl_steps(Path(cfg["dir"]), cfg["run"])
        # Every flushed step (and whatever else reached the child), in order, each exactly once.
        assert got == list(range(len(got))) and len(got) > flushed
        assert _tb_steps(Path(cfg["dir"]), cfg["run"]) == got


def test_ctrl_c_to_the_job_does_not_reach_the_exporter_process(tmp_path: Path) -> None:
    directory, run = tmp_path / "runs", "ctrl-c"
    cfg = {"exporters": ["jsonl"], "dir": str(directory), "run": run, "steps": 15, "wait": True}
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], env=_env(tmp_path), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline().split()[1])
    assert proc.stdout.readline().strip() == "READY"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err  # the training process got it; the exporter process did not die of it
    wait_exited(child, 30)
    assert _jsonl_steps(directory, run) == list(range(15))


def test_replay_of_a_folder_without_a_spool_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from otel_train.cli import main

    assert main(["replay", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"nothing to replay: no spool under {tmp_path}\n"


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_config_reported_after_init_reaches_a_backend_in_every_placement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str) -> None:
    isolated_wandb_env(monkeypatch, tmp_path)  # the exporter process inherits this environment
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", PLACEMENTS[placement])
    directory = tmp_path / "runs"
    # W&B's start in the training process can outlast the default 10 s hand-off on a loaded machine: the config,
    # not that deadline, is tested here.
    session = ot.init(exporters=["wandb"], dir=directory, run_id="cfg", run_name="cfg", config={"lr": 0.1},
                      shutdown_timeout_s=120.0)
    session.add_config({"batch_size": 32})  # as a framework integration does before training starts
    for step in range(3):
        with ot.step(step):
            ot.log({"train/loss": float(step)})
    ot.shutdown()
    run = read_run(wandb_files(directory, "cfg", "cfg")[0])
    assert run["config"]["lr"] == 0.1 and run["config"]["batch_size"] == 32
    assert sorted(run["history"]) == [0, 1, 2]


def test_the_drain_time_counts_after_the_trainers_wait(tmp_path: Path) -> None:
    """A drain time shorter than the shutdown timeout does not cut the trainer's wait short: shutdown returns with
    every step in a backend whose first write takes 3 s, and `flush(timeout_s=)` waits as long as asked."""
    directory, run = tmp_path / "runs", "slow"
    env = _env(tmp_path, **fake_wandb_env(tmp_path, "slow"), OTEL_TRAIN_DRAIN_TIMEOUT_S="1")
    cfg = {"exporters": ["wandb", "jsonl"], "dir": str(directory), "run": run, "steps": 5, "flush_every": 4,
           "kw": {"shutdown_timeout_s": 60}}
    proc = _start(tmp_path, cfg, env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "timed out" not in err, err[-3000:]
    logged = [json.loads(x)["step"] for x in (tmp_path / "wandb-out" / "logged.jsonl").read_text().splitlines()]
    assert logged == list(range(5))


def test_replay_says_what_is_left_and_gives_up_on_a_backend_that_always_fails(tmp_path: Path) -> None:
    directory, run = tmp_path / "runs", "stuck"
    cfg = {"exporters": ["wandb", "jsonl"], "dir": str(directory), "run": run, "steps": 20,
           "kw": {"shutdown_timeout_s": 1}}
    hang = _env(tmp_path, **fake_wandb_env(tmp_path, "hang"), OTEL_TRAIN_DRAIN_TIMEOUT_S="1", OTEL_TRAIN_RANKS="all",
                WORLD_SIZE="2")
    children, procs = [], []
    for rank in (0, 1):  # two ranks, started together, whose W&B hung: its windows wait in each rank's spool
        (tmp_path / f"rank{rank}").mkdir()
        procs.append(_start(tmp_path / f"rank{rank}", cfg, {**hang, "RANK": str(rank)}))
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        children.append(int(out.split()[1]))
    for child in children:
        wait_exited(child, 30)
    replay_env = _env(tmp_path, **fake_wandb_env(tmp_path, "fail"))
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(directory / run), "--stall", "2",
                           "--report-every", "0.5"], env=replay_env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    for rank in (0, 1):  # per rank and backend: what it waits for, then that it gave up on it (not the timeout)
        assert f"rank{rank}: waiting for `wandb` " in done.stderr, done.stderr[-3000:]
        assert f"rank{rank}: giving up on `wandb`: no progress for 2 s" in done.stderr, done.stderr[-3000:]
        assert f"rank{rank}: `wandb` behind by" in done.stdout
    assert "window(s) left" in done.stderr
    # Nothing was acknowledged for W&B: its windows stay in each rank's spool for a later replay.
    from otel_train.ship.spool import Spool, spool_dir

    for rank in (0, 1):
        spool = Spool(spool_dir(directory, run, rank))
        assert spool.cursor("wandb") == 0 < spool.last_seq and spool.cursor("jsonl") == spool.last_seq


def test_short_sessions_one_after_another_leave_no_exporter_process_behind(tmp_path: Path) -> None:
    """A sweep of short trials in one process: each session's exporter process, done draining, is reaped (its exit
    status collected) by a later session, not left as a zombie per trial."""
    import psutil

    pids = []
    for trial in range(3):
        session = ot.init(exporters=["jsonl"], dir=tmp_path, run_name=f"trial{trial}")
        with ot.step(0):
            ot.log({"loss": 1.0})
        pids.append(session.export_process.pid)
        ot.shutdown()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # done draining: it has exited (a zombie until reaped)
            try:
                if psutil.Process(pids[-1]).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
    ot.init(exporters=["jsonl"], dir=tmp_path, run_name="last")
    ot.shutdown()
    left = []
    for pid in pids:
        try:
            left.append((pid, psutil.Process(pid).status()))
        except psutil.NoSuchProcess:
            pass
    assert left == []


def test_windows_forgotten_unconfirmed_count_as_dropped_only_when_a_restart_needed_them() -> None:
    """The resend backlog keeps windows sent but not yet confirmed spooled, for a restarted child. A fast loop fills
    it and the oldest are forgotten: they were counted as dropped ("N dropped (windows the exporter process could
    not take ...)") though the child spooled them all. Only those a restart needs and cannot have are lost."""
    from otel_train.ship import export_process

    backlog = export_process.Backlog()
    extra = 5
    for seq in range(export_process._BACKLOG + extra):
        backlog.add(seq, seq, b"w")
    backlog.confirm(export_process._BACKLOG + extra - 1)  # the child spooled every one
    assert backlog.pending() == [] and backlog.dropped == 0

    lost = export_process.Backlog()
    for seq in range(export_process._BACKLOG + extra):
        lost.add(seq, seq, b"w")
    lost.confirm(1)  # the child spooled 0 and 1, then died: a restart needs 2.. and 2..4 were forgotten
    pending = lost.pending()
    assert pending[0][0] == extra and lost.dropped == extra - 2


def test_the_shutdown_timeout_warning_says_how_far_each_backend_is_then(tmp_path: Path) -> None:
    """The warning printed the progress of the moment the close began (before delivery), so a backend that had
    written everything since was named as behind by every step. Here JSONL writes all 10 steps at once and `otlp`,
    sending where nothing listens, none: only `otlp` is behind."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text("import sys\nimport otel_train as ot\n"
                      "ot.init(exporters=['jsonl', 'otlp'], dir=sys.argv[1], run_name='late', shutdown_timeout_s=1.0)\n"
                      "for s in ot.steps(range(10)):\n    ot.log({'train/loss': float(s)})\not.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
               OTEL_TRAIN_DRAIN_TIMEOUT_S="1")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [line for line in done.stderr.splitlines() if "shutdown timed out" in line]
    assert "`otlp` behind by 10 step(s)" in warning and "`jsonl` behind" not in warning, warning
