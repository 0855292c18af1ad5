"""`ot.log` keeps the value a tensor (or NumPy array) had at the call, not the one it has when the window
is collected: ordinary PyTorch code mutates in place right after logging. One window holds every step here
(`export_every` above the step count), so a late read would show the later values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import otel_train as ot
from otel_train.exporters.jsonl import read_jsonl
from otel_train.vocab.run_paths import run_folder

torch = pytest.importorskip("torch", reason="torch is a test dependency; only its absence skips this")

STEPS = 60


def _rows(folder: Path, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r["value"]) for r in read_jsonl(folder / "rank0.jsonl")
            if r.get("type") == "metric" and r["name"] == name]


def _tb(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensors_mutated_after_log_keep_the_logged_value(tmp_path: Path) -> None:
    ot.init(exporters="jsonl,tensorboard", dir=tmp_path, run_id="mutate", export_every=10_000,
            export_interval_s=3600)
    lr = torch.tensor(0.1, dtype=torch.float64)
    scale = torch.tensor(1024.0)
    running = torch.zeros(())
    weight = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    array = np.array(0.0)
    expected: dict[str, list[tuple[int, float]]] = {k: [] for k in ("lr", "scale", "running", "weight", "array")}
    for step in ot.steps(range(STEPS), start=0):
        running += float(step)  # an accumulator: logged, then zeroed
        logged = {"lr": lr, "scale": scale, "running": running, "weight": weight, "array": array}
        ot.log(logged)
        for key, value in logged.items():
            expected[key].append((step, float(value.item())))
        lr.fill_(0.1 * 0.9 ** (step + 1))  # a scheduler filling the LR tensor in place
        scale.mul_(0.5 if step % 2 else 2.0)  # a loss scaler halving and doubling
        running.zero_()
        optimizer.zero_grad()
        (weight * 2.0).backward()  # the optimizer changes the parameter in place
        optimizer.step()
        array[...] = -step  # a NumPy buffer reused every step
    ot.shutdown()
    folder = run_folder(tmp_path, "mutate")
    for key, points in expected.items():
        got = _rows(folder, key)
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points]), key
    assert [(s, round(v, 5)) for s, v in _tb(folder, "lr")] == [(s, round(v, 5)) for s, v in expected["lr"]]


def test_device_scalars_are_copied_once_per_device_and_dtype() -> None:
    from otel_train.capture.instrument import _copy_on_device

    a, b = torch.tensor(1.0), torch.tensor(2.0)
    c = torch.tensor(3, dtype=torch.int64)
    out: dict[str, object] = {}
    stacks = []
    real_stack = torch.stack

    def counting_stack(*args: object, **kwargs: object) -> object:
        stacks.append(args)
        return real_stack(*args, **kwargs)

    torch.stack = counting_stack
    try:
        _copy_on_device({("cpu", torch.float32): [("a", a), ("b", b)], ("cpu", torch.int64): [("c", c)]}, out)
    finally:
        torch.stack = real_stack
    assert len(stacks) == 2
    a.fill_(10.0)
    b.fill_(20.0)
    c.fill_(30)
    assert [out["a"].item(), out["b"].item(), out["c"].item()] == [1.0, 2.0, 3]  # type: ignore[attr-defined]


def test_the_snapshot_detaches_and_leaves_floats_alone() -> None:
    from otel_train.capture.instrument import _snapshot

    loss = torch.tensor(2.0, requires_grad=True) * 3.0
    mapping = {"plain": 1.0, "loss": loss, "vector": torch.ones(3, requires_grad=True) * 2}
    snap = _snapshot(mapping)
    assert snap["plain"] == 1.0 and snap["loss"] == 6.0 and type(snap["loss"]) is float
    assert snap["vector"].grad_fn is None  # not a scalar: kept (and refused on the export thread), detached
    floats = {"a": 1.0}
    assert _snapshot(floats) is floats
