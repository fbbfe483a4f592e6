"""What a run leaves behind: daemons the agent started, with the real `opencode` and the box."""
from __future__ import annotations

import socket
import time
import uuid

import psutil
import pytest

import task_store
from fake_openai import text, tool_call
from helpers import make_repo, run_task
from opencode_env import parse_events

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "started a server", "files_touched": [], "tests_run": [], "open_questions": []}\n```'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listener(port: int) -> list[psutil.Process]:
    found = []
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            found.append(psutil.Process(conn.pid))
    return found


@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_daemon_in_new_session_with_cleared_env_is_ended(opencode, tmp_path, monkeypatch, sandbox):
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", sandbox)
    monkeypatch.setenv("TASKBRIDGE_ALLOW_PROMPT_LEVEL", "1")
    repo = make_repo(tmp_path / "repo")
    port = free_port()
    opencode.model.script("daemon", [
        tool_call("bash", {"command": f"setsid env -i /usr/bin/python3 -m http.server {port} --bind 127.0.0.1 "
                                      ">/dev/null 2>&1 </dev/null & for i in $(seq 100); do "
                                      f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo server-up && break; "
                                      "sleep 0.2; done",
                           "description": "dev server"}),
        text("Started.\n" + RECEIPT),
    ])
    task = run_task("daemon", str(repo))
    left = listener(port)
    for proc in left:
        proc.kill()
    assert left == [], f"port {port} still held by {[p.cmdline() for p in left]}"
    assert task["status"] == "done", task["error"]
    receipt = task["result"]
    assert [c["exit"] for c in receipt["commands"]] == [0]
    outputs = [e["part"]["state"].get("output", "") for e in parse_events(task_store.log_path(task["id"]).read_text())
               if e.get("type") == "tool_use"]
    assert outputs and "server-up" in outputs[0], f"the dev server never answered: {outputs}"
    ended = [e for e in receipt["ended_with_run"] if "http.server" in e["command"]]
    assert len(ended) == 1 and ended[0]["ports"] == [port], receipt["ended_with_run"]
    assert not psutil.pid_exists(ended[0]["pid"])


def test_receipt_names_the_mcp_servers_opencode_gave_up_on(opencode, tmp_path):
    """A user's OpenCode MCP server that never answers holds up the first model call: the
    receipt names it (and one whose binary is missing) with the seconds OpenCode had waited."""
    opencode.configure({"mcp": {
        "mute": {"type": "local", "command": ["/usr/bin/python3", "-c", "import time; time.sleep(600)"]},
        "missing": {"type": "local", "command": [str(tmp_path / "no-such-server")]},
    }})
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("mcp", [text("Nothing to do.\n" + RECEIPT)])
    task = run_task("mcp", str(repo))
    assert task["status"] == "done", task["error"]
    down = {d["server"]: d for d in task["result"]["mcp_servers_unavailable"]}
    assert set(down) == {"mute", "missing"}, down
    assert down["mute"]["status"] == "failed" and down["mute"]["after_sec"] >= 20
    assert down["mute"]["after_sec"] <= task["result"]["latency_sec"]
    assert "server unavailable" in task_store.log_path(task["id"]).read_text()


def test_killed_shell_with_a_live_child_ends_the_run_early_and_is_named(opencode, tmp_path, monkeypatch):
    """OpenCode's bash tool never completes a call whose shell was killed: the worker names the
    dead shell and ends the run long before the task's timeout; the child is ended too."""
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    repo = make_repo(tmp_path / "repo")
    seconds = f"321.{uuid.uuid4().int % 10**9:09d}"   # a child no other process on the machine has
    command = f"sleep {seconds} & sleep 3; kill -9 $$"
    opencode.model.script("shot", [
        tool_call("bash", {"command": command, "description": "dies"}),
        text("unreachable\n" + RECEIPT),
    ])
    started = time.monotonic()
    task = run_task("shot", str(repo), timeout_sec=400, max_retries=0)
    took = time.monotonic() - started
    assert task["status"] == "failed"
    assert "the agent's shell (pid " in task["error"] and command in task["error"]
    assert "timed out" not in task["error"]
    assert took < 150, took
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]]
