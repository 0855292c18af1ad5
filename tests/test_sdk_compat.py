"""The OTel SDK dependency (`otel_train._internal.sdk`): one range pinned for every OTel package, `init()`
refusing an SDK outside it before anything starts, and every SDK internal we use working on the installed SDK
(`.ci/run` runs this file on the floor and on the latest release) or falling back where it is gone."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

import otel_train as ot
from otel_train._internal import sdk

ROOT = Path(__file__).resolve().parents[1]
#: Set by .ci/run where it installed the API and SDK below the floor (not `OTEL_TRAIN_*`: conftest clears those).
BELOW_FLOOR = "CI_OTEL_SDK_BELOW_FLOOR"

# -- the range ---------------------------------------------------------------------------------------------


def test_every_otel_package_has_the_one_range_the_code_checks() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    core = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    pins = dict(re.findall(r'"(opentelemetry-[a-z-]+)([^"]*)"', core))
    assert set(pins) >= {"opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto",
                         "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http"}
    assert set(pins.values()) == {sdk.SDK_REQUIREMENT}


def test_the_installed_sdk_is_supported() -> None:
    """The main environment resolves the latest release: a new major (or a broken pin) fails here first."""
    if os.environ.get(BELOW_FLOOR):
        pytest.skip("this run installed an SDK below the floor on purpose (.ci/run)")
    assert sdk.supported_problem() is None


@pytest.mark.parametrize(("version", "supported"), [
    ("1.41.9", False), ("1.42.0", True), ("1.42.0rc1", True), ("1.45.2", True), ("1.99.0", True),
    ("2.0.0", False), ("garbage", False),
])
def test_the_range_check(version: str, supported: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk, "_installed", lambda dist: version if dist == "opentelemetry-sdk" else "1.45.2")
    problem = sdk.supported_problem()
    assert (problem is None) is supported
    if not supported:
        assert problem == (f"opentelemetry-sdk {version} is installed, otel-train needs opentelemetry-sdk>=1.42,<2: "
                           "pip install -U otel-train (or pip install 'opentelemetry-sdk>=1.42,<2')")


def test_a_missing_sdk_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk, "_installed", lambda dist: None if dist == "opentelemetry-sdk" else "1.45.2")
    assert sdk.supported_problem() == ("opentelemetry-sdk is not installed; otel-train needs "
                                       "opentelemetry-sdk>=1.42,<2: pip install 'opentelemetry-sdk>=1.42,<2'")


def _started() -> tuple[set[int], set[int]]:
    return {t.ident or 0 for t in threading.enumerate()}, {c.pid for c in psutil.Process().children(recursive=True)}


def _new_since(before: tuple[set[int], set[int]]) -> tuple[set[int], set[int]]:
    """Threads and child processes started since `before` (ones that ended meanwhile do not count)."""
    threads, children = _started()
    return threads - before[0], children - before[1]


def test_init_on_an_unsupported_sdk_fails_in_one_line_and_starts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk, "_installed", lambda dist: "1.40.0")
    before = _started()
    with pytest.raises(ot.ConfigError) as err:
        ot.init(exporters="jsonl,tensorboard", dir=tmp_path / "runs")  # would start the exporter process
    assert str(err.value) == ("opentelemetry-sdk 1.40.0 is installed, otel-train needs opentelemetry-sdk>=1.42,<2: "
                              "pip install -U otel-train (or pip install 'opentelemetry-sdk>=1.42,<2')")
    assert _new_since(before) == (set(), set())
    assert not (tmp_path / "runs").exists()
    assert ot._session is None
    assert ot.init(disabled=True).enabled is False  # a disabled run needs no SDK: it still starts


def test_init_refuses_the_real_sdk_below_the_floor(tmp_path: Path) -> None:
    """`.ci/run` installs the API and SDK one release line below the floor and runs this test there."""
    if not os.environ.get(BELOW_FLOOR):
        pytest.skip("needs an opentelemetry-sdk below the floor: .ci/run's second environment installs one")
    code = textwrap.dedent("""
        import threading, psutil, otel_train as ot
        try:
            ot.init(exporters="jsonl")
        except ot.ConfigError as err:
            print(err)
        print(threading.active_count(), len(psutil.Process().children(recursive=True)))
    """)
    env = {**os.environ, "OTEL_TRAIN_DIR": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.splitlines()
    installed = sdk._installed("opentelemetry-sdk")
    assert out == [(f"opentelemetry-sdk {installed} is installed, otel-train needs opentelemetry-sdk>=1.42,<2: "
                    "pip install -U otel-train (or pip install 'opentelemetry-sdk>=1.42,<2')"), "1 0"]
    assert not (tmp_path / "runs").exists()


# -- each internal on the installed SDK --------------------------------------------------------------------


@pytest.fixture
def provider() -> Any:
    reader = InMemoryMetricReader(**sdk.reader_options({}, 10))
    provider = MeterProvider(metric_readers=[reader], resource=Resource({"train.run.id": "compat"}))
    provider.reader = reader  # type: ignore[attr-defined]
    yield provider
    provider.shutdown()


def _points(reader: Any) -> list[tuple[str, Any, dict[str, Any]]]:
    data = reader.get_metrics_data()
    if data is None:
        return []
    return [(m.name, p.value, dict(p.attributes)) for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics for p in m.data.data_points]


def test_the_sync_gauge_class_is_what_create_gauge_builds(provider: Any) -> None:
    gauge_class = sdk.sync_gauge_class()
    assert gauge_class is not None
    assert isinstance(provider.get_meter("t").create_gauge("g"), gauge_class)


def test_the_provider_resource_and_storage_are_found(provider: Any) -> None:
    resource = sdk.provider_resource(provider)
    assert resource is not None and resource.attributes["train.run.id"] == "compat"
    assert sdk.reader_storage(provider, provider.reader) is not None


def test_measurements_are_intercepted_and_stamped(provider: Any) -> None:
    seen: list[Any] = []

    def wrap(consume: sdk.Consume) -> sdk.Consume:
        def stamped(measurement: Any, *args: Any, **kwargs: Any) -> None:
            seen.append(measurement.value)
            consume(sdk.with_attribute(measurement, "train.step", 7), *args, **kwargs)
        return stamped

    assert sdk.intercept_measurements(sdk.reader_storage(provider, provider.reader), wrap)
    provider.get_meter("t").create_gauge("g").set(1.5, {"k": "v"})
    assert seen == [1.5]
    assert _points(provider.reader) == [("g", 1.5, {"k": "v", "train.step": 7})]


def test_a_forked_childs_storage_is_emptied(provider: Any) -> None:
    provider.get_meter("t").create_gauge("g").set(1.0, {"train.step": 1})
    assert sdk.empty_after_fork(sdk.reader_storage(provider, provider.reader))
    assert _points(provider.reader) == []
    provider.get_meter("t").create_gauge("g").set(2.0, {"train.step": 2})  # the storage still works after
    assert _points(provider.reader) == [("g", 2.0, {"train.step": 2})]


def test_discarded_measurements_are_not_kept(provider: Any) -> None:
    sdk.discard_measurements(sdk.reader_storage(provider, provider.reader))
    provider.get_meter("t").create_gauge("g").set(1.0)
    assert _points(provider.reader) == []


def test_collect_returns_the_data_without_receiving_it(provider: Any) -> None:
    provider.get_meter("t").create_counter("c").add(3, {"train.step": 1})
    data = sdk.collect(provider.reader, 10_000)
    assert data is not None
    assert [(m.name, [p.value for p in m.data.data_points])
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics] == [("c", [3])]
    assert sdk.collect(InMemoryMetricReader(), 10_000) is None  # no provider registered it yet


def test_the_span_key_is_the_one_the_api_uses() -> None:
    span = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
    assert trace.set_span_in_context(span).get(sdk.SPAN_KEY) is span


def test_the_early_exit_hook_runs_before_atexit_hooks() -> None:
    code = ("import atexit\nfrom otel_train._internal import sdk\n"
            "atexit.register(lambda: print('atexit'))\n"
            "print(sdk.register_before_atexit(lambda: print('early')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout.split()
    assert out == ["True", "early", "atexit"]


def test_reader_options_add_a_cardinality_limit_only_where_the_sdk_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = {int: "delta"}
    monkeypatch.setattr(sdk, "_has_cardinality_limits", lambda: False)
    assert sdk.reader_options(kinds, 5) == {"preferred_temporality": {int: "delta"}}
    monkeypatch.setattr(sdk, "_has_cardinality_limits", lambda: True)
    assert sdk.reader_options(kinds, 5) == {"preferred_temporality": {int: "delta"}, "cardinality_limits": {int: 5}}


# -- each internal where a release removed it: the fallback, never an exception ------------------------------


def test_fallbacks_where_the_internals_are_gone(caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk, "_warned_collect", False)
    bare = object()
    assert sdk.provider_resource(bare) is None
    assert sdk.reader_storage(bare, InMemoryMetricReader()) is None
    assert sdk.intercept_measurements(bare, lambda consume: consume) is False
    assert sdk.intercept_measurements(None, lambda consume: consume) is False
    assert sdk.empty_after_fork(bare) is False
    sdk.discard_measurements(None)

    class NoCallback:
        pass

    assert sdk.collect(NoCallback(), 10_000) is None  # type: ignore[arg-type]
    assert sdk.collect(NoCallback(), 10_000) is None  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records].count(
        "this opentelemetry-sdk has no reader collect callback: raw OTel instruments are not exported "
        "(otel_train.log values and spans are); otel-train needs opentelemetry-sdk>=1.42,<2") == 1  # once


def test_a_measurement_of_another_layout_is_rebuilt_or_kept() -> None:
    @dataclasses.dataclass(frozen=True)
    class Slotted:
        __slots__ = ("attributes", "value")
        value: float
        attributes: dict[str, Any] | None

    stamped = sdk.with_attribute(Slotted(1.0, {"k": 1}), "train.step", 3)
    assert (stamped.value, stamped.attributes) == (1.0, {"k": 1, "train.step": 3})

    class Opaque:
        __slots__ = ("attributes",)

        def __init__(self) -> None:
            self.attributes = None

    opaque = Opaque()
    assert sdk.with_attribute(opaque, "train.step", 3) is opaque


def test_the_apis_proxy_instruments_follow_a_new_meter(provider: Any) -> None:
    proxies = sdk.proxy_instruments()
    assert sorted(proxies) == ["counter", "gauge", "histogram", "observable_counter", "observable_gauge",
                               "observable_up_down_counter", "up_down_counter"]
    gauge = proxies["gauge"]("g", "", "")
    gauge.set(1.0)  # before a meter: a no-op
    gauge.on_meter_set(provider.get_meter("t"))
    gauge.set(2.0, {"train.step": 1})
    assert _points(provider.reader) == [("g", 2.0, {"train.step": 1})]


def test_init_fails_before_starting_anything_where_the_proxies_are_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def gone() -> dict[str, Any]:
        raise ImportError("opentelemetry-api 9.0 has no _ProxyGauge; otel-train needs opentelemetry-api>=1.42,<2")

    monkeypatch.setattr(sdk, "proxy_instruments", gone)
    before = _started()
    with pytest.raises(ot.ConfigError, match=r"^opentelemetry-api 9.0 has no _ProxyGauge; otel-train needs "):
        ot.init(exporters="jsonl", dir=tmp_path / "runs")
    assert _new_since(before) == (set(), set())
    assert not (tmp_path / "runs").exists()
