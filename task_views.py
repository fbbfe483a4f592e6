"""How a task, the queue and the worker look from outside: the shapes the MCP tools, the board's
HTTP API and the CLI all show, built once here.

- ``info`` / ``row``: a task as the tools return it (a full record, or a list row with long
  error and question text cut); ``cap_json`` shortens long lists and strings in a receipt.
- ``judge_worker``: a worker's heartbeat judged once (seen, recent, whether its process still
  runs, whether it died mid-run) with a one-line summary; ``worker_state`` judges the worker
  that reported last and ``workers_state`` every worker on every host; ``queue_snapshot``:
  tallies, the oldest pending task, the default model and those worker states;
  ``current_default_model``: the model a task without one runs with (from
  ``opencode_runner.default_model``, cached answers only).
- ``shown`` / ``shown_task`` / ``shown_log``: what is shown, TaskBridge's own secrets redacted.
- ``page_utf8`` / ``read_log_page``: text (a task's log through the store, or a file) paged by
  bytes, never splitting a UTF-8 character.

No SQL here (it lives in task_store); not run on its own; nothing happens at import time. Env: none of its own (the
store reads TASK_DB_PATH and TASK_LOG_DIR at call time).
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from typing_extensions import TypedDict

import agent_box
import knobs
import opencode_runner as oc
import process_tree
import redaction
import task_store as store
import worktrees

VERSION = "0.1.0"               # TaskBridge's version, as /health, ping and /api/status report it
ROW_TEXT_MAX = 300              # characters of error/question per list row
WORKER_RECENT_SEC = 180         # a heartbeat younger than this counts as a recent worker (it fires every 60 s)
# A worker on another host (its pid cannot be checked here) refreshes its row at least every
# task_store.WORKER_ROW_EVERY_SEC (5 s) while it lives: silent for six of those, it is not online.
WORKER_ELSEWHERE_SILENT_SEC = 30
QUIET_STATES = ("stopped", "pass")   # states in which a worker's process may end without dying mid-run

# Task text never reaches a terminal raw (tasks_cli's output, the worker's lines): C0 controls, DEL,
# C1 controls (0x9b is a one-byte CSI), and the bidi overrides and isolates that reorder what is
# shown ("Trojan Source"). CONTROL_OR_BREAK_RE adds tab and newline, for one-line fields.
CONTROL_CHARS = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
CONTROL_RE = re.compile(f"[{CONTROL_CHARS}]")
CONTROL_OR_BREAK_RE = re.compile(rf"[{CONTROL_CHARS}\t\n]")


def escape_char(match: re.Match) -> str:
    """One matched control character as a visible escape: ``\\x1b``, ``\\n``, ``\\u202e``."""
    code = ord(match.group())
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    return named.get(code) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


class TaskRow(TypedDict):
    """A task as list_tasks shows it (times ISO 8601 UTC; durations seconds)."""
    id: str
    title: str
    status: str
    priority: int
    model: str | None
    working_dir: str                   # '' for a task on a remote (repo)
    repo: str | None                   # the git remote the task works on (its branch is pushed there)
    base_ref: str | None               # the remote's ref it starts from (None: the remote's HEAD branch)
    host: str | None                   # the host whose workers may claim it (None: any)
    pushed_branch: str | None          # the branch pushed to repo, once pushed
    pushed_commit: str | None          # the commit pushed to repo as pushed_branch
    permission: str
    attempts: int
    max_retries: int
    timeout_sec: int
    origin_name: str | None
    origin_version: str | None
    origin_kind: str | None
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    heartbeat_at: str | None
    error: str | None
    question: str | None
    branch: str | None
    spent_usd: float
    max_cost_usd: float | None
    resume_at: str | None              # a task paused at its provider's usage limit resumes by itself then


class TaskInfo(TaskRow):
    """A task as submit/answer/cancel return it (times ISO 8601 UTC; durations seconds)."""
    agent: str | None
    worktree: bool
    worktree_keep: bool
    depends_on: list[str]
    idempotency_key: str | None
    answer: str | None
    worktree_path: str | None
    session_id: str | None
    spent_tokens: int
    max_tokens: int | None
    paused_for: str | None
    continue_from: str | None          # a follow-up of this task (same session and branch)
    fork_from: str | None              # a fork of this task (own branch, copy of the session)
    rules: dict[str, Any] | None       # the task's own permission rules (OpenCode's format)
    skills: list[str] | None
    subagents: list[str] | None
    pending_ask: dict[str, Any] | None  # the permission request it waits on: tool, subject, reason (+ decision)
    lease_host: str | None             # the host of the worker that holds (or last held) the lease
    limit_account: str | None          # the provider whose usage limit it paused at (held until resume_at)
    limit_pauses: list[dict[str, Any]] | None  # each usage-limit pause: at, until, provider, said, resumed_at
    schedule_timeout_sec: int | None   # queued longer than this without starting: start_overdue says so
    start_overdue: str | None          # the warning once that is passed


class WorkerState(TypedDict):
    """A worker's heartbeat, judged (ages in seconds; ``at`` and ``started_at`` ISO 8601 UTC)."""
    seen: bool
    name: str | None                   # worker:<host>:<pid>, as its leases' owner
    state: str | None                  # the state word it last wrote (a gone worker's is what it said then)
    task: str | None                   # the first of ``tasks``
    tasks: list[str]                   # the tasks it runs: an online or stale worker's ([] once gone or stopped)
    last_tasks: list[str]              # the tasks it said it ran when it last reported
    gone_since: str | None             # its last heartbeat (ISO 8601 UTC) once it is gone or stopped, else None
    slots: int | None
    engine: str | None                 # "cold" or "warm" (WORKER_ENGINE); None from a worker before it was said
    pid: int | None
    host: str | None
    started_at: str | None
    at: str | None
    age_sec: float | None
    pid_running: bool | None
    recent: bool
    died: bool
    label: str
    summary: str
    extra: dict[str, Any]


class BudgetState(TypedDict):
    """The queue's spending today (local day) against its daily budget (USD; None = no budget)."""
    day: str
    spent_usd: float
    spent_tokens: int
    daily_usd: float | None
    daily_tokens: int | None
    default_max_cost_usd: float | None
    default_max_tokens: int | None
    exhausted: bool
    reason: str | None
    resets_at: str | None


class QueueStatus(TypedDict):
    counts: dict[str, int]
    total: int
    claimable: int
    oldest_pending: str | None
    oldest_pending_age_sec: float | None
    default_model: str | None
    worker: WorkerState                # the worker that reported last (any host)
    workers: list[WorkerState]         # every worker that reported, any host, newest heartbeat first
    database: str
    budget: BudgetState
    held_accounts: list[dict[str, Any]]   # provider accounts a usage-limit pause holds: account, until, tasks
    start_overdue: list[dict[str, Any]]   # pending tasks past their schedule timeout: id, warning


# --------------------------------------------------------------------------------------------
# A task as a dict.

_INFO_KEYS = tuple(TaskInfo.__annotations__)
_ROW_KEYS = tuple(TaskRow.__annotations__)


def shown(value: Any) -> Any:
    """``value`` (a task, a receipt, a log page, a tool's answer: any JSON shape, str or bytes) as
    it may be shown: every text in it with the values of TaskBridge's own secrets replaced by
    labels (``redaction.redact_deep``). The second line behind the worker's redaction at write
    time, for logs and receipts stored before it, or by a worker that held other secrets; the
    board's API, the MCP tools and the CLI's views pass what they show through here. Offsets
    and sizes are the stored bytes' (a label is not as long as the value it replaces)."""
    return redaction.redact_deep(value)


def shown_task(task_id: Any) -> dict[str, Any]:
    """``store.get_task(task_id)`` as it may be shown (``shown``). Raises TaskNotFound,
    ValidationError (malformed id)."""
    return shown(store.get_task(task_id))


def shown_log(task_id: Any, offset: int = 0) -> tuple[bytes, int]:
    """A task's log from byte ``offset`` to its end as it may be shown (``shown``), and the
    stored offset it ends at (where a follower reads on). Raises ValidationError (malformed id)."""
    data = store.read_task_log(task_id, offset)
    return shown(data), offset + len(data)


def model_shown(task: dict[str, Any]) -> str:
    """The model a task runs on, as a person reads it: its own ``model``; else the one its last
    run used (the receipt's ``model``, or a list row's ``ran_model``) marked as the default; else
    ``default``, for a task no run has recorded yet (the worker picks it at claim)."""
    if task.get("model"):
        return task["model"]
    given = task.get("result")
    result = given if isinstance(given, dict) else {}
    ran = result.get("model") or task.get("ran_model")
    return f"{ran} (the default)" if ran else "default (chosen when it runs)"


def info(task: dict[str, Any]) -> dict[str, Any]:
    """A store task dict reduced to the TaskInfo fields."""
    return {key: task.get(key, [] if key == "depends_on" else None) for key in _INFO_KEYS}


def attempt_counts(task: dict[str, Any]) -> tuple[int, int, int]:
    """(counted, allowed, not counted) attempts, as the store judges a retry: hand-backs (the worker
    stopping, a spending-limit pause) and the tries before a manual retry keep their attempt numbers
    but spend none of the ``max_retries + 1`` allowed."""
    uncounted = (task.get("handbacks") or 0) + (task.get("spent_before_retry") or 0)
    return task["attempts"] - uncounted, task["max_retries"] + 1, uncounted


def attempt_text(task: dict[str, Any]) -> str:
    """``attempt 2 of 2``, or with attempts that spent no retry ``attempt 4 (1 of 2 counted; not
    counted: 1 hand-back, 2 before a retry)``: the one wording the worker's claimed line and
    ``show`` use. The number is the attempt's own (its run marker's ``aN``, the worker log's
    ``attempt N:``); the counted ones are what the retry budget spent."""
    counted, allowed, _ = attempt_counts(task)
    handbacks, before = task.get("handbacks") or 0, task.get("spent_before_retry") or 0
    parts = ([f"{handbacks} hand-back" + ("s" if handbacks != 1 else "")] if handbacks else []) + \
        ([f"{before} before a retry"] if before else [])
    if not parts:
        return f"attempt {counted} of {allowed}"
    return f"attempt {task['attempts']} ({counted} of {allowed} counted; not counted: {', '.join(parts)})"


def short(text: str | None, limit: int = ROW_TEXT_MAX) -> str | None:
    """``text`` cut to ``limit`` characters (ending in …); None stays None."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"


def row(task: dict[str, Any]) -> dict[str, Any]:
    """A store task dict as a list row (TaskRow; error and question cut to 300 characters)."""
    shaped = {key: task.get(key) for key in _ROW_KEYS}
    shaped["error"], shaped["question"] = short(shaped["error"]), short(shaped["question"])
    return shaped


def cap_json(value: Any, items: int = 100, chars: int = 4000) -> tuple[Any, bool]:
    """Shorten long lists (to their last ``items``) and strings (to ``chars``) inside a receipt;
    returns (value, whether anything was cut)."""
    if isinstance(value, str):
        return (value, False) if len(value) <= chars else (value[:chars] + "…", True)
    if isinstance(value, list):
        capped = [cap_json(v, items, chars) for v in value[-items:]]
        return [v for v, _ in capped], len(value) > items or any(c for _, c in capped)
    if isinstance(value, dict):
        capped_d = {k: cap_json(v, items, chars) for k, v in value.items()}
        return {k: v for k, (v, _) in capped_d.items()}, any(c for _, c in capped_d.values())
    return value, False


# --------------------------------------------------------------------------------------------
# The worker and the queue.


_BEAT_KEYS = frozenset(WorkerState.__annotations__) | {"ts", "pid_start"}


def worker_label(seen: bool, recent: bool, running: bool | None, died: bool, stopped: bool = False) -> str:
    """The one word a person reads for the worker: ``never seen``, ``gone`` (its process ended
    mid-run), ``stopped`` (it ended cleanly: after a one-pass run or a Ctrl-C; ``stopped``: it
    said so, which is all a reader on another host can know), ``online`` (its heartbeat is
    recent and its process runs, or it runs on another host) or ``stale`` (silent: see
    ``judge_worker``)."""
    if not seen:
        return "never seen"
    if died:
        return "gone"
    if running is False or stopped:   # one that said it stopped claims nothing more while it exits
        return "stopped"
    return "online" if recent else "stale"


def gone_words(worker: dict[str, Any]) -> str:
    """What a worker whose process is gone without saying it stopped (``died``) left: its tasks,
    which the next pass requeues, or none (killed while idle: nothing to requeue)."""
    tasks = worker.get("last_tasks") or worker.get("tasks") or ([worker["task"]] if worker.get("task") else [])
    if tasks:
        return f"it died mid-run; the next pass requeues {', '.join(map(str, tasks))}"
    return "it ended without saying it stopped (killed?) while it held no task"


def stale_tasks_words(tasks: list[str]) -> str:
    """What a stale worker's tasks are: still its own (it may be running them), until their
    leases' heartbeat is WORKER_STALE_SEC old and the next worker pass requeues them."""
    try:
        limit = f"{knobs.knob('WORKER_STALE_SEC'):g} s"
    except knobs.KnobError:
        limit = "WORKER_STALE_SEC"   # the entry points refuse a bad value with its own line
    return (f"it may still be running {', '.join(map(str, tasks))}: the reaper leaves their leases to it until "
            f"their heartbeat is {limit} old (WORKER_STALE_SEC), then the next worker pass requeues them; retry "
            "or cancel them sooner only if you know that worker is gone")


def worker_state() -> dict[str, Any]:
    """The worker that reported last, from any host (``task_store.list_workers``), judged as
    ``judge_worker`` does; the heartbeat file beside the database when the table has none or
    the database cannot be read (the worker's liveness is still told then). A queue that does
    not exist yet is not made by asking."""
    try:
        rows = store.list_workers() if store.queue_exists() else []
    except (store.TaskStoreError, OSError):
        rows = []
    return judge_worker(rows[0] if rows else store.read_worker_heartbeat())


def no_worker_note() -> str | None:
    """What a person queuing a task should hear when no worker serves this queue now (none seen
    lately on any host: never run, its process gone, its schedule not installed): the task waits
    until one runs, and how to start one. None when a worker is serving it, or it cannot be told."""
    try:
        workers = workers_state()
    except (store.TaskStoreError, OSError):
        return None
    if any(worker["recent"] for worker in workers):
        return None
    last = workers[0] if workers else judge_worker(None)
    return f"no worker serves this queue now, so it waits until one runs: {last['summary']}"


def workers_state() -> list[dict[str, Any]]:
    """Every worker that reported to this queue from any host, newest heartbeat first, each judged
    (WorkerState): a stale or dead worker's row stays listed as ``stale`` or ``gone``. None
    (and no queue made) when the queue does not exist yet."""
    return [judge_worker(beat) for beat in store.list_workers()] if store.queue_exists() else []


def _worker_process_lives(beat: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``beat`` still runs: None when it was written on another
    host; on this one its pid, and its start time where the beat has it (``pid_start``), so a pid
    reused by another program is not taken for the worker."""
    running = beat.get("pid_running")
    if running and beat.get("pid_start") is not None:
        return process_tree.same_process(beat.get("pid"), beat["pid_start"]) is not None
    return running


def _beat_said(beat: dict[str, Any], running: bool | None, age: float, silent_after: float) -> str:
    """The summary's head: who reported when, what it was doing, whether its process runs."""
    said = f"worker pid {beat.get('pid')} last reported {age:.0f} s ago, state {beat.get('state') or 'unknown'}"
    if beat.get("task"):
        said += f", task {beat['task']}"
    said += "; its process is " + ("running" if running else "gone" if running is False
                                   else f"on another host ({beat.get('host')})")
    if running and abs(age) > silent_after:
        said += (f" (pid and start time checked), so it counts as alive although its heartbeat's time is "
                 f"{abs(age):.0f} s off this clock: a clock that jumped or differs")
    return said



def holder_gone(task: dict[str, Any]) -> bool:
    """Whether a running task's worker process is gone: it was claimed on this host by a process
    (``lease_pid`` and its start time, as the store keeps them) that no longer runs. Such a task
    is requeued by the next worker pass; until then its log grows no more. False for any other
    status, a lease taken on another host (its pid means nothing here) or without a pid."""
    if task["status"] != "running" or not task.get("lease_pid") or task.get("lease_host") != store.host_name():
        return False
    return process_tree.same_process(task["lease_pid"], task["lease_pid_start"]) is None


def judge_worker(beat: dict[str, Any] | None) -> dict[str, Any]:
    """One heartbeat (a ``list_workers`` row or ``read_worker_heartbeat``), judged (WorkerState):
    ``recent`` for a worker on this host whose process (pid and start time) still runs, whatever
    its heartbeat's age, or whose heartbeat is younger than 180 s (WORKER_RECENT_SEC); for one on
    another host, a heartbeat younger than 30 s (WORKER_ELSEWHERE_SILENT_SEC) by the queue's clock
    (it refreshes its row every 5 s while it lives); ``pid_running`` (None when it was written on another
    host), ``died`` when its process is gone although it was not stopped or between passes,
    ``label`` (``worker_label``), a one-line summary saying what to do, and in ``extra`` any other
    field the worker wrote (an ``error``, for one). ``tasks`` (and ``task``) are what it runs: an
    online worker's, and a stale one's (silent on another host, it may still run them: their leases
    stay its own until their heartbeat is WORKER_STALE_SEC old, and the summary says so); one gone
    or stopped runs none, what it said it ran is ``last_tasks`` and its last heartbeat
    ``gone_since``. None: no worker ever reported."""
    if beat is None:
        return {"seen": False, "name": None, "state": None, "task": None, "tasks": [], "last_tasks": [],
                "gone_since": None, "slots": None, "engine": None,
                "pid": None, "host": None, "started_at": None, "at": None, "age_sec": None,
                "pid_running": None, "recent": False, "died": False, "extra": {},
                "label": worker_label(False, False, None, False),
                "summary": f"no worker has run on this queue yet; run `{store.script_command('worker.py')}` "
                           f"(one pass), `{store.script_command('worker.py', '--watch')}`, or the restart_worker tool"}
    running = _worker_process_lives(beat)
    age: float = beat["age_sec"]   # every heartbeat the store gives has its age
    silent_after = WORKER_RECENT_SEC if running is not None else WORKER_ELSEWHERE_SILENT_SEC
    # A live worker process here is never called dead by its heartbeat's age alone: the age sets
    # two wall-clock readings against each other, and a clock jumps (sleep, NTP, by hand) or
    # differs per process (faketime) while the process goes on working.
    recent = bool(running) or (age is not None and age <= silent_after)
    state = beat.get("state")
    tasks = beat.get("tasks")
    tasks = tasks if isinstance(tasks, list) else [t for t in [beat.get("task")] if t]
    # Gone with tasks in hand is dying mid-run whatever the state word (a pass with --max-tasks
    # reached keeps saying "pass" while its last task runs).
    died = running is False and (state not in QUIET_STATES or bool(tasks))
    summary = _beat_said(beat, running, age, silent_after)
    if running is False and state == "pass" and not died:
        summary += " (a one-pass worker exits after each pass; the schedule starts the next)"
    if beat.get("budget"):
        summary += f"; claims nothing new: {beat['budget']}"
    if running is None and state == "stopped":
        summary += "; it said it stopped"
    elif not recent:
        summary += (f"; no heartbeat for over {WORKER_RECENT_SEC} s: is the schedule installed? restart_worker "
                    "starts a pass" if running is not None else
                    f"; no heartbeat for over {silent_after} s: is the worker on {beat.get('host')} still running?")
    label = worker_label(True, recent, running, died, stopped=state == "stopped")
    if label == "stale" and tasks:
        summary += "; " + stale_tasks_words(tasks)
    # What it runs now: a worker gone or stopped runs nothing; what it last said stays in last_tasks
    # (a dead worker's tasks are the next pass's to requeue). A stale one (silent on another host)
    # may still run its tasks: the reaper leaves their leases alone until WORKER_STALE_SEC, so a
    # reader must not be told they run under no one (a planner would retry or cancel work going on).
    ended = label in ("gone", "stopped")
    return {"seen": True, "name": beat.get("name"), "state": state, "task": None if ended or not tasks else tasks[0],
            "tasks": [] if ended else tasks, "last_tasks": tasks, "gone_since": beat.get("at") if ended else None,
            "slots": beat.get("slots"), "engine": beat.get("engine"), "pid": beat.get("pid"), "host": beat.get("host"),
            "started_at": beat.get("started_at"), "at": beat.get("at"), "age_sec": age,
            "pid_running": running, "recent": recent, "died": died, "summary": summary,
            "label": label, "extra": {k: v for k, v in beat.items() if k not in _BEAT_KEYS}}


def models_cache_file() -> Path:
    """Where answers of `opencode models` / `opencode debug config` are kept for a minute,
    beside the database (the MCP server, the CLI and the worker share it)."""
    return store.state_path("models.json")


def current_default_model(ask: bool = False) -> str | None:
    """The model a task without one runs with (``opencode_runner.default_model``); None when it
    cannot be told. Without ``ask`` OpenCode is not run: only cached answers count (a status
    view must not wait seconds on it)."""
    try:
        return oc.default_model(store.default_model(), cache_file=models_cache_file(), ask=ask).model
    except (LookupError, oc.NoDefaultModel, oc.OpencodeNotFound, OSError, subprocess.TimeoutExpired):
        return None


def limit_warnings(task: dict[str, Any]) -> list[str]:
    """What a submit says about a task's spending limit: a dollar limit on a model OpenCode prices
    at 0 (or gives no price) never triggers, so it is flagged with the way out (``max_tokens``).
    The model is the task's own, else the default; both are judged from cached answers of
    OpenCode only (a submit never waits on it), so nothing is said when none is cached."""
    if task.get("max_cost_usd") is None or task.get("max_tokens") is not None:
        return []
    model = task.get("model") or current_default_model()
    try:
        models = oc.known_models(cache_file=models_cache_file(), ask=False) if model else []
    except (LookupError, OSError, ValueError):
        return []
    listed = next((m for m in models if m["id"] == model), None)
    if listed is None or not oc.is_free(listed):
        return []
    return [f"{task['id']}: OpenCode reports no price for {model} (cost 0), so max_cost_usd "
            f"${task['max_cost_usd']:g} can never be reached; give max_tokens (tokens) to limit it, "
            "or declare the model's cost in your OpenCode config"]


def submit_warnings(task: dict[str, Any], in_place: dict[str, bool | None] | None = None) -> list[str]:
    """Everything a submit warns about a task just queued (one line each, naming the way out):
    its spending limit (`limit_warnings`), a folder outside any git repository, where the agent
    changes the files in place, and no model chosen anywhere (OpenCode's hosted free model would
    run it; judged from the worker's and doctor's cached answers of OpenCode: a submit never
    waits on it). ``in_place``: as `place_warnings` takes it. Raises nothing."""
    hosted = hosted_model_note() if not task.get("model") else None
    return limit_warnings(task) + place_warnings(task, in_place) + ([f"{task['id']}: {hosted}"] if hosted else [])


def hosted_model_note(ask: bool = False) -> str | None:
    """`opencode_runner.hosted_free_note` for this queue's default model, or None (also when it
    cannot be told). Without ``ask`` only cached answers of OpenCode count."""
    try:   # connect may run before any queue exists: it must not make one
        setting = store.default_model() if store.queue_exists() else None
        choice = oc.default_model(setting, cache_file=models_cache_file(), ask=ask)
    except (LookupError, oc.NoDefaultModel, oc.OpencodeNotFound, OSError, subprocess.TimeoutExpired,
            store.TaskStoreError):
        return None
    return oc.hosted_free_note(choice)


def place_warnings(task: dict[str, Any], in_place: dict[str, bool | None] | None = None) -> list[str]:
    """A folder task that asked for a worktree but whose folder is in no git repository: it
    runs in place (no branch to review, nothing to undo), which a person should hear at once.
    ``in_place``: folder → `worktrees.refuse_unrunnable_folder`'s answer, from the submit's own
    check (a folder not in it, or None there, is asked of git)."""
    folder = task.get("working_dir")
    if task.get("repo") or not task.get("worktree") or not isinstance(folder, str) or not os.path.isdir(folder):
        return []
    known = (in_place or {}).get(folder)
    if not (worktrees.runs_in_place(folder) if known is None else known):
        return []
    return [f"{task['id']}: {folder} is not in a git repository, so the agent will change its files in place "
            "(no worktree, no branch to review, nothing to undo); cancel it and `git init` and commit "
            "there first, or resubmit on a repository, if that is not what you want"]


def queue_snapshot() -> dict[str, Any]:
    """Tallies, oldest pending, default model, worker liveness, today's spend and the daily budget
    (QueueStatus: the queue_status tool, /api/status, `tasks_cli.py status`)."""
    summary = store.queue_summary()
    workers = workers_state()
    return summary | {"total": sum(summary["counts"].values()), "default_model": current_default_model(),
                      "worker": workers[0] if workers else worker_state(), "workers": workers,
                      "database": store.database_label(),
                      "budget": store.budget_state(), "held_accounts": store.held_accounts(),
                      "start_overdue": store.overdue_tasks()}


# --------------------------------------------------------------------------------------------
# Paging text by bytes without splitting a UTF-8 character.


def _char_start(data: bytes, pos: int) -> int:
    """The first character boundary at or after ``pos`` (skips UTF-8 continuation bytes)."""
    while pos < len(data) and data[pos] & 0xC0 == 0x80:
        pos += 1
    return pos


def _char_end(data: bytes, pos: int) -> int:
    """The last character boundary at or before ``pos``."""
    while 0 < pos < len(data) and data[pos] & 0xC0 == 0x80:
        pos -= 1
    return pos


def page_utf8(data: bytes, offset: int, limit: int) -> tuple[str, int, int]:
    """A page of ``data`` from byte ``offset``, at most ``limit`` bytes, cut on character
    boundaries (a page always holds at least one character). Returns (text, start, end) with byte
    offsets; ``end`` is the next page's offset."""
    start = _char_start(data, min(offset, len(data)))
    end = min(len(data), start + limit)
    if end < len(data):
        end = _char_end(data, end)
        if end <= start < len(data):        # a limit below one character: return that character
            end = _char_start(data, start + 1)
    return data[start:end].decode("utf-8", errors="replace"), start, end


def file_size(path: Path) -> int:
    """Size of ``path`` in bytes; 0 when it does not exist or cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_log_page(source: Path | str, offset: int | None, tail_lines: int, max_bytes: int) -> dict[str, Any]:
    """Either ``max_bytes`` from byte ``offset`` on, or the last ``tail_lines`` lines (at most
    ``max_bytes``) of a log: ``source`` is a file (a Path: the worker's own log) or a task id (its
    log through the store: the file on SQLite, the database's chunks on PostgreSQL). Returns
    {exists, size, offset, next_offset, truncated, text}. Raises store.ValidationError when
    ``offset`` is past the end of the log (or the task id is malformed)."""
    if isinstance(source, Path):
        size, exists = file_size(source), source.exists()

        def read(at: int, limit: int) -> bytes:
            with source.open("rb") as handle:
                handle.seek(at)
                return handle.read(limit)
    else:
        size = store.task_log_size(source)
        exists = size > 0

        def read(at: int, limit: int) -> bytes:
            return store.read_task_log(source, at, limit)
    if not exists:
        if offset:
            raise store.ValidationError(f"offset {offset} is past the end of the log (it has no bytes yet)")
        return {"exists": False, "size": 0, "offset": 0, "next_offset": 0, "truncated": False, "text": ""}
    if offset is not None:
        if offset > size:
            raise store.ValidationError(
                f"offset {offset} is past the end of the log ({size} bytes); pass the next_offset "
                "of your last call, or leave offset out to get the tail")
        text, start, end = page_utf8(read(offset, max_bytes + 4), 0, max_bytes)
        start, end = offset + start, offset + end
        return {"exists": True, "size": size, "offset": start, "next_offset": end,
                "truncated": end < size, "text": text}
    begin = max(0, size - max_bytes)
    data = read(begin, size - begin)
    skip = _char_start(data, 0)
    text = data[skip:].decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    if begin > 0 and len(lines) > 1:
        lines = lines[1:]                          # the block began mid-line: show whole lines only
    kept = lines[-tail_lines:]
    shown = "".join(kept)
    cut = len(kept) < tail_lines and begin > 0     # wanted more lines than the byte cap allowed
    return {"exists": True, "size": size, "offset": size - len(shown.encode("utf-8", errors="replace")),
            "next_offset": size, "truncated": cut, "text": shown}


# --------------------------------------------------------------------------------------------
# Transcripts.

TRANSCRIPT_PAGE_MAX = 100   # turns per page


def line_of_work(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The tasks a task builds on through continue_from / fork_from, first task first, ending
    with ``task`` itself (a task whose predecessor was cleared starts the line there)."""
    line, seen = [task], {task["id"]}
    while (parent := line[0].get("continue_from") or line[0].get("fork_from")) and parent not in seen:
        try:
            line.insert(0, store.get_task(parent))
        except store.TaskNotFound:
            break
        seen.add(parent)
    return line


def _export(holder: dict[str, Any], cwd: str) -> dict[str, Any]:
    """``oc.export_session`` of ``holder``'s session where the runs keep their sessions: in the
    folders of the session's line (agent_box.session_home; else the holder's own line's), read
    in a box, when runs are boxed here (agent_box.call_box); else in your data folder, in ``cwd``."""
    session_id = holder["session_id"]
    home = agent_box.session_home(session_id) or agent_box.line_home(holder["id"])
    with agent_box.scratch("export-") as scratch:
        box = agent_box.call_box(Path(scratch), home=home)
        return oc.export_session(session_id, str(Path(scratch) / "cwd") if box else cwd, box=box)


def transcript(task_id: Any, offset: int = 0, limit: int = 20) -> dict[str, Any]:
    """The whole conversation of a task's line of work (the task, and the tasks it follows up or
    forks from), paged by turn: ``{"task_id", "line": [ids, first first], "session_id",
    "source", "turns": [{"index", "role", "at", "text", "tools": [{"tool", "status", "title",
    "output"}]}], "total", "offset", "next_offset" | None, "note"}``.

    Source ``opencode session``: OpenCode's own record of the newest session of the line
    (``opencode export``: a follow-up's session holds every earlier turn, a fork's copy holds its
    origin's), with the briefs as user turns. Source ``task logs`` when OpenCode cannot give it
    (no session yet, the session deleted): each task's brief, then what its log shows the agent
    said and did. Texts are clipped (a turn at 8,000 characters, a tool output at 1,000, 20
    tool calls a turn; the task log holds them whole). Raises ValidationError (bad id, offset,
    limit) or TaskNotFound."""
    offset = store.coerce_int("offset", store._or(offset, 0), 0, 10**6)
    limit = store.coerce_int("limit", store._or(limit, 20), 1, TRANSCRIPT_PAGE_MAX)
    task = store.get_task(task_id)
    line = line_of_work(task)
    holder = next((t for t in reversed(line) if t.get("session_id")), None)
    turns, source, note = None, "task logs", ""
    if holder is not None:
        cwd = holder.get("worktree_path") if holder.get("worktree_path") and os.path.isdir(holder["worktree_path"]) \
            else holder["working_dir"]
        try:
            turns = oc.session_turns(_export(holder, cwd if os.path.isdir(cwd) else "/"))
            source = "opencode session"
            if holder is not task:
                note = f"{task['id']} has no session yet: this is the line so far, in {holder['id']}'s session"
        except (oc.SessionCopyFailed, oc.OpencodeNotFound, subprocess.TimeoutExpired, OSError,
                agent_box.BoxSettingError) as exc:
            note = f"OpenCode could not give session {holder['session_id']} ({exc}); rebuilt from the task logs"
    if turns is None:
        turns = [turn for t in line for turn in _turns_from_log(t)]
    page = turns[offset:offset + limit]
    end = offset + len(page)
    return {"task_id": task["id"], "line": [t["id"] for t in line],
            "session_id": holder["session_id"] if holder else None, "source": source,
            "turns": [{"index": offset + i, **turn} for i, turn in enumerate(page)],
            "total": len(turns), "offset": offset, "next_offset": end if end < len(turns) else None,
            "note": note}


def _turns_from_log(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A task's brief as a user turn, then one assistant turn per text the log shows (the tool
    calls before a text go with it)."""
    turns = [{"role": "user", "at": task["created_at"], "text": oc.clip_turn(
        f"# Task {task['id']}: {task['title']}\n\n{task['instructions']}", oc.TURN_TEXT_MAX), "tools": []}]
    try:
        text = store.read_task_log(task["id"]).decode(errors="replace")
    except OSError:
        return turns
    tools: list[dict[str, Any]] = []
    for entry in oc.render_log(text):
        if entry["kind"] == "tool":
            tools.append({"tool": entry["tool"], "status": entry["status"], "title": entry["title"],
                          "output": oc.clip_turn(entry["output"], oc.TOOL_OUTPUT_MAX) if entry["output"] else None})
        elif entry["kind"] == "text":
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry["ts"])) if entry.get("ts") else None
            turns.append({"role": "assistant", "at": at, "text": oc.clip_turn(entry["text"], oc.TURN_TEXT_MAX),
                          "tools": oc.cap_tools(tools)})
            tools = []
    if tools:
        turns.append({"role": "assistant", "at": None, "text": "", "tools": oc.cap_tools(tools)})
    return turns
