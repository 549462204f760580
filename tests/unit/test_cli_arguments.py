"""orchestration/cli/arguments.py: watermarks given on the command line."""

from __future__ import annotations


def test_a_watermark_written_as_the_other_kind_is_refused() -> None:
    """`reset --after` / `replay --from --to` remember how a watermark was written: a time on an integer watermark
    or an integer on a timestamp one is refused with what it would have meant."""
    from orchestration.cli.arguments import watermark, watermark_kind_error

    assert watermark_kind_error("t", False, "--after", watermark("20")) is None
    assert watermark_kind_error("t", True, "--after", watermark("2026-11-23T07:00:00Z")) is None
    assert watermark_kind_error("t", True, "--after", 20) is None  # not from the command line: nothing to tell
    assert "would be 1970-01-01T00:29:24.547200Z" in watermark_kind_error("t", True, "--after", watermark("1764547200"))
    assert "read as 1767225600000000" in watermark_kind_error("t", False, "--to", watermark("2026-01-01"))
    assert watermark("-5") == -5 and not watermark("-5").is_time
    assert watermark("1_000") == 1000 and not watermark("1_000").is_time  # what int() takes is an integer
    assert "is past any time" in watermark_kind_error("t", True, "--after", watermark("300000000000000000"))
