"""Wake a waiting thread when files in a folder change: Linux inotify through ctypes, no polling.

``FolderWatch(folder, names)`` watches ``folder`` for writes to, creation of and renames onto the
files called ``names``; ``wait(timeout)`` blocks until one happens (True) or ``timeout`` seconds
pass (False). Where inotify is missing (macOS, an exhausted ``fs.inotify.max_user_instances``, a
network filesystem that reports nothing) ``available`` is False and ``wait`` simply sleeps: the
caller re-checks on its own schedule, so a missing notification costs latency, never correctness.

The store uses it for ``wait_for_change`` (SQLite writes every commit to the ``-wal`` file, or to
the database file itself in rollback-journal mode); ``wait_for`` is the wait loop it shares with
store_pg.PgChangeWatch. Imports the standard library only; reads no env; not run on its own.
"""
from __future__ import annotations

import os
import select
import struct
import sys
import time
from pathlib import Path
from typing import Protocol

IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x80, 0x100
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            import ctypes  # here, not at import time: only a waiting process pays for it
            libc = ctypes.CDLL(None, use_errno=True)
            libc.inotify_init1, libc.inotify_add_watch  # noqa: B018 - AttributeError where absent
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]


class Watch(Protocol):
    """What ``wait_for`` needs of a watch: a descriptor that turns readable when notices come
    (negative: none, the waiter sleeps), and ``drain()`` reading them without blocking (True
    when one is a change the waiter wants)."""
    fd: int

    def drain(self) -> bool: ...


def wait_for(watch: Watch, timeout: float, *, buffered: bool = False) -> bool:
    """Block until ``watch`` drains a change (True) or ``timeout`` seconds pass (False); without
    a descriptor, sleep the timeout (False). ``buffered``: the watch may already hold notices it
    read (libpq does), which no select would show, so it is drained before the first wait; a
    descriptor dropped meanwhile (``fd`` < 0) ends the wait."""
    deadline = time.monotonic() + max(0.0, timeout)
    if watch.fd < 0:
        time.sleep(max(0.0, timeout))
        return False
    ready = buffered
    while True:
        if ready and watch.drain():
            return True
        left = deadline - time.monotonic()
        if left <= 0 or watch.fd < 0:
            return False
        ready = bool(select.select([watch.fd], [], [], left)[0]) or buffered


class FolderWatch:
    """An inotify watch on one folder, for a few file names in it. Use as a context manager (the
    inotify descriptor is closed on exit)."""

    def __init__(self, folder: Path | str, names: tuple[str, ...]) -> None:
        self.names = {name.encode() for name in names}
        self.fd = -1
        libc = _libc() if sys.platform.startswith("linux") else None
        if libc is None:
            return
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            return
        mask = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
        if libc.inotify_add_watch(fd, os.fsencode(str(folder)), mask) < 0:
            os.close(fd)
            return
        self.fd = fd

    @property
    def available(self) -> bool:
        """True when changes are notified; False when ``wait`` only sleeps."""
        return self.fd >= 0

    def wait(self, timeout: float) -> bool:
        """Block until one of the watched files changes (True) or ``timeout`` seconds pass (False)."""
        return wait_for(self, timeout)

    def drain(self) -> bool:
        """Read the queued notifications (never blocks); True when one names a watched file.
        An event loop waits for ``fd`` to be readable, then calls this."""
        hit = False
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return hit
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, _, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
                hit = hit or name in self.names
                offset += _EVENT.size + length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> FolderWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
