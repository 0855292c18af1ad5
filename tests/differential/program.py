"""Runs one generated logging program (JSON, argv[1]) with otel-train, as a training script would.

One process is one rank (RANK/WORLD_SIZE come from the environment); every backend is named in
OTEL_TRAIN_EXPORTERS, so one run writes them all at once. The program's shape is described in
`reference.py` (tests/helpers), which also computes what every backend must hold afterwards.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch

import otel_train as ot

STEP_FORMS = {"int": int, "np_int64": np.int64, "np_int32": np.int32, "float": float, "np_float64": np.float64}
VALUE_FORMS = {"float": float, "int": int, "bool": bool, "np_float32": np.float32, "np_float64": np.float64,
               "np_int64": np.int64, "np_bool": np.bool_}


def value(spec: dict[str, Any]) -> Any:
    if spec["form"] == "tensor":
        return torch.tensor(spec["v"], dtype=getattr(torch, spec["dtype"]))
    return VALUE_FORMS[spec["form"]](spec["v"])


def log(logs: list[list[Any]], step: Any = None) -> None:
    values = {key: value(spec) for key, spec in logs}
    if step is None:
        ot.log(values)
    else:
        ot.log(values, step=step)
    for (_key, spec), v in zip(logs, values.values()):
        if spec["form"] == "tensor" and spec.get("mutate") is not None:
            v.fill_(spec["mutate"])  # what a scheduler / accumulator does right after logging


def body(it: dict[str, Any]) -> None:
    if it.get("span"):
        with ot.span(it["span"]):
            log(it["logs"])
    else:
        log(it["logs"])
    if it.get("flush"):
        ot.flush(timeout_s=60)


def main() -> None:
    program = json.loads(sys.argv[1])
    ot.init()
    for block in program["blocks"]:
        form = STEP_FORMS[block["form"]]
        if block["kind"] == "step":
            with ot.step(form(block["start"])):
                body(block["iters"][0])
        elif block["kind"] == "steps":
            iters = block["iters"]
            if block.get("omit_start"):
                loop = ot.steps(iters)
            else:
                loop = ot.steps(iters, start=form(block["start"]))
            for it in loop:
                body(it)
        else:  # "log_step": ot.log(..., step=) outside any step context
            for k, it in enumerate(block["iters"]):
                log(it["logs"], step=form(block["start"] + k))
                if it.get("flush"):
                    ot.flush(timeout_s=60)
    ot.shutdown()


if __name__ == "__main__":
    main()
