"""The project's own local stack: Kafka (KRaft), PostgreSQL and MariaDB on loopback.

No Docker engine is assumed. Every service runs from a data directory under ``ROWRELAY_HOME``
(default ``~/.cache/rowrelay``), outside any checkout, so a second clone finds and reuses the
running stack instead of starting a competing one. ``up`` is idempotent; ``down`` stops only the
processes whose pid files this module wrote.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STACK_DIR = Path(__file__).resolve().parent
USER = "rowrelay"
# A throwaway local stack: the password only guards loopback ports. Real deployments pass their own.
PASSWORD = "rowrelay-local"
DAGSTER_DB = "dagster"
# A role pg_hba.conf admits over TLS only (hostnossl ... reject): a read as this role proves its connection was TLS.
PG_TLS_USER = "rowrelay_tls"
DEMO_DB = "rowrelay_demo"
# The broker's SASL_SSL listener: one SCRAM user the stack creates, a certificate signed by the stack's CA.
KAFKA_SASL_USER = "rowrelay"
KAFKA_SASL_PASSWORD = "rowrelay-local-scram"  # loopback only, like PASSWORD
KAFKA_SASL_MECHANISM = "SCRAM-SHA-512"
# Guards the broker's PKCS12 key store under ROWRELAY_HOME (Kafka's file-based PEM store needs an encrypted key).
KAFKA_KEYSTORE_PASSWORD = "rowrelay-local-keystore"


class StackError(RuntimeError):
    """A service could not be brought up; the message says what to read or change."""


def home() -> Path:
    return Path(os.environ.get("ROWRELAY_HOME", Path.home() / ".cache" / "rowrelay")).expanduser()


def env_file() -> Path:
    return home() / "stack.env"


@dataclass(frozen=True)
class Ports:
    kafka: int
    kafka_controller: int
    postgres: int
    mariadb: int
    spark_connect: int
    kafka_sasl: int = 19094

    @classmethod
    def from_env(cls) -> Ports:
        # Defaults sit away from the services' usual ports so a system PostgreSQL/MySQL/Kafka can coexist.
        kafka = int(os.environ.get("ROWRELAY_KAFKA_PORT", 19092))
        return cls(
            kafka=kafka,
            kafka_controller=int(os.environ.get("ROWRELAY_KAFKA_CONTROLLER_PORT", 19093)),
            postgres=int(os.environ.get("ROWRELAY_PG_PORT", 15432)),
            mariadb=int(os.environ.get("ROWRELAY_MARIADB_PORT", 13306)),
            spark_connect=int(os.environ.get("ROWRELAY_SPARK_CONNECT_PORT", 15102)),
            # Next to the broker's own port (19094 by default): a second stack that moves ROWRELAY_KAFKA_PORT
            # moves its SASL_SSL listener along instead of colliding with the first one's.
            kafka_sasl=int(os.environ.get("ROWRELAY_KAFKA_SASL_PORT", kafka + 2)),
        )


# --------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[stack] {msg}", flush=True)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_until(check: Callable[[], bool], timeout: float, what: str, logfile: Path, pid: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if pid is not None and not pid_alive(pid):
            raise StackError(f"{what} exited during start-up; read {logfile}")
        time.sleep(0.5)
    raise StackError(f"{what} did not answer within {timeout:.0f}s; read {logfile}")


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports for private servers (tests, the bench): every socket stays bound until all are
    chosen, so the OS cannot hand out the same port twice (one at a time, it may: a server then gets two listeners
    on one port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def require_free_port(port: int, service: str, env_var: str) -> None:
    if port_open(port):
        raise StackError(
            f"port {port} for {service} is already taken by a process this stack did not start; "
            f"stop it or set {env_var} to a free port"
        )


def reuse_or_claim(service: str, pid: int | None, ready: Callable[[], bool], port: int, env_var: str,
                   logfile: Path, timeout: float) -> bool:
    """True if our process for `service` is running (waits until it answers); else checks its port is free."""
    if pid_alive(pid):
        wait_until(ready, timeout, service, logfile, pid)
        log(f"{service}: reusing server pid {pid} on 127.0.0.1:{port}")
        return True
    require_free_port(port, service, env_var)
    return False


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)  # type: ignore[call-overload]


def is_root() -> bool:
    return os.geteuid() == 0


def apt_install(*packages: str) -> None:
    if not is_root():
        raise StackError(f"missing system packages; run: sudo apt-get install -y {' '.join(packages)}")
    log(f"installing Debian packages: {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", *packages], check=True, env=env, stdout=subprocess.DEVNULL)


def ensure_tools() -> None:
    missing = []
    if not shutil.which("java"):
        missing.append("openjdk-17-jre-headless")
    if not shutil.which("mvn"):
        missing.append("maven")
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        missing.append("postgresql")
    if not shutil.which("mariadbd") and not os.path.exists("/usr/sbin/mariadbd"):
        missing.append("mariadb-server")
    if not any(shutil.which(name) for name in ("chromium", "chromium-browser")):
        missing.append("chromium")  # headless, for the tests of what the Dagster UI shows (they skip without it)
    if missing:
        apt_install(*missing)


def pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if not found:
        raise StackError("PostgreSQL server binaries not found; run: apt-get install -y postgresql")
    return found[-1]


# --------------------------------------------------------------------------- jars


def jar_dir(kind: str) -> Path:
    return home() / "jars" / kind


def fetch_jars(kind: str) -> Path:
    """Copy a pom's runtime dependencies from Maven Central into the cache, once."""
    target = jar_dir(kind)
    marker = target / ".complete"
    pom = STACK_DIR / "poms" / f"{kind}.xml"
    if marker.exists() and marker.read_text() == pom.read_text():
        return target
    log(f"fetching {kind} jars from Maven Central into {target}")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    try:
        run(["mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
             "-DincludeScope=runtime", f"-DoutputDirectory={target}"])
    except subprocess.CalledProcessError as exc:
        raise StackError(f"mvn could not fetch {kind} jars:\n{exc.stdout}\n{exc.stderr}") from exc
    marker.write_text(pom.read_text())
    return target


def jdbc_jars() -> list[str]:
    return sorted(str(p) for p in fetch_jars("jdbc").glob("*.jar"))


# --------------------------------------------------------------------------- Kafka


def kafka_classpath() -> str:
    kafka_home = os.environ.get("KAFKA_HOME")
    if kafka_home:
        libs = Path(kafka_home) / "libs"
        if not libs.is_dir():
            raise StackError(f"KAFKA_HOME={kafka_home} has no libs/ folder")
        return f"{libs}/*"
    return f"{fetch_jars('kafka')}/*"


def kafka_jars_stale() -> bool:
    """True if `fetch_jars('kafka')` would re-fetch (stack/poms/kafka.xml changed since the jars were copied)."""
    if os.environ.get("KAFKA_HOME"):
        return False
    marker = jar_dir("kafka") / ".complete"
    return not marker.exists() or marker.read_text() != (STACK_DIR / "poms" / "kafka.xml").read_text()


KAFKA_LOG4J = """\
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def kafka_properties(ports: Ports, data: Path, keystore: Path | None = None, fingerprint: str = "") -> str:
    """server.properties. With a key store: a SASL_SSL listener (SCRAM-SHA-512) next to PLAINTEXT, which stays
    the inter-broker listener and what every other client uses. `fingerprint` (jars, certificate) is written as
    a comment so that `kafka_up` restarts a running broker when anything it loaded at start changed."""
    sasl = keystore is not None
    listeners = f"PLAINTEXT://127.0.0.1:{ports.kafka},"
    if sasl:
        listeners += f"SASL_SSL://127.0.0.1:{ports.kafka_sasl},"
    listeners += f"CONTROLLER://127.0.0.1:{ports.kafka_controller}"
    text = f"""\
# rowrelay stack: {fingerprint}
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{ports.kafka_controller}
listeners={listeners}
advertised.listeners={listeners}
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT{",SASL_SSL:SASL_SSL" if sasl else ""}
log.dirs={data}
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
transaction.abort.timed.out.transaction.cleanup.interval.ms=2000
group.initial.rebalance.delay.ms=0
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Kafka's default. 1000 (this stack's setting before) made the log cleaner look over every compacted partition
# each second: 0.12-0.14 CPU-s of the broker per 1M-row backfill with the ~2,600 progress topics that tests
# leave on it, against 0.01-0.03 now.
log.cleaner.backoff.ms=15000
"""
    if sasl:
        # SCRAM credentials live in the KRaft metadata log (created by `ensure_kafka_scram_user`); the listener's
        # JAAS line only names the login module. No client certificates: clients verify the broker, not the reverse.
        text += f"""\
sasl.enabled.mechanisms={KAFKA_SASL_MECHANISM}
listener.name.sasl_ssl.sasl.enabled.mechanisms={KAFKA_SASL_MECHANISM}
listener.name.sasl_ssl.{KAFKA_SASL_MECHANISM.lower()}.sasl.jaas.config=\
org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location={keystore}
listener.name.sasl_ssl.ssl.keystore.password={KAFKA_KEYSTORE_PASSWORD}
listener.name.sasl_ssl.ssl.key.password={KAFKA_KEYSTORE_PASSWORD}
listener.name.sasl_ssl.ssl.client.auth=none
"""
    return text


def kafka_ca_file() -> Path:
    """The CA that signed the broker's SASL_SSL certificate: the stack's CA (the same one as PostgreSQL's)."""
    return pg_ca_file()


def ensure_stack_ca() -> None:
    """The stack's CA (tls/ca.crt, tls/ca.key), if PostgreSQL's set-up has not made it yet (it runs first in `up`).

    Same subject and extensions as `ensure_pg_certificates`, which remakes it only if PostgreSQL's certificate no
    longer verifies; the broker's certificate is then re-issued (and the broker restarted) on the next `up`.
    """
    ca_crt, ca_key = pg_ca_file(), tls_dir() / "ca.key"
    if ca_crt.exists() and ca_key.exists():
        return
    tls_dir().mkdir(parents=True, exist_ok=True)
    log(f"kafka: making the stack's local CA ({ca_crt})")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", "3650", "-subj",
             "/CN=rowrelay local stack CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(ca_key), "-out", str(ca_crt))
    os.chmod(ca_key, 0o600)


def ensure_kafka_certificate(base: Path) -> Path:
    """A PKCS12 key store (base/tls/broker.p12) with a key and a certificate for 127.0.0.1/localhost signed by the
    stack's CA; re-issued when missing or when the CA no longer verifies it. Returns the key store's path."""
    tls = base / "tls"
    crt, key, p12 = tls / "broker.crt", tls / "broker.key", tls / "broker.p12"
    ca_crt, ca_key = kafka_ca_file(), tls_dir() / "ca.key"
    if p12.exists() and crt.exists() and ca_crt.exists() and subprocess.run(
            ["openssl", "verify", "-CAfile", str(ca_crt), str(crt)], capture_output=True).returncode == 0:
        return p12
    ensure_stack_ca()
    tls.mkdir(parents=True, exist_ok=True)
    log(f"kafka: issuing a broker certificate for 127.0.0.1 signed by {ca_crt}")
    csr, ext = tls / "broker.csr", tls / "broker.ext"
    ext.write_text(SERVER_CERT_EXTENSIONS)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-sha256", "-subj", "/CN=127.0.0.1",
             "-keyout", str(key), "-out", str(csr))
    os.chmod(key, 0o600)
    # -CAserial in our own directory: PostgreSQL's certificate code owns tls/ca.srl.
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAserial",
             str(tls / "ca.srl"), "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", str(ext),
             "-out", str(crt))
    new_p12 = tls / "broker.p12.new"
    _openssl("pkcs12", "-export", "-in", str(crt), "-inkey", str(key), "-certfile", str(ca_crt), "-name", "broker",
             "-passout", f"pass:{KAFKA_KEYSTORE_PASSWORD}", "-out", str(new_p12))
    os.chmod(new_p12, 0o600)
    shutil.move(new_p12, p12)
    csr.unlink(missing_ok=True)
    return p12


def _digest(*parts: str) -> str:
    import hashlib

    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


# The broker's JVM: Kafka's own performance options (bin/kafka-run-class.sh) and a heap with room for the thousands
# of partitions a developer's stack collects from test runs. At 768 MB, ~13k partitions kept the heap ~75 % live
# after each collection, above G1's marking threshold, so G1 marked the whole heap again and again: ~0.85 CPU-s
# of every 1M-row publish on this 2-core box, which no broker in service pays (see docs/performance.md).
KAFKA_JVM_OPTIONS = ("-Xms3g", "-Xmx3g", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                     "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent",
                     "-XX:MaxInlineLevel=15", "-Djava.awt.headless=true")


def kafka_fingerprint(classpath: str, keystore: Path) -> str:
    """What a running broker loaded at start and cannot pick up by itself: its jars, its certificate, its JVM."""
    jars = sorted(p.name for p in Path(classpath.rstrip("*")).glob("*.jar"))
    return (f"jars {_digest(*jars)} certificate {_digest(keystore.read_bytes().hex())} "
            f"jvm {_digest(*KAFKA_JVM_OPTIONS)}")


def kafka_sasl_conf(port: int) -> dict[str, str]:
    """librdkafka settings for the stack's SASL_SSL listener (what stack.env hands to clients)."""
    return {"bootstrap.servers": f"127.0.0.1:{port}", "security.protocol": "SASL_SSL",
            "sasl.mechanism": KAFKA_SASL_MECHANISM, "sasl.username": KAFKA_SASL_USER,
            "sasl.password": KAFKA_SASL_PASSWORD, "ssl.ca.location": str(kafka_ca_file())}


def kafka_ready(port: int) -> bool:
    from confluent_kafka.admin import AdminClient

    if not port_open(port):
        return False
    try:
        md = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", "log_level": 0}).list_topics(timeout=2)
        return bool(md.brokers)
    except Exception:
        return False


def kafka_sasl_ready(port: int) -> bool:
    """The SASL_SSL listener answers a metadata request after TLS (verified against the CA) and a SCRAM login."""
    from confluent_kafka.admin import AdminClient

    if not port_open(port):
        return False
    try:
        md = AdminClient({**kafka_sasl_conf(port), "log_level": 0}).list_topics(timeout=3)
        return bool(md.brokers)
    except Exception:
        return False


def ensure_kafka_scram_user(ports: Ports) -> None:
    """Create (or reset) the SCRAM user through the PLAINTEXT listener's AdminClient.

    KRaft only takes SCRAM users at `kafka-storage format --add-scram`; an existing cluster gets them through
    AlterUserScramCredentials. Skipped when a SCRAM login already works, so a reused broker sees no change.
    """
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    if kafka_sasl_ready(ports.kafka_sasl):
        return
    log(f"kafka: creating SCRAM user {KAFKA_SASL_USER!r} ({KAFKA_SASL_MECHANISM})")
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{ports.kafka}", "log_level": 0})
    upsert = UserScramCredentialUpsertion(KAFKA_SASL_USER, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
                                          KAFKA_SASL_PASSWORD.encode())
    try:
        admin.alter_user_scram_credentials([upsert], request_timeout=30)[KAFKA_SASL_USER].result(timeout=30)
    except Exception as exc:  # noqa: BLE001 - any failure here means the listener is unusable: say where to look
        raise StackError(f"kafka: cannot create SCRAM user {KAFKA_SASL_USER!r}: {exc}") from exc


def kafka_up(ports: Ports) -> None:
    base = home() / "kafka"
    pidfile, logfile = base / "kafka.pid", base / "kafka.log"
    props, data = base / "server.properties", base / "data"
    pid = read_pid(pidfile)
    if pid_alive(pid) and kafka_jars_stale():
        # Re-fetching replaces the jar folder under a running JVM: stop it first (it restarts below anyway).
        log("kafka: stack/poms/kafka.xml changed; restarting the broker on the new jars")
        stop_pidfile("kafka", pidfile)
        pid = None
    classpath = kafka_classpath()
    keystore = ensure_kafka_certificate(base)
    wanted = kafka_properties(ports, data, keystore, kafka_fingerprint(classpath, keystore))
    if pid_alive(pid):
        if props.exists() and props.read_text() == wanted:
            wait_until(lambda: kafka_ready(ports.kafka), 90, "kafka", logfile, pid)
            ensure_kafka_scram_user(ports)
            log(f"kafka: reusing broker pid {pid} on 127.0.0.1:{ports.kafka} (SASL_SSL {ports.kafka_sasl})")
            return
        # Listeners, jars, the certificate or the JVM options changed: Kafka reads them only at start. One short outage.
        log(f"kafka: {props} changed; restarting broker pid {pid}")
        stop_pidfile("kafka", pidfile)
    require_free_port(ports.kafka, "kafka", "ROWRELAY_KAFKA_PORT")
    require_free_port(ports.kafka_controller, "kafka controller", "ROWRELAY_KAFKA_CONTROLLER_PORT")
    require_free_port(ports.kafka_sasl, "kafka SASL_SSL listener", "ROWRELAY_KAFKA_SASL_PORT")
    data.mkdir(parents=True, exist_ok=True)
    props.write_text(wanted)
    log4j = base / "log4j2.properties"
    log4j.write_text(KAFKA_LOG4J)
    java = ["java", f"-Dlog4j2.configurationFile={log4j}", "-cp", classpath]
    if not (data / "meta.properties").exists():
        cluster_id = "-"
        while cluster_id.startswith("-"):  # one in 64 would be read as an option (Kafka's Uuid.randomUuid skips them)
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        try:
            run([*java, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props), "--standalone"])
        except subprocess.CalledProcessError as exc:
            raise StackError(f"kafka storage format failed:\n{exc.stdout}\n{exc.stderr}") from exc
    log(f"kafka: starting broker on 127.0.0.1:{ports.kafka}, SASL_SSL on {ports.kafka_sasl} (log {logfile})")
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            ["java", *KAFKA_JVM_OPTIONS, *java[1:], "kafka.Kafka", str(props)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
    # A broker loads every partition before it answers: ~15,000 left by tests took over two minutes here. The wait
    # still ends at once if the broker exits.
    wait_until(lambda: kafka_ready(ports.kafka), 600, "kafka", logfile, proc.pid)
    ensure_kafka_scram_user(ports)
    wait_until(lambda: kafka_sasl_ready(ports.kafka_sasl), 60, "kafka SASL_SSL listener", logfile, proc.pid)


# --------------------------------------------------------------------------- PostgreSQL


def _pg_user_prefix() -> list[str]:
    # PostgreSQL refuses to run as root: as root, run it as the Debian 'postgres' user.
    return ["runuser", "-u", "postgres", "--"] if is_root() else []


def _make_traversable(path: Path) -> None:
    """Let the 'postgres' user reach a data dir below root's home (search bit only, no listing)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o001)


def pg_ready(port: int) -> bool:
    if not port_open(port):
        return False
    import psycopg

    try:
        with psycopg.connect(host="127.0.0.1", port=port, user=USER, password=PASSWORD,
                             dbname="postgres", connect_timeout=2):
            return True
    except Exception:
        return False


# Settings a running server takes only at a restart, as the stack starts it. max_prepared_transactions: the tests
# of prepared (two-phase) transactions holding a cut (tests/test_edge_cuts.py) need some; PostgreSQL's default is 0.
PG_RESTART_SETTINGS = {"max_prepared_transactions": "20"}


def _pg_options(ports: Ports) -> str:
    restart_only = " ".join(f"-c {name}={value}" for name, value in PG_RESTART_SETTINGS.items())
    return (f"-p {ports.postgres} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            f"-c max_connections=300 -c synchronous_commit=off -c shared_buffers=256MB {restart_only}")


def postgres_restart_for_settings(ports: Ports, data: Path, logfile: Path) -> None:
    """Restart a running stack server started without one of PG_RESTART_SETTINGS (an older stack, reused by a
    new checkout: its tests need them). Sessions open on it are cut off (`-m fast`), once."""
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=ports.postgres, user=USER, password=PASSWORD, dbname="postgres",
                         autocommit=True, sslmode="disable") as conn:
        differ = [f"{name}={row[0] if row else '?'}" for name, value in PG_RESTART_SETTINGS.items()
                  if (row := conn.execute("SELECT setting FROM pg_settings WHERE name = %s", (name,)).fetchone())
                  is None or row[0] != value]
    if not differ:
        return
    wanted = ", ".join(f"{name}={value}" for name, value in PG_RESTART_SETTINGS.items())
    log(f"postgresql: restarting (pg_ctl restart -m fast) for {wanted}; it runs with {', '.join(differ)}")
    try:
        subprocess.run([*_pg_user_prefix(), pg_bin("pg_ctl"), "-D", str(data), "-l", str(logfile), "-o",
                        _pg_options(ports), "-m", "fast", "-w", "-t", "60", "restart"], check=True,
                       capture_output=True, text=True, start_new_session=True)
    except subprocess.CalledProcessError as exc:
        raise StackError(f"postgresql did not restart; read {logfile}\n{exc.stdout}{exc.stderr}") from exc
    wait_until(lambda: pg_ready(ports.postgres), 60, "postgresql", logfile)


def postgres_up(ports: Ports) -> None:
    base = home() / "postgres"
    data, logfile = base / "data", base / "postgres.log"
    if reuse_or_claim("postgresql", read_pid(data / "postmaster.pid"), lambda: pg_ready(ports.postgres),
                      ports.postgres, "ROWRELAY_PG_PORT", logfile, 60):
        postgres_restart_for_settings(ports, data, logfile)
        postgres_tls_up(ports.postgres, data, logfile)  # a running server gets TLS by a reload, no restart
        return
    base.mkdir(parents=True, exist_ok=True)
    if is_root():
        _make_traversable(base)
        pw = pwd.getpwnam("postgres")
        os.chown(base, pw.pw_uid, pw.pw_gid)
    if not (data / "PG_VERSION").exists():
        log(f"postgresql: initdb {data}")
        pwfile = base / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        if is_root():
            os.chown(pwfile, pw.pw_uid, pw.pw_gid)
        try:
            run([*_pg_user_prefix(), pg_bin("initdb"), "-D", str(data), "-U", USER, "--pwfile", str(pwfile),
                 "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"])
        except subprocess.CalledProcessError as exc:
            raise StackError(f"initdb failed:\n{exc.stdout}\n{exc.stderr}") from exc
        finally:
            pwfile.unlink(missing_ok=True)
    if not logfile.exists():
        logfile.touch()
    if is_root():
        os.chown(logfile, pw.pw_uid, pw.pw_gid)
    log(f"postgresql: starting on 127.0.0.1:{ports.postgres} (log {logfile})")
    try:
        subprocess.run([*_pg_user_prefix(), pg_bin("pg_ctl"), "-D", str(data), "-l", str(logfile), "-o",
                        _pg_options(ports), "-w", "-t", "60", "start"], check=True, capture_output=True, text=True,
                       start_new_session=True)
    except subprocess.CalledProcessError as exc:
        raise StackError(f"postgresql did not start; read {logfile}\n{exc.stdout}{exc.stderr}") from exc
    wait_until(lambda: pg_ready(ports.postgres), 60, "postgresql", logfile)
    postgres_tls_up(ports.postgres, data, logfile)
    ensure_pg_database(ports.postgres, DAGSTER_DB)
    ensure_pg_database(ports.postgres, DEMO_DB)


def tls_dir() -> Path:
    return home() / "tls"


def pg_ca_file() -> Path:
    """The stack's own CA certificate; clients verify the local PostgreSQL against it (sslrootcert)."""
    return tls_dir() / "ca.crt"


def _openssl(*args: str) -> None:
    try:
        run(["openssl", *args])
    except FileNotFoundError as exc:
        raise StackError("openssl not found; run: apt-get install -y openssl") from exc
    except subprocess.CalledProcessError as exc:
        raise StackError(f"openssl {args[0]} failed:\n{exc.stdout}{exc.stderr}") from exc


SERVER_CERT_EXTENSIONS = """\
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
"""


def ensure_pg_certificates(data: Path) -> bool:
    """A self-signed CA (tls/ca.crt) and a server certificate for 127.0.0.1/localhost it signed, as server.crt and
    server.key in the data dir. True if they were (re)made, i.e. the server must reload them."""
    ca_crt, ca_key = pg_ca_file(), tls_dir() / "ca.key"
    crt, key = data / "server.crt", data / "server.key"
    if ca_crt.exists() and key.exists() and crt.exists() and subprocess.run(
            ["openssl", "verify", "-CAfile", str(ca_crt), str(crt)], capture_output=True).returncode == 0:
        return False
    tls_dir().mkdir(parents=True, exist_ok=True)
    log(f"postgresql: making a local CA ({ca_crt}) and a server certificate for 127.0.0.1")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", "3650", "-subj",
             "/CN=rowrelay local stack CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(ca_key), "-out", str(ca_crt))
    os.chmod(ca_key, 0o600)
    csr, ext = tls_dir() / "server.csr", tls_dir() / "server.ext"
    ext.write_text(SERVER_CERT_EXTENSIONS)
    new_key = tls_dir() / "server.key.new"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-sha256", "-subj", "/CN=127.0.0.1",
             "-keyout", str(new_key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "3650", "-sha256", "-extfile", str(ext), "-out", str(crt))
    shutil.move(new_key, key)
    csr.unlink(missing_ok=True)
    # PostgreSQL refuses a key file others can read; it must belong to the server's OS user.
    os.chmod(key, 0o600)
    if is_root():
        pw = pwd.getpwnam("postgres")
        for path in (crt, key):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    return True


TLS_ONLY_HBA_LINE = f"hostnossl all {PG_TLS_USER} all reject"


def ensure_tls_only_role_hba(data: Path) -> bool:
    """pg_hba.conf refuses PG_TLS_USER over plaintext (the first matching line decides). True if added."""
    hba = data / "pg_hba.conf"
    lines = hba.read_text().splitlines()
    if TLS_ONLY_HBA_LINE in lines:
        return False
    hba.write_text("\n".join([f"# rowrelay stack: {PG_TLS_USER} may connect over TLS only", TLS_ONLY_HBA_LINE,
                              *lines]) + "\n")
    return True


PG_TLS_SETTINGS = {"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key"}


def pg_tls_ready(port: int) -> bool:
    import psycopg

    try:
        with psycopg.connect(host="127.0.0.1", port=port, user=PG_TLS_USER, password=PASSWORD, dbname="postgres",
                             sslmode="verify-full", sslrootcert=str(pg_ca_file()), connect_timeout=2):
            return True
    except Exception:
        return False


def postgres_tls_up(port: int, data: Path, logfile: Path) -> None:
    """Serve TLS (server.crt/server.key signed by the stack's CA) next to plaintext, idempotently.

    ssl settings and pg_hba.conf take effect on a reload (SIGHUP), so a running server needs no restart and
    sessions already open are untouched; plaintext connections keep working for every other role.
    """
    import psycopg
    from psycopg import sql

    changed = ensure_pg_certificates(data)
    changed |= ensure_tls_only_role_hba(data)
    with psycopg.connect(host="127.0.0.1", port=port, user=USER, password=PASSWORD, dbname="postgres",
                         autocommit=True, sslmode="disable") as conn:
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (PG_TLS_USER,)).fetchone():
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(PG_TLS_USER),
                                                                             sql.Literal(PASSWORD)))
        for name, value in PG_TLS_SETTINGS.items():
            current = conn.execute(sql.SQL("SELECT setting FROM pg_settings WHERE name = {}").format(
                sql.Literal(name))).fetchone()
            if current is None or current[0] != value:
                conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
                changed = True
        if changed:
            log("postgresql: enabling TLS (pg_reload_conf, no restart)")
            conn.execute("SELECT pg_reload_conf()")
    wait_until(lambda: pg_tls_ready(port), 30, "postgresql over TLS", logfile)


def ensure_pg_database(port: int, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(host="127.0.0.1", port=port, user=USER, password=PASSWORD, dbname="postgres",
                         autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def postgres_down() -> None:
    data = home() / "postgres" / "data"
    pid = read_pid(data / "postmaster.pid")
    if pid_alive(pid):
        log(f"postgresql: stopping pid {pid}")
        # A fast shutdown writes a checkpoint, which on a loaded host can outlast pg_ctl's wait; `down` must still
        # leave no process, so an immediate shutdown (crash recovery at the next start) follows.
        for mode, wait_s in (("fast", 60), ("immediate", 30)):
            subprocess.run([*_pg_user_prefix(), pg_bin("pg_ctl"), "-D", str(data), "-m", mode, "-w", "-t",
                            str(wait_s), "stop"], check=False, capture_output=True)
            if not pid_alive(pid):
                return
            log(f"postgresql: pid {pid} still running after a {mode} shutdown")


# --------------------------------------------------------------------------- MariaDB


def mariadb_socket() -> Path:
    return home() / "mariadb" / "mariadb.sock"


def mariadb_ready(port: int) -> bool:
    if not port_open(port):
        return False
    import pymysql

    try:
        pymysql.connect(host="127.0.0.1", port=port, user=USER, password=PASSWORD, connect_timeout=2).close()
        return True
    except Exception:
        return False


def mariadb_up(ports: Ports) -> None:
    base = home() / "mariadb"
    data, logfile, pidfile = base / "data", base / "mariadb.log", base / "mariadb.pid"
    if reuse_or_claim("mariadb", read_pid(pidfile), lambda: mariadb_ready(ports.mariadb), ports.mariadb,
                      "ROWRELAY_MARIADB_PORT", logfile, 60):
        return
    base.mkdir(parents=True, exist_ok=True)
    user = pwd.getpwuid(os.geteuid()).pw_name
    fresh = not (data / "mysql").exists()
    if fresh:
        log(f"mariadb: installing system tables in {data}")
        try:
            run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", f"--user={user}",
                 "--auth-root-authentication-method=socket", "--skip-test-db"])
        except subprocess.CalledProcessError as exc:
            raise StackError(f"mariadb-install-db failed:\n{exc.stdout}\n{exc.stderr}") from exc
    mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    log(f"mariadb: starting on 127.0.0.1:{ports.mariadb} (log {logfile})")
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            [mariadbd, "--no-defaults", f"--datadir={data}", f"--port={ports.mariadb}", "--bind-address=127.0.0.1",
             f"--socket={mariadb_socket()}", f"--pid-file={pidfile}", f"--user={user}", "--skip-name-resolve",
             "--innodb-buffer-pool-size=256M", "--innodb-flush-log-at-trx-commit=2", "--max-connections=300",
             "--character-set-server=utf8mb4", "--collation-server=utf8mb4_unicode_ci",
             "--max-allowed-packet=64M"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
    wait_until(lambda: mariadb_socket().exists(), 60, "mariadb", logfile, proc.pid)
    # The root account authenticates over the socket only; it creates the project's TCP user once.
    sql_text = (
        f"CREATE USER IF NOT EXISTS '{USER}'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}';"
        f"CREATE USER IF NOT EXISTS '{USER}'@'localhost' IDENTIFIED BY '{PASSWORD}';"
        f"GRANT ALL PRIVILEGES ON *.* TO '{USER}'@'127.0.0.1' WITH GRANT OPTION;"
        f"GRANT ALL PRIVILEGES ON *.* TO '{USER}'@'localhost' WITH GRANT OPTION;"
        f"CREATE DATABASE IF NOT EXISTS {DEMO_DB};"
    )
    deadline = time.monotonic() + 60
    while True:
        res = subprocess.run(["mariadb", "--no-defaults", f"--socket={mariadb_socket()}", "-uroot", "-e", sql_text],
                             capture_output=True, text=True)
        if res.returncode == 0:
            break
        if time.monotonic() > deadline or not pid_alive(proc.pid):
            raise StackError(f"mariadb did not accept the set-up statements ({res.stderr.strip()}); read {logfile}")
        time.sleep(0.5)
    wait_until(lambda: mariadb_ready(ports.mariadb), 60, "mariadb", logfile, proc.pid)


# --------------------------------------------------------------------------- Spark Connect


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def spark_connect_ready(port: int) -> bool:
    return port_open(port)


# The Connect server's logging: Spark's default layout at INFO, except the execution manager, whose INFO line about
# an execution its client left unreleased (a run worker ends with os._exit) prints the whole plan: the JDBC options,
# the source's password among them.
SPARK_CONNECT_LOG4J = """\
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.connect_executions.name = org.apache.spark.sql.connect.service.SparkConnectExecutionManager
logger.connect_executions.level = warn
"""


def spark_connect_command(base: Path, port: int, master: str, extra_conf: dict[str, str] | None = None) -> list[str]:
    """The Connect server's command line: its state under `base`, its executors on `master` (local[2] or a
    standalone cluster's spark://host:port), the JDBC drivers shipped to them, UTC in every JVM."""
    log4j = base / "log4j2.properties"
    log4j.write_text(SPARK_CONNECT_LOG4J)
    conf = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.extraJavaOptions": f"-Duser.timezone=UTC -Dlog4j2.configurationFile=file:{log4j}",
        "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.local.dir": str(base / "tmp"),
        "spark.sql.warehouse.dir": str(base / "warehouse"),
        **(extra_conf or {}),
    }
    cmd = [str(spark_home() / "bin" / "spark-submit"), "--class",
           "org.apache.spark.sql.connect.service.SparkConnectServer", "--name", "rowrelay-spark-connect",
           "--master", master, "--driver-memory", "1g", "--jars", ",".join(jdbc_jars())]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return cmd + ["spark-internal"]


def start_spark_connect(base: Path, port: int, master: str, extra_conf: dict[str, str] | None = None
                        ) -> subprocess.Popen:
    """Starts a Connect server (see spark_connect_command) logging to base/spark-connect.log; waits until it listens."""
    base.mkdir(parents=True, exist_ok=True)
    logfile = base / "spark-connect.log"
    cmd = spark_connect_command(base, port, master, extra_conf)
    log(f"spark connect: starting on sc://127.0.0.1:{port}, executors on {master} (log {logfile})")
    # Owner-only: a client's JDBC options (its password) reach the server in every read's plan.
    logfile.touch(mode=0o600)
    logfile.chmod(0o600)
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=base, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "SPARK_HOME": str(spark_home())})
    (base / "spark-connect.pid").write_text(str(proc.pid))
    wait_until(lambda: spark_connect_ready(port), 180, "spark connect", logfile, proc.pid)
    return proc


def spark_connect_up(ports: Ports) -> None:
    """A warm Spark (Connect server) that runs can share instead of starting a JVM each: on local[2], or on a
    standalone cluster of ROWRELAY_SPARK_WORKERS workers (stack/spark_cluster.py)."""
    base = home() / "spark-connect"
    pidfile, logfile = base / "spark-connect.pid", base / "spark-connect.log"
    if logfile.exists():  # a server started by an earlier release wrote it readable by all
        logfile.chmod(0o600)
    if reuse_or_claim("spark connect", read_pid(pidfile), lambda: spark_connect_ready(ports.spark_connect),
                      ports.spark_connect, "ROWRELAY_SPARK_CONNECT_PORT", logfile, 120):
        with contextlib.suppress(OSError, TypeError):
            if b"log4j2.configurationFile" not in Path(f"/proc/{read_pid(pidfile)}/cmdline").read_bytes():
                log("spark connect: this server was started by an earlier release and logs whole plans (the JDBC "
                    "password among them) at INFO: restart it (`python -m stack down`, then `up`)")
        return
    from stack import spark_cluster  # it builds on this module's helpers: imported where used, not at the top

    workers = spark_cluster.workers_wanted()
    if workers:
        cluster = spark_cluster.cluster_up(home() / "spark-cluster", workers, spark_cluster.ClusterPorts.from_env())
        start_spark_connect(base, ports.spark_connect, cluster.master_url, spark_cluster.executor_conf(workers))
    else:
        start_spark_connect(base, ports.spark_connect, "local[2]")


# --------------------------------------------------------------------------- stack


def stop_pidfile(name: str, pidfile: Path, timeout: float = 30) -> None:
    pid = read_pid(pidfile)
    if not pid_alive(pid):
        pidfile.unlink(missing_ok=True)
        return
    assert pid is not None
    log(f"{name}: stopping pid {pid}")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.3)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def settings(ports: Ports | None = None, with_jars: bool = True) -> dict[str, str]:
    p = ports or Ports.from_env()
    values = {
        "ROWRELAY_HOME": str(home()),
        "ROWRELAY_KAFKA_BOOTSTRAP": f"127.0.0.1:{p.kafka}",
        # The broker's SASL_SSL listener (SCRAM-SHA-512; TLS with a certificate of the stack's CA). rowrelay.yaml
        # takes these as ${VAR} templates; tests/test_sasl.py relays through it.
        "ROWRELAY_KAFKA_SASL_BOOTSTRAP": f"127.0.0.1:{p.kafka_sasl}",
        "ROWRELAY_KAFKA_SASL_MECHANISM": KAFKA_SASL_MECHANISM,
        "ROWRELAY_KAFKA_SASL_USER": KAFKA_SASL_USER,
        "ROWRELAY_KAFKA_SASL_PASSWORD": KAFKA_SASL_PASSWORD,
        "ROWRELAY_KAFKA_CA": str(kafka_ca_file()),
        "ROWRELAY_PG_HOST": "127.0.0.1",
        "ROWRELAY_PG_PORT": str(p.postgres),
        "ROWRELAY_PG_USER": USER,
        "ROWRELAY_PG_PASSWORD": PASSWORD,
        "ROWRELAY_PG_SSLROOTCERT": str(pg_ca_file()),  # the local PostgreSQL also serves TLS, signed by this CA
        "ROWRELAY_PG_TLS_USER": PG_TLS_USER,
        "ROWRELAY_MARIADB_HOST": "127.0.0.1",
        "ROWRELAY_MARIADB_PORT": str(p.mariadb),
        "ROWRELAY_MARIADB_USER": USER,
        "ROWRELAY_MARIADB_PASSWORD": PASSWORD,
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": str(p.postgres),
        "DAGSTER_PG_USER": USER,
        "DAGSTER_PG_PASSWORD": PASSWORD,
        "DAGSTER_PG_DB": DAGSTER_DB,
        # libpq clients of this local stack skip TLS on localhost: Dagster's storage opens a new connection for
        # every operation (NullPool), and a TLS handshake each time cost ~10 ms per storage call here. A URL's
        # own sslmode still wins (tests/test_tls.py); pgjdbc (Spark) does not read this variable.
        "PGSSLMODE": "disable",
        # dagster.yaml puts local artifacts and compute logs here, so nothing Dagster writes lands in a checkout.
        "ROWRELAY_DAGSTER_DIR": str(home() / "dagster"),
        "ROWRELAY_SPARK_REMOTE": f"sc://127.0.0.1:{p.spark_connect}",
    }
    if with_jars:
        values["ROWRELAY_JDBC_JARS"] = ",".join(jdbc_jars())
    return values


def write_env_file(values: dict[str, str]) -> Path:
    path = env_file()
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path


def load_env_file() -> dict[str, str]:
    path = env_file()
    if not path.exists():
        raise StackError(f"{path} not found: run `python -m stack up` (or `make stack`) first")
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v
    return out


def preflight(ports: Ports) -> None:
    """Fail fast, before any install or download, when a port we need belongs to someone else."""
    ours = [
        (read_pid(home() / "kafka" / "kafka.pid"), [(ports.kafka, "kafka", "ROWRELAY_KAFKA_PORT"),
         (ports.kafka_controller, "kafka controller", "ROWRELAY_KAFKA_CONTROLLER_PORT"),
         (ports.kafka_sasl, "kafka SASL_SSL listener", "ROWRELAY_KAFKA_SASL_PORT")]),
        (read_pid(home() / "postgres" / "data" / "postmaster.pid"),
         [(ports.postgres, "postgresql", "ROWRELAY_PG_PORT")]),
        (read_pid(home() / "mariadb" / "mariadb.pid"), [(ports.mariadb, "mariadb", "ROWRELAY_MARIADB_PORT")]),
        (read_pid(home() / "spark-connect" / "spark-connect.pid"),
         [(ports.spark_connect, "spark connect", "ROWRELAY_SPARK_CONNECT_PORT")]),
    ]
    for pid, checks in ours:
        if pid_alive(pid):
            continue
        for port, service, var in checks:
            require_free_port(port, service, var)


def up() -> dict[str, str]:
    from stack import kafka_cluster  # it builds on this module's helpers: imported where used, not at the top

    home().mkdir(parents=True, exist_ok=True)
    ports = Ports.from_env()
    preflight(ports)
    ensure_tools()
    fetch_jars("jdbc")
    postgres_up(ports)
    mariadb_up(ports)
    kafka_up(ports)
    spark_connect_up(ports)
    values = settings(ports)
    if (brokers := kafka_cluster.brokers_wanted()) > 1:
        # The data on a replicated cluster; the single broker stays up for its SASL_SSL listener.
        values["ROWRELAY_KAFKA_BOOTSTRAP"] = kafka_cluster.stack_cluster_up(home() / "kafka-cluster", brokers)
    path = write_env_file(values)
    log(f"stack is up; settings in {path}")
    return values


def down() -> None:
    from stack import kafka_cluster, spark_cluster  # they build on this module's helpers: imported where used

    stop_pidfile("spark connect", home() / "spark-connect" / "spark-connect.pid")
    spark_cluster.cluster_down(home() / "spark-cluster")
    kafka_cluster.stack_cluster_down(home() / "kafka-cluster")
    stop_pidfile("kafka", home() / "kafka" / "kafka.pid")
    stop_pidfile("mariadb", home() / "mariadb" / "mariadb.pid")
    postgres_down()


def status() -> int:
    ports = Ports.from_env()
    rows = [
        ("kafka", read_pid(home() / "kafka" / "kafka.pid"), ports.kafka, kafka_ready, home() / "kafka" / "kafka.log"),
        ("kafka sasl", read_pid(home() / "kafka" / "kafka.pid"), ports.kafka_sasl, kafka_sasl_ready,
         home() / "kafka" / "kafka.log"),
        ("postgresql", read_pid(home() / "postgres" / "data" / "postmaster.pid"), ports.postgres, pg_ready,
         home() / "postgres" / "postgres.log"),
        ("mariadb", read_pid(home() / "mariadb" / "mariadb.pid"), ports.mariadb, mariadb_ready,
         home() / "mariadb" / "mariadb.log"),
        ("spark", read_pid(home() / "spark-connect" / "spark-connect.pid"), ports.spark_connect,
         spark_connect_ready, home() / "spark-connect" / "spark-connect.log"),
    ]
    from stack import kafka_cluster  # it builds on this module's helpers: imported where used, not at the top

    nodes = sorted((home() / "kafka-cluster").glob("node-*"))
    for node, port in zip(nodes, kafka_cluster.stack_ports(len(nodes))[0], strict=True):
        rows.append((f"kafka {node.name}", read_pid(node / "kafka.pid"), port, kafka_ready, node / "kafka.log"))
    all_up = True
    for name, pid, port, ready, logfile in rows:
        alive = pid_alive(pid)
        answering = alive and ready(port)
        all_up &= answering
        state = "up" if answering else ("starting/unhealthy" if alive else "down")
        print(f"{name:<11} {state:<18} pid={pid if alive else '-':<8} 127.0.0.1:{port:<6} log={logfile}")
    print(f"settings    {env_file()}")
    return 0 if all_up else 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd = args[0] if args else "status"
    try:
        if cmd == "up":
            up()
            return 0
        if cmd == "down":
            down()
            return 0
        if cmd == "status":
            return status()
        if cmd == "env":
            print(env_file())
            return 0
    except StackError as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 1
    print("usage: python -m stack up|down|status|env", file=sys.stderr)
    return 2
