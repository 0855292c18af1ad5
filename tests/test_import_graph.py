"""No import cycles among the project's modules: every `import` in every module counts, those inside functions
and under `TYPE_CHECKING` too (two modules that import each other can only be understood together, however
late the import runs)."""

from __future__ import annotations

from pathlib import Path

from import_graph import cycle, import_graph, modules

import otel_train
import otel_train.exporters


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
