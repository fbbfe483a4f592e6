"""End to end over MCP: submit_task → a real worker pass (`python worker.py`, the real `opencode`,
the scripted model on 127.0.0.1) → wait_for wakes up without the client polling →
get_task_result holds the receipt with the diff, tokens and cost. Also a question and its answer
over MCP, and list_models / set_default_model against the real `opencode models`."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest
from mcp import Client
from mcp.types import Implementation

import opencode_bridge_mcp as bridge
import task_store
from fake_openai import text, tool_call
from helpers import call_tool, git, make_repo, step_finish_sums

pytestmark = [pytest.mark.real_opencode, pytest.mark.anyio]
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "Wrote hello.txt", "files_touched": ["hello.txt"], ' \
          '"tests_run": ["cat hello.txt"], "open_questions": []}\n```'


def worker_pass() -> subprocess.Popen:
    """One worker pass in the background, as launchd would start it (output to a temp file, so a
    chatty pass can never block on a full pipe while the test sits in wait_for)."""
    sink = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, str(bridge.REPO_DIR / "worker.py")], stdin=subprocess.DEVNULL,
                            stdout=sink, stderr=subprocess.STDOUT)
    proc.sink = sink
    return proc


def finished(proc: subprocess.Popen) -> str:
    """Wait for a worker pass; returns its output."""
    proc.wait(timeout=120)
    proc.sink.seek(0)
    return proc.sink.read().decode(errors="replace")


def client() -> Client:
    return Client(bridge.build_server(), mode="legacy", client_info=Implementation(name="claude-ai", version="0.14.2"))


async def test_submit_over_mcp_worker_pass_wait_for_and_result(opencode, tmp_path, monkeypatch):
    monkeypatch.setattr(bridge, "PROGRESS_EVERY_SEC", 1.0)
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("hello", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello over MCP\n"}),
        tool_call("bash", {"command": "cat hello.txt", "description": "check"}),
        text("Done.\n" + RECEIPT),
    ])
    progress: list[str] = []

    async def on_progress(value, total, message):
        progress.append(message)

    async with client() as c:
        task = await call_tool(c, "submit_task", {"title": "Say hello", "working_dir": str(repo),
                                             "instructions": "Create hello.txt. SCRIPT:hello"})
        worker = worker_pass()
        started = time.monotonic()
        waited = await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 300},
                            progress_callback=on_progress)
        woke = time.monotonic()
        output = finished(worker)
        result = await call_tool(c, "get_task_result", {"task_id": task["id"]})
        logs = await call_tool(c, "get_task_logs", {"task_id": task["id"], "tail_lines": 3})
        shown = await call_tool(c, "get_task", {"task_id": task["id"]})
    assert worker.returncode == 0, output
    assert waited["met"] and waited["tasks"][0]["status"] == "done", (waited, output)
    assert progress, "wait_for sent no progress while the worker ran"
    assert woke - started < 300
    receipt = result["result"]
    assert result["status"] == "done" and receipt["summary"] == "Wrote hello.txt"
    assert receipt["files_touched"] == ["hello.txt"] and "hello over MCP" in result["diff"]
    assert result["diff_total_bytes"] == len(result["diff"].encode()) and result["diff_next_offset"] is None
    sums = step_finish_sums(task_store.log_path(task["id"]).read_text())
    assert result["usage"]["tokens"]["input"] == sums["input"] > 0
    assert result["usage"]["cost_usd"] == pytest.approx(sums["cost"]) and sums["cost"] > 0
    assert result["branch"] == f"taskbridge/{task['id']}"
    assert git(repo, "show", f"{result['branch']}:hello.txt") == "hello over MCP"
    assert logs["exists"] and logs["text"].count("\n") == 3
    assert shown["origin_kind"] == "claude" and shown["summary"] == "Wrote hello.txt"


async def test_a_question_over_mcp_is_answered_and_the_task_resumes(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ask", [
        text("Before I start:\n```question\nWhich greeting should hello.txt hold?\n```"),
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "bonjour\n"}),
        text("Done.\n" + RECEIPT),
    ])
    async with client() as c:
        task = await call_tool(c, "submit_task", {"title": "Ask first", "working_dir": str(repo),
                                             "instructions": "Create hello.txt. SCRIPT:ask"})
        first = worker_pass()
        waited = await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 300, "mode": "all"})
        finished(first)
        assert waited["waiting"] == [task["id"]], waited
        assert "Which greeting" in waited["tasks"][0]["question"]
        await call_tool(c, "answer_task", {"task_id": task["id"], "answer": "bonjour"})
        second = worker_pass()
        done = await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 300})
        finished(second)
        result = await call_tool(c, "get_task_result", {"task_id": task["id"]})
    assert done["tasks"][0]["status"] == "done", done
    assert "bonjour" in result["diff"] and result["result"]["questions"][0]["answer"] == "bonjour"


async def test_list_models_and_set_default_model_with_the_real_opencode(opencode):
    async with client() as c:
        models = await call_tool(c, "list_models", {"search": "model"})
        chosen = await call_tool(c, "set_default_model", {"model": "model"})
    assert [m["id"] for m in models["models"]] == ["fake/model"] and models["resolved"] == "fake/model"
    assert models["models"][0]["cost"]["output"] == 2.0 and models["models"][0]["context"] == 128000
    assert chosen["model"] == "fake/model" and chosen["resolved_from"] == "model"
    assert task_store.default_model() == "fake/model"
