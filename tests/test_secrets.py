"""Secrets stay ${VAR} templates: never in event logs, errors, run config, resource config or metadata."""

from __future__ import annotations

import json
import os

import pytest
from dagster._serdes import serialize_value
from sqlalchemy import text

from resources.config import parse_config
from tests.pipeline import Harness
from tests.test_edge_watermarks import unprivileged_pg_role

pytestmark = pytest.mark.integration


def test_passwords_never_reach_dagster_storage_or_errors(services, pg_database, pg_engine, dagster_instance, spark,
                                                         name, monkeypatch) -> None:
    secret = services.pg_password
    monkeypatch.setenv("RR_TEST_PG_PASSWORD", secret)
    monkeypatch.setenv("RR_TEST_SASL_PASSWORD", "sasl-" + secret)
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b'), ('c')"))
        conn.execute(text(f"CREATE TABLE {name}_b (id bigserial PRIMARY KEY, v text)"))
    url = (f"postgresql://{pg_database.username}:${{RR_TEST_PG_PASSWORD}}@{pg_database.host}:{pg_database.port}"
           f"/{pg_database.database}")
    cfg = parse_config({
        "sources": {"src": {"url": url}},
        "tables": [{"source": "src", "table": f"public.{name}", "watermark": "id"},
                   {"source": "src", "table": f"public.{name}_b", "watermark": "id", "columns": ["id", "nope"]}],
        # A producer secret that librdkafka ignores on a PLAINTEXT listener but Dagster would show if resolved.
        "kafka": {"bootstrap_servers": services.kafka_bootstrap,
                  "producer": {"sasl.username": "u", "sasl.password": "${RR_TEST_SASL_PASSWORD}"}},
        "spark": {"master": "local[2]"},
    })
    h = Harness(cfg, dagster_instance)
    good, broken = cfg.tables
    keys = h.drain(good, until_hi=3)
    h.instance.add_dynamic_partitions(f"{broken.dagster_name}__slices", ["000000000000-000000000003"])
    failed = h.run(broken, "000000000000-000000000003", raise_on_error=False)
    assert not failed.success
    with pytest.raises(Exception, match=r"nope") as tick_error:  # the columns error, not any error
        h.tick(broken)

    texts = [str(tick_error.value)]
    run_ids = [failed.run_id] + [r.run_id for r in h.instance.get_runs()
                                 if r.tags.get("dagster/partition") in keys]
    for run_id in run_ids:
        run = h.instance.get_run_by_id(run_id)
        texts.append(json.dumps(run.run_config, default=str))
        texts.append(serialize_value(run))
        texts += [serialize_value(record) for record in h.instance.all_logs(run_id)]
    # What the UI shows for resources: their config as Dagster holds it.
    texts += [r.model_dump_json() if hasattr(r, "model_dump_json") else repr(r) for r in h.defs.resources.values()]
    blob = "\n".join(texts)
    assert "already_committed" in blob and "nope" in blob, "the collected texts must include metadata and errors"
    assert secret not in blob
    assert "sasl-" + secret not in blob


def _dagster_texts(h: Harness, run_ids: list[str]) -> list[str]:
    """Everything Dagster holds about these runs: run config, tags, event logs (errors, materialization metadata),
    the materializations as the asset catalog lists them, and the resources' config."""
    from assets.identity import asset_key

    texts = []
    for run_id in run_ids:
        run = h.instance.get_run_by_id(run_id)
        assert run is not None
        texts.append(json.dumps(run.run_config, default=str))
        texts.append(json.dumps(dict(run.tags)))
        texts.append(serialize_value(run))
        texts += [serialize_value(record) for record in h.instance.all_logs(run_id)]
    for table in h.config.tables:
        texts += [serialize_value(r) for r in h.instance.fetch_materializations(asset_key(table), limit=1000).records]
    texts += [r.model_dump_json() if hasattr(r, "model_dump_json") else repr(r) for r in h.defs.resources.values()]
    return texts


def test_sasl_password_never_reaches_dagster_storage_logs_or_errors(services, pg_database, pg_engine,
                                                                    dagster_instance, spark, name, monkeypatch,
                                                                    capfd) -> None:
    """A relay through the stack's SASL_SSL listener, then one with a wrong password: neither the password nor
    the wrong one shows in what Dagster stores, in the errors, or in the process's own output."""
    from stack.local import load_env_file
    from tests.test_errors import failure_text
    from tests.test_sasl import SaslHarness, sasl_kafka

    if os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1":
        pytest.skip("the SASL_SSL listener is set up by the local stack only")
    env = load_env_file()
    assert "ROWRELAY_KAFKA_SASL_PASSWORD" in env, "stack.env lacks the SASL listener: run `python -m stack up`"
    secret, wrong = env["ROWRELAY_KAFKA_SASL_PASSWORD"], "wrong-" + env["ROWRELAY_KAFKA_SASL_PASSWORD"][::-1]
    for var, key in (("RR_SASL_BOOTSTRAP", "ROWRELAY_KAFKA_SASL_BOOTSTRAP"),
                     ("RR_SASL_USER", "ROWRELAY_KAFKA_SASL_USER"), ("RR_SASL_PASSWORD", "ROWRELAY_KAFKA_SASL_PASSWORD"),
                     ("RR_KAFKA_CA", "ROWRELAY_KAFKA_CA")):
        monkeypatch.setenv(var, env[key])  # the secrets exist only in the environment
    monkeypatch.setenv("RR_TEST_PG_PASSWORD", services.pg_password)
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b'), ('c')"))
    url = (f"postgresql://{pg_database.username}:${{RR_TEST_PG_PASSWORD}}@{pg_database.host}:{pg_database.port}"
           f"/{pg_database.database}")
    cfg = parse_config({"sources": {"src": {"url": url}},
                        "tables": [{"source": "src", "table": f"public.{name}", "watermark": "id"}],
                        "kafka": sasl_kafka(), "spark": {"master": "local[2]"}})
    h = SaslHarness(cfg, dagster_instance, plain_bootstrap=services.kafka_bootstrap)
    table = h.table()
    keys = h.drain(table, until_hi=3)
    assert h.materialization(table, keys[-1]), "a materialization with metadata was recorded over SASL_SSL"

    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('d')"))
    monkeypatch.setenv("RR_SASL_PASSWORD", wrong)
    bad = SaslHarness(cfg, dagster_instance, plain_bootstrap=services.kafka_bootstrap)
    with pytest.raises(Exception, match=r"refused the login") as tick_error:  # the login error, not any error
        bad.tick(table)
    key = "000000000003-000000000004"
    bad.instance.add_dynamic_partitions(f"{table.dagster_name}__slices", [key])
    failed = bad.run(table, key, raise_on_error=False)
    assert not failed.success

    run_ids = [failed.run_id] + [r.run_id for r in h.instance.get_runs() if r.tags.get("dagster/partition") in keys]
    texts = [str(tick_error.value), repr(tick_error.value), failure_text(failed), *_dagster_texts(h, run_ids)]
    out, err = capfd.readouterr()  # the console: Dagster's log lines, librdkafka's own log lines
    texts += [out, err]
    blob = "\n".join(texts)
    assert "already_committed" in blob and "SASL_SSL" in blob, "the texts must include metadata and the kafka config"
    assert "${RR_SASL_PASSWORD}" in blob, "Dagster holds the template"
    assert failure_text(failed) in blob
    for shown in (secret, wrong, services.pg_password):
        assert shown not in blob


def test_a_password_with_url_characters_connects_and_is_never_shown(services, pg_database, pg_engine,
                                                                     dagster_instance, spark, name,
                                                                     monkeypatch) -> None:
    """A password holding '@', ':', '/', '#', '%41' and '+' reached SQLAlchemy raw: its '@' moved part of it into the
    host, which every connection error then named. Taken literally now,
    it connects, and neither it nor an `sslpassword` parameter shows in an error or in Dagster's storage."""
    password, key_password = "rv@secret:7/x#%41+y", "rv-key-secret-5521"
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b')"))
    monkeypatch.setenv("RR_TEST_ODD_PASSWORD", password)
    monkeypatch.setenv("RR_TEST_KEY_PASSWORD", key_password)
    with unprivileged_pg_role(services, pg_database, pg_engine, name, password=password) as reader:
        url = (f"postgresql://{reader.username}:${{RR_TEST_ODD_PASSWORD}}@{pg_database.host}:{pg_database.port}/"
               f"{pg_database.database}?sslpassword=${{RR_TEST_KEY_PASSWORD}}")
        cfg = parse_config({
            "sources": {"src": {"url": url}},
            "tables": [{"source": "src", "table": f"public.{name}", "watermark": "id"},
                       {"source": "src", "table": f"public.{name}_missing", "watermark": "id"}],
            "kafka": {"bootstrap_servers": services.kafka_bootstrap},
            "spark": {"master": "local[2]"},
        })
        h = Harness(cfg, dagster_instance)
        good, missing = cfg.tables
        keys = h.drain(good, until_hi=2)  # connects as the role: the password arrived whole
        with pytest.raises(Exception, match=rf"{name}_missing") as tick_error:
            h.tick(missing)
        error = str(tick_error.value)
        assert f"@{pg_database.host}:{pg_database.port}/" in error and "sslpassword=***" in error, error
        run_ids = [r.run_id for r in h.instance.get_runs() if r.tags.get("dagster/partition") in keys]
        blob = "\n".join([error, *_dagster_texts(h, run_ids)])
        assert run_ids and "watermark_hi" in blob, "the collected texts must include the runs' metadata"
        for shown in (password, "rv@secret", "7/x#", key_password):
            assert shown not in blob, f"{shown!r} is shown"
