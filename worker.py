"""TaskBridge worker: claims tasks from the queue and runs each with the real `opencode run`.

    .venv/bin/python worker.py            one pass: lock, reap, run every claimable task, exit
                                          (what launchd / the systemd timer fires every 60 s)
    .venv/bin/python worker.py --watch    loop: picks new work up within a second, reaps every minute
    --slots N                             run up to N tasks at once (each in its own worktree)
    --engine warm                         a kept `opencode serve` per slot, started ahead (default: cold)
    -q / -v                               say less (failures, errors, Ctrl-C) / more (attempts, every tool call)
    --db URL                              the queue: a postgresql:// URL or a SQLite file (sets TASK_DB_URL)
    --stop-at-once                        the first signal hands the tasks in hand back at once (serve.py)

A pass holds a single-instance lock per queue; a second pass that finds it held exits 0 at once.
Each task runs in its own git worktree on branch ``taskbridge/t_0001`` (outside the user's
checkout), in its own process group, with its output streamed into ``task_logs/t_0001.log``, its
lease renewed every second, and a receipt built from what git and the event stream show.
A task with a spending limit (or any task while the queue has a daily budget) runs with the spend
gate (``spend_gate.js``, an OpenCode plugin): at the limit the run ends at a step boundary, before
another model request goes out, and the task waits with a question (see docs/tasks.md, "Spending
limits"); while the daily budget is spent a pass claims nothing and says why in its heartbeat.
It says what it does (worker_talk): a start line, a line when a task is claimed and when it ends,
a live line on a terminal, what a first and a second Ctrl-C / SIGTERM do; the same lines go to the
worker log beside the database (``tasks.worker.log``).

Env (read at call time): TASK_DB_URL, TASK_DB_PATH, TASK_LOG_DIR, WORKER_MODEL, OPENCODE_BIN, WORKER_NOTIFY,
TASKBRIDGE_WORKTREE_ROOT, WORKER_STALE_SEC, WORKER_INACTIVITY_SEC, WORKER_KILL_GRACE_SEC,
WORKER_EXIT_GRACE_SEC, WORKER_POLL_SEC, WORKER_LEASE_SEC, WORKER_SLOTS, WORKER_ENGINE (1: a kept
``opencode serve`` per slot, see engine_slots.py; ``--engine warm``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil

import agent_box
import box_binds
import engine
import engine_client
import engine_slots
import knobs
import opencode_runner as oc
import os_faults
import process_tree
import receipt as receipt_mod
import redaction
import reverse_bridge
import task_store as store
import worker_talk as talk
import worktrees
from receipt import ITEM_MAX, ITEMS_MAX, SUMMARY_MAX, Receipt  # noqa: F401 - ITEM*/SUMMARY_MAX: worker's names too
from receipt import clip_items as _clip_items  # noqa: F401 - the worker's name for it (tests read it)
from worker_talk import Talk
from worktrees import Workspace

_RECEIPT_EXAMPLE = ('{"summary": "what you did, in two or three sentences", "files_touched": ["relative/path"], '
                    '"tests_run": ["command you ran to test"], "open_questions": ["anything left open"]}')
RECEIPT_PROTOCOL = f"""\
When you are finished, end your final message with exactly one fenced JSON block:
```json
{_RECEIPT_EXAMPLE}
```
If you cannot go on without an answer from the person who gave you this task, do not guess:
end your message with a fenced question block instead, and stop:
```question
your question, self-contained
```"""


@dataclass
class Knobs:
    """Worker timings in seconds, read from the environment at call time (knobs.REGISTRY holds each
    one's default and range; a bad value raises knobs.KnobError)."""
    stale_sec: float = field(default_factory=lambda: knobs.knob("WORKER_STALE_SEC"))
    inactivity_sec: float = field(default_factory=lambda: knobs.knob("WORKER_INACTIVITY_SEC"))
    kill_grace_sec: float = field(default_factory=lambda: knobs.knob("WORKER_KILL_GRACE_SEC"))
    exit_grace_sec: float = field(default_factory=lambda: knobs.knob("WORKER_EXIT_GRACE_SEC"))
    poll_sec: float = field(default_factory=lambda: knobs.knob("WORKER_POLL_SEC"))
    lease_sec: float = field(default_factory=lambda: knobs.knob("WORKER_LEASE_SEC"))
    limit_hold_sec: float = field(default_factory=lambda: knobs.knob("WORKER_LIMIT_HOLD_SEC"))
    limit_margin_sec: float = field(default_factory=lambda: knobs.knob("WORKER_LIMIT_MARGIN_SEC"))
    limit_backoff_sec: float = field(default_factory=lambda: knobs.knob("WORKER_LIMIT_BACKOFF_SEC"))
    limit_rounds: int = field(default_factory=lambda: int(knobs.knob("WORKER_LIMIT_ROUNDS")))   # an int knob
    engine: bool = field(default_factory=lambda: knobs.knob("WORKER_ENGINE") == 1)   # kept servers per slot


class Flags:
    """Set by signal handlers only; the loops act on them."""

    def __init__(self, at_once: bool = False) -> None:
        self.stopping = False     # first SIGTERM/SIGINT: finish the current task, then exit
        self.stop_now = False     # second: end the run at once and hand the task back
        self.at_once = at_once    # --stop-at-once: the first signal already stops now (serve.py's one Ctrl-C)

    def signalled(self) -> None:
        if self.stopping or self.at_once:
            self.stop_now = True
        self.stopping = True

    def stop_reason(self) -> str:
        """Why the task in hand goes back unfinished, as the requeue event and ``show`` say it."""
        return "worker stopped (Ctrl-C or SIGTERM)" if self.at_once else \
            "worker stopped at once (a second Ctrl-C or SIGTERM)"


def _on_signal(_signum: int, _frame: Any) -> None:   # the signal module's handler signature
    current().flags.signalled()


def log(message: str, level: int = talk.NORMAL) -> None:
    """One line to stderr (launchd/systemd keep it) at ``level`` (``-q`` / ``-v``), also in the
    worker log beside the database unless verbose-only (see worker_talk)."""
    current().talk.say(message, level)


# --------------------------------------------------------------------------------------------
# The queue database away for a while (a PostgreSQL restart, a lost network, SQLite's write
# lock held long): weathered, never a task's failure. The agent keeps running; renewals, ships
# and the worker's own loop retry with back-off; the outage is said once when it starts and once
# when it ends; the result of a finished run is written as soon as the database answers (for up
# to WORKER_STALE_SEC). The fencing still holds: an attempt reaped meanwhile ends with its
# StaleAttempt when the database answers again.

OUTAGE_BACKOFF_SEC = (0.5, 5.0)   # the first wait before a retry, and the longest (seconds)


def db_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the queue database is away or busy for now (DatabaseUnavailable,
    DatabaseBusy: PostgreSQL away or busy, SQLite locked), not that the task or our code is at fault."""
    # a full disk too: space can come back, and a finished run's result is held till then
    return isinstance(exc, (store.DatabaseUnavailable, store.DatabaseBusy, store.DiskFull))


class Outage:
    """This worker's view of the queue database: away since when, back. Said once each way, from
    the second failed call on: a kept connection that died with a restart fails its first call
    and reopens on the next, which is no outage to report. A full disk goes to ``full_disk``.
    A busy outage (DatabaseBusy: another program holds SQLite's write lock, PostgreSQL busy) is
    over only when a call that met it lands (``answered(proved=True)``): reads answer all along
    under a lock, and counting them said "reachable again" between every two failed writes."""

    def __init__(self, full_disk: FullDisk) -> None:
        self.lock = threading.Lock()
        self.full_disk = full_disk
        self.since: float | None = None   # time.time() of the first failed call of this outage
        self.said = False
        self.busy = False                 # the outage's last failure was DatabaseBusy

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            if isinstance(exc, store.DiskFull):
                return self.full_disk.failed(exc)
            self.busy = isinstance(exc, store.DatabaseBusy)
            if self.since is None:
                self.since = time.time()
                return
            if self.said:
                return
            self.said = True
        said = " ".join(str(exc).split("; check TASK_DB_URL")[0].split())
        then = "the worker is stopping: what it cannot write is left to the next pass" if current().flags.stop_now \
            else "retrying (the running agents go on)"
        log(f"queue database unreachable since {time.strftime('%H:%M:%S', time.localtime(self.since))} "
            f"({said}); {then}", talk.QUIET)

    def answered(self, proved: bool = True) -> None:
        """A store call answered; ``proved`` False for one that did not itself meet the outage
        (a read that went through while writes waited), which ends only an outage that was not busy."""
        if self.since is None or (self.busy and not proved):
            return
        with self.lock:
            since, said, self.since, self.said = self.since, self.said, None, False
        if since is not None and said:
            log(f"queue database reachable again after {time.time() - since:.0f} s; carrying on", talk.QUIET)


class FullDisk:
    """A full disk under the queue's files, said once per FULL_SAY_EVERY_SEC: on a nearly full
    disk some writes land (SQLite reuses free pages) and others fail, so a success says nothing
    about the next write, and a line per flip would flood the log."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.said_at: float | None = None   # time.monotonic() of the last line

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            if self.said_at is not None and time.monotonic() - self.said_at < FULL_SAY_EVERY_SEC:
                return
            self.said_at = time.monotonic()
        log(f"{exc}; what the running tasks finished is held and written once there is space (retrying)",
            talk.QUIET)


FULL_SAY_EVERY_SEC = 600


class LostQueue:
    """The queue file gone from under this worker (store.QueueGone: deleted or moved away while it
    ran; the store makes no new one in its place). Said once when it goes, with the way out: the
    attempts in hand end (their worktrees kept and named), nothing more is claimed, and a --watch
    worker waits for the file to be put back: then it says so, hands those attempts back (no
    retry spent) and claims again. A one-pass exits 1 once its tasks in hand end; the next pass's
    reaper then requeues them as attempts whose worker ended (each spending a retry)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watch = True                 # a --watch worker waits for the file; a one-pass exits (Loop sets it)
        self.since: float | None = None   # time.time() when a store call first met it gone
        self.said_replaced = False        # QueueReplaced said (a file put there while the old one's WAL stays)
        self.ended: list[tuple[str, str, str]] = []   # (task id, run marker, where its work is) it ended

    def gone(self, exc: store.QueueGone) -> None:
        """A store call met the queue file gone (``exc``): say so once, with the way out (a file
        replaced while the old one's WAL is still beside it: the store's own words, QueueReplaced)."""
        replaced = isinstance(exc, store.QueueReplaced)
        with self.lock:
            first, self.since = self.since is None, self.since or time.time()
            said_replaced, self.said_replaced = self.said_replaced, self.said_replaced or replaced
        if first:   # a process started meanwhile opens nothing there (task_store._refuse_while_lost)
            store.mark_queue_lost({"pid_start": current().beat.pid_start, "slots": current().beat.slots})
        if replaced and not said_replaced:   # said even after "gone": a file put there is not the one that went
            log(f"{exc}; this worker claims nothing more meanwhile (the tasks in hand end; their worktrees are kept)",
                talk.QUIET)
        if not first or replaced:
            return
        path = store.db_path()
        if self.watch:
            said = ("this worker claims nothing more and waits for it (the tasks in hand end; their worktrees are "
                    "kept); put the file back there to carry on; or, to begin a new, empty queue at that path, stop "
                    f"the worker and {store.stale_files_words(path)}, then start it")
        else:
            said = ("this pass claims nothing more and exits once the tasks in hand end (their worktrees are kept); "
                    "put the file back there: the next pass's reaper then requeues them as attempts whose worker "
                    "ended (each spends a retry); else the next pass begins a new, empty queue at that path (first "
                    f"{store.stale_files_words(path)})")
        log(f"the queue file {path} is gone (deleted or moved away): {said}", talk.QUIET)

    def ended_attempt(self, task: dict[str, Any], where: str) -> None:
        """``task``'s attempt was ended because the queue file went (``where``: where its work was
        left, kept_work_words): handed back once the file returns, at once when it is back already."""
        with self.lock:
            if self.since is not None:
                self.ended.append((task["id"], task["run_marker"], where))
                return
        self._hand_back([(task["id"], task["run_marker"], where)])

    def back(self) -> None:
        """A store call answered again after the file went: say so and hand the ended attempts
        back (fenced: a queue put there that does not hold an attempt, a new one or another copy,
        leaves it as it is, and each such attempt is named with where its work is)."""
        with self.lock:
            since, ended, self.since, self.ended, self.said_replaced = self.since, self.ended, None, [], False
        if since is None:
            return
        current().beat.write()   # the lost mark goes first: a process reading the file now is not refused
        log(f"a queue file is at {store.db_path()} again after {time.time() - since:.0f} s; claims go on", talk.QUIET)
        self._hand_back(ended)

    def _hand_back(self, ended: list[tuple[str, str, str]]) -> None:
        for index, (task_id, marker, where) in enumerate(ended):
            try:
                store.requeue_attempt(task_id, marker, "the queue file was gone while this attempt ran: its run was "
                                      "ended; handed back (its worktree was kept)", count_attempt=False)
            except (store.StaleAttempt, store.TaskNotFound):   # a new queue, or a copy without that attempt running
                log(f"{task_id}: its attempt {marker}, ended while the queue file was gone, is not in the queue "
                    f"there now (a new queue, or another copy, was put in its place), so nothing hands it back: "
                    f"{where}", talk.QUIET)
                continue
            except store.QueueGone:   # gone again (said again by the loop): these wait for its next return
                with self.lock:
                    self.since = self.since or time.time()
                    self.ended = ended[index:] + self.ended
                raise
            log(f"{task_id}: handed back (its run was ended while the queue file was gone)")


class QueueLostMidRun(Exception):
    """An attempt met the queue file gone (``gone``: the store's QueueGone) after its workspace
    ``ws`` was made (None: before): the run was ended, the worktree is kept."""

    def __init__(self, gone: store.QueueGone, ws: Workspace | None) -> None:
        super().__init__(str(gone))
        self.gone, self.ws = gone, ws


def kept_work_words(ws: Workspace | None) -> str:
    """Where an attempt ended early left its work, for the log: the worktree and its branch (or,
    when the run had ended and removed it already, the branch), the folder it ran in, or the
    worktree folder when none was made yet."""
    if ws is None:
        return f"no worktree of its was finished yet (look under {worktrees.worktree_root()})"
    if ws.mode == "worktree" and not os.path.isdir(ws.top or ""):
        return (f"its run had ended and its worktree {ws.top} was removed: what it committed is on branch "
                f"{ws.branch} (a run that committed nothing leaves no branch)")
    if ws.mode == "worktree":
        return f"its worktree {ws.top} (branch {ws.branch}) is kept as it was"
    return f"it ran in place in {ws.cwd}: what it changed there is left as it was"


def backoff(delay: float) -> float:
    """The next wait after ``delay`` seconds: doubled, at most OUTAGE_BACKOFF_SEC[1]."""
    return min(max(delay * 2, OUTAGE_BACKOFF_SEC[0]), OUTAGE_BACKOFF_SEC[1])


def db(fn: Any, *args: Any, patience: float | None = None, hold_full: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a store call), retried with back-off while the queue database is
    away (``db_outage``) for up to ``patience`` seconds (default WORKER_STALE_SEC: past it the
    attempt may be reaped anyway); then, or after a second Ctrl-C, the last error is raised.
    ``hold_full`` False: a full disk (DiskFull) is raised at once too. Any other error
    (StaleAttempt, TaskNotFound, ...) is raised at once."""
    patience = knobs.knob("WORKER_STALE_SEC") if patience is None else patience
    deadline, delay, met = time.monotonic() + patience, OUTAGE_BACKOFF_SEC[0], False
    while True:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if not db_outage(exc) or current().flags.stop_now or time.monotonic() + delay > deadline or \
                    (not hold_full and isinstance(exc, store.DiskFull)):
                raise
            current().outage.failed(exc)
            met = True
            time.sleep(delay)
            delay = backoff(delay)
            continue
        current().outage.answered(proved=met)
        return result


# How long a write that rides outages out waits for SQLite's write lock (store.lock_wait): a run's
# watch in each of its writes (the lease renewal, a log ship, the meter's step; it checks the
# timeout, a cancel and the watchdogs between them) and the heartbeat row (Beat; the file beside
# the queue is written first). Another program holding the queue (a backup, a `sqlite3` shell
# left in a transaction) is then an outage to ride out, not a 30 s stall.
SHORT_LOCK_WAIT_SEC = 1.0


class Renewal:
    """A lease's renewals (every WORKER_LEASE_SEC) that ride out an outage: ``due(now)`` says when
    to try, ``renew()`` tries once (never blocks longer than one store call; in a run's watch, nor
    longer than SHORT_LOCK_WAIT_SEC for SQLite's write lock) and backs off while the database is away.
    Fields that could not be written yet (the agent's pid) go with the next renewal. Raises
    StaleAttempt when the attempt was fenced off."""

    def __init__(self, task: dict[str, Any], lease_sec: float) -> None:
        self.task_id, self.marker, self.lease_sec = task["id"], task["run_marker"], lease_sec
        self.last = time.monotonic()
        self.every = lease_sec
        self.pending: dict[str, Any] = {}

    def due(self, now: float) -> bool:
        return now - self.last >= self.every

    def renew(self, **fields: Any) -> bool:
        """True when renewed (the caller then beats, ships, ...); False while the database is away."""
        self.last = time.monotonic()
        self.pending.update(fields)
        try:
            store.renew_lease(self.task_id, self.marker, **self.pending)
        except store.StaleAttempt:
            raise
        except Exception as exc:
            if not db_outage(exc):
                raise
            current().outage.failed(exc)
            self.every = backoff(self.every)
            self._still_current()
            return False
        self.pending.clear()
        self.every = self.lease_sec
        current().outage.answered()
        return True

    def _still_current(self) -> None:
        """While the renewal cannot write (another program holds SQLite's write lock), a read still
        answers (WAL): a cancel or a reap of this attempt is seen now (StaleAttempt, from
        store.check_attempt), not once the lock is let go. A read that fails too says nothing."""
        try:
            store.check_attempt(self.task_id, self.marker)
        except store.StaleAttempt:
            raise
        except store.TaskNotFound:
            raise store.StaleAttempt(f"task {self.task_id} was cleared from the queue; its attempt "
                                     f"{self.marker} ends") from None
        except Exception:  # noqa: BLE001 - the database away for reads too: the outage goes on
            return


# --------------------------------------------------------------------------------------------
# The prompt.


def build_prompt(task: dict[str, Any], ws: Workspace, notes: list[dict], history: list[dict],
                 parent: dict[str, Any] | None = None, box: agent_box.Support | None = None) -> str:
    """The task's instructions wrapped with the working rules, notes, earlier questions and
    answers (when a resumed session was lost) and the receipt protocol; a follow-up or fork
    (``parent``: the task it builds on) is told where its work starts."""
    rules = [
        f"- Work only inside {ws.cwd}. Do not read, write or run anything outside it.",
        "- Do not commit, push or switch branches; TaskBridge commits your changes itself.",
    ]
    for what, how in agent_box.labels(task["permission"], box or agent_box.Support(None), ws).items():
        if what in ("box", "environment", "files") and task["permission"] == "auto":
            continue
        rules.append(f"- Restriction ({task['permission']}): {what} — {how}.")
    if task["permission"] == "readonly":
        rules.append("- This task is read-only: do not change any file; report what you find.")
    if task["permission"] == "no-network":
        rules.append("- Do not use the network (no curl, wget, pip or npm downloads).")
    if task.get("skills"):
        rules.append("- Before you start, load these OpenCode skills with your skill tool: "
                     f"{', '.join(task['skills'])}.")
    if task.get("subagents"):
        rules.append(f"- You may hand parts of the work to these sub-agents with your task tool: "
                     f"{', '.join(task['subagents'])}.")
    if task.get("rules"):
        rules.append(f"- Permission rules of this task (OpenCode's format, enforced before each tool call): "
                     f"{json.dumps(task['rules'])}. A call they mark ask waits for the planner's decision.")
    parts = [f"# Task {task['id']}: {task['title']}", task["instructions"], "## Working rules", *rules]
    if parent is not None:
        how = "a follow-up of" if task.get("continue_from") else "a fork (another approach, on a branch of its own) of"
        parts.insert(1, f"This is {how} task {parent['id']} ({parent['title']}): its changes are already "
                        f"committed here, on {ws.branch}. Build on them.")
    if notes:
        parts += ["## Notes from the planner", *[f"- {n['author']}: {n['text']}" for n in notes]]
    if history:
        parts.append("## Earlier questions and answers (your earlier session was lost)")
        for qa in history:
            parts += [f"Q: {qa['question']}", f"A: {qa['answer'] or '(no answer yet)'}"]
    parts += ["## When you finish", RECEIPT_PROTOCOL]
    return "\n\n".join(parts)


def permission_question(ask: dict[str, Any]) -> str:
    """The question a task paused on a permission ask puts to the planner: the tool, the command
    or path (exactly: JSON-quoted when backticks, line breaks or edge spaces would blur it), the
    agent's description of the call (quoted as its words), and the answers it takes, saying that
    ``always`` covers that text alone."""
    subject = str(ask["subject"])
    if "`" in subject or "\n" in subject or subject != subject.strip() or not subject:
        shown = json.dumps(subject)
    else:
        shown = f"`{subject}`"
    # The agent's own words (the call's description; a run can write the ask itself too):
    # quoted as such, never as TaskBridge's.
    reason = f" The agent's own description of the call (not checked): {json.dumps(str(ask['reason']))}." \
        if ask.get("reason") else ""
    commands = ask.get("commands") or []
    if commands and commands != [subject]:
        asked_for = ", ".join(json.dumps(c) for c in commands)
        which = f" (the task's rules say ask for {asked_for})."
        always = "for exactly those commands only"
    else:
        which, always = " (the task's rules say ask).", "for exactly this text only"
    return (f"Permission asked: the agent wants to run {ask['tool']} {shown}{which}"
            f"{reason} Answer allow once, allow always, deny once or deny always (always: for this task and "
            f"the follow-ups and forks that inherit its rules, and {always}: any * or ? in it is taken "
            "literally, never as a pattern).")


def resume_message(answer: str, notes: list[dict], ask: dict[str, Any] | None = None) -> str:
    """The message that resumes a session after the planner answered its question (or decided a
    permission ask: ``ask`` with its ``decision``)."""
    parts = [f"The answer to your question:\n\n{answer}"]
    if ask and ask.get("decision", "").startswith("allow"):
        parts = [f"The planner allowed your {ask['tool']} call `{ask['subject']}` ({ask['decision']}); "
                 "it was not run yet. Run it again now, then carry on."]
    elif ask and ask.get("decision"):
        parts = [f"The planner refused your {ask['tool']} call `{ask['subject']}` ({ask['decision']}): it was "
                 "not run. Do not try it again; carry on without it and say so in your receipt."]
    if notes:
        parts.append("New notes from the planner:\n" + "\n".join(f"- {n['author']}: {n['text']}" for n in notes))
    parts += ["Continue the task.", RECEIPT_PROTOCOL]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------
# Supervising one `opencode run`.


@dataclass
class RunResult:
    """What one `opencode run` did, as observed."""
    stream: oc.EventStream
    returncode: int | None = None
    killed: str | None = None          # why the worker ended it (timeout, inactivity, cancel, ...)
    superseded: bool = False           # the attempt was fenced off (cancelled or reaped)
    interrupted: bool = False          # the worker is shutting down at once
    agent_exited: bool = True
    stderr_tail: list[str] = field(default_factory=list)
    seconds: float = 0.0
    paused: dict[str, Any] | None = None   # a spending limit ended it at a step boundary (Meter.check)
    asked: dict[str, Any] | None = None    # a call matched an ``ask`` rule: {tool, subject, reason}
    limited: dict[str, Any] | None = None  # the provider's usage limit: {said, reset_at, source} (see _limit)
    not_believed: list[str] = field(default_factory=list)   # plugin replies the worker set aside, and why
    box: agent_box.Support | None = None   # the box the run was in (its mechanism None: unboxed)
    ended: list[dict[str, Any]] = field(default_factory=list)   # still running at the run's end: {pid, command, ports}
    mcp_down: list[dict[str, Any]] = field(default_factory=list)   # MCP servers OpenCode gave up on (mcp_note)
    meter: Any = None                  # its Meter, whose last booking a full disk may have put off
    engine_gone: str | None = None     # a kept server's run: the server died or stopped answering (its line)

    def doubt(self, line: str) -> None:
        """Note a plugin reply set aside, and why (the first DOUBTS_MAX: the agent can forge replies in a loop)."""
        if len(self.not_believed) < DOUBTS_MAX:
            self.not_believed.append(line)


HELD_WAIT_SEC = 5             # how long a spend gate's reply may wait for the event stream to bear it out
ASK_STEP_WAIT_SEC = 5         # how long a permission ask waits for its step's step_finish (its spend)
REPLY_MAX = 1 << 20           # bytes of a plugin's reply read; a longer one is not believed
DOUBTS_MAX = 20               # replies not believed that one receipt lists
SPOOL_READ = 1 << 20          # bytes per read of OpenCode's stdout file
# Seconds a bash tool shell may be gone before its tool call is judged never to complete: the
# tool_use event of a shell that exited follows within moments; a killed one's never comes.
DEAD_SHELL_SEC = 15
LINE_MAX = 64 * 1024 * 1024   # bytes of one output line held for parsing; longer ones are only logged
STDERR_LINE_KEEP = 2_000      # bytes of each of the last 20 stderr lines kept for the error
# Characters of receipt texts; the whole text stays in the task's log (the raw event stream).
QUESTION_MAX = 20_000


class Meter:
    """A run's spend against its limits, step by step: after each ``step_finish`` the attempt's
    cost and tokens so far go to the task row (live) and the step's own to today's spend
    (``store.record_spend``); then the task's total (earlier attempts + this one) is checked
    against its ``max_cost_usd`` / ``max_tokens`` and today's spend against the daily budget.

    With any limit set at the start, the spend gate (``spend_gate.js``) runs inside OpenCode: the
    gate file tells it what this run may still spend (``allow_usd``, ``allow_tokens``, rewritten
    after each step as other tasks spend too), and before each model call it sums this run's
    finished steps from OpenCode's storage; at the allowance it holds the call and says so in
    ``<gate>.held``, which ``held()`` reads. (``opencode run`` prints a step's event only once the
    next call is under way, so the printed stream alone always lets one more request out.)

    That reply sits in the run's reply folder, which the agent's own shell can write too: its
    figures are the agent's word. Spend is booked only from the event stream (OpenCode's own
    output, which prints the held run's steps within moments); ``believes`` says whether a hold is
    borne out: this run's streamed spend reached the lowest allowance the gate was ever given."""

    def __init__(self, task: dict[str, Any], gate_file: str | None):
        usage = task.get("usage") or {}
        self.task_id, self.marker = task["id"], task["run_marker"]
        self.max_usd, self.max_tokens = task.get("max_cost_usd"), task.get("max_tokens")
        self.prior_usd = float(usage.get("cost_usd") or 0)
        self.prior_tokens = int((usage.get("tokens") or {}).get("total") or 0)
        self.gate_file = gate_file
        self.stopped: str | None = None
        self.cost = 0.0
        self.tokens = 0
        self.booked = (0.0, 0)    # (cost, tokens) of this run already in today's spend
        self.owed = False         # a full disk kept the last booking off (settle_owed books it)
        self.floor: tuple[float | None, int | None] = (None, None)   # lowest allowances the gate file carried
        self.budget: dict[str, Any] = db(store.budget_state) if gate_file else {}
        self.write_gate()

    def step(self, stream: oc.EventStream) -> dict[str, Any] | None:
        """Record the step just finished; the pause (kind, reason, spend, limit) when a limit is
        now reached, else None."""
        self.add(stream.cost_usd, stream.tokens["total"])
        paused = self.check()
        if paused is None:
            self.write_gate()
        return paused

    def add(self, cost: float, tokens: int) -> None:
        """Meter the run's totals so far (``cost`` USD, ``tokens``), when they grew. What could not
        be recorded (the queue database away) goes with the next record, or ``settle``'s."""
        if cost <= self.cost and tokens <= self.tokens:
            return
        self.cost, self.tokens = max(cost, self.cost), max(tokens, self.tokens)
        self._book()

    def settle(self) -> None:
        """At the run's end: what is still unrecorded is recorded, retried while the queue
        database is away (``db``), so today's spend misses no step."""
        if self.cost > self.booked[0] or self.tokens > self.booked[1]:
            self._book(last=True)

    def _book(self, last: bool = False, hold_full: bool = False) -> None:
        cost, tokens = self.cost, self.tokens
        args = (self.task_id, self.marker, round(cost, 8), tokens, max(cost - self.booked[0], 0.0),
                max(tokens - self.booked[1], 0))
        try:
            self.budget = db(store.record_spend, *args, hold_full=hold_full) if last else store.record_spend(*args)
        except store.DiskFull as exc:   # the work is committed first; the spend is booked after (settle_owed)
            current().outage.failed(exc)
            self.owed = True
            return
        except (store.DatabaseUnusable, store.StorageFault, OSError, store.DatabaseUnavailable,
                store.DatabaseBusy) as exc:   # the meter never fails a run
            if db_outage(exc) and not last:
                current().outage.failed(exc)   # said once for the worker; recorded with the next step
            else:
                log(f"{self.task_id}: could not record spend: {exc}", talk.QUIET)
            return
        self.booked = (cost, tokens)

    def settle_owed(self) -> None:
        """Book what a full disk kept ``settle`` from booking, holding on while the disk is full
        (``db``): called once the run's work is committed, before the task is recorded."""
        if self.owed:
            self.owed = False
            self._book(last=True, hold_full=True)

    def check(self) -> dict[str, Any] | None:
        usd, tokens = self.prior_usd + self.cost, self.prior_tokens + self.tokens
        if self.max_usd is not None and usd >= self.max_usd:
            return {"kind": "task_limit", "unit": "usd", "spent": usd, "limit": self.max_usd,
                    "reason": f"spent ${usd:.4f} of its ${self.max_usd:.4f} limit"}
        if self.max_tokens is not None and tokens >= self.max_tokens:
            return {"kind": "task_limit", "unit": "tokens", "spent": tokens, "limit": self.max_tokens,
                    "reason": f"used {tokens:,} of its {self.max_tokens:,} tokens"}
        if self.budget.get("exhausted"):
            return {"kind": "daily_budget", "unit": "usd", "spent": self.budget["spent_usd"],
                    "limit": self.budget["daily_usd"], "reason": self.budget["reason"]}
        return None

    def allowance(self) -> tuple[float | None, int | None]:
        """What this run may spend in all (USD, tokens): the task's limits less its earlier
        attempts, and the daily budgets less what everyone else spent today."""
        usd = [self.max_usd - self.prior_usd] if self.max_usd is not None else []
        tokens = [self.max_tokens - self.prior_tokens] if self.max_tokens is not None else []
        if self.budget.get("daily_usd") is not None:
            usd.append(self.budget["daily_usd"] - (self.budget["spent_usd"] - self.cost))
        if self.budget.get("daily_tokens") is not None:
            tokens.append(self.budget["daily_tokens"] - (self.budget["spent_tokens"] - self.tokens))
        return (min(usd) if usd else None), (min(tokens) if tokens else None)

    def refresh(self) -> None:
        """Other runs spend too: re-read today's spend and rewrite the allowance (the worker does
        this at each lease renewal, every WORKER_LEASE_SEC)."""
        if self.gate_file is None or self.stopped:
            return
        try:
            self.budget = store.budget_state()
        except (store.DatabaseUnusable, store.StorageFault, OSError, store.DatabaseUnavailable,
                store.DatabaseBusy):   # a read the disk refused: the allowance stays as it was
            return
        self.write_gate()

    def write_gate(self, stop: str | None = None) -> None:
        """Tell the spend gate the run's allowance, or to stop (an atomic rename); once told to
        stop it stays stopped."""
        if self.gate_file is None:
            return
        self.stopped = stop = self.stopped or stop
        usd, tokens = self.allowance()
        self.floor = (_lowest(self.floor[0], usd), _lowest(self.floor[1], tokens))
        tmp = f"{self.gate_file}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump({"allow_usd": usd, "allow_tokens": tokens, "stop": stop}, out)
        os.replace(tmp, self.gate_file)

    def held(self) -> dict[str, Any] | None:
        """What the spend gate's reply says it held a model call at (``steps``, ``cost_usd``,
        ``tokens``: the agent's word, see the class), or None when there is no reply."""
        if self.gate_file is None:
            return None
        return read_reply(oc.reply_path(self.gate_file, ".held"))

    def believes(self) -> bool:
        """Whether a hold is borne out by what the event stream showed: the gate was told to stop,
        or this run's streamed spend reached the lowest allowance the gate file ever carried (the
        gate holds only at its allowance)."""
        usd, tokens = self.floor
        return bool(self.stopped) or (usd is not None and self.cost >= usd - 1e-9) or (
            tokens is not None and self.tokens >= tokens)

    def set_aside(self, held: dict[str, Any]) -> str:
        """Remove a reply the stream did not bear out; the receipt's line saying so."""
        if self.gate_file is not None:   # always so: held() read the reply beside it
            with contextlib.suppress(OSError):
                os.unlink(oc.reply_path(self.gate_file, ".held"))
        usd, _ = self.floor
        said = {key: json.dumps(held.get(key))[:40] for key in ("cost_usd", "tokens", "steps")}
        return (f"the spend gate's reply claimed {said['cost_usd']} USD, {said['tokens']} tokens over "
                f"{said['steps']} steps, but the event stream showed ${self.cost:.4f}, {self.tokens:,} tokens "
                f"(allowance {'none' if usd is None else f'${usd:.4f}'} not reached): not believed, nothing booked "
                "from it (the reply folder is writable from inside the agent's box)")

    def close(self) -> None:
        if self.gate_file is not None:
            for path in (self.gate_file, oc.reply_path(self.gate_file, ".held"), f"{self.gate_file}.tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


_Number = TypeVar("_Number", int, float)   # an allowance: USD (float) or tokens (int), kept as it came


def _lowest(old: _Number | None, new: _Number | None) -> _Number | None:
    return new if old is None else old if new is None else min(old, new)


def read_reply(path: str) -> dict[str, Any] | None:
    """A plugin's JSON reply at ``path`` (an object), or None when it is missing, unreadable, not
    an object or over REPLY_MAX bytes: the agent can write there, so it is read with a bound."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(REPLY_MAX + 1)
        data = json.loads(raw) if len(raw) <= REPLY_MAX else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_rules_file(task: dict[str, Any], control: Path) -> str | None:
    """The rules file the permission-rules plugin reads (``{"rules", "once"}``: the task's rules
    and, after "allow once", that one request) in the run's ``control`` folder, or None for a task
    without rules."""
    if not task.get("rules"):
        return None
    path = control / "rules"
    ask = task.get("pending_ask") or {}
    once = [{"tool": ask["tool"], "subject": ask["subject"]}] if ask.get("decision") == "allow once" else []
    store.write_private(path, json.dumps({"rules": task["rules"], "once": once}))
    return str(path)


def fresh_run_folder(task_id: str, suffix: str = ".run") -> Path:
    """``<TASK_LOG_DIR>/<id>.run/`` made anew for one attempt (see ``run_folder``)."""
    return run_folder(store.log_path(task_id).with_suffix(suffix))


def run_folder(run: Path) -> Path:
    """``run`` made anew (0700) as a run's folder: ``control/`` (the files the worker hands
    OpenCode: read-only inside the box), ``reply/`` (the plugins' answers), ``tmp/`` (the run's
    private /tmp) and ``objects/`` (its git objects). Removed when the attempt (or, for a kept
    server's, the server) ends."""
    shutil.rmtree(run, ignore_errors=True)
    for sub in ("control", "reply", "tmp", "objects"):
        (run / sub).mkdir(mode=0o700, parents=True)
    return run


class ShellWatch:
    """The bash tool's shells of one run, seen from outside: OpenCode runs each command as
    ``$SHELL -c COMMAND`` in a session of its own, and a shell killed by a signal (``kill -9
    $$``, the OOM killer) leaves OpenCode 1.18.33's tool call waiting forever, with or without
    a child living on (measured: no tool_use event after 120 s). A shell seen running that is
    gone for DEAD_SHELL_SEC with no bash tool_use for its command is named as dead. Looked at
    once a second: a shell killed within its first second is not seen (the timeout still ends
    that run)."""

    def __init__(self, root: int, argv: list[str], shell: str | None = None) -> None:
        self.root, self.argv, self.shell = root, argv, shell
        self.agent: psutil.Process | None = None
        self.shells: dict[int, dict[str, Any]] = {}   # pid -> {proc, command, gone_at}
        self.next_look = 0.0

    def look(self, now: float) -> None:
        """Note new shells and the time tracked ones went away (at most once a second)."""
        if now < self.next_look:
            return
        self.next_look = now + 1.0
        for shell in self.shells.values():
            if shell["gone_at"] is None and not _alive(shell["proc"]):
                shell["gone_at"] = now
        for proc in self._agent_children():
            with contextlib.suppress(*process_tree.GONE, OSError):
                if proc.pid not in self.shells and os.getsid(proc.pid) == proc.pid:
                    cmdline = proc.cmdline()
                    if _runs_a_shell(cmdline, self.shell):   # OpenCode's own git helpers lead sessions too
                        self.shells[proc.pid] = {"proc": proc, "command": _shell_command(cmdline), "gone_at": None}

    def completed(self, command: str) -> None:
        """A bash tool call for ``command`` finished: its shell is accounted for."""
        for pid, shell in list(self.shells.items()):
            if shell["command"] == command or (shell["command"] and shell["command"] in command):
                del self.shells[pid]
                return

    def dead(self, now: float) -> tuple[int, dict[str, Any]] | None:
        """(pid, shell) of a shell gone for DEAD_SHELL_SEC whose tool call never completed."""
        for pid, shell in self.shells.items():
            if shell["gone_at"] is not None and now - shell["gone_at"] > DEAD_SHELL_SEC:
                return pid, shell
        return None

    def tool_used(self, event: dict[str, Any]) -> None:
        """An event OpenCode printed: a completed bash tool call accounts for its shell."""
        if event.get("type") == "tool_use" and (event.get("part") or {}).get("tool") == "bash":
            called = (event["part"].get("state") or {}).get("input") or {}
            self.completed(str(called.get("command")))

    def died(self, now: float) -> str | None:
        """Why the run must end early, when a bash tool shell died and its call will never
        complete (``now``: time.monotonic(); looked at once a second), else None."""
        self.look(now)
        found = self.dead(now)
        if found is None:
            return None
        pid, shell = found
        return (f"the agent's shell (pid {pid}) died while running {json.dumps(shell['command'][:300])}, and "
                f"OpenCode's bash tool call never completed (nothing for {DEAD_SHELL_SEC} s after): the run was "
                "ended early (a shell killed by a signal, e.g. `kill -9 $$` or the OOM killer)")

    def _agent_children(self) -> list[psutil.Process]:
        try:
            if self.agent is None:
                self.agent = next((p for p in psutil.Process(self.root).children(recursive=True)
                                   if p.cmdline()[1:] == self.argv[1:]), None)
            return self.agent.children() if self.agent is not None else []
        except process_tree.GONE:
            return []


def _shell_watch(launch: Launch, pid: int) -> ShellWatch:
    """The watch over the bash tool's shells of the run ``launch`` started as ``pid``: OpenCode's
    own children, the kept server's when the run drives one."""
    kept = launch.server
    if kept is not None and kept.engine.proc is not None:
        return ShellWatch(kept.engine.proc.pid, kept.engine.argv, kept.engine.shell)
    return ShellWatch(pid, launch.argv, launch.env.get("SHELL"))


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except process_tree.GONE:
        return False


SHELL_NAMES = {"sh", "bash", "dash", "zsh", "ksh", "fish"}


def _runs_a_shell(cmdline: list[str], shell: str | None) -> bool:
    """Whether ``cmdline`` is ``SHELL … -c COMMAND`` (the run's ``$SHELL``, run directly or by
    its interpreter, or a shell by name): what OpenCode's bash tool starts, not its git helpers."""
    if "-c" not in cmdline[:-1]:
        return False
    head = cmdline[:cmdline.index("-c")][:2]
    return any(part == shell or os.path.basename(part) in SHELL_NAMES for part in head)


def _shell_command(cmdline: list[str]) -> str:
    """COMMAND of ``SHELL … -c COMMAND``, else the whole command line (bash may have exec'd it)."""
    if "-c" in cmdline[:-1]:
        return cmdline[cmdline.index("-c") + 1]
    return " ".join(cmdline)


class Courier:
    """Carries notes added while an attempt runs into its running session: it writes the task's
    undelivered notes to the notes file the note courier plugin (``notes_courier.js``) reads
    before each model call, and records the ones the plugin acknowledges as delivered (when, and
    that it was in the running session), and those the warm engine's client gave a turn of their
    own once the agent had finished (``turns``: the event stream's ``note_turns``, [(ids, epoch
    seconds)])."""

    TURN = "in the running session, as a turn of its own after the agent had finished"

    def __init__(self, task: dict[str, Any], notes_file: str):
        self.task_id, self.marker, self.path = task["id"], task["run_marker"], notes_file
        self.written: list[int] | None = None
        self.recorded: set[int] = set()

    def sync(self, turns: list[tuple[list[Any], float]]) -> None:
        """Write the notes file when the undelivered notes changed; record new acknowledgements."""
        with contextlib.suppress(OSError, ValueError, TypeError, store.TaskStoreError):
            self._record_acks()
            self._record(turns, self.TURN)
            notes = store.undelivered_notes(self.task_id)
            ids = [n["id"] for n in notes]
            if ids != self.written:
                tmp = f"{self.path}.tmp"
                with open(tmp, "w", encoding="utf-8") as out:
                    json.dump({"notes": notes}, out)
                os.replace(tmp, self.path)
                self.written = ids

    def _record_acks(self) -> None:
        try:
            with open(oc.reply_path(self.path, ".ack"), encoding="utf-8") as handle:
                acks = json.load(handle).get("delivered") or []
        except FileNotFoundError:
            return
        self._record([([a["id"]], float(a["at"]) / 1000) for a in acks], "in the running session, at a step boundary")

    def _record(self, deliveries: list[tuple[list[Any], float]], how: str) -> None:
        """Mark delivered ``how`` the notes of ``deliveries`` ([(ids, epoch seconds)]) not yet recorded."""
        new = [(int(note_id), at) for ids, at in deliveries for note_id in ids if int(note_id) not in self.recorded]
        if new:
            store.mark_notes_delivered(self.task_id, self.marker, new, how)
            self.recorded.update(note_id for note_id, _ in new)

    def close(self, turns: list[tuple[list[Any], float]]) -> None:
        """Record the last acknowledgements and remove the files."""
        with contextlib.suppress(OSError, ValueError, TypeError, store.TaskStoreError):
            self._record_acks()
            self._record(turns, self.TURN)
        for path in (self.path, oc.reply_path(self.path, ".ack"), f"{self.path}.tmp"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def spend_limited(task: dict[str, Any]) -> bool:
    """Whether a run needs the spend gate: the task has a limit, or the queue a daily budget."""
    if task.get("max_cost_usd") is not None or task.get("max_tokens") is not None:
        return True
    state = db(store.budget_state)
    return state["daily_usd"] is not None or state["daily_tokens"] is not None


class TaskLog:
    """The task's log as a run writes it, unbuffered. A write the disk refuses (full, over quota,
    read-only) is named once, with the path and the way out, and the run goes on: the events are
    still read and parsed for the receipt, only the log misses them (a line says how much)."""

    def __init__(self, task_id: str, handle: Any) -> None:
        self.task_id, self.handle, self.path = task_id, handle, store.log_path(task_id)
        self.lost = 0   # bytes refused since the last write that landed

    def write(self, data: bytes) -> None:
        try:
            if self.lost:
                os.write(self.handle.fileno(), f"[worker] {self.lost:,} bytes of this log were lost: "
                                               "the disk refused them\n".encode())
                self.lost = 0
            os.write(self.handle.fileno(), data)
        except OSError as exc:
            if not self.lost:
                fault = store.storage_fault(exc, self.path)
                log(f"{self.task_id}: {fault or exc}; the run goes on, its log misses what cannot be written",
                    talk.QUIET)
            self.lost += len(data) or 1

    def flush(self) -> None:
        """Nothing waits: every write went to the file at once."""

    def fileno(self) -> int:
        return self.handle.fileno()


class LogShipper:
    """The task log on its way to the database, where logs live on PostgreSQL
    (``task_store.logs_in_database``): the worker writes its local file as always and ships what
    was appended since the last ship, at each lease renewal (every WORKER_LEASE_SEC), as soon as a
    chunk's worth (64 KiB) waits, and at the end of the run. A ship that fails is retried with
    the same bytes at the next one; ``append_task_log``'s ``at`` turns bytes that did land before
    the failure was seen into a no-op, so nothing is written twice. A crash loses only what was
    not shipped yet. On SQLite it does nothing: the file is the log."""

    def __init__(self, task_id: str, log: Any) -> None:
        self.task_id, self.log, self.path = task_id, log, store.log_path(task_id)
        self.active = store.logs_in_database()
        self.local = self._size()                            # the file's bytes from before this run stay local
        self.remote = db(store.task_log_size, task_id) if self.active else 0
        self.failed_at: str | None = None

    def _size(self) -> int:
        return os.fstat(self.log.fileno()).st_size

    def waiting(self) -> int:
        """Bytes written to the file (flushed) and not shipped yet."""
        return self._size() - self.local if self.active else 0

    def ship(self, last: bool = False) -> None:
        """Ship what waits. ``last``: the run's end, after which no ship comes to retry it: while
        the queue database is away it is retried (``db``, for up to WORKER_STALE_SEC)."""
        if not self.active:
            return
        self.log.flush()
        end = self._size()
        if end <= self.local:
            return
        with open(self.path, "rb") as handle:
            handle.seek(self.local)
            data = handle.read(end - self.local)
        try:
            self.remote = (db(store.append_task_log, self.task_id, data, at=self.remote) if last else
                           store.append_task_log(self.task_id, data, at=self.remote))
        except store.TaskNotFound:
            self.active = False                              # the task was cleared: nothing to ship to
            return
        except Exception as exc:  # noqa: BLE001 - a ship is retried at the next one; the run goes on
            if self.failed_at is None:
                self.failed_at = str(exc)
                log(f"{self.task_id}: the log could not be shipped to the database ({exc}); retrying", talk.QUIET)
            return
        self.local += len(data)
        if self.failed_at is not None:
            self.failed_at = None
            log(f"{self.task_id}: the log reaches the database again")


class LimitWatch:
    """The provider's usage limit as one run meets it: the retry time comes from the retry watch
    plugin (OpenCode's own, from the provider's headers, in ``retry_file``), else from the words
    of a ``--print-logs`` limit line (``log_line``). ``hold_sec``: WORKER_LIMIT_HOLD_SEC."""

    def __init__(self, retry_file: str | None, hold_sec: float) -> None:
        self.retry_file, self.hold_sec = retry_file, hold_sec
        self.logged: dict[str, Any] | None = None   # the last limit a --print-logs line named

    def log_line(self, text: str) -> None:
        """A stderr line of OpenCode's: kept when it names a limit."""
        self.logged = oc.limit_from_log(text, time.time()) or self.logged

    def reached(self, stream: oc.EventStream) -> tuple[dict[str, Any], float] | None:
        """``({said, reset_at, source}, seconds to wait)`` when OpenCode is about to sleep longer
        than ``hold_sec`` for its next try (the session to resume is then named on ``stream``:
        nothing was printed yet on a first call), else None."""
        retry = self._retry_said()
        if retry is not None and isinstance(retry.get("next"), (int, float)):
            said, source, reset_at, session = str(retry.get("message") or ""), "retry", retry["next"] / 1000, \
                retry.get("sessionID")
        elif self.logged is not None and self.logged.get("reset_at"):
            said, source, reset_at, session = self.logged["said"], "log", self.logged["reset_at"], \
                self.logged.get("session_id")
        else:
            return None
        wait = reset_at - time.time()
        if wait <= self.hold_sec:
            return None
        stream.session_id = stream.session_id or (str(session) if session else None)
        return {"said": said, "reset_at": reset_at, "source": source}, wait

    def ended(self, result: RunResult) -> str | None:
        """Why the run must end now, when the limit holds OpenCode longer than ``hold_sec`` (the
        slot is freed; the task pauses until the reset, which ``result.limited`` names), else None."""
        found = self.reached(result.stream)
        if found is None:
            return None
        result.limited, wait = found
        return f"paused at the provider's usage limit: OpenCode would wait {wait:.0f} s for its next try"

    @staticmethod
    def at_give_up(result: RunResult) -> None:
        """OpenCode gave up on a limit (its retries spent): the ``error`` event names it, with the
        provider's headers; ``result.limited`` says so, and the task pauses instead of failing."""
        stream = result.stream
        if result.limited is None and stream.limit is not None and not stream.finished and not result.killed:
            result.limited = {**stream.limit, "source": "error"}

    def _retry_said(self) -> dict[str, Any] | None:
        """The retry OpenCode last scheduled (retry_watch.js's file), when its words are a limit's."""
        if not self.retry_file:
            return None
        try:
            with open(oc.reply_path(self.retry_file, ".json"), encoding="utf-8") as handle:
                retry = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(retry, dict) or not (oc.is_limit(str(retry.get("message") or "")) or self.logged):
            return None
        return retry


class AskWatch:
    """The call the permission-rules plugin held for the planner (failed, its session's next model
    call held), from its ``.ask`` reply beside ``rules_file`` ({tool, subject, reason}). The reply
    folder is writable in the box, so the request is the agent's word: it is believed only when
    the task's rules say ask for exactly it (what the plugin checked before holding it). Any other
    reply is removed and the run goes on; a believed one can at most ask for what the agent could
    have called anyway."""

    def __init__(self, task: dict[str, Any], rules_file: str, cwd: str) -> None:
        self.rules, self.path, self.cwd = task["rules"], oc.reply_path(rules_file, ".ask"), cwd
        self.believed_at: float | None = None   # when an ask was first believed (time.monotonic())

    def step_ended(self, stream: oc.EventStream, now: float) -> bool:
        """Whether a run with a believed ask may end: the step that made the call has ended (its
        step_finish printed, so its spend is booked; the plugin holds the next model call), or
        ASK_STEP_WAIT_SEC went by since the ask was first believed (a sub-agent's call: its
        steps are not printed). ``now``: time.monotonic()."""
        self.believed_at = self.believed_at or now
        return stream.held_step_ended or now - self.believed_at > ASK_STEP_WAIT_SEC

    def held(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the ask believed, or None; why a reply was not believed, or None). A believed bash ask
        carries ``commands``: those of its command line the rules mark ask (what ``always`` adds
        a rule for), worked out here, not taken from the reply."""
        if not os.path.exists(self.path):
            return None, None
        said = read_reply(self.path)
        asked: dict[str, Any] = {k: str((said or {}).get(k) or "") for k in ("tool", "subject", "reason")}
        if said is not None and oc.rule_action(self.rules, asked["tool"], asked["subject"], self.cwd) == "ask":
            commands = oc.asking_commands(self.rules, asked["tool"], asked["subject"])
            return asked | ({"commands": commands} if commands else {}), None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        return None, (f"a permission ask for {asked['tool'] or '?'} {json.dumps(asked['subject'][:200])}, which "
                      "the task's rules do not mark ask: not believed, the run went on (the reply folder is "
                      "writable from inside the agent's box)")

    def asked(self, result: RunResult) -> dict[str, Any] | None:
        """The ask believed, or None; a reply not believed is set aside and noted in ``result``
        (the receipt says so)."""
        asked, doubt = self.held()
        if doubt:
            result.doubt(doubt)
        return asked


@dataclass
class Launch:
    """One attempt's OpenCode command as the Supervisor starts it."""
    argv: list[str]                      # `opencode run ...` (oc.run_command)
    env: dict[str, str]                  # its environment, the plugins' control files named in it
    cwd: str                             # the agent's working directory
    prompt: str                          # sent on its stdin
    boxed_argv: list[str] | None = None  # ``argv`` as the box runs it (None: argv itself)
    rules_file: str | None = None        # the permission rules plugin's file (write_rules_file), if any
    retry_file: str | None = None        # the retry watch plugin's file (oc.with_retry_watch), if any
    server: engine_slots.Kept | None = None   # the kept server the command drives (engine_client.py)
    # Called from the run's own thread at each round of the watch once the run has gone on for
    # ENGINE_NEXT_AFTER_SEC, until it returns True (the slot's next kept server is built and started
    # then: _engine_meanwhile); None: nothing to do meanwhile.
    meanwhile: Callable[[], bool] | None = None

    def adopting(self, status_w: int) -> list[str]:
        """The boxed command with run_reaper.py between the box and OpenCode (inside the box, so
        that it adopts what the agent detaches there), reporting OpenCode's exit on ``status_w``.
        Raises ValueError when the box's command does not end with OpenCode's."""
        boxed = self.boxed_argv or self.argv
        at = len(boxed) - len(self.argv)
        if boxed[at:] != self.argv:
            raise ValueError("the box's command does not end with OpenCode's")
        return [*boxed[:at], *process_tree.reaper_argv(agent_box.stdlib_python(), status_w, self.argv)]

    def carries_run(self, proc: psutil.Process) -> bool:
        """Whether ``proc`` is the box, the reaper or OpenCode itself: the processes a run is made of."""
        return process_tree.carries(proc, self.argv)


class OutputLines:
    """OpenCode's two output streams (``"out"``: the event stream on its stdout; ``"err"``: its
    stderr) cut into lines as their bytes arrive (``feed``). Each line is redacted before anything
    reads it, written to the task's log and handed on: an event to the run's EventStream, then to
    ``on_event`` (the Supervisor's watchers) and the worker's voice; a stderr line to the stderr
    tail and the usage-limit watch (``limits``), unless it names an MCP server OpenCode gave up on
    (kept for the receipt instead). A line past LINE_MAX bytes is logged as it comes and not
    parsed, so memory stays bounded.

    ``log``: the task's log (a TaskLog; any binary file will do); ``result``: the run's
    RunResult, written into; ``started_wall``: time.time() when OpenCode started (default: now),
    from which an MCP server's wait is counted."""

    def __init__(self, task_id: str, log: Any, result: RunResult, limits: LimitWatch,
                 on_event: Callable[[dict[str, Any]], None] | None = None, started_wall: float | None = None) -> None:
        self.task_id, self.log, self.result, self.limits, self.on_event = task_id, log, result, limits, on_event
        self.started_wall = time.time() if started_wall is None else started_wall
        self.redactor = redaction.current()
        self.partial: dict[str, bytearray] = {}   # the line being read: "out" and "err"
        self.oversized: dict[str, redaction.LongLine] = {}   # streams in the middle of a line over LINE_MAX

    def refresh_secrets(self) -> None:
        """Redact with the secrets held now (a token rotated mid-run: files are stat'ed, not re-read)."""
        self.redactor = redaction.current()

    def feed(self, stream: str, data: bytes) -> None:
        """``data`` as read from ``stream`` ("out" or "err"): each line it completes is handled."""
        start = 0
        while (newline := data.find(b"\n", start)) >= 0:
            self._take(stream, data[start:newline], end=True)
            start = newline + 1
        if start < len(data):
            self._take(stream, data[start:], end=False)

    def finish(self) -> None:
        """The streams have ended: a last line without its newline is handled as one."""
        for stream in ("out", "err"):
            if self.partial.get(stream) or stream in self.oversized:
                self._take(stream, b"", end=True)
        self.partial.clear()

    def _take(self, stream: str, piece: bytes, end: bool) -> None:
        """Add ``piece`` to the line being read on ``stream``; ``end``: the line is complete. A line
        past LINE_MAX bytes goes to the log as it comes and is not parsed (memory stays bounded)."""
        if stream in self.oversized:
            self.log.write(self.oversized[stream].feed(piece))
            if end:
                self.log.write(self.oversized.pop(stream).end())
                self.result.stream.bad_lines += 1
                self.log.write(f"\n[worker] the line above is over {LINE_MAX:,} bytes: logged, not parsed\n".encode())
            return
        buf = self.partial.setdefault(stream, bytearray())
        buf += piece
        if end:
            line = bytes(buf)
            buf.clear()
            self._line(stream, line)
        elif len(buf) > LINE_MAX:
            # Written as it comes, so a secret may be split between pieces: LongLine holds back
            # what a later piece could complete.
            self.oversized[stream] = redaction.LongLine(self.redactor)
            self.log.write((b"[stderr] " if stream == "err" else b"") + self.oversized[stream].feed(bytes(buf)))
            buf.clear()

    def _line(self, stream: str, line: bytes) -> None:
        # Redacted before anything reads it: the log, the receipt's texts and the worker's own
        # lines are all made from the redacted line.
        line = self.redactor.redact(line)
        if stream == "err":
            text = line[:STDERR_LINE_KEEP].decode(errors="replace")
            self.log.write(b"[stderr] " + line + b"\n")
            if (down := oc.mcp_unavailable(text)) is not None:
                return self._mcp_down(down)
            self.result.stderr_tail = (self.result.stderr_tail + [text])[-20:]
            self.limits.log_line(text)
        else:
            self.log.write(line + b"\n")
            event = self.result.stream.feed(line.decode(errors="replace"))
            if event is None and line.strip():
                self.log.write(b"[worker] skipped a non-JSON line above\n")
            elif event is not None:
                if self.on_event is not None:
                    self.on_event(event)
                current().talk.event(self.task_id, event)
        self.log.flush()

    def _mcp_down(self, down: dict[str, Any]) -> None:
        """An MCP server OpenCode gave up on: kept for the receipt with the seconds it had waited
        since OpenCode started, and kept out of the stderr tail that an exit error quotes."""
        if len(self.result.mcp_down) < DOUBTS_MAX:
            after = round(max(0.0, down["at"] - self.started_wall), 1) if down["at"] else None
            self.result.mcp_down.append({"server": down["server"][:200], "type": down["type"],
                                         "status": down["status"], "after_sec": after})
            log(f"{self.task_id}: OpenCode gave up on its MCP server {down['server'][:200]!r} "
                f"({down['status']}) {after} s after it started", talk.VERBOSE)
        self.log.flush()


class OutputReader:
    """What a running OpenCode writes, read without blocking as it grows: its stdout file
    (``spool``, see _spool_file), its stderr pipe and run_reaper.py's status pipe (``status``,
    whose ``exit CODE`` is kept as ``agent_code``). Their lines go to ``lines``. Owns the three:
    ``drain`` reads them to their end and closes them. ``last_activity``: time.monotonic() of the
    last output read (or of ``start``)."""

    def __init__(self, lines: OutputLines, spool: int, status: int, stderr: IO[bytes]) -> None:
        self.lines, self.spool, self.status, self.stderr = lines, spool, status, stderr
        self.selector = selectors.DefaultSelector()
        self.status_said = b""
        self.agent_code: int | None = None   # OpenCode's exit code, as run_reaper.py reported it
        self.last_activity = time.monotonic()
        self.exited_at: float | None = None   # when OpenCode was first seen gone

    def start(self, now: float) -> None:
        """Begin watching the pipes; inactivity counts from ``now`` (time.monotonic())."""
        os.set_blocking(self.stderr.fileno(), False)
        self.selector.register(self.stderr, selectors.EVENT_READ)
        os.set_blocking(self.status, False)
        self.selector.register(self.status, selectors.EVENT_READ)
        self.last_activity = now

    def pump(self, timeout: float) -> None:
        """Read what arrived, waiting up to ``timeout`` seconds for the pipes."""
        for key, _ in self.selector.select(timeout):
            if key.fileobj == self.status:
                self._read_status()
            else:
                self._read_stderr()
        self._read_spool()

    def read_out(self) -> bool:
        """Asked once OpenCode has exited: True when its pipes are read to their end, or a second
        after it was first seen gone (a stray grandchild may hold them open: not waited on)."""
        self.exited_at = self.exited_at or time.monotonic()
        return not self.selector.get_map() or time.monotonic() - self.exited_at > 1.0

    def drain(self) -> None:
        """Read what is left after the tree is gone (stderr for up to a second: a stray process
        may hold it open; the stdout file to its end), finish partial lines, close all three."""
        end = time.monotonic() + 1.0
        while self.selector.get_map() and time.monotonic() < end:
            self.pump(0.1)
        self._read_spool()
        self.lines.finish()
        for fileobj in (self.stderr, self.status):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fileobj)
        self.stderr.close()
        os.close(self.spool)
        os.close(self.status)

    def _read_status(self) -> None:
        """run_reaper.py's ``exit CODE`` line: OpenCode has ended (what it left may live on)."""
        try:
            data = os.read(self.status, 256)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(self.status)
            return
        self.status_said += data
        words = self.status_said.split()
        if len(words) >= 2 and words[0] == b"exit" and words[1].lstrip(b"-").isdigit():
            self.agent_code = int(words[1])

    def _read_spool(self) -> None:
        """Everything OpenCode wrote to its stdout file since the last call."""
        while data := os.read(self.spool, SPOOL_READ):
            self.last_activity = time.monotonic()
            self.lines.feed("out", data)

    def _read_stderr(self) -> None:
        try:
            data = os.read(self.stderr.fileno(), 65536)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(self.stderr)
            return
        self.last_activity = time.monotonic()
        self.lines.feed("err", data)


class SpendWatch:
    """A run's spend as the Supervisor watches it, through the task's Meter: each finished step
    is booked and checked, and at a reached limit the run is to end at that step boundary, the
    gate file telling the spend gate plugin to hold the next model call. The gate's own replies
    (``held``) are checked too. ``step`` and ``held`` return why the run must end (the Supervisor
    ends it), or None; ``result``: the run's RunResult, written into."""

    def __init__(self, meter: Meter, result: RunResult) -> None:
        self.meter, self.result = meter, result
        self.held_since: float | None = None   # when a spend gate reply was first seen

    def gated(self) -> bool:
        """Whether the run has a spend gate whose replies are to be read."""
        return bool(self.meter.gate_file)

    def step(self, stopping: bool) -> str | None:
        """A step finished: meter it; at a reached limit, pause the run at this step boundary (the
        gate keeps the next model call from going out), else let the next call go. ``stopping``:
        the run is ending already (nothing to pause)."""
        stream = self.result.stream
        paused = self.meter.step(stream)
        if paused is not None and not stream.finished and not stopping:
            return self._pause(paused)
        return None

    def held(self, now: float, stopping: bool, final: bool = False) -> str | None:
        """The spend gate's reply says it held a model call. Its figures are the agent's word (the
        reply folder is writable in the box), so nothing is booked from them: a real hold follows
        steps the event stream shows within moments, and once their spend reaches the gate's
        allowance the run pauses on them. A reply not borne out after HELD_WAIT_SEC (or by the
        run's end, ``final``) is set aside, the receipt says so, and the run goes on. ``now``:
        time.monotonic(); ``stopping``: the run is ending already."""
        meter = self.meter
        held = meter.held()
        if held is None:
            self.held_since = None
            return None
        self.held_since = self.held_since or time.monotonic()
        if meter.believes():
            if not final and not stopping:
                return self._pause(meter.check() or {"kind": "daily_budget", "unit": "usd", "spent": meter.cost,
                                                     "limit": None,
                                                     "reason": "the spend gate held the next model call"})
        elif final or now - self.held_since > HELD_WAIT_SEC:
            self.result.doubt(meter.set_aside(held))
            self.held_since = None
        return None

    def refresh(self) -> None:
        """A lease renewal landed: take the queue's spend as it is now (Meter.refresh)."""
        self.meter.refresh()

    def close(self) -> None:
        """The run's end, once its tree is gone: a last look at the gate's reply, the last booking,
        the meter handed to the result, the gate file removed (a missing one lets calls go)."""
        self.held(time.monotonic(), stopping=True, final=True)
        self.meter.settle()
        self.result.meter = self.meter
        self.meter.close()

    def _pause(self, paused: dict[str, Any]) -> str:
        paused["gated"] = self.meter.gate_file is not None
        self.meter.write_gate(stop=paused["reason"])
        self.result.paused = paused
        return f"paused at a spending limit: {paused['reason']}"


@dataclass
class Running:
    """What Supervisor.run() makes as it starts OpenCode: the process, the reader of its output,
    the watch over the bash tool's shells, and the task log's shipper."""
    proc: subprocess.Popen[bytes]
    output: OutputReader
    shells: ShellWatch
    shipper: LogShipper


class Supervisor:
    """Runs `opencode run` for one attempt and watches it: output to the log as it arrives, the
    lease renewed, the timeout, the inactivity watchdog, the exit grace after a terminal event,
    cancel (fencing) and shutdown; ends the whole process tree whatever happens. Its other jobs
    are objects of their own: the command (Launch), the output (OutputReader, OutputLines), the
    lease (Renewal), the log's copy in the queue (LogShipper), the spend (SpendWatch over a
    Meter), the notes (Courier), the bash tool's shells (ShellWatch), the provider's usage limit
    (LimitWatch) and the permission asks (AskWatch).

    ``launch``: the command, its environment, folder, prompt and plugin files; ``deadline_at``:
    time.monotonic() at which the attempt's timeout ends (None: ``timeout_sec`` from the start of
    the run)."""

    def __init__(self, task: dict, launch: Launch, knobs: Knobs, box: agent_box.Support, *,
                 meter: Meter | None = None, courier: Courier | None = None, deadline_at: float | None = None):
        self.task, self.launch, self.knobs, self.deadline_at = task, launch, knobs, deadline_at
        self.result = RunResult(oc.EventStream(), box=box)
        self.spend = SpendWatch(meter, self.result) if meter is not None else None
        self.courier = courier
        self.limits = LimitWatch(launch.retry_file, knobs.limit_hold_sec)
        self.asks = AskWatch(task, launch.rules_file, launch.cwd) if launch.rules_file else None
        self.renewal = Renewal(task, knobs.lease_sec)
        self.finished_at: float | None = None   # when the stream's terminal event came
        self.stop = False
        self.running: Running | None = None   # made by run() as OpenCode starts

    def run(self) -> RunResult:
        """Run the attempt to its end; the RunResult says what it did. Raises what starting
        OpenCode raises (OSError; ValueError when the box's command does not end with OpenCode's)."""
        started = time.monotonic()
        with store.open_task_log(self.task["id"]) as handle:
            task_log = TaskLog(self.task["id"], handle)
            shipper = LogShipper(self.task["id"], task_log)
            task_log.write(_run_header(self.task["run_marker"], self.launch, self.result.box))
            if self.courier is not None:
                self.courier.sync(self.result.stream.note_turns)
            self.running = running = self._start(task_log, shipper)
            _send_prompt(running.proc, self.launch.prompt)
            self._record_pid(running.proc.pid)
            try:
                self._watch()
            finally:
                self._wind_up(running)
        self.result.seconds = round(time.monotonic() - started, 2)
        return self.result

    def _start(self, task_log: TaskLog, shipper: LogShipper) -> Running:
        """Start OpenCode in its own session, its stdout to a spool file (_spool_file), and what watches it."""
        launch = self.launch
        spool, writer = _spool_file(store.log_path(self.task["id"]).parent)
        started_wall = time.time()
        status, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                launch.adopting(status_w), cwd=launch.cwd, env=launch.env, stdin=subprocess.PIPE,
                stdout=writer, stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status_w,))
        except BaseException:
            os.close(spool)
            os.close(status)
            raise
        finally:
            os.close(writer)
            os.close(status_w)
        if proc.stderr is None:
            raise RuntimeError("OpenCode was started without a stderr pipe")
        output = OutputReader(self._lines(task_log, started_wall), spool, status, proc.stderr)
        return Running(proc, output, _shell_watch(launch, proc.pid), shipper)

    def _wind_up(self, running: Running) -> None:
        """The run's end, whatever ended it: the tree ended, the output read to its end and
        shipped, the exit code, the usage limit's, the spend's and the notes' last word."""
        self.result.ended = _end_leftovers(self.task, self.launch, running.proc.pid, self.knobs.kill_grace_sec)
        running.output.drain()
        running.shipper.ship(last=True)
        code = running.proc.wait()
        self.result.returncode = code if running.output.agent_code is None else running.output.agent_code
        self.limits.at_give_up(self.result)
        if self.spend is not None:
            self.spend.close()
        if self.courier is not None:
            self.courier.close(self.result.stream.note_turns)

    def _started(self) -> Running:
        """OpenCode's process and what watches it; run() makes them before anything here reads them."""
        if self.running is None:
            raise RuntimeError("the supervisor has not started OpenCode yet (run() does)")
        return self.running

    def _record_pid(self, pid: int) -> None:
        try:   # while the database is away, the pid goes with the next renewal that lands
            self.renewal.renew(agent_pid=pid, agent_pid_start=process_tree.start_time(pid))
        except store.StaleAttempt:
            self._end("cancelled or reaped before it started", superseded=True)

    def _watch(self) -> None:
        output = self._started().output
        now = time.monotonic()
        # The task's timeout bounds the whole attempt: workspace preparation spent part of it.
        deadline = self.deadline_at or now + self.task["timeout_sec"]
        output.start(now)
        meanwhile_at = now + ENGINE_NEXT_AFTER_SEC
        with store.lock_wait(SHORT_LOCK_WAIT_SEC):
            while not self.stop and not self._done():
                output.pump(0.2)
                self._check(time.monotonic(), deadline)
                if self.launch.meanwhile is not None and time.monotonic() >= meanwhile_at and not self.stop \
                        and self.launch.meanwhile():
                    self.launch.meanwhile = None

    def _agent_gone(self) -> bool:
        """OpenCode has exited (the reaper said so, or the whole run is gone), whatever it left."""
        running = self._started()
        return running.output.agent_code is not None or running.proc.poll() is not None

    def _done(self) -> bool:
        return self._agent_gone() and self._started().output.read_out()

    def _check(self, now: float, deadline: float) -> None:
        """One round of the watch (``now``, ``deadline``: time.monotonic()): the lease, then the
        first thing found that ends the run, then the exit grace after a terminal event."""
        if self._keep_lease(now) or self._ended_by_watch(now, deadline):
            return
        if self.spend is not None and self.spend.gated() and not self.stop:
            paused = self.spend.held(now, self.stop)
            if paused is not None:
                self._end(paused)
                return
        limited = self.limits.ended(self.result)
        if limited is not None:
            self._end(limited)
        if self.stop:
            return
        if self.result.stream.finished and self.finished_at is None:
            self.finished_at = now
        if self.finished_at and now - self.finished_at > self.knobs.exit_grace_sec and not self._agent_gone():
            self.result.agent_exited = False   # ended by us; the run still counts by its events
            self.stop = True

    def _keep_lease(self, now: float) -> bool:
        """Renew the lease when due, and with a renewal that landed refresh what waits on the
        database (the log's copy, the spend, the notes); else ship a full log chunk. True when the
        attempt was superseded (the run is ended)."""
        running = self._started()
        if self.renewal.due(now):
            try:
                renewed = self.renewal.renew()
            except store.StaleAttempt as exc:
                self._end(str(exc), superseded=True)
                return True
            if renewed:   # while the database is away the agent runs on; the rest waits for it
                running.output.lines.refresh_secrets()
                current().beat.write()
                running.shipper.ship()
                if self.spend is not None:
                    self.spend.refresh()
                if self.courier is not None:
                    self.courier.sync(self.result.stream.note_turns)
        elif running.shipper.waiting() >= store.LOG_CHUNK_MAX and current().outage.since is None:
            running.shipper.ship()
        return False

    def _ended_by_watch(self, now: float, deadline: float) -> bool:
        """End the run on the first reason found (told to stop at once, a permission ask, the
        timeout, the inactivity watchdog, a dead shell); True when one was."""
        knobs = self.knobs
        if current().flags.stop_now:
            self._end("the worker was told to stop at once", interrupted=True)
        elif self.asks is not None and (asked := self.asks.asked(self.result)) is not None \
                and self.asks.step_ended(self.result.stream, now):
            self.result.asked = asked
            self._end(f"paused: the agent asked permission for {asked['tool']} {asked['subject'][:200]}")
        elif now > deadline:
            self._end(f"timed out after {self.task['timeout_sec']} s")
        elif now - self._started().output.last_activity > knobs.inactivity_sec:
            self._end(f"no output or event for {knobs.inactivity_sec:g} s (inactivity watchdog)")
        elif (died := self._started().shells.died(now)) is not None:
            self._end(died)
        else:
            return False
        return True

    def _end(self, reason: str, superseded: bool = False, interrupted: bool = False) -> None:
        self.stop = True
        self.result.killed = reason
        self.result.superseded = superseded
        self.result.interrupted = interrupted

    def _lines(self, log: Any, started_wall: float | None = None) -> OutputLines:
        """The line handling of this run's output, written to ``log`` (the task's TaskLog; the
        benches pass any binary file) and handing events to this supervisor's watchers."""
        return OutputLines(self.task["id"], log, self.result, self.limits, self._event, started_wall)

    def _event(self, event: dict[str, Any]) -> None:
        """An event OpenCode printed (OutputLines hands each on): a finished step is metered, a
        completed bash call accounts for its shell (none is watched before run() starts OpenCode)."""
        if event.get("type") == "step_finish" and self.spend is not None:
            paused = self.spend.step(self.stop)
            if paused is not None:
                self._end(paused)
        if event.get("type") == "note_turn":   # the warm engine gave late notes a turn: the run goes on
            self.finished_at = None
            if self.courier is not None:
                self.courier.sync(self.result.stream.note_turns)
        if self.running is not None:
            self.running.shells.tool_used(event)


def _end_leftovers(task: dict[str, Any], launch: Launch, pid: int, grace_sec: float) -> list[dict[str, Any]]:
    """Name what the run of ``launch`` (OpenCode's ``pid``) still has going (a dev server the agent
    detached, the commands of a run we stopped), then end the whole tree and anything tagged with
    the run, SIGKILL after ``grace_sec`` seconds. Returns what was named: [{pid, command, ports}]."""
    ended = process_tree.described(process_tree.run_leftovers(pid, launch.carries_run))
    if launch.server is not None:   # a kept server's: the agent's commands are the server's children
        ended += process_tree.described(launch.server.agent_processes())
    process_tree.kill_tree(pid, grace_sec, run_stragglers(task["run_marker"], launch.env[oc.QUEUE_ENV]))
    for item in ended:
        ports = f" (listening on {', '.join(map(str, item['ports']))})" if item["ports"] else ""
        log(f"{task['id']}: ended pid {item['pid']}{ports} with the run: {item['command'][:120]}", talk.VERBOSE)
    return ended


def _run_header(marker: str, launch: Launch, box: agent_box.Support | None) -> bytes:
    """The lines a run's part of the task log opens with (redacted): the attempt, when, where, in
    which box, and the command."""
    return redaction.current().redact(f"=== {marker} {store.iso(time.time())} cwd={launch.cwd} "
                                      f"box={box.label if box else None}\n$ {' '.join(launch.argv)}\n".encode())


def _send_prompt(proc: subprocess.Popen[bytes], prompt: str) -> None:
    """Write ``prompt`` to OpenCode's stdin and close it; an OpenCode already gone is no error.
    Raises RuntimeError when it was started without a stdin pipe."""
    stdin = proc.stdin
    if stdin is None:
        raise RuntimeError("OpenCode was started without a stdin pipe")
    try:
        stdin.write(prompt.encode())
    except BrokenPipeError:
        pass
    finally:
        try:
            stdin.close()
        except BrokenPipeError:
            pass


def _spool_file(folder: Any) -> tuple[int, int]:
    """(read fd, write fd) of a fresh unlinked file (in memory where the system can, else in
    ``folder``) for OpenCode's stdout. A file,
    not a pipe: Bun drops what is still queued for a pipe when `opencode run` exits, so a reader
    a little slower than a 20 MB event line lost its tail (measured: a reader pausing 5 ms per
    64 KB got 0.5 MB of 21 MB); a file keeps every byte and is read as it grows."""
    if hasattr(os, "memfd_create"):   # Linux: in memory, so a disk that fills up loses no event
        reader = os.memfd_create("opencode-stdout")
        return reader, os.open(f"/proc/self/fd/{reader}", os.O_WRONLY | os.O_APPEND)
    reader, path = tempfile.mkstemp(prefix=".opencode-", suffix=".stdout", dir=folder)
    try:
        writer = os.open(path, os.O_WRONLY | os.O_APPEND)
    finally:
        os.unlink(path)
    return reader, writer


def run_stragglers(marker: str, queue: str):
    """What else belongs to a run: processes tagged with its marker and this queue's tag."""
    return lambda: process_tree.tagged_processes({oc.MARKER_ENV: marker, oc.QUEUE_ENV: queue})


def environment_fault(run: RunResult) -> str | None:
    """The operating-system fault line (``EACCES … mkdir …``) of a run that did not finish, if
    OpenCode printed one, or the box's own refusal (``bwrap: …``: the box did not start, but for
    a start that met a file changing, ``box_start_raced``): no retry can fix either (see
    ``oc.ENV_FAULTS``)."""
    if run.stream.finished or run.killed:
        return None
    said = _box_refusal(run)
    if said and not box_start_raced(run):
        named = os_faults.from_text(said) if said.startswith(box_binds.PREFIX) else None
        return f"the agent box (bubblewrap) did not start: {named.line if named else said[:500]}"
    return None if said else oc.environment_fault(run.stderr_tail)


def _box_refusal(run: RunResult) -> str | None:
    """bubblewrap's (or box_binds.py's) last line, when the box of a run that sent no event did
    not start."""
    if run.box is None or run.box.mechanism != "bubblewrap" or run.stream.events:
        return None
    said = [line.strip() for line in run.stderr_tail if line.startswith(("bwrap: ", box_binds.PREFIX))]
    return said[-1] if said else None


# bubblewrap's words when a bind's source went between its check and the mount: a file its owner
# replaced by a rename, or removed, while the box started (a temporary file beside one it shows).
_BIND_RACE = re.compile(r"^bwrap: Can't (find source path /proc/self/fd/\d+: No such file or directory|bind mount "
                        r".*(: No such file or directory| \(deleted\)\" in mount table))$")


def box_start_raced(run: RunResult) -> str | None:
    """bubblewrap's line when the box did not start because a file it shows changed meanwhile
    (``_BIND_RACE``): the next attempt's box starts, so the attempt is retried. Else None."""
    said = _box_refusal(run)
    return said if said and _BIND_RACE.match(said) else None


def mcp_note(run: RunResult) -> str:
    """``; OpenCode waited for MCP servers that never answered: NAME (failed after N s)`` or ``""``."""
    if not run.mcp_down:
        return ""
    named = ", ".join(f"{d['server']} ({d['status'] or 'unavailable'} after {d['after_sec']} s)" for d in run.mcp_down)
    return f"; OpenCode waited for MCP servers that never answered: {named}"


def failure_reason(run: RunResult) -> str | None:
    """None when the run succeeded by its events; else the specific reason it failed."""
    stream = run.stream
    if run.paused is not None or run.asked is not None or run.limited is not None:
        return None
    if run.killed:
        signal_note = "; the process tree was sent SIGTERM, then SIGKILL after the grace period"
        return run.killed + signal_note + mcp_note(run)
    if stream.errors:
        said = "; ".join(stream.errors)
        logged = oc.logged_errors(run.stderr_tail)
        if logged and "Unexpected server error" in said:
            said += " (OpenCode's log: " + "; ".join(logged) + ")"
        fault = environment_fault(run)   # OpenCode met this machine's limit, not the model's
        named = os_faults.from_text(fault) if fault else None
        return "model error: " + said[:2000] + (f"; {named}" if named else "")
    if stream.finished:
        return None
    stderr = "\n".join(run.stderr_tail)
    if "Session not found" in stderr:
        return "Session not found: the OpenCode session to resume no longer exists"
    if run.returncode and run.returncode < 0:
        return f"opencode was killed by {signal.Signals(-run.returncode).name} before it finished"
    raced = box_start_raced(run)
    if raced:
        return (f"the agent box (bubblewrap) did not start: a file it shows was replaced or removed while it "
                f"started ({raced[:300]}); the next attempt's box starts afresh")
    fault = environment_fault(run)
    if fault:
        return (f"opencode exited with code {run.returncode}: {fault} (a fault of this machine's "
                "environment, not retried: fix it, then retry the task)")
    last = run.stderr_tail[-1].strip() if run.stderr_tail else ""
    if run.returncode:
        return f"opencode exited with code {run.returncode}" + (f": {last}" if last else "")
    if stream.events == 0:
        return "opencode exited 0 with an empty event stream (no answer)" + (f"; stderr: {last}" if last else "")
    return (f"opencode exited 0 without a terminal step_finish (last step reason: "
            f"{stream.last_reason or 'none'}); the agent did not finish")


# --------------------------------------------------------------------------------------------
# One task.


BOOKKEEPING_MIN_SEC = 60


class Phases:
    """The watcher of one attempt's phases outside the agent run (workspace preparation, receipt,
    commit, cleanup), called by `worktrees.git` while a git command runs and between steps: it
    renews the lease every WORKER_LEASE_SEC and says stop when the attempt was cancelled or
    reaped, its timeout passed, or the worker must stop at once."""

    def __init__(self, task: dict[str, Any], knobs: Knobs):
        self.task, self.knobs = task, knobs
        self.deadline = time.monotonic() + task["timeout_sec"]
        self.renewal = Renewal(task, knobs.lease_sec)
        self.superseded = self.interrupted = False
        self.agent_ran = False

    def check(self) -> str | None:
        now = time.monotonic()
        if self.renewal.due(now):
            try:   # as in a run's watch, a locked queue holds the timeout check up SHORT_LOCK_WAIT_SEC at most
                with store.lock_wait(SHORT_LOCK_WAIT_SEC):
                    renewed = self.renewal.renew()   # the database away: git goes on, the renewal is retried
                if renewed:
                    current().beat.write()
            except store.StaleAttempt as exc:
                self.superseded = True
                return str(exc)
        if current().flags.stop_now and not self.agent_ran:
            self.interrupted = True
            return "the worker was told to stop at once"
        if now > self.deadline:
            return f"timed out after {self.task['timeout_sec']} s"
        return None

    def after_run(self) -> None:
        """The receipt, commit and cleanup get what is left of the timeout, and at least
        BOOKKEEPING_MIN_SEC: an agent that finished just in time is not thrown away. A second
        SIGTERM no longer stops them: the run is over, and handing the task back would run the
        agent again; each git step stays bounded by TASKBRIDGE_GIT_TIMEOUT_SEC."""
        self.agent_ran = True
        self.deadline = max(self.deadline, time.monotonic() + BOOKKEEPING_MIN_SEC)


def run_task(task: dict[str, Any], knobs: Knobs) -> dict[str, Any] | None:
    """Run one claimed attempt to its end and record the outcome (fenced by its run marker).
    Every phase renews the lease and honours the timeout and a cancel (see Phases). Returns the
    task's final dict, or None if the attempt was superseded. Raises QueueLostMidRun when the
    queue file went away meanwhile (its run ended, its workspace named)."""
    made: list[Workspace] = []   # the attempt's workspace, once made: named if the queue file goes
    final = None
    try:
        final = _run_task(task, knobs, made)
        return final
    except store.QueueGone as exc:
        raise QueueLostMidRun(exc, made[0] if made else None) from exc
    finally:   # superseded, or ended as cancelled: a cancel's retry waits until its worktree is dealt with
        if final is None or final.get("status") == "cancelled" or final.get("wrapping_up") == task["run_marker"]:
            _end_wrap_up(task)


def _end_wrap_up(task: dict[str, Any]) -> None:
    """This worker is done with its attempt that a cancel ended (store.end_wrap_up): a retry's
    next attempt may start now (retried while the queue database is away). A queue that cannot
    say so leaves it to the reaper, once this worker is gone or silent."""
    try:
        db(store.end_wrap_up, task["id"], task["run_marker"])
    except Exception as exc:   # noqa: BLE001 - the reaper ends it once this worker is gone or silent
        log(f"{task['id']}: could not record that its cancelled attempt is wrapped up: {exc!r}", talk.VERBOSE)


def _run_task(task: dict[str, Any], knobs: Knobs, made: list[Workspace]) -> dict[str, Any] | None:
    resume = bool(task.get("answer") and task.get("session_id"))
    phases = Phases(task, knobs)
    with worktrees.watched(phases.check):
        ended, final = _earlier_work(task, phases)
        if ended:
            return final
        try:
            model = task_model(task)
        except (oc.NoDefaultModel, oc.OpencodeNotFound) as exc:
            current().talk.runs(task, None)
            log(f"{task['id']} cannot run: {exc}", talk.VERBOSE)
            return _finish(store.fail_unrunnable, task, task["run_marker"], str(exc))
        current().talk.runs(task, model)
        kept, called_off = _take_engine(task, resume, model, phases)
        if called_off:
            return _stopped_early(task, phases, called_off)
        home = None
        try:
            ws, final = _workspace(task, phases, resume, kept.folder if kept else None)
            made.extend([ws] if ws is not None else [])
            if kept is not None and ws is not None:
                kept.parked = None   # the task's worktree is there now (taken over or made anew): never dropped
            if ws is None:
                return final
            ws.home = home = _home(task)
            if kept is not None and kept.home is not None and not agent_box.adopt_home(kept.home, home):
                log(f"{task['id']}: its line of work has OpenCode folders already; runs cold")
                kept.recycle(knobs.kill_grace_sec)
                kept = None
            setup, final = _run_setup(task, ws, phases, model)
            if setup is None:
                return final
            setup.engine = kept
            _engine_learns(task, ws, model, setup)   # before the run: the next server may start during it
            run, session_note = _run_agent(task, ws, knobs, model, setup, resume, phases.deadline)
            if run.stream.session_id and setup.box.mechanism:
                _remember_session(task, run, run.stream.session_id, home)
        finally:
            if kept is not None:   # not used (the task ended before its run, or ran cold): recycled
                kept.recycle(knobs.kill_grace_sec)
            if home is not None:
                agent_box.drop_cache(home)
            _engine_next()
        phases.after_run()
        return _after_run(task, ws, run, model, setup, session_note, phases)


def _remember_session(task: dict[str, Any], run: RunResult, session: str, home: str) -> None:
    """Record where the run's OpenCode session lives (agent_box.remember_session): a follow-up,
    an answer, a fork find it there. An id recorded for another line's folders is not this run's
    (the event stream is what the box printed): the task keeps no session, and says so."""
    try:
        if agent_box.remember_session(session, home):
            return
    except (OSError, ValueError):
        return
    log(f"{task['id']}: its run named OpenCode session {session}, which belongs to another line "
        "of work; the task keeps no session (a follow-up starts a new one)")
    run.stream.session_id = None


def _home(task: dict[str, Any]) -> str:
    """OpenCode's folders for the task's runs in a box (agent_box): those of the session it
    resumes (its own, after a question; its predecessor's, for a follow-up) when they are known,
    else its own line's; a fork's copy of its origin's session is made in its own."""
    session = task.get("session_id")
    if not session and task.get("continue_from"):
        with contextlib.suppress(store.TaskNotFound):   # cleared meanwhile: a new session, in its own
            session = db(store.get_task, task["continue_from"]).get("session_id")
    return agent_box.session_home(session) or agent_box.line_home(task["id"])


@dataclass
class RunSetup:
    """What run_task prepared around the workspace before the agent runs."""
    notes: list[dict]                    # the planner's notes taken for this attempt
    snapshot: dict | None                # readonly in place: the folder's state to revert to
    config_files: dict[str, Any]         # the project's OpenCode config files (oc.project_config_files)
    box: agent_box.Support               # the box the run goes in
    env: dict[str, str]                  # the run's environment
    checkout_before: dict                # the user's checkout before the run (worktrees.checkout_state)
    engine: engine_slots.Kept | None = None   # the slot's kept server, when the task may run on it


def _earlier_work(task: dict[str, Any], phases: Phases) -> tuple[bool, dict[str, Any] | None]:
    """(True, the task's final dict) when an earlier attempt's work decides this one: its commit
    landed after the reaper looked, or its unpushed commit is pushed again (the agent is not run);
    (False, None) to run the agent."""
    marker = task["run_marker"]
    earlier = _reaped_attempt(task)   # its git commit may have landed after the reaper looked
    if earlier and (recorded := _recorded_from_commit(task, earlier)) is not None:
        current().talk.runs(task, None)
        return True, recorded
    if not worktrees.holds_unpushed_work(task):
        return False, None
    try:
        kept = worktrees.unpushed_workspace(task)
    except worktrees.GitStopped as exc:
        return True, _stopped_early(task, phases, f"fetching the remote: {exc}")
    except worktrees.Unreachable as exc:
        log(f"{task['id']} cannot reach its remote: {exc}", talk.VERBOSE)
        return True, _finish(store.fail_attempt, task, marker, str(exc))
    except (worktrees.Unrunnable, worktrees.GitError) as exc:
        return True, _cannot_run(task, exc)
    if kept is None:
        return False, None
    current().talk.runs(task, None)
    return True, _push_kept_work(task, kept)


def _workspace(task: dict[str, Any], phases: Phases, resume: bool,
               folder: Path | None = None) -> tuple[Workspace | None, dict | None]:
    """(the attempt's workspace, None), its place recorded on the lease; or (None, the task's final
    dict) when it could not be had. ``folder``: where a new worktree goes instead of the worktree
    root (a kept server's folder)."""
    marker = task["run_marker"]
    try:
        ws = worktrees.prepare_workspace(task, resume, folder)
        if ws.leftover:
            log(f"{task['id']}: {worktrees.leftover_words(ws)}")
        db(store.renew_lease, task["id"], marker, worktree_path=ws.top if ws.mode == "worktree" else None,
           branch=ws.branch, base_commit=ws.base_commit, line_base=ws.line_base)
    except worktrees.GitStopped as exc:
        return None, _stopped_early(task, phases, f"preparing the workspace: {exc}")
    except store.StaleAttempt as exc:   # cancelled or reaped after the last check, before the place was recorded
        phases.superseded = True
        return None, _stopped_early(task, phases, f"preparing the workspace: {exc}", ws)
    except worktrees.Unreachable as exc:   # the remote may answer next time: retried
        log(f"{task['id']} cannot reach its remote: {exc}", talk.VERBOSE)
        return None, _finish(store.fail_attempt, task, marker, str(exc))
    except (worktrees.Unrunnable, worktrees.GitError) as exc:
        return None, _cannot_run(task, exc)
    return ws, None


def _run_setup(task: dict[str, Any], ws: Workspace, phases: Phases,
               model: str) -> tuple[RunSetup | None, dict | None]:
    """(the notes, snapshot, box and environment of the run, None); or (None, the task's final
    dict) when the run cannot be set up (a bad OpenCode config, no box where one is required)."""
    try:
        notes = db(store.take_notes, task["id"], task["run_marker"])
        readonly_in_place = task["permission"] == "readonly" and ws.mode == "in-place"
        snapshot = worktrees.take_snapshot(ws.cwd) if readonly_in_place else None
        config_files = oc.project_config_files(ws.cwd, ws.top or ws.cwd)
        try:
            box, env = _box_and_env(task, ws, model, config_files)
        except (oc.ConfigProblem, agent_box.BoxUnavailable, agent_box.BoxSettingError) as exc:
            oc.undo_housekeeping(config_files)
            if not task["worktree_keep"]:
                worktrees.remove_worktree(ws)
            log(f"{task['id']} cannot run: {exc}", talk.VERBOSE)
            final = _finish(store.fail_unrunnable, task, task["run_marker"], str(exc))
            _drop_branch_of_ended(task, ws, final)
            return None, final
        checkout_before = worktrees.checkout_state(ws.repo) if ws.mode == "worktree" and not ws.remote else {}
    except worktrees.GitStopped as exc:
        return None, _stopped_early(task, phases, f"preparing the workspace: {exc}", ws)
    return RunSetup(notes, snapshot, config_files, box, env, checkout_before), None


def _box_and_env(task: dict[str, Any], ws: Workspace, model: str,
                 config_files: dict[str, Any]) -> tuple[agent_box.Support, dict[str, str]]:
    """The run's box and environment. Raises oc.ConfigProblem, agent_box.BoxUnavailable,
    agent_box.BoxSettingError (a folder that cannot be made is named)."""
    box = agent_box.choose(task["permission"])
    base = agent_box.agent_env(dict(os.environ), model, [*agent_box.config_texts(dict(os.environ)),
                                                   *config_files.values()])
    env = _boxed_run_env(task, ws, base, box)
    if box.mechanism:
        agent_box.opencode_dirs(env, ws.home)
        _guard_only_box_writable(task, ws, env)
    return box, env


def _after_run(task: dict[str, Any], ws: Workspace, run: RunResult, model: str, setup: RunSetup,
               session_note: str, phases: Phases) -> dict[str, Any] | None:
    """Undo what the run planted in git's configuration, then record the outcome (_conclude); a
    failure of ours after a successful run fails the task without running the agent again."""
    marker, config_files = task["run_marker"], setup.config_files
    try:   # before any further git command: what the run planted in git's configuration is undone
        if worktrees.undo_planted_git(ws):
            log(f"{task['id']}: undid git configuration the run planted: "
                + "; ".join(f"{p['file']} {p['change']}" for p in ws.git_planted or []))
    except worktrees.GitPlanted as exc:
        log(f"{task['id']} stopped before any further git command: {exc}")
        return _finish(store.fail_unrunnable, task, marker, str(exc))
    try:
        repo_config = {"files": [os.path.relpath(p, ws.cwd) for p in config_files],
                       "restrictions": oc.repo_restrictions(config_files, ws.cwd),
                       "housekeeping_undone": [os.path.relpath(p, ws.cwd)
                                               for p in oc.undo_housekeeping(config_files)]}
        return _conclude(task, ws, run, model, setup, session_note, repo_config, phases)
    except Exception as exc:  # noqa: BLE001 - a finished agent run is never run again for our fault
        if run.superseded or run.interrupted or failure_reason(run) is not None or db_outage(exc):
            raise
        if os_faults.describe(exc) is None:   # a bug of ours: its traceback is for us, in the worker log
            log(f"{task['id']}: internal error after a successful run: {traceback.format_exc()}")
        return _bookkeeping_failed(task, ws, run, Receipt(summary=run.stream.final_text[-2000:]), None,
                                   "recording the result", exc, phases)


def _cannot_run(task: dict, exc: BaseException) -> dict | None:
    """Fail an attempt whose workspace could not be had (``exc``: Unrunnable or GitError): an OS
    fault behind it is named by ``os_faults`` and retried only when a retry can help; anything
    else is the repository's fault and is not retried."""
    fault = os_faults.describe(exc)
    log(f"{task['id']} cannot run: {fault or exc}", talk.VERBOSE)
    if fault is not None and fault.retry:
        return _finish(store.fail_attempt, task, task["run_marker"], fault.line)
    return _finish(store.fail_unrunnable, task, task["run_marker"], str(fault or exc))


def task_model(task: dict[str, Any], say: bool = True) -> str:
    """The task's own model, else the default (``opencode_runner.default_model``: the queue's
    setting, WORKER_MODEL, the user's OpenCode config as seen from the task's folder, the first
    usable listed model), said in the log when ``say``. Raises oc.NoDefaultModel /
    oc.OpencodeNotFound."""
    if task["model"]:
        return task["model"]
    cwd = task["working_dir"] if os.path.isdir(task["working_dir"]) else None
    choice = oc.default_model(db(store.default_model), cwd, cache_file=store.state_path("models.json"))
    if say:
        log(f"{task['id']} runs with {choice.model} (default from {choice.source})", talk.VERBOSE)
    return choice.model


def _stopped_early(task: dict, phases: Phases, message: str, ws: Workspace | None = None) -> dict | None:
    """A phase before the agent ran was ended: cancelled or reaped (nothing to write), the
    worker stopping at once (handed back), or the timeout or a hung git step (a failed attempt,
    named)."""
    log(f"{task['id']} attempt {task['run_marker']} ended {message}")
    if phases.superseded:
        if ws is not None:
            _cleanup_superseded(task, ws)
        return None
    if phases.interrupted:
        return _finish(store.requeue_attempt, task, task["run_marker"],
                       f"{current().flags.stop_reason()} while preparing; handed back", count_attempt=False)
    return _finish(store.fail_attempt, task, task["run_marker"], message)


def _run_agent(task: dict, ws: Workspace, knobs: Knobs, model: str, setup: RunSetup, resume: bool,
               deadline: float | None = None) -> tuple[RunResult, str]:
    """Resume the waiting session with the answer when it can; otherwise a new session whose
    prompt carries the instructions (and, after a lost session, every question and answer).
    ``setup``: the attempt's notes, box and environment (_run_setup)."""
    notes, box = setup.notes, setup.box
    if resume and ws.reused:
        run = _attempt(task, ws, knobs, model, setup, resume_message(task["answer"], notes, task.get("pending_ask")),
                       task["session_id"], deadline)
        if not (run.stream.events == 0 and "Session not found" in "\n".join(run.stderr_tail)):
            return run, f"resumed OpenCode session {task['session_id']}"
        lost = "the earlier OpenCode session was gone"
    else:
        lost = "the earlier worktree was gone"
    if not resume and (task.get("continue_from") or task.get("fork_from")):
        return _run_line(task, ws, knobs, model, setup, deadline)
    if not resume:
        return (_attempt(task, ws, knobs, model, setup, build_prompt(task, ws, notes, [], box=box), None, deadline),
                "new session")
    current = db(store.get_task, task["id"])
    prompt = build_prompt(task, ws, current["notes"], current["questions"], box=box)
    return (_attempt(task, ws, knobs, model, setup, prompt, None, deadline),
            f"{lost}; a new session got the history in its prompt")


def _run_line(task: dict, ws: Workspace, knobs: Knobs, model: str, setup: RunSetup,
              deadline: float | None) -> tuple[RunResult, str]:
    """A follow-up resumes the OpenCode session of the task it continues; a fork resumes a copy
    of it made for its own worktree. Both get the brief as the next message; a session that is
    gone (or cannot be copied) gives way to a new session with the brief."""
    parent = db(store.get_task, task["continue_from"] or task["fork_from"])
    prompt = build_prompt(task, ws, setup.notes, [], parent, setup.box)
    session, how = task.get("session_id"), f"resumed this task's OpenCode session {task.get('session_id')}"
    if not session and not parent.get("session_id"):
        how = f"{parent['id']} left no OpenCode session; a new session got the brief"
    elif not session and task.get("continue_from"):
        session, how = parent["session_id"], f"continued {parent['id']}'s OpenCode session {parent['session_id']}"
    elif not session:
        probe = fresh_run_folder(task["id"], f".copy-{secrets.token_hex(3)}")
        # In the task's box: the session is exported from its line's home and imported into the
        # fork's, folders only a box reads.
        origin = replace(ws, home=agent_box.session_home(parent["session_id"]) or agent_box.line_home(parent["id"]))
        try:
            session = oc.copy_session(parent["session_id"], parent.get("worktree_path") or parent["working_dir"],
                                      ws.top or ws.cwd, setup.env, box=lambda argv, env: _boxed(
                                          task, ws, setup.box, probe, argv, env), scratch=str(probe / "control"),
                                      source_box=lambda argv, env: _boxed(task, origin, setup.box, probe, argv, env),
                                      until=_ended_by(parent))
            how = f"a copy ({session}) of {parent['id']}'s OpenCode session {parent['session_id']} (fork)"
        except (oc.SessionCopyFailed, subprocess.TimeoutExpired, OSError) as exc:
            how = f"{parent['id']}'s session could not be copied ({exc}); a new session got the brief"
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    if session:
        # An earlier attempt of this task wrote its turns in this session (its own, or the line's it
        # continues; a fork's fresh copy has none of them): what became of its work.
        wrote = task["attempts"] > 1 and (task.get("session_id") or task.get("continue_from"))
        told = f"{earlier_attempt_note(ws)}\n\n{prompt}" if wrote else prompt
        run = _attempt(task, ws, knobs, model, setup, told, session, deadline)
        if not (run.stream.events == 0 and "Session not found" in "\n".join(run.stderr_tail)):
            return run, how
        how = f"the OpenCode session {session} was gone; a new session got the brief"
    return _attempt(task, ws, knobs, model, setup, prompt, None, deadline), how


def earlier_attempt_note(ws: Workspace) -> str:
    """What a line task's next attempt, resuming the session its earlier attempt wrote in, is told
    of that attempt's work: gone when the worktree was made again from the branch (a failed
    attempt's folder is removed), still there, uncommitted, when the folder was kept. (How that
    attempt ended is in the task's log; the claim cleared its error.)"""
    left = (f"its uncommitted changes are still in the worktree (git status in {ws.top or ws.cwd} shows them)"
            if ws.reused else f"its changes are gone: the worktree holds only what is committed on {ws.branch}")
    return (f"Note from TaskBridge: your earlier attempt at this step ended before its work was kept; "
            f"{left}. Check the files before you rely on anything that attempt did, then do the task below.")


def _ended_by(task: dict[str, Any]) -> float | None:
    """A finished task's end as epoch seconds, rounded up (the store's times are whole seconds):
    a fork's copy of its session keeps what OpenCode wrote until then. None while it is not
    finished."""
    if task["status"] not in store.TERMINAL or not task.get("finished_at"):
        return None
    return datetime.fromisoformat(task["finished_at"]).timestamp() + 1


def _attempt(task: dict, ws: Workspace, knobs: Knobs, model: str, setup: RunSetup, prompt: str,
             session_id: str | None, deadline: float | None = None) -> RunResult:
    if setup.engine is not None:
        run = _engine_attempt(task, ws, knobs, model, setup, prompt, session_id, deadline)
        if run is not None:
            return run
    box = setup.box
    argv = oc.run_command(model, task["run_marker"], session_id=session_id, agent=task.get("agent"))
    log(f"{task['id']} attempt {task['attempts']}: opencode run in {ws.cwd} ({ws.mode}; box: {box.label})",
        talk.VERBOSE)
    run_dir = fresh_run_folder(task["id"])
    try:
        files = _run_files(task, setup.env, model, run_dir / "control")
        boxed, env = _boxed(task, ws, box, run_dir, argv, files.env)
        launch = Launch(argv, env, ws.cwd, prompt, boxed, rules_file=files.rules, retry_file=files.retry,
                        meanwhile=_engine_meanwhile(task))
        return Supervisor(task, launch, knobs, box, meter=Meter(task, files.gate),
                          courier=Courier(task, files.notes), deadline_at=deadline).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class RunFiles:
    """A run's environment with TaskBridge's plugins loaded, and the control files they read
    (in the run folder's ``control/``): the spend gate's (None without a spending limit), the
    notes', the retry watch's, the permission rules' (None without rules)."""
    env: dict[str, str]
    gate: str | None
    notes: str
    retry: str
    rules: str | None


def _run_files(task: dict, env: dict[str, str], model: str, control: Path, quiet: bool = False) -> RunFiles:
    """``env`` (the run's, from _box_and_env) with the plugins and the reverse bridge a run of
    ``task`` on ``model`` gets, their files in ``control`` (the rules file written). A reverse
    bridge that cannot start is said under the task's id, unless ``quiet`` (a kept server made
    for a task like it: the run itself says it). Raises oc.ConfigProblem."""
    gate = str(control / "gate") if spend_limited(task) else None
    if gate:
        env = oc.with_spend_gate(env, gate)
    notes = str(control / "notes")
    env = oc.with_notes_courier(env, notes)

    def say(line: str) -> None:
        log(f"{task['id']}: {line}")

    env = reverse_bridge.reverse_bridge_env(env, model, say=None if quiet else say)
    retry = str(control / "retry")
    env = oc.with_retry_watch(env, retry)
    rules = write_rules_file(task, control)
    if rules:
        env = oc.with_permission_rules(env, rules)
    return RunFiles(env, gate, notes, retry, rules)


# --------------------------------------------------------------------------------------------
# The warm engine (WORKER_ENGINE=1): a kept `opencode serve` per slot (engine_slots.py), driven by
# engine_client.py, which the Supervisor runs in place of `opencode run`.

ENGINE_CLIENT = Path(__file__).resolve().parent / "engine_client.py"
ENGINE_WAIT_SEC = 20.0   # how long a claimed task waits for its slot's server to finish starting (at most half
#                          of what is left of its timeout: _take_engine)
# How long a run goes on before the slot's next kept server starts beside it, so that a queue with
# more tasks waiting finds it ready (a server starts in 2-9 s here); a run shorter than this (a
# small task takes ~0.7 s warm) has the machine to itself, and the next server starts at its end.
ENGINE_NEXT_AFTER_SEC = 5.0


def _slot() -> str:
    """The slot this thread is (the pool's thread name, ``slot_0``...)."""
    return threading.current_thread().name


def _engine_kind(task: dict[str, Any]) -> bool:
    """Whether tasks like ``task`` run on kept servers: worktree tasks on a local repository that
    start a line of work (a follow-up or a fork runs where its session is)."""
    return bool(task["worktree"] and not task.get("repo") and not task.get("continue_from")
                and not task.get("fork_from"))


def _engine_eligible(task: dict[str, Any], resume: bool) -> bool:
    """Whether ``task`` may run on a kept server now: of that kind (_engine_kind), and its first
    worktree (a resumed session, or a retry, runs where its worktree already is)."""
    return _engine_kind(task) and not resume and not task.get("worktree_path") and not task.get("session_id")


def _shape(task: dict[str, Any], model: str, repo: str | None) -> tuple:
    """What a kept server must have been made for to run ``task`` (checked before its workspace
    is made; the whole run environment is compared after, engine_slots.Kept.fits)."""
    return (repo, model, task["permission"], task.get("agent"), bool(task.get("rules")), spend_limited(task))


def _take_engine(task: dict[str, Any], resume: bool, model: str,
                 phases: Phases) -> tuple[engine_slots.Kept | None, str | None]:
    """(the slot's kept server for ``task``, None) when the engine is on, the task is eligible and
    the server was made for a task like it (else it is recycled and the task runs cold at once).
    The wait for a server still starting keeps the lease, lasts ENGINE_WAIT_SEC and half of what
    is left of the timeout at most (then the task runs cold), and ends at a stop; at a cancel, a reap,
    the timeout or a stop-now (``phases``) it ends too and returns (None, the attempt's ending:
    the reason, or the failure of the worktree's park it ended, naming its git step)."""
    slots = current().engines
    if slots is None or not _engine_eligible(task, resume):
        return None, None
    try:
        repo = worktrees.repo_top(task["working_dir"]) if os.path.isdir(task["working_dir"]) else None
    except (worktrees.Unrunnable, worktrees.GitError):
        repo = None   # the workspace's own step says what is wrong with the folder
    called_off: list[str] = []

    def stopping() -> str | None:
        if not called_off and (reason := phases.check()):
            called_off.append(reason)
        if called_off:
            return called_off[0]
        return "the worker is stopping" if current().flags.stopping else None

    # A short timeout is not spent waiting: past half of what is left the task runs cold, as it
    # would without the engine (its run, its receipt), rather than time out before it starts.
    wait = min(ENGINE_WAIT_SEC, max(0.0, (phases.deadline - time.monotonic()) / 2))
    kept, why = slots.take(_slot(), wait, _shape(task, model, repo), stopping)
    if kept is not None and called_off:   # ready as the attempt ended: not used
        kept.recycle(0)
        kept, why = None, called_off[0]
    if kept is None:
        log(f"{task['id']}: no kept OpenCode server for {_slot()} ({why or 'none was made yet'})"
            + ("" if called_off else "; runs cold"), talk.VERBOSE if called_off else talk.NORMAL)
    if not called_off:
        return kept, None
    return kept, (why if why != called_off[0] else f"while it waited for its kept server: {why}")


def _engine_learns(task: dict[str, Any], ws: Workspace, model: str, setup: RunSetup) -> None:
    """The slot's next server is made for a task like this one (its repository, model, preset)."""
    slots = current().engines
    if slots is not None and ws.mode == "worktree" and ws.repo and _engine_kind(task):
        slots.last[_slot()] = Prediction(task, ws.repo, model, dict(setup.config_files))


def _engine_wanted(slots: engine_slots.Slots) -> bool:
    """Whether the slot's next server is worth starting: never while the worker is stopping;
    always in ``--watch``; in a one-pass only while tasks are pending (it ends when none is left),
    as one read that rides no outage: a run's watch calls this, and its timeout, cancel and
    watchdogs must not wait on the queue. A queue that cannot be read now says no. Never raises."""
    if current().flags.stopping:
        return False
    if slots.watch:
        return True
    try:
        return bool(db(store.list_tasks, status="pending", limit=1, patience=0)["total"])
    except Exception as exc:  # noqa: BLE001 - no next server is all a queue away costs here
        log(f"{_slot()}'s next kept OpenCode server waits: the queue cannot be read now ({exc})", talk.VERBOSE)
        return False


def _engine_next() -> None:
    """Start the slot's next server in the background (the engine on, a task to predict from,
    ``_engine_wanted``); one built beside the run is started now."""
    slots = current().engines
    if slots is not None and _engine_wanted(slots):
        problem = slots.prepare(_slot())
        if problem:
            log(problem, talk.VERBOSE)


def _engine_meanwhile(task: dict[str, Any]) -> Callable[[], bool] | None:
    """What a run of ``task`` does once it has gone on for ENGINE_NEXT_AFTER_SEC (Launch.meanwhile,
    called each round of the watch until it returns True): the slot's next kept server is built
    beside it in a thread of its own (engine_slots.Slots.make_ahead: for a restricted preset that
    takes ~1.5 s, which the watch must not spend), then started from the slot's own thread, which
    outlives that server (engine.Engine.launch). None when the engine is off. A queue it cannot
    read now is said, and the server then starts after the run as before."""
    slots = current().engines
    if slots is None:
        return None
    asked = False

    def step() -> bool:
        nonlocal asked
        if current().flags.stopping:   # finishing what is in hand: no task will take it
            return True
        try:
            if asked:
                done, problem = slots.launch_made(_slot())
                if problem:
                    log(problem, talk.VERBOSE)
                return done
            asked = True
            if not _engine_wanted(slots) or slots.has(_slot()):
                return True
            log(f"{task['id']} has run {ENGINE_NEXT_AFTER_SEC:g} s: {_slot()}'s next kept OpenCode server "
                "starts beside it", talk.VERBOSE)
            slots.make_ahead(_slot())
            return False
        except Exception as exc:  # noqa: BLE001 - the run goes on; the slot's next server starts after it
            log(f"{task['id']}: {_slot()}'s next kept OpenCode server waits for the run's end ({exc})", talk.VERBOSE)
            return True
    return step


@dataclass
class Prediction:
    """What a slot's next server is made for: a task like ``task`` in the checkout ``repo``."""
    task: dict[str, Any]
    repo: str
    model: str
    config_files: dict[str, Any]


def predict_from_queue() -> Prediction | None:
    """The task a pass's first servers are made for: the pending task a claim takes first
    (highest priority, then oldest), else the newest task; None when it runs cold anyway."""
    pending = store.list_tasks(status="pending", limit=500)["tasks"]
    def claim_order(task: dict[str, Any]) -> tuple:
        return -task["priority"], task["created_at"], store.parse_task_id(task["id"])

    page = [min(pending, key=claim_order)] if pending else store.list_tasks(limit=1)["tasks"]
    if not page:
        return None
    task = store.get_task(page[0]["id"])
    if not _engine_kind(task) or not os.path.isdir(task["working_dir"]):
        return None
    repo = worktrees.repo_top(task["working_dir"])
    if not repo:
        return None
    return Prediction(task, repo, task_model(task, say=False), oc.project_config_files(repo, repo))


def make_kept(slot: str, prediction: Prediction | None) -> engine_slots.Kept | None:
    """A slot's next server (not started), made for ``prediction``: its folder under the worktree
    root, its run folder beside the task logs, its environment and box computed as a run of the
    predicted task would get them (_box_and_env, _run_files, _boxed) with the slot's marker.
    Raises what those raise (oc.ConfigProblem, agent_box.BoxUnavailable, OSError)."""
    if prediction is None:
        return None
    token = secrets.token_hex(4)
    folder = worktrees.worktree_root() / "engine" / f"{slot}-{token}"
    engine_slots.make_folder(folder, store.queue_tag())   # its owner recorded: the root may be shared (sweep)
    run_dir = run_folder(store.log_dir() / f"engine-{slot}-{token}.run")
    marker = engine_slots.new_marker(slot)
    like = {**prediction.task, "run_marker": marker}
    home = agent_box.slot_home(f"{store.queue_tag()}-{slot}-{token}")
    ws = Workspace("worktree", str(folder), top=str(folder), repo=prediction.repo, home=home)
    try:
        box, env = _box_and_env(like, ws, prediction.model, prediction.config_files)
        files = _run_files(like, env, prediction.model, run_dir / "control", quiet=True)
        plan = agent_box.slot_plan(str(folder), prediction.repo, files.env, like["permission"], run_dir, home)
    except BaseException:   # no server: its folders go at once, not at the next pass's sweep
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
        worktrees.drop_engine_folder(folder)
        raise

    def boxed(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        return _boxed(like, ws, box, run_dir, argv, env, plan)

    shape = _shape(like, prediction.model, prediction.repo)
    sub = os.path.relpath(prediction.task["working_dir"], prediction.repo)

    def warm(kept: engine_slots.Kept) -> None:   # in the server's start thread (engine_slots)
        kept.parked = worktrees.parked_path(folder, prediction.repo)   # named first: a recycle meanwhile drops it
        if kept.recycled:
            return
        worktrees.park_worktree(prediction.repo, folder)
        kept.engine.warm_up(os.path.normpath(kept.parked / sub), run_dir / "control" / "warm-up.json",
                            prediction.model, like.get("agent"))
        kept.warmed = True

    kept = engine_slots.Kept(folder, run_dir, prediction.repo, files.env, boxed, shape, warm=warm)
    kept.home = home if box.mechanism else None
    return kept


def _engine_attempt(task: dict, ws: Workspace, knobs: Knobs, model: str, setup: RunSetup, prompt: str,
                    session_id: str | None, deadline: float | None) -> RunResult | None:
    """The attempt on the slot's kept server (engine_client.py in place of `opencode run`, under
    the same Supervisor), which is then recycled, what the agent left running named in the
    result; None when the task does not fit the server (it runs cold; the server is recycled)."""
    kept, setup.engine = setup.engine, None
    assert kept is not None
    files = _run_files(task, setup.env, model, kept.run_dir / "control")
    admin = agent_box.git_dirs(ws.top)[1] if ws.top else None
    if (session_id or ws.mode != "worktree" or ws.repo != kept.repo or admin is None
            or Path(ws.root()).parent != kept.folder or not kept.fits(files.env)):
        log(f"{task['id']}: its run differs from what {_slot()}'s kept server was made for; runs cold")
        kept.recycle(knobs.kill_grace_sec)
        return None
    if (kept.run_dir / "git").is_dir():   # the bash tool's git index (agent_box.slot_plan)
        shutil.copyfile(Path(admin) / "index", kept.run_dir / "git" / "index")
    eng = kept.engine
    if kept.warmed and not ws.parked:   # made anew where the opened one was: the server reads it afresh
        with contextlib.suppress(engine.EngineError):
            eng.release(ws.cwd)
    argv = [agent_box.stdlib_python(), str(ENGINE_CLIENT), "--port", str(eng.port), "--directory", ws.cwd,
            "--title", task["run_marker"], "--model", model, "--server-log", str(eng.log_path),
            "--notes", files.notes, "--notes-ack", oc.reply_path(files.notes, ".ack")]
    if task.get("agent"):
        argv += ["--agent", task["agent"]]
    env = {name: os.environ[name] for name in ("PATH", "LANG", "LC_ALL") if name in os.environ}
    env.update({"OPENCODE_SERVER_PASSWORD": eng.password, oc.MARKER_ENV: task["run_marker"],
                oc.QUEUE_ENV: store.queue_tag()})
    log(f"{task['id']} attempt {task['attempts']}: kept OpenCode server of {_slot()} in {ws.cwd}, "
        f"{'parked and opened before the claim' if ws.parked else 'made after the claim'} "
        f"(box: {setup.box.label})", talk.VERBOSE)
    launch = Launch(argv, env, ws.cwd, prompt, rules_file=files.rules, retry_file=files.retry,
                    server=kept, meanwhile=_engine_meanwhile(task))
    try:
        run = Supervisor(task, launch, knobs, setup.box, meter=Meter(task, files.gate),
                         courier=Courier(task, files.notes), deadline_at=deadline).run()
    finally:
        left = kept.recycle(knobs.kill_grace_sec)
    known = {item["pid"] for item in run.ended}
    run.ended += [item for item in left if item["pid"] not in known]
    if run.returncode == engine_client.ENGINE_GONE and not run.killed and not run.stream.finished:
        said = [line for line in run.stderr_tail if "the OpenCode engine" in line]
        run.engine_gone = said[-1].strip() if said else "the kept OpenCode server ended mid-run"
    return run


def _guard_only_box_writable(task: dict, ws: Workspace, env: dict[str, str]) -> None:
    """The git guard checks, of the files that configure TaskBridge's git, those the box lets the
    run write (the worktree's own, its admin folder's): a change to any other (your ~/.gitconfig,
    the repository's config) cannot come from the run, and is yours to keep."""
    if ws.git_pin:
        plan = agent_box.plan_for(ws, env, task["permission"], store.log_path(task["id"]).with_suffix(".run"))
        ws.git_pin = {path: state for path, state in ws.git_pin.items() if plan.lets_write(path)}


def _boxed_run_env(task: dict, ws: Workspace, base: dict[str, str], box: agent_box.Support) -> dict[str, str]:
    """``oc.run_env`` for the attempt, its ``opencode debug config`` (a restricted task's) run in
    the task's box: the worktree's OpenCode plugins load there, and the agent wrote them."""
    probe = fresh_run_folder(task["id"], f".probe-{secrets.token_hex(3)}")   # a kept server's may run beside
    try:
        return oc.run_env(base, ws.cwd, task["run_marker"], store.queue_tag(), task["permission"],
                          task.get("agent"), box=lambda argv, env: _boxed(task, ws, box, probe, argv, env))
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _boxed(task: dict, ws: Workspace, box: agent_box.Support, run_dir: Path, argv: list[str],
           env: dict[str, str], plan: agent_box.Plan | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a run inside ``box`` (the shape of ``oc.run_env``'s ``box`` hook): a private
    temp folder (the box's /tmp) and the box's ``$SHELL`` (agent_box.box_shell). ``plan``: the
    box's layout (default: ``agent_box.plan_for`` the attempt in ``ws``)."""
    if box.mechanism is None:
        return argv, {**env, "TMPDIR": str(run_dir / "tmp")}
    env = {**env, "TMPDIR": "/tmp"}
    plan = plan or agent_box.plan_for(ws, env, task["permission"], run_dir)
    env["SHELL"] = agent_box.box_shell(run_dir / "control" / "shell", plan, task["permission"], box.mechanism)
    return agent_box.wrap(box.mechanism, plan, argv), env


def _conclude(task: dict, ws: Workspace, run: RunResult, model: str, setup: RunSetup,
              session_note: str, repo_config: dict[str, Any], phases: Phases) -> dict[str, Any] | None:
    marker = task["run_marker"]
    if run.killed:   # the log ends where the run was cut: it says why, as the reaper's line does
        with contextlib.suppress(Exception):
            ended = f"\n[worker] the run was ended: {redaction.redact(run.killed)}\n"
            store.append_task_log(task["id"], ended.encode())
    if run.superseded:
        log(f"{task['id']} attempt {marker} ended: {run.killed}", talk.VERBOSE)
        _observe_cancelled(task, ws, run, model, setup, session_note, repo_config)
        _cleanup_superseded(task, ws)
        return None
    reason = failure_reason(run)
    block = oc.parse_closing_block(run.stream.final_text)
    receipt, diff, problem = _observed_receipt(task, ws, run, model, block, setup, session_note, repo_config)
    usage = run.stream.usage()
    if phases.superseded:
        _record_cancelled(task, run, receipt, diff, problem)
        _cleanup_superseded(task, ws)
        return None
    if problem is not None and reason is None and not run.interrupted:
        return _bookkeeping_failed(task, ws, run, receipt, None, "building the receipt (git diff)", problem, phases)
    if problem is not None:
        receipt.diff_error = str(problem)
    # A hand-back (the worker stopping at once, the kept server gone) records no receipt or diff:
    # its worktree stays as the run left it, as a killed worker's does, and the next attempt moves
    # it aside whole before making it anew (worktrees.set_aside); the branch keeps any commit.
    handed_back = run.interrupted or run.engine_gone is not None
    if not task["worktree_keep"] and reason is not None and not handed_back:
        _remove(ws, receipt)
    if run.interrupted:
        return _finish(store.requeue_attempt, task, marker, f"{current().flags.stop_reason()}; handed back",
                       count_attempt=False, usage=usage)
    if run.engine_gone is not None:   # not the task's fault; its next attempt runs cold (its worktree is recorded)
        log(f"{task['id']}: {run.engine_gone}; handed back once, for a cold attempt")
        return _finish(store.requeue_attempt, task, marker, f"{run.engine_gone}; handed back for another attempt",
                       count_attempt=False, usage=usage)
    if run.limited is not None:
        return _pause_at_limit(task, run, model, receipt, usage, phases.knobs)
    if run.paused is not None:
        question = limit_question(task, run)
        notify(f"TaskBridge {task['id']} paused at its spending limit", question[:200])
        return _finish(store.pause_for_question, task, marker, question, session_id=run.stream.session_id,
                       result=receipt, usage=usage, paused_for=run.paused["kind"])
    if run.asked is not None:
        question = permission_question(run.asked)
        notify(f"TaskBridge {task['id']} asks permission", question[:200])
        return _finish(store.pause_for_question, task, marker, question, session_id=run.stream.session_id,
                       result=receipt, usage=usage, paused_for="permission", ask=run.asked)
    if reason is None and block["kind"] == "question":
        notify(f"TaskBridge {task['id']} asks", block["question"][:200])
        question = store.clip(block["question"], QUESTION_MAX, receipt_mod.whole_text_at(task, run))
        return _finish(store.pause_for_question, task, marker, question,
                       session_id=run.stream.session_id, result=receipt, usage=usage)
    if reason is None:
        return _commit_and_finish(task, ws, run, receipt, diff, phases)
    final = _failed(task, run, model, reason, receipt, diff, usage)
    _drop_branch_of_ended(task, ws, final)
    return final


def _observe_cancelled(task: dict, ws: Workspace, run: RunResult, model: str, setup: RunSetup,
                       session_note: str, repo_config: dict[str, Any]) -> None:
    """When a cancel ended the run, it is observed as any run's end (a readonly run's changes
    reverted, which in place without a box is what keeps the folder as it was) and its receipt
    kept (_record_cancelled). Not for a reaped or taken-over attempt: its next attempt may be in
    the same place already. A failure here is logged, never raised: the cleanup after it runs."""
    now = _ended_as_written(task["id"], task["run_marker"])
    if now is None or (now["status"] != "cancelled" and now.get("wrapping_up") != task["run_marker"]):
        return   # reaped, or retried and started anew (a retry waits for this wrap-up: see end_wrap_up)
    try:
        block = oc.parse_closing_block(run.stream.final_text)
        with worktrees.watched(None):   # the attempt is over: only git's own time limit applies
            observed = _observed_receipt(task, ws, run, model, block, setup, session_note, repo_config)
        _record_cancelled(task, run, *observed)
    except Exception as exc:   # noqa: BLE001 - its worktree and branch are cleaned up whatever failed here
        log(f"{task['id']}: the cancelled run's receipt was not recorded: {exc!r}")


def _record_cancelled(task: dict, run: RunResult, receipt: Receipt, diff: str | None,
                      problem: Exception | None) -> None:
    """Record what a run that a cancel ended had done (``_observed_receipt``'s receipt, diff and
    git failure, named as ``diff_error``) on the cancelled task before its worktree goes
    (store.record_cancelled_receipt, fenced: nothing is written for a reaped or taken-over
    attempt; redacted as every receipt, by _finish)."""
    if problem is not None:
        receipt.diff_error = str(problem)
    _finish(store.record_cancelled_receipt, task, task["run_marker"], result=receipt, diff=diff,
            session_id=run.stream.session_id)


UNCOMMITTED_SHOWN = 200   # paths of the person's uncommitted work a receipt names (in place)


def _observed_receipt(task: dict, ws: Workspace, run: RunResult, model: str, block: dict, setup: RunSetup,
                      session_note: str, repo_config: dict[str, Any]) -> tuple[Receipt, str | None, Exception | None]:
    """(the receipt, the diff, the git failure that kept the diff from being read, or None): the
    readonly revert (``setup.snapshot``), git's view of the changes and of your checkout (against
    ``setup.checkout_before``), the project's config."""
    snapshot, checkout_before = setup.snapshot, setup.checkout_before
    reverted, files, diff, problem = _observe(task, ws, snapshot)
    receipt = build_receipt(task, ws, run, model, block, files, reverted[0], session_note)
    if reverted[1]:
        receipt.not_reverted = reverted[1]
        receipt.sandbox["shell writes"] = (f"{len(reverted[1])} change(s) could not be reverted, listed in "
                                           "not_reverted; the rest were")
    receipt.changed_outside_worktree = worktrees.changed_outside(checkout_before, ws.repo) \
        if ws.mode == "worktree" and not ws.remote and problem is None else []
    if ws.uncommitted_before:   # at most UNCOMMITTED_SHOWN paths, then how many more
        more = len(ws.uncommitted_before) - UNCOMMITTED_SHOWN
        receipt.uncommitted_before = ws.uncommitted_before[:UNCOMMITTED_SHOWN] + (
            [f"… and {more:,} more (git status in {ws.top})"] if more > 0 else [])
    receipt.repo_config = repo_config
    if ws.leftover:
        receipt.leftover_saved = worktrees.leftover_words(ws)
    if task["permission"] == "readonly" and ws.mode == "in-place" and snapshot is None:
        receipt.sandbox["shell writes"] = ("not reverted: the directory was too large to snapshot before the run "
                                           "(over 50 MB of files, 200,000 entries or 256 folders deep), or a link")
    return receipt, diff, problem


def _failed(task: dict, run: RunResult, model: str, reason: str, receipt: Receipt, diff: str | None,
            usage: dict[str, Any]) -> dict[str, Any] | None:
    """The run failed (``reason``): the attempt fails with its receipt, retried unless a retry
    cannot help (a model OpenCode does not offer, a request the provider refuses, the machine)."""
    marker = task["run_marker"]
    # A provider's refusal decides only a run that ended on the model's error, not one that was
    # killed or timed out later (an earlier refused request may sit in its stream).
    refused = run.stream.refused_status if reason.startswith("model error:") else None
    retryable = not oc.model_missing(reason) and refused is None
    if oc.model_missing(reason):
        # Retrying cannot bring the model back: fail once, naming it and quoting OpenCode.
        reason = (f"model {model} is not offered by OpenCode here (not retried; pick one with "
                  f"`tasks_cli.py models` and resubmit): {reason}")
    elif not retryable:
        reason += (f" (not retried: the provider refuses this request itself, HTTP {refused}; "
                   "fix the model's settings or the task, then retry_task)")
    log(f"{task['id']} attempt failed: {reason}", talk.VERBOSE)
    final = _finish(store.fail_attempt, task, marker, reason, result=receipt, diff=diff, usage=usage,
                    session_id=run.stream.session_id,
                    retryable=retryable and environment_fault(run) is None)
    if final and final["status"] == "failed":
        notify(f"TaskBridge {task['id']} failed", reason[:200])
    return final


LIMIT_BACKOFF_MAX_SEC = 3600   # the longest back-off for a limit whose reset the provider did not say


def limit_resume_at(task: dict, limited: dict[str, Any], knobs: Knobs, now: float) -> float | None:
    """When a task paused at a usage limit resumes (epoch seconds): the provider's reset plus
    WORKER_LIMIT_MARGIN_SEC; with no reset given, a back-off from WORKER_LIMIT_BACKOFF_SEC doubling
    with each such pause in a row (at most an hour); None after WORKER_LIMIT_ROUNDS of those (the
    planner is asked instead)."""
    if limited.get("reset_at"):
        return max(float(limited["reset_at"]), now) + knobs.limit_margin_sec
    rounds = int(task.get("limit_rounds") or 0) + 1
    if rounds > knobs.limit_rounds:
        return None
    return now + min(knobs.limit_backoff_sec * 2 ** (rounds - 1), LIMIT_BACKOFF_MAX_SEC)


def _pause_at_limit(task: dict, run: RunResult, model: str, receipt: Receipt, usage: dict,
                    knobs: Knobs) -> dict[str, Any] | None:
    """Pause the task at its provider's usage limit (not a failure: no retry spent, the worktree
    and the OpenCode session kept) until the reset; other tasks on the provider wait meanwhile."""
    limited, account = run.limited, model.split("/", 1)[0]
    if limited is None:
        raise ValueError(f"{task['id']}'s run reached no usage limit to pause at")
    resume_at = limit_resume_at(task, limited, knobs, time.time())
    said = " ".join(str(limited.get("said") or "a usage limit (no words given)").split())[:1000]
    receipt.limit = {"provider": account, "said": said, "reset_at": store.iso(limited.get("reset_at")),
                        "seen_in": limited.get("source")}
    if resume_at is None:
        way = (f"It gave no reset time {knobs.limit_rounds} times in a row, so TaskBridge does not resume it by "
               "itself: answer 'continue' to try again now, or 'stop' to fail it with its receipt kept.")
    else:
        how = "the provider's reset" if limited.get("reset_at") else "a back-off (the provider gave no reset time)"
        way = (f"It resumes by itself at {store.iso(resume_at)} ({how}); until then other tasks on {account} stay "
               "queued and tasks on other providers run. Answer 'continue' to resume now, or 'stop' to fail it.")
    question = (f"Usage limit: the provider {account} said {said!r}. TaskBridge paused {task['id']} (no attempt spent; "
                f"the worktree and the OpenCode session are kept). {way}")
    log(f"{task['id']} paused at {account}'s usage limit until {store.iso(resume_at) or 'the planner answers'}")
    notify(f"TaskBridge {task['id']} paused at a usage limit", question[:200])
    return _finish(store.pause_for_limit, task, task["run_marker"], question, account=account, said=said,
                   resume_at=resume_at, known_reset=bool(limited.get("reset_at")),
                   session_id=run.stream.session_id, result=receipt, usage=usage)


def limit_question(task: dict, run: RunResult) -> str:
    """The question a task paused at a spending limit asks: the spend, the limit, what the agent
    was doing, and the ways on."""
    paused, stream, name = run.paused, run.stream, task["id"]
    if paused is None:
        raise ValueError(f"{name}'s run reached no spending limit to ask about")
    usage = f"this attempt: {stream.steps} model calls, ${stream.cost_usd:.4f}, {stream.tokens['total']:,} tokens"
    if paused["kind"] == "daily_budget":
        head = f"Daily budget reached: {paused['reason']}."
        way = ("Raise the budget (set_budget, or `tasks_cli.py budget set --daily USD`) and answer "
               "'continue' to resume the same session, or answer 'stop' to fail the task with its receipt kept.")
    else:
        head = f"Spending limit reached: {name} has {paused['reason']} ({usage})."
        figure = store.limit_example(paused["unit"], paused["spent"], paused["limit"])
        more = f"${figure:.2f}" if paused["unit"] == "usd" else f"{figure:,} tokens"
        cli = f"`tasks_cli.py budget raise {name} {figure:.2f}`" if paused["unit"] == "usd" else \
            f"`tasks_cli.py budget raise {name} --tokens {figure}`"
        way = (f"Answer 'continue, up to {more}' (or run {cli}) to resume the same session, or "
               "'stop' to fail the task with its receipt kept.")
    doing = _last_activity(stream)
    sent = "before the next one was sent" if paused.get("gated") else \
        "(no spend gate was loaded: a limit set after the run started; the next call may have gone out)"
    return (f"{head} TaskBridge ended the run after model call {stream.steps}, {sent}; the agent was "
            f"{doing}. The worktree and the OpenCode session are kept. {way}")


def _last_activity(stream: oc.EventStream) -> str:
    """What the agent did last, in a few words: its last tool call, else its last words."""
    if stream.tool_calls:
        call = stream.tool_calls[-1]
        subject = call["input"].get("command") or call["input"].get("filePath") or call["input"].get("description")
        return f"working with {call['tool']}" + (f" ({str(subject)[:160]})" if subject else "") + \
            f", {len(stream.tool_calls)} tool calls so far"
    text = " ".join(stream.final_text.split())
    return f"writing: {text[-160:]!r}" if text else "starting (no tool call yet)"


def _observe(task: dict, ws: Workspace, snapshot: dict | None) -> tuple[tuple[list[str], list[str]], list[str],
                                                                       str | None, Exception | None]:
    """((reverted paths, ``path: why`` not reverted), changed files, diff, None), or the git
    failure that stopped it."""
    try:
        reverted = worktrees.revert_changes(ws, snapshot) if task["permission"] == "readonly" else ([], [])
        files, diff = worktrees.observed_changes(ws)
    except (worktrees.GitError, OSError) as exc:
        return ([], []), [], None, exc
    return reverted, files, diff, None


def _commit_and_finish(task: dict, ws: Workspace, run: RunResult, receipt: Receipt, diff: str | None,
                       phases: Phases) -> dict[str, Any] | None:
    """The agent succeeded: commit on the task branch, remove the worktree (checked), done. A
    failed commit is bookkeeping: never a rerun of the agent."""
    try:
        message = worktrees.task_commit_message(task, receipt.summary, {"usage": run.stream.usage(),
                                                                         "session_id": run.stream.session_id})
        receipt.commit = worktrees.commit_changes(ws, message)
        # in place nothing is committed: no change is what git (or the folder's listing) saw
        receipt.no_change = not receipt.commit if ws.mode == "worktree" else not receipt.files_touched
        if ws.mode == "in-place" and not ws.top and ws.start_listing is None:   # only the tools' word: not said
            receipt.unset("no_change")
        if task.get("continue_from") or task.get("fork_from"):
            receipt.line = {"continues": task.get("continue_from"), "forked_from": task.get("fork_from"),
                               **worktrees.line_of_work(ws, receipt.commit or ws.base_commit)}
    except worktrees.GitError as exc:
        return _bookkeeping_failed(task, ws, run, receipt, diff, "the commit", exc, phases)
    if ws.remote:
        try:
            _push(task, ws, receipt)
        except worktrees.GitError as exc:
            return _bookkeeping_failed(task, ws, run, receipt, diff, f"the push of {ws.branch} to {ws.remote}",
                                       exc, phases)
    if not task["worktree_keep"]:
        try:
            _remove(ws, receipt)
        except worktrees.GitError as exc:   # stopped: the work is committed; say what is left
            receipt.update(worktree_removed=False, worktree_left=f"{ws.top}: {exc}")
        if not _drop_empty_branch(task, ws, receipt):
            return None
    if run.meter is not None:
        run.meter.settle_owed()
    notify(f"TaskBridge {task['id']} done", receipt.summary[:200])
    return _finish(store.complete_attempt, task, task["run_marker"], result=receipt, diff=diff,
                   usage=run.stream.usage(), session_id=run.stream.session_id)


def _push(task: dict, ws: Workspace, receipt: Receipt) -> None:
    """A task on a remote: push its commit as its branch (leased: see worktrees.push_branch) and
    record where it went, in the receipt and on the task's row. Nothing committed: nothing
    pushed, and the receipt says so. Raises worktrees.GitError."""
    receipt.repo = ws.remote
    commit = receipt.get("commit")
    if not commit:
        receipt.update(pushed_branch=None, pushed_commit=None,
                       pushed=f"nothing pushed to {ws.remote}: the agent changed no file")
        return
    worktrees.push_branch(ws, commit)
    receipt.update(pushed_branch=ws.branch, pushed_commit=commit,
                   pushed=f"{ws.branch} at {commit[:12]} pushed to {ws.remote}")
    db(store.renew_lease, task["id"], task["run_marker"], pushed_branch=ws.branch, pushed_commit=commit)
    log(f"{task['id']} pushed {ws.branch} ({commit[:12]}) to {ws.remote}", talk.VERBOSE)


def _remove(ws: Workspace, receipt: Receipt) -> None:
    """Remove the worktree and record in the receipt whether it is really gone, and what is
    left when it is not (the task keeps its worktree_path, so clear --remove-worktrees can
    retry)."""
    if ws.mode != "worktree":
        return
    left = worktrees.remove_worktree(ws)
    receipt.worktree_removed = left is None
    if left:
        receipt.worktree_left = left
        log(left)


def _drop_empty_branch(task: dict, ws: Workspace, receipt: Receipt) -> bool:
    """A run that changed nothing, its worktree gone: its empty branch is deleted (see
    worktrees.drop_empty_branch) and the receipt and the task's row say there is no branch.
    False when the attempt was superseded meanwhile (the caller stops; the branch is put back).
    A git command stopped on the way keeps the branch, as before this cleanup existed."""
    if not receipt.get("no_change") or not receipt.get("worktree_removed"):
        return True

    def record() -> bool:
        db(store.renew_lease, task["id"], task["run_marker"], branch=None)
        return True

    try:
        if not _branch_dropped(task, ws, record):
            return True
    except store.StaleAttempt as exc:
        log(str(exc))
        return False
    receipt.update(branch=None, branch_deleted=ws.branch)
    log(f"{task['id']} changed nothing: its empty branch {ws.branch} was deleted", talk.VERBOSE)
    return True


def _drop_branch_of_ended(task: dict, ws: Workspace, final: dict[str, Any] | None) -> None:
    """An attempt that ended the task cancelled or failed (``final``: the task's row then) with its
    worktree gone: the branch made for it is deleted when it holds no commit, as a done task's
    (worktrees.drop_empty_branch: never a branch with work on it, a parent's, one checked out or
    a remote task's), and the task's row and receipt say so (store.record_branch_dropped)."""
    if not final or final["status"] not in ("cancelled", "failed") or final.get("run_marker") != task["run_marker"] \
            or task["worktree_keep"] or ws.mode != "worktree" or final.get("branch") != ws.branch:
        return
    with worktrees.watched(None):   # the attempt is over: only git's own time limit applies
        dropped = _branch_dropped(task, ws, lambda: db(store.record_branch_dropped, task["id"], task["run_marker"],
                                                       ws.branch))
    if dropped:
        log(f"{task['id']} ended {final['status']} having committed nothing: its empty branch {ws.branch} was "
            "deleted", talk.VERBOSE)


def _branch_dropped(task: dict, ws: Workspace, record: Callable[[], bool]) -> bool:
    """Delete ``ws``'s empty branch (worktrees.drop_empty_branch), then ``record`` it in the queue
    (True: recorded). Whether both happened. When the record is refused (False) or raises, the
    branch is put back (worktrees.restore_branch) and the exception goes on: the task's row never
    names a branch that is gone. A git failure keeps the branch (said in the worker's log)."""
    try:
        if not worktrees.drop_empty_branch(ws):
            return False
    except worktrees.GitError as exc:
        log(f"{task['id']}: its empty branch {ws.branch} is kept: {exc}")
        return False
    recorded = False
    try:
        recorded = record()
    finally:
        if not recorded:
            try:
                worktrees.restore_branch(ws)
            except worktrees.GitError as exc:
                log(f"{task['id']}: its empty branch {ws.branch} was deleted, but the queue did not record it and "
                    f"putting it back failed: {exc}")
    return recorded


def _bookkeeping_failed(task: dict, ws: Workspace, run: RunResult, receipt: Receipt, diff: str | None,
                        step: str, exc: BaseException, phases: Phases) -> dict[str, Any] | None:
    """The agent finished but recording its work did not: the receipt is stored, the step and
    git's reason are named, the worktree is kept for the person, and the (paid) agent run is
    not repeated: the task fails without a retry."""
    if phases.superseded:
        _cleanup_superseded(task, ws)
        return None
    if ws.mode != "worktree":
        where = f"its changes are in {ws.cwd}"
    elif ws.remote and (commit := receipt.get("commit")):
        where = (f"its work is committed ({commit[:12]}) in the kept worktree {ws.top}: push it "
                 f"yourself once the remote takes it ({_push_yourself(ws)})")
    elif task["permission"] == "readonly":
        where = f"the worktree {ws.top} is kept as the agent left it"
    elif _still_a_checkout(ws.top):
        where = (f"its work is kept in the worktree {ws.top} on branch {ws.branch}: commit it there "
                 f"({store.shell_command('git', '-C', ws.top, 'add', '-A')} && "
                 f"{store.shell_command('git', '-C', ws.top, 'commit')})")
    else:   # the agent removed or broke the worktree's .git: git cannot commit there any more
        where = (f"its files are kept in {ws.top}, which is no longer a git worktree (its .git was removed or "
                 f"broken, so nothing can be committed there): copy what you need out of it, then remove the "
                 f"folder and run {store.shell_command('git', '-C', ws.repo, 'worktree', 'prune')}")
    error = (f"the agent finished, but {step} failed: {os_faults.describe(exc) or exc}; {where}. "
             "The agent is not run again")
    receipt.update(bookkeeping_error=error, worktree_kept=ws.mode == "worktree")
    log(f"{task['id']}: {error}")
    final = _finish(store.fail_attempt, task, task["run_marker"], error, retryable=False, result=receipt,
                    diff=diff, usage=run.stream.usage(), session_id=run.stream.session_id,
                    pin_host=bool(ws.remote and ws.mode == "worktree" and receipt.get("commit")))
    if final:
        notify(f"TaskBridge {task['id']} needs you", error[:200])
    return final


def _push_yourself(ws: Workspace) -> str:
    """The command a person runs to push a kept worktree's commit (a workspace on a remote has its
    root, remote and branch). Raises ValueError for a workspace without them."""
    if ws.remote is None or ws.branch is None:
        raise ValueError(f"the {ws.mode} workspace at {ws.cwd} has no remote branch to push")
    return worktrees.push_command(ws.root(), ws.remote, ws.branch)


def _push_kept_work(task: dict, ws: Workspace) -> dict[str, Any] | None:
    """A retried task on a remote whose earlier attempt's push failed, its commit kept in a
    worktree on this machine (worktrees.unpushed_workspace): push that commit again — the agent is
    never run again — and finish with the earlier receipt. A push refused again fails the task
    the same way (worktree kept, host pinned, not retried)."""
    receipt = Receipt.from_json({k: v for k, v in (task.get("result") or {}).items()
                                 if k not in ("bookkeeping_error", "worktree_kept")})
    commit = receipt.get("commit")
    if not commit:   # unpushed_workspace found the worktree at the receipt's commit
        raise ValueError(f"{task['id']}'s earlier receipt names no commit to push again")
    receipt.pushed_again = (f"attempt {task['attempts']} pushed the commit an earlier attempt left in "
                               f"{ws.top}; the agent was not run again")
    log(f"{task['id']}: pushing the kept commit {commit[:12]} again (the agent is not run again)",
        talk.VERBOSE)
    try:
        _push(task, ws, receipt)
    except worktrees.GitError as exc:
        error = (f"the agent finished in an earlier attempt, but the push of {ws.branch} to {ws.remote} failed "
                 f"again: {exc}; its work is committed ({commit[:12]}) in the kept worktree {ws.top}: "
                 f"push it yourself once the remote takes it "
                 f"({_push_yourself(ws)}). The agent is not run again")
        receipt.unset("pushed_again")
        receipt.update(bookkeeping_error=error, worktree_kept=True)
        log(f"{task['id']}: {error}")
        return _finish(store.fail_attempt, task, task["run_marker"], error, retryable=False, result=receipt,
                       diff=task.get("diff"), pin_host=True)
    if not task["worktree_keep"]:
        try:
            _remove(ws, receipt)
        except worktrees.GitError as exc:
            receipt.update(worktree_removed=False, worktree_left=f"{ws.top}: {exc}")
    notify(f"TaskBridge {task['id']} done", receipt.get("summary", "")[:200])
    return _finish(store.complete_attempt, task, task["run_marker"], result=receipt, diff=task.get("diff"))


def _still_a_checkout(top: str | None) -> bool:
    """Whether git still sees ``top`` as the root of a working tree (an agent may delete .git)."""
    if not top or not os.path.lexists(os.path.join(top, ".git")):
        return False
    try:
        found = worktrees.git(["rev-parse", "--show-toplevel"], top, check=False)
    except Exception:  # noqa: BLE001 - a git that cannot even run here is no checkout to commit in
        return False
    return bool(found) and os.path.realpath(found) == os.path.realpath(top)


def _finish(fn: Any, task: dict, marker: str, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """Record how the attempt ended (``fn``: complete_attempt, fail_attempt, ...), retried while the
    queue database is away (``db``: the result of a finished run is never dropped for an outage);
    None when the attempt was fenced off. A write whose answer was lost to the outage may have
    landed: its retry then finds the attempt ended as it wrote it, and returns that."""
    tries = []

    def once(*args: Any, **kwargs: Any) -> dict[str, Any]:
        tries.append(time.monotonic())
        return fn(*args, **kwargs)

    # Everything an attempt stores (receipt, diff, error, question) passes here: redacted once.
    if isinstance(kwargs.get("result"), Receipt):
        kwargs["result"] = kwargs["result"].to_json()
    redactor = redaction.current()
    args, kwargs = redaction.redact_deep(args, redactor), redaction.redact_deep(kwargs, redactor)
    try:
        return db(once, task["id"], marker, *args, **kwargs)
    except store.StaleAttempt as exc:
        if len(tries) > 1 and (landed := _ended_as_written(task["id"], marker)) is not None:
            return landed
        log(str(exc))
        return None


def _ended_as_written(task_id: str, marker: str) -> dict[str, Any] | None:
    """The task, when attempt ``marker`` already ended it (a write whose answer was lost landed);
    else None (also when the queue cannot say)."""
    with contextlib.suppress(Exception):
        found = store.get_task(task_id)
        if found["run_marker"] == marker and found["status"] != "running":
            return found
    return None


def _cleanup_superseded(task: dict, ws: Workspace) -> None:
    """A cancelled waiting/running task keeps its branch when it holds work (an empty one is
    deleted: _drop_branch_of_ended); its worktree goes unless kept."""
    try:
        current = db(store.get_task, task["id"])
    except store.TaskNotFound:
        current = {"status": "gone"}
    retried = current.get("wrapping_up") == task["run_marker"] and current["status"] == "pending"
    if (current["status"] == "cancelled" or retried) and not task["worktree_keep"]:
        with worktrees.watched(None):   # the attempt is over: only git's own time limit applies
            left = worktrees.remove_worktree(ws)
        if left:
            log(left)
        _drop_branch_of_ended(task, ws, current)


def build_receipt(task: dict, ws: Workspace, run: RunResult, model: str, block: dict,
                  files: list[str], reverted: list[str], session_note: str) -> Receipt:
    """The receipt (receipt.build): what git and the event stream showed, beside what the agent says."""
    current = db(store.get_task, task["id"])
    return receipt_mod.build(task, current, ws, run, model, block, (files, reverted), session_note)


# --------------------------------------------------------------------------------------------
# Banners.


def notify(title: str, message: str) -> None:
    """A desktop banner (macOS osascript, Linux notify-send where present); ``WORKER_NOTIFY=0``
    silences. A banner that fails never fails a task."""
    if os.environ.get("WORKER_NOTIFY", "1") == "0":
        return
    if platform.system() == "Darwin" and shutil.which("osascript"):
        script = f"display notification {_applescript(message)} with title {_applescript(title)}"
        argv = ["osascript", "-e", script]
    elif shutil.which("notify-send"):
        argv = ["notify-send", title, message]
    else:
        return
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=5)
    except (OSError, subprocess.SubprocessError):
        pass


def _applescript(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --------------------------------------------------------------------------------------------
# The reaper and the pass.


def reap(knobs: Knobs) -> int:
    """Requeue (or fail, when retries are spent) every running task whose lease is dead: its
    heartbeat is older than the stale limit; or, for a lease held on this host
    (``TASKBRIDGE_HOST``), it ran past its timeout or the worker process that holds it is gone
    (pid *and* start time checked). A lease held on another host is judged by its heartbeat age
    only: it is never requeued while that heartbeat is fresh. A local lease's orphaned processes
    are killed first (the agent by pid and start time, the rest by the run marker tag). Fenced:
    each attempt is requeued exactly once. Returns how many were reaped."""
    reaped = 0
    host = store.host_name()
    _end_dead_wrap_ups(knobs, host)
    for task, why in _dead_leases(knobs, host):
        if _lease_here(task, host):   # a pid from another machine names nothing here
            agent = process_tree.same_process(task["agent_pid"], task["agent_pid_start"])
            process_tree.kill_tree(agent, knobs.kill_grace_sec, run_stragglers(task["run_marker"], store.queue_tag()))
        if _lease_here(task, host) and _recorded_from_commit(task, task["run_marker"]):
            reaped += 1
            continue
        reason = f"{REAPED_PREFIX}{task['run_marker']} ended: {why}"
        if ended := _finish(store.requeue_attempt, task, task["run_marker"], reason):
            reaped += 1
            log(f"reaped {task['id']}: {reason}")
            then = "the reaper handed it back" if ended["status"] == "pending" else \
                f"the reaper ended it: {ended['status']}, its retries spent"
            with contextlib.suppress(Exception):   # its worker died mid-line maybe: a line of its own
                store.append_task_log(task["id"], f"\n[worker] {redaction.redact(reason)}; {then}\n".encode())
    return reaped


REAPED_PREFIX = talk.REAPED_PREFIX   # how a reaped attempt's error begins (see _reaped_attempt)


def _reaped_attempt(task: dict[str, Any]) -> str | None:
    """The run marker of the attempt before this one when the reaper ended it (its worker gone
    or silent): that attempt may have committed its work before it was stopped."""
    error = task.get("error") or ""
    if not error.startswith(REAPED_PREFIX):
        return None
    marker = error[len(REAPED_PREFIX):].split(" ", 1)[0]
    return marker if marker != task["run_marker"] else None


def _recorded_from_commit(task: dict[str, Any], marker: str) -> dict[str, Any] | None:
    """Attempt ``marker`` of ``task`` committed its work but its worker stopped (killed, or its
    disk full) before the queue recorded it: record the task done from that commit, as the
    current attempt; the agent is not run again. The task's final dict, or None when the branch
    holds no such commit (or git cannot tell: then the task runs as it would have)."""
    try:
        found = worktrees.unrecorded_commit(task, marker)
    except worktrees.GitError as exc:
        log(f"{task['id']}: could not look for attempt {marker}'s commit: {exc}", talk.VERBOSE)
        return None
    if found is None:
        return None
    receipt = Receipt(summary=found["summary"], files_touched=found["files"], commit=found["commit"],
                      recovered=(f"attempt {marker} committed this work ({found['commit'][:12]} on {task['branch']}) "
                             "but its worker stopped before the queue recorded it; recorded from the commit: "
                             "the agent was not run again"))
    if task.get("worktree_path") and not task["worktree_keep"]:
        left = worktrees.remove_worktree_at(task["worktree_path"])
        receipt.worktree_removed = left is None
    log(f"{task['id']}: {receipt.recovered}")
    return _finish(store.complete_attempt, task, task["run_marker"], result=receipt, diff=found["diff"],
                   usage=found["usage"], session_id=found["session_id"])


def _dead_leases(knobs: Knobs, host: str) -> list[tuple[dict[str, Any], str]]:
    dead = {t["id"]: (t, f"no heartbeat since {t['heartbeat_at']} or past its timeout")
            for t in store.stale_leases(knobs.stale_sec, host=host)}
    for task in store.running_leases():
        if task["id"] not in dead and _lease_here(task, host) and \
                (task["lease_owner"] or "").startswith("worker:") and \
                not process_tree.same_process(task["lease_pid"], task["lease_pid_start"]):
            dead[task["id"]] = (task, f"its worker (pid {task['lease_pid']}) is gone from {host}")
    return [(t, why) for t, why in dead.values() if not _own_live_attempt(t)]


def _end_dead_wrap_ups(knobs: Knobs, host: str) -> None:
    """End the wrap-up of a cancelled attempt (store.end_wrap_up) whose worker will never end it:
    its heartbeat is older than the stale limit, or, on this host, its process is gone. A task
    retried meanwhile waits for that (a second attempt beside the first in one worktree), and
    must not wait for good. The attempt's processes still tagged are killed first, as a dead
    lease's are."""
    for task in store.wrap_ups(knobs.stale_sec):
        here = _lease_here(task, host)
        gone = here and (task["lease_owner"] or "").startswith("worker:") and \
            not process_tree.same_process(task["lease_pid"], task["lease_pid_start"])
        if not (task["stale"] or gone) or _own_live_attempt(task):
            continue
        if here:
            process_tree.kill_tree(None, knobs.kill_grace_sec, run_stragglers(task["wrapping_up"], store.queue_tag()))
        why = f"its worker (pid {task['lease_pid']}) is gone from {host}" if gone else \
            f"its worker ({task['lease_owner']}) has been silent since {task['heartbeat_at']}"
        if store.end_wrap_up(task["id"], task["wrapping_up"], why):
            log(f"{task['id']}: the cancelled attempt {task['wrapping_up']} was not wrapped up: {why}")


def _lease_here(task: dict[str, Any], host: str) -> bool:
    """Whether the lease was taken on this host, where its pids mean something (a lease from
    before hosts were recorded names its host in its owner, ``worker:<host>:<pid>``)."""
    if task.get("lease_host"):
        return task["lease_host"] == host
    return (task["lease_owner"] or "").startswith(f"worker:{host}:")


def _own_live_attempt(task: dict[str, Any]) -> bool:
    """This very process holds the lease and one of its slots runs that attempt now: its own
    supervision ends it (timeout, cancel); reaping it would start a second attempt beside it."""
    with current().beat.lock:
        running = current().beat.tasks.get(task["id"]) == task["run_marker"]
    return running and task["lease_pid"] == os.getpid() and \
        process_tree.same_process(task["lease_pid"], task["lease_pid_start"]) is not None


def worker_identity() -> tuple[str, int, float]:
    """(lease owner name, pid, pid start time in seconds)."""
    me = psutil.Process()
    return f"worker:{store.host_name()}:{me.pid}", me.pid, me.create_time()


def preflight() -> str | None:
    """None when a pass can run; else what is missing and how to fix it, said before anything is
    claimed: the opencode and git binaries (launchd's PATH is bare: /usr/bin:/bin:/usr/sbin:/sbin)
    and the log and worktree folders."""
    try:
        oc.opencode_bin()
    except oc.OpencodeNotFound as exc:
        return str(exc)
    if not shutil.which("git"):
        return f"git not found on PATH ({os.environ.get('PATH', '')}); install git or fix PATH"
    return worktrees.folders_problem()


def run_pass(watch: bool = False, max_tasks: int | None = None, slots: int = 1) -> int:
    """One pass (or, with ``watch``, a loop): lock, reap, claim and run tasks, up to ``slots`` at
    once. Returns the exit code: 0 (also when another pass holds the lock), 1 when a required
    tool is missing. Raises the store's error (DatabaseUnusable, ReadOnlyStorage, ...) before
    anything is written beside the queue when this user cannot use or write it."""
    # An unusable queue is refused before anything is written beside it (the lock, the heartbeat):
    # one SQLite can only read opens read-only without a word, so what cannot be written is asked first.
    store.require_writable()
    store.connect().close()
    lock = store.take_lock(store.worker_lock_path())
    if lock is None:
        holder = store.read_worker_heartbeat() or {}
        # One pass per queue by design: a person who started a second to get more done at once
        # needs the knob that does that, not a silent exit.
        print(f"another worker pass holds the lock {store.worker_lock_path()} "
              f"(pid {holder.get('pid', '?')}, up to {holder.get('slots') or 1} task(s) at once); exiting. "
              "To run more tasks at once, stop it and start one worker with --slots N "
              "(or set WORKER_SLOTS)", flush=True)
        return 0
    try:
        beat, knobs = current().beat, Knobs()
        beat.slots, beat.pid_start = slots, worker_identity()[2]
        beat.engine = "warm" if knobs.engine else "cold"
        current().beat.write("starting")
        return _loop(watch, max_tasks, knobs, slots)
    finally:
        current().beat.write("stopped")
        os.close(lock)  # closing the descriptor releases the flock


class Beat:
    """The worker heartbeat (the file beside the database and this worker's row in the workers
    table): this process's state and the tasks it runs right now. A database away while it
    writes is said through ``outage``."""

    def __init__(self, outage: Outage) -> None:
        self.outage = outage
        self.lock = threading.Lock()
        self.tasks: dict[str, str] = {}   # task id -> run marker
        self.state = "starting"
        self.slots = 1                    # how many tasks this pass may run at once (the board shows it)
        self.engine: str | None = None    # "cold" (an `opencode run` per attempt) or "warm" (kept servers)
        self.budget: str | None = None    # why nothing new is claimed: the daily budget is spent
        self.pid_start: float | None = None   # this process's start time (the workers table keeps it)

    def write(self, state: str | None = None, **extra: Any) -> None:
        with self.lock:
            self.state = state or self.state
            ids = sorted(self.tasks)
            said = {"budget": self.budget} if self.budget else {}
            try:   # the heartbeat file is written first; the row waits for the database
                with store.lock_wait(SHORT_LOCK_WAIT_SEC):
                    store.write_worker_heartbeat({"state": self.state, "task": ids[0] if ids else None,
                                                  "tasks": ids, "slots": self.slots, "engine": self.engine,
                                                  "pid_start": self.pid_start, **said, **extra})
            except store.QueueGone as exc:   # nothing to beat for: the loop and the runs act on it
                current().lost.gone(exc)
            except Exception as exc:
                if not db_outage(exc):
                    raise
                self.outage.failed(exc)

    def running(self, task: dict[str, Any], active: bool) -> None:
        with self.lock:
            if active:
                self.tasks[task["id"]] = task["run_marker"]
            else:
                self.tasks.pop(task["id"], None)
        self.write()


class WorkerState:
    """What one worker process keeps across its tasks and slots: the signal flags, its view of
    the queue database (outage, full disk, its file gone), its heartbeat and its voice. One is
    made per ``main()`` (``fresh_state``); ``current()`` is the one in use (made on first use for
    callers that never ran ``main``; a test that needs a clean one calls ``fresh_state``)."""

    def __init__(self, at_once: bool = False, voice: Talk | None = None) -> None:
        self.flags = Flags(at_once)
        self.full_disk = FullDisk()
        self.outage = Outage(self.full_disk)
        self.beat = Beat(self.outage)
        self.lost = LostQueue()
        self.talk = voice or Talk()
        self.engines: engine_slots.Slots | None = None   # the kept servers (WORKER_ENGINE=1), per pass


_state: WorkerState | None = None


def current() -> WorkerState:
    """This process's WorkerState (made on first use)."""
    global _state
    if _state is None:
        _state = WorkerState()
    return _state


def fresh_state(at_once: bool = False, voice: Talk | None = None) -> WorkerState:
    """A new WorkerState, now the current one (``main`` at its start; tests between cases)."""
    global _state
    _state = WorkerState(at_once, voice)
    return _state


def _loop(watch: bool, max_tasks: int | None, knobs: Knobs, slots: int) -> int:
    """The pass's loop (see Loop); its exit code."""
    problem = preflight()
    if problem:
        log(problem, talk.QUIET)
        current().beat.write("error", error=problem)
        return 1
    with ThreadPoolExecutor(max_workers=slots, thread_name_prefix="slot") as pool:
        # what a killed worker's kept servers left (a cold pass too: else its parked worktrees stay
        # registered in the user's repository until a warm pass)
        engine_slots.sweep(worktrees.worktree_root() / "engine", store.log_dir(), store.queue_tag(),
                           knobs.kill_grace_sec)
        # OpenCode processes may start side by side (slots, kept servers, other queues' workers)
        problem = _prepare_opencode_db()
        if problem:
            log(problem, talk.VERBOSE)
        engines = current().engines = _start_engines(slots, watch) if knobs.engine else None
        try:
            return Loop(watch, max_tasks, knobs, slots, pool).run()
        finally:
            current().engines = None
            if engines is not None:
                engines.stop_all(knobs.kill_grace_sec)


def _prepare_opencode_db() -> str | None:
    """``oc.prepare_opencode_db`` for the database the runs use: when runs are boxed, the
    template each line's home gets a copy of (agent_box.template_home, in a box), else yours.
    None, or one line on why it was not prepared."""
    with agent_box.scratch("prepare-") as scratch:
        try:
            box = agent_box.call_box(Path(scratch), home=agent_box.template_home())
        except agent_box.BoxSettingError as exc:
            return f"OpenCode's database was not prepared: {exc}"
        return oc.prepare_opencode_db(
            stopping=lambda: current().flags.stopping, say=log, box=box,
            data_home=agent_box.box_vars(agent_box.template_home())["XDG_DATA_HOME"] if box else None)


def _start_engines(slots: int, watch: bool) -> engine_slots.Slots:
    """The pass's kept servers, one starting per slot for a task like the queue's first (when it
    has one that fits a kept server: else each slot's first task runs cold and teaches it)."""
    try:
        first = predict_from_queue()
    except Exception as exc:
        # each slot's first task runs cold and teaches it; the queue away now is the loop's to weather
        if not (db_outage(exc) or isinstance(exc, (oc.NoDefaultModel, oc.OpencodeNotFound,
                                                   worktrees.Unrunnable, worktrees.GitError))):
            raise
        log(f"kept OpenCode servers wait for a first task: {exc}", talk.VERBOSE)
        first = None
    engines = engine_slots.Slots(make_kept, first, watch)
    for index in range(slots):
        problem = engines.prepare(f"slot_{index}")
        if problem:
            log(problem)
    return engines


class Loop:
    """One pass's loop: reap, claim, hand each task to a slot of ``pool``, wait for a change;
    ride out the queue database's outages (``--watch``: back off and retry; a one-pass: claim
    nothing more after the second failure and exit 1 once the tasks in hand end)."""

    def __init__(self, watch: bool, max_tasks: int | None, knobs: Knobs, slots: int,
                 pool: ThreadPoolExecutor) -> None:
        self.watch, self.max_tasks, self.knobs, self.slots, self.pool = watch, max_tasks, knobs, slots, pool
        self.state = current()
        self.state.lost.watch = watch
        self.owner, self.pid, self.pid_start = worker_identity()
        self.busy: set[Any] = set()   # the slots' futures
        self.started = self.trimmed = 0   # tasks started; and when the heap was last handed back
        self.last_reap = 0.0
        self.budget_said: str | None = None
        self.folders_said: str | None = None   # why claims wait for a folder of ours, as last said
        self.announced = False
        self.status = 0
        self.delay, self.failures = OUTAGE_BACKOFF_SEC[0], 0   # the outage back-off, failed turns in a row
        self.mark = 0   # the last event id before the claim: a change after it wakes the wait
        # The loop wakes at least this often, so the worker's row is refreshed every
        # WORKER_ROW_EVERY_SEC while it lives (other hosts judge it silent after 30 s).
        self.nap = min(knobs.poll_sec, store.WORKER_ROW_EVERY_SEC)

    def run(self) -> int:
        flags = self.state.flags
        while not flags.stopping and (self.max_tasks is None or self.started < self.max_tasks):
            self.state.talk.signals(flags.stopping, flags.stop_now)
            self.busy = {f for f in self.busy if not f.done()}
            try:
                with store.lock_wait(give_up=lambda: flags.stopping):   # a stop is not held up by a locked queue
                    task = self._turn()
                if not self._next(task):
                    break
            except store.QueueGone as exc:
                if not self._queue_gone(exc):
                    break
            except Exception as exc:
                if not db_outage(exc):
                    raise
                if self._outage(exc):
                    continue
                break
        while self.busy:  # first signal: the tasks in hand finish (a second one ends them at once)
            self.state.talk.signals(flags.stopping, flags.stop_now)
            self.busy = wait(self.busy, timeout=0.2).not_done
        self.state.talk.signals(flags.stopping, flags.stop_now)
        return self.status

    def _state_word(self) -> str:
        return "running" if self.busy else "idle" if self.watch else "pass"

    def _turn(self) -> dict[str, Any] | None:
        """Reap when due, beat, claim a task when a slot is free; the task claimed, or None."""
        lost = self.state.lost
        if lost.since is not None:   # the queue file went away: is it back?
            self.mark = store.last_event_id()   # QueueGone while it is not: the loop waits for it (run)
            lost.back()              # said, and the attempts it ended handed back (one ending later, by its run)
        # A one-pass announces itself once it has work; --watch at once.
        self.announced = self.announced or (self.watch and announce_start(self.watch, self.slots))
        if time.monotonic() - self.last_reap > (60 if self.watch else 0):
            reap(self.knobs)
            if self.watch:
                store.checkpoint()
            self.last_reap = time.monotonic()
        self.state.beat.write(self._state_word())
        self.mark = store.last_event_id()  # before the claim: a change after it wakes the wait below
        free = len(self.busy) < self.slots
        held = self._folders_held() if free else False
        task = _claim(self.owner, self.pid, self.pid_start) if free and not held else None
        if task is None and free:
            self.budget_said = _say_budget(self.budget_said, self._state_word())
        self.state.outage.answered(proved=free)   # a claim takes the write lock; reads alone prove nothing busy
        self.delay, self.failures = OUTAGE_BACKOFF_SEC[0], 0
        return task

    def _folders_held(self) -> bool:
        """Whether claims wait because a folder of ours cannot be written (``worktrees.folders_problem``),
        said once when it starts and once when it ends."""
        problem = worktrees.folders_problem()
        if problem != self.folders_said:
            log(f"claims wait: {problem}" if problem else "the log and worktree folders can be written again: "
                "claims go on", talk.QUIET)
            self.folders_said = problem
        return problem is not None

    def _queue_gone(self, exc: store.QueueGone) -> bool:
        """The queue file is gone (said once, ``LostQueue``): True to look again after a poll
        (``--watch``: it waits for the file to be put back), False when a one-pass stops claiming
        (exit status 1 once its tasks in hand end). Nothing is claimed meanwhile: every store
        call fails until the file is back."""
        self.state.lost.gone(exc)
        if not self.watch:
            self.status = 1
            return False
        self._nap(self.knobs.poll_sec)
        return True

    def _outage(self, exc: BaseException) -> bool:
        """The queue database failed a turn: True to turn again after a back-off (``--watch``, or
        a one-pass's first failure), False when a one-pass gives up claiming (exit status 1)."""
        self.state.outage.failed(exc)
        self.failures += 1
        if not self.watch and self.failures > 1:   # a one-pass claims nothing more: the tasks in hand ride it out
            log(f"error: the queue database is unreachable; this pass claims nothing more and exits "
                f"once its {len(self.busy)} task(s) in hand end (the next pass tries again)", talk.QUIET)
            self.status = 1
            return False
        self._nap(self.delay)   # --watch: wait and try again
        self.delay = backoff(self.delay)
        return True

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` in steps of at most 0.2 s, ending early at a stop (a signal)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.state.flags.stopping:
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    def _next(self, task: dict[str, Any] | None) -> bool:
        """Start ``task`` in a slot, or wait for a slot or a change; False when the pass is over."""
        if task is not None:
            self.state.beat.budget = self.budget_said = None
            self.announced = self.announced or announce_start(self.watch, self.slots)
            self.state.talk.claimed(task)
            self.busy.add(self.pool.submit(_run_guarded, task, self.knobs))
            self.started += 1
        elif len(self.busy) >= self.slots:
            wait(self.busy, timeout=self.nap, return_when=FIRST_COMPLETED)
        elif self.busy or self.watch:
            self._idle()
        else:
            if not self.started and sys.stderr.isatty():   # a person ran it (a schedule's pass stays quiet)
                self._said_nothing_to_claim()
            return False
        return True

    def _said_nothing_to_claim(self) -> None:
        """One line for a one-pass run by hand that found nothing to claim (it used to end silent)."""
        try:
            pending = db(store.counts).get("pending", 0)
        except Exception as exc:
            if not db_outage(exc):
                raise
            return
        said = (f"{pending} task(s) pending, none claimable now ({store.script_command('tasks_cli.py', 'status')} "
                "says why)" if pending else "no task is pending")
        log(f"one pass over {store.database_label()}: nothing to claim, {said}")

    def _idle(self) -> None:
        """Nothing to claim: hand memory back once idle, then wait for a change."""
        if not self.busy and self.started > self.trimmed:
            self.trimmed = self.started
            _give_memory_back()
        # A submit, an answer or a slot's end records an event: the wait wakes within
        # milliseconds; the poll is the fallback (back-off ends, no inotify).
        try:
            store.wait_for_change(self.mark, self.nap, self.knobs.poll_sec)
        except store.QueueGone:
            raise   # the loop waits for the file (run)
        except Exception as exc:
            if not db_outage(exc):
                raise
            self.state.outage.failed(exc)   # the next turn of the loop backs off


def _claim(owner: str, pid: int, pid_start: float) -> dict[str, Any] | None:
    """Resume the usage-limit pauses whose reset has come, then claim the next task, skipping those
    on a provider account a pause still holds."""
    for task in store.resume_due():
        log(f"{task['id']} resumes: its provider's usage limit has reset", talk.VERBOSE)
    return store.claim_next(owner, pid, pid_start, default_account=_default_account())


def _default_account() -> str | None:
    """The provider of the default model, while some account is held (tasks without a model of
    their own run on it); None otherwise or when no default can be found (they are then claimed)."""
    if not store.held_accounts():
        return None
    try:
        return oc.default_model(store.default_model(), None,
                                cache_file=store.state_path("models.json")).model.split("/", 1)[0]
    except (oc.NoDefaultModel, oc.OpencodeNotFound, OSError, subprocess.SubprocessError):
        return None


def _say_budget(said: str | None, state: str) -> str | None:
    """Nothing was claimed: when the daily budget is why, say so in the heartbeat (``budget``)
    and once in the log. Returns the reason now in force (None when the budget is not spent)."""
    reason = store.budget_state()["reason"]
    if reason != current().beat.budget:
        current().beat.budget = reason
        current().beat.write(state)
    if reason and reason != said:
        log(f"claims nothing new: {reason}")
    return reason


def announce_start(watch: bool, slots: int) -> bool:
    """The start line: queue, default model (and where it comes from), slots, mode. Returns True."""
    try:
        choice = oc.default_model(db(store.default_model, patience=0), cache_file=store.state_path("models.json"))
        model = f"{choice.model} (default from {choice.source})"
    except (oc.NoDefaultModel, oc.OpencodeNotFound) as exc:
        model = f"none ({exc}); tasks that name no model will fail"
    except Exception as exc:
        if not db_outage(exc):
            raise
        model = "not known yet (the queue database does not answer)"
    engine = ("warm engine: a kept `opencode serve` per slot" if knobs.knob("WORKER_ENGINE") == 1
              else "cold engine: an `opencode run` per attempt")
    current().talk.started(store.database_label(), model, slots,
                           f"{engine}; " + ("watching for tasks (Ctrl-C stops)" if watch else "one pass"))
    current().talk.say(box_line())
    return True


def box_line() -> str:
    """What the worker says at start about the agent box: the mechanism, or why there is none,
    its fix, and what that means for restricted presets."""
    box = agent_box.choose("auto")
    if box.mechanism:
        return f"agent box: {box.label} (every run contained by the operating system)"
    then = ("they run prompt-level (TASKBRIDGE_ALLOW_PROMPT_LEVEL=1)" if agent_box.prompt_level_allowed()
            else "they fail at once (set TASKBRIDGE_ALLOW_PROMPT_LEVEL=1 to run them prompt-level)")
    return (f"no agent box: {box.reason}; fix: {box.fix}. Agents run uncontained; "
            f"readonly, no-shell and no-network tasks: {then}")


def _give_memory_back() -> None:
    """Hand the heap freed by finished tasks back to the OS while idle: glibc keeps it (in the slot
    threads' arenas) otherwise, and an idle --watch worker held ~5 MB more than it needs."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS): nothing to do
        pass


def _run_guarded(task: dict[str, Any], knobs: Knobs) -> None:
    """run_task, but a bug of ours fails the attempt with its reason instead of leaving it running."""
    current().beat.running(task, True)
    began, final, flags, unwritten = time.monotonic(), None, current().flags, False
    lost: str | None = None   # where its work was left, when the queue file went
    try:
        # A stop now is not held up by a locked queue: each write gives up its wait for the lock
        # (db() then raises, and the attempt is left to the reaper, below).
        with store.lock_wait(give_up=lambda: flags.stop_now):
            final = run_task(task, knobs)
    except Exception as exc:  # noqa: BLE001 - the queue must stay consistent whatever happens
        if isinstance(exc, (QueueLostMidRun, store.QueueGone)):   # nothing can be written: kept, handed back later
            gone = exc.gone if isinstance(exc, QueueLostMidRun) else exc
            current().lost.gone(gone)
            where = kept_work_words(getattr(exc, "ws", None))
            what = "replaced in use" if isinstance(gone, store.QueueReplaced) else "gone"
            with contextlib.suppress(Exception):   # a log beside no queue (SQLite's own files) still says why it stops
                store.append_task_log(task["id"], f"\n[worker] the run was ended: the queue file was {what}; {where}\n"
                                      .encode())
            current().lost.ended_attempt(task, where)
            lost = where + (   # said in its end line
                "; it goes back to the queue (no retry spent) once the file is put back" if current().lost.watch
                else "; once the file is put back, the next pass's reaper requeues it (spending a retry)")
        elif db_outage(exc):   # never the task's failure: nothing can be written, the reaper decides
            why = " ".join(str(exc).split("; check TASK_DB_URL")[0].split())
            log(f"{task['id']}: the worker stopped before the queue database could be written ({why}): the "
                "attempt is left to the next pass's reaper; its worktree and branch are kept" if flags.stop_now else
                f"{task['id']}: gave up writing to the queue database after WORKER_STALE_SEC ({knobs.stale_sec:g} s) "
                f"of outage ({why}): the attempt is left to the reaper; its worktree and branch are kept", talk.QUIET)
            unwritten = True
        elif (fault := os_faults.describe(exc)) is not None and (ours := worktrees.folders_problem()):
            # TaskBridge's own folder, not the task: handed back whole, and claims wait for the fix
            log(f"{task['id']}: {fault}; {ours}: the attempt is handed back (no retry spent)", talk.QUIET)
            final = _finish(store.requeue_attempt, task, task["run_marker"], f"{fault.line}; {ours}; handed back",
                            count_attempt=False)
        elif fault is not None:   # the machine's fault, named once, no traceback
            log(f"{task['id']}: {fault}", talk.QUIET)
            final = _finish(store.fail_attempt, task, task["run_marker"], fault.line, retryable=fault.retry)
        elif isinstance(exc, store.TaskNotFound):   # its row went: deleted, or the queue file replaced
            log(f"{task['id']}: the task is no longer in the queue {store.database_label()} (its row was removed, or "
                "the queue file was replaced by another): its run was ended; its worktree and branch are kept",
                talk.QUIET)
        else:
            log(f"{task['id']}: internal error: {traceback.format_exc()}", talk.QUIET)
            final = _finish(store.fail_attempt, task, task["run_marker"], f"worker internal error: {exc!r}")
    finally:
        current().beat.running(task, False)
        # a stop not yet said is said while it still names this task
        current().talk.signals(flags.stopping, flags.stop_now)
        now = _row_now(task["id"]) if final is None and not unwritten and lost is None else None
        current().talk.ended(task, final, time.monotonic() - began, handed_back=flags.stop_now, unwritten=unwritten,
                             lost=lost, now=now)


def _row_now(task_id: str) -> dict[str, Any] | None:
    """The task's row as it stands (for the end line of an attempt ended from outside): ``{"status":
    "gone"}`` when it was removed, None when the queue cannot be read now."""
    try:
        return store.get_task(task_id)
    except store.TaskNotFound:
        return {"status": "gone"}
    except Exception:  # noqa: BLE001 - an end line never fails the worker
        return None


def refuse(message: str) -> None:
    """Say why the queue cannot be used: in the worker log when this queue already has one, else
    on stderr only (launchd and systemd keep it), so a refused queue path gets no log beside it."""
    if store.state_path("worker.log").exists():
        log(message, talk.QUIET)
    else:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--watch", action="store_true", help="loop, picking new work up within a second")
    parser.add_argument("--max-tasks", type=int, default=None, help="stop after starting this many tasks (1 or more)")
    parser.add_argument("--slots", type=int, default=None,
                        help="how many tasks run at once, 1-16 (default $WORKER_SLOTS or 1)")
    parser.add_argument("-q", "--quiet", action="store_true", help="say only failures, errors and what a Ctrl-C does")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also say each attempt's details and every tool call the agent makes")
    parser.add_argument("--stop-at-once", action="store_true",
                        help="the first SIGTERM/SIGINT ends the runs in hand and hands them back (no retry "
                             "spent), as a second one does otherwise; serve.py starts its worker so")
    parser.add_argument("--db", metavar="URL", default=None,
                        help="the queue: a postgresql:// URL or a SQLite file (default $TASK_DB_URL, else "
                             "$TASK_DB_PATH or <repo>/tasks.db); sets TASK_DB_URL for this process")
    parser.add_argument("--engine", choices=("cold", "warm"), default=None,
                        help="cold: a new `opencode run` per attempt; warm: a kept `opencode serve` per slot, "
                             "started ahead of the slot's next task (default $WORKER_ENGINE: 0 cold, 1 warm)")
    return parser


def _refused() -> list[str]:
    """What stops the worker before anything starts: a bad knob, box setting or host name."""
    refused = knobs.problems() + agent_box.problems()
    try:
        store.host_name()
    except store.ValidationError as exc:
        refused.append(str(exc))
    return refused


def _no_queue_given(flag: str | None) -> list[str]:
    """A ``--db`` naming a SQLite file where no queue is (a typo, or a folder that is not there) is
    refused as tasks_cli.py refuses it: the worker makes a new queue only at its configured path
    (TASK_DB_PATH, serve.py's worker), never from a mistyped flag. A file a live worker lost and
    waits for is left to the store's own refusal (QueueGone)."""
    if flag is None or store.queue_exists() or store.queue_left_in_use():
        return []
    path = store.db_path()
    return [f"no queue at {path}: check --db / TASK_DB_PATH (a typo?); "
            f"`{store.script_command('tasks_cli.py', 'submit', '...')}` makes a new queue there, as does "
            f"`{store.script_command('serve.py')}`; nothing was made"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.engine is not None:   # the knob the worker reads (and what its runs inherit)
        os.environ["WORKER_ENGINE"] = "1" if args.engine == "warm" else "0"
    try:   # before anything touches the store
        knobs.select_database(args.db)
    except knobs.KnobError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    if args.max_tasks is not None and args.max_tasks < 1:
        parser.error(f"--max-tasks must be 1 or more; got {args.max_tasks} (leave it out for no limit)")
    refused = _refused() or _no_queue_given(args.db)
    if refused:   # before anything starts: a typo must not run with a default nor stop a task mid-run
        print("\n".join(f"worker: {line}" for line in refused), file=sys.stderr)
        return 2
    if args.slots is None:
        args.slots = knobs.knob("WORKER_SLOTS")
    state = fresh_state(at_once=args.stop_at_once, voice=Talk(
        talk.QUIET if args.quiet else talk.VERBOSE if args.verbose else talk.NORMAL, terminal=None))
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        if not 1 <= args.slots <= 16:
            parser.error(f"--slots must be from 1 to 16; got {args.slots}")
        return run_pass(watch=args.watch, max_tasks=args.max_tasks, slots=args.slots)
    except store.TaskStoreError as exc:   # its message names the queue and the way out
        refuse(f"error: {exc}")
        return 1
    except OSError as exc:
        fault = store.storage_fault(exc, exc.filename or store.db_path()) or os_faults.describe(exc)
        if fault is not None:   # a full or read-only disk, an open-files limit: named with the way out
            refuse(f"error: {fault}")
            return 1
        refuse(f"error: cannot use the queue database {store.database_label()}: {exc}; check TASK_DB_URL / "
               "TASK_DB_PATH (a readable, writable SQLite file and folder)")
        return 1
    finally:
        state.talk.close()


if __name__ == "__main__":
    sys.exit(main())
