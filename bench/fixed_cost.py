"""What a short job pays around its loop: the whole process, `init()` and `shutdown()`, per setup, beside the
same job written against each peer by hand.

Every setup is one fresh process running a job that logs 20 steps of 20 values; setups are interleaved (one
round runs each once, in a shuffled order) and each figure is the median over the rounds. Ratios are against
`import otel_train` (for our setups) and against the slowest peer called by hand.

    python bench/fixed_cost.py               # 5 rounds (~2 min on 2 cores)
    python bench/fixed_cost.py --reps 3 --singles   # also each backend alone (the "slowest single" column)
    python bench/fixed_cost.py --reps 3 --close --singles --only "after flush"   # shutdown once every backend is up
    python bench/fixed_cost.py --only "import otel_train,all six,peer,mlflow alone" --singles   # backend processes

A new MLflow store starts from a template of an empty one, kept in the user's cache folder by the first store
built on the machine (`otel_train.exporters._mlflow_store`): the first round's setups with MLflow may build it;
"first MLflow store on this machine" is the cost without it, every time.

`--close` adds each setup "after flush": the job calls `ot.flush()` (every backend up and holding every step)
before it times `shutdown()`, which then costs the hand-over and the backends' close alone, as at the end of a job
whose loop outlasts the backends' start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ALL_SIX = "tensorboard,chrome_trace,wandb,mlflow,clearml,trackio"
STEPS, VALUES = 20, 20

OURS = textwrap.dedent(f"""
    import json, os, time
    import otel_train as ot
    t0 = time.perf_counter()
    ot.init()
    t1 = time.perf_counter()
    for step in range({STEPS}):
        with ot.step(step):
            ot.log({{f"train/v{{k}}": float(step + k) for k in range({VALUES})}})
    if os.environ.get("BENCH_FLUSH") == "1":
        assert ot.flush(600), "flush timed out"
    t2 = time.perf_counter()
    ot.shutdown()
    t3 = time.perf_counter()
    print("TIMES" + json.dumps({{"init": t1 - t0, "shutdown": t3 - t2}}))
""")

PEERS = {
    "peer: W&B offline init/log/finish": textwrap.dedent(f"""
        import os, wandb
        run = wandb.init(project="fixed-cost", dir=os.environ["BENCH_DIR"], mode="offline")
        for step in range({STEPS}):
            run.log({{f"train/v{{k}}": float(step + k) for k in range({VALUES})}}, step=step)
        run.finish()
    """),
    "peer: MLflow (sqlite) start_run/log/end_run": textwrap.dedent(f"""
        import os, mlflow
        mlflow.set_tracking_uri("sqlite:///" + os.path.join(os.environ["BENCH_DIR"], "mlflow.db"))
        with mlflow.start_run():
            for step in range({STEPS}):
                mlflow.log_metrics({{f"train/v{{k}}": float(step + k) for k in range({VALUES})}}, step=step)
    """),
    "peer: torch SummaryWriter": textwrap.dedent(f"""
        import os
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.environ["BENCH_DIR"])
        for step in range({STEPS}):
            for k in range({VALUES}):
                writer.add_scalar(f"train/v{{k}}", float(step + k), step)
        writer.close()
    """),
}

SETUPS: dict[str, tuple[str, dict[str, str]]] = {
    "bare Python": ("pass", {}),
    "import otel_train": ("import otel_train", {}),
    "otel-train, default backends": (OURS, {}),
    "otel-train, default backends, in process": (OURS, {"OTEL_TRAIN_EXPORT_PROCESS": "off"}),
    "otel-train, all six": (OURS, {"OTEL_TRAIN_EXPORTERS": ALL_SIX}),
    # MLflow's store from its migrations, as on a machine's first store per MLflow version (no store template)
    "otel-train, all six, first MLflow store on this machine": (OURS, {"OTEL_TRAIN_EXPORTERS": ALL_SIX,
                                                                       "BENCH_NO_TEMPLATE": "1"}),
    "otel-train, all six, one exporter process": (OURS, {"OTEL_TRAIN_EXPORTERS": ALL_SIX,
                                                         "OTEL_TRAIN_BACKEND_PROCESSES": "off"}),
    **{name: (code, {}) for name, code in PEERS.items()},
}


def _env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_TRAIN_", "WANDB_", "MLFLOW_", "CLEARML_", "TRACKIO_", "HF_"))}
    env.update(OTEL_TRAIN_DIR=str(root / "runs"), OTEL_TRAIN_QUIET="1", BENCH_DIR=str(root),
               WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(root), WANDB_CONFIG_DIR=str(root / "wbc"),
               WANDB_CACHE_DIR=str(root / "wbcache"), WANDB_DATA_DIR=str(root / "wbdata"),
               MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}", CLEARML_OFFLINE_MODE="1",
               CLEARML_CACHE_DIR=str(root / "clearml"), TRACKIO_DIR=str(root / "trackio"), HF_HOME=str(root / "hf"),
               GIT_PYTHON_REFRESH="quiet")
    env.update(extra)
    if env.pop("BENCH_NO_TEMPLATE", None):
        env["XDG_CACHE_HOME"] = str(root / "cache")  # empty: MLflow's store template is not there yet
    return env


def run_once(code: str, extra: dict[str, str]) -> dict[str, float]:
    """One fresh process: its wall time, and `init` / `shutdown` as it timed them (ours only)."""
    # The wall time is the training process's: an exporter process still draining (after a shutdown timeout)
    # may write on; its folder is then left behind.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        busy = _machine_cpu_s()
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], env=_env(Path(tmp), extra), capture_output=True,
                              text=True, timeout=600, check=False)
        wall = time.perf_counter() - start
        busy = _machine_cpu_s() - busy
    if done.returncode != 0:
        raise RuntimeError(f"setup failed ({done.returncode}):\n{done.stderr[-2000:]}")
    out = {"wall": wall, "cpu": busy}
    for line in done.stdout.splitlines():
        if line.startswith("TIMES"):
            out.update(json.loads(line[len("TIMES"):]))
    return out


def _machine_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (every process: the backends' own and their services'), from
    /proc/stat; NaN where there is none. Meaningful on a machine with nothing else running."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _compile_otel_train() -> None:
    """Compile otel-train's modules once, as an installed wheel has them: where `PYTHONDONTWRITEBYTECODE` is set,
    each fresh process would otherwise compile them again (tens of ms that no installed job pays)."""
    import compileall

    import otel_train
    import otel_train.exporters

    for folder in (os.path.dirname(otel_train.__file__), *otel_train.exporters.__path__):
        compileall.compile_dir(folder, quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="rounds (each setup once per round)")
    parser.add_argument("--singles", action="store_true", help="also each of the six backends alone")
    parser.add_argument("--close", action="store_true",
                        help="also our setups timing shutdown() after ot.flush() (every backend up and written)")
    parser.add_argument("--only", default="", help="comma list of setup names (substrings) to run")
    args = parser.parse_args()
    _compile_otel_train()
    setups = dict(SETUPS)
    if args.singles:
        for name in ALL_SIX.split(","):
            setups[f"otel-train, {name} alone"] = (OURS, {"OTEL_TRAIN_EXPORTERS": name})
    if args.close:
        for name, (code, extra) in list(setups.items()):
            if code is OURS:
                setups[f"{name}, after flush"] = (OURS, {**extra, "BENCH_FLUSH": "1"})
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        setups = {k: v for k, v in setups.items() if any(w in k for w in wanted)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    for rnd in range(args.reps):
        order = list(setups)
        random.shuffle(order)
        for name in order:
            results[name].append(run_once(*setups[name]))
        print(f"round {rnd + 1}/{args.reps} done", file=sys.stderr, flush=True)

    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in results.get(name, []) if key in r]
        return statistics.median(values) if values else None

    base = med("import otel_train", "wall") or 0.0
    peers = [med(name, "wall") or 0.0 for name in PEERS if name in results]
    slowest_peer = max(peers) if peers else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average {load:.1f}, "
          f"median of {args.reps}, {STEPS} steps x {VALUES} values")
    print("| setup | wall s | over `import otel_train` s | x slowest peer | init s | shutdown s | machine CPU s |")
    print("|---|---|---|---|---|---|---|")
    for name in setups:
        wall = med(name, "wall") or 0.0
        init, shut, cpu = med(name, "init"), med(name, "shutdown"), med(name, "cpu")
        over = f"{wall - base:.2f}" if name.startswith("otel-train") else ""
        ratio = f"{wall / slowest_peer:.2f}" if slowest_peer else ""
        print(f"| {name} | {wall:.2f} | {over} | {ratio} | {'' if init is None else f'{init:.3f}'} | "
              f"{'' if shut is None else f'{shut:.3f}'} | {'' if cpu is None else f'{cpu:.2f}'} |")
    singles = [med(f"otel-train, {name} alone, after flush", "shutdown") for name in ALL_SIX.split(",")]
    six = med("otel-train, all six, after flush", "shutdown")
    if six is not None and all(x is not None for x in singles):
        slowest = max(x for x in singles if x is not None)
        print(f"shutdown after flush: all six {six:.3f} s = {six / slowest:.2f}x the slowest backend alone "
              f"({slowest:.3f} s); the sum of the six alone {sum(x for x in singles if x is not None):.3f} s")


if __name__ == "__main__":
    main()
