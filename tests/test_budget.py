"""Spending limits without an agent run (issue 14): the store's meter, limits and answers, the
daily budget's claim stop, the MCP tools and the CLI. The runs themselves (pause at a step, no
further request, resume, stop) are in test_spending_limits.py with the real opencode."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from mcp import Client
from mcp.types import Implementation

import opencode_bridge_mcp as bridge
import task_store
import tasks_cli
from helpers import call_tool, submit, tool_error


def _pause(task: dict, cost: float, kind: str = "task_limit") -> dict:
    """Claim the task, meter ``cost`` USD for one step and pause it as the worker does."""
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.record_spend(task["id"], claimed["run_marker"], cost, 1000, cost, 1000)
    usage = {"tokens": {"total": 1000}, "cost_usd": cost, "steps": 1}
    return task_store.pause_for_question(task["id"], claimed["run_marker"], "limit reached", session_id="ses_1",
                                         result={"summary": "so far", "commands": [{"command": "make"}]},
                                         usage=usage, paused_for=kind)


def test_limits_are_validated_and_defaults_apply_only_when_none_given(tmp_path):
    for bad in (-1, 0, "abc", float("nan"), 10**9, True):
        with pytest.raises(task_store.ValidationError, match="max_cost_usd"):
            submit(tmp_path, max_cost_usd=bad)
    with pytest.raises(task_store.ValidationError, match="max_tokens"):
        submit(tmp_path, max_tokens=0)
    assert submit(tmp_path, max_cost_usd="$0.50")["max_cost_usd"] == 0.5
    task_store.set_budget(default_max_cost_usd=0.25, default_max_tokens=5000)
    plain = submit(tmp_path)
    assert (plain["max_cost_usd"], plain["max_tokens"]) == (0.25, 5000)
    own = submit(tmp_path, max_tokens=100)
    assert (own["max_cost_usd"], own["max_tokens"]) == (None, 100), "a task's own limit replaces the defaults"
    task_store.set_budget(default_max_cost_usd=0, default_max_tokens=None)
    assert submit(tmp_path)["max_cost_usd"] is None
    with pytest.raises(task_store.ValidationError, match="daily_usd"):
        task_store.set_budget(daily_usd=-3)


def test_spend_is_live_on_the_running_task_and_counted_per_local_day(tmp_path):
    task = submit(tmp_path)
    claimed = task_store.claim_next("w")
    state = task_store.record_spend(task["id"], claimed["run_marker"], 0.1, 500, 0.1, 500)
    task_store.record_spend(task["id"], claimed["run_marker"], 0.3, 900, 0.2, 400)
    running = task_store.get_task(task["id"])
    assert running["spent_usd"] == pytest.approx(0.3) and running["spent_tokens"] == 900
    assert task_store.list_tasks()["tasks"][0]["spent_usd"] == pytest.approx(0.3)
    assert state["day"] == task_store.local_day() and state["spent_usd"] == pytest.approx(0.1)
    budget = task_store.budget_state()
    assert budget["spent_usd"] == pytest.approx(0.3) and budget["spent_tokens"] == 900
    assert budget["daily_usd"] is None and not budget["exhausted"]
    # A stale attempt's meter still counts the money but not on the task row.
    task_store.record_spend(task["id"], "br-1-a9", 5.0, 1, 0.5, 1)
    assert task_store.get_task(task["id"])["spent_usd"] == pytest.approx(0.3)
    assert task_store.budget_state()["spent_usd"] == pytest.approx(0.8)


def test_an_attempt_ended_without_its_workers_count_keeps_its_metered_spend(tmp_path):
    """Every way a running attempt ends without the worker's own count (the reaper's hand-back, a
    cancel, a fault before the receipt) books what its meter last recorded: before, the spend of
    a handed-back attempt vanished from the task's total, and a limit could be spent twice."""
    task = submit(tmp_path, max_retries=3, max_cost_usd=1.0)
    for counted in (True, False):   # the reaper's hand-back; a hand-back spending no retry
        claimed = task_store.claim_next("w", task_id=task["id"])
        task_store.record_spend(task["id"], claimed["run_marker"], 0.2, 100, 0.2, 100)
        task_store.requeue_attempt(task["id"], claimed["run_marker"], "lease went stale", count_attempt=counted)
    pending = task_store.get_task(task["id"])
    assert pending["spent_usd"] == pytest.approx(0.4) and pending["spent_tokens"] == 200
    assert [a.get("metered") for a in pending["usage"]["by_attempt"]] == [True, True]
    # The worker's own count (steps included) wins over the meter's when it has one.
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.record_spend(task["id"], claimed["run_marker"], 0.1, 50, 0.1, 50)
    task_store.requeue_attempt(task["id"], claimed["run_marker"], "worker stopping", count_attempt=False,
                               usage={"tokens": {"total": 60}, "cost_usd": 0.12, "steps": 2})
    assert task_store.get_task(task["id"])["spent_usd"] == pytest.approx(0.52)
    # A fault that fails the attempt before the worker counted it.
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.record_spend(task["id"], claimed["run_marker"], 0.05, 10, 0.05, 10)
    failed = task_store.fail_attempt(task["id"], claimed["run_marker"], "worker internal error", retryable=False)
    assert failed["spent_usd"] == pytest.approx(0.57) and failed["spent_tokens"] == 270
    assert failed["usage"]["steps"] == 2 and len(failed["usage"]["by_attempt"]) == 4
    # A cancel of a running attempt keeps what it spent so far.
    other = submit(tmp_path, "other")
    claimed = task_store.claim_next("w", task_id=other["id"])
    task_store.record_spend(other["id"], claimed["run_marker"], 0.25, 40, 0.25, 40)
    cancelled = task_store.cancel_task(other["id"])
    assert cancelled["spent_usd"] == pytest.approx(0.25) and cancelled["spent_tokens"] == 40


def test_the_day_is_the_local_calendar_day(monkeypatch):
    monkeypatch.setenv("TZ", "Pacific/Auckland")
    import time
    time.tzset()
    try:
        ts = 1_796_036_600.0   # 2026-11-30 11:03:20 UTC = 2026-12-01 00:03:20 in Auckland (UTC+13)
        assert task_store.local_day(ts) == "2026-12-01"
        assert task_store.next_local_midnight(ts) - ts == pytest.approx(24 * 3600 - 200, abs=1)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_spent_daily_budget_stops_claims_until_raised(tmp_path):
    first, second = submit(tmp_path), submit(tmp_path)
    task_store.set_budget(daily_usd=0.5)
    claimed = task_store.claim_next("w")
    task_store.record_spend(first["id"], claimed["run_marker"], 0.5, 10, 0.5, 10)
    state = task_store.budget_state()
    assert state["exhausted"] and "daily budget is spent ($0.5000 of $0.5000" in state["reason"]
    assert task_store.claim_next("w") is None
    with pytest.raises(task_store.InvalidTransition, match="daily budget is spent"):
        task_store.claim_next("w", task_id=second["id"])
    task_store.set_budget(daily_usd=1)
    assert task_store.claim_next("w")["id"] == second["id"]


def test_answers_to_a_limit_pause(tmp_path):
    task = submit(tmp_path, max_cost_usd=0.2)
    paused = _pause(task, 0.25)
    assert paused["status"] == "waiting" and paused["paused_for"] == "task_limit"
    with pytest.raises(task_store.ValidationError, match="still at its spending limit"):
        task_store.answer_task(task["id"], "continue")
    with pytest.raises(task_store.ValidationError, match=r"already spent \$0.2500"):
        task_store.answer_task(task["id"], "ok, up to $0.25")
    with pytest.raises(task_store.ValidationError, match="above 0"):
        task_store.answer_task(task["id"], "continue, up to $0")
    resumed = task_store.answer_task(task["id"], "continue, up to $2")
    assert resumed["status"] == "pending" and resumed["max_cost_usd"] == 2.0 and resumed["paused_for"] is None
    assert "spending limit" in resumed["answer"] and "up to $2" in resumed["answer"]
    assert task_store.get_task(task["id"])["questions"][-1]["answer"] == "continue, up to $2"


def test_stop_fails_the_paused_task_keeping_its_receipt_and_fails_dependents(tmp_path):
    task = submit(tmp_path, max_cost_usd=0.2)
    child = task_store.submit_task(title="c", instructions="i", working_dir=str(tmp_path), depends_on=[task["id"]])
    _pause(task, 0.25)
    stopped = task_store.answer_task(task["id"], "Stop, that is enough")
    assert stopped["status"] == "failed" and "stopped at its spending limit" in stopped["error"]
    assert stopped["result"]["commands"] == [{"command": "make"}] and stopped["usage"]["cost_usd"] == 0.25
    assert task_store.get_task(child["id"])["status"] == "failed"


def test_a_daily_budget_pause_resumes_on_continue_and_tokens_limits_read_bare_numbers(tmp_path):
    task = submit(tmp_path)
    task_store.set_budget(daily_usd=0.1)
    _pause(task, 0.1, kind="daily_budget")
    with pytest.raises(task_store.ValidationError, match="raise the budget first"):
        task_store.answer_task(task["id"], "continue")
    task_store.set_budget(daily_usd=None)
    assert task_store.answer_task(task["id"], "continue")["status"] == "pending"
    tokens = submit(tmp_path, max_tokens=800)
    _pause(tokens, 0.0)
    with pytest.raises(task_store.ValidationError, match="already used 1,000 tokens"):
        task_store.answer_task(tokens["id"], "900")
    assert task_store.answer_task(tokens["id"], "go on, 5k tokens")["max_tokens"] == 5000


def test_raise_limit_resumes_a_paused_task_and_refuses_finished_ones(tmp_path):
    task = submit(tmp_path, max_cost_usd=0.2)
    _pause(task, 0.25)
    raised = task_store.raise_limit(task["id"], max_cost_usd=1.5, author="cli:me")
    assert raised["status"] == "pending" and raised["max_cost_usd"] == 1.5
    other = submit(tmp_path)
    assert task_store.raise_limit(other["id"], max_tokens=10)["max_tokens"] == 10
    with pytest.raises(task_store.ValidationError, match="give the new limit"):
        task_store.raise_limit(other["id"])
    task_store.cancel_task(other["id"])
    with pytest.raises(task_store.InvalidTransition, match="cancelled"):
        task_store.raise_limit(other["id"], max_cost_usd=1)


@pytest.mark.parametrize(
    "text,unit,expected",
    [
        ("continue, up to $2", "usd", ("usd", 2.0)),
        ("2.50", "usd", ("usd", 2.5)),
        ("3 dollars", "tokens", ("usd", 3.0)),
        ("50000 tokens", "usd", ("tokens", 50000.0)),
        ("1.5m tokens", "usd", ("tokens", 1_500_000.0)),
        ("400000", "tokens", ("tokens", 400000.0)),
        ("no", "usd", ("stop", None)),
        ("yes, go on", "usd", ("continue", None)),
    ],
)
def test_parse_limit_answer(text, unit, expected):
    assert task_store.parse_limit_answer(text, unit) == expected


def test_cli_submit_limits_budget_commands_and_status(tmp_path):
    work = tmp_path / "work"   # beside the queue, which tmp_path holds
    work.mkdir()
    run = CliRunner().invoke
    result = run(
        tasks_cli.cli, ["submit", "x", "--dir", str(work), "--max-cost", "$0.40", "--max-tokens", "900", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["max_cost_usd"] == 0.4
    bad = run(tasks_cli.cli, ["submit", "x", "--dir", str(work), "--max-cost", "lots"])
    assert bad.exit_code == 2 and "max_cost_usd must be an amount in USD" in bad.output
    assert run(tasks_cli.cli, ["budget", "set"]).exit_code == 2
    result = run(tasks_cli.cli, ["budget", "set", "--daily", "0.001", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["daily_usd"] == 0.001
    claimed = task_store.claim_next("w")
    task_store.record_spend(claimed["id"], claimed["run_marker"], 0.002, 5, 0.002, 5)
    shown = run(tasks_cli.cli, ["status"])
    assert shown.exit_code == 0 and "$0.0020 of $0.0010" in shown.output
    assert "Nothing new is claimed: the daily budget is spent" in shown.output
    assert json.loads(run(tasks_cli.cli, ["budget", "show", "--json"]).output)["exhausted"] is True
    raised = run(tasks_cli.cli, ["budget", "raise", claimed["id"], "0.001"])
    assert raised.exit_code == 1 and "already spent $0.0020" in raised.output
    assert run(tasks_cli.cli, ["budget", "raise", claimed["id"], "1"]).exit_code == 0
    assert task_store.get_task(claimed["id"])["max_cost_usd"] == 1.0
    missing = run(tasks_cli.cli, ["budget", "raise", "t_0099", "1"])
    assert missing.exit_code == 1 and "t_0099 not found" in missing.output
    # A negative amount reaches the amount's own check (click took "-5" for an unknown option)
    for amount in ("-5", "-0.5", "-$1"):
        negative = run(tasks_cli.cli, ["budget", "raise", claimed["id"], amount])
        assert negative.exit_code == 2 and "No such option" not in negative.output, negative.output
        assert "usd must be" in negative.output, negative.output
    unknown = run(tasks_cli.cli, ["budget", "raise", claimed["id"], "1", "--token", "5"])
    assert unknown.exit_code == 2 and "No such option '--token'" in unknown.output, "a mistyped option: click's words"
    assert task_store.get_task(claimed["id"])["max_cost_usd"] == 1.0


@pytest.mark.anyio
async def test_mcp_set_budget_queue_status_and_submit_limits(tmp_path):
    work = tmp_path / "work"   # beside the queue, which tmp_path holds
    work.mkdir()
    async with Client(bridge.build_server(), client_info=Implementation(name="claude-ai", version="1")) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        hints = tools["set_budget"].annotations
        assert hints.idempotent_hint and hints.destructive_hint and not hints.read_only_hint
        assert hints.open_world_hint is False
        assert tools["set_budget"].input_schema.get("additionalProperties") is False
        await tool_error(c, "set_budget", {"daily_usd": 1, "monthly_usd": 5})
        assert set(tools["submit_task"].input_schema["properties"]) >= {"max_cost_usd", "max_tokens"}
        set_result = await call_tool(c, "set_budget", {"daily_usd": 3, "default_max_cost_usd": 0.5})
        assert set_result["daily_usd"] == 3
        refused = await tool_error(c, "set_budget", {"daily_usd": -1})
        assert "daily_usd" in refused and "\n" not in refused
        task = await call_tool(c, "submit_task", {"title": "t", "instructions": "i", "working_dir": str(work),
                                                  "max_tokens": 700, "worktree": False})
        assert task["max_tokens"] == 700 and task["max_cost_usd"] is None and task["warnings"] == []
        bad = await tool_error(c, "submit_batch", {"tasks": [{"title": "t", "instructions": "i",
                                                              "working_dir": str(work), "max_cost_usd": "x"}]})
        assert "max_cost_usd" in bad
        for not_a_number in ("NaN", "inf"):   # said as such, not as "must be ≤ 1000000"
            said = await tool_error(c, "submit_task", {"title": "t", "instructions": "i", "working_dir": str(work),
                                                      "max_cost_usd": not_a_number})
            assert "max_cost_usd" in said and "finite number" in said, said
        not_rules = await tool_error(c, "submit_task", {"title": "t", "instructions": "i",
                                                        "working_dir": str(work), "rules": "deny bash"})
        assert "rules must be an object (a JSON object)" in not_rules, not_rules
        missing = await tool_error(c, "submit_batch", {"tasks": [{"title": "t", "working_dir": str(work)}]})
        assert "instructions is required" in missing, missing
        status = await call_tool(c, "queue_status")
        assert status["budget"]["daily_usd"] == 3 and status["budget"]["default_max_cost_usd"] == 0.5
        assert status["budget"]["exhausted"] is False and status["budget"]["resets_at"]
        cleared = await call_tool(c, "set_budget", {"daily_usd": 0})
        assert cleared["daily_usd"] is None and cleared["default_max_cost_usd"] == 0.5


def test_the_board_api_shows_todays_spend_the_budget_and_live_task_spend(tmp_path, monkeypatch):
    from starlette.testclient import TestClient
    monkeypatch.setenv("MCP_BEARER_TOKEN", "board-token-for-budget-tests")
    client = TestClient(bridge.build_app(), base_url="http://127.0.0.1:8765")
    auth = {"Authorization": "Bearer board-token-for-budget-tests"}
    task = submit(tmp_path, max_cost_usd=1)
    task_store.set_budget(daily_usd=0.05)
    claimed = task_store.claim_next("w")
    task_store.record_spend(task["id"], claimed["run_marker"], 0.06, 10, 0.06, 10)
    status = client.get("/api/status", headers=auth).json()
    assert status["budget"]["exhausted"] and "daily budget is spent" in status["budget"]["reason"]
    row = client.get("/api/tasks", headers=auth).json()["tasks"][0]
    assert row["spent_usd"] == pytest.approx(0.06) and row["max_cost_usd"] == 1
    page = client.get(f"/api/tasks/{task['id']}", headers=auth).json()
    assert page["spent_usd"] == pytest.approx(0.06) and page["status"] == "running"
    script = client.get("/board/app.js").text
    assert "renderSpend" in script and "spent_usd" in script and "innerHTML" not in script


def test_the_worker_says_a_task_paused_at_its_limit(tmp_path):
    import worker_talk
    task = submit(tmp_path, max_cost_usd=0.2)
    paused = _pause(task, 0.25)
    line, style = worker_talk.ended_line(task | {"attempts": 1}, paused, 3.0)
    assert line.startswith(f"{task['id']} paused at its spending limit after 3.0 s, $0.2500") and style == "magenta"


def test_the_meter_tells_the_gate_what_the_run_may_still_spend(tmp_path):
    import worker
    task_store.set_budget(daily_usd=1.0)
    mine, other = submit(tmp_path, max_cost_usd=0.5), submit(tmp_path)
    claimed = task_store.claim_next("w", task_id=mine["id"]) | {"usage": {"cost_usd": 0.1, "tokens": {"total": 5}}}
    gate = worker.fresh_run_folder(mine["id"]) / "control" / "gate"
    meter = worker.Meter(claimed, str(gate))
    assert json.loads(gate.read_text()) == {"allow_usd": pytest.approx(0.4), "allow_tokens": None, "stop": None}
    # Another run spends 0.8 of today's 1.0: at the next refresh this run may spend 0.2 in all.
    theirs = task_store.claim_next("w", task_id=other["id"])
    task_store.record_spend(other["id"], theirs["run_marker"], 0.8, 10, 0.8, 10)
    meter.refresh()
    assert json.loads(gate.read_text())["allow_usd"] == pytest.approx(0.2)
    assert not meter.believes(), "a hold below every allowance the gate was given is not borne out"
    meter.write_gate(stop="limit")
    meter.refresh()
    assert json.loads(gate.read_text())["stop"] == "limit", "once stopped, a refresh never reopens the gate"
    held = gate.parent.parent / "reply" / "gate.held"
    held.write_text('{"steps": 2, "cost_usd": 0.25, "tokens": 40}')
    assert meter.held() == {"steps": 2, "cost_usd": 0.25, "tokens": 40}
    assert meter.believes(), "told to stop, the gate holds whatever the stream showed"
    meter.close()
    assert not gate.exists() and not held.exists()


def test_a_cancelled_then_retried_paused_task_is_not_shown_as_paused(tmp_path):
    task = submit(tmp_path, max_cost_usd=0.2)
    _pause(task, 0.25)
    task_store.cancel_task(task["id"])
    task_store.retry_task(task["id"])
    assert task_store.claim_next("w", task_id=task["id"])["paused_for"] is None


@pytest.mark.parametrize("fault", ["DiskFull", "ReadOnlyStorage"])
def test_a_refresh_the_disk_refuses_keeps_the_allowance_and_the_run(tmp_path, monkeypatch, fault):
    """store_sqlite maps a read's 'disk is full' or read-only mount to a StorageFault: the meter's
    refresh keeps the gate it had instead of ending the run as a worker error."""
    import worker
    task_store.set_budget(daily_usd=1.0)
    mine = submit(tmp_path, max_cost_usd=0.5)
    claimed = task_store.claim_next("w", task_id=mine["id"]) | {"usage": {"cost_usd": 0.1, "tokens": {"total": 5}}}
    gate = worker.fresh_run_folder(mine["id"]) / "control" / "gate"
    meter = worker.Meter(claimed, str(gate))
    before = gate.read_text()

    def refused():
        raise getattr(task_store, fault)(f"{fault}: the disk under the queue refused it")

    monkeypatch.setattr(task_store, "budget_state", refused)
    meter.refresh()
    assert gate.read_text() == before
    meter.close()


@pytest.mark.parametrize("unit, limits, spend", [("tokens", {"max_tokens": 100}, (0.01, 1050)),
                                                  ("usd", {"max_cost_usd": 0.01}, (0.25, 10))])
def test_the_limit_question_suggests_answers_the_queue_takes(tmp_path, unit, limits, spend):
    # A step can overshoot a limit many times over (1,050 tokens of 100): the question's suggested
    # answer and its CLI command must both name a limit above the spend, which answer_task requires.
    import re

    import opencode_runner as oc
    import worker
    cost, tokens = spend
    for way in ("answer", "cli"):
        task = submit(tmp_path, **limits)
        claimed = task_store.claim_next("w", task_id=task["id"])
        task_store.record_spend(task["id"], claimed["run_marker"], cost, tokens, cost, tokens)
        limit = limits.get("max_tokens") or limits["max_cost_usd"]
        spent = tokens if unit == "tokens" else cost
        run = worker.RunResult(oc.EventStream())
        run.paused = {"kind": "task_limit", "unit": unit, "spent": spent, "limit": limit, "reason": "over"}
        question = worker.limit_question(task, run)
        task_store.pause_for_question(task["id"], claimed["run_marker"], question, session_id="ses_1",
                                      result={"summary": "so far"}, paused_for="task_limit",
                                      usage={"tokens": {"total": tokens}, "cost_usd": cost, "steps": 1})
        if way == "answer":
            task_store.answer_task(task["id"], re.search(r"Answer '([^']+)'", question).group(1))
        else:
            argv = re.search(r"`tasks_cli.py (budget raise [^`]+)`", question).group(1).split()
            out = CliRunner().invoke(tasks_cli.cli, ["--db", str(task_store.db_path()), *argv])
            assert out.exit_code == 0, out.output
        assert task_store.get_task(task["id"])["status"] == "pending", question


@pytest.mark.parametrize("odd,words", [
    (float("inf"), "must be a finite number"), (float("-inf"), "must be a finite number"),
    (float("nan"), "must be a finite number"), ("Infinity", "must be a finite number"),
    ("NaN", "must be a finite number"),
    ("$inf", "must be a finite number"), ("1e999", "must be a finite number"),
    (True, "must be a number, not true or false"), (False, "must be a number, not true or false"),
])
def test_every_number_of_the_store_refuses_infinity_nan_and_booleans_in_the_same_words(tmp_path, odd, words):
    """Python reads true as 1 and a bare float('inf') as a number: every number the store takes
    (a task's bounds and limits, the budget, a raise) says what is wrong, not "must be ≤ …"."""
    for field in ("priority", "timeout_sec", "max_retries", "max_tokens", "max_cost_usd", "schedule_timeout_sec"):
        with pytest.raises(task_store.ValidationError, match=f"^{field} {words}"):
            submit(tmp_path, **{field: odd})
    for field in ("daily_usd", "daily_tokens", "default_max_cost_usd", "default_max_tokens"):
        if odd is False:
            continue        # False, like 0 and None, removes a budget
        with pytest.raises(task_store.ValidationError, match=f"^{field} {words}"):
            task_store.set_budget(**{field: odd})
    task = submit(tmp_path)
    for field in ("max_cost_usd", "max_tokens"):
        with pytest.raises(task_store.ValidationError, match=f"^{field} {words}"):
            task_store.raise_limit(task["id"], **{field: odd})
    assert [t["id"] for t in task_store.list_tasks()["tasks"]] == [task["id"]], "nothing half-written"
    assert task_store.budget_state()["daily_usd"] is None


def test_a_raise_too_big_for_a_float_is_refused_not_a_crash(tmp_path):
    tokens = submit(tmp_path, max_tokens=800)
    _pause(tokens, 0.0)
    with pytest.raises(task_store.ValidationError, match="the new token limit must be a finite number"):
        task_store.answer_task(tokens["id"], "9" * 400 + " tokens")
    assert task_store.get_task(tokens["id"])["status"] == "waiting"
