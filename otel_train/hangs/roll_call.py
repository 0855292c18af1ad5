"""The roll call (`otel-train hangs RUN_DIR`): which ranks are stuck where, and which one is the odd one out.

Stuck ranks are grouped by (open span, the main thread's innermost frame). When most stuck ranks share a place
(a collective) and a few do not, the few are where to look: the others wait for them. A rank whose file is not
``ended`` and whose heartbeat is old has stopped altogether (a dead node, a kill -9, a C call holding the GIL)
and is named from its last record; such ranks are where to look first. A rank that ended while stuck (its file
``ended`` with an ``ended`` record: a job stopped by a signal or its launcher mid-hang) is no longer stuck, but
the sentence still says where it was, grouped the same way, so the roll call after such a job points at the rank.

Example:
    >>> now = 1000.0
    >>> def f(state, phase, frame, user):
    ...     rec = {"state": state, "time": now, "step": 50, "phase": phase, "waited_s": 212.0,
    ...            "main_frame": frame, "user_frame": user, "native": True}
    ...     return {"state": state, "step": 50, "heartbeat_time": now, "heartbeat_s": 5.0, "latest": rec,
    ...             "world_size": 3}
    >>> c10d = "torch/distributed/distributed_c10d.py:2501 in all_reduce"
    >>> load = "train.py:41 in load_batch"
    >>> files = {0: f("stuck", "backward", c10d, "train.py:88 in main"), 1: f("stuck", "data", load, load),
    ...          2: f("stuck", "backward", c10d, "train.py:88 in main")}
    >>> print(take_roll_call(files, now=now).verdict())
    ranks [0, 2] have waited 212 s in `backward` at `torch/distributed/distributed_c10d.py:2501 in all_reduce` (from `train.py:88 in main`); rank [1] has waited 212 s in `data` at `train.py:41 in load_batch`: rank 1 is where to look
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["Group", "RollCall", "take_roll_call"]


def silent_after_s(heartbeat_s: float) -> float:
    """How long after its last heartbeat a rank counts as stopped."""
    return 3 * heartbeat_s + 10


@dataclasses.dataclass(frozen=True)
class Group:
    """Stuck ranks in the same place."""

    ranks: list[int]
    phase: str
    frame: str
    user_frame: str | None
    native: bool
    waited_s: float
    steps: list[int]

    def place(self) -> str:
        where = f"in `{self.phase}` at `{self.frame}`"
        if self.user_frame and self.user_frame != self.frame:
            where += f" (from `{self.user_frame}`)"
        return where


@dataclasses.dataclass(frozen=True)
class Silent:
    """A rank that stopped writing: its last known state."""

    rank: int
    silent_s: float
    host: str | None
    last: Mapping[str, Any] | None
    state: str
    step: int | None
    native_frames: list[str]  # the main thread's stack from a faulthandler dump made after the last heartbeat


@dataclasses.dataclass(frozen=True)
class RollCall:
    groups: list[Group]
    silent: list[Silent]
    running: dict[int, int | None]  # rank -> its step: alive, not stuck
    ended: list[int]
    missing: list[int]  # ranks below the world size without a file
    missing_label: str = "without a hang file"  # how the counts name them (the sink: never heard from)
    ended_stuck: list[Group] = dataclasses.field(default_factory=list)  # ranks that ended while stuck, by place

    @property
    def stuck(self) -> bool:
        """Some rank is stuck or has stopped (the CLI's exit status 1)."""
        return bool(self.groups or self.silent)

    def suspects(self) -> list[int]:
        """The ranks to look at first: stopped ranks; else the ranks outside the one largest stuck group; else
        ranks still running while others are stuck. With none stuck: the odd ones out of the ranks that ended
        while stuck."""
        if self.silent:
            return sorted(s.rank for s in self.silent)
        groups = self.groups if self.stuck else self.ended_stuck
        if len(groups) > 1 and len(groups[0].ranks) > len(groups[1].ranks):
            return sorted(r for g in groups[1:] for r in g.ranks)
        if self.groups and self.running:
            return sorted(self.running)
        return []

    def verdict(self) -> str:
        """The one-line answer."""
        if not self.stuck:
            text = f"no rank is stuck ({_counts(self)})"
            if self.ended_stuck:
                text += "; the job ended while " + "; ".join(
                    f"{_ranks(g.ranks)} had waited {g.waited_s:.0f} s {g.place()}" for g in self.ended_stuck)
                suspects = self.suspects()
                if suspects:
                    text += f": {_who(suspects)} where to look"
            return text
        parts = [f"{_ranks(g.ranks)} {'have' if len(g.ranks) > 1 else 'has'} waited {g.waited_s:.0f} s {g.place()}"
                 + (" (in native code)" if g.native and len(self.groups) == 1 else "") for g in self.groups]
        parts += [f"{_ranks([s.rank])} has sent nothing for {s.silent_s:.0f} s{_last(s)}" for s in self.silent]
        if self.groups and self.running:
            parts.append(f"{_ranks(sorted(self.running))} {'are' if len(self.running) > 1 else 'is'} not stuck")
        suspects = self.suspects()
        text = "; ".join(parts)
        if suspects:
            text += f": {_who(suspects)} where to look"
        return text

    def text(self, run_dir: str) -> str:
        """The verdict, then one line per group and per stopped or missing rank."""
        lines = [self.verdict()]
        if not self.stuck:
            for g in self.ended_stuck:
                steps = ", ".join(str(s) for s in sorted(set(g.steps)))
                lines.append(f"  {_ranks(g.ranks)}: ended while stuck at step {steps}, {g.place()}"
                             f"{' in native code' if g.native else ''}")
            if self.ended_stuck:
                lines.append(f"  every thread's stack: {run_dir}/hang/rank<N>.json")
            return "\n".join(lines)
        for g in self.groups:
            steps = ", ".join(str(s) for s in sorted(set(g.steps)))
            lines.append(f"  {_ranks(g.ranks)}: step {steps}, {g.place()}{' in native code' if g.native else ''}")
        for s in self.silent:
            at = f"{s.state} at step {s.step}" if s.step is not None else f"{s.state}, before its first step"
            lines.append(f"  {_ranks([s.rank])}: possibly dead (host {s.host}; its last heartbeat, {s.silent_s:.0f} s "
                         f"ago, said {at}){_last(s)}")
        if self.running:
            lines.append("  running: " + ", ".join(f"rank {r} (step {s})" for r, s in sorted(self.running.items())))
        if self.missing:
            lines.append(f"  no hang file: {_ranks(self.missing)} (watchdog off, or the rank never started)")
        lines.append(f"  every thread's stack: {run_dir}/hang/rank<N>.json")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"stuck": self.stuck, "suspects": self.suspects(), "verdict": self.verdict(),
                "groups": [dataclasses.asdict(g) for g in self.groups],
                "silent": [{"rank": s.rank, "silent_s": round(s.silent_s, 1), "host": s.host, "state": s.state,
                            "step": s.step, "last": s.last, "native_frames": s.native_frames} for s in self.silent],
                "running": {str(r): s for r, s in sorted(self.running.items())}, "ended": self.ended,
                "ended_stuck": [dataclasses.asdict(g) for g in self.ended_stuck], "missing": self.missing}


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"


def _ranks(ranks: list[int]) -> str:
    return f"{'ranks' if len(ranks) > 1 else 'rank'} [{', '.join(map(str, ranks))}]"


def _last(s: Silent) -> str:
    if s.native_frames:  # the watchdog could not run: faulthandler's dump, made without the GIL
        return f" (its main thread holds the GIL in native code, called from `{s.native_frames[0]}`)"
    last = s.last
    if not last or last.get("state") != "stuck":
        return ""
    return f" (last record: in `{last.get('phase')}` at `{last.get('main_frame')}`)"


def _counts(call: RollCall) -> str:
    parts = [f"{len(call.running)} running", f"{len(call.ended)} ended"]
    if call.missing:
        parts.append(f"{len(call.missing)} {call.missing_label}")
    return ", ".join(parts)


def take_roll_call(files: Mapping[int, Mapping[str, Any]], now: float | None = None,
                   missing_label: str = "without a hang file") -> RollCall:
    """The roll call over every rank's hang file (`otel_train.hangs.hang_file.read_hang_files`) at time `now`;
    `missing_label` names the ranks below the world size that have none (the sink's: ``never heard from``)."""
    now = time.time() if now is None else now
    by_place: dict[tuple[str, str], list[tuple[int, Mapping[str, Any]]]] = {}
    ended_by_place: dict[tuple[str, str], list[tuple[int, Mapping[str, Any]]]] = {}
    silent: list[Silent] = []
    running: dict[int, int | None] = {}
    ended: list[int] = []
    world = 0
    for rank, content in sorted(files.items()):
        world = max(world, int(content.get("world_size") or 0))
        state = str(content.get("state"))
        latest = content.get("latest") or None
        if state == "ended":
            ended.append(rank)
            if latest is not None and latest.get("state") == "ended":  # it ended while stuck
                ended_by_place.setdefault(_place(latest), []).append((rank, latest))
            continue
        quiet_s = now - float(content.get("heartbeat_time") or 0.0)
        if quiet_s > silent_after_s(float(content.get("heartbeat_s") or 30.0)):
            dump = content.get("native_dump") or {}
            silent.append(Silent(rank, quiet_s, content.get("host"), latest, state, content.get("step"),
                                 list(dump.get("main_frames") or [])))
        elif state == "stuck" and latest is not None:
            by_place.setdefault(_place(latest), []).append((rank, latest))
        else:
            running[rank] = content.get("step")
    missing = [r for r in range(world) if r not in files]
    return RollCall(_groups(by_place, now), silent, running, ended, missing, missing_label,
                    _groups(ended_by_place, None))


def _place(record: Mapping[str, Any]) -> tuple[str, str]:
    return str(record.get("phase")), str(record.get("main_frame"))


def _groups(by_place: Mapping[tuple[str, str], list[tuple[int, Mapping[str, Any]]]], now: float | None) -> list[Group]:
    """Ranks by place, the largest group first; `now`: the wait goes on since each record (None: it ended)."""
    groups = []
    for (phase, frame), members in by_place.items():
        first = members[0][1]
        groups.append(Group(
            ranks=[r for r, _ in members], phase=phase, frame=frame, user_frame=first.get("user_frame"),
            native=all(bool(m.get("native")) for _, m in members),
            waited_s=max(float(m.get("waited_s") or 0.0)
                         + (0.0 if now is None else max(0.0, now - float(m.get("time") or now))) for _, m in members),
            steps=[int(m["step"]) for _, m in members if m.get("step") is not None]))
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks))
    return groups
