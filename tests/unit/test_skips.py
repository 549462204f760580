"""The skip advice's pure parts: the entry form that names one row, and a row's columns read from its message."""

from __future__ import annotations

from assets.skips import message_fields, one_row_form
from resources.config import TableConfig, parse_config


def table(**settings: object) -> TableConfig:
    return parse_config({"sources": {"shop": {"url": "postgresql://u@h/db"}},
                         "tables": [{"source": "shop", "table": "public.orders", "watermark": "id", **settings}],
                         "kafka": {"bootstrap_servers": "k:9092"}}).tables[0]


def test_one_row_form_names_the_row_by_tie_break_else_key_columns() -> None:
    assert one_row_form(table(tie_break="seq"), "7") == "skip_watermarks: [{watermark: 7, tie_break: <its seq>}]"
    assert one_row_form(table(key=["a", "b"]), "7") == \
        "skip_watermarks: [{watermark: 7, key: {a: <its a>, b: <its b>}}]"
    assert one_row_form(table(), "7") == "skip_watermarks: [{watermark: 7, key: {<column>: <value>}}]"


def test_message_fields_reads_plain_values_of_an_object() -> None:
    assert message_fields(b'{"id": 1, "name": "x", "ok": true, "n": null, "d": 1.5}', envelope=False) == \
        {"id": 1, "name": "x"}
    assert message_fields(b'{"op": "insert", "data": {"id": 2}}', envelope=True) == {"id": 2}
    assert message_fields(b"[1, 2]", envelope=False) == {}
    assert message_fields(b"not json", envelope=False) == {}
    assert message_fields(None, envelope=False) == {}
