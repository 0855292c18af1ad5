"""Issue 2's numbers in one run: `ot.log`+`ot.span` against raw OTel and the floor, plus RSS growth.

    python bench/overhead.py                 # 20,000 steps per row, then a 200,000-step RSS run
    python bench/overhead.py --steps 5000 --rss-steps 50000

Each row runs in its own process (same loop as `run.py`: 20 scalars + 4 timing regions per step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from run import HERE, isolated_env, run_row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gap-us", type=float, default=200.0, help="simulated device time per step (sleep)")
    p.add_argument("--rss-steps", type=int, default=200_000)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="otel-train-overhead-"))
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, tmp: Path) -> int:
    rows = {tool: run_row(tool, args.steps, args, tmp) for tool in ("floor", "ot", "raw-otel")}
    for tool, r in rows.items():
        if "error" in r:
            print(f"{tool}: {r['error']}")
            return 1
    floor, ours, raw = rows["floor"], rows["ot"], rows["raw-otel"]
    print(f"{args.steps:,} steps per row, gap {args.gap_us:g} µs; per step: 20 scalars + 4 regions\n")
    print("| row | µs/step mean | p99 | 4 regions µs | log µs | train CPU µs/step | bg CPU µs/step |")
    print("|---|---|---|---|---|---|---|")
    for r in (floor, ours, raw):
        print(f"| {r['name']} | {r['mean_us']:.1f} | {r['p99_us']:.1f} | {r['span_us']:.1f} | {r['log_us']:.1f} "
              f"| {r['train_cpu_us']:.1f} | {r['bg_cpu_us']:.1f} |")
    log_ratio = raw["log_us"] / ours["log_us"]
    span_ratio = (ours["span_us"] / 4) / (raw["span_us"] / 4)
    print()
    print(f"- ot.log(20 scalars) {ours['log_us']:.1f} µs vs 20 raw gauge.set {raw['log_us']:.1f} µs: "
          f"{log_ratio:.0f}× cheaper (target ≥ 10×: {'met' if log_ratio >= 10 else 'MISSED'})")
    print(f"- a span: ot.span {ours['span_us'] / 4:.1f} µs vs raw OTel {raw['span_us'] / 4:.1f} µs: "
          f"{span_ratio:.2f}× (target ≤ 1.3×: {'met' if span_ratio <= 1.3 else 'MISSED'}; ot includes "
          f"entering ot.step)")
    print(f"- ot.log vs the floor (list.append of the dict): {ours['log_us'] / floor['log_us']:.2f}×; "
          f"whole step vs floor: {ours['mean_us'] / floor['mean_us']:.2f}×")
    cmd = [sys.executable, str(HERE / "soak.py"), "--steps", str(args.rss_steps), "--every",
           str(max(1, args.rss_steps // 10)), "--gap-us", str(args.gap_us), "--dir", str(tmp / "soak")]
    proc = subprocess.run(cmd, env=isolated_env(tmp), capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        print(f"- RSS run failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        return 1
    growth = result["growth_mb"]
    print(f"- RSS over {args.rss_steps:,} steps (ot.log + 4 ot.span per step, counting backend): "
          f"{result['rss_first_interval_mb']:.1f} -> {result['rss_end_mb']:.1f} MB, growth {growth:+.1f} MB "
          f"(target < 20 MB: {'met' if growth < 20 else 'MISSED'}); dropped {result['dropped_records']} records, "
          f"{result['dropped_spans']} spans")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
