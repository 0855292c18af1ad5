"""A trainer whose DataLoader workers (fork) call `ot.log` with `step=`, to be killed with SIGKILL.

Run as ``python worker_kill9_driver.py DIR RUN``. The main loop logs `loss` at every step inside a span;
each of the two workers logs ``data/item`` = the item's index at step = the item's index, so after a
kill every worker point the backends hold is known by its value. It prints ``step N`` after each step,
and ``exporter PID`` once, for the test that kills it.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, Dataset

import otel_train as ot


class Items(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        ot.log({"data/item": float(i)}, step=i)
        return torch.tensor([float(i)])


def main() -> None:
    directory, run = sys.argv[1], sys.argv[2]
    session = ot.init(exporters="jsonl,tensorboard,chrome_trace", dir=directory, run_id=run, run_name=run,
                      export_interval_s=0.05)
    print("exporter", session.export_process.pid, flush=True)
    loader = DataLoader(Items(), batch_size=1, num_workers=2, multiprocessing_context="fork")
    for step, batch in enumerate(loader):
        with ot.step(step), ot.span("train_step"):
            ot.log({"loss": float(batch.sum())})
        print("step", step, flush=True)


if __name__ == "__main__":
    main()
