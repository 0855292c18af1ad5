"""The ~0.6 ms step of `real_loop.py --step 1ms`, in this process: a 256-96-96-10 MLP on the CPU, one thread, batch
128; per step 4 timing regions (``data``, ``forward``, ``backward``, ``optimizer``) and 20 values, the loss a tensor.
Shared by `loop_parts.py` (the training thread's parts), `collector_parts.py` (the collector thread's) and
`collector_gc.py` (the cycle collector's)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


class MlpLoop:
    def __init__(self, hidden: int = 96) -> None:
        import torch

        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                         torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x, self.y = torch.randn(128, 256), torch.randint(0, 10, (128,))
        self._loss = torch.nn.functional.cross_entropy

    def body(self, step: int, region: Callable[[str], AbstractContextManager[Any]],
             log: Callable[[dict[str, Any]], None] | None) -> None:
        """One step's work, each region in `region(name)`, then its 20 values to `log` (None: built, not logged)."""
        with region("data"):
            xb = self.x + 0.0
        with region("forward"):
            loss = self._loss(self.model(xb), self.y)
        with region("backward"):
            self.opt.zero_grad()
            loss.backward()
        with region("optimizer"):
            self.opt.step()
        values: dict[str, Any] = {f"train/m{k:02d}": step + k / 32 for k in range(19)}
        values["train/loss"] = loss.detach()
        if log is not None:
            log(values)


def add_thread_time(owner: Any, name: str, label: str, spent: collections.Counter[str]) -> None:
    """Replace `owner.name` by itself adding the calling thread's CPU time to `spent[label]`."""
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.thread_time() - start

    setattr(owner, name, timed)
