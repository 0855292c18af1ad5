"""Read Chrome trace files (also ones cut off by a crash) and merge the ranks of a run into one.

The per-rank files written by the `chrome_trace` exporter use the rank as ``pid``, so a merge keeps
each rank on its own process track; metadata events (process and thread names) are kept once and
the other events are sorted by time. Files may be gzip-compressed (``.json.gz``, also cut off), and
an output named ``*.gz`` is written compressed.

A torch profiler trace (`prof.export_chrome_trace`) merges onto the same timeline
(`load_profiler_trace`): its times are moved to Unix microseconds like ours (``ts`` +
``baseTimeNanoseconds``), its host process becomes the rank's ``pid`` (its thread ids are the OS
thread ids, as ours, so torch ops sit under our spans on the same thread track) and its device
processes (GPU streams) get ``pid`` ``1000 * (rank + 1) + device``, named "rank R <name>".

Example:
    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "rank0.trace.json").write_text('[\\n{"name":"a","ph":"X","ts":2,"dur":1,"pid":0,"tid":1},\\n')
    >>> _ = (d / "rank1.trace.json").write_text('[{"name":"b","ph":"X","ts":1,"dur":1,"pid":1,"tid":1}]')
    >>> merge_traces(d / "all.json", [d / "rank0.trace.json", d / "rank1.trace.json"])
    2
    >>> [e["name"] for e in json.loads((d / "all.json").read_text())]
    ['b', 'a']
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["load_profiler_trace", "load_trace", "merge_traces"]

#: Categories of the torch profiler's host-side (CPU thread) events.
_HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation", "python_function", "cpu_instant_event", "fwdbwd",
                              "Trace", "overhead", "gpu_user_annotation_host"})
_DEVICE_PID_BASE = 1000
_PROCESS_METADATA = frozenset({"process_name", "process_labels", "process_sort_index"})

_logger = logging.getLogger(__name__)


def load_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a Chrome trace file.

    Reads the JSON array format, the object format (``{"traceEvents": [...]}``) and an array that
    was never closed (a process killed while tracing): every complete event before the cut is kept.

    Raises:
        ValueError: the file is not a Chrome trace (neither an array nor a ``traceEvents`` object).
    """
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _load_unterminated(text, path)
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        data = data["traceEvents"]
    if not isinstance(data, list):
        # The file's content is wrong, not the argument's type: ValueError, like json's own errors.
        raise ValueError(  # noqa: TRY004
            f"{os.fspath(path)}: not a Chrome trace (expected a JSON array or `traceEvents`)"
        )
    return [e for e in data if isinstance(e, dict)]


def _read_text(path: str | os.PathLike[str]) -> str:
    """The file's text; gzip is recognised by its magic bytes and may be cut off (no trailer)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        inflater = zlib.decompressobj(wbits=31)  # gzip framing; keeps going without the trailer
        try:
            raw = inflater.decompress(raw) + inflater.flush()
        except zlib.error as err:
            raise ValueError(f"{os.fspath(path)}: corrupt gzip data ({err})") from None
        if not inflater.eof:
            _logger.info("%s: gzip stream cut off; reading what was written", os.fspath(path))
    return raw.decode("utf-8", errors="replace")


def load_profiler_trace(path: str | os.PathLike[str], rank: int | None = None) -> list[dict[str, Any]]:
    """The events of a torch profiler Chrome trace, moved onto the clock and pids of our traces.

    Args:
        path: A file from `torch.profiler.profile.export_chrome_trace` (``.json`` or ``.json.gz``).
        rank: The rank it was recorded on; default its ``distributedInfo.rank``, else 0.

    Raises:
        ValueError: the file is not a Chrome trace.
    """
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = {"traceEvents": _load_unterminated(text, path)}
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{os.fspath(path)}: not a Chrome trace (expected `traceEvents`)")  # noqa: TRY004
    if rank is None:
        info = data.get("distributedInfo")
        rank = int(info.get("rank", 0)) if isinstance(info, dict) else 0
    events = [e for e in data["traceEvents"] if isinstance(e, dict)]
    # Kineto writes ts relative to `baseTimeNanoseconds`; older traces hold Unix µs already.
    base_us = float(data.get("baseTimeNanoseconds") or 0) / 1000.0
    host = {e.get("pid") for e in events if e.get("cat") in _HOST_CATEGORIES}
    host |= {e.get("pid") for e in events
             if e.get("name") == "process_labels" and (e.get("args") or {}).get("labels") == "CPU"}
    out: list[dict[str, Any]] = []
    for event in events:
        e = dict(event)
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] = round(e["ts"] + base_us, 3)
        pid = e.get("pid")
        if pid in host:
            e["pid"] = rank
            if e.get("ph") == "M" and e.get("name") in _PROCESS_METADATA:
                e.pop("tid", None)  # keyed like ours, so the rank's own names win in a merge
                if e.get("name") == "process_name":
                    e["args"] = {"name": f"rank {rank}"}
        elif isinstance(pid, int):
            e["pid"] = _DEVICE_PID_BASE * (rank + 1) + pid
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = {"name": f"rank {rank} {(e.get('args') or {}).get('name', pid)}"}
            elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": e["pid"]}
        out.append(e)
    return out


def _load_unterminated(text: str, path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Decode events one by one from an array without its end; stop at the first incomplete one."""
    decoder = json.JSONDecoder()
    pos = _skip(text, 0, "")
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{os.fspath(path)}: not a Chrome trace (expected a JSON array)")
    pos += 1
    events: list[dict[str, Any]] = []
    while True:
        pos = _skip(text, pos, ",")
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            event, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            _logger.info("%s: trace cut off after %d event(s); the rest is dropped", os.fspath(path), len(events))
            break
        if isinstance(event, dict):
            events.append(event)
    return events


def _skip(text: str, pos: int, extra: str) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in extra):
        pos += 1
    return pos


def _metadata_key(event: dict[str, Any]) -> tuple[Any, ...]:
    return (event.get("name"), event.get("pid"), event.get("tid"))


def merge_traces(out_path: str | os.PathLike[str], paths: Iterable[str | os.PathLike[str]],
                 profiler: Iterable[str | os.PathLike[str]] = ()) -> int:
    """Merge trace files (one per rank) and torch profiler traces into `out_path`, a valid JSON array.

    Pids are kept (the exporter uses the rank), metadata events are kept once per
    (name, pid, tid) (the first wins: ours before the profiler's) and come first; the other events
    are sorted by ``ts``. The output is written to a temporary file and renamed, so it is never
    half written; a name ending in ``.gz`` is written gzip-compressed.

    Args:
        out_path: The merged file.
        paths: Our per-rank traces.
        profiler: torch profiler traces (`load_profiler_trace`), each with the rank from its
            ``distributedInfo`` (else 0).

    Returns:
        The number of events written (metadata included).
    """
    metadata: dict[tuple[Any, ...], dict[str, Any]] = {}
    timed: list[dict[str, Any]] = []
    loaded = [load_trace(p) for p in paths] + [load_profiler_trace(p) for p in profiler]
    for trace in loaded:
        for event in trace:
            if event.get("ph") == "M":
                metadata.setdefault(_metadata_key(event), event)
            else:
                timed.append(event)
    timed.sort(key=lambda e: _ts(e.get("ts")))  # stable: equal times keep file order
    events = [*metadata.values(), *timed]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    opener: Any = gzip.open if out.name.endswith(".gz") else open
    with opener(tmp, "wt", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        f.write("\n]\n")
    os.replace(tmp, out)
    return len(events)


def _ts(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
