"""The built wheel maps `exporters/` to `otel_train.exporters` and never ships a top-level `exporters`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built once for the tests that read it."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True,
    )
    (built,) = out.glob("otel_train-*.whl")
    return built


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "otel_train/exporters/tensorboard.py" in names
    assert "otel_train/exporters/base.py" in names
    assert "otel_train/py.typed" in names
    assert not [n for n in names if n.startswith("exporters/")]
    # Every module of the source tree is in the wheel (a package missing from pyproject's list is not).
    sources = {f"otel_train/{p.relative_to(ROOT / 'otel_train').as_posix()}" for p in (ROOT / "otel_train").rglob("*.py")}
    assert sources - set(names) == set()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "otel-train = otel_train.cli:main" in text
    assert "[opentelemetry_metrics_exporter]" in text


def test_bare_exporters_is_not_importable(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import otel_train.exporters.base; import exporters"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0
    assert "No module named 'exporters'" in result.stderr


_STRAY = (".whl", ".tar.gz", ".pyc", ".so", ".zip")
_STRAY_DIRS = ("otel-train-runs/", "wandb/", "mlruns/", ".venv", "__pycache__/", ".ci/")


def _stray(names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(_STRAY) or any(d in n for d in _STRAY_DIRS)]


def test_wheel_and_sdist_hold_no_stray_files(wheel: Path, tmp_path: Path) -> None:
    """Build artefacts, run folders and binaries never ship, in the wheel nor in the sdist."""
    import tarfile

    assert _stray(zipfile.ZipFile(wheel).namelist()) == []
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    (sdist,) = tmp_path.glob("otel_train-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    assert any(n.endswith("otel_train/__init__.py") for n in names)
    assert _stray(names) == []
