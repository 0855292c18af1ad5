"""Read Chrome trace files (also ones cut off by a crash) and merge the ranks of a run into one.

The per-rank files written by the `chrome_trace` exporter use the rank as ``pid``, so a merge keeps
each rank on its own process track; metadata events (process and thread names) are kept once and
the other events are sorted by time.

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

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["load_trace", "merge_traces"]

_logger = logging.getLogger(__name__)


def load_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a Chrome trace file.

    Reads the JSON array format, the object format (``{"traceEvents": [...]}``) and an array that
    was never closed (a process killed while tracing): every complete event before the cut is kept.

    Raises:
        ValueError: the file is not a Chrome trace (neither an array nor a ``traceEvents`` object).
    """
    text = Path(path).read_text(encoding="utf-8")
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


def merge_traces(out_path: str | os.PathLike[str], paths: Iterable[str | os.PathLike[str]]) -> int:
    """Merge trace files (one per rank) into `out_path`, a valid JSON array.

    Pids are kept (the exporter uses the rank), metadata events are kept once per
    (name, pid, tid) (the first wins) and come first; the other events are sorted by ``ts``.
    The output is written to a temporary file and renamed, so it is never half written.

    Returns:
        The number of events written (metadata included).
    """
    metadata: dict[tuple[Any, ...], dict[str, Any]] = {}
    timed: list[dict[str, Any]] = []
    for path in paths:
        for event in load_trace(path):
            if event.get("ph") == "M":
                metadata.setdefault(_metadata_key(event), event)
            else:
                timed.append(event)
    timed.sort(key=lambda e: _ts(e.get("ts")))  # stable: equal times keep file order
    events = [*metadata.values(), *timed]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
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
