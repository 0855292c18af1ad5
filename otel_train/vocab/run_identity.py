"""Who produced a row: the run and rank (`RunInfo`, read from and written to the OTel Resource), and the
short hash of a run's hyperparameters recorded on it (`config_hash`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from otel_train.vocab import semconv

__all__ = [
    "CONFIG_HASH",
    "LOCAL_RANK",
    "PREEMPTED",
    "RUN_ID",
    "RUN_NAME",
    "THREAD_ID",
    "THREAD_NAME",
    "WORLD_SIZE",
    "RunInfo",
    "as_int",
    "config_hash",
]

RUN_ID = semconv.TRAIN_RUN_ID
RUN_NAME = semconv.TRAIN_RUN_NAME
LOCAL_RANK = semconv.TRAIN_LOCAL_RANK
WORLD_SIZE = semconv.TRAIN_WORLD_SIZE
CONFIG_HASH = semconv.TRAIN_CONFIG_HASH
THREAD_ID = semconv.THREAD_ID
THREAD_NAME = semconv.THREAD_NAME
PREEMPTED = semconv.RUN_PREEMPTED


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """Who produced a row: one rank of one training run (from the OTel Resource)."""

    run_id: str
    run_name: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    service_name: str = "otel-train"
    host: str = ""
    pid: int = 0
    config_hash: str = ""

    def __hash__(self) -> int:
        # Rows are grouped by run per point on the export thread: hash once, not per lookup.
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.run_id, self.run_name, self.rank, self.local_rank, self.world_size,
                           self.service_name, self.host, self.pid, self.config_hash))
            object.__setattr__(self, "_hash", cached)
        return cached

    def resource_attributes(self) -> dict[str, Any]:
        """The Resource attributes of DESIGN.md for this run and rank."""
        attrs: dict[str, Any] = {
            semconv.SERVICE_NAME: self.service_name,
            RUN_ID: self.run_id,
            RUN_NAME: self.run_name,
            semconv.TRAIN_RANK: self.rank,
            LOCAL_RANK: self.local_rank,
            WORLD_SIZE: self.world_size,
            semconv.HOST_NAME: self.host or socket.gethostname(),
            semconv.PROCESS_PID: self.pid or os.getpid(),
        }
        if self.config_hash:
            attrs[CONFIG_HASH] = self.config_hash
        return attrs

    @classmethod
    def from_resource(cls, attributes: Mapping[str, Any] | None) -> RunInfo:
        """Read a RunInfo back from Resource attributes (in-process or from OTLP)."""
        attrs = attributes or {}
        run_id = str(attrs.get(RUN_ID) or attrs.get("service.instance.id") or "unknown-run")
        return cls(
            run_id=run_id,
            run_name=str(attrs.get(RUN_NAME) or run_id),
            rank=as_int(attrs.get(semconv.TRAIN_RANK)),
            local_rank=as_int(attrs.get(LOCAL_RANK)),
            world_size=max(1, as_int(attrs.get(WORLD_SIZE), 1)),
            service_name=str(attrs.get("service.name") or "otel-train"),
            host=str(attrs.get("host.name") or ""),
            pid=as_int(attrs.get("process.pid")),
            config_hash=str(attrs.get(CONFIG_HASH) or ""),
        )


def as_int(value: Any, default: int = 0) -> int:
    """`value` as an int, or `default` when it is none (an attribute that is missing or not a number)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def config_hash(config: Mapping[str, Any] | None) -> str:
    """A short stable hash of a hyperparameter mapping, recorded on the Resource to match runs."""
    if not config:
        return ""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
