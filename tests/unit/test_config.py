"""resources/config.py: configuration defaults, validation, variables and `skip_watermarks` entries."""

from __future__ import annotations

import json

import pytest

from resources.config import ConfigError, parse_config, resolve_env, resolve_url_env
from resources.names import DEFAULT_TRANSACTIONAL_ID_PREFIX as PREFIX

BASE = {
    "sources": {"shop": {"url": "postgresql://u:${PW}@h/db"}},
    "tables": [{"source": "shop", "table": "public.orders", "watermark": "id"}],
    "kafka": {"bootstrap_servers": "k:9092"},
}


def test_config_defaults_and_names() -> None:
    import copy

    keyed = copy.deepcopy(BASE)  # the watermark and tie_break are read whatever `columns:` says: keys may use them
    keyed["tables"][0].update(columns=["a"], key=["id", "n"], tie_break="n")
    assert parse_config(keyed).tables[0].key == ["id", "n"]
    cfg = parse_config(BASE)
    t = cfg.tables[0]
    assert t.topic_name == "shop.public.orders"
    assert t.slice_max_rows == 100_000 and t.start_after is None and t.key == "none"
    assert cfg.spark.master == "local[*]"
    assert t.topic_shared_with == ()

    # Tables writing to one topic know of each other (a compacted topic is refused to them, test_edge_publish.py).
    shared = copy.deepcopy(BASE)
    shared["tables"] += [dict(BASE["tables"][0], table="public.refunds", topic="shop.public.orders"),
                         dict(BASE["tables"][0], table="public.carts")]
    from assets.identity import channel_for

    orders, refunds, carts = parse_config(shared).tables
    assert orders.topic_shared_with == ("shop.public.refunds",) and refunds.topic_shared_with == ("shop.public.orders",)
    assert carts.topic_shared_with == () and channel_for(refunds, PREFIX).shared_with == ("shop.public.orders",)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["tables"][0].pop("watermark"), "tables[0].watermark: Field required"),
    (lambda c: c["tables"][0].update(source="nope"), "tables[0].source: 'nope' is not one of"),
    (lambda c: c["tables"][0].update(slice_max_rows=0), "tables[0].slice_max_rows"),
    (lambda c: c["tables"][0].update(key="random"), "tables[0].key"),
    (lambda c: c["tables"][0].update(topic="bad topic!"), "not a valid Kafka topic name"),
    (lambda c: c["tables"][0].update(colour="red"), "tables[0].colour: Extra inputs are not permitted"),
    # A typo names the key meant.
    (lambda c: c["tables"][0].update(slice_max_row=5), "tables[0].slice_max_row: Extra inputs are not permitted "
     "(did you mean 'slice_max_rows'?)"),
    (lambda c: c["sources"]["shop"].update(url="oracle://x"), "unsupported database 'oracle'"),
    (lambda c: c.pop("kafka"), "kafka: Field required"),
    (lambda c: c["tables"].append(dict(c["tables"][0])), "configured twice"),
    # A key column left out of `columns:` failed every run with a bare KeyError, retried forever.
    (lambda c: c["tables"][0].update(columns=["id", "a"], key=["b"]),
     "key columns ['b'] are not among the columns read (['id', 'a']); add them to `columns:`"),
    # The prefix names each progress topic: a '/' failed every run with librdkafka's "Unknown topic".
    (lambda c: c["kafka"].update(transactional_id_prefix="rr/stg"),
     "kafka.transactional_id_prefix: Value error, 'rr/stg' may hold only letters, digits"),
    (lambda c: c["kafka"].update(transactional_id_prefix="r" * 240), "characters, over Kafka's 249"),
    # Settings rowrelay owns: silently overridden, or failing every run as "Expected ... bool type, not str".
    (lambda c: c["kafka"].update(producer={"transactional.id": "prod"}),
     "'transactional.id' cannot be set: rowrelay sets it per table"),
    (lambda c: c["kafka"].update(producer={"delivery.report.only.error": True}),
     "'delivery.report.only.error' cannot be set"),
])
def test_config_errors_name_the_key(change, message) -> None:
    import copy

    data = copy.deepcopy(BASE)
    change(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PW", "s3cret")
    assert resolve_env("postgresql://u:${PW}@h/db") == "postgresql://u:s3cret@h/db"
    assert resolve_env("${MISSING_VAR_X:-fallback}") == "fallback"
    monkeypatch.setenv("EMPTY_VAR_X", "")
    assert resolve_env("${EMPTY_VAR_X:-fallback}") == "fallback"  # as a shell does (it gave "")
    assert resolve_env("${EMPTY_VAR_X}") == ""
    monkeypatch.delenv("PW")
    with pytest.raises(ConfigError, match="PW is not set"):
        resolve_env("${PW}")


def test_url_variables_stay_in_their_part_of_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A password spliced raw into a URL moved into the host at its '@' ('a@b' made the host
    'b@host', named in every error) or failed as a port ('a@b:c'). Each value is now taken literally in its part."""
    from sqlalchemy.engine import make_url

    from resources.source_database import SourceDatabaseResource, SourceError

    secret = "a@b:c/d?e#f%41+g h"
    monkeypatch.setenv("PW", secret)
    monkeypatch.setenv("USR", "us@er")
    monkeypatch.setenv("KEYPW", "k&y=1#")
    monkeypatch.setenv("HOST", "db.example")
    url = make_url(resolve_url_env("postgresql://${USR}:${PW}@${HOST}:5433/db?sslpassword=${KEYPW}&sslmode=require"))
    assert (url.username, url.password, url.host, url.port, url.database) == ("us@er", secret, "db.example", 5433, "db")
    assert dict(url.query) == {"sslpassword": "k&y=1#", "sslmode": "require"}
    assert make_url(resolve_url_env("postgresql://u:${NOPE_X:-p@ss}@h/db")).password == "p@ss"
    assert resolve_url_env("sqlite:///data/${HOST}.db") == "sqlite:///data/db.example.db"
    assert make_url(resolve_url_env("postgresql://u:lit%40eral@h/db")).password == "lit@eral"  # the URL's own escapes
    # A ${VAR} holding user:password, whole parameters, or a parameter's name.
    monkeypatch.setenv("CREDS", "app:s3:cr@t")
    monkeypatch.setenv("PARAMS", "sslmode=require&connect_timeout=5")
    monkeypatch.setenv("NAME", "sslmode")
    creds = make_url(resolve_url_env("postgresql://${CREDS}@h/db?${PARAMS}&${NAME}=verify-full"))
    assert (creds.username, creds.password) == ("app", "s3:cr@t")
    assert dict(creds.query) == {"sslmode": ("require", "verify-full"), "connect_timeout": "5"}
    assert make_url(resolve_url_env("postgresql://${USR}@h/db")).username == "us@er"
    source = SourceDatabaseResource(url="postgresql://u:${PW}@h:5432/db?sslpassword=${KEYPW}&sslmode=disable")
    assert source.safe_description == "postgresql://u:***@h:5432/db?sslmode=disable&sslpassword=***"
    with pytest.raises(SourceError, match=r"not a valid database URL \(ValueError; its variables: \$\{PW\}\)") as bad:
        _ = SourceDatabaseResource(url="postgresql://u:x@h:${PW}/db").sqlalchemy_url  # a port that is not one
    assert "a@b" not in str(bad.value)


def test_skip_watermarks_entries_name_a_value_or_one_row() -> None:
    """`skip_watermarks` takes a bare value (as before: valid only where it matches one row), or a mapping naming
    one row by its watermark and tie_break, or by its watermark and key columns; each entry's suggested text
    reads back as the same entry."""
    import yaml

    from resources.slices import RowSkip

    def table(**more: object) -> dict[str, object]:
        return {"source": "s", "table": "t", "watermark": "at", **more}

    def parsed(*tables: dict[str, object]):  # noqa: ANN202 - the config's tables
        return parse_config({"sources": {"s": {"url": "postgresql://u@h/d"}}, "tables": list(tables),
                             "kafka": {"bootstrap_servers": "k:9092"}, "spark": {"master": "local[1]"}}).tables

    (t,) = parsed(table(tie_break="uid", skip_watermarks=yaml.safe_load(
        "[7, 2026-11-23T07:00:00.5Z, {watermark: 2026-11-23T07:00:00Z, tie_break: 500},"
        " {watermark: 9, key: {region: 'eu', n: 3}}]")))
    at = 1_795_417_200_000_000  # 2026-11-23T07:00:00Z
    assert t.skip_rows == [RowSkip(7), RowSkip(at + 500_000), RowSkip(at, (("uid", "500"),)),
                           RowSkip(9, (("n", "3"), ("region", "eu")))]
    assert [s.watermark for s in t.skip_rows_in(8, at)] == [at, 9]
    # The text a stop message suggests reads back as the same row, through rowrelay.yaml.
    for skip, timestamps in ((RowSkip(at, (("uid", "500"),)), True), (RowSkip(7), False), (RowSkip(at), True),
                             (RowSkip(9, (("n", "3"), ("region", "e'u"))), False)):
        entry = skip.entry(timestamps, "uid")
        (again,) = parsed(table(tie_break="uid", skip_watermarks=yaml.safe_load(f"[{entry}]")))
        assert again.skip_rows == [skip], entry
    assert RowSkip(at, (("uid", "500"),)).entry(True, "uid") == (
        "{watermark: 2026-11-23T07:00:00.000000Z, tie_break: 500}")
    # A progress record keeps a bare value as the integer (as records always have), a row as a mapping.
    for skip in t.skip_rows:
        assert RowSkip.from_record(json.loads(json.dumps(skip.to_record()))) == skip
    assert RowSkip(7).to_record() == 7
    # One way to name the row; a tie_break entry needs the table's tie_break.
    with pytest.raises(ConfigError, match="tie_break: value` or by `key"):
        parsed(table(tie_break="uid", skip_watermarks=[{"watermark": 1, "tie_break": 2, "key": {"a": 1}}]))
    with pytest.raises(ConfigError, match="tie_break: value` or by `key"):
        parsed(table(skip_watermarks=[{"watermark": 1}]))
    with pytest.raises(ConfigError, match="has no `tie_break:`"):
        parsed(table(skip_watermarks=[{"watermark": 1, "tie_break": 2}]))
    with pytest.raises(ConfigError, match="skip_watermarks"):
        parsed(table(skip_watermarks=[{"watermark": 1, "key": {"a": 1}, "other": 3}]))
