"""Accelerate: what a tracker adds per step to a tiny model's loop, beside Accelerate's own.

    python bench/accelerate_loggers.py                  # 500 steps, 3 rounds
    python bench/accelerate_loggers.py --steps 200 --rounds 1

Rows: no tracker; Accelerate's own TensorBoard tracker (``log_with="tensorboard"``); `OtelTrainTracker` with
`OTEL_TRAIN_EXPORTERS=tensorboard` (every logged step a step boundary, exporter process). Each step logs 5
values with ``accelerator.log(..., step=i)``. Times: wall time per step from step `--warmup` to the last step
(start-up excluded), and the loop plus ``end_training()`` (the trackers' flush/close). One process per row,
rounds interleaved, medians; the values otel-train wrote are read back from TensorBoard.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from _integration_rows import bench_main

ROWS = ("none", "tensorboard", "otel")
LABELS = {"none": "no tracker", "tensorboard": "(a) Accelerate's TensorBoard tracker",
          "otel": "(b) OtelTrainTracker -> tensorboard"}


def worker(row: str, steps: int, warmup: int, root: Path) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    log_with: Any = None
    if row == "tensorboard":
        log_with = "tensorboard"
    elif row == "otel":
        import os

        from otel_train.integrations.accelerate import OtelTrainTracker

        os.environ.update({"OTEL_TRAIN_EXPORTERS": "tensorboard", "OTEL_TRAIN_DIR": str(root / "ot")})
        log_with = OtelTrainTracker(run_name="bench")
    accelerator = Accelerator(cpu=True, log_with=log_with, project_dir=str(root / "acc"))
    if log_with is not None:
        accelerator.init_trackers("bench")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    xs, ys = torch.randn(steps, 8, 32, generator=g), torch.randn(steps, 8, 1, generator=g)
    t_warm = t0 = time.perf_counter()
    for i in range(steps):
        if i == warmup:
            t_warm = time.perf_counter()
        out = model(xs[i])
        loss = torch.nn.functional.mse_loss(out, ys[i])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"train/loss": loss.detach(), "train/out_mean": out.detach().mean(),
                         "train/out_std": out.detach().std(), "train/y_mean": ys[i].mean(),
                         "train/abs_err": (out.detach() - ys[i]).abs().mean()}, step=i)
    t_end = time.perf_counter()
    accelerator.end_training()
    t_close = time.perf_counter()
    result: dict[str, Any] = {"row": row, "steady_ms": (t_end - t_warm) / (steps - warmup) * 1e3,
                              "loop_close_s": t_close - t0}
    if row == "otel":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(root / "ot" / "bench"), size_guidance={"scalars": 0})
        acc.Reload()
        result["landed"] = sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"] if t.startswith("train/"))
    return result


def main() -> int:
    return bench_main(__doc__ or "", __file__, ROWS, LABELS,
                      {"steady_ms": "ms/step after step {warmup}", "loop_close_s": "loop + end_training s"},
                      worker, "steps", 500, 100,
                      "Accelerate loop, {count} steps, 5 values per accelerator.log, median of {rounds} interleaved rounds")


if __name__ == "__main__":
    raise SystemExit(main())
