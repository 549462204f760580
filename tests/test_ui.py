"""The asset Checks tab in the Dagster UI, rendered by headless Chromium (stack/screenshot.py, issue 13).

The pure parts of the screenshot tool are tested on page texts captured from dagster-webserver 1.13; the
integration test serves a table's instance with dagster-webserver and checks what the Checks tab shows.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dagster import AssetCheckKey, build_sensor_context
from sqlalchemy import text

from stack.screenshot import (
    asset_checks,
    checks_path,
    evaluated,
    list_labels,
    page_shows_results,
    pick_asset,
    rendered,
    shoot,
    wait_for_evaluated,
    wait_for_ui,
)
from tests.pipeline import ROOT, Harness, relay_config
from tests.private_servers import free_port

# What the Checks tab's text looks like (document.body.innerText), trimmed to the checks list and detail panel.
PENDING_PAGE = ("Checks (2)\nExecute all\nlag\nlag\nIn Progress\nslice_parity\nslice_parity\nIn Progress\nlag\n"
                "Execute\nOverview\nLatest execution\nEvaluation result\nRunning\nTimestamp\n")
DONE_PAGE = ("Checks (2)\nExecute all\nlag\nSucceeded\nslice_parity\nFailed\nlag\nExecute\nOverview\n"
             "Latest execution\nEvaluation result\nPassed\nTimestamp\n")
LOADING_PAGE = "Overview\nPartitions\nEvents\nChecks\nLineage"


def test_page_text_tells_pending_from_evaluated_checks() -> None:
    names = ["lag", "slice_parity"]
    assert list_labels(PENDING_PAGE, "lag") == {"In Progress", "Execute"}  # the list entry and the panel header
    assert rendered(PENDING_PAGE, names) and not page_shows_results(PENDING_PAGE, names)
    assert rendered(DONE_PAGE, names) and page_shows_results(DONE_PAGE, names)  # a failed check is a result
    assert not rendered(LOADING_PAGE, names) and not page_shows_results(LOADING_PAGE, names)
    one_running = DONE_PAGE.replace("slice_parity\nFailed", "slice_parity\nIn Progress")
    assert not page_shows_results(one_running, names)
    detail_running = DONE_PAGE.replace("Evaluation result\nPassed", "Evaluation result\nRunning")
    assert not page_shows_results(detail_running, names)


def test_checks_route_and_asset_choice() -> None:
    assert checks_path(["shop", "public", "orders"]) == "/assets/shop/public/orders?view=checks"
    assert checks_path(["a b", "c/d"], "lag") == "/assets/a%20b/c%2Fd?view=checks&checkDetail=lag"
    data = {"assetNodes": [
        {"assetKey": {"path": ["web", "x"]}, "assetChecksOrError": {"checks": [
            {"name": "lag", "executionForLatestMaterialization": {"status": "SUCCEEDED"}}]}},
        {"assetKey": {"path": ["plain"]}, "assetChecksOrError": {"__typename": "AssetCheckNeedsMigrationError"}},
        {"assetKey": {"path": ["shop", "y"]}, "assetChecksOrError": {"checks": [
            {"name": "lag", "executionForLatestMaterialization": {"status": "FAILED"}},
            {"name": "slice_parity", "executionForLatestMaterialization": {"status": "IN_PROGRESS"}}]}},
    ]}
    assets = asset_checks(data)
    assert set(assets) == {("web", "x"), ("shop", "y")}  # assets without checks are not candidates
    assert pick_asset(assets, None) == ("shop", "y") and pick_asset(assets, "web/x") == ("web", "x")
    with pytest.raises(SystemExit, match="no asset 'nope' with checks"):
        pick_asset(assets, "nope")
    assert evaluated(assets[("web", "x")]) and not evaluated(assets[("shop", "y")])
    assert not evaluated([{"name": "lag", "executionForLatestMaterialization": None}])



def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])  # the IHDR chunk
    return width, height


@pytest.mark.integration
def test_checks_tab_shows_a_passed_parity_and_a_failed_lag_check_in_headless_chromium(
        services, pg_database, pg_engine, dagster_home, dagster_instance, spark, name, tmp_path) -> None:
    from assets.checks import LAG_CHECK, PARITY_CHECK
    from assets.identity import asset_key
    from orchestration.factory import lag_sensor_name

    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.skip("no chromium on this machine")
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text, "
                          "created_at timestamptz NOT NULL DEFAULT now())"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, 200) g"))
    cfg = relay_config(services, {"src": pg_database}, [
        {"source": "src", "table": f"public.{name}", "watermark": "id", "slice_max_rows": 100,
         "lag_timestamp_column": "created_at", "warn_lag_seconds": 30, "error_lag_seconds": 3600}])
    h = Harness(cfg, dagster_instance)
    table = h.table()
    h.drain(table, until_hi=200)  # both checks evaluated in the runs: passed
    # Then 25 rows wait a minute while the table's sensor is stopped: the lag sensor records a WARN.
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v, created_at) SELECT 'w', now() - interval '60 seconds' "
                          "FROM generate_series(1, 25) g"))
    sensor = h.defs.resolve_sensor_def(lag_sensor_name(table))
    with build_sensor_context(resources=h.defs.resources, definitions=h.defs, sensor_name=sensor.name,
                              instance=dagster_instance) as ctx:
        assert "lag recorded" in (sensor.evaluate_tick(ctx).skip_message or "")
    lag = dagster_instance.get_latest_asset_check_evaluation_record(AssetCheckKey(asset_key(table), LAG_CHECK))
    assert lag is not None and not lag.evaluation.passed

    config_file = tmp_path / "rowrelay.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    web = subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-h", "127.0.0.1", "-p", str(port), "-w",
                            str(ROOT / "workspace.yaml")], cwd=ROOT, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env={**os.environ, "DAGSTER_HOME": str(dagster_home), "ROWRELAY_CONFIG": str(config_file)})
    try:
        wait_for_ui(base, timeout=120)
        key, names = wait_for_evaluated(base, "/".join(asset_key(table).path), timeout=120)
        assert names == sorted([LAG_CHECK, PARITY_CHECK])
        shot = tmp_path / "checks.png"
        started = time.monotonic()
        page = shoot(base, key, LAG_CHECK, shot, 1280, 800, timeout=120)
        # The list: parity passed in the runs, lag failed (WARN) from the sensor; the panel shows lag's figures.
        assert list_labels(page, PARITY_CHECK) & {"Succeeded", "Failed"} == {"Succeeded"}, page[:2000]
        assert list_labels(page, LAG_CHECK) & {"Succeeded", "Failed"} == {"Failed"}, page[:2000]
        assert f"{table.table_id}: 25 row(s) waiting" in page, page[:2000]
        assert "lag_rows\n25" in page and "oldest_unpublished_row" in page, page[:2000]
        assert _png_size(shot) == (1280, 800) and shot.stat().st_size > 20_000
        print(f"checks tab rendered and shot in {time.monotonic() - started:.1f} s: {shot}")
    finally:
        from bench.run import stop_process_group

        stop_process_group(web, grace_s=30)
