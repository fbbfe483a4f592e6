"""What MCP clients other than ours need from both servers (issue 8, sections 8 and 8b), checked
through real SDK clients against the servers as users run them (subprocesses over stdio and
streamable-http):

- every tool, of both servers, is declared in a form every client takes: closed input schemas
  (OpenAI strict mode), no ``"type": [..., "null"]`` or ``anyOf`` null unions (Gemini, Cursor),
  all four behaviour hints (ChatGPT apps); a read-only tool changes nothing in the queue;
- every tool's result, at its defaults and at its maxima, stays under 40,000 characters (Claude
  Code keeps results above ~50,000 out of the model's context), and paged results page on.

The tool lists are read from the servers, so a tool added later is checked without editing this file.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Implementation

import claude_control_mcp as control
import mcp_shared
import opencode_bridge_mcp as bridge
import task_store
from fake_anthropic import FakeAnthropic
from helpers import bridge_process, free_port, wait_healthy
from opencode_env import opencode_env

pytestmark = pytest.mark.anyio

TOKEN = "clients-token-0123456789"
BUDGET = mcp_shared.RESULT_CHARS_MAX
WELL_UNDER = 50_000                      # Claude Code's limit; BUDGET leaves room below it
DESCRIPTION_MAX = 2048                   # Claude Code cuts a tool description there
HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
LONG_MODEL = f"fake/model-000-{'x' * 80}"      # one of many_models()


# ---------------------------------------------------------------------------------------------
# Servers as users run them.


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ, MCP_BEARER_TOKEN=TOKEN, **(extra or {}))


def over_http(url: str, mode: str = "legacy") -> Client:
    transport = streamable_http_client(url, http_client=httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120))
    return Client(transport, mode=mode, client_info=Implementation(name="claude-code", version="2.1.197"))


def over_stdio(script: str, env: dict[str, str], mode: str = "legacy") -> Client:
    params = StdioServerParameters(command=sys.executable, args=[str(bridge.REPO_DIR / script)], env=env)
    return Client(params, mode=mode, client_info=Implementation(name="opencode", version="1.18.33"))


@contextlib.asynccontextmanager
async def connected(which: str, mode: str = "legacy", env: dict[str, str] | None = None) -> AsyncIterator[Client]:
    env = env or server_env()
    if which == "bridge over http":
        with bridge_process(env, log_level="WARNING") as base:
            async with over_http(f"{base}/mcp", mode) as client:
                yield client
    else:
        script = "opencode_bridge_mcp.py" if which == "bridge over stdio" else "claude_control_mcp.py"
        async with over_stdio(script, env, mode) as client:
            yield client


# ---------------------------------------------------------------------------------------------
# Declarations.


def schema_problems(node: Any, where: str = "arguments") -> list[str]:
    """What a strict client would refuse in an input schema: type arrays, null in a union, a
    null default, an object with declared properties that is not closed."""
    problems: list[str] = []
    if isinstance(node, list):
        for index, item in enumerate(node):
            problems += schema_problems(item, f"{where}[{index}]")
        return problems
    if not isinstance(node, dict):
        return problems
    problems += own_schema_problems(node, where)
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions"):
            for name, sub in value.items():
                problems += schema_problems(sub, f"{where}.{name}")
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems", "not"):
            problems += schema_problems(value, f"{where}.{key}")
    return problems


def own_schema_problems(node: dict[str, Any], where: str) -> list[str]:
    """schema_problems of one schema object itself, not of the schemas nested in it."""
    problems: list[str] = []
    if isinstance(node.get("type"), list):
        problems.append(f"{where}: type array {node['type']}")
    if node.get("type") == "null":
        problems.append(f"{where}: type null")
    for key in ("anyOf", "oneOf"):
        if any(isinstance(m, dict) and m.get("type") == "null" for m in node.get(key) or []):
            problems.append(f"{where}: null in {key}")
    if "default" in node and node["default"] is None:
        problems.append(f"{where}: default null")
    if ("properties" in node or node.get("type") == "object") and node.get("additionalProperties") is not False:
        problems.append(f"{where}: object not closed (additionalProperties is not false)")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node:
            problems.append(f"{where}: {key} (Gemini-model routes refuse it)")
    return problems


def declaration_problems(tool: Any) -> list[str]:
    """Everything wrong with one listed tool, for every client we know of."""
    wire = tool.model_dump(by_alias=True, exclude_none=True)
    schema = wire["inputSchema"]
    problems = [f"{tool.name}: {p}" for p in schema_problems(schema)]
    if schema.get("type") != "object" or schema.get("additionalProperties") is not False or "properties" not in schema:
        problems.append(f"{tool.name}: the arguments object is not a closed object with properties")
    hints = wire.get("annotations") or {}
    missing = [h for h in HINTS if not isinstance(hints.get(h), bool)]
    if missing:
        problems.append(f"{tool.name}: annotations lack {missing}")
    if hints.get("readOnlyHint") and hints.get("destructiveHint"):
        problems.append(f"{tool.name}: read-only and destructive at once")
    if len(tool.description or "") < 60:
        problems.append(f"{tool.name}: no real description")
    if len(tool.description or "") > DESCRIPTION_MAX:
        problems.append(
            f"{tool.name}: description of {len(tool.description)} characters (Claude Code cuts at {DESCRIPTION_MAX})"
        )
    if not (wire.get("title") and hints.get("title") == wire["title"]):
        problems.append(f"{tool.name}: no title (on the tool and in its annotations)")
    return problems


def test_the_registry_refuses_a_tool_without_all_four_hints():
    registry = mcp_shared.ToolRegistry()
    with pytest.raises(TypeError, match="open_world_hint"):
        registry.tool(mcp_shared.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True))
    with pytest.raises(TypeError, match="read_only_hint"):
        registry.tool()
    assert registry.entries == []
    hinted = mcp_shared.hints(read_only=True, destructive=True, idempotent=True, open_world=False)
    with pytest.raises(TypeError, match="title"):
        registry.tool(hinted)
    registry.tool(hinted, title="Length")(len)
    assert registry.entries[0][1].destructive_hint is False       # read-only is never destructive


@pytest.mark.parametrize("which", ["bridge over stdio", "bridge over http", "control over stdio"])
async def test_every_tool_is_declared_in_a_form_every_client_takes(which):
    mode = "auto" if which == "bridge over http" else "legacy"
    async with connected(which, mode) as client:
        tools = (await client.list_tools()).tools
    expected = len(bridge.registry.entries) if which.startswith("bridge") else len(control.registry.entries)
    assert len(tools) == expected >= 6
    problems = [p for tool in tools for p in declaration_problems(tool)]
    assert problems == []


async def test_rules_in_the_strict_list_form_are_stored_as_opencode_rules_and_bounds_still_hold(tmp_path):
    """What the closed schema advertises (rules as lists of {pattern, action}; max_cost_usd with a
    minimum of 0 said to be exclusive) is what the server takes and enforces."""
    (tmp_path / "project").mkdir()
    base = {"title": "t", "instructions": "x", "working_dir": str(tmp_path / "project")}
    rules = {"bash": [{"pattern": "*", "action": "allow"}, {"pattern": "git push*", "action": "ask"}],
             "webfetch": [{"pattern": "*", "action": "deny"}]}
    async with connected("bridge over stdio") as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        cost = listed["submit_task"].input_schema["properties"]["max_cost_usd"]
        queued = await client.call_tool("submit_task", base | {"rules": rules})
        zero = await client.call_tool("submit_task", base | {"max_cost_usd": 0})
        odd = await client.call_tool("submit_task", base | {"rules": {"bash": [{"pattern": "x"}]}})
    assert cost["minimum"] == 0 and "more than 0" in cost["description"]
    assert not queued.is_error, queued.content[0].text
    stored = task_store.get_task(queued.structured_content["id"])["rules"]
    assert stored == {"bash": {"*": "allow", "git push*": "ask"}, "webfetch": {"*": "deny"}}
    assert list(stored["bash"]) == ["*", "git push*"]            # order kept: the last match wins
    assert zero.is_error and "max_cost_usd must be > 0" in zero.content[0].text
    assert odd.is_error and "rules.bash[0] must be an object with exactly pattern and action" in odd.content[0].text
    assert task_store.list_tasks()["total"] == 1


async def test_closed_schemas_are_true_unknown_arguments_are_refused_and_null_still_works(tmp_path):
    (tmp_path / "project").mkdir()
    async with connected("bridge over stdio") as client:
        typo = await client.call_tool(
            "submit_task", {"title": "t", "instructions": "x", "working_dir": str(tmp_path / "project"), "timeout": 60}
        )
        none = await client.call_tool("ping", {"verbose": True})
        nulls = await client.call_tool("list_tasks", {"origin": None, "search": None, "limit": None})
    assert typo.is_error and "unknown argument(s) 'timeout'" in typo.content[0].text
    assert "timeout_sec" in typo.content[0].text and "\n" not in typo.content[0].text
    assert none.is_error and "it takes no arguments" in none.content[0].text
    assert not nulls.is_error and nulls.structured_content["total"] == 0
    assert task_store.list_tasks()["total"] == 0          # the typo queued nothing


def queue_dump() -> list[str]:
    """The whole queue database as SQL, except when results were read (tasks.result_seen_at):
    get_task_result's read receipt, the one write a read-only tool makes (it changes no task)."""
    conn = sqlite3.connect(task_store.db_path())
    try:
        return list(conn.iterdump()) if not _has_seen_column(conn) else \
            _dump_without(conn, "result_seen_at")
    finally:
        conn.close()


def _has_seen_column(conn: sqlite3.Connection) -> bool:
    return any(row[1] == "result_seen_at" for row in conn.execute("PRAGMA table_info(tasks)"))


def _dump_without(conn: sqlite3.Connection, column: str) -> list[str]:
    copy = sqlite3.connect(":memory:")
    conn.backup(copy)
    copy.execute(f"UPDATE tasks SET {column} = NULL")
    copy.commit()
    try:
        return list(copy.iterdump())
    finally:
        copy.close()


def sample_args(name: str, schema: dict[str, Any], task_id: str = "t_0001", job_id: int = 1) -> dict[str, Any]:
    """Arguments for any tool, from its schema: ids point at the sample task or job, other
    required fields get a plain value of their type."""
    args: dict[str, Any] = {}
    for field in schema.get("required", []):
        prop = schema["properties"][field]
        if field in ("task_id",):
            args[field] = task_id
        elif field == "task_ids":
            args[field] = [task_id]
        elif field == "job_id":
            args[field] = job_id
        elif prop.get("type") == "integer":
            args[field] = max(1, prop.get("minimum", 1))
        elif prop.get("type") == "array":
            args[field] = []
        elif prop.get("type") == "boolean":
            args[field] = False
        else:
            args[field] = prop.get("enum", ["sample"])[0]
    return args


@pytest.mark.parametrize("which", ["bridge over stdio", "control over stdio"])
async def test_a_read_only_tool_changes_nothing(which, tmp_path):
    """The readOnlyHint is true: calling each such tool leaves the queue database as it was."""
    (tmp_path / "project").mkdir()
    task = task_store.submit_task(title="sample", instructions="x", working_dir=str(tmp_path / "project"))
    marker = task_store.claim_next("test", task_id=task["id"])["run_marker"]
    task_store.complete_attempt(task["id"], marker, result={"summary": "ok"}, diff="+x\n")
    job = task_store.create_claude_job("q", "api", 60)
    task_store.finish_claude_job(job["id"], "done", answer="a")
    env = server_env(opencode_env(tmp_path, "http://127.0.0.1:9/v1")) | {
        "TASK_DB_PATH": os.environ["TASK_DB_PATH"], "TASK_LOG_DIR": os.environ["TASK_LOG_DIR"]}
    async with connected(which, env=env) as client:
        await client.call_tool("ping" if which.startswith("bridge") else "claude_status", {})   # migrations settle
        before = queue_dump()
        read_only = [t for t in (await client.list_tools()).tools if t.annotations.read_only_hint]
        for tool in read_only:
            result = await client.call_tool(tool.name, sample_args(tool.name, tool.input_schema, task["id"], job["id"]))
            assert not result.is_error, (tool.name, result.content[0].text)
            assert queue_dump() == before, f"{tool.name} is marked read-only but changed the queue"
    assert len(read_only) >= 3


# ---------------------------------------------------------------------------------------------
# Result sizes.


def measure(result: Any) -> int:
    """The larger of the two copies a client may show the model: the text content, and the
    structured content as compact JSON."""
    text = sum(len(getattr(block, "text", "") or "") for block in result.content)
    structured = len(json.dumps(result.structured_content, ensure_ascii=False)) if result.structured_content else 0
    return max(text, structured)


NASTY = 'say "hi" \\ \x01\x1f ✓ 日本 🚀\n'     # every character here grows when JSON-escaped or is multibyte


def nasty(chars: int) -> str:
    return (NASTY * (chars // len(NASTY) + 1))[:chars]


def long_dir(root: Path) -> str:
    path = root
    for part in range(4):
        path = path / (f"{part}" * 200)
    path.mkdir(parents=True)
    return str(path)


def extremes(root: Path) -> dict[str, Any]:
    """A queue holding the longest texts the store accepts, the biggest diff, receipt and log
    a run can leave, and many tasks: what the tools must answer about without growing."""
    wd = long_dir(root)
    big = task_store.submit_task(title="€" * 200, instructions=nasty(task_store.INSTRUCTIONS_MAX), working_dir=wd,
                                 idempotency_key="k" * 200, agent="a" * 64, origin_name="claude-code" * 10)
    marker = task_store.claim_next("test", task_id=big["id"])["run_marker"]
    task_store.pause_for_question(big["id"], marker, nasty(task_store.ANSWER_MAX))
    task_store.answer_task(big["id"], nasty(task_store.ANSWER_MAX))
    for _ in range(12):
        task_store.add_note(big["id"], nasty(task_store.NOTE_MAX))
    marker = task_store.claim_next("test", task_id=big["id"])["run_marker"]
    receipt = {"summary": nasty(300_000), "files_touched": [f"{wd}/{i}.txt" for i in range(500)],
               "commands": [{"command": nasty(3000), "exit": 0} for _ in range(300)],
               "open_questions": [nasty(4000) for _ in range(100)]}
    task_store.complete_attempt(big["id"], marker, result=receipt, diff=nasty(3_000_000),
                                usage={"input_tokens": 1, "output_tokens": 2, "cost_usd": 0.5})
    log = task_store.log_path(big["id"])
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(nasty(1_500_000).encode() + b"\x01" * 200_000 + b"\n")   # control bytes grow 6x in JSON
    failed = task_store.submit_task(title="t" * 200, instructions="x", working_dir=wd)
    marker = task_store.claim_next("test", task_id=failed["id"])["run_marker"]
    task_store.fail_attempt(failed["id"], marker, nasty(200_000), retryable=False)
    waiting = []
    for _batch in range(0, 100, 20):
        batch = task_store.submit_batch([{"title": nasty(200), "instructions": "x", "working_dir": wd}
                                         for _ in range(20)])
        for task in batch:
            marker = task_store.claim_next("test", task_id=task["id"])["run_marker"]
            task_store.pause_for_question(task["id"], marker, nasty(task_store.ANSWER_MAX))
            waiting.append(task["id"])
    for _batch in range(0, 120, 20):
        task_store.submit_batch([{"title": nasty(200), "instructions": "x", "working_dir": wd,
                                  "model": LONG_MODEL} for _ in range(20)])
    return {"wd": wd, "big": big["id"], "failed": failed["id"], "waiting": waiting}


def many_models(count: int = 250) -> dict[str, Any]:
    """A provider whose catalogue has `count` models with long names (OpenCode's own config), and
    an agent of the longest name."""
    models = {
        f"model-{i:03d}-{'x' * 80}": {
            "name": f"Model {i} " + "y" * 80,
            "limit": {"context": 128000, "output": 8192},
            "cost": {"input": 1.0, "output": 2.0, "cache_read": 0.1, "cache_write": 1.25},
        }
        for i in range(count)
    }
    # and an agent of the longest name submit_task takes (an unknown agent is refused at submit)
    return {"provider": {"fake": {"models": models}}, "agent": {"a" * 64: {"mode": "primary"}}}


def bridge_calls(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each bridge tool at its defaults and at its maxima (restart_worker: see below)."""
    wd, big, failed, waiting = data["wd"], data["big"], data["failed"], data["waiting"]
    submit_max = {"title": "€" * 200, "instructions": nasty(task_store.INSTRUCTIONS_MAX), "working_dir": wd,
                  "model": LONG_MODEL, "agent": "a" * 64, "idempotency_key": "i" * 200}
    return [
        ("ping", {}),
        ("queue_status", {}),
        ("worker_heartbeat", {}),
        ("submit_task", {"title": "t", "instructions": "x", "working_dir": wd}),
        ("submit_task", submit_max),
        # (instructions are not echoed; 20 x 200,000 characters would pass the SDK's 4 MB request limit)
        (
            "submit_batch",
            {
                "tasks": [
                    submit_max | {"instructions": "x", "idempotency_key": f"b{i}" * 60, "ref": f"@{i}" * 50}
                    for i in range(task_store.BATCH_MAX)
                ]
            },
        ),
        ("get_task", {"task_id": big}),
        ("get_task", {"task_id": failed}),
        ("get_task", {"task_id": waiting[0]}),
        ("get_task_result", {"task_id": big}),
        ("get_task_result", {"task_id": big, "diff_max_bytes": bridge.DIFF_PAGE_MAX}),
        ("get_task_result", {"task_id": failed}),
        ("get_task_logs", {"task_id": big}),
        ("get_task_logs", {"task_id": big, "tail_lines": 5000, "max_bytes": bridge.LOG_PAGE_MAX}),
        ("get_task_logs", {"task_id": big, "offset": 0, "max_bytes": bridge.LOG_PAGE_MAX}),
        ("get_task_logs", {"task_id": big, "offset": 1_500_000, "max_bytes": bridge.LOG_PAGE_MAX}),
        ("wait_for", {"task_ids": [waiting[0]]}),
        ("wait_for", {"task_ids": waiting, "mode": "all", "timeout_sec": 1}),
        ("list_tasks", {}),
        ("list_tasks", {"limit": bridge.LIST_PAGE_MAX}),
        ("list_tasks", {"limit": bridge.LIST_PAGE_MAX, "status": ["waiting"]}),
        ("answer_task", {"task_id": waiting[1], "answer": nasty(task_store.ANSWER_MAX)}),
        ("add_task_note", {"task_id": waiting[2], "text": nasty(task_store.NOTE_MAX)}),
        ("cancel_task", {"task_id": waiting[3], "reason": nasty(task_store.NOTE_MAX)}),  # its maximum
        ("list_models", {}),
        ("list_models", {"limit": bridge.LIST_PAGE_MAX}),
        ("set_default_model", {"model": f"fake/model-001-{'x' * 80}"}),
        ("clear_finished", {"remove_logs": True}),
    ]


# restart_worker starts a real worker pass (or restarts the user's service): its result is four
# short fields (method, command, pid, detail); calling it here would run the queue's tasks.
NOT_CALLED = {"restart_worker"}


@pytest.mark.timeout(600)
async def test_every_bridge_result_stays_under_the_budget_at_defaults_and_maxima(tmp_path):
    data = extremes(tmp_path)
    env = server_env(opencode_env(tmp_path, "http://127.0.0.1:9/v1", extra_config=many_models())) | {
        "TASK_DB_PATH": os.environ["TASK_DB_PATH"], "TASK_LOG_DIR": os.environ["TASK_LOG_DIR"]}
    sizes: list[tuple[str, str, int]] = []
    async with connected("bridge over http", env=env) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        calls = bridge_calls(data)
        later = [(name, sample_args(name, tool.input_schema, data["failed"])) for name, tool in listed.items()
                 if name not in {c for c, _ in calls} | NOT_CALLED]          # tools added later: refusals count too
        calls[-1:-1] = later                                                    # before clear_finished
        # Paged results page on: the whole diff comes back through its pages.
        diff, offset = [], 0
        while offset is not None and len(diff) < 400:
            page = (
                await client.call_tool(
                    "get_task_result",
                    {"task_id": data["big"], "diff_offset": offset, "diff_max_bytes": bridge.DIFF_PAGE_MAX},
                )
            ).structured_content
            diff.append(page["diff"])
            offset = page["diff_next_offset"]
        for name, args in calls:
            result = await client.call_tool(name, args)
            assert not result.is_error or (name, args) in later, (name, result.content[0].text[:300])
            sizes.append((name, ",".join(sorted(args)) or "defaults", measure(result)))
    print("\n".join(f"{size:>7} {name}({args})" for name, args, size in sorted(sizes, key=lambda s: -s[2])))
    assert {name for name, _, _ in sizes} == set(listed) - NOT_CALLED
    too_big = [(name, args, size) for name, args, size in sizes if size > BUDGET]
    assert too_big == [] and BUDGET < WELL_UNDER
    assert offset is None and "".join(diff) == nasty(3_000_000)


@pytest.mark.timeout(300)
async def test_every_reverse_bridge_result_stays_under_the_budget_and_a_long_answer_pages(tmp_path):
    answer = nasty(150_000)
    with FakeAnthropic(answer=answer) as fake:
        env = server_env({"ANTHROPIC_BASE_URL": fake.url, "ANTHROPIC_API_KEY": "sk-fake", "CLAUDE_BACKEND": "api",
                          "CLAUDE_CODE_MAX_RETRIES": "0", "CLAUDE_MAX_TOKENS": "64000"})
        sizes: list[tuple[str, int]] = []
        async with connected("control over stdio", env=env) as client:
            listed = {t.name for t in (await client.list_tools()).tools}
            asked = await client.call_tool("claude_ask", {"prompt": "long please"})
            sizes.append(("claude_ask", measure(asked)))
            submitted = await client.call_tool("claude_submit", {"prompt": "long please"})
            sizes.append(("claude_submit", measure(submitted)))
            job = submitted.structured_content["job_id"]
            for _ in range(300):
                polled = await client.call_tool("claude_poll", {"job_id": job})
                if polled.structured_content["status"] not in ("queued", "running"):
                    break
                await anyio.sleep(0.1)
            sizes.append(("claude_poll", measure(polled)))
            pages, offset = [], 0
            while offset is not None:
                page = await client.call_tool("claude_result", {"job_id": job, "offset": offset})
                assert not page.is_error, page.content[0].text
                sizes.append(("claude_result", measure(page)))
                pages.append(page.structured_content["answer"])
                offset = page.structured_content["answer_next_offset"]
            for name in ("claude_status", "claude_cancel"):
                result = await client.call_tool(name, {"job_id": job} if name == "claude_cancel" else {})
                sizes.append((name, measure(result)))
    print("\n".join(f"{size:>7} {name}" for name, size in sorted(sizes, key=lambda s: -s[1])))
    full = "".join(pages)
    assert full.startswith(answer) and len(pages) >= 4                    # the whole answer, in pages
    assert "more characters cut" in asked.structured_content["answer"]
    assert {name for name, _ in sizes} == listed
    assert [s for s in sizes if s[1] > BUDGET] == []


# ---------------------------------------------------------------------------------------------
# Clients that accept only JSON, clients that go away.

JSON_ONLY = {"Accept": "application/json", "Content-Type": "application/json",
             "Authorization": f"Bearer {TOKEN}"}
INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "json-only", "version": "1"},
    },
}


def json_only_session(url: str) -> dict[str, str]:
    """initialize + initialized with Accept: application/json only; returns the headers to go on with."""
    opened = httpx2.post(url, json=INIT, headers=JSON_ONLY, timeout=30)
    assert opened.status_code == 200, (opened.status_code, opened.text)
    assert opened.headers["content-type"].startswith("application/json")
    assert opened.json()["result"]["serverInfo"]["name"] == "taskbridge"
    headers = JSON_ONLY | {"mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
    assert httpx2.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers,
                       timeout=30).status_code == 202
    return headers


def test_a_client_that_accepts_only_json_gets_plain_json_and_sse_clients_keep_sse(tmp_path):
    (tmp_path / "project").mkdir()
    with bridge_process(server_env(), log_level="WARNING") as base:
        url = f"{base}/mcp"
        headers = json_only_session(url)
        listed = httpx2.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=headers, timeout=30)
        sent = httpx2.post(
            url,
            json={
                "jsonrpc": "2.0",
                "id": 3,
                "method": "tools/call",
                "params": {
                    "name": "submit_task",
                    "arguments": {"title": "json", "instructions": "x", "working_dir": str(tmp_path / "project")},
                },
            },
            headers=headers,
            timeout=30,
        )
        streamed = httpx2.post(url, json=INIT, headers=JSON_ONLY | {"Accept": "application/json, text/event-stream"},
                               timeout=30)
    assert listed.status_code == 200 and listed.headers["content-type"].startswith("application/json")
    assert len(listed.json()["result"]["tools"]) == len(bridge.registry.entries)
    task = sent.json()["result"]["structuredContent"]
    assert task["origin_name"] == "json-only" and task_store.get_task(task["id"])["title"] == "json"
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")


SDK_CLIENT = '''
import sys, anyio, httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
async def main(url, token, task_id):
    http = httpx2.AsyncClient(headers={"Authorization": "Bearer " + token}, timeout=900)
    async with Client(streamable_http_client(url, http_client=http), mode="legacy") as client:
        print("waiting", flush=True)
        await client.call_tool("wait_for", {"task_ids": [task_id], "timeout_sec": 600})
anyio.run(main, *sys.argv[1:])
'''

JSON_CLIENT = '''
import json, sys, httpx2
url, token, task_id = sys.argv[1:]
headers = {"Accept": "application/json", "Content-Type": "application/json", "Authorization": "Bearer " + token}
init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
        "capabilities": {}, "clientInfo": {"name": "json-only", "version": "1"}}}
opened = httpx2.post(url, json=init, headers=headers)
headers.update({"mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"})
httpx2.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers)
print("waiting", flush=True)
httpx2.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "wait_for",
            "arguments": {"task_ids": [task_id], "timeout_sec": 600}}}, headers=headers, timeout=900)
'''


@pytest.mark.parametrize("client", ["sdk client (sse)", "json-only client"])
def test_wait_for_stops_within_seconds_when_its_http_client_goes_away(client, tmp_path):
    """A real client over real HTTP starts a 600 s wait_for and is killed (SIGKILL: its TCP
    connection closes with no goodbye); the server's wait ends within seconds and says so."""
    (tmp_path / "project").mkdir()
    task = task_store.submit_task(title="never runs", instructions="x", working_dir=str(tmp_path / "project"))
    script = tmp_path / "client.py"
    script.write_text(SDK_CLIENT if client.startswith("sdk") else JSON_CLIENT)
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        server = subprocess.Popen([sys.executable, str(bridge.REPO_DIR / "opencode_bridge_mcp.py"), "--transport",
                                   "streamable-http", "--port", str(port), "--log-level", "INFO"],
                                  env=server_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}")
        url = f"http://127.0.0.1:{port}/mcp"
        waiter = subprocess.Popen([sys.executable, str(script), url, TOKEN, task["id"]], stdout=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
        assert waiter.stdout.readline().strip() == b"waiting"
        deadline = time.monotonic() + 30
        while b"wait_for" not in log.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.1)                         # the call reached the server
        time.sleep(1.0)
        assert b"stopped after" not in log.read_bytes()
        waiter.kill()
        waiter.wait()
        killed = time.monotonic()
        while b"tool wait_for stopped after" not in log.read_bytes() and time.monotonic() - killed < 10:
            time.sleep(0.05)
        stopped_in = time.monotonic() - killed
        still = httpx2.post(url, json=INIT, headers=JSON_ONLY, timeout=30)
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = log.read_text()
    assert "tool wait_for stopped after" in text and "its client closed the connection" in text, text[-2000:]
    assert stopped_in < 5, stopped_in
    assert still.status_code == 200                      # the server serves on
    print(f"\n{client}: the server's wait_for ended {stopped_in:.2f} s after the client was killed")


BLOCKING = {"wait_for", "claude_ask"}      # tools that hold the call open while they wait


@pytest.mark.parametrize("which", ["bridge over stdio", "control over stdio"])
async def test_blocking_tools_default_under_the_60_s_clients_give_a_call(which):
    """MCP Inspector, OpenCode's MCP client and most SDK clients end a tool call after 60 s."""
    async with connected(which) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    blocking = BLOCKING & set(tools)
    assert blocking
    for name in blocking:
        assert tools[name].input_schema["properties"]["timeout_sec"]["default"] < 60, name
        assert "again" in tools[name].description or "claude_submit" in tools[name].description, name
