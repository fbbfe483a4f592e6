"""What the worker says while it works: one line at start, one when a task is claimed and one when
it ends, what a Ctrl-C does, and on a terminal a live line with each running task's current step.

Used by ``worker.py`` only. Lines go to stderr (launchd and systemd keep it): on a terminal the
worker has in the foreground through rich, with a spinner line under them per running task (its
time, model call, last finished tool call); otherwise (a pipe, a file, a worker in the background
or in serve.py's session) as plain ``[HH:MM:SS] message`` lines, and no spinner. Levels: ``quiet`` (``-q``: errors,
the signal lines, nothing else), ``normal``, ``verbose`` (``-v``: also each attempt's details and
every tool call). Whatever the level, the normal lines are also appended to the worker log beside
the database (``store.state_path("worker.log")``), one ``<ISO time> <message>`` line each, kept
under ``LOG_MAX_BYTES`` (its older half is dropped); the board shows its tail.

Task text (titles, tool inputs) is shown with control characters escaped. Env: none of its own.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported only on a terminal: a worker under launchd/cron never pays for it
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

import redaction
import task_store as store
import task_views

QUIET, NORMAL, VERBOSE = 0, 1, 2
LOG_MAX_BYTES = 256 * 1024    # the worker log is cut to its newer half past this size
LIVE_REFRESH_PER_SEC = 4


def owns_terminal() -> bool:
    """Whether stderr is a terminal this process has in the foreground. A worker started in a
    session of its own (serve.py's) or in the background (``&``) prints plain lines instead of
    drawing a live line over someone else's output."""
    try:
        return sys.stderr.isatty() and os.tcgetpgrp(sys.stderr.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def plain(value: Any, limit: int = 120) -> str:
    """``value`` on one line, control characters escaped as the CLI escapes them (``\\x1b``,
    ``\\n``), cut to ``limit`` characters."""
    text = task_views.CONTROL_OR_BREAK_RE.sub(task_views.escape_char, str(value if value is not None else ""))
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Running:
    """A task in hand, as the live line shows it."""
    task_id: str
    title: str
    started: float = field(default_factory=time.monotonic)
    steps: int = 0             # model calls so far
    last_tool: str = ""        # the latest finished tool call (OpenCode reports a call when it ends)

    def status(self) -> str:
        seconds = int(time.monotonic() - self.started)
        parts = [f"{self.task_id} {seconds}s", f"model call {self.steps}" if self.steps else "starting opencode"]
        if self.last_tool:
            parts.append(f"last tool: {self.last_tool}")
        return " · ".join(parts)


class Talk:
    """The worker's voice: one per worker process (``worker.WorkerState.talk``), made at its start.
    ``level``: QUIET, NORMAL or VERBOSE; ``terminal``: rich and a live line (None: when stderr is
    a terminal this process has in the foreground; False, the default: plain lines)."""

    def __init__(self, level: int = NORMAL, terminal: bool | None = False) -> None:
        self.level = level
        self.lock = threading.RLock()
        self.live: Live | None = None
        self.running: dict[str, Running] = {}
        self.announced = 0      # how many stop signals have been announced
        self.console: Console | None = None
        if owns_terminal() if terminal is None else terminal:
            from rich.console import Console
            self.console = Console(stderr=True, highlight=False)

    # -- lines ------------------------------------------------------------------------------

    def say(self, message: str, level: int = NORMAL, style: str = "") -> None:
        """One line (shown at ``level`` and above); normal and quiet lines also go to the worker log.
        TaskBridge's secrets never reach either (redaction)."""
        if level > NORMAL and level > self.level:
            return   # before redacting: -v lines come per tool call, and most workers do not show them
        message = redaction.redact(message)
        if level <= NORMAL:
            write_log_line(message)
        if level > self.level:
            return
        # No lock of ours around printing: rich's live refresh holds the console's lock while it
        # renders the live line, so holding ours here as well could deadlock.
        console = self.console
        if console is not None:
            from rich.text import Text
            console.print(Text(f"[{time.strftime('%H:%M:%S')}] ", style="dim") + Text(message, style=style),
                          soft_wrap=True)
        else:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def started(self, queue: str, model: str, slots: int, mode: str) -> None:
        self.say(f"worker started (pid {os.getpid()}): queue {queue}; model {model}; "
                f"{slots} slot{'s' if slots != 1 else ''}; {mode}", style="bold")

    def claimed(self, task: dict[str, Any]) -> None:
        """A task taken in hand (the live line and the Ctrl-C lines name it); its line follows
        from `runs` once its model is known."""
        with self.lock:
            self.running[task["id"]] = Running(task["id"], plain(task["title"], 40))
        self._refresh()

    def runs(self, task: dict[str, Any], model: str | None) -> None:
        """The claimed line: title, attempt, model (None: no model could be chosen)."""
        self.say(f"{task['id']} claimed: {plain(task['title'], 80)} ({task_views.attempt_text(task)}, "
                f"model {plain(model, 80) if model else 'none'})", style="cyan")

    def ended(self, task: dict[str, Any], final: dict[str, Any] | None, seconds: float,
              handed_back: bool = False, unwritten: bool = False, lost: str | None = None,
              now: dict[str, Any] | None = None) -> None:
        """The task's end line: status, duration, cost, branch (or why it failed or waits; ``lost``,
        ``now``: see ``ended_line``)."""
        with self.lock:
            self.running.pop(task["id"], None)
        self._refresh()
        message, style = ended_line(task, final, seconds, handed_back, unwritten, lost, now)
        self.say(message, level=QUIET if style == "red" else NORMAL, style=style)

    def signals(self, stopping: bool, stop_now: bool) -> None:
        """Announce each stop signal once, naming what happens to the tasks in hand."""
        seen = 2 if stop_now else 1 if stopping else 0
        with self.lock:   # the loop and a slot's end both call this: each signal is said once
            if seen <= self.announced:
                return
            before, self.announced = self.announced, seen
            ids = ", ".join(sorted(self.running))
        if before < 1 and seen < 2:   # both at once (--stop-at-once): say only what happens
            self.say(f"finishing {ids} (Ctrl-C again to stop now)" if ids
                    else "stopping: no task in hand", level=QUIET, style="yellow")
        if seen == 2:
            self.say(f"stopping now: ending the run of {ids} and handing it back to the queue "
                    "(no retry spent; the worktree kept as the run left it)" if ids else "stopping now",
                    level=QUIET, style="yellow")

    # -- the live line --------------------------------------------------------------------

    def event(self, task_id: str, event: dict[str, Any]) -> None:
        """An event of a task's stream: the live line shows it; ``-v`` prints tool calls too."""
        kind = event.get("type")
        with self.lock:
            run = self.running.get(task_id)
            if run is not None and kind == "step_start":
                run.steps += 1
        if kind != "tool_use":
            return
        tool = tool_text(event)
        with self.lock:
            if run is not None:
                run.last_tool = tool
        self.say(f"{task_id} {tool}", level=VERBOSE, style="dim")

    def _refresh(self) -> None:
        if self.console is None or self.level == QUIET:
            return
        with self.lock:
            if self.running and self.live is None:
                from rich.live import Live
                self.live = Live(self._render(), console=self.console, transient=True,
                                refresh_per_second=LIVE_REFRESH_PER_SEC, get_renderable=self._render)
                self.live.start()
            elif not self.running and self.live is not None:
                self.live.stop()
                self.live = None

    def _render(self) -> Table:
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text
        grid = Table.grid(padding=(0, 1))
        for run in list(self.running.values()):   # a copy, without our lock (see `say`)
            grid.add_row(Spinner("dots", style="cyan"), Text(run.status(), overflow="ellipsis", no_wrap=True))
        return grid

    def close(self) -> None:
        with self.lock:
            if self.live is not None:
                self.live.stop()
                self.live = None


def tool_text(event: dict[str, Any]) -> str:
    """A finished tool call in a few words: ``bash: npm test``, ``write: /w/app.py (error)``."""
    part = event.get("part") or {}
    state = part.get("state") or {}
    args = state.get("input") or {}
    what = state.get("title") or args.get("command") or args.get("filePath") or args.get("pattern") or ""
    status = state.get("status") or ""
    return plain(f"{part.get('tool')}: {what}" + (f" ({status})" if status and status != "completed" else ""), 100)


def ended_line(task: dict[str, Any], final: dict[str, Any] | None, seconds: float,
               handed_back: bool = False, unwritten: bool = False, lost: str | None = None,
               now: dict[str, Any] | None = None) -> tuple[str, str]:
    """The end-of-task line and its style, from the task as claimed and as it ended
    (``handed_back``: the worker was told to stop at once and requeued it; ``unwritten``: the
    attempt's end could not be written to the queue, so ``final`` is None and the reaper decides;
    ``lost``: its run was ended because the queue file went: where its work was left, and what next;
    ``now``: when ``final`` is None because the attempt was ended from outside, the task's row as
    it stands after it (``{"status": "gone"}``: its row was removed; None: not read), which says
    what ended it: see ``ended_from_outside``)."""
    ident = task["id"]
    took = f"{seconds:.1f} s" if seconds < 100 else f"{seconds / 60:.1f} min"
    if final is None:
        return _unrecorded_line(task, took, unwritten, lost, now)
    usage = final.get("usage") if isinstance(final.get("usage"), dict) else {}
    cost = f", ${usage.get('cost_usd', 0):.4f}" if usage else ""
    status = final["status"]
    if status == "done":
        branch = f", branch {final['branch']}" if final.get("branch") else " (in place)"
        if final.get("branch") and not (final.get("result") or {}).get("commit"):
            branch = f", no change: nothing committed on {final['branch']}"
        if (final.get("result") or {}).get("branch_deleted"):
            branch = f", no change: nothing committed; its empty branch {final['result']['branch_deleted']} was deleted"
        if final.get("repo"):
            branch = f", pushed {final['pushed_branch']} to {final['repo']}" if final.get("pushed_branch") \
                else f", nothing pushed to {final['repo']} (no change)"
        return f"{ident} done in {took}{cost}{branch}", "green"
    if status == "pending" and handed_back:
        return f"{ident} handed back to the queue after {took}{cost} (worker stopped; no retry spent)", "yellow"
    if status == "pending" and (final.get("handbacks") or 0) > (task.get("handbacks") or 0):   # a dead kept server
        return f"{ident} handed back to the queue after {took}{cost} (no retry spent): " \
               f"{plain(final.get('error'), 200)}", "yellow"
    if status == "pending":
        return f"{ident} failed attempt {task['attempts']} after {took}{cost}; requeued for a retry: " \
               f"{plain(final.get('error'), 200)}", "yellow"
    if status == "waiting" and final.get("paused_for") == "permission":
        return f"{ident} waiting after {took}{cost}: it asks permission. {plain(final.get('question'), 200)}", "magenta"
    if status == "waiting" and final.get("paused_for") == "usage_limit":
        return f"{ident} paused at its provider's usage limit after {took}{cost}: " \
               f"{plain(final.get('question'), 200)}", "magenta"
    if status == "waiting" and final.get("paused_for"):
        return f"{ident} paused at its spending limit after {took}{cost}: " \
               f"{plain(final.get('question'), 200)}", "magenta"
    if status == "waiting":
        return f"{ident} waiting after {took}{cost}: it asks {plain(final.get('question'), 160)}", "magenta"
    if status == "cancelled":
        return f"{ident} cancelled after {took}", "yellow"
    return f"{ident} {status} after {took}{cost}: {plain(final.get('error'), 300)}", "red"


REAPED_PREFIX = "lease of attempt "   # how the error of an attempt the reaper ended begins (worker.reap)


def ended_from_outside(task: dict[str, Any], now: dict[str, Any] | None) -> str:
    """What ended the claimed attempt ``task`` from outside the worker (its writes fenced off), in
    words, from the task's row ``now`` (see ``ended_line``): a cancel (with its reason), another
    attempt that took the task over after its lease was judged dead, the reaper's hand-back, a
    person finishing it by hand, its row removed; or that the queue could not say."""
    if now is None:
        return "it was ended from outside the worker (the queue could not be read to say how: " \
               f"`tasks_cli.py show {task['id']}` tells)"
    if now.get("status") == "gone":
        return "the task is no longer in the queue (its row was removed, or the queue file replaced)"
    if now.get("run_marker") != task["run_marker"]:
        return (f"taken over by attempt {now.get('run_marker')} (this attempt's lease was judged dead and the task "
                f"claimed again; it is {now['status']} now)")
    if now["status"] == "cancelled":
        reason = plain(now.get("error"), 200)
        result = given if isinstance(given := now.get("result"), dict) else {}
        branch = f"; it committed nothing: its empty branch {result['branch_deleted']} was deleted" \
            if result.get("branch_deleted") else f"; its branch {now['branch']} is kept" if now.get("branch") else ""
        return "the task was cancelled" + (f" ({reason})" if reason and reason != "cancelled" else "") + \
            "; its run was ended" + branch
    if now["status"] in ("pending", "failed") and (now.get("error") or "").startswith(REAPED_PREFIX):
        then = "handed it back to the queue" if now["status"] == "pending" else "failed it, its retries spent"
        return f"its lease was judged dead and the reaper {then}"
    return f"it was ended from outside the worker: the task is {now['status']} now"


def _unrecorded_line(task: dict[str, Any], took: str, unwritten: bool, lost: str | None,
                     now: dict[str, Any] | None) -> tuple[str, str]:
    """The end line of an attempt whose end this worker did not record (``ended_line``'s words)."""
    ident = task["id"]
    if lost is not None:
        return f"{ident} attempt ended after {took}: its run was ended, the queue file is gone; {lost}", "red"
    if unwritten:
        return f"{ident} attempt ended after {took}: its end could not be written to the queue; left running " \
               "for the reaper (the next pass hands it back)", "yellow"
    return f"{ident} attempt ended after {took}: {ended_from_outside(task, now)}", "yellow"


_log_lock = threading.Lock()


def write_log_line(message: str) -> None:
    """Append ``<ISO time> <message>`` to the worker log beside the database, cut to its newer
    half once it passes LOG_MAX_BYTES. A log that cannot be written is skipped (never fatal), as
    is one whose folder went away with the queue file (it is not made again beside nothing)."""
    path = store.state_path("worker.log")
    if not path.parent.is_dir() and store.queue_gone():
        return
    entry = f"{store.iso(time.time())} {plain(message, 2000)}\n".encode()
    with _log_lock:
        try:
            # 0600: the log names tasks and their errors, for this user only.
            with store.append_private(path) as handle:
                handle.write(entry)
                size = handle.tell()
            if size > LOG_MAX_BYTES:
                data = path.read_bytes()[-LOG_MAX_BYTES // 2:]
                store.write_private(path, data[data.find(b"\n") + 1:])
        except OSError:
            pass
