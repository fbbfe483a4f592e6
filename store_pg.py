"""The PostgreSQL side of the store (``TASK_DB_URL=postgresql://…``): connections, transactions,
LISTEN/NOTIFY, URL handling and psycopg's errors mapped into the store's own (store_errors.py).

task_store holds the queue's SQL, written once for both databases; this module speaks it to
PostgreSQL: ``pg_sql`` adapts placeholders, ``PgConnection`` answers like a sqlite3 connection
(rows as ``PgRow``, explicit transactions, events appended at the commit), ``connect`` opens and
migrates, ``transaction`` wraps a write, ``PgChangeWatch`` wakes a waiter on the events' NOTIFY.
A lost server becomes DatabaseUnavailable, a lock not granted in time DatabaseBusy, each naming the
URL without its password (``redact_url``) and the way out.

Imports the standard library, store_errors, psycopg 3 only when a connection is opened, and
file_watch (its wait loop) only in a waiting process.
Env: none (the URL comes from task_store). Not run on its own (task_store imports it).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

from store_errors import CONSTRAINT_WAY_OUT, ConstraintViolated, DatabaseBusy, DatabaseUnavailable

PG_SCHEMES = ("postgresql://", "postgres://")


# Connection parameters (libpq's names) a shown URL keeps; every other one (password,
# sslpassword, however spelled or percent-encoded, and any this list does not know) is left out.
URL_SHOWN_PARAMS = frozenset({"host", "hostaddr", "port", "dbname", "user", "sslmode", "application_name",
                              "connect_timeout", "target_session_attrs", "gssencmode", "load_balance_hosts"})


def redact_url(url: str) -> str:
    """``url`` as logs, messages and ``database_label`` show it: scheme, user name, hosts, ports,
    database, and only the query parameters in URL_SHOWN_PARAMS (decoded as libpq decodes them),
    so no password shows (``user:pw@``, ``password=``, ``%70assword=``, ``sslpassword=``). A
    value without ``://`` (a file path) is returned as it is."""
    if "://" not in url:
        return url
    try:
        parts = urllib.parse.urlsplit(url.strip())
    except ValueError:
        return url.partition("://")[0] + "://… (a URL that cannot be read)"
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    hosts = parts.netloc.rpartition("@")[2]
    kept = [(key, value) for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
            if key.lower() in URL_SHOWN_PARAMS]
    return (f"{parts.scheme}://{user + '@' if user else ''}{hosts}{parts.path}"
            + (f"?{urllib.parse.urlencode(kept)}" if kept else ""))


def url_secrets(url: str) -> list[str]:
    """Every secret ``url`` holds, as written and decoded (the user part's password, any parameter
    that is not in URL_SHOWN_PARAMS): what an error quoting the URL must have scrubbed."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
    except ValueError:
        return []
    userinfo = parts.netloc.rpartition("@")[0]
    found = [userinfo.partition(":")[2]] if ":" in userinfo else []
    for pair in parts.query.split("&"):
        key, _, value = pair.partition("=")
        if urllib.parse.unquote(key).lower() not in URL_SHOWN_PARAMS:
            found.append(value)
    return sorted({form for raw in found if raw for form in (raw, urllib.parse.unquote_plus(raw))},
                  key=len, reverse=True)


def url_option(url: str | None, name: str) -> str | None:
    """A connection option of ``url`` (``?passfile=…``: the last when repeated), or None (no URL,
    no such option, a URL that cannot be parsed)."""
    if not url:
        return None
    try:
        values = urllib.parse.parse_qs(urllib.parse.urlsplit(url.strip()).query).get(name)
    except ValueError:
        return None
    return values[-1] if values else None


def pgpass_file(url: str | None) -> str:
    """PostgreSQL's password file as libpq finds it for a connection to ``url`` (None: no queue
    URL): the URL's ``passfile``, else ``$PGPASSFILE``, else ``~/.pgpass`` (``$HOME``'s). Not
    checked for existence."""
    home = os.environ.get("HOME") or os.path.expanduser("~")
    return url_option(url, "passfile") or os.environ.get("PGPASSFILE") or os.path.join(home, ".pgpass")


# PostgreSQL (TASK_DB_URL=postgresql://…): a kept connection per thread and process like the
# SQLite ones, speaking the store's SQL through one adaptation (placeholders), rows like
# sqlite3.Row, explicit transactions. No global lock: a claim picks with FOR UPDATE SKIP LOCKED,
# every other write locks the rows it decides on (``_row``'s FOR UPDATE, FOR SHARE on a new task's
# dependencies), so writers of different tasks never wait on one another; the hot calls are one
# autocommit statement each (``with_event``). Events are appended in the transaction's last
# statement (or in that one statement) with ids made of its transaction id (``PG_EVENT_ID``), and a
# reader stops at the oldest transaction still open (``PG_EVENTS_FINAL``): ids commit out of
# order, but below that horizon every one has committed or never will, so a cursor never skips an
# event that commits late. pg_notify tells listeners at the commit.

PG_CHANNEL = "taskbridge_events"
PG_MIGRATE_LOCK = 0x7461736B64  # advisory lock keys: migrations ("taskd"),
PG_KEY_LOCK = 0x74626B79        # the first key of an idempotency key's lock ("tbky"; the second its hash)
# An event's id: its transaction's id (xid8, unique and assigned in start order) times 2^20 plus
# its place in the transaction. Below the oldest open transaction's id times 2^20 no event can
# still appear, whatever order the transactions commit in. 2^20 events a transaction, and ids
# stay below 2^53 (exact in JavaScript, the board's) for 2^33 transactions.
PG_EVENT_SLOTS = 1 << 20
PG_EVENT_ID = f"pg_current_xact_id()::text::bigint * {PG_EVENT_SLOTS:d}"
PG_EVENTS_FINAL = f"id < (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint * {PG_EVENT_SLOTS:d})"
PG_CONNECT_TIMEOUT_SEC = 10
PG_LOCK_TIMEOUT_SEC = 30.0   # how long a write waits for a lock (as BUSY_WAIT_SEC on SQLite)

_PG_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|::|\?|:([A-Za-z_]\w*)|%")


@functools.lru_cache(maxsize=1024)
def pg_sql(sql: str) -> str:
    """The store's SQL with psycopg's placeholders: ``?`` -> ``%s``, ``:name`` -> ``%(name)s``,
    a literal ``%`` doubled; string literals and ``::`` casts kept. Cached per statement text."""
    def swap(match: re.Match) -> str:
        text = match.group(0)
        if text == "?":
            return "%s"
        if match.group(1):
            return f"%({match.group(1)})s"
        return text.replace("%", "%%")
    return _PG_TOKEN.sub(swap, sql)


class PgRow(tuple):
    """A PostgreSQL row as sqlite3.Row behaves: ``row["col"]``, ``row[0]``, ``dict(row)``,
    ``row.keys()``; iterating gives the values."""
    __slots__ = ()
    _names: dict[str, int] = {}

    def __getitem__(self, key: Any) -> Any:
        return tuple.__getitem__(self, self._names[key] if isinstance(key, str) else key)

    def keys(self) -> list[str]:
        return list(self._names)


@functools.lru_cache(maxsize=512)
def _row_class(names: tuple[str, ...]) -> type:
    return type("PgRow", (PgRow,), {"__slots__": (), "_names": {n: i for i, n in enumerate(names)}})


def _pg_rows(cursor: Any) -> Any:
    """psycopg row factory: PgRow subclasses per column list."""
    return _row_class(tuple(c.name for c in cursor.description)) if cursor.description else tuple


@functools.lru_cache(maxsize=1)
def _nul_free_dumper() -> type:
    """psycopg's str dumper, with NUL characters stored as U+FFFD: PostgreSQL's text cannot hold
    NUL (SQLite's can), and an agent's output, an error or a diff may carry one; refusing the
    write would lose the receipt. Input the store validates refuses NUL before this."""
    from psycopg.types.string import StrDumperUnknown

    class NulFreeStrDumper(StrDumperUnknown):
        def dump(self, obj: str) -> Any:
            return super().dump(obj.replace("\x00", "\ufffd") if "\x00" in obj else obj)

    return NulFreeStrDumper


def _psycopg(url: str = "") -> Any:
    try:
        import psycopg
    except ImportError:
        raise DatabaseUnavailable(
            f"TASK_DB_URL names a PostgreSQL queue ({redact_url(url)}) but psycopg is not installed: "
            "run ./install.sh (it installs requirements.txt), or unset TASK_DB_URL to use SQLite") from None
    return psycopg


def unavailable(url: str, exc: BaseException, hint: str = "") -> DatabaseUnavailable:
    """A DatabaseUnavailable naming the URL (no password) and the way out (``hint`` first when
    given); any text of ``exc`` that quotes a secret of the URL is scrubbed."""
    said = " ".join(str(exc).split()) or type(exc).__name__
    for secret in url_secrets(url):
        said = said.replace(secret, "***")
    way_out = hint or ("check TASK_DB_URL (postgresql://user:password@host:5432/dbname) and that the "
                       "server is running and reachable, or unset TASK_DB_URL to use SQLite")
    return DatabaseUnavailable(f"cannot use the PostgreSQL queue {redact_url(url)}: {said}; {way_out}")


class PgConnection:
    """A kept PostgreSQL connection (autocommit; transactions explicit) that takes the store's
    statements as written for SQLite: ``execute`` / ``executemany`` with ``?`` and ``:name``
    placeholders, rows as PgRow. Inside a write transaction ``writing`` is True: task reads that
    decide a transition lock their row, and events wait in ``events`` until ``commit``."""

    def __init__(self, raw: Any, url: str) -> None:
        self.raw, self.url = raw, url
        self.writing = False
        self.events: list[tuple[int | None, float, str, str]] = []
        # The driver's errors this connection maps (``_mapped``): a lost or refused operation, and
        # a write a constraint refused. Any other (a ProgrammingError: a bug in a statement) stays raw.
        self._errors = tuple(getattr(type(raw), name) for name in ("OperationalError", "IntegrityError")
                             if hasattr(type(raw), name)) or (Exception,)

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self._execute(sql, params, False)

    def execute_idempotent(self, sql: str, params: Any = ()) -> Any:
        """``execute`` for a statement that may run twice with the same effect (a fenced lease
        renewal): outside a transaction it is retried once on a new connection like a SELECT."""
        return self._execute(sql, params, True)

    def _execute(self, sql: str, params: Any, idempotent: bool) -> Any:
        idle = self.raw.pgconn.transaction_status == 0   # IDLE: no transaction of ours to lose
        try:
            return self.raw.execute(pg_sql(sql), params)
        except self._errors as exc:
            if not (idle and self._retryable(sql, idempotent)):
                raise self._mapped(exc) from None
        # The server dropped the connection (a restart, an idle timeout) before a statement that
        # had nothing to lose: a read outside a transaction, or the BEGIN opening one. Log in
        # again and run it once more, instead of failing this call (a lease renewal, say).
        self.raw = _pg_open(self.url)
        try:
            return self.raw.execute(pg_sql(sql), params)
        except self._errors as exc:
            raise self._mapped(exc) from None

    def _retryable(self, sql: str, idempotent: bool) -> bool:
        # Only a statement that cannot have changed anything (a SELECT, a BEGIN) or one whose
        # second run changes nothing more.
        return (self.raw.broken or self.raw.closed) and (idempotent or sql.lstrip()[:6].upper() in ("SELECT", "BEGIN"))

    def executemany(self, sql: str, rows: Iterable[Any]) -> None:
        try:
            with self.raw.cursor() as cur:
                cur.executemany(pg_sql(sql), list(rows))
        except self._errors as exc:
            raise self._mapped(exc) from None

    def _mapped(self, exc: BaseException) -> BaseException:
        # A write a constraint refused (SQLSTATE class 23) is ConstraintViolated, as on SQLite; a
        # lock not granted in time or a broken deadlock is a busy queue (try again); any other
        # operational failure (a lost connection, a server going down) its unavailability.
        state = getattr(exc, "sqlstate", None) or ""
        if state.startswith("23"):
            said = " ".join(str(exc).split())
            return ConstraintViolated(f"the PostgreSQL queue {redact_url(self.url)} refused a write ({said}): "
                                      f"{CONSTRAINT_WAY_OUT}", said)
        if state == "55P03" or state.startswith("40"):
            said = " ".join(str(exc).split())
            return DatabaseBusy(f"the PostgreSQL queue {redact_url(self.url)} is busy ({said}); nothing was "
                                "written: try again in a moment")
        return unavailable(self.url, exc)

    @property
    def in_transaction(self) -> bool:
        return self.raw.pgconn.transaction_status != 0   # 0: IDLE

    @property
    def usable(self) -> bool:
        return not (self.raw.closed or self.raw.broken)

    def close(self) -> None:
        self.raw.close()

    def commit(self) -> None:
        """COMMIT; with events, first append them (ids from this transaction's id, see
        ``PG_EVENT_ID``) and notify listeners (delivered at the commit). One message, one round
        trip: the values go in as literals quoted by psycopg (``sql.Literal``)."""
        if not self.events:
            self.execute("COMMIT")
            return
        rows, self.events = self.events, []
        try:
            self.raw.execute(_events_statement(rows))
        except self._errors as exc:
            raise self._mapped(exc) from None


def _events_statement(rows: list[tuple[int | None, float, str, str]]) -> Any:
    """The INSERT of ``rows`` (task_id, ts, kind, message) into events, the NOTIFY and the COMMIT,
    as one psycopg ``sql.Composed``. Raises RuntimeError past PG_EVENT_SLOTS rows (a bug)."""
    from psycopg import sql
    if len(rows) >= PG_EVENT_SLOTS:
        raise RuntimeError(f"task_store: {len(rows)} events in one transaction; at most {PG_EVENT_SLOTS - 1}")
    values = sql.SQL(", ").join(
        sql.SQL("({}, CAST({} AS BIGINT), CAST({} AS DOUBLE PRECISION), {}, {})").format(
            *map(sql.Literal, (n, *row))) for n, row in enumerate(rows, 1))
    return sql.SQL(
        "WITH v (n, task_id, ts, kind, message) AS (VALUES {values}), added AS (INSERT INTO events"
        " (id, task_id, ts, kind, message) SELECT {first} + n, task_id, ts, kind, message FROM v RETURNING id)"
        " SELECT pg_notify({channel}, max(id)::text) FROM added; COMMIT"
    ).format(values=values, first=sql.SQL(PG_EVENT_ID), channel=sql.Literal(PG_CHANNEL))


def with_event(change: str, kind: str, message: str, *, before: str = "", also: str = "",
               source: str = "changed") -> str:
    """One statement that makes ``change`` (the store's ``UPDATE`` or ``INSERT … RETURNING *`` of
    task rows) and, for each row it returns, appends an event (``kind``: a literal kind;
    ``message``: an SQL expression over ``changed``'s columns; the time is ``:event_ts``) and
    notifies listeners, as ``commit`` does for a transaction's events: one round trip instead of
    BEGIN, the write and the COMMIT. For autocommit only: the statement is its own transaction, so
    its events' ids (PG_EVENT_ID plus 1, 2, …) are that transaction's only ones and a cursor's
    horizon (PG_EVENTS_FINAL) keeps them as it keeps a commit's. ``before``: CTEs to put first
    (``name AS (…), ``); ``also``: columns to select besides (``, expr AS name``); ``source``:
    what the rows are selected from. Rows: ``notified`` (NULL), ``also``'s columns, the row's."""
    return (f"WITH {before}changed AS ({change}), added AS (INSERT INTO events (id, task_id, ts, kind, message)"
            f" SELECT {PG_EVENT_ID} + row_number() OVER (ORDER BY changed.id), changed.id,"
            f" CAST(:event_ts AS DOUBLE PRECISION), '{kind}', {message} FROM changed RETURNING id)"
            f" SELECT (SELECT pg_notify('{PG_CHANNEL}', max(id)::text) FROM added HAVING count(*) > 0) AS notified"
            f"{also}, changed.* FROM {source}")


def _pg_open(url: str) -> Any:
    """A new psycopg connection set up for the store (autocommit, rows, NUL-free text, the lock
    timeout). Raises DatabaseUnavailable."""
    psycopg = _psycopg(url)
    try:
        raw = psycopg.connect(url, autocommit=True, connect_timeout=PG_CONNECT_TIMEOUT_SEC,
                              row_factory=_pg_rows, application_name="taskbridge")
        raw.prepared_max = 256
        raw.adapters.register_dumper(str, _nul_free_dumper())
        raw.execute(f"SET lock_timeout = {int(PG_LOCK_TIMEOUT_SEC * 1000):d}")
    except (psycopg.Error, ValueError) as exc:
        raise unavailable(url, exc) from None
    return raw


def connect(url: str, steps: list[list[str]]) -> PgConnection:
    """A new PostgreSQL connection to ``url``, migrated: ``steps`` are the statements of each
    migration in order (task_store's ``pg_migrations()``; the version in table schema_version).
    Raises DatabaseUnavailable."""
    conn = PgConnection(_pg_open(url), url)
    try:
        _migrate(conn, steps)
    except _psycopg(url).Error as exc:   # e.g. a role that may not create tables, a statement_timeout in the URL
        conn.close()
        raise unavailable(url, exc, _PG_SETUP_HINTS.get(getattr(exc, "sqlstate", None) or "", "")) from None
    except BaseException:
        conn.close()
        raise
    return conn


# What to do when the queue's tables cannot be set up, by SQLSTATE.
_PG_SETUP_HINTS = {
    "42501": "the role must be able to create tables there: make it the database's owner "
             "(ALTER DATABASE … OWNER TO …) or GRANT CREATE ON SCHEMA public TO it",
    "57014": "a statement was cancelled by a timeout: take statement_timeout out of the URL's options",
}


def health(url: str, steps: list[list[str]]) -> dict[str, Any]:
    """``task_store.database_health`` for the PostgreSQL queue ``url``: ``{"backend":
    "postgresql", "path" (the URL without its password), "integrity" ("ok" once a query answers),
    "journal_mode" and "filesystem" (None), "tasks", "server_version"}``. Opens (and migrates)
    it like every entry point; raises as ``connect``."""
    conn = connect(url, steps)
    try:
        version = conn.execute("SHOW server_version").fetchone()[0]
        tasks = conn.execute("SELECT count(*) FROM tasks").fetchone()[0]
    finally:
        conn.close()
    return {"backend": "postgresql", "path": redact_url(url), "integrity": "ok", "journal_mode": None,
            "filesystem": None, "tasks": tasks, "server_version": version}


def _migrate(conn: PgConnection, steps: list[list[str]]) -> None:
    try:
        version = conn.raw.execute("SELECT max(version) FROM schema_version").fetchone()[0] or 0
    except _psycopg(conn.url).errors.UndefinedTable:
        version = 0
    if version >= len(steps):
        return
    conn.execute("BEGIN")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (PG_MIGRATE_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        version = conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]
        for statement in (s for step in steps[version:] for s in step):
            conn.raw.execute(statement)   # DDL as written: no placeholders to adapt
        conn.execute("DELETE FROM schema_version")
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (len(steps),))
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            conn.raw.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def transaction(conn: PgConnection) -> Iterator[PgConnection]:
    """A PostgreSQL write transaction: BEGIN, the body (which locks the rows it decides on), the
    buffered events, COMMIT; ROLLBACK on any error. A connection left broken or inside a
    transaction is closed (``usable`` turns False: the keeper opens a new one)."""
    if conn.in_transaction:
        raise RuntimeError("task_store: a write transaction was opened inside another one")
    conn.writing = True
    try:
        conn.execute("BEGIN")
        yield conn
        conn.commit()
    except BaseException:
        conn.events.clear()
        if conn.usable:
            try:
                conn.raw.execute("ROLLBACK")
            except Exception:  # noqa: BLE001 - the connection is dropped below instead
                pass
        if not conn.usable or conn.in_transaction:
            with contextlib.suppress(Exception):
                conn.close()
        raise
    finally:
        conn.writing = False


def detach_inherited(conn: Any) -> None:
    # A forked child must never talk on its parent's PostgreSQL socket, not even to close it
    # (libpq's goodbye would end the parent's session). psycopg's finaliser already skips the
    # goodbye in another process; the child's copy of the descriptor is also pointed at
    # /dev/null, so nothing done to the object here (a close, a stray query) reaches the server.
    raw = conn.raw if isinstance(conn, PgConnection) else conn
    if hasattr(raw, "pgconn"):   # a psycopg connection (a sqlite3 one needs nothing)
        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, raw.pgconn.socket)
            os.close(devnull)


# Idle LISTEN connections of this process, per URL: a waiter (the worker's --watch loop waits
# once per pass, the MCP wait_for once per call) takes one instead of logging in anew each time.
# A forked child holds its parent's in _INHERITED (never used, never closed: see detach_inherited).
_INHERITED: list[Any] = []
_LISTENERS: dict[str, list[Any]] = {}
_LISTENERS_LOCK = threading.Lock()
_LISTENERS_PID = [os.getpid()]
LISTENERS_IDLE_MAX = 4


def _drained(conn: Any) -> bool:
    """Read and drop what a LISTEN connection holds (old notifications); False when it is broken."""
    try:
        if conn.closed or conn.broken:
            return False
        conn.pgconn.consume_input()
        while conn.pgconn.notifies() is not None:
            pass
        return conn.pgconn.transaction_status == 0   # IDLE
    except Exception:  # noqa: BLE001 - a broken connection is simply not reused
        return False


def _take_listener(url: str) -> Any:
    """An idle LISTEN connection to ``url`` of this process, or a new one. Raises psycopg.Error."""
    with _LISTENERS_LOCK:
        if _LISTENERS_PID[0] != os.getpid():   # a forked child: its parent's are not its own
            for conn in (c for idle in _LISTENERS.values() for c in idle):
                _INHERITED.append(conn)
                detach_inherited(conn)
            _LISTENERS.clear()
            _LISTENERS_PID[0] = os.getpid()
        idle = _LISTENERS.get(url, [])
        while idle:
            conn = idle.pop()
            if _drained(conn):
                return conn
            with contextlib.suppress(Exception):
                conn.close()
    conn = _psycopg(url).connect(url, autocommit=True, connect_timeout=PG_CONNECT_TIMEOUT_SEC,
                              application_name="taskbridge-listen")
    conn.execute(f"LISTEN {PG_CHANNEL}")
    return conn


def _give_back_listener(url: str, conn: Any) -> None:
    with _LISTENERS_LOCK:
        idle = _LISTENERS.setdefault(url, [])
        if _LISTENERS_PID[0] == os.getpid() and len(idle) < LISTENERS_IDLE_MAX and _drained(conn):
            idle.append(conn)
            return
    with contextlib.suppress(Exception):
        conn.close()


def close_listeners() -> None:
    """Close this process's idle LISTEN connections (``task_store.close_connections``)."""
    with _LISTENERS_LOCK:
        idle = [c for conns in _LISTENERS.values() for c in conns] if _LISTENERS_PID[0] == os.getpid() else []
        _LISTENERS.clear()
    for conn in idle:
        with contextlib.suppress(Exception):
            conn.close()


def _after_fork_in_child() -> None:
    # The child starts with only the forking thread: a lock another thread of the parent held at
    # the fork would never be released here.
    global _LISTENERS_LOCK
    _LISTENERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def change_watch(url: str) -> PgChangeWatch:
    """A PgChangeWatch on the PostgreSQL queue ``url`` (as store_sqlite.change_watch on a file)."""
    return PgChangeWatch(url)


class PgChangeWatch:
    """``file_watch.FolderWatch``'s interface over ``LISTEN taskbridge_events`` on a connection of
    its own (kept for the next watch of this process when closed): ``wait(timeout) -> bool``,
    ``drain()``, ``fd`` / ``fileno()`` for an event loop, ``available``, ``close()``, a context
    manager. When the server cannot be reached ``available`` is False and ``wait`` only sleeps
    (the caller's poll re-checks)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Any = None
        self.fd = -1
        try:
            self.conn = _take_listener(url)
            self.fd = self.conn.pgconn.socket
        except Exception:  # noqa: BLE001 - no notifications: the waiter polls, as FolderWatch without inotify
            self.close()

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def fileno(self) -> int:
        return self.fd

    def wait(self, timeout: float) -> bool:
        """Block until a change is notified (True) or ``timeout`` seconds pass (False)."""
        from file_watch import wait_for  # imported by waiting processes only
        return wait_for(self, timeout, buffered=True)

    def drain(self) -> bool:
        """Read what the server sent (never blocks); True when a change was notified (or the
        connection broke: the caller re-checks, then polls)."""
        if self.fd < 0:
            return False
        pgconn = self.conn.pgconn
        try:
            pgconn.consume_input()
        except Exception:  # noqa: BLE001 - a lost server: say "look again"; polling takes over
            self.close()
            return True
        hit = False
        while pgconn.notifies() is not None:
            hit = True
        return hit

    def close(self) -> None:
        conn, self.conn, self.fd = self.conn, None, -1
        if conn is not None:
            _give_back_listener(self.url, conn)

    def __enter__(self) -> PgChangeWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
