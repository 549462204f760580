"""Secrets stay ${VAR} templates: never in event logs, errors, run config, resource config or metadata."""

from __future__ import annotations

import json

import pytest
from dagster._serdes import serialize_value
from sqlalchemy import text

from resources.config import parse_config
from tests.pipeline import Harness

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
    with pytest.raises(Exception) as tick_error:
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
