"""What `accelerate_loggers.py` and `ray_tune_loggers.py` share: one process per row, rows interleaved over
rounds (rotated order), medians compared with the first row."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from run import isolated_env


def run_rows(script: str, rows: Sequence[str], rounds: int, extra: list[str], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    tmp = Path(tempfile.mkdtemp(prefix="otel-train-integration-bench-"))
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    try:
        for r in range(rounds):
            order = list(rows[r % len(rows):]) + list(rows[:r % len(rows)])
            for row in order:
                root = tmp / f"{row}-{r}"
                root.mkdir(parents=True)
                cmd = [sys.executable, script, "--worker", row, "--dir", str(root), *extra]
                proc = subprocess.run(cmd, env=isolated_env(root), capture_output=True, text=True,
                                      timeout=timeout_s, check=False)
                for line in proc.stdout.splitlines():
                    if line.startswith("RESULT "):
                        results[row].append(dict(json.loads(line[7:])))
                        break
                else:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                    raise RuntimeError(f"row {row!r} failed: " + " | ".join(tail))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def table(results: dict[str, list[dict[str, Any]]], labels: dict[str, str], keys: dict[str, str]) -> str:
    """A Markdown table of each row's medians and their overhead over the first row."""
    rows = list(results)
    med = {row: {k: statistics.median(x[k] for x in runs) for k in keys} for row, runs in results.items()}
    base = med[rows[0]]
    lines = ["| row | " + " | ".join(f"{title} | overhead" for title in keys.values()) + " |",
             "|---|" + "---|---|" * len(keys)]
    for row in rows:
        cells = [f"{med[row][k]:.3f} | {'—' if row == rows[0] else f'{med[row][k] / base[k] - 1:+.1%}'}"
                 for k in keys]
        lines.append(f"| {labels[row]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (5 min {five:.1f}), {os.cpu_count()} cores"


def bench_main(doc: str, script: str, rows: Sequence[str], labels: dict[str, str], keys: dict[str, str],
         worker: Callable[[str, int, int, Path], dict[str, Any]], count: str, count_default: int,
         warmup_default: int, title: str) -> int:
    """A bench's command line: `--worker ROW` runs one row (in its own process, from `run_rows`); otherwise every
    row over `--rounds` interleaved rounds, then the table. `count` names the bench's size flag (`steps`,
    `results`); `title` is formatted with it, ``rounds`` and ``warmup``; `keys` titles may use ``{warmup}``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(f"--{count}", dest="count", type=int, default=count_default)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=warmup_default)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--worker", choices=rows, help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.count, args.warmup, args.dir)), flush=True)
        return 0
    before = load()
    results = run_rows(script, rows, args.rounds, [f"--{count}", str(args.count), "--warmup", str(args.warmup)],
                       args.timeout_s)
    print(title.format(count=args.count, rounds=args.rounds, warmup=args.warmup)
          + f"; {before} before, {load()} after\n")
    print(table(results, labels, {k: v.format(warmup=args.warmup) for k, v in keys.items()}))
    print(f"\n- otel-train values in TensorBoard per run: {[x.get('landed') for x in results['otel']]} "
          f"(expected {5 * args.count})")
    return 0
