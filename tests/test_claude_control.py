"""The reverse bridge (claude_control_mcp.py) through the MCP SDK client, for both backends.

Backends: ``cli`` is the real pinned ``claude`` binary (node_modules/.bin/claude; skipped when
missing, a failure under CI=true) and ``api`` is the anthropic SDK; both talk to
tests/fake_anthropic.py on 127.0.0.1 with HOME, CLAUDE_CONFIG_DIR and TMPDIR under tmp_path and
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1, so no byte leaves loopback. Output shapes the real CLI
cannot be made to produce come from a tiny fake ``claude`` script (FAKE_CLAUDE below) chosen with
CLAUDE_BIN; each such test says so.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from mcp import Client, StdioServerParameters

import claude_control_mcp as ccm
import task_store
from fake_anthropic import DEFAULT_ANSWER, FakeAnthropic
from helpers import call_tool, fake_binary, require_pinned, tool_error

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "claude_control_mcp.py"
REAL_CLAUDE = ROOT / "node_modules" / ".bin" / "claude"
BACKENDS = ["cli", "api"]


# --------------------------------------------------------------------------------------------
# Fixtures.

def require_real_claude() -> str:
    """The pinned claude binary; skip when missing, fail when CI=true."""
    return require_pinned(str(REAL_CLAUDE), "the claude CLI (@anthropic-ai/claude-code)")


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def claude_env(tmp_path: Path, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point both backends at the fake and isolate the CLI's files under tmp_path."""
    values = {"ANTHROPIC_BASE_URL": fake.url, "ANTHROPIC_API_KEY": "sk-fake-test-key",
              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_RETRIES": "0"}
    for name in ("HOME", "CLAUDE_CONFIG_DIR", "TMPDIR"):
        path = tmp_path / "claude" / name.lower()
        path.mkdir(parents=True)
        values[name] = str(path)
    for name in ("CLAUDE_BACKEND", "CLAUDE_BIN", "CLAUDE_API_MODEL", "CLAUDE_STALL_SEC",
                 "ANTHROPIC_CUSTOM_HEADERS", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, claude_env: dict, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs once per backend; the key is set in both (the CLI needs one for the fake)."""
    if request.param == "cli":
        monkeypatch.setenv("CLAUDE_BIN", require_real_claude())
    monkeypatch.setenv("CLAUDE_BACKEND", request.param)
    return request.param


@pytest.fixture
def runner() -> Iterator[ccm.JobRunner]:
    job_runner = ccm.JobRunner()
    yield job_runner
    job_runner.shutdown()


@pytest.fixture
def server(runner: ccm.JobRunner) -> Any:
    return ccm.build_server(runner)


async def wait_status(client: Client, job_id: int, statuses: tuple[str, ...], timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = await call_tool(client, "claude_poll", {"job_id": job_id})
        if state["status"] in statuses:
            return state
        assert time.monotonic() < deadline, f"job {job_id} still {state['status']} after {timeout} s"
        await anyio.sleep(0.1)


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` without blocking the event loop (the in-memory server shares it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await anyio.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# A fake `claude` for shapes and process trees the real CLI cannot be made to produce. Env:
# FAKE_CLAUDE_LOG (append a JSON line: argv, whether stdin is /dev/null, bytes it could read),
# FAKE_CLAUDE_STDOUT / FAKE_CLAUDE_STDERR / FAKE_CLAUDE_RC (what to print, the exit code; default a
# normal result echoing the prompt), FAKE_CLAUDE_SLEEP (seconds to hang first), FAKE_CLAUDE_PIDS
# (spawn a child and a setsid grandchild that sleep, write all pids there).
FAKE_CLAUDE = textwrap.dedent("""\
    import json, os, select, subprocess, sys, time
    env = os.environ
    if env.get("FAKE_CLAUDE_LOG"):
        st, null = os.fstat(0), os.stat(os.devnull)
        data = b""
        while select.select([0], [], [], 0 if not data else 1)[0]:  # what is there, up to EOF
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            data += chunk
        with open(env["FAKE_CLAUDE_LOG"], "a") as log:
            log.write(json.dumps({"argv": sys.argv[1:],
                                  "stdin_is_devnull": (st.st_dev, st.st_ino) == (null.st_dev, null.st_ino),
                                  "stdin_bytes": len(data)}) + "\\n")
    if env.get("FAKE_CLAUDE_PIDS"):
        sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
        child = subprocess.Popen(sleeper)
        grandchild = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(300)", *sleeper], stdout=subprocess.PIPE)
        escaped = int(grandchild.stdout.readline())
        with open(env["FAKE_CLAUDE_PIDS"], "w") as out:
            json.dump([os.getpid(), child.pid, grandchild.pid, escaped], out)
    time.sleep(float(env.get("FAKE_CLAUDE_SLEEP", "0")))
    prompt = sys.argv[-1] if "--" in sys.argv else ""
    default = json.dumps({"type": "result", "subtype": "success", "is_error": False,
                          "result": "fake cli: " + prompt[:50],
                          "usage": {"input_tokens": 3, "output_tokens": 4}, "total_cost_usd": 0.001})
    sys.stdout.write(env.get("FAKE_CLAUDE_STDOUT", default))
    sys.stderr.write(env.get("FAKE_CLAUDE_STDERR", ""))
    sys.exit(int(env.get("FAKE_CLAUDE_RC", "0")))
""")


@pytest.fixture
def fake_claude(tmp_path: Path, claude_env: dict, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install FAKE_CLAUDE as CLAUDE_BIN (CLI backend); returns the path of its call log."""
    script = fake_binary(tmp_path, "fake-claude", FAKE_CLAUDE, shebang=f"#!{sys.executable}")
    log = tmp_path / "fake-claude.log"
    monkeypatch.setenv("CLAUDE_BIN", str(script))
    monkeypatch.setenv("CLAUDE_BACKEND", "cli")
    monkeypatch.setenv("FAKE_CLAUDE_LOG", str(log))
    return log


def fake_claude_calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# --------------------------------------------------------------------------------------------
# Asking and background jobs, both backends.

async def test_ask_returns_the_fakes_answer_with_usage(server: Any, backend: str, fake: FakeAnthropic) -> None:
    async with Client(server, mode="legacy") as client:
        answer = await call_tool(client, "claude_ask", {"prompt": "-does this option-like prompt arrive?",
                                                        "system": "Answer in one line.", "model": "claude-haiku-4-5"})
    assert answer["answer"] == f"{DEFAULT_ANSWER} | echo: -does this option-like prompt arrive?"
    assert answer["backend"] == backend
    usage = answer["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0 and usage["backend"] == backend
    assert (usage["cost_usd"] is not None) == (backend == "cli")  # only claude -p reports a cost
    sent = fake.message_requests()[-1]
    assert sent.body["model"] == "claude-haiku-4-5" == answer["model"]
    assert "Answer in one line." in json.dumps(sent.body["system"])
    # the CLI sends x-api-key; this SDK version sends the key as a bearer token
    assert "sk-fake-test-key" in (sent.headers.get("x-api-key", "") + sent.headers.get("authorization", ""))


async def test_api_model_defaults_to_claude_api_model(server: Any, claude_env: dict, fake: FakeAnthropic,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_API_MODEL", "claude-sonnet-4-6")
    async with Client(server, mode="legacy") as client:
        answer = await call_tool(
            client, "claude_ask", {"prompt": "which model?", "system": "null", "timeout_sec": "30"}
        )
    assert answer["model"] == "claude-sonnet-4-6" == fake.message_requests()[-1].body["model"]
    assert "system" not in fake.message_requests()[-1].body  # "null" means absent


async def test_submit_poll_result(server: Any, backend: str) -> None:
    async with Client(server, mode="legacy") as client:
        job = await call_tool(client, "claude_submit", {"prompt": "background question"})
        assert job["status"] in ("queued", "running") and job["backend"] == backend
        state = await wait_status(client, job["job_id"], ("done", "failed", "cancelled"))
        assert state["status"] == "done" and state["answer_ready"] and state["error"] is None
        result = await call_tool(client, "claude_result", {"job_id": str(job["job_id"])})
    assert result["answer"].endswith("echo: background question")
    assert result["usage"]["output_tokens"] > 0 and result["usage"]["backend"] == backend
    stored = task_store.get_claude_job(job["job_id"])
    assert stored["status"] == "done" and stored["answer"] == result["answer"] and stored["finished_at"]


@pytest.mark.parametrize("mode, kind, words", [
    ("401", "auth", "ANTHROPIC_API_KEY"),
    ("529", "overloaded", "overloaded"),
    ("429", "rate_limit", "429"),
    ("500", "server_error", "500"),
])
async def test_api_errors_are_specific_and_fast(server: Any, backend: str, fake: FakeAnthropic,
                                                mode: str, kind: str, words: str) -> None:
    started = time.monotonic()
    async with Client(server, mode="legacy") as client:
        error = await tool_error(client, "claude_ask", {"prompt": f"MODE:{mode} please", "timeout_sec": 30})
    assert f"{kind}: " in error and words.lower() in error.lower(), error
    assert "sk-fake-test-key" not in error
    assert time.monotonic() - started < 10
    assert [r.mode for r in fake.message_requests()] and {r.mode for r in fake.message_requests()} == {mode}


@pytest.mark.parametrize("mode", ["stall:60", "slow:60"])
async def test_stall_and_slow_end_within_the_timeout(server: Any, backend: str, fake: FakeAnthropic,
                                                     mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that stops mid-answer, and a server that never starts one: both end by timeout_sec.
    The SDK sees the stall itself (read timeout) and says "stalled"; claude -p just never finishes."""
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", f"x-fake-mode: {mode}")  # the header route
    started = time.monotonic()
    async with Client(server, mode="legacy") as client:
        error = await tool_error(client, "claude_ask", {"prompt": "hello", "timeout_sec": 3})
    elapsed = time.monotonic() - started
    expected = "stalled" if backend == "api" and mode.startswith("stall") else "timeout"
    assert error.split("Error executing tool claude_ask: ")[-1].startswith(f"{expected}: "), error
    assert 2.5 <= elapsed < 3 + 4, elapsed
    assert fake.message_requests()[0].mode == mode


async def test_cancel_ends_a_running_job_within_seconds(server: Any, backend: str, fake: FakeAnthropic) -> None:
    async with Client(server, mode="legacy") as client:
        job = await call_tool(client, "claude_submit", {"prompt": "MODE:stall:120 think hard", "timeout_sec": 600})
        await wait_status(client, job["job_id"], ("running",))
        await wait_for(lambda: fake.message_requests(), 20, "the request to reach the fake")
        pid = task_store.get_claude_job(job["job_id"])["pid"]
        assert (pid is not None) == (backend == "cli")
        if pid:  # where the stalled CLI is connected right now: the fake on loopback, nothing else
            remote = {c.raddr.ip for c in psutil.Process(pid).net_connections("inet") if c.raddr}
            assert remote <= {"127.0.0.1"}, remote
        started = time.monotonic()
        cancelled = await call_tool(client, "claude_cancel", {"job_id": job["job_id"]})
        assert cancelled["cancelled"] and cancelled["status"] == "cancelled"
        assert time.monotonic() - started < 5
        if pid:
            await wait_for(lambda: gone(pid), 5, f"claude pid {pid} to exit")
        state = await call_tool(client, "claude_poll", {"job_id": job["job_id"]})
        assert state["status"] == "cancelled"
        error = await tool_error(client, "claude_result", {"job_id": job["job_id"]})
        assert "cancelled" in error
        again = await call_tool(client, "claude_cancel", {"job_id": job["job_id"]})
        assert not again["cancelled"] and "already finished" in again["message"]


async def test_api_backend_retries_transient_overload(server: Any, claude_env: dict, fake: FakeAnthropic,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_CODE_MAX_RETRIES", "2")
    async with Client(server, mode="legacy") as client:
        answer = await call_tool(client, "claude_ask", {"prompt": "MODE:failnext:2:529 try twice"})
    assert answer["answer"].startswith(DEFAULT_ANSWER)
    assert [r.mode for r in fake.message_requests()] == ["529", "529", "normal"]


# --------------------------------------------------------------------------------------------
# The CLI backend: login, odd output, stdin, process trees.

async def test_not_logged_in_is_a_clear_error(server: Any, claude_env: dict, fake: FakeAnthropic,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """No key and no login (HOME is empty): the auto backend is the CLI, which refuses at once."""
    monkeypatch.setenv("CLAUDE_BIN", require_real_claude())
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    async with Client(server, mode="legacy") as client:
        status = await call_tool(client, "claude_status")
        error = await tool_error(client, "claude_ask", {"prompt": "hello", "timeout_sec": 30})
    assert status["backend"] == "cli" and "ANTHROPIC_API_KEY is not set" in status["reason"]
    assert status["logged_in"] is False and not status["ready"] and status["problem"] == ccm.NOT_LOGGED_IN
    assert "not_logged_in: claude CLI is not logged in: run `claude login` or set ANTHROPIC_API_KEY" in error
    assert fake.message_requests() == []


async def test_real_cli_empty_result_is_an_error(server: Any, claude_env: dict, fake: FakeAnthropic,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The real CLI prints result "" with is_error false when the model says nothing."""
    monkeypatch.setenv("CLAUDE_BIN", require_real_claude())
    monkeypatch.setenv("CLAUDE_BACKEND", "cli")
    async with Client(server, mode="legacy") as client:
        error = await tool_error(client, "claude_ask", {"prompt": "MODE:empty say nothing", "timeout_sec": 30})
    assert "empty_answer: claude -p returned an empty answer" in error


async def test_long_prompt_goes_through_stdin(server: Any, claude_env: dict, fake: FakeAnthropic,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_BIN", require_real_claude())
    monkeypatch.setenv("CLAUDE_BACKEND", "cli")
    prompt = "-starts like an option. " + "lorem ipsum " * 12_000 + "THE-END"
    assert len(prompt.encode()) > ccm.STDIN_PROMPT_BYTES
    async with Client(server, mode="legacy") as client:
        answer = await call_tool(client, "claude_ask", {"prompt": prompt, "timeout_sec": 60})
    assert answer["answer"].startswith(DEFAULT_ANSWER)
    received = fake.message_requests()[-1].user_text()
    assert received.strip().startswith("-starts like an option.") and received.strip().endswith("THE-END")


def result_json(**fields: Any) -> str:
    base = {"type": "result", "subtype": "success", "is_error": False, "result": "ok", "session_id": "s",
            "usage": {"input_tokens": 5, "output_tokens": 6}, "total_cost_usd": 0.01}
    return json.dumps({**base, **fields})


ODD_SHAPES = [
    # (id, stdout, stderr, exit code, expected answer or error fragment)
    ("events-array", json.dumps([{"type": "system", "subtype": "init"},
                                 {"type": "assistant", "message": {"content": []}},
                                 json.loads(result_json(result="from the array"))]), "", 0, "=from the array"),
    ("json-lines", json.dumps({"type": "system"}) + "\n" + result_json(result="from lines"), "", 0, "=from lines"),
    ("empty-result", result_json(result=""), "", 0, "empty_answer: claude -p returned an empty answer"),
    ("is-error-exit-0", result_json(is_error=True, result="API Error: 529 Overloaded", api_error_status=529), "", 0,
     "overloaded: claude -p: the Anthropic API answered HTTP 529 overloaded_error (the CLI said: API Error: 529 "
     "Overloaded)"),
    ("is-error-401", result_json(is_error=True, result="Invalid API key · Fix external API key",
                                 api_error_status=401), "", 1,
     "auth: claude -p: the Anthropic API answered HTTP 401 authentication_error (the CLI said: Invalid API key"),
    ("error-only-on-stdout", "API Error: Request rejected (429) · rate limited\n", "", 1, "rate_limit: claude -p:"),
    ("not-logged-in-text", "Not logged in · Please run /login\n", "", 1, ccm.NOT_LOGGED_IN),
    ("truncated-json", result_json(result="cut")[:40], "", 0, "cli_output: claude -p printed JSON that does not parse"),
    ("errors-only", json.dumps({"type": "result", "subtype": "error_max_turns", "is_error": False,
                                "errors": ["Reached maximum number of turns (1)"]}), "", 0,
     "cli_output: claude -p returned no result (Reached maximum number of turns (1))"),
    ("nothing-at-all", "", "segfault in node\n", 2, "cli_output: claude -p printed nothing (exit 2); stderr: segfault"),
    ("plain-text-exit-0", "Hello there\n", "", 0, "cli_output: claude -p printed text instead of JSON"),
    ("no-result-event", json.dumps([{"type": "system"}]), "", 0, "cli_output: claude -p printed JSON without a result"),
    ("exit-1-no-is-error", result_json(result="partial"), "", 1, "cli_error: claude -p: partial"),
]


@pytest.mark.parametrize("stdout, stderr, rc, expected", [s[1:] for s in ODD_SHAPES], ids=[s[0] for s in ODD_SHAPES])
async def test_odd_cli_output_shapes(server: Any, fake_claude: Path, monkeypatch: pytest.MonkeyPatch,
                                     stdout: str, stderr: str, rc: int, expected: str) -> None:
    """field-failures 16, through the tool. The fake claude script prints each shape: the real CLI
    cannot be made to print most of them on demand (the empty result is also tested for real above)."""
    monkeypatch.setenv("FAKE_CLAUDE_STDOUT", stdout)
    monkeypatch.setenv("FAKE_CLAUDE_STDERR", stderr)
    monkeypatch.setenv("FAKE_CLAUDE_RC", str(rc))
    async with Client(server, mode="legacy") as client:
        result = await client.call_tool("claude_ask", {"prompt": "shape?", "timeout_sec": 20})
    if expected.startswith("="):
        assert not result.is_error, result.content[0].text
        assert result.structured_content["answer"] == expected[1:]
        assert result.structured_content["usage"]["input_tokens"] == 5
    else:
        assert result.is_error and expected in result.content[0].text, result.content[0].text


@contextlib.contextmanager
def protocol_bytes_on_fd0() -> Iterator[None]:
    """Make this process's fd 0 a pipe holding bytes, as a stdio server's stdin holds the
    JSON-RPC stream (the MCP SDK's own stdio transport diverts fd 0 while it serves, so the
    in-memory test is where a child inheriting stdin would show)."""
    read_end, write_end = os.pipe()
    saved = os.dup(0)
    os.write(write_end, b'{"jsonrpc": "2.0", "method": "ping", "id": 99}\n')
    os.dup2(read_end, 0)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)


async def test_cli_argv_and_stdin(server: Any, fake_claude: Path) -> None:
    """The fake script records its argv and stdin: JSON output, no tools, `--` before the prompt,
    stdin from /dev/null (never the server's own stdin); a long prompt comes on stdin instead."""
    with protocol_bytes_on_fd0():
        async with Client(server, mode="legacy") as client:
            await call_tool(client, "claude_ask", {"prompt": "--help", "model": "sonnet", "system": "Be brief."})
            await call_tool(client, "claude_ask", {"prompt": "x" * (ccm.STDIN_PROMPT_BYTES + 1)})
        assert select.select([0], [], [], 0)[0], "a child read the bytes waiting on the server's stdin"
        assert os.read(0, 100).startswith(b'{"jsonrpc"')
    short, long = fake_claude_calls(fake_claude)
    assert short["argv"] == ["-p", "--output-format", "json", "--tools", "", "--no-session-persistence",
                             "--model", "sonnet", "--system-prompt", "Be brief.", "--", "--help"]
    assert short["stdin_is_devnull"] and short["stdin_bytes"] == 0
    assert "--" not in long["argv"] and long["stdin_bytes"] == ccm.STDIN_PROMPT_BYTES + 1


async def test_timeout_and_cancel_kill_the_whole_tree(server: Any, fake_claude: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake script starts a child and a grandchild in a session of its own, then hangs: the
    timeout and claude_cancel must each leave none of them alive."""
    pids_file = tmp_path / "pids.json"
    monkeypatch.setenv("FAKE_CLAUDE_PIDS", str(pids_file))
    monkeypatch.setenv("FAKE_CLAUDE_SLEEP", "300")
    async with Client(server, mode="legacy") as client:
        started = time.monotonic()
        error = await tool_error(client, "claude_ask", {"prompt": "hang", "timeout_sec": 3})
        assert "timeout: claude -p gave no answer within 3 s" in error and time.monotonic() - started < 8
        pids = json.loads(pids_file.read_text())
        await wait_for(lambda: all(gone(p) for p in pids), 5, f"{pids} to die after the timeout")

        pids_file.unlink()
        job = await call_tool(client, "claude_submit", {"prompt": "hang", "timeout_sec": 600})
        await wait_for(pids_file.exists, 20, "the fake claude to start its children")
        await wait_for(lambda: len(pids_file.read_text()) > 2, 5, "the pids")
        pids = json.loads(pids_file.read_text())
        assert all(not gone(p) for p in pids)
        started = time.monotonic()
        assert (await call_tool(client, "claude_cancel", {"job_id": job["job_id"]}))["cancelled"]
        await wait_for(lambda: all(gone(p) for p in pids), 5, f"{pids} to die after the cancel")
        assert time.monotonic() - started < 6


async def test_a_client_giving_up_on_claude_ask_kills_the_cli(server: Any, fake_claude: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake script hangs with a child and a grandchild; the client cancels its request."""
    pids_file = tmp_path / "pids.json"
    monkeypatch.setenv("FAKE_CLAUDE_PIDS", str(pids_file))
    monkeypatch.setenv("FAKE_CLAUDE_SLEEP", "300")
    async with Client(server, mode="legacy") as client:
        with anyio.move_on_after(2):
            await client.call_tool("claude_ask", {"prompt": "hang", "timeout_sec": 600})
        pids = json.loads(pids_file.read_text())
        await wait_for(lambda: all(gone(p) for p in pids), 5, f"{pids} to die after the client gave up")
        assert len((await client.list_tools()).tools) == 6


async def test_a_job_cancelled_in_the_database_stops_here(server: Any, fake_claude: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Another bridge server (or a restart) finishing the record stops the call running here."""
    pids_file = tmp_path / "pids.json"
    monkeypatch.setenv("FAKE_CLAUDE_PIDS", str(pids_file))
    monkeypatch.setenv("FAKE_CLAUDE_SLEEP", "300")
    async with Client(server, mode="legacy") as client:
        job = await call_tool(client, "claude_submit", {"prompt": "hang", "timeout_sec": 600})
        await wait_for(lambda: pids_file.exists() and len(pids_file.read_text()) > 2, 20, "the fake claude's children")
        task_store.finish_claude_job(job["job_id"], "cancelled", error="cancelled elsewhere")
        pids = json.loads(pids_file.read_text())
        await wait_for(lambda: all(gone(p) for p in pids), 6, f"{pids} to die after the record was cancelled")
        state = await call_tool(client, "claude_poll", {"job_id": job["job_id"]})
    assert state["status"] == "cancelled" and state["error"] == "cancelled elsewhere"


# --------------------------------------------------------------------------------------------
# Status, arguments, unknown jobs.

async def test_status_with_a_key_never_shows_it(server: Any, claude_env: dict) -> None:
    async with Client(server, mode="legacy") as client:
        status = await call_tool(client, "claude_status")
    assert status["backend"] == "api" and status["api_key_present"] and status["ready"]
    assert "ANTHROPIC_API_KEY is set" in status["reason"] and status["model"] == ccm.DEFAULT_API_MODEL
    assert status["base_url"] == claude_env["ANTHROPIC_BASE_URL"]
    assert "sk-fake-test-key" not in json.dumps(status)


async def test_status_reports_the_cli(server: Any, backend: str) -> None:
    async with Client(server, mode="legacy") as client:
        status = await call_tool(client, "claude_status")
    assert status["backend"] == backend and status["ready"] and status["problem"] is None
    if backend == "cli":
        assert status["claude_bin"] == str(REAL_CLAUDE) and "Claude Code" in status["claude_version"]
        assert status["logged_in"] is True and status["auth_method"] == "api_key"


async def test_no_key_and_no_cli(server: Any, claude_env: dict, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    monkeypatch.setenv("CLAUDE_BIN", str(tmp_path / "no-such-claude"))
    async with Client(server, mode="legacy") as client:
        status = await call_tool(client, "claude_status")
        error = await tool_error(client, "claude_ask", {"prompt": "hello"})
        monkeypatch.setenv("CLAUDE_BACKEND", "api")
        forced = await tool_error(client, "claude_ask", {"prompt": "hello"})
        monkeypatch.setenv("CLAUDE_BACKEND", "gpt")
        bad = await tool_error(client, "claude_ask", {"prompt": "hello"})
    assert not status["ready"] and "set ANTHROPIC_API_KEY" in status["problem"]
    assert "no_backend: ANTHROPIC_API_KEY is not set and CLAUDE_BIN=" in error and "claude login" in error
    assert "no_backend: CLAUDE_BACKEND=api but ANTHROPIC_API_KEY is not set" in forced
    assert "CLAUDE_BACKEND must be auto, api or cli; got 'gpt'" in bad


@pytest.mark.parametrize("arguments, fragment", [
    ({"prompt": "   "}, "prompt must be non-empty text"),
    ({"prompt": "hi", "model": "bad model!"}, "model must be a model name"),
    ({"prompt": "hi", "timeout_sec": 0}, "timeout_sec"),
    ({"prompt": "hi", "timeout_sec": "soon"}, "timeout_sec"),
])
async def test_bad_arguments_are_refused_clearly(server: Any, claude_env: dict, arguments: dict,
                                                 fragment: str) -> None:
    async with Client(server, mode="legacy") as client:
        for tool in ("claude_ask", "claude_submit"):
            assert fragment in await tool_error(client, tool, arguments)
    assert task_store.list_claude_jobs() == []


@pytest.mark.parametrize("tool, arguments, fragments", [
    ("claude_poll", {"job_id": "x"}, ["job_id must be a whole number; got 'x'"]),
    ("claude_result", {}, ["job_id is required"]),
    ("claude_cancel", {"job_id": 0}, ["job_id must be ≥ 1; got 0"]),
    ("claude_ask", {"prompt": "hi", "timeout_sec": 3601, "model": 5},
     ["timeout_sec must be ≤ 3600; got 3601", "model "]),
    ("claude_submit", {"prompt": ["a"]}, ["prompt must be text (a JSON string)"]),
])
async def test_schema_failures_are_one_line_per_bad_argument(server: Any, claude_env: dict, tool: str,
                                                             arguments: dict, fragments: list[str]) -> None:
    async with Client(server, mode="legacy") as client:
        error = await tool_error(client, tool, arguments)
    assert error.startswith(f"invalid arguments for {tool}: ") and "\n" not in error, error
    assert all(f in error for f in fragments), error
    assert "validation error" not in error and "pydantic" not in error and "Error executing tool" not in error


ODD_NUMBERS = [10**23, -(10**23), 2**63, 10**400, "99999999999999999999999", "9" * 5000, -1, 0, 1.5, 1e300,
               "1e3", "0x10", True, [], {}, "", None]


async def test_every_numeric_argument_refuses_odd_numbers_clearly(server: Any, claude_env: dict) -> None:
    async with Client(server, mode="legacy") as client:
        for value in ODD_NUMBERS:
            for tool, arguments in [("claude_poll", {"job_id": value}), ("claude_result", {"job_id": value}),
                                    ("claude_cancel", {"job_id": value}),
                                    ("claude_submit", {"prompt": "p", "timeout_sec": value}),
                                    ("claude_ask", {"prompt": "p", "timeout_sec": value})]:
                result = await client.call_tool(tool, arguments)
                text = result.content[0].text
                assert "internal" not in text and "Error executing tool" not in text, (tool, value, text)
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63 - 1:
                    assert result.is_error and "must be" in text, (tool, value, text)


@pytest.mark.parametrize("field", ["prompt", "system", "model"])
async def test_a_nul_character_is_refused_naming_the_field(server: Any, claude_env: dict, field: str) -> None:
    arguments = {"prompt": "hello"} | {field: "a\x00b"}
    async with Client(server, mode="legacy") as client:
        for tool in ("claude_ask", "claude_submit"):
            error = await tool_error(client, tool, arguments)
            assert f"{field} contains a NUL character" in error and "internal" not in error, error
    assert task_store.list_claude_jobs() == []


def break_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> Path:
    path = tmp_path / "broken.db"
    path.write_bytes(b"not a database\n" * 100) if kind == "corrupt" else path.mkdir()
    monkeypatch.setenv("TASK_DB_PATH", str(path))
    return path


@pytest.mark.parametrize("kind", ["corrupt", "directory"])
async def test_a_broken_database_is_named_with_the_way_out(server: Any, claude_env: dict, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    path = break_database(tmp_path, monkeypatch, kind)
    async with Client(server, mode="legacy") as client:
        for tool, arguments in [("claude_submit", {"prompt": "p"}), ("claude_poll", {"job_id": 1}),
                                ("claude_result", {"job_id": 1}), ("claude_cancel", {"job_id": 1})]:
            error = await tool_error(client, tool, arguments)
            assert f"the task database {path} cannot be used" in error and "TASK_DB_PATH" in error, error
            assert "internal" not in error and "arguments" not in error
        assert (await call_tool(client, "claude_status"))["backend"] == "api"          # needs no database


@pytest.mark.parametrize("kind", ["corrupt", "missing-row"])
def test_a_job_whose_end_cannot_be_recorded_ends_quietly(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    if kind == "corrupt":
        path = break_database(tmp_path, monkeypatch, "corrupt")
        needle = f"the task database {path} cannot be used"
    else:
        needle = "Claude job 7 not found"
    ccm._record_end(7, {"status": "failed", "error": "overloaded: busy"})     # no exception escapes the thread
    assert "job 7 ended failed but that could not be recorded" in caplog.text and needle in caplog.text


async def test_with_a_broken_database_the_stdio_server_starts_and_lists_its_tools(tmp_path: Path) -> None:
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database\n" * 100)
    raw = RawStdio(server_env(TASK_DB_PATH=str(broken), CLAUDE_CONTROL_LOG_LEVEL="chatty"))
    try:
        raw.initialize()
        assert len(raw.send("tools/list")["result"]["tools"]) == 6
        polled = raw.send("tools/call", {"name": "claude_poll", "arguments": {"job_id": 1}})["result"]
        assert polled["isError"] and f"the task database {broken} cannot be used" in polled["content"][0]["text"]
    finally:
        assert raw.close() == 0
    err = raw.proc.stderr.read()
    assert "CLAUDE_CONTROL_LOG_LEVEL='CHATTY' is not one of" in err and "cannot check for interrupted jobs" in err
    assert "Traceback" not in err


async def test_unknown_and_unfinished_jobs(server: Any, claude_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", "x-fake-mode: slow:30")
    async with Client(server, mode="legacy") as client:
        for tool in ("claude_poll", "claude_result", "claude_cancel"):
            assert "Claude job 999 not found" in await tool_error(client, tool, {"job_id": 999})
        job = await call_tool(client, "claude_submit", {"prompt": "slow one", "timeout_sec": 60})
        await wait_status(client, job["job_id"], ("running",))
        assert "is still running" in await tool_error(client, "claude_result", {"job_id": job["job_id"]})
        await call_tool(client, "claude_cancel", {"job_id": job["job_id"]})


async def test_a_failed_job_keeps_its_reason(server: Any, claude_env: dict) -> None:
    async with Client(server, mode="legacy") as client:
        job = await call_tool(client, "claude_submit", {"prompt": "MODE:529 busy?"})
        state = await wait_status(client, job["job_id"], ("done", "failed", "cancelled"))
        assert state["status"] == "failed" and state["error"].startswith("overloaded: ")
        refused = await tool_error(client, "claude_result", {"job_id": job["job_id"]})
        assert f"job {job['job_id']} failed: overloaded: " in refused


async def test_jobs_wait_queued_beyond_max_parallel(claude_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_MAX_PARALLEL", "1")
    runner = ccm.JobRunner()
    try:
        async with Client(ccm.build_server(runner), mode="legacy") as client:
            first = await call_tool(client, "claude_submit", {"prompt": "MODE:slow:30 first", "timeout_sec": 60})
            await wait_status(client, first["job_id"], ("running",))
            second = await call_tool(client, "claude_submit", {"prompt": "second"})
            await anyio.sleep(0.5)
            assert (await call_tool(client, "claude_poll", {"job_id": second["job_id"]}))["status"] == "queued"
            await call_tool(client, "claude_cancel", {"job_id": first["job_id"]})
            assert (await wait_status(client, second["job_id"], ("done",)))["status"] == "done"
    finally:
        runner.shutdown()


# --------------------------------------------------------------------------------------------
# Over real stdio.

def server_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "CLAUDE_CONTROL_LOG_LEVEL": "DEBUG", **extra}


async def test_stdio_session_survives_ten_bridge_calls(backend: str) -> None:
    """Both protocol generations: the handshake one with the CLI, the newer one with the SDK."""
    mode = "legacy" if backend == "cli" else "auto"
    params = StdioServerParameters(command=sys.executable, args=[str(SCRIPT)], env=server_env())
    async with Client(params, mode=mode) as client:
        for number in range(10):
            if number % 2:
                answer = await call_tool(client, "claude_ask", {"prompt": f"question {number}", "timeout_sec": 60})
            else:
                job = await call_tool(client, "claude_submit", {"prompt": f"question {number}", "timeout_sec": 60})
                await wait_status(client, job["job_id"], ("done",))
                answer = await call_tool(client, "claude_result", {"job_id": job["job_id"]})
            assert answer["answer"].endswith(f"echo: question {number}")
        tools = await client.list_tools()
    assert sorted(t.name for t in tools.tools) == sorted(
        ["claude_ask", "claude_submit", "claude_poll", "claude_result", "claude_cancel", "claude_status"])


class RawStdio:
    """A JSON-RPC client over the server's raw pipes: every stdout line must be a JSON-RPC message."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, text=True, bufsize=1)
        self.next_id = 0
        self.lines: list[str] = []

    def send(self, method: str, params: dict | None = None, notify: bool = False) -> dict | None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params or {}}
        if not notify:
            self.next_id += 1
            message["id"] = self.next_id
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return None if notify else self._reply(self.next_id)

    def _reply(self, wanted: int) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"server closed stdout; stderr: {self.proc.stderr.read()[-2000:]}"
            self.lines.append(line)
            message = json.loads(line)  # a non-JSON byte on stdout fails the test here
            assert message.get("jsonrpc") == "2.0", line
            if message.get("id") == wanted:
                return message

    def initialize(self) -> None:
        reply = self.send("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                         "clientInfo": {"name": "raw-test", "version": "1"}})
        assert reply["result"]["serverInfo"]["name"] == "claude-control"
        self.send("notifications/initialized", notify=True)

    def tool(self, name: str, **arguments: Any) -> dict:
        reply = self.send("tools/call", {"name": name, "arguments": arguments})
        result = reply["result"]
        assert not result.get("isError"), result
        return result["structuredContent"]

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


async def test_stdio_stdout_is_only_json_rpc_and_children_never_read_it(fake_claude: Path) -> None:
    """Raw pipes: ten calls through the fake claude script, which records that its stdin is
    /dev/null and that it could read no byte; every stdout line is a JSON-RPC message."""
    raw = RawStdio(server_env())
    try:
        raw.initialize()
        for number in range(10):
            assert raw.tool("claude_ask", prompt=f"q{number}")["answer"] == f"fake cli: q{number}"
        listed = raw.send("tools/list")
        assert len(listed["result"]["tools"]) == 6
    finally:
        assert raw.close() == 0
    calls = fake_claude_calls(fake_claude)
    assert len(calls) == 10 and all(c["stdin_is_devnull"] and c["stdin_bytes"] == 0 for c in calls)
    assert all(json.loads(line)["jsonrpc"] == "2.0" for line in raw.lines)


def test_a_question_piped_before_stdin_closes_is_answered_before_exit(fake_claude: Path) -> None:
    """Raw bytes: initialize, a claude_ask that takes a second, claude_status, then stdin closes.
    The SDK cancelled the ask at stdin's end (its reply never written though claude ran); now
    every request read is answered before the server exits."""
    messages = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "pipe", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "claude_ask", "arguments": {"prompt": "piped", "timeout_sec": 60}},
        },
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "claude_status", "arguments": {}}},
    ]
    data = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
    done = subprocess.run([sys.executable, str(SCRIPT)], input=data, env=server_env(FAKE_CLAUDE_SLEEP="1"),
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    replies = {m["id"]: m for m in map(json.loads, done.stdout.splitlines()) if "id" in m}
    assert sorted(replies) == [1, 2, 3]
    assert replies[2]["result"]["structuredContent"]["answer"] == "fake cli: piped"
    assert [c["argv"][-1] for c in fake_claude_calls(fake_claude) if "-p" in c["argv"]] == ["piped"]


async def test_job_in_flight_when_the_server_is_killed_fails_after_restart(backend: str, fake: FakeAnthropic) -> None:
    env = server_env(ANTHROPIC_CUSTOM_HEADERS="x-fake-mode: stall:120")
    first = RawStdio(env)
    try:
        first.initialize()
        job_id = first.tool("claude_submit", prompt="long thought", timeout_sec=600)["job_id"]
        await wait_for(lambda: task_store.get_claude_job(job_id)["status"] == "running" and fake.message_requests(),
                 20, "the job to run")
        cli_pid = task_store.get_claude_job(job_id)["pid"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    finally:
        first.close()
    assert task_store.get_claude_job(job_id)["status"] == "running"  # nobody could record the death
    if backend == "cli":
        assert cli_pid and not gone(cli_pid)  # its own session: it outlived the server
    second = RawStdio(server_env())
    try:
        second.initialize()
        state = second.tool("claude_poll", job_id=job_id)
    finally:
        assert second.close() == 0
    assert state["status"] == "failed" and state["error"] == ccm.INTERRUPTED
    if backend == "cli":
        await wait_for(lambda: gone(cli_pid), 5, "the orphaned claude to be killed on restart")


async def test_sigterm_marks_jobs_interrupted_and_kills_the_cli(fake_claude: Path, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids.json"
    raw = RawStdio(server_env(FAKE_CLAUDE_PIDS=str(pids_file), FAKE_CLAUDE_SLEEP="300"))
    try:
        raw.initialize()
        job_id = raw.tool("claude_submit", prompt="hang", timeout_sec=600)["job_id"]
        await wait_for(lambda: pids_file.exists() and len(pids_file.read_text()) > 2, 20, "the fake claude's children")
        pids = json.loads(pids_file.read_text())
        raw.proc.send_signal(signal.SIGTERM)
        raw.proc.wait(15)
    finally:
        raw.close()
    job = task_store.get_claude_job(job_id)
    assert job["status"] == "failed" and job["error"] == ccm.INTERRUPTED
    await wait_for(lambda: all(gone(p) for p in pids), 5, f"{pids} to die with the server")


# --------------------------------------------------------------------------------------------
# Registration in OpenCode's config.

def test_register_opencode_merges_and_is_idempotent(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "opencode.json"
    config.write_text(json.dumps({"model": "fake/model", "mcp": {"other": {"type": "remote", "url": "http://x"}}}))
    assert ccm.main(["--register-opencode", "--config", str(config)]) == 0
    first = config.read_text()
    assert ccm.main(["--register-opencode", "--config", str(config)]) == 0
    assert config.read_text() == first
    data = json.loads(first)
    assert data["model"] == "fake/model" and data["mcp"]["other"] == {"type": "remote", "url": "http://x"}
    assert data["mcp"]["claude-control"] == {"type": "local", "command": [sys.executable, str(SCRIPT)],
                                             "enabled": True}
    printed = capsys.readouterr().out
    assert '"claude-control"' in printed and str(SCRIPT) in printed


def test_register_opencode_default_path_and_bad_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert ccm.main(["--register-opencode"]) == 0
    assert "claude-control" in json.loads((tmp_path / "xdg" / "opencode" / "opencode.json").read_text())["mcp"]
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  // a comment\n  "model": "x"\n}\n')
    assert ccm.main(["--register-opencode", "--config", str(broken)]) == 1
    assert "is not plain JSON" in capsys.readouterr().err and "// a comment" in broken.read_text()


@pytest.mark.real_opencode
def test_real_opencode_connects_to_the_registered_server(tmp_path: Path) -> None:
    """The registered block is valid for the pinned opencode: `opencode mcp list` starts the
    server and reports it connected."""
    from opencode_env import opencode_env, require_opencode_bin

    binary = require_opencode_bin()
    env = opencode_env(tmp_path, "http://127.0.0.1:9/v1")
    env.pop("OPENCODE_CONFIG")  # read the registered XDG config alone
    config = Path(env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
    assert subprocess.run([sys.executable, str(SCRIPT), "--register-opencode"], env=env, capture_output=True,
                          timeout=60).returncode == 0
    listed = subprocess.run([binary, "mcp", "list"], env={**env, "PWD": str(tmp_path)}, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert config.exists() and "claude-control" in listed.stdout and "connected" in listed.stdout, listed


@pytest.mark.real_opencode
def test_an_opencode_agent_asks_claude_through_the_bridge(claude_env: dict, fake: FakeAnthropic, opencode: Any,
                                                          tmp_path: Path) -> None:
    """The whole chain with real binaries: opencode run → this server (as configured by
    --register-opencode) → the real claude CLI → the fake Messages API, and the answer back into
    the agent's conversation."""
    from fake_openai import text, tool_call

    require_real_claude()
    opencode.configure({"mcp": {"claude-control": ccm.opencode_entry()}})
    opencode.env.update(claude_env, CLAUDE_BACKEND="cli", CLAUDE_BIN=str(REAL_CLAUDE))
    opencode.model.script("ask", [tool_call("claude-control_claude_ask", {"prompt": "Which file first?"}),
                                  text("Claude answered.")])
    work = tmp_path / "work"
    work.mkdir()
    run = opencode.run("SCRIPT:ask decide with the planner", cwd=work, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    tools = [t["function"]["name"] for t in opencode.model.step_requests("ask")[0]["json"]["tools"]]
    assert "claude-control_claude_ask" in tools, tools
    assert fake.message_requests()[-1].user_text() == "Which file first?"
    followup = json.dumps(opencode.model.step_requests("ask")[-1]["json"]["messages"])
    assert f"{DEFAULT_ANSWER} | echo: Which file first?" in followup
