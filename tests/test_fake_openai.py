"""Tests of the scripted OpenAI-compatible model, over plain HTTP, and one run of the real opencode.

Run: .venv/bin/python -m pytest tests/test_fake_openai.py -q   (add `-m "not real_opencode"` to
skip the ~5-10 s real-binary run).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import opencode_env as oc_env
from fake_openai import (
    ScriptedModel,
    default_usage,
    hang,
    http_error,
    stall_after,
    text,
    tool_call,
)
from opencode_env import OPENCODE_VERSION, OpenCode, opencode_config, opencode_env, parse_events

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SAMPLE_EVENTS = Path("/tmp/opencode_events_sample.jsonl")


def chat_body(user: Any, assistants: int = 0, *, stream: bool = True, tools: bool = True,
              cwd: str | None = "/tmp/proj") -> dict[str, Any]:
    """A request body like OpenCode's: system prompt, the user turn, `assistants` earlier turns."""
    system = f"You are a coding agent.\n<env>\n  Working directory: {cwd}\n</env>" if cwd else "Hi."
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": user}]
    for i in range(assistants):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    body: dict[str, Any] = {"model": "model", "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tools:
        body["tools"] = TOOLS
    return body


def post(model: ScriptedModel, body: dict[str, Any], timeout: float = 5) -> tuple[int, dict, bytes]:
    """POST to /v1/chat/completions; (status, headers, raw body), HTTP errors included."""
    request = urllib.request.Request(model.url + "/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def sse_data(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON, or the literal "[DONE]"."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert block == "", f"not an SSE data block: {block!r}"
    return out


def stream(model: ScriptedModel, body: dict[str, Any]) -> list[Any]:
    status, headers, raw = post(model, body)
    assert status == 200, raw
    assert headers["Content-Type"] == "text/event-stream"
    return sse_data(raw)


def content_of(chunks: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if isinstance(c, dict) and c["choices"])


def tool_calls_of(chunks: list[Any]) -> list[dict[str, Any]]:
    """Reassemble streamed tool calls the way a client does: by index, arguments concatenated."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if not isinstance(chunk, dict) or not chunk["choices"]:
            continue
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or []:
            call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.get("id") or call["id"]
            call["name"] = delta.get("function", {}).get("name") or call["name"]
            call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def finish_reason(chunks: list[Any]) -> str | None:
    reasons = [c["choices"][0]["finish_reason"] for c in chunks
               if isinstance(c, dict) and c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(reasons) == 1, reasons
    return reasons[0]


@pytest.fixture
def model(scripted_model: ScriptedModel) -> ScriptedModel:
    return scripted_model


# --- the stream format -----------------------------------------------------------------------


def test_text_step_streams_openai_chunks_then_usage_then_done(model: ScriptedModel) -> None:
    model.script("t", [text("The answer is forty-two, as computed.")])
    chunks = stream(model, chat_body("SCRIPT:t go"))

    assert chunks[-1] == "[DONE]"
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "chat.completion.chunk"
    assert usage_chunk["usage"] == {
        "prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
        "prompt_tokens_details": {"cached_tokens": 100},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    body_chunks = chunks[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == usage_chunk["id"] for c in body_chunks)
    assert body_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(body_chunks) > 3, "the text should arrive in several chunks"
    assert content_of(chunks) == "The answer is forty-two, as computed."
    assert finish_reason(chunks) == "stop"


def test_tool_call_step_streams_id_name_and_split_arguments(model: ScriptedModel) -> None:
    args = {"filePath": "{cwd}/hello.txt", "content": "hi {cwd}\n"}
    model.script("w", [tool_call("write", args)])
    chunks = stream(model, chat_body("SCRIPT:w", cwd="/tmp/my proj"))

    (call,) = tool_calls_of(chunks)
    assert call["id"].startswith("call_") and call["name"] == "write"
    assert json.loads(call["arguments"]) == {"filePath": "/tmp/my proj/hello.txt",
                                             "content": "hi /tmp/my proj\n"}
    heads = [d for c in chunks if isinstance(c, dict) and c["choices"]
             for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert heads[0]["type"] == "function" and heads[0]["function"]["arguments"] == ""
    assert len(heads) == 3, "head, then the arguments in two pieces"
    assert finish_reason(chunks) == "tool_calls"


def test_several_tool_calls_in_one_step_get_their_own_indexes(model: ScriptedModel) -> None:
    model.script("m", [tool_call([("read", {"filePath": "{cwd}/a"}), ("bash", {"command": "ls"})])])
    calls = tool_calls_of(stream(model, chat_body("SCRIPT:m")))
    assert [c["name"] for c in calls] == ["read", "bash"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"filePath": "/tmp/proj/a"}, {"command": "ls"}]
    assert calls[0]["id"] != calls[1]["id"]


def test_non_stream_request_gets_a_chat_completion(model: ScriptedModel) -> None:
    model.script("n", [tool_call("bash", {"command": "pwd"}), text("bye")])
    status, _, raw = post(model, chat_body("SCRIPT:n", stream=False))
    reply = json.loads(raw)
    assert status == 200 and reply["object"] == "chat.completion"
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"command": "pwd"}'}
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 100}

    reply = json.loads(post(model, chat_body("SCRIPT:n", 1, stream=False))[2])
    assert reply["choices"][0] == {"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "bye"}}
    assert reply["usage"]["prompt_tokens"] == 1010


# --- picking the script and the step ------------------------------------------------------------


def test_step_is_the_number_of_assistant_messages(model: ScriptedModel) -> None:
    model.script("s", [tool_call("bash", {"command": "one"}), tool_call("bash", {"command": "two"}),
                       text("three")])
    assert json.loads(tool_calls_of(stream(model, chat_body("SCRIPT:s", 1)))[0]["arguments"]) == {"command": "two"}
    assert json.loads(tool_calls_of(stream(model, chat_body("SCRIPT:s", 0)))[0]["arguments"]) == {"command": "one"}
    assert content_of(stream(model, chat_body("SCRIPT:s", 2))) == "three"
    assert content_of(stream(model, chat_body("SCRIPT:s", 7))) == "three", "a text last step repeats"
    assert [r["step"] for r in model.step_requests("s")] == [1, 0, 2, 7]
    assert [r["usage"]["prompt_tokens"] for r in model.step_requests("s")] == [1010, 1000, 1020, 1070]


def test_past_a_tool_call_last_step_the_answer_is_done(model: ScriptedModel) -> None:
    model.script("loop", [tool_call("bash", {"command": "x"})])
    chunks = stream(model, chat_body("SCRIPT:loop", 1))
    assert content_of(chunks) == "done" and finish_reason(chunks) == "stop"


def test_scripts_are_picked_by_token_in_any_message_shape(model: ScriptedModel) -> None:
    model.script("alpha", [text("from alpha")])
    model.script("beta", [text("from beta")])
    model.script("default", [text("from default")])
    parts = [{"type": "text", "text": "please run"}, {"type": "text", "text": "task SCRIPT:beta now"}]
    assert content_of(stream(model, chat_body(parts))) == "from beta"
    assert content_of(stream(model, chat_body("x SCRIPT:alpha."))) == "from alpha"
    assert content_of(stream(model, chat_body("no token here"))) == "from default"
    assert [r["script"] for r in model.requests] == ["beta", "alpha", "default"]


def test_unknown_script_is_a_400_that_names_it(model: ScriptedModel) -> None:
    model.script("known", [text("x")])
    status, _, raw = post(model, chat_body("SCRIPT:nope"))
    assert status == 400
    assert "no script 'nope' registered (known: known)" in json.loads(raw)["error"]["message"]
    status, _, raw = post(model, chat_body("no token"))
    assert status == 400 and "'default'" in json.loads(raw)["error"]["message"]


def test_request_without_tools_is_a_title_request(model: ScriptedModel) -> None:
    model.script("t", [tool_call("bash", {"command": "x"})])
    chunks = stream(model, chat_body("SCRIPT:t", tools=False))
    assert content_of(chunks) and finish_reason(chunks) == "stop"
    (entry,) = model.requests
    assert entry["kind"] == "title" and entry["step"] is None and model.step_requests("t") == []


def test_cwd_without_working_directory_line_is_a_clear_400(model: ScriptedModel) -> None:
    model.script("c", [text("in {cwd}")])
    status, _, raw = post(model, chat_body("SCRIPT:c", cwd=None))
    assert status == 400 and "Working directory" in json.loads(raw)["error"]["message"]
    assert content_of(stream(model, chat_body("SCRIPT:c", cwd="/srv/x"))) == "in /srv/x"


def test_usage_override_merges_over_the_step_defaults(model: ScriptedModel) -> None:
    model.script("u", [text("a", usage={"reasoning_tokens": 7, "cached_tokens": 0})])
    usage = stream(model, chat_body("SCRIPT:u", 3))[-2]["usage"]
    assert usage["prompt_tokens"] == default_usage(3)["prompt_tokens"] == 1030
    assert usage["completion_tokens"] == 53
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 7}
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_requests_are_recorded_with_headers_and_body(model: ScriptedModel) -> None:
    model.script("r", [text("a")])
    stream(model, chat_body("SCRIPT:r"))
    (entry,) = model.requests_for("r")
    assert entry["path"] == "/v1/chat/completions" and entry["json"]["stream"] is True
    assert entry["headers"]["Content-Type"] == "application/json"
    assert entry["cwd"] == "/tmp/proj" and entry["kind"] == "step"


def test_other_paths_are_404(model: ScriptedModel) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(model.url + "/models", timeout=5)
    assert err.value.code == 404 and model.requests[0]["kind"] == "not_found"


def test_bad_script_definitions_are_refused() -> None:
    model = ScriptedModel()
    with pytest.raises(ValueError, match="non-empty list"):
        model.script("x", [])
    with pytest.raises(ValueError, match="letters, digits"):
        model.script("a b", [text("x")])
    with pytest.raises(ValueError, match="args must be a dict"):
        tool_call("bash")
    with pytest.raises(RuntimeError, match="not started"):
        _ = model.url


# --- failures ------------------------------------------------------------------------------------


def test_http_error_uses_openai_error_shape_and_headers(model: ScriptedModel) -> None:
    model.script("e", [http_error(429, "slow down", {"retry-after-ms": "10"}),
                       http_error(500, "boom"), http_error(400, "bad tools")])
    status, headers, raw = post(model, chat_body("SCRIPT:e"))
    assert status == 429 and headers["retry-after-ms"] == "10"
    assert json.loads(raw) == {"error": {"message": "slow down", "type": "requests",
                                         "param": None, "code": "rate_limit_exceeded"}}
    status, _, raw = post(model, chat_body("SCRIPT:e", 1))
    assert status == 500 and json.loads(raw)["error"]["type"] == "server_error"
    status, _, raw = post(model, chat_body("SCRIPT:e", 2))
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_hang_never_answers_and_does_not_block_stop() -> None:
    model = ScriptedModel().start()
    model.script("h", [hang()])
    outcome: list[Any] = []

    def client() -> None:
        try:
            outcome.append(post(model, chat_body("SCRIPT:h"), timeout=30))
        except Exception as exc:  # the server closing on us is the expected end
            outcome.append(exc)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not (model.requests and model.requests[0]["kind"] == "step") and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert model.requests[0]["step"] == 0 and outcome == [], "a hang must not answer"

    started = time.monotonic()
    model.stop()
    assert time.monotonic() - started < 1.0
    thread.join(timeout=2)
    assert not thread.is_alive() and outcome and not isinstance(outcome[0], tuple)


def test_stall_after_sends_some_chunks_then_nothing(model: ScriptedModel) -> None:
    model.script("st", [stall_after("partial answer")])
    body = json.dumps(chat_body("SCRIPT:st")).encode()
    conn = http.client.HTTPConnection("127.0.0.1", model.port, timeout=0.5)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    received = b""
    with pytest.raises((socket.timeout, TimeoutError)):
        while True:
            piece = response.read1(65536)
            assert piece, "the stream must not end"
            received += piece
    assert content_of(sse_data(received)) == "partial answer"
    assert b"[DONE]" not in received and b"usage" not in received
    started = time.monotonic()
    model.stop()
    assert time.monotonic() - started < 1.0
    conn.close()


def test_client_disconnect_mid_stream_is_silent(model: ScriptedModel, capfd: pytest.CaptureFixture) -> None:
    model.script("big", [text("x" * 4_000_000)])
    body = json.dumps(chat_body("SCRIPT:big")).encode()
    sock = socket.create_connection(("127.0.0.1", model.port), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(1024).startswith(b"HTTP/1.0 200")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # RST while the server is still writing
    deadline = time.monotonic() + 5
    while not model.requests[0]["finished"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert model.requests[0]["finished"]
    model.script("after", [text("still serving")])
    assert content_of(stream(model, chat_body("SCRIPT:after"))) == "still serving"
    model.stop()
    assert capfd.readouterr().err == ""


# --- the environment -----------------------------------------------------------------------------


def test_opencode_env_isolates_everything_under_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENCODE_CONFIG_CONTENT", '{"model": "leak/leak"}')
    env = opencode_env(tmp_path, "http://127.0.0.1:9/v1", extra_config={
        "provider": {"fake": {"options": {"chunkTimeout": 3000}}}})
    for key in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME"):
        assert Path(env[key]).is_dir() and Path(env[key]).is_relative_to(tmp_path)
    assert "OPENCODE_CONFIG_CONTENT" not in env
    assert env["OPENCODE_DISABLE_MODELS_FETCH"] == "1" and env["WORKER_MODEL"] == "fake/model"
    assert env["npm_config_registry"].startswith("http://127.0.0.1:")
    plugin_dir = Path(env["XDG_CONFIG_HOME"]) / "opencode"
    assert (plugin_dir / "node_modules").is_dir()
    assert json.loads((plugin_dir / "package.json").read_text())["dependencies"] == {
        "@opencode-ai/plugin": OPENCODE_VERSION}
    lock = json.loads((plugin_dir / "package-lock.json").read_text())
    assert lock["packages"][""]["dependencies"] == {"@opencode-ai/plugin": OPENCODE_VERSION}
    config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    options = config["provider"]["fake"]["options"]
    assert options == {"baseURL": "http://127.0.0.1:9/v1", "apiKey": "x",
                       "headerTimeout": 60000, "chunkTimeout": 3000}
    assert config["model"] == config["small_model"] == "fake/model"
    assert config["enabled_providers"] == ["fake"] and config["snapshot"] is False
    assert config["provider"]["fake"]["models"]["model"]["cost"]["cache_write"] == 1.25
    assert "cost" not in opencode_config("http://x/v1", cost=False)["provider"]["fake"]["models"]["model"]


def test_missing_binary_skips_but_fails_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oc_env, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("OPENCODE_BIN", raising=False)
    monkeypatch.delenv("CI", raising=False)
    assert oc_env.opencode_bin() is None
    with pytest.raises(pytest.skip.Exception, match="install.sh --test"):
        oc_env.require_opencode_bin()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="OPENCODE_BIN"):
        oc_env.require_opencode_bin()
    monkeypatch.setenv("OPENCODE_BIN", "true")
    assert oc_env.require_opencode_bin() == shutil.which("true")


def test_opencode_fixture_applies_its_env_to_this_process(opencode: OpenCode) -> None:
    for key in ("HOME", "XDG_DATA_HOME", "OPENCODE_CONFIG", "OPENCODE_BIN", "WORKER_MODEL"):
        assert os.environ[key] == opencode.env[key]
    assert opencode.env["OPENCODE_BIN"] == opencode.bin
    config = json.loads(Path(opencode.env["OPENCODE_CONFIG"]).read_text())
    assert config["provider"]["fake"]["options"]["baseURL"] == opencode.model.url
    opencode.configure({"provider": {"fake": {"options": {"headerTimeout": 2000}}}})
    options = json.loads(Path(opencode.env["OPENCODE_CONFIG"]).read_text())["provider"]["fake"]["options"]
    assert options["headerTimeout"] == 2000 and options["baseURL"] == opencode.model.url


# --- the real binary -----------------------------------------------------------------------------


def make_repo(path: Path) -> Path:
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=Test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    (path / "README.md").write_text("# test repo\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    return path


@pytest.mark.real_opencode
def test_real_opencode_writes_runs_bash_and_reports_the_fakes_tokens(opencode: OpenCode, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("hello", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello from the fake\n"}),
        tool_call("bash", {"command": "echo ran-it", "description": "print a marker"},
                  usage={"reasoning_tokens": 7}),
        text("Wrote hello.txt and ran the echo."),
    ])
    started = time.monotonic()
    result = opencode.run("SCRIPT:hello Write hello.txt, then run echo.", repo)
    wall = time.monotonic() - started
    SAMPLE_EVENTS.write_text(result.stdout)
    print(f"\nopencode run wall time: {wall:.2f} s")

    assert result.returncode == 0, result.stderr
    assert (repo / "hello.txt").read_text() == "hello from the fake\n"
    events = parse_events(result.stdout)
    tools = {e["part"]["tool"]: e["part"]["state"] for e in events if e["type"] == "tool_use"}
    assert tools["write"]["status"] == "completed"
    assert tools["bash"]["status"] == "completed" and tools["bash"]["metadata"]["exit"] == 0
    assert "ran-it" in tools["bash"]["output"]
    finishes = [e["part"] for e in events if e["type"] == "step_finish"]
    assert [f["reason"] for f in finishes] == ["tool-calls", "tool-calls", "stop"]
    texts = [e["part"]["text"] for e in events if e["type"] == "text"]
    assert texts == ["Wrote hello.txt and ran the echo."]

    sent = [r["usage"] for r in opencode.model.step_requests("hello")]
    assert [r["step"] for r in opencode.model.step_requests("hello")] == [0, 1, 2]
    for finish, usage in zip(finishes, sent, strict=True):
        tokens = finish["tokens"]
        assert tokens["input"] == usage["prompt_tokens"] - usage["cached_tokens"]
        assert tokens["cache"]["read"] == usage["cached_tokens"]
        assert tokens["output"] == usage["completion_tokens"] - usage["reasoning_tokens"]
        assert tokens["reasoning"] == usage["reasoning_tokens"]
        expected_cost = (tokens["input"] * 1.0 + (tokens["output"] + tokens["reasoning"]) * 2.0
                         + tokens["cache"]["read"] * 0.1) / 1e6
        assert finish["cost"] == pytest.approx(expected_cost)
    assert sum(f["tokens"]["input"] for f in finishes) == 900 + 910 + 920

    plugin_dir = Path(opencode.env["XDG_CONFIG_HOME"]) / "opencode"
    assert list((plugin_dir / "node_modules").iterdir()) == [], "no npm install may have run"


@pytest.mark.real_opencode
def test_pinned_binary_has_the_pinned_version(opencode: OpenCode) -> None:
    result = subprocess.run([opencode.bin, "--version"], env=opencode.env, capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == OPENCODE_VERSION
