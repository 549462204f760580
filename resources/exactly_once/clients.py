"""Kafka client plumbing: client settings, error callbacks and logging, metadata, consumers, retried transactional
calls and failpoints."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from resources.cache import KeptAnswers
from resources.exactly_once.errors import KafkaAuthenticationError, KafkaUnavailable, ProducerSettingsError, RelayError

_log = logging.getLogger("resources.exactly_once")  # one logger, filtered once, for the whole package


_ATTEMPT_NUMBERS = re.compile(r"\b\d+ms\b|(?<=#producer-)\d+|(?<=#consumer-)\d+|(?<=#admin-)\d+|\b\d+(?=/\d+ brokers)")


class _RepeatsDropped(logging.Filter):
    """Drops a line that repeats one let through in the last `window_s` (numbers aside). A broker that is away
    makes every client log each reconnect attempt: hundreds of lines before the one error that says what is wrong."""

    def __init__(self, window_s: float = 30.0) -> None:
        super().__init__()
        self.window_s = window_s
        # Many distinct lines: the old ones are forgotten first.
        self.seen: KeptAnswers[str, bool] = KeptAnswers(limit=1000, ttl_s=window_s)

    def filter(self, record: logging.LogRecord) -> bool:
        # Numbers that change from one attempt to the next only (a table or host name keeps its digits).
        return self.seen.keep_new(_ATTEMPT_NUMBERS.sub("#", f"{record.name} {record.getMessage()}"), True)


_log.addFilter(_RepeatsDropped())
# librdkafka's own log lines (connection failures and the like), through Python logging with the same filter: a
# client with an error_cb still logs each failed connect itself.
_librdkafka_log = logging.getLogger("rowrelay.librdkafka")
_librdkafka_log.addFilter(_RepeatsDropped())


StageHook = Callable[[str], None]
STAGES = ("initialized", "progress_read", "begun", "rows_produced", "flushed", "before_commit", "committed")


def env_failpoint(stage: str) -> None:
    """Fault injection for crash tests: ROWRELAY_FAILPOINT=<stage> kills this process at that stage;
    ROWRELAY_FAILPOINT=stop:<stage> freezes it there (SIGSTOP) until someone sends SIGCONT: a zombie;
    ROWRELAY_FAILPOINT=sleep:<stage>:<seconds> holds it there (a slow slice)."""
    target = os.environ.get("ROWRELAY_FAILPOINT")
    if not target:
        return
    if target.startswith(f"sleep:{stage}:"):
        time.sleep(float(target.rsplit(":", 1)[1]))
    elif target == stage:
        os.kill(os.getpid(), signal.SIGKILL)
    elif target == f"stop:{stage}":
        os.kill(os.getpid(), signal.SIGSTOP)


DEFAULT_TRANSACTION_TIMEOUT_MS = 600_000
_TRANSACTION_TIMEOUT_RANGE = (1000, 2**31 - 1)  # librdkafka's limits for transaction.timeout.ms


def transaction_timeout_ms(kafka_conf: dict[str, Any]) -> int:
    """The effective transaction.timeout.ms: the producer settings' value, else the default (10 minutes)."""
    raw = kafka_conf.get("transaction.timeout.ms")
    if raw is None:
        return DEFAULT_TRANSACTION_TIMEOUT_MS
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ProducerSettingsError(
            f"kafka.producer: transaction.timeout.ms must be a whole number of milliseconds, got {raw!r}") from None
    low, high = _TRANSACTION_TIMEOUT_RANGE
    if not low <= value <= high:
        raise ProducerSettingsError(
            f"kafka.producer: transaction.timeout.ms is {value}, outside the range {low}..{high} ms")
    return value


_broker_max_timeout_ms: dict[str, int | None] = {}  # bootstrap.servers -> transaction.max.timeout.ms


def broker_max_transaction_timeout_ms(kafka_conf: dict[str, Any], timeout: float = 10.0) -> int | None:
    """The brokers' transaction.max.timeout.ms (read once per process and bootstrap); None if unreadable."""
    bootstrap = str(kafka_conf.get("bootstrap.servers"))
    if bootstrap in _broker_max_timeout_ms:
        return _broker_max_timeout_ms[bootstrap]
    value: int | None = None
    try:
        admin = AdminClient(base_conf(kafka_conf))
        # DescribeCluster names the brokers without a metadata answer for every topic of the cluster.
        nodes = admin.describe_cluster(request_timeout=timeout).result(timeout=timeout).nodes
        broker = ConfigResource(ConfigResource.Type.BROKER, str(min(n.id for n in nodes)))
        entry = admin.describe_configs([broker], request_timeout=timeout)[broker].result(timeout=timeout).get(
            "transaction.max.timeout.ms")
        value = int(entry.value) if entry is not None and entry.value is not None else None
    except Exception:  # noqa: BLE001 - e.g. no DescribeConfigs permission: skip the check, the broker enforces it
        value = None
    _broker_max_timeout_ms[bootstrap] = value
    return value


def _fatal_message(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


def _is_fenced(err: KafkaError) -> bool:
    return err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


_auth_failures: dict[str, str] = {}


def _error_cb(bootstrap: str) -> Callable[[KafkaError], None]:
    def note(err: KafkaError) -> None:
        if err.code() == KafkaError._AUTHENTICATION:
            _auth_failures[bootstrap] = err.str()
        else:  # with an error_cb set librdkafka no longer logs its errors itself
            _log.warning("kafka client at %s: %s", bootstrap, err.str())
    return note


def with_error_cb(conf: dict[str, Any]) -> dict[str, Any]:
    """A client's settings plus the error_cb `unreachable` reads (unless the caller set its own)."""
    return {"error_cb": _error_cb(str(conf.get("bootstrap.servers"))), "logger": _librdkafka_log, **conf}


def unreachable(client: Any, kafka_conf: dict[str, Any], what: str) -> RelayError:
    """The error for a broker call that failed: a refused login names authentication (never the password: the
    message is librdkafka's); anything else is KafkaUnavailable (transient)."""
    bootstrap = str(kafka_conf.get("bootstrap.servers"))
    with contextlib.suppress(Exception):
        client.poll(0)  # serve error_cb
    refused = _auth_failures.pop(bootstrap, None)
    if refused is not None:
        return KafkaAuthenticationError(
            f"Kafka at {bootstrap} refused the login: {refused}. Check kafka.producer security.protocol, "
            "sasl.mechanism, sasl.username, sasl.password and ssl.ca.location")
    return KafkaUnavailable(f"cannot reach Kafka at {bootstrap}: {what}")


def list_topics(client: Any, kafka_conf: dict[str, Any], topic: str | None = None, timeout: float = 10.0) -> Any:
    """client.list_topics(topic), asked in steps of a second: a refused login fails within about a second, not
    after the whole timeout (librdkafka notes it within ~0.3 s, but only to error_cb). Other failures, e.g. a
    broker that is away, still wait out `timeout`."""
    bootstrap = str(kafka_conf.get("bootstrap.servers"))
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.list_topics(topic, timeout=min(1.0, max(0.1, deadline - time.monotonic())))
        except KafkaException as exc:
            # Serve error_cb; never on a consumer with partitions assigned, where poll() would take a message.
            if not isinstance(client, Consumer) or not client.assignment():
                with contextlib.suppress(Exception):
                    client.poll(0)
            if bootstrap in _auth_failures or time.monotonic() >= deadline:
                raise unreachable(client, kafka_conf, exc.args[0].str()) from exc


def base_conf(kafka_conf: dict[str, Any]) -> dict[str, Any]:
    """Client settings shared by producer, consumer and admin (bootstrap, security); producer-only keys dropped."""
    shared_prefixes = ("bootstrap.servers", "security.", "sasl.", "ssl.", "client.", "socket.", "broker.",
                       "metadata.", "reconnect.", "log_level", "debug", "logger")
    return with_error_cb({k: v for k, v in kafka_conf.items() if k.startswith(shared_prefixes)})


def _topic_metadata(admin: AdminClient, kafka_conf: dict[str, Any], topics: list[str], timeout: float
                    ) -> dict[str, Any]:
    """Metadata of `topics` that exist, asked topic by topic: the cost of a whole-cluster answer grows with every
    topic of the cluster, in client and broker CPU per answer."""
    found = {}
    for name in topics:
        topic = list_topics(admin, kafka_conf, name, timeout=timeout).topics.get(name)
        code = topic.error.code() if topic is not None and topic.error is not None else None
        if topic is None or code == KafkaError.UNKNOWN_TOPIC_OR_PART:
            continue  # missing
        if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise RelayError(f"not authorized to describe topic {name}: {topic.error.str()}")
        found[name] = topic  # present, possibly still without a leader (LEADER_NOT_AVAILABLE)
    return found


FAST_READS = {"fetch.queue.backoff.ms": 10}


def _consumer(kafka_conf: dict[str, Any], isolation_level: str = "read_committed") -> Consumer:
    return Consumer({**base_conf(kafka_conf), "group.id": f"rowrelay-reader-{uuid.uuid4().hex}",
                     "isolation.level": isolation_level, "enable.auto.commit": False,
                     "enable.partition.eof": False, "auto.offset.reset": "earliest",
                     # Short fetch waits: a read ends at a transaction marker, which only a further fetch skips.
                     "fetch.wait.max.ms": 10, **FAST_READS})


READ_BATCH = 5000


RETRIABLE_CALL_S = 120.0  # how long a transactional call failing with retriable errors is called again


def call_retrying(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, a transactional producer call, called again while it fails with a retriable error that needs no
    abort, for up to RETRIABLE_CALL_S: librdkafka's way to retry one. A commit_transaction that timed out goes on in
    the background, and calling it again awaits its outcome; an abort then would be refused. The last error is
    raised (KafkaException): still retriable, the call's outcome is unknown."""
    deadline = time.monotonic() + RETRIABLE_CALL_S
    while True:
        try:
            return fn(*args)
        except KafkaException as exc:
            err = exc.args[0]
            if err.retriable() and not err.txn_requires_abort() and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise


def outcome_unknown(err: KafkaError) -> bool:
    """Whether a commit_transaction that failed with `err` (after `call_retrying`) may still have committed: not when
    the transaction must be aborted or the producer is fenced or failed (the coordinator aborts it); otherwise (a
    timeout, the coordinator unreachable) the commit may complete in the background."""
    return not (err.txn_requires_abort() or err.fatal() or _is_fenced(err))
