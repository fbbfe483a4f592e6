"""Starts bubblewrap with each bind's source held open, so the box binds the very folder or file
TaskBridge checked, not whatever its path leads to by the time bubblewrap reads it.

    python box_binds.py /usr/bin/bwrap --ro-bind / / … --bind /home/me/proj /home/me/proj … -- opencode run …

- Every ``--bind SRC DEST`` and ``--ro-bind SRC DEST`` before ``--`` becomes ``--bind-fd FD DEST``
  / ``--ro-bind-fd FD DEST`` (bubblewrap 0.8.0): ``SRC`` is opened (``O_PATH``), and the opened
  object's own path (``/proc/self/fd/FD``) must be ``SRC`` itself, as agent_box.py wrote it
  (its paths have no symbolic link in them). A symbolic link on the way, or a folder swapped in
  since (a link renamed over a parent folder: another run's agent can do that in a folder it may
  write), and the box does not start: one line on stderr beginning ``PREFIX`` and exit code 1,
  which the worker reports as the box's refusal (worker.environment_fault).
- ``--ro-bind-try SRC DEST`` (what agent_box.py shows again in a folder it emptied: the entries
  it listed) of a folder becomes ``--ro-bind-fd FD DEST`` the same way, or is left out when
  ``SRC`` is gone or cannot be opened at its own path any more (gone, moved, a link loop): the
  box then shows less, never something else. Of a file it stays as it is, bound by its path: a
  held handle on a file its owner then replaces by a rename points at nothing, and bubblewrap
  would refuse to start. Running out of handles (the open-files limit) refuses the box as above.
- Why a separate process: the handles must be open in the process that becomes bubblewrap, and
  every place a boxed command is started (a run, a kept server, an ``opencode debug config``
  probe) then gets them without passing descriptors through.

Used by agent_box.py (``bwrap_argv`` puts it in front of bubblewrap); standard library only,
since it runs with the system's python3, as run_reaper.py does. Env: none (passed through).
"""
from __future__ import annotations

import errno
import os
import sys

PREFIX = "TaskBridge's bind check: "
BINDS = {"--bind": "--bind-fd", "--ro-bind": "--ro-bind-fd"}


class Moved(Exception):
    """A bind's source is not at the path it was given under (the message says where it leads)."""


def pin(source: str) -> int:
    """An inheritable ``O_PATH`` handle on ``source``; raises Moved when the object opened is
    not at ``source`` itself, OSError when it cannot be opened."""
    fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
    held = os.readlink(f"/proc/self/fd/{fd}")
    if held != source:
        os.close(fd)
        raise Moved(f"{source} leads to {held} (a symbolic link on its path, or a folder swapped in after "
                    "TaskBridge checked it), and the box binds a folder only at its own path; put the folder "
                    "itself there (or give the task the folder's real path) and retry")
    os.set_inheritable(fd, True)
    return fd


# bubblewrap's options that agent_box.py writes and how many operands each takes: an operand (a
# link's target, a variable's value) is never read as an option, whatever it says.
OPERANDS = {"--bind": 2, "--ro-bind": 2, "--ro-bind-try": 2, "--symlink": 2, "--setenv": 2, "--tmpfs": 1,
            "--dev": 1, "--proc": 1, "--chdir": 1, "--remount-ro": 1, "--perms": 1, "--cap-drop": 1}


def pinned(argv: list[str]) -> list[str]:
    """``argv`` (bubblewrap's, its path first) with every bind source before ``--`` replaced by
    its handle. Raises Moved or OSError."""
    out, at = list(argv), 1
    while at < len(out) and out[at] != "--":
        option = out[at]
        if option in BINDS and at + 2 < len(out):
            out[at:at + 2] = [BINDS[option], str(pin(out[at + 1]))]
        elif option == "--ro-bind-try" and at + 2 < len(out):
            if os.path.isfile(out[at + 1]) and not os.path.islink(out[at + 1]):
                # A file is shown again by its path: one its owner replaces by a rename (an app
                # saving its state) while bubblewrap starts would leave a held handle pointing at
                # nothing, and the box would not start; by path it shows what is there then, or
                # nothing. A link (one put where a listed entry was) is pinned below, and left out.
                at += 3
                continue
            try:
                out[at:at + 2] = ["--ro-bind-fd", str(pin(out[at + 1]))]
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):   # out of handles: no box, said as such
                    raise
                del out[at:at + 3]   # gone, moved, a link loop, unreadable since listed: shown less
                continue
            except Moved:
                del out[at:at + 3]
                continue
        at += 1 + OPERANDS.get(option, 0)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(f"{PREFIX}usage: box_binds.py BWRAP ARGS…", file=sys.stderr)
        return 2
    try:
        box = pinned(argv)
    except Moved as exc:
        print(f"{PREFIX}{exc}", file=sys.stderr)
        return 1
    except OSError as exc:   # the errno's name said, so the worker names the fault (EMFILE: the open-files limit)
        name = errno.errorcode.get(exc.errno or 0, "")
        print(f"{PREFIX}'{exc.filename}' cannot be opened ({name}: {exc.strerror})", file=sys.stderr)
        return 1
    try:
        os.execv(box[0], box)
    except OSError as exc:
        print(f"{PREFIX}{box[0]} cannot be started ({exc.strerror})", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
