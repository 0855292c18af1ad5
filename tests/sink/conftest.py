"""Fixtures of the sink tests; helpers live in `sinkkit` / `rotel_proc` beside this file."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: let tests import their helpers

from sinkkit import make_sink


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[Any]:
    s = make_sink(tmp_path)
    try:
        yield s
    finally:
        s.stop()
