"""Render docs/where-did-my-step-go.png from a real demo run (docs/where-did-my-step-go.md and the README).

    python docs/make_figure.py            # needs matplotlib (not a dependency of otel-train)

Runs `otel-train demo`'s training loop with system metrics on, then draws three panels from what the
backends wrote: the Chrome trace of three steps, the per-step phases from the TensorBoard files, and
the step-bucketed CPU and RSS series.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread: the step is the training thread's time
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

OUT = Path(__file__).with_name("where-did-my-step-go.png")
STEPS = 300


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import otel_train as ot
    from otel_train.demo import train
    from otel_train.trace_merge import load_trace

    tmp = Path(tempfile.mkdtemp(prefix="otel-train-figure-"))
    os.environ.update({"OTEL_TRAIN_SYSTEM_METRICS": "1", "OTEL_TRAIN_SYSTEM_INTERVAL_S": "0.05",
                       "OTEL_TRAIN_QUIET": "1"})
    ot.init(dir=tmp, run_name="demo")
    train(steps=STEPS, batch_size=16384, progress=None)  # a bigger batch: steps of a few milliseconds
    ot.shutdown()

    acc = EventAccumulator(str(tmp / "demo"), size_guidance={"scalars": 0})
    acc.Reload()
    series = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    events = load_trace(tmp / "demo" / "trace" / "rank0.trace.json")

    fig, (ax_t, ax_p, ax_s) = plt.subplots(3, 1, figsize=(9, 7.2), gridspec_kw={"height_ratios": [1, 1.4, 1.2]})
    colors = {"data": "tab:blue", "forward": "tab:orange", "backward": "tab:green", "optimizer": "tab:red"}

    # 1. the timeline of three typical consecutive steps (what Perfetto shows of the trace file)
    durations = series["train/step_duration_s"]
    median = sorted(durations.values())[len(durations) // 2]
    first = min(range(10, STEPS - 3), key=lambda s: sum(abs(durations[s + k] - median) for k in range(3)))
    shown = (first, first + 1, first + 2)
    window = [e for e in events if e.get("ph") == "X" and e["args"].get("train.step") in shown]
    t0 = min(e["ts"] for e in window)
    for e in window:
        ax_t.broken_barh([((e["ts"] - t0) / 1000, e["dur"] / 1000)], (0, 1), color=colors.get(e["name"], "grey"))
    ax_t.set_yticks([])
    for k, s in enumerate(shown):
        start = min(e["ts"] for e in window if e["args"]["train.step"] == s)
        ax_t.text((start - t0) / 1000, 1.05, f"step {s}", fontsize=8)
    for name, color in colors.items():
        ax_t.bar(0, 0, color=color, label=name)
    ax_t.legend(fontsize=7, ncol=4, loc="lower right")
    ax_t.set_ylim(0, 1.3)
    ax_t.set_xlabel(f"ms (Chrome trace, steps {shown[0]}-{shown[-1]}, training thread)")
    ax_t.set_title("Timeline: the spans of each step")

    # 2. where each step's time went (phase/*_s, stacked; TensorBoard's series)
    steps = sorted(series["train/step_duration_s"])
    bottom = [0.0] * len(steps)
    for name in ("data", "forward", "backward", "optimizer", "other"):
        values = [series[f"phase/{name}_s"].get(s, 0.0) * 1e3 for s in steps]
        ax_p.fill_between(steps, bottom, [b + v for b, v in zip(bottom, values)], step="mid", linewidth=0,
                          color=colors.get(name, "lightgrey"), label=f"phase/{name}_s")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_p.plot(steps, [series["train/step_duration_s"][s] * 1e3 for s in steps], color="black", linewidth=0.6,
              label="train.step.duration_s")
    ax_p.set_ylabel("ms per step")
    ax_p.set_title("Phases per step (they add up to the step duration)")
    ax_p.legend(fontsize=7, ncol=3, loc="upper right")
    ax_p.set_ylim(0, sorted(bottom)[int(len(bottom) * 0.98)] * 1.6)

    # 3. system metrics bucketed by step
    cpu = series["system/cpu_percent/mean"]
    ax_s.plot(sorted(cpu), [cpu[s] for s in sorted(cpu)], ".", markersize=6, color="tab:purple",
              label="system/cpu_percent/mean")
    cpu_max = series["system/cpu_percent/max"]
    ax_s.plot(sorted(cpu_max), [cpu_max[s] for s in sorted(cpu_max)], ".", markersize=4, color="plum",
              label="system/cpu_percent/max")
    ax_s.set_ylabel("process CPU %")
    ax_s.set_xlabel("train.step")
    ax_r = ax_s.twinx()
    rss = series["system/rss_mb/mean"]
    ax_r.plot(sorted(rss), [rss[s] for s in sorted(rss)], color="tab:brown", linewidth=1, label="system/rss_mb/mean")
    ax_r.set_ylabel("RSS MB")
    ax_s.set_title("System metrics per step (mean and max of the samples taken during the step)")
    ax_s.legend(fontsize=7, loc="lower left")
    ax_r.legend(fontsize=7, loc="lower right")
    for ax in (ax_p, ax_s):
        ax.set_xlim(0, STEPS)

    fig.tight_layout()
    fig.savefig(OUT, dpi=80)
    sys.stdout.write(f"wrote {OUT} ({OUT.stat().st_size // 1024} KB) from {tmp}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
