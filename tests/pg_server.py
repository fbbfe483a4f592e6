"""A real PostgreSQL server for the tests (a pytest plugin, listed in conftest's pytest_plugins).

``pg_server`` (session): Debian's ``postgresql`` binaries (the newest ``/usr/lib/postgresql/*/bin``
holding ``initdb`` and ``postgres``) run a fresh cluster in a temporary folder, listening on a free
127.0.0.1 port with its unix socket in that folder, as a non-root user (PostgreSQL refuses root:
``taskbridge-test`` is created with useradd when the tests run as root, as in CI). Host
connections need the password (scram-sha-256), so URLs carry one as users' do. The server is
stopped and its folder removed at the end of the session. Missing binaries or psycopg skip the
tests that need it; under ``CI=true`` they fail instead (``./install.sh --test`` installs both).

``PgServer.restart(down_sec)`` (``halt`` + ``start``) stops the cluster as ``pg_ctl -m fast stop``
does and starts it again on the same port: the outage tests use it on the shared server.

``pg_url`` (per test): a fresh database of its own, made in milliseconds from a template
(``CREATE DATABASE … TEMPLATE``) migrated once per session when the store speaks PostgreSQL;
dropped after the test. ``store_backend`` (per test, parametrized ``sqlite`` / ``postgresql``):
the queue on SQLite as the autouse fixture sets it, or ``TASK_DB_URL`` pointing at ``pg_url``.

Tests that need the server are marked ``postgres`` (pytest.ini). Reads ``CI`` at call time; not
run on its own.
"""
from __future__ import annotations

import contextlib
import glob
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

PASSWORD = "tb-secret-pw"   # the cluster's own password: the tests check it never shows
SUPERUSER = "taskbridge"
TEMPLATE = "taskbridge_template"
_NAMES = itertools.count(1)


def _missing(message: str) -> None:
    """Skip the test locally; fail it under CI=true, where PostgreSQL must be there."""
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def pg_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb and postgres, or None."""
    found = []
    for folder in glob.glob("/usr/lib/postgresql/*/bin"):
        version = re.search(r"/(\d+)(?:\.\d+)?/bin$", folder)
        if version and all(os.access(os.path.join(folder, b), os.X_OK) for b in ("initdb", "postgres")):
            found.append((int(version.group(1)), Path(folder)))
    return max(found)[1] if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PgServer:
    """A running cluster: ``url(dbname)`` gives a connection URL (with the password),
    ``create_database`` / ``drop_database`` manage databases through an admin connection."""
    folder: Path
    port: int
    bindir: Path
    proc: subprocess.Popen
    admin: Any = None
    migrated: bool = False
    _created: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)         # how ``proc`` was started (``start``)
    popen: dict[str, Any] = field(default_factory=dict)

    @property
    def socket_dir(self) -> Path:
        return self.folder / "sock"

    def url(self, dbname: str = "postgres", password: str | None = PASSWORD) -> str:
        auth = SUPERUSER + (f":{password}" if password is not None else "")
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def execute(self, sql: str) -> None:
        self.admin.execute(sql)

    def create_database(self, name: str, template: str | None = None) -> str:
        # FILE_COPY: a copy of the template's files (with fsync off, no flush); WAL_LOG, the
        # default since PostgreSQL 15, writes every page to the WAL.
        extra = f" TEMPLATE {template} STRATEGY FILE_COPY" if template else ""
        self.execute(f'CREATE DATABASE "{name}"{extra}')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def halt(self) -> None:
        """Stop the server as ``pg_ctl -m fast stop`` does (SIGINT: every session is ended with
        "terminating connection due to administrator command"), keeping its folder and port."""
        with contextlib.suppress(Exception):
            self.admin.close()
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)

    def start(self) -> None:
        """Start a halted server again, on the same port; returns once it takes connections."""
        log = open(self.folder / "postgres.log", "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log, **self.popen)
        log.close()
        if not _wait_ready(self):
            raise RuntimeError(f"postgres did not start again: {(self.folder / 'postgres.log').read_text()[-2000:]}")

    def ensure_up(self) -> None:
        """``start`` a server a test left halted (it failed between its ``halt`` and ``start``),
        so that the tests after it find one."""
        if self.proc.poll() is not None:
            self.start()

    def restart(self, down_sec: float) -> None:
        """``halt``, ``down_sec`` seconds with no server, ``start``."""
        self.halt()
        time.sleep(down_sec)
        self.start()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.admin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)   # fast shutdown: sessions ended, no checkpoint wait
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def _as_user() -> dict[str, Any]:
    """Popen arguments that run a step as the non-root test user (none when not root)."""
    if os.geteuid() != 0:
        return {}
    import helpers
    user = helpers.normal_user()
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def start_server() -> PgServer:
    """initdb + postgres in a new temporary folder; waits until it takes connections."""
    bindir = pg_bin_dir()
    if bindir is None:
        _missing("PostgreSQL is not installed (/usr/lib/postgresql/*/bin/postgres): run "
                 "./install.sh --test as root, or apt-get install postgresql")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _missing("psycopg is not installed: run ./install.sh --test (pinned in requirements.txt)")
    run_as = _as_user()
    folder = Path(tempfile.mkdtemp(prefix="taskbridge-pg-"))
    (folder / "sock").mkdir()
    (folder / "pwfile").write_text(PASSWORD + "\n")
    if run_as:
        for path in (folder, folder / "sock", folder / "pwfile"):
            os.chown(path, run_as["user"], run_as["group"])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": str(folder)}
    init = subprocess.run(
        [str(bindir / "initdb"), "-D", str(folder / "data"), "-U", SUPERUSER, "--pwfile", str(folder / "pwfile"),
         "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync"],
        cwd=folder, env=env, capture_output=True, text=True, **run_as)
    if init.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"initdb failed: {init.stderr or init.stdout}")
    for _attempt in range(5):
        port = free_port()
        log = open(folder / "postgres.log", "ab")
        argv = [str(bindir / "postgres"), "-D", str(folder / "data"), "-h", "127.0.0.1", "-p", str(port),
                "-k", str(folder / "sock"), "-c", "fsync=off", "-c", "synchronous_commit=off",
                "-c", "full_page_writes=off", "-c", "max_connections=300", "-c", "shared_buffers=32MB",
                "-c", "log_min_messages=warning"]
        popen = dict(cwd=folder, env=env, stdin=subprocess.DEVNULL, start_new_session=True, **run_as)
        proc = subprocess.Popen(argv, stdout=log, stderr=log, **popen)
        log.close()
        server = PgServer(folder, port, bindir, proc, argv=argv, popen=popen)
        if _wait_ready(server):
            return server
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = (folder / "postgres.log").read_text(errors="replace")[-3000:]
    shutil.rmtree(folder, ignore_errors=True)
    pytest.fail(f"postgres did not start: {text}")


def _wait_ready(server: PgServer, timeout: float = 30) -> bool:
    import psycopg
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False   # e.g. the port was taken in between: the caller tries another
        try:
            server.admin = psycopg.connect(host=str(server.socket_dir), port=server.port, user=SUPERUSER,
                                           dbname="postgres", autocommit=True, connect_timeout=5)
            return True
        except psycopg.OperationalError:
            time.sleep(0.05)
    return False


def _migrate_template(server: PgServer) -> None:
    """Make the template every test's database is copied from; migrated when the store speaks
    PostgreSQL (each test then skips the migrations)."""
    server.create_database(TEMPLATE)
    import task_store
    if not hasattr(task_store, "backend"):
        return
    saved = os.environ.get("TASK_DB_URL")
    os.environ["TASK_DB_URL"] = server.url(TEMPLATE)
    try:
        task_store.last_event_id()
    finally:
        task_store.close_connections()
        if saved is None:
            os.environ.pop("TASK_DB_URL", None)
        else:
            os.environ["TASK_DB_URL"] = saved
    server.migrated = True


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A PostgreSQL server for the whole session (see the module docstring)."""
    server = start_server()
    try:
        _migrate_template(server)
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A URL (with the password) of a fresh database for this test alone, dropped afterwards."""
    name = f"t{os.getpid()}_{next(_NAMES)}"
    url = pg_server.create_database(name, TEMPLATE)
    try:
        yield url
    finally:
        store = sys.modules.get("task_store")
        if store is not None:
            store.close_connections()   # the kept connections to it end before the drop
        pg_server.ensure_up()
        pg_server.drop_database(name)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on each backend: ``sqlite`` (as the autouse fixture set it) or ``postgresql``
    (``TASK_DB_URL`` = a fresh ``pg_url``). Returns the backend's name."""
    if request.param == "postgresql":
        monkeypatch.setenv("TASK_DB_URL", request.getfixturevalue("pg_url"))
    else:
        monkeypatch.delenv("TASK_DB_URL", raising=False)
    return request.param
