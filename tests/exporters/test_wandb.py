"""WandbExporter: a real offline W&B run read back from its `.wandb` file; resume in a second process;
rank policy and step ordering against a fake `wandb` module."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import backendkit
import pytest
from backendkit import isolated_wandb_env, read_run, two_ranks, wait_exited, wandb_files

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow
from otel_train.vocab.run_identity import RunInfo, config_hash

HPARAMS = {"lr": 0.1, "optim": {"beta": 0.9}}
RUN_ID = "job/77"  # "/" is reserved in W&B ids: becomes "-"


def row(run: RunInfo, step: int, tag: str, value: float, **attrs: Any) -> MetricRow:
    return backendkit.row(run, step, tag, value, 1_000 + step, **attrs)


def log_rows(r0: RunInfo, r1: RunInfo) -> list[LogRow]:
    return [LogRow(r0, 3, 1, 13, "WARNING", "loss spiked", "train"),
            LogRow(r1, 1, 2, 17, "ERROR", "uncaught ValueError in thread 'MainThread': boom", "otel_train.uncaught",
                   {"exception.stacktrace": "Traceback (most recent call last):\nValueError: boom\n"}),
            LogRow(r0, None, 3, 13, "WARNING", "before the first step", "data")]


# -- the real offline run (one module-scoped session) ----------------------------------------------
@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from otel_train.exporters.wandb import WandbExporter

    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        isolated_wandb_env(mp, root)
        options = ExporterOptions(directory=root / "runs", project="otel-wandb-test", hparams=HPARAMS,
                                  ranks="all")
        r0, r1 = two_ranks(RUN_ID, "wb", HPARAMS)
        hist = HistogramRow(r0, 1, "grad", "grad", 4, 6.0, 0.5, 3.0, (1.0, 2.0), (1, 2, 1), 5_000)
        exporter = WandbExporter(options)
        exporter.hold_s = 0.0  # each window written at once: what happens to a row later than the hold
        # Window 1: steps out of order across series inside the window (one `log` per step, in step order), a
        # suffixed series, a histogram, rank 1.
        assert exporter.export_window(Window(metrics=[
            row(r0, 2, "train/acc", 0.9), row(r0, 0, "train/loss", 1.0), row(r0, 1, "train/loss", 0.5),
            row(r0, 2, "train/loss", 0.2), row(r0, 1, "eval/acc{split=val}", 0.75, split="val"),
            row(r1, 0, "train/loss", 1.5), row(r1, 1, "train/loss", 1.25),
        ], histograms=[hist]))
        # Window 2: a late value for the step written last (merged), a step going back in its series (skipped, as
        # in TensorBoard), an older step of another series (W&B's run is at step 2: dropped), new steps.
        assert exporter.export_window(Window(metrics=[
            row(r0, 2, "eval/late", 7.0), row(r0, 1, "train/loss", 99.0), row(r0, 1, "eval/older", 98.0),
            row(r0, 3, "train/loss", 0.1), row(r0, 4, "train/loss", 0.05),
        ], logs=log_rows(r0, r1)))
        dropped = exporter.steps_dropped, exporter.step_order.counts()
        exporter.shutdown()
        exporter.shutdown()  # idempotent
        import wandb

        wandb.teardown()  # the service process writes the last records of each run file: wait for it
        yield {"root": root, "options": options, "dropped": dropped, "env": dict(os.environ)}


def test_offline_history_every_step_and_value(offline: dict[str, Any]) -> None:
    files = wandb_files(offline["root"] / "runs", "wb", "job-77")
    assert len(files) == 1
    run = read_run(files[0])
    assert (run["id"], run["name"], run["group"], run["project"]) == ("job-77", "wb", RUN_ID, "otel-wandb-test")
    hist = run["history"]
    assert sorted(hist) == [0, 1, 2, 3, 4]
    assert {s: h["train/loss"] for s, h in hist.items()} == {0: 1.0, 1: 0.5, 2: 0.2, 3: 0.1, 4: 0.05}
    assert hist[1]["eval/acc{split=val}"] == 0.75
    assert hist[2]["eval/late"] == 7.0 and hist[2]["train/acc"] == 0.9  # same step in a later window: merged
    assert "eval/older" not in hist[1]
    # The step-1 row of `eval/older` that came after step 2; the one of `train/loss`, gone back in its series.
    assert offline["dropped"] == (1, {"backwards": 1, "dropped": 1})
    # A histogram is stored as nested keys under its tag; outer edges are its min and max.
    assert hist[1]["grad/values"] == [1, 2, 1] and hist[1]["grad/bins"] == [0.5, 1.0, 2.0, 3.0]


def test_log_records_are_lines_of_each_ranks_run_file(offline: dict[str, Any]) -> None:
    """W&B's place for text: a file in the run's files folder (its Files tab), one per rank's run."""
    from otel_train.exporters.wandb import offline_run_files

    folder = offline["root"] / "runs" / "wb" / "wandb"
    texts = {}
    for wandb_id in ("job-77", "job-77-rank1"):
        (path,) = offline_run_files(folder, wandb_id)
        rank = 1 if wandb_id.endswith("rank1") else 0
        texts[rank] = (path.parent / "files" / "otel-train-logs" / f"rank{rank}.log").read_text().splitlines()
    assert texts[0] == ["[step 3] WARNING train: loss spiked", "[step -] WARNING data: before the first step"]
    assert texts[1] == ["[step 1] ERROR otel_train.uncaught: uncaught ValueError in thread 'MainThread': boom",
                        "Traceback (most recent call last):", "ValueError: boom"]


def test_offline_config_has_hparams_and_hash(offline: dict[str, Any]) -> None:
    run = read_run(wandb_files(offline["root"] / "runs", "wb", "job-77")[0])
    cfg = {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in run["config"].items()}
    assert cfg["lr"] == 0.1 and cfg["optim"] == {"beta": 0.9}
    assert cfg["train.config.hash"] == config_hash(HPARAMS)
    assert cfg["train.run.id"] == RUN_ID


def test_rank1_is_its_own_run_in_the_group(offline: dict[str, Any]) -> None:
    files = wandb_files(offline["root"] / "runs", "wb", "job-77-rank1")
    assert len(files) == 1
    run = read_run(files[0])
    assert (run["id"], run["name"], run["group"]) == ("job-77-rank1", "wb-rank1", RUN_ID)
    assert {s: h["train/loss"] for s, h in run["history"].items()} == {0: 1.5, 1: 1.25}


RESUME_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from otel_train.exporters.base import Window
    from otel_train.exporters.wandb import WandbExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo(sys.argv[2], "wb", world_size=2)
    exp = WandbExporter(ExporterOptions(directory=Path(sys.argv[1]), project="otel-wandb-test", ranks="all"))
    rows = [MetricRow(run, s, "train/loss", "train/loss", 10.0 + s, "gauge", s) for s in range(3, 8)]
    assert exp.export_window(Window(metrics=rows))
    exp.shutdown()
    print("dropped", exp.steps_dropped)
""")


def test_resumed_job_continues_without_duplicate_steps(offline: dict[str, Any], tmp_path: Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(offline["root"] / "runs"), RUN_ID],
                          env=offline["env"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dropped 2" in done.stdout  # steps 3 and 4 were already in the run
    assert "monotonically" not in done.stderr
    files = wandb_files(offline["root"] / "runs", "wb", "job-77")
    assert len(files) == 2  # offline: one file per process, same run id (`wandb sync` joins them)
    first, second = (read_run(f) for f in files)
    assert second["id"] == first["id"] == "job-77"
    assert {s: h["train/loss"] for s, h in second["history"].items()} == {5: 15.0, 6: 16.0, 7: 17.0}
    assert not set(first["history"]) & set(second["history"])


DELETED_SCRIPT = textwrap.dedent("""
    import shutil, sys
    from pathlib import Path
    from otel_train.exporters.base import Window
    from otel_train.exporters.wandb import WandbExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("deleted-run", "deleted")
    exp = WandbExporter(ExporterOptions(directory=Path(sys.argv[1]), project="otel-wandb-test"))
    exp.hold_s = 0.0

    def window(steps):
        return Window(metrics=[MetricRow(run, s, "train/loss", "train/loss", float(s), "gauge", s) for s in steps])

    assert exp.export_window(window(range(3))) and exp.force_flush()
    import time
    deadline = time.monotonic() + 60
    while (exp.durable_step() or 0) < 1 and time.monotonic() < deadline:  # W&B's service writes on its own time
        time.sleep(0.1)
    print("before", exp.durable_step())  # the last step stays open until the run closes: 1
    shutil.rmtree(Path(sys.argv[1]) / "deleted")  # the run folder removed under the running job
    assert exp.export_window(window(range(3, 6))) and exp.force_flush()
    print("after", exp.durable_step())
    exp.shutdown()
""")


def test_a_run_file_deleted_under_the_run_claims_nothing_more(offline: dict[str, Any], tmp_path: Path) -> None:
    """W&B goes on writing into a run file deleted under it (the run folder removed): its read-back found no file
    and claimed everything, so the windows left the spool, lost with "0 dropped". It now claims nothing more: the
    windows stay in the spool for `otel-train replay`."""
    script = tmp_path / "deleted.py"
    script.write_text(DELETED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=offline["env"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "before 1" in done.stdout, done.stdout  # steps 0 and 1 held (W&B holds the last one open)
    assert "after -1" in done.stdout, done.stdout
    assert "was deleted while the run wrote to it" in done.stderr


# -- fakes: rank policy, one `log` per step, and the missing package ---------------------------------
class FakeRun:
    def __init__(self, kwargs: dict[str, Any], root: Path) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[int, dict[str, Any]]] = []
        self.finished = 0
        self.starting_step = 0
        self.settings = types.SimpleNamespace(wandb_dir=str(root))

    def log(self, data: dict[str, Any], step: int) -> None:
        self.calls.append((step, dict(data)))

    def finish(self) -> None:
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[FakeRun]:
    runs: list[FakeRun] = []

    def init(settings: Any = None, **kwargs: Any) -> FakeRun:
        runs.append(FakeRun({**kwargs, "settings": settings}, tmp_path))
        return runs[-1]

    module = types.SimpleNamespace(init=init, Settings=lambda **kw: kw, Histogram=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", module)
    for key in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_CONSOLE", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(key, raising=False)
    return runs


def test_rank_zero_policy_and_one_log_per_step(fake_wandb: list[FakeRun], tmp_path: Path) -> None:
    from otel_train.exporters.wandb import WandbExporter

    r0, r1 = RunInfo("r", "n", rank=0, world_size=2), RunInfo("r", "n", rank=1, world_size=2)
    with WandbExporter(ExporterOptions(directory=tmp_path, project="proj")) as exp:
        assert exp.export_window(Window(metrics=[
            row(r0, 1, "b", 2.0), row(r0, 0, "a", 0.0), row(r0, 1, "a", 1.0), row(r1, 0, "a", 9.0)]))
    assert len(fake_wandb) == 1  # rank 1 ignored with ranks "0"
    run = fake_wandb[0]
    assert run.calls == [(0, {"a": 0.0}), (1, {"a": 1.0, "b": 2.0})]
    assert run.finished == 1
    kw = run.kwargs
    assert (kw["id"], kw["name"], kw["project"], kw["resume"]) == ("r", "n", "proj", "allow")
    assert "group" not in kw and kw["dir"] == str(tmp_path / "n") and kw["settings"] == {"console": "off"}


def test_wandb_env_wins_over_defaults(fake_wandb: list[FakeRun], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.wandb import WandbExporter

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    before = dict(os.environ)
    with WandbExporter(ExporterOptions(directory=tmp_path, project="proj")) as exp:
        exp.export_window(Window(metrics=[row(RunInfo("r", "n"), 0, "a", 1.0)]))
    kw = fake_wandb[0].kwargs
    assert kw["project"] == "from-env" and "dir" not in kw  # wandb reads WANDB_DIR itself
    assert dict(os.environ) == before  # never writes the environment


def test_missing_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.wandb import WandbExporter

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'otel-train\[wandb\]'") as err:
        WandbExporter(ExporterOptions())
    assert err.value.name == "wandb"


REPLAY_JOB = textwrap.dedent("""
    import os, sys
    import otel_train as ot
    session = ot.init(exporters=["wandb", "jsonl"], dir=sys.argv[1], run_id="rp", run_name="rp")
    print(session.export_process.pid, flush=True)
    rank = int(os.environ["RANK"])
    for s in ot.steps(range(6)):
        ot.log({"loss": s + rank / 10})
    ot.shutdown()
""")


def test_replay_twice_after_wandb_failed_writes_every_rank_step_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks whose W&B failed during the job (online, not logged in: `wandb.init` raises) leave W&B's windows
    in their spools; `otel-train replay` with a working (offline) W&B writes every step of every rank, step 0
    included, and a second replay writes nothing more."""
    from otel_train.ship.export_process import replay

    isolated_wandb_env(monkeypatch, tmp_path / "wandb-home")
    script, runs = tmp_path / "job.py", tmp_path / "runs"
    script.write_text(REPLAY_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(WANDB_MODE="online", WANDB_API_KEY="", OTEL_TRAIN_RANKS="all", WORLD_SIZE="2",
               OTEL_TRAIN_SHUTDOWN_TIMEOUT_S="3", OTEL_TRAIN_DRAIN_TIMEOUT_S="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(runs)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        exporter = int(out.split()[0])
        wait_exited(exporter, 60)  # its exporter process drains a moment longer; replay waits for it to be gone
    assert not any(wandb_files(runs, "rp", wid) for wid in ("rp", "rp-rank1"))  # W&B held nothing yet

    def held() -> list[tuple[str, int, float]]:
        return sorted((wid, step, row["loss"]) for wid in ("rp", "rp-rank1") for path in wandb_files(runs, "rp", wid)
                      for step, row in read_run(path)["history"].items() if "loss" in row)

    want = sorted((wid, s, s + rank / 10) for rank, wid in enumerate(("rp", "rp-rank1")) for s in range(6))
    for _ in range(2):
        # The run recorded W&B online (where it failed): `otel-train replay --set WANDB_MODE=offline` keeps it offline.
        progress = replay(runs / "rp", timeout_s=120, stall_s=60, overrides={"WANDB_MODE": "offline"})
        assert {k: p.behind() for k, p in progress.items()} == {"rank0": {}, "rank1": {}}
        assert held() == want  # a list: a step held twice (over several run files) shows
