"""Series names (`series_tag`): distinct series never share a name, ordinary names stay as they were.

A name is read back here by a small parser of the documented escaping: every tag parses back to its key and its
attributes (as text), which is what makes the mapping one-to-one; hypothesis tries keys and values full of the
characters the escaping is about.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_train.vocab.rows import series_tag

sys.path.insert(0, str(Path(__file__).parent / "sink"))  # the sink tests' helpers


def parse(tag: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(name, ((key, value), ...)) of a tag, by the documented rule: a tag without `{` is a name as logged; else
    the name ends at the first `{` not escaped by a backslash, and in an escaped part `\\x` stands for `x`."""
    if "{" not in tag:
        return tag, ()
    i, name = 0, []
    while i < len(tag) and tag[i] != "{":
        if tag[i] == "\\":
            i += 1
        name.append(tag[i])
        i += 1
    if i == len(tag):  # a name holding `{`, escaped, without attributes
        return "".join(name), ()
    assert tag.endswith("}"), tag
    items: list[tuple[str, str]] = []
    part: list[str] = []
    key: str | None = None
    i += 1
    while i < len(tag) - 1:
        c = tag[i]
        if c == "\\":
            part.append(tag[i + 1])
            i += 2
            continue
        if c == "=" and key is None:
            key, part = "".join(part), []
        elif c == ",":
            assert key is not None, tag
            items.append((key, "".join(part)))
            key, part = None, []
        else:
            assert c not in "{}=", tag  # an unescaped special character inside the suffix
            part.append(c)
        i += 1
    assert key is not None, tag
    items.append((key, "".join(part)))
    return "".join(name), tuple(items)


_TEXT = st.text(st.sampled_from("ab1\\,={} /.é"), max_size=6)


@given(name=_TEXT.filter(bool), attributes=st.dictionaries(_TEXT.filter(bool), _TEXT | st.integers(), max_size=3))
def test_every_tag_parses_back_to_its_series(name: str, attributes: dict[str, object]) -> None:
    want = (name, tuple(sorted((k, str(v)) for k, v in attributes.items())))
    assert parse(series_tag(name, attributes)) == want


@pytest.mark.parametrize(("name", "attributes", "tag"), [
    ("eval/acc", {"split": "val"}, "eval/acc{split=val}"),
    ("eval/acc", {"split": "val", "fold": 2, "train.step": 3, "train.rank": 1}, "eval/acc{fold=2,split=val}"),
    ("val/mAP@0.5", {"trial_id": "a-1_b.c"}, "val/mAP@0.5{trial_id=a-1_b.c}"),
    ("Loss (val)", None, "Loss (val)"),
    ("path\\with\\backslash", None, "path\\with\\backslash"),
    ("loss", {"rank": 1}, "loss{rank=1}"),
])
def test_ordinary_names_are_unchanged(name: str, attributes: dict[str, object] | None, tag: str) -> None:
    assert series_tag(name, attributes) == tag


def test_the_three_series_of_one_step_that_used_to_be_one() -> None:
    tags = {series_tag("acc", {"a": "1,b=2"}), series_tag("acc", {"a": "1", "b": "2"}), series_tag("acc{a=1,b=2}", {})}
    assert tags == {"acc{a=1\\,b\\=2}", "acc{a=1,b=2}", "acc\\{a=1,b=2}"}
    assert series_tag("a\\", {"x": 1}) != series_tag("a{x=1}", None)  # a backslash before the suffix is escaped


def test_the_sink_names_the_three_series_as_the_training_process_does(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `otlp` and a real `otel-train sink` (JSONL): the key holding `{` travels as a mapped instrument name
    with the key in its description; the sink escapes it in the tag as the training process does."""
    from sinkkit import make_sink

    from otel_train.exporters.base import Window
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl
    from otel_train.exporters.otlp import OTLPExporter
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("otlp-series", "otlp-series")
    series = [("acc", {"a": "1,b=2"}, 1.0), ("acc", {"a": "1", "b": "2"}, 2.0), ("acc{a=1,b=2}", {}, 3.0)]
    rows = [MetricRow(run, 20, name, series_tag(name, attrs), value, "gauge", 1_700_000_000_000_000_000, attrs)
            for name, attrs, value in series]
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.grpc_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        exp = OTLPExporter()
        assert exp.export_window(Window(metrics=rows))
        exp.shutdown()
        assert sink.flush(10)
    finally:
        sink.stop()
    got = sorted((r["tag"], r["step"], r["value"]) for r in read_jsonl(jsonl_path(tmp_path / "runs", run.run_name, 0))
                 if r["type"] == "metric")
    assert got == sorted((row.tag, 20, row.value) for row in rows)
