"""Bounded text (issue 8 §7): a 20 MB final message with no closing block, from the scripted model
through a real worker pass with the real opencode, becomes a small receipt whose clipped texts
say where the whole text is; get_task (MCP) and `tasks_cli.py show` stay small."""
from __future__ import annotations

import json
from typing import TypedDict

import pytest
from mcp import Client

import opencode_bridge_mcp as bridge
import opencode_runner as oc
import task_store
import worker
from fake_openai import text
from helpers import make_repo, run_script

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

HUGE = 20 * 1024 * 1024


@pytest.mark.real_opencode
@pytest.mark.anyio
async def test_a_20_mb_final_message_gives_a_small_receipt(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    body = ("word " * (HUGE // 5))[:HUGE - 3] + "END"
    opencode.model.script("huge", [text(body)])
    task = task_store.submit_task(title="huge", instructions="SCRIPT:huge", working_dir=str(repo))
    passed = run_script("worker.py", timeout=600)
    assert passed.returncode == 0, passed.stderr[-2000:]
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    summary = done["result"]["summary"]
    log = task_store.log_path(task["id"])
    assert len(summary) < worker.SUMMARY_MAX + 500 and summary.endswith("END")
    assert "[clipped:" in summary and str(log) in summary and f"{HUGE:,} characters" in summary
    assert log.stat().st_size > HUGE  # the whole text is where the note says
    async with Client(bridge.build_server(), mode="legacy") as client:
        got = await client.call_tool("get_task", {"task_id": task["id"]})
    assert not got.is_error
    size = len(json.dumps(got.structured_content)) + sum(
        len(getattr(c, "text", "")) for c in got.content
    )  # resource links carry no text
    assert size < 100_000, f"get_task answered {size:,} characters"
    shown = run_script("tasks_cli.py", "show", task["id"])
    assert shown.returncode == 0 and len(shown.stdout) < 100_000, len(shown.stdout)


def test_the_event_stream_keeps_only_a_tail_of_text():
    stream = oc.EventStream()
    stream.feed(json.dumps({"type": "step_start", "part": {}}))
    for n in range(300):
        stream.feed(json.dumps({"type": "text", "part": {"text": f"{n:04d}" + "x" * 4096}}))
    stream.feed(json.dumps({"type": "text", "part": {"text": "```json\n{\"summary\": \"ok\"}\n```"}}))
    stream.feed(json.dumps({"type": "step_finish", "part": {"reason": "stop"}}))
    assert len(stream.final_text) <= oc.TEXT_KEEP
    assert stream.final_text_chars > 300 * 4096
    assert oc.parse_closing_block(stream.final_text)["summary"] == "ok"


def test_error_events_are_bounded():
    stream = oc.EventStream()
    for n in range(50):
        stream.feed(
            json.dumps({"type": "error", "error": {"name": "APIError", "data": {"message": f"{n} " + "m" * 100_000}}})
        )
    assert len(stream.errors) == 20 and stream.errors[-1].startswith("APIError: 49 ")
    assert all(len(e) <= oc.INPUT_KEEP for e in stream.errors)


def test_a_write_calls_content_is_not_kept():
    stream = oc.EventStream()
    stream.feed(json.dumps({"type": "tool_use", "part": {"tool": "write", "state": {
        "status": "completed", "input": {"filePath": "/w/a.txt", "content": "y" * 5_000_000}}}}))
    assert stream.tool_calls[0]["input"] == {"filePath": "/w/a.txt"}


def test_receipt_lists_and_stored_errors_are_clipped(tmp_path):
    where = "the log"
    items = worker._clip_items(["q" * 10_000] + ["short"] * 150, where)
    assert len(items) == worker.ITEMS_MAX + 1 and "150 more items" not in items[-1]
    assert "51 more items" in items[-1] and len(items[0]) < worker.ITEM_MAX + 200
    repo = make_repo(tmp_path / "repo")
    task = task_store.submit_task(title="e", instructions="i", working_dir=str(repo), max_retries=0)
    claimed = task_store.claim_next("worker:test:1")
    failed = task_store.fail_attempt(task["id"], claimed["run_marker"], "E" * 1_000_000)
    assert len(failed["error"]) < task_store.ERROR_MAX + 300
    assert str(task_store.log_path(task["id"])) in failed["error"]


@pytest.mark.anyio
async def test_get_task_stays_small_with_many_long_notes(tmp_path):
    repo = make_repo(tmp_path / "repo")
    task = task_store.submit_task(title="n", instructions="i" * 100_000, working_dir=str(repo))
    for n in range(40):
        task_store.add_note(task["id"], f"note {n} " + "n" * 19_000)
    async with Client(bridge.build_server(), mode="legacy") as client:
        got = await client.call_tool("get_task", {"task_id": task["id"]})
    assert not got.is_error
    notes = got.structured_content["notes"]
    assert len(notes) == 20 and notes[-1]["text"].startswith("note 39")
    size = len(json.dumps(got.structured_content))
    assert size < 80_000, f"get_task answered {size:,} characters"


class BigAnswer(TypedDict):
    summary: str
    items: list[str]


@pytest.mark.anyio
async def test_every_tool_answer_has_a_size_cap():
    """No real tool can be made to answer a megabyte any more (their texts are bounded at the
    source), so the last guard is shown on a tool registered on the same server class."""
    import mcp_shared

    server = mcp_shared.TranslatingServer("cap-test")

    @server.tool()
    def big() -> BigAnswer:
        """A tool that answers 3 MB."""
        return {"summary": "s" * 3_000_000, "items": ["i" * 10] * 10}

    async with Client(server, mode="legacy") as client:
        got = await client.call_tool("big", {})
    assert not got.is_error
    size = len(json.dumps(got.structured_content)) + sum(
        len(getattr(c, "text", "")) for c in got.content
    )  # resource links carry no text
    assert size <= mcp_shared.RESPONSE_MAX
    assert "3,000,000 characters" in got.structured_content["summary"]
    assert got.structured_content["items"] == ["i" * 10] * 10
