"""Every MCP tool of the bridge through the SDK client in memory, in both protocol modes (legacy handshake and
auto), including the bad-input list of issue 3 and the caps on huge logs, diffs and lists."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from mcp import Client
from mcp.types import Implementation

import mcp_shared
import opencode_bridge_mcp as bridge
import opencode_runner
import task_store
import tasks_cli
from helpers import call_tool, fake_binary, tool_error

pytestmark = pytest.mark.anyio

TOOLS = {
    "submit_task", "submit_batch", "get_task", "get_task_result", "get_task_logs", "wait_for",
    "answer_task", "list_tasks", "queue_status", "worker_heartbeat", "restart_worker",
    "add_task_note", "cancel_task", "clear_finished", "list_models", "set_default_model", "ping",
    "retry_task", "apply_task", "set_budget", "get_task_transcript",
}
CLAUDE = Implementation(name="claude-ai", version="0.14.2")


@pytest.fixture(autouse=True)
def no_token_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token"))


@pytest.fixture(params=["legacy", "auto"])
def mode(request):
    return request.param


@pytest.fixture
def wd(tmp_path) -> str:
    path = tmp_path / "project"
    path.mkdir()
    return str(path)


def client(mode: str = "legacy", info: Implementation = CLAUDE) -> Client:
    return Client(bridge.build_server(), mode=mode, client_info=info)


def task_args(wd: str, **over) -> dict:
    return {"title": "Add a README", "instructions": "Write README.md", "working_dir": wd} | over


def finish(task_id: str, status: str = "done", diff: str = "", result: dict | None = None,
           branch: str | None = None) -> None:
    """Play the worker: claim the task and finish its attempt (on ``branch``, as a worktree run)."""
    claimed = task_store.claim_next("test-worker", task_id=task_id)
    marker = claimed["run_marker"]
    if branch:
        task_store.renew_lease(task_id, marker, branch=branch)
    if status == "done":
        task_store.complete_attempt(task_id, marker, result=result or {"summary": "ok"}, diff=diff,
                                    usage={"tokens": {"input": 10, "output": 5}, "cost_usd": 0.25})
    elif status == "waiting":
        task_store.pause_for_question(task_id, marker, "Which license?")
    else:
        task_store.fail_attempt(task_id, marker, "it broke", retryable=False)


# ---------------------------------------------------------------------------------------------
# Listing and round trips, both modes.


async def test_lists_the_17_tools_with_docs_and_output_schemas(mode):
    async with client(mode) as c:
        tools = (await c.list_tools()).tools
    assert {t.name for t in tools} == TOOLS
    for tool in tools:
        assert tool.description and len(tool.description) > 60, tool.name
        assert tool.output_schema and tool.output_schema.get("type") == "object", tool.name
    submit = next(t for t in tools if t.name == "submit_task").input_schema
    assert submit["properties"]["title"]["type"] == "string"
    assert set(submit["required"]) == {"title", "instructions"}      # working_dir or repo: the store checks
    assert {"working_dir", "repo", "base_ref", "host"} <= set(submit["properties"])
    timeout = submit["properties"]["timeout_sec"]
    assert (timeout["type"], timeout["minimum"], timeout["maximum"], timeout["default"]) == ("integer", 1, 86400, 1800)
    batch = next(t for t in tools if t.name == "submit_batch").input_schema["properties"]["tasks"]
    assert batch["maxItems"] == 20 and {"working_dir", "repo", "base_ref", "host"} <= set(batch["items"]["properties"])
    assert set(batch["items"]["required"]) == {"title", "instructions"}


def _walk(node):
    yield node
    for value in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()):
        yield from _walk(value)


async def test_listed_output_schemas_are_lean_and_judge_every_result_as_the_sdk_schema_does(wd):
    """The listed output schemas hold no $ref and no union of bare types (the client's jsonschema
    check walked every row's fields through them), and accept and refuse what the SDK's own
    schemas do: real results, a nullable text given as null, a number or left out."""
    from jsonschema import Draft202012Validator
    server = bridge.build_server()
    for n in range(3):
        task_store.submit_task(title=f"t{n}", instructions="x", working_dir=wd)
    finish("t_0001")
    async with Client(server, mode="legacy") as c:
        listed = {t.name: t.output_schema for t in (await c.list_tools()).tools}
        results = {name: await call_tool(c, name, args) for name, args in (
            ("list_tasks", {"limit": 50}), ("get_task", {"task_id": "t_0001"}), ("queue_status", {}))}
    for name, schema in listed.items():
        nodes = list(_walk(schema))
        assert not any(isinstance(n, dict) and "$ref" in n for n in nodes), name
        assert not any(isinstance(n, dict) and isinstance(n.get("anyOf"), list)
                       and all(isinstance(m, dict) and set(m) == {"type"} for m in n["anyOf"]) for n in nodes), name
    for name, value in results.items():
        original = Draft202012Validator(server._tool_manager.get_tool(name).output_schema)
        lean = Draft202012Validator(listed[name])
        row = value["tasks"][0] if name == "list_tasks" else value
        key = "oldest_pending" if name == "queue_status" else "error"
        for changed in (None, 5, "text", ...):
            probe = json.loads(json.dumps(value))
            target = probe["tasks"][0] if name == "list_tasks" else probe
            if changed is ...:
                del target[key]
            else:
                target[key] = changed
            assert original.is_valid(probe) == lean.is_valid(probe), (name, changed)
        assert lean.is_valid(value) and original.is_valid(value) and key in row, name
    assert not Draft202012Validator(listed["list_tasks"]).is_valid({**results["list_tasks"], "tasks": [{"id": 1}]})


async def test_submit_get_list_round_trip_stamps_the_caller(mode, wd):
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd, priority=5))
        assert task["id"] == "t_0001" and task["status"] == "pending" and task["duplicate"] is False
        assert task["hint"].startswith("no worker serves this queue now, so it waits until one runs: no worker has run")
        assert (task["origin_name"], task["origin_version"], task["origin_kind"]) == ("claude-ai", "0.14.2", "claude")
        shown = await call_tool(c, "get_task", {"task_id": "1"})
        assert shown["instructions"] == "Write README.md" and shown["priority"] == 5
        assert shown["origin_kind"] == "claude" and shown["events"][0]["kind"] == "submitted"
        assert (await call_tool(c, "list_tasks", {"origin": "claude"}))["total"] == 1
        assert (await call_tool(c, "list_tasks", {"origin": "chatgpt"}))["total"] == 0
    async with client(mode, Implementation(name="openai-mcp", version="1.0.0")) as c:
        other = await call_tool(c, "submit_task", task_args(wd))
        assert other["origin_kind"] == "chatgpt"
        ping = await call_tool(c, "ping")
        assert ping["caller"] == {"name": "openai-mcp", "version": "1.0.0", "kind": "chatgpt"}
        assert ping["tasks"] == 2 and ping["version"] == bridge.VERSION


async def test_the_submit_result_names_the_task_as_task_id_like_every_other_tool(mode, wd):
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        shown = await call_tool(c, "get_task", {"task_id": task["task_id"]})
        assert task["task_id"] == task["id"] == shown["id"]
        batch = await call_tool(c, "submit_batch", {"tasks": [task_args(wd), task_args(wd)]})
        assert [t["task_id"] for t in batch["tasks"]] == ["t_0002", "t_0003"]
        # wd is no git repository: each submit says the agent changes it in place.
        assert all(any(f"{wd} is not in a git repository" in w for w in t["warnings"]) for t in [task, *batch["tasks"]])


async def test_free_text_that_looks_like_json_or_a_number_is_stored_exactly(mode, wd):
    texts = {"title": '{"steps":[1]}', "instructions": "12345", "idempotency_key": "[1, 2]"}
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd, **texts, agent="build"))
        await call_tool(c, "add_task_note", {"task_id": task["id"], "text": "null"})
        await call_tool(c, "add_task_note", {"task_id": task["id"], "text": '["a", 1]'})
        shown = await call_tool(c, "get_task", {"task_id": task["id"]})
        batch = await call_tool(c, "submit_batch", {"tasks": [task_args(wd, title="007", instructions="true")]})
    stored = task_store.get_task(task["id"])
    for key, value in texts.items():
        assert shown[key] == value and stored[key] == value and isinstance(stored[key], str)
    assert [n["text"] for n in stored["notes"]] == ["null", '["a", 1]']
    assert task_store.get_task(batch["tasks"][0]["id"])["title"] == "007"
    assert task_store.get_task(batch["tasks"][0]["id"])["instructions"] == "true"


async def test_odd_argument_shapes_are_accepted(mode, wd):
    async with client(mode) as c:
        first = await call_tool(c, "submit_task", task_args(wd))
        task = await call_tool(c, "submit_task", task_args(
            wd, timeout_sec="600", priority="null", model="null", max_retries="2", worktree="false",
            depends_on=json.dumps([first["id"]]), idempotency_key="null", agent="null"))
        assert (task["timeout_sec"], task["priority"], task["model"], task["max_retries"]) == (600, 0, None, 2)
        assert task["worktree"] is False and task["depends_on"] == ["t_0001"]
        assert task["idempotency_key"] is None and task["agent"] is None
        plain = await call_tool(c, "submit_task", task_args(wd, depends_on="t_0001, 2"))
        assert plain["depends_on"] == ["t_0001", "t_0002"]
        batch = await call_tool(
            c, "submit_batch", {"tasks": json.dumps([task_args(wd, timeout_sec="60", priority="null")])}
        )
        assert batch["tasks"][0]["timeout_sec"] == 60 and batch["tasks"][0]["priority"] == 0
        waited = await call_tool(c, "wait_for", {"task_ids": '["t_0001", "2"]', "timeout_sec": "1", "mode": "null"})
        assert [t["id"] for t in waited["tasks"]] == ["t_0001", "t_0002"]
        page = await call_tool(c, "list_tasks", {"status": '["pending"]', "limit": "2", "offset": "null"})
        assert page["total"] == 4 and len(page["tasks"]) == 2 and page["next_offset"] == 2
        assert (await call_tool(c, "list_tasks", {"status": "pending,running"}))["total"] == 4


async def test_idempotency_key_returns_the_first_task_and_refuses_it_for_another(mode, wd):
    """The same request again (a retry after a lost answer) gets the first task back; the key
    with another title or instructions is refused, naming the first task: returning it would drop
    the new one unseen (payment APIs refuse a key reused with other parameters the same way)."""
    async with client(mode) as c:
        first = await call_tool(c, "submit_task", task_args(wd, idempotency_key="job-7"))
        again = await call_tool(c, "submit_task", task_args(wd, idempotency_key="job-7"))
        other = await tool_error(c, "submit_task", task_args(wd, idempotency_key="job-7", title="other"))
        in_batch = await tool_error(c, "submit_batch", {"tasks": [task_args(wd, title="new one"),
                                                                  task_args(wd, idempotency_key="job-7",
                                                                            instructions="else")]})
    assert again["id"] == first["id"] and again["duplicate"] is True and "idempotency_key" in again["hint"]
    assert f"'job-7' was already used by {first['id']}" in other and "whose title differs;" in other, other
    assert "give this task a new key" in other and "whose instructions differ;" in in_batch, in_batch
    assert task_store.counts()["pending"] == 1, "nothing of the refused batch was queued"


async def test_batch_with_refs_inside_the_batch(mode, wd):
    items = [task_args(wd, title="tests", ref="@t", depends_on=["@lib"]), task_args(wd, title="lib", ref="@lib")]
    async with client(mode) as c:
        batch = await call_tool(c, "submit_batch", {"tasks": items})
    tests, lib = batch["tasks"]
    assert batch["count"] == 2 and tests["depends_on"] == [lib["id"]]
    assert tests["origin_kind"] == lib["origin_kind"] == "claude"


async def test_follow_ups_and_forks_through_submit_task_and_batch(mode, wd):
    async with client(mode) as c:
        first = await call_tool(c, "submit_task", task_args(wd, title="first"))
        follow = await call_tool(c, "submit_task", task_args(wd, title="next", continue_from=first["id"]))
        batch = await call_tool(c, "submit_batch", {"tasks": [
            task_args(wd, title="base", ref="@base"),
            task_args(wd, title="after", continue_from="@base"),
            task_args(wd, title="other way", fork_from="@base")]})
        again = await tool_error(c, "submit_task", task_args(wd, title="again", continue_from=first["id"]))
    assert follow["depends_on"] == [first["id"]]
    assert task_store.get_task(follow["id"])["continue_from"] == first["id"]
    base, after, other = batch["tasks"]
    assert after["depends_on"] == other["depends_on"] == [base["id"]]
    assert task_store.get_task(other["id"])["fork_from"] == base["id"]
    assert f"{follow['id']} already continues it" in again and "fork_from" in again


async def test_get_task_transcript_pages_turns(mode, wd):
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd, instructions="transcript-brief"))
        page = await call_tool(c, "get_task_transcript", {"task_id": task["id"]})
        bad = await tool_error(c, "get_task_transcript", {"task_id": task["id"], "limit": 0})
        gone = await tool_error(c, "get_task_transcript", {"task_id": "t_0404"})
    assert page["source"] == "task logs" and page["line"] == [task["id"]] and page["total"] == 1
    assert page["turns"][0]["role"] == "user" and "transcript-brief" in page["turns"][0]["text"]
    assert "limit" in bad and "not found" in gone


# ---------------------------------------------------------------------------------------------
# Bad input: an is_error result naming the problem, nothing half-written.

BAD_SUBMITS = [
    ({"working_dir": "relative/path"}, "is relative"),
    ({"working_dir": "/no/such/dir/anywhere"}, "does not exist"),
    ({"timeout_sec": 0}, "timeout_sec must be ≥ 1; got 0"),
    ({"timeout_sec": "0"}, "timeout_sec must be ≥ 1"),
    ({"timeout_sec": 86401}, "timeout_sec must be ≤ 86400"),
    ({"timeout_sec": "ten minutes"}, "timeout_sec must be a whole number"),
    ({"priority": 1.5}, "priority must be a whole number"),
    ({"permission": "root"}, "permission must be one of"),
    ({"title": 12345}, "title must be text"),
    ({"title": ""}, "title must not be empty"),
    ({"title": "x" * 201}, "the limit is 200"),
    ({"depends_on": ["t_0042"]}, "t_0042, which does not exist"),
    ({"depends_on": "[t_0001"}, "depends_on must be a list"),
    ({"depends_on": {"id": 1}}, "depends_on must be a list"),
    ({"model": "gpt"}, "not found"),  # a plain name needs `opencode models`: OPENCODE_BIN is missing
    ({"model": "no provider/x y"}, "provider/model"),
    ({"agent": "rm -rf"}, "OpenCode agent name"),
    ({"worktree": "maybe"}, "worktree must be true or false"),
    ({"continue_from": "t_0042"}, "continue_from names t_0042, which does not exist"),
    ({"fork_from": "t_0042"}, "fork_from names t_0042, which does not exist"),
    ({"continue_from": "1", "fork_from": "1"}, "give continue_from or fork_from, not both"),
]


@pytest.mark.parametrize("over,needle", BAD_SUBMITS, ids=[n for _, n in BAD_SUBMITS])
async def test_bad_submit_is_refused_with_a_clear_message(over, needle, wd, monkeypatch):
    monkeypatch.setenv("OPENCODE_BIN", "/nonexistent/opencode")
    async with client("legacy") as c:
        text = await tool_error(c, "submit_task", task_args(wd, **over))
    assert needle in text
    assert sum(task_store.counts().values()) == 0


async def test_deep_or_huge_json_text_in_arguments_gets_one_short_line(wd):
    """List arguments may come as JSON text: a few KB of ``[[[`` raised RecursionError inside the
    tool (an "internal error"), and a refused value was echoed whole (100 KB in one message)."""
    deep_object = '{"title": ' + "[" * 3000 + "]" * 3000 + "}"
    cases = [("wait_for", {"task_ids": "[" * 3000, "timeout_sec": 1}, "task_ids must be a list"),
             ("list_tasks", {"status": "[" * 3000}, "status must be a list"),
             ("submit_task", task_args(wd, depends_on="[" * 3000 + "]" * 3000), "depends_on must be a list"),
             ("submit_batch", {"tasks": [deep_object]}, "a batch item nests arrays or objects too deeply"),
             ("wait_for", {"task_ids": "[" + "x" * 100_000, "timeout_sec": 1}, "task_ids must be a list"),
             ("add_task_note", {"task_id": 1, "text": "\ud800"}, "unpaired UTF-16 surrogate")]
    async with client("legacy") as c:
        await call_tool(c, "submit_task", task_args(wd))
        for tool, args, needle in cases:
            text = await tool_error(c, tool, args)
            assert needle in text and "internal error" not in text and len(text) < 400, (tool, text[:400])
    assert sum(task_store.counts().values()) == 1 and task_store.get_task(1)["notes"] == []


async def test_bad_input_in_both_modes(mode, wd):
    async with client(mode) as c:
        await call_tool(c, "submit_task", task_args(wd))
        cases = [
            ("get_task", {"task_id": "t_0999"}, "t_0999 not found"),
            ("get_task", {"task_id": "task-one"}, "use t_0001, 0001 or 1"),
            ("get_task", {"task_id": [1]}, "must be a task id"),
            ("get_task", {}, "task_id is required"),
            ("get_task_result", {"task_id": 999}, "t_0999 not found"),
            ("get_task_logs", {"task_id": "0999"}, "t_0999 not found"),
            ("answer_task", {"task_id": 999, "answer": "yes"}, "t_0999 not found"),
            ("answer_task", {"task_id": 1, "answer": "yes"}, "not waiting"),
            ("answer_task", {"task_id": 1, "answer": "  "}, "answer must not be empty"),
            ("add_task_note", {"task_id": 999, "text": "hi"}, "t_0999 not found"),
            ("cancel_task", {"task_id": 999}, "t_0999 not found"),
            ("wait_for", {"task_ids": ["t_0001", "t_0999"], "timeout_sec": 5}, "t_0999 not found"),
            ("wait_for", {"task_ids": [], "timeout_sec": 5}, "1 to 100 tasks"),
            ("wait_for", {"task_ids": ["t_0001"], "timeout_sec": 0}, "timeout_sec must be ≥ 1"),
            ("wait_for", {"task_ids": ["t_0001"], "timeout_sec": 3601}, "timeout_sec must be ≤ 3600"),
            ("wait_for", {"task_ids": ["t_0001"], "mode": "some"}, "mode must be one of"),
            ("list_tasks", {"status": "finished"}, "'finished'"),
            ("list_tasks", {"limit": 201}, "limit must be ≤ 200"),
            ("list_tasks", {"offset": -1}, "offset must be ≥ 0"),
            ("clear_finished", {"statuses": ["pending"]}, "statuses.0 must be one of"),
            ("submit_batch", {"tasks": []}, "1 to 20 tasks"),
            ("submit_batch", {"tasks": "not json"}, "tasks must be a list"),
            ("submit_batch", {"tasks": ["not json"]}, "a task must be an object"),
            ("nonexistent_tool", {}, "Unknown tool"),
        ]
        for tool, args, needle in cases:
            assert needle in await tool_error(c, tool, args), (tool, args)
    assert task_store.counts()["pending"] == 1 and len(task_store.get_task(1)["notes"]) == 0


async def test_a_batch_of_21_is_refused_and_nothing_is_written(mode, wd):
    async with client(mode) as c:
        text = await tool_error(c, "submit_batch", {"tasks": [task_args(wd, title=f"t{i}") for i in range(21)]})
    assert "1 to 20" in text and "got 21" in text
    assert sum(task_store.counts().values()) == 0


async def test_a_batch_with_one_bad_item_or_a_cycle_writes_nothing(mode, wd):
    async with client(mode) as c:
        bad_item = [task_args(wd), task_args(wd), task_args(wd, working_dir="rel")]
        assert "task 2 of the batch" in await tool_error(c, "submit_batch", {"tasks": bad_item})
        cycle = [task_args(wd, ref="@a", depends_on=["@c"]), task_args(wd, ref="@b", depends_on=["@a"]),
                 task_args(wd, ref="@c", depends_on=["@b"])]
        assert "dependency cycle refused" in await tool_error(c, "submit_batch", {"tasks": cycle})
        own = [task_args(wd, ref="@a", depends_on=["@a"])]
        assert "depends on itself" in await tool_error(c, "submit_batch", {"tasks": own})
    assert sum(task_store.counts().values()) == 0


async def test_a_crash_inside_a_tool_is_logged_not_leaked(monkeypatch, caplog):
    def broken():
        raise RuntimeError("secret internals /etc/shadow")
    monkeypatch.setattr(task_store, "queue_summary", broken)
    async with client("legacy") as c:
        text = await tool_error(c, "queue_status", {})
    assert "internal error (RuntimeError)" in text and "secret" not in text
    assert "secret internals" in caplog.text


# ---------------------------------------------------------------------------------------------
# A broken database: every tool that reads the queue names the file and the way out.


def break_database(kind: str, tmp_path: Path, monkeypatch) -> str:
    """Make the queue database unusable; returns the text the error must name."""
    path = tmp_path / "broken.db"
    if kind == "corrupt":
        path.write_bytes(b"this is not a SQLite file\n" * 200)
    elif kind == "directory":
        path.mkdir()
    else:   # read-only: tests may run as root, whom file modes do not stop, so SQLite's error is played
        def readonly(*args, **kwargs):
            raise sqlite3.OperationalError("attempt to write a readonly database")
        monkeypatch.setattr(task_store, "connect", readonly)
    monkeypatch.setenv("TASK_DB_PATH", str(path))
    return str(path)


DB_TOOLS = [
    ("submit_task", None), ("submit_batch", None), ("get_task", {"task_id": 1}),
    ("get_task_result", {"task_id": 1}), ("get_task_logs", {"task_id": 1}),
    ("wait_for", {"task_ids": [1], "timeout_sec": 1}), ("answer_task", {"task_id": 1, "answer": "yes"}),
    ("list_tasks", {}), ("queue_status", {}), ("add_task_note", {"task_id": 1, "text": "hi"}),
    ("cancel_task", {"task_id": 1}), ("clear_finished", {}), ("ping", {}), ("list_models", {}),
    ("set_default_model", {"model": "fake/model"}),
]
WAY_OUT = {"corrupt": "restore it from a backup", "directory": "must name a file (not a folder)",
           "readonly": "fix the permissions"}


@pytest.mark.parametrize("kind", ["corrupt", "directory", "readonly"])
async def test_a_broken_database_is_named_with_the_way_out_by_every_tool(kind, wd, tmp_path, monkeypatch,
                                                                         fake_opencode):
    path = break_database(kind, tmp_path, monkeypatch)
    async with client("legacy") as c:
        for tool, args in DB_TOOLS:
            args = {"tasks": [task_args(wd)]} if tool == "submit_batch" else task_args(wd) if args is None else args
            text = await tool_error(c, tool, args)
            assert f"the task database {path} cannot be used" in text, (tool, text)
            assert WAY_OUT[kind] in text and "TASK_DB_PATH" in text, (tool, text)
            assert "internal error" not in text and "arguments" not in text, (tool, text)
        assert not (await c.call_tool("worker_heartbeat", {})).is_error     # needs no database


# ---------------------------------------------------------------------------------------------
# Odd numbers and NUL characters never reach the client as an internal error.


ODD_NUMBERS = [10**23, -(10**23), 2**63, 2**63 - 1, 10**400, "99999999999999999999999", "9" * 5000, -1, 0,
               1.5, 1e300, -1e300, "1e3", "0x10", " 7 ", True, [], {}, "", "null", None]


def numeric_fields(schema: dict) -> list[str]:
    def numeric(prop: dict) -> bool:
        kinds = [prop.get("type")] + [p.get("type") for p in prop.get("anyOf", [])]
        return any(k in ("integer", "number") for k in kinds) or (
            prop.get("type") == "array" and numeric(prop.get("items", {})))
    # Task ids are advertised as strings (the form every client takes) but also accept numbers.
    return [name for name, prop in schema.get("properties", {}).items()
            if numeric(prop) or name in ("task_id", "task_ids", "depends_on")]


def base_args(tool: str, wd: str) -> dict:
    return {
        "submit_task": task_args(wd),
        "submit_batch": {"tasks": [task_args(wd)]},
        "answer_task": {"task_id": 1, "answer": "yes"},
        "add_task_note": {"task_id": 1, "text": "hi"},
        "set_default_model": {"model": "fake/model"},
    }.get(
        tool,
        {"task_id": 1}
        if tool.startswith(("get_", "cancel"))
        else {"task_ids": [1], "timeout_sec": 1}
        if tool == "wait_for"
        else {},
    )


def assert_clear(result, tool: str, args: dict) -> None:
    if result.is_error:
        text = result.content[0].text
        assert "internal error" not in text and "Error executing tool" not in text, (tool, args, text)
        assert "\n" not in text and "pydantic" not in text, (tool, args, text)


async def test_every_numeric_argument_of_every_tool_refuses_odd_numbers_clearly(wd, fake_opencode, monkeypatch):
    task_store.submit_task(title="one", instructions="x", working_dir=wd)
    finish("t_0001")                  # wait_for([1]) returns at once; other ids wait timeout_sec=1 at most
    async with client("legacy") as c:
        tools = (await c.list_tools()).tools
        fields = {t.name: numeric_fields(t.input_schema) for t in tools if t.name != "restart_worker"}
        assert fields["get_task"] == ["task_id"] and "offset" in fields["list_tasks"]
        assert set(fields["get_task_logs"]) == {"task_id", "tail_lines", "offset", "max_bytes"}
        for tool, names in fields.items():
            for name in names:
                for value in ODD_NUMBERS:
                    args = base_args(tool, wd) | {name: value}
                    result = await c.call_tool(tool, args)
                    assert_clear(result, tool, args)
                    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63 - 1:
                        assert result.is_error, (tool, name, value)
        batch_fields = ["priority", "timeout_sec", "max_retries", "depends_on"]
        for name in batch_fields:
            for value in ODD_NUMBERS:
                args = {"tasks": [task_args(wd, **{name: [value] if name == "depends_on" else value})]}
                assert_clear(await c.call_tool("submit_batch", args), "submit_batch", args)


@pytest.mark.parametrize("tool,field", [
    ("submit_task", "title"), ("submit_task", "instructions"), ("submit_task", "working_dir"),
    ("submit_task", "model"), ("submit_task", "agent"), ("submit_task", "idempotency_key"),
    ("submit_batch", "tasks.0.title"), ("submit_batch", "tasks.0.working_dir"), ("answer_task", "answer"),
    ("add_task_note", "text"), ("cancel_task", "reason"), ("get_task", "task_id"), ("list_tasks", "search"),
    ("list_tasks", "origin"), ("list_models", "provider"), ("list_models", "search"),
    ("set_default_model", "model"), ("wait_for", "task_ids.0"),
])
async def test_a_nul_character_in_any_text_is_refused_naming_the_field(tool, field, wd, fake_opencode):
    args = base_args(tool, wd)
    if field == "task_ids.0":
        args["task_ids"] = ["t_00\x001"]
    elif field.startswith("tasks.0."):
        args["tasks"][0][field.split(".")[-1]] = wd + "/a\x00b"
    else:
        args[field] = (wd if field == "working_dir" else "x") + "\x00y"
    async with client("legacy") as c:
        text = await tool_error(c, tool, args)
    assert f"{field} contains a NUL character" in text and "internal error" not in text
    assert sum(task_store.counts().values()) == 0


# ---------------------------------------------------------------------------------------------
# wait_for.


async def test_wait_for_reports_the_event_of_a_change_that_lands_between_its_reads(wd, monkeypatch):
    """A task finishing between wait_for's events read and its statuses read: the answer says
    done and carries the done event too (it used to carry only the claim)."""
    async with client() as c:
        task = await call_tool(c, "submit_task", task_args(wd, title="racy"))
        real, calls = task_store.statuses_of, []

        def statuses_with_a_commit_landing_first(ids):
            calls.append(1)
            if len(calls) == 2:          # the read after the claim's event: the finish lands now
                claimed = task_store.get_task(task["id"])
                task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"},
                                            diff="", usage={"tokens": {"input": 1, "output": 1}, "cost_usd": 0})
            return real(ids)

        monkeypatch.setattr(task_store, "statuses_of", statuses_with_a_commit_landing_first)
        threading.Timer(0.3, task_store.claim_next, args=("test-worker",), kwargs={"task_id": task["id"]}).start()
        waited = await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 10})
    assert waited["tasks"][0]["status"] == "done"
    assert [e["kind"] for e in waited["events"]] == ["claimed", "done"]


async def test_wait_for_any_returns_when_one_task_finishes(mode, wd):
    async with client(mode) as c:
        a = await call_tool(c, "submit_task", task_args(wd, title="a"))
        b = await call_tool(c, "submit_task", task_args(wd, title="b"))
        timer = threading.Timer(0.5, finish, args=(b["id"],))
        timer.start()
        started = time.monotonic()
        waited = await call_tool(c, "wait_for", {"task_ids": [a["id"], b["id"]], "timeout_sec": 30})
        elapsed = time.monotonic() - started
    timer.join()
    assert 0.4 < elapsed < 3, elapsed
    assert waited["met"] is True and waited["timed_out"] is False and waited["ready"] == [b["id"]]
    assert {t["id"]: t["status"] for t in waited["tasks"]} == {a["id"]: "pending", b["id"]: "done"}
    assert waited["unfinished"] == [a["id"]] and "get_task_result" in waited["hint"]
    assert [e["kind"] for e in waited["events"]] == ["claimed", "done"]


async def test_wait_for_all_waits_for_every_task(mode, wd):
    async with client(mode) as c:
        a = await call_tool(c, "submit_task", task_args(wd, title="a"))
        b = await call_tool(c, "submit_task", task_args(wd, title="b"))
        finish(a["id"])
        timer = threading.Timer(0.6, finish, args=(b["id"], "failed"))
        timer.start()
        started = time.monotonic()
        waited = await call_tool(c, "wait_for", {"task_ids": [a["id"], b["id"]], "timeout_sec": 30, "mode": "all"})
    timer.join()
    assert time.monotonic() - started > 0.5
    assert waited["met"] and sorted(waited["ready"]) == [a["id"], b["id"]] and waited["unfinished"] == []
    assert [t["status"] for t in waited["tasks"]] == ["done", "failed"]


async def test_wait_for_returns_for_a_waiting_task_even_in_all_mode(mode, wd):
    async with client(mode) as c:
        a = await call_tool(c, "submit_task", task_args(wd, title="a"))
        b = await call_tool(c, "submit_task", task_args(wd, title="b"))
        timer = threading.Timer(0.3, finish, args=(b["id"], "waiting"))
        timer.start()
        waited = await call_tool(c, "wait_for", {"task_ids": [a["id"], b["id"]], "timeout_sec": 30, "mode": "all"})
        timer.join()
        assert waited["met"] and waited["waiting"] == [b["id"]] and "answer_task" in waited["hint"]
        assert waited["tasks"][1]["question"] == "Which license?"
        answered = await call_tool(c, "answer_task", {"task_id": b["id"], "answer": "MIT"})
    assert answered["status"] == "pending" and answered["answer"] == "MIT"
    assert task_store.get_task(b["id"])["questions"][0]["answer"] == "MIT"


async def test_wait_for_times_out_with_every_status_and_reports_progress(mode, wd, monkeypatch):
    monkeypatch.setattr(bridge, "PROGRESS_EVERY_SEC", 0.3)
    progress: list[tuple] = []

    async def on_progress(value, total, message):
        progress.append((value, total, message))

    async with client(mode) as c:
        a = await call_tool(c, "submit_task", task_args(wd))
        started = time.monotonic()
        waited = await call_tool(
            c, "wait_for", {"task_ids": [a["id"]], "timeout_sec": 2}, progress_callback=on_progress
        )
    assert 1.9 < time.monotonic() - started < 4
    assert waited["timed_out"] is True and waited["met"] is False and waited["tasks"][0]["status"] == "pending"
    assert len(progress) >= 4, progress
    assert all(total == 2 for _, total, _ in progress)
    assert [v for v, _, _ in progress] == sorted(v for v, _, _ in progress)
    assert "t_0001 pending" in progress[-1][2]


# ---------------------------------------------------------------------------------------------
# Results, logs, caps.


async def test_get_task_result_reads_an_earlier_attempts_receipt_that_a_retry_kept(mode, wd):
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        claimed = task_store.claim_next("w")
        task_store.fail_attempt(task["id"], claimed["run_marker"], "no", retryable=False,
                                result={"files_touched": ["A.txt"]}, diff="+A\n")
        await call_tool(c, "retry_task", {"task_id": task["id"]})
        again = task_store.claim_next("w")
        task_store.complete_attempt(task["id"], again["run_marker"], result={"files_touched": ["B.txt"]}, diff="+B\n")
        last = await call_tool(c, "get_task_result", {"task_id": task["id"]})
        earlier = await call_tool(c, "get_task_result", {"task_id": task["id"], "attempt": "a1"})
        missing = await tool_error(c, "get_task_result", {"task_id": task["id"], "attempt": "a7"})
    assert (last["diff"], last["attempt"], [e["attempt"] for e in last["earlier_attempts"]]) == \
        ("+B\n", None, [claimed["run_marker"]])
    assert "get_task_result(attempt=...)" in last["hint"]
    assert (earlier["diff"], earlier["attempt"], earlier["result"]["files_touched"]) == \
        ("+A\n", claimed["run_marker"], ["A.txt"])
    assert f"keeps no earlier attempt 'a7'; it keeps: {claimed['run_marker']}" in missing


async def test_get_task_result_pages_a_big_diff_without_splitting_characters(mode, wd):
    diff = "".join(f"+ línea {i}: 日本語 ✓ 🚀\n" for i in range(6000))  # ~190 KB, multibyte
    receipt = {
        "summary": "wrote it",
        "files_touched": ["a.txt"],
        "commands": [{"command": f"echo {i}"} for i in range(300)],
    }
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        finish(task["id"], diff=diff, result=receipt)
        pages, offset = [], 0
        while offset is not None:
            page = await call_tool(
                c, "get_task_result", {"task_id": task["id"], "diff_offset": offset, "diff_max_bytes": 65536}
            )
            assert len(page["diff"].encode()) <= 65536 and "\ufffd" not in page["diff"]
            pages.append(page)
            offset = page["diff_next_offset"]
        shown = await call_tool(c, "get_task", {"task_id": task["id"]})
        past = await tool_error(c, "get_task_result", {"task_id": task["id"], "diff_offset": 10**7})
    assert "".join(p["diff"] for p in pages) == diff and len(pages) >= -(-len(diff.encode()) // 65530)
    assert all(mcp_shared.result_chars(p) <= mcp_shared.RESULT_CHARS_MAX for p in pages)
    first = pages[0]
    assert first["diff_total_bytes"] == len(diff.encode()) and first["diff_truncated"] is True
    assert first["result"]["summary"] == "wrote it" and len(first["result"]["commands"]) == 100
    assert first["result_truncated"] is True and first["usage"]["cost_usd"] == 0.25
    assert shown["diff_bytes"] == len(diff.encode()) and shown["summary"] == "wrote it"
    assert "past the end of the diff" in past


@pytest.mark.parametrize("end", ["failed", "cancelled"])
async def test_get_task_result_of_a_task_with_no_diff_says_where_its_kept_worktrees_work_is(tmp_path, end):
    """A task failed by the reaper (its worker killed) or cancelled while its worker was dead has
    no diff; its worktree, still on disk, holds its agent's work: the hint says so."""
    from helpers import git, make_repo
    repo = make_repo(tmp_path / "repo")
    tree = tmp_path / "worktrees" / "t_0001"
    git(repo, "worktree", "add", "-q", "-b", "taskbridge/t_0001", str(tree))
    (tree / "new.txt").write_text("the agent's\n")
    task = task_store.submit_task(title="killed", instructions="x", working_dir=str(repo))
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=str(tree), branch="taskbridge/t_0001")
    if end == "failed":
        task_store.fail_attempt(task["id"], claimed["run_marker"], "its worker died", retryable=False)
    else:
        task_store.cancel_task(task["id"])
    async with client("legacy") as c:
        result = await call_tool(c, "get_task_result", {"task_id": task["id"]})
        assert result["diff"] == "" and f"no diff was recorded, but its worktree {tree} is still on disk as its " \
            "run left it" in result["hint"], result["hint"]


def write_big_log(task_id: str) -> bytes:
    line = "{\"type\":\"text\",\"part\":{\"text\":\"żółć 日本語 🚀 — %06d\"}}\n"
    data = "".join(line % i for i in range(5 * 1024 * 1024 // len((line % 0).encode()) + 1)).encode()
    task_store.append_task_log(task_id, data)   # the file on SQLite, the database on PostgreSQL
    assert len(data) >= 5 * 1024 * 1024
    return data


async def test_a_5_mb_log_is_capped_tailed_and_paged_without_splitting_utf8(wd):
    async with client("legacy") as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        data = write_big_log(task["id"])
        tail = await call_tool(c, "get_task_logs", {"task_id": task["id"], "tail_lines": 5})
        assert tail["text"].count("\n") == 5 and tail["text"].endswith("\n")
        assert tail["next_offset"] == tail["size"] == len(data) and tail["truncated"] is False
        assert data[tail["offset"]:].decode() == tail["text"]
        capped = await call_tool(c, "get_task_logs", {"task_id": task["id"], "tail_lines": 5000})
        assert len(capped["text"].encode()) <= 65536 and capped["truncated"] is True
        assert "\ufffd" not in capped["text"] and capped["text"].startswith("{")
        mid = await call_tool(c, "get_task_logs", {"task_id": task["id"], "offset": 47, "max_bytes": 1000})
        assert "\ufffd" not in mid["text"] and mid["offset"] >= 47
        assert data[mid["offset"]:mid["next_offset"]].decode() == mid["text"]
        pieces, offset, calls = [], 0, 0
        while True:
            page = await call_tool(c, "get_task_logs", {"task_id": task["id"], "offset": offset})
            assert len(page["text"].encode()) <= 65536 and "\ufffd" not in page["text"]
            pieces.append(page["text"])
            offset, calls = page["next_offset"], calls + 1
            if not page["truncated"]:
                break
        assert "".join(pieces).encode() == data and calls <= len(data) // (bridge.LOG_PAGE_DEFAULT - 4) + 1
        end = await call_tool(c, "get_task_logs", {"task_id": task["id"], "offset": len(data)})
        assert end["text"] == "" and end["truncated"] is False
        assert "past the end of the log" in await tool_error(
            c, "get_task_logs", {"task_id": task["id"], "offset": len(data) + 1}
        )


async def test_logs_of_a_task_that_has_not_started(mode, wd):
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        page = await call_tool(c, "get_task_logs", {"task_id": task["id"]})
    assert page["exists"] is False and page["text"] == "" and page["path"] == task_store.task_log_location(task["id"])
    assert task_store.backend() != "sqlite" or page["path"].endswith("t_0001.log")


def seed(count: int, wd: str) -> None:
    for start in range(0, count, 20):
        task_store.submit_batch([{"title": f"task {start + i} ✓", "instructions": "x", "working_dir": wd,
                                  "origin_name": "claude-ai"} for i in range(min(20, count - start))])


async def test_a_5000_task_list_is_capped_and_paged(wd):
    seed(5000, wd)
    async with client("legacy") as c:
        assert "limit must be ≤ 200" in await tool_error(c, "list_tasks", {"limit": 5000})
        seen, offset, calls = [], 0, 0
        while offset is not None:
            page = await call_tool(c, "list_tasks", {"limit": 200, "offset": offset})
            assert len(page["tasks"]) <= 200 and page["total"] == 5000
            assert mcp_shared.result_chars(page) <= mcp_shared.RESULT_CHARS_MAX
            seen += [t["id"] for t in page["tasks"]]
            offset, calls = page["next_offset"], calls + 1
        default = await call_tool(c, "list_tasks")
        found = await call_tool(c, "list_tasks", {"search": "task 4999 ✓"})
    assert calls >= 25 and len(seen) == len(set(seen)) == 5000      # pages shrink to stay under the budget
    assert len(default["tasks"]) == 20 and default["next_offset"] == 20 and "offset=20" in default["hint"]
    assert [t["id"] for t in found["tasks"]] == ["t_5000"]


async def test_list_rows_cut_long_errors(mode, wd):
    async with client(mode) as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        await call_tool(c, "cancel_task", {"task_id": task["id"], "reason": "é" * 5000})
        row = (await call_tool(c, "list_tasks"))["tasks"][0]
    assert row["status"] == "cancelled" and len(row["error"]) == bridge.ROW_TEXT_MAX


# ---------------------------------------------------------------------------------------------
# Notes, cancel, clear.


async def test_notes_cancel_and_dependents(mode, wd):
    async with client(mode) as c:
        base = await call_tool(c, "submit_task", task_args(wd, title="base"))
        child = await call_tool(c, "submit_task", task_args(wd, title="child", depends_on=[base["id"]]))
        note = await call_tool(c, "add_task_note", {"task_id": base["id"], "text": "use tabs"})
        assert note == {"task_id": base["id"], "status": "pending", "delivery": "the agent's next prompt"}
        cancelled = await call_tool(c, "cancel_task", {"task_id": base["id"]})
        assert cancelled["status"] == "cancelled"
        assert (await call_tool(c, "get_task", {"task_id": child["id"]}))[
            "error"
        ] == f"dependency {base['id']} cancelled"
        assert "already cancelled" in await tool_error(c, "cancel_task", {"task_id": base["id"]})
        assert "is cancelled" in await tool_error(c, "add_task_note", {"task_id": base["id"], "text": "late"})


async def test_clear_finished_removes_finished_tasks_and_asked_for_logs(mode, wd):
    async with client(mode) as c:
        done = await call_tool(c, "submit_task", task_args(wd, title="done"))
        keep = await call_tool(c, "submit_task", task_args(wd, title="pending"))
        finish(done["id"])
        task_store.log_path(done["id"]).parent.mkdir(parents=True, exist_ok=True)
        task_store.log_path(done["id"]).write_text("log\n")
        nothing = await call_tool(c, "clear_finished", {"older_than_sec": 3600})
        assert nothing["count"] == 0
        cleared = await call_tool(c, "clear_finished", {"statuses": '["done"]', "remove_logs": "true"})
        assert cleared["removed"] == [done["id"]] and cleared["logs_removed"] == 1
        assert not task_store.log_path(done["id"]).exists()
        assert "t_0001 not found" in await tool_error(c, "get_task", {"task_id": done["id"]})
        assert (await call_tool(c, "get_task", {"task_id": keep["id"]}))["status"] == "pending"
        assert cleared["kept_for_dependents"] == {}
        finish(keep["id"], branch=f"taskbridge/{keep['id']}")
        follow = await call_tool(c, "submit_task", {"title": "next", "instructions": "more",
                                                    "continue_from": keep["id"]})
        kept = await call_tool(c, "clear_finished", {})
        assert kept["count"] == 0 and kept["kept_for_dependents"] == {keep["id"]: [follow["id"]]}


async def test_clear_finished_removes_the_folders_its_tasks_worktrees_were_set_aside_to(tmp_path):
    task = task_store.submit_task(title="retried", instructions="x", working_dir=str(tmp_path))
    claimed = task_store.claim_next("w", task_id=task["id"])
    aside = tmp_path / "worktrees" / "left" / f"{task['id']}-1"   # as worktrees.set_aside leaves it
    (aside / "sub").mkdir(parents=True)
    (aside / "sub" / "work.txt").write_text("an earlier attempt's\n")
    task_store.record_leftover(task["id"], claimed["run_marker"], str(aside))
    task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})
    async with client("legacy") as c:
        cleared = await call_tool(c, "clear_finished", {})
    assert cleared["removed"] == [task["id"]] and cleared["leftovers_removed"] == [str(aside)]
    assert cleared["problems"] == [] and not aside.exists()


async def test_clear_finished_removes_a_kept_worktree_but_not_its_branch(tmp_path):
    from helpers import git, make_repo
    repo = make_repo(tmp_path / "repo")
    tree = tmp_path / "worktrees" / "t_0001"
    git(repo, "worktree", "add", "-q", "-b", "taskbridge/t_0001", str(tree))
    task = task_store.submit_task(title="kept", instructions="x", working_dir=str(repo))
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=str(tree), branch="taskbridge/t_0001")
    task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})
    async with client("legacy") as c:
        kept = await call_tool(c, "clear_finished", {})
        assert kept["removed"] == [] and kept["kept_for_worktrees"] == [task["id"]], (
            "the queue still knows the worktree"
        )
        cleared = await call_tool(c, "clear_finished", {"remove_worktrees": True})
    assert cleared["removed"] == [task["id"]] and cleared["kept_for_worktrees"] == []
    assert cleared["worktrees_removed"] == [str(tree)] and cleared["problems"] == []
    assert not tree.exists() and "taskbridge/t_0001" in git(repo, "branch", "--list")


# ---------------------------------------------------------------------------------------------
# Queue and worker.


async def test_queue_status_and_worker_heartbeat(mode, wd):
    async with client(mode) as c:
        status = await call_tool(c, "queue_status")
        assert status["worker"]["seen"] is False and "worker.py" in status["worker"]["summary"]
        await call_tool(c, "submit_task", task_args(wd))
        task_store.write_worker_heartbeat({"task": "t_0001", "state": "running"})
        status = await call_tool(c, "queue_status")
        beat = await call_tool(c, "worker_heartbeat")
    assert status["counts"]["pending"] == 1 and status["total"] == 1 and status["claimable"] == 1
    assert status["oldest_pending"] == "t_0001" and status["oldest_pending_age_sec"] >= 0
    assert status["default_model"] is None   # no setting, no WORKER_MODEL, OpenCode not asked yet
    assert beat["seen"] and beat["pid"] == os.getpid() and beat["pid_running"] is True
    assert beat["recent"] and beat["state"] == "running" and beat["task"] == "t_0001"
    assert "t_0001" in beat["summary"] and beat["age_sec"] < 60


async def test_restart_worker_kickstarts_launchd_when_the_agent_is_loaded(tmp_path, monkeypatch):
    """launchctl is a fake binary first on PATH (this is Linux); it records its arguments."""
    calls = tmp_path / "calls"
    fake_binary(tmp_path / "bin", "launchctl", f'echo "$@" >> {calls}\nexit 0\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    async with client("legacy") as c:
        done = await call_tool(c, "restart_worker")
    target = f"gui/{os.getuid()}/com.taskbridge.worker"
    assert done["method"] == "launchctl" and done["command"][1:] == ["kickstart", "-k", target]
    assert calls.read_text().splitlines() == [f"print {target}", f"kickstart -k {target}"]


async def test_restart_worker_restarts_the_systemd_unit_when_installed(tmp_path, monkeypatch):
    """systemctl is a fake binary first on PATH that knows the unit; no launchctl is on PATH."""
    calls = tmp_path / "calls"
    fake_binary(tmp_path / "bin", "systemctl", f'echo "$@" >> {calls}\nexit 0\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    async with client("auto") as c:
        done = await call_tool(c, "restart_worker")
    assert done["method"] == "systemctl" and "taskbridge-worker.service" in done["detail"]
    assert calls.read_text().splitlines() == ["--user cat taskbridge-worker.service",
                                              "--user restart taskbridge-worker.service"]


async def test_restart_worker_reports_a_refusing_service_manager(tmp_path, monkeypatch):
    """A fake systemctl whose restart fails: the tool says so instead of claiming success."""
    fake_binary(
        tmp_path / "bin", "systemctl", 'case "$2" in cat) exit 0;; *) echo "Access denied" >&2; exit 1;; esac\n'
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    async with client("legacy") as c:
        text = await tool_error(c, "restart_worker", {})
    assert "systemctl --user restart" in text and "Access denied" in text


async def test_restart_worker_starts_a_detached_pass_otherwise(tmp_path, monkeypatch):
    """A fake systemctl that does not know the unit; the real worker.py runs one pass on the empty
    test queue, detached, its output in the log folder (never the server's stdout)."""
    if not (bridge.REPO_DIR / "worker.py").exists():
        pytest.skip("worker.py is not written yet")
    fake_binary(tmp_path / "bin", "systemctl", "exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    async with client("legacy") as c:
        done = await call_tool(c, "restart_worker")
    assert done["method"] == "detached" and done["pid"] > 0 and done["command"][-1].endswith("worker.py")
    import psutil
    if psutil.pid_exists(done["pid"]):
        psutil.Process(done["pid"]).wait(timeout=60)
    beat = task_store.read_worker_heartbeat()
    assert beat is not None and beat["pid"] == done["pid"]     # the pass ran against this queue
    assert (task_store.log_dir() / "worker-restart.log").exists()


# ---------------------------------------------------------------------------------------------
# Models.

MODELS_OUT = """opencode/cat-jam-free
{
  "name": "Cat Jam (free)",
  "cost": {"input": 0, "output": 0},
  "limit": {"context": 200000, "output": 32000}
}
fake/model
{
  "name": "Fake",
  "cost": {"input": 1.0, "output": 2.0, "cache_read": 0.1, "cache_write": 1.25},
  "limit": {"context": 128000, "output": 8192}
}
other/model
{
  "name": "Other",
  "limit": {"context": 8000, "output": 1000}
}
"""


@pytest.fixture
def fake_opencode(tmp_path, monkeypatch):
    """OPENCODE_BIN points at a fake `opencode models --verbose` (the real one is exercised in
    the end-to-end test); an unknown provider fails as OpenCode does. Its list lies beside it:
    TaskBridge asks OpenCode in a box, which shows the binary's folder and not the test's."""
    binary = fake_binary(tmp_path / "oc", "opencode",
                      'if [ "$1" = "debug" ]; then echo \'{"model": "other/model"}\'; exit 0; fi\n'
                      'if [ "$2" = "nope" ]; then echo "Error: Provider not found: nope" >&2; exit 1; fi\n'
                      'cat "$(dirname "$0")/models.txt"\n')
    (tmp_path / "oc" / "models.txt").write_text(MODELS_OUT)
    monkeypatch.setenv("OPENCODE_BIN", str(binary))
    return binary


async def test_list_models_search_paging_and_resolution(mode, fake_opencode):
    async with client(mode) as c:
        everything = await call_tool(c, "list_models")
        assert [m["id"] for m in everything["models"]] == ["opencode/cat-jam-free", "fake/model", "other/model"]
        fake = everything["models"][1]
        assert fake["cost"]["output"] == 2.0 and fake["context"] == 128000 and fake["output_limit"] == 8192
        assert (await call_tool(c, "list_models", {"search": "CAT jam"}))["resolved"] is None
        found = await call_tool(c, "list_models", {"search": "cat-jam-free"})
        assert found["total"] == 1 and found["resolved"] == "opencode/cat-jam-free"
        paged = await call_tool(c, "list_models", {"limit": 2})
        assert len(paged["models"]) == 2 and paged["next_offset"] == 2 and paged["total"] == 3
        assert "Provider not found: nope" in await tool_error(c, "list_models", {"provider": "nope"})


@pytest.mark.parametrize("provider", ["-m", "--refresh", "-", " -h", "open ai", "a/b", "x" * 101])
async def test_a_provider_that_is_not_a_provider_id_never_reaches_opencodes_command_line(provider, fake_opencode,
                                                                                         monkeypatch):
    """``opencode models -m`` printed OpenCode's help as the error: a value given as the positional
    PROVIDER was read as an option. The MCP tool and the CLI refuse it before OpenCode runs."""
    ran: list[list[str]] = []
    real_run = subprocess.run
    monkeypatch.setattr(opencode_runner.subprocess, "run",
                        lambda argv, *a, **kw: ran.append(argv) or real_run(argv, *a, **kw))
    async with client() as c:
        said = await tool_error(c, "list_models", {"provider": provider})
    shown = task_store.shown_value(provider)
    assert said.startswith(f"provider {shown} is not a provider id") and "such as openai" in said, said
    cli = CliRunner().invoke(tasks_cli.cli, ["models", f"--provider={provider}"])
    assert cli.exit_code == 1 and "is not a provider id" in cli.output and "Traceback" not in cli.output, cli.output
    assert not [argv for argv in ran if "models" in argv], ran
    with pytest.raises(task_store.ValidationError, match="not a provider id"):
        opencode_runner.list_models(provider)
    assert [m["id"] for m in opencode_runner.list_models(" fake ")] == ["opencode/cat-jam-free", "fake/model",
                                                                        "other/model"]


async def test_set_default_model_validates_resolves_and_persists(mode, fake_opencode, wd):
    async with client(mode) as c:
        ambiguous = await tool_error(c, "set_default_model", {"model": "model"})
        assert "ambiguous" in ambiguous and "fake/model" in ambiguous and "other/model" in ambiguous
        assert "similar: opencode/cat-jam-free" in await tool_error(c, "set_default_model", {"model": "cat-jam"})
        assert "not offered" in await tool_error(c, "set_default_model", {"model": "nobody/nothing"})
        chosen = await call_tool(c, "set_default_model", {"model": "cat-jam-free"})
        # Before any setting the default is the user's OpenCode config's model.
        assert chosen == {"model": "opencode/cat-jam-free", "previous": "other/model",
                          "resolved_from": "cat-jam-free"}
        chosen = await call_tool(c, "set_default_model", {"model": "fake/model"})
        assert chosen["resolved_from"] is None and task_store.default_model() == "fake/model"
        assert (await call_tool(c, "queue_status"))["default_model"] == "fake/model"
        task = await call_tool(c, "submit_task", task_args(wd, model="cat-jam-free"))
        assert task["model"] == "opencode/cat-jam-free"
        assert "ambiguous" in await tool_error(c, "submit_task", task_args(wd, model="model"))
        refused = await tool_error(c, "submit_task", task_args(wd, model="fake/modle"))
        assert "'fake/modle' is not offered by OpenCode" in refused and "similar: fake/model" in refused
        batch = [task_args(wd), task_args(wd, model="othr/model")]
        assert "similar: other/model" in await tool_error(c, "submit_batch", {"tasks": batch})
    assert task_store.get_setting("default_model") == "fake/model"
    assert task_store.counts()["pending"] == 1      # the refused ones wrote nothing


async def test_list_models_without_opencode_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv("OPENCODE_BIN", "/nonexistent/opencode")
    async with client("legacy") as c:
        text = await tool_error(c, "list_models", {})
    assert "not found" in text and "OPENCODE_BIN" in text


# ---------------------------------------------------------------------------------------------
# Pure helpers.


@pytest.mark.parametrize("raw,seconds", [("", 0.2), ("0.5", 0.5), ("0.01", 0.01), ("5", 5.0)])
def test_the_wait_poll_interval_is_read_in_its_range(raw, seconds, monkeypatch):
    monkeypatch.setenv("MCP_WAIT_POLL_SEC", raw)
    assert bridge._poll_sec() == seconds


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 7, 64])
def test_page_utf8_never_splits_a_character(limit):
    text = "aé日🚀" * 50
    data = text.encode()
    for offset in range(0, len(data)):
        page, start, end = bridge.page_utf8(data, offset, limit)
        assert "\ufffd" not in page and start >= offset and end <= len(data)
        assert data[start:end].decode() == page
        assert end > start or start == len(data)
        assert end - start <= max(limit, 4)


def test_host_names_are_normalised():
    assert bridge.host_name("ABC.ngrok-free.app:443") == "abc.ngrok-free.app"
    assert bridge.host_name("https://Tunnel.example.com/mcp") == "tunnel.example.com"
    assert bridge.host_name("[::1]:8765") == "[::1]" and bridge.host_name("::1") == "[::1]"
    assert bridge.host_name("localhost.") == "localhost"
    assert bridge.host_name("localhost:evil.com") is None and bridge.host_name("a@b") is None


@pytest.mark.parametrize("header,parsed", [
    ("localhost", ("localhost", None)), ("LOCALHOST.:8765", ("localhost", "8765")),
    ("127.0.0.1:80", ("127.0.0.1", "80")), ("[::1]:8765", ("[::1]", "8765")), ("[::1]", ("[::1]", None)),
    ("abc.ngrok-free.app:443", ("abc.ngrok-free.app", "443")),
    ("localhost:evil.com", None), ("127.0.0.1:1@evil.com", None), ("localhost:1@evil.com", None),
    ("localhost:", None), ("localhost:99999", None), ("localhost:80:80", None), ("localhost:+80", None),
    ("user@localhost", None), ("localhost/x", None), ("local host", None), ("", None), ("[::1]:x", None),
    ("::1", None), ("[evil.com]", None), ("localhost:٨٠", None), ("-localhost", None),
])
def test_a_host_header_is_a_name_and_an_optional_port_of_digits(header, parsed):
    assert bridge.parse_host(header) == parsed


def test_a_malformed_allowed_hosts_entry_is_skipped_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("MCP_ALLOWED_HOSTS", "good.example.org, localhost:evil.com ,")
    assert bridge.allowed_hosts() == frozenset(bridge.LOOPBACK_NAMES) | {"good.example.org"}
    assert "'localhost:evil.com' is not a host name" in caplog.text


async def test_a_folder_no_task_could_run_in_is_refused_at_submit(tmp_path):
    """A bare repository and a repository with no commits were queued and failed at their claim
    (found by a fresh user); the worker's own reason now comes at submit, by every entry point."""
    bare, empty = tmp_path / "bare.git", tmp_path / "empty"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    subprocess.run(["git", "init", "-q", str(empty)], check=True)
    async with client() as c:
        assert "bare repository" in await tool_error(c, "submit_task", task_args(str(bare)))
        assert "no commits" in await tool_error(c, "submit_task", task_args(str(empty)))
        (tmp_path / "plain").mkdir()
        batch = await tool_error(c, "submit_batch", {"tasks": [task_args(str(tmp_path / "plain")),
                                                               task_args(str(empty))]})
        assert "task 1 of the batch" in batch and "no commits" in batch
    said = CliRunner().invoke(tasks_cli.cli, ["submit", "T", "--dir", str(empty)])
    assert said.exit_code != 0 and "no commits" in said.output and "Traceback" not in said.output
    assert task_store.counts().get("pending", 0) == 0


async def test_a_folder_its_worktree_would_not_have_is_refused_at_submit(tmp_path):
    """A subfolder git does not track (untracked or ignored) was queued and failed at its run with
    a bare ENOENT inside the worktree, and `show` suggested a retry (found by a new-user test).
    In place (worktree=false) it is the folder itself and runs."""
    repo = tmp_path / "repo"
    (repo / "tracked").mkdir(parents=True)
    (repo / "tracked" / "f.txt").write_text("x\n")
    (repo / "new").mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "tracked"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "i"],
                   check=True)
    new = str(repo / "new")
    async with client() as c:
        said = await tool_error(c, "submit_task", task_args(new))
        assert said.startswith(f"{new} is not in the last commit of {repo}") and "worktree=false" in said
        batch = await tool_error(c, "submit_batch", {"tasks": [task_args(str(repo / "tracked")), task_args(new)]})
        assert batch.startswith("task 1 of the batch: ") and "not in the last commit" in batch
        assert task_store.counts().get("pending", 0) == 0
        in_place = await call_tool(c, "submit_task", task_args(new, worktree=False))
        tracked = await call_tool(c, "submit_task", task_args(str(repo / "tracked")))
        assert in_place["status"] == tracked["status"] == "pending"
    cli = CliRunner().invoke(tasks_cli.cli, ["submit", "T", "--dir", new])
    assert cli.exit_code != 0 and "not in the last commit" in cli.output and "--no-worktree" in cli.output


async def test_a_submit_asks_git_about_its_folder_once(tmp_path, monkeypatch):
    """A submit ran `git rev-parse` three times on one folder (the root, then HEAD to refuse a
    repository with no commits, then the root again for the in-place warning): ~3 ms each, most of
    submit_task's own time. One run now answers all three, by every entry point."""
    real_git = subprocess.run(["sh", "-c", "command -v git"], capture_output=True, text=True).stdout.strip()
    calls = tmp_path / "git-calls"
    fake_binary(tmp_path / "bin", "git", f'echo "$@" >> {calls}\nexec {real_git} "$@"')
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    plain.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "init"], check=True)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")

    def runs() -> int:
        count = len(calls.read_text().splitlines()) if calls.exists() else 0
        calls.unlink(missing_ok=True)
        return count

    async with client() as c:
        in_repo = await call_tool(c, "submit_task", task_args(str(repo)))
        assert runs() == 1 and in_repo["warnings"] == []
        outside = await call_tool(c, "submit_task", task_args(str(plain)))
        assert runs() == 1 and any(f"{plain} is not in a git repository" in w for w in outside["warnings"])
        batch = await call_tool(c, "submit_batch", {"tasks": [task_args(str(repo)), task_args(str(plain))]})
        assert runs() == 2 and [bool(t["warnings"]) for t in batch["tasks"]] == [False, True]
        # A duplicate (the same request again) is the earlier task, with its warning.
        first = await call_tool(c, "submit_task", task_args(str(plain), idempotency_key="k"))
        again = await call_tool(c, "submit_task", task_args(str(plain), idempotency_key="k"))
        assert again["duplicate"] and again["warnings"] == first["warnings"] != []
    runs()
    said = CliRunner().invoke(tasks_cli.cli, ["submit", "T", "--dir", str(plain), "--json"])
    assert said.exit_code == 0 and "is not in a git repository" in said.output and runs() == 1


@pytest.mark.anyio
async def test_a_log_file_the_os_refuses_is_named_not_an_internal_error(wd):
    """A task log the OS will not read (here a folder where the file should be) is named in one
    line with the path, as the CLI names it; it was 'failed with an internal error'."""
    async with client() as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        path = task_store.log_path(task["id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        text = await tool_error(c, "get_task_logs", {"task_id": task["id"]})
    assert "internal error" not in text and str(path) in text, text


# ---------------------------------------------------------------------------------------------
# A tool's answer built once (issue 25).


async def test_a_tool_answer_is_built_once_with_its_text_from_the_same_content(wd, monkeypatch):
    """A registry tool answers a ready result: the structured content redacted once and its one
    text block the indented JSON of that same content (the SDK neither dumps it again nor writes
    a second text), with the output schema it always listed; the bearer token stays redacted."""
    import pydantic_core
    token = "tok-" + "z" * 40
    monkeypatch.setenv("MCP_BEARER_TOKEN", token)
    server = bridge.build_server()
    async with Client(server, mode="legacy") as c:
        await call_tool(c, "submit_task", task_args(wd, title=f"uses {token}"))
        listed = {t.name: t for t in (await c.list_tools()).tools}
        got = await c.call_tool("list_tasks", {"limit": 5})
    direct = await server.call_tool("list_tasks", {"limit": 5})
    assert isinstance(direct, mcp_shared.ShownAnswer)
    assert direct.content[0].text == pydantic_core.to_json(direct.structured_content, indent=2).decode()
    assert got.structured_content == direct.structured_content == json.loads(got.content[0].text)
    assert token not in got.content[0].text and "[redacted: bearer token]" in got.content[0].text
    assert listed["list_tasks"].output_schema["properties"]["tasks"]["items"]["properties"]["title"]


async def test_get_task_reads_its_task_once(wd, monkeypatch):
    """get_task's resource links come from its own answer: the task was read a second time."""
    monkeypatch.setenv("MCP_CHANNEL_PUSH", "0")    # the channel's notice of the end reads it too
    async with client() as c:
        task = await call_tool(c, "submit_task", task_args(wd))
        finish(task["id"])
        reads = []
        real = task_store.get_task
        monkeypatch.setattr(task_store, "get_task", lambda *a, **k: reads.append(a) or real(*a, **k))
        got = await c.call_tool("get_task", {"task_id": task["id"]})
    assert not got.is_error and len(reads) == 1
    kinds = [b.uri.rsplit("/", 1)[-1] for b in got.content if b.type == "resource_link"]
    assert kinds == ["log", "transcript", "diff", "receipt"], kinds


async def test_restart_worker_starts_no_pass_while_one_runs_the_queue(tmp_path, monkeypatch):
    """Without launchd or systemd it starts a detached pass; while another pass holds the queue's
    worker lock, that pass would exit at once, so it says which pass runs and starts nothing
    (it used to answer "started one detached worker pass")."""
    fake_binary(tmp_path / "bin", "systemctl", "exit 1\n")   # no systemd unit installed
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    lock = task_store.take_lock(task_store.worker_lock_path())
    assert lock is not None
    task_store.write_worker_heartbeat({"state": "idle", "task": None, "tasks": [], "slots": 1})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        async with Client(bridge.build_server()) as c:
            said = await call_tool(c, "restart_worker")
    finally:
        os.close(lock)
    assert said["method"] == "already-running" and said["pid"] == os.getpid(), said
    assert "nothing was started" in said["detail"]
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


async def test_an_error_that_echoes_a_huge_argument_is_cut_to_its_head_and_way_out(wd):
    """A refused value was echoed whole: 5 KB of folder name, 100 KB of skill name in one error."""
    cases = [("submit_task", task_args(wd, working_dir=wd + "/" + "a" * 5000), "does not exist"),
             ("submit_task", task_args(wd, skills=["s" * 100_000]), "skill"),
             ("submit_task", task_args(wd, skills=["s"] * 1000), "skill"),
             ("set_default_model", {"model": "q" * 100_000}, "model"),
             ("set_default_model", {"model": " "}, "a model must be named")]
    async with client("legacy") as c:
        for tool, args, needle in cases:
            text = await tool_error(c, tool, args)
            assert needle in text and len(text) <= mcp_shared.ERROR_MAX + 60, (tool, len(text), text[:300])
    assert sum(task_store.counts().values()) == 0


FINITE = "must be a finite number; got"
ODD_FOR_NUMBERS = [(True, "must be a number, not true or false; got True"),
                   (False, "must be a number, not true or false; got False"),
                   (float("inf"), f"{FINITE} inf"), (float("-inf"), f"{FINITE} -inf"), (float("nan"), f"{FINITE} nan"),
                   ("Infinity", f"{FINITE} 'Infinity'"), ("NaN", f"{FINITE} 'NaN'")]


@pytest.mark.parametrize("value,words", ODD_FOR_NUMBERS)
async def test_every_number_argument_refuses_booleans_infinity_and_nan_as_the_wire_delivers_them(value, words, wd,
                                                                                                 fake_opencode):
    """What a transport's JSON parser hands the server (Python's json reads the literal Infinity
    as float('inf'); pydantic's lax mode read true as 1 for an int, and set_budget's daily_usd said
    "NaN" "must be ≤ 1000000.0"). The SDK client turns inf into null before sending, so the server
    is called directly here, as the stdio and HTTP transports call it."""
    task_store.submit_task(title="one", instructions="x", working_dir=wd)
    server = bridge.build_server()
    async with client("legacy") as c:
        schemas = {t.name: t.input_schema for t in (await c.list_tools()).tools if t.name != "restart_worker"}
    checked = 0
    for tool, schema in schemas.items():
        numbers = [name for name, prop in schema.get("properties", {}).items()
                   if ({prop.get("type")} | {p.get("type") for p in prop.get("anyOf", [])}) & {"integer", "number"}]
        for name in numbers:
            with pytest.raises(mcp_shared.ToolError) as refused:
                await server.call_tool(tool, base_args(tool, wd) | {name: value})
            assert f"invalid arguments for {tool}: {name} {words}" in str(refused.value), (tool, name)
            checked += 1
    for name in ("priority", "timeout_sec", "max_retries", "max_cost_usd", "max_tokens", "schedule_timeout_sec"):
        with pytest.raises(mcp_shared.ToolError, match=f"tasks.1.{name} {words}"):
            await server.call_tool("submit_batch", {"tasks": [task_args(wd), task_args(wd, **{name: value})]})
        checked += 1
    assert checked > 25
    assert task_store.budget_state()["daily_usd"] is None
    assert len(task_store.list_tasks()["tasks"]) == 1, "nothing was written"
