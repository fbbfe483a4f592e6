"""The worker's kept OpenCode servers: one ``opencode serve`` per slot, started ahead of the slot's
next task in a box made for that slot, used for one task, then recycled (issue 21, its first step).

Why one server per slot and per task: a bubblewrap box's binds are fixed when it starts, and a
server that outlived its task would let the next task reach the earlier one's worktree and the
processes it left. So each server gets a fresh, empty folder of its own (``folder``, under the
worktree root, bound writable into its box): the next task's worktree is parked inside it and
opened by the server before the claim (``warm``: worktrees.park_worktree, engine.Engine.warm_up),
then taken over by the claimed task, and nothing else of TaskBridge's is in reach. The server is
stopped with its whole process tree when its task ends (what the agent left running is named),
and the slot's next server starts in the background, so the next task finds one that answers:
the server's start (2–9 s) and OpenCode's set-up of the folder (1–2.5 s) leave the path from
submit to the model's first request.

A server is made for the slot's *predicted* next task: the worker computes its environment and box
exactly as for a run (worker.py), from the last task the slot ran, or at start from the pending
task a claim takes first. A claimed task runs on it only when it is of the same shape (repository,
model, preset, agent, rules, limits: checked before any wait) and, once its workspace is made, its
whole run environment is the same (``Kept.fits``); otherwise it runs cold and the server is
recycled. Which tasks are eligible at all is the worker's call (``worker._engine_eligible``).

Used by worker.py (``WORKER_ENGINE=1`` or ``worker.py --engine warm``); not run on its own. No SQL.
Env: none of its own (the server's environment is handed in).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

import agent_box
import engine
import opencode_runner as oc
import process_tree
import worktrees

# What may differ between the server's environment and a task's own without changing what the
# agent can do: the folder (each session names its own), and the run marker (the server carries
# its slot's; the client it is driven by carries the task's).
PER_TASK = (oc.MARKER_ENV, "PWD")
PARK_END_SEC = 5.0   # how long a wait called off gives a park's git step to end, to name it
STOP_PARK_SEC = 30.0   # how long a pass's end waits for start threads to drop the parks they made


def fit_key(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the variables that may differ per task (PER_TASK)."""
    return {name: value for name, value in env.items() if name not in PER_TASK}


class Kept:
    """One slot's server, made for one task.

    ``folder``: the empty folder the task's worktree goes in (bound writable in the box);
    ``run_dir``: the run folder of the box (``control/``, ``reply/``, ``tmp/``, ``objects/``,
    ``git/``), as worker.fresh_run_folder makes for a cold run; ``repo``: the repository the box
    shows; ``env``: the server's environment (its fit key is what a task must match); ``box``: the
    argv wrapper of the box; ``home``: its OpenCode data and state folders in a box
    (agent_box.slot_home), removed with it unless its task's line took them; ``shape``: what a
    task must be like (worker._shape); ``warm``: called
    with the Kept in its start thread once the server answers, to park the task's worktree
    (``parked``, named before it is made) and open it (``warmed``); the server then also loads the
    warm-up stop plugin (opencode_runner.with_warm_up). ``begin`` launches it, its health and the
    warm-up are waited for in a thread; ``ready`` waits for that."""

    def __init__(self, folder: Path, run_dir: Path, repo: str, env: dict[str, str],
                 box: engine.Box | None, shape: Any = None, start_timeout: float = 120.0,
                 warm: Callable[[Kept], None] | None = None) -> None:
        self.folder, self.run_dir, self.repo, self.env, self.shape = folder, run_dir, repo, env, shape
        self.home: str | None = None   # set by its maker, when its box has one
        self.warm = warm
        # The server runs with the warm-up stop besides the task's own environment (which is
        # what a task must match: ``fits``).
        server_env = oc.with_warm_up(env, str(run_dir / "control" / "warm-up.json")) if warm else env
        self.engine = engine.Engine(server_env, str(folder), box=box, start_timeout=start_timeout)
        self.parked: Path | None = None   # where the task's worktree is parked (``warm``), until a task has it
        self.warmed = False               # the parked worktree was opened (engine.Engine.warm_up)
        self.problem: str | None = None   # one line: why the server did not start
        self.warm_problem: str | None = None   # one line: why the worktree was not parked or opened ahead
        self.recycled: str | None = None   # why it was recycled (ends a park in progress: ``_start``)
        self.starting = False              # its start thread runs (``begin`` to the end of ``_start``)
        self.lock = threading.Lock()       # recycled and starting, set by two threads
        self.served = False               # the server answered (``started`` is set once warm is done too)
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._start, name=f"engine-{folder.name}", daemon=True)

    def begin(self) -> Kept:
        """Start the server process now (from this thread, which must outlive it: see
        ``engine.Engine.launch``) and wait for its answer in the background; returns self."""
        try:
            self.engine.launch()
        except (engine.EngineError, OSError) as exc:
            self.problem = f"opencode serve could not be started: {exc}"
            self.started.set()
            return self
        self.starting = True
        self.thread.start()
        return self

    def _start(self) -> None:
        try:
            self.engine.wait_ready()
            # Its start loaded the server's own folder (the config check); the task's worktree is
            # another folder, so that one is let go.
            with contextlib.suppress(engine.EngineError):
                self.engine.release(str(self.folder))
            self.served = True
            if self.warm is not None:
                try:
                    # Parks the task's worktree and opens it (engine.Engine.warm_up); a recycle
                    # meanwhile ends a git step of it at once (it holds worktrees' lock).
                    with worktrees.watched(lambda: self.recycled):
                        self.warm(self)
                except worktrees.GitStopped as exc:   # ended (a recycle, git's time limit): named by take
                    self.warm_problem = f"preparing the workspace ahead on its kept server: {exc}"
                except (worktrees.GitError, engine.EngineRefused, OSError):
                    pass   # the task's worktree is then made after the claim, its first prompt slower
        except engine.EngineError as exc:
            self.problem = str(exc)
        except OSError as exc:   # the log file, the exec: the worker's machine, said in one line
            self.problem = f"opencode serve could not be started: {exc}"
        except Exception as exc:  # noqa: BLE001 - never "ready" after a start that did not finish
            self.problem = f"the kept OpenCode server's start failed ({exc.__class__.__name__}: {exc})"
        finally:
            with self.lock:
                self.starting = False
                recycled = bool(self.recycled)
            if recycled:   # recycled while it started: its parked worktree is dropped here, not left
                self._drop_parked()
            self.started.set()

    def ready(self, timeout: float) -> bool:
        """Whether the server answers, waiting up to ``timeout`` seconds for its start."""
        self.started.wait(timeout)
        return self.started.is_set() and self.problem is None and self.engine.alive()

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a task whose run environment is ``env`` (computed as for this server: the same
        run folder) may run here: the same environment but for PER_TASK."""
        return fit_key(env) == fit_key(self.env)

    def agent_processes(self) -> list[Any]:
        """The live processes of the server's tree that the agent started (not the server, not
        its box): the bash tool's commands and whatever they left running (psutil.Process)."""
        server = self.engine.proc.pid if self.engine.proc is not None else None
        return [p for p in self.engine.processes() if p.pid != server and not self._carries(p)]

    def _carries(self, proc: Any) -> bool:
        try:
            return process_tree.carries(proc, self.engine.argv)
        except process_tree.GONE:
            return True   # gone: nothing left to name

    def recycle(self, grace: float, reason: str = "its server was recycled") -> list[dict[str, Any]]:
        """Stop the server and everything it started (SIGTERM, ``grace`` seconds, SIGKILL; then a
        sweep by its tag) and drop its run folder; a park in progress is ended with ``reason``.
        Returns what was still running besides the server and its box, ``[{"pid", "command",
        "ports"}]`` (the agent's leftovers, for the receipt); [] when it was recycled already."""
        with self.lock:
            if self.recycled:
                return []
            self.recycled = reason
            starting = self.starting   # then its start thread drops the park (_start), not this one
        left = process_tree.described(self.agent_processes())   # a server still starting is stopped too
        self.engine.stop(grace)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.home is not None:   # gone already when its task's line took it (agent_box.adopt_home)
            shutil.rmtree(self.home, ignore_errors=True)
        if not starting:
            self._drop_parked()
        return left

    def _drop_parked(self) -> None:
        """Drop the parked worktree no task took (else its workspace step let it go) and the
        server's folder when that leaves it empty. Not under the caller's git watcher: a task past
        its deadline (or a stop) would stop this git before it starts, leaving the parked worktree
        locked in the repository; and never in a task's thread while the start thread may still
        hold worktrees' lock (a park behind another slot's hung git step)."""
        if self.parked is not None:
            with contextlib.suppress(worktrees.GitError), worktrees.watched(None):
                worktrees.drop_parked(self.parked)
        worktrees.drop_engine_folder(self.folder)   # only when no worktree was made in it


class Slots:
    """The kept servers of one worker pass, one per slot thread (the pool's thread names them).

    ``make(slot_name, prediction) -> Kept | None`` builds (not starts) a slot's next server for
    ``prediction`` (the slot's entry in ``last``, else ``first``; worker.Prediction), or None when
    there is nothing to predict from. Thread-safe: each slot thread touches only its own entries;
    ``stop_all`` runs at the pass's end. The build can take seconds (for a restricted preset it
    reads OpenCode's resolved config, ~1.5 s): beside a running task it runs in a thread of its
    own (``make_ahead``), and the slot's thread, which must launch the server, only launches it
    (``launch_made``)."""

    def __init__(self, make: Callable[[str, Any], Kept | None], first: Any = None, watch: bool = True) -> None:
        self.make, self.first, self.watch = make, first, watch   # watch: the pass loops (--watch)
        self.lock = threading.Lock()
        self.kept: dict[str, Kept] = {}
        self.making: dict[str, _Making] = {}   # slot -> its next server being built (make_ahead)
        self.last: dict[str, Any] = {}   # slot -> what its last task was like (its next server's prediction)

    def take(self, slot: str, wait: float, shape: Any,
             stopping: Callable[[], str | None]) -> tuple[Kept | None, str | None]:
        """(the slot's server for the task in hand, None): removed from the slot (one task
        per server) when it was made for a task of this ``shape`` and answers within ``wait``
        seconds, looked at every 0.2 s until ``stopping()`` gives a reason (a stop, a cancel, the
        timeout; not asked again then). Else (None, why not in one line or None when the slot has
        none), the server recycled at once. A wait called off ends a park
        of the task's worktree in progress (its git step, with the reason) and why is the reason,
        or the park's failure that names its step and the reason."""
        with self.lock:
            kept = self.kept.pop(slot, None)
        if kept is None:
            return None, None
        if kept.shape != shape:
            kept.recycle(0)
            return None, "it was made for another kind of task (repository, model, preset, agent, limits)"
        deadline, stopped = time.monotonic() + wait, None
        while not kept.started.wait(0.2) and time.monotonic() < deadline and not (stopped := stopping()):
            pass
        if kept.ready(0):
            return kept, None
        if stopped:
            kept.recycle(0, stopped)
            kept.started.wait(PARK_END_SEC)   # a park's git step is ended with its tree within ~2 s
            return None, kept.warm_problem or stopped
        why = kept.problem or ("opencode serve exited after its start" if not kept.engine.alive() else
                               f"opening its worktree ahead took over {wait:g} s" if kept.served else
                               f"opencode serve did not answer within {wait:g} s")
        kept.recycle(0)
        return None, why

    def has(self, slot: str) -> bool:
        """Whether ``slot`` has a server (started, starting, or failed and not yet taken)."""
        with self.lock:
            return slot in self.kept

    def prepare(self, slot: str) -> str | None:
        """Start the slot's next server in the background (a server already there is kept; one
        ``make_ahead`` is building is waited for and started); returns the one-line reason when
        none could be made. Call from the thread that outlives the server (engine.Engine.launch)."""
        _done, problem = self.launch_made(slot, wait=None)
        with self.lock:
            if problem or slot in self.kept:
                return problem
        making = _Making()
        making.build(self.make, slot, self.last.get(slot) or self.first)
        if making.kept is not None:
            with self.lock:
                self.kept[slot] = making.kept.begin()
        return making.problem

    def make_ahead(self, slot: str) -> None:
        """Build the slot's next server in a thread of its own, without waiting (nothing when the
        slot has one, or one is being built); ``launch_made`` or ``prepare`` starts it."""
        with self.lock:
            if slot in self.kept or slot in self.making:
                return
            making = self.making[slot] = _Making()
            prediction = self.last.get(slot) or self.first
        making.thread = threading.Thread(target=making.build, args=(self.make, slot, prediction),
                                         name=f"engine-make-{slot}", daemon=True)
        making.thread.start()

    def launch_made(self, slot: str, wait: float | None = 0) -> tuple[bool, str | None]:
        """Start the server ``make_ahead`` built for ``slot`` once it is built, waiting up to
        ``wait`` seconds for the build (None: until it ends); from the slot's thread, which
        outlives the server. (Whether nothing is left to start, the one-line reason no server
        could be made or None.)"""
        with self.lock:
            making = self.making.get(slot)
        if making is None:
            return True, None
        if making.thread is not None:
            making.thread.join(wait)
            if making.thread.is_alive():
                return False, None
        with self.lock:
            self.making.pop(slot, None)
            if making.kept is not None:
                self.kept[slot] = making.kept.begin()
        return True, making.problem

    def stop_all(self, grace: float) -> None:
        """Stop every kept server, and every one still being built once it is (the pass is ending)."""
        with self.lock:
            kept, self.kept = list(self.kept.values()), {}
            making, self.making = list(self.making.values()), {}
        for build in making:
            if build.thread is not None:
                build.thread.join()
            if build.kept is not None:
                kept.append(build.kept)
        for each in kept:
            each.recycle(grace)
        for each in kept:   # a start thread drops the park its recycle ended: waited for, the pass ends
            if each.thread.is_alive():
                each.thread.join(STOP_PARK_SEC)


class _Making:
    """A slot's next server being built (``build``, maybe in ``thread``): the Kept, or why not."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.kept: Kept | None = None
        self.problem: str | None = None

    def build(self, make: Callable[[str, Any], Kept | None], slot: str, prediction: Any) -> None:
        try:
            self.kept = make(slot, prediction)
        except Exception as exc:  # noqa: BLE001 - a prediction that cannot be built means a cold run, said once
            self.problem = f"no kept OpenCode server for {slot}: {exc}"


def make_folder(folder: Path, queue: str, pid: int | None = None) -> None:
    """Make a kept server's ``folder`` (``<worktree root>/engine/<slot>-<hex>``, mode 0700) with
    its owner's record beside it first (``worktrees.engine_owner_file``: outside the folder, which
    is bound writable into the server's box): this ``queue`` (its tag), this host, and the worker
    process ``pid`` (default: this one) with its start time. Another queue's worker sharing the
    worktree root, or this queue's next pass, reads it in ``sweep`` and leaves the folder alone
    while that worker lives. Raises OSError."""
    pid = os.getpid() if pid is None else pid
    record = json.dumps({"queue": queue, "host": socket.gethostname(), "pid": pid,
                         "pid_start": process_tree.start_time(pid)})
    for attempt in range(3):
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            worktrees.engine_owner_file(folder).write_text(record, encoding="utf-8")
            folder.mkdir(mode=0o700)
            return
        except FileNotFoundError:   # the engine folder went meanwhile (another worker's last slot folder did)
            if attempt == 2:
                raise


def _owner(folder: Path) -> dict[str, Any] | None:
    """The owner record ``make_folder`` wrote beside ``folder``, or None: none (an earlier
    version's folder, or one whose record is being written) or unreadable."""
    try:
        record = json.loads(worktrees.engine_owner_file(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _owner_gone(record: dict[str, Any], queue: str) -> bool:
    """Whether what ``record`` names is this ``queue``'s, on this host, and its worker is gone
    (this very process counts as gone: an earlier pass of it, which ended)."""
    if record.get("queue") != queue or record.get("host") != socket.gethostname():
        return False
    alive = process_tree.same_process(record.get("pid"), record.get("pid_start"))
    return alive is None or alive.pid == os.getpid()


def _in_use(folder: Path) -> bool:
    """Whether a live process has its working folder, or a file open, in ``folder`` (what cannot
    be read is taken as not in it: another user's processes cannot reach a 0700 folder)."""
    inside = f"{folder}{os.sep}"
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if f"{proc.cwd()}{os.sep}".startswith(inside) or \
                    any(f.path.startswith(inside) for f in proc.open_files()):
                return True
    return False


def _sweepable(folder: Path, queue: str) -> bool:
    """Whether the sweep of ``queue``'s pass may remove ``folder`` and the worktree parked in it:
    its owner record names this queue and a worker that is gone; a folder with no record (made by
    an earlier version, which wrote none) only when no live process works or has a file in it."""
    record = _owner(folder)
    return _owner_gone(record, queue) if record is not None else not _in_use(folder)


def sweep(root: Path, log_dir: Path, queue: str, grace: float = 2.0) -> None:
    """Remove what kept servers of an earlier pass left when their worker was killed: the
    processes of this ``queue`` (its tag) that carry a slot's marker (``new_marker``: an unboxed
    server's children, which no box's death ended, are found by it, not by their task's marker;
    SIGTERM, ``grace`` seconds, SIGKILL), parked worktrees no task took and the folders under
    ``root`` (``<worktree root>/engine``) that are then empty (one holding a task's worktree
    stays), run folders ``engine-*.run`` in ``log_dir`` and the servers' OpenCode folders
    (agent_box.slot_home) no task took. Only while this queue's pass lock is
    held: no server of this queue's is running then. Two queues may share one worktree root: only
    folders this queue's gone worker made are touched (``_sweepable``; another queue's, or a
    live worker's, keep their parked worktree, its git registration and lock). Without ``root``
    (no kept server was made since the last sweep, or none ever) there is nothing to look for: no
    process is scanned."""
    for home in Path(agent_box.slot_home(f"{queue}-")).parent.glob(f"{queue}-*"):
        shutil.rmtree(home, ignore_errors=True)
    if not root.is_dir():
        return
    process_tree.kill_tree(None, grace, lambda: process_tree.processes_where(
        lambda env: env.get(oc.QUEUE_ENV) == queue and env.get(oc.MARKER_ENV, "").startswith(MARKER_PREFIX)))
    kept: set[str] = set()   # folders left alone: their run folders too (a shared TASK_LOG_DIR)
    with contextlib.suppress(OSError):
        for entry in list(root.iterdir()):
            if entry.name.endswith(worktrees.ENGINE_OWNER):   # a record whose folder went (a kill between the two)
                folder = entry.with_name(entry.name[:-len(worktrees.ENGINE_OWNER)])
                if not os.path.lexists(folder) and (record := _owner(folder)) is not None \
                        and _owner_gone(record, queue):
                    entry.unlink(missing_ok=True)
                continue
            if entry.is_symlink() or not entry.is_dir():
                continue
            if not _sweepable(entry, queue):
                kept.add(entry.name)
                continue
            for inside in list(entry.iterdir()):
                worktrees.drop_parked(inside)   # a task's worktree (on its branch) stays
            worktrees.drop_engine_folder(entry)
    for run in log_dir.glob("engine-*.run"):
        if run.name[len("engine-"):-len(".run")] not in kept:
            shutil.rmtree(run, ignore_errors=True)


MARKER_PREFIX = "eng-"


def new_marker(slot: str) -> str:
    """The run marker a slot's server carries: ``eng-<slot>-<hex>``."""
    return f"{MARKER_PREFIX}{slot}-{secrets.token_hex(4)}"
