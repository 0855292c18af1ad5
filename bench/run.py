"""The benchmark suite: every tool in its own process, the same loop, one table.

    python bench/run.py            # 10,000 steps per fast row (~6 min on 2 cores)
    python bench/run.py --quick    # 1,000 steps per row (< 2 min)

Per step: 20 scalars and 4 timing regions (see `_loop.py`), then `--gap-us` of sleep that stands for
the device's share of the step (the GIL is free, as while a training thread waits on the GPU).
Slow clients (MLflow sync, ClearML) run fewer steps (`--slow-steps`); their per-step numbers are
still per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: (tool id for worker.py, slow client?)
ROWS: list[tuple[str, bool]] = [
    ("floor", False),
    ("ot", False),
    ("raw-otel", False),
    ("tb-writer", False),
    ("tensorboardx", False),
    ("wandb", False),
    ("clearml", True),
    ("clearml-nosub", True),
    ("mlflow-sync", True),
    ("mlflow-async", True),
    ("trackio", False),
    ("ot:tensorboard", False),
    ("ot:tensorboard,chrome_trace", False),
    ("ot:wandb", False),
    ("ot:clearml", False),
    ("ot:mlflow", False),
    ("ot:trackio", False),
]
DIRECT_OF = {"ot:tensorboard": "tb-writer", "ot:wandb": "wandb", "ot:clearml": "clearml-nosub",
             "ot:mlflow": "mlflow-async", "ot:trackio": "trackio"}


def isolated_env(root: Path) -> dict[str, str]:
    """Every backend writes under `root`: no user config, no network."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "CLEARML_", "TRAINS_", "MLFLOW_", "TRACKIO_", "OTEL_TRAIN_", "OTEL_SDK"))}
    env.update({
        "HOME": str(root / "home"), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"), "WANDB_DISABLE_GIT": "true",
        "CLEARML_CONFIG_FILE": str(root / "clearml.conf"), "CLEARML_CACHE_DIR": str(root / "clearml-cache"),
        "TRACKIO_DIR": str(root / "trackio"), "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def run_row(tool: str, steps: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    root = tmp / tool.replace(":", "_").replace(",", "+")
    root.mkdir(parents=True)
    cmd = [sys.executable, str(HERE / "worker.py"), tool, "--steps", str(steps), "--gap-us", str(args.gap_us),
           "--warmup", str(args.warmup), "--dir", str(root)]
    t0 = time.perf_counter()
    # Own session: on a timeout the whole group goes (ClearML and W&B start helper processes).
    proc = subprocess.Popen(cmd, env=isolated_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        loop = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("LOOP ")]
        if not loop:
            return {"tool": tool, "error": f"timed out after {args.timeout_s:g} s"}
        out = {**loop[0], "tool": tool, "name": tool, "bg_cpu_us": None, "close_s": None, "landed": None,
               "expected": loop[0]["total_steps"] * 20, "row_s": time.perf_counter() - t0,
               "note": f"flush/close > {args.timeout_s:g} s: killed"}
        return out
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            out: dict[str, Any] = json.loads(line[7:])
            out["tool"] = tool
            out["row_s"] = time.perf_counter() - t0
            return out
    tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
    missing = "No module named 'otel_train.exporters." in stderr or "unknown exporter" in stderr
    return {"tool": tool, "error": "n/a (exporter missing)" if missing and tool.startswith("ot:") else tail[0][:160]}


def fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["tool"] == "ot" and "error" not in r), None)
    head = ("| row | steps | µs/step mean | p99 | regions µs | log µs | train CPU µs/step | bg CPU µs/step "
            "| flush+close s | peak RSS MB | landed/expected | × ot |")
    lines = [head, "|" + "|".join(["---"] * 12) + "|"]
    for r in results:
        name = r.get("name", r["tool"])
        if "error" in r:
            lines.append(f"| {r['tool']} | {r['error']} |" + " |" * 10)
            continue
        landed = "n/c" if r.get("landed") is None else f"{r['landed']:,}/{r['expected']:,}"
        close = fmt(r["close_s"], 2) if r.get("close_s") is not None else "killed"
        ratio = f"{r['mean_us'] / base['mean_us']:.2f}" if base else "—"
        lines.append(
            f"| {name} | {r['steps']:,} | {fmt(r['mean_us'])} | {fmt(r['p99_us'])} | {fmt(r['span_us'])} "
            f"| {fmt(r['log_us'])} | {fmt(r['train_cpu_us'])} | {fmt(r['bg_cpu_us'])} | {close} "
            f"| {fmt(r['peak_rss_mb'], 0)} | {landed} | {ratio} |")
    return "\n".join(lines)


def targets(results: list[dict[str, Any]], step_ms: float) -> list[str]:
    by = {r["tool"]: r for r in results if "error" not in r}
    out: list[str] = []

    def check(label: str, ok: bool, detail: str) -> None:
        out.append(f"- [{'met' if ok else 'MISSED'}] {label}: {detail}")

    ot, floor = by.get("ot"), by.get("floor")
    if ot and floor:
        check("ot.log of 20 scalars ≤ 3× the list.append floor", ot["log_us"] <= 3 * floor["log_us"],
              f"{ot['log_us']:.1f} µs vs {floor['log_us']:.1f} µs ({ot['log_us'] / floor['log_us']:.2f}×)")
    if ot and "tb-writer" in by:
        tb = by["tb-writer"]
        check("ot.log ≤ 1/3 of TensorBoard's event writer", ot["log_us"] <= tb["log_us"] / 3,
              f"{ot['log_us']:.1f} µs vs {tb['log_us']:.1f} µs ({tb['log_us'] / ot['log_us']:.1f}× faster)")
    if ot and "raw-otel" in by:
        raw = by["raw-otel"]
        check("4 ot.span ≤ 1/5 of 4 raw OTel spans", ot["span_us"] <= raw["span_us"] / 5,
              f"{ot['span_us']:.1f} µs (incl. ot.step enter) vs {raw['span_us']:.1f} µs "
              f"({raw['span_us'] / ot['span_us']:.1f}× faster)")
        check("ot.log ≤ 1/10 of 20 raw gauge.set", ot["log_us"] <= raw["log_us"] / 10,
              f"{ot['log_us']:.1f} µs vs {raw['log_us']:.1f} µs")
    if ot:
        for tool, direct in DIRECT_OF.items():
            r = by.get(tool)
            if r is None:
                continue
            same = r["train_cpu_us"] <= ot["train_cpu_us"] * 1.25 and r["mean_us"] <= ot["mean_us"] * 1.25
            check(f"{r['name']} costs the training thread what ot.log does (±25%)", same,
                  f"{r['mean_us']:.1f} vs {ot['mean_us']:.1f} µs/step wall, {r['train_cpu_us']:.1f} vs "
                  f"{ot['train_cpu_us']:.1f} µs CPU")
            if r.get("landed") is not None:
                check(f"{r['name']}: every value lands", r["landed"] == r["expected"],
                      f"{r['landed']:,}/{r['expected']:,}")
            d = by.get(direct)
            if d:
                check(f"{r['name']}: the log call ≤ 1/10 of {d['name']}'s", r["log_us"] <= d["log_us"] / 10,
                      f"{r['log_us']:.1f} vs {d['log_us']:.1f} µs ({d['log_us'] / r['log_us']:.1f}×); whole step "
                      f"{r['mean_us']:.1f} vs {d['mean_us']:.1f} µs ({d['mean_us'] / r['mean_us']:.1f}×)")
    whole = by.get("ot:tensorboard,chrome_trace")
    if whole:
        budget = step_ms * 1000 * 0.005
        check(f"whole step (20 scalars + 4 spans, TB + trace) ≤ 0.5% of a {step_ms:g} ms step ({budget:.0f} µs)",
              whole["mean_us"] <= budget,
              f"{whole['mean_us']:.1f} µs on the training thread; with the export threads' CPU "
              f"{whole['mean_us'] + whole['bg_cpu_us']:.1f} µs")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1,000 steps per row (100 for slow clients), 30 s per row at most")
    p.add_argument("--steps", type=int, default=None, help="steps per fast row (default 10,000)")
    p.add_argument("--slow-steps", type=int, default=None, help="steps for MLflow sync / ClearML (default 1,000)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gap-us", type=float, default=200.0, help="simulated device time per step (sleep)")
    p.add_argument("--only", default="", help="comma list of row ids to run")
    p.add_argument("--timeout-s", type=float, default=None, help="per row (default 600; 30 with --quick)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    p.add_argument("--keep", action="store_true", help="keep the backends' files")
    args = p.parse_args()
    steps = args.steps or (1_000 if args.quick else 10_000)
    slow = args.slow_steps or (100 if args.quick else 1_000)
    if args.timeout_s is None:
        args.timeout_s = 30.0 if args.quick else 600.0
    if args.quick:
        args.warmup = min(args.warmup, 50)
    only = {s for s in args.only.split(",") if s}
    tmp = Path(tempfile.mkdtemp(prefix="otel-train-bench-"))
    results = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for tool, is_slow in ROWS:
            if only and tool not in only:
                continue
            r = run_row(tool, slow if is_slow else steps, args, tmp)
            results.append(r)
            sys.stderr.write(f"{tool:32s} " + (r.get("error") or f"{r['mean_us']:9.1f} µs/step  ({r['row_s']:.0f} s)") + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"otel-train bench, {started}, {machine}; gap {args.gap_us:g} µs/step, warm-up {args.warmup} steps\n")
    print(table(results))
    print("\nTargets:")
    print("\n".join(targets(results, 20.0)))
    if args.json:
        args.json.write_text(json.dumps({"started": started, "machine": machine, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
