"""Connection parameters of the source URL (TLS first of all) reach Spark's JDBC reads, not only SQLAlchemy.

The stack's PostgreSQL serves TLS with a certificate of the stack's own CA (ROWRELAY_PG_SSLROOTCERT) and admits
the role ROWRELAY_PG_TLS_USER over TLS only (pg_hba.conf: hostnossl ... reject). Each relayed row carries
whether the connection that read it was encrypted: the view's column asks pg_stat_ssl about its own backend.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.engine import URL

from resources.jdbc import jdbc_options
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX
from resources.slices import SliceRange
from tests.pipeline import Harness, assert_exactly_once, read_topic, relay_config
from tests.test_errors import failure_text

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack_tls() -> dict[str, str]:
    """The stack's CA file and TLS-only role (`python -m stack up` writes them to stack.env)."""
    if os.environ.get("ROWRELAY_TEST_CONTAINERS") == "1":
        pytest.skip("TLS is set up by the local stack only")
    from stack.local import load_env_file

    env = load_env_file()
    missing = [k for k in ("ROWRELAY_PG_SSLROOTCERT", "ROWRELAY_PG_TLS_USER") if k not in env]
    assert not missing, f"stack.env lacks {missing}: run `.venv/bin/python -m stack up` to enable TLS"
    return {"ca": env["ROWRELAY_PG_SSLROOTCERT"], "user": env["ROWRELAY_PG_TLS_USER"]}


def _tls_view(engine: sa.Engine, name: str, tls_user: str, rows: int) -> str:
    """A table of `rows` rows and a view over it whose column `tls` says if the reading connection is encrypted."""
    view = f"{name}_v"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) SELECT 'r' || g FROM generate_series(1, {rows}) g"))
        conn.execute(text(f"CREATE VIEW {view} AS SELECT id, v, "
                          f"(SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()) AS tls FROM {name}"))
        conn.execute(text(f"GRANT SELECT ON {view} TO {tls_user}"))
    return view


def _with_query(url: URL, user: str | None = None, **query: str) -> URL:
    return url.set(username=user or url.username).update_query_dict(query)


def _other_ca(tmp_path: Path) -> Path:
    """A CA that did not sign the server's certificate."""
    ca = tmp_path / "other-ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=not the stack CA", "-keyout", str(tmp_path / "other-ca.key"), "-out", str(ca)],
                   check=True, capture_output=True)
    return ca


@pytest.mark.parametrize(("query", "tls_only_role", "encrypted"), [
    ({"sslmode": "require"}, True, True),
    ({"sslmode": "verify-full", "sslrootcert": "{ca}"}, True, True),
    ({"sslmode": "disable"}, False, False),
], ids=["require", "verify-full", "disable"])
def test_source_url_tls_settings_reach_the_spark_read(services, pg_database, pg_engine, dagster_instance, spark,
                                                      name, stack_tls, query, tls_only_role, encrypted) -> None:
    view = _tls_view(pg_engine, name, stack_tls["user"], rows=3)
    if tls_only_role:
        # The role cannot read in plaintext at all: a run that succeeds as it read over TLS.
        with pytest.raises(psycopg.OperationalError, match="no encryption"):
            psycopg.connect(host=services.pg_host, port=services.pg_port, user=stack_tls["user"],
                            password=services.pg_password, dbname=pg_database.database, sslmode="disable")
    url = _with_query(pg_database, stack_tls["user"] if tls_only_role else None,
                      **{k: v.format(ca=stack_tls["ca"]) for k, v in query.items()})
    cfg = relay_config(services, {"src": url}, [{"source": "src", "table": f"public.{view}", "watermark": "id"}])
    h = Harness(cfg, dagster_instance)
    h.drain(h.table(), until_hi=3)
    messages = read_topic(services.kafka_bootstrap, h.table().topic_name)
    assert_exactly_once(messages, [1, 2, 3])
    # Each row was read by Spark's own JDBC connection; pg_stat_ssl describes that connection.
    assert [m.value["tls"] for m in messages] == [encrypted] * 3, f"sslmode={query['sslmode']}"


def test_wrong_ca_fails_clearly_and_publishes_nothing(services, pg_database, pg_engine, dagster_instance, spark,
                                                     name, stack_tls, tmp_path) -> None:
    from assets.identity import channel_for
    from resources.slice_reads import SliceFrame, SourceReadError
    from resources.source_database import SourceDatabaseResource
    from resources.spark import SparkResource
    from tests.pipeline import source_url

    view = _tls_view(pg_engine, name, stack_tls["user"], rows=3)
    good = _with_query(pg_database, stack_tls["user"], sslmode="verify-full", sslrootcert=stack_tls["ca"])
    table_cfg = {"source": "src", "table": f"public.{view}", "watermark": "id"}
    h = Harness(relay_config(services, {"src": good}, [table_cfg]), dagster_instance)
    h.drain(h.table(), until_hi=3)
    with pg_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('late1'), ('late2')"))

    wrong = _with_query(good, sslrootcert=str(_other_ca(tmp_path)))
    bad = Harness(relay_config(services, {"src": wrong}, [table_cfg]), dagster_instance)
    with pytest.raises(Exception, match="certificate verify failed"):
        bad.tick(bad.table())
    key = SliceRange(3, 5).key
    bad.instance.add_dynamic_partitions(f"{bad.table().dagster_name}__slices", [key])
    result = bad.run(bad.table(), key, raise_on_error=False)
    assert not result.success and "certificate verify failed" in failure_text(result)

    # Spark's own read must refuse the server too (SQLAlchemy above is psycopg, not the JDBC driver), and say why.
    good_source = SourceDatabaseResource(url=source_url(good))
    wrong_source = SourceDatabaseResource(url=source_url(wrong))
    try:
        shape = good_source.table_shape("public", view, "id")
        reader = SparkResource(master="local[2]", jars=services.jdbc_jars)
        frame = SliceFrame(channel_for(h.table(), PREFIX), SliceRange(3, 5), expected_rows=2,
                           read_chunk=lambda sub, rows: reader.read_slice(wrong_source, shape, sub, rows))
        with pytest.raises(SourceReadError, match="unable to find valid certification path") as info:
            frame.fetch(SliceRange(3, 5), 2)
        assert "(3, 5]" in str(info.value) and "SSL error" in str(info.value)
        assert services.pg_password not in str(info.value)
    finally:
        good_source.dispose()
        wrong_source.dispose()

    # Nothing of the failed slice is visible and progress did not move.
    messages = read_topic(services.kafka_bootstrap, h.table().topic_name)
    assert_exactly_once(messages, [1, 2, 3])
    progress = h.progress(h.table())
    assert progress is not None and progress.hi == 3


def test_url_parameter_spark_cannot_honour_fails_the_run_clearly(services, pg_database, pg_engine,
                                                                  dagster_instance, spark, name) -> None:
    """libpq takes sslcrl, pgjdbc has no equivalent: the sensor tick and the run fail naming it, rather than
    reading without it."""
    with pg_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b')"))
    url = _with_query(pg_database, sslmode="require", sslcrl="/nonexistent/crl.pem")
    h = Harness(relay_config(services, {"src": url}, [{"source": "src", "table": f"public.{name}",
                                                        "watermark": "id"}]), dagster_instance)
    with pytest.raises(Exception, match="source URL parameter 'sslcrl'"):
        h.tick(h.table())
    key = "000000000000-000000000002"
    dagster_instance.add_dynamic_partitions(f"{h.table().dagster_name}__slices", [key])
    result = h.run(h.table(), key, raise_on_error=False)
    assert not result.success
    assert "source URL parameter 'sslcrl'" in failure_text(result)
    assert read_topic(services.kafka_bootstrap, h.table().topic_name) == []
    assert h.progress(h.table()) is None


def test_mariadb_tls_request_reaches_the_spark_read(services, mariadb_database, mariadb_engine, spark,
                                                     name) -> None:
    """pymysql's ssl_* parameters reach Connector/J: asked for TLS, Spark's read never falls back to plaintext."""
    from assets.identity import channel_for
    from resources.slice_reads import SliceFrame, SourceReadError
    from resources.source_database import SourceDatabaseResource
    from resources.spark import SparkResource
    from tests.pipeline import source_url

    with mariadb_engine.begin() as conn:
        if conn.execute(text("SELECT @@have_ssl")).scalar() == "YES":
            pytest.skip("this MariaDB serves TLS; the test needs one that does not")
        conn.execute(text(f"CREATE TABLE {name} (id bigint AUTO_INCREMENT PRIMARY KEY, v text)"))
        conn.execute(text(f"INSERT INTO {name} (v) VALUES ('a'), ('b')"))
    cfg = relay_config(services, {"src": mariadb_database}, [{"source": "src", "table": name, "watermark": "id"}])
    plain = SourceDatabaseResource(url=source_url(mariadb_database))
    tls = SourceDatabaseResource(url=source_url(mariadb_database.update_query_dict({"ssl_verify_cert": "false"})))
    try:
        shape = plain.table_shape(None, name, "id")
        reader = SparkResource(master="local[2]", jars=services.jdbc_jars)

        def frame(source: SourceDatabaseResource) -> SliceFrame:
            return SliceFrame(channel_for(cfg.tables[0], PREFIX), SliceRange(0, 2), expected_rows=2,
                              read_chunk=lambda sub, rows: reader.read_slice(source, shape, sub, rows))

        assert frame(plain).fetch(SliceRange(0, 2), 2).num_rows == 2
        with pytest.raises(SourceReadError, match="ssl not enabled in the server"):
            frame(tls).fetch(SliceRange(0, 2), 2)
    finally:
        plain.dispose()
        tls.dispose()


# -- the mapping itself (pure logic) ---------------------------------------------------------------------------


def _pg(query: str) -> dict[str, object]:
    return jdbc_options(sa.make_url(f"postgresql+psycopg://u:secret@db:5432/app?{query}"), "postgresql")


def _maria(query: str) -> dict[str, object]:
    return jdbc_options(sa.make_url(f"mysql+pymysql://u:secret@db:3306/app?{query}"), "mysql")


def test_libpq_parameters_map_to_pgjdbc_properties() -> None:
    opts = _pg("sslmode=verify-ca&sslrootcert=/ca.pem&sslcert=/c.pem&sslkey=/k.pk8&sslpassword=kp"
               "&application_name=relay&connect_timeout=7")
    assert {k: v for k, v in opts.items() if k not in ("url", "driver")} == {
        "user": "u", "password": "secret", "sslmode": "verify-ca", "sslrootcert": "/ca.pem", "sslcert": "/c.pem",
        "sslkey": "/k.pk8", "sslpassword": "kp", "ApplicationName": "relay", "connectTimeout": "7"}
    assert "?" not in str(opts["url"]), "parameters go as driver properties, never into the logged JDBC URL"


def test_pymysql_ssl_parameters_map_to_connector_j_ssl_mode() -> None:
    assert _maria("ssl_ca=/ca.pem")["sslMode"] == "verify-full"  # pymysql checks the host name once a CA is given
    assert _maria("ssl_ca=/ca.pem")["serverSslCert"] == "/ca.pem"
    assert _maria("ssl_ca=/ca.pem&ssl_check_hostname=false")["sslMode"] == "verify-ca"
    assert _maria("ssl_ca=/ca.pem&ssl_verify_identity=true")["sslMode"] == "verify-full"
    assert _maria("ssl_verify_cert=false&ssl_ca=/ca.pem&ssl_check_hostname=false")["sslMode"] == "trust"
    assert _maria("ssl_disabled=true")["sslMode"] == "disable"
    opts = _maria("charset=utf8mb4&connect_timeout=5")
    assert opts["connectTimeout"] == "5000" and "sslMode" not in opts


@pytest.mark.parametrize(("make", "query", "named"), [
    (_pg, "sslmode=verify-everything", "sslmode"),
    (_pg, "sslcrl=/crl.pem", "sslcrl"),
    (_pg, "socketTimeout=5&sslpassword=hunter2", "socketTimeout"),
    (_maria, "ssl_key=/k.pem&ssl_cert=/c.pem&ssl_key_password=hunter2", "ssl_key"),
    (_maria, "frobnicate=1", "frobnicate"),
], ids=["bad-sslmode", "no-pgjdbc-equivalent", "unknown-pg", "pem-client-key", "unknown-mariadb"])
def test_unusable_url_parameters_are_a_clear_error(make, query, named) -> None:
    with pytest.raises(ValueError) as info:
        make(query)
    message = str(info.value)
    assert repr(named) in message and "source URL" in message
    assert "hunter2" not in message and "secret" not in message, "secrets never appear in errors"


def test_url_encoded_paths_are_decoded() -> None:
    path = "/etc/ssl/my ca.pem"
    assert _pg(f"sslmode=verify-full&sslrootcert={quote(path)}")["sslrootcert"] == path
