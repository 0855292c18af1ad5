"""Value conversion (export thread) and what `ot.log` keeps of a tensor (training thread)."""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import otel_train as ot
from otel_train._internal import values as V
from otel_train.capture.instrument import LogBuffer
from otel_train.testing import InMemoryRowExporter

torch = pytest.importorskip("torch", reason="torch is a test dependency; the tensor cases need it")


def test_to_float_numbers_and_non_numbers() -> None:
    assert V.to_float(1.5) == 1.5 and V.to_float(3) == 3.0 and V.to_float(True) == 1.0
    assert V.to_float(np.float32(0.25)) == 0.25 and V.to_float(np.array(2.0)) == 2.0
    assert V.to_float(Fraction(1, 4)) == 0.25 and V.to_float([7]) == 7.0
    for bad in ("1.0", b"1", {"a": 1}, [1, 2], np.zeros(3), None, object()):
        assert V.to_float(bad) is None, bad


def test_to_floats_batches_cpu_tensors_and_keeps_order() -> None:
    vals = [torch.tensor(1.5), 2.0, torch.tensor([3], dtype=torch.int64), np.float64(4.0), "x",
            torch.tensor(0.1, dtype=torch.float16), torch.zeros(2), torch.tensor(6.0, requires_grad=True) * 1]
    out = V.to_floats(vals)
    assert out[:5] == [1.5, 2.0, 3.0, 4.0, None]
    assert out[5] == pytest.approx(0.1, abs=1e-3)
    assert out[6] is None  # two elements: not a scalar
    assert out[7] == 6.0


def test_to_floats_one_host_copy_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of one device are stacked and copied once, not `.item()`-ed one by one."""
    calls = {"item": 0, "stack": 0}
    real_stack = torch.stack

    def stack(*a, **k):  # type: ignore[no-untyped-def]
        calls["stack"] += 1
        return real_stack(*a, **k)

    monkeypatch.setattr(torch, "stack", stack)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.__setitem__("item", calls["item"] + 1) or 0.0)
    out = V.to_floats([torch.tensor(float(i)) for i in range(50)])
    assert out == [float(i) for i in range(50)]
    assert calls == {"item": 0, "stack": 1}


def test_every_non_empty_string_is_a_key() -> None:
    for key in ("train/loss", "val/mAP@0.5", "Loss (val)", "épochs/loss", "1loss", "x" * 1000, " "):
        assert V.valid_name(key), key
    assert not V.valid_name("") and not V.valid_name(3) and not V.valid_name(None) and not V.valid_name(b"k")


def test_log_buffer_detaches_tensors_that_require_grad() -> None:
    buf = LogBuffer(10)
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    logged = {"loss": loss, "lr": 0.1, "epoch": 2}
    buf.append(0, logged)
    (_, _, kept, _), = buf.drain()
    assert type(kept["loss"]) is float  # a CPU scalar is read at the call: no tensor (nor graph) kept
    assert kept["loss"] == 6.0 and kept["lr"] == 0.1 and kept["epoch"] == 2
    assert logged["loss"] is loss and loss.requires_grad  # the caller's mapping is untouched
    plain = {"a": 1.0, "b": 2}
    buf.append(1, plain)
    assert buf.drain()[0][2] is plain  # nothing to detach: no copy


class _Marker:
    """Saved in an autograd graph; freed when the graph is."""


class _SaveMarker(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, marker):  # type: ignore[no-untyped-def, override]
        ctx.marker = marker
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad * 2, None


def test_logged_tensor_does_not_keep_the_graph_alive(run_dir: Path) -> None:
    """Logged before backward (or never backpropagated): the graph must go when the user drops it,
    not at the next collection."""
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, export_every=10**6, export_interval_s=3600)
    marker = _Marker()
    ref = weakref.ref(marker)
    x = torch.ones(4, requires_grad=True)
    loss = _SaveMarker.apply(x, marker).sum()
    del marker
    with ot.step(0):
        ot.log({"loss": loss})
    del loss
    gc.collect()
    assert ref() is None, "the autograd graph of a logged tensor is still alive before collection"
    ot.flush()
    assert mem.values("loss") == [(0, 8.0)]


class _DeviceArray:
    """Stands in for a CuPy/JAX array on a GPU: `.item()` would sync per value."""

    device = "cuda:0"

    def item(self) -> float:
        return 2.0


def test_strict_sync_warns_once_per_key_on_the_training_thread() -> None:
    buf = LogBuffer(10, strict=True)
    with pytest.warns(RuntimeWarning, match=r"key 'x'.*one device sync per value") as caught:
        buf.append(0, {"x": _DeviceArray(), "cpu": torch.tensor(1.0), "f": 1.0, "i": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning for the same key would raise here
        buf.append(1, {"x": _DeviceArray()})
    assert len(caught) == 1
    assert len(buf.drain()) == 2


def test_strict_sync_off_costs_no_check(recwarn: pytest.WarningsRecorder) -> None:
    buf = LogBuffer(10)
    buf.append(0, {"x": _DeviceArray()})
    assert not [w for w in recwarn if "device sync" in str(w.message)]


def test_decimal_fraction_and_other_reals_are_numbers() -> None:
    from decimal import Decimal

    assert V.to_float(Decimal("1.1")) == 1.1 and V.to_float(Decimal("-0.25")) == -0.25
    assert V.to_float(Decimal("Infinity")) == float("inf") and math.isnan(V.to_float(Decimal("NaN")))  # type: ignore[arg-type]
    assert V.to_float(Fraction(1, 3)) == 1 / 3 and V.to_float(np.longdouble(0.5)) == 0.5
    assert V.to_floats([Decimal("2.5"), Fraction(3, 4)]) == [2.5, 0.75]
    assert V.to_float(Decimal("sNaN")) is None  # a signaling NaN cannot be read: refused, not raised
    assert V.refusal(Decimal("sNaN")) == "not_a_number"


@pytest.mark.parametrize(("value", "cause"), [
    (1 + 2j, "not_a_number"), ("0.5", "not_a_number"), (None, "not_a_number"), (b"1", "not_a_number"),
    (object(), "not_a_number"), ({"a": 1}, "not_a_number"), ([1.0, 2.0], "not_a_scalar"),
    ([], "not_a_scalar"), (["x"], "not_a_number"), (np.zeros((2, 2)), "not_a_scalar"), (np.array("s"), "not_a_number"),
])
def test_why_a_value_is_refused(value: object, cause: str) -> None:
    assert V.to_float(value) is None
    assert V.refusal(value) == cause


def test_why_a_tensor_is_refused() -> None:
    assert V.refusal(torch.zeros(3)) == "not_a_scalar" and V.refusal(torch.zeros(0)) == "not_a_scalar"
    assert V.to_float(torch.tensor(1 + 2j)) is None and V.refusal(torch.tensor(1 + 2j)) == "not_a_number"
    assert set(V.REFUSAL_CAUSES) >= {"not_a_number", "not_a_scalar", "bad_key", "not_a_mapping", "bad_step",
                                     "step_out_of_range", "bad_attribute", "bad_step_entered"}
