"""Set-up mistakes a new user makes end in one line naming the setting to fix and a non-zero exit, not in noise.

Exit codes (orchestration/exits.py): 1 failed or refused, 2 a bad setting or command line, 3 nothing final to
publish yet (tests/test_cli.py, the backfill whose wait for final rows ran out)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from orchestration.cli import main
from tests.pipeline import ROOT, relay_config
from tests.test_cli import _config_file

pytestmark = pytest.mark.integration


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("rowrelay: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


def _table(services, pg_database, pg_engine, name: str, tmp_path: Path, ddl: str = "id bigserial PRIMARY KEY, v text",
           url: str | None = None) -> tuple[str, str]:
    """A table of three rows, and (the config file, the table id) of a config relaying it on Spark Connect."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} ({ddl})"))
        conn.execute(text(f"INSERT INTO {name} (id) SELECT g FROM generate_series(1, 3) g"))
    cfg = relay_config(services, {"src": pg_database}, [{"source": "src", "table": f"public.{name}",
                                                         "watermark": "id"}], spark_remote=True)
    if url is not None:
        cfg = cfg.model_copy(update={"sources": {"src": cfg.sources["src"].model_copy(update={"url": url})}})
    return _config_file(cfg, tmp_path / "rowrelay.yaml"), cfg.tables[0].table_id


def test_a_missing_dagster_storage_database_is_one_line_naming_it_and_its_setting(
        services, pg_database, pg_engine, name, tmp_path) -> None:
    """It was a 177-line traceback ending in `too many retries for DB connection`, after raw `WARNING:root:Retrying
    failed database connection` lines, naming neither the database nor the DAGSTER_PG_* settings."""
    config, _ = _table(services, pg_database, pg_engine, name, tmp_path)
    missing = f"nodb_{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DAGSTER_HOME": str(ROOT), "DAGSTER_PG_DB": missing,
           "ROWRELAY_DAGSTER_DIR": str(tmp_path / "dagster")}
    done = subprocess.run([sys.executable, "-m", "orchestration.cli", "--config", config, "pools"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    line = _one_line(done.stderr)
    assert missing in line and "DAGSTER_PG_DB" in line, line


def test_a_dagster_home_without_rowrelays_dagster_yaml_is_refused(tmp_path, monkeypatch, capsys) -> None:
    """It ran silently on Dagster's default storage (SQLite files in DAGSTER_HOME), out of the daemon's sight."""
    config = tmp_path / "rowrelay.yaml"
    config.write_text("sources: {src: {url: 'postgresql://u@127.0.0.1:1/db'}}\n"
                      "tables: [{source: src, table: public.t, watermark: id}]\n"
                      "kafka: {bootstrap_servers: '127.0.0.1:1'}\n")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert main(["--config", str(config), "pools"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "DAGSTER_HOME" in line and str(home) in line and "dagster.yaml" in line, line
    assert list(home.iterdir()) == [], "Dagster wrote its default storage there"


def test_a_wrong_source_password_names_the_source_and_its_variable(
        services, pg_database, pg_engine, dagster_home, name, tmp_path, monkeypatch, capsys) -> None:
    url = pg_database.set(password="PLACEHOLDER").render_as_string(hide_password=False).replace(
        "PLACEHOLDER", "${ROWRELAY_TEST_SOURCE_PASSWORD}")
    config, table_id = _table(services, pg_database, pg_engine, name, tmp_path, url=url)
    monkeypatch.setenv("ROWRELAY_TEST_SOURCE_PASSWORD", "not-the-password")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    assert main(["--config", config, "backfill", "--table", table_id]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "source 'src'" in line and "ROWRELAY_TEST_SOURCE_PASSWORD" in line, line
    assert "not-the-password" not in line, line


def test_unsupported_column_types_are_reported_together(
        services, pg_database, pg_engine, dagster_home, name, tmp_path, monkeypatch, capsys) -> None:
    """Each run named one column; after leaving it out, the next named the next."""
    config, table_id = _table(services, pg_database, pg_engine, name, tmp_path,
                              ddl="id bigserial PRIMARY KEY, tags int[], span interval, v text")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    assert main(["--config", config, "backfill", "--table", table_id]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "'tags'" in line and "'span'" in line and "columns: [id, v]" in line, line
