"""TaskBridge's own secrets never show in what it stores or serves, even when a run prints them:
the worker redacts at write time (the task log, the receipt, the diff, the error, the worker's own
lines), and the board's API, the MCP tools and the CLI redact again at read time (logs and
receipts stored before, or by a worker that did not hold a secret this process holds)."""
from __future__ import annotations

import io
import json
import os

import pytest
from click.testing import CliRunner
from mcp import Client
from starlette.testclient import TestClient

import opencode_bridge_mcp as bridge
import opencode_runner as oc
import redaction
import task_store
import worker
from fake_openai import http_error, text, tool_call
from helpers import make_repo, run_script
from tasks_cli import cli

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

TOKEN = "Tok3n-bearer-4c2b9e1f7d6a5b8c"          # the HTTP bearer token (in the token file)
KEY = "sk-ant-api03-fakeKEY-9f8e7d6c5b4a3210"    # the reverse bridge's ANTHROPIC_API_KEY
PW = "pgPa55-w0rd-e3d2c1b0"                      # the queue database's password (~/.pgpass)
VALUES = (TOKEN, KEY, PW)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def secrets_held(tmp_path, monkeypatch):
    """The worker and the servers hold the three secrets, each from another kind of source."""
    token_file = tmp_path / "taskbridge" / "token"
    token_file.parent.mkdir()
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"db.example:5432:queue:tb:{PW}\n")
    pgpass.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(pgpass))


def leaks(shown: object) -> list[str]:
    text_form = shown if isinstance(shown, str) else \
        shown.decode(errors="replace") if isinstance(shown, bytes) else json.dumps(shown, default=str)
    return [v for v in VALUES if v in text_form]


def cli_out(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def served(task_id: str) -> dict[str, object]:
    """What every read path shows of a task: the MCP tools (SDK client in memory), the board's
    /api routes, the CLI's show / diff / logs / list."""
    seen: dict[str, object] = {}
    async with Client(bridge.build_server()) as c:
        for tool, args in [("get_task", {}), ("get_task_result", {}), ("get_task_logs", {}),
                           ("get_task_logs", {"offset": 0}), ("list_tasks", {})]:
            result = await c.call_tool(tool, {"task_id": task_id, **args} if tool != "list_tasks" else {})
            assert not result.is_error, result.content[0].text
            seen[f"mcp {tool} {args}"] = [result.structured_content, [getattr(b, "text", "") for b in result.content]]
    client = TestClient(bridge.build_app(), base_url="http://127.0.0.1:8765")
    for path in ("/api/tasks", f"/api/tasks/{task_id}", f"/api/tasks/{task_id}/log",
                 f"/api/tasks/{task_id}/log?offset=0", "/api/events", "/api/engine"):
        answer = client.get(path, headers=AUTH)
        assert answer.status_code == 200, answer.text
        seen[f"board {path}"] = answer.text
    for args in (["show", task_id], ["show", task_id, "--json"], ["logs", task_id], ["logs", task_id, "--raw"],
                 ["list", "--json"]) + ((["diff", task_id],) if task_store.get_task(task_id)["diff"] else ()):
        seen[f"cli {' '.join(args)}"] = cli_out(*args)
    return seen


def assert_nothing_shows(seen: dict[str, object]) -> None:
    leaked = {where: leaks(what) for where, what in seen.items() if leaks(what)}
    assert not leaked, leaked


# --------------------------------------------------------------------------------------------
# Write time: a real worker pass whose agent prints the secrets.


LEAK_RECEIPT = ('```json\n{"summary": "printed ' + PW + '", "files_touched": ["leak.txt"], '
                '"tests_run": ["echo ' + KEY + '"], "open_questions": ["is ' + TOKEN + ' the token?"]}\n```')


@pytest.mark.real_opencode
@pytest.mark.anyio
async def test_a_run_that_prints_the_secrets_stores_and_shows_none_of_them(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("leak", [
        tool_call("bash", {"command": f"echo token={TOKEN} key={KEY} pw={PW}", "description": "leak"}),
        tool_call("write", {"filePath": "{cwd}/leak.txt", "content": f"password {PW}\n"}),
        text(f"Found {TOKEN} and {KEY}.\n" + LEAK_RECEIPT),
    ])
    task = task_store.submit_task(title="leak", instructions="SCRIPT:leak", working_dir=str(repo))
    passed = run_script("worker.py", "-v")
    assert passed.returncode == 0, passed.stderr
    assert not leaks(passed.stderr), "the worker's own lines"

    stored = task_store.get_task(task["id"])
    assert stored["status"] == "done", stored["error"]
    log = task_store.log_path(task["id"]).read_bytes()
    assert b"token=[redacted: bearer token] key=[redacted: anthropic api key] pw=[redacted: database password]" \
        in log, "the echo ran and its output is in the log, redacted"
    assert not leaks(log)
    assert not leaks(stored), "the stored row: receipt, diff, events"
    receipt = stored["result"]
    assert receipt["summary"] == "printed [redacted: database password]"
    assert receipt["open_questions"] == ["is [redacted: bearer token] the token?"]
    assert any("[redacted: bearer token]" in c["command"] for c in receipt["commands"])
    assert "+password [redacted: database password]" in stored["diff"]
    assert not leaks(task_store.state_path("worker.log").read_bytes())
    assert_nothing_shows(await served(task["id"]))


@pytest.mark.real_opencode
def test_a_model_error_quoting_a_secret_is_stored_without_it(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("refused", [http_error(400, f"invalid x-api-key {KEY}")])
    task = task_store.submit_task(title="refused", instructions="SCRIPT:refused", working_dir=str(repo),
                                  max_retries=0)
    assert run_script("worker.py").returncode == 0
    stored = task_store.get_task(task["id"])
    assert stored["status"] == "failed"
    assert "invalid x-api-key [redacted: anthropic api key]" in stored["error"]
    assert not leaks(stored) and not leaks(task_store.log_path(task["id"]).read_bytes())


# --------------------------------------------------------------------------------------------
# Read time: a task stored with the secrets in it (before redaction, or by another worker).


@pytest.mark.anyio
async def test_logs_and_receipts_stored_with_secrets_are_shown_redacted(tmp_path):
    task = task_store.submit_task(title="old", instructions="i", working_dir=str(tmp_path))
    claimed = task_store.claim_next("old-worker", task_id=task["id"])
    with task_store.open_task_log(task["id"]) as log:
        log.write(json.dumps({"type": "tool_use", "timestamp": 1, "sessionID": "s", "part": {
            "tool": "bash", "state": {"status": "completed", "input": {"command": f"echo {TOKEN}"},
                                      "output": f"{TOKEN} {KEY}\n", "metadata": {"exit": 0}}}}).encode() + b"\n")
        log.write(f"[stderr] password {PW}\n".encode())
    task_store.fail_attempt(task["id"], claimed["run_marker"], f"it printed {KEY}", retryable=False,
                            result={"summary": f"the token is {TOKEN}", "commands": [{"command": f"echo {PW}"}]},
                            diff=f"diff --git a/x b/x\n+{PW}\n")
    assert leaks(task_store.get_task(task["id"])) and leaks(task_store.log_path(task["id"]).read_bytes())

    seen = await served(task["id"])
    assert_nothing_shows(seen)
    assert "[redacted: bearer token]" in seen[f"cli logs {task['id']} --raw"]
    assert "[redacted: anthropic api key]" in json.dumps(seen[f"board /api/tasks/{task['id']}"])


# --------------------------------------------------------------------------------------------
# Units.


def test_redact_overlapping_values_and_bytes_and_str():
    r = redaction.Redactor({"abcdefgh1234": "bearer token", "1234wxyzWXYZ": "database password",
                            "abcdefgh": "anthropic api key", "short7!": "ignored by the caller"})
    assert r.redact("<abcdefgh1234wxyzWXYZ>") == "<[redacted: bearer token, database password]>"
    assert r.redact("abcdefgh and abcdefgh1234") == "[redacted: anthropic api key] and [redacted: bearer token]"
    assert r.redact(b"x abcdefgh1234 y") == b"x [redacted: bearer token] y"
    assert r.redact("nothing here") == "nothing here" and r.redact(42) == 42
    assert redaction.redact_deep({"k": [("abcdefgh1234",)], "abcdefgh": b"abcdefgh"}, r) == \
        {"k": [("[redacted: bearer token]",)], "[redacted: anthropic api key]": b"[redacted: anthropic api key]"}


def test_values_are_matched_as_json_escapes_them():
    r = redaction.Redactor({'pa"ss\\word9': "database password"})
    line = json.dumps({"output": 'pw=pa"ss\\word9'})
    assert json.loads(r.redact(line))["output"] == "pw=[redacted: database password]"


def test_secret_values_are_read_at_call_time_from_each_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TASK_DB_URL", "postgresql://tb:url-pa%73sword@db.example/queue")
    monkeypatch.setenv("PGPASSWORD", "short")      # under MIN_SECRET_CHARS: not a secret worth matching
    oauth = tmp_path / "taskbridge" / "oauth.json"
    oauth.write_text(json.dumps({"clients": {"c1": {"client_id": "c1", "client_secret": "oauth-client-secret-1"}}}))
    values = redaction.secret_values()
    assert values[TOKEN] == "bearer token" and values[KEY] == "anthropic api key" and values[PW] == "database password"
    assert values["url-password"] == values["url-pa%73sword"] == "database password"
    assert values["oauth-client-secret-1"] == "oauth client secret"
    assert "short" not in values
    token_file = tmp_path / "taskbridge" / "token"
    token_file.write_text("a-rotated-token-value")
    os.utime(token_file, ns=(1, 1))                  # a new stamp even within the clock's resolution
    assert redaction.redact(f"{TOKEN} a-rotated-token-value") == f"{TOKEN} [redacted: bearer token]"


def test_values_this_process_holds_are_secrets_while_held_and_a_while_after():
    """A kept server's password lives in no variable or file of the worker's (engine.py holds it).
    It stays a secret while its server runs, however many others start and stop meanwhile (a cap
    on all values by count let a long run's go), and for the last RELEASED_KEPT after their stop."""
    long_run = "long-running-server-password"
    redaction.hold(long_run, "opencode server password")
    assert redaction.redact(f"x {long_run}") == "x [redacted: opencode server password]"
    first = "first-stopped-server-password"
    redaction.hold(first, "opencode server password")
    redaction.release(first)
    assert redaction.redact(first) != first, "its run's receipt is stored after the stop"
    for n in range(redaction.RELEASED_KEPT):
        redaction.hold(f"later-server-password-{n}", "opencode server password")
        redaction.release(f"later-server-password-{n}")
    assert redaction.redact(first) == first, "the oldest released is let go: the matcher stays bounded"
    assert redaction.redact(long_run) != long_run, "still held"
    redaction.release(long_run)


def test_the_password_file_the_queue_url_names_is_read_as_libpq_reads_it(tmp_path, monkeypatch):
    """libpq takes the URL's passfile over PGPASSFILE: so must the redactor (it read PGPASSFILE
    or ~/.pgpass only, and a password kept in the URL's passfile reached the logs unredacted)."""
    passfile = tmp_path / "url-passfile"
    passfile.write_text("db.example:5432:queue:tb:url-passfile-password-77\n")
    monkeypatch.setenv("TASK_DB_URL", f"postgresql://tb@db.example/queue?passfile={passfile}")
    values = redaction.secret_values()
    assert values["url-passfile-password-77"] == "database password"
    assert task_store.pgpass_file(task_store.database_url()) == str(passfile)
    monkeypatch.delenv("TASK_DB_URL")
    assert task_store.pgpass_file(task_store.database_url()) == os.environ["PGPASSFILE"]
    monkeypatch.delenv("PGPASSFILE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert task_store.pgpass_file(None) == str(tmp_path / ".pgpass")


def test_a_value_split_between_pieces_of_a_long_line_is_redacted():
    r = redaction.Redactor({"SECRET-abcdefgh": "bearer token", "gh-OTHER-1234": "database password"})
    line = b"x" * 50 + b"SECRET-abcdefgh" + b"y" * 7 + b"SECRET-abcdefgh-OTHER-1234" + b"z" * 30
    for size in range(1, len(line) + 1):
        cut = redaction.LongLine(r)
        written = b"".join(cut.feed(line[i:i + size]) for i in range(0, len(line), size)) + cut.end()
        assert written == r.redact(line), size
        assert b"SECRET" not in written and b"OTHER" not in written


def test_the_workers_oversized_line_path_redacts_across_reads(monkeypatch):
    monkeypatch.setattr(worker, "LINE_MAX", 1000)
    log = io.BytesIO()
    lines = worker.OutputLines("t_0001", log, worker.RunResult(oc.EventStream()), worker.LimitWatch(None, 60))
    line = b"o" * 1500 + TOKEN.encode() + b"p" * 2000
    split = 1500 + len(TOKEN) // 2                   # the token straddles two reads of OpenCode's stdout
    lines.feed("out", line[:split])
    lines.feed("out", line[split:] + b"\n")
    written = log.getvalue()
    assert TOKEN.encode() not in written and b"[redacted: bearer token]" in written
    assert written.startswith(b"o" * 1500) and b"p" * 2000 in written and not lines.oversized


def test_the_model_providers_keys_are_secrets_too(tmp_path, monkeypatch):
    # A provider's 401 ("Incorrect API key provided: sk-…") put the key in the worker's line, the
    # failure reason and `show` (found by a new-user test).
    config = tmp_path / "xdg-config" / "opencode"
    config.mkdir(parents=True)
    (config / "opencode.json").write_text(json.dumps({"provider": {
        "mine": {"options": {"baseURL": "http://127.0.0.1:1/v1", "apiKey": "sk-from-the-config-file"}},
        "ref": {"options": {"apiKey": "{env:SOME_KEY}"}}}}))
    data = tmp_path / "xdg-data" / "opencode"
    data.mkdir(parents=True)
    (data / "auth.json").write_text(json.dumps({"openai": {"type": "api", "key": "sk-from-opencode-auth"}}))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    inline = {"provider": {"x": {"options": {"apiKey": "sk-inline-1"}}}}
    monkeypatch.setenv("OPENCODE_CONFIG_CONTENT", json.dumps(inline))
    values = redaction.secret_values()
    assert values["sk-from-the-config-file"] == values["sk-from-opencode-auth"] == "provider api key"
    assert values["sk-inline-1"] == "provider api key"
    assert values["sk-from-the-environment"] == "api key (OPENAI_API_KEY)"
    assert "{env:SOME_KEY}" not in values
    said = "401: Incorrect API key provided: sk-from-opencode-auth"
    assert redaction.redact(said) == "401: Incorrect API key provided: [redacted: provider api key]"
    (config / "opencode.json").write_text("[1, 2]")   # not a config at all: no value, no error
    os.utime(config / "opencode.json", ns=(1, 1))
    assert "sk-from-the-config-file" not in redaction.secret_values()
