"""One training job logging every input of the bad-input table (tests/inputs/test_bad_inputs.py), with every
local backend at once; a forked child logs its own bad inputs. Each input has its own step, in increasing
order (W&B keeps one step axis per run). Prints the session's refusals as JSON on the last line of stdout."""

from __future__ import annotations

import json
import multiprocessing as mp
from decimal import Decimal
from fractions import Fraction

import numpy as np
import torch

import otel_train as ot

MAX_STEP = 2**63 - 1


def child() -> None:
    ot.log({"in/child_str": "x", "in/child_ok": 2.5}, step=40)  # one value refused, one written
    ot.log({"in/child_big": 1.0}, step=2**63)
    ot.flush()


def main() -> None:
    session = ot.init()
    log = ot.log
    log({"in/complex": 1 + 2j}, step=1)
    log({"in/str": "0.5"}, step=2)
    log({"in/none": None}, step=3)
    log({"in/bytes": b"1"}, step=4)
    log({"in/object": object()}, step=5)
    log({"in/tensor": torch.zeros(3)}, step=6)
    log({"in/array": np.zeros((2, 2))}, step=7)
    log({"in/list": [1.0, 2.0]}, step=8)
    log(None, step=9)  # type: ignore[arg-type]
    log({"": 1.0}, step=10)
    log({5: 1.0}, step=11)  # type: ignore[dict-item]
    log({"_step": 7.0}, step=12)
    log({"in/decimal": Decimal("1.1")}, step=13)
    log({"in/fraction": Fraction(1, 4)}, step=14)
    log({"in/big_step": 1.0}, step=2**63)
    log({"in/negative_step": 1.0}, step=-1)
    log({"in/half_step": 1.0}, step=2.5)  # type: ignore[arg-type]
    log({"in/bad_attribute": 3.0}, step=15, attributes={"bad": {"x": 1}})
    log({"in/acc": 1.0}, step=20, attributes={"a": "1,b=2"})
    log({"in/acc": 2.0}, step=20, attributes={"a": "1", "b": "2"})
    log({"in/acc{a=1,b=2}": 3.0}, step=20)
    ot.flush()
    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join()
    log({"in/max_step": 9.0}, step=MAX_STEP)
    ot.shutdown()
    print(json.dumps(dict(session.refusals)))


if __name__ == "__main__":
    main()
