"""Settings: env parsing, keyword precedence, one-line errors naming variable, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_train.config.settings import load_settings
from otel_train.errors import ConfigError
from otel_train.sink.settings import load_sink_settings


def test_defaults() -> None:
    s = load_settings({})
    assert s.exporters == ("tensorboard", "chrome_trace")
    assert s.dir == Path("otel-train-runs")
    assert (s.export_every, s.export_interval_s, s.ranks, s.disabled) == (1, 30.0, "0", False)


def test_env_values_are_parsed() -> None:
    s = load_settings({
        "OTEL_TRAIN_EXPORTERS": " TensorBoard , jsonl,jsonl ",
        "OTEL_TRAIN_EXPORT_EVERY": "10",
        "OTEL_TRAIN_EXPORT_INTERVAL_S": "2.5",
        "OTEL_TRAIN_RANKS": "all",
        "OTEL_TRAIN_CONFIG_JSON": '{"lr": 0.1, "model": {"depth": 4}}',
        "OTEL_TRAIN_RUN_NAME": "baseline",
        "OTEL_SERVICE_NAME": "trainer",
    })
    assert s.exporters == ("tensorboard", "jsonl")
    assert (s.export_every, s.export_interval_s, s.ranks, s.run_name) == (10, 2.5, "all", "baseline")
    assert s.config == {"lr": 0.1, "model": {"depth": 4}}
    assert s.service_name == "trainer"


def test_keywords_override_env() -> None:
    s = load_settings({"OTEL_TRAIN_EXPORT_EVERY": "10", "OTEL_TRAIN_EXPORTERS": "jsonl"},
                      export_every=3, exporters=["tensorboard"])
    assert s.export_every == 3
    assert s.exporters == ("tensorboard",)


def test_empty_exporters_means_none() -> None:
    assert load_settings({"OTEL_TRAIN_EXPORTERS": ""}).exporters == ()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_TRAIN_EXPORT_EVERY": "ten"}, "OTEL_TRAIN_EXPORT_EVERY: 'ten' is not an integer; expected an integer >= 1"),
        ({"OTEL_TRAIN_EXPORT_EVERY": "0"}, "OTEL_TRAIN_EXPORT_EVERY: 0 is too small; expected an integer >= 1"),
        ({"OTEL_TRAIN_EXPORT_INTERVAL_S": "-1"}, "OTEL_TRAIN_EXPORT_INTERVAL_S: '-1' is not allowed"),
        ({"OTEL_TRAIN_EXPORT_INTERVAL_S": "soon"}, "OTEL_TRAIN_EXPORT_INTERVAL_S: 'soon' is not a number"),
        ({"OTEL_TRAIN_SHUTDOWN_TIMEOUT_S": "nan"}, "OTEL_TRAIN_SHUTDOWN_TIMEOUT_S: 'nan' is not allowed"),
        ({"OTEL_TRAIN_RANKS": "1"}, "OTEL_TRAIN_RANKS: '1' is not allowed; use `0`"),
        ({"OTEL_TRAIN_BACKEND_PROCESSES": "sometimes"},
         "OTEL_TRAIN_BACKEND_PROCESSES: 'sometimes' is not allowed; use one of auto, off"),
        ({"OTEL_TRAIN_DISABLED": "maybe"}, "OTEL_TRAIN_DISABLED: 'maybe' is not a boolean"),
        ({"OTEL_SDK_DISABLED": "2"}, "OTEL_SDK_DISABLED: '2' is not a boolean"),
        ({"OTEL_TRAIN_CONFIG_JSON": "[1, 2]"}, "OTEL_TRAIN_CONFIG_JSON: '[1, 2]' is not allowed; expected a JSON object"),
        ({"OTEL_TRAIN_CONFIG_JSON": "{lr: 1}"}, "OTEL_TRAIN_CONFIG_JSON: not valid JSON"),
        ({"OTEL_TRAIN_DIR": "~no-such-user-x9/runs"},
         "OTEL_TRAIN_DIR: '~no-such-user-x9/runs' names no user's home directory"),
    ],
)
def test_bad_values_fail_with_one_line(env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    message = str(info.value)
    assert message.startswith(expected)
    assert "\n" not in message


def test_bad_keyword_is_named() -> None:
    with pytest.raises(ConfigError, match="^dir: '~no-such-user-x9' names no user's home directory"):
        load_settings({}, dir="~no-such-user-x9")
    with pytest.raises(ConfigError, match="export_every: 0 is too small"):
        load_settings({}, export_every=0)
    with pytest.raises(ConfigError, match="unknown keyword `exporter`"):
        load_settings({}, exporter="tensorboard")


@pytest.mark.parametrize("var", ["OTEL_TRAIN_DISABLED", "OTEL_SDK_DISABLED"])
def test_disabled_flags(var: str) -> None:
    assert load_settings({var: "true"}).disabled is True
    assert load_settings({var: "0"}).disabled is False


def test_sink_settings() -> None:
    s = load_sink_settings({"OTEL_TRAIN_SINK_AGGREGATE": "mean,max", "OTEL_TRAIN_SINK_GRPC": "0.0.0.0:5317"})
    assert s.aggregate == ("mean", "max")
    assert s.grpc == "0.0.0.0:5317"
    assert s.http == "127.0.0.1:4318"
    with pytest.raises(ConfigError, match="OTEL_TRAIN_SINK_AGGREGATE: unknown aggregate 'median'; allowed: mean, min, max"):
        load_sink_settings({"OTEL_TRAIN_SINK_AGGREGATE": "median"})
    with pytest.raises(ConfigError, match="--grpc: 'localhost' is not allowed; expected HOST:PORT"):
        load_sink_settings({}, grpc="localhost")
    with pytest.raises(ConfigError, match="OTEL_TRAIN_SINK_SPOOL_DIR: '~no-such-user-x9' names no user's home"):
        load_sink_settings({"OTEL_TRAIN_SINK_SPOOL_DIR": "~no-such-user-x9"})


@pytest.mark.parametrize(("keyword", "value", "message"), [
    ("step_order", 1, "step_order: '1' is not allowed"),  # was accepted; the exporter process failed on it twice
    ("ranks", 1, "ranks: '1'"),
    ("strict_sync", 5, "strict_sync: 5 is not allowed; expected True or False"),
    ("run_name", 123, "run_name: 123 is not allowed; expected a string"),  # was AttributeError: 'int' ... 'strip'
])
def test_a_keyword_of_the_wrong_type_fails_init_in_one_line(keyword: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({}, **{keyword: value})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("keyword", "value"), [("rank", "x"), ("world_size", -2), ("local_rank", True)])
def test_a_place_that_is_no_integer_fails_init_in_one_line(keyword: str, value: object) -> None:
    import otel_train as ot

    with pytest.raises(ConfigError, match=rf"^{keyword}: {value!r} is not allowed; expected an integer >= 0$"):
        ot.init(exporters=[], **{keyword: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRAIN_EXPORT_INTERVAL_S": "1e10"},  # the collector thread died on it (OverflowError), nothing exported
     "OTEL_TRAIN_EXPORT_INTERVAL_S: '1e10' is not allowed; expected a number of seconds > 0 and at most 1e+09"),
    ({"OTEL_TRAIN_DRAIN_TIMEOUT_S": "inf"}, "OTEL_TRAIN_DRAIN_TIMEOUT_S: 'inf' is not allowed"),
    ({"OTEL_TRAIN_BUFFER_SIZE": str(10**23)},  # a raw OverflowError naming no setting
     "OTEL_TRAIN_BUFFER_SIZE: 100000000000000000000000 is too large; expected an integer from 1 to 2147483647"),
    ({"OTEL_TRAIN_RESUME_STEP": str(2**63)}, "expected an integer from 0 to 9223372036854775807"),  # TensorBoard failed
    ({"OTEL_TRAIN_EXPORT_CPUS": "0-"}, "OTEL_TRAIN_EXPORT_CPUS: '0-' is not a CPU list"),  # was taken as `0`
    ({"OTEL_TRAIN_LOG_RATE": "x"}, "OTEL_TRAIN_LOG_RATE: 'x' is not a number; expected log records per second > 0"),
])
def test_values_that_would_break_at_run_time_fail_init_in_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(env)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
