"""A stand-in `wandb` module that an exporter process (a fresh interpreter) imports from disk, for fault tests
of a backend that records, hangs, is slow at its first write, fails, or fails to import (`FAKE_WANDB`); its
import takes `FAKE_WANDB_IMPORT_S` seconds when set (then it leaves a file ``imported``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

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
