"""Where the training thread's time goes at a ~0.6 ms step: the loop's otel-train parts switched on one at a time.

The loop of `real_loop.py --step 1ms` (a 256-96-96-10 MLP on the CPU, one thread, batch 128; per step 4 `ot.span`
and one `ot.log` of 20 values in an `ot.step`). Unlike `real_loop.py`, every setup runs in one process, one session
after the other, interleaved round by round, and each is timed by the training thread's own CPU time
(`time.thread_time`) over 1,500 steps after 200 untimed ones: between processes this VM's step varies by ±100 µs,
within one process by a few µs, so parts of 5-15 µs can be told apart. Also counted: the cycle collector's
collections per generation over the timed steps (the disabled loop makes none).

    taskset -c 0 env OTEL_TRAIN_EXPORT_CPUS=1 python bench/loop_parts.py            # 8 rounds (~2 min)
    taskset -c 0 env OTEL_TRAIN_EXPORT_CPUS=1 python bench/loop_parts.py --rounds 12

Setups: ``disabled`` (`OTEL_TRAIN_DISABLED`); with no backend (`exporters=[]`: the reader and its collector thread
run, nothing is delivered): ``step`` (`ot.step` alone), ``step+log``, ``step+spans``, ``step+spans, no OTel
context`` (the spans without the OTel context they set so that raw OTel spans nest in them: what that costs),
``all``; and ``all, default backends`` (TensorBoard and the Chrome trace in the exporter process).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from _mlp_loop import MlpLoop

SETUPS: dict[str, tuple[str, frozenset[str]]] = {  # label -> (session, parts of the loop)
    "disabled": ("disabled", frozenset({"step", "log", "spans"})),
    "step": ("none", frozenset({"step"})),
    "step+log": ("none", frozenset({"step", "log"})),
    "step+spans": ("none", frozenset({"step", "spans"})),
    "step+spans, no OTel context": ("none", frozenset({"step", "spans", "no_context"})),
    "all": ("none", frozenset({"step", "log", "spans"})),
    "all, default backends": ("default", frozenset({"step", "log", "spans"})),
}


class _NoScope:
    def __enter__(self) -> _NoScope:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    os.environ.setdefault("OTEL_TRAIN_QUIET", "1")

    import otel_train as ot

    loop = MlpLoop()
    no_scope = _NoScope()
    parts: frozenset[str] = frozenset()

    def scope(name: str) -> Any:
        if "spans" not in parts:
            return no_scope
        if "no_context" in parts:
            return ot._scope(name, None, False)  # what `ot.span` is without the OTel context it sets
        return ot.span(name)

    def body(step: int) -> None:
        loop.body(step, scope, ot.log if "log" in parts else None)

    def one_step(step: int) -> None:
        if "step" in parts:
            with ot.step(step):
                body(step)
        else:
            body(step)

    cpu: dict[str, list[float]] = {label: [] for label in SETUPS}
    collections: dict[str, list[list[int]]] = {label: [] for label in SETUPS}
    step = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for label, (session, setup_parts) in SETUPS.items():
                parts = setup_parts
                kw: dict[str, Any] = {"disabled": True} if session == "disabled" else (
                    {"exporters": []} if session == "none" else {})
                ot.init(dir=tmp, run_name=f"r{rnd}-{len(cpu[label])}-{label.replace(' ', '_')}", **kw)
                for _ in range(200):
                    one_step(step)
                    step += 1
                before = [s["collections"] for s in gc.get_stats()]
                start = time.thread_time()
                for _ in range(args.steps):
                    one_step(step)
                    step += 1
                cpu[label].append((time.thread_time() - start) / args.steps * 1e6)
                collections[label].append([b - a for a, b in zip(before, (s["collections"] for s in gc.get_stats()),
                                                                   strict=True)])
                ot.shutdown()
    base = statistics.median(cpu["disabled"])
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps per setup, median of "
          f"{args.rounds} interleaved rounds; training thread CPU\n")
    print("| setup | µs/step | over disabled | cycle collections per 1,000 steps (gen 0/1/2) |")
    print("|---|---|---|---|")
    for label in SETUPS:
        med = statistics.median(cpu[label])
        per_gen = [sum(c[g] for c in collections[label]) / (args.rounds * args.steps) * 1000 for g in range(3)]
        print(f"| {label} | {med:.0f} | {med - base:+.0f} | {' / '.join(f'{n:.1f}' for n in per_gen)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
