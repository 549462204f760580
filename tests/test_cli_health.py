"""`rowrelay status`, `replay` and the backfill progress bar on the real stack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from sqlalchemy import text

from orchestration.cli import main
from resources.config import RelayConfig
from tests.pipeline import Harness, relay_config

pytestmark = pytest.mark.integration


def _config_file(cfg: RelayConfig, tmp_path: Path) -> str:
    path = tmp_path / "rowrelay.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    return str(path)


def test_status_json_matches_the_real_lag(services, pg_database, pg_engine, dagster_home, dagster_instance, spark,
                                          name, tmp_path, capsys, monkeypatch) -> None:
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text, "
                          "created_at timestamptz NOT NULL DEFAULT now())"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 200) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 100,
         "lag_timestamp_column": "created_at"}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)
    config_file = _config_file(cfg, tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))

    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 0
    (caught_up,) = json.loads(capsys.readouterr().out)
    assert (caught_up["committed_hi"], caught_up["source_max"], caught_up["lag_rows"]) == (200, 200, 0)
    assert caught_up["lag_basis"] == "caught_up" and caught_up["active_runs"] == 0

    # 37 rows wait above committed progress, the oldest written 120 s ago (the database's own clock).
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v, created_at) SELECT 'w' || g, now() - interval '120 seconds' "
                          "FROM generate_series(1, 37) g"))
    assert main(["--config", config_file, "status", "--table", table.table_id, "--json"]) == 0
    (waiting,) = json.loads(capsys.readouterr().out)
    assert (waiting["committed_hi"], waiting["source_max"], waiting["lag_rows"]) == (200, 237, 37)
    assert waiting["lag_basis"] == "oldest_unpublished_row"
    assert 119 <= waiting["lag_seconds"] < 180
    assert waiting["last_commit_at"] == h.progress(table).committed_at

    # Without a timestamp column the seconds are the time since the last commit, and the output says so.
    no_ts = cfg.model_copy(update={"tables": [table.model_copy(update={"lag_timestamp_column": None})]})
    monkeypatch.delenv("DAGSTER_HOME")
    assert main(["--config", _config_file(no_ts, tmp_path), "status"]) == 0
    out = capsys.readouterr().out
    assert table.table_id in out and "time since last commit" in out and "37" in out

    # A timestamp column that does not exist is named, with the key to fix.
    bad = cfg.model_copy(update={"tables": [table.model_copy(update={"lag_timestamp_column": "nope"})]})
    assert main(["--config", _config_file(bad, tmp_path), "status", "--json"]) == 1
    assert "lag_timestamp_column 'nope' does not exist" in capsys.readouterr().err
    assert main(["--config", config_file, "status", "--table", "src.public.missing"]) == 2
    assert "no configured table 'src.public.missing'" in capsys.readouterr().err
