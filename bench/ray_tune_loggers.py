"""Ray Tune: what a logger callback adds per reported result, beside Tune's own.

    python bench/ray_tune_loggers.py                  # 1 trial, 500 results, 3 rounds
    python bench/ray_tune_loggers.py --results 200 --rounds 1

Rows: no logger callback (``TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=1``); Tune's own `TBXLoggerCallback`
(TensorBoard); `OtelTrainCallback` with `OTEL_TRAIN_EXPORTERS=tensorboard` (each result a step boundary,
exporter process). The trainable reports 5 values per result as fast as it can, so the driver's callbacks are
the bottleneck. Times: driver wall time per result from result `--warmup` to the last (Ray's start-up
excluded) and the whole `Tuner.fit()`. One process per row, rounds interleaved, medians; the values otel-train
wrote are read back from TensorBoard.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from _integration_rows import bench_main

ROWS = ("none", "tbx", "otel")
LABELS = {"none": "no logger callback", "tbx": "(a) Tune's TBXLoggerCallback",
          "otel": "(b) OtelTrainCallback -> tensorboard"}


def worker(row: str, results: int, warmup: int, root: Path) -> dict[str, Any]:
    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    import ray
    from ray import tune
    from ray.tune import Callback

    class Clock(Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.seen = 0
            self.t_warm = self.t_end = 0.0

        def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any) -> None:
            self.seen += 1
            if self.seen == warmup:
                self.t_warm = time.perf_counter()
            self.t_end = time.perf_counter()

    def trainable(config: dict[str, Any]) -> None:
        for i in range(config["n"]):
            tune.report({"loss": 1.0 / (i + 1), "acc": i / config["n"], "lr": 0.1, "grad_norm": 0.5 + i % 3,
                         "nested": {"val": float(i)}})

    clock = Clock()
    callbacks: list[Any] = [clock]
    if row == "tbx":
        from ray.tune.logger import TBXLoggerCallback

        callbacks.append(TBXLoggerCallback())
    elif row == "otel":
        from otel_train.integrations.ray_tune import OtelTrainCallback

        os.environ.update({"OTEL_TRAIN_EXPORTERS": "tensorboard", "OTEL_TRAIN_DIR": str(root / "ot"),
                           "OTEL_TRAIN_RUN_NAME": "bench"})
        callbacks.append(OtelTrainCallback())
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    tuner = tune.Tuner(trainable, param_space={"n": results},
                       run_config=tune.RunConfig(storage_path=str(root / "ray"), callbacks=callbacks, verbose=0))
    t0 = time.perf_counter()
    tuner.fit()
    t1 = time.perf_counter()
    ray.shutdown()
    out: dict[str, Any] = {"row": row, "per_result_ms": (clock.t_end - clock.t_warm) / (results - warmup) * 1e3,
                           "fit_s": t1 - t0}
    if row == "otel":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(root / "ot" / "bench"), size_guidance={"scalars": 0})
        acc.Reload()
        out["landed"] = sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"]
                            if t.startswith(("tune/loss", "tune/acc", "tune/lr", "tune/grad_norm", "tune/nested")))
    return out


def main() -> int:
    return bench_main(__doc__ or "", __file__, ROWS, LABELS,
                      {"per_result_ms": "driver ms/result after result {warmup}", "fit_s": "Tuner.fit() s"},
                      worker, "results", 500, 50,
                      "Ray Tune, 1 trial reporting {count} results of 5 values, median of {rounds} interleaved rounds")


if __name__ == "__main__":
    raise SystemExit(main())
