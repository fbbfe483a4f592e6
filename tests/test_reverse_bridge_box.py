"""The reverse bridge for a boxed agent (issue 19 point 7): the worker runs claude_control_mcp.py
outside the run, over loopback HTTP with a token of its own; the run holds neither the API key nor
the queue, and claude_ask still answers from inside a task."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import psutil
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import claude_control_mcp as ccm
import reverse_bridge
import task_store
from fake_anthropic import DEFAULT_ANSWER, FakeAnthropic
from fake_openai import text, tool_call
from helpers import ROOT, make_repo, run_script

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

KEY = "sk-fake-reverse-bridge-key-0123456789"
RECEIPT = '```json\n{"summary": "asked Claude", "files_touched": [], "tests_run": [], "open_questions": []}\n```'
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def api_env(fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own environment: the API backend pointed at the fake, with the key."""
    for name in ("CLAUDE_BIN", "CLAUDE_API_MODEL", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_MAX_PARALLEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"ANTHROPIC_BASE_URL": fake.url, "ANTHROPIC_API_KEY": KEY, "CLAUDE_BACKEND": "api",
                        "CLAUDE_CODE_MAX_RETRIES": "0"}.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(autouse=True)
def fresh_bridge() -> Iterator[None]:
    """Each test starts without this process's server and leaves none behind."""
    reverse_bridge._state.update(server=None, failed_at=None, problem=None)
    yield
    reverse_bridge.stop_server()
    reverse_bridge._state.update(server=None, failed_at=None, problem=None)


def registered_env(tmp_path: Path) -> dict[str, str]:
    """A run env whose global OpenCode config holds the entry --register-opencode writes."""
    xdg = tmp_path / "xdg"
    ccm.register_opencode(xdg / "opencode" / "opencode.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCODE_")}
    return {**env, "XDG_CONFIG_HOME": str(xdg), "OPENCODE_CONFIG_CONTENT": json.dumps({"share": "disabled"})}


def bridge_entry(env: dict[str, str]) -> dict[str, Any]:
    return json.loads(env["OPENCODE_CONFIG_CONTENT"])["mcp"][ccm.SERVER_NAME]


def sent_key(fake: FakeAnthropic) -> str | None:
    """The key the last Messages API request carried (the SDK sends it as a bearer token)."""
    headers = fake.message_requests()[-1].headers
    return headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ") or None


def bridge_servers() -> list[psutil.Process]:
    """Live HTTP reverse-bridge servers of this test's queue."""
    found = []
    for proc in psutil.process_iter():
        try:
            if "--listen-fd" in proc.cmdline() and \
                    proc.environ().get("TASK_DB_PATH") == os.environ["TASK_DB_PATH"]:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def test_the_server_name_is_the_bridges() -> None:
    assert reverse_bridge.SERVER_NAME == ccm.SERVER_NAME


@pytest.mark.parametrize("content", [None, {"mcp": {"claude-control": {"enabled": False}}}])
def test_not_registered_or_disabled_leaves_the_env_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             content: dict | None) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "empty"), "ANTHROPIC_API_KEY": KEY}
    if content is not None:
        env = registered_env(tmp_path) | {"ANTHROPIC_API_KEY": KEY, "OPENCODE_CONFIG_CONTENT": json.dumps(content)}
    assert reverse_bridge.reverse_bridge_env(dict(env)) == env
    assert reverse_bridge._state["server"] is None


def test_registered_in_the_opencode_config_file_counts(tmp_path: Path) -> None:
    config = tmp_path / "own.json"
    ccm.register_opencode(config)
    assert reverse_bridge.registered({"XDG_CONFIG_HOME": str(tmp_path / "empty"), "OPENCODE_CONFIG": str(config)})
    assert not reverse_bridge.registered({"XDG_CONFIG_HOME": str(tmp_path / "empty")})


@pytest.mark.anyio
async def test_the_server_wants_its_token_and_answers_claude_ask_with_the_workers_key(
        tmp_path: Path, api_env: None, fake: FakeAnthropic) -> None:
    env = reverse_bridge.reverse_bridge_env(registered_env(tmp_path) | {"ANTHROPIC_API_KEY": KEY})
    assert "ANTHROPIC_API_KEY" not in env
    entry = bridge_entry(env)
    assert entry["type"] == "remote" and entry["enabled"] is True and entry["url"].startswith("http://127.0.0.1:")
    token = entry["headers"]["Authorization"].removeprefix("Bearer ")
    assert len(token) >= 32 and token != os.environ.get("MCP_BEARER_TOKEN")
    async with httpx2.AsyncClient(timeout=30) as raw:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            refused = await raw.post(entry["url"], json=INIT, headers=MCP_HEADERS | headers)
            assert refused.status_code == 401, refused.text
        host = await raw.post(entry["url"], json=INIT, headers=MCP_HEADERS | entry["headers"] | {"Host": "evil.test"})
        assert host.status_code == 421
    transport = streamable_http_client(entry["url"], http_client=httpx2.AsyncClient(headers=entry["headers"],
                                                                                      timeout=60))
    async with Client(transport) as client:
        result = await client.call_tool("claude_ask", {"prompt": "Which file first?"})
    assert not result.is_error, result.content[0].text
    assert result.structured_content["answer"] == f"{DEFAULT_ANSWER} | echo: Which file first?"
    assert result.structured_content["backend"] == "api"
    assert sent_key(fake) == KEY
    again = reverse_bridge.reverse_bridge_env(registered_env(tmp_path))
    assert bridge_entry(again) == entry, "one server per worker process"
    pid = reverse_bridge._state["server"].proc.pid
    reverse_bridge.stop_server()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_anthropic_model_keeps_its_key(tmp_path: Path, api_env: None) -> None:
    env = reverse_bridge.reverse_bridge_env(registered_env(tmp_path) | {"ANTHROPIC_API_KEY": KEY},
                                            model="anthropic/claude-sonnet-4-5")
    assert env["ANTHROPIC_API_KEY"] == KEY and bridge_entry(env)["type"] == "remote"


def test_a_server_that_cannot_start_says_so_in_one_line_and_the_run_goes_on(
        tmp_path: Path, api_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_MAX_PARALLEL", "many")   # the server refuses to start with a bad knob
    said: list[str] = []
    env = reverse_bridge.reverse_bridge_env(registered_env(tmp_path) | {"ANTHROPIC_API_KEY": KEY}, say=said.append)
    assert len(said) == 1 and "\n" not in said[0], said
    assert "reverse bridge" in said[0] and "CLAUDE_MAX_PARALLEL" in said[0], said
    assert bridge_entry(env) == {"enabled": False} and "ANTHROPIC_API_KEY" not in env
    started = time.monotonic()
    reverse_bridge.reverse_bridge_env(registered_env(tmp_path), say=said.append)
    assert time.monotonic() - started < 1 and len(said) == 2, "a failed start is not retried at every run"


def test_the_server_ends_when_its_worker_is_killed(tmp_path: Path, api_env: None) -> None:
    """SIGKILL leaves no atexit: the server's stdin ending is its cue."""
    env = registered_env(tmp_path)
    code = ("import json, os, sys, time, reverse_bridge\n"
            "reverse_bridge.reverse_bridge_env(json.loads(sys.argv[1]))\n"
            "print(reverse_bridge._state['server'].proc.pid, flush=True)\n"
            "time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, json.dumps(env)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pid = int(holder.stdout.readline())
        assert psutil.pid_exists(pid)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not psutil.pid_exists(pid), "the server outlived its worker"
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_worker_run_asks_claude_through_its_own_server_without_the_key(
        opencode: Any, fake: FakeAnthropic, api_env: None, tmp_path: Path) -> None:
    """The whole chain: worker.py → opencode run (scripted model) → the worker's HTTP reverse
    bridge → the fake Messages API with the worker's key; the run's own environment (printed by
    `env` in the bash tool) holds no key, and the server is gone when the worker exits."""
    registered = run_script("claude_control_mcp.py", "--register-opencode")
    assert registered.returncode == 0, registered.stderr
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ask", [
        tool_call("claude-control_claude_ask", {"prompt": "Which file first?"}),
        tool_call("bash", {"command": "env | sort", "description": "print the environment"}),
        text("Claude answered.\n" + RECEIPT),
    ])
    task = task_store.submit_task(title="ask", instructions="SCRIPT:ask", working_dir=str(repo))
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    tools = [t["function"]["name"] for t in opencode.model.step_requests("ask")[0]["json"]["tools"]]
    assert "claude-control_claude_ask" in tools, tools
    assert fake.message_requests()[-1].user_text() == "Which file first?"
    assert sent_key(fake) == KEY
    followup = json.dumps(opencode.model.step_requests("ask")[-1]["json"]["messages"])
    assert f"{DEFAULT_ANSWER} | echo: Which file first?" in followup and '\\"backend\\": \\"api\\"' in followup
    printed = [c for c in done["result"]["commands"] if c["command"] == "env | sort"]
    assert printed and printed[0]["exit"] == 0
    log_text = task_store.log_path(task["id"]).read_text()
    assert "TASKBRIDGE_RUN=" in log_text, "the bash tool's env output is in the log"
    assert KEY not in log_text and "ANTHROPIC_API_KEY=" not in log_text
    assert bridge_servers() == [], "the worker's reverse-bridge server outlived the worker"



def test_a_worker_run_goes_on_without_a_bridge_that_cannot_start(
        opencode: Any, api_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_script("claude_control_mcp.py", "--register-opencode").returncode == 0
    broken = tmp_path / "broken-packages" / "uvicorn"   # an interpreter whose HTTP server package fails
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('uvicorn is broken in this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    opencode.model.script("plain", [text("Nothing to ask.\n" + RECEIPT)])
    task = task_store.submit_task(
        title="plain", instructions="SCRIPT:plain", working_dir=str(make_repo(tmp_path / "r"))
    )
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    assert task_store.get_task(task["id"])["status"] == "done"
    said = [line for line in passed.stderr.splitlines() if "reverse bridge" in line]
    assert len(said) == 1 and "uvicorn is broken in this test" in said[0] and task["id"] in said[0], passed.stderr
    tools = [t["function"]["name"] for t in opencode.model.step_requests("plain")[0]["json"]["tools"]]
    assert not any(name.startswith("claude-control_") for name in tools), "the local entry ran in the run"
