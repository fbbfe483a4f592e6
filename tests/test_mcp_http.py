"""The HTTP side of the MCP server: streamable-http and sse live on a loopback port with the SDK
client, progress during wait_for, a stale Mcp-Session-Id after a restart, and the security rules
(bearer token on /mcp, /sse, /messages, /api; Host allowlist on every route; refusal to serve a
non-loopback address without a token; the token never in a log)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Implementation
from starlette.testclient import TestClient

import opencode_bridge_mcp as bridge
import task_store
from helpers import BRIDGE_TOOL_COUNT, ROOT, free_port, serving, wait_healthy

TOKEN = "s3cret-token-value-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROTECTED = [("GET", "/api/status"), ("GET", "/api/tasks"), ("POST", "/mcp"), ("GET", "/mcp"),
             ("GET", "/sse"), ("POST", "/messages/?session_id=0123")]
OPEN = [("GET", "/health"), ("GET", "/")]
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "raw-test", "version": "1"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(autouse=True)
def token(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)


@pytest.fixture
def wd(tmp_path) -> str:
    (tmp_path / "project").mkdir()
    return str(tmp_path / "project")


def http_client(base: str, **kw) -> Client:
    transport = streamable_http_client(f"{base}/mcp", http_client=httpx2.AsyncClient(headers=AUTH, timeout=30))
    return Client(transport, client_info=Implementation(name="claude-code", version="2.1.197"), **kw)


def sse(base: str) -> Client:
    return Client(sse_client(f"{base}/sse", headers=AUTH), mode="legacy",
                  client_info=Implementation(name="openai-mcp", version="1.0.0"))


def finish_later(task_id: str, delay: float) -> threading.Timer:
    def finish() -> None:
        claimed = task_store.claim_next("test-worker", task_id=task_id)
        task_store.complete_attempt(task_id, claimed["run_marker"], result={"summary": "ok"})
    timer = threading.Timer(delay, finish)
    timer.start()
    return timer


# ---------------------------------------------------------------------------------------------
# Live transports.


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_streamable_http_live(mode, wd):
    with serving() as base:
        async with http_client(base, mode=mode) as c:
            assert len((await c.list_tools()).tools) == BRIDGE_TOOL_COUNT
            sent = await c.call_tool("submit_task", {"title": "over http", "instructions": "x", "working_dir": wd})
            assert not sent.is_error, sent.content[0].text
            got = await c.call_tool("get_task", {"task_id": sent.structured_content["id"]})
            ping = await c.call_tool("ping", {})
            bad = await c.call_tool("get_task", {"task_id": "t_0404"})
    assert got.structured_content["origin_name"] == "claude-code"
    assert got.structured_content["origin_kind"] == "claude"
    assert ping.structured_content["caller"]["version"] == "2.1.197"
    assert bad.is_error and bad.content[0].text.startswith("task t_0404 not found")


@pytest.mark.anyio
async def test_sse_live(wd):
    with serving() as base:
        async with sse(base) as c:
            assert len((await c.list_tools()).tools) == BRIDGE_TOOL_COUNT
            sent = await c.call_tool("submit_task", {"title": "over sse", "instructions": "x", "working_dir": wd})
            ping = await c.call_tool("ping", {})
    assert sent.structured_content["origin_kind"] == "chatgpt"
    assert ping.structured_content["caller"] == {"name": "openai-mcp", "version": "1.0.0", "kind": "chatgpt"}


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
async def test_progress_notifications_arrive_during_wait_for(transport, wd, monkeypatch):
    monkeypatch.setattr(bridge, "PROGRESS_EVERY_SEC", 0.3)
    progress: list[tuple] = []

    async def on_progress(value, total, message):
        progress.append((time.monotonic(), value, total, message))

    with serving() as base:
        async with (http_client(base, mode="legacy") if transport != "sse" else sse(base)) as c:
            sent = await c.call_tool("submit_task", {"title": "slow", "instructions": "x", "working_dir": wd})
            task_id = sent.structured_content["id"]
            timer = finish_later(task_id, 1.6)
            started = time.monotonic()
            waited = await c.call_tool("wait_for", {"task_ids": [task_id], "timeout_sec": 60},
                                       progress_callback=on_progress)
            returned = time.monotonic()
            timer.join()
    assert not waited.is_error and waited.structured_content["met"] is True
    assert 1.5 < returned - started < 5
    assert len(progress) >= 3, progress
    assert all(started < at < returned for at, *_ in progress)
    assert progress[0][2] == 60 and f"{task_id} pending" in progress[0][3]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
async def test_a_wait_for_in_progress_when_the_server_is_stopped_gets_an_answer_saying_so(transport, wd):
    """SIGTERM to the server during a long wait_for: the call answers at once with an error that
    says the server is stopping and to call again (the client got an empty 200 stream: the wait
    ran on until the shutdown's grace period cancelled it mid-request)."""
    task_id = task_store.submit_task(title="never claimed", instructions="x", working_dir=wd)["id"]
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "opencode_bridge_mcp.py"), "--transport", transport,
                             "--port", str(port)], env=dict(os.environ), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        base = f"http://127.0.0.1:{port}"
        async with (http_client(base) if transport != "sse" else sse(base)) as c:
            async def stop_soon() -> None:
                await anyio.sleep(1.5)
                proc.terminate()

            async with anyio.create_task_group() as group:
                group.start_soon(stop_soon)
                started = time.monotonic()
                with anyio.fail_after(20):
                    waited = await c.call_tool("wait_for", {"task_ids": [task_id], "timeout_sec": 60})
        assert waited.is_error, waited
        text = waited.content[0].text
        assert "the server is stopping" in text and "call wait_for again" in text, text
        assert time.monotonic() - started < 1.5 + 3, "answered within the shutdown's grace period"
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1].decode(errors="replace")
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.anyio
async def test_a_stale_session_id_after_restart_gets_404_and_a_new_session_works(wd):
    port = free_port()
    with serving(port) as base:
        async with http_client(base, mode="legacy") as c:
            sent = await c.call_tool("submit_task", {"title": "survives", "instructions": "x", "working_dir": wd})
        async with httpx2.AsyncClient(headers=AUTH | MCP_HEADERS) as raw:
            first = await raw.post(f"{base}/mcp", json=INIT)
            session = first.headers["mcp-session-id"]
            assert first.status_code == 200 and session
    with serving(port) as base:
        async with httpx2.AsyncClient(headers=AUTH | MCP_HEADERS) as raw:
            stale = await raw.post(
                f"{base}/mcp",
                headers={"mcp-session-id": session, "mcp-protocol-version": "2025-06-18"},
                json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            )
        assert stale.status_code == 404
        message = said(stale, "/mcp")
        assert message.startswith("Session not found") and "initialize without an Mcp-Session-Id" in message, message
        async with http_client(base, mode="legacy") as c:
            got = await c.call_tool("get_task", {"task_id": sent.structured_content["id"]})
    assert got.structured_content["title"] == "survives"


# ---------------------------------------------------------------------------------------------
# Security (in-process ASGI).


def asgi(host: str = "127.0.0.1:8765") -> TestClient:
    return TestClient(bridge.build_app(), base_url=f"http://{host}")


def said(response, path: str) -> str:
    """A refusal's message: on /mcp from the JSON-RPC error every refusal there is (the shape the
    SDK's client hands its caller), elsewhere from ``{"error": ...}``."""
    assert response.headers["content-type"] == "application/json", response.text
    body = response.json()
    if path.split("?")[0] == "/mcp":
        assert body["jsonrpc"] == "2.0" and body["id"] is None and body["error"]["code"] < 0, body
        return body["error"]["message"]
    return body["error"]


def call(client: TestClient, method: str, path: str, **kw):
    if method == "POST":
        kw.setdefault("json", INIT)
        kw["headers"] = MCP_HEADERS | kw.get("headers", {})
    return client.request(method, path, **kw)


@pytest.mark.parametrize("method,path", PROTECTED)
@pytest.mark.parametrize("sent", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer "])
def test_protected_routes_refuse_a_missing_or_wrong_token(method, path, sent):
    headers = {"Authorization": sent} if sent else {}
    response = call(asgi(), method, path, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith('Bearer realm="taskbridge"')
    assert "bearer token" in said(response, path) and TOKEN not in response.text


@pytest.mark.parametrize("method,path", OPEN)
def test_health_and_board_stay_open_and_health_reveals_nothing(method, path):
    response = call(asgi(), method, path)
    assert response.status_code == 200
    if path == "/health":
        assert response.json() == {"ok": True, "version": bridge.VERSION}
    else:
        assert "TaskBridge" in response.text and response.headers["content-type"].startswith("text/html")


def test_api_with_the_token(wd):
    task_store.submit_task(title="one", instructions="x", working_dir=wd, origin_name="claude-ai")
    client = asgi()
    status = client.get("/api/status", headers=AUTH)
    assert status.status_code == 200 and status.json()["counts"]["pending"] == 1
    assert status.json()["version"] == bridge.VERSION and status.json()["worker"]["seen"] is False
    tasks = client.get("/api/tasks?limit=5&origin=claude", headers=AUTH).json()
    assert tasks["total"] == 1 and tasks["tasks"][0]["id"] == "t_0001" and "instructions" not in tasks["tasks"][0]
    assert client.get(f"/api/status?token={TOKEN}").status_code == 200     # connectors without headers
    too_many = client.get("/api/tasks?limit=500", headers=AUTH)
    assert too_many.status_code == 400 and "limit must be from 1 to 200" in too_many.json()["error"]
    bogus = client.get("/api/tasks?status=bogus", headers=AUTH)
    assert bogus.status_code == 400 and "'bogus'" in bogus.json()["error"]


FOREIGN = [
    "evil.example.com",
    "evil.example.com:8765",
    "localhost.evil.com",
    "127.0.0.1.nip.io:80",
    "abc.ngrok-free.app",
]


@pytest.mark.parametrize("host", FOREIGN)
@pytest.mark.parametrize("method,path", PROTECTED + OPEN)
def test_a_foreign_host_gets_421_on_every_route(host, method, path):
    response = call(asgi(host), method, path, headers=AUTH)
    assert response.status_code == 421
    error = said(response, path)
    assert f"the Host {host.split(':')[0]!r} is not on this server's allowlist" in error, error
    assert "add it to MCP_ALLOWED_HOSTS" in error


@pytest.mark.parametrize("host", ["abc.ngrok-free.app", "abc.ngrok-free.app:443", "ABC.Ngrok-Free.App",
                                  "Tunnel.Example.org:8443", "localhost:9", "127.0.0.1", "[::1]:8765"])
def test_allowed_hosts_any_port_any_case_reach_every_route(host, monkeypatch):
    monkeypatch.setenv("MCP_ALLOWED_HOSTS", " abc.ngrok-free.app , https://tunnel.example.org ")
    with asgi(host) as client:                   # runs the lifespan: /mcp reaches the SDK
        assert client.get("/health").status_code == 200
        assert client.get("/api/status", headers=AUTH).status_code == 200
        init = call(client, "POST", "/mcp", headers=AUTH)
        assert init.status_code == 200, init.text
        assert "mcp-session-id" in init.headers and "taskbridge" in init.text


MCP_ROUTES = [("POST", "/mcp"), ("GET", "/mcp"), ("GET", "/sse"), ("POST", "/messages/?session_id=0123")]


def test_a_foreign_origin_is_refused_in_the_shape_of_every_other_error(monkeypatch):
    # The SDK answered it with a plain-text "Invalid Origin header" (found by a new-user test).
    with serving() as base, httpx2.Client(base_url=base, headers=AUTH | MCP_HEADERS, timeout=30) as http:
        for method, path in MCP_ROUTES:
            body = {"content": json.dumps(INIT)} if method == "POST" else {}
            refused = http.request(method, path, headers={"Origin": "https://evil.example"}, **body)
            assert refused.status_code == 403, (path, refused.text)
            error = said(refused, path)
            assert "'https://evil.example'" in error and "MCP_ALLOWED_HOSTS" in error, error
        ours = http.post("/mcp", headers={"Origin": "http://127.0.0.1:8765"}, content=json.dumps(INIT))
        assert ours.status_code == 200, ours.text
        not_json = http.post("/mcp", headers={"Content-Type": "text/plain"}, content=json.dumps(INIT))
        assert not_json.status_code == 400 and "application/json" in said(not_json, "/mcp"), not_json.text
    monkeypatch.setenv("MCP_ALLOWED_HOSTS", "evil.example")   # the way out the message names
    with serving() as base:
        init = httpx2.post(f"{base}/mcp", headers=AUTH | MCP_HEADERS | {"Origin": "https://evil.example"},
                           content=json.dumps(INIT), timeout=30)
        assert init.status_code == 200, init.text


@pytest.mark.parametrize("method,headers,status,words", [
    ("GET", {}, 400, ["Missing session ID", "send the Mcp-Session-Id header"]),
    ("PUT", {}, 405, ["Method Not Allowed", "/mcp takes POST"]),
    ("POST", {"mcp-session-id": "0" * 32}, 404, ["Session not found", "start a new one"]),
])
def test_the_sdks_own_refusals_on_mcp_name_the_way_out(method, headers, status, words):
    """The SDK answered these as JSON-RPC errors with its bare words ("Method Not Allowed")."""
    with serving() as base, httpx2.Client(base_url=base, headers=AUTH | MCP_HEADERS, timeout=30) as http:
        refused = http.request(method, "/mcp", headers=headers, content=json.dumps(INIT))
    assert refused.status_code == status, refused.text
    message = said(refused, "/mcp")
    assert all(word in message for word in words), message
    assert int(refused.headers["content-length"]) == len(refused.content)


MALFORMED = ["localhost:evil.com", "127.0.0.1:1@evil.com", "localhost:1@evil.com", "[::1]:1@evil.com",
             "127.0.0.1:8765:80", "localhost:", "localhost:99999", "localhost:-1", "user@localhost",
             "localhost/evil", "localhost evil", "[::1]evil", "::1"]


@pytest.mark.parametrize("host", MALFORMED)
def test_a_host_with_anything_but_digits_after_the_colon_gets_421_on_every_route(host):
    with asgi() as client:                       # the lifespan runs: /mcp would reach the SDK
        for method, path in PROTECTED + OPEN:
            response = call(client, method, path, headers=AUTH | {"Host": host})
            assert response.status_code == 421, (host, method, path, response.text)
            error = said(response, path)
            assert error.startswith("the Host header is malformed") and "evil" not in error, error


def test_two_host_headers_get_421():
    scope_headers = [(b"host", b"127.0.0.1:8765"), (b"host", b"evil.example.com")]
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send):          # never reached
        raise AssertionError("the request got through")

    guard = bridge.HostGuard(app, bridge.allowed_hosts())
    anyio.run(guard, {"type": "http", "headers": scope_headers, "path": "/health"}, None, send)
    assert sent[0]["status"] == 421
    assert b"exactly one Host header (2 sent)" in sent[1]["body"]


@pytest.mark.parametrize("host", ["LOCALHOST.:8765", "Localhost", "[::1]", "127.0.0.1:0080"])
def test_the_sdk_sees_the_canonical_host_so_both_checks_agree(host):
    with asgi() as client:
        init = call(client, "POST", "/mcp", headers=AUTH | {"Host": host})
        assert init.status_code == 200, init.text


def test_the_token_file_is_used_when_the_env_is_empty(tmp_path, monkeypatch):
    monkeypatch.delenv("MCP_BEARER_TOKEN")
    (tmp_path / "token").write_text("from-the-file\n")
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "token"))
    client = asgi()
    assert client.get("/api/status").status_code == 401
    assert client.get("/api/status", headers={"Authorization": "Bearer from-the-file"}).status_code == 200


def test_without_any_token_loopback_stays_usable(monkeypatch):
    monkeypatch.delenv("MCP_BEARER_TOKEN")
    assert asgi().get("/api/status").status_code == 200
    assert asgi("evil.example.com").get("/api/status").status_code == 421


@pytest.mark.parametrize("kind", ["corrupt", "directory"])
def test_the_api_answers_a_broken_database_with_503_naming_the_file(kind, tmp_path, monkeypatch):
    path = tmp_path / "broken.db"
    path.write_bytes(b"not sqlite\n" * 100) if kind == "corrupt" else path.mkdir()
    monkeypatch.setenv("TASK_DB_PATH", str(path))
    client = TestClient(bridge.build_app(), base_url="http://127.0.0.1:8765", raise_server_exceptions=False)
    for route in ("/api/status", "/api/tasks", "/api/tasks?limit=5&status=pending"):
        response = client.get(route, headers=AUTH)
        assert response.status_code == 503, (route, response.text)
        error = response.json()["error"]
        assert f"the task database {path} cannot be used" in error and "TASK_DB_PATH" in error
        assert "Traceback" not in response.text
    assert client.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------
# Token configuration: a token source that is set but unusable stops the server.


def unusable_token(kind: str, tmp_path, monkeypatch) -> str:
    """Configure an unusable token source; returns what the refusal must say."""
    path = tmp_path / "token"
    if kind in ("blank", "spaces"):
        monkeypatch.setenv("MCP_BEARER_TOKEN", "" if kind == "blank" else " \t ")
        return "MCP_BEARER_TOKEN is set but blank"
    monkeypatch.delenv("MCP_BEARER_TOKEN")
    monkeypatch.setenv("MCP_TOKEN_FILE", str(path))
    if kind == "directory":
        path.mkdir()
        return f"the token file {path} is a folder"
    if kind == "empty":
        path.write_text("  \n")
        return f"the token file {path} is empty"
    if kind == "two-lines":
        path.write_text("first-token\nsecond-token\n")
        return "whitespace or non-ASCII"
    if kind == "not-text":
        path.write_bytes(b"\xff\xfe\x00bad")
        return f"cannot read the token file {path}"
    (tmp_path / "file").write_text("x")              # unreadable: its folder is a file
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "file" / "token"))
    return f"cannot read the token file {tmp_path / 'file' / 'token'}"


TOKEN_KINDS = ["blank", "spaces", "directory", "empty", "two-lines", "not-text", "unreadable"]


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_an_unusable_token_source_is_refused_by_name(kind, tmp_path, monkeypatch):
    needle = unusable_token(kind, tmp_path, monkeypatch)
    with pytest.raises(bridge.TokenConfigError) as refused:
        bridge.bearer_token()
    assert needle in str(refused.value) and "second-token" not in str(refused.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_token_file_without_read_permission_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("MCP_BEARER_TOKEN")
    (tmp_path / "token").write_text("secret\n")
    (tmp_path / "token").chmod(0)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "token"))
    with pytest.raises(bridge.TokenConfigError, match="cannot read the token file"):
        bridge.bearer_token()


def test_no_token_source_at_all_is_not_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MCP_BEARER_TOKEN")
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "missing" / "token"))
    assert bridge.bearer_token() is None


# ---------------------------------------------------------------------------------------------
# The command line.


def start_cli(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(bridge.REPO_DIR / "opencode_bridge_mcp.py"), *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_refuses_a_public_address_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "MCP_BEARER_TOKEN"}
    proc = start_cli("--transport", "streamable-http", "--host", "0.0.0.0", "--port", str(free_port()), env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == b""
    assert b"refusing to serve on 0.0.0.0 without a bearer token" in err and b"MCP_BEARER_TOKEN" in err


@pytest.mark.parametrize("kind", ["blank", "directory", "empty", "unreadable"])
def test_the_cli_refuses_to_start_on_loopback_with_an_unusable_token(kind, tmp_path, monkeypatch):
    needle = unusable_token(kind, tmp_path, monkeypatch)
    proc = start_cli("--transport", "streamable-http", "--port", str(free_port()), env=dict(os.environ))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == b"", err.decode()
    assert b"refusing to start: " + needle.encode() in err and b"Traceback" not in err


@pytest.mark.parametrize("args,needle", [
    (["--port", "99999"], "99999 is not a port number: give 0-65535"),
    (["--port", "-1"], "-1 is not a port number"),
    (["--port", "65536"], "65536 is not a port number"),
    (["--port", "80x"], "'80x' is not a port number"),
    (["--host", ""], "the address is empty"),
    (["--host", "no such host.invalid"], "cannot bind to 'no such host.invalid'"),
    (["--log-level", "LOUD"], "invalid choice: 'LOUD'"),
    (["--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
])
def test_bad_command_line_values_end_in_a_usage_error(args, needle, capsys):
    with pytest.raises(SystemExit) as ended:
        bridge.parse_args(args)
    assert ended.value.code == 2 and needle in capsys.readouterr().err


def test_the_extreme_ports_are_accepted():
    assert bridge.parse_args(["--port", "0"]).port == 0 and bridge.parse_args(["--port", "65535"]).port == 65535


def test_a_port_out_of_range_on_the_command_line_is_a_usage_error_not_a_traceback():
    proc = start_cli("--transport", "streamable-http", "--port", "99999", env=dict(os.environ))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and b"Traceback" not in err and b"not a port number" in err


def test_a_taken_port_or_a_foreign_address_is_one_line_before_any_start_up_log():
    # uvicorn logged "on http://…", "Application startup complete", then a raw "[Errno 98]"
    # (found by a new-user test).
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = start_cli("--transport", "streamable-http", "--port", str(port), env=dict(os.environ))
        _, err = proc.communicate(timeout=60)
    said = err.decode().strip()
    assert proc.returncode == 1 and len(said.splitlines()) == 1, said
    assert f"cannot serve on 127.0.0.1:{port}: the port is taken by python" in said and "another --port" in said
    assert f"(pid {os.getpid()})" in said and "TaskBridge MCP" not in said
    proc = start_cli("--transport", "streamable-http", "--host", "192.0.2.7", "--port", str(port),
                     env=dict(os.environ))
    _, err = proc.communicate(timeout=60)
    said = err.decode().strip()
    assert proc.returncode == 1 and "give --host an address of this machine" in said and "Traceback" not in said



def test_the_http_server_refuses_a_queue_file_that_is_no_database_before_serving(tmp_path):
    # It served until killed, every tool call failing (found by a new-user test); serve.py, the
    # worker and the CLI refused at once.
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not SQLite at all " * 50)
    proc = start_cli("--transport", "streamable-http", "--port", str(free_port()), "--db", str(junk),
                     env=dict(os.environ))
    _, err = proc.communicate(timeout=60)
    said = err.decode().strip()
    assert proc.returncode == 1 and len(said.splitlines()) == 1, said
    assert f"refusing to start: the task database {junk} cannot be used" in said and "move it aside" in said
    assert junk.read_bytes() == b"not SQLite at all " * 50


@pytest.mark.parametrize("transport", ["sse", "streamable-http"])
def test_the_cli_serves_one_port_and_never_logs_the_token(transport):
    port = free_port()
    proc = start_cli("--transport", transport, "--port", str(port), "--log-level", "DEBUG", env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        assert httpx2.get(f"{base}/api/status?token={TOKEN}").status_code == 200
        assert httpx2.get(f"{base}/api/status?token=wrong-{TOKEN}").status_code == 401
        init = httpx2.post(f"{base}/mcp", headers=AUTH | MCP_HEADERS, content=json.dumps(INIT))
        assert init.status_code == 200 and "taskbridge" in init.text
        with httpx2.stream("GET", f"{base}/sse", headers=AUTH) as stream:
            assert stream.status_code == 200
            assert next(stream.iter_lines()).startswith("event: endpoint")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert TOKEN.encode() not in err and TOKEN.encode() not in out
    assert b"TaskBridge MCP" in err            # it did log, to stderr


# --------------------------------------------------------------------------------------------
# Bodies the board's actions refuse, over a real port: unknown keys, wrong types, deep or huge JSON.

DEEP = b'{"text": ' + b"[" * 2000 + b"]" * 2000 + b"}"


def test_board_actions_refuse_unknown_keys_wrong_shapes_and_deep_or_huge_bodies(wd, caplog):
    """A key an action does not take was ignored (200), and 4 KB of nested arrays crashed the JSON
    parser (500 with a RecursionError traceback in the log). Every case is now one 400/413 line
    naming the problem, nothing changes, and nothing is logged as a crash."""
    task = task_store.submit_task(title="t", instructions="i", working_dir=wd)
    waiting = task_store.submit_task(title="w", instructions="i", working_dir=wd)
    claimed = task_store.claim_next("test-worker", task_id=waiting["id"])
    task_store.pause_for_question(waiting["id"], claimed["run_marker"], "Which port?")
    tid, wid = task["id"], waiting["id"]
    cases = [  # (task, action, raw body, status, words the one-line error holds)
        (tid, "note", {"text": "ok", "extra": 1}, 400, ["'extra'", "text (required text)"]),
        (wid, "answer", {"answer": "8080", "answr": "x"}, 400, ["'answr'", "answer (required text)"]),
        (tid, "cancel", {"reson": "typo"}, 400, ["'reson'", "reason (optional text)"]),
        (tid, "retry", {"model": "a/b", "notes": "x"}, 400, ["'notes'", "note (optional text)"]),
        (tid, "note", {}, 400, ["text must be text", "got nothing"]),
        (tid, "note", {"text": ["a"]}, 400, ["text must be text", "got a JSON array"]),
        (tid, "note", {"text": {"a": 1}}, 400, ["got a JSON object"]),
        (wid, "answer", {"answer": True}, 400, ["got a JSON boolean"]),
        (tid, "cancel", {"reason": 5}, 400, ["reason must be text", "got a JSON number"]),
        (tid, "retry", {"note": ["x"]}, 400, ["note must be text"]),
        (tid, "note", {"text": "x" * (task_store.NOTE_MAX + 1)}, 400, ["the limit is 20000"]),
        (tid, "cancel", {"reason": "x" * (task_store.NOTE_MAX + 1)}, 400, ["reason is", "the limit is 20000"]),
        (tid, "note", DEEP, 400, ["nests arrays or objects more than 32 deep"]),
        (tid, "cancel", b"[" * 100_000, 400, ["more than 32 deep"]),
        (tid, "note", b'{"text": "' + b"x" * 400_000 + b'"}', 413, ["at most 300000"]),
        (tid, "note", b'{"text": "\\ud800"}', 400, ["unpaired UTF-16 surrogate"]),
        (tid, "note", b'{"text": "a [[[[ \\" {{" }', 200, []),   # brackets inside a string are text
    ]
    with serving() as base, caplog.at_level("INFO"):
        with httpx2.Client(base_url=base, headers=AUTH, timeout=30) as http:
            for task_id, action, body, status, words in cases:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                got = http.post(f"/api/tasks/{task_id}/{action}", content=raw,
                                headers={"Content-Type": "application/json"})
                assert got.status_code == status, (action, raw[:60], got.text[:300])
                if status != 200:
                    error = got.json()["error"]
                    assert "\n" not in error and len(error) < 400, error
                    assert all(w in error for w in words), (words, error)
            chunked = http.post(f"/api/tasks/{tid}/note", headers={"Content-Type": "application/json"},
                                content=iter([b'{"text": "', b"y" * 200_000, b"y" * 200_000, b'"}']))
            assert chunked.status_code == 413 and "at most 300000" in chunked.json()["error"]
            deep_mcp = http.post("/mcp", content=b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": '
                                 + b"[" * 5000 + b"]" * 5000 + b"}", headers=MCP_HEADERS)
            assert deep_mcp.status_code < 500, deep_mcp.text[:300]
    after = task_store.get_task(tid)
    assert after["status"] == "pending" and [n["text"] for n in after["notes"]] == ['a [[[[ " {{']
    assert task_store.get_task(wid)["status"] == "waiting"
    crashes = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert not crashes, [r.getMessage() for r in crashes]
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


@pytest.mark.anyio
async def test_mcp_tools_over_streamable_http_refuse_a_misspelt_or_wrong_argument(wd):
    """Closed schemas (mcp_shared): clear_finished {"status": ...} (the key is ``statuses``) and
    submit_task with ``permision`` are refused naming the key, and change nothing."""
    finished = task_store.submit_task(title="done one", instructions="i", working_dir=wd)
    claimed = task_store.claim_next("test-worker", task_id=finished["id"])
    task_store.complete_attempt(finished["id"], claimed["run_marker"], diff="", result={"summary": "ok"}, usage={})
    with serving() as base:
        async with http_client(base) as c:
            cleared = await c.call_tool("clear_finished", {"status": "running"})
            sent = await c.call_tool("submit_task", {"title": "x", "instructions": "y", "working_dir": wd,
                                                     "permision": "readonly"})
    for result, key in ((cleared, "'status'"), (sent, "'permision'")):
        text = result.content[0].text
        assert result.is_error and "unknown argument" in text and key in text and "\n" not in text, text
    assert [t["id"] for t in task_store.list_tasks(limit=10)["tasks"]] == [finished["id"]]
    assert task_store.get_task(finished["id"])["status"] == "done"


def test_board_api_refuses_query_parameters_a_route_does_not_read(wd):
    """``?stauts=done`` (misspelt) was ignored and the whole list came back as if filtered."""
    done = task_store.submit_task(title="d", instructions="i", working_dir=wd)
    claimed = task_store.claim_next("test-worker", task_id=done["id"])
    task_store.complete_attempt(done["id"], claimed["run_marker"], diff="", result={"summary": "ok"}, usage={})
    task_store.submit_task(title="p", instructions="i", working_dir=wd)
    with serving() as base, httpx2.Client(base_url=base, headers=AUTH, timeout=30) as http:
        refused = [("/api/tasks?stauts=done", "'stauts'"), ("/api/status?verbose=1", "'verbose'"),
                   ("/api/tasks/1?full=1", "'full'"), ("/api/events?since=3", "'since'"),
                   ("/api/changes?wait=0&curosr=1", "'curosr'")]
        for path, named in refused:
            got = http.get(path)
            assert got.status_code == 400 and named in got.json()["error"] and "it takes" in got.json()["error"], \
                (path, got.text)
        posted = http.post(f"/api/tasks/{done['id']}/note?text=x", json={"text": "y"})
        assert posted.status_code == 400 and "'text'" in posted.json()["error"]
        assert [t["id"] for t in http.get("/api/tasks?status=done").json()["tasks"]] == [done["id"]]
        assert http.get(f"/api/status?token={TOKEN}").status_code == 200     # the token's own place


@pytest.mark.parametrize("query,status,needle", [
    ("", 400, "session_id is required: open GET /sse first"),
    ("?session_id=zzz", 400, "is not a session id"),
    ("?session_id=0123456789abcdef0123456789abcdef", 404, "no open /sse stream has this session_id"),
])
def test_a_post_to_messages_without_a_live_session_is_a_json_refusal_with_the_way_out(query, status, needle):
    """The SDK answered these in plain text ("Invalid session ID"), unlike every other refusal."""
    response = call(asgi(), "POST", f"/messages/{query}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json" and needle in response.json()["error"]
