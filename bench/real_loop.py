"""A real training loop, not a microbenchmark: what otel-train costs the *process*, per exporter set.

A small torch MLP on the CPU (`torch.set_num_threads(1)`, batch 128), per step 4 `ot.span` and one
`ot.log` of 20 values (the loss as a tensor), 600 steps. Each configuration runs in its own process,
interleaved with the same loop under `OTEL_TRAIN_DISABLED=1`; the ratio is the median of the per-repetition
ratios of wall time per step, with their range. `init` (child start included) and `shutdown` are timed apart from
the loop. The "disabled again" row runs the disabled loop against itself: its range is how far apart two runs of
one process land on the machine at that time, below which no ratio means anything.

    python bench/real_loop.py               # 3 repetitions, pinned and unpinned (~15 min on 2 cores)
    python bench/real_loop.py --reps 1 --modes pinned
    python bench/real_loop.py --step 1ms --modes pinned --configs 0,2   # the ~0.6 ms step (256-96-96-10)
    python bench/real_loop.py --step 1ms --modes pinned --configs 0,6,7 # beside TensorBoard's and W&B's own loggers
    python bench/real_loop.py --step 1ms --modes pinned --configs 8,0,9,10,11,12 --reps 7   # the loop's parts
    python bench/real_loop.py --step 1ms --modes pinned --configs 8,0,13 --steps 5000 --reps 7   # with the start apart

Pinned: the loop runs under `taskset -c 0` and `OTEL_TRAIN_EXPORT_CPUS=1` (as on a node where the loop
has its own cores and logging runs on housekeeping cores). Unpinned: both share every core. Each run starts once
the previous run's exporter process has exited (one that outlives its `shutdown()`, still draining, would take
CPU from the next run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ALL_SIX = "tensorboard,chrome_trace,wandb,mlflow,trackio,clearml"
CONFIGS = {  # label -> extra environment
    "default (tensorboard,chrome_trace)": {},
    "default, EXPORT_PROCESS=off": {"OTEL_TRAIN_EXPORT_PROCESS": "off"},
    "all six": {"OTEL_TRAIN_EXPORTERS": ALL_SIX},
    "all six, EXPORT_PROCESS=off": {"OTEL_TRAIN_EXPORTERS": ALL_SIX, "OTEL_TRAIN_EXPORT_PROCESS": "off"},
    # `otlp` to an `otel-train sink` (TensorBoard) that this script runs on loopback gRPC, in its own process.
    "otlp -> sink": {"OTEL_TRAIN_EXPORTERS": "otlp"},
    "otlp -> sink, EXPORT_PROCESS=off": {"OTEL_TRAIN_EXPORTERS": "otlp", "OTEL_TRAIN_EXPORT_PROCESS": "off"},
    # Peers called by hand in the same loop, otel-train disabled: the same 20 values a step (the loss a tensor, as
    # their docs pass it), no spans (neither has one). What the loop costs with the logger a user would otherwise use.
    "peer: torch SummaryWriter, 20 add_scalar": {"BENCH_PEER": "tensorboard", "OTEL_TRAIN_DISABLED": "1"},
    "peer: W&B offline, wandb.log": {"BENCH_PEER": "wandb", "OTEL_TRAIN_DISABLED": "1"},
    # The disabled loop against itself: how far apart two runs of the same process land on this machine now. A
    # ratio within that spread of 1.00 is noise, whatever its median.
    "disabled again (noise control)": {"OTEL_TRAIN_DISABLED": "1"},
}
#: What a plain run measures: the configurations above. The diagnostics below run only when named (their indices
#: follow): default backends with parts of the loop's otel-train calls left out (the disabled loop they are
#: compared with still makes its no-op calls, ~0.1-0.2 µs each).
MAIN_CONFIGS = len(CONFIGS)
CONFIGS.update({
    "default, spans without their OTel context": {"BENCH_PARTS": "step,log,spans-no-context"},
    "default, no spans": {"BENCH_PARTS": "step,log"},
    "default, ot.step alone": {"BENCH_PARTS": "step"},
    "default, a session and no call": {"BENCH_PARTS": ""},
    # The session's start (the OTel SDK's import and build, the exporter process's launch) runs on a thread of the
    # training process after `init()` returns, on the loop's core: here `ot.flush()` waits for it before the warm-up,
    # so the timed steps hold only what every later step pays.
    "default, timed once its start is done": {"BENCH_FLUSH_FIRST": "1"},
})

#: The MLP's hidden width per step size (batch 128, one thread).
STEP_SIZES = {"4ms": 512, "1ms": 96}

LOOP = textwrap.dedent("""
    import contextlib, json, os, sys, threading, time

    def thread_cpu():
        # CPU seconds per thread name (`/proc/self/task`, clock ticks): where the training core's time goes.
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = names.get(int(tid), "other")
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    t0 = time.perf_counter()
    import torch
    import otel_train as ot
    torch.manual_seed(0)
    torch.set_num_threads(1)
    steps, hidden = int(sys.argv[1]), int(sys.argv[2])
    model = torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    t_init = time.perf_counter()
    session = ot.init()
    peer, peer_log, peer_close = os.environ.get("BENCH_PEER"), None, None
    if peer == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.environ["OTEL_TRAIN_DIR"])
        def peer_log(values, step):
            for key, value in values.items():
                writer.add_scalar(key, value, step)
        peer_close = writer.close
    elif peer == "wandb":
        import wandb
        os.makedirs(os.environ["OTEL_TRAIN_DIR"], exist_ok=True)
        run = wandb.init(project="real-loop", dir=os.environ["OTEL_TRAIN_DIR"], mode="offline",
                         settings=wandb.Settings(console="off"))
        def peer_log(values, step):
            run.log(values, step=step)
        peer_close = run.finish
    t_init = time.perf_counter() - t_init
    if os.environ.get("BENCH_FLUSH_FIRST"):
        ot.flush(timeout_s=60)
    for i in range(20):  # warm-up, not timed
        opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
    threads, start, cpu = thread_cpu(), time.perf_counter(), time.process_time()
    parts = set(os.environ.get("BENCH_PARTS", "step,log,spans").split(","))
    null = contextlib.nullcontext()
    if "spans" in parts:
        span = ot.span
    elif "spans-no-context" in parts:
        span = lambda name: ot._scope(name, None, False)  # `ot.span` without the OTel context it sets
    else:
        span = lambda name: null
    for step in range(steps):
        with ot.step(step) if "step" in parts else null:
            with span("data"):
                xb = x + 0.0
            with span("forward"):
                loss = torch.nn.functional.cross_entropy(model(xb), y)
            with span("backward"):
                opt.zero_grad()
                loss.backward()
            with span("optimizer"):
                opt.step()
            values = {f"train/m{k:02d}": step + k / 32 for k in range(19)}
            values["train/loss"] = loss.detach()
            if "log" in parts:
                ot.log(values)
            if peer_log is not None:
                peer_log(values, step)
    loop, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = thread_cpu()
    per_thread = {k: (v - threads.get(k, 0.0)) / steps * 1e6 for k, v in after.items()}
    t_shut = time.perf_counter()
    ot.shutdown()
    if peer_close is not None:
        peer_close()
    t_shut = time.perf_counter() - t_shut
    child = getattr(getattr(session, "export_process", None), "start_s", None)
    export_pid = getattr(getattr(session, "export_process", None), "pid", None)
    print("RESULT" + json.dumps({"step_ms": loop / steps * 1000, "cpu_ms": cpu / steps * 1000, "init_s": t_init, "shutdown_s": t_shut,
                                 "child_start_s": child, "export_pid": export_pid, "collector_us": per_thread.get("otel-train-collect", 0.0),
                                 "training_thread_us": per_thread.get("MainThread", 0.0),
                                 # CPU of every other thread of the process, those that ended during the loop included
                                 # (per-thread figures come in clock ticks: clamped at 0)
                                 "other_threads_us": max(0.0, cpu / steps * 1e6 - per_thread.get("MainThread", 0.0)
                                                         - per_thread.get("otel-train-collect", 0.0))}))
""")


def _run(script: Path, steps: int, env: dict[str, str], pinned: bool, hidden: int = 512) -> dict[str, float]:
    cmd = [sys.executable, str(script), str(steps), str(hidden)]
    if pinned:
        cmd = ["taskset", "-c", "0", *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    result: dict[str, float] = json.loads(line[len("RESULT"):])
    _wait_gone(result.get("export_pid"))
    return result


def _wait_gone(pid: float | None, within_s: float = 300.0) -> None:
    """Wait until the run's exporter process has exited: past `shutdown()`'s timeout it goes on draining (all six
    backends at a 0.6 ms step: ~10 s more), and the next run must not be measured beside it."""
    end = time.monotonic() + within_s
    while pid and time.monotonic() < end:
        try:
            with open(f"/proc/{int(pid)}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.1)


def _writes_tensorboard(config: dict[str, str]) -> bool:
    """Whether a run of `config` writes its 20 values a step to TensorBoard files (read back after it; W&B's
    offline files are not)."""
    if "BENCH_PEER" in config:
        return config["BENCH_PEER"] == "tensorboard"
    return "OTEL_TRAIN_DISABLED" not in config and "log" in config.get("BENCH_PARTS", "log").split(",")


def _landed(directory: Path, steps: int) -> str:
    """Values of the last run read back from TensorBoard (20 per step expected)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = directory.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("train/m") or t == "train/loss"]
    return f"{sum(len(acc.Scalars(t)) for t in tags)}/{20 * steps}"


def _compile_otel_train() -> None:
    """Compile otel-train's modules once, as an installed wheel has them: where `PYTHONDONTWRITEBYTECODE` is set,
    each fresh process would otherwise compile them again (tens of ms that no installed job pays)."""
    import compileall

    import otel_train
    import otel_train.exporters

    for folder in (os.path.dirname(otel_train.__file__), *otel_train.exporters.__path__):
        compileall.compile_dir(folder, quiet=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default="pinned,unpinned")
    parser.add_argument("--step", choices=list(STEP_SIZES), default="4ms",
                        help="the MLP's width: 4ms (256-512-512-10, the default) or 1ms (256-96-96-10, ~0.6 ms "
                             "steps on a 2-core VM: where the per-step cost around the loop shows)")
    parser.add_argument("--configs", default=",".join(str(i) for i in range(MAIN_CONFIGS)),
                        help=f"indices into the config list (default: 0-{MAIN_CONFIGS - 1}; the diagnostics "
                             f"{MAIN_CONFIGS}-{len(CONFIGS) - 1} only when named)")
    args = parser.parse_args()
    _compile_otel_train()
    labels = [list(CONFIGS)[int(i)] for i in args.configs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "loop.py"
        script.write_text(LOOP)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_TRAIN_", "WANDB_", "MLFLOW_"))}
        base.update(HOME=str(root / "home"), WANDB_MODE="offline", WANDB_SILENT="true", TRACKIO_DIR=str(root / "trk"),
                    CLEARML_CONFIG_FILE=str(root / "clearml.conf"), CLEARML_CACHE_DIR=str(root / "cml"),
                    HF_HOME=str(root / "hf"))
        sink = None
        if any(CONFIGS[label].get("OTEL_TRAIN_EXPORTERS") == "otlp" for label in labels):
            sink = _start_sink(root / "sink-runs")
            base.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink.grpc_port}",
                        OTEL_EXPORTER_OTLP_INSECURE="true")
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps, median of "
              f"{args.reps}; step size {args.step} (hidden width {STEP_SIZES[args.step]})")
        for mode in args.modes.split(","):
            pinned = mode == "pinned"
            extra = {"OTEL_TRAIN_EXPORT_CPUS": "1"} if pinned else {}
            ratios: dict[str, list[float]] = {label: [] for label in labels}
            results: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
            disabled: list[float] = []
            disabled_cpu: list[float] = []
            disabled_thread: list[float] = []
            for rep in range(args.reps):
                for label in labels:
                    hidden = STEP_SIZES[args.step]
                    off = _run(script, args.steps, {**base, "OTEL_TRAIN_DISABLED": "1"}, pinned, hidden)
                    name = f"{mode}-{rep}-{labels.index(label)}"
                    directory = root / f"runs-{name}"
                    env = {**base, **extra, **CONFIGS[label], "OTEL_TRAIN_DIR": str(directory),
                           "OTEL_TRAIN_RUN_NAME": name, "OTEL_TRAIN_RUN_ID": name}
                    on = _run(script, args.steps, env, pinned, hidden)
                    if sink is not None and CONFIGS[label].get("OTEL_TRAIN_EXPORTERS") == "otlp":
                        sink.flush(60)
                        directory = root / "sink-runs" / name
                    landed = _landed(directory, args.steps) if _writes_tensorboard(CONFIGS[label]) else "-"
                    on["landed"] = landed  # type: ignore[assignment]
                    disabled.append(off["step_ms"])
                    disabled_cpu.append(off["cpu_ms"])
                    disabled_thread.append(off["training_thread_us"])
                    ratios[label].append(on["step_ms"] / off["step_ms"])
                    results[label].append(on)
            print(f"\n{mode}: disabled {statistics.median(disabled):.2f} ms/step, "
                  f"CPU {statistics.median(disabled_cpu):.2f} ms/step, training thread "
                  f"{statistics.median(disabled_thread):.0f} µs/step")
            print("| exporters | ms/step | × disabled (range) | training-process CPU ms/step | training thread / "
                  "collector / other threads CPU µs/step | init s (child start s) | shutdown s | TensorBoard values |")
            print("|---|---|---|---|---|---|---|---|")
            for label in labels:
                rs = results[label]
                child = [r["child_start_s"] for r in rs if r["child_start_s"] is not None]
                child_txt = f" ({statistics.median(child):.2f})" if child else ""
                ratio = ratios[label]
                print(f"| {label} | {statistics.median(r['step_ms'] for r in rs):.2f} | "
                      f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
                      f"{statistics.median(r['cpu_ms'] for r in rs):.2f} | "
                      f"{statistics.median(r['training_thread_us'] for r in rs):.0f} / "
                      f"{statistics.median(r['collector_us'] for r in rs):.0f} / "
                      f"{statistics.median(r['other_threads_us'] for r in rs):.0f} | "
                      f"{statistics.median(r['init_s'] for r in rs):.2f}"
                      f"{child_txt} | {statistics.median(r['shutdown_s'] for r in rs):.2f} | {rs[-1]['landed']} |")
        if sink is not None:
            sink.stop()
    return 0


def _start_sink(directory: Path) -> Any:
    """An `otel-train sink` writing TensorBoard files, on a free loopback gRPC port, in this process."""
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.sink import Sink, exporter_factory
    from otel_train.sink.settings import SinkSettings

    settings = SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0")
    return Sink(settings, exporter_factory(("tensorboard",), ExporterOptions(directory, ranks="all"))).start()


if __name__ == "__main__":
    sys.exit(main())
