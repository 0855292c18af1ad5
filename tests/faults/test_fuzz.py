"""Bad input, generated: `ot.log` never raises into the loop and writes exactly the documented rows;
every environment variable parses to a value or fails with a `ConfigError` that names it.

(The sink's decoding of arbitrary OTLP bytes and JSON is fuzzed in `tests/sink/test_decode_fuzz.py`.)
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import otel_train as ot
from otel_train.config import settings as cfg
from otel_train.errors import ConfigError
from otel_train.testing import InMemoryRowExporter
from otel_train.vocab.rows import series_tag

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_./\-]{0,254}\Z")  # the OTel instrument name syntax (README)

keys = st.one_of(st.text(max_size=20), st.from_regex(_NAME, fullmatch=True).filter(lambda k: len(k) < 40)).filter(
    lambda k: not k.startswith("train."))  # `train.*` are the auto-recorded series
scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.floats(width=32), st.integers(),
    st.integers(2**1024, 2**1100), st.integers(-(2**1100), -(2**1024)),
    st.booleans(), st.none(), st.text(max_size=5),
    st.floats(allow_nan=False).map(np.float32), st.integers(-1000, 1000).map(np.int64),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda v: np.array([v])),
    st.lists(st.floats(), min_size=2, max_size=3).map(np.array),
)
values = st.one_of(scalars, st.dictionaries(st.text(max_size=3), scalars, max_size=2))


def documented(value: Any) -> float | None:
    """What the README says a logged value becomes: a number (or one-element array) -> float, else skipped."""
    if isinstance(value, int) and abs(value) >= 2**1024:  # beyond the float range: +-inf, not an error
        return math.inf if value > 0 else -math.inf
    if isinstance(value, (bool, int, float, np.floating, np.integer)):
        return float(value)
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(-1)[0])
    return None


_memory: dict[str, InMemoryRowExporter] = {}


def session_memory(tmp: Path) -> InMemoryRowExporter:
    """One session per test function, shared by its examples (the autouse fixture ends it after the test)."""
    import otel_train

    if otel_train._session is None or otel_train._session.closed:
        _memory["mem"] = InMemoryRowExporter()
        ot.init(exporters=[_memory["mem"]], dir=tmp, run_id="fuzz")
    return _memory["mem"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mapping=st.dictionaries(keys, values, max_size=6), step=st.integers(0, 10**9))
def test_log_never_raises_and_writes_the_documented_rows(tmp_path: Path, mapping: dict[str, Any], step: int) -> None:
    memory = session_memory(tmp_path)
    with memory._rows_lock:
        memory.metrics.clear()
    ot.log(mapping, step=step)  # must not raise, whatever the mapping holds
    assert ot.flush(60.0)  # generous: on a loaded 2-core machine a collection can wait seconds for the CPU
    # As lists: a point written twice shows twice. Any non-empty key, as its series name (a key holding `{` is
    # escaped: `series_tag`).
    got = sorted(((r.tag, _comparable(r.value)) for r in memory.metrics
                  if r.step == step and not r.tag.startswith("train.")), key=repr)
    want = sorted(((series_tag(k, None), _comparable(documented(v))) for k, v in mapping.items()
                   if k and documented(v) is not None), key=repr)
    assert got == want


def _comparable(value: float | None) -> object:
    """NaN as a string (NaN != NaN)."""
    return "nan" if value is not None and math.isnan(value) else value


def test_ten_thousand_distinct_keys_in_one_call_all_land(tmp_path: Path) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=tmp_path, run_id="wide")
    ot.log({f"k/{i}": float(i) for i in range(10_000)}, step=3)
    ot.shutdown()
    assert sorted((r.tag, r.value) for r in mem.metrics if r.tag.startswith("k/")) == sorted(
        (f"k/{i}", float(i)) for i in range(10_000))


def test_log_of_something_not_a_mapping_is_skipped_not_raised(tmp_path: Path) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=tmp_path, run_id="nm")
    for bad in (None, 3.0, "loss", object()):
        ot.log(bad, step=1)  # type: ignore[arg-type]
    ot.shutdown()
    assert [r for r in mem.metrics if not r.tag.startswith("train.")] == []


_VARS = sorted({var for var, _ in cfg._ENV.values()} | {cfg.OTEL_TRAIN_DISABLED, cfg.OTEL_SDK_DISABLED})


@settings(max_examples=300, deadline=None)
@given(var=st.sampled_from(_VARS), raw=st.text(max_size=30))
def test_every_env_variable_parses_or_names_itself(var: str, raw: str) -> None:
    try:
        s = cfg.load_settings({var: raw})
    except ConfigError as err:
        message = str(err)
        assert message.startswith(f"{var}: ") and "\n" not in message
        return
    assert isinstance(s, cfg.Settings)
    if var == cfg.OTEL_TRAIN_STEP_ORDER and raw.strip():
        assert s.step_order == raw.strip().lower()
    if var == cfg.OTEL_TRAIN_RESUME_STEP and raw.strip():
        assert s.resume_step == int(raw) and s.resume_step >= 0
