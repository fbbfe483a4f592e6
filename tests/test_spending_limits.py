"""Spending limits (issue 14) with the real `opencode` and the scripted model: a task limit pauses
the run at the step that reaches it before any further model request, an answer raising the limit
resumes the same session, "stop" fails it with its receipt kept; a spent daily budget keeps new
tasks pending until it is raised.

Prices come from the scripted provider's config (tests/opencode_env.py: input 1.0 and output 2.0
USD per million tokens), so a step with 100,000 prompt and 1,000 completion tokens costs $0.102.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mcp import Client

import opencode_bridge_mcp as bridge
import opencode_runner as oc
import task_store
import task_views
import tasks_cli
from fake_openai import text, tool_call
from helpers import ROOT, make_repo, run_script
from opencode_env import MODEL

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
STEP_USAGE = {"prompt_tokens": 100_000, "completion_tokens": 1_000, "cached_tokens": 0, "reasoning_tokens": 0}
STEP_USD = 0.102
DONE = '```json\n{"summary": "counted to four", "files_touched": ["n.txt"], "tests_run": [], ' \
       '"open_questions": []}\n```'


def _five_steps() -> list:
    return [tool_call("bash", {"command": f"echo {n} >> n.txt", "description": f"count {n}"}, usage=STEP_USAGE)
            for n in range(1, 5)] + [text("Counted.\n" + DONE, usage=STEP_USAGE)]


def test_task_limit_pauses_at_the_step_then_resumes_the_same_session(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("count", _five_steps())
    task = task_store.submit_task(title="count", instructions="Count to four. SCRIPT:count",
                                  working_dir=str(repo), max_cost_usd=0.25)
    assert run_script("worker.py").returncode == 0
    paused = task_store.get_task(task["id"])
    assert paused["status"] == "waiting", paused["error"]
    assert paused["paused_for"] == "task_limit"
    # Steps cost 0.102, 0.204, 0.306 in total: the third crosses 0.25 and no fourth request went out.
    assert len(opencode.model.step_requests("count")) == 3
    assert paused["spent_usd"] == pytest.approx(3 * STEP_USD)
    question = paused["question"]
    assert "$0.3060 of its $0.2500 limit" in question and "after model call 3" in question
    assert "echo 3 >> n.txt" in question, "the question says what the agent was doing"
    assert paused["worktree_path"] and paused["session_id"]
    assert paused["result"]["usage"]["cost_usd"] == pytest.approx(3 * STEP_USD)

    with pytest.raises(task_store.ValidationError, match="still at its spending limit"):
        task_store.answer_task(task["id"], "continue")
    with pytest.raises(task_store.ValidationError, match="already spent"):
        task_store.answer_task(task["id"], "continue, up to $0.30")
    assert task_store.get_task(task["id"])["status"] == "waiting", "a refused answer changes nothing"
    task_store.answer_task(task["id"], "continue, up to $2")
    assert task_store.get_task(task["id"])["max_cost_usd"] == 2.0
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert done["session_id"] == paused["session_id"]
    assert done["result"]["session"].startswith("resumed OpenCode session")
    assert done["usage"]["cost_usd"] == pytest.approx(5 * STEP_USD)
    assert len(opencode.model.step_requests("count")) == 5
    resumed = opencode.model.step_requests("count")[3]
    assert "spending limit" in json.dumps(resumed["json"]["messages"])


def test_stop_at_the_limit_fails_the_task_with_its_receipt(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("count", _five_steps())
    task = task_store.submit_task(title="count", instructions="SCRIPT:count", working_dir=str(repo),
                                  max_tokens=150_000)
    assert run_script("worker.py").returncode == 0
    paused = task_store.get_task(task["id"])
    assert paused["status"] == "waiting", paused["error"]
    assert len(opencode.model.step_requests("count")) == 2, "tokens: 101,000 then 202,000 >= 150,000"
    assert "202,000 of its 150,000 tokens" in paused["question"]
    stopped = task_store.answer_task(task["id"], "stop")
    assert stopped["status"] == "failed"
    assert "stopped at its spending limit" in stopped["error"]
    kept = task_store.get_task(task["id"])
    assert kept["result"]["commands"][-1]["command"] == "echo 2 >> n.txt"
    assert kept["usage"]["tokens"]["total"] == 202_000


def test_spent_daily_budget_keeps_the_third_task_pending_until_raised(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("one", [text("Done.\n" + DONE, usage=STEP_USAGE)])
    task_store.set_budget(daily_usd=0.15)
    ids = [task_store.submit_task(title=f"t{n}", instructions="SCRIPT:one", working_dir=str(repo))["id"]
           for n in range(3)]
    assert run_script("worker.py").returncode == 0
    assert [task_store.get_task(i)["status"] for i in ids] == ["done", "done", "pending"]
    status = task_views.queue_snapshot()
    assert status["budget"]["exhausted"] and status["budget"]["spent_usd"] == pytest.approx(2 * STEP_USD)
    assert status["counts"]["pending"] == 1
    assert "daily budget is spent" in status["worker"]["extra"]["budget"]
    assert "daily budget is spent" in status["worker"]["summary"]
    task_store.set_budget(daily_usd=1)
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(ids[2])["status"] == "done"


def test_the_spend_gate_holds_the_call_after_the_step_that_reaches_the_allowance(opencode, tmp_path):
    """The plugin alone, driven by hand: steps cost ~$0.00101 each (the default scripted usage),
    the run may spend $0.0015, so the third call is held and never sent, and the .held file says
    what OpenCode stored for the run."""
    work = tmp_path / "work"
    work.mkdir()
    opencode.model.script("gate", [tool_call("bash", {"command": f"echo {n}", "description": "n"})
                                   for n in range(4)] + [text("done")])
    gate = tmp_path / "run" / "control" / "gate"   # the worker's run folder: control/ and reply/
    gate.parent.mkdir(parents=True)
    (tmp_path / "run" / "reply").mkdir()
    gate.write_text('{"allow_usd": 0.0015, "allow_tokens": null, "stop": null}')
    env = oc.with_spend_gate({**opencode.env, "PWD": str(work)}, str(gate))
    proc = subprocess.Popen([opencode.bin, "run", "--auto", "--format", "json", "-m", MODEL, "--title", "br-gate"],
                            cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        proc.stdin.write(b"SCRIPT:gate go")
        proc.stdin.close()
        held = Path(oc.reply_path(str(gate), ".held"))
        deadline = time.monotonic() + 120
        while not held.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        said = json.loads(held.read_text())
        assert said["steps"] == 2 and said["cost_usd"] == pytest.approx(0.00101 + 0.001022)
        assert said["tokens"] == (1000 + 50) + (1010 + 51)
        time.sleep(2)
        assert len(opencode.model.step_requests("gate")) == 2, "the third call was never sent"
        assert proc.poll() is None, "the run waits for the worker to end it"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_a_dollar_limit_on_an_unpriced_model_is_flagged_at_submit(opencode, tmp_path):
    opencode.configure({"provider": {"fake": {"models": {"model": {
        "cost": {"input": 0, "output": 0, "cache_read": 0, "cache_write": 0}}}}}})
    work = tmp_path / "work"   # not tmp_path: it holds the test's OpenCode configuration, refused for in-place work
    work.mkdir()
    args = {"title": "t", "instructions": "i", "working_dir": str(work), "model": MODEL, "worktree": False}
    async with Client(bridge.build_server()) as c:
        flagged = (await c.call_tool("submit_task", args | {"max_cost_usd": 1})).structured_content
        tokens = (await c.call_tool("submit_task", args | {"max_cost_usd": 1, "max_tokens": 9000})).structured_content
    assert flagged["status"] == "pending", "warned, not refused"
    assert flagged["warnings"] and "no price for fake/model" in flagged["warnings"][0]
    assert "max_tokens" in flagged["warnings"][0]
    assert tokens["warnings"] == []
    result = CliRunner().invoke(tasks_cli.cli, ["submit", "t", "--dir", str(work), "--model", MODEL,
                                                "--max-cost", "1"])
    assert result.exit_code == 0 and "Warning:" in result.output and "no price" in result.output


def test_the_gate_plugin_joins_the_users_own_plugins(opencode, tmp_path):
    opencode.configure({"plugin": ["file:///somewhere/users-own-plugin.js"]})
    env = oc.with_spend_gate({**opencode.env, "PWD": str(tmp_path)}, str(tmp_path / "x.gate"))
    resolved = oc.resolved_config(env, str(tmp_path))
    assert resolved["plugin"] == ["file:///somewhere/users-own-plugin.js", oc.spend_gate_plugin().as_uri()]


def test_a_run_that_spends_the_daily_budget_pauses_and_resumes_once_it_is_raised(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("count", _five_steps())
    task_store.set_budget(daily_usd=0.25)
    task = task_store.submit_task(title="count", instructions="SCRIPT:count", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    paused = task_store.get_task(task["id"])
    assert paused["status"] == "waiting" and paused["paused_for"] == "daily_budget", paused["error"]
    assert len(opencode.model.step_requests("count")) == 3
    assert paused["question"].startswith("Daily budget reached: the daily budget is spent ($0.3060 of $0.2500")
    with pytest.raises(task_store.ValidationError, match="daily budget"):
        task_store.answer_task(task["id"], "continue")
    task_store.set_budget(daily_usd=2)
    task_store.answer_task(task["id"], "continue")
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert done["session_id"] == paused["session_id"] and len(opencode.model.step_requests("count")) == 5
    assert task_store.budget_state()["spent_usd"] == pytest.approx(5 * STEP_USD)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="instant wake-ups use inotify (Linux)")
def test_a_watching_worker_says_the_budget_is_spent_and_claims_soon_after_a_raise(opencode, tmp_path):
    spender = task_store.submit_task(title="spent it", instructions="x", working_dir=str(tmp_path))
    claimed = task_store.claim_next("someone", task_id=spender["id"])
    task_store.record_spend(spender["id"], claimed["run_marker"], 0.01, 10, 0.01, 10)
    task_store.set_budget(daily_usd=0.005)
    gone = tmp_path / "gone"
    gone.mkdir()
    task = task_store.submit_task(title="next", instructions="x", working_dir=str(gone))
    gone.rmdir()   # the claim then fails at once, without running an agent
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            env=os.environ | {"WORKER_POLL_SEC": "20"})
    try:
        deadline = time.monotonic() + 60
        while "daily budget is spent" not in (task_store.read_worker_heartbeat() or {}).get("budget", ""):
            assert time.monotonic() < deadline and proc.poll() is None, "the heartbeat never said why"
            time.sleep(0.05)
        time.sleep(0.5)
        assert task_store.get_task(task["id"])["status"] == "pending"
        assert "claims nothing new: the daily budget is spent" in task_views.worker_state()["summary"]
        started = time.monotonic()
        task_store.set_budget(daily_usd=1)
        while task_store.get_task(task["id"])["status"] == "pending":
            assert time.monotonic() - started < 8, "not claimed within 8 s of the raise (the poll is 20 s)"
            time.sleep(0.02)
        # The claim commits a moment before the worker rewrites its heartbeat: under load the
        # file read right after the claim may still be the one written before it.
        while "budget" in (task_store.read_worker_heartbeat() or {}):
            assert time.monotonic() - started < 8, "the heartbeat still says the budget is spent"
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
