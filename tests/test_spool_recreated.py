"""A spool folder deleted during the run (``rm -rf`` of the run folder) is created again with what the writer
still holds: the open segment's windows, the cursors, the written records, the writer lock; it is said once."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from otel_train.ship import spool as spool_mod
from otel_train.ship.framing import decode_window, encode_window
from otel_train.ship.spool import Spool, try_lock
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("run", "run")


def window(step: int) -> bytes:
    return encode_window(RUN, [("train/loss", step, float(step), 1_000 + step)])[0]


def _steps(path: Path, after: int = 0) -> list[int]:
    return [decode_window(p).metrics[0].step for _, _, p in Spool(path).read(after)]


def test_a_deleted_spool_folder_is_created_again_with_the_windows_not_yet_everywhere(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "run" / "spool" / "rank0"
    claim = try_lock(folder)  # the rank's claim, as `claim_run` takes it before the spool opens
    assert claim is not None
    sp = Spool(folder)
    sp.backends = ["jsonl", "wandb"]
    for seq in range(1, 6):
        assert sp.append(seq, seq, window(seq))
    sp.acknowledge("jsonl", 5)
    sp.acknowledge("wandb", 2)
    sp.advance("jsonl", 5)
    hooked: list[bool] = []
    sp.on_recreated.append(lambda: hooked.append((folder / "cursors.json").exists()))
    shutil.rmtree(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        assert sp.append(6, 6, window(6))
        assert sp.append(7, 7, window(7))
    said = [r.getMessage() for r in caplog.records if "was deleted during the run" in r.getMessage()]
    assert len(said) == 1 and str(folder) in said[0] and "with the 5 window(s)" in said[0], said
    assert hooked == [True]
    assert sp.sync() and sp.failed_appends == 0  # nothing lost from the spool: every window written ahead again
    assert try_lock(folder) is None  # the writer holds the new folder's lock: a second writer takes another name
    sp.acknowledge("wandb", 4)  # the cursor is saved in the new folder, not refused
    sp.close()
    os.close(claim)
    # What a restarted exporter process or `otel-train replay` finds: W&B still needs 5-7, JSONL 6-7.
    again = Spool(folder)
    assert again.cursor("wandb") == 4 and again.cursor("jsonl") == 5 and again.last_seq == 7
    assert _steps(folder, 4) == [5, 6, 7]
    assert _steps(folder) == [1, 2, 3, 4, 5, 6, 7]  # a list: a window written twice would show


def test_a_cursor_saved_after_the_deletion_creates_the_folder_again(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "spool" / "rank0"
    sp = Spool(folder)
    sp.backends = ["tb"]
    assert sp.append(1, 1, window(1)) and sp.append(2, 2, window(2))
    shutil.rmtree(tmp_path / "run")
    sp.acknowledge("tb", 1)  # before any new window: the backend's cursor save notices
    sp.close()
    assert Spool(folder).cursor("tb") == 1 and _steps(folder, 1) == [2]


def test_older_segments_lost_with_the_folder_are_counted_as_not_written_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "_SEGMENT_BYTES", 1)  # one record per segment: 1-3 closed, 4 open
    folder = tmp_path / "spool"
    sp = Spool(folder)
    sp.backends = ["a"]
    for seq in range(1, 5):
        assert sp.append(seq, seq, window(seq))
    sp.acknowledge("a", 1)
    shutil.rmtree(folder)
    assert sp.append(5, 5, window(5))
    assert sp.failed_appends == 2  # windows 2 and 3: in memory only now
    assert not sp.sync()  # so the spool does not call itself durable
    sp.close()
    assert _steps(folder, 1) == [4, 5]


def test_a_segment_that_cannot_be_written_again_is_not_called_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "spool"
    sp = Spool(folder)
    sp.backends = ["a"]
    for seq in range(1, 4):
        assert sp.append(seq, seq, window(seq))
    shutil.rmtree(folder)
    real_open = open

    class FullDisk:  # the rebuilt segment: the disk takes none of the old records
        def __init__(self, *args: object, **kwargs: object) -> None:
            self._f = real_open(*args, **kwargs)  # type: ignore[call-overload]

        def write(self, data: bytes) -> int:
            return 0

        def __getattr__(self, name: str) -> object:
            return getattr(self._f, name)

    monkeypatch.setattr(spool_mod, "open", FullDisk, raising=False)
    sp.append(4, 4, window(4))
    assert sp.failed_appends >= 3  # windows 1-3 (and 4, on this disk) are in memory only now
    assert not sp.sync()
    sp.close()
