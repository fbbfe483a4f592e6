"""Reading a task's log and getting its work back: `logs` (rendered, --raw, --follow), `diff`,
`branch`, `apply`, `retry`, and the MCP tools `retry_task` / `apply_task`.

Runs the real opencode with the scripted model where a finished task is needed, and real git
repositories throughout."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import opencode_runner
import task_store
import tasks_cli
from fake_openai import http_error, text, tool_call
from helpers import make_repo, run_script

RECEIPT = '```json\n{"summary": "Tried a few things", "files_touched": [], "tests_run": [], ' \
          '"open_questions": []}\n```'


def cli(*args: str):
    result = CliRunner().invoke(tasks_cli.cli, list(args), catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


@pytest.mark.real_opencode
def test_logs_of_a_finished_run_read_like_an_opencode_session(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("mix", [
        tool_call("bash", {"command": "echo checking && exit 3", "description": "a failing check"}),
        tool_call("read", {"filePath": "{cwd}/missing.txt"}),
        tool_call("write", {"filePath": "{cwd}/blocked.txt", "content": "no"}),
        text("I looked around.\n" + RECEIPT),
    ])
    opencode.model.script("bad", [http_error(400, "the scripted model refuses this request")])
    task = task_store.submit_task(title="mix", instructions="SCRIPT:mix", working_dir=str(repo),
                                  permission="readonly")
    bad = task_store.submit_task(title="bad", instructions="SCRIPT:bad", working_dir=str(repo), max_retries=0)
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "done"
    assert task_store.get_task(bad["id"])["status"] == "failed"

    shown = cli("logs", task["id"])
    assert shown.exit_code == 0
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("── attempt br-1-a1 started ")
    assert "| bash     echo checking && exit 3  (exit 3)" in lines
    assert lines[lines.index("| bash     echo checking && exit 3  (exit 3)") + 1] == "  checking"
    assert any(line.startswith("| read     ") and "missing.txt  error: File not found" in line for line in lines)
    assert any(line.startswith("| write     denied: Model tried to call unavailable tool 'write'") for line in lines)
    assert "I looked around." in lines
    steps = [line for line in lines if line.startswith("   step finished")]
    assert len(steps) == 4 and steps[-1].startswith("   step finished (stop): ") and "$0.00" in steps[-1]
    assert not any(line.lstrip().startswith('{"type"') for line in lines), "no raw JSON events"

    failed = cli("logs", bad["id"])
    assert "Error: APIError: the scripted model refuses this request (HTTP 400)" in failed.stdout

    # --raw is the file byte for byte (through a real pipe), --tail counts rendered entries.
    raw = run_script("tasks_cli.py", "logs", task["id"], "--raw")
    assert raw.returncode == 0 and raw.stdout == task_store.log_path(task["id"]).read_text()
    assert cli("logs", task["id"], "--tail", "1").stdout.startswith("   step finished (stop)")
    followed = cli("logs", task["id"], "--follow")
    assert followed.stdout == shown.stdout and "t_0001 is done; log ends" in followed.stderr


def test_render_log_line_kinds_and_fields():
    step = json.dumps({"type": "step_finish", "timestamp": 1_700_000_000_000, "part": {
        "reason": "stop", "cost": 0.5, "tokens": {"total": 12, "input": 5, "output": 4, "reasoning": 3,
                                                   "cache": {"read": 2, "write": 1}}}})
    entry = opencode_runner.render_log_line(step)
    assert entry["kind"] == "step" and entry["reason"] == "stop" and entry["cost_usd"] == 0.5
    assert entry["tokens"] == {"total": 12, "input": 5, "output": 4, "reasoning": 3, "cache_read": 2,
                               "cache_write": 1}
    assert entry["ts"] == 1_700_000_000
    assert opencode_runner.render_log_line('{"type":"step_start","part":{}}') is None
    assert opencode_runner.render_log_line("   ") is None
    assert opencode_runner.render_log_line("[stderr] boom") == {"kind": "stderr", "text": "boom"}
    assert opencode_runner.render_log_line("[worker] skipped") == {"kind": "worker", "text": "skipped"}
    assert opencode_runner.render_log_line("not json {") == {"kind": "other", "text": "not json {"}
    assert opencode_runner.render_log_line('{"type":"new_kind"}')["kind"] == "other"
    # Malformed events never raise: every field is checked for its type.
    for odd in ('{"type":"tool_use","part":{"state":"x"}}', '{"type":"error","error":"plain"}',
                '{"type":"step_finish","part":{"tokens":[],"cost":"1"}}', '{"type":"text","part":[]}', "[1]"):
        assert opencode_runner.render_log_line(odd)["kind"] in ("tool", "error", "step", "text", "other")
    chunk = "=== br-2-a1 2026-01-01T00:00:00+00:00 cwd=/x\n$ opencode run\n" + step + "\n"
    assert [e["kind"] for e in opencode_runner.render_log(chunk)] == ["attempt", "worker", "step"]
    assert opencode_runner.render_log(chunk)[0]["cwd"] == "/x"
