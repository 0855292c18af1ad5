"""Parsers of setting values, shared by `otel_train.config.settings` (the training process) and
`otel_train.sink.settings` (the sink): each takes the setting's name and its raw text and raises `ConfigError`
with one line naming the setting, the bad value and what is allowed."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from otel_train.errors import ConfigError

__all__ = ["choice", "parse_bool", "parse_config_json", "parse_cpus", "parse_exporters", "parse_int", "parse_nice",
           "parse_non_negative_float",
           "parse_path", "parse_positive_float", "parse_text"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(name: str, raw: str) -> bool:
    """Parse a boolean setting; raise `ConfigError` naming the variable on anything else."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: {raw!r} is not a boolean; use one of 1, true, yes, on, 0, false, no, off")


#: The largest size or count a setting takes (a deque's length, a socket's buffer: beyond it they overflow at run time).
MOST_INT = 2**31 - 1
#: The longest time a setting takes, in seconds (~31 years: "never" in practice; Python's waits refuse far more).
MOST_SECONDS = 1e9


def parse_int(name: str, raw: str, minimum: int, most: int = MOST_INT) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer; expected an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}: {value} is too small; expected an integer >= {minimum}")
    if value > most:
        raise ConfigError(f"{name}: {value} is too large; expected an integer from {minimum} to {most}")
    return value


def parse_positive_float(name: str, raw: str, unit: str = "seconds", most: float = MOST_SECONDS) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number; expected {unit} > 0") from None
    if not 0 < value <= most:
        raise ConfigError(f"{name}: {raw!r} is not allowed; expected a number of {unit} > 0 and at most {most:g}")
    return value


def parse_non_negative_float(name: str, raw: str) -> float:
    """A finite number >= 0 (a size, a cap where 0 turns a feature off)."""
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number; expected a finite number >= 0") from None
    if not value >= 0 or math.isinf(value):
        raise ConfigError(f"{name}: {raw!r} is not allowed; expected a finite number >= 0")
    return value


def parse_exporters(name: str, raw: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in raw.split(",") if part.strip())
    seen: list[str] = []
    for part in names:
        if part not in seen:
            seen.append(part)
    return tuple(seen)


def choice(allowed: tuple[str, ...]) -> Callable[[str, str], str]:
    """A parser accepting one of `allowed` (case-insensitive)."""
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ConfigError(f"{name}: {raw!r} is not allowed; use one of {', '.join(allowed)}")
        return value
    return parse


def parse_config_json(name: str, raw: str) -> Mapping[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{name}: not valid JSON ({err.msg} at char {err.pos}); expected a JSON object") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: {raw[:60]!r} is not allowed; expected a JSON object")
    return value


def parse_cpus(name: str, raw: str) -> tuple[int, ...]:
    """A CPU list as `taskset -c` takes it: ``1``, ``0,2``, ``8-9,12``."""
    cpus: set[int] = set()
    try:
        for part in raw.replace(" ", "").split(","):
            first, dash, last = part.partition("-")
            lo, hi = int(first), int(last if dash else first)  # `0-` is no range
            if lo < 0 or hi < lo:
                raise ValueError(part)
            cpus.update(range(lo, hi + 1))
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a CPU list; expected e.g. `1`, `0,2` or `8-9,12`") from None
    return tuple(sorted(cpus))


def parse_nice(name: str, raw: str) -> int:
    value = parse_int(name, raw, 0)
    if value > 19:
        raise ConfigError(f"{name}: {value} is too large; expected an integer from 0 to 19")
    return value


def parse_text(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ConfigError(f"{name}: empty value is not allowed; unset it or give a non-empty string")
    return value


def parse_path(name: str, raw: str | os.PathLike[str]) -> Path:
    """A folder setting, `~` and `~user` expanded; a `~user` with no home directory is a one-line `ConfigError`
    (pathlib raises `RuntimeError` there)."""
    text = parse_text(name, raw) if isinstance(raw, str) else os.fspath(raw)
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ConfigError(f"{name}: {text!r} names no user's home directory; give an absolute path, a relative "
                          "one, or ~/...") from None
