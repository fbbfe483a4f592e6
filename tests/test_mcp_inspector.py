"""A client nobody here wrote: the MCP Inspector CLI (node_modules/.bin/mcp-inspector, pinned in
package.json) lists the tools and calls submit_task, get_task and ping over stdio and over HTTP
(streamable-http and sse) with the bearer token. Skipped when the binary is missing, except under
CI=true where that is a failure. HOME points into tmp_path (the Inspector writes ~/.mcp-inspector)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import opencode_bridge_mcp as bridge
from helpers import BRIDGE_TOOL_COUNT, bridge_process, require_pinned

INSPECTOR = bridge.REPO_DIR / "node_modules" / ".bin" / "mcp-inspector"
SCRIPT = str(bridge.REPO_DIR / "opencode_bridge_mcp.py")
TOKEN = "inspector-token-0123456789"


@pytest.fixture(autouse=True)
def inspector(tmp_path, monkeypatch):
    require_pinned(str(INSPECTOR), "the MCP Inspector (@modelcontextprotocol/inspector)")
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token"))


@pytest.fixture
def project(tmp_path) -> str:
    (tmp_path / "project").mkdir()
    return str(tmp_path / "project")


def inspect(target: list[str], method: str, tool: str | None = None, args: dict | None = None,
            extra: list[str] | None = None, is_error: bool = False) -> dict:
    """Run the Inspector CLI; it exits 5 when a tool result has isError (expected with is_error)."""
    argv = [str(INSPECTOR), "--cli", "-q", "--format", "json", *(extra or []), "--method", method]
    if tool:
        argv += ["--tool-name", tool, "--tool-args-json", json.dumps(args or {})]
    proc = subprocess.run([*argv, *target], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert proc.returncode == (5 if is_error else 0), proc.stderr + proc.stdout
    out = json.loads(proc.stdout)
    return out.get("result", out)


def exercise(target: list[str], project: str, extra: list[str] | None = None) -> None:
    tools = inspect(target, "tools/list", extra=extra)["tools"]
    assert len(tools) == BRIDGE_TOOL_COUNT and {"submit_task", "get_task", "ping", "wait_for"} <= {
        t["name"] for t in tools
    }
    sent = inspect(target, "tools/call", "submit_task",
                   {"title": "12345", "instructions": '{"steps":[1]}', "working_dir": project, "timeout_sec": "600"},
                   extra=extra)
    assert sent["isError"] is False, sent
    task = sent["structuredContent"]
    assert task["title"] == "12345" and task["timeout_sec"] == 600
    assert task["origin_name"] == "inspector-cli" and task["origin_kind"] == "other"
    got = inspect(target, "tools/call", "get_task", {"task_id": task["id"]}, extra=extra)["structuredContent"]
    assert got["instructions"] == '{"steps":[1]}'
    ping = inspect(target, "tools/call", "ping", extra=extra)["structuredContent"]
    assert ping["ok"] is True and ping["database"] == os.environ["TASK_DB_PATH"]
    bad = inspect(target, "tools/call", "get_task", {"task_id": "t_0999"}, extra=extra, is_error=True)
    assert bad["isError"] is True and "t_0999 not found" in bad["content"][0]["text"]


def test_inspector_over_stdio(project):
    env = [f"{k}={os.environ[k]}" for k in ("TASK_DB_PATH", "TASK_LOG_DIR", "MCP_TOKEN_FILE")]
    extra = [flag for pair in env for flag in ("-e", pair)]
    exercise(["--", sys.executable, SCRIPT, "--log-level", "DEBUG"], project, extra)


@pytest.mark.parametrize("path", ["/mcp", "/sse"])
def test_inspector_over_http_with_the_token(path, project):
    with bridge_process(dict(os.environ, MCP_BEARER_TOKEN=TOKEN)) as base:
        exercise([f"{base}{path}"], project, ["--header", f"Authorization: Bearer {TOKEN}"])
        refused = subprocess.run([str(INSPECTOR), "--cli", "-q", "--format", "json", "--method", "tools/list",
                                  f"{base}{path}"], capture_output=True, text=True, timeout=120,
                                 stdin=subprocess.DEVNULL)
    assert refused.returncode != 0 and "19" not in refused.stdout


def test_wait_for_at_its_default_timeout_fits_the_inspectors_default_timeout(project):
    """The Inspector gives a call 60 s (its SDK's default; no --request-timeout here). wait_for
    with only task_ids, on a task no worker runs, must come back within that with timed_out and
    the advice to call again with the same ids (it used to wait 600 s and the call failed)."""
    import task_store
    task = task_store.submit_task(title="never runs", instructions="x", working_dir=project)
    env = [f"{k}={os.environ[k]}" for k in ("TASK_DB_PATH", "TASK_LOG_DIR", "MCP_TOKEN_FILE")]
    extra = [flag for pair in env for flag in ("-e", pair)]
    tools = inspect(["--", sys.executable, SCRIPT], "tools/list", extra=extra)["tools"]
    wait = next(t for t in tools if t["name"] == "wait_for")
    assert wait["inputSchema"]["properties"]["timeout_sec"]["default"] == bridge.WAIT_DEFAULT_SEC < 60
    assert "call wait_for again with the same task_ids" in " ".join(wait["description"].split())
    result = inspect(["--", sys.executable, SCRIPT], "tools/call", "wait_for", {"task_ids": [task["id"]]}, extra=extra)
    waited = result["structuredContent"]
    assert waited["timed_out"] is True and waited["unfinished"] == [task["id"]]
    assert bridge.WAIT_DEFAULT_SEC <= waited["waited_sec"] < 60
    assert "call wait_for again with the same task_ids" in waited["hint"]
