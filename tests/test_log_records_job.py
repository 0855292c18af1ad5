"""The issue's check, end to end: a job (rank 1 of 2, backends in the exporter process) that logs warnings at
known steps, whose DataLoader worker logs and raises, and whose main thread finally raises uncaught: every record
in JSONL and in the Chrome trace, at its step and rank, with the exception's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.trace_merge import load_trace

JOB = textwrap.dedent("""
    import logging, sys
    import torch
    from torch.utils.data import DataLoader, Dataset, Subset
    import otel_train as ot

    log = logging.getLogger("job")

    class Samples(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 2:
                logging.getLogger("job.data").warning("odd sample %d", i)
            if i == 6:
                raise ValueError("corrupt sample 6")
            return torch.tensor(float(i))

    ot.init(exporters="jsonl,chrome_trace", dir=sys.argv[1], run_name="logs")
    # Epoch one: samples 0-5 at steps 0-5; its worker warns at sample 2 (and exits at the epoch's end).
    for batch in ot.steps(DataLoader(Subset(Samples(), range(6)), batch_size=1, num_workers=1), start=0):
        if int(batch) in (1, 4):
            log.warning("loss spiked at sample %d", int(batch))
    # Epoch two: its worker raises on its first sample, before step 6 is entered.
    try:
        for batch in ot.steps(DataLoader(Subset(Samples(), [6, 7]), batch_size=1, num_workers=1)):
            pass
    except ValueError:
        log.exception("data loading failed")
    with ot.step(7):
        raise RuntimeError("diverged")
""")


def _run_job(tmp_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", OTEL_TRAIN_RUN_ID="job-1", OTEL_TRAIN_QUIET="1")
    out = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=180,
                         env=env, check=False)
    assert out.returncode == 1 and "RuntimeError: diverged" in out.stderr, out.stderr  # the traceback still printed
    records = [r for r in read_jsonl(jsonl_path(runs, "logs", 1)) if r["type"] == "log"]
    (trace,) = (runs / "logs" / "trace").glob("rank1*.trace.json")
    events = [e for e in load_trace(trace) if e.get("cat") == "log"]
    return records, events, out.stderr


def test_every_record_reaches_jsonl_and_the_trace_at_its_step_and_rank(tmp_path: Path) -> None:
    records, events, stderr = _run_job(tmp_path)
    by_body = {r["body"]: r for r in records}
    assert {r["rank"] for r in records} == {1} and {r["run_id"] for r in records} == {"job-1"}
    # Warnings of the training loop at their steps (sample i is step i).
    assert [(r["step"], r["severity_text"]) for r in records if r["body"].startswith("loss spiked")] == [
        (1, "WARNING"), (4, "WARNING")]
    # The DataLoader worker's warning, through the worker channel, at the trainer's step then (prefetched).
    worker = by_body["odd sample 2"]
    assert worker["attributes"]["worker"] == 0 and 0 <= worker["step"] <= 2
    # The worker's exception, re-raised in the main thread and logged there, with the worker's traceback.
    failed = by_body["data loading failed"]
    assert failed["step"] == 5 and failed["severity_text"] == "ERROR"  # the latest step entered
    assert "corrupt sample 6" in failed["attributes"]["exception.message"]
    assert 'raise ValueError("corrupt sample 6")' in failed["attributes"]["exception.message"]  # worker's frames
    # The main thread's uncaught exception: FATAL, at its step, with its traceback.
    (fatal,) = [r for r in records if r["logger"] == "otel_train.uncaught"]
    assert (fatal["step"], fatal["severity_text"]) == (7, "FATAL")
    assert fatal["attributes"]["exception.type"] == "RuntimeError"
    assert 'raise RuntimeError("diverged")' in fatal["attributes"]["exception.stacktrace"]
    # The same records in the trace: instant events on the rank's track, message, level and step in args.
    assert sorted((e["args"]["message"], e["args"].get("train.step"), e["pid"]) for e in events) == sorted(
        (r["body"], r["step"], 1) for r in records)
    assert all(e["ph"] == "i" and e["s"] == "t" for e in events)
    worker_event = next(e for e in events if e["args"]["message"] == "odd sample 2")
    main_event = next(e for e in events if e["args"]["message"] == "loss spiked at sample 1")
    assert worker_event["tid"] != main_event["tid"]  # the worker's own track
    assert "Traceback" in next(e for e in events if e["args"]["logger"] == "otel_train.uncaught")["args"][
        "exception.stacktrace"]
    assert "loss spiked at sample 1" in stderr  # Python still prints what no handler of the job's takes


def test_output_lines_are_captured_when_asked(tmp_path: Path) -> None:
    script = tmp_path / "out.py"
    script.write_text(textwrap.dedent("""
        import logging, sys
        import otel_train as ot
        ot.init(exporters="jsonl", dir=sys.argv[1], run_name="out")
        with ot.step(3):
            print("epoch 3 done")
            logging.getLogger("job").warning("printed by Python, captured once")
            print("partial", end="")
            sys.stderr.write("cuda warning\\n")
        ot.shutdown()
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRAIN_CAPTURE_OUTPUT="1", OTEL_TRAIN_QUIET="1")
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                         timeout=120, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "epoch 3 done\npartial" and "cuda warning" in out.stderr  # still printed
    assert "printed by Python, captured once" in out.stderr
    records = [r for r in read_jsonl(jsonl_path(tmp_path / "runs", "out", 0)) if r["type"] == "log"]
    assert [(r["logger"], r["step"], r["severity_text"], r["body"]) for r in records] == [
        ("stdout", 3, "INFO", "epoch 3 done"), ("job", 3, "WARNING", "printed by Python, captured once"),
        ("stderr", 3, "WARN", "cuda warning"), ("stdout", 3, "INFO", "partial")]
