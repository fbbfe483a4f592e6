"""Safe when public: each finding from probing the HTTP server on loopback, as a test against the
real server process (uvicorn, the guards, the SDK transports)."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time

import httpx2
import pytest

import http_app
from helpers import ROOT, free_port, wait_healthy

TOKEN = "s3cret-token-for-safety-tests"


def start_server(env: dict[str, str], port: int, log_level: str = "INFO") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "opencode_bridge_mcp.py"), "--transport", "streamable-http",
                             "--port", str(port), "--log-level", log_level], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture
def server(tmp_path):
    port = free_port()
    proc = start_server(dict(os.environ, MCP_BEARER_TOKEN=TOKEN), port)
    wait_healthy(proc, f"http://127.0.0.1:{port}")
    yield proc, port
    proc.terminate()
    proc.wait(15)


def stderr_of(proc: subprocess.Popen) -> str:
    proc.terminate()
    return proc.communicate(timeout=15)[1].decode(errors="replace")


def raw_request(port: int, request: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data


def test_no_token_with_a_tunnel_host_refuses_to_start(tmp_path):
    port = free_port()
    env = dict(os.environ, MCP_ALLOWED_HOSTS="quiet-river-42.trycloudflare.com",
               MCP_TOKEN_FILE=str(tmp_path / "absent"))
    env.pop("MCP_BEARER_TOKEN", None)
    proc = start_server(env, port)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "refusing to start" in err.decode() and "quiet-river-42.trycloudflare.com" in err.decode()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_no_token_on_loopback_alone_still_serves_with_a_warning(tmp_path):
    port = free_port()
    env = dict(os.environ, MCP_TOKEN_FILE=str(tmp_path / "absent"))
    env.pop("MCP_BEARER_TOKEN", None)
    env.pop("MCP_ALLOWED_HOSTS", None)
    proc = start_server(env, port)
    wait_healthy(proc, f"http://127.0.0.1:{port}")
    said = " ".join(stderr_of(proc).split())
    # a fresh tester's finding: a mistyped MCP_TOKEN_FILE opened the port with no word of the path
    assert f"no bearer token configured (MCP_TOKEN_FILE names {tmp_path / 'absent'}, which does not exist" in said


@pytest.mark.parametrize("path", ["/mcp", "/api/status", "/sse", "/mcp/anything"])
def test_websocket_upgrade_to_a_protected_path_without_the_token_gets_401(server, path):
    _, port = server
    head = raw_request(port, (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                              "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                              "Sec-WebSocket-Version: 13\r\n\r\n").encode())
    assert head.startswith(b"HTTP/1.1 401"), head
    assert b"www-authenticate: Bearer" in head.lower().replace(b"bearer", b"Bearer")


@pytest.mark.anyio
@pytest.mark.parametrize("extensions,expected", [({"websocket.http.response": {}}, 401), ({}, "close")])
async def test_the_guard_refuses_websocket_scopes_under_any_server(extensions, expected):
    """Another ASGI server might hand a WebSocket scope over: the guard still refuses it."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope)

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    guard = http_app.BearerGuard(app, TOKEN)
    await guard({"type": "websocket", "path": "/mcp", "headers": [], "query_string": b"",
                 "extensions": extensions}, receive, send)
    assert reached == []
    if expected == 401:
        assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 401
    else:
        assert sent == [{"type": "websocket.close", "code": 1008}]
    await guard({"type": "websocket", "path": "/mcp", "headers": [(b"authorization", f"Bearer {TOKEN}".encode())],
                 "query_string": b"", "extensions": extensions}, receive, send)
    assert len(reached) == 1


@pytest.mark.anyio
async def test_an_unknown_scope_type_is_not_passed_through():
    reached = []

    async def app(scope, receive, send):
        reached.append(scope)

    await http_app.BearerGuard(app, TOKEN)({"type": "webtransport", "path": "/mcp"}, None, None)
    assert reached == []


def test_a_control_character_in_a_refused_path_never_reaches_the_log_raw(server):
    proc, port = server
    path = "/mcp/%0a2026-11-30 10:00:00 INFO taskbridge: all good%1b[2J%1b]0;owned%07" + "A" * 5000
    response = httpx2.get(f"http://127.0.0.1:{port}{path}", timeout=10)
    assert response.status_code == 401
    err = stderr_of(proc)
    refused = [line for line in err.splitlines() if "refused" in line and "(401)" in line]
    assert len(refused) == 1, err
    assert "\x1b" not in err and "\x07" not in err
    assert not any(line.startswith("2026-11-30 10:00:00 INFO taskbridge: all good") for line in err.splitlines())
    assert "\\n2026-11-30" in refused[0] and "\\x1b[2J" in refused[0]
    assert len(refused[0]) < 400, "log lines from requests are bounded"


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock``: an orderly end (``b""``) or a reset, which is how a close
    arrives when bytes we sent were still unread on its side (the trickling client's last line)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_and_trickling_connections_are_closed_and_health_keeps_answering(server, monkeypatch):
    _, port = server
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(40)]
    trickle = socket.create_connection(("127.0.0.1", port), timeout=30)
    trickle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    started = time.monotonic()
    assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    for sock in [*idle, trickle]:
        if sock is trickle:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):   # closed already: fine
                trickle.sendall(b"X-Slow: 1\r\n")
        assert closed_by_server(sock), "the server closes a connection that sends no request head"
        sock.close()
    waited = time.monotonic() - started
    assert http_app.REQUEST_HEAD_SEC - 1 <= waited <= http_app.REQUEST_HEAD_SEC + 5
    assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_connections_past_the_cap_are_closed_at_once(server):
    _, port = server
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(http_app.MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        started = time.monotonic()
        assert extra.recv(1) == b"" and time.monotonic() - started < 3
        extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        except httpx2.TransportError:
            pass
        assert time.monotonic() < deadline, "/health answers again once the connections are gone"
        time.sleep(0.2)


def test_a_token_file_readable_by_others_is_warned_about(tmp_path, monkeypatch, caplog):
    token_file = tmp_path / "token"
    token_file.write_text("abc-token\n")
    token_file.chmod(0o644)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token_file))
    with caplog.at_level(logging.WARNING):
        assert http_app.bearer_token() == "abc-token"
    assert "readable by other users (mode 644)" in caplog.text and "chmod 600" in caplog.text
    token_file.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        http_app.bearer_token()
    assert "readable" not in caplog.text
