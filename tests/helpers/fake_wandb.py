"""A stand-in `wandb` module that an exporter process (a fresh interpreter) imports from disk, for fault tests
of a backend that records, hangs, is slow at its first write, fails, or fails to import (`FAKE_WANDB`); its
import takes `FAKE_WANDB_IMPORT_S` seconds when set (then it leaves a file ``imported``)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

# A stand-in `wandb` the exporter process imports from disk: it records every `log` or hangs in it.
FAKE_WANDB = textwrap.dedent("""
    import json, os, time, types
    Settings = dict
    with open(os.path.join(os.environ["FAKE_WANDB_DIR"], "pids"), "a") as f:  # the processes that imported it
        f.write(f"{os.getpid()}\\n")
    if os.environ.get("FAKE_WANDB") == "broken":
        raise RuntimeError("injected: no wandb here")
    if os.environ.get("FAKE_WANDB_IMPORT_S"):  # a client whose import takes that long (a busy machine, a big one)
        time.sleep(float(os.environ["FAKE_WANDB_IMPORT_S"]))
        open(os.path.join(os.environ["FAKE_WANDB_DIR"], "imported"), "w").close()

    class _Run:
        starting_step = 0
        def __init__(self):
            self.settings = types.SimpleNamespace(wandb_dir=os.environ["FAKE_WANDB_DIR"])
        def log(self, data, step):
            if os.environ.get("FAKE_WANDB") == "hang":
                time.sleep(3600)
            if os.environ.get("FAKE_WANDB") == "slow" and not getattr(_Run, "warm", False):
                _Run.warm = True
                time.sleep(3)  # a slow first write (a store being created, a service starting on a busy machine)
            if os.environ.get("FAKE_WANDB") == "fail":
                raise RuntimeError("W&B is down")
            with open(os.path.join(os.environ["FAKE_WANDB_DIR"], "logged.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **data}) + "\\n")
        def finish(self):
            pass

    def init(settings=None, **kwargs):
        return _Run()
""")



def fake_wandb_env(root: Path, mode: str) -> dict[str, str]:
    """Environment for a process whose `import wandb` gets the stand-in, in `mode` (record, hang, slow, fail, broken);
    what it records goes to ``<root>/wandb-out/logged.jsonl``."""
    fakes = root / "fakes"
    (fakes / "wandb").mkdir(parents=True, exist_ok=True)
    (fakes / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    (root / "wandb-out").mkdir(exist_ok=True)
    return {"PYTHONPATH": str(fakes), "FAKE_WANDB": mode, "FAKE_WANDB_DIR": str(root / "wandb-out")}


def use_fake_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, import_s: float = 0.0) -> Path:
    """Put the stand-in `wandb` first on `sys.path` (this process's and the processes it starts); returns where it
    records."""
    env = fake_wandb_env(tmp_path, mode)
    monkeypatch.syspath_prepend(env["PYTHONPATH"])
    # Out of `sys.modules` for the test: the real one, if a test before imported it, comes back at teardown, and
    # the stand-in goes (with `delitem` alone, a process that had not imported W&B kept the stand-in, and a later
    # test's `import wandb.proto` there failed).
    monkeypatch.setitem(sys.modules, "wandb", sys.modules.get("wandb"))
    monkeypatch.delitem(sys.modules, "wandb")
    monkeypatch.setenv("FAKE_WANDB", mode)
    monkeypatch.setenv("FAKE_WANDB_DIR", env["FAKE_WANDB_DIR"])
    if import_s:
        monkeypatch.setenv("FAKE_WANDB_IMPORT_S", str(import_s))
    return Path(env["FAKE_WANDB_DIR"])
