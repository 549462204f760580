"""resources/exactly_once/clients.py: the Kafka clients' log lines."""

from __future__ import annotations


def test_a_repeated_kafka_log_line_is_let_through_once_per_window(monkeypatch) -> None:
    """A broker that was away made every client log each reconnect attempt: ~390 lines before the one error
    that says what is wrong. A line repeating one let through in the last 30 s (numbers aside) is dropped."""
    import logging

    from resources.exactly_once import clients as exactly_once

    clock = [100.0]
    monkeypatch.setattr(exactly_once.time, "monotonic", lambda: clock[0])
    repeats = exactly_once._RepeatsDropped(window_s=30.0)

    def passes(message: str) -> bool:
        return repeats.filter(logging.LogRecord("rowrelay.librdkafka", logging.ERROR, "", 0, message, None, None))

    assert passes("FAIL: Connect to 127.0.0.1:19099 failed (after 0ms in state CONNECT)")
    assert not passes("FAIL: Connect to 127.0.0.1:19099 failed (after 1ms in state CONNECT)")  # numbers aside
    assert passes("another line")
    assert passes("topic orders_2024: unknown") and passes("topic orders_2025: unknown")  # names keep their digits
    assert passes("FAIL [rdkafka#consumer-3] down") and not passes("FAIL [rdkafka#consumer-4] down")
    clock[0] += 31.0
    assert passes("FAIL: Connect to 127.0.0.1:19099 failed (after 0ms in state CONNECT)")  # once per window
