"""A gloo (CPU) job for the hang watchdog's torchrun tests; run as ``train.py MODE OUT`` by
``python -m torch.distributed.run --nproc_per_node=N``.

``hang``: rank 1 waits in `load_batch` at step 50 (inside the ``data`` span) until the file ``OUT/go`` exists (at
most 120 s), while the other ranks wait for it in the gradient `all_reduce` inside ``backward``.
``vary``: no hang, but steps whose time varies: a slow first step (3 s, as a compiling one) and a 12x slower
``validation`` span inside every 20th step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import otel_train as ot


def load_batch(step: int, rank: int, mode: str, out: Path) -> torch.Tensor:
    if mode == "hang" and rank == 1 and step == 50:
        deadline = time.monotonic() + 120
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return torch.full((8, 4), float(step))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ot.init(run_name="job")
    model = torch.nn.Linear(4, 1)
    for step in ot.steps(range(60 if mode == "hang" else 45)):
        with ot.span("data"):
            x = load_batch(step, rank, mode, out)
        with ot.span("forward"):
            if mode == "vary" and step == 0:
                time.sleep(3.0)  # a first step that compiles
            loss = model(x).sum()
        with ot.span("backward"):
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad = None
        time.sleep(0.1 if mode == "vary" else 0.02)  # the work of a step: the watchdog sees steps finish
        if mode == "vary" and step % 20 == 0 and step:
            with ot.span("validation"):
                time.sleep(1.2)
    ot.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
