"""The SQLite side of the store (the default, one machine): the connection factory and its pragmas,
the journal mode a folder's filesystem allows, read-only opening on a read-only mount, migrations
run on open, write transactions (``BEGIN IMMEDIATE`` with short busy waits of our own), the change
watch on the file, and sqlite3's errors mapped into the store's own (store_errors.py).

task_store holds the queue's SQL, written once for both databases, and keeps one connection per
thread and file; this module opens them and says what a failure amounts to (``fault``): a locked
file DatabaseBusy, a full disk DiskFull, a read-only mount ReadOnlyStorage, a file that is no
database DatabaseCorrupt, any other DatabaseUnusable, each naming the file and the way out. No
module above the store sees a sqlite3 error or reads SQLite's words.

Env read at call time: ``TASK_DB_JOURNAL`` (auto | wal | delete), ``TASKBRIDGE_MOUNTINFO`` (a mount
table in /proc/self/mountinfo's format, for tests). Imports the standard library and
store_errors (file_watch and psutil only where used). Not run on its own (task_store imports it).
"""
from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shlex
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store_errors import (
    CONSTRAINT_WAY_OUT,
    ConstraintViolated,
    DatabaseBusy,
    DatabaseCorrupt,
    DatabaseUnusable,
    DiskFull,
    QueueGone,
    QueueReplaced,
    ReadOnlyStorage,
    StorageFault,
    TaskStoreError,
    ValidationError,
)

if TYPE_CHECKING:
    from file_watch import FolderWatch


# SQLite's WAL keeps its index in shared memory (a mmap'd -shm file) that these filesystems do not
# share between processes or machines; users report corrupted queues on them. "fuse" matches
# every FUSE type (fuse.sshfs, fuse.s3fs, fuseblk, ...).
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "9p", "virtiofs",
                       "fuse", "afs", "ncpfs", "ceph", "glusterfs", "lustre", "gpfs", "vboxsf",
                       "vmhgfs", "prl_fs", "davfs", "webdav", "autofs", "osxfuse", "macfuse")
JOURNAL_CHOICES = ("auto", "wal", "delete")


def db_filesystem(folder: Path | str) -> tuple[str, str] | None:
    """``(filesystem type, mount point)`` of the mount holding ``folder`` (resolved), from
    ``/proc/self/mountinfo`` on Linux (or the file ``$TASKBRIDGE_MOUNTINFO`` names, in the same
    format), else ``psutil.disk_partitions(all=True)`` (macOS: getfsstat). None when unknown."""
    folder = os.path.realpath(folder)
    table = os.environ.get("TASKBRIDGE_MOUNTINFO") or "/proc/self/mountinfo"
    mounts: list[tuple[str, str]] = []
    try:
        with open(table, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if " - " in line and len(fields) >= 5:
                    fstype = line.split(" - ", 1)[1].split()[0]
                    mounts.append((_unescape_mount(fields[4]), fstype))
    except OSError:
        mounts = _psutil_mounts()
    best: tuple[str, str] | None = None
    for point, fstype in mounts:
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[1])):
            best = (fstype, point)
    return best


def _unescape_mount(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _psutil_mounts() -> list[tuple[str, str]]:
    try:
        import psutil  # only where /proc is missing (macOS); the store is stdlib-only otherwise
        return [(p.mountpoint, p.fstype) for p in psutil.disk_partitions(all=True)]
    except Exception:  # noqa: BLE001 - detection is best effort; unknown means local
        return []


def is_network_filesystem(fstype: str) -> bool:
    """True for a filesystem type on which SQLite's WAL is unsafe (see NETWORK_FILESYSTEMS)."""
    fstype = fstype.lower()
    return any(fstype == name or fstype.startswith(name + ".") or
               (name == "fuse" and fstype.startswith("fuse")) for name in NETWORK_FILESYSTEMS)


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def storage_fault(exc: BaseException, path: Path | str) -> StorageFault | None:
    """The StorageFault that ``exc`` (an OSError, or SQLite's error for a write) amounts to for
    a write at ``path`` (a queue file or folder: the database, a log, a worktree): DiskFull for
    ENOSPC/EDQUOT and SQLite's "database or disk is full", ReadOnlyStorage for EROFS and a
    "readonly database" on a filesystem mounted read-only; None for any other error."""
    if isinstance(exc, StorageFault):
        return exc
    code, text = getattr(exc, "errno", None), str(exc).lower()
    if code in FULL_ERRNOS or (isinstance(exc, sqlite3.Error) and "disk is full" in text):
        return DiskFull(disk_fault_line("full", path))
    if code == errno.EROFS or (isinstance(exc, sqlite3.Error) and "readonly" in text and read_only_at(path)):
        return ReadOnlyStorage(disk_fault_line("read-only", path))
    return None


# SQLite's primary result codes (the low byte of ``sqlite_errorcode``) a queue file's fault is told by.
SQLITE_PERM, SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_CORRUPT = 3, 5, 6, 8, 11
SQLITE_CANTOPEN, SQLITE_CONSTRAINT, SQLITE_NOTADB = 14, 19, 26
_OPEN_ERRORS = (IsADirectoryError, NotADirectoryError, FileNotFoundError, FileExistsError)


def fault(exc: BaseException, path: Path | str) -> TaskStoreError:
    """The store error that ``exc`` (a sqlite3.Error, or an OSError met opening the queue) amounts
    to for the SQLite queue file ``path``, its message naming the file and the way out: a
    StorageFault for a full or read-only disk (``storage_fault``), DatabaseBusy when another
    process held the lock too long, DatabaseCorrupt for a file that is no database or is damaged,
    ConstraintViolated for a write a constraint refused, else DatabaseUnusable. A TaskStoreError is
    returned as it is. Told by SQLite's result code, by its words where an error carries none."""
    if isinstance(exc, TaskStoreError):
        return exc
    fault = storage_fault(exc, path)
    if fault is not None:
        return fault
    code, text = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF, str(exc).lower()
    detail = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        detail = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror

    def said(way_out: str) -> str:
        return f"the task database {path} cannot be used ({detail}): {way_out}"

    def unusable(kind: type[DatabaseUnusable], way_out: str) -> DatabaseUnusable:
        return kind(said(way_out), detail, way_out)

    if code == SQLITE_CONSTRAINT or isinstance(exc, sqlite3.IntegrityError):
        return ConstraintViolated(f"the task database {path} refused a write ({detail}): {CONSTRAINT_WAY_OUT}", detail)
    if code in (SQLITE_NOTADB, SQLITE_CORRUPT) or "not a database" in text or "malformed" in text or "corrupt" in text:
        if not _maybe_queue(path):   # some other file (/etc/passwd): nobody's queue to move aside
            return unusable(DatabaseUnusable, "it is not a SQLite database at all, so not a queue: point "
                                              "TASK_DB_PATH at the queue's file, or at a new path (a new queue "
                                              "is made there)")
        aside = f"mv {shlex.quote(str(path))} {shlex.quote(str(path) + '.broken')}"
        return unusable(DatabaseCorrupt, f"it is not a SQLite database or it is damaged: restore it from a backup, "
                                         f"move it aside ({aside}; a new, empty queue is made in its place), or "
                                         "point TASK_DB_PATH at another file")
    if code in (SQLITE_BUSY, SQLITE_LOCKED) or "locked" in text or "busy" in text:
        return DatabaseBusy(said("another process holds it locked: try again in a moment"))
    if code in (SQLITE_READONLY, SQLITE_PERM) or "readonly" in text or isinstance(exc, PermissionError):
        return unusable(DatabaseUnusable, "it cannot be written: fix the permissions of the file and of its folder "
                                          "(SQLite writes -wal and -shm files beside it), or point TASK_DB_PATH "
                                          "elsewhere")
    if code == SQLITE_CANTOPEN or "unable to open" in text or isinstance(exc, _OPEN_ERRORS):
        return unusable(DatabaseUnusable, "it cannot be opened: TASK_DB_PATH must name a file (not a folder) in "
                                          "a folder this user can write")
    return unusable(DatabaseUnusable, "check TASK_DB_PATH and the file's permissions, or restore it from a backup")


SQLITE_HEADER = b"SQLite format 3\x00"   # the first 16 bytes of every SQLite database file


def _maybe_queue(path: Path | str) -> bool:
    """Whether the file ``path``, which SQLite refused, may be a damaged queue (so moving it aside
    for a new one is the way out): it begins as a SQLite database does, is named as one (.db,
    .sqlite, .sqlite3), or cannot be read to tell."""
    if Path(path).suffix.lower() in (".db", ".sqlite", ".sqlite3"):
        return True
    try:
        with open(path, "rb") as file:
            return file.read(len(SQLITE_HEADER)) in (SQLITE_HEADER, b"")
    except OSError:
        return True


def read_only_at(path: Path | str) -> bool:
    """Whether the filesystem holding ``path`` (or its nearest existing folder) is mounted read-only."""
    try:
        return bool(os.statvfs(_nearest_existing(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _nearest_existing(path: Path | str) -> str:
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def disk_fault_line(kind: str, path: Path | str) -> str:
    """One line for a disk that is ``full`` or ``read-only`` under ``path``: the folder, its
    filesystem, mount point and free space, and the way out."""
    folder = _nearest_existing(path)
    found = db_filesystem(folder)
    mount = f"{found[0]} mounted at {found[1]}" if found else "its filesystem"
    if kind == "read-only":
        return (f"read-only filesystem: {folder} ({mount}, mounted read-only) cannot be written; reading "
                "the queue still works; writing needs it remounted read-write (after a disk check) or "
                "TASK_DB_PATH / TASK_LOG_DIR / TASKBRIDGE_WORKTREE_ROOT on another disk")
    try:
        st = os.statvfs(folder)
        free = f"{st.f_bavail * st.f_frsize / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    return (f"disk full: {path} could not be written ({mount}, {free}; or over a quota); free space "
            "there, or point TASK_DB_PATH / TASK_LOG_DIR / TASKBRIDGE_WORKTREE_ROOT at another disk")


def write_problem(path: Path) -> tuple[str, str] | None:
    """What stops this process writing the SQLite queue ``path``, checked without writing
    anything: ``(what cannot be written, the way out)``, or None when it can be written (or is
    ``:memory:``). Looks at the filesystem (mounted read-only), the queue file and the files SQLite
    keeps beside it (``-wal``, ``-shm``, ``-journal``) that exist, and the folder they sit in (SQLite
    makes its ``-wal`` and ``-shm`` files there), or the nearest folder that exists when that folder
    is still to be made. A file SQLite can only read is opened read-only without a word, so a
    writer asks here first."""
    if str(path) == ":memory:":
        return None
    if read_only_at(path.parent):
        said, _, way_out = disk_fault_line("read-only", path.parent).partition("; ")
        return said, way_out
    files = [path.with_name(path.name + suffix) for suffix in ("", "-wal", "-shm", "-journal")]
    blocked = [file for file in files if file.is_file() and not _may(file, os.W_OK)]
    if blocked:   # every one named at once: SQLite makes its -wal and -shm with the queue file's mode
        return "; ".join(("the queue file" if file == path else "SQLite's file") +
                         f" {file} is not writable by {_user_words(file)}" for file in blocked), _fix_words(*blocked)
    folder = Path(_nearest_existing(path.parent))
    if not _may(folder, os.W_OK | os.X_OK):
        made = "" if folder == path.parent else f" (it would make {path.parent} inside it)"
        return (f"the queue's folder {folder} is not writable by {_user_words(folder)}{made}; SQLite writes "
                f"its -wal and -shm files beside the queue file"), _fix_words(folder)
    return None


def _may(path: Path, mode: int) -> bool:
    """Whether this process may use ``path`` so (``os.access`` by its effective user and group)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _owner(path: Path) -> str:
    try:
        uid = path.stat().st_uid
    except OSError:
        return "?"
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _me() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def _user_words(path: Path) -> str:
    """``user nobody (it belongs to root, mode 0644)``: who asked, whose ``path`` is, its mode."""
    try:
        mode = f", mode {path.stat().st_mode & 0o7777:04o}"
    except OSError:
        mode = ""
    return f"user {_me()} (it belongs to {_owner(path)}{mode})"


def _fix_words(*blocked: Path) -> str:
    """The way out for ``blocked`` (files or a folder of the queue) this user cannot write: write
    access given by the owner it is (``chmod u+w``), else by its owner or root (``chown``)."""
    me, names = _me(), " ".join(shlex.quote(str(path)) for path in blocked)
    if all(_owner(path) == me for path in blocked):
        return (f"{'it is' if len(blocked) == 1 else 'they are'} yours but read-only: give yourself write access "
                f"(chmod u+w {names}), or point "
                "TASK_DB_PATH at another queue (a new one is made at a new path)")
    owners = " or ".join(sorted({_owner(path) for path in blocked}))
    return (f"run TaskBridge as {owners}, who owns it, or give user {me} write access to it "
            f"(sudo chown {shlex.quote(me)} {names}), or point TASK_DB_PATH at a queue "
            f"this user can write (a new one is made at a new path)")


def journal_mode(path: Path | str) -> str:
    """The journal mode for the database at ``path``: ``wal`` on a local disk; on a network or
    virtual filesystem (NFS, SMB/CIFS, 9p, virtiofs, FUSE, ...) a ValidationError naming the
    filesystem, the folder and the ways out. ``TASK_DB_JOURNAL`` overrides: ``auto`` (default, as
    described), ``wal`` (keep WAL: you know the mount is safe) or ``delete`` (a rollback journal:
    slower, no concurrent readers during a write, for one machine only)."""
    choice = (os.environ.get("TASK_DB_JOURNAL") or "auto").strip().lower()
    if choice not in JOURNAL_CHOICES:
        raise ValidationError(f"TASK_DB_JOURNAL={choice!r} is not one of {', '.join(JOURNAL_CHOICES)}; "
                              "unset it for the default (auto)")
    if choice != "auto":
        return choice
    folder = Path(path).parent
    found = db_filesystem(folder)
    if found and is_network_filesystem(found[0]):
        raise ValidationError(
            f"the queue database folder {folder} is on a {found[0]} filesystem (mounted at "
            f"{found[1]}), where SQLite's WAL is unsafe (its shared memory is not shared there) and "
            "queues get corrupted; point TASK_DB_PATH at a local disk, or set TASK_DB_JOURNAL=delete "
            "to use a rollback journal there (one machine only), or TASK_DB_JOURNAL=wal if you know "
            "this mount is safe")
    return "wal"


def migrate(conn: sqlite3.Connection, migrations: Sequence[Callable[[sqlite3.Connection], None]]) -> None:
    """Apply the ``migrations`` the file lacks (its version in ``PRAGMA user_version``), in one
    BEGIN IMMEDIATE transaction."""
    if conn.execute("PRAGMA user_version").fetchone()[0] >= len(migrations):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        for number, step in enumerate(migrations[version:], start=version + 1):
            step(conn)
            conn.execute(f"PRAGMA user_version = {number:d}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _create_private(path: Path) -> None:
    """Create an empty file readable by this user only, unless it exists (SQLite gives its WAL
    and shared-memory files the database file's mode)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def connect(path: Path, migrations: Sequence[Callable[[sqlite3.Connection], None]]) -> sqlite3.Connection:
    """A new connection to the queue file ``path`` (its folder made 0700, the file 0600), set up
    once here: autocommit (transactions explicit), rows as sqlite3.Row, busy timeout, foreign keys,
    the journal (WAL; see ``journal_mode``), and migrated by ``migrations``; on a filesystem mounted
    read-only a read-only one (``_connect_read_only``). A file this process opened before and
    that is gone now is not made again (``refuse_gone``). The caller closes it. Raises QueueGone,
    DatabaseUnusable / DatabaseCorrupt / DatabaseBusy / StorageFault (see ``fault``),
    ValidationError (``journal_mode``)."""
    refuse_gone(path)
    refuse_stale_wal(path)
    try:
        conn = _open(path, migrations)
    except (sqlite3.Error, OSError) as exc:
        raise fault(exc, path) from exc
    if str(path) != ":memory:":
        where = os.path.abspath(path)
        _OPENED[where] = (file_id(where), file_id(where + "-wal"))
    return conn


# The queue files this process has opened (absolute path -> the (device, inode) of the file and of
# its -wal then). One of them gone is a queue deleted or moved away under a running process: making
# a new, empty one there (what a first open does) would carry the process on against a queue
# without its tasks, the running ones stranded. One replaced while the -wal beside it is still the
# old file's would be corrupted by it (refuse_stale_wal).
_OPENED: dict[str, tuple[tuple[int, int] | None, tuple[int, int] | None]] = {}


def file_id(path: Path | str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def refuse_gone(path: Path | str) -> None:
    """Raise QueueGone when the queue file ``path`` was opened by this process before (``connect``)
    and is gone now (deleted, moved away, its folder too); a file put back there (restored, or
    replaced by another queue) is opened as any. A path never opened here passes: a first open
    makes the queue."""
    where = os.path.abspath(path)
    if where not in _OPENED or os.path.exists(where):
        return
    way_out = (f"put the file back there (from where it was moved, or a backup) and this process carries on; "
               f"or, to begin a new, empty queue at {where}, stop it and {stale_files_words(where)}, then start it")
    raise QueueGone(f"the task database {where} is gone (deleted or moved away while this process used it); no "
                    f"new queue was made in its place: {way_out}", "the queue file is gone", way_out)


def stale_files_words(where: Path | str) -> str:
    """The step before a new file goes where the queue file ``where`` went: its -wal and -shm, which
    SQLite leaves beside the path and would read into a new file there, moved along."""
    name = Path(where).name
    return (f"move {name}-wal and {name}-shm, if they are still beside it, next to the file that went under its "
            f"name plus -wal and -shm (delete them if it is gone for good): a new file there is read with them and "
            f"corrupted")


def refuse_stale_wal(path: Path | str) -> None:
    """Raise QueueReplaced when the queue file ``path``, opened by this process before, is another
    file now while the ``-wal`` beside it is still the one the old file had and holds pages:
    SQLite would read them into the new file as its own (its own warning: never rename or replace
    a database file in use; it leaves a moved file's WAL behind on close, for good). Passes once
    that WAL is moved away or deleted, or when there was none."""
    where = os.path.abspath(path)
    if where not in _OPENED:
        return
    file_then, wal_then = _OPENED[where]
    file_now = file_id(where)
    if file_now is None or file_now == file_then or wal_then is None or not _stale_wal(where, wal_then):
        return
    name = Path(where).name
    way_out = (f"stop every TaskBridge process using this queue (worker, serve.py, MCP servers); then move "
               f"{name}-wal and {name}-shm next to the old {name}, wherever it went, under its name plus -wal and "
               f"-shm (delete them if the old file is gone for good), and start them again. A process started "
               f"before they are moved reads the new file with them and corrupts it")
    raise QueueReplaced(f"the task database {where} was replaced by another file while this process used it, and "
                        f"SQLite's {where}-wal beside it still holds the old file's pages: nothing is read or "
                        f"written: {way_out}", "the queue file was replaced in use", way_out)


def _stale_wal(where: str, wal_then: tuple[int, int]) -> bool:
    """Whether ``where``'s -wal is still the file ``wal_then`` names and holds pages."""
    try:
        st = os.stat(where + "-wal")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == wal_then and st.st_size > 0


def forget_opened() -> None:
    """Forget which queue files this process opened (``task_store.close_connections``: a process
    that lets go of its queues on purpose); the next open of any is a first one."""
    _OPENED.clear()


@contextlib.contextmanager
def mapped(path: Path | str) -> Iterator[None]:
    """Raise what the body raises from SQLite (or an OSError met opening ``path``) as the store's
    error (``fault``)."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        raise fault(exc, path) from exc


@contextlib.contextmanager
def reading(conn: sqlite3.Connection, path: Path | str, drop: Callable[[], None]) -> Iterator[sqlite3.Connection]:
    """Reads on ``conn`` (the queue ``path``'s): a SQLite error leaves as the store's (``fault``),
    ``drop()`` called first when the connection must not be used again."""
    try:
        yield conn
    except sqlite3.Error as exc:
        if breaks_connection(exc):
            drop()
        raise fault(exc, path) from exc


BUSY_WAIT_SEC = 30.0  # how long a write waits for the write lock before "database is locked"


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, path: Path | str, drop: Callable[[], None],
                lock_wait_sec: float | None = None,
                give_up: Callable[[], bool] | None = None) -> Iterator[sqlite3.Connection]:
    """A write transaction on ``conn``: ``BEGIN IMMEDIATE`` takes the write lock before the first
    read, waiting for it up to ``lock_wait_sec`` seconds (default BUSY_WAIT_SEC) and no longer once
    ``give_up()`` is true (``_begin_immediate``), COMMIT after the
    body, ROLLBACK on any error. A SQLite error leaves as the store's (``fault``), an OSError of
    a full or read-only disk as StorageFault; ``drop()`` is called when the connection must not
    be used again (a ROLLBACK that failed, a broken connection). RuntimeError for a transaction
    opened inside another (a bug)."""
    if conn.in_transaction:  # a store function called another inside its transaction: a bug
        raise RuntimeError("task_store: a write transaction was opened inside another one")
    try:
        _begin_immediate(conn, BUSY_WAIT_SEC if lock_wait_sec is None else lock_wait_sec, give_up)
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    except BaseException as exc:
        # never reuse a connection mid-transaction (its ROLLBACK itself failed) or a broken one
        if conn.in_transaction or (isinstance(exc, sqlite3.Error) and breaks_connection(exc)):
            drop()
        if isinstance(exc, sqlite3.Error):
            raise fault(exc, path) from exc
        found = storage_fault(exc, path) if isinstance(exc, OSError) else None
        if found is not None:
            raise found from exc
        raise


def health(path: Path, migrations: Sequence[Callable[[sqlite3.Connection], None]]) -> dict[str, Any]:
    """``task_store.database_health`` for the queue file ``path``: ``{"backend": "sqlite", "path",
    "integrity" ("ok" or SQLite's first complaints), "journal_mode", "filesystem", "tasks"}``.
    Opens (and migrates) it like every entry point; raises as ``connect``."""
    conn = connect(path, migrations)
    try:
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check(5)")]
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        tasks = conn.execute("SELECT count(*) FROM tasks").fetchone()[0]
    except sqlite3.Error as exc:
        raise fault(exc, path) from exc
    finally:
        conn.close()
    return {"backend": "sqlite", "path": str(path), "integrity": "ok" if problems == ["ok"] else "; ".join(problems),
            "journal_mode": mode, "filesystem": db_filesystem(path.parent), "tasks": tasks}


def checkpoint(conn: sqlite3.Connection) -> None:
    """Copy the WAL back into the database without waiting for readers (``PASSIVE``)."""
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def change_watch(path: Path) -> FolderWatch:
    """A ``file_watch.FolderWatch`` on the files SQLite writes at each commit to the queue file
    ``path`` (the ``-wal`` file; the file itself in rollback-journal mode)."""
    from file_watch import FolderWatch  # imported by waiting processes only
    return FolderWatch(path.parent, (path.name, f"{path.name}-wal", f"{path.name}-journal"))


def _open(path: Path, migrations: Sequence[Callable[[sqlite3.Connection], None]]) -> sqlite3.Connection:
    if str(path) != ":memory:" and read_only_at(path.parent):
        return _connect_read_only(path, len(migrations))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if str(path) != ":memory:" and not path.exists():
        _create_private(path)
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False,
                           cached_statements=256)
    try:
        _set_up(conn, path, migrations)
    except BaseException:
        conn.close()
        raise
    return conn


def _set_up(conn: sqlite3.Connection, path: Path, migrations: Sequence[Callable[[sqlite3.Connection], None]]) -> None:
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute("PRAGMA foreign_keys = ON")
    _refuse_foreign(conn, path)   # before anything below writes to the file
    _switch_journal(conn, journal_mode(path))
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA wal_autocheckpoint = 10000")  # ~40 MB; the worker also checkpoints each minute
    conn.execute("PRAGMA mmap_size = 268435456")  # reads map the file (256 MB) instead of copying pages
    migrate(conn, migrations)


def _switch_journal(conn: sqlite3.Connection, mode: str) -> None:
    """Put the file in journal ``mode`` unless it is in it. When two connections make a new queue
    at once, both switch it: the later one reads the header, then needs the write lock the first
    holds, and SQLite answers "locked" at once (its busy handler is not called for a read that
    would turn into a write: that could deadlock). The switch is then tried again, in short
    sleeps, for up to BUSY_WAIT_SEC (by then the first has usually made the switch, and this one
    finds it made)."""
    deadline = time.monotonic() + BUSY_WAIT_SEC
    while conn.execute("PRAGMA journal_mode").fetchone()[0] != mode:
        try:
            conn.execute(f"PRAGMA journal_mode = {mode}")
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.001 * (0.5 + random.random()))


def _is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" / "busy" (another connection holds the lock)."""
    return "locked" in str(exc) or "busy" in str(exc)


def _refuse_foreign(conn: sqlite3.Connection, path: Path) -> None:
    """Raise DatabaseUnusable when ``path`` is another program's SQLite database (tables, none of
    them the queue's ``tasks``): it would be migrated into a queue, its journal mode and
    ``user_version`` changed, which can break the program it belongs to. A new, empty file passes."""
    tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    if not tables or "tasks" in tables:
        return
    shown = ", ".join(tables[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
    way_out = ("point TASK_DB_PATH at the queue's file, or at a new path (a new queue is made there); "
               "it was left as it was")
    raise DatabaseUnusable(f"the task database {path} cannot be used (a SQLite database of another program: its "
                           f"tables are {shown}, not a queue's): {way_out}", "not a TaskBridge queue", way_out)


def _connect_read_only(path: Path, version: int) -> sqlite3.Connection:
    """A read-only connection to a queue whose folder is on a filesystem mounted read-only: the
    tasks and results stay readable; a write raises ReadOnlyStorage (see ``storage_fault``). With
    no WAL file beside it the database is opened immutable (SQLite cannot make its shared-memory
    file there, and nothing can change the file while the mount is read-only). Raises
    ReadOnlyStorage when there is no queue there, or one older than ``version`` (it would need a
    migration)."""
    if not path.is_file():
        raise ReadOnlyStorage(disk_fault_line("read-only", path.parent) + f"; and there is no queue at {path}")
    wal = path.with_name(path.name + "-wal")
    uri = f"{path.resolve().as_uri()}?mode=ro" + ("" if wal.exists() else "&immutable=1")
    conn = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False,
                           cached_statements=256)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA foreign_keys = ON")
        if conn.execute("PRAGMA user_version").fetchone()[0] < version:
            raise ReadOnlyStorage(disk_fault_line("read-only", path.parent) +
                                  "; its queue needs an upgrade this TaskBridge cannot write there")
    except BaseException:
        conn.close()
        raise
    return conn


def _begin_immediate(conn: sqlite3.Connection, wait_sec: float, give_up: Callable[[], bool] | None = None) -> None:
    """``BEGIN IMMEDIATE``, waiting for the write lock in short sleeps of our own for up to
    ``wait_sec`` seconds, or until ``give_up()`` is true (then "database is locked").

    SQLite's busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between tries: with a few
    processes writing, each conflict cost milliseconds while the lock was free again in tens of
    microseconds (4 processes reached ~450 cycles/s). Here the handler is off for this one
    statement and the retry sleeps 50 µs, doubling to at most 2 ms, with jitter; every other
    statement keeps the 30 s busy timeout."""
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        delay, deadline = 0.00005, None
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                deadline = deadline or time.monotonic() + wait_sec
                if time.monotonic() > deadline or (give_up is not None and give_up()):
                    raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.002)
    finally:
        conn.execute("PRAGMA busy_timeout = 30000")


def breaks_connection(exc: sqlite3.Error) -> bool:
    """Whether a connection that raised ``exc`` must not be used again. A busy/locked database or
    a constraint is no fault of the connection; anything else (disk I/O, corruption, a file gone
    read-only, a closed connection) reopens on the next call."""
    return not isinstance(exc, sqlite3.IntegrityError) and not _is_busy(exc)
