"""The README and the documentation site say what the code does: the two commands at the top, an example that
runs, links that resolve, and every `OTEL_TRAIN_*` variable on the Configuration page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
#: The two commands CI and newcomers rely on (.ci/run runs the second), word for word.
COMMANDS = "pip install . && otel-train demo\npip install torch==2.13.0 -e '.[test]' && pytest"
_VARIABLE = re.compile(r"""["'](OTEL_TRAIN_[A-Z0-9_<>]*[A-Z0-9>])["']""")
_ROW_HEAD = re.compile(r"^\| `(OTEL_TRAIN_[A-Z0-9_<>]+)` \|", re.MULTILINE)


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def _variables_in_code() -> dict[str, str]:
    """Every `OTEL_TRAIN_*` name written as a string literal in the package -> one file that has it."""
    found: dict[str, str] = {}
    for folder in ("otel_train", "exporters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in _VARIABLE.findall(path.read_text(encoding="utf-8")):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert _code_blocks(text, "bash")[0].strip() == COMMANDS
    assert text.index(COMMANDS) < text.index("\n## ")  # before the first section


def test_every_variable_the_code_reads_has_a_row_on_the_configuration_page() -> None:
    in_code = _variables_in_code()
    rows = _ROW_HEAD.findall(CONFIGURATION.read_text(encoding="utf-8"))
    assert "OTEL_TRAIN_EXPORTERS" in in_code and "OTEL_TRAIN_SINK_TOKEN" in in_code  # the grep sees the code
    missing = {name: where for name, where in in_code.items() if name not in rows}
    assert not missing, f"variables read by the code but missing from docs/configuration.md: {missing}"
    stale = [name for name in rows if name not in in_code]
    assert not stale, f"docs/configuration.md documents variables the code no longer reads: {stale}"
    assert len(rows) == len(set(rows)), "a variable has two rows"


def test_readme_links_resolve() -> None:
    """Relative links in README.md point at files of the repository (MkDocs checks the pages; GitHub shows this one)."""
    text = README.read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert len(targets) >= 10
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_readme_example_runs_and_lands_every_step(tmp_path: Path) -> None:
    """The README's example, run as it is, writes `train/loss` once per step 0..199 to TensorBoard and a trace."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (example,) = _code_blocks(README.read_text(encoding="utf-8"), "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    (run,) = (tmp_path / "otel-train-runs").iterdir()
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [step for step, _ in loss] == list(range(200))
    assert loss[-1][1] < loss[0][1] / 100  # the model in the example learns
    assert len([e for e in acc.Scalars("train/grad_norm")]) == 200
    assert (run / "trace" / "rank0.trace.json").stat().st_size > 0


def test_the_layout_section_names_every_module_of_the_tree() -> None:
    """The Layout section of docs/architecture.md lists the package's modules folder by folder: a module added,
    moved or removed without it fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = _code_blocks(text.split("## Layout", 1)[1], "")[0]
    listed: set[str] = set()
    folder = ""
    for line in layout.splitlines():
        name = line.strip().split("  ")[0]
        if line.startswith("  ") and not line.startswith("    ") and name.endswith("/"):
            folder = name
        for module in re.findall(r"(\w+\.py)", name):
            listed.add((folder if line.startswith("    ") else "") + module)
    tree = {str(p.relative_to(ROOT / "otel_train")) for p in (ROOT / "otel_train").glob("*.py")}
    tree |= {str(p.relative_to(ROOT / "otel_train")) for sub in ("capture", "collect", "ship", "verify", "hangs")
             for p in (ROOT / "otel_train" / sub).glob("*.py") if p.name != "__init__.py"}
    assert sorted(tree - listed) == [], "modules missing from the Layout section"
    assert sorted(listed - tree) == [], "the Layout section names modules that are gone"
