"""A relay through the stack's SASL_SSL listener (SCRAM-SHA-512 over TLS) with its secrets only in env vars.

`python -m stack up` gives the broker a SASL_SSL listener next to PLAINTEXT, with a certificate signed by the
stack's CA and one SCRAM user, and writes ROWRELAY_KAFKA_SASL_* and ROWRELAY_KAFKA_CA to stack.env. The relay
config names them only as ${VAR} templates. The checks read the topic over PLAINTEXT (the same broker).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL

from resources.config import RelayConfig, TableConfig, parse_config
from resources.exactly_once import ProgressRecord, read_committed_progress
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.pipeline import Harness, assert_exactly_once, read_topic, source_url
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration

SASL_VARS = ("ROWRELAY_KAFKA_SASL_BOOTSTRAP", "ROWRELAY_KAFKA_SASL_USER", "ROWRELAY_KAFKA_SASL_PASSWORD",
             "ROWRELAY_KAFKA_CA")


@pytest.fixture(scope="module")
def stack_sasl() -> dict[str, str]:
    """The SASL_SSL listener's settings from stack.env."""
    if os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1":
        pytest.skip("the SASL_SSL listener is set up by the local stack only")
    from stack.local import load_env_file

    env = load_env_file()
    missing = [k for k in SASL_VARS if k not in env]
    assert not missing, f"stack.env lacks {missing}: run `.venv/bin/python -m stack up` to add the SASL listener"
    return {k: env[k] for k in SASL_VARS}


@pytest.fixture
def sasl_env(stack_sasl: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The secrets exist only here, as the process environment (under names the config refers to)."""
    env = {"RR_SASL_BOOTSTRAP": stack_sasl["ROWRELAY_KAFKA_SASL_BOOTSTRAP"],
           "RR_SASL_USER": stack_sasl["ROWRELAY_KAFKA_SASL_USER"],
           "RR_SASL_PASSWORD": stack_sasl["ROWRELAY_KAFKA_SASL_PASSWORD"],
           "RR_KAFKA_CA": stack_sasl["ROWRELAY_KAFKA_CA"]}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def sasl_kafka() -> dict[str, Any]:
    """The `kafka:` section a user writes for a SASL_SSL cluster: every secret a ${VAR}."""
    return {"bootstrap_servers": "${RR_SASL_BOOTSTRAP}",
            "producer": {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                         "sasl.username": "${RR_SASL_USER}", "sasl.password": "${RR_SASL_PASSWORD}",
                         "ssl.ca.location": "${RR_KAFKA_CA}"}}


def sasl_config(url: URL, tables: list[dict[str, Any]]) -> RelayConfig:
    return parse_config({"sources": {"src": {"url": source_url(url)}}, "tables": tables, "kafka": sasl_kafka(),
                         "spark": {"master": "local[2]"}})


@dataclass
class SaslHarness(Harness):
    """Harness.progress connects with bootstrap_servers alone (here a ${VAR} of the SASL listener): read the
    committed progress over the same broker's PLAINTEXT listener instead."""

    plain_bootstrap: str = ""

    def progress(self, table: TableConfig) -> ProgressRecord | None:
        from assets.identity import channel_for

        return read_committed_progress({"bootstrap.servers": self.plain_bootstrap}, channel_for(table, PREFIX))


def _table(engine: Any, name: str, rows: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, {rows}) g"))


def test_relay_through_sasl_ssl_exactly_once(services, pg_database, pg_engine, dagster_instance, spark, name,
                                             sasl_env) -> None:
    _table(pg_engine, name, 40)
    cfg = sasl_config(pg_database, [{"source": "src", "table": f"public.{name}", "watermark": "id",
                                     "slice_max_rows": 25}])
    # The config Dagster holds carries templates only; the listener is the SASL one, not PLAINTEXT.
    dumped = cfg.model_dump_json()
    assert sasl_env["RR_SASL_PASSWORD"] not in dumped and services.kafka_bootstrap not in dumped
    h = SaslHarness(cfg, dagster_instance, plain_bootstrap=services.kafka_bootstrap)
    table = h.table()
    first = h.drain(table, until_hi=40)
    assert len(first) >= 2, f"40 rows at 25 per slice are at least two slices (two transactions): {first}"
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'late' || g FROM generate_series(1, 10) g"))
    h.drain(table, until_hi=50)

    messages = read_topic(services.kafka_bootstrap, table.topic_name)
    assert_exactly_once(messages, list(range(1, 51)))
    progress = h.progress(table)
    assert progress is not None and progress.hi == 50


def test_wrong_sasl_password_fails_clearly_and_publishes_nothing(services, pg_database, pg_engine,
                                                                 dagster_instance, spark, name, sasl_env,
                                                                 monkeypatch) -> None:
    _table(pg_engine, name, 3)
    cfg = sasl_config(pg_database, [{"source": "src", "table": f"public.{name}", "watermark": "id"}])
    h = SaslHarness(cfg, dagster_instance, plain_bootstrap=services.kafka_bootstrap)
    table = h.table()
    h.drain(table, until_hi=3)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('late1'), ('late2')"))

    wrong = "not-the-" + sasl_env["RR_SASL_PASSWORD"]
    monkeypatch.setenv("RR_SASL_PASSWORD", wrong)
    # A fresh harness: the same config, resolved again where connections are made.
    bad = SaslHarness(cfg, dagster_instance, plain_bootstrap=services.kafka_bootstrap)
    started = time.monotonic()
    with pytest.raises(Exception) as tick_error:
        bad.tick(bad.table())
    tick_s = time.monotonic() - started
    tick_text = str(tick_error.value)
    # librdkafka notes the refused login within ~0.3 s; the tick must not wait out its 10-s metadata timeout.
    assert tick_s < 8, f"the tick took {tick_s:.1f} s to report a refused login"
    key = SliceRange(3, 5).key
    bad.instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [key])
    result = bad.run(bad.table(), key, raise_on_error=False)
    elapsed = time.monotonic() - started
    assert not result.success
    run_text = failure_text(result)
    assert run_text, "the failed run must carry an error message"
    assert elapsed < 120, f"a wrong password must fail, not hang ({elapsed:.0f}s for a tick and a run)"
    for shown in (tick_text, run_text):
        assert wrong not in shown and sasl_env["RR_SASL_PASSWORD"] not in shown

    # Nothing of the refused slice is visible and progress did not move.
    assert_exactly_once(read_topic(services.kafka_bootstrap, table.topic_name), [1, 2, 3])
    progress = h.progress(table)
    assert progress is not None and progress.hi == 3

    # The errors must say why: librdkafka reports the refused SASL login only to error_cb (served by poll()); a
    # metadata call alone just times out as "Broker transport failure" (what both errors said before the fix).
    unnamed = [where for where, shown in (("sensor tick", tick_text), ("run", run_text))
               if "authentication" not in shown.lower()]
    assert not unnamed, f"the {' and the '.join(unnamed)} error(s) do not name authentication: {tick_text!r} / " \
                        f"{run_text[:400]!r}"
