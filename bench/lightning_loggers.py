"""Lightning: what a logger adds to a tiny model's `Trainer.fit`.

    python bench/lightning_loggers.py                  # 500 steps, 3 rounds, ~2-3 min on 2 cores
    python bench/lightning_loggers.py --steps 200 --rounds 1

Rows: no logger; Lightning's `TensorBoardLogger`; `WandbLogger` (offline); `OtelTrainLogger` with
`OTEL_TRAIN_EXPORTERS=tensorboard,wandb` (W&B offline); and, for reference, that logger with
`OtelTrainCallback` (spans to a Chrome trace too, and export after every step). Every row runs in its own process; rounds are
interleaved (each round runs every row once, in a rotated order) and each row's median over the rounds
is compared with the no-logger median. Each step logs 5 values with ``log_every_n_steps=1`` (the
worst case for a logger; Lightning's default of 50 makes every logger's cost small). Times: `fit` wall
time (it includes the loggers' `finalize`, where otel-train flushes); `fit` plus closing the logger (W&B
finishing its offline run, otel-train's shutdown); and the wall time per step from step `--warmup` to
`on_train_end` (start-up excluded: (b) and (c) both start a W&B run, which on 2 cores costs more than 500
steps of a tiny model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from run import isolated_env

ROWS = ("none", "tensorboard", "wandb", "otel", "otel+callback")
LABELS = {
    "none": "no logger",
    "tensorboard": "(a) TensorBoardLogger",
    "wandb": "(b) WandbLogger offline",
    "otel": "(c) OtelTrainLogger -> tensorboard,wandb",
    "otel+callback": "(d) (c) + OtelTrainCallback (spans, per-step export)",
}


def worker(row: str, steps: int, warmup: int, root: Path) -> dict[str, Any]:
    """One `fit` of `steps` steps with the logger of `row`; times and what landed."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self.layer(x)
            loss = torch.nn.functional.mse_loss(out, y)
            self.log_dict({"train/loss": loss, "train/out_mean": out.mean(), "train/out_std": out.std(),
                           "train/y_mean": y.mean(), "train/abs_err": (out - y).abs().mean()})
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(pl.Callback):
        """Wall time from the start of step `warmup` to the end of training: the per-step cost, without
        start-up (W&B starts its service and run in (b) and (c) alike) and the loggers' final flush."""

        def __init__(self) -> None:
            self.t_warm = self.t_end = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == warmup:
                self.t_warm = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.t_end = time.perf_counter()  # before loggers finalize (otel-train flushes there)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 8, 32, generator=g), torch.randn(steps * 8, 1, generator=g))
    loader = DataLoader(data, batch_size=8)
    logger: Any = False
    close: Any = None
    callbacks: list[Any] = []
    if row == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(str(root / "tb"))
    elif row == "wandb":
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="bench", save_dir=str(root), offline=True)
        close = wandb.finish
    elif row.startswith("otel"):
        import otel_train as ot
        from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger

        exporters = "tensorboard,wandb" + (",chrome_trace" if row == "otel+callback" else "")
        ot.init(exporters=exporters, dir=root / "ot", run_name="bench")
        logger = OtelTrainLogger()
        if row == "otel+callback":
            callbacks.append(OtelTrainCallback())
        close = ot.shutdown
    clock = Clock()
    trainer = pl.Trainer(max_steps=steps, max_epochs=1, accelerator="cpu", devices=1, logger=logger,
                         callbacks=[clock, *callbacks],
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    t0 = time.perf_counter()
    trainer.fit(Tiny(), loader)
    t1 = time.perf_counter()
    if close is not None:
        close()
    t2 = time.perf_counter()
    result: dict[str, Any] = {"row": row, "fit_s": t1 - t0, "fit_close_s": t2 - t0,
                              "steady_ms": (clock.t_end - clock.t_warm) / (steps - warmup) * 1e3}
    if row.startswith("otel"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(root / "ot" / "bench"), size_guidance={"scalars": 0})
        acc.Reload()
        result["landed"] = sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"] if t.startswith("train/"))
    return result


def _run_row(row: str, args: argparse.Namespace, tmp: Path, round_: int) -> dict[str, Any]:
    root = tmp / f"{row}-{round_}"
    root.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--worker", row, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--dir", str(root)]
    proc = subprocess.run(cmd, env=isolated_env(root), capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"row {row!r} failed: " + " | ".join(tail))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=100, help="steps before the steady-state clock starts")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.warmup, args.dir)), flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="otel-train-lightning-bench-"))
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    try:
        for r in range(args.rounds):
            order = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]  # rotate: no row always runs first
            for row in order:
                results[row].append(_run_row(row, args, tmp, r))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    keys = ("fit_s", "fit_close_s", "steady_ms")
    med = {row: {k: statistics.median(x[k] for x in runs) for k in keys}
           for row, runs in results.items()}
    base = med["none"]
    print(f"Lightning fit, {args.steps} steps, 5 values logged per step (log_every_n_steps=1), "
          f"median of {args.rounds} interleaved rounds\n")
    print(f"| row | fit s | overhead | fit + close s | overhead | ms/step after step {args.warmup} | overhead |")
    print("|---|---|---|---|---|---|---|")
    for row in ROWS:
        m = med[row]
        cells = [f"{m[k]:{'.3f' if k == 'steady_ms' else '.2f'}} | {m[k] / base[k] - 1:+.1%}" for k in keys]
        print(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    landed = [x.get("landed") for x in results["otel"]]
    print(f"\n- otel-train values in TensorBoard per run: {landed} (expected {5 * args.steps})")
    for key, what, unit in (("fit_s", "fit", "s"), ("fit_close_s", "fit + close", "s"),
                            ("steady_ms", "per step after warm-up", "ms")):
        over = {row: med[row][key] - base[key] for row in ROWS}
        cheaper = min(over["tensorboard"], over["wandb"])
        verdict = "met" if over["otel"] < cheaper else "MISSED"
        print(f"- {what}: (c) adds {over['otel']:.3f} {unit}, the cheaper of (a)/(b) adds {cheaper:.3f} {unit} "
              f"(target (c) below it: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
