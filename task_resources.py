"""A task's log, diff, transcript and receipt as MCP resources, and the resource links that the
queue tools' results carry to them (issue 22, part 4).

Clients that read resources (``resources/read``) fetch a whole log or diff on demand instead of
having it inlined in a tool result; clients that do not still get today's paged tools. URIs:

    taskbridge://tasks/t_0001/log          text/plain    the run log (its last RESOURCE_BYTES bytes)
    taskbridge://tasks/t_0001/diff         text/x-diff   the diff (its first RESOURCE_BYTES bytes)
    taskbridge://tasks/t_0001/transcript   application/json  the conversation (first 100 turns)
    taskbridge://tasks/t_0001/receipt      application/json  the receipt and usage

Not run on its own; opencode_bridge_mcp installs it (``install``). Reads no env of its own (the
store reads TASK_DB_URL / TASK_DB_PATH / TASK_LOG_DIR).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import ResourceLink

import task_store as store
import task_views

SCHEME = "taskbridge://tasks"
RESOURCE_BYTES = 1_000_000      # a resource read returns at most this much of a log or diff
TRANSCRIPT_TURNS = 100
LISTED_TASKS = 20               # resources/list names the resources of the newest tasks

# kind -> (MIME type, what it is, which tasks have it)
KINDS: dict[str, tuple[str, str]] = {
    "log": ("text/plain", "the agent's run log (OpenCode's JSON event stream and stderr)"),
    "diff": ("text/x-diff", "the task's diff (git, untracked files included)"),
    "transcript": ("application/json", "the conversation of the task's line of work, as turns"),
    "receipt": ("application/json", "the receipt (summary, files, commands, tests) and usage"),
}


def uri(task_id: str, kind: str) -> str:
    """``taskbridge://tasks/<id>/<kind>`` for a formatted task id (t_0001) and a KINDS key."""
    return f"{SCHEME}/{task_id}/{kind}"


def _task(task_id: str) -> dict[str, Any]:
    try:
        return store.get_task(task_id)
    except store.TaskStoreError as exc:
        raise ResourceError(str(exc)) from None


def _cut_note(kept: int, total: int, where: str) -> str:
    return (f"[{where} {kept:,} of {total:,} bytes; get_task_logs / get_task_result page through the rest]\n"
            if kept < total else "")


def read_log(task_id: str) -> str:
    """The task's run log, its last RESOURCE_BYTES bytes (a first line says when it was cut)."""
    task = _task(task_id)
    size = store.task_log_size(task["id"])
    start = max(0, size - RESOURCE_BYTES)
    data = store.read_task_log(task["id"], start, RESOURCE_BYTES) if size else b""
    return _cut_note(len(data), size, "the last") + data.decode("utf-8", errors="replace")


def read_diff(task_id: str) -> str:
    """The task's diff, its first RESOURCE_BYTES bytes (a first line says when it was cut)."""
    diff = (_task(task_id).get("diff") or "").encode()
    head = diff[:RESOURCE_BYTES]
    return _cut_note(len(head), len(diff), "the first") + head.decode("utf-8", errors="ignore")


async def read_transcript(task_id: str) -> str:
    """The line of work's conversation (task_views.transcript, the first TRANSCRIPT_TURNS turns)."""
    _task(task_id)
    page = await anyio.to_thread.run_sync(task_views.transcript, task_id, 0, TRANSCRIPT_TURNS)
    return json.dumps(page, ensure_ascii=False, indent=1)


def read_receipt(task_id: str) -> str:
    """The receipt, usage, status and branch of the task, as JSON."""
    task = _task(task_id)
    shown = {key: task.get(key) for key in ("id", "title", "status", "error", "result", "usage", "branch",
                                             "base_commit", "finished_at")}
    return json.dumps(shown, ensure_ascii=False, indent=1, default=str)


READERS: dict[str, Callable[[str], Any]] = {"log": read_log, "diff": read_diff,
                                            "transcript": read_transcript, "receipt": read_receipt}


def install(server: MCPServer) -> MCPServer:
    """Register the four resource templates on ``server``; returns it."""
    for kind, reader in READERS.items():
        mime, what = KINDS[kind]
        server.resource(f"{SCHEME}/{{task_id}}/{kind}", name=f"task {kind}", title=f"Task {kind}",
                        description=f"{what}; task_id like t_0001", mime_type=mime)(reader)
    return server


def links(task: dict[str, Any]) -> list[ResourceLink]:
    """Resource links for one task (a store or tool dict with ``id`` and ``status``): its log
    once a run started, its diff and receipt once it finished, its transcript once it has a run."""
    status, ident = task.get("status"), str(task["id"])
    kinds = ["log", "transcript"] if status != "pending" or task.get("attempts") else []
    if status in store.TERMINAL:
        kinds += ["diff", "receipt"]
    return [ResourceLink(type="resource_link", uri=uri(ident, k), name=f"{ident} {k}", mime_type=KINDS[k][0],
                         description=f"{ident}: {KINDS[k][1]}") for k in kinds]


def listed(limit: int = LISTED_TASKS) -> list[dict[str, Any]]:
    """Resources of the newest ``limit`` tasks, for resources/list: ``[{uri, name, mime_type,
    description}]`` (clients that offer resources to attach list these)."""
    rows = store.list_tasks(limit=limit)["tasks"]
    return [{"uri": link.uri, "name": link.name, "mime_type": link.mime_type, "description": link.description}
            for row in rows for link in links(row)]
