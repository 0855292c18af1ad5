"""A full disk: training never stops, every step still lands once, the failure is logged once, a loss is counted.

Under the spool, two ways to fill it: a patched segment write in the exporter process (a `sitecustomize` that
makes the spool's file object return a short write, then raise ENOSPC, for a range of appends: runs anywhere),
and a real 64 KiB tmpfs mounted on the spool folder and filled up mid-run (needs root to mount). Under the whole
run folder (every file backend and the spool): a real 2 MiB tmpfs filled mid-run, then freed or never freed
(needs root; the same faults through a hook that runs anywhere are in tests/exporters/test_storage_faults.py).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from faultkit import SERIES, expected, jsonl_points, tb_points, value

import otel_train as ot
from otel_train.vocab.run_paths import run_folder

STEPS = 40

FULL_DISK = textwrap.dedent("""
    # Loaded at start by every interpreter of the test (the exporter process too): the spool's segment
    # writes number FROM..TO-1 fail as on a full disk (a short write first, then ENOSPC).
    import errno, io, os
    import otel_train.ship.spool as spool
    FROM, TO = map(int, os.environ["FAKE_ENOSPC"].split(":"))
    count = [0]

    class FullDisk(io.FileIO):
        def write(self, b):
            count[0] += 1
            if FROM <= count[0] < TO:
                if count[0] == FROM:
                    return super().write(bytes(b)[: len(b) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(b)

    spool.open = lambda path, mode="r", buffering=-1: FullDisk(path, mode)
""")

TRAIN = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    import otel_train as ot
    from faultkit import SERIES, value
    ot.init(exporters=["jsonl", "tensorboard"], dir=sys.argv[1], run_id="full", run_name="full",
            export_interval_s=0.02)
    for s in ot.steps(range({STEPS})):
        ot.log({{tag: value(tag, s) for tag in SERIES}})
        if s % 10 == 9:
            ot.flush()  # syncs the spool: must not fail either
    print("TRAINED", s, flush=True)
    ot.shutdown()
""")


def _replay(run_dir: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(run_dir)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _verify(run_dir: Path) -> tuple[int, str]:
    """`otel-train verify` on a run: its exit status and report."""
    done = subprocess.run([sys.executable, "-m", "otel_train.cli", "verify", str(run_dir)], capture_output=True,
                          text=True, timeout=120, check=False)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(("fail", "recovers"), [("2:4", True), ("2:1000000", False)])
def test_disk_full_on_the_spool_delivers_from_memory(tmp_path: Path, fail: str, recovers: bool) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FULL_DISK)
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_TRAIN_")}
    env.update(PYTHONPATH=str(tmp_path / "site"), FAKE_ENOSPC=fail)
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(out)], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"TRAINED {STEPS - 1}"]  # training never stopped
    err = proc.stderr
    assert err.count("cannot write the spool") == 1, err  # logged once, with the reason
    assert "No space left on device" in err or "short write" in err
    assert "exporter process exited" not in err  # the exporter process did not die of it
    again = re.findall(r"the spool \S+ is writable again; (\d+) window\(s\) so far were delivered from memory only", err)
    assert again == (["2"] if recovers else []), err  # counted: appends 2 and 3 failed
    points = jsonl_points(out, "full")
    assert len(points) == len(set(points)) and set(points) == expected(range(STEPS))  # every step, once
    assert sorted(tb_points(out / "full")) == sorted(expected(range(STEPS), as_f32=True))
    assert "every one delivered to every backend" in _replay(out / "full")  # replay finds nothing left, adds nothing
    assert len(jsonl_points(out, "full")) == len(points)


def test_real_tmpfs_filled_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "runs"
    spool_root = run_folder(out, "tmpfs") / "spool"
    spool_root.mkdir(parents=True)
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command to mount a tmpfs with")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(spool_root)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    filler = spool_root / "filler"
    try:
        caplog.set_level(logging.WARNING, logger="otel_train")
        ot.init(exporters=["jsonl", "tensorboard"], dir=out, run_id="tmpfs", run_name="tmpfs",
                export_interval_s=0.02)
        pad = {f"pad/{i}": float(i) for i in range(32)}  # windows large enough to outgrow a segment's last page
        for s in ot.steps(range(STEPS)):
            ot.log({**pad, **{tag: value(tag, s) for tag in SERIES}})
            time.sleep(0.01)
            if s == 10:
                assert ot.flush(timeout_s=30)
                with open(filler, "wb", buffering=0) as f:  # fill the disk to the last byte
                    try:
                        while f.write(b"\0" * 512):
                            pass
                    except OSError:
                        pass
            if s == 25:
                assert ot.flush(timeout_s=30)  # every window so far reached the backends, from memory
                filler.unlink()
    finally:
        ot.shutdown()
        subprocess.run(["umount", "-l", str(spool_root)], check=False)
    messages = [r.getMessage() for r in caplog.records]
    # The kernel's first answer on a full disk is a short write (the old code ignored it: a torn record).
    assert sum("cannot write the spool" in m and "short write" in m for m in messages) == 1, messages
    (again,) = [m for m in messages if "is writable again" in m]
    assert int(re.search(r"again; (\d+) window", again)[1]) > 0, again  # type: ignore[index]
    points = jsonl_points(out, "tmpfs")
    assert len(points) == len(set(points)) and set(points) == expected(range(STEPS))
    assert sorted(tb_points(out / "tmpfs")) == sorted(expected(range(STEPS), as_f32=True))


def test_a_segment_that_cannot_be_opened_is_skipped_then_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    import errno

    from otel_train.ship import spool as spool_module

    spool = spool_module.Spool(tmp_path / "rank0")
    assert spool.append(1, 0, b"one")
    spool._file_bytes = spool_module._SEGMENT_BYTES  # the next append rolls to a new segment
    real_open = open

    def full(path: Path, *args: object, **kwargs: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_module, "open", full, raising=False)
    assert not spool.append(2, 1, b"two")  # never raises: counted and logged
    monkeypatch.setattr(spool_module, "open", real_open, raising=False)
    assert spool.append(3, 2, b"three")
    spool.close()
    assert spool.failed_appends == 1
    assert [(seq, payload) for seq, _, payload in spool_module.Spool(tmp_path / "rank0").read(0)] == [
        (1, b"one"), (3, b"three")]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot write the spool" in m for m in messages) == 1 and sum("writable again" in m for m in messages) == 1


# -- The run folder itself on a full disk: every file backend (TensorBoard, JSONL, the Chrome trace) ----------
ON_TMPFS = textwrap.dedent(f"""
    # argv: the run folder's root (a small tmpfs), the step after which the disk is filled, the step after
    # which it is freed again (-1: never). With FAKE_FULL_FLAG set, the disk is "full" while that file exists
    # (the `sitecustomize` below), not filled.
    import os, sys, time
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    import otel_train as ot
    from faultkit import SERIES, value
    out, fill_at, free_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    filler = os.path.join(out, "filler")
    ot.init(exporters=["jsonl", "tensorboard", "chrome_trace"], dir=out, run_id="full", run_name="full",
            export_interval_s=0.02)
    pad = {{f"pad/{{i}}": float(i) for i in range(16)}}  # windows large enough to be cut mid-record
    for s in ot.steps(range({STEPS} * 2)):
        ot.log({{**pad, **{{tag: value(tag, s) for tag in SERIES}}}})
        time.sleep(0.01)
        if s == fill_at and os.environ.get("FAKE_FULL_FLAG"):
            assert ot.flush(timeout_s=30)
            open(os.environ["FAKE_FULL_FLAG"], "w").close()
        elif s == fill_at:
            assert ot.flush(timeout_s=30)
            with open(filler, "wb", buffering=0) as f:  # to the last byte
                try:
                    while f.write(b"\\0" * 4096):
                        pass
                except OSError:
                    pass
                try:
                    while f.write(b"\\0"):
                        pass
                except OSError:
                    pass
        if s == free_at:
            os.unlink(os.environ.get("FAKE_FULL_FLAG") or filler)
    print("TRAINED", s, flush=True)
    ot.shutdown()
""")


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command to mount a tmpfs with")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {mounted.stderr.strip()}")


# Loaded at start by every interpreter of the test (the exporter process too): while the flag file exists, the
# file backends' appends (`otel_train.ship.file_append`) get what a full disk gives, a short write, then ENOSPC.
FULL_FLAG = textwrap.dedent("""
    import errno, os
    import otel_train.ship.file_append as file_append
    real, flag = file_append._write, os.environ["FAKE_FULL_FLAG"]

    def write(fd, data):
        if not os.path.exists(flag):
            return real(fd, data)
        if len(data) > 64:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    file_append._write = write
""")


def _train_on_a_full_disk(tmp_path: Path, fill_at: int, free_at: int, how: str) -> tuple[Path, str]:
    """Run the trainer with its run folder on a real tmpfs (`how="tmpfs"`, needs root) or with the fault hook."""
    out = tmp_path / "runs"
    (tmp_path / "train.py").write_text(ON_TMPFS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_TRAIN_")}
    env.update(OTEL_TRAIN_SELF_METRICS="0", OTEL_TRAIN_SYSTEM_METRICS="0", OTEL_TRAIN_SHUTDOWN_TIMEOUT_S="5")
    if how == "hook":
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(FULL_FLAG)
        env.update(PYTHONPATH=str(tmp_path / "site"), FAKE_FULL_FLAG=str(tmp_path / "full"))
    else:
        _mount_tmpfs(out, "2m")
    try:
        proc = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(out), str(fill_at), str(free_at)],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines() == [f"TRAINED {2 * STEPS - 1}"]  # training never stopped
        if how == "hook":
            return out, proc.stderr
        if free_at < 0:
            (out / "filler").unlink()  # room to copy the files out before the tmpfs goes
        copy = tmp_path / "copy"
        shutil.copytree(out, copy, ignore=shutil.ignore_patterns("filler"))
    finally:
        if how == "tmpfs":
            subprocess.run(["umount", "-l", str(out)], check=False)
    return copy, proc.stderr


def _summary(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("otel-train: ") and " points in " in x]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _trace_counters(run_dir: Path, strict: bool = True) -> list[tuple[str, float]]:
    """The trace's counter events; `strict`: the file must be valid JSON (closed cleanly), else as viewers load
    a file whose closing ``]`` never got written (a disk still full at shutdown)."""
    import json

    from otel_train.trace_merge import load_trace

    (path,) = (run_dir / "trace").iterdir()
    events = json.loads(path.read_text()) if strict else load_trace(path)
    return [(e["name"], e["args"]["value"]) for e in events if e.get("ph") == "C"]


def _all_rows(run_dir: Path) -> dict[str, int]:
    """Rows each backend holds (every series): JSONL and TensorBoard metric points, trace counter events."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
    import readback

    from otel_train.exporters.jsonl import read_jsonl

    return {"jsonl": sum(r["type"] == "metric" for r in read_jsonl(run_dir / "rank0.jsonl")),
            "tensorboard": len(readback.tensorboard(run_dir)), "chrome_trace": len(_trace_counters(run_dir, strict=False))}


def _rows_left_in_spool(run_dir: Path) -> dict[str, int]:
    """Per backend: the metric rows of the windows its rank-0 spool holds after its cursor (not delivered)."""
    from otel_train.ship.framing import decode_window
    from otel_train.ship.spool import Spool

    spool = Spool(run_dir / "spool" / "rank0")
    try:
        return {name: sum(len(decode_window(payload).metrics) for _, _, payload in spool.read(spool.cursor(name)))
                for name in ("jsonl", "tensorboard", "chrome_trace")}
    finally:
        spool.close()


@pytest.mark.parametrize("how", ["tmpfs", "hook"])
def test_run_folder_on_a_full_disk_then_freed_every_point_once(tmp_path: Path, how: str) -> None:
    copy, err = _train_on_a_full_disk(tmp_path, fill_at=10, free_at=50, how=how)
    steps = range(2 * STEPS)
    points = jsonl_points(copy, "full")
    assert sorted(points) == sorted(expected(steps))  # every step, once: nothing garbled, nothing twice
    assert sorted(tb_points(copy / "full")) == sorted(expected(steps, as_f32=True))  # TensorBoard reads past the fault
    want = sorted((tag, value(tag, s)) for s in steps for tag in SERIES)
    assert sorted(c for c in _trace_counters(copy / "full") if c[0] in SERIES) == want
    assert "No space left on device" in err, err[-3000:]  # the fault was real, and said
    line = _summary(err)
    assert "rows not written" not in line and "; 0 dropped;" in line, line  # no backend lost a row
    code, report = _verify(copy / "full")
    assert code == 0, report  # every logged value once in every backend, by their own readers


@pytest.mark.parametrize("how", ["tmpfs", "hook"])
def test_run_folder_on_a_full_disk_never_freed_counts_the_loss_exactly(tmp_path: Path, how: str) -> None:
    copy, err = _train_on_a_full_disk(tmp_path, fill_at=10, free_at=-1, how=how)
    run = copy / "full"
    points = jsonl_points(copy, "full")
    assert len(points) == len(set(points)) and set(points) <= expected(range(2 * STEPS))  # what landed: once
    assert set(points) >= expected(range(11))  # everything before the disk filled
    from otel_train.exporters.jsonl import read_jsonl

    per_step = len({r["name"] for r in read_jsonl(run / "rank0.jsonl") if r["type"] == "metric" and r["step"] == 0})
    handed = per_step * 2 * STEPS  # rows each backend was handed (no self or system metrics)
    line = _summary(err)
    held = _all_rows(run)
    waiting = _rows_left_in_spool(run)
    for backend in ("jsonl", "tensorboard", "chrome_trace"):
        lost = handed - held[backend]
        assert lost > 0, (backend, held)
        # What the backend lacks is counted as lost to the full disk, but for the windows the spool holds after
        # its cursor (its failed write held the rest back there): those are `otel-train replay`'s to deliver.
        counted = lost - waiting[backend]
        said = re.findall(rf"{backend}: ([\d,]+ rows not written \([^)]*\))", line)
        assert said == ([f"{counted:,} rows not written ({counted:,} disk full)"] if counted else []), (
            backend, lost, waiting, line)
    code, report = _verify(run)
    print(report)
    if how == "tmpfs":  # the spool (on the same full disk) could not hold it either
        assert "durable" not in line and "data is durable" not in err, err[-3000:]
        return
    # The hook fills only the backends' disk: the spool kept every window, so a replay (with space) heals it all.
    _replay(copy / "full")
    assert sorted(jsonl_points(copy, "full")) == sorted(expected(range(2 * STEPS)))
    assert sorted(tb_points(copy / "full")) == sorted(expected(range(2 * STEPS), as_f32=True))
    code, report = _verify(copy / "full")
    assert code == 0, report
