"""The first process of an agent run: starts OpenCode, adopts what the run leaves behind, and
tells the worker when OpenCode itself has ended.

    python run_reaper.py STATUS_FD [--die-with-parent[=PARENT_PID]] -- opencode run --auto …

- Linux: it is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a daemon the agent starts in a
  new session with a cleared environment (``setsid env -i server &``: no process group, no tag
  to find it by) is re-parented to it instead of init, and stays in the run's process tree where
  the worker finds it, names it and ends it. Inside the box it sits under bubblewrap's init, so
  the box's PID namespace lives until the worker has looked.
- When OpenCode exits, it writes ``exit CODE`` on ``STATUS_FD`` (``-N``: ended by signal N); then
  it holds what is left (its adopted children) until they are gone or a termination signal comes, and exits with CODE.
- ``--die-with-parent`` (a kept ``opencode serve``, engine.py): Linux sends it SIGTERM when the
  thread that started it ends (``PR_SET_PDEATHSIG``), so an unboxed server does not outlive a
  killed worker (bubblewrap's ``--die-with-parent`` does that for a boxed one).
- SIGTERM / SIGINT / SIGHUP: passed to OpenCode while it runs; once OpenCode is gone, it waits
  for its remaining children to end (the worker signals them itself) and exits.

Used by worker.py (process_tree.reaper_argv builds the command); standard library only, since
inside the box it runs with the system's python3. Env: none (OpenCode gets it unchanged).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _State:
    agent: int | None = None      # OpenCode's pid while it runs
    forked = False                # OpenCode was started


def _on_signal(signum: int, _frame: object) -> None:
    # Forwarded here, not from the loop: the loop sits in wait(), which Python resumes after a
    # handler (PEP 475), so a flag alone would not reach OpenCode until something exits.
    if not _State.forked:   # before OpenCode starts (the parent died during our start): it never does
        os._exit(128 + signum)
    if _State.agent is not None:
        try:
            os.kill(_State.agent, signum)
        except ProcessLookupError:
            pass


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # refused: orphans go to init, as before


def _hold(code: int) -> int:
    """Reap adopted children until none is left, then return ``code`` (the worker signals them)."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return code


def _die_with_parent(parent: int | None) -> None:
    """Ask for SIGTERM when the starting thread ends; ``parent``: the pid that started us (None:
    the parent now), so a parent that ended during our own start (~50 ms of Python) is seen too."""
    if sys.platform.startswith("linux"):
        parent = parent or os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:   # the parent ended before the signal was asked for
            os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    flag, _, given = argv[2].partition("=") if len(argv) > 2 else ("", "", "")
    orphan = flag == "--die-with-parent"
    parent = int(given) if orphan and given.isdigit() else None
    if orphan:
        argv = [argv[0], argv[1], *argv[3:]]
    if len(argv) < 4 or argv[2] != "--":
        print("usage: run_reaper.py STATUS_FD [--die-with-parent[=PID]] -- COMMAND…", file=sys.stderr)
        return 2
    status_fd, command = int(argv[1]), argv[3:]
    _become_subreaper()
    for sig in _ENDING:
        signal.signal(sig, _on_signal)
    if orphan:
        _die_with_parent(parent)
    _State.forked = True
    agent = os.fork()
    if agent == 0:
        os.close(status_fd)
        for sig in _ENDING:
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    _State.agent = agent
    while True:
        pid, status = os.wait()
        if pid == agent:
            break
    _State.agent = None
    code = os.waitstatus_to_exitcode(status)   # -N: ended by signal N, said so to the worker
    try:
        os.write(status_fd, f"exit {code}\n".encode())
        os.close(status_fd)
    except OSError:
        pass
    return _hold(128 - code if code < 0 else code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
