"""The phases budget: wall time per step with phases + the system sampler on vs off (target <= 1 %).

    python bench/phases_overhead.py                       # 5,000 steps per run, 3 interleaved pairs
    python bench/phases_overhead.py --steps 20000 --tool ot:tensorboard --gap-us 1000

Each run is the real-loop benchmark row (`worker.py`: per step 4 spans and one `ot.log` of 20 scalars,
then `--gap-us` of sleep standing for the device) in its own process; "off" sets `OTEL_TRAIN_PHASES=0`,
"on" sets `OTEL_TRAIN_PHASES=1 OTEL_TRAIN_SYSTEM_METRICS=1` (1 s interval, the default). Runs alternate
off/on so load changes hit both; the result is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run import HERE, isolated_env

MODES = {"off": {"OTEL_TRAIN_PHASES": "0"},
         "on": {"OTEL_TRAIN_PHASES": "1", "OTEL_TRAIN_SYSTEM_METRICS": "1"}}


def run_once(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True)
    env = {**isolated_env(root), **MODES[mode], "OTEL_TRAIN_QUIET": "1"}
    cmd = [sys.executable, str(HERE / "worker.py"), args.tool, "--steps", str(args.steps), "--gap-us",
           str(args.gap_us), "--warmup", str(args.warmup), "--dir", str(root)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    raise RuntimeError(f"{mode}: no result: {(out.stderr or out.stdout).strip()[-300:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5_000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gap-us", type=float, default=200.0, help="simulated device time per step (sleep)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--tool", default="ot", help="worker.py row: `ot` (counting backend) or `ot:<backends>`")
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="otel-train-phases-"))
    rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        for k in range(args.pairs):
            off = run_once("off", args, tmp / f"off{k}")
            on = run_once("on", args, tmp / f"on{k}")
            rows.append((off, on))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.tool}, {args.steps:,} steps per run, gap {args.gap_us:g} µs, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| pair | off wall µs/step | on wall µs/step | on/off | off otel-train µs/step | on otel-train µs/step "
          "| off bg CPU µs/step | on bg CPU µs/step |")
    print("|---|---|---|---|---|---|---|---|")

    def wall(r: dict[str, Any]) -> float:  # the whole step, device gap included: what a user's run takes
        return float(r["loop_wall_s"]) / r["steps"] * 1e6

    for k, (off, on) in enumerate(rows):
        print(f"| {k} | {wall(off):.1f} | {wall(on):.1f} | {wall(on) / wall(off):.3f} | {off['mean_us']:.1f} "
              f"| {on['mean_us']:.1f} | {off['bg_cpu_us']:.1f} | {on['bg_cpu_us']:.1f} |")
    ratio = statistics.median(wall(on) / wall(off) for off, on in rows)
    inner = statistics.median(on["mean_us"] / off["mean_us"] for off, on in rows)
    bg = statistics.median(on["bg_cpu_us"] - off["bg_cpu_us"] for off, on in rows)
    print(f"\nmedian wall time per step on/off: {ratio:.3f} ({(ratio - 1) * 100:+.1f} %); otel-train's part of the "
          f"step (spans + log, gap excluded) on/off: {inner:.3f}; background CPU on - off: {bg:+.1f} µs/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
