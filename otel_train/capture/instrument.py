"""What the training thread does: append to buffers, nothing else.

`LogBuffer` and `SpanBuffer` are bounded deques (thread-safe appends, oldest dropped when full);
every record carries a sequence number so the reader counts what was dropped without the hot
path paying for it. Conversion to numbers and to OTel data happens later, on the export thread.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import random
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.context.context import Context as _Context

from otel_train._internal.sdk import SPAN_KEY as _SPAN_KEY
from otel_train._internal.sdk import context_var
from otel_train.capture.attributes import held_attributes, held_value
from otel_train.capture.log_records import CapturedLog
from otel_train.capture.step import _current, current_step

if TYPE_CHECKING:
    from contextvars import Token

__all__ = ["NO_SPAN", "AttributedValues", "LogBuffer", "ProfiledSpanScope", "SpanBuffer", "SpanRecord", "SpanScope", "traced_with"]

_F = TypeVar("_F", bound=Callable[..., Any])
_SAMPLED = otel_trace.TraceFlags(otel_trace.TraceFlags.SAMPLED)
_context_var = context_var()
#: OTel's current context, read, set and reset as the API does, without its forwarding calls where it can.
_get_context = otel_context.get_current if _context_var is None else _context_var.get
_attach = otel_context.attach if _context_var is None else _context_var.set
_reset = otel_context.detach if _context_var is None else _context_var.reset
_detach = otel_context.detach
_time_ns = time.time_ns
_current_thread = threading.current_thread
#: Per thread: its `threading.Thread` (the same object in a forked child), one lookup instead of a call.
_thread_local = threading.local()
_rand64 = random.getrandbits
_PLAIN = frozenset((float, int, bool))


class _Bounded:
    """A bounded deque whose records are (seq, ...) tuples; `drain` reports how many were dropped."""

    __slots__ = ("_expected", "_items", "_seq", "dropped")

    def __init__(self, maxlen: int) -> None:
        self._items: deque[tuple[Any, ...]] = deque(maxlen=maxlen)
        self._seq = itertools.count()
        self._expected = 0
        self.dropped = 0

    def drain(self) -> list[tuple[Any, ...]]:
        """Take every record appended so far (export thread only)."""
        items = self._items
        out = []
        pop = items.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            pass
        if out:
            first = out[0][0]
            if first > self._expected:
                self.dropped += first - self._expected
            self._expected = out[-1][0] + 1
        return out

    def __len__(self) -> int:
        return len(self._items)

    @property
    def maxlen(self) -> int:
        return self._items.maxlen or 0


class AttributedValues:
    """The values of one `ot.log(..., attributes=)` call and their extra attributes (a `LogBuffer` record's
    mapping; a plain dict everywhere else, so the collector tells them apart by type)."""

    __slots__ = ("attributes", "values")

    def __init__(self, values: Mapping[str, Any], attributes: Mapping[str, Any]) -> None:
        self.values = values
        self.attributes = attributes


class LogBuffer(_Bounded):
    """Records of `ot.log`: ``(seq, step, mapping, time_ns)``; `mapping` is an `AttributedValues` for a call
    with `attributes=`, a `CapturedLog` for a log record (its step None outside any step).

    With `strict` (`OTEL_TRAIN_STRICT_SYNC`), values that will cost a device sync per value when
    converted (device arrays with `.item()` that are not torch tensors: CuPy, JAX ...) and device
    tensors that are not scalars are reported once per key, on the training thread where the
    warning points at the `ot.log` call. Off, the check costs nothing: it runs only on the path
    taken by non-float values.
    """

    __slots__ = ("_warned", "strict")

    def __init__(self, maxlen: int, strict: bool = False) -> None:
        super().__init__(maxlen)
        self.strict = strict
        self._warned: set[str] = set()

    def append(self, step: int, mapping: Mapping[str, Any], time_ns: int | None = None) -> None:
        for value in mapping.values():
            if type(value) is not float:  # rare: tensors (and ints, arrays) take the slow path
                if self.strict:
                    self._check_sync(mapping)
                mapping = _snapshot(mapping)
                break
        self._items.append((next(self._seq), step, mapping, _time_ns() if time_ns is None else time_ns))

    def append_attributed(self, step: int, mapping: Mapping[str, Any], attributes: Mapping[str, Any]) -> None:
        """`append`, for values logged with extra `attributes` (already checked: `clean_attributes`)."""
        for value in mapping.values():
            if type(value) is not float:
                if self.strict:
                    self._check_sync(mapping)
                mapping = _snapshot(mapping)
                break
        self._items.append((next(self._seq), step, AttributedValues(mapping, attributes), _time_ns()))

    def append_log(self, record: CapturedLog) -> None:
        """Append a captured log record (`otel_train.capture.log_records`): it travels with `ot.log` records."""
        self._items.append((next(self._seq), record.step, record, record.time_unix_nano))

    def append_floats(self, step: int, mapping: Any) -> None:
        """Append a record known to hold only floats (anything with `items()`), unchecked."""
        self._items.append((next(self._seq), step, mapping, _time_ns()))

    def _check_sync(self, mapping: Mapping[str, Any]) -> None:
        for key, value in mapping.items():
            if type(value) in _PLAIN or key in self._warned:
                continue
            why = _sync_cost(value)
            if why:
                self._warned.add(key)
                warnings.warn(f"otel_train.log: key {key!r}: {why} (OTEL_TRAIN_STRICT_SYNC; warned once per key)",
                              RuntimeWarning, stacklevel=5)  # the user's `ot.log` line


def _sync_cost(value: Any) -> str | None:
    """Why converting `value` would sync a device one value at a time, or None when it would not."""
    t = type(value)
    if t.__module__ == "torch" and t.__name__ in ("Tensor", "Parameter"):
        if value.device.type != "cpu" and value.numel() != 1:
            return (f"a {value.device.type} tensor of {value.numel()} elements is not a scalar and is dropped; "
                    "log a scalar tensor (`.mean()`, `[i]`)")
        return None  # scalar tensors are stacked and copied once per window, off the training thread
    device = getattr(value, "device", None)
    if callable(getattr(value, "item", None)) and device is not None and "cpu" not in str(device).lower():
        return (f"a {t.__module__}.{t.__name__} on {device} is read with `.item()`, one device sync per value "
                "on the export thread; log a torch tensor or a float")
    return None


def _snapshot(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """`mapping` with every value fixed as it is now, so that mutating it after `ot.log` (an LR tensor the
    scheduler fills, a loss scale halved, an accumulator zeroed, a parameter the optimizer steps) does not
    change what is exported. The training thread never waits for a device:

    - a CPU tensor of one element is read now (`.item()` on the CPU is no device sync), as is a NumPy array;
    - the device scalars of one call are copied on their device into new memory, one `torch.stack` per
      device and dtype (enqueued on the current stream, no host sync); the export thread reads them per
      window, as before;
    - anything else is kept as it is (tensors detached, so no autograd graph stays alive).
    """
    out: dict[str, Any] | None = None
    on_device: dict[tuple[Any, Any], list[tuple[str, Any]]] | None = None
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None) if torch is not None else None
    for key, value in mapping.items():
        if type(value) in _PLAIN:
            continue
        if tensor_type is not None and isinstance(value, tensor_type):
            if out is None:
                out = dict(mapping)
            try:
                if value.is_cpu:  # `is_cpu`, not `device.type`: a bool, where `device` builds an object (~250 ns)
                    out[key] = value.item()  # raises for more or fewer than one element: below
                elif value.numel() != 1:
                    out[key] = value.detach()  # not a scalar: refused on the export thread, as before
                else:
                    if on_device is None:
                        on_device = {}
                    on_device.setdefault((value.device, value.dtype), []).append((key, value))
            except Exception:  # not a scalar, or an exotic tensor (meta, a subclass): left to the export thread
                out[key] = value.detach() if hasattr(value, "detach") else value
        elif type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":  # mutable, unlike np.float32
            if out is None:
                out = dict(mapping)
            out[key] = _read_array(value)
    if on_device:
        _copy_on_device(on_device, out)  # type: ignore[arg-type]  # `out` was made with the first tensor
    return mapping if out is None else out


def _read_array(value: Any) -> Any:
    """A NumPy array's one element now (its float), or the array as is (not a scalar: refused later)."""
    try:
        return value.item() if value.size == 1 else value
    except (TypeError, ValueError):
        return value


def _copy_on_device(groups: dict[tuple[Any, Any], list[tuple[str, Any]]], out: dict[str, Any]) -> None:
    """Copy each group of device scalars into one new tensor (one kernel) and give each key its element."""
    import torch

    with torch.no_grad():
        for items in groups.values():
            try:
                copies = torch.stack([t.detach().reshape(()) for _, t in items]).unbind(0)
            except Exception:  # never into the training loop: the (uncopied) values still export
                copies = tuple(t.detach() for _, t in items)
            for (key, _), copy in zip(items, copies):
                out[key] = copy


class SpanRecord:
    """A finished `ot.span`, materialised into OTel spans / span rows on the export thread."""

    __slots__ = (
        "attributes",
        "end_ns",
        "error",
        "in_step",
        "name",
        "parent_id",
        "span_id",
        "start_ns",
        "step",
        "thread_id",
        "thread_name",
        "trace_id",
    )

    def __init__(
        self, name: str, trace_id: int, span_id: int, parent_id: int | None, start_ns: int, end_ns: int,
        thread_id: int, thread_name: str, step: int | None, attributes: Mapping[str, Any] | None,
        error: str | None, in_step: bool = True,
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.thread_id = thread_id
        self.thread_name = thread_name
        self.step = step
        self.attributes = attributes
        self.error = error
        self.in_step = in_step  # opened inside `ot.step` (its context), not stamped with the latest step


class SpanBuffer(_Bounded):
    """Finished spans: ``(seq, SpanRecord | ReadableSpan)``."""

    __slots__ = ()

    def append(self, span: Any) -> None:
        self._items.append((next(self._seq), span))


class _NoSpan:
    """What `ot.span` returns before `init()`, after `shutdown()` and when disabled: does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None


NO_SPAN = _NoSpan()


#: Per thread (its native id): the `ot.span` scope entered last. One dict store as a span enters, none as it exits:
#: `open_spans_of` (the hang watchdog's thread) walks from it to its outer scopes and skips those that have ended.
_innermost: dict[int, SpanScope | None] = {}


class SpanScope(SpanRecord, otel_trace.NonRecordingSpan):
    """The context manager behind `ot.span`: ids and OTel context now, the OTel span itself later.

    The scope is its own record (appended to the buffer at exit: one object per span) and the
    OTel `Span` placed in the context while it runs, so a raw OTel span started inside is its
    child, and it is the child of a raw OTel span it is started in. Its `SpanContext` is built
    only when someone asks for it (a raw OTel child, a propagator), not on every span.
    """

    __slots__ = ("_buffer", "_outer", "_record_context", "_span_context", "_token")

    def __init__(self, buffer: SpanBuffer, name: str, attributes: Mapping[str, Any] | None = None,
                 record_context: bool = True) -> None:
        self._buffer = buffer
        self.name = name
        # A copy: the rows are made after the span ends, from what the caller's dict held at the call.
        self.attributes = held_attributes(attributes) if attributes else None
        self._record_context = record_context
        self._token: Token[Any] | None = None
        self._span_context: otel_trace.SpanContext | None = None
        self.error: str | None = None

    def __enter__(self) -> SpanScope:
        current = _get_context()
        parent = current.get(_SPAN_KEY)
        if parent is None:  # the outermost span of its context: a new trace
            self.trace_id = _rand64(128) or 1
            self.parent_id: int | None = None
            self._outer: SpanScope | None = None
        elif type(parent) is SpanScope:  # nested ot.span: no SpanContext needed
            self.trace_id = parent.trace_id
            self.parent_id = parent.span_id
            self._outer = parent
        else:
            self._outer = parent if isinstance(parent, SpanScope) else None
            ctx = parent.get_span_context() if isinstance(parent, otel_trace.Span) else None
            if ctx is not None and ctx.is_valid:
                self.trace_id = ctx.trace_id
                self.parent_id = ctx.span_id
            else:
                self.trace_id = _rand64(128) or 1
                self.parent_id = None
        self.span_id = _rand64(64) or 1
        if self._record_context:
            values = dict(current)
            values[_SPAN_KEY] = self
            self._token = _attach(_Context(values))
        try:
            thread = _thread_local.thread
        except AttributeError:  # this thread's first span
            thread = _thread_local.thread = _current_thread()
        self.thread_id = thread.native_id or 0  # cached by `threading` (and set anew in a forked child): no syscall
        self.thread_name = thread.name  # read each time: a thread may be renamed
        step = _current.get()
        self.in_step = step is not None
        self.step = current_step() if step is None else step
        self.start_ns = _time_ns()
        _innermost[self.thread_id] = self  # the hang watchdog reads a thread's open spans from here
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.end_ns = _time_ns()
        token = self._token
        if token is not None:
            self._token = None
            try:
                _reset(token)
            except Exception:  # a token of another context (a span left in another task): OTel's detach logs it
                _detach(token)
        if exc_type is not None:
            self.error = f"{exc_type.__name__}: {exc}"
        self._buffer.append(self)

    # -- the OTel Span face (what `trace.get_current_span()` returns inside the scope) ----------
    def get_span_context(self) -> otel_trace.SpanContext:
        ctx = self._span_context
        if ctx is None:
            ctx = self._span_context = otel_trace.SpanContext(self.trace_id, self.span_id, False, _SAMPLED)
        return ctx

    def set_attribute(self, key: str, value: Any) -> None:
        """Add an attribute to the span while it runs."""
        attrs = dict(self.attributes or {})
        attrs[key] = held_value(value)
        self.attributes = attrs

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes = {**(self.attributes or {}), **held_attributes(attributes)}

    def __repr__(self) -> str:
        return f"SpanScope({self.name!r}, span_id={getattr(self, 'span_id', 0):016x})"


class ProfiledSpanScope(SpanScope):
    """`SpanScope` that also opens a `torch.profiler.record_function` of its name while a torch
    profiler records (`OTEL_TRAIN_PROFILER_BRIDGE`), so the profiler's trace shows our phases.

    torch is only looked up in `sys.modules`: a process that never imported it pays one dict lookup.
    The record function opens after our start time and closes before our end, so it nests inside.
    """

    __slots__ = ("_record",)

    def __enter__(self) -> SpanScope:
        scope = super().__enter__()
        self._record: Any = None
        profiler = sys.modules.get("torch.autograd.profiler")
        if profiler is not None and getattr(profiler, "_is_profiler_enabled", False):
            try:
                record = profiler.record_function(self.name)
                record.__enter__()
                self._record = record
            except Exception:  # the profiler must never break the training loop
                self._record = None
        return scope

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        record = self._record
        if record is not None:
            self._record = None
            with contextlib.suppress(Exception):  # the profiler must never break the training loop
                record.__exit__(None, None, None)
        super().__exit__(exc_type, exc, tb)


def traced_with(make_scope: Callable[[str, bool], Any], name: str | None, fn: _F) -> _F:
    """Wrap plain, async, generator and async-generator functions in a span named `name`.

    Generators get one span over their whole life, recorded without attaching OTel context
    (a generator's context would leak into its caller between `yield`s).
    """
    span_name = name or fn.__qualname__
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def agen_wrapper(*args: Any, **kwargs: Any) -> Any:
            with make_scope(span_name, False):
                async for item in fn(*args, **kwargs):
                    yield item
        return agen_wrapper  # type: ignore[return-value]
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with make_scope(span_name, True):
                return await fn(*args, **kwargs)
        return async_wrapper  # type: ignore[return-value]
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
            with make_scope(span_name, False):
                return (yield from fn(*args, **kwargs))
        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with make_scope(span_name, True):
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def open_span_scopes() -> list[Any]:
    """The `ot.span` scopes open in the current (interrupted) context, innermost first. Lock-free: a
    signal handler calls it to record the spans a preemption cuts short."""
    from opentelemetry import context as otel_context

    scopes = []
    scope = otel_context.get_current().get(_SPAN_KEY)
    while isinstance(scope, SpanScope):  # ProfiledSpanScope too
        scopes.append(scope)
        outer: Any = getattr(scope._token, "old_value", None)  # the context it was entered from holds its parent
        scope = outer.get(_SPAN_KEY) if hasattr(outer, "get") else None
    return scopes


def open_spans_of(thread_id: int) -> list[SpanScope]:
    """The `ot.span` scopes open on the thread of native id `thread_id`, outermost first. Lock-free, from any
    thread (the hang watchdog's): a scope that has ended meanwhile is left out."""
    scopes: list[SpanScope] = []
    scope = _innermost.get(thread_id)
    while scope is not None and len(scopes) < 64:  # 64: a bound, should the chain ever loop
        if not hasattr(scope, "end_ns"):  # `end_ns` is set when the scope exits
            scopes.append(scope)
        scope = scope._outer
    scopes.reverse()
    return scopes
