"""How a usage-limit pause shows (issue 23): wait_for returns on the pause and on the resume and
waits on through it, get_task / list_tasks / queue_status carry the resume time and the held
account, the CLI's status and show name them, answer_task resumes now."""
from __future__ import annotations

import threading

import pytest
from click.testing import CliRunner
from mcp import Client

import opencode_bridge_mcp as bridge
import task_store
import tasks_cli
from helpers import call_tool, submit

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def no_token_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token"))


def pause(task_id: str, resume_in: float = 600) -> None:
    """Play the worker: claim the task and pause it at the provider's usage limit."""
    claimed = task_store.claim_next("test-worker", task_id=task_id)
    task_store.pause_for_limit(task_id, claimed["run_marker"], "Usage limit: the provider fake said 'slow down'",
                               account="fake", said="slow down", resume_at=task_store.now() + resume_in,
                               known_reset=True, session_id="ses_1")


async def test_wait_for_returns_on_the_pause_then_waits_through_it_and_returns_on_the_resume(tmp_path):
    task = submit(tmp_path, "limited", model="fake/model")
    async with Client(bridge.build_server(), mode="legacy") as c:
        timer = threading.Timer(0.3, pause, args=(task["id"], 1.0))
        timer.start()
        paused = await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 20})
        timer.join()
        assert paused["met"] and paused["tasks"][0]["resume_at"] and "resuming by itself" in paused["hint"]
        assert [e["kind"] for e in paused["events"]][-1] == "paused"
        info = await call_tool(c, "get_task", {"task_id": task["id"]})
        assert info["paused_for"] == "usage_limit" and info["limit_account"] == "fake" and info["resume_at"]
        status = await call_tool(c, "queue_status", {})
        assert [h["account"] for h in status["held_accounts"]] == ["fake"]
        listed = await call_tool(c, "list_tasks", {})
        assert listed["tasks"][0]["resume_at"] == info["resume_at"]
        # A wait begun during the pause does not return at once: it returns when the task resumes.
        threading.Timer(1.5, task_store.resume_due).start()
        resumed = await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 20})
        assert resumed["met"] and resumed["waited_sec"] >= 1.0 and resumed["tasks"][0]["status"] == "pending"
        assert "resumed" in [e["kind"] for e in resumed["events"]]


async def test_answer_task_resumes_a_pause_now(tmp_path):
    task = submit(tmp_path, "limited", model="fake/model")
    pause(task["id"])
    async with Client(bridge.build_server(), mode="legacy") as c:
        answered = await call_tool(c, "answer_task", {"task_id": task["id"], "answer": "continue"})
    assert answered["status"] == "pending" and answered["resume_at"] is None
    assert task_store.get_task(task["id"])["limit_pauses"][0]["resumed"] == "by planner"


def test_cli_status_and_show_name_the_held_account_and_the_resume_time(tmp_path):
    task = submit(tmp_path, "limited", model="fake/model")
    pause(task["id"])
    shown = CliRunner().invoke(tasks_cli.cli, ["show", task["id"]])
    resume_at = task_store.get_task(task["id"])["resume_at"]
    assert shown.exit_code == 0 and "resumes at" in shown.output and resume_at in shown.output
    status = CliRunner().invoke(tasks_cli.cli, ["status"])
    assert status.exit_code == 0 and f"Provider fake is at its usage limit until {resume_at}" in status.output
    as_json = CliRunner().invoke(tasks_cli.cli, ["status", "--json"])
    assert '"held_accounts"' in as_json.output and task["id"] in as_json.output


async def test_a_task_queued_past_its_schedule_timeout_is_flagged(tmp_path, monkeypatch):
    work = tmp_path / "work"   # beside the queue, which tmp_path holds
    work.mkdir()
    async with Client(bridge.build_server(), mode="legacy") as c:
        late = await call_tool(c, "submit_task", {"title": "late", "instructions": "x", "working_dir": str(work),
                                           "schedule_timeout_sec": 60})
        plain = await call_tool(c, "submit_task", {"title": "plain", "instructions": "x", "working_dir": str(work)})
        assert late["schedule_timeout_sec"] == 60 and late["start_overdue"] is None
        started = task_store.now()
        monkeypatch.setattr(task_store, "now", lambda: started + 61)   # a minute passes, no worker runs
        info = await call_tool(c, "get_task", {"task_id": late["id"]})
        assert "past its schedule timeout of 60 s" in info["start_overdue"]
        assert (await call_tool(c, "get_task", {"task_id": plain["id"]}))["start_overdue"] is None
        status = await call_tool(c, "queue_status", {})
        assert [t["id"] for t in status["start_overdue"]] == [late["id"]]
        shown = CliRunner().invoke(tasks_cli.cli, ["status"])
        assert f"{late['id']}: queued 61 s without starting" in shown.output
        task_store.claim_next("w", task_id=late["id"])   # started: no longer flagged
        assert (await call_tool(c, "get_task", {"task_id": late["id"]}))["start_overdue"] is None
    bad = CliRunner().invoke(tasks_cli.cli, ["submit", "t", "--dir", str(work), "--schedule-timeout", "0"])
    assert bad.exit_code == 2 and "--schedule-timeout" in bad.output
