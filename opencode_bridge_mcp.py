"""TaskBridge's MCP server: the tools with which Claude (or any MCP client) drives the queue.

Run:
    python opencode_bridge_mcp.py                                  # stdio (what Claude Desktop runs)
    python opencode_bridge_mcp.py --transport streamable-http --port 8765   # one HTTP port:
        /mcp (streamable-http), /sse + /messages/ (sse), /health, / (board), /api/status, /api/tasks
    --host 127.0.0.1 (default) | --log-level DEBUG|INFO|WARNING|ERROR (logs go to stderr only)
    --db URL: the queue, a postgresql:// URL or a SQLite file (sets TASK_DB_URL for the process)

Env read at call time: TASK_DB_URL, TASK_DB_PATH, TASK_LOG_DIR, WORKER_MODEL (through task_store);
OPENCODE_BIN (list_models); MCP_BEARER_TOKEN, else the token file MCP_TOKEN_FILE (default
<repo>/.taskbridge/token); MCP_ALLOWED_HOSTS (extra Host names, comma list); MCP_WAIT_POLL_SEC
(how often wait_for reads the events log, default 0.2 s); MCP_CHANNEL_PUSH (0: no channel notices,
see channel_push). A token source that is set but unusable
(a blank MCP_BEARER_TOKEN; a token file that is a folder, unreadable or empty) stops the HTTP
server with exit status 2, on loopback too; a bad --port or --host is a usage error (exit 2).

All queue logic lives in task_store; the tools here are thin typed wrappers whose docstrings are
what the planner reads. Store errors reach the client as `is_error` results carrying the store's
message; malformed arguments get one message naming each bad field and the allowed values; a
database that cannot be used is named with its path and the way out (see mcp_shared).
The HTTP side (guards, routes) is http_app; the board and /api are board_api; the shapes shared
with the CLI and the board are task_views; MCP Tasks (a task handle for submit_task) are mcp_tasks;
the Claude Code channel notice when a task ends or asks is channel_push.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BeforeValidator, Field, TypeAdapter, WithJsonSchema, WrapValidator
from typing_extensions import TypedDict

import channel_push
import dispatch_card
import http_app
import human_asks
import knobs
import mcp_shared
import mcp_tasks
import opencode_runner
import task_resources
import task_spec as spec
import task_store as store
import task_views
import worktrees

# The HTTP side and the shared views; names re-exported here are what this server's callers and
# tests have always found on it.
from http_app import (  # noqa: F401
    LOOPBACK_NAMES,
    BearerGuard,
    HostGuard,
    TokenConfigError,
    allowed_hosts,
    bearer_token,
    host_name,
    is_loopback,
    parse_host,
    token_file,
)
from launchd import schedule
from task_views import (  # noqa: F401
    ROW_TEXT_MAX,
    WORKER_RECENT_SEC,
    BudgetState,
    QueueStatus,
    TaskInfo,
    TaskRow,
    WorkerState,
    cap_json,
    info,
    page_utf8,
    queue_snapshot,
    read_log_page,
    row,
    short,
    transcript,
    worker_state,
)

VERSION = task_views.VERSION
SERVER_NAME = "taskbridge"
REPO_DIR = Path(__file__).resolve().parent
LAUNCHD_LABEL, SYSTEMD_UNIT = schedule.LABEL, f"{schedule.UNIT}.service"

NUMBER_MAX = 2**63 - 1        # bound of every offset / age argument (SQLite's INTEGER range)
ID_TEXT_MAX = 40               # characters of a task id given as text
LOG_PAGE_MAX = 65_536          # bytes per get_task_logs page (a page is also cut to RESULT_CHARS)
LOG_PAGE_DEFAULT = 16_384
DIFF_PAGE_MAX = 65_536         # bytes per get_task_result diff page (likewise)
DIFF_PAGE_DEFAULT = 16_384
LIST_PAGE_MAX = 200            # rows per list_tasks / list_models page (likewise)
LIST_PAGE_DEFAULT = 20
INSTRUCTIONS_SHOWN = 20_000    # characters of instructions get_task shows
INFO_TEXT_MAX = 2_000          # characters of error/question/answer where a tool echoes a task
RECEIPT_CHARS = 12_000         # characters of the receipt get_task_result shows beside a diff page
RESULT_CHARS = mcp_shared.RESULT_CHARS_MAX   # every tool result's text stays under this
WAIT_RANGE = (1, 3600)         # wait_for timeout_sec
WAIT_DEFAULT_SEC = 50          # under the 60 s most MCP clients give a tool call (MCP Inspector, SDKs)
WAIT_IDS_MAX = 100
PROGRESS_EVERY_SEC = 3.0
STOP_CHECK_SEC = 1.0          # wait_for notices the HTTP server stopping this soon (its grace period is 3 s)
ATTENTION = frozenset(store.TERMINAL) | {"waiting"}

log = logging.getLogger("taskbridge.mcp")


# --------------------------------------------------------------------------------------------
# Argument types. The SDK JSON-decodes a string argument whenever the annotation is not exactly
# `str` (Claude Desktop sends lists as JSON strings); free text is therefore annotated `str`, and
# optional free text uses `OptText` (annotation `str`, null accepted) so that a title such as
# '{"steps":[1]}' or '12345' is stored exactly as sent.


def _null_ok(value: Any, handler: Any) -> Any:
    return None if value is None else handler(value)


def _as_list(value: Any) -> Any:
    """Lists also arrive as JSON strings or comma lists (``"t_0001,t_0002"``); "null" is empty."""
    if value is None or isinstance(value, (list, tuple)):
        return [] if value is None else list(value)
    try:
        return store.coerce_list("list", value)
    except store.ValidationError:
        raise ValueError(f"must be a list (a JSON array, a string holding one, or a comma list); "
                         f"got {store.shown_value(value)}") from None


if TYPE_CHECKING:   # what a tool receives: the validator lets None through
    OptText = str | None
else:               # a str field to pydantic, so a list or number is refused as "must be text"
    OptText = Annotated[str, WrapValidator(_null_ok), WithJsonSchema({"type": ["string", "null"]})]
def _id_shape(value: Any) -> Any:
    """Ids pass on to the store, which parses them; only shapes it could not even read stop here
    (Python refuses to turn more than 4300 digits into an int)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"must be a task id such as t_0001, 0001 or 1; got {value!r}")
    if isinstance(value, int) and value > store.MAX_ID:
        raise ValueError(f"must be a task id such as t_0001; ids go up to {store.MAX_ID}")
    if isinstance(value, str) and len(value.strip()) > ID_TEXT_MAX:
        raise ValueError(f"must be a task id such as t_0001; got {len(value)} characters")
    return value


# Advertised as a plain string (the one form every client's schema dialect takes); a number is accepted too.
TaskId = Annotated[str | int, BeforeValidator(_id_shape),
                   WithJsonSchema({"type": "string", "description": "a task id: t_0001, 0001 or 1"})]
IdList = Annotated[list[TaskId], BeforeValidator(_as_list)]
# Rules as strict tool schemas can state them (OpenAI strict mode refuses an open object): per
# tool an ordered list of {pattern, action}; the server also takes OpenCode's own map form.
_RULE = {"type": "object", "additionalProperties": False, "required": ["pattern", "action"],
         "properties": {"pattern": {"type": "string", "description": "a wildcard pattern (* and ?), e.g. \"git push*\"; \"*\" for every call"},
                        "action": {"type": "string", "enum": list(store.RULE_ACTIONS)}}}
RULES_SCHEMA = {"type": "object", "additionalProperties": False,
                "properties": {tool: {"type": "array", "items": _RULE} for tool in store.RULE_TOOLS}}
Rules = Annotated[dict[str, Any], WithJsonSchema(RULES_SCHEMA)]
Status = Literal["pending", "running", "waiting", "done", "failed", "cancelled"]
Permission = Literal["auto", "readonly", "no-shell", "no-network"]


# --------------------------------------------------------------------------------------------
# Result shapes (structured output).


class SubmittedTask(TaskInfo):
    task_id: str          # the same as id, under the name every other tool takes
    duplicate: bool
    hint: str
    warnings: list[str]


class Note(TypedDict):
    author: str
    text: str
    created_at: str | None
    delivered: bool
    delivered_at: str | None    # when it reached the agent (ISO UTC)
    delivered_how: str | None   # "in the running session, at a step boundary" or "in the prompt of attempt br-…"


class QuestionAnswer(TypedDict):
    attempt: int
    question: str
    answer: str | None
    asked_at: str | None
    answered_at: str | None


class Event(TypedDict):
    id: int
    task_id: str | None
    ts: str | None
    kind: str
    message: str


class TaskDetail(TaskInfo):
    instructions: str
    instructions_truncated: bool
    notes: list[Note]
    questions: list[QuestionAnswer]
    events: list[Event]
    summary: str | None
    usage: dict[str, Any] | None
    diff_bytes: int
    log_bytes: int
    texts_cut: bool


class TaskPage(TypedDict):
    tasks: list[TaskRow]
    total: int
    offset: int
    next_offset: int | None
    next_cursor: str | None
    hint: str


class BatchResult(TypedDict):
    tasks: list[SubmittedTask]
    count: int


class TaskResult(TypedDict):
    id: str
    title: str
    status: str
    error: str | None
    result: dict[str, Any] | None
    result_truncated: bool
    usage: dict[str, Any] | None
    diff: str
    diff_offset: int
    diff_next_offset: int | None
    diff_total_bytes: int
    diff_truncated: bool
    branch: str | None
    worktree_path: str | None
    base_commit: str | None
    session_id: str | None
    finished_at: str | None
    attempt: str | None                  # the earlier attempt whose receipt and diff these are; None: the last
    earlier_attempts: list[dict[str, Any]]
    hint: str


class LogPage(TypedDict):
    task_id: str
    path: str                # where the log is: its file, or the queue database (PostgreSQL)
    exists: bool
    size: int
    offset: int
    next_offset: int
    truncated: bool
    text: str


class TranscriptTool(TypedDict):
    tool: str
    status: str
    title: str
    output: str | None


class TranscriptTurn(TypedDict):
    index: int
    role: str
    at: str | None
    text: str
    tools: list[TranscriptTool]


class Transcript(TypedDict):
    task_id: str
    line: list[str]
    session_id: str | None
    source: str
    turns: list[TranscriptTurn]
    total: int
    offset: int
    next_offset: int | None
    note: str


class WaitTask(TypedDict):
    id: str
    title: str
    status: str
    error: str | None
    question: str | None
    finished_at: str | None
    resume_at: str | None    # paused at its provider's usage limit: it resumes by itself then


class WaitResult(TypedDict):
    met: bool
    timed_out: bool
    mode: str
    waited_sec: float
    tasks: list[WaitTask]
    ready: list[str]
    waiting: list[str]
    unfinished: list[str]
    unseen: list[str]          # finished tasks anywhere in the queue whose result you have not read
    unseen_total: int
    events: list[Event]
    hint: str
    asked_human: list[human_asks.HumanAsk]   # what was asked of the person through the client, and the outcome


class PlannerStatus(QueueStatus):
    unseen: list[str]          # finished tasks whose result the planner has not read (oldest first, ≤50)
    unseen_total: int


class NoteResult(TypedDict):
    task_id: str
    status: str
    delivery: str


class ClearResult(TypedDict):
    removed: list[str]
    count: int
    logs_removed: int
    worktrees_removed: list[str]
    leftovers_removed: list[str]   # folders earlier attempts' worktrees were set aside to (<worktree root>/left/<id>-<n>)
    kept_for_worktrees: list[str]
    kept_on_hosts: dict[str, list[str]]   # host -> ids whose worktrees were kept on that machine, not this one
    kept_for_dependents: dict[str, list[str]]   # id -> the unfinished tasks that depend on it (or follow it up)
    problems: list[str]


class RetryResult(TaskInfo):
    requeued_dependents: list[str]
    unpushed: str | None   # a commit a failed push left in a worktree: which host holds it (only its worker takes the task)
    waits: str | None   # a cancelled attempt's worker still wraps it up: the task starts once it has (seconds)


class ApplyResult(TypedDict):
    """What apply_task did in the user's checkout (commits are full git ids)."""
    task_id: str
    mode: str
    status: str
    branch: str
    tip: str
    repo: str
    into: str
    before: str
    head: str
    files: list[str]
    later: int          # commits on the branch after `tip` (a follow-up's work), not applied


class RestartResult(TypedDict):
    method: Literal["launchctl", "systemctl", "detached", "already-running"]
    command: list[str]
    pid: int | None
    detail: str


class ModelInfo(TypedDict):
    id: str
    provider: str
    name: str
    cost: dict[str, Any] | None
    context: int | None
    output_limit: int | None


class ModelPage(TypedDict):
    models: list[ModelInfo]
    total: int
    offset: int
    next_offset: int | None
    hint: str
    default_model: str | None
    resolved: str | None


class DefaultModel(TypedDict):
    model: str
    previous: str | None
    resolved_from: str | None


class Caller(TypedDict):
    name: str | None
    version: str | None
    kind: str | None


class PingResult(TypedDict):
    ok: bool
    server: str
    version: str
    database: str
    tasks: int
    default_model: str | None
    worker: str
    caller: Caller
    protocol_version: str | None


class BatchTask(TypedDict, total=False):
    """One item of submit_batch (the fields of submit_task, plus ref)."""
    ref: Annotated[str, Field(description="a label (e.g. '@build'; up to 200 characters, not a task id) other items may name in depends_on, continue_from or fork_from")]
    title: Annotated[str, Field(description=f"short title, ≤{spec.TITLE_MAX} characters (required)")]
    instructions: Annotated[str, Field(description="what the agent must do (required)")]
    working_dir: Annotated[str, Field(description="absolute path of an existing directory (this or repo is required)")]
    repo: Annotated[str, Field(description="a git remote to work on instead of working_dir; its branch is pushed back there")]
    base_ref: Annotated[str, Field(description="with repo: the branch, tag or commit to start from (default: the remote's HEAD branch)")]
    host: Annotated[str, Field(description="only workers with this TASKBRIDGE_HOST may run it")]
    model: Annotated[str, Field(description="provider/model; default: the queue's default model")]
    priority: Annotated[int, spec.PRIORITY.field(f"higher runs first; default {spec.PRIORITY.default}")]
    depends_on: Annotated[list[str], Field(description="task ids (t_0001) or refs of this batch")]
    timeout_sec: Annotated[int, spec.TIMEOUT.field(f"seconds per attempt; default {spec.TIMEOUT.default}")]
    max_retries: Annotated[int, spec.RETRIES.field(f"extra attempts after a failure; default {spec.RETRIES.default}")]
    permission: Permission
    worktree: bool
    worktree_keep: bool
    ask_human: bool
    agent: str
    idempotency_key: str
    max_cost_usd: Annotated[float, spec.USD.field("USD the task may spend over all its attempts")]
    max_tokens: Annotated[int, spec.TOKENS.field("tokens the task may use (for a model with no price)")]
    continue_from: Annotated[str, Field(description="a follow-up of this task id or ref (same session and branch; its permission, rules, agent, skills and subagents unless given)")]
    fork_from: Annotated[str, Field(description="a fork of this task id or ref (own branch, copy of the session; its settings as continue_from)")]
    rules: Annotated[Rules, Field(description="permission rules per tool (see submit_task)")]
    skills: Annotated[list[str], Field(description="OpenCode skills to load first")]
    subagents: Annotated[list[str], Field(description="OpenCode sub-agents it may start")]
    schedule_timeout_sec: Annotated[int, spec.SCHEDULE_TIMEOUT.field("seconds it may stay queued before start_overdue warns")]


def _echo(task: dict[str, Any]) -> dict[str, Any]:
    """A task as a tool that changed it answers: its long texts (error, question, answer) cut
    to INFO_TEXT_MAX characters; get_task has room for them."""
    shown = info(task)
    for key in ("error", "question", "answer"):
        shown[key] = short(shown[key], INFO_TEXT_MAX)
    return shown


def _submitted(task: dict[str, Any], in_place: dict[str, bool | None] | None = None) -> dict[str, Any]:
    """submit_task's answer for ``task``; ``in_place``: folder → whether it runs in place, from the
    submit's own check (`task_views.place_warnings`; None: git is asked)."""
    hint = (f"the worker picks it up on its next pass; wait_for(['{task['id']}']) blocks until it "
            f"finishes or asks a question, then get_task_result('{task['id']}') has the receipt")
    if task.get("duplicate"):
        hint = f"idempotency_key matched the earlier task {task['id']}; nothing new was queued"
    elif note := task_views.no_worker_note():
        hint = f"{note}; then wait_for(['{task['id']}']) and get_task_result('{task['id']}')"
    return _echo(task) | {"task_id": task["id"], "duplicate": bool(task.get("duplicate")), "hint": hint,
                         "warnings": task_views.submit_warnings(task, in_place)}


# --------------------------------------------------------------------------------------------
# Errors: anything a tool raises becomes one clear is_error text (never "Error executing tool");
# the translation itself lives in mcp_shared, shared with the reverse bridge.


class BridgeServer(mcp_shared.TranslatingServer):
    """MCPServer whose tool errors read as the store's messages, never 'Error executing tool';
    the results of the tools that show tasks carry resource links to their log, diff, transcript
    and receipt (task_resources), and resources/list names those of the newest tasks."""

    passthrough = (store.TaskStoreError, opencode_runner.OpencodeNotFound)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        result = await super().call_tool(name, arguments, context)
        shown = _linked_tasks(name, getattr(result, "structured_content", None))
        if not shown or getattr(result, "is_error", False):
            return result
        extra = [link for task in shown for link in task_resources.links(task)]
        return result.model_copy(update={"content": [*result.content, *extra]})

    async def list_resources(self) -> list[Any]:
        from mcp.types import Resource
        return [*await super().list_resources(), *(Resource(**r) for r in task_resources.listed())]


LINKED_TOOLS = ("get_task", "get_task_result", "get_task_logs", "get_task_transcript", "wait_for")


def _linked_tasks(tool: str, data: Any) -> list[dict[str, Any]]:
    """The tasks a tool result shows, as {id, status}: wait_for's tasks that need attention, or
    the one task of the others."""
    if tool not in LINKED_TOOLS or not isinstance(data, dict):
        return []
    if tool == "wait_for":
        return [t for t in data.get("tasks", []) if t.get("id") in data.get("ready", [])]
    ident = data.get("id") or data.get("task_id")
    if not ident:
        return []
    # get_task's own answer has what the links need (read in the same call): no second read
    return [data] if "status" in data and "attempts" in data else [store.get_task(ident)]


# --------------------------------------------------------------------------------------------
# Small helpers shared by the tools and the HTTP API.


def caller_of(ctx: Context | None) -> tuple[str | None, str | None]:
    """The MCP client's clientInfo (name, version) from the handshake or the request envelope."""
    try:
        params = ctx.session.client_params if ctx is not None else None
    except (AttributeError, ValueError, RuntimeError):
        return None, None
    client = params.client_info if params is not None else None
    return (client.name, client.version) if client is not None else (None, None)


def known_models(provider: str | None = None, refresh: bool = False) -> list[dict[str, Any]]:
    """``opencode models --verbose`` (cached for a minute per provider and OpenCode setup).
    Raises ToolError when OpenCode is missing or refuses."""
    try:
        return opencode_runner.known_models(provider, refresh=refresh, cache_file=task_views.models_cache_file())
    except opencode_runner.OpencodeNotFound as exc:
        raise ToolError(str(exc)) from None
    except subprocess.TimeoutExpired:
        raise ToolError("`opencode models` did not answer within 60 s; try again") from None
    except (RuntimeError, OSError) as exc:
        raise ToolError(f"`opencode models` failed: {exc}") from None


def resolve_model(name: str, models: list[dict[str, Any]]) -> str:
    """A full ``provider/model`` id for ``name``: an exact id, or a plain model name that exactly
    one provider offers (case-insensitive). Raises ToolError naming the closest ids otherwise."""
    try:
        return opencode_runner.match_model(name, models)
    except opencode_runner.UnknownModel as exc:
        raise ToolError(str(exc)) from None


def _model_arg(model: str | None) -> str | None:
    """A model given at submit, checked against ``opencode models`` (cached for a minute): an
    unknown one is refused with the closest ids; a plain name resolves to its full id. When
    OpenCode cannot be asked, a full ``provider/model`` id passes unchecked (the worker's run
    says what OpenCode thinks of it); a plain name cannot."""
    model = store.optional(model)
    if model is None or not isinstance(model, str):
        return model
    try:
        models = known_models()
    except ToolError:
        if "/" in model:
            return model
        raise
    return resolve_model(model, models)


def _task_ids(values: list[Any]) -> list[str]:
    ids: list[str] = []
    for value in values:
        task_id = store.format_task_id(store.parse_task_id(value))
        if task_id not in ids:
            ids.append(task_id)
    return ids


# --------------------------------------------------------------------------------------------
# The tools.

INSTRUCTIONS = """TaskBridge queues coding tasks for OpenCode agents running on this machine.
Typical flow: submit_task (or submit_batch) -> wait_for (blocks server-side, returns when a task
finishes or asks a question) -> get_task_result (receipt, usage, diff). A task in status `waiting`
asked a question: read it with get_task, reply with answer_task. Task ids look like t_0001 (0001
and 1 work too). Times are ISO 8601 UTC; durations are seconds; sizes are bytes; cost is USD.
A <channel> message from this server (attributes task_id, status, event) says a task ended (status
done/failed/cancelled: call get_task_result) or asks (status waiting: get_task, then answer_task)."""

# Behaviour hints (mcp_shared.hints). "Open world" means reaching beyond this machine's queue:
# queueing a task only writes the queue (the agent runs later, in the worker); list_models and
# set_default_model run `opencode models`, which may fetch the models.dev catalogue; a restarted
# worker runs queued agents against their model providers.
READ_ONLY = mcp_shared.hints(read_only=True, destructive=False, idempotent=True, open_world=False)
# Writes that add (a task, a note, an answer, a requeue, a merge into the user's checkout) and are
# refused when repeated (retry_task, answer_task) or may add again (a submit, a squash).
ADDS = mcp_shared.hints(read_only=False, destructive=False, idempotent=False, open_world=False)
ENDS = mcp_shared.hints(read_only=False, destructive=True, idempotent=True, open_world=False)
REMOVES = mcp_shared.hints(read_only=False, destructive=True, idempotent=False, open_world=False)
CATALOGUE = mcp_shared.hints(read_only=True, destructive=False, idempotent=True, open_world=True)
OVERWRITES_SETTING = mcp_shared.hints(read_only=False, destructive=True, idempotent=True, open_world=True)
RESTARTS = mcp_shared.hints(read_only=False, destructive=True, idempotent=False, open_world=True)
# Replaces the queue's budget settings (the earlier values are gone); asks nothing outside.
SETS_BUDGET = mcp_shared.hints(read_only=False, destructive=True, idempotent=True, open_world=False)


registry = mcp_shared.ToolRegistry()


def build_server() -> MCPServer:
    """A fresh MCPServer with the 21 TaskBridge tools, the task resources and MCP Tasks for submit_task
    (mcp_tasks; nothing is opened until a tool runs)."""
    tasks = mcp_tasks.QueueTasks()
    mcp = BridgeServer(SERVER_NAME, version=VERSION, instructions=INSTRUCTIONS,
                       extensions=[dispatch_card.apps(), tasks])
    served = tasks.attach(task_resources.install(registry.install(mcp, dispatch_card.tool_meta())), _submitted)
    return channel_push.install(served)


@registry.tool(ADDS, title="Submit a coding task")
def submit_task(  # noqa: PLR0913 - an MCP tool's parameters are its input schema
    title: Annotated[str, Field(description=f"short title shown in lists, ≤{spec.TITLE_MAX} characters; stored exactly as sent")],
    instructions: Annotated[str, Field(description=f"what the agent must do, as a full brief (≤{spec.INSTRUCTIONS_MAX:,} characters)")],
    ctx: Context,
    working_dir: Annotated[OptText, Field(description="absolute path of an existing directory on the worker's machine (a git repo gets an isolated worktree); give this or repo")] = None,
    repo: Annotated[OptText, Field(description="a git remote to work on instead of working_dir: https://, ssh://, git@host:path, file:// or a repository's absolute path, without credentials (each worker uses its own git credentials); the worker pushes branch taskbridge/<id> back there")] = None,
    base_ref: Annotated[OptText, Field(description="with repo: the branch, tag or commit the task starts from (default: the remote's HEAD branch)")] = None,
    host: Annotated[OptText, Field(description="only workers whose TASKBRIDGE_HOST is this name may run it (default: the server's machine for a working_dir, any machine for a repo)")] = None,
    model: Annotated[OptText, Field(description="provider/model (or a plain model name that one provider offers); default: the queue's default model")] = None,
    priority: Annotated[int | None, spec.PRIORITY.field("higher runs first, then oldest")] = spec.PRIORITY.default,
    depends_on: Annotated[IdList, Field(description="ids of tasks that must be done first")] = [],  # noqa: B006 - never mutated; the schema shows []
    timeout_sec: Annotated[int | None, spec.TIMEOUT.field("seconds per attempt (each retry gets it again)")] = spec.TIMEOUT.default,
    max_retries: Annotated[int | None, spec.RETRIES.field("extra attempts after a failure")] = spec.RETRIES.default,
    permission: Annotated[Permission | None, Field(description="Every run is boxed by the OS (writes only in its worktree, no TaskBridge secret). auto "
                                                                   "(default; a follow-up's or fork's: its task's): anything in the worktree; readonly: "
                                                                   "the worktree is read-only; no-shell: no bash; no-network: bash gets no network. Without an "
                                                                   "OS box the last three fail unless the worker allows prompt-level (the receipt's sandbox says which)")] = None,
    worktree: Annotated[bool | None, Field(description="in a git repo, work on branch taskbridge/t_NNNN in a separate worktree")] = True,
    worktree_keep: Annotated[bool | None, Field(description="keep the worktree after success (the branch is always kept)")] = False,
    ask_human: Annotated[bool | None, Field(description="its permission asks go to the person through your client's forms where it has them (else to you)")] = False,
    agent: Annotated[OptText, Field(description="OpenCode agent name, e.g. build or plan")] = None,
    idempotency_key: Annotated[OptText, Field(description="a key of yours: submitting it again with the same task (title, instructions, working_dir or repo, base_ref, worktree, the task it continues or forks, agent, permission, rules, skills, subagents; the model may differ) returns the first task instead of a new one; with another task it is refused, naming the fields that differ")] = None,
    max_cost_usd: Annotated[float | None, spec.USD.field("USD the task may spend over all its attempts; at the limit it pauses in `waiting` and asks (default: the queue's, see set_budget)")] = None,
    max_tokens: Annotated[int | None, spec.TOKENS.field("tokens the task may use, for a model that reports no price (default: the queue's)")] = None,
    continue_from: Annotated[OptText, Field(description="a follow-up of this task id: resumes its OpenCode session (the agent keeps its history) and commits on its branch; waits for it like a dependency")] = None,
    fork_from: Annotated[OptText, Field(description="a fork of this task id: a new branch from the commit it ended at with a copy of its session as it ended, to try another approach side by side; waits for it")] = None,
    rules: Annotated[Rules | None, Field(description="permission rules added to the preset: per tool an ordered list of {pattern, action} (allow|deny|ask), the last match winning, e.g. {\"bash\": [{\"pattern\": \"git push*\", \"action\": \"ask\"}]}; OpenCode's map form {\"bash\": {\"git push*\": \"ask\"}} works too; a bash line is matched command by command (cd x && git push meets git push*), the strictest answer winning; ask pauses the task for your answer")] = None,
    skills: Annotated[list[str] | None, Field(description="OpenCode skills the agent is told to load first (checked against `opencode debug skill`)")] = None,
    subagents: Annotated[list[str] | None, Field(description="OpenCode sub-agents the agent may hand work to with its task tool (checked against OpenCode's config)")] = None,
    schedule_timeout_sec: Annotated[int | None, spec.SCHEDULE_TIMEOUT.field("seconds it may stay queued without starting; past it get_task's start_overdue and queue_status's start_overdue warn (a queue that silently stopped)")] = None,
) -> SubmittedTask:
    """Queue one coding task for an OpenCode agent; returns the task (id like t_0001, status pending).

    The worker runs it in `working_dir` (in a git repo: on branch taskbridge/<id> in its own
    worktree) and records a receipt; then call wait_for([id]) and get_task_result(id). A
    `working_dir` task runs only on the machine that queued it (or on `host`).
    Spending: at `max_cost_usd` (USD) or `max_tokens` the run stops at that step and the task
    waits with a question stating the spend; answer_task "continue, up to $2" resumes the session,
    "stop" fails it. `warnings` flags a USD limit on a model priced at 0 (give max_tokens).
    `repo` instead of `working_dir`: a git remote; a worker on any machine (or on `host`) works
    from `base_ref`, commits and pushes branch taskbridge/<id> there (receipt: `pushed_branch`).
    A refused push fails the task without rerunning the agent (worktree kept).
    continue_from: the next step of that task's line of work (same session and branch; receipt's
    `line`: the line's whole diff); fork_from: a branch of its own from that task's head with a
    copy of the session. Both run in its working_dir, with its permission, rules, agent, skills and
    subagents unless given. A call matching an `ask` rule moves the task to `waiting` with the
    request as its question; answer_task allow or deny (once, or always) resumes the session.
    Errors (nothing is written then): a relative or missing working_dir, both or neither of
    working_dir and repo, a repo that is not a git URL or path or carries credentials, a bad
    base_ref or host, an unknown dependency, a value out of range, a model `opencode models` does
    not list, both continue_from and fork_from, a second follow-up of one task (fork instead),
    following a task that ran with worktree=false or is failed/cancelled, a bad rule, a skill or
    sub-agent OpenCode does not offer, a bare or commit-less repository, a folder not in the last
    commit, an idempotency_key used before with another task.
    """
    fields = _task_fields(ctx, {k: v for k, v in locals().items() if k != "ctx"})   # locals(): the parameters
    _check_names(fields)
    in_place = _place_checked(fields)   # before anything is queued
    return cast(SubmittedTask, _submitted(store.submit_task(**fields), in_place))


def _place_checked(item: dict[str, Any]) -> dict[str, bool | None]:
    """`worktrees.refuse_unrunnable_folder` for a submission's folder: ``{working_dir: whether it
    runs in place}`` ({} without a folder, or when git could not tell). Raises ValidationError."""
    folder = item.get("working_dir")
    if not isinstance(folder, str) or item.get("repo"):   # with a repo too the store refuses the pair
        return {}
    answer = worktrees.refuse_unrunnable_folder(folder, item.get("host"),
                                                store.coerce_bool("worktree", item.get("worktree", True)))
    return {} if answer is None else {folder: answer}


def _task_fields(ctx: Context, given: dict[str, Any]) -> dict[str, Any]:
    """submit_task's parameters (``given``, by name) as store.submit_task's fields: the model as
    _model_arg resolves it, a null worktree, worktree_keep or ask_human at its default, and the
    calling client (``ctx``) as the task's origin. Raises ToolError for a model nobody offers."""
    name, version = caller_of(ctx)
    return given | {"model": _model_arg(given["model"]),
                    "worktree": True if given["worktree"] is None else given["worktree"],
                    "worktree_keep": False if given["worktree_keep"] is None else given["worktree_keep"],
                    "ask_human": bool(given["ask_human"]), "origin_name": name, "origin_version": version}


def _check_names(fields: dict[str, Any]) -> None:
    """Refuse skills, sub-agents and an agent OpenCode does not offer for the task's folder; when
    OpenCode cannot be asked they pass unchecked (the run's skill and task tools say what is
    missing)."""
    skills, subagents = store.coerce_list("skills", fields.get("skills")), \
        store.coerce_list("subagents", fields.get("subagents"))
    agent = store.optional(fields.get("agent"))   # "null" and "" say absent, as the store takes them
    agent = agent if isinstance(agent, str) else None
    folder = fields.get("working_dir")
    if not (skills or subagents or agent) or not isinstance(folder, str) or not os.path.isdir(folder):
        return
    try:
        opencode_runner.check_names([str(x) for x in skills], [str(x) for x in subagents], folder,
                                    agent.strip() if agent else None)
    except opencode_runner.UnknownName as exc:
        raise ToolError(str(exc)) from None
    except (opencode_runner.OpencodeNotFound, RuntimeError, subprocess.TimeoutExpired, OSError):
        return


_BATCH_SCHEMA = {
    "type": "array", "minItems": 1, "maxItems": spec.BATCH_MAX,
    "items": TypeAdapter(BatchTask).json_schema() | {"required": ["title", "instructions"]},
}


def _batch_item(item: Any, name: str | None, version: str | None) -> Any:
    if isinstance(item, str) and item.strip().startswith("{"):
        item = store.loads_json("a batch item", item, "a JSON object with title, instructions, working_dir or repo")
    if not isinstance(item, dict):
        return item          # the store names the problem
    item = dict(item)
    if isinstance(item.get("model"), str):
        item["model"] = _model_arg(item["model"])
    _check_names(item)
    return item | {"origin_name": name, "origin_version": version}


@registry.tool(ADDS, title="Submit several tasks")
def submit_batch(
    tasks: Annotated[list[Any], WithJsonSchema(_BATCH_SCHEMA), Field(
        description="1–20 task objects with the fields of submit_task; an item may carry `ref` "
                    "(a label) that other items name in depends_on, continue_from or fork_from")],
    ctx: Context,
) -> BatchResult:
    """Queue 1–20 tasks at once, all or nothing; returns them in the order given.

    Items may depend on each other through `ref` labels (e.g. {"ref": "@lib", ...} and
    {"depends_on": ["@lib"], ...}; continue_from and fork_from name a ref the same way) as well as
    on existing task ids; a cycle is refused.
    Each item gives `working_dir` or `repo` (a git remote; with `base_ref`), and may give `host`.
    Errors (nothing is written then): more than 20 items, a bad field in any item (the message
    names the item's index), an unknown dependency or ref (the message lists the batch's refs), a cycle.
    """
    name, version = caller_of(ctx)
    raw = store.coerce_list("tasks", tasks)
    if not 1 <= len(raw) <= spec.BATCH_MAX:
        raise ToolError(f"a batch holds 1 to {spec.BATCH_MAX} tasks; got {len(raw)}. Split it")
    items = [_batch_item(item, name, version) for item in raw]
    in_place: dict[str, bool | None] = {}
    for index, item in enumerate(items):
        try:
            in_place |= _place_checked(item) if isinstance(item, dict) else {}
        except store.ValidationError as exc:
            raise store.ValidationError(f"task {index} of the batch: {exc}") from None
    done = store.submit_batch(items)
    return mcp_shared.fit({"tasks": [_submitted(t, in_place) for t in done], "count": len(done)},
                          RESULT_CHARS)[0]


@registry.tool(READ_ONLY, title="Show a task")
def get_task(task_id: TaskId) -> TaskDetail:
    """One task in full: settings, status, caller, dependencies, notes, questions and answers,
    its last 20 events, the receipt summary and usage (tokens, cost_usd), and the sizes in bytes
    of its diff and log. Instructions beyond 20,000 characters are cut (instructions_truncated).
    Bounded: the last 20 notes and the last 10 questions, each text cut at 2,000 characters
    (`tasks_cli.py show ID --json` has them whole); receipt texts are clipped when stored, with a
    note naming the log that holds the whole text; when the whole would still pass 40,000
    characters its longest texts are cut, each marked "… [N more characters cut]" (texts_cut).
    Errors: unknown or malformed id."""
    task = store.get_task(task_id)
    result = task.get("result") or {}
    instructions = task["instructions"]
    detail = info(task) | {
        "instructions": instructions[:INSTRUCTIONS_SHOWN],
        "instructions_truncated": len(instructions) > INSTRUCTIONS_SHOWN,
        "notes": cap_json(task["notes"], items=20, chars=2000)[0],
        "questions": cap_json(task["questions"], items=10, chars=2000)[0],
        "events": task["events"],
        "summary": result.get("summary") if isinstance(result, dict) else None,
        "usage": task.get("usage"),
        "diff_bytes": len((task.get("diff") or "").encode()),
        "log_bytes": store.task_log_size(task_id),
    }
    detail, cut = mcp_shared.fit(detail, RESULT_CHARS)
    return detail | {"texts_cut": cut}


@registry.tool(READ_ONLY, title="Read a task's result")
def get_task_result(
    task_id: TaskId,
    diff_offset: Annotated[int | None, Field(ge=0, le=NUMBER_MAX, description="byte offset into the diff (the diff_next_offset of the previous call)")] = 0,
    diff_max_bytes: Annotated[int | None, Field(ge=1, le=DIFF_PAGE_MAX, description="bytes of diff per page (default 16,384)")] = DIFF_PAGE_DEFAULT,
    attempt: Annotated[str | None, Field(max_length=200, description="an earlier attempt (from earlier_attempts: its run marker such as br-42-a1, or a1) whose receipt and diff to read instead of the last one's")] = None,
) -> TaskResult:
    """A finished (or failed) task's outcome: the receipt (`result`: summary, files_touched,
    commands, tests_run, open_questions, model, latency_sec, sandbox…), `usage` (tokens, cost_usd
    in USD), and its diff, paged by bytes (default 16,384, at most 65,536 a page, never splitting
    a character; a page is made smaller when the whole result would pass 40,000 characters):
    pass diff_next_offset back as diff_offset for the next page. Long lists in the receipt are
    cut to their last 100 items and long texts shortened to keep it under 12,000 characters
    (result_truncated). `earlier_attempts` lists the receipts of earlier attempts kept when a
    retry started the task afresh (attempt, status, ended_at, files_touched, summary, diff_bytes;
    the last 5): pass one's `attempt` to read its receipt and diff. Reading a finished task's
    result marks it seen (it leaves wait_for's and queue_status's `unseen`). Errors: unknown id,
    offset past the end, an attempt not kept (the message names those that are)."""
    task = store.get_task(task_id)
    if attempt is not None:
        earlier = store.earlier_receipt(task_id, attempt)
        task = task | {"result": earlier.get("result"), "diff": earlier.get("diff")}
    diff = (task.get("diff") or "").encode()
    offset = 0 if diff_offset is None else diff_offset
    if offset > len(diff):
        raise ToolError(f"diff_offset {offset} is past the end of the diff ({len(diff)} bytes)")
    if task["status"] in store.TERMINAL:
        # Only bookkeeping: a queue on a read-only disk still hands the planner its results.
        with contextlib.suppress(store.ReadOnlyStorage):
            store.mark_result_seen(task["id"])
    result, cut = cap_json(task.get("result"))
    result, shortened = mcp_shared.fit(result, RECEIPT_CHARS)
    hint = {"done": worktrees.no_change_note(task) or "finished; the diff is committed on the branch",
            "failed": "failed; `error` says why (get_task_logs shows the run)",
            "waiting": "waiting for an answer: read `question` with get_task, reply with answer_task",
            "cancelled": "cancelled"}.get(task["status"], f"still {task['status']}; wait_for([id]) blocks until it ends")
    if not diff and task["status"] in ("failed", "cancelled") and (kept := worktrees.kept_work_words(task)):
        hint += f"; no diff was recorded, but {kept}"   # the worker died before it recorded the attempt
    head = {"id": task["id"], "title": task["title"], "status": task["status"],
            "error": short(task.get("error"), INFO_TEXT_MAX), "result": result,
            "result_truncated": cut or shortened, "usage": task.get("usage")}
    if attempt is not None:
        hint = f"the receipt and diff of the earlier attempt {earlier['attempt']} ({earlier['status']}), kept when a retry " \
               "started the task afresh; without attempt: the last attempt's"
    elif task["earlier_attempts"]:
        hint += (f"; earlier attempts' receipts are kept ({', '.join(e['attempt'] for e in task['earlier_attempts'])}): "
                 "get_task_result(attempt=...) reads one")
    tail = {"branch": task.get("branch"), "worktree_path": task.get("worktree_path"),
            "base_commit": task.get("base_commit"), "session_id": task.get("session_id"),
            "finished_at": task.get("finished_at"), "attempt": earlier["attempt"] if attempt is not None else None,
            "earlier_attempts": task["earlier_attempts"], "hint": hint}

    def page(limit: int) -> dict[str, Any]:
        text, start, end = page_utf8(diff, offset, limit)
        more = end < len(diff)
        return head | {"diff": text, "diff_offset": start, "diff_next_offset": end if more else None,
                       "diff_total_bytes": len(diff), "diff_truncated": start > 0 or more} | tail | {
            "hint": hint + (f"; the diff continues: get_task_result(diff_offset={end})" if more else "")}

    return mcp_shared.fit_page(page, diff_max_bytes or DIFF_PAGE_DEFAULT, RESULT_CHARS)


@registry.tool(READ_ONLY, title="Read a task's run log")
def get_task_logs(
    task_id: TaskId,
    tail_lines: Annotated[int | None, Field(ge=1, le=5000, description="the last N lines (used when offset is not given)")] = 200,
    offset: Annotated[int | None, Field(ge=0, le=NUMBER_MAX, description="byte offset to read from instead of the tail (the next_offset of the previous call)")] = None,
    max_bytes: Annotated[int | None, Field(ge=1, le=LOG_PAGE_MAX, description="bytes per page (default 16,384)")] = LOG_PAGE_DEFAULT,
) -> LogPage:
    """The agent's raw run log (OpenCode's JSON event stream and stderr): at most max_bytes
    (default 16,384, at most 65,536) a call, never splitting a character, and made smaller when
    the result would pass 40,000 characters. Without `offset`: the last `tail_lines` lines. With
    `offset`: the bytes from there on; `next_offset` is where the next call continues (to follow a
    running task, pass it back). `truncated`: more bytes follow (offset mode) or the tail was cut
    by the byte cap (then `offset` tells where the text shown begins). Errors: unknown id, offset
    past the end."""
    task_id = store.statuses_of([task_id]).popitem()[0]
    where = store.task_log_location(task_id)
    return mcp_shared.fit_page(
        lambda limit: {"task_id": task_id, "path": where} | read_log_page(task_id, offset, tail_lines or 200, limit),
        max_bytes or LOG_PAGE_DEFAULT, RESULT_CHARS)


@registry.tool(READ_ONLY, title="Read a task's conversation")
async def get_task_transcript(
    task_id: TaskId,
    offset: Annotated[int | None, Field(ge=0, le=1_000_000, description="the first turn to return (the next_offset of the previous call)")] = 0,
    limit: Annotated[int | None, Field(ge=1, le=100, description="turns per page")] = 20,
) -> Transcript:
    """The whole conversation of a task's line of work, as readable turns, paged: the task and
    the tasks it follows up (continue_from) or forks from (fork_from), first task first (`line`).
    Each turn: `index`, `role` (user: a brief or an answer; assistant: the agent), `at` (ISO UTC),
    `text` (≤ 8,000 characters) and `tools` (each call's tool, status, title, output ≤ 1,000
    characters; 20 calls a turn, then one `omitted` entry counting the rest). `source` is `opencode session` (OpenCode's own record, `opencode export`) or
    `task logs` (no session yet, or OpenCode could not give it: `note` says why). `next_offset`:
    where the next page starts, null at the end. Takes ~2 s (OpenCode is asked).
    Errors: unknown or malformed id, offset or limit out of range."""
    return cast(Transcript, await anyio.to_thread.run_sync(transcript, task_id, offset or 0, limit or 20))


def _wait_met(statuses: dict[str, str], mode: str) -> bool:
    values = list(statuses.values())
    if any(s == "waiting" for s in values):
        return True
    return all(s in ATTENTION for s in values) if mode == "all" else any(s in ATTENTION for s in values)


def _wait_statuses(ids: list[str]) -> dict[str, str]:
    """Each task's status, a task paused at a usage limit that resumes by itself shown as
    ``paused``: it needs no answer, so a wait goes on through the pause."""
    statuses = store.statuses_of(ids)
    waiting = [t for t, s in statuses.items() if s == "waiting"]
    for task_id in store.resuming_by_itself(waiting) if waiting else []:
        statuses[task_id] = "paused"
    return statuses


def _poll_sec() -> float:
    """``$MCP_WAIT_POLL_SEC``: seconds between wait_for's re-checks, 0.01..5 (default 0.2).
    Raises knobs.KnobError for any other value (the server refuses to start with one)."""
    return knobs.knob("MCP_WAIT_POLL_SEC")


def _progress_text(statuses: dict[str, str], elapsed: float) -> str:
    open_ = [f"{tid} {s}" for tid, s in statuses.items() if s not in ATTENTION]
    return f"waited {elapsed:.0f} s; still open: {', '.join(open_[:10]) or 'none'}"


@registry.tool(READ_ONLY, title="Wait for tasks")
async def wait_for(
    task_ids: Annotated[IdList, Field(description="1–100 task ids, e.g. [\"t_0001\", \"t_0002\"]")],
    ctx: Context,
    timeout_sec: Annotated[int | None, Field(ge=WAIT_RANGE[0], le=WAIT_RANGE[1], description="seconds to wait at most (default 50, under the 60 s many clients allow a call; raise it only if your client waits longer)")] = WAIT_DEFAULT_SEC,
    mode: Annotated[Literal["any", "all"] | None, Field(description="any: return when one task needs attention; all: when every task does")] = "any",
) -> WaitResult:
    """Block until tasks finish — no polling on your side. Returns as soon as, in mode "any", one
    task is done, failed, cancelled or waiting (asked a question), or in mode "all", every task is
    finished; a task that turns `waiting` returns in both modes. A task paused at its provider's
    usage limit (paused_for `usage_limit`, resume_at set) resumes by itself: wait_for returns
    when it pauses and when it resumes, and waits on through the pause. Otherwise returns after
    timeout_sec (default 50 s, at most 3600) with timed_out true: to keep waiting, call wait_for
    again with the same task_ids (a task that ended in between is reported at once). Sends a
    progress notification every ~3 s while it waits; stops when the client goes away. Always
    returns every task's status, the ids that need attention (`ready`), the events seen while
    waiting, `unseen` (finished tasks anywhere in the queue whose result you have not read with
    get_task_result yet, named or not; `unseen_total` counts them) and a hint for the next step.
    With a client that can show forms (elicitation), a task paused at its spending limit, or at a
    permission ask of a task submitted with ask_human, is asked of the person first; the answer
    acts and the wait goes on (`asked_human` says what was asked and answered). A decline or no
    answer leaves it to you, as without forms. Errors: unknown id, no ids, more than 100; the
    HTTP server stopping mid-wait (call wait_for again once it is back)."""
    ids = _task_ids(task_ids)
    timeout_sec, mode = timeout_sec or WAIT_DEFAULT_SEC, mode or "any"
    if not 1 <= len(ids) <= WAIT_IDS_MAX:
        raise ToolError(f"task_ids must name 1 to {WAIT_IDS_MAX} tasks; got {len(ids)}")
    started = time.monotonic()
    asked: list[human_asks.HumanAsk] = []
    while True:
        result = await _wait_round(ids, mode, ctx, started, timeout_sec)
        left = started + timeout_sec - time.monotonic()
        if result["timed_out"] or not await human_asks.ask_waiting(ctx, result["waiting"], asked, left):
            return cast(WaitResult, result | {"asked_human": asked})


STOPPING_SAID = ("the server is stopping, so this wait ended early: call wait_for again with the same task_ids "
                 "once the server is back (a task that ended meanwhile is reported at once)")


async def _wait_round(ids: list[str], mode: str, ctx: Context, started: float, timeout_sec: int) -> dict[str, Any]:
    """One wait until the tasks meet ``mode`` or the call's deadline (started + timeout_sec).
    Raises ToolError (STOPPING_SAID) when the HTTP server begins to stop (mcp_shared.STOPPING):
    the client gets that answer before the connection closes, not an empty stream."""
    # Store reads on a kept connection take microseconds: they run on the event loop. The wait
    # itself sleeps on the database's change notification (inotify), polling only as a fallback.
    cursor = store.last_event_id()
    statuses = _wait_statuses(ids)
    deadline, next_progress, poll = started + timeout_sec, time.monotonic() + PROGRESS_EVERY_SEC, _poll_sec()
    seen: list[dict[str, Any]] = []
    timed_out = False
    with store.change_watch() as watch:
        while not _wait_met(statuses, mode) and not any(e["kind"] in ("paused", "resumed") for e in seen):
            if mcp_shared.STOPPING.is_set():
                raise ToolError(STOPPING_SAID)
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if now >= next_progress:
                await ctx.report_progress(round(now - started, 1), timeout_sec, _progress_text(statuses, now - started))
                next_progress += PROGRESS_EVERY_SEC
            newest = await _next_change(watch, cursor, min(poll, STOP_CHECK_SEC, deadline - now, next_progress - now))
            if newest > cursor:
                new = store.events_since(cursor, ids, 1000)
                cursor = new[-1]["id"] if len(new) == 1000 else max(newest, new[-1]["id"] if new else 0)
                if new:
                    seen = (seen + new)[-50:]
                    statuses = _wait_statuses(ids)
    # Rows first, then the events after the cursor: a change commits its event with it, so every
    # status returned has its event among those returned (a change that landed between the last
    # events read and the statuses read was otherwise reported without its event).
    tasks = [store.get_task(t) for t in ids]
    seen = (seen + store.events_since(cursor, ids, 1000))[-50:]
    return _wait_result(tasks, mode, timed_out, time.monotonic() - started, seen, store.unseen_results())


async def _next_change(watch: Any, since: int, timeout: float) -> int:
    """The newest event id once it passes ``since``, or after ``timeout`` seconds (the poll)."""
    newest = store.last_event_id()
    if newest > since or timeout <= 0:
        return newest
    if not watch.available:
        await anyio.sleep(timeout)
        return store.last_event_id()
    with anyio.move_on_after(timeout):
        while True:
            await anyio.wait_readable(watch.fd)
            if watch.drain():
                for pause in store.SETTLE_PAUSES:
                    await anyio.sleep(pause)
                    if store.last_event_id() > since:
                        return store.last_event_id()
    return store.last_event_id()


def _wait_result(tasks: list[dict[str, Any]], mode: str, timed_out: bool, waited: float,
                 events: list[dict[str, Any]], unseen: dict[str, Any]) -> dict[str, Any]:
    rows = [{"id": t["id"], "title": t["title"], "status": t["status"], "error": short(t.get("error")),
             "question": t.get("question"), "finished_at": t.get("finished_at"),
             "resume_at": t.get("resume_at")} for t in tasks]
    ready = [r["id"] for r in rows if r["status"] in ATTENTION]
    waiting = [r["id"] for r in rows if r["status"] == "waiting"]
    unfinished = [r["id"] for r in rows if r["status"] not in ATTENTION]
    limited = [f"{t['id']} until {t['resume_at']}" for t in tasks
               if t["status"] == "waiting" and t.get("paused_for") == "usage_limit" and t.get("resume_at")]
    if limited:
        hint = (f"paused at the provider's usage limit, resuming by itself: {', '.join(limited)}; wait_for again "
                "to follow it, or answer_task(task_id, 'continue' | 'stop') to resume now or stop it")
    elif waiting:
        hint = f"{', '.join(waiting)} asked a question: answer_task(task_id, answer) lets it go on"
    elif timed_out:
        hint = (f"timed out; {', '.join(unfinished)} still open: call wait_for again with the same task_ids to "
                "keep waiting (queue_status shows the worker)")
    else:
        hint = "get_task_result(id) has the receipt, usage and diff of each finished task"
    named = {r["id"] for r in rows}
    others = [t for t in unseen["ids"] if t not in named]
    if others:
        hint += f"; also finished, result not read yet: {', '.join(others[:10])}" + (
            f" and {unseen['total'] - len(unseen['ids'])} more" if unseen["total"] > len(unseen["ids"]) else "")
    result = {"met": not timed_out, "timed_out": timed_out, "mode": mode, "waited_sec": round(waited, 2),
              "tasks": rows, "ready": ready, "waiting": waiting, "unfinished": unfinished,
              "unseen": unseen["ids"], "unseen_total": unseen["total"], "events": events, "hint": hint}
    return mcp_shared.fit(result, RESULT_CHARS)[0]     # 100 tasks with long questions: texts are cut


@registry.tool(ADDS, title="Answer a task's question")
def answer_task(
    task_id: TaskId,
    answer: Annotated[str, Field(description="your reply to the task's question (≤50,000 characters), stored exactly as sent")],
) -> TaskInfo:
    """Answer the question of a task in status `waiting`: it goes back to pending and its next
    attempt resumes the same OpenCode session with your answer. A task paused at a spending limit
    (`paused_for` set) reads it: "continue, up to $2" (or "300k tokens") raises its limit and
    resumes the session, "stop" fails it with its receipt kept, a bare "continue" resumes only
    when no limit is reached any more. A task waiting on a permission ask (paused_for
    `permission`) takes `allow once`, `allow always`, `deny once` or `deny always`, alone (a bare
    `allow` or `deny` is once; always: a rule for that exact request, for a bash line for each
    command the question names, is added to the task's rules, which its follow-ups and forks inherit); allow lets that call run, deny resumes with the call refused. Errors: unknown id,
    empty answer, the task is not waiting (add_task_note reaches a running task instead), a limit
    not above the spend, another answer to a permission ask."""
    return cast(TaskInfo, _echo(store.answer_task(task_id, answer, author="planner")))


@registry.tool(READ_ONLY, title="List tasks")
def list_tasks(
    status: Annotated[list[Status] | None, BeforeValidator(lambda v: None if store.optional(v) is None else _as_list(v)),
                      Field(description="only these statuses, e.g. [\"pending\", \"running\"]; default all")] = None,
    origin: Annotated[OptText, Field(description="only tasks from this caller: a kind (claude, chatgpt, other) or a clientInfo name")] = None,
    search: Annotated[OptText, Field(description="only titles containing this text (case-insensitive)")] = None,
    limit: Annotated[int | None, Field(ge=1, le=LIST_PAGE_MAX, description="rows per page (default 20)")] = LIST_PAGE_DEFAULT,
    offset: Annotated[int | None, Field(ge=0, le=NUMBER_MAX, description="rows to skip (next_offset of the previous page)")] = 0,
    cursor: Annotated[OptText, Field(description="next_cursor of the previous page: continues right after its last row, however deep, even while tasks are added (offset is then ignored)")] = None,
) -> TaskPage:
    """A page of tasks (running first, then waiting, pending, finished; by priority, newest first)
    with status, caller (origin_name/version/kind), times, error and question (cut to 300
    characters). limit rows a page (default 20, at most 200; fewer when the page would pass
    40,000 characters): pass next_cursor back as cursor (or next_offset as offset) for the next
    page (both null at the end). Errors: an unknown status, a cursor list_tasks did not return."""
    start = 0 if cursor else offset or 0
    found = store.list_tasks(status=status or None, origin=origin, search=search,
                             limit=limit or LIST_PAGE_DEFAULT, offset=start, cursor=cursor)
    rows = [row(t) for t in found["tasks"]]
    more = found["next_cursor"] is not None
    return mcp_shared.fit_page(lambda n: _task_page(rows[:n], found["total"], start, more or n < len(rows),
                                                    cursor is None), max(1, len(rows)), RESULT_CHARS)


def _task_page(rows: list[dict[str, Any]], total: int, start: int, more: bool, by_offset: bool) -> dict[str, Any]:
    """A list_tasks page: ``_page_of`` with the cursor after its last row (and, paging by cursor,
    no offsets: the position is not counted)."""
    page = _page_of(rows, "tasks", total, start)
    page["next_cursor"] = store.list_cursor(rows[-1]) if more and rows else None
    if not by_offset:
        page["next_offset"] = None
        page["hint"] = ("pass cursor=next_cursor for the next page" if page["next_cursor"]
                        else "this is the last page")
    return page


def _page_of(rows: list[dict[str, Any]], key: str, total: int, start: int) -> dict[str, Any]:
    """A page of ``rows`` starting at row ``start`` of ``total``, with the next offset and a hint."""
    end = start + len(rows)
    more = end < total
    hint = (f"rows {start}–{end - 1} of {total}; pass offset={end} for the next page" if more and rows
            else f"{total} in all; this is the last page")
    return {key: rows, "total": total, "offset": start, "next_offset": end if more else None, "hint": hint}


@registry.tool(READ_ONLY, title="Queue status")
def queue_status() -> PlannerStatus:
    """The queue at a glance: task counts per status, how many are claimable now, the oldest
    pending task and its age in seconds, the default model (the setting, WORKER_MODEL, or the
    user's OpenCode config as last seen; null until list_models or a worker has asked OpenCode),
    the worker's liveness (`worker`: the last to report, from any host: heartbeat age in seconds,
    host, whether its process runs — null on another host —, a one-line summary that says when it
    claims nothing because the daily budget is spent; `workers`: every worker on every host,
    newest heartbeat first, each labelled online, stale, gone or stopped; a gone or stopped one
    has no `tasks`, a stale one keeps them: it may still run them), and `budget`:
    today's spend (local day; USD and tokens), the daily budget and default task limits (null =
    none), `exhausted` with its `reason`, and `resets_at` (next local midnight, ISO UTC);
    `unseen`: finished tasks whose result you have not read with get_task_result yet (oldest
    first, at most 50; `unseen_total` counts them all)."""
    unseen = store.unseen_results()
    return cast(PlannerStatus, queue_snapshot() | {"unseen": unseen["ids"], "unseen_total": unseen["total"]})


@registry.tool(READ_ONLY, title="Worker heartbeat")
def worker_heartbeat() -> WorkerState:
    """The last heartbeat of any worker (any host; queue_status lists them all): state (pass,
    idle, running, stopped, error), the tasks it runs now (`tasks`; none once it is gone or
    stopped: what it said it ran then is `last_tasks`, its last heartbeat `gone_since`), pid,
    host, age in seconds, whether that process still runs (null when it runs on another host),
    and a summary with what to do if no worker has been seen lately (restart_worker starts one).
    A worker on another host silent for over 30 s is `stale`: it keeps its `tasks`, which it may
    still be running (their leases stay its own until their heartbeat is WORKER_STALE_SEC old,
    900 s by default): do not retry or cancel them on that alone."""
    return cast(WorkerState, worker_state())


def _run_quiet(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    # stdin from /dev/null: under stdio our stdin is the JSON-RPC pipe and must not be inherited.
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def _launchd_restart() -> dict[str, Any] | None:
    launchctl = shutil.which("launchctl")
    if not launchctl:
        return None
    target = f"gui/{os.getuid()}/{LAUNCHD_LABEL}"
    if _run_quiet([launchctl, "print", target]).returncode != 0:
        return None
    argv = [launchctl, "kickstart", "-k", target]
    proc = _run_quiet(argv)
    if proc.returncode != 0:
        raise ToolError(f"`launchctl kickstart -k {target}` failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    return {"method": "launchctl", "command": argv, "pid": None,
            "detail": f"kickstarted the launchd agent {LAUNCHD_LABEL} (a new pass runs now)"}


def _systemd_restart() -> dict[str, Any] | None:
    systemctl = shutil.which("systemctl")
    if not systemctl or _run_quiet([systemctl, "--user", "cat", SYSTEMD_UNIT]).returncode != 0:
        return None
    argv = [systemctl, "--user", "restart", SYSTEMD_UNIT]
    proc = _run_quiet(argv, timeout=60)
    if proc.returncode != 0:
        raise ToolError(f"`systemctl --user restart {SYSTEMD_UNIT}` failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    return {"method": "systemctl", "command": argv, "pid": None,
            "detail": f"restarted the systemd user unit {SYSTEMD_UNIT} (a new pass runs now)"}


def _detached_pass() -> dict[str, Any]:
    script = REPO_DIR / "worker.py"
    if not script.exists():
        raise ToolError(f"no launchd agent or systemd unit is installed and {script} is missing; reinstall TaskBridge")
    out = store.log_dir() / "worker-restart.log"
    argv = [sys.executable, str(script)]
    probe = store.take_lock(store.worker_lock_path())   # a pass started while another holds it exits at once
    if probe is None:
        holder = store.read_worker_heartbeat() or {}
        return {"method": "already-running", "command": argv, "pid": holder.get("pid"),
                "detail": f"a worker pass already runs this queue (pid {holder.get('pid', '?')}, "
                          f"{holder.get('state') or 'running'}): it takes pending tasks itself; nothing was started"}
    os.close(probe)
    with store.append_private(out) as sink:
        proc = subprocess.Popen(argv, cwd=str(REPO_DIR), stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    # Reap it when it ends, so a long-lived server does not collect zombies.
    threading.Thread(target=proc.wait, name=f"reap-worker-{proc.pid}", daemon=True).start()
    return {"method": "detached", "command": argv, "pid": proc.pid,
            "detail": f"no launchd agent or systemd unit found; started one detached worker pass "
                      f"(pid {proc.pid}, output in {out}); install.sh sets up the schedule"}


@registry.tool(RESTARTS, title="Run the worker now")
def restart_worker() -> RestartResult:
    """Make a worker pass run now. macOS: `launchctl kickstart -k` of the agent com.taskbridge.worker
    when it is loaded; Linux: `systemctl --user restart taskbridge-worker.service` when that unit is
    installed; otherwise it starts one detached `python worker.py` pass, unless a pass already runs
    this queue (`method` "already-running", its pid: nothing is started). Returns which it did
    (`method`), the command and, for a detached pass, its pid. Errors: the service manager refused."""
    return cast(RestartResult, _launchd_restart() or _systemd_restart() or _detached_pass())


@registry.tool(ADDS, title="Add a note to a task")
def add_task_note(
    task_id: TaskId,
    text: Annotated[str, Field(description="the note (≤20,000 characters), stored exactly as sent")],
) -> NoteResult:
    """Add a note to a task that has not finished. A running task's agent gets it in its running
    session before its next model call (a step boundary); one that comes during the agent's last
    model call gets a turn of its own in that session on the warm engine (worker.py --engine
    warm), and otherwise waits. Else it reaches the agent in its next prompt (the next attempt, or
    the resume after a question). `delivery` says which; the task's notes (get_task) and its
    receipt say when and how each note was delivered.
    Errors: unknown id, empty or too long text, the task already finished (submit a follow-up
    with continue_from instead)."""
    return cast(NoteResult, store.add_note(task_id, text, author="planner"))


@registry.tool(ENDS, title="Cancel a task")
def cancel_task(
    task_id: TaskId,
    reason: Annotated[OptText, Field(description="why, recorded on the task (at most 20,000 characters)")] = "cancelled by the planner",
) -> TaskInfo:
    """Cancel a pending, waiting or running task (a running agent is stopped within seconds).
    A running agent's changes until then are kept in the task's receipt (`result`: files_touched)
    and `diff` once its worker has ended it (a readonly run's are reverted: `files_reverted`); its
    worktree goes unless kept, its branch stays only with commits on it (`kept` says where the
    work stays). Tasks that depend on it fail, naming it.
    Errors: unknown id, the task already finished."""
    return cast(TaskInfo, _echo(store.cancel_task(task_id, reason or "cancelled by the planner")))


@registry.tool(ADDS, title="Retry a task")
def retry_task(
    task_id: TaskId,
    model: Annotated[OptText, Field(description="provider/model (or a plain model name one provider offers) to use from now on; default: keep the task's")] = None,
    note: Annotated[OptText, Field(description="extra instructions (≤20,000 characters) the agent gets in its next prompt, stored exactly as sent")] = None,
) -> RetryResult:
    """Requeue a failed or cancelled task with a fresh budget: it is pending again, may fail
    `max_retries` more times before it fails for good, and its next attempt starts a new OpenCode
    session (attempt numbers go on). `model` replaces its model; `note` adds instructions as a note.
    Tasks that failed only because this one failed or was cancelled are requeued too
    (`requeued_dependents`). A task on a remote whose push failed keeps its commit in a worktree on
    the machine that ran it: the task is pinned to that host, whose worker pushes the commit again
    without running the agent (`unpushed` says which host). A task cancelled while it ran starts
    only once the worker of that attempt has wrapped it up (its receipt, a readonly run's revert,
    its worktree; seconds) or is found gone: `waits` says so, and nothing needs doing about it.
    Then wait_for([id]) as after a submit.
    Errors (nothing is written then): unknown id, a task that is not failed or cancelled (done:
    submit a follow-up task; pending, running or waiting: cancel it first), a follow-up whose task
    another live follow-up continues now (both would work in one worktree: cancel that one, or
    continue from it), a bad model, an empty or too long note."""
    task = store.retry_task(task_id, model=_model_arg(model), note=note, author="planner")
    return cast(RetryResult, _echo(task) | {"requeued_dependents": task["requeued_dependents"],
                                            "unpushed": worktrees.unpushed_note(task), "waits": task["waits"]})


@registry.tool(ADDS, title="Apply a task to the checkout")
async def apply_task(
    task_id: TaskId,
    ctx: Context,
    mode: Annotated[Literal["merge", "squash", "cherry-pick"] | None,
                    Field(description="merge: a merge commit (or fast-forward); squash: one new commit; cherry-pick: copy the task's commits")] = "merge",
) -> ApplyResult:
    """Bring a done task's work (its branch taskbridge/<id>) into the current branch of the user's
    checkout at the task's working_dir. Returns `status` "applied" (with `files` changed and the new
    `head`) or "already-applied" (the branch, or its changes from an earlier apply in another mode,
    were in HEAD already; nothing changed), and `before`, the commit to reset to in order to undo it.
    It applies up to the task's own commit (`tip`): a follow-up's later commits on the same branch
    (`later` counts them) are applied by applying that follow-up.
    Errors (the checkout untouched): the task is not done, made no change ("no change, nothing to
    apply"; its empty branch was deleted), has no branch or made no commit, its
    branch was deleted; the checkout has uncommitted changes to tracked files, a detached HEAD, an
    unfinished merge or rebase, or is on the task's branch. A conflict aborts the apply: the error
    names the conflicting files and the checkout is exactly as it was (HEAD, index, files).
    Applies into one checkout run one at a time, whichever client asks: another under way is
    waited for up to 60 s, then an error says so.
    With a client that can show forms (elicitation) the person is asked first; their "no" is an
    error and nothing changes; a decline or no answer leaves your call to stand."""
    task = store.get_task(task_id)
    # A task that changed nothing has nothing to ask about: apply_branch says so.
    if task["status"] == "done" and not worktrees.no_change_note(task) and \
            await human_asks.confirm_apply(ctx, task, mode or "merge") is False:
        raise ToolError(f"the person chose not to apply {task['id']} now (asked through your client); "
                        "the checkout is unchanged")
    return cast(ApplyResult, await anyio.to_thread.run_sync(worktrees.apply_branch, task, mode or "merge"))


@registry.tool(REMOVES, title="Clear finished tasks")
def clear_finished(
    older_than_sec: Annotated[int | None, Field(ge=0, le=NUMBER_MAX, description="only tasks finished at least this many seconds ago")] = 0,
    statuses: Annotated[list[Literal["done", "failed", "cancelled"]] | None,
                        BeforeValidator(lambda v: None if store.optional(v) is None else _as_list(v)),
                        Field(description="which finished statuses to remove; default all three")] = None,
    remove_logs: Annotated[bool | None, Field(description="also delete their log files (on PostgreSQL a log lives in the database and always goes with its task) and their OpenCode sessions (those a remaining follow-up resumes stay)")] = False,
    remove_worktrees: Annotated[bool | None, Field(description="also remove worktrees kept with worktree_keep (branches stay); without it their tasks stay in the queue")] = False,
) -> ClearResult:
    """Remove finished tasks (done, failed, cancelled) from the queue; tasks that an unfinished
    task depends on (or follows up) are kept (`kept_for_dependents`: id -> those tasks), and so
    are tasks whose kept worktree is still on disk (ids in
    `kept_for_worktrees`: call again with remove_worktrees to remove those worktrees and the tasks),
    and so are tasks whose worktree was kept on another machine (`kept_on_hosts`: host -> ids; only
    a clear on that host can remove them, remove_worktrees included).
    Log files are deleted only when asked (on PostgreSQL a task's log is in the database and goes
    with the task); the folders its earlier worktrees were set aside to (`leftovers_removed`:
    `<worktree root>/left/<id>-<n>`, named in its `leftover` events) always go with it; a task
    whose worktree or such a folder could not be removed stays in the queue, named in
    `problems`; task branches always stay.
    Returns the removed ids (`count` is the total; past some thousands of tasks the lists are
    shortened to keep the result under 40,000 characters). Errors: a status that is not a finished one."""
    removed, purged = worktrees.clear_finished(older_than_sec or 0, statuses or store.TERMINAL,
                                               remove_logs=bool(remove_logs), remove_worktrees=bool(remove_worktrees))
    shown, _ = mcp_shared.fit({"removed": [t["id"] for t in removed], "count": len(removed)} | purged, RESULT_CHARS)
    return shown


@registry.tool(CATALOGUE, title="List models")
def list_models(
    search: Annotated[OptText, Field(description="words that must all appear in the id or name (case-insensitive)")] = None,
    provider: Annotated[OptText, Field(description="only this provider, e.g. opencode")] = None,
    limit: Annotated[int | None, Field(ge=1, le=LIST_PAGE_MAX, description="models per page (default 50)")] = 50,
    offset: Annotated[int | None, Field(ge=0, le=NUMBER_MAX, description="models to skip")] = 0,
    refresh: Annotated[bool | None, Field(description="ask OpenCode again instead of the one-minute cache")] = False,
) -> ModelPage:
    """Models OpenCode can use here (from `opencode models --verbose`): id (provider/model), name,
    cost (USD per million tokens, as OpenCode reports it: input, output, cache.read, cache.write), context and output
    limits (tokens). `resolved` is the full id when `search` is a plain model name that exactly one
    provider offers. limit models a page (default 50, at most 200; fewer when the page would pass
    40,000 characters): pass next_offset back as offset. Errors: OpenCode not installed, unknown
    provider."""
    models = known_models(store.optional(provider), bool(refresh))
    chosen = opencode_runner.search_models(models, store.optional(search))
    resolved = None
    if (store.optional(search) or "").split():
        with contextlib.suppress(ToolError):
            resolved = resolve_model(search or "", models)
    start, size = offset or 0, limit or 50
    rows = chosen[start:start + size]
    extra = {"default_model": task_views.current_default_model(ask=True), "resolved": resolved}
    return mcp_shared.fit_page(lambda n: _page_of(rows[:n], "models", len(chosen), start) | extra,
                               max(1, len(rows)), RESULT_CHARS)


@registry.tool(OVERWRITES_SETTING, title="Set the default model")
def set_default_model(
    model: Annotated[str, Field(description="provider/model, or a plain model name that exactly one provider offers")],
) -> DefaultModel:
    """Set the model for tasks that name none; checked against `opencode models` and stored in the
    queue's settings (it outlives restarts and beats WORKER_MODEL and OpenCode's configured model).
    `previous` is the default before (null when it could not be told). Errors: unknown model, an
    ambiguous plain name (the candidates are listed), OpenCode not installed."""
    resolved = resolve_model(model, known_models())
    previous = task_views.current_default_model(ask=True)
    store.set_setting("default_model", resolved)
    return {"model": resolved, "previous": previous,
            "resolved_from": model if resolved != model.strip() else None}


@registry.tool(SETS_BUDGET, title="Set the spending budget")
def set_budget(
    daily_usd: Annotated[float | None, Field(ge=0, le=spec.USD.hi, allow_inf_nan=False, description="USD the whole queue may spend per local day; 0 removes the budget; omit to keep it")] = None,
    daily_tokens: Annotated[int | None, Field(ge=0, le=spec.TOKENS.hi, description="tokens per local day (models with no price); 0 removes; omit to keep")] = None,
    default_max_cost_usd: Annotated[float | None, Field(ge=0, le=spec.USD.hi, allow_inf_nan=False, description="USD limit a new task gets when it names none; 0 removes; omit to keep")] = None,
    default_max_tokens: Annotated[int | None, Field(ge=0, le=spec.TOKENS.hi, description="token limit a new task gets when it names none; 0 removes; omit to keep")] = None,
) -> BudgetState:
    """Set the queue's daily budget and the spending limits new tasks get by default; returns the
    budget state (as queue_status's `budget`). The day is the machine's local calendar day: the
    meter starts again at local midnight. While today's spend is at the budget the worker claims
    nothing new (a running task pauses at its next step and asks); raising it lets the next pass
    take work. Errors: a negative or too large value."""
    given = {"daily_usd": daily_usd, "daily_tokens": daily_tokens,
             "default_max_cost_usd": default_max_cost_usd, "default_max_tokens": default_max_tokens}
    return cast(BudgetState, store.set_budget(**{k: v for k, v in given.items() if v is not None}))


@registry.tool(READ_ONLY, title="Check the server")
def ping(ctx: Context) -> PingResult:
    """Check the server: version, the database path and its task count, the default model, the
    worker's state in one line, and who is calling (your clientInfo name, version and kind)."""
    name, version = caller_of(ctx)
    snapshot = queue_snapshot()
    return {"ok": True, "server": SERVER_NAME, "version": VERSION, "database": snapshot["database"],
            "tasks": snapshot["total"], "default_model": snapshot["default_model"],
            "worker": snapshot["worker"]["summary"],
            "caller": {"name": name, "version": version, "kind": store.caller_kind(name) if name else None},
            "protocol_version": getattr(ctx, "protocol_version", None)}


# --------------------------------------------------------------------------------------------
# Entry point.


def build_app(server: MCPServer | None = None) -> Any:
    """The one Starlette app for every HTTP transport (http_app.build_app) around ``server``, by
    default a fresh one with every tool; reads the token and allowlist now."""
    return http_app.build_app(server or build_server())


def configure_logging(level: str) -> None:
    """Everything to stderr: on stdio, stdout carries JSON-RPC only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def port_number(text: str) -> int:
    """argparse type of ``--port``: a whole number 0..65535 (0 lets the system pick)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: give 0-65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: give 0-65535 (0 picks a free port)")
    return port


def bind_address(text: str) -> str:
    """argparse type of ``--host``: a name or address this machine can bind (checked with getaddrinfo)."""
    host = text.strip()
    if not host:
        raise argparse.ArgumentTypeError("the address is empty: give 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot bind to {host!r} ({getattr(exc, 'strerror', None) or exc}): "
                                         "give an address of this machine such as 127.0.0.1") from None
    return host


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value ends with argparse's usage message and exit status 2."""
    parser = argparse.ArgumentParser(description="TaskBridge MCP server (stdio by default).")
    parser.add_argument("--transport", choices=("stdio", "streamable-http", "sse"), default="stdio",
                        help="stdio (Claude Desktop) or HTTP; either HTTP choice serves /mcp and /sse on one port")
    parser.add_argument("--host", type=bind_address, default="127.0.0.1",
                        help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8765, help="HTTP port, 0-65535 (default 8765)")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="stderr log level")
    parser.add_argument("--db", metavar="URL", default=None,
                        help="the queue: a postgresql:// URL or a SQLite file (default $TASK_DB_URL, else "
                             "$TASK_DB_PATH or <repo>/tasks.db); sets TASK_DB_URL for this process")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:   # before anything touches the store
        knobs.select_database(args.db)
    except knobs.KnobError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    refused = knobs.problems(("TASKBRIDGE_GIT_TIMEOUT_SEC", "MCP_WAIT_POLL_SEC", "MCP_CHANNEL_PUSH"))   # the ones its tools read
    if refused:
        print(f"refusing to start: {refused[0]}", file=sys.stderr)
        return 2
    if args.transport == "stdio":
        log.info("TaskBridge MCP %s on stdio; database %s", VERSION, store.database_label())
        build_server().run("stdio")
        return 0
    try:
        token = bearer_token()
    except TokenConfigError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not token:
        print(f"refusing to serve on {args.host} without a bearer token: set MCP_BEARER_TOKEN or create "
              f"{token_file()} (install.sh does), or bind to 127.0.0.1", file=sys.stderr)
        return 2
    try:
        app = build_app()
    except TokenConfigError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    try:
        store.last_event_id()   # a queue that cannot be used is refused before serving, as serve.py does
        sock = http_app.listening_socket(args.host, args.port)
    except store.TaskStoreError as exc:   # its message names the queue and the way out
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 1
    except http_app.PortTaken as exc:
        print(exc.strerror, file=sys.stderr)
        return 1
    log.info("TaskBridge MCP %s on http://%s:%d (/mcp, /sse, /health, /api); database %s",
             VERSION, args.host, args.port, store.database_label())
    http_app.serve(app, sock, args.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
