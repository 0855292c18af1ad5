"""Which run and sender an OTLP Resource belongs to, for `otel_train.sink.decode.requests` and
`otel_train.sink.decode.traces`: the run by its attributes (cached, with names no other run holds), the run
of a Resource without `train.run.id`, the sending process."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from otel_train.sink.decode.metric_walk import MetricHeaders
from otel_train.sink.decode.otlp import MAX_RUN_ID_BYTES, DecodeError
from otel_train.sink.decode.points import AttributeCache
from otel_train.sink.decode.run_names import RunNames
from otel_train.vocab.run_identity import RUN_ID, RunInfo

__all__ = ["DecodeCache", "RunsSeen", "fallback_run_id", "resource_run", "sender_of"]


class RunsSeen(Protocol):
    """Where `resource_run` notes what it found (`otel_train.sink.decode.requests.Decoded` is one)."""

    sender: str
    runs: dict[RunInfo, int]
    unattributed: dict[str, int]

    def resource_began(self, run: RunInfo) -> None:
        """The Resource being decoded is `run`'s (before it adds anything: what a refusal takes back)."""


class DecodeCache:
    """What decoding learns once and reuses: RunInfo by Resource attributes (every process of every
    run has its own Resource) and decoded point attributes by their encoding. Both bounded.

    Args:
        names: Gives each run id a name no other run id holds (see `otel_train.sink.decode.run_names`);
            ``None``: names as the senders give them.
    """

    def __init__(self, max_entries: int = 10_000, names: RunNames | None = None) -> None:
        self._runs: dict[tuple[tuple[str, Any], ...], RunInfo] = {}
        self._max = max_entries
        self._names = names
        self.points = AttributeCache()
        self.headers = MetricHeaders()
        self._lock = threading.Lock()

    def run_for(self, resource_attributes: Mapping[str, Any]) -> RunInfo:
        """The run of a Resource.

        Raises:
            DecodeError: its `train.run.id` holds a NUL or is over 255 bytes (no backend can name it).
        """
        key = tuple(sorted(resource_attributes.items(), key=lambda kv: kv[0]))
        run = self._runs.get(key)
        if run is None:
            with self._lock:  # requests are decoded on several threads: one RunInfo per Resource
                return self._new_run(key, resource_attributes)
        return run

    def _new_run(self, key: tuple[tuple[str, Any], ...], resource_attributes: Mapping[str, Any]) -> RunInfo:
        run = self._runs.get(key)
        if run is None:
            if len(self._runs) >= self._max:
                self._runs.clear()
            attrs = resource_attributes
            if not attrs.get(RUN_ID):
                attrs = {**attrs, RUN_ID: fallback_run_id(attrs)}
            try:
                run = RunInfo.from_resource(attrs)
            except (OverflowError, ValueError) as err:  # `train.rank` = ±inf and the like: the sender's error
                raise DecodeError(f"a resource attribute is not allowed ({err}): `train.rank`, "
                                  "`train.local_rank`, `train.world_size` and `process.pid` must be integers") from None
            for what, value in (("train.run.id", run.run_id), ("train.run.name", run.run_name)):
                if "\x00" in value or len(value.encode("utf-8", "surrogatepass")) > MAX_RUN_ID_BYTES:
                    raise DecodeError(f"resource attribute `{what}` {value[:60]!r}... is not allowed: it holds a NUL "
                                      f"or is over {MAX_RUN_ID_BYTES} bytes")
            if self._names is not None:
                name = self._names.name_for(run.run_id, run.run_name)
                if name != run.run_name:
                    run = dataclasses.replace(run, run_name=name)
            self._runs[key] = run
        return run


def sender_of(attrs: Mapping[str, Any]) -> str:
    """Which process sent a Resource: its `service.instance.id` (the OTel SDKs set a UUID per process),
    else its host and pid. Cumulative state is kept per sender, so two processes never read as restarts
    of one another.

    Example:
        >>> sender_of({"service.instance.id": "7f3a"}), sender_of({"host.name": "n1", "process.pid": 42})
        ('7f3a', 'n1/42')
    """
    instance = attrs.get("service.instance.id")
    if instance:
        return str(instance)
    return f"{attrs.get('host.name', '')}/{attrs.get('process.pid', '')}"


def fallback_run_id(attrs: Mapping[str, Any]) -> str:
    """The run of a Resource without `train.run.id`, in this order: ``<service.name>-<service.instance.id>``
    (the Python SDK sets a UUID per process), ``<service.name>@<host.name>``, ``<service.name>``, then
    ``unknown-run``. Two apps with different service names never share a run.

    Example:
        >>> fallback_run_id({"service.name": "billing", "host.name": "node-3"})
        'billing@node-3'
        >>> fallback_run_id({"service.name": "billing", "service.instance.id": "7f3a"})
        'billing-7f3a'
    """
    service = str(attrs.get("service.name") or "")
    instance = attrs.get("service.instance.id")
    if instance:
        return f"{service}-{instance}" if service else str(instance)
    if service:
        host = attrs.get("host.name")
        return f"{service}@{host}" if host else service
    return "unknown-run"


def resource_run(attrs: dict[str, Any], has_data: bool, runs: DecodeCache, out: RunsSeen) -> RunInfo:
    """The run of one Resource of a request; counts Resources without `train.run.id` by their run."""
    run = runs.run_for(attrs)
    out.sender = sender_of(attrs)
    out.resource_began(run)
    if RUN_ID not in attrs:
        out.unattributed[run.run_id] = out.unattributed.get(run.run_id, 0) + 1
    if has_data:
        out.runs.setdefault(run, -1)
    return run
