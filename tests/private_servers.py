"""PostgreSQL and MariaDB servers a test starts for itself, from the Debian binaries the local stack uses: for
setups the shared servers must not take (a replica of them, a lazy commit setting, a crash)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pymysql
import pytest
from sqlalchemy.engine import URL

from stack.local import free_ports

USER = "rowrelay"


def free_port() -> int:
    return free_ports(1)[0]


def polled(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.1)


@contextmanager
def scratch_dir(prefix: str, user: str) -> Iterator[Path]:
    """A temporary directory the server's user owns (as root, PostgreSQL and MariaDB run as their Debian users)."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        if os.geteuid() == 0:
            entry = pwd.getpwnam(user)
            os.chown(base, entry.pw_uid, entry.pw_gid)
            for parent in base.parents:  # reachable (search bit) by the service user
                os.chmod(parent, os.stat(parent).st_mode | 0o001)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if not found:
        pytest.skip("no PostgreSQL server binaries (the local stack's Debian packages)")
    return found[-1]


@dataclass
class PostgresServer:
    """One PostgreSQL server: trust authentication on 127.0.0.1 for `rowrelay`, replication included."""

    data: Path
    port: int
    options: str = ""

    @property
    def _as_pg(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def url(self, database: str = "postgres", user: str = USER) -> URL:
        return URL.create("postgresql+psycopg", username=user, host="127.0.0.1", port=self.port, database=database)

    def init(self) -> None:
        subprocess.run([*self._as_pg, pg_bin("initdb"), "-D", str(self.data), "-U", USER, "--auth=trust", "-E",
                        "UTF8", "--locale=C.UTF-8"], check=True, capture_output=True, text=True)
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host replication {USER} 127.0.0.1/32 trust\n")

    def start(self) -> None:
        subprocess.run([*self._as_pg, pg_bin("pg_ctl"), "-D", str(self.data), "-l", f"{self.data}.log", "-o",
                        f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
                        f"-c shared_buffers=16MB {self.options}", "-w", "-t", "60", "start"],
                       check=True, capture_output=True, text=True, start_new_session=True)

    def crash(self) -> None:
        """Stop as a crash does (no checkpoint, nothing flushed that was not)."""
        subprocess.run([*self._as_pg, pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True)

    def standby(self, data: Path, port: int) -> PostgresServer:
        """A streaming hot standby of this server."""
        subprocess.run([*self._as_pg, pg_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER,
                        "-D", str(data), "-R", "-X", "stream"], check=True, capture_output=True, text=True)
        return PostgresServer(data, port, self.options)


@contextmanager
def postgres_servers(options: str = "") -> Iterator[Callable[..., PostgresServer]]:
    """Yields `make(standby_of=None)`: a started server (or a standby of one); every one is stopped at the end."""
    made: list[PostgresServer] = []
    with scratch_dir("rowrelay-pg-", "postgres") as base:
        def make(standby_of: PostgresServer | None = None) -> PostgresServer:
            data = base / f"pg{len(made)}"
            server = (standby_of.standby(data, free_port()) if standby_of is not None
                      else PostgresServer(data, free_port(), options))
            if standby_of is None:
                server.init()
            made.append(server)
            server.start()
            return server

        try:
            yield make
        finally:
            for server in reversed(made):
                server.crash()


@dataclass
class MariadbServer:
    """One MariaDB server; root over its socket."""

    data: Path
    port: int
    user: str
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> str:
        return f"{self.data}.sock"

    def url(self, database: str, user: str, password: str) -> URL:
        return URL.create("mysql+pymysql", username=user, password=password, host="127.0.0.1", port=self.port,
                          database=database)

    def start(self) -> None:
        mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        with open(f"{self.data}.log", "ab") as out:
            self.proc = subprocess.Popen(
                [mariadbd, "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
                 "--bind-address=127.0.0.1", f"--socket={self.socket}", f"--user={self.user}", "--skip-name-resolve",
                 "--innodb-buffer-pool-size=32M", *self.args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        polled(lambda: os.path.exists(self.socket) and self._answers(), "the MariaDB server starts")

    def _answers(self) -> bool:
        try:
            pymysql.connect(unix_socket=self.socket, user="root").close()
            return True
        except pymysql.err.OperationalError:
            return False

    def crash(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def root(self, *statements: str) -> None:
        conn = pymysql.connect(unix_socket=self.socket, user="root", autocommit=True)
        try:
            with conn.cursor() as cursor:
                for statement in statements:
                    cursor.execute(statement)
        finally:
            conn.close()


@contextmanager
def mariadb_servers() -> Iterator[Callable[..., MariadbServer]]:
    """Yields `make(*args)`: a started server with these mariadbd arguments; every one is killed at the end."""
    mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    if not os.path.exists(mariadbd) or not shutil.which("mariadb-install-db"):
        pytest.skip("no MariaDB server binaries (the local stack's Debian packages)")
    user = "mysql" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    made: list[MariadbServer] = []
    with scratch_dir("rowrelay-mariadb-", user) as base:
        def make(*args: str) -> MariadbServer:
            server = MariadbServer(base / f"m{len(made)}", free_port(), user,
                                   [f"--server-id={len(made) + 1}", *args])
            subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={server.data}", f"--user={user}",
                            "--auth-root-authentication-method=normal", "--skip-test-db"],
                           check=True, capture_output=True, text=True)
            made.append(server)
            server.start()
            # Not in the binary log: a replica creates the same user itself.
            server.root("SET sql_log_bin = 0", f"CREATE USER '{USER}'@'127.0.0.1' IDENTIFIED BY 'pw'",
                        f"GRANT ALL ON *.* TO '{USER}'@'127.0.0.1' WITH GRANT OPTION")
            return server

        try:
            yield make
        finally:
            for server in made:
                server.crash()


@contextmanager
def private_mariadb_database(*args: str) -> Iterator[tuple[MariadbServer, URL]]:
    """A MariaDB server of the test's own (these mariadbd arguments) and a database on it that `rowrelay` owns: for
    a test that changes server-wide settings (SET GLOBAL), which every other test on a shared server would see."""
    with mariadb_servers() as make:
        server = make(*args)
        server.root("CREATE DATABASE relay")
        yield server, server.url("relay", USER, "pw")
