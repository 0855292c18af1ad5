"""The `otel-train` command: `demo`, `trace merge`, `replay`, `verify`, `hangs`, `sink`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from otel_train.ship.store_env import STORE_VARIABLES

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import otel_train as ot
    from otel_train.config.settings import load_settings
    from otel_train.demo import train

    session = ot.init(dir=args.dir, run_name=args.run_name)
    loss = train(steps=args.steps)
    ot.shutdown()
    run = session.run
    if not session.enabled or run is None:
        sys.stdout.write("otel-train is disabled (OTEL_TRAIN_DISABLED / OTEL_SDK_DISABLED); nothing was written\n")
        return 0
    settings = load_settings(dir=args.dir, run_name=args.run_name)  # what `init` resolved, read the same way
    run_dir = Path(settings.dir) / run.run_name
    lines = [f"trained {args.steps} steps, final loss {loss:.4f}; run {run.run_name!r}"]
    names = settings.exporters
    if "tensorboard" in names:
        lines.append(f"  curves:   tensorboard --logdir {settings.dir}")
    if "chrome_trace" in names:
        trace = f"rank{run.rank}.trace.json" + (".gz" if settings.trace_gzip else "")
        lines.append(f"  timeline: open {run_dir / 'trace' / trace} in https://ui.perfetto.dev")
    if "jsonl" in names:
        lines.append(f"  records:  {run_dir / f'rank{run.rank}.jsonl'}")
    others = [n for n in names if n not in ("tensorboard", "chrome_trace", "jsonl")]
    if others:
        lines.append(f"  also sent to: {', '.join(others)}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _trace_merge(args: argparse.Namespace) -> int:
    from otel_train.trace_merge import merge_traces

    if not args.files and not args.profiler:
        sys.stderr.write("otel-train: error: trace merge: give trace files and/or --profiler FILE\n")
        return 2
    count = merge_traces(args.out, args.files, args.profiler)
    n = len(args.files) + len(args.profiler)
    sys.stdout.write(f"merged {count} events from {n} file(s) into {args.out}\n")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from otel_train.ship.export_process import replay

    before = _verify_report(args.run_dir)
    wanted = None
    if before is not None:
        from otel_train.verify.wanted import rows_missing

        logging.getLogger("otel_train").info("replay: each backend verify could check gets only what it lacks")
        wanted = rows_missing(before)
    results = replay(args.run_dir, timeout_s=args.timeout, stall_s=args.stall, report_every_s=args.report_every,
                     allow_outside=args.allow_outside, wanted=wanted, overrides=_overrides(args.overrides))
    if not results:
        sys.stdout.write(f"nothing to replay: no spool under {args.run_dir}\n")
        return 0
    behind = False
    for name, progress in results.items():
        if progress.behind():
            behind = True
            sys.stdout.write(f"{name}: {progress.summary()}; missing, kept in {args.run_dir / 'spool' / name} for "
                             "the next `otel-train replay`\n")
        else:
            sys.stdout.write(f"{name}: {progress.summary()}\n")
    if before is not None and not before.ok and not behind:  # verify found some missing: is any still?
        behind = _still_missing(args.run_dir)
    return 1 if behind else 0


def _still_missing(run_dir: Path) -> bool:
    """After a replay that delivered everything its spools held: whether verify still fails (values missing that
    the spool no longer had, a store it cannot read back); says which, per rank and backend."""
    after = _verify_report(run_dir)
    if after is None:
        return False
    failing = [b for b in after.backends if b.status == "fail"]
    for b in failing:
        if not b.missing:  # e.g. a store verify cannot read back: replay cannot tell it is whole
            why = b.reason or "duplicated or unexpected values"
            sys.stdout.write(f"rank {b.rank} {b.backend}: verify still fails after the replay ({why}); "
                             f"`otel-train verify {run_dir}` says why\n")
            continue
        points = b.missing_points()
        shown = ", ".join(f"`{series}` at step {step}" for series, step in points[:5])
        sys.stdout.write(f"rank {b.rank} {b.backend}: {b.missing} value(s) still missing after the replay, not in "
                         f"the spool (e.g. {shown}); `otel-train verify {run_dir}` lists them\n")
    return bool(failing)


def _overrides(pairs: list[str]) -> dict[str, str]:
    """``--set NAME=VALUE`` pairs; a name that is no store variable fails in one line."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in STORE_VARIABLES:
            raise SystemExit(f"otel-train replay: --set {pair!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(STORE_VARIABLES)}")
        out[name] = value
    return out


def _verify_report(run_dir: Path) -> Any:
    """`otel-train verify`'s report of the run when it kept a record; else None (replay follows the cursors).

    Verify runs in a process of its own: reading a store back imports its client, and one that fixes its store at
    import (Trackio) would then make replay write to the store of this shell, not the run's."""
    import json
    import subprocess

    from otel_train.verify.wanted import report_from_json

    if not (run_dir / "verify").is_dir():
        return None
    try:
        done = subprocess.run([sys.executable, "-m", "otel_train.cli", "verify", "--json", str(run_dir)],
                              capture_output=True, text=True, timeout=600, check=False)
        report = report_from_json(json.loads(done.stdout))
    except (OSError, ValueError, subprocess.SubprocessError) as err:  # replay as the cursors say
        logging.getLogger("otel_train").warning("replay: cannot verify %s (%s: %s); every backend gets what its "
                                                "cursor says it lacks", run_dir, type(err).__name__, err)
        return None
    return None if report.problem else report


def _verify(args: argparse.Namespace) -> int:
    import json

    from otel_train.verify import check, format_report

    report = check(args.run_dir)
    if args.json:
        sys.stdout.write(json.dumps(report.to_json(), indent=1, default=str) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
    return report.exit_code


def _hangs(args: argparse.Namespace) -> int:
    import json

    from otel_train.hangs.hang_file import read_hang_files
    from otel_train.hangs.roll_call import take_roll_call

    files = read_hang_files(args.run_dir)
    if not files:
        sys.stderr.write(f"otel-train: error: hangs: no hang files under {args.run_dir / 'hang'} (is this a run "
                         "folder, OTEL_TRAIN_DIR/<run name>? OTEL_TRAIN_HANG_AFTER_S=0 writes none)\n")
        return 2
    call = take_roll_call(files)
    if args.json:
        sys.stdout.write(json.dumps(call.to_json(), indent=1, default=str) + "\n")
    else:
        sys.stdout.write(call.text(str(args.run_dir)) + "\n")
    return 1 if call.stuck else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-train", description="OpenTelemetry for training loops.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny NumPy model and write TensorBoard curves + a trace")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    demo.add_argument("--dir", default=None, help="output directory (default: OTEL_TRAIN_DIR or ./otel-train-runs)")
    demo.add_argument("--run-name", default=None, help="run name (default: OTEL_TRAIN_RUN_NAME or the run id)")
    demo.set_defaults(func=_demo)

    trace = sub.add_parser("trace", help="Chrome trace tools")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    merge = trace_sub.add_parser("merge", help="merge per-rank trace files (and torch profiler traces) into one")
    merge.add_argument("out", type=Path, help="the merged trace file to write (.json, or .json.gz compressed)")
    merge.add_argument("files", type=Path, nargs="*", help="per-rank trace files (rank<N>.trace.json[.gz])")
    merge.add_argument("--profiler", type=Path, action="append", default=[], metavar="FILE",
                       help="a torch profiler Chrome trace to align with ours (repeatable; rank from its "
                            "distributedInfo, else 0)")
    merge.set_defaults(func=_trace_merge)

    replay = sub.add_parser("replay", help="deliver what a run's exporter process had spooled but not delivered",
                            description="Feed every backend the spooled windows it has not acknowledged, for every "
                                        "rank of the run folder. Safe to run twice: each backend resumes after its "
                                        "cursor.")
    replay.add_argument("run_dir", type=Path, help="the run folder (OTEL_TRAIN_DIR/<run name>)")
    replay.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the backends (default 600)")
    replay.add_argument("--stall", type=float, default=60.0,
                        help="give up on a backend after this many seconds without progress (default 60)")
    replay.add_argument("--report-every", type=float, default=10.0,
                        help="seconds between the messages saying what is left per rank and backend (default 10)")
    replay.add_argument("--allow-outside", action="store_true",
                        help="write where the run's exporters.json says even outside the folder holding the run "
                             "(its directory, a recorded MLflow URI, Trackio, W&B or ClearML folder); default: refuse")
    replay.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="overrides",
                        help="use this store variable instead of the one the run recorded at init() (repeatable; "
                             "e.g. WANDB_MODE=offline to keep a run whose W&B was online and failed): "
                             + ", ".join(STORE_VARIABLES))
    replay.set_defaults(func=_replay)

    verify = sub.add_parser("verify", help="check that every local backend holds what the run logged",
                            description="Read every local backend of the run back with its own reader and compare it, "
                                        "as lists of (step, value), with the run's record of what was logged. "
                                        "Exit 0 when every value is present once or accounted for (refused, "
                                        "skipped by a routing rule, counted as not written); 1 when a backend "
                                        "misses, duplicates or alters values; 2 when the run has no record.")
    verify.add_argument("run_dir", type=Path, help="the run folder (OTEL_TRAIN_DIR/<run name>)")
    verify.add_argument("--json", action="store_true", help="print the report as JSON (for tools)")
    verify.set_defaults(func=_verify)

    hangs = sub.add_parser("hangs", help="the roll call: which ranks are stuck where, and which one to look at",
                           description="Read every rank's hang/rank<N>.json (written by the hang watchdog) and group "
                                       "the stuck ranks by (open span, innermost frame of the main thread); name the "
                                       "odd ones out and the ranks that stopped writing. Exit 0 when no rank is "
                                       "stuck, 1 when some are (or have stopped), 2 when the run has no hang files.")
    hangs.add_argument("run_dir", type=Path, help="the run folder (OTEL_TRAIN_DIR/<run name>)")
    hangs.add_argument("--json", action="store_true", help="print the roll call as JSON (for tools)")
    hangs.set_defaults(func=_hangs)

    try:
        from otel_train.sink import cli as sink_cli
    except ImportError:
        sink_cli = None  # type: ignore[assignment]
    if sink_cli is not None:
        sink = sub.add_parser("sink", help="receive OTLP from a collector and write every run to the backends",
                              description=sink_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        sink_cli.add_arguments(sink)
        sink.set_defaults(func=sink_cli.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    from otel_train.errors import OtelTrainError

    logging.basicConfig(level=logging.INFO, format="otel-train: %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OtelTrainError as err:
        sys.stderr.write(f"otel-train: error: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
