"""Eight processes as the ranks of one run: each rank's points land once, in the right place.

One subprocess imports otel-train once and forks the eight ranks (each calls `init` with its rank),
so the test costs one interpreter. With `OTEL_TRAIN_RANKS=0` only rank 0 writes metrics; with `all`
every rank writes its own; spans come from every rank either way.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from faultkit import SERIES, jsonl_points, jsonl_spans, value

WORLD = 8
SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    sys.path.insert(0, {kit!r})
    import faultkit
    import otel_train as ot
    from otel_train.exporters import jsonl  # noqa: F401  (imported once, before forking)
    pids = []
    for rank in range({world}):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ot.init(exporters=["jsonl"], dir={out!r}, run_id="job-8", run_name="job-8", ranks={ranks!r},
                        rank=rank, local_rank=rank, world_size={world})
                for s in ot.steps(range(12)):
                    with ot.span("step"):
                        ot.log({{tag: faultkit.value(tag, s) + rank for tag in faultkit.SERIES}})
                atexit._run_exitfuncs()
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    sys.exit(max(os.waitpid(p, 0)[1] for p in pids))
""")


@pytest.mark.parametrize("ranks", ["0", "all"])
def test_eight_ranks_of_one_run(tmp_path: Path, ranks: str) -> None:
    script = SCRIPT.format(kit=str(Path(__file__).parent), world=WORLD, out=str(tmp_path), ranks=ranks)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(WORLD):
        want = {(tag, s, value(tag, s) + rank) for s in range(12) for tag in SERIES}
        points = jsonl_points(tmp_path, "job-8", rank)
        if ranks == "all" or rank == 0:
            assert sorted(points) == sorted(want), rank  # exactly once each
        else:
            assert points == [], rank
        assert sorted(s["step"] for s in jsonl_spans(tmp_path, "job-8", rank)) == list(range(12))
