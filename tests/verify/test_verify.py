"""`otel-train verify` against a real job's backends: every local backend read back with its own reader (TensorBoard's
event-file loader, JSONL, the Chrome trace, an offline W&B run file, MLflow's SQLite store, Trackio's store,
ClearML's offline session) and compared with the run's record. Then the files are altered (points removed,
duplicated, changed) and verify must name the backend, the series and the steps, and exit non-zero.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from backendkit import isolated_backends_env

from otel_train.cli import main as cli_main
from otel_train.verify.expected import KILLED_IN_FLIGHT

pytestmark = pytest.mark.timeout(600)
DRIVER = Path(__file__).with_name("verify_driver.py")
ALL = "jsonl,chrome_trace,tensorboard,wandb,mlflow,clearml,trackio"
STEPS = 30
#: Series the driver logs, as TensorBoard names them, and how many points each has.
USER_SERIES = ("train/loss", "train/lr", "train/acc", "eval/acc{split=val}", "samples")


@dataclass(frozen=True)
class Job:
    out: Path  # OTEL_TRAIN_DIR
    run_dir: Path
    stderr: str


def _env(home: Path, **extra: str) -> dict[str, str]:
    """This environment with W&B, ClearML, MLflow and Trackio offline under `home`, and no otel-train setting."""
    with pytest.MonkeyPatch.context() as mp:
        isolated_backends_env(mp, home)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_", "HF_"))}
    env["TRACKIO_DIR"] = str(home / "trackio")
    env.update(extra)
    return env


def _run_job(root: Path, run: str, mode: str, mlflow_store: Path | None, **env: str) -> Job:
    out = root / "runs"
    if mlflow_store is not None:  # an existing store, as every rank but the first opens (creating one takes seconds)
        (out / "mlruns").mkdir(parents=True)
        shutil.copyfile(mlflow_store, out / "mlruns" / "mlflow.db")
    proc = subprocess.run([sys.executable, str(DRIVER), str(out), run, str(STEPS), mode], check=False,
                          capture_output=True,
                          text=True, timeout=300, env=_env(root / "home", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return Job(out, out / run, proc.stderr)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path) -> Job:
    """One job with every local backend, verified at its end (`OTEL_TRAIN_VERIFY=1`). Without the exporter
    process's self-telemetry: ClearML merges its per-exporter series (`{exporter=X}` is lost from the series
    name), which verify reports as missing and duplicated points."""
    return _run_job(tmp_path_factory.mktemp("all"), "v", "plain", mlflow_store_template,
                    OTEL_TRAIN_EXPORTERS=ALL, OTEL_TRAIN_VERIFY="1", OTEL_TRAIN_SELF_METRICS="0")


def _verify(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    """`otel-train verify --json` and the text report: (exit status, JSON report, text)."""
    capsys.readouterr()
    code = cli_main(["verify", str(run_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert cli_main(["verify", str(run_dir)]) == code
    return code, report, capsys.readouterr().out


def _backend(report: dict[str, Any], name: str, rank: int = 0) -> dict[str, Any]:
    found = [b for b in report["backends"] if b["backend"] == name and b["rank"] == rank]
    assert len(found) == 1, report["backends"]
    return found[0]


def test_every_backend_holds_every_logged_value_once(job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, text = _verify(job.run_dir, capsys)
    assert code == 0, text
    assert sorted(b["backend"] for b in report["backends"]) == sorted(ALL.split(","))
    for b in report["backends"]:
        assert b["status"] == "pass", (b["backend"], b["reason"], text)
        assert b["missing"] == b["duplicated"] == b["wrong_value"] == b["unexpected"] == 0
    for name in ("jsonl", "tensorboard", "wandb", "mlflow", "clearml", "trackio"):
        b = _backend(report, name)
        # The user's series (5 x STEPS points) and the built-in ones (step time, phases, self-telemetry).
        assert b["expected"] >= len(USER_SERIES) * STEPS, (name, b)
        assert b["present"] == b["expected"], (name, b)
    assert _backend(report, "jsonl")["spans_expected"] == STEPS
    assert _backend(report, "chrome_trace")["spans_expected"] == STEPS
    assert f"rank 0 tensorboard: pass: {_backend(report, 'tensorboard')['expected']:,} expected" in text
    # The verdict of the job's own verify, in its summary line.
    summary = [line for line in job.stderr.splitlines() if line.startswith("otel-train: ")]
    assert len(summary) == 1 and "verify: pass (7 backends)" in summary[0], job.stderr[-2000:]


def test_the_record_holds_each_user_value_once(job: Job) -> None:
    """The expected side itself: the user's series, each step once, with the logged values (counter: its total)."""
    from otel_train.verify.expected import load

    plan = load(job.run_dir)[0]
    points = {k.tag: v for k, v in plan.backends["jsonl"].expected.points.items()}
    assert points["train/loss"] == [(s, 1.0 / (s + 1)) for s in range(STEPS)]
    assert points["eval/acc{split=val}"] == [(s, 0.5 + s / 1000) for s in range(STEPS)]
    assert points["samples"] == [(s, 8.0 * (s + 1)) for s in range(STEPS)]


def _tampered(job: Job, tmp_path: Path) -> Path:
    """A copy of the run folder, to alter (verify reads file backends in the folder it is given)."""
    copy = tmp_path / job.run_dir.name
    shutil.copytree(job.run_dir, copy)
    return copy


def _rewrite_jsonl(path: Path, change: Any) -> None:
    lines = path.read_text().splitlines()
    out: list[str] = []
    for line in lines:
        record = json.loads(line)
        out.extend(json.dumps(r) for r in change(record))
    path.write_text("\n".join(out) + "\n")


def test_points_removed_from_jsonl_are_missing(job: Job, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _tampered(job, tmp_path)
    _rewrite_jsonl(run_dir / "rank0.jsonl", lambda r: [] if r.get("tag") == "train/lr" and r["step"] in (3, 7)
                   else [r])
    code, report, text = _verify(run_dir, capsys)
    assert code == 1
    b = _backend(report, "jsonl")
    assert b["status"] == "fail" and b["missing"] == 2
    assert [(s["series"], s["missing"]) for s in b["series"]] == [("train/lr", [3, 7])]
    assert "`train/lr`: missing at steps 3, 7" in text
    assert _backend(report, "tensorboard")["status"] == "pass"  # the other backends are untouched


def test_replay_says_what_is_still_missing_when_the_spool_no_longer_has_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Values lost after every backend had acknowledged them (their spool segments are gone): replay cannot bring
    them back, and says so, with a non-zero exit, instead of "every backend up to date"."""
    job = _run_job(tmp_path, "gone", "plain", None, OTEL_TRAIN_EXPORTERS="jsonl,tensorboard")
    assert not list((job.run_dir / "spool" / "rank0").glob("*.seg"))  # every window acknowledged: none kept
    _rewrite_jsonl(job.run_dir / "rank0.jsonl", lambda r: [] if r.get("tag") == "train/lr" and r["step"] in (3, 7)
                   else [r])
    capsys.readouterr()
    assert cli_main(["replay", str(job.run_dir)]) == 1
    out = capsys.readouterr().out
    assert "rank 0 jsonl: 2 value(s) still missing after the replay, not in the spool" in out, out
    assert "`train/lr` at step 3, `train/lr` at step 7" in out, out
    assert "tensorboard: " not in out.split("still missing", 1)[1], out  # TensorBoard holds everything


def test_replay_says_a_backend_verify_still_fails_on_without_missing_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Spans lost from the trace after it had acknowledged them: no value is missing, but verify fails; replay
    said nothing and exited 0 (its check looked only at missing values)."""
    job = _run_job(tmp_path, "spans", "plain", None, OTEL_TRAIN_EXPORTERS="jsonl,chrome_trace")
    for trace in (job.run_dir / "trace").glob("rank0*.trace.json"):
        trace.write_text("[\n")  # every span gone, as a disk or a user could leave it
    capsys.readouterr()
    assert cli_main(["replay", str(job.run_dir)]) == 1
    out = capsys.readouterr().out
    assert "rank 0 chrome_trace: verify still fails after the replay" in out, out


def test_a_duplicated_and_a_changed_jsonl_point(job: Job, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _tampered(job, tmp_path)

    def change(r: dict[str, Any]) -> list[dict[str, Any]]:
        if r.get("tag") == "train/loss" and r["step"] == 4:
            return [r, r]
        if r.get("tag") == "eval/acc{split=val}" and r["step"] == 9:
            return [{**r, "value": 0.25}]
        return [r]

    _rewrite_jsonl(run_dir / "rank0.jsonl", change)
    code, report, text = _verify(run_dir, capsys)
    assert code == 1
    series = {s["series"]: s for s in _backend(report, "jsonl")["series"]}
    assert series["train/loss"]["duplicated"] == [4]
    assert series["eval/acc{split=val}"]["wrong_value"] == [[9, 0.5 + 9 / 1000, 0.25]]
    assert "`train/loss`: duplicated at steps 4" in text


def _tf_records(path: Path) -> list[bytes]:
    """The raw records of a TensorBoard event file (length, its CRC, data, the data's CRC), in file order."""
    data, out, off = path.read_bytes(), [], 0
    while off + 12 <= len(data):
        n = int.from_bytes(data[off:off + 8], "little")
        out.append(data[off:off + 12 + n + 4])
        off += 12 + n + 4
    return out


def test_tensorboard_records_cut_and_doubled(job: Job, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _tampered(job, tmp_path)
    (events,) = sorted(run_dir.glob("events.out.tfevents.*"))
    records = _tf_records(events)
    assert b"".join(records) == events.read_bytes()
    # The record of train/loss at step 5 twice; the file's last record gone.
    from tensorboard.compat.proto.event_pb2 import Event

    def holds(rec: bytes, tag: str, step: int) -> bool:
        event = Event.FromString(rec[12:-4])
        return event.step == step and any(v.tag == tag for v in event.summary.value)

    doubled = next(r for r in records if holds(r, "train/loss", 5))
    last = Event.FromString(records[-1][12:-4])
    events.write_bytes(b"".join(records[:-1]) + doubled)
    code, report, text = _verify(run_dir, capsys)
    assert code == 1
    b = _backend(report, "tensorboard")
    series = {s["series"]: s for s in b["series"]}
    assert 5 in series["train/loss"]["duplicated"]
    gone = {v.tag for v in last.summary.value}
    assert gone and all(last.step in series[tag]["missing"] for tag in gone), (gone, series)
    assert b["missing"] == len(gone)
    assert "rank 0 tensorboard: FAIL" in text


def test_a_span_removed_from_the_trace(job: Job, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _tampered(job, tmp_path)
    (trace,) = (run_dir / "trace").glob("rank0*.trace.json")
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    kept = [e for e in events if not (e.get("ph") == "X" and e.get("args", {}).get("train.step") == 12)]
    assert len(kept) == len(events) - 1
    # Written cut off, as a crash leaves it (no closing bracket): the reader still loads it.
    trace.write_text("[\n" + ",\n".join(json.dumps(e) for e in kept) + ",\n")
    code, report, text = _verify(run_dir, capsys)
    assert code == 1
    b = _backend(report, "chrome_trace")
    assert b["spans_missing"] == 1 and b["span_problems"] == {"step": [[12], []]}
    assert "span `step`: missing at steps 12" in text


def test_a_trace_gzip_cut_off_by_a_crash_is_read_up_to_the_cut(job: Job, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`OTEL_TRAIN_TRACE_GZIP=1` flushes whole events as it goes; a crash leaves the stream without its end marker,
    which `gzip` refuses (EOFError): verify read nothing and failed the trace, and replay then had nothing to go
    on. Read up to the cut, the trace's spans are all there."""
    import zlib

    run_dir = _tampered(job, tmp_path)
    (trace,) = (run_dir / "trace").glob("rank0*.trace.json")
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    packer = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    cut = packer.compress(("[\n" + ",\n".join(json.dumps(e) for e in events) + ",\n").encode())
    cut += packer.flush(zlib.Z_SYNC_FLUSH)  # as the writer flushes; no `flush()`: no end marker
    trace.unlink()
    trace.with_name(trace.name + ".gz").write_bytes(cut)
    code, report, _ = _verify(run_dir, capsys)
    b = _backend(report, "chrome_trace")
    assert (b["status"], b["spans_missing"], b["reason"]) == ("pass", 0, ""), b
    assert code == 0


def test_a_wandb_run_file_cut_off_mid_record_is_read_up_to_the_cut(job: Job, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk or a kill tears W&B's last record: verify read past the file's end (a protobuf DecodeError) and
    said only "cannot read it back", so replay could not tell what W&B lacked. Read as W&B reads it (up to the torn
    record), the values of the records before the cut are there and those after it are named missing."""
    run_dir = _tampered(job, tmp_path)
    for run_file in (run_dir / "wandb").rglob("*.wandb"):  # the run's folder and `latest-run` (copied, not linked)
        data = run_file.read_bytes()
        run_file.write_bytes(data[:len(data) * 2 // 3])  # mid-record, most likely; never past a whole file
    code, report, text = _verify(run_dir, capsys)
    b = _backend(report, "wandb")
    assert "cannot read it back" not in b["reason"], b
    assert code == 1 and b["status"] == "fail" and b["missing"] > 0, b
    assert 0 < b["missing"] < STEPS * len(USER_SERIES), b  # the part before the cut was read
    assert "wandb" in text


def test_nan_and_infinity_pass_where_a_backend_stores_them_otherwise(
        tmp_path: Path, mlflow_store_template: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MLflow stores ±inf as ±1.8e308 and ClearML NaN and ±inf as 0 (docs/backends.md): verify compared the logged
    value and failed both ("1.797e308 instead of inf"); it now compares with what the backend stores."""
    job = _run_job(tmp_path, "odd", "nonfinite", mlflow_store_template, OTEL_TRAIN_EXPORTERS="jsonl,mlflow,clearml",
                   OTEL_TRAIN_SELF_METRICS="0")
    code, report, text = _verify(job.run_dir, capsys)
    assert {b["backend"]: b["status"] for b in report["backends"]} == {"jsonl": "pass", "mlflow": "pass",
                                                                      "clearml": "pass"}, text
    assert code == 0


UNREACHABLE = """
import sys
import otel_train as ot
ot.init(exporters=["jsonl", "otlp"], dir=sys.argv[1], run_name="unreachable", shutdown_timeout_s=1.0)
for s in ot.steps(range(10)):
    ot.log({"train/loss": float(s)})
ot.shutdown()
"""


def test_a_backend_that_cannot_be_read_back_fails_when_the_spool_knows_it_lacks_windows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A backend verify cannot read (a collector, a server: W&B online, MLflow or ClearML with a server) was "not
    checked" and the run passed, while the spool knew it had acknowledged none of the run's windows. Now it fails,
    naming the windows and `otel-train replay`. Here: `otlp` to an endpoint where nothing listens."""
    script = tmp_path / "unreachable.py"
    script.write_text(UNREACHABLE)
    env = _env(tmp_path / "home", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
               OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_TRAIN_DRAIN_TIMEOUT_S="1")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    code, report, _ = _verify(tmp_path / "runs" / "unreachable", capsys)
    assert _backend(report, "jsonl")["status"] == "pass"
    otlp = _backend(report, "otlp")
    assert otlp["status"] == "fail" and "never acknowledged 10 window(s)" in otlp["reason"], otlp
    assert code == 1


def test_no_record_is_not_a_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = _verify(tmp_path, capsys)
    assert code == 2 and not report["ok"] and "no record" in report["problem"]


@pytest.fixture(scope="module")
def accounted(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """A job whose backends lack values for a reason: a routing rule, and a step going backwards."""
    return _run_job(tmp_path_factory.mktemp("rules"), "r", "backwards", None,
                    OTEL_TRAIN_EXPORTERS="jsonl,tensorboard", OTEL_TRAIN_JSONL_EXCLUDE="train/lr",
                    OTEL_TRAIN_VERIFY="record")


def test_rows_skipped_by_rule_or_counted_are_accounted(accounted: Job, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, text = _verify(accounted.run_dir, capsys)
    assert code == 0, text
    jsonl = _backend(report, "jsonl")
    assert jsonl["status"] == "pass" and jsonl["skipped_by_rule"] == STEPS  # train/lr never reached it, by rule
    assert jsonl["missing"] == 0
    tb = _backend(report, "tensorboard")
    # TensorBoard skips the step going backwards and counts it: missing, but accounted for.
    assert tb["status"] == "pass" and tb["missing"] == 1 and tb["lost"] == {"step_order": 1}
    assert [(s["series"], s["missing"]) for s in tb["series"]] == [("train/loss", [1])]
    assert "not written: 1 step_order" in text


def test_a_record_past_its_cap_says_where_checking_stops(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    job = _run_job(tmp_path, "c", "plain", None, OTEL_TRAIN_EXPORTERS="jsonl", OTEL_TRAIN_EXPORT_INTERVAL_S="0.01",
                   OTEL_TRAIN_VERIFY="record", OTEL_TRAIN_VERIFY_RECORD_MB="0.002")
    assert "OTEL_TRAIN_VERIFY_RECORD_MB" in job.stderr  # warned once, naming the setting
    code, report, text = _verify(job.run_dir, capsys)
    b = _backend(report, "jsonl")
    stop = b["not_checked_past"]
    assert stop is not None and 0 <= stop < STEPS - 1, b
    assert code == 0 and b["status"] == "pass" and b["missing"] == 0
    assert f"not checked past step {stop}" in text


def test_in_process_backends_are_recorded_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Backends in the training process (`OTEL_TRAIN_EXPORT_PROCESS=off`) are fed by the same delivery: recorded."""
    job = _run_job(tmp_path, "p", "plain", None, OTEL_TRAIN_EXPORTERS="jsonl,tensorboard",
                   OTEL_TRAIN_EXPORT_PROCESS="off", OTEL_TRAIN_VERIFY="on")
    assert "verify: pass (2 backends)" in job.stderr
    code, report, text = _verify(job.run_dir, capsys)
    assert code == 0, text
    for name in ("jsonl", "tensorboard"):
        b = _backend(report, name)
        assert b["expected"] >= len(USER_SERIES) * STEPS and b["present"] == b["expected"], b


def _killed_job(tmp_path: Path, run: str, exporters: str = "jsonl,tensorboard", **fault: str) -> Path:
    """The driver's job (`exporters`, recorded) with `fault` set, killed whole by it; its run folder."""
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(DRIVER), str(out), run, str(STEPS), "plain"], check=False,
                          capture_output=True, text=True, timeout=300,
                          env=_env(tmp_path / "home", OTEL_TRAIN_EXPORTERS=exporters, OTEL_TRAIN_VERIFY="record",
                                   **fault))
    assert proc.returncode == -9, proc.stderr[-3000:]
    return out / run


def test_a_job_killed_whole_is_complete_after_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every process of the job killed (the exporter process right after a TensorBoard write at step >= 10, before
    it is recorded; its restart and the training process's fallback likewise): verify finds nothing but missing
    values, and after `otel-train replay` every recorded value is in JSONL and TensorBoard once."""
    run_dir = _killed_job(tmp_path, "k", OTEL_TRAIN_TEST_KILL_AFTER_WRITE="tensorboard@10")
    code, report, text = _verify(run_dir, capsys)
    for b in report["backends"]:
        assert b["duplicated"] == b["wrong_value"] == b["unexpected"] == 0, text
    assert cli_main(["replay", str(run_dir)]) == 0
    code, report, text = _verify(run_dir, capsys)
    assert code == 0, text
    from otel_train.verify.expected import load

    loss = next(v for k, v in load(run_dir)[0].backends["jsonl"].expected.points.items() if k.tag == "train/loss")
    assert [s for s, _ in loss][:11] == list(range(11))  # the record holds the steps up to the kill at least
    for name in ("jsonl", "tensorboard"):
        b = _backend(report, name)
        # A window the training process recorded just before it was killed, its spool never holding it, died
        # with the job (as one still in its memory would): counted as such, not failed.
        in_flight = b["lost"].get(KILLED_IN_FLIGHT, 0)
        assert b["present"] + b["missing"] == b["expected"] > 0 and b["missing"] <= in_flight, b


def test_a_backend_a_killed_job_never_had_up_is_checked_after_replay(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The job killed whole at step 5 while MLflow was still starting (held: a client slower to import than the job
    lived): the record was written before MLflow was up, yet names its store, so after `otel-train replay` verify
    reads MLflow back and finds every recorded value there once (not "not checked")."""
    run_dir = _killed_job(tmp_path, "m", "jsonl,mlflow", OTEL_TRAIN_TEST_KILL_AFTER_WRITE="jsonl@5",
                          OTEL_TRAIN_TEST_HOLD_START="mlflow")
    assert not (run_dir.parent / "mlruns").exists()  # MLflow never opened its store before the kill
    assert cli_main(["replay", str(run_dir)]) == 0
    code, report, text = _verify(run_dir, capsys)
    assert code == 0, text
    b = _backend(report, "mlflow")
    assert b["status"] == "pass" and b["where"].endswith("mlflow.db"), (b, text)
    assert b["present"] + b["missing"] == b["expected"] >= len(USER_SERIES) * 5, b
    assert b["missing"] <= b["lost"].get(KILLED_IN_FLIGHT, 0), b
    assert b["duplicated"] == b["wrong_value"] == b["unexpected"] == 0, b


def test_a_window_recorded_by_a_job_killed_before_its_spool_held_it_is_counted_lost_to_the_kill(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every writer killed between recording window 6 and spooling it (the exporter process, its restart, the
    training process's fallback): no spool holds it and nobody can send it again. Verify says so, per backend, and
    counts it as lost to the kill; everything else is there once after `otel-train replay`."""
    run_dir = _killed_job(tmp_path, "r", OTEL_TRAIN_TEST_KILL_AFTER_RECORD="6")  # a loaded machine makes 10 windows, not 16
    assert cli_main(["replay", str(run_dir)]) == 0
    code, report, text = _verify(run_dir, capsys)
    assert code == 0, text
    for name in ("jsonl", "tensorboard"):
        b = _backend(report, name)
        in_flight = b["lost"].get(KILLED_IN_FLIGHT, 0)
        assert 0 < b["missing"] <= in_flight and b["present"] + b["missing"] == b["expected"], b
        assert b["duplicated"] == b["wrong_value"] == b["unexpected"] == 0, b
        assert f"not written: {in_flight:,} {KILLED_IN_FLIGHT}" in text, text


def test_a_forked_childs_values_are_recorded_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A child process's values reach the backends in side windows (not spooled): they are recorded as delivered."""
    job = _run_job(tmp_path, "f", "fork", None, OTEL_TRAIN_EXPORTERS="jsonl,tensorboard", OTEL_TRAIN_VERIFY="on")
    code, report, text = _verify(job.run_dir, capsys)
    assert code == 0, text
    from otel_train.verify.expected import load

    points = load(job.run_dir)[0].backends["jsonl"].expected.points
    child = sorted(p for k, v in points.items() if k.name == "data/x" for p in v)
    assert child == [(5, 105.0), (15, 115.0)]
    # Removed from the JSONL file, they are missing there.
    _rewrite_jsonl(job.run_dir / "rank0.jsonl", lambda r: [] if r.get("name") == "data/x" and r["step"] == 15 else [r])
    code, report, text = _verify(job.run_dir, capsys)
    assert code == 1
    (series,) = _backend(report, "jsonl")["series"]
    assert series["missing"] == [15] and series["series"].startswith("data/x{worker=")
