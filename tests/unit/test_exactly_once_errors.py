"""resources/exactly_once/errors.py: what the protocol's errors say."""

from __future__ import annotations

from resources.exactly_once import SliceOutOfOrder
from resources.slices import SliceRange


def test_largest_field_names_the_column_behind_a_large_row() -> None:
    from resources.exactly_once import largest_field

    assert largest_field(b'{"id": 7, "note": "' + b"x" * 5000 + b'", "tag": "abc"}') == "note"
    assert largest_field(b'{"op":"insert","data":{"id":1,"blob":"' + b"y" * 900 + b'"},"source":{"table":"t"}}'
                         ) == "blob"
    assert largest_field(b"not json") is None


def test_out_of_order_says_whether_a_slice_waits_or_can_never_commit() -> None:
    """Progress inside a slice (after a reset) was reported as "the slice (250, 200] must commit first"."""
    waits = str(SliceOutOfOrder.at("t", SliceRange(200, 400), 100))
    assert "cannot commit yet" in waits and "(100, 200] must commit first" in waits
    never = str(SliceOutOfOrder.at("t", SliceRange(200, 400), 250))
    assert "can never commit as cut" in never and "again from 250" in never
    assert "(250, 200]" not in never and "must commit first" not in never
