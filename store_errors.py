"""The store's error tree: what task_store and its database modules raise, and what the boundaries
(CLI, MCP, HTTP) translate; nothing else is caught above the store (issue 20).

Each database module (store_sqlite.py, store_pg.py) maps its own driver's errors into these, so no
sqlite3 or psycopg error, and no sorting of their words, reaches the modules above the store. Every
name here is also task_store's (``task_store.DatabaseBusy``), as callers use them.

Imports nothing; reads no env. Not run on its own.
"""
from __future__ import annotations


class TaskStoreError(Exception):
    """Base class of every error the store raises; its message is safe to show a user."""


class ValidationError(TaskStoreError):
    """An argument is malformed or out of range; nothing was written."""


class LogFolderTaken(ValidationError):
    """The log folder (TASK_LOG_DIR) holds another SQLite queue's task logs: this queue would write
    into that queue's t_NNNN.log files (or, new, move them aside). Nothing was moved or made; the
    message names both queues and the way out (a log folder of its own)."""


class TaskNotFound(TaskStoreError):
    """No task has the given id."""


class InvalidTransition(TaskStoreError):
    """The task's current status does not allow the requested change."""


class StaleAttempt(TaskStoreError):
    """A write named an attempt (run marker) that is no longer the task's current one (fencing)."""


class JobNotFound(TaskStoreError):
    """No Claude job has the given id."""


class DatabaseBusy(TaskStoreError):
    """Another process held the queue's write lock too long (SQLite's "database is locked" past
    BUSY_WAIT_SEC; a PostgreSQL lock not granted within PG_LOCK_TIMEOUT_SEC, or a deadlock
    broken); nothing was written: try again."""


class StorageFault(TaskStoreError):
    """The disk under the queue's files refused a write (full, over quota, read-only, ...);
    nothing was written. The message names the folder, its mount and the way out."""


class DiskFull(StorageFault):
    """No space (or quota) left where the queue's files live: writing works again once space is
    freed there, so a writer may hold what it has and retry."""


class ReadOnlyStorage(StorageFault):
    """The queue's folder is on a filesystem mounted read-only (``errors=remount-ro`` after disk
    errors, say): reading still works; retrying a write cannot help until it is remounted."""


class DatabaseUnusable(TaskStoreError):
    """The SQLite queue file cannot be used as it is: a folder, a path that cannot be opened or
    made, no permission to read or write it, or (DatabaseCorrupt) not a database at all. Retrying
    cannot help until it is fixed. The message names the file and the way out; ``detail`` is the
    operating system's or SQLite's own words, ``way_out`` the way out alone (or "")."""

    def __init__(self, message: str, detail: str = "", way_out: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message
        self.way_out = way_out


class QueueGone(DatabaseUnusable):
    """The SQLite queue file this process had open was deleted or moved away (or its folder was):
    nothing is written, and no new, empty queue is made in its place, which would strand the
    tasks of the one that went. Restoring the file there lets this process carry on; a process
    started anew makes a new queue at that path, as at a first use."""


class QueueReplaced(QueueGone):
    """The SQLite queue file this process had open was replaced by another file, but SQLite's
    ``-wal`` beside it is still the old file's: opened with it, the new file would get the old
    one's pages and be corrupted. SQLite never removes a moved file's WAL, so this lasts until a
    person moves it away (its message says how)."""


class DatabaseCorrupt(DatabaseUnusable):
    """The queue file is not a SQLite database, or it is damaged ("file is not a database",
    "database disk image is malformed")."""


class ConstraintViolated(DatabaseUnusable):
    """The database refused a write that would break one of the queue's constraints (a duplicate
    key, a reference to a row that is not there, a value a CHECK refuses), on either database;
    nothing was written. Not the file's or the server's fault: a write the store should not have
    made (a bug), or one racing another writer. ``detail`` is the database's own words. A
    DatabaseUnusable, as SQLite's constraint errors were before both databases said it alike."""


# The way out a ConstraintViolated's message gives, on either database.
CONSTRAINT_WAY_OUT = ("nothing was written; try again, and if it happens again report it as a TaskBridge bug "
                      "(the queue's data is intact)")


class DatabaseUnavailable(TaskStoreError):
    """The PostgreSQL queue cannot be used: a bad URL, a server that does not answer or refuses
    the login, a lost connection, or psycopg missing. The message names the URL (never its
    password) and the way out."""
