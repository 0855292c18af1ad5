"""OTel's global meter and tracer providers, set once per process and pointed at the running session.

The OTel API lets a process set each global provider once. A later `init()` (after `shutdown()`) builds new
SDK providers, so the globals are our own delegating providers, set once, that each session points at its
providers (`point_to`) and releases at shutdown (then they do nothing until the next session). Meters,
instruments and tracers obtained from them before a session switch follow it: instruments are the OTel
API's own proxy instruments, which re-create their real instrument on every switch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackT, Meter, MeterProvider, NoOpMeter, NoOpMeterProvider
from opentelemetry.trace import NoOpTracer, NoOpTracerProvider, ProxyTracer, Tracer, TracerProvider
from opentelemetry.util.types import Attributes

from otel_train._internal import sdk

__all__ = ["SESSION_METER_PROVIDER", "SESSION_TRACER_PROVIDER", "PendingProviders", "install", "release"]


_PROXY = sdk.proxy_instruments()  # the API's re-pointable proxy instrument classes (`on_meter_set`), by kind


def _key(name: str, version: str | None, schema_url: str | None, attributes: Attributes) -> tuple[Any, ...]:
    return name, version, schema_url, repr(sorted(attributes.items())) if attributes else None


class _SessionMeter(Meter):
    """Creates the API's proxy instruments (one per identity) and points each at the current real meter."""

    def __init__(self, name: str, version: str | None, schema_url: str | None, attributes: Attributes) -> None:
        super().__init__(name, version=version, schema_url=schema_url)
        self._attributes = attributes
        self._lock = threading.Lock()
        self._instruments: dict[str, Any] = {}  # the API's proxy instruments
        self._real: Meter | None = None

    def point_to(self, provider: MeterProvider) -> None:
        real = provider.get_meter(self._name, self._version, self._schema_url, self._attributes)
        with self._lock:
            self._real = real
            for instrument in self._instruments.values():
                instrument.on_meter_set(real)

    def _proxy(self, proxy: Any, advisory: Any = None) -> Any:
        status = self._register_instrument(proxy._name, type(proxy), proxy._unit, proxy._description, advisory)
        with self._lock:
            existing = self._instruments.get(status.instrument_id)
            if existing is not None:
                return existing
            self._instruments[status.instrument_id] = proxy
            if self._real is not None:
                proxy.on_meter_set(self._real)
            return proxy

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._proxy(_PROXY["counter"](name, unit, description))

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._proxy(_PROXY["up_down_counter"](name, unit, description))

    def create_histogram(self, name: str, unit: str = "", description: str = "", *,
                         explicit_bucket_boundaries_advisory: Sequence[float] | None = None) -> Any:
        advisory = tuple(explicit_bucket_boundaries_advisory) if explicit_bucket_boundaries_advisory else None
        return self._proxy(_PROXY["histogram"](name, unit, description, explicit_bucket_boundaries_advisory), advisory)

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._proxy(_PROXY["gauge"](name, unit, description))

    def create_observable_counter(self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "",
                                  description: str = "") -> Any:
        return self._proxy(_PROXY["observable_counter"](name, callbacks, unit=unit, description=description))

    def create_observable_gauge(self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "",
                                description: str = "") -> Any:
        return self._proxy(_PROXY["observable_gauge"](name, callbacks, unit=unit, description=description))

    def create_observable_up_down_counter(self, name: str, callbacks: Sequence[CallbackT] | None = None,
                                          unit: str = "", description: str = "") -> Any:
        return self._proxy(_PROXY["observable_up_down_counter"](name, callbacks, unit=unit, description=description))


class SessionMeterProvider(MeterProvider):
    """The global `MeterProvider`: its meters follow the running session (no-ops between sessions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meters: dict[tuple[Any, ...], _SessionMeter] = {}
        self.current: MeterProvider = NoOpMeterProvider()

    def get_meter(self, name: str, version: str | None = None, schema_url: str | None = None,
                  attributes: Attributes = None) -> Meter:
        key = _key(name, version, schema_url, attributes)
        with self._lock:
            meter = self._meters.get(key)
            if meter is None:
                meter = self._meters[key] = _SessionMeter(name, version, schema_url, attributes)
                meter.point_to(self.current)
            return meter

    def point_to(self, provider: MeterProvider) -> None:
        with self._lock:
            self.current = provider
            for meter in self._meters.values():
                meter.point_to(provider)


class _SessionTracer(ProxyTracer):
    """The API's `ProxyTracer` (`start_span`, `start_as_current_span`, also as a decorator), resolving the
    running session's tracer at each span instead of once."""

    def __init__(self, provider: SessionTracerProvider, name: str, version: str | None, schema_url: str | None,
                 attributes: Attributes) -> None:
        super().__init__(name, version, schema_url, attributes)
        self._provider = provider
        self._for: TracerProvider | None = None

    @property
    def _tracer(self) -> Tracer:
        current = self._provider.current
        if self._for is not current or self._real_tracer is None:
            self._real_tracer = current.get_tracer(self._instrumenting_module_name,
                                                   self._instrumenting_library_version, self._schema_url,
                                                   self._attributes)
            self._for = current
        return self._real_tracer


class SessionTracerProvider(TracerProvider):
    """The global `TracerProvider`: its tracers follow the running session (no-ops between sessions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tracers: dict[tuple[Any, ...], _SessionTracer] = {}
        self.current: TracerProvider = NoOpTracerProvider()

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Attributes = None) -> Tracer:
        key = _key(instrumenting_module_name, instrumenting_library_version, schema_url, attributes)
        with self._lock:
            tracer = self._tracers.get(key)
            if tracer is None:
                tracer = self._tracers[key] = _SessionTracer(self, instrumenting_module_name,
                                                             instrumenting_library_version, schema_url, attributes)
            return tracer

    def point_to(self, provider: TracerProvider) -> None:
        self.current = provider


class PendingProviders:
    """A session's SDK providers while they are being built off the training thread (`init()` returns first).

    The globals point at `meter_provider` / `tracer_provider` meanwhile: a raw OTel measurement or span made
    before the SDK's are built waits for them (once, bounded by `timeout_s`) and then goes to the real
    instrument or tracer, so nothing recorded after `init()` is dropped (the API's own proxies would drop it).
    """

    def __init__(self, timeout_s: float) -> None:
        self._done = threading.Event()
        self._timeout_s = timeout_s
        self._real: tuple[MeterProvider, TracerProvider] | None = None
        self.meter_provider = _PendingMeterProvider(self)
        self.tracer_provider = _PendingTracerProvider(self)

    def finish(self, providers: tuple[MeterProvider, TracerProvider] | None) -> None:
        """The SDK providers are built (None: the start failed; waiting calls then record nothing)."""
        self._real = providers
        self._done.set()

    def real(self) -> tuple[MeterProvider, TracerProvider] | None:
        """The SDK providers, waiting for them if they are being built; None if they never will be."""
        if not self._done.is_set() and not self._done.wait(self._timeout_s):
            self._done.set()  # waited once in vain: nobody waits again (the start failed silently)
        return self._real


class _PendingInstrument:
    """A synchronous instrument created on a pending meter: each call goes to the real instrument, created
    from the SDK's meter once it exists (the first call waits for it)."""

    def __init__(self, pending: PendingProviders, meter: tuple[Any, ...], create: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self._pending = pending
        self._meter = meter
        self._create = create
        self._args = args
        self._kwargs = kwargs
        self._instrument: Any = None

    def _real(self) -> Any:
        instrument = self._instrument
        if instrument is None:
            providers = self._pending.real()
            if providers is None:
                return None
            meter = providers[0].get_meter(*self._meter)
            instrument = self._instrument = getattr(meter, self._create)(*self._args, **self._kwargs)
        return instrument

    def add(self, amount: Any, attributes: Attributes = None, context: Any = None) -> None:
        real = self._real()
        if real is not None:
            real.add(amount, attributes, context)

    def record(self, amount: Any, attributes: Attributes = None, context: Any = None) -> None:
        real = self._real()
        if real is not None:
            real.record(amount, attributes, context)

    def set(self, amount: Any, attributes: Attributes = None, context: Any = None) -> None:
        real = self._real()
        if real is not None:
            real.set(amount, attributes, context)


class _PendingMeter(NoOpMeter):
    """Synchronous instruments that wait for the SDK's meter (`_PendingInstrument`); observable ones are the
    API's no-ops, re-created on the real meter when the globals point at it (callbacks run only at collection)."""

    def __init__(self, pending: PendingProviders, name: str, version: str | None, schema_url: str | None,
                 attributes: Attributes) -> None:
        super().__init__(name, version=version, schema_url=schema_url)
        self._pending = pending
        self._args = (name, version, schema_url, attributes)

    def _instrument(self, create: str, *args: Any, **kwargs: Any) -> Any:
        return _PendingInstrument(self._pending, self._args, create, args, kwargs)

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._instrument("create_counter", name, unit, description)

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._instrument("create_up_down_counter", name, unit, description)

    def create_histogram(self, name: str, unit: str = "", description: str = "", *,
                         explicit_bucket_boundaries_advisory: Sequence[float] | None = None) -> Any:
        return self._instrument("create_histogram", name, unit, description,
                                explicit_bucket_boundaries_advisory=explicit_bucket_boundaries_advisory)

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._instrument("create_gauge", name, unit, description)


class _PendingMeterProvider(MeterProvider):
    def __init__(self, pending: PendingProviders) -> None:
        self._pending = pending

    def get_meter(self, name: str, version: str | None = None, schema_url: str | None = None,
                  attributes: Attributes = None) -> Meter:
        return _PendingMeter(self._pending, name, version, schema_url, attributes)


class _PendingTracerProvider(TracerProvider):
    """Tracers are resolved at each span (`_SessionTracer`): the first span waits for the SDK's provider."""

    def __init__(self, pending: PendingProviders) -> None:
        self._pending = pending

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Attributes = None) -> Tracer:
        providers = self._pending.real()
        if providers is None:
            return NoOpTracer()
        return providers[1].get_tracer(instrumenting_module_name, instrumenting_library_version, schema_url,
                                       attributes)


SESSION_METER_PROVIDER = SessionMeterProvider()
SESSION_TRACER_PROVIDER = SessionTracerProvider()


def _unset(provider: Any) -> bool:
    """Whether a global is still the API's default (a proxy, or a no-op), i.e. nobody has set one."""
    return type(provider).__name__.startswith(("_Proxy", "Proxy", "NoOp"))


def install(meter_provider: MeterProvider, tracer_provider: TracerProvider) -> None:
    """Point the globals at a session's providers, setting ours as the globals if nobody has set one; a
    provider the user set stays (their instruments then never reach otel-train, as before)."""
    if _unset(metrics.get_meter_provider()):
        metrics.set_meter_provider(SESSION_METER_PROVIDER)
    if _unset(trace.get_tracer_provider()):
        trace.set_tracer_provider(SESSION_TRACER_PROVIDER)
    SESSION_METER_PROVIDER.point_to(meter_provider)
    SESSION_TRACER_PROVIDER.point_to(tracer_provider)


def release(meter_provider: MeterProvider, tracer_provider: TracerProvider) -> None:
    """A session ends: where the globals point at its providers, they do nothing until the next session."""
    if SESSION_METER_PROVIDER.current is meter_provider:
        SESSION_METER_PROVIDER.point_to(NoOpMeterProvider())
    if SESSION_TRACER_PROVIDER.current is tracer_provider:
        SESSION_TRACER_PROVIDER.point_to(NoOpTracerProvider())
