"""No import cycles among the project's modules: every `import` in every module counts, those inside functions
and under `TYPE_CHECKING` too (two modules that import each other can only be understood together, however
late the import runs)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import otel_train
import otel_train.exporters


def modules(package: str, folder: Path) -> dict[str, Path]:
    """Every module under `folder`, by its dotted name in `package`."""
    found = {}
    for path in folder.rglob("*.py"):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a name imported from a package counts as its submodule
    when it is one, else as the package's `__init__`)."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            deps.update(o for o in map(owner, names) if o is not None and o != mod)
        graph[mod] = deps
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        return list(err.args[1])
    return None


def test_the_project_has_no_import_cycle() -> None:
    mods = modules("otel_train", Path(otel_train.__file__).parent)
    mods.update(modules("otel_train.exporters", Path(otel_train.exporters.__file__).parent))
    assert len(mods) > 120  # the whole project was walked
    found = cycle(import_graph(mods))
    assert found is None, "import cycle: " + " -> ".join(found or [])


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (pkg / "c.py").write_text("def f():\n    from pkg.a import x\n")
    graph = import_graph(modules("pkg", pkg))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert sorted(set(cycle(graph) or [])) == ["pkg.a", "pkg.b", "pkg.c"]
