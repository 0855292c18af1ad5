"""The semantic conventions: `otel_train.vocab.semconv`, the table in docs/semantic-conventions.md and the code agree."""

from __future__ import annotations

import re
from pathlib import Path

from otel_train.vocab import semconv
from otel_train.vocab.semconv import CONVENTIONS, display_name

ROOT = Path(__file__).resolve().parents[1]
#: Dotted names in the code that are not telemetry names (an entry-point group, an MLflow bookkeeping tag).
NOT_TELEMETRY = {"otel_train.exporters", "otel_train.last_step", "otel_train.resume_step",  # backend tags
                 "otel_train.ship.delivery", "otel_train.collect.reader", "otel_train.hang",  # logger names
                 "otel_train.cli"}  # a module run with `python -m`


def _docs_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "semantic-conventions.md").read_text(encoding="utf-8")
    block = text.split("<!-- semconv:start", 1)[1].split("<!-- semconv:end -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]  # rows[0]: the header


def _cell(value: str) -> str:
    return f"`{value}`" if value else "—"


def test_docs_table_is_the_module() -> None:
    expected = [[f"`{c.name}`", c.kind, c.type, c.unit or "—", c.set_by, _cell(c.otel), _cell(c.display)]
                for c in CONVENTIONS]
    assert _docs_rows() == expected


def test_every_dotted_name_in_the_code_is_a_convention() -> None:
    """Each `"train.*"` / `"otel_train.*"` / OTel attribute string literal in the package is in the table."""
    names = {c.name for c in CONVENTIONS}
    pattern = re.compile(r"""["']((?:train|otel_train|thread|host|process)\.[a-z_.]+)["']""")
    found: dict[str, str] = {}
    for folder in ("otel_train", "exporters"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "semconv.py":  # the table itself (it also names the OTel conventions followed)
                continue
            for match in pattern.finditer(path.read_text()):
                name = match.group(1)
                if not name.startswith(("otel_train.compat", "otel_train.sink", "otel_train.integrations")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: where for n, where in found.items() if n not in names and n not in NOT_TELEMETRY}
    assert not unknown, f"names missing from otel_train/vocab/semconv.py: {unknown}"


def test_built_in_series_have_a_slash_display_name() -> None:
    for c in CONVENTIONS:
        if c.kind == "metric" and "." in c.name:
            assert "/" in display_name(c.name) and "." not in display_name(c.name), c.name
    assert display_name(semconv.TRAIN_STEP_DURATION) == "train/step_duration_s"
    assert display_name("train/loss") == "train/loss"
