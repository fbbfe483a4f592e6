"""MCP Tasks for the queue: the ``io.modelcontextprotocol/tasks`` extension (2026-07-28) over
TaskBridge's own tasks.

A client that declares the extension in a request's capabilities and calls ``submit_task`` gets
a task handle (``resultType: "task"``) instead of the tool's result; the handle's ``taskId`` is
the queue's id (``t_0001``). Then:

- ``tasks/get`` reads the queue: pending and running are ``working``, waiting is
  ``input_required`` (the agent's question as a form elicitation in ``inputRequests``), done is
  ``completed`` (``result``: submit_task's result for the finished task with the receipt
  ``get_task_result`` returns merged in), failed is ``failed`` (``error``:
  the task's error, its receipt in ``error.data``), cancelled is ``cancelled``; ``statusMessage``
  says what the task is doing or why it ended.
- ``tasks/update`` answers the question (``inputResponses``: the form's ``answer`` accepted under
  the key ``tasks/get`` gave); a response under any other key, or one declined, is ignored as the
  extension asks, and the task keeps waiting.
- ``tasks/cancel`` cancels the task as ``cancel_task`` does.

The 2025-11-25 form (the experimental tasks of that protocol's core, which VS Code declares) is
served too: the ``tasks`` capability at ``initialize``, ``execution.taskSupport: optional`` on
``submit_task``; a call with a ``task`` field gets ``{"task": ...}`` (``ttl``/``pollInterval``);
``tasks/get``, ``tasks/cancel`` (returning the task), ``tasks/result`` (blocks until the task
ends: its final result, ``isError`` for a failed task) and ``tasks/list`` (pages of 20, cursor).
A question reaches a client that declared elicitation as a form on the blocked ``tasks/result``
request's stream (else, and after a decline, ``answer_task`` answers it). The SDK checks a 2025-11-25 ``tools/call``
reply against ``CallToolResult`` even from an extension, so that handle is made by a server
middleware, whose own result the SDK sends as it is.

Bad input is a JSON-RPC error with one line naming it: an unknown or malformed task id or cursor,
the cancel of a finished task, the result of a cancelled one (-32602), a 2026 client that did not
declare the extension (-32021).

Used by opencode_bridge_mcp.py (``build_server``); not run on its own; reads no env of its own.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pydantic
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CallToolRequestParams,
    CallToolResult,
    CancelTaskRequestParams,
    ElicitResult,
    GetTaskPayloadRequestParams,
    GetTaskRequestParams,
    PaginatedRequestParams,
    RequestParams,
)
from mcp_types.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

import task_store as store
import task_views

log = logging.getLogger("taskbridge.mcp")

EXTENSION_ID = "io.modelcontextprotocol/tasks"
TASK_TOOLS = frozenset({"submit_task"})     # the tools whose call becomes a task handle
POLL_INTERVAL_MS = 5000     # a worker pass takes seconds at least; polling faster learns nothing
ANSWER_FIELD = "answer"     # the one field of the question's form

STATUS = {"pending": "working", "running": "working", "waiting": "input_required",
          "done": "completed", "failed": "failed", "cancelled": "cancelled"}
_MODERN = frozenset(MODERN_PROTOCOL_VERSIONS)
LEGACY = "2025-11-25"       # the handshake protocol whose core has (experimental) tasks
_BOTH = _MODERN | {LEGACY}
LIST_PAGE = 20              # tasks/list rows a page
RESULT_POLL_SEC = 1.0       # how often a blocked tasks/result reads the task again
RELATED_TASK = "io.modelcontextprotocol/related-task"
LEGACY_CAPABILITY: dict[str, Any] = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}


class UpdateTaskParams(RequestParams):
    """``tasks/update`` params: the task and the client's responses keyed as ``inputRequests`` were."""

    task_id: str
    input_responses: dict[str, Any]


class QueueTasks(Extension):
    """The tasks extension over the queue; ``attach`` it to the server it was constructed into,
    whose tools give a finished task's result."""

    identifier = EXTENSION_ID

    def __init__(self) -> None:
        self.server: MCPServer | None = None
        self.echo: Callable[[dict[str, Any]], dict[str, Any]] = dict

    def attach(self, server: MCPServer, echo: Callable[[dict[str, Any]], dict[str, Any]]) -> MCPServer:
        """Remember ``server`` (built with this extension), whose ``get_task_result`` gives a
        finished task's receipt, and ``echo``, which shapes a store task dict as ``submit_task``
        answers (the final result must fit the called tool's output schema); add the 2025-11-25
        form's middleware to it. Returns ``server``."""
        self.server, self.echo = server, echo
        server.middleware.append(self.legacy_middleware)
        return server

    def methods(self) -> Sequence[MethodBinding]:
        # One binding a method: where both protocols have it, the handler answers each its shape.
        return (MethodBinding("tasks/get", GetTaskRequestParams, self.get, _BOTH),
                MethodBinding("tasks/update", UpdateTaskParams, self.update, _MODERN),
                MethodBinding("tasks/cancel", CancelTaskRequestParams, self.cancel, _BOTH),
                MethodBinding("tasks/result", GetTaskPayloadRequestParams, self.result, frozenset({LEGACY})),
                MethodBinding("tasks/list", PaginatedRequestParams, self.list_page, frozenset({LEGACY})))

    async def intercept_tool_call(self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any],
                                  call_next: CallNext) -> HandlerResult:
        """Run the tool as usual; a task tool's success, for a client that declared the
        extension on this request, is answered with the task's handle instead."""
        result = await call_next(ctx)
        if params.name not in TASK_TOOLS or not declares_tasks(ctx) or not isinstance(result, CallToolResult):
            return result
        task_id = (result.structured_content or {}).get("id")
        if result.is_error or not isinstance(task_id, str):
            return result
        try:
            task = await anyio.to_thread.run_sync(task_views.shown_task, task_id)
        except store.TaskStoreError:
            # The task is queued (the handle must not come before that); a queue that cannot be
            # read back this moment still owes the caller the submit's own result.
            return result
        return {"resultType": "task", **task_view(task)}

    async def get(self, ctx: ServerRequestContext[Any, Any], params: GetTaskRequestParams) -> dict[str, Any]:
        """``tasks/get``: the task's state, with its question, result or error by status.

        Raises MCPError: -32021 (extension not declared), -32602 (unknown or malformed id)."""
        task = await _task(ctx, params.task_id)
        if ctx.protocol_version == LEGACY:
            return legacy_view(task)
        return task_view(task) | await self._payload(task)

    async def update(self, ctx: ServerRequestContext[Any, Any], params: UpdateTaskParams) -> dict[str, Any]:
        """``tasks/update``: answer the outstanding question with an accepted form's ``answer``;
        other keys and declined forms are ignored. Returns the empty acknowledgement.

        Raises MCPError: -32021, -32602 (unknown id; an answer the store refuses, e.g. empty)."""
        task = await _task(ctx, params.task_id)
        key = question_key(task)
        response = params.input_responses.get(key) if key else None
        answer = _accepted_answer(response)
        if answer is not None:
            await _store_call(store.answer_task, task["id"], answer, "planner")
        return {}

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: CancelTaskRequestParams) -> dict[str, Any]:
        """``tasks/cancel``: cancel the task as ``cancel_task`` does; returns the empty
        acknowledgement (2026-07-28) or the cancelled task (2025-11-25).

        Raises MCPError: -32021, -32602 (unknown id, or the task already finished)."""
        _require_declared(ctx)
        task = await _store_call(store.cancel_task, params.task_id, "cancelled by the client (tasks/cancel)")
        if ctx.protocol_version == LEGACY:
            return legacy_view(await _store_call(store.get_task, task["id"]))
        return {}

    async def result(self, ctx: ServerRequestContext[Any, Any], params: GetTaskPayloadRequestParams) -> dict[str, Any]:
        """``tasks/result`` (2025-11-25): block until the task ends, then give the tool's result:
        for a done task as ``get`` completes it, for a failed one that result marked ``isError``.
        A question asked meanwhile goes to a client that declared elicitation as a form on this
        request's stream (once per question).

        Raises MCPError -32602: unknown or malformed id, or the task was cancelled."""
        task = await _store_call(store.get_task, params.task_id)
        asked: set[str | None] = set()
        while task["status"] not in store.TERMINAL:
            if task["status"] == "waiting" and question_key(task) not in asked and _can_elicit(ctx):
                asked.add(question_key(task))       # each question once: a decline leaves it to answer_task
                await _ask_while_waiting(ctx, task)
            await anyio.sleep(RESULT_POLL_SEC)
            task = await _store_call(store.get_task, task["id"])
        if task["status"] == "cancelled":
            raise MCPError(INVALID_PARAMS, f"{task['id']} was cancelled, so it has no result: {status_message(task)}")
        final = await self._final_result(task)
        meta = {**(final.get("_meta") or {}), RELATED_TASK: {"taskId": task["id"]}}
        return final | {"_meta": meta} | ({"isError": True} if task["status"] == "failed" else {})

    async def list_page(self, _ctx: ServerRequestContext[Any, Any], params: PaginatedRequestParams) -> dict[str, Any]:
        """``tasks/list`` (2025-11-25): a page of the queue's tasks in list_tasks' order, with
        ``nextCursor`` while more follow.

        Raises MCPError -32602: a cursor tasks/list did not give."""
        page = await _store_call(lambda: store.list_tasks(limit=LIST_PAGE, cursor=params.cursor))
        return {"tasks": [legacy_view(task) for task in page["tasks"]],
                **({"nextCursor": page["next_cursor"]} if page["next_cursor"] else {})}

    async def legacy_middleware(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """The 2025-11-25 form, where the SDK's per-version result check refuses what an
        extension returns for ``tools/call``: a server middleware's own result is sent as it is.
        Advertises the ``tasks`` capability at ``initialize``, marks the task tools
        ``execution.taskSupport: optional`` in ``tools/list``, and answers a task tool called
        with ``task`` (its success) with ``{"task": ...}``; every other request passes."""
        result = await call_next(ctx)
        if ctx.request_id is None or not isinstance(result, dict):
            return result
        if ctx.method == "initialize" and result.get("protocolVersion") == LEGACY:
            return result | {"capabilities": {**result.get("capabilities", {}), "tasks": LEGACY_CAPABILITY}}
        if ctx.protocol_version != LEGACY:
            return result
        if ctx.method == "tools/list":
            marked = {"execution": {"taskSupport": "optional"}}
            return result | {"tools": [tool | marked if tool.get("name") in TASK_TOOLS else tool
                                       for tool in result.get("tools", [])]}
        params = ctx.params or {}
        if ctx.method != "tools/call" or params.get("name") not in TASK_TOOLS or params.get("task") is None:
            return result
        task_id = (result.get("structuredContent") or {}).get("id")
        if result.get("isError") or not isinstance(task_id, str):
            return result
        try:
            task = await anyio.to_thread.run_sync(task_views.shown_task, task_id)
        except store.TaskStoreError:
            return result
        return {"task": legacy_view(task)}

    async def _payload(self, task: dict[str, Any]) -> dict[str, Any]:
        """The status's own field: the question, the tool result, or the error."""
        status = STATUS[task["status"]]
        if status == "input_required":
            return {"inputRequests": {question_key(task): question_request(task)}}
        if status == "completed":
            return {"result": await self._final_result(task)}
        if status == "failed":
            receipt = (await self._receipt(task["id"])).get("structuredContent")
            return {"error": {"code": INTERNAL_ERROR, "message": task.get("error") or "the task failed",
                              "data": receipt}}
        return {}

    async def _final_result(self, task: dict[str, Any]) -> dict[str, Any]:
        """What the task-augmented submit_task returns in the end: its own result's fields for the
        finished task (a client checks them against the tool's output schema) overlaid with the
        receipt get_task_result gives (result, usage, the diff's first page), and that tool's
        resource links."""
        receipt = await self._receipt(task["id"])
        merged = self.echo(task) | (receipt.get("structuredContent") or {})
        links = [block for block in receipt.get("content") or [] if block.get("type") != "text"]
        return receipt | {"structuredContent": merged,
                          "content": [{"type": "text", "text": json.dumps(merged, indent=2, ensure_ascii=False)},
                                      *links]}

    async def _receipt(self, task_id: str) -> dict[str, Any]:
        if self.server is None:
            raise MCPError(INTERNAL_ERROR, "the tasks extension was not attached to its server (QueueTasks.attach)")
        result = await self.server.call_tool("get_task_result", {"task_id": task_id})
        return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def declares_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether this request's client declared the extension (on 2026-07-28, per request)."""
    if ctx.protocol_version not in _MODERN:
        return False
    capabilities = ctx.session.client_capabilities
    extensions = capabilities.extensions if capabilities else None
    return EXTENSION_ID in (extensions or {})


def _can_elicit(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether the (2025-11-25) client declared form elicitation at initialize."""
    capabilities = ctx.session.client_capabilities
    elicitation = capabilities.elicitation if capabilities else None
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


async def _ask_on_result_stream(ctx: ServerRequestContext[Any, Any], task: dict[str, Any]) -> None:
    """Ask a waiting task's question as 2025-11-25 asks a task's input: an elicitation sent on
    the blocked ``tasks/result`` request's stream; an accepted answer answers the task. A client
    that fails the form, declines it, or sends an answer the store refuses leaves the question
    to ``answer_task``."""
    form = question_request(task)["params"]
    try:
        reply = await ctx.session.elicit_form(form["message"], form["requestedSchema"],
                                              related_request_id=ctx.request_id)
        answer = _accepted_answer(reply.model_dump(by_alias=True, mode="json"))
        if answer is not None:
            await _store_call(store.answer_task, task["id"], answer, "planner")
    except Exception as exc:  # noqa: BLE001 - whatever the client did, the task keeps waiting for answer_task
        log.info("tasks/result could not ask %s's question (%s): left to answer_task", task["id"], exc)


async def _ask_while_waiting(ctx: ServerRequestContext[Any, Any], task: dict[str, Any]) -> None:
    """``_ask_on_result_stream`` for as long as the question stands: the form is given up (its
    reply no longer awaited) once the task is answered elsewhere (answer_task, the CLI, another
    client) or ends, so tasks/result returns with the task, not with the person's form."""
    async with anyio.create_task_group() as group:
        async def ask() -> None:
            await _ask_on_result_stream(ctx, task)
            group.cancel_scope.cancel()
        group.start_soon(ask)
        while True:
            await anyio.sleep(RESULT_POLL_SEC)
            now = await _store_call(store.get_task, task["id"])
            if now["status"] != "waiting" or question_key(now) != question_key(task):
                group.cancel_scope.cancel()
                return


def _require_declared(ctx: ServerRequestContext[Any, Any]) -> None:
    # On 2025-11-25 the server's ``tasks`` capability is the whole negotiation.
    if ctx.protocol_version != LEGACY and not declares_tasks(ctx):
        raise MCPError(MISSING_REQUIRED_CLIENT_CAPABILITY,
                       f"Missing required client capability: declare the {EXTENSION_ID} extension in the "
                       "request's capabilities to use tasks/get, tasks/update and tasks/cancel",
                       {"requiredCapabilities": {"extensions": {EXTENSION_ID: {}}}})


async def _task(ctx: ServerRequestContext[Any, Any], task_id: str) -> dict[str, Any]:
    _require_declared(ctx)
    return await _store_call(store.get_task, task_id)


async def _store_call(fn: Any, *args: Any) -> Any:
    """Run a store function off the event loop; what it returns as it may be shown (task_views.shown:
    TaskBridge's secrets redacted, as every tool shows a task); its refusals become the protocol's
    -32602."""
    try:
        return task_views.shown(await anyio.to_thread.run_sync(fn, *args))
    except (store.TaskNotFound, store.ValidationError, store.InvalidTransition) as exc:
        raise MCPError(INVALID_PARAMS, str(exc)) from None


def task_view(task: dict[str, Any]) -> dict[str, Any]:
    """The extension's ``Task`` fields for a queue task dict (``store.get_task``'s shape)."""
    return {"taskId": task["id"], "status": STATUS[task["status"]], "statusMessage": status_message(task),
            "createdAt": task["created_at"], "lastUpdatedAt": last_updated(task),
            "ttlMs": None, "pollIntervalMs": POLL_INTERVAL_MS}


def legacy_view(task: dict[str, Any]) -> dict[str, Any]:
    """The 2025-11-25 ``Task`` (``ttl`` and ``pollInterval`` where 2026 has ``ttlMs``, ``pollIntervalMs``)."""
    return {"taskId": task["id"], "status": STATUS[task["status"]], "statusMessage": status_message(task),
            "createdAt": task["created_at"], "lastUpdatedAt": last_updated(task),
            "ttl": None, "pollInterval": POLL_INTERVAL_MS}


def last_updated(task: dict[str, Any]) -> str:
    """The time of the task's last event (a list row has no events: its latest timestamp)."""
    events = task.get("events") or []
    if events:
        return events[-1]["ts"]
    stamps = [task.get(key) for key in ("created_at", "claimed_at", "started_at", "heartbeat_at", "finished_at")]
    return max(stamp for stamp in stamps if stamp)


def status_message(task: dict[str, Any]) -> str:
    """One line on what the task is doing, or how it ended."""
    status = task["status"]
    if status == "pending":
        return "queued: waiting for a worker (or for its dependencies)"
    if status == "running":
        return f"running attempt {task['attempts']}"
    if status == "waiting":
        return f"waiting for an answer: {task.get('question') or ''}".strip()
    if status == "done":
        summary = (task.get("result") or {}).get("summary") if isinstance(task.get("result"), dict) else None
        return f"done: {summary}" if summary else "done"
    return f"{status}: {task.get('error')}" if task.get("error") else status


def question_key(task: dict[str, Any]) -> str | None:
    """The ``inputRequests`` key of a waiting task's question: one per question asked, so a key is
    never reused over the task's life."""
    if task["status"] != "waiting":
        return None
    return f"question-{len(task.get('questions') or []) or 1}"


def question_request(task: dict[str, Any]) -> dict[str, Any]:
    """The waiting task's question as a form elicitation with one text field, ``answer``."""
    return {"method": "elicitation/create",
            "params": {"mode": "form", "message": task.get("question") or "The task is waiting for an answer.",
                       "requestedSchema": {"type": "object", "required": [ANSWER_FIELD], "properties": {
                           ANSWER_FIELD: {"type": "string", "description": "your answer; the agent resumes with it"}}}}}


def _accepted_answer(response: Any) -> str | None:
    try:
        result = ElicitResult.model_validate(response)
    except pydantic.ValidationError:
        return None
    answer = (result.content or {}).get(ANSWER_FIELD) if result.action == "accept" else None
    return answer if isinstance(answer, str) else None
