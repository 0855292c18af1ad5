"""Which parameters of a test module the session runs, for a module fixture that starts every case at once."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def selected(request: pytest.FixtureRequest, argname: str, values: Iterable[str]) -> list[str]:
    """`values`, in their order, that a test of the requesting module runs with as `argname` in this session (all
    of them, or those picked by `-k` or node id): a case nobody asserts on is not started."""
    picked = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None and argname in callspec.params:
            picked.add(callspec.params[argname])
    return [v for v in values if v in picked]
