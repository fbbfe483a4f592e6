"""TaskBridge's durable queue: every SQL statement of the project lives here.

One SQLite file (``TASK_DB_PATH``, default ``<repo>/tasks.db``) in WAL mode holds the tasks, their
dependencies, notes, questions and answers, an append-only events log, settings and the reverse
bridge's Claude jobs. Every public function opens its own connection through ``connect()``, which
migrates the schema on open (``PRAGMA user_version``), and closes it again; every write runs in a
``BEGIN IMMEDIATE`` transaction or is a single statement, so concurrent processes (MCP server, CLI,
worker passes) never hit "database is locked" from a deferred read-then-write upgrade.

Spending limits live here too: each task's ``max_cost_usd`` / ``max_tokens``, the running
attempt's live spend, the spend per local day and the daily budget (``budget_state``,
``set_budget``, ``record_spend``, ``raise_limit``; answers to a limit pause in ``answer_task``).

Past one machine the same functions run on PostgreSQL (``TASK_DB_URL=postgresql://…``, through
psycopg 3, imported only then): the same schema and migrations, the statements that differ kept
side by side (see "PostgreSQL" below), claims with ``FOR UPDATE SKIP LOCKED``, wake-ups with
``LISTEN/NOTIFY``, task logs in the database (``append_task_log``, ``read_task_log``,
``task_log_size``: the file on SQLite, ``task_log_chunks`` on PostgreSQL) and every worker of
every host in ``workers`` (``write_worker_heartbeat``, ``list_workers``).

Env read at call time: ``TASK_DB_URL``, ``TASK_DB_PATH``, ``TASK_LOG_DIR``, ``TASK_DB_JOURNAL``,
``TASKBRIDGE_HOST``, ``TASKBRIDGE_MOUNTINFO``.

Behind it, one flat module per database and the error tree they share: store_sqlite.py (the
connection factory and pragmas, journal mode, read-only opening, BEGIN IMMEDIATE transactions with
busy waits, the change watch on the file, sqlite3's errors mapped into the store's), store_pg.py
(the same for PostgreSQL: connections, transactions, LISTEN/NOTIFY, URL handling, psycopg's errors)
and store_errors.py (the error tree, every name also this module's). This module keeps the queue's
SQL, its migrations and one connection per thread and database. Imports the standard library,
knobs.py and those only (psycopg through store_pg when TASK_DB_URL names PostgreSQL).
Not run on its own (the MCP server, the CLI and the worker import it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import itertools
import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sized
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast, runtime_checkable

import knobs
import store_pg
import store_sqlite
import task_spec as spec
from store_errors import (  # noqa: F401
    ConstraintViolated,
    DatabaseBusy,
    DatabaseCorrupt,
    DatabaseUnavailable,
    DatabaseUnusable,
    DiskFull,
    InvalidTransition,
    JobNotFound,
    LogFolderTaken,
    QueueGone,
    QueueReplaced,
    ReadOnlyStorage,
    StaleAttempt,
    StorageFault,
    TaskNotFound,
    TaskStoreError,
    ValidationError,
)
from store_pg import (  # noqa: F401
    PG_EVENTS_FINAL,
    PG_KEY_LOCK,
    PG_SCHEMES,
    URL_SHOWN_PARAMS,
    PgChangeWatch,
    PgConnection,
    PgRow,
    pg_sql,
    pgpass_file,
    redact_url,
    url_option,
    url_secrets,
)
from store_sqlite import (  # noqa: F401
    JOURNAL_CHOICES,
    NETWORK_FILESYSTEMS,
    db_filesystem,
    disk_fault_line,
    is_network_filesystem,
    journal_mode,
    read_only_at,
    storage_fault,
)
from task_spec import BATCH_MAX, INSTRUCTIONS_MAX, TITLE_MAX  # noqa: F401 - the store's callers read them here too

if TYPE_CHECKING:   # the driver itself is store_sqlite's; here it only names types
    import sqlite3

    from file_watch import FolderWatch


@runtime_checkable
class Row(Protocol):
    """A row as both databases give it (sqlite3.Row, store_pg.PgRow): ``row["col"]``, ``row[0]``,
    ``row.keys()``, ``dict(row)``; iterating gives the values."""

    def __getitem__(self, key: Any, /) -> Any: ...

    def keys(self) -> list[str]: ...

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


def row_dict(row: Row | dict[str, Any]) -> dict[str, Any]:
    """A row (or a dict already) as a new dict of its columns. ``dict(row)`` on a sqlite3.Row looks
    every column up by name: 23 µs for a task's 67 columns against 3 µs here, a tenth of a
    submit -> claim -> finish cycle, and a page of 50 rows paid it 50 times."""
    return dict(row) if isinstance(row, dict) else dict(zip(row.keys(), row, strict=True))


class Cursor(Protocol):
    """What the store reads of a statement's result: its rows (each a Row), and how many it changed."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


@runtime_checkable
class Connection(Protocol):
    """A kept connection as the store's SQL (written once for both databases) uses it: a
    sqlite3.Connection, or a store_pg.PgConnection, which takes the same statements with SQLite's
    placeholders (``?``, ``:name``) and gives rows that read like Row. Transactions are
    opened and ended by the backend modules (``_writing``), not through this interface; what only
    one database has (PgConnection's ``writing``, ``events``) is reached through ``_dialect``."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Iterable[Any], /) -> object: ...

    def close(self) -> None: ...

    @property
    def in_transaction(self) -> bool: ...


if TYPE_CHECKING:
    def _both_are_connections(sqlite: sqlite3.Connection, pg: PgConnection, row: sqlite3.Row,
                              pg_row: PgRow) -> tuple[list[Connection], list[Row]]:
        # mypy checks here that each database's connection and row satisfy the protocols above.
        return [sqlite, pg], [row, pg_row]

REPO_DIR = Path(__file__).resolve().parent

STATUSES = ("pending", "running", "waiting", "done", "failed", "cancelled")
TERMINAL = ("done", "failed", "cancelled")
PERMISSIONS = ("auto", "readonly", "no-shell", "no-network")

NOTE_MAX = 20_000
ANSWER_MAX = 50_000
RETRY_BACKOFF_SEC = (2, 30)  # first back-off, cap: short and bounded (DESIGN §4)
MODEL_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/\S+$")
PROVIDER_RE = re.compile(r"[A-Za-z0-9][\w.\-]{0,99}")   # a model id's part before the "/"
AGENT_NAME = re.compile(r"[A-Za-z0-9_][\w.\-]{0,63}")   # an OpenCode agent's name, as a task may give it
MAX_ID = 2**63 - 1  # SQLite's INTEGER range
TASK_ID_RE = re.compile(r"^\s*(?:t_)?0*([0-9]{1,30})\s*$", re.IGNORECASE)   # ASCII digits only


# --------------------------------------------------------------------------------------------
# Paths and knobs (read at call time).


def database_url() -> str | None:
    """``$TASK_DB_URL`` when it names a PostgreSQL database (``postgresql://`` or ``postgres://``),
    else None (the queue is SQLite)."""
    raw = os.environ.get("TASK_DB_URL")
    return raw.strip() if raw and raw.lstrip().startswith(PG_SCHEMES) else None


def backend() -> str:
    """``"postgresql"`` when ``TASK_DB_URL`` names PostgreSQL, else ``"sqlite"``."""
    return _dialect().name


@dataclasses.dataclass(frozen=True, eq=False)
class Dialect:
    """What the queue's SQL (written once, below) asks about the database it runs on. A statement
    that differs as a whole is kept in a dict keyed by the two dialects (``_COUNTS[dialect]``)."""
    name: str                # backend()'s answer: "sqlite" or "postgresql"
    locks_rows: bool         # no global writers' lock: a write transaction locks the rows it decides on
    #                          (FOR UPDATE / FOR SHARE) and advisory-locks keys and logs
    server_clock: bool       # "now" is the server's clock (store_now), not this machine's
    clock_sql: str           # "now" inside a statement: the bound :now, or the server's clock
    true_sql: str            # a condition that always holds
    contains_fn: str         # position of a substring in a string (0: absent)
    events_final: str        # the condition that keeps a read of events below any still to commit
    events_at_commit: bool   # events wait in the connection until its commit (PgConnection.commit)
    counts_table: bool       # tasks per status kept in task_counts by triggers (migration 9)
    index_hints: bool        # the planner needs INDEXED BY / a unary + on a few partial indexes
    logs_in_database: bool   # task logs are task_log_chunks rows, not files
    wal_checkpoints: bool    # checkpoint() copies the WAL back (the PostgreSQL server checkpoints by itself)


SQLITE = Dialect(name="sqlite", locks_rows=False, server_clock=False, clock_sql=":now", true_sql="1",
                 contains_fn="instr", events_final="1 = 1", events_at_commit=False, counts_table=True,
                 index_hints=True, logs_in_database=False, wal_checkpoints=True)
POSTGRESQL = Dialect(name="postgresql", locks_rows=True, server_clock=True,
                     clock_sql="extract(epoch FROM clock_timestamp())", true_sql="true", contains_fn="strpos",
                     events_final=PG_EVENTS_FINAL, events_at_commit=True, counts_table=False,
                     index_hints=False, logs_in_database=True, wal_checkpoints=False)


def _dialect(conn: Any = None) -> Dialect:
    """The dialect of ``conn`` (a connection from ``_kept`` or ``connect``), or without one of the
    configured queue: the one place the store's SQL tells its two databases apart."""
    if conn is None:
        return POSTGRESQL if database_url() else SQLITE
    return POSTGRESQL if type(conn) is PgConnection else SQLITE


def _as_sqlite(conn: Connection) -> sqlite3.Connection:
    """``conn`` as the type checker cannot tell it is where ``_dialect(conn)`` is SQLITE."""
    return cast("sqlite3.Connection", conn)


def _as_pg(conn: Connection) -> PgConnection:
    """``conn`` as the type checker cannot tell it is where ``_dialect(conn)`` is POSTGRESQL."""
    return cast(PgConnection, conn)


def _sqlite_setting(url: str | None = None) -> str | None:
    """The SQLite file as configured: a path in ``TASK_DB_URL`` (the same as ``TASK_DB_PATH``;
    ``url`` is its value when the caller read it already), else ``TASK_DB_PATH``. Raises
    ValidationError for a URL of another kind."""
    raw = (url if url is not None else os.environ.get("TASK_DB_URL") or "").strip()
    if raw and not raw.startswith(PG_SCHEMES):
        if knobs.is_keyword_dsn(raw):
            raise ValidationError("TASK_DB_URL is a libpq key=value string; give it as a URL instead: "
                                  "postgresql://user@host:5432/dbname (the password in ~/.pgpass)")
        if "://" in raw:
            raise ValidationError(f"TASK_DB_URL={redact_url(raw)!r} is neither a postgresql:// URL nor a "
                                  "file path; give postgresql://user:password@host:5432/dbname, a path to "
                                  "the SQLite file, or unset it")
        return raw
    return os.environ.get("TASK_DB_PATH")


def queue_exists() -> bool:
    """Whether the queue is there to read: the SQLite file exists, or (PostgreSQL) always — the
    server's database is the queue, migrated on first use; a wrong URL fails when it is used."""
    return database_url() is not None or db_path().exists()


QUEUE_LOST_STATE = "waiting for its queue file"   # a worker's heartbeat state while its queue file is away


def mark_queue_lost(state: dict[str, Any]) -> None:
    """Say in the heartbeat file beside the queue (``state`` as ``write_worker_heartbeat``'s, its
    state made QUEUE_LOST_STATE; nothing in the database, which went) that this worker lost its
    queue file and waits for it: a process started meanwhile opens nothing at that path
    (``queue_left_in_use``), where another file would be read with the old one's WAL and be
    corrupted. Written only where the queue's folder still is; never raises."""
    if database_url():
        return
    path = state_path("worker.json")
    if not path.parent.is_dir():
        return
    beat = dict(state) | {"state": QUEUE_LOST_STATE, "pid": os.getpid(), "host": host_name(), "ts": now()}
    with contextlib.suppress(OSError):
        write_private(path, json.dumps(beat))


def queue_left_in_use() -> str | None:
    """When a worker on this machine whose process is running lost this SQLite queue's file and
    waits for it (its heartbeat beside the queue says QUEUE_LOST_STATE: deleted, moved away or
    replaced while it ran), or the file is missing while such a worker's heartbeat says it uses
    it: the words for it ("worker pid 4242 lost it while it ran and waits for it ..."); else
    None, and always on PostgreSQL. Nothing should open a file at that path meanwhile: a new
    queue made there is not the one that worker waits for, and another file put there would be
    read with the old one's WAL."""
    if database_url():
        return None
    beat = read_worker_heartbeat()
    if not beat or beat.get("pid_running") is not True:
        return None
    if _lost_by_live_worker(beat):
        return (f"worker pid {beat.get('pid')} lost it while it ran (deleted, moved away or replaced) and waits for "
                f"it (said {beat['age_sec']:g} s ago)")
    if db_path().exists() or beat.get("state") == "stopped":
        return None
    return (f"it was deleted or moved away while worker pid {beat.get('pid')} used it (its heartbeat "
            f"{beat['age_sec']:g} s ago), which waits for it")


def queue_gone() -> bool:
    """Whether the SQLite queue file this process used is gone now (deleted or moved away: the
    store raises QueueGone and makes no new one there). False on PostgreSQL, and for a queue this
    process never opened."""
    if database_url():
        return False
    try:
        store_sqlite.refuse_gone(db_path())
    except QueueGone:
        return True
    return False


def database_label() -> str:
    """The queue database for display: the SQLite file's path, or the PostgreSQL URL without its
    password (never log a password)."""
    url = database_url()
    return redact_url(url) if url else str(db_path())


def db_path(url: str | None = None) -> Path:
    """The SQLite file: a path in ``$TASK_DB_URL``, else ``$TASK_DB_PATH``, else
    ``<repo>/tasks.db`` (``~`` expanded, symlinks resolved; a relative path is taken from the
    working directory). On PostgreSQL the worker's state files still sit beside this path.
    ``url``: TASK_DB_URL's value when the caller read it already."""
    return _resolved(_sqlite_setting(url) or str(REPO_DIR / "tasks.db"))


def _resolved(raw: str) -> Path:
    """``raw`` (a path from the environment) with ``~`` expanded and symlinks resolved, once per
    value and working directory: resolving walks every path component (a syscall each), and the
    store asks for its paths on every call."""
    key = (raw, None if os.path.isabs(raw) else os.getcwd())
    path = _RESOLVED.get(key)
    if path is None:
        path = _RESOLVED[key] = Path(raw).expanduser().resolve()
    return path


_RESOLVED: dict[tuple[str, str | None], Path] = {}


def log_dir() -> Path:
    """The folder of per-task logs: ``$TASK_LOG_DIR``; else ``<repo>/task_logs`` for the default
    database, or ``<db folder>/<db name>_logs`` beside a ``$TASK_DB_PATH`` (two queues never share
    log files)."""
    if os.environ.get("TASK_LOG_DIR"):
        return _resolved(os.environ["TASK_LOG_DIR"])
    if not _sqlite_setting():
        return REPO_DIR / "task_logs"
    path = db_path()
    return path.with_name(f"{path.stem}_logs")


LOG_FOLDER_MARK = ".taskbridge-queue"   # in a log folder: the resolved path of the queue file whose logs it holds


def default_log_dirs(path: Path) -> set[Path]:
    """The log folders only the SQLite queue file ``path`` uses by default (``log_dir`` without
    ``$TASK_LOG_DIR``): ``<db folder>/<db name>_logs``, and ``<repo>/task_logs`` for the default file."""
    folders = {path.with_name(f"{path.stem}_logs")}
    if path == _resolved(str(REPO_DIR / "tasks.db")):
        folders.add(REPO_DIR / "task_logs")
    return folders


def log_folder_queue(folder: Path | None = None) -> Path | None:
    """The queue file whose logs the log folder ``folder`` (default ``log_dir()``) holds, as its
    mark says (``LOG_FOLDER_MARK``), or None when it names none (no folder, no mark: a folder
    made before marks were written, or unreadable)."""
    try:
        said = ((folder or log_dir()) / LOG_FOLDER_MARK).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Path(said) if said else None


def mark_log_folder(folder: Path | None = None) -> None:
    """Write in the log folder (``log_dir()`` by default; only when it exists: no folder is made
    here) that it holds the logs of the configured SQLite queue file, unless it says so already.
    Never raises: a folder that cannot be written is reported where a log is written."""
    folder = folder or log_dir()
    path = db_path()
    with contextlib.suppress(OSError):   # is_dir raises for a name too long, say
        if database_url() or not folder.is_dir() or log_folder_queue(folder) == path:
            return
        write_private(folder / LOG_FOLDER_MARK, f"{path}\n")


def _log_folder_verdict(path: Path, new: bool) -> bool:
    """Whether the log folder's task logs (``t_*.log``) are to be moved aside for the SQLite queue
    ``path`` (the configured one): True only for a new queue whose folder is its own (its mark
    names this same path, a queue replaced at it; or names a queue file that is gone; or, with no
    mark, it is this path's default folder or holds no task log). Raises LogFolderTaken when the
    folder holds another queue's logs: its mark names another queue file that exists, or (a new
    queue) it has no mark, is not this path's default folder and holds task logs, whose queue
    cannot be told. Nothing is moved or written here."""
    folder = log_dir()
    owner = log_folder_queue(folder)
    if owner is not None and owner != path and owner.exists():
        raise LogFolderTaken(
            f"{_log_folder_words()} {folder} holds the logs of the queue {owner}, not of {path}; give this "
            f"queue a log folder of its own ({_log_folder_way_out()}); nothing was moved or made")
    if not new:
        return False
    if owner is not None or folder in default_log_dirs(path):
        return True
    if next(folder.glob("t_*.log"), None) is None:
        return False
    raise LogFolderTaken(
        f"{_log_folder_words()} {folder} holds task logs (t_NNNN.log) of a queue it does not name (written "
        f"before log folders named their queue), maybe not of {path}; give this new queue a log folder of its own "
        f"({_log_folder_way_out()}), or, if that queue is gone for good, move its t_*.log files out of the folder; "
        "nothing was moved or made")


def _log_folder_words() -> str:
    return "TASK_LOG_DIR" if os.environ.get("TASK_LOG_DIR") else "the log folder"


def _log_folder_way_out() -> str:
    return "set TASK_LOG_DIR to another folder, or unset it" if os.environ.get("TASK_LOG_DIR") else \
        "set TASK_LOG_DIR to another folder"


def log_path(task_id: int | str) -> Path:
    """The log file of one task: ``<TASK_LOG_DIR>/t_0001.log``."""
    return log_dir() / f"{format_task_id(parse_task_id(task_id))}.log"


def open_task_log(task_id: int | str) -> BinaryIO:
    """One task's log file opened for appending (binary). A new log folder is 0700 and a new log
    0600: logs hold instructions, diffs and tool output, for this user only. A log folder made
    here is marked as the configured queue's (``mark_log_folder``)."""
    return _append_task_log_file(log_path(task_id))


def _append_task_log_file(path: Path) -> BinaryIO:
    """``append_private(path)`` for a task log; its folder, when made here, marked as the
    configured queue's (``mark_log_folder``)."""
    if path.parent.is_dir():
        return append_private(path)
    handle = append_private(path)
    mark_log_folder(path.parent)
    return handle


def append_private(path: Path) -> BinaryIO:
    """``path`` opened for appending (binary), created 0600 when missing, its folder made 0700
    when missing: every log TaskBridge appends to (task logs, the worker log, a detached pass's
    output) is for this user only. Raises OSError."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically as a 0600 file, never readable by others even for a
    moment: every file TaskBridge writes beside the database (and its token) goes through here.
    The folder must exist (no folder is made: a mistyped path must not grow one). The temporary
    file is made anew, never opened through a link (the box's data folder, where its preparation
    stamp goes, is writable to runs). Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()   # a killed process's with this pid and thread, or a link planted there
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                       "wb" if isinstance(data, bytes) else "w") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def state_path(name: str) -> Path:
    """A worker state file (lock, heartbeat) kept beside the database, so each queue has its own;
    on PostgreSQL beside the SQLite path, named after the queue (``pg-<queue_tag>.<name>``)."""
    path = db_path()
    if database_url():
        return path.with_name(f"pg-{queue_tag()}.{name}")
    return path.with_name(f"{path.stem}.{name}")


def queue_tag() -> str:
    """A short hash of the database path (on PostgreSQL of its URL without the password): names
    this queue in run markers' environment tags."""
    try:  # CPython's own SHA-1: hashlib would load OpenSSL (~3.5 MB of every process's memory)
        from _sha1 import sha1
    except ImportError:
        from hashlib import sha1
    return sha1(database_label().encode()).hexdigest()[:10]


def _marks(values: Sized) -> str:
    """``"?,?,?"``: one placeholder per value, for ``IN (...)``; the values themselves go as parameters."""
    return ",".join("?" * len(values))


def format_task_id(num: int) -> str:
    """``1`` -> ``"t_0001"``."""
    return f"t_{num:04d}"


def parse_task_id(value: Any) -> int:
    """Accept ``t_0001``, ``0001``, ``1`` or an int; return the integer id.

    Raises ValidationError for anything else (the message shows the accepted shapes).
    """
    shown = value
    if isinstance(value, bool):
        raise ValidationError(f"task id {value!r} is not valid; use t_0001, 0001 or 1")
    if isinstance(value, str):
        match = TASK_ID_RE.match(value)
        value = int(match.group(1)) if match else None
    if isinstance(value, int) and 0 < value <= MAX_ID:
        return value
    if isinstance(value, int) and value > MAX_ID:
        raise ValidationError(f"task id {value} is too large (ids go up to {MAX_ID}); use t_0001, 0001 or 1")
    raise ValidationError(f"task id {shown!r} is not valid; use t_0001, 0001 or 1")


def now() -> float:
    """Unix time in seconds (float), by this process's clock: for what this process shows or
    keeps for itself. What the queue stamps and compares (leases, heartbeats, back-off) is
    ``store_now``'s."""
    return time.time()


def store_now(conn: Any) -> float:
    """What "now" is for the queue on ``conn``, in Unix seconds: the database server's clock on
    PostgreSQL (``clock_timestamp()``: hosts whose clocks disagree still stamp and compare leases
    on one clock, so a host running ahead never reaps another's live attempt), this machine's
    on SQLite (the file has no clock of its own and every process using it runs here)."""
    dialect = _dialect(conn)
    if dialect.server_clock:
        return float(conn.execute(f"SELECT {dialect.clock_sql}").fetchone()[0])
    return now()


ERROR_MAX = 4_000  # characters of a stored error; a longer one is kept whole in the task's log (fail_attempt)
SUMMARY_MAX = 8_000  # characters of a receipt's summary: an agent's is clipped to it, a person's refused past it
EVENT_TEXT_MAX = 500  # characters of a task's text (a summary, an error) an event's message carries


def clip(text: str, limit: int, where: str) -> str:
    """``text`` unchanged when it has at most ``limit`` characters; else its head and its tail
    around a note giving the full length and ``where`` the whole text is (e.g. the task's log),
    so the result has about ``limit`` characters plus the note."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit - limit * 2 // 3
    return (text[:head] + f"\n… [clipped: {len(text):,} characters in all; the whole text is in {where}] …\n"
            + text[len(text) - tail:])


def event_text(text: str, whole_in: str, limit: int = EVENT_TEXT_MAX) -> str:
    """``text`` for an event's message: whole up to ``limit`` characters, else its head marked
    as cut, saying how long it is and where it is whole (``whole_in``), in ``limit`` at most."""
    if len(text) <= limit:
        return text
    note = f"… [{len(text):,} characters; the whole text is in {whole_in}]"
    return text[:max(limit - len(note), 0)] + note


def iso(ts: float | None) -> str | None:
    """Unix seconds -> ISO 8601 UTC with seconds precision, or None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# Schema and migrations: an ordered list, never edited once shipped.

SCHEMA_V1 = """
CREATE TABLE tasks (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    title           TEXT    NOT NULL,
    instructions    TEXT    NOT NULL,
    working_dir     TEXT    NOT NULL,
    model           TEXT,
    agent           TEXT,
    priority        INTEGER NOT NULL DEFAULT 0,
    status          TEXT    NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending','running','waiting','done','failed','cancelled')),
    permission      TEXT    NOT NULL DEFAULT 'auto',
    worktree        INTEGER NOT NULL DEFAULT 1,
    worktree_keep   INTEGER NOT NULL DEFAULT 0,
    timeout_sec     INTEGER NOT NULL DEFAULT 1800,
    max_retries     INTEGER NOT NULL DEFAULT 1,
    attempts        INTEGER NOT NULL DEFAULT 0,
    handbacks       INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT    UNIQUE,
    origin_name     TEXT,
    origin_version  TEXT,
    origin_kind     TEXT,
    created_at      REAL    NOT NULL,
    claimed_at      REAL,
    started_at      REAL,
    finished_at     REAL,
    heartbeat_at    REAL,
    not_before      REAL,
    lease_owner     TEXT,
    lease_pid       INTEGER,
    lease_pid_start REAL,
    run_marker      TEXT,
    agent_pid       INTEGER,
    agent_pid_start REAL,
    session_id      TEXT,
    question        TEXT,
    answer          TEXT,
    result          TEXT,
    diff            TEXT,
    usage           TEXT,
    error           TEXT,
    branch          TEXT,
    worktree_path   TEXT,
    base_commit     TEXT
);
CREATE INDEX tasks_claim ON tasks (status, priority DESC, created_at, id);
CREATE TABLE task_deps (
    task_id    INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    depends_on INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    PRIMARY KEY (task_id, depends_on)
);
CREATE INDEX task_deps_reverse ON task_deps (depends_on);
CREATE TABLE notes (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id    INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    author     TEXT    NOT NULL,
    text       TEXT    NOT NULL,
    created_at REAL    NOT NULL,
    delivered_marker TEXT
);
CREATE TABLE questions (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id     INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL,
    question    TEXT    NOT NULL,
    answer      TEXT,
    asked_at    REAL    NOT NULL,
    answered_at REAL
);
CREATE TABLE events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id INTEGER,
    ts      REAL    NOT NULL,
    kind    TEXT    NOT NULL,
    message TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX events_task ON events (task_id, id);
CREATE TABLE settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE claude_jobs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt      TEXT    NOT NULL,
    system      TEXT,
    model       TEXT,
    backend     TEXT    NOT NULL,
    status      TEXT    NOT NULL DEFAULT 'queued'
                CHECK (status IN ('queued','running','done','failed','cancelled')),
    timeout_sec INTEGER NOT NULL,
    answer      TEXT,
    error       TEXT,
    usage       TEXT,
    owner       TEXT,
    pid         INTEGER,
    pid_start   REAL,
    created_at  REAL    NOT NULL,
    started_at  REAL,
    finished_at REAL
);
"""


def _run_script(conn: Connection, script: str) -> None:
    # executescript() would commit the migration's transaction; run statement by statement.
    for statement in script.split(";"):
        if statement.strip():
            conn.execute(statement)


def _migrate_v1(conn: Connection) -> None:
    _run_script(conn, SCHEMA_V1)
    if not _dialect(conn).logs_in_database:
        _set_aside_earlier_logs(conn)


def _set_aside_earlier_logs(conn: Connection) -> None:
    """A new SQLite queue numbers its tasks from t_0001 again: log files an earlier queue at this
    path left in its log folder (the file moved aside, as ``doctor`` advises for a broken one, or
    deleted) are moved into ``<log folder>/earlier-<UTC time>/``, so a new task's log never starts
    with an old task's run of the same id. Only for the configured queue (a ``connect(path)`` to
    another file has no log folder of its own), and only when the folder is its own
    (``_log_folder_verdict``): another live queue's logs in a shared TASK_LOG_DIR are never moved
    (LogFolderTaken instead)."""
    row = conn.execute("PRAGMA database_list").fetchone()
    if not row or not row[2] or Path(row[2]).resolve() != db_path():
        return
    if not _log_folder_verdict(db_path(), new=True):
        return
    folder = log_dir()
    old = sorted(folder.glob("t_*.log")) if folder.is_dir() else []
    if old:
        aside = folder / f"earlier-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
        aside.mkdir(mode=0o700, exist_ok=True)
        for log in old:
            log.rename(aside / log.name)


# The order list_tasks shows: running, waiting, pending, then finished; higher priority first;
# newest first. An expression index serves it, so a page costs the rows it returns.
LIST_RANK = ("(CASE status WHEN 'running' THEN 0 WHEN 'waiting' THEN 1 WHEN 'pending' THEN 2"
             " ELSE 3 END)")

SCHEMA_V2 = [
    "CREATE INDEX notes_task ON notes (task_id, id)",
    "CREATE INDEX questions_task ON questions (task_id, id)",
    f"CREATE INDEX tasks_list ON tasks ({LIST_RANK}, priority DESC, id DESC)",
    "CREATE INDEX claude_jobs_status ON claude_jobs (status, id)",
    "CREATE INDEX tasks_pending_age ON tasks (created_at, id) WHERE status = 'pending'",
    # Tasks per status, kept by triggers in the same transaction as the change: counts cost one
    # small read instead of a scan of the status index.
    "CREATE TABLE task_counts (status TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID",
    "INSERT INTO task_counts (status, n) SELECT column1, (SELECT count(*) FROM tasks WHERE status = column1)"
    " FROM (VALUES ('pending'), ('running'), ('waiting'), ('done'), ('failed'), ('cancelled'))",
    "CREATE TRIGGER task_counts_insert AFTER INSERT ON tasks BEGIN"
    " UPDATE task_counts SET n = n + 1 WHERE status = NEW.status; END",
    "CREATE TRIGGER task_counts_delete AFTER DELETE ON tasks BEGIN"
    " UPDATE task_counts SET n = n - 1 WHERE status = OLD.status; END",
    "CREATE TRIGGER task_counts_update AFTER UPDATE OF status ON tasks WHEN OLD.status != NEW.status BEGIN"
    " UPDATE task_counts SET n = n - 1 WHERE status = OLD.status;"
    " UPDATE task_counts SET n = n + 1 WHERE status = NEW.status; END",
]


def _migrate_v2(conn: Connection) -> None:
    """Indexes for every lookup (notes and questions by task, the list order, jobs by status) and
    the per-status counts table."""
    for statement in SCHEMA_V2:
        conn.execute(statement)


# retry_task gives a failed task a fresh budget without reusing attempt numbers (run markers
# and fencing need them unique): the attempts counted before the retry are set aside here.
SCHEMA_V3 = ["ALTER TABLE tasks ADD COLUMN spent_before_retry INTEGER NOT NULL DEFAULT 0"]


def _migrate_v3_retry_budget(conn: Connection) -> None:
    for statement in SCHEMA_V3:
        conn.execute(statement)


SCHEMA_V4 = [
    # Per-task spending limits (USD, or tokens where a model reports no price).
    "ALTER TABLE tasks ADD COLUMN max_cost_usd REAL",
    "ALTER TABLE tasks ADD COLUMN max_tokens INTEGER",
    # The running attempt's spend as it streams (the worker adds each step's figures).
    "ALTER TABLE tasks ADD COLUMN run_cost_usd REAL NOT NULL DEFAULT 0",
    "ALTER TABLE tasks ADD COLUMN run_tokens INTEGER NOT NULL DEFAULT 0",
    # Why a waiting task waits when no agent asked: 'task_limit' or 'daily_budget'.
    "ALTER TABLE tasks ADD COLUMN paused_for TEXT",
    # Spend per local calendar day (YYYY-MM-DD): the daily budget's meter.
    "CREATE TABLE daily_spend (day TEXT PRIMARY KEY, cost_usd REAL NOT NULL DEFAULT 0,"
    " tokens INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID",
]


def _migrate_v4_spending_limits(conn: Connection) -> None:
    """Spending limits (issue 14): per-task limits, the live spend of a running attempt, why a
    task is paused, and the spend per local day."""
    for statement in SCHEMA_V4:
        conn.execute(statement)


SCHEMA_V5 = [
    # Follow-ups and forks (issue 15): the task a follow-up continues (same session, same branch)
    # or a fork branches from (a copy of its session, a branch of its own), and the commit the
    # whole line of work started from (the receipt's whole-line diff).
    "ALTER TABLE tasks ADD COLUMN continue_from INTEGER REFERENCES tasks(id) ON DELETE SET NULL",
    "ALTER TABLE tasks ADD COLUMN fork_from INTEGER REFERENCES tasks(id) ON DELETE SET NULL",
    "ALTER TABLE tasks ADD COLUMN line_base TEXT",
    "CREATE INDEX tasks_continue_from ON tasks (continue_from) WHERE continue_from IS NOT NULL",
    # OpenCode skills the agent is told to load and sub-agents it may start (JSON lists, checked
    # at submit), the task's own permission rules (JSON, OpenCode's rule format) and the
    # permission request a task waits on (JSON: tool, pattern, reason).
    "ALTER TABLE tasks ADD COLUMN skills TEXT",
    "ALTER TABLE tasks ADD COLUMN subagents TEXT",
    "ALTER TABLE tasks ADD COLUMN rules TEXT",
    "ALTER TABLE tasks ADD COLUMN pending_ask TEXT",
    # Steering: when a note reached the agent, and how (in the running session, or a prompt).
    "ALTER TABLE notes ADD COLUMN delivered_at REAL",
    "ALTER TABLE notes ADD COLUMN delivered_how TEXT",
]


def _migrate_v5_lines_of_work(conn: Connection) -> None:
    for statement in SCHEMA_V5:
        conn.execute(statement)


SCHEMA_V6 = [
    # Tasks that name a repository instead of a folder (issue 13): the git remote a worker mirrors
    # and the ref the task starts from; for such a task working_dir is ''.
    "ALTER TABLE tasks ADD COLUMN repo_url TEXT",
    "ALTER TABLE tasks ADD COLUMN base_ref TEXT",
    # The host (TASKBRIDGE_HOST) whose workers may claim the task: NULL for any host (a task that
    # names a remote), the submitting machine for a local working_dir, or what the task asked for.
    "ALTER TABLE tasks ADD COLUMN host TEXT",
    # The host of the worker holding the lease: the reaper checks pids only on its own host.
    "ALTER TABLE tasks ADD COLUMN lease_host TEXT",
    # Where a remote task's branch went: the branch name and commit pushed back to repo_url.
    "ALTER TABLE tasks ADD COLUMN pushed_branch TEXT",
    "ALTER TABLE tasks ADD COLUMN pushed_commit TEXT",
    # A task's log in the database (PostgreSQL), appended by its worker in chunks (seq from 1), so
    # a reader on another machine needs no shared disk. On SQLite the log stays a file.
    "CREATE TABLE task_log_chunks (task_id INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,"
    " seq INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (task_id, seq))",
    # Workers on every host: their heartbeat and state (the JSON of write_worker_heartbeat).
    "CREATE TABLE workers (name TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER, pid_start REAL,"
    " started_at REAL NOT NULL, heartbeat_at REAL NOT NULL, state TEXT)",
]


def _migrate_v6_past_one_machine(conn: Connection) -> None:
    """Past one machine (issue 13): remote-repository tasks, host affinity, pushed branches, logs
    in the database and the workers table."""
    for statement in SCHEMA_V6:
        conn.execute(statement)


SCHEMA_V7 = [
    # The planner's seat (issue 22): when the planner read a finished task's result (NULL: not
    # yet seen). Tasks that had finished before this migration count as seen: only what ends from
    # now on is announced. retry_task clears it (the task will end again).
    "ALTER TABLE tasks ADD COLUMN result_seen_at REAL",
    "UPDATE tasks SET result_seen_at = finished_at WHERE status IN ('done', 'failed', 'cancelled')",
    "CREATE INDEX tasks_unseen ON tasks (finished_at, id) WHERE result_seen_at IS NULL"
    " AND status IN ('done', 'failed', 'cancelled')",
    # The submitter's wish that the task's permission asks go to the person (through the MCP
    # client's elicitation form) rather than to the planner model.
    "ALTER TABLE tasks ADD COLUMN ask_human INTEGER NOT NULL DEFAULT 0",
]


def _migrate_v7_results_seen(conn: Connection) -> None:
    for statement in SCHEMA_V7:
        conn.execute(statement)


SCHEMA_V8 = [
    # A provider's usage limit (issue 23): a task paused at one (paused_for 'usage_limit') resumes
    # by itself at resume_at; while it waits, pending tasks on the same provider account
    # (limit_account, the model's provider id) are not claimed. limit_rounds counts its pauses in a
    # row whose reset the provider did not give (the back-off grows with it); limit_pauses is the
    # receipt's record of every pause (JSON list).
    "ALTER TABLE tasks ADD COLUMN resume_at REAL",
    "ALTER TABLE tasks ADD COLUMN limit_account TEXT",
    "ALTER TABLE tasks ADD COLUMN limit_rounds INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE tasks ADD COLUMN limit_pauses TEXT",
    # A schedule timeout (seconds): a task queued longer than this without being started is
    # flagged (start_overdue), so a queue that silently stopped is noticed.
    "ALTER TABLE tasks ADD COLUMN schedule_timeout_sec INTEGER",
    "CREATE INDEX tasks_limit_holds ON tasks (limit_account, resume_at) WHERE paused_for = 'usage_limit'",
]


def _migrate_v8_usage_limits(conn: Connection) -> None:
    """Usage-limit pauses (issue 23): the resume time, the held account and the pauses' record."""
    for statement in SCHEMA_V8:
        conn.execute(statement)


_UNSEEN = "{row}.result_seen_at IS NULL AND {row}.status IN ('done', 'failed', 'cancelled')"
SCHEMA_V9 = [
    # Fewer pages per write (issue 25). AUTOINCREMENT rewrote sqlite_sequence's page in every
    # transaction that added an event; events are never deleted, so a plain rowid (the largest
    # plus one) rises just as surely and a cursor still never skips or repeats one.
    "CREATE TABLE events_v9 (id INTEGER PRIMARY KEY, task_id INTEGER, ts REAL NOT NULL, kind TEXT NOT NULL,"
    " message TEXT NOT NULL DEFAULT '')",
    "INSERT INTO events_v9 (id, task_id, ts, kind, message) SELECT id, task_id, ts, kind, message FROM events",
    "DROP TABLE events",
    "ALTER TABLE events_v9 RENAME TO events",
    "CREATE INDEX events_task ON events (task_id, id)",
    # The oldest pending task is found through the claim index (one probe per priority pending
    # tasks have, see _OLDEST_PENDING): its own index cost two pages a cycle (submit, claim).
    "DROP INDEX tasks_pending_age",
    # Pending tasks that have a schedule timeout (queue_status's overdue check read every pending
    # task through the claim index); a task without one is not in it and costs it no page.
    "CREATE INDEX tasks_schedule ON tasks (created_at, id)"
    " WHERE status = 'pending' AND schedule_timeout_sec IS NOT NULL",
    # Unread results counted beside the statuses, in the counts row's page a finish writes anyway:
    # queue_status counted them through their index (100,000 unread: 4x the time of 1,000).
    f"INSERT INTO task_counts (status, n) SELECT 'unseen', count(*) FROM tasks t WHERE {_UNSEEN.format(row='t')}",
    f"CREATE TRIGGER task_unseen_insert AFTER INSERT ON tasks WHEN {_UNSEEN.format(row='NEW')} BEGIN"
    " UPDATE task_counts SET n = n + 1 WHERE status = 'unseen'; END",
    f"CREATE TRIGGER task_unseen_delete AFTER DELETE ON tasks WHEN {_UNSEEN.format(row='OLD')} BEGIN"
    " UPDATE task_counts SET n = n - 1 WHERE status = 'unseen'; END",
    f"CREATE TRIGGER task_unseen_update AFTER UPDATE OF status, result_seen_at ON tasks"
    f" WHEN ({_UNSEEN.format(row='OLD')}) != ({_UNSEEN.format(row='NEW')}) BEGIN"
    f" UPDATE task_counts SET n = n + (CASE WHEN {_UNSEEN.format(row='NEW')} THEN 1 ELSE -1 END)"
    " WHERE status = 'unseen'; END",
]


def _migrate_v9_fewer_pages(conn: Connection) -> None:
    """Events without AUTOINCREMENT and the unread results' count kept (SQLite only: PostgreSQL's
    identity column writes no extra page, and it counts with a query)."""
    for statement in SCHEMA_V9:
        conn.execute(statement)


SCHEMA_V10 = [
    # The rules a submission gave, as it gave them: an ``always`` answer rewrites ``rules`` (a
    # pattern for exactly the request it allowed, after the task's own), and a repeated
    # idempotency key is compared with what was submitted, not with what the answers made of it.
    # A queue of before keeps its rules as they are now (answers already in them).
    "ALTER TABLE tasks ADD COLUMN rules_given TEXT",
    "UPDATE tasks SET rules_given = rules WHERE rules IS NOT NULL",
]


def _migrate_v10_rules_given(conn: Connection) -> None:
    for statement in SCHEMA_V10:
        conn.execute(statement)


SCHEMA_V11 = [
    # The run marker of a cancelled attempt whose worker is still wrapping it up (its receipt, a
    # readonly run's revert, its worktree's removal); NULL otherwise. A task retried meanwhile is
    # not claimed until that worker ends the wrap-up (end_wrap_up) or the reaper finds it gone:
    # a second attempt would work in the same worktree or folder beside it.
    "ALTER TABLE tasks ADD COLUMN wrapping_up TEXT",
    # The reaper reads them at every pass (wrap_ups): a few rows at most, never the whole table.
    "CREATE INDEX tasks_wrapping_up ON tasks (id) WHERE wrapping_up IS NOT NULL",
]


def _migrate_v11_wrapping_up(conn: Connection) -> None:
    for statement in SCHEMA_V11:
        conn.execute(statement)


SCHEMA_V12 = [
    # The receipts of a task's earlier attempts that a retry started afresh from (their diff was
    # the only copy of the work: the worktree went), kept when the next attempt's receipt takes
    # ``result`` and ``diff``: a JSON list, oldest first, the last EARLIER_KEPT (earlier_receipts).
    "ALTER TABLE tasks ADD COLUMN earlier_receipts TEXT",
]


def _migrate_v12_earlier_receipts(conn: Connection) -> None:
    for statement in SCHEMA_V12:
        conn.execute(statement)


MIGRATIONS: list[Callable[[Connection], None]] = [
              _migrate_v1, _migrate_v2, _migrate_v3_retry_budget, _migrate_v4_spending_limits,
              _migrate_v5_lines_of_work, _migrate_v6_past_one_machine, _migrate_v7_results_seen,
              _migrate_v8_usage_limits, _migrate_v9_fewer_pages, _migrate_v10_rules_given,
              _migrate_v11_wrapping_up, _migrate_v12_earlier_receipts]


# PostgreSQL runs the same numbered migrations (its version in the table schema_version). Its
# statements are SQLite's with the column types PostgreSQL names differently (``_pg_ddl``), except
# where a step differs: no task_counts table and triggers (counts are a GROUP BY; a trigger-kept
# row per status would serialise every claim and can deadlock), no WITHOUT ROWID.
PG_SCHEMA_V2 = [statement for statement in SCHEMA_V2 if "task_counts" not in statement]


def _pg_ddl(statement: str) -> str:
    """One SQLite schema statement in PostgreSQL's types: identity ids, bigint, double
    precision, bytea; no WITHOUT ROWID."""
    statement = statement.replace("INTEGER PRIMARY KEY AUTOINCREMENT",
                                  "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
    statement = re.sub(r"\bINTEGER\b", "BIGINT", statement)
    statement = re.sub(r"\bREAL\b", "DOUBLE PRECISION", statement)
    statement = re.sub(r"\bBLOB\b", "BYTEA", statement)
    return statement.replace(" WITHOUT ROWID", "")


def pg_migrations() -> list[list[str]]:
    """The statements of each migration on PostgreSQL, in MIGRATIONS' order (built at call time,
    so a statement added to a SCHEMA_V* list is on both backends)."""
    steps = [[s for s in SCHEMA_V1.split(";") if s.strip()], PG_SCHEMA_V2, SCHEMA_V3, SCHEMA_V4,
             SCHEMA_V5, SCHEMA_V6, SCHEMA_V7, SCHEMA_V8, [],   # v9 is SQLite's alone
             SCHEMA_V10, SCHEMA_V11, SCHEMA_V12]
    return [[_pg_ddl(s) for s in step] for step in steps]


def connect(path: Path | str | None = None) -> Connection:
    """Open a new connection (creating its folder): the journal (WAL; see ``journal_mode``), busy
    timeout, foreign keys; migrated. Without ``path`` while ``TASK_DB_URL`` names PostgreSQL: a
    new migrated PgConnection to it (raises DatabaseUnavailable).

    The connection is in autocommit mode (``isolation_level=None``): transactions are explicit.
    The caller closes it (the store's own functions use ``_kept()`` instead). Raises
    DatabaseUnusable / DatabaseCorrupt / DatabaseBusy / StorageFault if the file cannot be opened
    or migrated (see ``store_sqlite.fault``), ValidationError when the folder is on a filesystem where
    WAL is unsafe (see ``journal_mode``).
    """
    url = None if path else database_url()
    if url:
        return store_pg.connect(url, pg_migrations())
    target = Path(path) if path else db_path()
    if target != db_path():
        return store_sqlite.connect(target, MIGRATIONS)
    _refuse_while_lost(target)
    # A file this process lost (gone, or replaced in use) is said as such before anything else: a
    # queue made meanwhile may have taken the log folder, and the worker waiting for its own must
    # hear that its file is gone or replaced, not that the folder is another queue's.
    store_sqlite.refuse_gone(target)
    store_sqlite.refuse_stale_wal(target)
    try:   # before the file is made: a new queue never takes another queue's log folder
        new = not target.exists() or target.stat().st_size == 0
    except OSError:
        new = False   # store_sqlite.connect says what is wrong with it
    with contextlib.suppress(OSError):   # a log folder that cannot be read is said where a log is written
        _log_folder_verdict(target, new)
    conn = store_sqlite.connect(target, MIGRATIONS)
    mark_log_folder()   # an existing queue's folder made before marks were written is marked on first use
    return conn


stale_files_words = store_sqlite.stale_files_words


def _lost_by_live_worker(beat: dict[str, Any]) -> bool:
    """Whether the heartbeat ``beat`` (``read_worker_heartbeat``'s) is a lost queue's mark
    (``mark_queue_lost``) whose worker still lives: its pid running and, when the mark gives its
    start time, still that process (a pid reused by another program is not)."""
    if beat.get("state") != QUEUE_LOST_STATE or beat.get("pid_running") is not True:
        return False
    if beat.get("pid_start") is None:
        return True
    import process_tree  # here: only a lost queue's mark needs it (psutil)
    return process_tree.same_process(beat.get("pid"), beat["pid_start"]) is not None


def _refuse_while_lost(path: Path) -> None:
    """Raise QueueGone when another live worker's heartbeat beside ``path`` says it lost that
    queue file and waits for it (``mark_queue_lost``): what is at the path now (a new file, or
    another queue's, read with the old one's WAL beside it) is not to be opened or made."""
    beat = read_worker_heartbeat()
    if not beat or beat.get("pid") == os.getpid() or not _lost_by_live_worker(beat):
        return
    way_out = ("put its file back there (with its -wal and -shm if they went with it) and that worker carries on; to "
               "use a new or another file there, stop that worker first (and move the old file's -wal and -shm, if "
               "they are beside the path, next to the old file: another file opened with them is corrupted)")
    raise QueueGone(f"the task database {path} is in no state to open: worker pid {beat.get('pid')} lost it while it "
                    f"ran (deleted, moved away or replaced) and waits for it; nothing was opened or made: {way_out}",
                    "the queue file is away from a worker that waits for it", way_out)


def write_problem(path: Path | str | None = None) -> tuple[str, str] | None:
    """What stops this user writing the queue, found without writing anything: ``(what cannot be
    written, the way out)`` (``store_sqlite.write_problem``: a read-only filesystem, the SQLite
    file or a file SQLite keeps beside it not writable, or its folder), or None. SQLite opens a
    file it can only read read-only without a word, so a writer (a worker pass) asks here before
    it writes anything beside the queue. Always None on PostgreSQL (the server says at the first
    write)."""
    if not path and database_url():
        return None
    return store_sqlite.write_problem(Path(path) if path else db_path())


def require_writable() -> None:
    """Raise DatabaseUnusable (ReadOnlyStorage on a filesystem mounted read-only) naming what of
    the queue this user cannot write and the way out (``write_problem``); nothing is written."""
    problem = write_problem()
    if problem is None:
        return
    said, way_out = problem
    if store_sqlite.read_only_at(db_path().parent):
        raise ReadOnlyStorage(f"{said}; {way_out}")
    raise DatabaseUnusable(f"the task database {db_path()} cannot be written: {said}; {way_out}", said, way_out)


def database_health(path: Path | str | None = None) -> dict[str, Any]:
    """What `tasks_cli.py doctor` reports about the queue database: ``{"backend", "path",
    "integrity" ("ok" or SQLite's first complaint), "journal_mode", "filesystem" (type, mount
    point) | None, "tasks"}``; on PostgreSQL ``path`` is the URL without its password,
    ``integrity`` "ok" once a query answers, ``journal_mode`` and ``filesystem`` None, plus
    ``server_version``. Opens (and migrates) it like every entry point: raises DatabaseUnusable
    (DatabaseCorrupt, ...; see ``store_sqlite.fault``) when the file cannot be used as a database,
    ValidationError on a filesystem where WAL is unsafe, DatabaseUnavailable when PostgreSQL
    cannot be used."""
    url = None if path else database_url()
    if url:
        return store_pg.health(url, pg_migrations())
    return store_sqlite.health(Path(path) if path else db_path(), MIGRATIONS)


# Kept connections. Opening a connection per call cost ~1 ms (pragmas, schema check) and the last
# close checkpointed and deleted the WAL every time; a kept one costs a dict lookup and a stat.
# One connection per (thread, database file), owned by this process: a thread never shares its
# connection (the worker's slot threads and the MCP server's threads each write in their own
# transactions), and a process never uses one it inherited through fork (SQLite forbids carrying
# a connection across fork; the child opens its own). The WAL is checkpointed by SQLite's own
# autocheckpoint (every 10,000 pages, ~40 MB: fewer fsyncs per write) and by ``checkpoint()``, which the
# worker calls each minute.
_KEPT: dict[tuple[int, str], tuple[Connection, tuple[int, int] | None]] = {}
_KEPT_LOCK = threading.Lock()
_KEPT_PID = [os.getpid()]
_INHERITED: list[Connection] = []   # held, never used or closed: they belong to the parent
KEPT_MAX = 32  # connections one process keeps (threads x databases); the oldest are closed past it


def _kept() -> Connection:
    """This thread's connection to ``db_path()``, opened through ``connect()`` on first use and
    again when the process forked, the file was replaced, or the last use broke it (on
    PostgreSQL: to ``TASK_DB_URL``, see ``_kept_pg``). A file removed (deleted, moved away) is
    not made again: QueueGone (``store_sqlite.refuse_gone``) until it is put back; one replaced
    while the old file's WAL is still beside it is not opened with it: QueueReplaced
    (``store_sqlite.refuse_stale_wal``)."""
    if _KEPT_PID[0] != os.getpid():
        _forget_inherited()
    # One read of TASK_DB_URL per call (an unset variable costs ~0.6 µs to look up).
    url = os.environ.get("TASK_DB_URL")
    if url and url.lstrip().startswith(PG_SCHEMES):
        return _kept_pg(url.strip())
    path = db_path(url or "")
    key = (threading.get_ident(), str(path))
    entry = _KEPT.get(key)
    if entry is not None and entry[1] is not None and entry[1] == store_sqlite.file_id(path):
        return entry[0]
    if entry is not None:
        _discard(key)
    with store_sqlite.mapped(path):   # connect maps its errors; this also holds for a test's double of it
        conn = connect(path)
    with _KEPT_LOCK:
        _KEPT[key] = (conn, store_sqlite.file_id(path))
        if len(_KEPT) > KEPT_MAX:
            _prune()
    return conn


def _forget_inherited() -> None:
    # Runs in a forked child: the parent's connections are kept referenced (so no finaliser closes
    # them here, which would touch the parent's locks) and never used.
    with _KEPT_LOCK:
        if _KEPT_PID[0] != os.getpid():
            _INHERITED.extend(conn for conn, _ in _KEPT.values())
            for conn, _ in _KEPT.values():
                store_pg.detach_inherited(conn)
            _KEPT.clear()
            _KEPT_PID[0] = os.getpid()


def _after_fork_in_child() -> None:
    # The child starts with only the forking thread: a lock another thread of the parent held at
    # the fork would never be released here, so the child gets a fresh one first.
    global _KEPT_LOCK
    _KEPT_LOCK = threading.Lock()
    _forget_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _prune() -> None:
    """Close the connections of threads that ended, then this thread's oldest, down to KEPT_MAX
    (lock held). Another live thread's connection is never closed under it."""
    alive = {t.ident for t in threading.enumerate()}
    me = threading.get_ident()
    ended = [k for k in _KEPT if k[0] not in alive]
    mine = [k for k in _KEPT if k[0] == me][:-1]
    for key in ended + mine[:max(0, len(_KEPT) - len(ended) - KEPT_MAX)]:
        _close_quietly(_KEPT.pop(key)[0])


def _discard(key: tuple[int, str] | None = None) -> None:
    """Close and forget this thread's connection to the queue database (or ``key``'s)."""
    key = key or (threading.get_ident(), database_url() or str(db_path()))
    with _KEPT_LOCK:
        entry = _KEPT.pop(key, None)
    if entry is not None:
        _close_quietly(entry[0])


def _close_quietly(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.close()


def close_connections() -> None:
    """Close every connection this process keeps (tests, and a process about to exit or to stop
    using a database file). The next store call opens a new one, and makes the SQLite file again
    if it is gone by then (``store_sqlite.refuse_gone`` refuses that only for a file still in use)."""
    with _KEPT_LOCK:
        if _KEPT_PID[0] != os.getpid():
            return
        entries = list(_KEPT.values())
        _KEPT.clear()
    for conn, _ in entries:
        _close_quietly(conn)
    store_pg.close_listeners()   # the change watches' LISTEN connections
    store_sqlite.forget_opened()   # let go of on purpose: a file gone since is made again on next use


def checkpoint() -> None:
    """Copy the WAL back into the database without waiting for readers (``PASSIVE``); SQLite
    also does this by itself every 10,000 pages. The worker calls it once a minute. Nothing on
    PostgreSQL (the server checkpoints)."""
    if not _dialect().wal_checkpoints:
        return
    with _reading() as conn:
        store_sqlite.checkpoint(_as_sqlite(conn))


@contextlib.contextmanager
def _reading() -> Iterator[Connection]:
    conn = _kept()
    if _dialect(conn) is POSTGRESQL:   # psycopg's errors are mapped by PgConnection itself
        yield conn
        return
    with store_sqlite.reading(_as_sqlite(conn), db_path(), _discard):
        yield conn


_LOCK_WAIT = threading.local()   # this thread's wait for SQLite's write lock (lock_wait): .sec, .give_up


@contextlib.contextmanager
def lock_wait(seconds: float | None = None, give_up: Callable[[], bool] | None = None) -> Iterator[None]:
    """Within this block, every write of this thread waits for SQLite's write lock at most
    ``seconds`` (None: store_sqlite.BUSY_WAIT_SEC, 30 s), and no longer once ``give_up()`` is
    true (asked between tries); then DatabaseBusy, which callers that ride outages out retry
    later. After a write of the block waited in vain, the next ones try once (no wait) until one
    lands: a round of several writes is held up once, not once per write. A run's watch uses it
    (between its checks of the timeout, a cancel and the watchdogs, another program holding the
    queue must not stall it), and the worker's loop (a stop is not held up by it). PostgreSQL
    has no global write lock; a row's lock is waited for up to PG_LOCK_TIMEOUT_SEC as before."""
    before = (getattr(_LOCK_WAIT, "sec", None), getattr(_LOCK_WAIT, "give_up", None),
              getattr(_LOCK_WAIT, "held", False))
    _LOCK_WAIT.sec, _LOCK_WAIT.give_up, _LOCK_WAIT.held = seconds, give_up, False
    try:
        yield
    finally:
        _LOCK_WAIT.sec, _LOCK_WAIT.give_up, _LOCK_WAIT.held = before


@contextlib.contextmanager
def _writing() -> Iterator[Connection]:
    """A write transaction: ``BEGIN IMMEDIATE`` takes the write lock before the first read,
    waiting for it as long as ``lock_wait`` says (else store_sqlite.BUSY_WAIT_SEC). On PostgreSQL
    no global lock: rows are locked as they are read, see ``store_pg.transaction``."""
    conn = _kept()
    if _dialect(conn) is POSTGRESQL:
        with store_pg.transaction(_as_pg(conn)):
            yield conn
        return
    wait = getattr(_LOCK_WAIT, "sec", None)
    if wait is not None and getattr(_LOCK_WAIT, "held", False):
        wait = 0.0   # this block's last write waited its limit in vain: one try, until a write lands
    try:
        with store_sqlite.transaction(_as_sqlite(conn), db_path(), _discard, wait,
                                      getattr(_LOCK_WAIT, "give_up", None)):
            yield conn
    except DatabaseBusy:
        _LOCK_WAIT.held = wait is not None
        raise
    _LOCK_WAIT.held = False


@contextlib.contextmanager
def _single_write() -> Iterator[Connection]:
    """For a write that is one statement: on PostgreSQL the kept connection in autocommit (the
    statement is its own transaction: no BEGIN or COMMIT round trip); on SQLite ``_writing``."""
    conn = _kept()
    if _dialect(conn) is POSTGRESQL:
        yield conn
        return
    with _writing() as conn:
        yield conn


def _kept_pg(url: str) -> PgConnection:
    """This thread's PostgreSQL connection to ``url``, made on first use and again when the
    process forked or the last use broke it."""
    key = (threading.get_ident(), url)
    entry = _KEPT.get(key)
    if entry is not None and _as_pg(entry[0]).usable:
        return _as_pg(entry[0])
    if entry is not None:
        _discard(key)
    conn = store_pg.connect(url, pg_migrations())
    with _KEPT_LOCK:
        _KEPT[key] = (conn, None)
        if len(_KEPT) > KEPT_MAX:
            _prune()
    return conn


def _event(conn: Connection, task_id: int | None, kind: str, message: str = "") -> None:
    if _dialect(conn).events_at_commit:   # appended at the commit, in order (PgConnection.commit)
        _as_pg(conn).events.append((task_id, now(), kind, message))
        return
    conn.execute(
        "INSERT INTO events (task_id, ts, kind, message) VALUES (?, ?, ?, ?)",
        (task_id, now(), kind, message),
    )


# --------------------------------------------------------------------------------------------
# Validation helpers shared by every boundary (MCP tools, CLI, HTTP).


def odd_number(value: Any) -> str | None:
    """What is wrong with ``value`` as a number, in the words every boundary uses, or None:
    true/false (Python counts a bool as an int, so True passed as 1) and infinity or NaN (as a
    float or as text such as ``"Infinity"``, which no limit, count or duration can be)."""
    if isinstance(value, bool):
        return f"must be a number, not true or false; got {value!r}"
    number = value
    if isinstance(value, str):   # "inf", "NaN", "-Infinity", "$inf", "1e999"
        try:
            number = float(value.strip().lstrip("$").strip())
        except ValueError:
            return None
    if isinstance(number, float) and not math.isfinite(number):
        return f"must be a finite number; got {shown_value(value)}"
    return None


def _plain_number(name: str, value: Any) -> None:
    """Raise ValidationError when ``value`` is a bool or not finite (see ``odd_number``)."""
    problem = odd_number(value)
    if problem:
        raise ValidationError(f"{name} {problem}")


def coerce_int(name: str, value: Any, lo: int, hi: int) -> int:
    """An int in [lo, hi]; accepts ints and decimal strings such as ``"600"``.

    Raises ValidationError naming the field, the bounds and what was sent.
    """
    _plain_number(name, value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?0*\d{1,30}\s*", value):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be a whole number from {lo} to {hi}; got {value!r}")
    if not lo <= value <= hi:
        raise ValidationError(f"{name} must be from {lo} to {hi}; got {value}")
    return value


def coerce_list(name: str, value: Any) -> list:
    """A list; accepts a list, a JSON string holding a list, ``None``/``"null"``/``""`` (empty),
    or a comma-separated string. Raises ValidationError otherwise."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text in ("", "null", "[]"):
            return []
        if text.startswith("["):
            parsed = loads_json(name, text)
            if isinstance(parsed, list):
                return parsed
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    raise ValidationError(f"{name} must be a list; got {shown_value(value)}")


def shown_value(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a one-line message, cut to ``limit`` characters with ``…``."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def shell_command(*args: Any) -> str:
    """One command line for a person to paste into a POSIX shell: each argument quoted with
    ``shlex.quote`` (a path or URL holding ``$(…)``, backticks, ``;``, ``|`` or quotes stays one
    literal argument; plain ones are shown as they are). Every command TaskBridge prints — CLI,
    MCP results, the board, errors — is built here; join several with `` && ``."""
    import shlex
    return " ".join(shlex.quote(str(arg)) for arg in args)


# The interpreter ./install.sh makes, as the README runs every script: a bare `python` on a fresh
# machine lacks the dependencies.
CHECKOUT_PYTHON = ".venv/bin/python"


def script_command(script: str, *args: Any) -> str:
    """The command line a person runs for one of this checkout's scripts from its folder:
    ``script_command("tasks_cli.py", "show", "t_0001")`` -> ``.venv/bin/python tasks_cli.py show
    t_0001`` (arguments quoted as `shell_command` does; pass a placeholder such as ``"..."`` as one
    argument). ``script`` is a path relative to the checkout (``worker.py``,
    ``launchd/schedule.py``). A queue file this process was given by ``--db`` is named again for
    the scripts that take it (``knobs.GIVEN_DB_FILE``). Every hint that names a TaskBridge script
    is built here."""
    given = knobs.GIVEN_DB_FILE[0]
    db = ("--db", given) if given and script in DB_SCRIPTS else ()
    return shell_command(CHECKOUT_PYTHON, script, *db, *args)


DB_SCRIPTS = ("tasks_cli.py", "worker.py", "serve.py")   # whose --db comes right after the script


def shown_repo(value: Any, limit: int = 120) -> str:
    """A refused ``repo`` value for a one-line message, never whole: any user-info part (what
    comes before the last ``@`` of the host part — a user name, a password, a token, in a URL or
    the scp form ``user:password@host:path``) is replaced by ``***``, as are a query string and a
    fragment; then ``repr``, cut to ``limit`` characters (see `shown_value`). Every repo error
    shows its value through this."""
    if not isinstance(value, str):
        return shown_value(value, limit)
    text = value
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    for mark in ("?", "#"):
        if mark in rest:
            rest = rest.split(mark, 1)[0] + mark + "***"
    return shown_value(f"{scheme}{sep}{rest}", limit)


def loads_json(name: str, text: str, want: str = "a list") -> Any:
    """JSON text an argument holds, parsed. Raises ValidationError naming ``name`` when it is not
    valid JSON or nests past the parser's recursion limit (a few KB of ``[[[`` raised RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValidationError(f"{name} nests arrays or objects too deeply to read; send {want}") from None
    except ValueError:
        raise ValidationError(f"{name} is not valid JSON: {shown_value(text)}; send {want}") from None



def coerce_bool(name: str, value: Any) -> bool:
    """A bool; accepts true/false, 1/0 and their string forms. Raises ValidationError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValidationError(f"{name} must be true or false; got {value!r}")


def optional(value: Any) -> Any:
    """``None`` for the ways clients say "absent" (``None``, ``"null"``, ``""``); else the value."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "null", "None")):
        return None
    return value


def _or(value: Any, default: Any) -> Any:
    value = optional(value)
    return default if value is None else value


def _batch_ref(value: Any) -> str | None:
    """A batch item's ``ref``: a label of up to 200 characters that cannot be read as a task id
    (``depends_on`` names both, and an existing task would be hidden by it), or None. Raises
    ValidationError."""
    value = optional(value)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 200:
        raise ValidationError("ref must be a label of up to 200 characters, e.g. '@build'; "
                              f"got {shown_value(value, 60)}")
    if TASK_ID_RE.match(value):
        raise ValidationError(f"ref {value!r} reads as a task id, which depends_on also takes; give a label that "
                              "is not one, e.g. '@build'")
    return value


def _bounded(bound: spec.Bound, raw: dict[str, Any]) -> int | None:
    """``raw[bound.name]`` as an int within the bound, its default when absent (None for a field
    with no default). Raises ValidationError naming the field and its range."""
    value = _or(raw.get(bound.name), bound.default)
    return None if value is None else coerce_int(bound.name, value, *bound.range)


def _text(name: str, value: Any, limit: int) -> str:
    if value is None:
        raise ValidationError(f"{name} is required: give it as text")
    if not isinstance(value, str):
        raise ValidationError(f"{name} must be text; got {type(value).__name__}")
    if not value.strip():
        raise ValidationError(f"{name} must not be empty")
    if "\x00" in value:
        raise ValidationError(f"{name} contains a NUL character; send plain text")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:   # JSON's "\ud800" decodes to a lone surrogate SQLite cannot store
            raise ValidationError(f"{name} contains an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff "
                                  "escape); send valid Unicode text") from None
    if len(value) > limit:
        raise ValidationError(f"{name} is {len(value)} characters; the limit is {limit}")
    return value


def validate_model(model: Any) -> str | None:
    """``provider/model`` or None. Raises ValidationError otherwise."""
    model = optional(model)
    if model is None:
        return None
    if not isinstance(model, str) or not MODEL_RE.match(model.strip()):
        raise ValidationError(
            f"model {model!r} is not of the form provider/model (for example "
            f"anthropic/claude-sonnet-4-5); list_models or `tasks_cli.py models` shows what is available"
        )
    return model.strip()


def validate_provider(provider: Any) -> str | None:
    """A provider id (``openai``, ``anthropic``) or None. It goes on OpenCode's command line
    (``opencode models PROVIDER``), where ``-m`` or ``--refresh`` would be read as an option, so
    only a model id's provider part passes. Raises ValidationError otherwise."""
    provider = optional(provider)
    if provider is None:
        return None
    if not isinstance(provider, str) or not PROVIDER_RE.fullmatch(provider.strip()):
        raise ValidationError(
            f"provider {shown_value(provider)} is not a provider id (letters, digits, _ . -, starting with a letter "
            "or digit), such as openai or anthropic; leave it out to list every provider's models")
    return provider.strip()


def validate_working_dir(value: Any) -> str:
    """An absolute path to an existing directory, normalised. Raises ValidationError otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError("working_dir must be an absolute path to an existing directory")
    if "\x00" in value:
        raise ValidationError("working_dir contains a NUL character; give a plain absolute path")
    if not os.path.isabs(value):
        raise ValidationError(
            f"working_dir {value!r} is relative; give an absolute path such as /home/me/project"
        )
    path = os.path.realpath(value)
    if not os.path.isdir(path):
        raise ValidationError(f"working_dir {value!r} does not exist or is not a directory")
    refused, private = _too_wide(path), _private_folder(path)
    shown = value if value == path else f"{value!r} (that is {path})"
    if refused:
        raise ValidationError(f"working_dir {shown} is {refused}: the agent would work over all of it "
                              "with the task's permissions; give the project's own folder")
    if private:
        raise ValidationError(f"working_dir {shown} is in {private}: a task there could change other tasks' "
                              "work or read what the agent's box hides; give the project's own folder")
    return path


def _too_wide(path: str) -> str | None:
    """What makes ``path`` (resolved) no place for an agent: the whole filesystem, the user's home
    itself, or TaskBridge's own folders (its checkout with its token and queue, the database's
    and the logs' folders). None when it is an ordinary folder."""
    if path == _system_real(os.sep):
        return "the root of the filesystem"
    if path == _system_real(os.path.expanduser("~")):
        return "your home folder itself"
    system = _system_folder(path)
    if system:
        return f"the system folder {system}"
    checkout = str(REPO_DIR)   # resolved, as db_path() is (the log folder's name may be a link)
    own = [(checkout, "TaskBridge's own folder"), (str(db_path().parent), "the folder of TaskBridge's queue"),
           (_system_real(str(log_dir())), "the folder of TaskBridge's task logs")]
    for folder, what in own:
        if path == folder or path.startswith(folder.rstrip(os.sep) + os.sep) and folder == checkout:
            return what
        if folder == checkout and folder.startswith(path.rstrip(os.sep) + os.sep):
            return f"a folder holding {what} ({folder}: its token and queue)"   # the box hides a queue elsewhere
    return None


# How far below a folder TaskBridge's or OpenCode's own folders make it refused: ~/.config holds
# opencode/, ~/.local holds share/opencode/ and state/taskbridge/; a project folder that holds them
# deeper down (a test's folder with its own XDG folders in a subfolder) is not refused for it.
HOLDING_DEPTH = 2


def _private_folder(path: str) -> str | None:
    """What of TaskBridge's or OpenCode's own ``path`` (resolved) is or lies in: the folders of
    every queue's task worktrees and mirrors (``$XDG_STATE_HOME/taskbridge``,
    ``$XDG_CACHE_HOME/taskbridge``, TASKBRIDGE_WORKTREE_ROOT, TASKBRIDGE_MIRROR_DIR), OpenCode's
    data (every session, the providers' credentials), configuration, cache and state (the last
    two writable to an unboxed agent run, as the box's own, under TaskBridge's cache, are to
    every boxed run: a repository planted there must not become a task's folder), a folder
    that holds one of those six at most HOLDING_DEPTH levels down, or a folder that holds a
    TaskBridge queue itself (``tasks.db``, or a worker's ``*.worker.lock`` beside a queue: the
    box hides only the worker's own queue). None when it is none of them."""
    for real, what, holding in _private_places(tuple(os.environ.get(name) for name in _PRIVATE_ENV)):
        if path == real or path.startswith(real.rstrip(os.sep) + os.sep):
            return what
        if holding and real.startswith(path.rstrip(os.sep) + os.sep) and \
                real.count(os.sep) - path.rstrip(os.sep).count(os.sep) <= HOLDING_DEPTH:
            return f"a folder holding {what} ({real})"
    try:
        with os.scandir(path) as entries:
            queue = next((e.name for e in entries if is_queue_file(e.name) and _holds_queue(e.path)), None)
    except OSError:
        queue = None
    return f"the folder of a TaskBridge queue (it holds {queue})" if queue else None


# What _private_places reads: the variables that place TaskBridge's and OpenCode's own folders.
_PRIVATE_ENV = ("HOME", *knobs.XDG_DEFAULTS, "TASKBRIDGE_WORKTREE_ROOT", "TASKBRIDGE_MIRROR_DIR")


@functools.lru_cache(maxsize=8)
def _private_places(values: tuple[str | None, ...]) -> tuple[tuple[str, str, bool], ...]:
    """(resolved folder, what it is, whether a folder holding it is refused too) for each of
    ``_private_folder``'s places, for ``values`` (those of _PRIVATE_ENV, the key of this cache):
    building and resolving them took ~60 µs of every submit, and they move only with the
    environment. A relative folder (a misset variable) is left out."""
    env = {name: value for name, value in zip(_PRIVATE_ENV, values, strict=True) if value is not None}
    xdg = {name: str(knobs.xdg_home(name, env)) for name in knobs.XDG_DEFAULTS}
    places = [(os.path.join(xdg["XDG_STATE_HOME"], "taskbridge"), "TaskBridge's state folder (every queue's task "
               "worktrees)"),
              (os.path.join(xdg["XDG_CACHE_HOME"], "taskbridge"), "TaskBridge's cache (the mirrors of remotes, "
               "OpenCode's folders for boxed runs)"),
              (os.path.join(xdg["XDG_DATA_HOME"], "opencode"), "OpenCode's data folder (every session and the "
               "providers' credentials)"),
              (os.path.join(xdg["XDG_CONFIG_HOME"], "opencode"), "OpenCode's configuration folder"),
              (os.path.join(xdg["XDG_CACHE_HOME"], "opencode"), "OpenCode's cache (writable to an unboxed agent "
               "run)"),
              (os.path.join(xdg["XDG_STATE_HOME"], "opencode"), "OpenCode's state folder (writable to an unboxed "
               "agent run)")]
    held = len(places)   # these six are refused in a folder holding them too (~/.local/share, say)
    places += [(env[name], what) for name, what in (
        ("TASKBRIDGE_WORKTREE_ROOT", "TaskBridge's task worktrees (TASKBRIDGE_WORKTREE_ROOT)"),
        ("TASKBRIDGE_MIRROR_DIR", "TaskBridge's mirrors of remotes (TASKBRIDGE_MIRROR_DIR)"))
        if env.get(name)]
    return tuple((str(_resolved(folder)), what, n < held) for n, (folder, what) in enumerate(places)
                 if os.path.isabs(os.path.expanduser(folder)))


# How far below an in-place task's folder another queue is looked for (queue_inside), and how
# many entries the look reads at most: a queue's folder kept in a project (q/tasks.db, a/q/tasks.db).
QUEUE_DEPTH = 3
QUEUE_SCAN_MAX = 20_000


def is_queue_file(name: str) -> bool:
    """Whether a file named ``name`` marks a TaskBridge queue's folder: ``tasks.db``, or a
    worker's ``*.worker.lock``."""
    return name == "tasks.db" or name.endswith(".worker.lock")


def _holds_queue(path: str) -> bool:
    """Whether the file ``path`` (named as `is_queue_file` says) is a TaskBridge queue's: a
    worker's lock, an empty ``tasks.db`` (one being made), or an SQLite ``tasks.db`` with the
    queue's ``task_deps`` table; another program's ``tasks.db`` (a to-do app's) is not. One that
    cannot be read counts as a queue."""
    if not path.endswith("tasks.db"):
        return True
    import sqlite3
    try:
        if os.path.getsize(path) == 0:
            return True
        with open(path, "rb") as handle:
            if handle.read(16) != b"SQLite format 3\x00":
                return False
        conn = sqlite3.connect(f"{Path(path).as_uri()}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'task_deps'").fetchone() is not None
        finally:
            conn.close()
    except (OSError, sqlite3.Error):
        return True


def queue_inside(path: str) -> str | None:
    """Another TaskBridge queue's file (``tasks.db``, or a worker's ``*.worker.lock`` beside a
    queue) or another checkout's ``.taskbridge/`` folder (its token and OAuth store) in the folder
    ``path`` (resolved) or a folder at most QUEUE_DEPTH levels below it (not
    in ``.git``), other than this process's own queue (the agent's box hides that one): an
    in-place task gets its whole folder writable, and could rewrite that queue's tasks. Links are
    not followed; the look stops after QUEUE_SCAN_MAX entries. None when there is none."""
    own = db_path()
    mine = {str(own), str(own.with_name(f"{own.stem}.worker.lock"))}
    folders, seen = [(path, 0)], 0
    while folders:
        folder, depth = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if seen > QUEUE_SCAN_MAX:
                        return None
                    if is_queue_file(entry.name) and entry.path not in mine and \
                            entry.is_file(follow_symlinks=False) and _holds_queue(entry.path):
                        return entry.path
                    if entry.name == ".taskbridge" and entry.is_dir(follow_symlinks=False) and \
                            entry.path != str(REPO_DIR / ".taskbridge"):   # another checkout's token, OAuth store
                        return entry.path
                    if depth < QUEUE_DEPTH and entry.is_dir(follow_symlinks=False) and entry.name != ".git":
                        folders.append((entry.path, depth + 1))
        except OSError:
            continue
    return None


# The operating system's own folders: no project lives in or under them.
_SYSTEM_TREES = ("/etc", "/proc", "/sys", "/dev", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                 "/libx32", "/boot", "/run", "/System", "/Library", "/private/etc", "/private/var/db")
# Folders that hold projects below them but are no project themselves.
_SYSTEM_ROOTS = ("/var", "/tmp", "/opt", "/srv", "/mnt", "/media", "/home", "/Users", "/private",
                 "/private/tmp", "/private/var", "/root", "/snap")


@functools.lru_cache(maxsize=64)
def _system_real(folder: str) -> str:
    # The operating system's folders, the user's home and TaskBridge's log folder do not move
    # while a process runs; resolving the thirty of them afresh cost ~0.6 ms of every submit (a
    # third of a submit -> claim -> finish cycle).
    return os.path.realpath(folder)


def _system_folder(path: str) -> str | None:
    """The system folder ``path`` (resolved) is or lies in, or None."""
    for tree in _SYSTEM_TREES:
        real = _system_real(tree)
        if path == real or path.startswith(real.rstrip(os.sep) + os.sep):
            return tree
    for root in _SYSTEM_ROOTS:
        if path == _system_real(root):
            return root
    return None


HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def host_name() -> str:
    """This machine's name for the queue: ``$TASKBRIDGE_HOST``, else ``socket.gethostname()``
    (read at call time). A worker claims only tasks whose host is unset or this name; a task with
    a local working_dir is for the host that submitted it. Raises ValidationError when
    TASKBRIDGE_HOST is not a plain host name (letters, digits, ``.``, ``-``, ``_``; ≤253)."""
    configured = os.environ.get("TASKBRIDGE_HOST")
    if configured is None or not configured.strip():
        return socket.gethostname()
    if not HOST_RE.match(configured):
        raise ValidationError(f"TASKBRIDGE_HOST={shown_value(configured)} is not a plain host name (letters, "
                              "digits, '.', '-', '_'); set it to this machine's name, or unset it to use "
                              f"{socket.gethostname()!r}")
    return configured


def validate_host(value: Any) -> str | None:
    """A task's ``host`` (the machine whose workers may claim it): a plain host name, or None.
    Raises ValidationError."""
    value = optional(value)
    if value is None:
        return None
    if not isinstance(value, str) or not HOST_RE.match(value.strip()):
        raise ValidationError(f"host {shown_value(value)} is not a plain host name (letters, digits, '.', '-', "
                              "'_'; what TASKBRIDGE_HOST or `hostname` says on the worker's machine)")
    return value.strip()


REPO_SCHEMES = ("https", "http", "ssh", "git", "file")
_SCP_RE = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9][A-Za-z0-9.-]*:(?!//)[^\s]+$")


def validate_repo(value: Any) -> str | None:
    """A task's ``repo``: a git remote the worker mirrors and pushes the task branch to — a URL
    (``https://``, ``http://``, ``ssh://``, ``git://``, ``file://``), the scp form
    ``user@host:path``, or the absolute path of a git repository on this machine (bare or not;
    resolved). A path or ``file://`` URL must name a git repository here at submit; a remote is
    never contacted. None when absent. A URL carrying credentials (a password, or any user name in an
    http(s) URL, where it is usually a token; a query string) is refused: each worker's own git
    credentials are used, never stored in the queue. Raises ValidationError."""
    value = optional(value)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValidationError(f"repo must be text (a git URL or an absolute path); got {type(value).__name__}")
    text = value.strip()
    if not text or len(text) > 2000 or any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValidationError(f"repo {shown_repo(value)} must be one git URL or absolute path without spaces "
                              "or control characters")
    if text.startswith("-"):
        raise ValidationError(f"repo {shown_repo(value)} starts with '-'; give a git URL or an absolute path")
    if "://" in text:
        return _repo_url(text)
    if _SCP_RE.match(text):
        return text
    if "::" in text or not os.path.isabs(text):
        raise ValidationError(f"repo {shown_repo(value)} is neither a git URL (https://, ssh://, git@host:path, "
                              "file://) nor an absolute path of a git repository")
    return _local_repository(text, text)


def _repo_url(text: str) -> str:
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(text)
        parts.port   # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ValidationError(f"repo {shown_repo(text)} is not a valid URL ({shown_repo(str(exc))[1:-1]})") from None
    scheme = parts.scheme.lower()
    if scheme not in REPO_SCHEMES:
        raise ValidationError(f"repo {shown_repo(text)}: the scheme {scheme!r} is not one of "
                              f"{', '.join(REPO_SCHEMES)} (git's other transports run programs)")
    if scheme != "file" and not parts.hostname:
        raise ValidationError(f"repo {shown_repo(text)} names no host")
    if (parts.hostname or "").startswith("-") or (parts.username or "").startswith("-"):
        raise ValidationError(f"repo {shown_repo(text)}: a host or user name starting with '-' would be read "
                              "as an ssh option; give the remote's real host")
    if scheme == "file" and (not parts.path.startswith("/") or parts.netloc not in ("", "localhost")):
        raise ValidationError(f"repo {shown_repo(text)}: a file URL names an absolute path (file:///srv/repo.git)")
    if parts.password is not None or (scheme in ("https", "http") and parts.username is not None) \
            or parts.query or parts.fragment:
        raise ValidationError("repo must not carry credentials (a user name or password in the URL, or a query "
                              "string): each worker pushes with its own git credentials (a credential helper, "
                              "an SSH key), never stored in the queue; give the URL without them")
    if scheme == "file":   # on this machine: looked at now, as a plain path is (a remote is never probed)
        from urllib.parse import unquote
        _local_repository(unquote(parts.path), text)
    return text


def _local_repository(path: str, given: str) -> str:
    """``path`` resolved, when it is a git repository on this machine (see `_is_git_repository`);
    else ValidationError naming ``given`` (what the submitter wrote: the path or file:// URL)."""
    resolved = os.path.realpath(path)
    if not _is_git_repository(resolved):
        raise ValidationError(f"repo {shown_repo(given)} is not a git repository here "
                              "(no .git, or not a bare repository); give a repository's path or its URL")
    return resolved


def _is_git_repository(path: str) -> bool:
    """Whether ``path`` looks like a git repository: a checkout (``.git``) or a bare one (HEAD,
    objects/, refs/)."""
    if os.path.exists(os.path.join(path, ".git")):
        return True
    return all(os.path.exists(os.path.join(path, name)) for name in ("HEAD", "objects", "refs"))


_REF_BAD = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")


def validate_ref(value: Any) -> str | None:
    """A task's ``base_ref``: a branch, tag or full ref name as ``git check-ref-format`` allows it
    (``main``, ``release/2.1``, ``refs/tags/v1``) or a commit id; None when absent (the remote's
    HEAD branch). Raises ValidationError naming the rule it breaks."""
    value = optional(value)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValidationError("base_ref must be a branch, tag or commit name such as main")
    ref = value.strip()
    problem = None
    if len(ref) > 255:
        problem = "is over 255 characters"
    elif _REF_BAD.search(ref):
        problem = "holds a space, a control character, '..', '@{', '//' or one of ~ ^ : ? * [ \\"
    elif ref.startswith(("-", "/")) or ref.endswith(("/", ".", ".lock")) or ref == "@":
        problem = "starts with '-' or '/', ends with '/', '.' or '.lock', or is '@'"
    elif any(part.startswith(".") or part.endswith(".lock") for part in ref.split("/")):
        problem = "has a part that starts with '.' or ends with '.lock'"
    if problem:
        raise ValidationError(f"base_ref {shown_value(value)} is not a valid git ref name: it {problem}")
    return ref


def caller_kind(name: str | None) -> str:
    """Classify an MCP clientInfo name: ``claude``, ``chatgpt`` or ``other``."""
    lowered = (name or "").lower()
    if "claude" in lowered or "anthropic" in lowered:
        return "claude"
    if "openai" in lowered or "chatgpt" in lowered:
        return "chatgpt"
    return "other"


def _place(raw: dict[str, Any], parent: Any) -> tuple[Any, str | None, str | None]:
    """Where a submission runs: ``(working_dir as given or None, repo URL or None, base_ref or
    None)``, checked to go together (a follow-up or fork, ``parent``, may name neither). Raises
    ValidationError."""
    working_dir, repo = optional(raw.get("working_dir")), validate_repo(raw.get("repo"))
    if working_dir is not None and repo is not None:
        raise ValidationError("give working_dir (a folder on the worker's machine) or repo (a git remote the "
                              "worker clones and pushes to), not both")
    if working_dir is None and repo is None and parent is None:
        raise ValidationError("working_dir or repo is required: an absolute path of an existing directory, or a "
                              "git remote (https://, ssh://, git@host:path, file://, or a repository's path)")
    base_ref = validate_ref(raw.get("base_ref"))
    if base_ref is not None and repo is None and parent is None:
        raise ValidationError("base_ref goes with repo (the ref of the remote the task starts from); a task "
                              "with a working_dir starts from its checkout's HEAD")
    if repo is not None and not coerce_bool("worktree", raw.get("worktree", True)):
        raise ValidationError("worktree=false cannot go with repo: a task on a remote runs in a worktree of "
                              "the worker's mirror and pushes its branch")
    return working_dir, repo, base_ref


def _spec(raw: dict[str, Any], refs: Collection[str] = ()) -> dict[str, Any]:
    """Validate one submission; returns the normalised column values (no SQL). ``refs``: the
    refs its batch gives, which continue_from and fork_from may name as depends_on does."""
    if not isinstance(raw, dict):
        raise ValidationError(f"a task must be an object; got {type(raw).__name__}")
    known = {
        "title", "instructions", "working_dir", "model", "priority", "depends_on", "timeout_sec",
        "max_retries", "permission", "worktree", "worktree_keep", "agent", "idempotency_key",
        "origin_name", "origin_version", "ref", "max_cost_usd", "max_tokens", "continue_from", "fork_from",
        "rules", "skills", "subagents", "repo", "base_ref", "host", "ask_human", "schedule_timeout_sec",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValidationError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    parent, parent_kind = _line_parent(raw, refs)
    # A follow-up or fork that names no preset takes its task's (_inherit_settings).
    permission = optional(raw.get("permission")) or (None if parent is not None else "auto")
    if permission is not None and permission not in PERMISSIONS:
        raise ValidationError(f"permission {permission!r} is not one of {', '.join(PERMISSIONS)}")
    agent = optional(raw.get("agent"))
    if agent is not None and (not isinstance(agent, str) or not AGENT_NAME.fullmatch(agent)):
        raise ValidationError(f"agent {agent!r} must be an OpenCode agent name such as build or plan")
    key = optional(raw.get("idempotency_key"))
    if key is not None:
        key = _text("idempotency_key", str(key) if isinstance(key, int) else key, 200)
    origin_name = optional(raw.get("origin_name"))
    working_dir, repo, base_ref = _place(raw, parent)
    return {
        "title": _text("title", raw.get("title"), TITLE_MAX).strip(),
        "instructions": _text("instructions", raw.get("instructions"), INSTRUCTIONS_MAX),
        # A follow-up or fork may leave it out: it runs where the task it builds on ran.
        "working_dir": validate_working_dir(working_dir) if working_dir is not None else None,
        "repo_url": repo,
        "base_ref": base_ref,
        "host": validate_host(raw.get("host")),
        "model": validate_model(raw.get("model")),
        "agent": agent,
        "priority": _bounded(spec.PRIORITY, raw),
        "permission": permission,
        "worktree": int(coerce_bool("worktree", raw.get("worktree", True))),
        "worktree_keep": int(coerce_bool("worktree_keep", raw.get("worktree_keep", False))),
        "ask_human": int(coerce_bool("ask_human", raw.get("ask_human", False))),
        "timeout_sec": _bounded(spec.TIMEOUT, raw),
        "max_retries": _bounded(spec.RETRIES, raw),
        "idempotency_key": key,
        "origin_name": origin_name,
        "origin_version": optional(raw.get("origin_version")),
        "origin_kind": caller_kind(origin_name) if origin_name else None,
        "depends_on": coerce_list("depends_on", raw.get("depends_on")) + ([parent] if parent is not None else []),
        "ref": _batch_ref(raw.get("ref")),
        "max_cost_usd": coerce_usd("max_cost_usd", raw.get("max_cost_usd")),
        "max_tokens": coerce_tokens("max_tokens", raw.get("max_tokens")),
        "parent": parent,
        "parent_kind": parent_kind,
        "rules": validate_rules(raw.get("rules")),
        "skills": _names("skills", raw.get("skills")),
        "subagents": _names("subagents", raw.get("subagents")),
        "schedule_timeout_sec": _bounded(spec.SCHEDULE_TIMEOUT, raw),
    }


RULE_ACTIONS = ("allow", "deny", "ask")
RULE_TOOLS = ("bash", "edit", "read", "glob", "grep", "list", "webfetch", "websearch", "task", "skill")
RULES_MAX = 50   # patterns per task


def validate_rules(value: Any) -> str | None:
    """A task's permission rules in OpenCode's own format, as JSON text (None for none):
    ``{"bash": {"git push*": "ask", "rm *": "deny"}, "webfetch": "ask"}`` — per tool (one of
    RULE_TOOLS) an action (allow, deny, ask) or a map of wildcard patterns (``*``, ``?``; ``\\*``,
    ``\\?``, ``\\\\`` for the characters themselves) to actions, the last matching pattern winning,
    as in OpenCode. A tool's rules may also come as a list of ``{"pattern": …, "action": …}`` in
    order (the form strict tool schemas can state); they are stored as the map. Raises
    ValidationError."""
    value = optional(value)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValidationError("rules must be a JSON object like {\"bash\": {\"git push*\": \"ask\"}}") from None
    if not isinstance(value, dict) or not value:
        raise ValidationError("rules must be a non-empty object like {\"bash\": {\"git push*\": \"ask\"}}")
    count = 0
    value = {tool: _rule_map(tool, rule) for tool, rule in value.items()}
    for tool, rule in value.items():
        if tool not in RULE_TOOLS:
            raise ValidationError(f"rules: unknown tool {tool!r}; rules apply to {', '.join(RULE_TOOLS)}")
        patterns = rule if isinstance(rule, dict) else {"*": rule}
        if not patterns:
            raise ValidationError(f"rules.{tool} is empty; give an action or a map of patterns to actions")
        for pattern, action in patterns.items():
            count += 1
            if not isinstance(pattern, str) or not pattern or len(pattern) > 500:
                raise ValidationError(f"rules.{tool}: a pattern must be 1 to 500 characters")
            if action not in RULE_ACTIONS:
                raise ValidationError(f"rules.{tool}[{pattern!r}] = {action!r}: an action is one of "
                                      f"{', '.join(RULE_ACTIONS)}")
    if count > RULES_MAX:
        raise ValidationError(f"rules hold at most {RULES_MAX} patterns; got {count}")
    return json.dumps(value)


def _rule_map(tool: str, rule: Any) -> Any:
    """A list of {pattern, action} as OpenCode's ordered map; a later repeat of a pattern moves
    it last, so the last match still wins. Anything else is returned for validate_rules to judge."""
    if not isinstance(rule, list):
        return rule
    patterns: dict[str, Any] = {}
    for index, item in enumerate(rule):
        if not isinstance(item, dict) or set(item) != {"pattern", "action"}:
            raise ValidationError(f"rules.{tool}[{index}] must be an object with exactly pattern and action, "
                                  f"like {{\"pattern\": \"git push*\", \"action\": \"ask\"}}")
        if not isinstance(item["pattern"], str):
            raise ValidationError(f"rules.{tool}[{index}].pattern must be text (a wildcard pattern)")
        patterns.pop(item["pattern"], None)
        patterns[item["pattern"]] = item["action"]
    return patterns


def _names(name: str, value: Any) -> str | None:
    """A list of OpenCode skill or agent names as JSON text (None for none). Whether OpenCode
    offers them is checked at the boundary (it needs OpenCode). Raises ValidationError."""
    items = coerce_list(name, value)
    if not items:
        return None
    if len(items) > 20:
        raise ValidationError(f"{name}: at most 20 names; got {len(items)}")
    for item in items:
        if not isinstance(item, str) or not re.fullmatch(r"[A-Za-z0-9_][\w.\-]{0,63}", item):
            raise ValidationError(f"{name}: {item!r} is not an OpenCode name (letters, digits, _ . -)")
    return json.dumps(list(dict.fromkeys(items)))


def _line_parent(raw: dict[str, Any], refs: Collection[str] = ()) -> tuple[Any, str | None]:
    """(the task a submission continues or forks from, "continue_from" | "fork_from"), or
    (None, None): a task id, or a ref of the batch (``refs``; one starting with ``@`` is left
    for ``_check_batch_names`` to find). The parent is also a dependency: the new task waits for
    it to be done."""
    cont, fork = optional(raw.get("continue_from")), optional(raw.get("fork_from"))
    if cont is not None and fork is not None:
        raise ValidationError("give continue_from or fork_from, not both: a follow-up continues a task's "
                              "branch and session, a fork starts a branch of its own from it")
    parent, kind = (cont, "continue_from") if cont is not None else (fork, "fork_from")
    if parent is None:
        return None, None
    if isinstance(parent, str) and (parent in refs or parent.startswith("@")):
        return parent, kind
    try:
        return format_task_id(parse_task_id(parent)), kind
    except ValidationError:
        if not isinstance(parent, str):
            raise
        raise ValidationError(_not_a_name(kind, parent, refs)) from None


def _not_a_name(field: str, value: str, refs: Collection[str]) -> str:
    """The refusal of ``value`` in ``field`` (depends_on, continue_from, fork_from): neither a task
    id nor one of the batch's ``refs``, which it names."""
    given = (f"this batch's refs are {', '.join(map(repr, refs))}" if refs
             else "no item of this batch has a ref (give one `ref` to name it)")
    return (f"{field} names {shown_value(value, 60)}, which is neither a task id (t_0001, 0001 or 1) nor a ref "
            f"of this batch; {given}")


def _check_batch_names(specs: list[dict]) -> None:
    """Refuse a depends_on, continue_from or fork_from text that is neither a task id nor a ref
    the batch gives (naming the refs it gives). Raises ValidationError naming the item."""
    refs = [s["ref"] for s in specs if s["ref"]]
    for index, item in enumerate(specs):
        for dep in item["depends_on"]:
            if isinstance(dep, str) and dep not in refs and (dep.startswith("@") or not TASK_ID_RE.match(dep)):
                field = item["parent_kind"] if dep == item["parent"] else "depends_on"
                raise ValidationError(f"task {index} of the batch: {_not_a_name(field, dep, refs)}")


# --------------------------------------------------------------------------------------------
# Rows -> public dicts.

_JSON_COLUMNS = ("result", "usage", "rules", "skills", "subagents", "pending_ask", "limit_pauses")
_TIME_COLUMNS = ("created_at", "claimed_at", "started_at", "finished_at", "heartbeat_at", "not_before",
                 "result_seen_at", "resume_at")


def task_dict(row: Row, deps: list[int] | None = None) -> dict[str, Any]:
    """A task row as the public shape every boundary shows (ids as ``t_0001``, ISO UTC times,
    JSON columns parsed, booleans as booleans)."""
    task = row_dict(row)
    task["num"] = task["id"]
    task["id"] = format_task_id(task["id"])
    for column in _JSON_COLUMNS:
        task[column] = json.loads(task[column]) if task.get(column) else None
    for column in _TIME_COLUMNS:
        task[column] = iso(task.get(column))   # .get: a row of a queue that a test holds at an older version
    task["worktree"] = bool(task["worktree"])
    task["worktree_keep"] = bool(task["worktree_keep"])
    task["ask_human"] = bool(task.get("ask_human"))
    task.pop("rules_given", None)   # the store's own record for a repeated idempotency key
    earlier = task.pop("earlier_receipts", None)   # whole in earlier_receipt; here without the diffs
    task["earlier_attempts"] = _earlier_summaries(json.loads(earlier)) if earlier else []
    task["repo"] = task.get("repo_url")   # the submit field's name: the git remote of a task on one
    live = task["status"] == "running"
    usage = task["usage"] or {}
    task["spent_usd"] = round(float(usage.get("cost_usd") or 0) + (task.get("run_cost_usd") or 0 if live else 0), 8)
    task["spent_tokens"] = (int((usage.get("tokens") or {}).get("total") or 0)
                            + (task.get("run_tokens") or 0 if live else 0))
    for column in ("continue_from", "fork_from"):
        if task.get(column) is not None:
            task[column] = format_task_id(task[column])
    task["start_overdue"] = start_overdue(row)
    if deps is not None:
        task["depends_on"] = [format_task_id(d) for d in deps]
    return task




def start_overdue(row: Any, at: float | None = None) -> str | None:
    """The warning for a task queued longer than its ``schedule_timeout_sec`` without ever being
    started (a row or task dict with epoch-second times; at: now by default), or None."""
    if "schedule_timeout_sec" not in row.keys():
        return None
    limit, created = row["schedule_timeout_sec"], row["created_at"]
    if limit is None or row["status"] != "pending" or row["claimed_at"] is not None:
        return None
    queued = (now() if at is None else at) - created
    if queued <= limit:
        return None
    return (f"queued {queued:.0f} s without starting, past its schedule timeout of {limit} s: no worker is taking "
            "work (queue_status shows the workers), every slot is busy, its dependencies are not done, or its "
            "provider is at a usage limit")


def overdue_tasks() -> list[dict[str, Any]]:
    """Pending tasks past their schedule timeout, never started: ``[{"id", "warning"}]``, oldest first."""
    with _reading() as conn:
        # On SQLite its partial index (migration 9) holds only pending tasks with a timeout: the
        # planner, left alone, read every pending task through the claim index instead.
        hint = " INDEXED BY tasks_schedule" if _dialect(conn).index_hints else ""
        rows = conn.execute(f"SELECT id, status, created_at, claimed_at, schedule_timeout_sec FROM tasks{hint}"
                            " WHERE status = 'pending' AND claimed_at IS NULL AND schedule_timeout_sec IS NOT NULL"
                            " AND created_at + schedule_timeout_sec < ? ORDER BY created_at, id LIMIT 100",
                            (now(),)).fetchall()
    return [{"id": format_task_id(r["id"]), "warning": start_overdue(r)} for r in rows]


def _deps(conn: Connection, task_id: int) -> list[int]:
    rows = conn.execute(
        "SELECT depends_on FROM task_deps WHERE task_id = ? ORDER BY depends_on", (task_id,)
    )
    return [r[0] for r in rows]


def _row(conn: Connection, task_id: int) -> Row:
    # In a PostgreSQL write transaction the row is locked (there is no global writers' lock): no
    # claim or other writer can change it between this read and the write it decides.
    locked = _dialect(conn).locks_rows and _as_pg(conn).writing
    row = conn.execute("SELECT * FROM tasks WHERE id = ? FOR UPDATE" if locked else "SELECT * FROM tasks WHERE id = ?",
                       (task_id,)).fetchone()
    if row is None:
        raise TaskNotFound(
            f"task {format_task_id(task_id)} not found; list_tasks shows the ids that exist"
        )
    return row


# --------------------------------------------------------------------------------------------
# Submit.

_INSERT_TASK = """
INSERT INTO tasks (title, instructions, working_dir, model, agent, priority, permission, worktree,
                   worktree_keep, timeout_sec, max_retries, idempotency_key, origin_name,
                   origin_version, origin_kind, created_at, max_cost_usd, max_tokens,
                   repo_url, base_ref, host)
VALUES (:title, :instructions, :working_dir, :model, :agent, :priority, :permission, :worktree,
        :worktree_keep, :timeout_sec, :max_retries, :idempotency_key, :origin_name,
        :origin_version, :origin_kind, :created_at, :max_cost_usd, :max_tokens,
        :repo_url, :base_ref, :host)
RETURNING *
"""


def _existing_by_key(conn: Connection, key: str | None) -> Row | None:
    if key is None:
        return None
    if _dialect(conn).locks_rows:   # two submits of one key: the second waits, then finds the first
        conn.execute("SELECT pg_advisory_xact_lock(CAST(? AS integer), hashtext(?))", (PG_KEY_LOCK, key))
    return conn.execute("SELECT * FROM tasks WHERE idempotency_key = ?", (key,)).fetchone()


# What a repeated idempotency key must repeat: what the task does, where, and what it may do (its
# scheduling, limits and retries may differ). A field the submission leaves out (None) is not
# compared: the store fills it (a follow-up's folder and inherited preset, a remote's folder).
KEYED_FIELDS = ("title", "instructions", "working_dir", "repo_url", "base_ref", "worktree", "agent", "permission",
                "skills", "subagents")   # and rules (rules_given); not model, which a retry may change


def _same_request(spec: dict, existing: Row, refs: dict[str, int]) -> None:
    """Refuse a repeated idempotency key that comes with another task (as payment APIs refuse a
    key reused with other parameters): returning the first task would drop this one unseen.
    ``refs``: the batch's refs so far (a parent named by one). Raises ValidationError naming the
    fields that differ."""
    differ = [name for name in KEYED_FIELDS if spec[name] is not None and spec[name] != existing[name]]
    if spec["rules"] is not None and spec["rules"] != existing["rules_given"]:
        differ.append("rules")
    if spec["parent"] is not None:
        ref = spec["parent"]
        parent = refs.get(ref) if ref in refs or ref.startswith("@") else parse_task_id(ref)
        if existing[spec["parent_kind"]] != parent:
            differ.append(spec["parent_kind"])
    elif existing["continue_from"] is not None or existing["fork_from"] is not None:
        differ.append("continue_from" if existing["continue_from"] is not None else "fork_from")
    if differ:
        verb = "differ" if len(differ) > 1 or differ[0] in ("instructions", "rules", "skills", "subagents") \
            else "differs"
        raise ValidationError(
            f"idempotency_key {spec['idempotency_key']!r} was already used by {format_task_id(existing['id'])} "
            f"({existing['title']!r}), whose {' and '.join(differ)} {verb}; nothing was queued. A repeated key "
            "must come with the same task (what it does, where, from which task, and what it may do): give "
            "this task a new key")


def _resolve_deps(conn: Connection, spec: dict, refs: dict[str, int]) -> list[int]:
    resolved = []
    for dep in spec["depends_on"]:
        field = spec.get("parent_kind") if dep == spec.get("parent") else "depends_on"
        if isinstance(dep, str) and dep in refs:
            resolved.append(refs[dep])
            continue
        if isinstance(dep, str) and dep.startswith("@"):
            raise ValidationError(f"{field} names {dep!r}, which no earlier task in the batch has as ref")
        dep_id = parse_task_id(dep)
        # On PostgreSQL the dependency's row is share-locked to the commit: it cannot fail or be
        # cancelled in between, unseen by its _fail_dependents (which would miss this new task).
        row = conn.execute("SELECT status FROM tasks WHERE id = ? FOR SHARE" if _dialect(conn).locks_rows
                           else "SELECT status FROM tasks WHERE id = ?", (dep_id,)).fetchone()
        if row is None:
            raise ValidationError(f"{field} names {format_task_id(dep_id)}, which does not exist")
        if row["status"] in ("failed", "cancelled"):
            raise ValidationError(
                f"{field} names {format_task_id(dep_id)}, which is {row['status']}: retry it first "
                f"(retry_task {format_task_id(dep_id)}), then submit this task, or leave it out of {field}"
            )
        resolved.append(dep_id)
    return sorted(set(resolved))


def _check_batch_cycles(specs: list[dict]) -> None:
    """Within a batch, refs may point forward; refuse a cycle (names it)."""
    refs = {s["ref"] for s in specs if s["ref"]}
    graph = {s["ref"]: [d for d in s["depends_on"] if isinstance(d, str) and d in refs]
             for s in specs if s["ref"]}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        if state.get(node) == 1:
            cycle = path[path.index(node):] + [node]
            raise ValidationError(f"dependency cycle refused: {' -> '.join(cycle)}")
        state[node] = 1
        for nxt in graph.get(node, []):
            visit(nxt, path + [node])
        state[node] = 2

    for node in graph:
        visit(node, [])


def _batch_specs(tasks: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batch's submissions validated (``_spec`` each), their refs unique and free of cycles.
    Raises ValidationError naming the item."""
    raw = coerce_list("tasks", tasks)
    if not 1 <= len(raw) <= BATCH_MAX:
        raise ValidationError(f"a batch holds 1 to {BATCH_MAX} tasks; got {len(raw)}. Split it")
    specs = []
    given = [ref for item in raw if isinstance(item, dict) and isinstance(ref := optional(item.get("ref")), str)]
    for index, item in enumerate(raw):
        try:
            specs.append(_spec(item, given))
        except ValidationError as exc:
            raise ValidationError(f"task {index} of the batch: {exc}") from None
    refs = [s["ref"] for s in specs if s["ref"]]
    if len(refs) != len(set(refs)):
        raise ValidationError("refs in a batch must be unique")
    _check_batch_names(specs)
    keyed: dict[str, int] = {}
    for index, item in enumerate(specs):
        first = keyed.setdefault(item["idempotency_key"], index) if item["idempotency_key"] else index
        if first != index:
            raise ValidationError(f"task {index} of the batch: idempotency_key {shown_value(item['idempotency_key'])} "
                                  f"is task {first}'s of the same batch; give each task its own key")
    for item in specs:
        if item["ref"] is not None and item["ref"] in item["depends_on"]:
            raise ValidationError(f"dependency cycle refused: task {item['ref']!r} depends on itself")
    _check_batch_cycles(specs)
    return specs


def submit_batch(tasks: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Submit 1–20 tasks all or nothing; returns their public dicts in order.

    Each item has the fields of ``submit_task``; an item may carry ``ref`` (a label) and name
    earlier or later items' refs in ``depends_on``, ``continue_from`` and ``fork_from`` beside
    existing task ids. A repeated
    ``idempotency_key`` returns the original task (with ``"duplicate": True``) instead of a new one;
    it must come with the same task (KEYED_FIELDS, and the same task it continues or forks).
    Raises ValidationError (bad field, unknown dependency, cycle, batch size, a key reused for
    another task); nothing is written then.
    """
    specs = _batch_specs(tasks)
    if len(specs) == 1 and _dialect() is POSTGRESQL and _plain(specs[0]):
        return [_submit_alone(specs[0])]
    # Insert in dependency order so a ref always points at an already-inserted task.
    ordered = _topological(specs)
    out: dict[int, tuple[Row, list[int], bool]] = {}
    with _writing() as conn:
        ref_ids: dict[str, int] = {}
        made: dict[int, str] = {}   # this batch's new rows: a refusal names them so, not by an id it rolls back
        defaults = _limit_defaults(conn)
        for index in ordered:
            spec = specs[index]
            existing = _existing_by_key(conn, spec["idempotency_key"])
            if existing is not None:
                try:
                    _same_request(spec, existing, ref_ids)
                except ValidationError as exc:   # which item, as _batch_specs says it
                    raise ValidationError(f"task {index} of the batch: {exc}") from None
                out[index] = (existing, _deps(conn, existing["id"]), True)
                if spec["ref"]:
                    ref_ids[spec["ref"]] = existing["id"]
                continue
            try:
                spec = _inherit_settings(conn, spec, ref_ids) | {"rules_given": spec["rules"]}
                deps = _resolve_deps(conn, spec, ref_ids)
                values, line = _insert_values(conn, spec, ref_ids, defaults, made)
            except ValidationError as exc:   # which item, as _batch_specs says it
                raise ValidationError(f"task {index} of the batch: {exc}") from None
            row = _insert_task(conn, spec, deps, values, line)
            task_id = row["id"]
            if spec["ref"]:
                ref_ids[spec["ref"]] = task_id
            made[task_id] = f"task {index} of the batch" + (f" (ref {spec['ref']!r})" if spec["ref"] else "")
            out[index] = (row, deps, False)
    # Shaped after the commit: the write lock is held for the SQL only.
    return [task_dict(row, deps) | {"duplicate": duplicate} for row, deps, duplicate in
            (out[i] for i in range(len(specs)))]


def _insert_task(conn: Connection, spec: dict, deps: list[int], values: dict[str, Any],
                 line: dict[str, Any]) -> Row:
    """Write one new task of ``submit_batch`` (``values``, ``line``: ``_insert_values``' answer),
    its dependencies ``deps`` and its ``submitted`` event; returns its row."""
    extras = {k: spec[k] for k in ("rules", "rules_given", "skills", "subagents")}
    row = conn.execute(_INSERT_TASK, values).fetchone()
    task_id = row["id"]
    if spec["ask_human"]:   # a column of migration 7, set apart like those of migration 5
        row = conn.execute("UPDATE tasks SET ask_human = 1 WHERE id = ? RETURNING *", (task_id,)).fetchone()
    if spec["parent"] is not None or any(extras.values()):
        # Columns of migration 5 are set apart: the INSERT stays valid for older schemas.
        row = conn.execute("UPDATE tasks SET continue_from = :continue_from, fork_from = :fork_from,"
                           " rules = :rules, rules_given = :rules_given, skills = :skills, subagents = :subagents"
                           " WHERE id = :id RETURNING *", line | extras | {"id": task_id}).fetchone()
    if spec["schedule_timeout_sec"] is not None:   # a migration 8 column, set apart likewise
        row = conn.execute("UPDATE tasks SET schedule_timeout_sec = ? WHERE id = ? RETURNING *",
                           (spec["schedule_timeout_sec"], task_id)).fetchone()
    conn.executemany("INSERT INTO task_deps (task_id, depends_on) VALUES (?, ?)", [(task_id, d) for d in deps])
    origin = f" from {spec['origin_name']}" if spec["origin_name"] else ""
    _event(conn, task_id, "submitted", f"{spec['title']}{origin}")
    return row


def _insert_values(conn: Connection, spec: dict, refs: dict[str, int], defaults: dict[str, Any],
                   made: dict[int, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(_INSERT_TASK's parameters, ``_line_values``' rest) for ``spec``: the queue's default
    limits (``defaults``) when it gave neither, the folder, remote and host a follow-up or fork
    takes from its parent. ``made``: the rows this batch made so far, by id, with the words that
    name them. Raises ValidationError."""
    values = {k: v for k, v in spec.items()
              if k not in ("depends_on", "ref", "parent", "parent_kind", "ask_human", "schedule_timeout_sec",
                           "rules", "rules_given", "skills", "subagents")}
    if values["max_cost_usd"] is None and values["max_tokens"] is None:
        values.update(defaults)
    line = _line_values(conn, spec, refs, made)
    where = {k: line.pop(k, values[k]) for k in ("working_dir", "worktree_keep", "repo_url", "base_ref")}
    where["host"] = _task_host(spec, line.pop("parent_host", None), where)
    where["working_dir"] = where["working_dir"] or ""   # a task on a remote has no folder
    return values | {"created_at": now()} | where, line


def _plain(spec: dict[str, Any]) -> bool:
    """Whether a submission is one INSERT and its event: no key to look up, no dependency, parent or
    column set apart (``submit_batch``'s later UPDATEs)."""
    return (spec["idempotency_key"] is None and spec["parent"] is None and not spec["depends_on"]
            and not spec["ask_human"] and spec["schedule_timeout_sec"] is None
            and not any(spec[k] for k in ("rules", "skills", "subagents")))


# A plain submission on PostgreSQL: the INSERT, its event and the NOTIFY in one autocommit
# statement, made only when no default limit could apply (:unlimited: the submission set neither
# limit; then the queue must have none set). As INSERT … SELECT its NULL numbers need a type.
_SUBMIT_PG = store_pg.with_event(
    _INSERT_TASK.replace("VALUES (", "SELECT ")
    .replace(":max_cost_usd, :max_tokens", "CAST(:max_cost_usd AS DOUBLE PRECISION), CAST(:max_tokens AS BIGINT)")
    .replace(":host)\nRETURNING", ":host WHERE NOT (CAST(:unlimited AS BOOLEAN) AND EXISTS (SELECT 1 FROM settings"
                                   " WHERE key IN (:default_usd, :default_tokens) AND value <> ''))\nRETURNING"),
    "submitted", "CAST(:event_message AS TEXT)")


def _submit_alone(spec: dict[str, Any]) -> dict[str, Any]:
    """``submit_task`` of a ``_plain`` spec on PostgreSQL without a transaction, in one statement
    (a single row: nothing to keep atomic). When the queue has default limits and the spec set
    none, that statement writes nothing; the defaults are read and it runs again with them."""
    origin = f" from {spec['origin_name']}" if spec["origin_name"] else ""
    unlimited = spec["max_cost_usd"] is None and spec["max_tokens"] is None
    with _single_write() as conn:
        values, _ = _insert_values(conn, spec, {}, {}, {})
        values |= {"event_ts": now(), "event_message": f"{spec['title']}{origin}", "unlimited": unlimited,
                   "default_usd": BUDGET_KEYS["default_max_cost_usd"],
                   "default_tokens": BUDGET_KEYS["default_max_tokens"]}
        row = conn.execute(_SUBMIT_PG, values).fetchone()
        if row is None:   # the queue has defaults: written with them
            row = conn.execute(_SUBMIT_PG, values | _limit_defaults(conn) | {"unlimited": False}).fetchone()
    return task_dict(_task_columns(row), []) | {"duplicate": False}


def _line_values(conn: Connection, spec: dict, refs: dict[str, int], made: dict[int, str]) -> dict[str, Any]:
    """continue_from / fork_from (row ids) and the working_dir of a follow-up or fork, checked
    against the task it builds on. Raises ValidationError naming the way out, and a task of the
    same batch (``made``: id → its words) by its place in the batch: its id is rolled back."""
    values: dict[str, Any] = {"continue_from": None, "fork_from": None}
    if spec["parent"] is None:
        return values
    kind, ref = spec["parent_kind"], spec["parent"]
    num = refs[ref] if ref in refs else parse_task_id(ref)
    parent = _row(conn, num)
    name = made.get(num) or format_task_id(num)
    if not parent["worktree"]:
        raise ValidationError(f"{kind} {name}: that task ran with worktree=false; a follow-up or fork needs "
                              "a task that ran on its own branch in a git worktree")
    if parent["status"] == "done" and not parent["repo_url"] and not parent["branch"] and not _branch_deleted(parent):
        raise ValidationError(f"{kind} {name}: that task has no branch to build on (it was completed by hand, or "
                              "ran in place outside git); a follow-up or fork needs a task that ran on its own "
                              "branch in a git worktree: submit a new task instead")
    if parent["repo_url"]:
        if spec["working_dir"] is not None or spec["repo_url"] not in (None, parent["repo_url"]):
            raise ValidationError(f"{kind} {name}: that task works on the remote {parent['repo_url']}; give that "
                                  "repo or leave working_dir and repo out")
        if spec["base_ref"] is not None:
            raise ValidationError(f"{kind} {name}: a follow-up or fork starts from that task's pushed branch; "
                                  "leave base_ref out")
        values.update(repo_url=parent["repo_url"], base_ref=parent["base_ref"], working_dir="")
    elif spec["repo_url"] is not None or spec["base_ref"] is not None:
        raise ValidationError(f"{kind} {name}: that task ran in {parent['working_dir']}, not on a remote; "
                              "leave repo and base_ref out")
    elif spec["working_dir"] is None:
        values["working_dir"] = parent["working_dir"]
    elif os.path.realpath(spec["working_dir"]) != os.path.realpath(parent["working_dir"]):
        raise ValidationError(f"{kind} {name}: working_dir must be that task's ({parent['working_dir']}) "
                              "or left out")
    values["parent_host"] = parent["host"]
    if kind == "continue_from":
        # It works in that task's folder: a folder the person asked to keep stays kept.
        values["worktree_keep"] = spec["worktree_keep"] or parent["worktree_keep"]
        other = _live_follower(conn, num)
        if other is not None:
            follower = made.get(other) or format_task_id(other)
            raise ValidationError(f"continue_from {name}: {follower} already continues it "
                                  f"on its branch; continue from {follower} instead, or "
                                  f"use fork_from {name} to try another approach side by side")
    values[kind] = num
    return values


def _branch_deleted(row: Row) -> bool:
    """Whether a done task's receipt says its empty branch was deleted (it changed nothing): what
    builds on it starts from its base commit (worktrees._branch_dropped)."""
    try:
        result = json.loads(row["result"] or "{}")
    except ValueError:
        return False
    return isinstance(result, dict) and bool(result.get("branch_deleted"))


INHERITED = ("permission", "rules", "agent", "skills", "subagents")   # what a follow-up or fork takes from its task


def _inherit_settings(conn: Connection, spec: dict, refs: dict[str, int]) -> dict:
    """``spec`` with the INHERITED settings it left out (None) taken from the task it continues or
    forks (its preset, permission rules, agent, skills, sub-agents): work in the same line keeps
    the restrictions it was given unless the submission names its own. A parent that does not
    exist is left to ``_line_values`` to name."""
    if spec["parent"] is None or all(spec[k] is not None for k in INHERITED):
        return spec
    ref = spec["parent"]
    try:
        num = refs[ref] if ref in refs else parse_task_id(ref)
    except ValidationError:
        return spec
    row = conn.execute("SELECT permission, rules, agent, skills, subagents FROM tasks WHERE id = ?", (num,)).fetchone()
    if row is None:
        return spec
    taken = {k: row[k] for k in INHERITED if spec[k] is None}
    return spec | taken | {"permission": spec["permission"] or row["permission"] or "auto"}


def _live_follower(conn: Connection, parent: int, other_than: int | None = None) -> int | None:
    """The id of a follow-up of ``parent`` (``continue_from``) that is not failed or cancelled,
    but ``other_than``, else None: a line of work has one follow-up at a time (two would run in
    the same worktree and session at once, and one would lose its work; after a done one, the
    line goes on from it). On PostgreSQL ``parent``'s row is locked first, as a new follow-up's
    submit locks it: a retry and a submit that race are decided one after the other."""
    if _dialect(conn).locks_rows and _as_pg(conn).writing:
        conn.execute("SELECT id FROM tasks WHERE id = ? FOR UPDATE", (parent,)).fetchone()
    row = conn.execute("SELECT id FROM tasks WHERE continue_from = ? AND status NOT IN ('failed', 'cancelled')"
                       " AND id <> ? ORDER BY id LIMIT 1", (parent, -1 if other_than is None else other_than)
                       ).fetchone()
    return None if row is None else row["id"]


def _task_host(spec: dict, parent_host: str | None, where: dict[str, Any]) -> str | None:
    """The host whose workers may claim a new task: the one it asked for; else a follow-up's or
    fork's parent's (its folder and session are there); else, for a local working_dir, the
    submitting machine (``host_name()``); a task on a remote may run anywhere (None)."""
    if spec["host"] is not None:
        return spec["host"]
    if spec["parent"] is not None and parent_host:
        return parent_host
    return None if where["repo_url"] else host_name()


def _topological(specs: list[dict]) -> list[int]:
    by_ref = {s["ref"]: i for i, s in enumerate(specs) if s["ref"]}
    order: list[int] = []
    seen: set[int] = set()

    def visit(i: int) -> None:
        if i in seen:
            return
        seen.add(i)
        for dep in specs[i]["depends_on"]:
            if isinstance(dep, str) and dep in by_ref:
                visit(by_ref[dep])
        order.append(i)

    for i in range(len(specs)):
        visit(i)
    return order


def submit_task(**fields: Any) -> dict[str, Any]:
    """Submit one task; returns its public dict (``duplicate`` True when an earlier task with the
    same ``idempotency_key`` is returned instead).

    Fields: title (str ≤200), instructions (str), working_dir (absolute existing dir),
    model (``provider/model`` or None = default at claim), priority (int −1000..1000, higher first),
    depends_on (task ids), timeout_sec (1..86400 s, per attempt), max_retries (0..10),
    permission (auto|readonly|no-shell|no-network), worktree (bool), worktree_keep (bool),
    agent (OpenCode agent name), idempotency_key (str), origin_name / origin_version (MCP caller),
    max_cost_usd (USD, > 0) and max_tokens (tokens, > 0): the task's spending limits over all its
    attempts (neither given: the queue's defaults, see ``set_budget``).
    continue_from (a task id: a follow-up that resumes that task's OpenCode session and commits on
    its branch; working_dir may be left out) or fork_from (a task id: a new branch from the commit
    that task ended at, with a copy of its session as it ended). Either one also waits for that task like a dependency.
    Raises ValidationError; nothing is written then.
    """
    try:
        return submit_batch([fields])[0]
    except ValidationError as exc:
        # A single submission is not a batch: drop the "task 0 of the batch: " prefix.
        raise type(exc)(str(exc).removeprefix("task 0 of the batch: ")) from None   # a LogFolderTaken stays one


# --------------------------------------------------------------------------------------------
# Reading tasks.


def get_task(task_id: Any) -> dict[str, Any]:
    """One task's public dict with depends_on, notes, questions and its last 20 events.

    Raises ValidationError (bad id) or TaskNotFound.
    """
    num = parse_task_id(task_id)
    with _reading() as conn:
        task = task_dict(_row(conn, num), _deps(conn, num))
        task["notes"] = [
            {"author": r["author"], "text": r["text"], "created_at": iso(r["created_at"]),
             "delivered": r["delivered_marker"] is not None, "delivered_at": iso(r["delivered_at"]),
             "delivered_how": r["delivered_how"]}
            for r in conn.execute("SELECT * FROM notes WHERE task_id = ? ORDER BY id", (num,))
        ]
        task["questions"] = _questions(conn, num)
        task["events"] = [
            _event_dict(r) for r in conn.execute(
                "SELECT * FROM (SELECT * FROM events WHERE task_id = ? ORDER BY id DESC LIMIT 20) AS e"
                " ORDER BY id", (num,))
        ]
    return task


def _questions(conn: Connection, num: int) -> list[dict[str, Any]]:
    return [
        {"attempt": r["attempt"], "question": r["question"], "answer": r["answer"],
         "asked_at": iso(r["asked_at"]), "answered_at": iso(r["answered_at"])}
        for r in conn.execute("SELECT * FROM questions WHERE task_id = ? ORDER BY id", (num,))
    ]


_LIST_COLUMNS = ("id, title, working_dir, repo_url, base_ref, host, pushed_branch, pushed_commit, model, priority,"
                 " status, permission, attempts, handbacks,"
                 " spent_before_retry, max_retries, origin_name, origin_version, origin_kind, created_at, started_at,"
                 " finished_at, heartbeat_at, error, branch, question, timeout_sec,"
                 " json_extract(usage, '$.cost_usd') AS cost_usd, json_extract(result, '$.model') AS ran_model,"
                 " max_cost_usd, max_tokens, paused_for, resume_at,"
                 " round(coalesce(json_extract(usage, '$.cost_usd'), 0)"
                 " + (CASE status WHEN 'running' THEN run_cost_usd ELSE 0 END), 8) AS spent_usd,"
                 " coalesce(json_extract(usage, '$.tokens.total'), 0)"
                 " + (CASE status WHEN 'running' THEN run_tokens ELSE 0 END) AS spent_tokens, "
                 + LIST_RANK + " AS rank")
# PostgreSQL reads the usage JSON with its own operators and rounds a numeric.
_LIST_COLUMNS_PG = (_LIST_COLUMNS
                    .replace("round(coalesce(json_extract(usage, '$.cost_usd'), 0)",
                             "round((coalesce((usage::jsonb ->> 'cost_usd')::float8, 0)")
                    .replace("run_cost_usd ELSE 0 END), 8)", "run_cost_usd ELSE 0 END))::numeric, 8)::float8")
                    .replace("json_extract(usage, '$.cost_usd')", "(usage::jsonb ->> 'cost_usd')::float8")
                    .replace("json_extract(result, '$.model')", "(result::jsonb ->> 'model')")
                    .replace("json_extract(usage, '$.tokens.total')",
                             "(usage::jsonb #>> '{tokens,total}')::float8::bigint"))
_LIST_ORDER = f" ORDER BY {LIST_RANK}, priority DESC, id DESC"
CURSOR_RE = re.compile(r"^([0-3])\.(-?\d{1,4})\.(\d{1,19})$")


def _list_filter(dialect: Dialect, statuses: list[str], origin: str | None,
                 search: str | None) -> tuple[list[str], list[Any]]:
    """``list_tasks``' WHERE terms (ANDed) and their parameters, for ``dialect``."""
    # With finished tasks in the filter (the bulk of a long-lived queue), ``+status`` keeps SQLite on
    # the list-order index (no sort of every match); a filter of live statuses only reads those
    # few rows through the status index and sorts them.
    unary = "+" if "done" in statuses and dialect.index_hints else ""
    where, params = [f"{unary}status IN ({_marks(statuses)})"], list(statuses)
    if set(statuses) == set(STATUSES):  # no filter: a skipped row (offset) never reads its table row
        where, params = [dialect.true_sql], []
    origin = optional(origin)
    if origin:
        where.append("(origin_kind = ? OR origin_name = ?)")
        params += [origin, origin]
    if search is not None and optional(search):
        where.append(f"{dialect.contains_fn}(lower(title), lower(?)) > 0")
        params.append(search)
    return where, params


def list_tasks(
    status: str | Iterable[str] | None = None,
    origin: str | None = None,
    limit: int = 50,
    offset: int = 0,
    search: str | None = None,
    cursor: str | None = None,
) -> dict[str, Any]:
    """A page of tasks: running, waiting, pending, then finished; higher priority first; newest first.

    ``status``: one status, a list, or None for all; ``origin``: a caller kind (claude, chatgpt,
    other) or clientInfo name; ``limit`` 1..500; ``search``: substring of the title. Page either by
    ``cursor`` (the ``next_cursor`` of the previous page: each page costs its own rows, however
    deep) or by ``offset`` ≥ 0 (rows to skip; deep offsets walk the skipped rows).
    Returns ``{"tasks": [...], "total": N, "offset": o, "next_offset": o2 | None,
    "next_cursor": str | None}`` (tasks without instructions/diff/result, to stay small, with
    ``cost_usd`` from the usage (USD, or None), ``ran_model`` the model the last receipt names (or None);
    ``next_offset`` only when paging by offset). ``total`` counts every match (kept per status, so
    cheap unless origin or search is given). Raises ValidationError.
    """
    statuses = _statuses(status)
    limit = coerce_int("limit", limit, 1, 500)
    offset = coerce_int("offset", _or(offset, 0), 0, 10**9)
    cursor = optional(cursor)
    after = _parse_cursor(cursor) if cursor is not None else None
    dialect = _dialect()
    where, params = _list_filter(dialect, statuses, origin, search)
    clause = " AND ".join(where)
    columns = {SQLITE: _LIST_COLUMNS, POSTGRESQL: _LIST_COLUMNS_PG}[dialect]
    with _reading() as conn:
        if len(where) == 1 and dialect.counts_table:
            total = conn.execute(f"SELECT coalesce(sum(n), 0) FROM task_counts WHERE status IN ({_marks(statuses)})",
                                 statuses).fetchone()[0]
        else:
            total = conn.execute(f"SELECT count(*) FROM tasks WHERE {clause}", params).fetchone()[0]
        if after is None:
            rows = conn.execute(f"SELECT {columns} FROM tasks WHERE {clause}{_LIST_ORDER} LIMIT ? OFFSET ?",
                                params + [limit + 1, offset]).fetchall()
        else:
            rows = _rows_after(conn, clause, params, after, limit + 1, columns)
    more, rows = len(rows) > limit, rows[:limit]
    tasks = [_list_row(row) for row in rows]
    last = rows[-1] if rows and more else None
    return {
        "tasks": tasks, "total": total, "offset": offset,
        "next_offset": offset + len(rows) if more and after is None else None,
        "next_cursor": f"{last['rank']}.{last['priority']}.{last['id']}" if last else None,
    }


def list_cursor(task: dict[str, Any]) -> str:
    """The ``cursor`` that continues a ``list_tasks`` page after ``task`` (a dict with ``id``,
    ``status`` and ``priority``, as the page's rows have): for a caller that shows fewer rows than
    it fetched."""
    rank = {"running": 0, "waiting": 1, "pending": 2}.get(task["status"], 3)
    return f"{rank}.{task['priority']}.{parse_task_id(task['id'])}"


def _parse_cursor(cursor: Any) -> tuple[int, int, int]:
    match = CURSOR_RE.match(cursor) if isinstance(cursor, str) else None
    if match is None:
        raise ValidationError(f"cursor {cursor!r} is not one list_tasks returned; pass next_cursor "
                              "exactly as given, or leave it out for the first page")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def _rows_after(conn: Connection, clause: str, params: list, after: tuple[int, int, int],
                limit: int, columns: str = _LIST_COLUMNS) -> list[Row]:
    """Rows after ``(rank, priority, id)`` in list order: three index range reads (the rest of that
    priority, the rest of that rank, the later ranks), each stopping at ``limit`` rows."""
    rank, priority, num = after
    # Each ORDER BY leaves out the terms its WHERE holds constant: SQLite would otherwise sort.
    steps = (
        (f" AND {LIST_RANK} = ? AND priority = ? AND id < ? ORDER BY priority DESC, id DESC", [rank, priority, num]),
        (f" AND {LIST_RANK} = ? AND priority < ? ORDER BY priority DESC, id DESC", [rank, priority]),
        (f" AND {LIST_RANK} > ?{_LIST_ORDER}", [rank]),
    )
    rows: list[Row] = []
    for extra, values in steps:
        if len(rows) >= limit:
            break
        rows += conn.execute(f"SELECT {columns} FROM tasks WHERE {clause}{extra} LIMIT ?",
                             params + values + [limit - len(rows)]).fetchall()
    return rows


def _list_row(row: Row) -> dict[str, Any]:
    task = row_dict(row)
    del task["rank"]
    task["num"], task["id"] = task["id"], format_task_id(task["id"])
    for column in ("created_at", "started_at", "finished_at", "heartbeat_at", "resume_at"):
        task[column] = iso(task[column])
    task["repo"] = task["repo_url"]
    return task


def _statuses(status: str | Iterable[str] | None) -> list[str]:
    status = optional(status)
    if status is None:
        return list(STATUSES)
    several = not isinstance(status, str) or "," in status or status.startswith("[")
    values = coerce_list("status", status) if several else [status]
    for value in values:
        if value not in STATUSES:
            raise ValidationError(f"status {value!r} is not one of {', '.join(STATUSES)}")
    return list(values)


# Tasks per status: SQLite keeps them in task_counts (triggers); PostgreSQL counts (no trigger-kept
# rows there: they would serialise every claim).
_COUNTS = {SQLITE: "SELECT status, n FROM task_counts WHERE status != 'unseen'",
           POSTGRESQL: "SELECT status, count(*) FROM tasks GROUP BY status"}


def counts() -> dict[str, int]:
    """Tasks per status, every status present (zero when none)."""
    with _reading() as conn:
        rows = conn.execute(_COUNTS[_dialect(conn)]).fetchall()
    return dict.fromkeys(STATUSES, 0) | {r[0]: r[1] for r in rows}


# The oldest pending task. PostgreSQL reads its partial index tasks_pending_age; SQLite (which
# dropped that index in migration 9) walks the priorities pending tasks have, highest first, each
# found with one probe of the claim index (status, priority DESC, created_at, id), and takes each
# one's oldest: a few probes, however long the history or the backlog.
_OLDEST_PENDING = {
    POSTGRESQL: "SELECT id, created_at FROM tasks WHERE status = 'pending' ORDER BY created_at, id LIMIT 1",
    SQLITE: """WITH RECURSIVE p(pr) AS (
  SELECT (SELECT max(priority) FROM tasks WHERE status = 'pending')
  UNION ALL
  SELECT (SELECT max(priority) FROM tasks WHERE status = 'pending' AND priority < p.pr) FROM p WHERE p.pr IS NOT NULL)
SELECT t.id, t.created_at FROM p JOIN tasks t ON t.id = (SELECT id FROM tasks WHERE status = 'pending'
  AND priority = p.pr ORDER BY created_at, id LIMIT 1) ORDER BY t.created_at, t.id LIMIT 1""",
}


def queue_summary() -> dict[str, Any]:
    """Counts per status, the oldest pending task (id, age in seconds) and claimable count."""
    with _reading() as conn:
        dialect = _dialect(conn)
        tallies = dict.fromkeys(STATUSES, 0) | dict(conn.execute(_COUNTS[dialect]).fetchall())
        oldest = conn.execute(_OLDEST_PENDING[dialect]).fetchone()
        claimable = conn.execute(f"SELECT count(*) FROM tasks t WHERE {_READY}", {"now": store_now(conn)}).fetchone()[0]
    return {
        "counts": tallies,
        "claimable": claimable,
        "oldest_pending": format_task_id(oldest["id"]) if oldest else None,
        "oldest_pending_age_sec": round(now() - oldest["created_at"], 1) if oldest else None,
    }


# --------------------------------------------------------------------------------------------
# Claim, lease, finish (fenced by the run marker).

# A task retried while the worker of its cancelled attempt still wraps that up (``wrapping_up``)
# waits for it: the next attempt would work in the same worktree or folder.
_READY = """t.status = 'pending' AND (t.not_before IS NULL OR t.not_before <= :now) AND t.wrapping_up IS NULL
 AND NOT EXISTS (SELECT 1 FROM task_deps d JOIN tasks p ON p.id = d.depends_on
                 WHERE d.task_id = t.id AND p.status != 'done')"""
# Claimable by a worker on :host: ready, and meant for any host or for that one.
_CLAIMABLE = _READY + " AND (t.host IS NULL OR t.host = :host)"
# A provider account is held while a task waits for its usage limit's reset: a pending task whose
# model is on that provider (its own model's prefix, or for a task without one the default model's
# provider, :default_account) stays queued until then. Portable SQL (no instr/strpos).
_HELD = """EXISTS (SELECT 1 FROM tasks h WHERE h.status = 'waiting' AND h.paused_for = 'usage_limit'
 AND h.resume_at > :now AND (substr(t.model, 1, length(h.limit_account) + 1) = h.limit_account || '/'
 OR (t.model IS NULL AND h.limit_account = CAST(:default_account AS TEXT))))"""

_CLAIM = f"""
UPDATE tasks SET status = 'running', attempts = attempts + 1, claimed_at = :now, started_at = :now,
       heartbeat_at = :now, lease_owner = :owner, lease_pid = :pid, lease_pid_start = :pid_start, lease_host = :host,
       run_marker = 'br-' || id || '-a' || (attempts + 1), agent_pid = NULL, agent_pid_start = NULL,
       error = NULL, question = NULL, run_cost_usd = 0, run_tokens = 0, paused_for = NULL
 WHERE id = (SELECT t.id FROM tasks t WHERE {_CLAIMABLE} AND NOT {_HELD} AND (:task_id IS NULL OR t.id = :task_id)
             ORDER BY t.priority DESC, t.created_at, t.id LIMIT 1)
RETURNING *
"""
# On PostgreSQL the pick skips rows other claimers hold: many workers claim at once, none waits.
_CLAIM_PG = _CLAIM.replace("(:task_id IS NULL OR t.id = :task_id)",
                           "(CAST(:task_id AS BIGINT) IS NULL OR t.id = :task_id)").replace(
    "LIMIT 1)", "LIMIT 1 FOR UPDATE OF t SKIP LOCKED)")


# The same claim on PostgreSQL as one autocommit statement (a round trip instead of six): the
# server's clock read once (``clock``), the claimed event appended and notified (store_pg.with_event),
# the dependencies read; it claims only while no daily budget is set (``budgeted``, which the row
# reports even when nothing was claimed): a queue with one takes the transaction below, which
# reads today's spend first.
_CLAIM_PG_ALONE = store_pg.with_event(
    _CLAIM_PG.replace(":now", "(SELECT clock_now FROM clock)").replace(
        "(CAST(:task_id AS BIGINT) IS NULL OR t.id = :task_id)", "(SELECT n FROM budgeted) = 0"),
    "claimed", "'attempt ' || changed.attempts || ' by ' || CAST(:owner AS TEXT)",
    before="clock AS (SELECT CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION) AS clock_now),"
           " budgeted AS (SELECT count(*) AS n FROM settings WHERE key IN (:daily_usd, :daily_tokens)"
           " AND value <> ''), ",
    also=", budgeted.n AS budgeted, (SELECT coalesce(array_agg(depends_on ORDER BY depends_on), '{}')"
         " FROM task_deps WHERE task_id = changed.id) AS deps",
    source="budgeted LEFT JOIN changed ON true")


def _task_columns(row: Any) -> Any:
    """A row of a ``store_pg.with_event`` statement as the task's columns alone (a dict that
    ``task_dict`` reads as it reads a row)."""
    task = row_dict(row)
    for name in ("notified", "budgeted", "deps"):
        task.pop(name, None)
    return task


def _claim_alone(owner: str, pid: int | None, pid_start: float | None, host: str,
                 default_account: str | None) -> tuple[dict[str, Any] | None, bool]:
    """``claim_next`` on PostgreSQL in one statement: (the task dict or None, whether a daily
    budget is set: then nothing was claimed, and the caller claims in a transaction that checks
    today's spend)."""
    with _single_write() as conn:
        row = conn.execute(_CLAIM_PG_ALONE, {
            "owner": owner, "pid": pid, "pid_start": pid_start, "host": host, "default_account": default_account,
            "daily_usd": BUDGET_KEYS["daily_usd"], "daily_tokens": BUDGET_KEYS["daily_tokens"],
            "event_ts": now()}).fetchone()
    if row["id"] is None:
        return None, bool(row["budgeted"])
    return task_dict(_task_columns(row), list(row["deps"])), False


def claim_next(owner: str, pid: int | None = None, pid_start: float | None = None,
               task_id: Any = None, default_account: str | None = None) -> dict[str, Any] | None:
    """Atomically claim the best claimable task (priority, then oldest; dependencies done; back-off
    elapsed), or the given ``task_id`` if it is claimable. One ``UPDATE … RETURNING`` in
    ``BEGIN IMMEDIATE``: exactly one claimer wins (on PostgreSQL its pick is ``FOR UPDATE SKIP
    LOCKED``: claimers never wait on one another; without a task_id or a daily budget the claim,
    its event and its wake-up are one autocommit statement, ``_CLAIM_PG_ALONE``).

    ``owner``: a lease owner name (``worker@host``, ``cli:alice``); ``pid``/``pid_start``: the
    claiming process and its start time (psutil create_time, seconds) for the reaper.
    Only tasks for any host or for this one (``host_name()``) are claimed; the lease records the
    claimer's host (``lease_host``), so the reaper checks its pid only on that host.
    A task whose provider account is held by a usage-limit pause (see ``pause_for_limit``) is
    skipped until the reset; ``default_account`` is the provider of the default model, which
    tasks without a model of their own run on.
    Returns the task dict (``run_marker`` names this attempt) or None when nothing is claimable
    (also while the queue's daily budget is spent: see ``budget_state``).
    With ``task_id``: raises TaskNotFound, or InvalidTransition explaining why it is not claimable.
    Raises ValidationError when TASKBRIDGE_HOST is not a plain host name.
    """
    num = parse_task_id(task_id) if task_id is not None else None
    host = host_name()
    if num is None and _dialect() is POSTGRESQL:
        claimed, budgeted = _claim_alone(owner, pid, pid_start, host, default_account)
        if not budgeted:
            return claimed
    with _writing() as conn:
        spent = _budget_spent(conn)
        if spent:
            if num is not None:
                raise InvalidTransition(f"task {format_task_id(num)} waits: {spent}")
            return None
        row = conn.execute(
            {"sqlite": _CLAIM, "postgresql": _CLAIM_PG}[_dialect(conn).name],
            {"now": store_now(conn), "owner": owner, "pid": pid, "pid_start": pid_start, "task_id": num, "host": host,
             "default_account": default_account}
        ).fetchone()
        if row is None:
            if num is not None:
                _explain_unclaimable(conn, num, host, default_account)
            return None
        _event(conn, row["id"], "claimed", f"attempt {row['attempts']} by {owner}")
        deps = _deps(conn, row["id"])
    return task_dict(row, deps)


def _explain_unclaimable(conn: Connection, num: int, host: str, default_account: str | None) -> None:
    row = _row(conn, num)
    name = format_task_id(num)
    if row["status"] != "pending":
        raise InvalidTransition(f"task {name} is {row['status']}; only a pending task can be claimed")
    if row["host"] is not None and row["host"] != host:
        raise InvalidTransition(f"task {name} is for host {row['host']} (its folder is there), and this machine "
                                f"is {host} (TASKBRIDGE_HOST); claim it on {row['host']}")
    blockers = [format_task_id(d) for d in _deps(conn, num)
                if conn.execute("SELECT status FROM tasks WHERE id = ?", (d,)).fetchone()[0] != "done"]
    if blockers:
        raise InvalidTransition(f"task {name} waits for {', '.join(blockers)} to be done")
    held = conn.execute(f"SELECT 1 FROM tasks t WHERE t.id = :id AND {_HELD}",
                        {"id": num, "now": store_now(conn), "default_account": default_account}).fetchone()
    if held:
        raise InvalidTransition(f"task {name} waits for its provider's usage limit to reset (see queue_status's "
                                "held accounts); resume the paused task with answer_task to try now")
    if row["wrapping_up"] is not None:
        raise InvalidTransition(f"task {name} waits: {_wrap_up_wait(row)}")
    raise InvalidTransition(f"task {name} is backing off before its next attempt; try again shortly")


def _wrap_up_wait(row: Row) -> str:
    """What a task retried while its cancelled attempt is wrapped up waits for, in words."""
    return (f"the cancelled attempt {row['wrapping_up']} is still being wrapped up by {row['lease_owner']} (its "
            "receipt, a readonly run's revert, its worktree); the task starts when that is done, in a few seconds, "
            "or when the reaper finds that worker gone")


def _fenced(conn: Connection, num: int, marker: str) -> Row:
    row = _row(conn, num)
    name = format_task_id(num)
    if row["run_marker"] != marker:
        raise StaleAttempt(f"attempt {marker} of task {name} is not the current attempt (current: "
                           f"{row['run_marker']}, task is {row['status']}); the worker's record of it was refused")
    if row["status"] != "running":
        raise StaleAttempt(f"attempt {marker} of task {name} was ended from outside: the task is "
                           f"now {row['status']}; the worker's record of it was refused")
    return row


def renew_lease(task_id: Any, marker: str, **fields: Any) -> None:
    """Renew the lease of a running attempt (heartbeat now) and record optional run facts:
    ``agent_pid``, ``agent_pid_start`` (s), ``session_id``, ``worktree_path``, ``branch``,
    ``base_commit``, ``line_base`` (where a follow-up's line of work started), ``pushed_branch`` and
    ``pushed_commit`` (a task on a remote: what its worker pushed there). Raises StaleAttempt
    when the attempt is no longer current (reaped, cancelled): the caller must stop the run."""
    allowed = {"agent_pid", "agent_pid_start", "session_id", "worktree_path", "branch", "base_commit",
               "line_base", "pushed_branch", "pushed_commit"}
    bad = set(fields) - allowed
    if bad:
        raise ValidationError(f"renew_lease cannot set {', '.join(sorted(bad))}")
    num = parse_task_id(task_id)
    sets = "".join(f", {k} = :{k}" for k in sorted(fields))
    # One fenced statement: on PostgreSQL in autocommit, one round trip and one row lock held for
    # the statement alone (a fleet renews every few seconds per running task).
    # The server's clock on PostgreSQL (see store_now) read inside the statement, not a trip of its own.
    with _single_write() as conn:
        # PgConnection retries this fenced (so idempotent) statement once on a new connection.
        renewed = getattr(conn, "execute_idempotent", conn.execute)(
            f"UPDATE tasks SET heartbeat_at = {_dialect(conn).clock_sql}{sets} WHERE id = :id AND run_marker = :marker"
            " AND status = 'running' RETURNING id", fields | {"now": now(), "id": num, "marker": marker}
        ).fetchone()
    if renewed is None:
        check_attempt(num, marker)   # raises TaskNotFound or StaleAttempt, naming why
        raise StaleAttempt(f"attempt {marker} of task {format_task_id(num)} is not current; its renewal was refused")


def check_attempt(task_id: Any, marker: str) -> None:
    """A read (no write lock): raises StaleAttempt when the attempt ``marker`` is no longer the
    task's running one (cancelled, reaped, superseded), naming why; TaskNotFound when the task is
    gone. Returns when it is still current."""
    with _reading() as conn:
        _fenced(conn, parse_task_id(task_id), marker)


def heartbeat(task_id: Any, owner: str | None = None) -> dict[str, Any]:
    """A person's heartbeat on a task they claimed by hand: renews the lease of the running attempt.
    Raises TaskNotFound, or InvalidTransition when the task is not running."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        row = _row(conn, num)
        if row["status"] != "running":
            raise InvalidTransition(f"task {format_task_id(num)} is {row['status']}, not running; nothing to renew")
        if owner and row["lease_owner"] != owner:
            raise InvalidTransition(f"task {format_task_id(num)} is leased by {row['lease_owner']}, not {owner}")
        conn.execute("UPDATE tasks SET heartbeat_at = ? WHERE id = ?", (store_now(conn), num))
        return task_dict(_row(conn, num))


# complete_attempt's write on PostgreSQL as one autocommit statement, fenced in its WHERE; with
# ``usage`` it goes ahead only while the task's usage is still the one read to sum it (:old_usage).
_COMPLETE_PG = store_pg.with_event(
    "UPDATE tasks SET status = 'done', finished_at = :finished_at, result = :result, diff = :diff,"
    " usage = coalesce(CAST(:usage AS TEXT), usage), session_id = coalesce(CAST(:session_id AS TEXT), session_id),"
    " error = NULL WHERE id = :id AND run_marker = :marker AND status = 'running'"
    " AND (CAST(:usage AS TEXT) IS NULL OR usage IS NOT DISTINCT FROM CAST(:old_usage AS TEXT)) RETURNING *",
    "done", "CAST(:summary AS TEXT)")


def _complete_alone(num: int, marker: str, fields: dict[str, Any], usage: dict | None) -> dict[str, Any] | None:
    """``complete_attempt`` on PostgreSQL without a transaction: one fenced statement (with
    ``usage`` a read of the usage so far before it). None when the fence or the usage check
    refused it: the caller's transaction then finishes it or says why not."""
    with _single_write() as conn:
        old = total = None
        if usage is not None:
            row = conn.execute("SELECT usage, attempts FROM tasks WHERE id = ? AND run_marker = ?",
                               (num, marker)).fetchone()
            if row is None:
                return None
            old, total = row["usage"], _total_usage(row, usage)
        row = conn.execute(_COMPLETE_PG, fields | {"id": num, "marker": marker, "usage": total, "old_usage": old,
                                                   "finished_at": now(), "event_ts": now()}).fetchone()
    return None if row is None else task_dict(_task_columns(row))


def complete_attempt(task_id: Any, marker: str, *, result: dict | None = None, diff: str | None = None,
                     usage: dict | None = None, session_id: str | None = None) -> dict[str, Any]:
    """Finish the attempt ``marker`` as done with its receipt (``result``), ``diff`` text and
    ``usage`` (tokens, cost_usd). Raises StaleAttempt if the attempt was superseded."""
    num = parse_task_id(task_id)
    result_json, summary = _json(result), event_text((result or {}).get("summary") or "", "the receipt")
    if _dialect() is POSTGRESQL:
        done = _complete_alone(num, marker, {"result": result_json, "diff": diff, "session_id": session_id,
                                             "summary": summary}, usage)
        if done is not None:
            return done
    with _writing() as conn:
        row = _fenced(conn, num, marker)
        row = conn.execute(
            "UPDATE tasks SET status = 'done', finished_at = ?, result = ?, diff = ?, usage = ?,"
            " session_id = coalesce(?, session_id), error = NULL WHERE id = ? RETURNING *",
            (now(), result_json, diff, _usage_after(row, usage), session_id, num),
        ).fetchone()
        _event(conn, num, "done", summary)
    return task_dict(row)


# The worker's record of an attempt, one keyword-only field an argument (worker.py names each).
def fail_attempt(task_id: Any, marker: str, error: str, *, retryable: bool = True,  # noqa: PLR0913
                 result: dict | None = None, diff: str | None = None, usage: dict | None = None,
                 session_id: str | None = None, pin_host: bool = False) -> dict[str, Any]:
    """Finish the attempt ``marker`` as failed with ``error`` (the specific reason). If
    ``retryable`` and attempts ≤ max_retries, the task goes back to ``pending`` after a short
    bounded back-off (each retry gets the full timeout again); else it is ``failed`` and its
    dependents fail too, naming it. ``pin_host``: this attempt's machine keeps work the task
    needs (a commit a failed push left in its worktree), so a task that may run anywhere is pinned
    to it (``host`` = ``lease_host``, as a question pins it): a retry runs only there.
    Raises StaleAttempt if the attempt was superseded."""
    num = parse_task_id(task_id)
    error = _error_kept_whole(num, marker, error)
    with _writing() as conn:
        row = _fenced(conn, num, marker)
        values = (error, _json(result), diff, _usage_after(row, usage), session_id, num)
        if pin_host:
            conn.execute("UPDATE tasks SET host = coalesce(host, lease_host) WHERE id = ?", (num,))
        if retryable and retries_left(row):
            backoff = min(RETRY_BACKOFF_SEC[0] * 2 ** max(_counted_attempts(row) - 1, 0), RETRY_BACKOFF_SEC[1])
            conn.execute(
                "UPDATE tasks SET status = 'pending', not_before = ?, error = ?, result = ?, diff = ?,"
                " usage = ?, session_id = coalesce(?, session_id), lease_owner = NULL WHERE id = ?",
                (store_now(conn) + backoff,) + values,
            )
            said = event_text(error, "the task's error", 400)
            _event(conn, num, "retry", f"attempt {row['attempts']} failed: {said}")
        else:
            conn.execute(
                "UPDATE tasks SET status = 'failed', finished_at = ?, error = ?, result = ?, diff = ?,"
                " usage = ?, session_id = coalesce(?, session_id) WHERE id = ?",
                (now(),) + values,
            )
            _event(conn, num, "failed", event_text(error, "the task's error"))
            _fail_dependents(conn, num, "failed")
        return task_dict(_row(conn, num))


def _error_kept_whole(num: int, marker: str, error: str) -> str:
    """``error`` as the task stores it: whole up to ERROR_MAX characters; a longer one is written
    whole to the task's log first (a hand-claimed task has no log until then) and stored clipped,
    its note naming that log, or saying why it could not be written there."""
    if len(error) <= ERROR_MAX:
        return error
    where = f"the task's log, {task_log_location(num)}"
    try:
        append_task_log(num, f"\n[worker] attempt {marker} failed; its whole error ({len(error):,} characters, "
                             f"stored clipped to {ERROR_MAX:,}):\n{error}\n".encode())
    except (OSError, TaskStoreError) as exc:
        where = f"no file: writing it to the task's log failed ({exc})"
    return clip(error, ERROR_MAX, where)


def pause_for_question(task_id: Any, marker: str, question: str, *, session_id: str | None = None,
                       result: dict | None = None, usage: dict | None = None,
                       paused_for: str | None = None, ask: dict | None = None) -> dict[str, Any]:
    """The agent asked a question: the attempt ends ``waiting`` with the question stored (kept in
    order with earlier ones), the worktree and OpenCode session kept for the resume.
    ``paused_for`` (``task_limit`` or ``daily_budget``): the worker paused it at a spending limit
    and the question is the worker's (see ``answer_task``); ``permission``: a call matched an
    ``ask`` rule, and ``ask`` is the request (``{"tool", "subject", "reason"}``).
    A task on a remote that may run on any host is pinned to the host of this attempt's worker
    (``host`` = ``lease_host``): its worktree and session are there, so the resume runs there.
    Raises StaleAttempt if the attempt was superseded."""
    num = parse_task_id(task_id)
    question = _text("question", question, ANSWER_MAX)
    with _writing() as conn:
        _to_waiting(conn, num, marker, question, session_id, result, usage, paused_for, ask)
        return task_dict(_row(conn, num))


# The columns a pause writes, one an argument, as its two public callers take them.
def _to_waiting(conn: Connection, num: int, marker: str, question: str,  # noqa: PLR0913
                session_id: str | None,
                result: dict | None, usage: dict | None, paused_for: str | None, ask: dict | None) -> None:
    row = _fenced(conn, num, marker)
    conn.execute(
        "UPDATE tasks SET status = 'waiting', question = ?, answer = NULL, result = ?, usage = ?,"
        " session_id = coalesce(?, session_id), handbacks = handbacks + 1, paused_for = ?,"
        " pending_ask = ?, host = coalesce(host, lease_host) WHERE id = ?",
        (question, _json(result), _usage_after(row, usage), session_id, paused_for, _json(ask), num),
    )
    conn.execute(
        "INSERT INTO questions (task_id, attempt, question, asked_at) VALUES (?, ?, ?, ?)",
        (num, row["attempts"], question, now()),
    )
    _event(conn, num, "paused" if paused_for else "waiting", question[:500])


# The worker's record of the pause, one keyword-only field an argument (worker.py names each).
def pause_for_limit(task_id: Any, marker: str, question: str, *, account: str, said: str,  # noqa: PLR0913
                    resume_at: float | None, known_reset: bool, session_id: str | None = None,
                    result: dict | None = None, usage: dict | None = None) -> dict[str, Any]:
    """The model's provider reported a usage limit: the attempt ends ``waiting`` with
    ``paused_for`` ``usage_limit`` and ``question`` (the worker's words: provider, what it said, the
    resume time), without spending the retry budget; the worktree and OpenCode session are kept.
    ``account``: the provider id, held (see ``claim_next``) until ``resume_at`` (epoch seconds), when
    ``resume_due`` resumes the task by itself; ``resume_at`` None: no resume by itself, the planner
    is asked. ``said``: the provider's words; ``known_reset``: the provider gave the reset time
    (else ``limit_rounds`` grows, and with it the worker's back-off). The pause is added to
    ``limit_pauses`` ({"at", "until", "provider", "said"}). Raises StaleAttempt if superseded."""
    num = parse_task_id(task_id)
    question = _text("question", question, ANSWER_MAX)
    with _writing() as conn:
        _to_waiting(conn, num, marker, question, session_id, result, usage, "usage_limit", None)
        row = _row(conn, num)
        pauses = (json.loads(row["limit_pauses"]) if row["limit_pauses"] else [])[-49:]
        pauses.append({"at": iso(now()), "until": iso(resume_at), "provider": account, "said": said[:1000]})
        conn.execute("UPDATE tasks SET resume_at = ?, limit_account = ?, limit_pauses = ?,"
                     " limit_rounds = CASE WHEN ? THEN 0 ELSE limit_rounds + 1 END WHERE id = ?",
                     (resume_at, account, json.dumps(pauses), known_reset, num))
        return task_dict(_row(conn, num))


LIMIT_RESUMED = ("TaskBridge paused your run because the model provider's usage limit was reached "
                 "(this was not a question of yours); {how}. Carry on with the task where you stopped.")


def resume_due(at: float | None = None) -> list[dict[str, Any]]:
    """Tasks paused at a usage limit whose ``resume_at`` has come (by ``at``, epoch seconds; now by
    default) go back to ``pending``: their next attempt resumes the same OpenCode session. Each
    writes a ``resumed`` event; their pause in ``limit_pauses`` gets ``resumed_at``. Returns them."""
    at = now() if at is None else at
    with _reading() as conn:   # a read each worker turn; the write only when one is due
        due = conn.execute("SELECT id FROM tasks WHERE status = 'waiting' AND paused_for = 'usage_limit'"
                           " AND resume_at IS NOT NULL AND resume_at <= ?", (at,)).fetchall()
    if not due:
        return []
    resumed = []
    with _writing() as conn:
        for (num,) in due:
            row = _row(conn, num)
            if row["status"] == "waiting" and row["paused_for"] == "usage_limit" and row["resume_at"] is not None \
                    and row["resume_at"] <= at:
                _resume_limit(conn, row, "the limit's reset time has passed", "at its reset")
                resumed.append(task_dict(_row(conn, num)))
    return resumed


def _resume_limit(conn: Connection, row: Row, how: str, by: str) -> None:
    """A usage-limit pause ends: ``pending`` again with the message the resumed session gets."""
    pauses = json.loads(row["limit_pauses"]) if row["limit_pauses"] else []
    if pauses:
        pauses[-1]["resumed_at"] = iso(now())
        pauses[-1]["resumed"] = by
    conn.execute("UPDATE tasks SET status = 'pending', answer = ?, not_before = NULL, paused_for = NULL,"
                 " resume_at = NULL, limit_pauses = ? WHERE id = ?",
                 (LIMIT_RESUMED.format(how=how), json.dumps(pauses), row["id"]))
    conn.execute("UPDATE questions SET answer = ?, answered_at = ? WHERE id = "
                 "(SELECT max(id) FROM questions WHERE task_id = ?) AND answer IS NULL",
                 (f"(resumed {by})", now(), row["id"]))
    _event(conn, row["id"], "resumed", f"usage limit pause over: resumed {by}")


def held_accounts(at: float | None = None) -> list[dict[str, Any]]:
    """Provider accounts held by usage-limit pauses now (or at ``at``, epoch seconds):
    ``[{"account", "until": ISO time of the latest reset, "tasks": [ids]}]``, soonest first."""
    at = now() if at is None else at
    with _reading() as conn:
        rows = conn.execute("SELECT limit_account, resume_at, id FROM tasks WHERE status = 'waiting'"
                            " AND paused_for = 'usage_limit' AND resume_at > ? ORDER BY resume_at, id",
                            (at,)).fetchall()
    held: dict[str, dict[str, Any]] = {}
    for account, until, num in rows:
        entry = held.setdefault(account, {"account": account, "until": until, "tasks": []})
        entry["until"] = max(entry["until"], until)
        entry["tasks"].append(format_task_id(num))
    return [{**h, "until": iso(h["until"])} for h in sorted(held.values(), key=lambda h: h["until"])]


def answer_task(task_id: Any, answer: str, author: str = "planner") -> dict[str, Any]:
    """Answer a waiting task's question: it goes back to ``pending`` and its next attempt resumes
    the same OpenCode session with the answer.

    A task paused at a spending limit (``paused_for``) reads the answer (see ``parse_limit_answer``):
    ``stop`` fails it with its receipt kept; an amount (``continue, up to $2``, ``2.50``,
    ``50000 tokens``) raises its limit and resumes it; a bare ``continue`` resumes it only when its
    own limit is no longer reached (and, after a pause for the daily budget, when the budget is
    no longer spent).
    Raises TaskNotFound, ValidationError (empty answer; a limit not above the spend; a bare
    continue at a reached limit) or InvalidTransition (task not waiting)."""
    num = parse_task_id(task_id)
    answer = _text("answer", answer, ANSWER_MAX)
    with _writing() as conn:
        row = _row(conn, num)
        if row["status"] != "waiting":
            name = format_task_id(num)
            # A failed or cancelled task takes no follow-up until it is retried and done.
            way_out = (f"continue_from {name} submits a follow-up in its session" if row["status"] == "done" else
                       f"retry_task {name} runs it again; a follow-up can continue it once it is done"
                       if row["status"] in TERMINAL else
                       "add_task_note reaches a running task before its next model call, a pending one when it starts")
            raise InvalidTransition(f"task {name} is {row['status']}, not waiting; only a task that asked a "
                                    f"question takes an answer ({way_out})")
        resume: str | None   # None: stopped at its limit
        if row["paused_for"] == "permission":
            resume = _answer_permission(conn, row, answer)
        elif row["paused_for"] == "usage_limit":
            resume = _answer_usage_pause(conn, row, answer, author)
            if resume == "":   # resumed now, with its record kept
                return task_dict(_row(conn, num))
        else:
            resume = _answer_limit_pause(conn, row, answer, author) if row["paused_for"] else answer
        conn.execute(
            "UPDATE questions SET answer = ?, answered_at = ? WHERE id = "
            "(SELECT max(id) FROM questions WHERE task_id = ?)",
            (answer, now(), num),
        )
        if resume is None:   # stopped at its limit: failed, receipt kept
            return task_dict(_row(conn, num))
        conn.execute(
            "UPDATE tasks SET status = 'pending', answer = ?, not_before = NULL, paused_for = NULL"
            " WHERE id = ?", (resume, num)
        )
        _event(conn, num, "answered", f"by {author}: {answer[:400]}")
        return task_dict(_row(conn, num))


def _answer_usage_pause(conn: Connection, row: Row, answer: str, author: str) -> str | None:
    """A planner's answer to a usage-limit pause: ``stop`` fails the task (its receipt kept; None);
    anything else resumes it now (the answer reaches the session); returns "" once resumed."""
    if _STOP_WORDS.match(answer):
        why = f"stopped at its provider's usage limit by {author}"
        conn.execute("UPDATE tasks SET status = 'failed', finished_at = ?, paused_for = NULL, resume_at = NULL,"
                     " error = ? WHERE id = ?", (now(), why, row["id"]))
        _event(conn, row["id"], "failed", why)
        _fail_dependents(conn, row["id"], "failed")
        return None
    _resume_limit(conn, row, f"{author} resumed it before the reset, saying {answer.strip()[:200]!r}", f"by {author}")
    conn.execute("UPDATE tasks SET limit_rounds = 0 WHERE id = ?", (row["id"],))
    conn.execute("UPDATE questions SET answer = ?, answered_at = ? WHERE id = "
                 "(SELECT max(id) FROM questions WHERE task_id = ?)", (answer, now(), row["id"]))
    return ""


def literal_pattern(subject: str) -> str:
    """A rule pattern that matches exactly ``subject``: its ``*``, ``?`` and ``\\`` escaped with a
    backslash (the plugin's matcher, ``wildcard`` in opencode_plugins/permission_rules.js), so an
    ``always`` answer never turns a command holding them into a wildcard."""
    return re.sub(r"([\\*?])", r"\\\1", subject)


# The whole answer, a full stop at most after it: "allow twice" or "allow? no - deny always" is no
# decision to guess at (its first word decided it once).
PERMISSION_ANSWER = re.compile(r"^\s*(allow|deny)(?:\s+(once|always))?\s*\.?\s*$", re.IGNORECASE)


def _answer_permission(conn: Connection, row: Row, answer: str) -> str:
    """A task paused on a permission ask reads ``allow`` / ``deny``, each ``once`` (default) or
    ``always`` (for this task, and the follow-ups and forks that inherit its rules: a rule for
    exactly that request, or for each of the commands the ask names in ``commands``, is added
    after its own rules).
    The decision goes into ``pending_ask`` for the resumed attempt; returns the answer to store.
    Raises ValidationError for any other answer."""
    match = PERMISSION_ANSWER.match(answer)
    if match is None:
        raise ValidationError(f"task {format_task_id(row['id'])} waits on a permission: answer allow once, "
                              f"allow always, deny once or deny always, alone (not {answer.strip()[:80]!r})")
    decision, scope = match.group(1).lower(), (match.group(2) or "once").lower()
    ask = json.loads(row["pending_ask"] or "{}")
    if scope == "always" and ask.get("tool") and ask.get("subject") is not None:
        rules = json.loads(row["rules"] or "{}")
        block = rules.get(ask["tool"])
        block = dict(block) if isinstance(block, dict) else {"*": block} if block else {}
        # A bash ask names the commands of its line the rules marked ask (the worker's reading).
        for subject in ask.get("commands") or [ask["subject"]]:
            exact = literal_pattern(str(subject))
            block.pop(exact, None)
            block[exact] = decision   # last: it wins over the task's earlier patterns
        rules[ask["tool"]] = block
        conn.execute("UPDATE tasks SET rules = ? WHERE id = ?", (json.dumps(rules), row["id"]))
    ask["decision"] = f"{decision} {scope}"
    conn.execute("UPDATE tasks SET pending_ask = ? WHERE id = ?", (json.dumps(ask), row["id"]))
    return answer


def requeue_attempt(task_id: Any, marker: str, reason: str, *, count_attempt: bool = True,
                    usage: dict | None = None) -> dict[str, Any]:
    """Hand a running attempt back (reaper: stale lease; worker shutdown; a kept server that died).
    Requeued as pending, or failed when retries are spent (``count_attempt=False`` hands it back
    without spending one). The attempt's spend stays in the task's usage: ``usage`` (tokens,
    cost_usd, steps, as ``EventStream.usage``) when the worker counted it, else what its meter
    last recorded (``record_spend``). Fenced: raises StaleAttempt if ``marker`` is not current,
    so a task is requeued exactly once."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        row = _fenced(conn, num, marker)
        total = _usage_after(row, usage)
        if count_attempt and not retries_left(row):
            conn.execute(
                "UPDATE tasks SET status = 'failed', finished_at = ?, error = ?, usage = ? WHERE id = ?",
                (now(), reason, total, num),
            )
            _event(conn, num, "failed", reason[:500])
            _fail_dependents(conn, num, "failed")
        else:
            conn.execute(
                "UPDATE tasks SET status = 'pending', error = ?, lease_owner = NULL, usage = ?,"
                " handbacks = handbacks + ? WHERE id = ?",
                (reason, total, 0 if count_attempt else 1, num),
            )
            _event(conn, num, "requeued", reason[:500])
        return task_dict(_row(conn, num))


def retries_left(task: Row | dict[str, Any]) -> bool:
    """Whether a failure of ``task``'s current attempt (a row, or the dict of get_task) would put
    it back in the queue rather than fail it. Only failures spend retries: a hand-back (worker
    shutdown) or an attempt that ended asking a question is counted in handbacks. Attempt
    numbers stay unique for fencing."""
    return _counted_attempts(task) <= task["max_retries"]


def _counted_attempts(row: Row | dict[str, Any]) -> int:
    """Attempts that spent the retry budget: neither hand-backs nor those before a retry_task."""
    return row["attempts"] - row["handbacks"] - row["spent_before_retry"]


RETRYABLE = ("failed", "cancelled")


def retry_task(task_id: Any, *, model: str | None = None, note: str | None = None,
               author: str = "planner") -> dict[str, Any]:
    """Requeue a failed or cancelled task with a fresh budget: it is pending again, its next
    attempt starts a new OpenCode session on a fresh worktree from the checkout's HEAD at that
    time (or its dependency's commit), and it may fail ``max_retries`` more
    times before it fails for good (attempt numbers go on, so run markers stay unique). ``model``
    (``provider/model``) replaces the task's model; ``note`` reaches the agent's next prompt as a
    note by ``author``. Tasks that failed only because this one failed or was cancelled
    (``dependency t_0001 failed``) are requeued too, as far down as that goes. A task on a remote
    whose push failed stays pinned to the host that keeps its commit (``fail_attempt``'s
    ``pin_host``): that host's worker pushes the commit again without running the agent.

    One transaction with a ``retried`` event row (and a ``note`` event). Returns the task dict
    plus ``requeued_dependents`` (ids). Raises TaskNotFound, ValidationError (bad model, empty or
    too long note), InvalidTransition (the task is not failed or cancelled, or one of its
    dependencies is: it would wait for that forever; or it is a follow-up whose task another live
    follow-up continues now: both would run in one worktree). A dependent follow-up whose line
    has gone on with another follow-up stays failed."""
    num = parse_task_id(task_id)
    model = validate_model(model)
    note = None if note is None else _text("note", note, NOTE_MAX)
    author = _text("author", author, 100)
    with _writing() as conn:
        row = _row(conn, num)
        if row["status"] not in RETRYABLE:
            raise InvalidTransition(_not_retryable(num, row["status"]))
        blocked = _ended_dependency(conn, num)
        if blocked is not None:   # pending again it would wait for a dependency that never finishes
            dep = format_task_id(blocked["id"])
            raise InvalidTransition(
                f"task {format_task_id(num)} depends on {dep}, which is {blocked['status']}, so it could never "
                f"start: retry {dep} (retry_task {dep}; the tasks that failed because of it are requeued with it), "
                f"or submit this work again without that dependency")
        if row["continue_from"] is not None and (other := _live_follower(conn, row["continue_from"], num)):
            parent, follower = format_task_id(row["continue_from"]), format_task_id(other)
            done = _row(conn, other)["status"] == "done"
            raise InvalidTransition(
                f"task {format_task_id(num)} continues {parent}, which {follower} "
                + (f"continued since (done: the line goes on from it); submit this work as a follow-up of "
                   f"{follower} (continue_from {follower})" if done else
                   f"continues now (a line of work has one live follow-up: both would run in the same worktree); "
                   f"cancel {follower} first, or submit this work as a follow-up of {follower} "
                   f"(continue_from {follower})"))
        _requeue_fresh(conn, row, model)
        if note is not None:
            conn.execute("INSERT INTO notes (task_id, author, text, created_at) VALUES (?, ?, ?, ?)",
                         (num, author, note, now()))
            _event(conn, num, "note", f"{author}: {note[:400]}")
        said = f"by {author}: was {row['status']}; fresh budget of {row['max_retries'] + 1} attempt(s)"
        waits = _wrap_up_wait(row) if row["wrapping_up"] is not None else None
        _event(conn, num, "retried", (said + (f"; model {model}" if model else "")
                                      + (f"; it waits: {waits}" if waits else ""))[:500])
        dependents = _requeue_dependents(conn, num)
        return task_dict(_row(conn, num), _deps(conn, num)) | {
            "requeued_dependents": [format_task_id(d) for d in dependents], "waits": waits}


def _not_retryable(num: int, status: str) -> str:
    ident = format_task_id(num)
    if status == "done":
        return (f"task {ident} is done; only a failed or cancelled task can be retried (submit a "
                "follow-up task to change its work)")
    return (f"task {ident} is {status}, not failed or cancelled, so there is nothing to retry "
            f"(cancel it first to start it over)")


def _requeue_fresh(conn: Connection, row: Row, model: str | None) -> None:
    # The OpenCode session, question, answer and base commit go: the next attempt starts afresh
    # from the checkout's HEAD as it is then (the person may have fixed what made it fail); the
    # branch name stays, and the worker moves it there when that loses no commit. A cancelled
    # attempt still wrapped up keeps its lease (its worker, for _wrap_up_wait and the reaper).
    # The last attempt's receipt and diff are kept among the earlier ones (the next attempt's
    # take their place; its worktree, which held that work, goes or is set aside).
    conn.execute(
        "UPDATE tasks SET status = 'pending', model = coalesce(?, model), not_before = NULL, earlier_receipts = ?,"
        " finished_at = NULL, lease_owner = CASE WHEN wrapping_up IS NULL THEN NULL ELSE lease_owner END,"
        " lease_pid = CASE WHEN wrapping_up IS NULL THEN NULL ELSE lease_pid END,"
        " lease_pid_start = CASE WHEN wrapping_up IS NULL THEN NULL ELSE lease_pid_start END,"
        " agent_pid = NULL, agent_pid_start = NULL, session_id = NULL, question = NULL,"
        " answer = NULL, base_commit = NULL, result_seen_at = NULL, spent_before_retry = attempts - handbacks"
        " WHERE id = ?",
        (model, _with_earlier(row, row["result"], row["diff"]), row["id"]),
    )


def _ended_dependency(conn: Connection, num: int) -> Row | None:
    """The first dependency of task ``num`` that failed or was cancelled (``id``, ``status``), or
    None: a task pending with one would wait for it for good."""
    deps = _deps(conn, num)
    return conn.execute(f"SELECT id, status FROM tasks WHERE id IN ({_marks(deps)})"
                        " AND status IN ('failed', 'cancelled') ORDER BY id", deps).fetchone() if deps else None


def _requeue_dependents(conn: Connection, num: int) -> list[int]:
    """Requeue the tasks that failed because ``num`` failed or was cancelled (and theirs), but
    those with another dependency failed or cancelled (they stay failed, naming the first)."""
    requeued, parents = [], [num]
    while parents:
        parent = parents.pop()
        reasons = [f"dependency {format_task_id(parent)} {why}" for why in ("failed", "cancelled")]
        rows = conn.execute(
            "SELECT t.* FROM task_deps d JOIN tasks t ON t.id = d.task_id"
            " WHERE d.depends_on = ? AND t.status = 'failed' AND t.error IN (?, ?)", (parent, *reasons)
        ).fetchall()
        for row in rows:
            if _ended_dependency(conn, row["id"]) is not None:   # it still waits on another that failed
                continue
            if row["continue_from"] is not None and _live_follower(conn, row["continue_from"], row["id"]):
                continue   # its line of work has gone on with another follow-up: it stays failed

            _requeue_fresh(conn, row, None)
            _event(conn, row["id"], "retried", f"its dependency {format_task_id(num)} was retried")
            requeued.append(row["id"])
            parents.append(row["id"])
    return requeued


def stale_leases(stale_after_sec: float, slack_sec: float = 60, host: str | None = None) -> list[dict[str, Any]]:
    """Running tasks whose lease is stale: heartbeat older than ``stale_after_sec`` seconds, or —
    for a lease held on ``host`` (default ``host_name()``; or with no lease_host, from before
    hosts were recorded) — running past ``timeout_sec + slack_sec`` since the attempt started.
    A lease held on another host is judged by its heartbeat age only: its worker's own
    supervision ends an attempt past its timeout, and one whose heartbeat is fresh is alive."""
    host = host or host_name()
    with _reading() as conn:
        at = store_now(conn)
        rows = conn.execute(
            "SELECT * FROM tasks WHERE status = 'running' AND (heartbeat_at < :cut"
            " OR (started_at + timeout_sec + :slack < :now AND (lease_host IS NULL OR lease_host = :host)))",
            {"cut": at - stale_after_sec, "slack": slack_sec, "now": at, "host": host},
        ).fetchall()
    return [task_dict(r) for r in rows]


def running_leases() -> list[dict[str, Any]]:
    """Every running task with its lease (owner, pid and pid start time, run marker): the reaper
    also requeues one whose worker process on this host is gone, without waiting for staleness."""
    with _reading() as conn:
        rows = conn.execute("SELECT * FROM tasks WHERE status = 'running' ORDER BY id").fetchall()
    return [task_dict(r) for r in rows]


def cancel_task(task_id: Any, reason: str = "cancelled") -> dict[str, Any]:
    """Cancel a pending, waiting or running task (a running attempt is fenced off at once; its
    worker notices at its next lease renewal, about a second, and kills the run). Dependents fail,
    naming it; a running attempt's spend so far (its meter's last record) stays in the task's
    usage. The returned dict's ``kept`` says where the work stays (branch, a waiting task's
    worktree) or is None. Raises TaskNotFound, ValidationError (reason empty, not text, over
    NOTE_MAX characters) or InvalidTransition (already finished)."""
    num = parse_task_id(task_id)
    reason = _text("reason", reason, NOTE_MAX)
    with _writing() as conn:
        row = _row(conn, num)
        if row["status"] in TERMINAL:
            raise InvalidTransition(f"task {format_task_id(num)} is already {row['status']}; nothing to cancel")
        # A worker's running attempt stays held (wrapping_up) until that worker has observed it
        # (end_wrap_up): a retry's next attempt waits for it. A hand claim has no worker to wait for;
        # a task retried while its last cancelled attempt is wrapped up stays held by it.
        held = row["run_marker"] if row["status"] == "running" and _worker_lease(row) else None
        conn.execute(
            "UPDATE tasks SET status = 'cancelled', finished_at = ?, error = ?, usage = ?"
            + (", wrapping_up = ?" if held else "") + " WHERE id = ?",
            (now(), reason, _usage_after(row, None), *([held] if held else []), num),
        )
        kept = _kept_work(row)
        _event(conn, num, "cancelled", f"was {row['status']}: {reason}{'; ' + kept if kept else ''}"[:500])
        _fail_dependents(conn, num, "cancelled")
        return task_dict(_row(conn, num)) | {"kept": kept}


def record_cancelled_receipt(task_id: Any, marker: str, result: dict, diff: str | None,
                             session_id: str | None = None) -> bool:
    """Record the receipt of the attempt ``marker`` that a cancel ended while it ran: what the
    agent had changed by then (``result``, a receipt's JSON (receipt.Receipt.to_json):
    files_touched, commands, its words; ``diff``, git's diff of its uncommitted work, or None)
    and its OpenCode session, since the worker removes its worktree. The usage is not touched
    (cancel_task kept the meter's spend). Fenced: only while the task is still cancelled with
    that attempt's marker, or retried while that attempt is wrapped up (``wrapping_up``: its next
    attempt has not started). It does not end the wrap-up: the worker does, once the worktree is
    dealt with (end_wrap_up). Returns whether it was recorded. Raises TaskNotFound."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        row = _row(conn, num)
        if row["run_marker"] != marker or (row["status"] != "cancelled" and row["wrapping_up"] != marker):
            return False
        # Retried already (its next attempt waits for this wrap-up): kept among the earlier
        # receipts too, as _requeue_fresh keeps one recorded before the retry.
        earlier = _with_earlier(row, _json(result), diff, status="cancelled") if row["status"] != "cancelled" \
            else row["earlier_receipts"]
        conn.execute("UPDATE tasks SET result = ?, diff = ?, session_id = coalesce(?, session_id), earlier_receipts = ?"
                     " WHERE id = ? AND run_marker = ? AND (status = 'cancelled' OR wrapping_up = ?)",
                     (_json(result), diff, session_id, earlier, num, marker, marker))
        files = result.get("files_touched") or []
        _event(conn, num, "receipt", f"the cancelled attempt {marker} had changed {len(files)} file(s); its "
                                     "receipt and diff are kept (its worktree goes)"[:500])
    return True


EARLIER_KEPT = 5   # earlier attempts' receipts a task keeps (earlier_receipts), the newest


def _with_earlier(row: Row, result: str | None, diff: str | None, status: str | None = None) -> str | None:
    """``row``'s earlier_receipts (JSON) with a receipt (``result``: its JSON text; ``diff``) added
    last, the last EARLIER_KEPT kept: ``{"attempt", "status", "ended_at", "result", "diff"}``.
    The attempt is the one the receipt names (a worker's receipt.Receipt holds its ``attempt``
    number: a cancelled attempt's receipt may land after the retry, and the row then still
    holds an earlier attempt's), else ``row["run_marker"]``'s; a receipt without that number
    while the row's attempt is wrapped up is left to record_cancelled_receipt. Unchanged when
    there is no receipt, or its attempt is kept already."""
    kept = json.loads(row["earlier_receipts"]) if row["earlier_receipts"] else []
    number = (json.loads(result) if result else {}).get("attempt")
    marker = row["run_marker"]
    if isinstance(number, int) and not isinstance(number, bool) and marker:
        marker = re.sub(r"-a[0-9]+$", f"-a{number}", marker)
    elif row["wrapping_up"] is not None and status is None:
        return row["earlier_receipts"]
    if (result is None and not diff) or not marker or any(e.get("attempt") == marker for e in kept):
        return row["earlier_receipts"]
    kept.append({"attempt": marker, "status": status or row["status"],
                 "ended_at": iso(row["finished_at"] or now()), "result": json.loads(result) if result else None,
                 "diff": diff or None})
    return _json(kept[-EARLIER_KEPT:])


def _earlier_summaries(kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A task's ``earlier_attempts`` (task_dict): the earlier attempts' receipts it keeps, each
    without its diff text: ``{"attempt", "status", "ended_at", "files_touched", "summary",
    "diff_bytes"}`` (bytes of UTF-8), oldest first; ``earlier_receipt`` gives one whole."""
    return [{"attempt": e.get("attempt"), "status": e.get("status"), "ended_at": e.get("ended_at"),
             "files_touched": list(((e.get("result") or {}).get("files_touched") or [])[:50]),
             "summary": ((e.get("result") or {}).get("summary") or "")[:500] or None,
             "diff_bytes": len((e.get("diff") or "").encode())} for e in kept]


def earlier_receipt(task_id: Any, attempt: Any) -> dict[str, Any]:
    """The receipt of one earlier attempt of the task (``attempt``: its run marker, such as
    ``br-42-a1``, or its last part ``a1``), kept when a retry started afresh: ``{"attempt",
    "status", "ended_at", "result", "diff"}``. Raises TaskNotFound, ValidationError (no such
    attempt kept: the message names those that are)."""
    num = parse_task_id(task_id)
    with _reading() as conn:
        row = _row(conn, num)
    kept = json.loads(row["earlier_receipts"]) if row["earlier_receipts"] else []
    wanted = str(attempt or "").strip()
    for entry in kept:
        marker = str(entry.get("attempt") or "")
        if wanted and (wanted == marker or marker.endswith("-" + wanted)):
            return entry
    names = ", ".join(str(e.get("attempt")) for e in kept) or "none (no retry has started it afresh)"
    raise ValidationError(f"task {format_task_id(num)} keeps no earlier attempt {shown_value(attempt)}; "
                          f"it keeps: {names}")


def end_wrap_up(task_id: Any, marker: str, why: str | None = None) -> bool:
    """The worker of the cancelled attempt ``marker`` is done with it (its receipt recorded, its
    worktree removed or left for the next attempt), or ``why`` (the reaper's words) it never will
    be: its worker is gone. A task retried meanwhile can be claimed from now on (its lease, kept
    for the wait, goes). Fenced: only while that attempt is the one wrapped up. Returns whether
    it was. Raises TaskNotFound."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        row = _row(conn, num)
        if row["wrapping_up"] is None or row["wrapping_up"] != marker:
            return False
        retried = row["status"] == "pending"
        conn.execute("UPDATE tasks SET wrapping_up = NULL, lease_owner = CASE WHEN status = 'pending' THEN NULL"
                     " ELSE lease_owner END, lease_pid = CASE WHEN status = 'pending' THEN NULL ELSE lease_pid END,"
                     " lease_pid_start = CASE WHEN status = 'pending' THEN NULL ELSE lease_pid_start END"
                     " WHERE id = ? AND wrapping_up = ?", (num, marker))
        if why is not None or retried:
            said = f"the cancelled attempt {marker} was not wrapped up: {why}" if why else \
                f"the cancelled attempt {marker} is wrapped up"
            _event(conn, num, "wrapped-up", (said + ("; the retried task can start now" if retried else ""))[:500])
    return True


def wrap_ups(stale_after_sec: float) -> list[dict[str, Any]]:
    """The tasks whose cancelled attempt is still being wrapped up (``wrapping_up``, the attempt's
    marker; its lease: ``lease_owner``, ``lease_pid``, ``lease_pid_start``, ``lease_host``), each
    with ``stale``: its last heartbeat is older than ``stale_after_sec`` seconds (a worker
    renews none once its attempt is cancelled: the reaper ends such a wrap-up)."""
    with _reading() as conn:
        rows = conn.execute("SELECT *, heartbeat_at < :cut AS stale FROM tasks WHERE wrapping_up IS NOT NULL",
                            {"cut": store_now(conn) - stale_after_sec}).fetchall()
    return [task_dict(r) | {"stale": bool(r["stale"])} for r in rows]


def _worker_lease(row: Row) -> bool:
    """Whether a worker holds the row's lease (not a person's hand claim, ``cli:…``)."""
    return row["lease_owner"] is not None and not str(row["lease_owner"]).startswith("cli:")


def record_branch_dropped(task_id: Any, marker: str, branch: str) -> bool:
    """Record that the empty branch ``branch`` of a task whose attempt ``marker`` ended it
    cancelled or failed was deleted (it changed nothing; see worktrees.drop_empty_branch): the
    task's ``branch`` goes and its receipt (``result``, made when it has none) says
    ``branch_deleted``, as a done task's does, so a follow-up, a fork or a retry starts from its
    base commit. Fenced: only while the task still ended by that attempt holds that branch.
    Returns whether it was recorded. Raises TaskNotFound."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        row = _row(conn, num)
        if row["run_marker"] != marker or row["status"] not in ("cancelled", "failed") or row["branch"] != branch:
            return False
        try:
            result = json.loads(row["result"] or "{}")
        except ValueError:
            result = {}
        result = (result if isinstance(result, dict) else {}) | {"branch": None, "branch_deleted": branch}
        conn.execute("UPDATE tasks SET branch = NULL, result = ? WHERE id = ? AND run_marker = ? AND branch = ?",
                     (_json(result), num, marker, branch))
        _event(conn, num, "branch", f"its empty branch {branch} was deleted: attempt {marker} committed nothing")
    return True


# The event a worker records when it moves the worktree an earlier attempt left aside
# (worktrees.set_aside): the folder comes last, whole, so leftover_folders reads it back exactly.
LEFTOVER_EVENT = "leftover"
_LEFTOVER_SAID = re.compile(r"attempt (\S+) on (\S+) set an earlier attempt's worktree aside: (.+)", re.S)


def record_leftover(task_id: Any, marker: str, folder: str) -> None:
    """Record (an event of kind LEFTOVER_EVENT) that attempt ``marker`` of the task, on this host
    (``host_name``), moved the worktree an earlier attempt left to ``folder`` (an absolute path:
    worktrees.set_aside) before making it anew, so the task's events name it even when the attempt
    fails before its receipt, and ``clear`` can remove it with the task (leftover_folders). Not
    fenced: the folder was moved whatever became of the attempt since. Raises TaskNotFound,
    ValidationError (a marker or folder that is not one line)."""
    num = parse_task_id(task_id)
    if not marker or any(c.isspace() for c in marker) or not folder or "\n" in folder:
        raise ValidationError(f"record_leftover needs a run marker and one folder; got {marker!r}, {folder!r}")
    with _writing() as conn:
        _row(conn, num)
        _event(conn, num, LEFTOVER_EVENT, f"attempt {marker} on {host_name()} set an earlier attempt's worktree "
                                          f"aside: {folder}")


def leftover_folders(task_ids: Iterable[Any]) -> dict[str, list[dict[str, str]]]:
    """The folders record_leftover named for these tasks: ``{id: [{"path", "host", "attempt"}]}``
    (oldest first; a task with none is absent). Raises ValidationError (a bad id)."""
    nums = [parse_task_id(t) for t in task_ids]
    if not nums:
        return {}
    with _reading() as conn:
        rows = conn.execute(f"SELECT task_id, message FROM events WHERE kind = ? AND task_id IN ({_marks(nums)})"
                            " ORDER BY id", [LEFTOVER_EVENT, *nums]).fetchall()
    found: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        said = _LEFTOVER_SAID.fullmatch(row["message"] or "")
        if said:
            found.setdefault(format_task_id(row["task_id"]), []).append(
                {"attempt": said[1], "host": said[2], "path": said[3]})
    return found


def _kept_work(row: Row) -> str | None:
    """Where a cancelled task's work stays: its branch (and a waiting task's worktree)."""
    if not row["branch"]:
        return None
    # The worker deletes an empty one as the run ends (record_branch_dropped).
    kept = f"branch {row['branch']} kept"
    if row["status"] == "running":
        kept += (" if its attempt committed work (an empty one is deleted as its run ends); what the agent had "
                 "changed by then goes into its receipt and diff as its worker ends the run"
                 + (f" (a worker that is gone leaves it in the worktree {row['worktree_path']})"
                    if row["worktree_path"] else ""))
    if row["status"] == "waiting" and row["worktree_path"]:
        kept += f"; its uncommitted work stays in the worktree {row['worktree_path']}"
    return kept


def _fail_dependents(conn: Connection, num: int, why: str) -> None:
    pending = [(num, why)]
    while pending:
        parent, parent_status = pending.pop()
        rows = conn.execute(
            "SELECT t.id FROM task_deps d JOIN tasks t ON t.id = d.task_id"
            " WHERE d.depends_on = ? AND t.status IN ('pending', 'waiting')", (parent,)
        ).fetchall()
        for (child,) in rows:
            reason = f"dependency {format_task_id(parent)} {parent_status}"
            conn.execute(
                "UPDATE tasks SET status = 'failed', finished_at = ?, error = ? WHERE id = ?",
                (now(), reason, child),
            )
            _event(conn, child, "failed", reason)
            pending.append((child, "failed"))


def fail_unrunnable(task_id: Any, marker: str, error: str) -> dict[str, Any]:
    """Fail an attempt at once without retrying (a missing directory, a repo with no commits)."""
    return fail_attempt(task_id, marker, error, retryable=False)


def _usage_after(row: Row, usage: dict | None) -> str | None:
    """The task's usage once the running attempt of ``row`` ends: ``_total_usage`` with the
    attempt's ``usage`` as its worker counted it (``EventStream.usage``), or, without one (the
    reaper's hand-back, a cancel, a fault before the count), what the worker's meter last recorded
    for it (``record_spend``, once per finished model call): money spent is never dropped."""
    if usage is None and row["status"] == "running" and (row["run_cost_usd"] or row["run_tokens"]):
        usage = {"tokens": {"total": row["run_tokens"]}, "cost_usd": row["run_cost_usd"], "metered": True}
    return _total_usage(row, usage)


def _total_usage(row: Row, attempt: dict | None) -> str | None:
    """The task's usage over all its attempts: tokens, cost_usd and steps summed, and each
    attempt's own figures under ``by_attempt`` (an attempt that asked a question, failed or was
    resumed keeps its cost in the total)."""
    if attempt is None:
        return row["usage"]
    total = json.loads(row["usage"]) if row["usage"] else {}
    tokens = dict(total.get("tokens") or {})
    for key, value in (attempt.get("tokens") or {}).items():
        both_numbers = all(isinstance(v, (int, float)) for v in (value, tokens.get(key, 0)))
        tokens[key] = tokens.get(key, 0) + value if both_numbers else value
    return _json({
        "tokens": tokens,
        "cost_usd": round(float(total.get("cost_usd") or 0) + float(attempt.get("cost_usd") or 0), 8),
        "steps": int(total.get("steps") or 0) + int(attempt.get("steps") or 0),
        "by_attempt": list(total.get("by_attempt") or []) + [dict(attempt, attempt=row["attempts"])],
    })


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, default=str)


# --------------------------------------------------------------------------------------------
# Notes.


def add_note(task_id: Any, text: str, author: str = "planner") -> dict[str, Any]:
    """Add a note to a task that has not finished; a running task's agent gets it in its running
    session at its next step (the worker's note courier), else it reaches the agent in its next
    prompt (next attempt or resume); a task claimed by hand (a ``cli:`` lease) keeps it for its
    person. Returns ``{"task_id", "status", "delivery"}``.
    Raises TaskNotFound, ValidationError (empty, too long), InvalidTransition (task finished)."""
    num = parse_task_id(task_id)
    text = _text("note", text, NOTE_MAX)
    author = _text("author", author, 100)
    with _writing() as conn:
        row = _row(conn, num)
        if row["status"] in TERMINAL:
            raise InvalidTransition(
                f"task {format_task_id(num)} is {row['status']}; a note reaches only a task that is "
                "pending, waiting or running (submit a follow-up task instead)"
            )
        conn.execute(
            "INSERT INTO notes (task_id, author, text, created_at) VALUES (?, ?, ?, ?)",
            (num, author, text, now()),
        )
        _event(conn, num, "note", f"{author}: {text[:400]}")
    by_hand = row["status"] == "running" and str(row["lease_owner"] or "").startswith("cli:")
    delivery = (f"{row['lease_owner'][4:]}, who claimed it by hand (no agent runs it; show lists the note)" if by_hand
                else "the running session at its next step (else the next attempt or resume)"
                if row["status"] == "running" else "the agent's next prompt")
    return {"task_id": format_task_id(num), "status": row["status"], "delivery": delivery}


def take_notes(task_id: Any, marker: str) -> list[dict[str, Any]]:
    """The notes not yet given to an agent, marked as delivered to attempt ``marker`` (in its
    prompt, now)."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        rows = conn.execute(
            "UPDATE notes SET delivered_marker = ?, delivered_at = ?, delivered_how = ?"
            " WHERE task_id = ? AND delivered_marker IS NULL"
            " RETURNING id, author, text, created_at", (marker, now(), f"in the prompt of attempt {marker}", num)
        ).fetchall()
    return [{"author": r["author"], "text": r["text"], "created_at": iso(r["created_at"])}
            for r in sorted(rows, key=lambda r: r["id"])]


def undelivered_notes(task_id: Any) -> list[dict[str, Any]]:
    """The notes of a task no agent has had yet, oldest first: ``[{"id", "author", "text"}]``."""
    num = parse_task_id(task_id)
    with _reading() as conn:
        rows = conn.execute("SELECT id, author, text FROM notes WHERE task_id = ? AND delivered_marker IS NULL"
                            " ORDER BY id", (num,)).fetchall()
    return [row_dict(r) for r in rows]


def mark_notes_delivered(task_id: Any, marker: str, delivered: list[tuple[int, float]], how: str) -> int:
    """Record notes (``(note id, Unix seconds)``) as delivered to attempt ``marker``, ``how`` in
    words (``in the running session``); notes already delivered stay as they were. Returns how
    many were marked."""
    num = parse_task_id(task_id)
    marked = 0
    with _writing() as conn:
        for note_id, at in delivered:
            row = conn.execute("UPDATE notes SET delivered_marker = ?, delivered_at = ?, delivered_how = ?"
                               " WHERE id = ? AND task_id = ? AND delivered_marker IS NULL RETURNING author",
                               (marker, at, how, note_id, num)).fetchone()
            if row is not None:
                marked += 1
                _event(conn, num, "note_delivered", f"note {note_id} from {row['author']} {how}")
    return marked


# --------------------------------------------------------------------------------------------
# Events.


def _event_dict(row: Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "task_id": format_task_id(row["task_id"]) if row["task_id"] is not None else None,
        "ts": iso(row["ts"]),
        "kind": row["kind"],
        "message": row["message"],
    }


def _final(conn: Connection) -> str:
    """The condition that keeps a read of events below the horizon where none can still appear:
    always true on SQLite (ids commit in order there), ``PG_EVENTS_FINAL`` on PostgreSQL."""
    return _dialect(conn).events_final


def events_since(cursor: int = 0, task_ids: Iterable[Any] | None = None, limit: int = 200) -> list[dict[str, Any]]:
    """Events with id > ``cursor`` (oldest first, at most ``limit``), optionally only for the
    given tasks. Each: ``{id, task_id, ts, kind, message}``. On PostgreSQL only events below the
    oldest open transaction are returned, so the last id is a cursor that skips none."""
    limit = coerce_int("limit", limit, 1, 10_000)
    cursor = coerce_int("cursor", cursor, 0, MAX_ID)
    with _reading() as conn:
        if task_ids is None:
            rows = conn.execute(
                f"SELECT * FROM events WHERE id > ? AND {_final(conn)} ORDER BY id LIMIT ?", (cursor, limit)
            ).fetchall()
        else:
            nums = [parse_task_id(t) for t in task_ids]
            rows = conn.execute(
                f"SELECT * FROM events WHERE id > ? AND task_id IN ({_marks(nums)}) AND {_final(conn)}"
                " ORDER BY id LIMIT ?", [cursor, *nums, limit]
            ).fetchall()
    return [_event_dict(r) for r in rows]


def latest_events(limit: int = 50) -> list[dict[str, Any]]:
    """The newest ``limit`` events (1..10,000), oldest first, each as ``events_since`` gives it.
    Ids are a cursor, not a count (on PostgreSQL they are made of transaction ids and leave
    gaps), so "the last N" is asked here rather than worked out from the newest id."""
    limit = coerce_int("limit", limit, 1, 10_000)
    with _reading() as conn:
        rows = conn.execute(f"SELECT * FROM events WHERE {_final(conn)} ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
    return [_event_dict(row) for row in reversed(rows)]


def last_event_id() -> int:
    """The newest event id (0 when none): a cursor for ``events_since`` (on PostgreSQL the newest
    below the oldest open transaction, see ``events_since``)."""
    with _reading() as conn:
        return conn.execute(f"SELECT coalesce(max(id), 0) FROM events WHERE {_final(conn)}").fetchone()[0]


def change_marks() -> dict[str, Any]:
    """What a watcher (the board) compares to know whether anything it shows moved, in one
    statement: ``events`` (the newest event id, as ``last_event_id``) and ``jobs`` (the reverse
    bridge's jobs as ``"<newest id>:<queued>:<running>"``, which changes when a job is created,
    starts or ends)."""
    with _reading() as conn:
        row = conn.execute(
            f"SELECT (SELECT coalesce(max(id), 0) FROM events WHERE {_final(conn)}),"
            " (SELECT coalesce(max(id), 0) FROM claude_jobs),"
            " (SELECT count(*) FROM claude_jobs WHERE status = 'queued'),"
            " (SELECT count(*) FROM claude_jobs WHERE status = 'running')").fetchone()
    return {"events": row[0], "jobs": f"{row[1]}:{row[2]}:{row[3]}"}


def wait_for_change(since: int, timeout: float, poll: float = 0.5) -> int:
    """Block until an event newer than ``since`` (an event id, as ``last_event_id`` returns) is
    recorded by any process, or ``timeout`` seconds pass; returns the newest event id then.

    Every change a waiter cares about (submit, claim, finish, question, answer, note, cancel)
    records an event in the same transaction. On Linux the wait sleeps on an inotify watch of the
    database's folder (SQLite writes each commit to the ``-wal`` file) and wakes within about a
    millisecond of the commit; on PostgreSQL it LISTENs for the NOTIFY each event's commit sends.
    It also re-checks every ``poll`` seconds (0.01..5), the only schedule where inotify is missing
    (macOS) or says nothing (a network filesystem)."""
    poll = min(max(float(poll), 0.01), 5.0) if math.isfinite(float(poll)) else 0.5
    deadline = time.monotonic() + max(0.0, float(timeout))
    with change_watch() as watch:
        while True:
            newest = last_event_id()
            left = deadline - time.monotonic()
            if newest > since or left <= 0:
                return newest
            if watch.wait(min(left, poll)):
                for pause in SETTLE_PAUSES:
                    time.sleep(pause)
                    if last_event_id() > since:
                        break


# The -wal write that wakes a waiter lands just before SQLite publishes the commit in shared
# memory: a woken waiter looks again over these pauses (seconds) before going back to sleep.
SETTLE_PAUSES = (0, 0.001, 0.002, 0.005, 0.01)


def change_watch() -> FolderWatch | PgChangeWatch:
    """A ``file_watch.FolderWatch`` on the files SQLite writes at each commit to this queue's
    database (the ``-wal`` file; the database itself in rollback-journal mode); on PostgreSQL a
    PgChangeWatch (the same interface) listening for the events' NOTIFY on a connection of its
    own. Close it after use (a context manager). For async waiters; threads use
    ``wait_for_change``."""
    url = database_url()
    if url:
        return store_pg.change_watch(url)
    return store_sqlite.change_watch(db_path())


def statuses_of(task_ids: Iterable[Any]) -> dict[str, str]:
    """``{"t_0001": "running", ...}`` for the given ids. Raises TaskNotFound for an unknown one."""
    nums = [parse_task_id(t) for t in task_ids]
    with _reading() as conn:
        rows = dict(conn.execute(
            f"SELECT id, status FROM tasks WHERE id IN ({_marks(nums)})", nums
        ).fetchall()) if nums else {}
    missing = [format_task_id(n) for n in nums if n not in rows]
    if missing:
        raise TaskNotFound(f"task(s) {', '.join(missing)} not found; list_tasks shows the ids that exist")
    return {format_task_id(n): rows[n] for n in nums}


def resuming_by_itself(task_ids: Iterable[Any]) -> list[str]:
    """Which of the given tasks wait at a usage limit that resumes by itself (``resume_at`` set):
    they need no answer. Unknown ids are left out."""
    nums = [parse_task_id(t) for t in task_ids]
    if not nums:
        return []
    with _reading() as conn:
        rows = conn.execute("SELECT id FROM tasks WHERE status = 'waiting' AND paused_for = 'usage_limit'"
                            f" AND resume_at IS NOT NULL AND id IN ({_marks(nums)}) ORDER BY id",
                            nums).fetchall()
    return [format_task_id(r[0]) for r in rows]


# --------------------------------------------------------------------------------------------
# Results the planner has not read yet (issue 22).

UNSEEN_SHOWN = 50


def mark_result_seen(task_id: Any) -> bool:
    """Record that the planner read the result of ``task_id`` (only a finished task's result
    counts: a running task's has not been written yet). Returns whether this was the first read
    since it finished. Raises TaskNotFound."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        _row(conn, num)
        changed = conn.execute(
            "UPDATE tasks SET result_seen_at = ? WHERE id = ? AND result_seen_at IS NULL"
            " AND status IN ('done', 'failed', 'cancelled')", (now(), num)).rowcount
    return bool(changed)


# SQLite keeps the count in task_counts (migration 9's triggers); PostgreSQL counts the index.
_UNSEEN_TOTAL = {SQLITE: "SELECT n FROM task_counts WHERE status = 'unseen'",
                 POSTGRESQL: f"SELECT count(*) FROM tasks t WHERE {_UNSEEN.format(row='t')}"}


def unseen_results(limit: int = UNSEEN_SHOWN) -> dict[str, Any]:
    """Finished tasks whose result the planner has not read: ``{"ids": [...], "total": N}``,
    the ``limit`` (1..1000) that finished first, oldest first."""
    limit = max(1, min(int(limit), 1000))
    where = "result_seen_at IS NULL AND status IN ('done', 'failed', 'cancelled')"
    with _reading() as conn:
        # SQLite's planner, left to itself, read every finished task through the status index
        # and sorted them (0.4 s at 100,000 unread); the partial index holds exactly these rows.
        rows = conn.execute(f"SELECT id FROM tasks{' INDEXED BY tasks_unseen' if _dialect(conn).index_hints else ''}"
                            f" WHERE {where} ORDER BY finished_at, id LIMIT ?", (limit,)).fetchall()
        total = conn.execute(_UNSEEN_TOTAL[_dialect(conn)]).fetchone()[0]
    return {"ids": [format_task_id(r[0]) for r in rows], "total": int(total)}


# --------------------------------------------------------------------------------------------
# Spending limits and the daily budget (issue 14).

BUDGET_KEYS = {"daily_usd": "budget.daily_usd", "daily_tokens": "budget.daily_tokens",
               "default_max_cost_usd": "budget.default_max_cost_usd",
               "default_max_tokens": "budget.default_max_tokens"}
KEEP = object()                       # set_budget: leave this setting as it is
_STOP_WORDS = re.compile(r"^\s*(stop|no|cancel|abort|fail|halt|end)\b", re.IGNORECASE)
_USD_AMOUNT = re.compile(r"\$\s*(\d+(?:\.\d+)?)|(\d+(?:\.\d+)?)\s*(?:usd|dollars?)\b", re.IGNORECASE)
_TOKEN_AMOUNT = re.compile(r"(\d[\d,_]*(?:\.\d+)?)\s*(k|m)?\s*tokens?\b", re.IGNORECASE)
_BARE_AMOUNT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w.])")


def coerce_usd(name: str, value: Any) -> float | None:
    """An amount in USD above 0 (a number or its text, a leading ``$`` allowed), or None when
    absent. Raises ValidationError naming the field and what was sent."""
    value = optional(value)
    if value is None:
        return None
    _plain_number(name, value)
    if isinstance(value, str):
        text = value.strip().lstrip("$").strip()
        try:
            value = float(text)
        except ValueError:
            raise ValidationError(f"{name} must be an amount in USD such as 0.50; got {value!r}") from None
    if not isinstance(value, (int, float)):
        raise ValidationError(f"{name} must be an amount in USD such as 0.50; got {value!r}")
    if not spec.USD.lo < value <= spec.USD.hi:
        raise ValidationError(f"{name} must be above 0 and at most {spec.USD.hi:,.0f} USD; got {value}")
    return float(value)


def coerce_tokens(name: str, value: Any) -> int | None:
    """A token count of at least 1, or None when absent. Raises ValidationError."""
    value = optional(value)
    return None if value is None else coerce_int(name, value, *spec.TOKENS.range)


def local_day(ts: float | None = None) -> str:
    """The local calendar day (``YYYY-MM-DD``) of ``ts``: the daily budget's meter resets at
    local midnight (the machine's time zone, ``TZ``)."""
    return time.strftime("%Y-%m-%d", time.localtime(now() if ts is None else ts))


def next_local_midnight(ts: float | None = None) -> float:
    """Unix time of the next local midnight after ``ts``: when the daily meter starts again."""
    day = datetime.fromtimestamp(now() if ts is None else ts).replace(hour=0, minute=0, second=0, microsecond=0)
    return datetime.fromtimestamp(day.timestamp() + 26 * 3600).replace(hour=0).timestamp()


_BUDGET_SETTINGS = f"SELECT key, value FROM settings WHERE key IN ({_marks(BUDGET_KEYS)})"


def _budget_settings(conn: Connection) -> dict[str, float | None]:
    """The budget settings (BUDGET_KEYS' names -> number or None) in one statement: a claim reads
    them every time (on PostgreSQL each statement is a round trip)."""
    stored = dict(conn.execute(_BUDGET_SETTINGS, tuple(BUDGET_KEYS.values())).fetchall())
    numbers: dict[str, float | None] = {}
    for name, key in BUDGET_KEYS.items():
        try:
            numbers[name] = float(stored[key]) if stored.get(key) else None
        except ValueError:
            numbers[name] = None
    return numbers


def _limit_defaults(conn: Connection, numbers: dict[str, float | None] | None = None) -> dict[str, Any]:
    numbers = numbers or _budget_settings(conn)
    tokens = numbers["default_max_tokens"]
    return {"max_cost_usd": numbers["default_max_cost_usd"], "max_tokens": int(tokens) if tokens else None}


def _budget(conn: Connection, ts: float | None = None,
            numbers: dict[str, float | None] | None = None) -> dict[str, Any]:
    day = local_day(ts)
    spent = conn.execute("SELECT cost_usd, tokens FROM daily_spend WHERE day = ?", (day,)).fetchone()
    usd, tokens = (spent[0], spent[1]) if spent else (0.0, 0)
    numbers = numbers or _budget_settings(conn)
    daily_usd, daily_tokens = numbers["daily_usd"], numbers["daily_tokens"]
    reason = None
    if daily_usd is not None and usd >= daily_usd:
        reason = (f"the daily budget is spent (${usd:.4f} of ${daily_usd:.4f} on {day}); it resets at "
                  "local midnight; raise it with set_budget or `tasks_cli.py budget set --daily USD`")
    elif daily_tokens is not None and tokens >= daily_tokens:
        reason = (f"the daily token budget is spent ({tokens:,} of {int(daily_tokens):,} tokens on {day}); it "
                  "resets at local midnight; raise it with set_budget or `tasks_cli.py budget set --daily-tokens N`")
    defaults = _limit_defaults(conn, numbers)
    return {"day": day, "spent_usd": round(usd, 8), "spent_tokens": tokens, "daily_usd": daily_usd,
            "daily_tokens": int(daily_tokens) if daily_tokens else None,
            "default_max_cost_usd": defaults["max_cost_usd"], "default_max_tokens": defaults["max_tokens"],
            "exhausted": reason is not None, "reason": reason,
            "resets_at": iso(next_local_midnight(ts))}


def _budget_spent(conn: Connection) -> str | None:
    numbers = _budget_settings(conn)
    if numbers["daily_usd"] is None and numbers["daily_tokens"] is None:
        return None   # no daily budget: nothing to read today's spend for
    return _budget(conn, numbers=numbers)["reason"]


def budget_state() -> dict[str, Any]:
    """The queue's spending at a glance: ``day`` (local, YYYY-MM-DD), ``spent_usd`` and
    ``spent_tokens`` today, the daily budget (``daily_usd``, ``daily_tokens``; None = none), the
    defaults for new tasks (``default_max_cost_usd``, ``default_max_tokens``), ``exhausted`` and
    its ``reason`` (one line with the way out), and ``resets_at`` (the next local midnight,
    ISO 8601 UTC)."""
    with _reading() as conn:
        return _budget(conn)


def set_budget(*, daily_usd: Any = KEEP, daily_tokens: Any = KEEP, default_max_cost_usd: Any = KEEP,
               default_max_tokens: Any = KEEP) -> dict[str, Any]:
    """Set the queue's daily budget and the limits new tasks get by default; a value left out
    (``KEEP``) stays, None (or 0) removes it. USD values above 0, token counts at least 1.
    One transaction with a ``budget`` event (it wakes a worker waiting on a spent budget).
    Returns ``budget_state()``. Raises ValidationError naming the value."""
    given = {"daily_usd": daily_usd, "daily_tokens": daily_tokens,
             "default_max_cost_usd": default_max_cost_usd, "default_max_tokens": default_max_tokens}
    values: dict[str, str | None] = {}
    for name, value in given.items():
        if value is KEEP:
            continue
        if optional(value) is None or (not isinstance(value, bool) and value in (0, "0")):
            values[name] = None
        elif name.endswith("tokens"):
            values[name] = str(coerce_tokens(name, value))
        else:
            values[name] = repr(coerce_usd(name, value))
    with _writing() as conn:
        for name, value in values.items():
            if value is None:
                conn.execute("DELETE FROM settings WHERE key = ?", (BUDGET_KEYS[name],))
            else:
                conn.execute("INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key)"
                             " DO UPDATE SET value = excluded.value", (BUDGET_KEYS[name], value))
        said = ", ".join(f"{k} = {v or 'none'}" for k, v in values.items()) or "unchanged"
        _event(conn, None, "budget", said)
        return _budget(conn)


def record_spend(task_id: Any, marker: str, run_cost_usd: float, run_tokens: int,
                 step_cost_usd: float, step_tokens: int) -> dict[str, Any]:
    """The worker's meter, once per finished model call (``step_finish``): the attempt's spend so
    far (``run_cost_usd`` USD, ``run_tokens``) on the task row while it is the current attempt,
    and the step's own figures added to today's spend. Not fenced: money spent counts whoever
    ends the attempt. Returns ``budget_state()`` after the step."""
    num = parse_task_id(task_id)
    with _writing() as conn:
        conn.execute("UPDATE tasks SET run_cost_usd = ?, run_tokens = ? WHERE id = ? AND run_marker = ?",
                     (run_cost_usd, run_tokens, num, marker))
        conn.execute("INSERT INTO daily_spend (day, cost_usd, tokens) VALUES (?, ?, ?) ON CONFLICT (day)"
                     " DO UPDATE SET cost_usd = daily_spend.cost_usd + excluded.cost_usd,"
                     " tokens = daily_spend.tokens + excluded.tokens",
                     (local_day(), step_cost_usd, step_tokens))
        return _budget(conn)


def parse_limit_answer(text: str, unit: str = "usd") -> tuple[str, float | None]:
    """What an answer to a spending-limit pause asks: ``("stop", None)`` (it starts with stop, no,
    cancel, abort, fail, halt or end), ``("usd", amount)`` (``$2``, ``2 USD``, ``2 dollars``, or a
    bare number when the task's limit is in USD), ``("tokens", count)`` (``50000 tokens``,
    ``50k tokens``, or a bare number when the limit is in tokens), else ``("continue", None)``."""
    if _STOP_WORDS.match(text):
        return "stop", None
    match = _USD_AMOUNT.search(text)
    if match:
        return "usd", float(match.group(1) or match.group(2))
    match = _TOKEN_AMOUNT.search(text)
    if match:
        scale = {"k": 1_000, "m": 1_000_000}.get((match.group(2) or "").lower(), 1)
        return "tokens", float(match.group(1).replace(",", "").replace("_", "")) * scale
    match = _BARE_AMOUNT.search(text)
    if match:
        return unit, float(match.group(1))
    return "continue", None


def _limit_reached(row: Row) -> str | None:
    usage = json.loads(row["usage"]) if row["usage"] else {}
    usd, tokens = float(usage.get("cost_usd") or 0), int((usage.get("tokens") or {}).get("total") or 0)
    if row["max_cost_usd"] is not None and usd >= row["max_cost_usd"]:
        return f"it has spent ${usd:.4f} of its ${row['max_cost_usd']:.4f} limit"
    if row["max_tokens"] is not None and tokens >= row["max_tokens"]:
        return f"it has used {tokens:,} of its {row['max_tokens']:,} tokens"
    return None


def limit_example(unit: str, spent: float, limit: float | None = None) -> float | int:
    """A new limit to suggest for a task stopped at its spending limit: twice the larger of what
    it has spent and its old limit, so it is always above the spend (which answer_task requires).
    ``unit`` is "usd" (``spent``/``limit`` in USD; returns USD, at least 0.01) or "tokens"
    (returns a whole count). The question the worker asks and the refusal of a too-low answer
    both suggest this figure."""
    base = max(spent, limit or 0) * 2
    return max(round(base, 2), 0.01) if unit == "usd" else int(base)


def _set_limit(conn: Connection, row: Row, unit: str, amount: float | None) -> str:
    """Raise the task's limit in ``unit`` to ``amount``; returns it as said to the agent. Raises
    ValidationError when ``amount`` is not a valid limit above what the task has spent, or None."""
    name = format_task_id(row["id"])
    if amount is None:   # parse_limit_answer gives an amount with every "usd" and "tokens" answer
        raise ValidationError(f"task {name}: the answer names no new limit; answer 'continue, up to $2', "
                              "'200000 tokens' or 'stop'")
    usage = json.loads(row["usage"]) if row["usage"] else {}
    if unit == "usd":
        usd = coerce_usd("the new limit", amount)
        spent = float(usage.get("cost_usd") or 0) + (row["run_cost_usd"] if row["status"] == "running" else 0)
        if usd is None or usd <= spent:
            raise ValidationError(f"task {name} has already spent ${spent:.4f}; give a limit above that "
                                  f"(for example ${limit_example('usd', spent):.2f}) or answer stop")
        conn.execute("UPDATE tasks SET max_cost_usd = ? WHERE id = ?", (usd, row["id"]))
        return f"${usd:.4f}"
    count = coerce_tokens("the new token limit", int(amount) if math.isfinite(amount) else amount)
    spent = (int((usage.get("tokens") or {}).get("total") or 0)
             + (row["run_tokens"] if row["status"] == "running" else 0))
    if count is None or count <= spent:
        raise ValidationError(f"task {name} has already used {spent:,} tokens; give a limit above that "
                              f"(for example {limit_example('tokens', spent):,} tokens) or answer stop")
    conn.execute("UPDATE tasks SET max_tokens = ? WHERE id = ?", (count, row["id"]))
    return f"{count:,} tokens"


def _answer_limit_pause(conn: Connection, row: Row, answer: str, author: str) -> str | None:
    """A planner's answer to a spending-limit pause: None when it stops the task (failed now,
    its receipt kept); else the message the resumed session gets."""
    name = format_task_id(row["id"])
    unit = "tokens" if row["max_tokens"] is not None and row["max_cost_usd"] is None else "usd"
    kind, amount = parse_limit_answer(answer, unit)
    if kind == "stop":
        why = _limit_reached(row) or "the daily budget was spent"
        conn.execute("UPDATE tasks SET status = 'failed', finished_at = ?, paused_for = NULL, error = ?"
                     " WHERE id = ?", (now(), f"stopped at its spending limit by {author}: {why}", row["id"]))
        _event(conn, row["id"], "failed", f"stopped at its spending limit by {author}: {why}")
        _fail_dependents(conn, row["id"], "failed")
        return None
    if kind in ("usd", "tokens"):
        said = _set_limit(conn, row, kind, amount)
        row = _row(conn, row["id"])
        what = f"raised the limit to {said}"
    else:
        what = "said continue"
    reached = _limit_reached(row)
    if reached:
        raise ValidationError(f"task {name} is still at its spending limit: {reached}; answer with a higher "
                              "limit ('continue, up to $2' or '200000 tokens') or 'stop'")
    spent = _budget_spent(conn) if row["paused_for"] == "daily_budget" else None
    if spent:
        raise ValidationError(f"task {name} paused because {spent}; raise the budget first, then answer "
                              "'continue' (or answer 'stop')")
    return (f"TaskBridge paused your run at a spending limit (this was not a question of yours). "
            f"The planner {what} ({answer.strip()[:200]!r}). Carry on with the task where you stopped.")


def raise_limit(task_id: Any, *, max_cost_usd: Any = None, max_tokens: Any = None,
                author: str = "cli") -> dict[str, Any]:
    """Raise a task's spending limit (``max_cost_usd`` USD and/or ``max_tokens``; each must be
    above what it has spent). A task paused at its limit resumes its OpenCode session (as if
    answered ``continue, up to …``); a pending or running one keeps going under the new limit.
    Raises TaskNotFound, ValidationError (no value, a value not above the spend) or
    InvalidTransition (the task is finished)."""
    num = parse_task_id(task_id)
    usd, tokens = coerce_usd("max_cost_usd", max_cost_usd), coerce_tokens("max_tokens", max_tokens)
    if usd is None and tokens is None:
        raise ValidationError("give the new limit: an amount in USD (or a token count)")
    with _writing() as conn:
        row = _row(conn, num)
        if row["status"] in TERMINAL:
            raise InvalidTransition(f"task {format_task_id(num)} is {row['status']}; only an unfinished "
                                    "task's limit can be raised (retry_task requeues a failed one)")
        if row["status"] != "waiting" or not row["paused_for"]:
            said = [_set_limit(conn, row, unit, amount) for unit, amount in (("usd", usd), ("tokens", tokens))
                    if amount is not None]
            _event(conn, num, "limit", f"by {author}: raised to {', '.join(said)}")
            return task_dict(_row(conn, num))
        if usd is not None and tokens is not None:
            _set_limit(conn, row, "tokens", tokens)
    return answer_task(num, f"continue, up to ${usd}" if usd is not None else f"continue, up to {tokens} tokens",
                       author=author)


# --------------------------------------------------------------------------------------------
# Settings and housekeeping.


def get_setting(key: str, default: str | None = None) -> str | None:
    """A stored setting's value, or ``default``."""
    with _reading() as conn:
        row = conn.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
    return row[0] if row else default


def set_setting(key: str, value: str) -> None:
    """Store a setting (insert or replace) and log an event."""
    with _writing() as conn:
        conn.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value)
        )
        _event(conn, None, "setting", f"{key} = {value}")


def default_model() -> str | None:
    """The queue's own default model setting (``set_default_model``), or None. The model a task
    without one runs with is chosen by ``opencode_runner.default_model``, which puts this first."""
    return get_setting("default_model")


# The dependency rows whose dependent is not finished: the tasks they name stay (clear_finished).
_HELD_DEPS = "FROM task_deps d JOIN tasks t ON t.id = d.task_id WHERE t.status NOT IN ('done','failed','cancelled')"


def _finished_statuses(statuses: Iterable[str]) -> list[str]:
    chosen = _statuses(list(statuses))
    if any(s not in TERMINAL for s in chosen):
        raise ValidationError(f"clear_finished removes only {', '.join(TERMINAL)} tasks")
    return chosen


def clear_finished(older_than_sec: float = 0, statuses: Iterable[str] = TERMINAL, *,
                   dry_run: bool = False, only_ids: Iterable[Any] | None = None) -> list[dict[str, Any]]:
    """Delete terminal tasks finished more than ``older_than_sec`` seconds ago (their notes,
    questions, dependency rows and log chunks go with them; events stay as history). Returns the removed
    tasks' ``{id, branch, worktree_path, log, lease_host, worktree_removed, session_id}`` so the caller may remove
    files (``lease_host``: the machine of its last attempt; ``worktree_removed``: its receipt says
    the worktree was removed).
    A task that a not-finished task still depends on is kept. ``dry_run``: only list what would
    go; ``only_ids``: remove no task outside these ids. Raises ValidationError."""
    chosen = _finished_statuses(statuses)
    nums = None if only_ids is None else [parse_task_id(i) for i in only_ids]
    where = f"status IN ({_marks(chosen)}) AND finished_at <= ? AND id NOT IN (SELECT d.depends_on {_HELD_DEPS})"
    if nums is not None:
        where += f" AND id IN ({_marks(nums)})"
    params = [*chosen, now() - older_than_sec, *(nums or [])]
    with _writing() as conn:
        if dry_run:
            rows = conn.execute(f"SELECT id, branch, worktree_path, lease_host, result, session_id FROM tasks"
                                f" WHERE {where}", params).fetchall()
        else:
            rows = conn.execute(f"DELETE FROM tasks WHERE {where}"
                                " RETURNING id, branch, worktree_path, lease_host, result, session_id",
                                params).fetchall()
        if rows and not dry_run:
            _event(conn, None, "cleared", f"{len(rows)} finished task(s) removed")
    return [{"id": format_task_id(r["id"]), "branch": r["branch"], "worktree_path": r["worktree_path"],
             "log": str(log_path(r["id"])), "lease_host": r["lease_host"],
             "worktree_removed": _receipt_says_removed(r["result"]), "session_id": r["session_id"]} for r in rows]


def kept_for_dependents(older_than_sec: float = 0, statuses: Iterable[str] = TERMINAL) -> dict[str, list[str]]:
    """The finished tasks ``clear_finished`` keeps because a task not finished yet depends on
    them (a follow-up or fork waiting for its task counts): ``{id: [ids of those tasks]}``.
    Raises ValidationError as ``clear_finished``."""
    chosen = _finished_statuses(statuses)
    with _reading() as conn:
        rows = conn.execute(
            f"SELECT d.depends_on AS kept, d.task_id AS waiting {_HELD_DEPS} AND d.depends_on IN"
            f" (SELECT id FROM tasks WHERE status IN ({_marks(chosen)}) AND finished_at <= ?)"
            " ORDER BY d.depends_on, d.task_id", [*chosen, now() - older_than_sec]).fetchall()
    kept: dict[str, list[str]] = {}
    for row in rows:
        kept.setdefault(format_task_id(row["kept"]), []).append(format_task_id(row["waiting"]))
    return kept


def session_ids() -> set[str]:
    """Every OpenCode session id a task in the queue holds (one read of the whole table: for
    ``clear``, which must not remove a session a remaining follow-up resumes)."""
    with _reading() as conn:
        return {r["session_id"] for r in conn.execute(
            "SELECT DISTINCT session_id FROM tasks WHERE session_id IS NOT NULL")}


def _receipt_says_removed(result: str | None) -> bool:
    try:
        receipt = json.loads(result) if result else None
    except ValueError:
        return False
    return isinstance(receipt, dict) and receipt.get("worktree_removed") is True


# --------------------------------------------------------------------------------------------
# Task logs: the file the worker streams to on SQLite (one machine); rows of task_log_chunks on
# PostgreSQL, where the worker and the readers (MCP server, CLI, board) may sit on different
# machines. Every reader goes through these three functions.

LOG_CHUNK_MAX = 65_536   # bytes per task_log_chunks row
PG_LOG_LOCK = 0x74626C67  # first key of a task log's advisory lock ("tblg"; the second is the task id)


def logs_in_database() -> bool:
    """Whether task logs live in the database (PostgreSQL: the worker ships its log there, every
    reader reads it there) instead of files (SQLite: the file is the log)."""
    return _dialect().logs_in_database


def task_log_location(task_id: int | str) -> str:
    """Where a reader finds a task's log, for messages: its file (SQLite) or the database."""
    if logs_in_database():
        return f"the queue database (task {format_task_id(parse_task_id(task_id))}'s log chunks)"
    return str(log_path(task_id))


def append_task_log(task_id: int | str, data: bytes, *, at: int | None = None) -> int:
    """Append ``data`` to a task's log; returns the log's size in bytes afterwards.

    SQLite: the log file (``log_path``; made 0600 in a 0700 folder). PostgreSQL: rows of
    ``task_log_chunks`` of at most LOG_CHUNK_MAX (64 KiB) bytes each, ``seq`` going on from the
    last. ``at``: the byte offset the writer means ``data`` to start at. Bytes the log already
    holds from there that equal the start of ``data`` are not written again (a ship retried after
    its commit went unacknowledged); bytes that differ (another writer appended meanwhile) leave
    ``data`` to go after them whole. Raises ValidationError (bad id), TaskNotFound (database: no
    such task), OSError (file)."""
    data = bytes(data)
    if not logs_in_database():
        path = log_path(task_id)
        with _append_task_log_file(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if at is not None and at < size:
                with path.open("rb") as held:
                    held.seek(at)
                    data = _after_retried(data, held.read(min(size - at, len(data))))
            handle.write(data)
        return size + len(data)
    num = parse_task_id(task_id)
    if _dialect() is POSTGRESQL and 0 < len(data) <= LOG_CHUNK_MAX:
        shipped = _ship_alone(num, data, at)
        if shipped is not None:
            return shipped
    # PostgreSQL has no global writers' lock (ships come every second from each running task):
    # a lock of this task's log alone keeps two ships of one task from taking the same seq.
    with _writing() as conn:
        if _dialect(conn).locks_rows:
            conn.execute("SELECT pg_advisory_xact_lock(CAST(? AS integer), CAST(? AS integer))",
                         (PG_LOG_LOCK, num % 2_147_483_647))
        if conn.execute("SELECT 1 FROM tasks WHERE id = ?", (num,)).fetchone() is None:
            raise TaskNotFound(f"no task {format_task_id(num)}; its log cannot be written")
        row = conn.execute("SELECT coalesce(max(seq), 0), coalesce(sum(length(data)), 0)"
                           " FROM task_log_chunks WHERE task_id = ?", (num,)).fetchone()
        last, size = int(row[0]), int(row[1])
        if at is not None and at < size:
            data = _after_retried(data, _read_chunks(conn, num, at, min(size - at, len(data))))
        for start in range(0, len(data), LOG_CHUNK_MAX):
            last += 1
            conn.execute("INSERT INTO task_log_chunks (task_id, seq, data) VALUES (?, ?, ?)",
                         (num, last, data[start:start + LOG_CHUNK_MAX]))
    return size + len(data)


# A ship of one chunk as one autocommit statement: the next seq and the size read in the
# statement's snapshot, the row added under the log's lock (as the transaction below adds it:
# while it is held no other ship of the log runs) unless ``at`` falls inside the log (a retried
# ship: the transaction below compares the bytes) or a ship that ended after the snapshot was
# taken (while this one waited for the lock) took that seq: the primary key refuses it, ON
# CONFLICT says so with no row, and the transaction below appends after it.
_SHIP_PG = """WITH held AS (SELECT coalesce(max(seq), 0) AS last, coalesce(sum(length(data)), 0) AS size,
 pg_advisory_xact_lock(CAST(:lock AS integer), CAST(:key AS integer)) AS locked
 FROM task_log_chunks WHERE task_id = :id), wrote AS (INSERT INTO task_log_chunks (task_id, seq, data)
 SELECT :id, last + 1, :data FROM held WHERE (CAST(:at AS BIGINT) IS NULL OR CAST(:at AS BIGINT) >= size)
 AND EXISTS (SELECT 1 FROM tasks WHERE id = :id) ON CONFLICT (task_id, seq) DO NOTHING RETURNING seq)
SELECT size, (SELECT count(*) FROM wrote) AS wrote FROM held"""


def _ship_alone(num: int, data: bytes, at: int | None) -> int | None:
    """``append_task_log`` of one chunk on PostgreSQL in one statement: the log's size afterwards,
    or None when it was not written (no such task, ``at`` inside the log, a seq taken)."""
    with _single_write() as conn:
        row = conn.execute(_SHIP_PG, {"id": num, "data": data, "at": at, "lock": PG_LOG_LOCK,
                                      "key": num % 2_147_483_647}).fetchone()
    return int(row["size"]) + len(data) if row["wrote"] else None


def _after_retried(data: bytes, held: bytes) -> bytes:
    # The log already holds ``held`` where ``data`` was meant to start: the same bytes are a
    # retried ship's (skip them); other bytes are another writer's (keep all of ``data``).
    return data[len(held):] if data.startswith(held) else data


def read_task_log(task_id: int | str, offset: int = 0, limit: int | None = None) -> bytes:
    """Bytes of a task's log from byte ``offset``, at most ``limit`` of them (None: to the end);
    b"" when it has none there (no log yet, or ``offset`` at or past its end). Bounded: on the
    database only the chunks holding those bytes are read. Raises ValidationError (bad id or a
    negative offset or limit), OSError (file)."""
    if offset < 0 or (limit is not None and limit < 0):
        raise ValidationError(f"a log read needs offset ≥ 0 and limit ≥ 0; got {offset}, {limit}")
    if not logs_in_database():
        try:
            with log_path(task_id).open("rb") as handle:
                handle.seek(offset)
                return handle.read(-1 if limit is None else limit)
        except FileNotFoundError:
            return b""
    num = parse_task_id(task_id)
    with _reading() as conn:
        return _read_chunks(conn, num, offset, limit)


def _read_chunks(conn: Connection, num: int, offset: int, limit: int | None) -> bytes:
    """``limit`` bytes (None: all) of task ``num``'s chunks from byte ``offset``: the chunks'
    lengths first (no data read), then only the chunks that hold the range."""
    if limit == 0:
        return b""
    first = last = None
    pos = skip = 0
    for row in conn.execute("SELECT seq, length(data) FROM task_log_chunks WHERE task_id = ? ORDER BY seq",
                            (num,)).fetchall():
        seq, length = row[0], int(row[1])
        if first is None and pos + length > offset:
            first, skip = seq, offset - pos
        pos += length
        if first is not None:
            last = seq
            if limit is not None and pos >= offset + limit:
                break
    if first is None:
        return b""
    rows = conn.execute("SELECT data FROM task_log_chunks WHERE task_id = ? AND seq BETWEEN ? AND ?"
                        " ORDER BY seq", (num, first, last)).fetchall()
    data = b"".join(bytes(row[0]) for row in rows)[skip:]
    return data if limit is None else data[:limit]


def task_log_size(task_id: int | str) -> int:
    """The size of a task's log in bytes (0 when it has none). Raises ValidationError (bad id)."""
    return task_log_sizes([task_id])[format_task_id(parse_task_id(task_id))]


def task_log_sizes(task_ids: Iterable[Any]) -> dict[str, int]:
    """``{"t_0001": bytes, ...}``: the log sizes of several tasks in one look (the board follows up
    to 16 running logs); 0 for a task without a log. Raises ValidationError (bad id)."""
    nums = [parse_task_id(t) for t in task_ids]
    if not logs_in_database():
        sizes = {}
        for num in nums:
            try:
                sizes[format_task_id(num)] = log_path(num).stat().st_size
            except OSError:
                sizes[format_task_id(num)] = 0
        return sizes
    found: dict[int, int] = {}
    if nums:
        with _reading() as conn:
            found = {row[0]: int(row[1]) for row in conn.execute(
                f"SELECT task_id, sum(length(data)) FROM task_log_chunks WHERE task_id IN ({_marks(nums)})"
                " GROUP BY task_id", nums).fetchall()}
    return {format_task_id(num): int(found.get(num, 0)) for num in nums}


# --------------------------------------------------------------------------------------------
# Workers: the heartbeat file beside the database (this machine's last worker) and the workers
# table (every worker on every host).


def take_lock(path: Path | str) -> int | None:
    """A single-instance lock (a worker pass's, serve.py's): an exclusive, non-blocking ``flock``
    on ``path`` (made 0600, its folder too when missing); the open descriptor, whose close
    releases it, or None when another process holds it. (The filelock package does the same flock,
    but importing it cost ~100 ms and ~8 MB of the worker's memory.) Raises OSError when the file
    cannot be made."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def flock_wait(fd: int, give_up: Callable[[], str | None], seconds: float = math.inf,
               waits: Callable[[], None] | None = None) -> str | None:
    """Take an exclusive ``flock`` on ``fd``, trying every 0.1 s: None once it is taken; else why
    not: what ``give_up()`` returned (asked between tries; None or "" to go on waiting), or
    ``"held for over N s"`` after ``seconds``. ``waits()`` is called once, when the first try finds
    the lock held (to say so)."""
    deadline = time.monotonic() + seconds
    for tries in itertools.count():
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            if not tries and waits is not None:
                waits()
            reason = give_up()
            if reason:
                return reason
            if time.monotonic() >= deadline:
                return f"held for over {seconds:g} s"
            time.sleep(0.1)
    raise AssertionError("unreachable")


def served_by() -> tuple[str, int] | None:
    """(serve.py's pid, its port) when a serve.py serves this queue now: the ``pid port`` it wrote
    in the serve lock beside the database (see serve.hold_queue), its process alive; else None.
    The port is what `connect` and `doctor` mean by default."""
    try:
        pid, port = state_path("serve.lock").read_text().split()[:2]
        os.kill(int(pid), 0)   # read, never locked here: a probe's lock would refuse a serve.py starting
    except PermissionError:    # alive, another user's
        pass
    except (OSError, ValueError):
        return None
    return pid, int(port)


def worker_lock_path() -> Path:
    """The single-instance lock file of this queue's worker passes."""
    return state_path("worker.lock")


WORKER_ROWS_KEEP_SEC = 7 * 86_400   # a worker row silent this long is deleted (seconds)


def _host_here() -> str:
    # Judging whose pids are ours: a malformed TASKBRIDGE_HOST (refused up front by the worker)
    # must not stop a reader from showing the workers.
    try:
        return host_name()
    except ValidationError:
        return socket.gethostname()


def write_worker_heartbeat(state: dict[str, Any]) -> None:
    """Record this worker process's heartbeat: the heartbeat file beside the database (atomic; what
    ``read_worker_heartbeat`` reads on this machine) and its row in ``workers`` (upserted, so
    every machine sees every worker). ``state``: what the worker says (state, task, tasks, slots,
    ...); ``pid_start`` in it (process start time, Unix seconds) goes to its own column and the
    file. pid, host and time are added here (the row's time on the queue's clock, ``store_now``).
    A new worker on a host deletes that host's rows of workers that
    stopped cleanly (a one-pass schedule would add one a minute), and any row silent for
    WORKER_ROWS_KEEP_SEC (7 days) goes; other rows stay, judged stale or gone by their readers.
    Raises StorageFault (a full or read-only disk), OSError (file), DatabaseUnusable / DatabaseBusy
    (the database; see ``store_sqlite.fault``), QueueGone before anything is written when the
    queue file this process used is gone."""
    if not database_url():   # no heartbeat file beside a queue file that went away (nor its folder made again)
        store_sqlite.refuse_gone(db_path())
        store_sqlite.refuse_stale_wal(db_path())   # nor over the lost mark (mark_queue_lost) of one replaced
    state = dict(state)
    pid_start = state.pop("pid_start", None)
    beat = state | {"pid": os.getpid(), "host": host_name(), "ts": now()}
    path = state_path("worker.json")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(path, json.dumps(beat | {"pid_start": pid_start}))   # readers tell a reused pid by it
    except OSError as exc:
        fault = storage_fault(exc, path)
        if fault is None:
            raise
        raise fault from exc
    _upsert_worker(beat, pid_start)


WORKER_ROW_EVERY_SEC = 5.0   # an unchanged heartbeat refreshes the worker's row at most this often
_ROW_SAID: dict[tuple[str, str], tuple[str, float]] = {}   # (database, worker) -> (row's text, written at)


def _upsert_worker(beat: dict[str, Any], pid_start: float | None) -> None:
    # The worker beats every second per running task: its row is written when what it says
    # changed, else every WORKER_ROW_EVERY_SEC (a heartbeat is judged recent for 180 s).
    name = f"worker:{beat['host']}:{beat['pid']}"
    said = json.dumps({k: v for k, v in beat.items() if k not in ("pid", "host", "ts")})
    key = (database_url() or str(db_path()), name)
    last = _ROW_SAID.get(key)
    if last is not None and last[0] == said and beat["ts"] - last[1] < WORKER_ROW_EVERY_SEC:
        return
    _ROW_SAID.pop(key, None)
    if len(_ROW_SAID) > 64:            # a process that used many databases (tests)
        _ROW_SAID.clear()
    with _writing() as conn:
        at = store_now(conn)   # the row is judged by other hosts: on the queue's clock, not this one's
        new = conn.execute("SELECT 1 FROM workers WHERE name = ?", (name,)).fetchone() is None
        conn.execute(
            "INSERT INTO workers (name, host, pid, pid_start, started_at, heartbeat_at, state)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET heartbeat_at = excluded.heartbeat_at,"
            " state = excluded.state, pid_start = coalesce(excluded.pid_start, workers.pid_start)",
            (name, beat["host"], beat["pid"], pid_start, at, at, said))
        if new:
            gone = [row[0] for row in conn.execute(
                "SELECT name, state FROM workers WHERE host = ? AND name != ?", (beat["host"], name)).fetchall()
                if _said(row[1]).get("state") == "stopped"]
            gone += [row[0] for row in conn.execute("SELECT name FROM workers WHERE heartbeat_at < ?",
                                                    (at - WORKER_ROWS_KEEP_SEC,)).fetchall()]
            for old in gone:
                conn.execute("DELETE FROM workers WHERE name = ?", (old,))
    _ROW_SAID[key] = (said, beat["ts"])


def _said(text: str | None) -> dict[str, Any]:
    try:
        said = json.loads(text or "{}")
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


def list_workers() -> list[dict[str, Any]]:
    """Every worker that reported to this queue from any host, newest heartbeat first: what it
    said (state, task, tasks, slots, budget, error, ...) with ``name`` (``worker:<host>:<pid>``,
    as its leases' owner), ``host``, ``pid``, ``pid_start``, ``ts`` (heartbeat, Unix seconds),
    ``at`` and ``started_at`` (ISO 8601 UTC), ``age_sec`` (seconds since its heartbeat) and
    ``pid_running`` (True or False for a worker on this host, None for another host)."""
    with _reading() as conn:
        rows = conn.execute("SELECT name, host, pid, pid_start, started_at, heartbeat_at, state FROM workers"
                            " ORDER BY heartbeat_at DESC, name").fetchall()
        at = store_now(conn)
    here = _host_here()
    return [_said(row["state"]) | {
        "name": row["name"], "host": row["host"], "pid": row["pid"], "pid_start": row["pid_start"],
        "ts": row["heartbeat_at"], "at": iso(row["heartbeat_at"]), "started_at": iso(row["started_at"]),
        "age_sec": round(at - row["heartbeat_at"], 1),
        "pid_running": _pid_running(row["pid"]) if row["host"] == here else None} for row in rows]


def read_worker_heartbeat() -> dict[str, Any] | None:
    """The last heartbeat a worker on this machine wrote (the file beside the database), with
    ``age_sec``, ``at`` and ``pid_running`` added (True or False when the worker wrote it on this
    host, None for another host), or None if no worker ever ran here. ``list_workers`` has every
    host's."""
    try:
        state = json.loads(state_path("worker.json").read_text())
    except (OSError, ValueError):
        return None
    state["age_sec"] = round(now() - float(state.get("ts", 0)), 1)
    state["at"] = iso(float(state.get("ts", 0)))
    here = state.get("host") == _host_here()
    state["pid_running"] = _pid_running(state.get("pid")) if here else None
    return state


def _pid_running(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True
    except (OSError, ValueError, TypeError):
        return False
    return True


# --------------------------------------------------------------------------------------------
# Reverse bridge: Claude jobs.

JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")


def _job_dict(row: Row) -> dict[str, Any]:
    job = row_dict(row)
    job["usage"] = json.loads(job["usage"]) if job["usage"] else None
    for column in ("created_at", "started_at", "finished_at"):
        job[column] = iso(job[column])
    return job


def create_claude_job(prompt: str, backend: str, timeout_sec: int, system: str | None = None,
                      model: str | None = None, owner: str | None = None) -> dict[str, Any]:
    """Record a new reverse-bridge job (status ``queued``); returns it. ``owner`` names the
    server process that will run it (for restart recovery)."""
    prompt = _text("prompt", prompt, 1_000_000)
    with _writing() as conn:
        row = conn.execute(
            "INSERT INTO claude_jobs (prompt, system, model, backend, timeout_sec, owner, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING *",
            (prompt, system, model, backend, timeout_sec, owner, now()),
        ).fetchone()
        _event(conn, None, "claude_job", f"job {row['id']} queued ({backend})")
        return _job_dict(row)


def start_claude_job(job_id: int, pid: int | None = None, pid_start: float | None = None) -> None:
    """Mark a queued job running (with the backend process pid and start time when there is one)."""
    with _writing() as conn:
        conn.execute(
            "UPDATE claude_jobs SET status = 'running', started_at = coalesce(started_at, ?),"
            " pid = coalesce(?, pid), pid_start = coalesce(?, pid_start)"
            " WHERE id = ? AND status IN ('queued', 'running')",
            (now(), pid, pid_start, job_id),
        )


def finish_claude_job(job_id: int, status: str, answer: str | None = None, error: str | None = None,
                      usage: dict | None = None) -> dict[str, Any]:
    """Finish a job as done, failed or cancelled. A job already finished is left as it is (so a
    late result cannot overwrite a cancel). Raises JobNotFound or ValidationError."""
    if status not in ("done", "failed", "cancelled"):
        raise ValidationError(f"a job finishes as done, failed or cancelled; got {status!r}")
    with _writing() as conn:
        conn.execute(
            "UPDATE claude_jobs SET status = ?, answer = ?, error = ?, usage = ?, finished_at = ?"
            " WHERE id = ? AND status IN ('queued', 'running')",
            (status, answer, error, _json(usage), now(), job_id),
        )
        row = conn.execute("SELECT * FROM claude_jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(f"Claude job {job_id} not found")
        _event(conn, None, "claude_job", f"job {job_id} {row['status']}")
        return _job_dict(row)


def get_claude_job(job_id: Any) -> dict[str, Any]:
    """One job. Raises ValidationError (bad id) or JobNotFound."""
    job_id = coerce_int("job_id", job_id, 1, 2**62)
    with _reading() as conn:
        row = conn.execute("SELECT * FROM claude_jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise JobNotFound(f"Claude job {job_id} not found; claude_submit returns the ids that exist")
    return _job_dict(row)


def list_claude_jobs(status: Iterable[str] | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """Newest jobs first, optionally only some statuses."""
    chosen = list(status) if status else list(JOB_STATUSES)
    with _reading() as conn:
        rows = conn.execute(
            f"SELECT * FROM claude_jobs WHERE status IN ({_marks(chosen)}) ORDER BY id DESC LIMIT ?",
            [*chosen, limit]
        ).fetchall()
    return [_job_dict(r) for r in rows]
