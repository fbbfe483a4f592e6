"""Finding and ending process trees, shared by `worker.py` (OpenCode runs) and
`claude_control_mcp.py` (`claude -p` calls).

A process is identified by its pid *and* start time, so a recycled pid that now belongs to an
unrelated program is never signalled. Ending a tree collects the descendants first (children
that called setsid sit outside the process group), signals the group and each of them, waits a
grace period, then SIGKILLs what is left. "Already gone" is never an error.

Imports psutil and the standard library only; no SQL; reads no env; not run on its own.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable

import psutil

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
GONE = _GONE   # for callers that walk a run's processes themselves


def start_time(pid: int) -> float | None:
    """The process's start time in Unix seconds (psutil ``create_time``), or None when gone."""
    try:
        return psutil.Process(pid).create_time()
    except _GONE:
        return None


def same_process(pid: int | None, started: float | None, tolerance: float = 0.5) -> psutil.Process | None:
    """The live process with this ``pid`` that started at ``started`` (seconds, within
    ``tolerance``), or None: a pid reused by another program does not match, and a zombie (it
    ended, its parent has not reaped it yet: a worker killed by ``kill -9`` from a shell script)
    is no live process."""
    if not pid or started is None:
        return None
    try:
        proc = psutil.Process(int(pid))
        if abs(proc.create_time() - float(started)) > tolerance or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (*_GONE, ValueError):
        return None


def holds_connection(proc: psutil.Process, local: tuple[str, int], remote_port: int) -> bool:
    """Whether ``proc`` itself holds the TCP socket whose own end is ``local`` (ip, port) and
    whose far end is port ``remote_port``: which program opened a loopback connection to us.
    False when the process is gone or may not be read. Its children are not asked: finding them
    scans every process (tens of ms, on an event loop), and cloudflared and ngrok are one process."""
    with contextlib.suppress(*_GONE, OSError):
        return any(conn.laddr and conn.raddr and (conn.laddr.ip, conn.laddr.port) == tuple(local)
                   and conn.raddr.port == remote_port for conn in proc.net_connections(kind="tcp"))
    return False


def tagged_processes(tags: dict[str, str]) -> list[psutil.Process]:
    """Live processes whose environment holds every ``tags`` key with its value (Linux reads
    ``/proc/PID/environ``; processes we may not read are skipped). A run's tag is inherited by
    every descendant, including those that left its process group."""
    return processes_where(lambda env: all(env.get(key) == value for key, value in tags.items()))


def processes_where(match: Callable[[dict[str, str]], bool]) -> list[psutil.Process]:
    """Live processes whose environment ``match`` accepts (as ``tagged_processes`` reads it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (*_GONE, OSError):
            continue
        if match(env):
            found.append(proc)
    return found


def kill_tree(root: int | psutil.Process | None, grace: float,
              stragglers: Callable[[], Iterable[psutil.Process]] | None = None) -> int:
    """End ``root`` and everything it started; returns how many processes were signalled.

    ``root``: our own child's pid (its process group is signalled even if it already exited,
    since a group id cannot be reused while members remain), or a ``psutil.Process`` verified
    with ``same_process``, or None. ``stragglers``: returns extra processes to end (e.g.
    ``tagged_processes``); called before signalling and again after the grace period.
    SIGTERM first, SIGKILL after ``grace`` seconds.
    """
    pgid, procs = _collect(root)
    extra = list(stragglers()) if stragglers else []
    procs.update({p.pid: p for p in extra})
    procs.pop(os.getpid(), None)
    _signal(pgid, procs.values(), signal.SIGTERM)
    alive = _wait_ended(list(procs.values()), grace)
    late = [p for p in (stragglers() if stragglers else []) if p.pid != os.getpid()]
    _signal(pgid, [*alive, *late], signal.SIGKILL)
    _wait_ended([*alive, *late], 2)
    return len(procs)


def _wait_ended(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``procs`` to end; returns those still running. A zombie
    has ended: an orphan's is reaped when its new parent gets to it (a VM's init took 1.5 s), and
    waiting for that held every run's end (psutil.wait_procs waits for the reaping). Our own
    children are left for their owner to reap (a Popen keeps its exit code)."""
    deadline = time.monotonic() + timeout
    alive = procs
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


def _collect(root: int | psutil.Process | None) -> tuple[int | None, dict[int, psutil.Process]]:
    if root is None:
        return None, {}
    pid = root if isinstance(root, int) else root.pid
    procs: dict[int, psutil.Process] = {}
    try:
        proc = psutil.Process(pid) if isinstance(root, int) else root
        procs[pid] = proc
        procs.update({p.pid: p for p in proc.children(recursive=True)})
    except _GONE:
        pass
    try:
        leads_group = os.getpgid(pid) == pid
    except (ProcessLookupError, PermissionError):
        leads_group = isinstance(root, int)  # our exited child: its group may still hold members
    return (pid if leads_group else None), procs


def _signal(pgid: int | None, procs: Iterable[psutil.Process], sig: int) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for proc in procs:
        with contextlib.suppress(*_GONE):
            proc.send_signal(sig)


REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_reaper.py")


def carries(proc: psutil.Process, argv: list[str]) -> bool:
    """Whether ``proc`` is one of the processes a run of ``argv`` is made of: the box
    (bubblewrap), run_reaper.py, or ``argv`` itself (its arguments compared: the binary may be
    named another way). Raises psutil's errors for a process that is gone."""
    cmdline = proc.cmdline()
    return proc.name() == "bwrap" or REAPER in cmdline or cmdline[1:] == argv[1:]


def reaper_argv(python: str, status_fd: int, argv: list[str], die_with_parent: bool = False,
                parent: int | None = None) -> list[str]:
    """``argv`` started by run_reaper.py (a child subreaper, see there) under ``python``; it
    writes ``exit CODE`` on ``status_fd`` (an inherited pipe's write end) when ``argv`` ends.
    ``die_with_parent``: it ends ``argv`` when the thread that started it ends; ``parent``: the
    pid it must see as its parent (this process's, when no box's pid namespace is between them),
    so a parent that ended before the reaper asked for the signal is seen too."""
    flag = ([f"--die-with-parent={parent}" if parent else "--die-with-parent"] if die_with_parent else [])
    return [python, "-I", REAPER, str(status_fd), *flag, "--", *argv]


def described(procs: Iterable[psutil.Process]) -> list[dict]:
    """``[{pid, command, ports}]`` of the live ``procs``: the command line clipped to 300
    characters, ``ports`` the TCP ports each listens on (sorted). Gone ones are left out."""
    out = []
    for proc in procs:
        try:
            command = " ".join(proc.cmdline()) or proc.name()
            ports = sorted({c.laddr.port for c in proc.net_connections("inet")
                            if c.status == psutil.CONN_LISTEN and c.laddr})
        except _GONE:
            continue
        out.append({"pid": proc.pid, "command": command[:300], "ports": ports})
    return out


def run_leftovers(root: int, keep: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """The live descendants of ``root`` (our child's pid) for which ``keep`` is false: what a
    run still has going beside the processes that carry it (the box, the reaper, OpenCode)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except _GONE:
        return []
    left = []
    for proc in children:
        try:
            if not keep(proc):
                left.append(proc)
        except _GONE:
            continue
    return left


class AddressInUse(OSError):
    """``bind_port`` found the port taken; ``holder``: the process listening there (as
    ``listening_on`` gives it), or None when that cannot be told."""

    def __init__(self, port: int, holder: psutil.Process | None) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is taken")
        self.holder = holder


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` with SO_REUSEADDR, as uvicorn binds (connections of a
    server just stopped, in TIME_WAIT, do not hold the port); the caller listens on it or closes
    it. Raises AddressInUse naming the holder, or the OSError of any other refusal (a host name
    that does not resolve, an address not of this machine)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(port, listening_on(port)) from None
        raise
    return sock


def listening_on(port: int) -> psutil.Process | None:
    """The process listening on TCP ``port`` (any address), with ``info`` = {name, cmdline}, or
    None when it cannot be told (another user's process, or a system without the call)."""
    try:
        pids = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                and c.laddr and c.laddr.port == port and c.pid}
    except (psutil.Error, OSError):
        return None
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.info = {"name": proc.name(), "cmdline": proc.cmdline()}
            return proc
    return None
