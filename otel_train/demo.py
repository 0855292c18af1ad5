"""A tiny NumPy model trained with otel-train: what `otel-train demo` runs."""

from __future__ import annotations

import sys
from typing import Any, TextIO

import numpy as np

import otel_train as ot

__all__ = ["train"]


def _batches(rng: np.random.Generator, w_true: np.ndarray, batch_size: int) -> Any:
    while True:
        x = rng.normal(size=(batch_size, w_true.shape[0]))
        y = np.tanh(x @ w_true) + 0.05 * rng.normal(size=(batch_size, 1))
        yield x, y


def train(steps: int = 200, batch_size: int = 64, lr: float = 0.05, progress: TextIO | None = sys.stderr,
          seed: int = 0) -> float:
    """Fit a one-hidden-layer MLP to a synthetic regression task; returns the final loss.

    Must run after `ot.init()`. Logs `train/loss`, `train/lr`, `train/grad_norm` every step and
    spans `data`, `forward`, `backward`, `optimizer` inside each step.
    """
    rng = np.random.default_rng(seed)
    n_in, n_hidden = 16, 32
    w_true = rng.normal(size=(n_in, 1)) / np.sqrt(n_in)
    w1 = rng.normal(size=(n_in, n_hidden)) / np.sqrt(n_in)
    w2 = rng.normal(size=(n_hidden, 1)) / np.sqrt(n_hidden)
    data = _batches(rng, w_true, batch_size)
    loss = float("nan")
    for step in range(steps):
        with ot.step(step, samples=batch_size):  # samples= adds train.throughput
            with ot.span("data"):
                x, y = next(data)
            with ot.span("forward"):
                h = np.tanh(x @ w1)
                pred = h @ w2
                err = pred - y
                loss = float(np.mean(err**2))
            with ot.span("backward"):
                g_pred = 2 * err / batch_size
                g_w2 = h.T @ g_pred
                g_h = g_pred @ w2.T * (1 - h**2)
                g_w1 = x.T @ g_h
                grad_norm = float(np.sqrt((g_w1**2).sum() + (g_w2**2).sum()))
            with ot.span("optimizer"):
                step_lr = lr * (0.5 * (1 + np.cos(np.pi * step / steps)))  # cosine schedule
                w1 -= step_lr * g_w1
                w2 -= step_lr * g_w2
            ot.log({"train/loss": loss, "train/lr": step_lr, "train/grad_norm": grad_norm})
        if progress is not None and (step % max(1, steps // 20) == 0 or step == steps - 1):
            done = (step + 1) / steps
            bar = "#" * int(done * 30)
            progress.write(f"\r[{bar:<30}] step {step + 1}/{steps} loss {loss:.4f}")
            progress.flush()
    if progress is not None:
        progress.write("\n")
    return loss

