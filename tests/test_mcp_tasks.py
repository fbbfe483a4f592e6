"""MCP Tasks (the io.modelcontextprotocol/tasks extension, 2026-07-28) over the queue, with the
SDK's own client: a submit_task handle whose taskId is the queue's id, tasks/get following the
task as the store moves it (pending, running, waiting with its question, done with the result
get_task_result gives, failed, cancelled), tasks/update answering, tasks/cancel cancelling, the
protocol's errors for bad input; in memory and over streamable-http on a loopback port, and the
MCP Inspector's CLI (TypeScript, @modelcontextprotocol/ext-tasks) following a handle to its end."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import Implementation
from mcp_types import (
    CallToolResult,
    CancelTaskRequestParams,
    GetTaskRequestParams,
    Request,
    RequestParams,
    Result,
)
from pydantic import ConfigDict

import mcp_tasks
import opencode_bridge_mcp as bridge
import task_store
from helpers import require_pinned, serving

pytestmark = pytest.mark.anyio
MODERN = "2026-07-28"
TOKEN = "s3cret-token-value-for-tests"
CLAUDE = Implementation(name="claude-code", version="2.1.197")


# ---------------------------------------------------------------------------------------------
# A client speaking the extension: the SDK's claim mechanism for the handle, raw requests for
# tasks/*, each naming its task in the Mcp-Name header as the extension asks.


class TaskHandle(Result):
    """A ``resultType: "task"`` reply; the Task fields are kept as sent."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = "task"
    task_id: str
    status: str


class Detailed(Result):
    model_config = ConfigDict(extra="allow")


class GetTask(Request[GetTaskRequestParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: GetTaskRequestParams
    name_param = "taskId"


class UpdateParams(RequestParams):
    task_id: str
    input_responses: dict[str, Any]


class UpdateTask(Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: UpdateParams
    name_param = "taskId"


class CancelTask(Request[CancelTaskRequestParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: CancelTaskRequestParams
    name_param = "taskId"


async def get(c: Client, task_id: str) -> dict[str, Any]:
    result = await c.session.send_request(GetTask(params=GetTaskRequestParams(task_id=task_id)), Detailed)
    return result.model_dump(by_alias=True, mode="json")


async def update(c: Client, task_id: str, responses: dict[str, Any]) -> None:
    await c.session.send_request(UpdateTask(params=UpdateParams(task_id=task_id, input_responses=responses)), Detailed)


async def cancel(c: Client, task_id: str) -> None:
    await c.session.send_request(CancelTask(params=CancelTaskRequestParams(task_id=task_id)), Detailed)


class PollingTasks(ClientExtension):
    """Follows a handle with tasks/get until it ends, then gives the call its result."""

    identifier = mcp_tasks.EXTENSION_ID

    def __init__(self, poll_sec: float = 0.05) -> None:
        self.poll_sec = poll_sec

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskHandle, resolve=self.resolve)]

    async def resolve(self, handle: TaskHandle, ctx: ClaimContext) -> CallToolResult:
        while True:
            task = (await ctx.session.send_request(GetTask(params=GetTaskRequestParams(task_id=handle.task_id)),
                                                   Detailed)).model_dump(by_alias=True, mode="json")
            if task["status"] == "completed":
                return CallToolResult.model_validate(task["result"], by_name=False)
            if task["status"] in ("failed", "cancelled"):
                raise RuntimeError(f"{handle.task_id} {task['status']}: {task.get('statusMessage')}")
            await anyio.sleep(self.poll_sec)


@pytest.fixture
def wd(tmp_path) -> str:
    (tmp_path / "project").mkdir()
    return str(tmp_path / "project")


def args(wd: str, **over: Any) -> dict[str, Any]:
    return {"title": "Add a README", "instructions": "Write README.md", "working_dir": wd} | over


def in_memory(**kw: Any) -> Client:
    return Client(bridge.build_server(), mode=MODERN, client_info=CLAUDE, **kw)


def claim(task_id: str) -> str:
    return task_store.claim_next("test-worker", task_id=task_id)["run_marker"]


async def submit(c: Client, wd: str, **over: Any) -> TaskHandle:
    handle = await c.session.call_tool("submit_task", args(wd, **over), allow_claimed=True)
    assert isinstance(handle, TaskHandle), handle
    return handle


# ---------------------------------------------------------------------------------------------
# In memory.


async def test_the_server_advertises_the_extension():
    async with Client(bridge.build_server(), mode="auto", client_info=CLAUDE) as c:
        assert c.session.server_capabilities.extensions[mcp_tasks.EXTENSION_ID] == {}
    async with Client(bridge.build_server(), mode="legacy", client_info=CLAUDE) as c:
        assert c.session.server_capabilities.extensions is None     # a 2026 extension: not on the handshake


async def test_a_handle_follows_the_task_from_pending_to_done(wd):
    async with in_memory(extensions=[PollingTasks()]) as c:
        handle = await submit(c, wd)
        wire = handle.model_dump(by_alias=True, mode="json")
        assert handle.task_id == "t_0001" and task_store.get_task("t_0001")["status"] == "pending"
        assert wire["resultType"] == "task" and wire["status"] == "working"
        assert wire["ttlMs"] is None and wire["pollIntervalMs"] == mcp_tasks.POLL_INTERVAL_MS
        assert wire["createdAt"] == task_store.get_task("t_0001")["created_at"]
        assert "queued" in wire["statusMessage"]

        marker = claim("t_0001")
        running = await get(c, "t_0001")
        assert (running["status"], running["statusMessage"]) == ("working", "running attempt 1")
        assert running["resultType"] == "complete" and "result" not in running

        task_store.complete_attempt("t_0001", marker, result={"summary": "README written"}, diff="+readme\n",
                                    usage={"tokens": {"input": 10, "output": 5}, "cost_usd": 0.25})
        done = await get(c, "t_0001")
        assert (done["status"], done["statusMessage"]) == ("completed", "done: README written")
        receipt = done["result"]["structuredContent"]
        assert receipt["id"] == "t_0001" and receipt["status"] == "done"
        assert receipt["result"]["summary"] == "README written" and done["result"].get("isError") is not True
        direct = await c.call_tool("get_task_result", {"task_id": "t_0001"})
        assert direct.structured_content["result"] == receipt["result"]


async def test_a_question_is_input_required_and_tasks_update_answers_it(wd):
    async with in_memory(extensions=[PollingTasks()]) as c:
        handle = await submit(c, wd)
        task_store.pause_for_question(handle.task_id, claim(handle.task_id), "Which license?")
        waiting = await get(c, handle.task_id)
        assert waiting["status"] == "input_required" and "Which license?" in waiting["statusMessage"]
        [(key, request)] = waiting["inputRequests"].items()
        assert request["method"] == "elicitation/create" and request["params"]["message"] == "Which license?"
        assert request["params"]["requestedSchema"]["required"] == ["answer"]

        # Another key and a declined form are ignored: still waiting.
        await update(c, handle.task_id, {"question-99": {"action": "accept", "content": {"answer": "MIT"}},
                                         key: {"action": "decline"}})
        assert task_store.get_task(handle.task_id)["status"] == "waiting"

        await update(c, handle.task_id, {key: {"action": "accept", "content": {"answer": "MIT"}}})
        task = task_store.get_task(handle.task_id)
        assert task["status"] == "pending" and task["questions"][-1]["answer"] == "MIT"
        assert (await get(c, handle.task_id))["status"] == "working"

        # The next question gets a key of its own.
        task_store.pause_for_question(handle.task_id, claim(handle.task_id), "Which year?")
        again = await get(c, handle.task_id)
        assert list(again["inputRequests"]) != [key]
        with pytest.raises(MCPError) as refused:
            await update(c, handle.task_id, {next(iter(again["inputRequests"])): {"action": "accept",
                                                                                  "content": {"answer": "  "}}})
        assert refused.value.code == -32602


async def test_tasks_cancel_cancels_and_a_finished_task_is_refused(wd):
    async with in_memory(extensions=[PollingTasks()]) as c:
        handle = await submit(c, wd)
        await cancel(c, handle.task_id)
        assert task_store.get_task(handle.task_id)["status"] == "cancelled"
        cancelled = await get(c, handle.task_id)
        assert cancelled["status"] == "cancelled" and "tasks/cancel" in cancelled["statusMessage"]
        with pytest.raises(MCPError) as refused:
            await cancel(c, handle.task_id)
        assert refused.value.code == -32602 and "t_0001" in refused.value.message


async def test_a_failed_task_carries_its_error_and_receipt(wd):
    async with in_memory(extensions=[PollingTasks()]) as c:
        handle = await submit(c, wd)
        task_store.fail_attempt(handle.task_id, claim(handle.task_id), "it broke", retryable=False)
        failed = await get(c, handle.task_id)
        assert failed["status"] == "failed" and failed["statusMessage"] == "failed: it broke"
        assert failed["error"]["code"] == -32603 and failed["error"]["message"] == "it broke"
        assert failed["error"]["data"]["status"] == "failed"


@pytest.mark.parametrize("task_id,needle", [("t_0042", "t_0042"), ("banana", "banana")])
async def test_unknown_or_malformed_ids_are_invalid_params(task_id, needle):
    async with in_memory(extensions=[PollingTasks()]) as c:
        for call in (get(c, task_id), cancel(c, task_id), update(c, task_id, {})):
            with pytest.raises(MCPError) as refused:
                await call
            assert refused.value.code == -32602 and needle in refused.value.message


async def test_a_client_without_the_extension_gets_the_plain_result_and_no_tasks_methods(wd):
    async with in_memory() as c:
        plain = await c.call_tool("submit_task", args(wd))
        assert not plain.is_error and plain.structured_content["id"] == "t_0001"
        with pytest.raises(MCPError) as refused:
            await get(c, "t_0001")
    assert refused.value.code == -32021 and mcp_tasks.EXTENSION_ID in refused.value.message
    async with Client(bridge.build_server(), mode="legacy", client_info=CLAUDE) as legacy:
        assert not (await legacy.call_tool("submit_task", args(wd))).is_error


async def test_a_refused_submit_stays_a_tool_error_and_other_tools_stay_plain(wd):
    async with in_memory(extensions=[PollingTasks()]) as c:
        bad = await c.call_tool("submit_task", args(wd, working_dir="/no/such/dir"))
        assert bad.is_error and "/no/such/dir" in bad.content[0].text
        status = await c.call_tool("queue_status", {})
        assert not status.is_error


async def test_the_sdk_client_resolves_a_handle_into_the_final_result(wd):
    """Client(extensions=[...]) follows the handle itself: call_tool returns once the task ends."""
    async def play_worker() -> None:
        while True:
            try:
                task_store.get_task("t_0001")
                break
            except task_store.TaskNotFound:
                await anyio.sleep(0.01)
        marker = claim("t_0001")
        await anyio.sleep(0.1)
        task_store.complete_attempt("t_0001", marker, result={"summary": "ok"}, diff="",
                                    usage={"tokens": {"input": 1, "output": 1}, "cost_usd": 0.0})

    async with in_memory(extensions=[PollingTasks()]) as c, anyio.create_task_group() as group:
        group.start_soon(play_worker)
        with anyio.fail_after(20):
            final = await c.call_tool("submit_task", args(wd))
    assert not final.is_error and final.structured_content["status"] == "done"
    assert final.structured_content["result"]["summary"] == "ok"


# ---------------------------------------------------------------------------------------------
# Over streamable-http, the SDK client against the real app on a loopback port.


@pytest.fixture
def bearer(monkeypatch, tmp_path):
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)


def over_http(base: str, **kw: Any) -> Client:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    return Client(streamable_http_client(f"{base}/mcp", http_client=http), mode=MODERN, client_info=CLAUDE, **kw)


async def test_over_streamable_http_a_task_is_followed_answered_and_finished(wd, bearer):
    with serving() as base:
        async with over_http(base, extensions=[PollingTasks()]) as c:
            handle = await submit(c, wd)
            assert handle.task_id == "t_0001" and handle.status == "working"
            task_store.pause_for_question("t_0001", claim("t_0001"), "Which license?")
            waiting = await get(c, "t_0001")
            [key] = waiting["inputRequests"]
            await update(c, "t_0001", {key: {"action": "accept", "content": {"answer": "MIT"}}})
            assert (await get(c, "t_0001"))["status"] == "working"
            task_store.complete_attempt("t_0001", claim("t_0001"), result={"summary": "licensed"}, diff="",
                                        usage={"tokens": {"input": 1, "output": 1}, "cost_usd": 0.0})
            done = await get(c, "t_0001")
            assert done["status"] == "completed" and done["result"]["structuredContent"]["status"] == "done"
            with pytest.raises(MCPError) as refused:
                await cancel(c, "t_0001")
            assert refused.value.code == -32602
        async with over_http(base) as plain:
            with pytest.raises(MCPError) as undeclared:
                await get(plain, "t_0001")
            assert undeclared.value.code == -32021


# ---------------------------------------------------------------------------------------------
# A client nobody here wrote: the MCP Inspector CLI (pinned in package.json) in its modern era
# calls tools through @modelcontextprotocol/ext-tasks, which follows the handle with tasks/get.


def play_worker_when_queued(task_id: str, summary: str) -> threading.Thread:
    """A thread that waits for ``task_id`` to be queued, then claims and finishes it."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                task_store.get_task(task_id)
                break
            except task_store.TaskNotFound:
                time.sleep(0.05)
        marker = claim(task_id)
        time.sleep(0.5)         # a poll or two sees it running
        task_store.complete_attempt(task_id, marker, result={"summary": summary}, diff="",
                                    usage={"tokens": {"input": 1, "output": 1}, "cost_usd": 0.0})
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_inspector_follows_a_submit_task_handle_to_the_finished_task(wd, bearer, tmp_path, monkeypatch):
    inspector = require_pinned(str(bridge.REPO_DIR / "node_modules" / ".bin" / "mcp-inspector"),
                               "the MCP Inspector (@modelcontextprotocol/inspector)")
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))      # the Inspector writes ~/.mcp-inspector
    with serving() as base:
        worker = play_worker_when_queued("t_0001", "README written")
        proc = subprocess.run(
            [inspector, "--cli", "-q", "--format", "json", "--protocol-era", "modern",
             "--header", f"Authorization: Bearer {TOKEN}", "--method", "tools/call", "--tool-name", "submit_task",
             "--tool-args-json", json.dumps(args(wd)), f"{base}/mcp"],
            check=False, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=dict(os.environ))
        worker.join(10)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads(proc.stdout)["result"]
    final = result["structuredContent"]
    # Only the task's own end gives this: a plain submit_task answers while the task is pending.
    assert final["task_id"] == "t_0001" and final["status"] == "done"
    assert final["result"]["summary"] == "README written" and final["origin_name"] == "inspector-cli"
    assert json.loads(result["content"][0]["text"]) == final


# ---------------------------------------------------------------------------------------------
# The 2025-11-25 form (what VS Code declares): a `task` field on tools/call, tasks/get,
# tasks/result, tasks/list, tasks/cancel. The SDK's client refuses a task handle in reply to
# tools/call on that protocol (it checks the reply against CallToolResult, whose `content` a
# handle lacks), so this client speaks JSON-RPC over streamable-http itself.

LEGACY = "2025-11-25"


class LegacySession:
    """A streamable-http session on one protocol version, sending JSON-RPC by hand."""

    def __init__(self, http: httpx2.Client, version: str = LEGACY, capabilities: dict | None = None) -> None:
        self.http, self.version, self.ids = http, version, 0
        response, self.init = self._post(
            "initialize",
            {
                "protocolVersion": version,
                "capabilities": capabilities or {},
                "clientInfo": {"name": "Visual Studio Code", "version": "1.107.0"},
            },
        )
        self.headers = {"Mcp-Session-Id": response.headers["mcp-session-id"], "MCP-Protocol-Version": version}
        self.http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=self.headers)

    def _post(self, method: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[Any, dict]:
        self.ids += 1
        response = self.http.post("/mcp", json={"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params},
                                  headers=headers or {})
        body = response.text
        if "data:" in body:
            body = [line[5:] for line in body.splitlines() if line.startswith("data:")][-1]
        return response, json.loads(body)

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """The result; a JSON-RPC error is raised as MCPError."""
        reply = self._post(method, params, self.headers)[1]
        if "error" in reply:
            raise MCPError(reply["error"]["code"], reply["error"]["message"])
        return reply["result"]


@pytest.fixture
def legacy(bearer):
    with serving() as base, httpx2.Client(base_url=base, timeout=30, headers={
            "Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}) as http:
        yield LegacySession(http)


def test_legacy_capabilities_and_the_tools_that_take_a_task(legacy):
    assert legacy.init["result"]["capabilities"]["tasks"] == mcp_tasks.LEGACY_CAPABILITY
    tools = {t["name"]: t for t in legacy.call("tools/list", {})["tools"]}
    assert tools["submit_task"]["execution"] == {"taskSupport": "optional"}
    assert all("execution" not in t for name, t in tools.items() if name != "submit_task")


def test_legacy_a_task_augmented_submit_is_followed_to_its_result(wd, legacy):
    created = legacy.call("tools/call", {"name": "submit_task", "arguments": args(wd), "task": {"ttl": 60000}})
    task = created["task"]
    assert task["taskId"] == "t_0001" and task["status"] == "working" and task["ttl"] is None
    assert task["pollInterval"] == mcp_tasks.POLL_INTERVAL_MS and task_store.get_task("t_0001")["status"] == "pending"
    task_store.pause_for_question("t_0001", claim("t_0001"), "Which license?")
    waiting = legacy.call("tasks/get", {"taskId": "t_0001"})
    assert waiting["status"] == "input_required" and "Which license?" in waiting["statusMessage"]
    legacy.call("tools/call", {"name": "answer_task", "arguments": {"task_id": "t_0001", "answer": "MIT"}})
    assert legacy.call("tasks/get", {"taskId": "t_0001"})["status"] == "working"

    marker = claim("t_0001")
    def finish() -> None:
        time.sleep(1.0)
        task_store.complete_attempt("t_0001", marker, result={"summary": "licensed"}, diff="",
                                    usage={"tokens": {"input": 1, "output": 1}, "cost_usd": 0.0})
    threading.Thread(target=finish, daemon=True).start()
    started = time.monotonic()
    result = legacy.call("tasks/result", {"taskId": "t_0001"})       # blocks until the task ends
    assert time.monotonic() - started >= 0.9
    assert (
        result["structuredContent"]["status"] == "done"
        and result["structuredContent"]["result"]["summary"] == "licensed"
    )
    assert result["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": "t_0001"}
    assert not result.get("isError") and legacy.call("tasks/get", {"taskId": "t_0001"})["status"] == "completed"


def test_legacy_cancel_list_failure_and_bad_ids(wd, legacy):
    for n in range(mcp_tasks.LIST_PAGE + 2):
        legacy.call("tools/call", {"name": "submit_task", "arguments": args(wd, title=f"t{n}")})
    first = legacy.call("tasks/list", {})
    second = legacy.call("tasks/list", {"cursor": first["nextCursor"]})
    ids = [t["taskId"] for t in first["tasks"] + second["tasks"]]
    assert len(first["tasks"]) == mcp_tasks.LIST_PAGE and "nextCursor" not in second
    assert sorted(ids) == [f"t_{n:04d}" for n in range(1, mcp_tasks.LIST_PAGE + 3)]

    cancelled = legacy.call("tasks/cancel", {"taskId": "t_0001"})
    assert cancelled["taskId"] == "t_0001" and cancelled["status"] == "cancelled"
    task_store.fail_attempt("t_0002", claim("t_0002"), "it broke", retryable=False)
    failed = legacy.call("tasks/result", {"taskId": "t_0002"})
    assert failed["isError"] is True and failed["structuredContent"]["error"] == "it broke"
    for method, task_id, needle in (
        ("tasks/cancel", "t_0001", "already cancelled"),
        ("tasks/result", "t_0001", "cancelled"),
        ("tasks/get", "t_0999", "t_0999"),
        ("tasks/result", "banana", "banana"),
    ):
        with pytest.raises(MCPError) as refused:
            legacy.call(method, {"taskId": task_id})
        assert refused.value.code == -32602 and needle in refused.value.message, (method, refused.value.message)
    with pytest.raises(MCPError) as bad_cursor:
        legacy.call("tasks/list", {"cursor": "nonsense"})
    assert bad_cursor.value.code == -32602


def test_legacy_calls_without_a_task_and_older_protocols_are_unchanged(wd, legacy):
    plain = legacy.call("tools/call", {"name": "submit_task", "arguments": args(wd)})
    assert plain["structuredContent"]["id"] == "t_0001" and "task" not in plain
    other = legacy.call("tools/call", {"name": "get_task", "arguments": {"task_id": "t_0001"}, "task": {}})
    assert other["structuredContent"]["id"] == "t_0001"
    older = LegacySession(legacy.http, "2025-06-18")
    assert "tasks" not in older.init["result"]["capabilities"]
    assert all("execution" not in t for t in older.call("tools/list", {})["tools"])
    with pytest.raises(MCPError) as refused:
        older.call("tasks/get", {"taskId": "t_0001"})
    assert refused.value.code == -32601


def blocked_result(wd: str, after_question: Callable[[list[dict[str, Any]]], None],
                   answer: str | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A 2025-11-25 client that declared elicitation submits t_0001 as a task; the task asks
    "Which license?" and ``after_question(asked)`` runs in a thread while the client blocks in
    tasks/result, answering each form with ``answer`` (None: never). Returns (the forms asked,
    tasks/result's result or None)."""
    asked: list[dict[str, Any]] = []
    final = None
    with serving() as base, httpx2.Client(base_url=base, timeout=60, headers={
            "Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}) as http:
        session = LegacySession(http, capabilities={"elicitation": {"form": {}}})
        session.call("tools/call", {"name": "submit_task", "arguments": args(wd), "task": {}})
        task_store.pause_for_question("t_0001", claim("t_0001"), "Which license?")
        threading.Thread(target=after_question, args=(asked,), daemon=True).start()
        body = {"jsonrpc": "2.0", "id": 99, "method": "tasks/result", "params": {"taskId": "t_0001"}}
        with http.stream("POST", "/mcp", json=body, headers=session.headers) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("method") == "elicitation/create":
                    asked.append(message["params"])
                    if answer is not None:
                        reply = {"jsonrpc": "2.0", "id": message["id"],
                                 "result": {"action": "accept", "content": {"answer": answer}}}
                        assert http.post("/mcp", json=reply, headers=session.headers).status_code == 202
                elif message.get("id") == 99:
                    final = message["result"]
                    break
    return asked, final


def _finish_t_0001() -> None:
    task_store.complete_attempt("t_0001", claim("t_0001"), result={"summary": "MIT it is"}, diff="",
                                usage={"tokens": {"input": 1, "output": 1}, "cost_usd": 0.0})


def test_legacy_a_question_is_asked_on_the_blocked_result_stream(wd, bearer):
    """A 2025-11-25 client that declared elicitation gets the agent's question as a form on its
    tasks/result stream; its answer resumes the task, and the stream ends with the result."""
    def finish_when_answered(_asked: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and task_store.get_task("t_0001")["status"] != "pending":
            time.sleep(0.05)
        _finish_t_0001()

    asked, final = blocked_result(wd, finish_when_answered, "MIT")
    assert [a["message"] for a in asked] == ["Which license?"]
    assert task_store.get_task("t_0001")["questions"][-1]["answer"] == "MIT"
    assert final is not None and final["structuredContent"]["status"] == "done"
    assert final["structuredContent"]["result"]["summary"] == "MIT it is"


async def test_task_text_is_redacted_as_every_tool_shows_it(wd, monkeypatch):
    """A question or an error carrying one of TaskBridge's secrets (the agent's word) reaches the
    client redacted in statusMessage, the form's message and tasks/get's error, as get_task shows it."""
    secret = "tbk_SuperSecretValue0123456789"
    monkeypatch.setenv("MCP_BEARER_TOKEN", secret)
    async with in_memory(extensions=[PollingTasks()]) as c:
        first, second = await submit(c, wd), await submit(c, wd, title="second")
        task_store.pause_for_question(first.task_id, claim(first.task_id), f"paste {secret} here?")
        task_store.fail_attempt(second.task_id, claim(second.task_id), f"auth failed with {secret}",
                                retryable=False)
        waiting, failed = await get(c, first.task_id), await get(c, second.task_id)
    wire = json.dumps([waiting, failed])
    assert secret not in wire
    assert "[redacted: bearer token]" in waiting["statusMessage"]
    [request] = waiting["inputRequests"].values()
    assert request["params"]["message"] == "paste [redacted: bearer token] here?"
    assert "[redacted: bearer token]" in failed["error"]["message"]


def test_legacy_a_blocked_result_returns_when_the_question_is_answered_elsewhere(wd, bearer):
    """The client got the form and never answers it; the planner answers with answer_task and the
    task finishes: tasks/result returns the result instead of waiting on the form."""
    def answer_elsewhere_then_finish(asked: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not asked:
            time.sleep(0.05)
        task_store.answer_task("t_0001", "MIT", "planner")
        _finish_t_0001()

    asked, final = blocked_result(wd, answer_elsewhere_then_finish, None)
    assert [a["message"] for a in asked] == ["Which license?"]
    assert final is not None and final["structuredContent"]["result"]["summary"] == "MIT it is"
