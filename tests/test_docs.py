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


def _layout() -> tuple[set[str], dict[str, set[str]]]:
    """The Layout section of docs/architecture.md: the modules it names (paths under `otel_train/`) and, per
    folder, the folders and top modules it says that folder imports (``...; imports a/, b, c/``)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = _code_blocks(text.split("## Layout", 1)[1], "")[0]
    listed: set[str] = set()
    imports: dict[str, set[str]] = {}
    stack: list[str] = []
    for line in layout.splitlines()[1:]:  # below `otel_train/`
        depth = (len(line) - len(line.lstrip(" "))) // 2
        if depth == 0:
            break  # the folders beside the package
        name, _, about = line.strip().partition("  ")
        del stack[depth - 1:]
        if name.endswith("/"):
            stack.append(name)
            rule = about.rsplit("; imports ", 1)
            assert len(rule) == 2, f"{''.join(stack)}: say what it imports (`...; imports a/, b`)"
            imports["".join(stack)] = {w.strip() for w in rule[1].split(",")} - {"nothing"}
        for module in re.findall(r"(\w+\.py)", name):
            listed.add("".join(stack) + module)
    return listed, imports


def test_the_layout_section_names_every_module_of_the_tree() -> None:
    """Every module of the package is named in its folder, and only those: a module added, moved or removed
    without the page fails here."""
    listed, _ = _layout()
    tree = {p.relative_to(ROOT / "otel_train").as_posix() for p in (ROOT / "otel_train").rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") or p.parent == ROOT / "otel_train"}
    assert sorted(tree - listed) == [], "modules missing from the Layout section"
    assert sorted(listed - tree) == [], "the Layout section names modules that are gone"


def test_each_folder_imports_only_what_the_layout_section_says() -> None:
    """Each folder's line ends with what it may import (folders and top modules of the package); the code's
    imports, lazy and `TYPE_CHECKING` ones included, stay within it."""
    from import_graph import import_graph, modules

    import otel_train
    import otel_train.exporters

    _, allowed = _layout()
    mods = modules("otel_train", Path(otel_train.__file__).parent)
    mods.update(modules("otel_train.exporters", Path(otel_train.exporters.__file__).parent))

    def place(module: str) -> str:
        """`sink/runs/` for otel_train.sink.runs.router, `backend` for otel_train.backend."""
        parts = module.split(".")[1:]
        path = "/".join(parts) + ("/" if mods[module].name == "__init__.py" else "")
        folders = [f for f in allowed if path.startswith(f)]
        if folders:
            return max(folders, key=len)
        return "exporters/" if parts[:1] == ["exporters"] else parts[0] if parts else "otel_train"

    wrong = []
    for module, deps in import_graph(mods).items():
        here = place(module)
        if here not in allowed:
            continue
        for dep in deps:
            there = place(dep)
            inside = there == here or there.startswith(here) or here.startswith(there)
            if not inside and there not in allowed[here]:
                wrong.append(f"{module} imports {dep} ({here} -> {there})")
    assert wrong == []
