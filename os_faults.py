"""Naming an operating-system error (an OSError, or one found behind another error): one line
with the path, the limit it met and the way out, and whether running the same attempt again can
help. The worker, the CLI and the MCP server share it, so a fault reads the same everywhere.

Not run on its own; env: none. The disk faults (full, over quota, read-only) are the
store's own (``task_store.storage_fault``); this module adds every other errno.
"""
from __future__ import annotations

import errno
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

import task_store as store

# A retry seconds later can meet a different state: these clear by themselves. Anything else
# (a limit, a name, a permission, a missing file) meets the same wall again.
PASSING = frozenset({errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ENOMEM,
                     errno.ECONNRESET, errno.ECONNREFUSED, errno.ETXTBSY})


@dataclass(frozen=True)
class Fault:
    """One named OS fault: ``line`` (one line: what, where, the way out) and ``retry`` (True
    when another attempt may succeed without anyone acting)."""
    line: str
    retry: bool

    def __str__(self) -> str:
        return self.line


def find(exc: BaseException | None) -> tuple[OSError | None, str]:
    """The first OSError carrying an errno in ``exc`` or behind it (its ``__cause__`` chain: an
    error raised *from* it), and what the error just above it said (``""`` when ``exc`` is the
    OSError): a GitError raised because git could not start hides one, for example. An error
    merely raised while an OSError was being handled (``__context__``) is not that OSError: a
    bug there must keep its traceback."""
    seen: set[int] = set()
    above = ""
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc, above
        above = " ".join(str(exc).split())[:300]
        exc = exc.__cause__
    return None, ""


def describe(exc: BaseException | Fault, path: Path | str | None = None) -> Fault | None:
    """The Fault behind ``exc`` (any exception; its OSError is found with ``find``), for a write
    or open at ``path`` (default: the OSError's own file name); None when no OSError is behind
    it. A StorageFault from the store keeps its line (DiskFull: retry, space may come back); a
    Fault already named is itself."""
    if isinstance(exc, Fault):
        return exc
    if isinstance(exc, store.StorageFault):
        return Fault(str(exc), isinstance(exc, store.DiskFull))
    err, above = find(exc)
    if err is None:
        return None
    fault = _named(err, str(path or err.filename or ""))
    # What failed (git could not start in <repo>, ...) stays said, after the fault's own line.
    return Fault(f"{fault.line}; what failed: {above}", fault.retry) if above else fault


def from_text(line: str) -> Fault | None:
    """The Fault a child's message names by its errno (Bun's ``EMFILE: too many open files, open
    '/x'``, OpenCode's ``(cause: Error: EMFILE …)``), with the first absolute path in it; None
    when the line names no errno."""
    for word in re.findall(r"\bE[A-Z]{3,}\b", line):
        code = getattr(errno, word, None)
        if isinstance(code, int):
            path = re.search(r"['(](/[^')]+)[')]", line)
            return _named(OSError(code, os.strerror(code)), path.group(1) if path else "")
    return None


def _named(err: OSError, where: str) -> Fault:
    disk = store.storage_fault(err, where or os.getcwd())
    if disk is not None:
        return Fault(str(disk), isinstance(disk, store.DiskFull))
    at = f" at {where}" if where else ""
    if err.errno in (errno.EMFILE, errno.ENFILE):
        return Fault(open_files_line(err.errno, at), False)
    if err.errno == errno.ENAMETOOLONG and where:
        return Fault(name_too_long_line(where), False)
    name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno is not None else "None"
    return Fault(f"{err.strerror or err} ({name}){at}", err.errno in PASSING)


def open_files_line(code: int, at: str = "") -> str:
    """One line for EMFILE (this process's open-files limit) or ENFILE (the system's table);
    ``at``: `` at PATH`` or ``""``."""
    if code == errno.ENFILE:
        return (f"too many open files on this machine (ENFILE){at}: the system-wide file table is "
                "full; close programs or raise fs.file-max (sysctl), then retry the task")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"too many open files (EMFILE){at}: the worker may hold {soft} (ulimit -n; hard limit "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}); "
            f"raise it (`ulimit -n {max(4096, soft * 4)}` before "
            "starting the worker, LimitNOFILE= in its systemd unit, or launchctl limit maxfiles on macOS), "
            "then retry the task")


def name_too_long_line(where: str) -> str:
    """One line for ENAMETOOLONG: which part is too long, against which limit, and the way out."""
    folder = _existing_folder(where)
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    longest = max((len(part.encode()) for part in Path(where).parts), default=0)
    shown = where if len(where) <= 200 else f"{where[:120]}…{where[-60:]}"
    return (f"file name too long (ENAMETOOLONG): {shown} ({len(where.encode())} bytes, its longest name "
            f"{longest}; this filesystem allows {name_max} per name and {path_max} per path); shorten the "
            "folder (TASK_LOG_DIR / TASKBRIDGE_WORKTREE_ROOT / the task's directory) or the file's name")


def _existing_folder(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path)) or "/"
    while len(folder) > 1 and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return folder
