"""The MCP server as Claude Desktop runs it: `python opencode_bridge_mcp.py` over stdio.

Every byte on stdout must be JSON-RPC — at the most verbose logging, on a first start with no
database, while tools spawn child processes (a fake `opencode models` that prints on stdout and
stderr; a detached worker pass) and while wait_for sends progress notifications."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from mcp import Client, StdioServerParameters
from mcp.types import Implementation

import opencode_bridge_mcp as bridge
from helpers import BRIDGE_TOOL_COUNT, fake_binary

SCRIPT = str(bridge.REPO_DIR / "opencode_bridge_mcp.py")


class StdioSession:
    """A raw JSON-RPC conversation with the server subprocess; keeps every stdout byte."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--log-level", "DEBUG"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.notifications: list[dict] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.stdout += line
            self.lines.put(line)

    def _pump_err(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read(4096), b""):
            self.stderr += chunk

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def request(self, rid: int, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            message = json.loads(line)
            if message.get("id") == rid:
                return message
            self.notifications.append(message)

    def call(self, rid: int, tool: str, args: dict, meta: dict | None = None) -> dict:
        params = {"name": tool, "arguments": args} | ({"_meta": meta} if meta else {})
        return self.request(rid, "tools/call", params)["result"]

    def close(self) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(timeout=30)
        time.sleep(0.2)                   # let the pumps drain
        return code


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A first start: the database folder does not exist yet. OPENCODE_BIN is a fake that prints on
    both streams; PATH starts with a fake systemctl that knows no unit (so restart_worker detaches)."""
    opencode = fake_binary(tmp_path / "bin", "opencode",
                        'echo "opencode: some chatter on stdout"\necho "noise" >&2\n'
                        "printf 'fake/model\\n{\"name\": \"Fake\"}\\n'\n")
    fake_binary(tmp_path / "bin", "systemctl", "exit 1\n")
    out = dict(os.environ)
    out.update({"TASK_DB_PATH": str(tmp_path / "fresh" / "deep" / "tasks.db"),
                "TASK_LOG_DIR": str(tmp_path / "fresh" / "logs"),
                "OPENCODE_BIN": str(opencode), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                "MCP_TOKEN_FILE": str(tmp_path / "no-token")})
    return out


def test_every_stdout_byte_is_json_rpc_at_debug_on_a_first_start(env, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    assert not Path(env["TASK_DB_PATH"]).parent.exists()
    s = StdioSession(env)
    try:
        init = s.request(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                           "clientInfo": {"name": "claude-ai", "version": "0.14.2"}})
        assert init["result"]["serverInfo"]["name"] == "taskbridge"
        s.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert len(s.request(2, "tools/list")["result"]["tools"]) == BRIDGE_TOOL_COUNT
        ping = s.call(3, "ping", {})
        assert ping["structuredContent"]["caller"]["kind"] == "claude"
        restarted = s.call(4, "restart_worker", {})["structuredContent"]
        if restarted["method"] == "detached" and psutil.pid_exists(restarted["pid"]):
            psutil.Process(restarted["pid"]).wait(timeout=60)
        models = s.call(5, "list_models", {})["structuredContent"]
        assert [m["id"] for m in models["models"]] == ["fake/model"]
        sent = s.call(6, "submit_task", {"title": '{"steps":[1]}', "instructions": "12345",
                                         "working_dir": str(project), "timeout_sec": "600"})
        assert sent["structuredContent"]["title"] == '{"steps":[1]}' and sent["structuredContent"]["timeout_sec"] == 600
        got = s.call(7, "get_task", {"task_id": "t_0001"})["structuredContent"]
        assert got["instructions"] == "12345" and got["origin_name"] == "claude-ai"
        waited = s.call(8, "wait_for", {"task_ids": '["t_0001"]', "timeout_sec": 4}, meta={"progressToken": "w1"})
        assert waited["structuredContent"]["timed_out"] is True
        bad = s.call(9, "submit_task", {"title": "x", "instructions": "y", "working_dir": "rel", "timeout_sec": 0})
        assert bad["isError"] and "timeout_sec must be ≥ 1" in bad["content"][0]["text"]
        unknown = s.call(10, "get_task", {"task_id": 77})
        assert unknown["isError"] and unknown["content"][0]["text"].startswith("task t_0077 not found")
    finally:
        code = s.close()
    assert code == 0
    progress = [n for n in s.notifications if n.get("method") == "notifications/progress"]
    assert progress and progress[0]["params"]["progressToken"] == "w1"
    raw = bytes(s.stdout)
    assert raw.endswith(b"\n")
    for line in raw.split(b"\n")[:-1]:
        message = json.loads(line)                      # every line parses...
        assert message["jsonrpc"] == "2.0"              # ...as JSON-RPC
    assert b"chatter" not in raw and b"noise" not in raw
    assert b"DEBUG" in s.stderr and Path(env["TASK_DB_PATH"]).exists()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_sdk_client_over_stdio(mode, env, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    params = StdioServerParameters(command=sys.executable, args=[SCRIPT, "--log-level", "DEBUG"], env=env)
    async with Client(params, mode=mode, client_info=Implementation(name="claude-ai", version="1")) as c:
        sent = await c.call_tool("submit_task", {"title": "stdio", "instructions": "x", "working_dir": str(project)})
        listed = await c.call_tool("list_tasks", {"status": "pending"})
        ping = await c.call_tool("ping", {})
    assert not sent.is_error and sent.structured_content["origin_kind"] == "claude"
    assert listed.structured_content["total"] == 1
    assert ping.structured_content["database"] == env["TASK_DB_PATH"]


def test_with_a_broken_database_the_server_starts_lists_its_tools_and_names_the_problem(env, tmp_path):
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database\n" * 100)
    s = StdioSession(env | {"TASK_DB_PATH": str(broken)})
    try:
        s.request(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "claude-ai", "version": "1"}})
        s.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert len(s.request(2, "tools/list")["result"]["tools"]) == BRIDGE_TOOL_COUNT
        ping = s.call(3, "ping", {})
        text = ping["content"][0]["text"]
        assert ping["isError"] and f"the task database {broken} cannot be used" in text, text
        assert "restore it from a backup" in text and "internal error" not in text
    finally:
        code = s.close()
    assert code == 0 and b"Traceback" not in s.stderr


def piped(env: dict[str, str], messages: list[dict], script: str = SCRIPT) -> tuple[dict, bytes]:
    """Raw JSON-RPC bytes piped to the server in one write, then stdin closed (as a client does that
    sends its requests and hangs up): the replies by id, and stderr."""
    data = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
    done = subprocess.run([sys.executable, script], input=data, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(r["jsonrpc"] == "2.0" for r in replies)
    return {r["id"]: r for r in replies if "id" in r}, done.stderr


INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pipe", "version": "1"}}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def tool_call(rid: int, name: str, arguments: dict) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def test_requests_piped_before_stdin_closes_are_all_answered(env, tmp_path):
    """The SDK cancels in-flight handlers at stdin's end: submit_task made the task but its reply
    was never written, so the client could not learn the id and would submit again."""
    project = tmp_path / "project"
    project.mkdir()
    replies, _ = piped(env, [INIT, INITIALIZED,
                             tool_call(2, "submit_task", {"title": "piped", "instructions": "x",
                                                          "working_dir": str(project)}),
                             tool_call(3, "ping", {})])
    assert sorted(replies) == [1, 2, 3]
    sent = replies[2]["result"]["structuredContent"]
    assert sent["id"] == "t_0001" and sent["title"] == "piped"
    assert replies[3]["result"]["structuredContent"]["ok"] is True
    listed = subprocess.run([sys.executable, "-c", "import task_store, json; print(json.dumps("
                             "[t['id'] for t in task_store.list_tasks(limit=10)['tasks']]))"],
                            env=env, cwd=str(bridge.REPO_DIR), capture_output=True, text=True, timeout=60)
    assert json.loads(listed.stdout) == ["t_0001"]       # made once, and the client was told its id
