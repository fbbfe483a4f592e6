"""The HTTP side under a hostile peer, against a real server process on 127.0.0.1 (uvicorn, the
guards, the SDK's OAuth endpoints): request bodies have a deadline and a size cap on every route
(so trickling bodies cannot take every connection slot), a client hanging up mid-body costs one
log line, and every answer carries the safety headers. The process is started with two of
http_app's limits lowered (BODY_SEC, MAX_CONNECTIONS) so the test takes seconds, not minutes."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import fake_tunnel
import http_app
from helpers import ROOT, free_port, wait_healthy

TOKEN = "s3cret-token-for-limit-tests"
BODY_SEC = 2.0
MAX_CONNECTIONS = 8
LAUNCH = (
    "import sys, runpy; sys.path.insert(0, {root!r}); import http_app; "
    "{limits}; "
    "sys.argv = ['opencode_bridge_mcp.py', '--transport', 'streamable-http', '--host', {host!r}, '--port', '{port}']; "
    "runpy.run_path({script!r}, run_name='__main__')"
)


def launch_limited(tmp_path: Path, port: int, limits: dict[str, int], host: str = "127.0.0.1",
                   **env_extra: str) -> subprocess.Popen:
    """The MCP server on streamable-http at ``host:port`` with ``http_app``'s limits overridden
    (``{"BODY_SEC": 30, ...}``) and its own token and queue under ``tmp_path``; started and
    answering /health. The caller stops it."""
    code = LAUNCH.format(root=str(ROOT), host=host, port=port, script=str(ROOT / "opencode_bridge_mcp.py"),
                         limits="; ".join(f"http_app.{name} = {value}" for name, value in limits.items()))
    env = dict(os.environ, MCP_BEARER_TOKEN=TOKEN, MCP_TOKEN_FILE=str(tmp_path / "tb" / "token"),
               TASK_DB_PATH=str(tmp_path / "tasks.db"), **env_extra)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
    except BaseException:
        proc.kill()
        proc.communicate(timeout=15)
        raise
    return proc


@pytest.fixture
def server(tmp_path):
    port = free_port()
    proc = launch_limited(tmp_path, port, {"BODY_SEC": BODY_SEC, "MAX_CONNECTIONS": MAX_CONNECTIONS},
                          MCP_PUBLIC_URL=f"http://127.0.0.1:{port}")
    yield proc, port
    if proc.poll() is None:
        proc.terminate()
        proc.communicate(timeout=15)


def stderr_of(proc: subprocess.Popen) -> str:
    proc.terminate()
    return proc.communicate(timeout=15)[1].decode(errors="replace")


def head(path: str, length: int | None = None, extra: str = "", token: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/x-www-form-urlencoded"]
    lines += [f"Content-Length: {length}"] if length is not None else ["Transfer-Encoding: chunked"]
    lines += [f"Authorization: Bearer {TOKEN}"] if token else []
    return ("\r\n".join(lines + ([extra] if extra else [])) + "\r\n\r\n").encode()


def refusal(answer: bytes, path: str | None) -> str:
    """The message of a refusal read off the wire, checked for its shape: JSON, and on /mcp a
    JSON-RPC error without an id (the SDK's client hands its caller that message), else
    ``{"error": ...}``."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"\r\ncontent-type: application/json" in head.lower(), answer[:600]
    said = json.loads(body)
    if path == "/mcp":
        assert said["jsonrpc"] == "2.0" and said["id"] is None and said["error"]["code"] < 0, said
        return said["error"]["message"]
    return said["error"]


def read_answer(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("path", ["/register", "/token", "/oauth/consent", "/revoke"])
def test_a_trickled_body_gets_408_within_the_body_deadline(server, path):
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=BODY_SEC + 8) as sock:
        sock.sendall(head(path, 1000))
        started = time.monotonic()
        for _ in range(int(BODY_SEC * 4) + 8):   # one byte every 0.5 s: each well inside the head deadline
            try:
                sock.sendall(b"a")
            except OSError:
                break
            time.sleep(0.5)
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        sock.settimeout(5)
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < BODY_SEC + 3
    assert b"x-content-type-options: nosniff" in answer.lower()


def test_trickling_clients_cannot_starve_health_mcp_and_api(server):
    """As many trickling bodies as there are connection slots: once the body deadline passes
    they are answered 408 and closed, and /health, /api and /mcp answer again."""
    _, port = server
    holders = []
    for i in range(MAX_CONNECTIONS * 2):   # until the server refuses more: every slot is held
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(head(["/register", "/token", "/oauth/consent"][i % 3], 10_000) + b"x")
        time.sleep(0.1)
        sock.setblocking(False)
        try:
            refused = sock.recv(64)
        except BlockingIOError:
            refused = b""
        sock.setblocking(True)
        if refused:
            sock.close()
            break
        holders.append(sock)
    assert holders and refused.startswith(b"HTTP/1.1 503"), refused
    try:
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
    except httpx2.TransportError:
        pass   # the cap closed the new connection at once: the slots really are all taken
    time.sleep(BODY_SEC + 1.5)
    try:
        for sock in holders:
            sock.settimeout(3)
            assert read_answer(sock).startswith(b"HTTP/1.1 408")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert httpx2.get(f"http://127.0.0.1:{port}/api/status", headers=auth, timeout=5).status_code == 200
        accept = {"Accept": "application/json, text/event-stream"}
        answer = httpx2.post(f"http://127.0.0.1:{port}/mcp", headers=auth | accept,
                             json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, timeout=5)
        assert answer.status_code in (200, 400), answer.text   # reached the SDK (no session: 400)
    finally:
        for sock in holders:
            sock.close()


def test_a_big_chunked_body_to_the_api_is_refused_while_it_streams(server):
    """/api's 300 KB cap used to be checked after reading the whole body into memory."""
    _, port = server
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head("/api/tasks/1/cancel", token=True).replace(b"x-www-form-urlencoded", b"json"))
        chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
        try:
            for _ in range(3200):   # up to 200 MB
                sock.sendall(chunk)
                sent += 65536
        except OSError:
            pass   # the server answered and closed
        sock.settimeout(5)
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert sent < 20_000_000


@pytest.mark.parametrize("path,cap", [("/register", 64 * 1024), ("/api/tasks/1/cancel", 300_000),
                                      ("/mcp", http_app.MAX_BODY_BYTES)])
def test_a_content_length_over_the_cap_is_refused_before_reading(server, path, cap):
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head(path, cap + 1, token=True))
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    said = refusal(answer, path)
    assert f"at most {cap} bytes" in said and "send less" in said, said


def mcp_post(port: int, body: bytes, chunked: bool = False) -> bytes:
    """``body`` POSTed to /mcp with the token, whole or as one chunk; the raw answer."""
    lines = ["POST /mcp HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             "Accept: application/json, text/event-stream", f"Authorization: Bearer {TOKEN}", "Connection: close",
             "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"]
    framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if chunked else body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        with contextlib.suppress(OSError):   # refused mid-body: the server answered and closed
            sock.sendall(framed)
        return read_answer(sock)


def padded_initialize(size: int) -> bytes:
    """An initialize request of about ``size`` bytes (the padding in an experimental capability)."""
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                       "params": {"protocolVersion": "2025-06-18", "clientInfo": {"name": "big", "version": "1"},
                                  "capabilities": {"experimental": {"pad": {"x": "a" * size}}}}}).encode()


@pytest.mark.parametrize("chunked", [False, True])
def test_an_mcp_message_under_the_documented_cap_is_served_and_one_over_it_refused_as_json_rpc(server, chunked):
    """The SDK capped /mcp bodies at 4 MiB of its own with a plain-text 413, under the 8 MiB
    (MAX_BODY_BYTES) the docs name; now one cap holds, and its refusal is the JSON-RPC error every
    /mcp refusal is, naming the limit and the way out."""
    _, port = server
    under = mcp_post(port, padded_initialize(http_app.MAX_BODY_BYTES - (1 << 20)), chunked)
    assert under.startswith(b"HTTP/1.1 200"), under[:600]
    over = mcp_post(port, padded_initialize(http_app.MAX_BODY_BYTES), chunked)
    assert over.startswith(b"HTTP/1.1 413"), over[:600]
    said = refusal(over, "/mcp")
    assert f"at most {http_app.MAX_BODY_BYTES} bytes (8 MiB)" in said and "send less" in said, said


@pytest.mark.anyio
async def test_the_sdk_client_hands_its_caller_the_words_of_a_refusal_on_mcp(server):
    """What the JSON-RPC shape on /mcp is for: the SDK's client reads a non-2xx answer's body only
    when it is a JSON-RPC error, and hands its message on; for ``{"error": ...}`` it made up
    "Server returned an error response". (A body refused mid-upload is another matter: the client
    is still sending when the server answers and closes, and sees only a broken connection.)"""
    _, port = server
    transport = streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=httpx2.AsyncClient(
        headers={"Authorization": "Bearer wrong"}, timeout=30))
    with pytest.raises(Exception) as refused:
        with anyio.fail_after(20):
            async with Client(transport):
                pass
    assert "a valid bearer token is required" in repr(refused.value), repr(refused.value)


@pytest.mark.parametrize("path", ["/health", "/mcp", "/api/status"])
@pytest.mark.parametrize("pieces", [False, True])
def test_a_request_head_over_16_kib_gets_431_whole_or_in_pieces(server, path, pieces):
    """h11's own cap counted only a head still incomplete: one that arrived in one read passed at
    any size (and one in pieces got uvicorn's plain-text 400)."""
    _, port = server
    big = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
           f"X-Big: {'a' * http_app.MAX_HEAD_BYTES}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with contextlib.suppress(OSError):
            for at in range(0, len(big), 1000 if pieces else len(big)):
                sock.sendall(big[at:at + (1000 if pieces else len(big))])
                time.sleep(0.01 if pieces else 0)
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:300]
    said = refusal(answer, path)
    assert f"at most {http_app.MAX_HEAD_BYTES} bytes" in said and "send fewer or shorter headers" in said, said
    assert b"x-content-type-options: nosniff" in answer.lower()
    # A head just under the cap is served.
    small = big.replace(b"a" * http_app.MAX_HEAD_BYTES, b"a" * (http_app.MAX_HEAD_BYTES - 300))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(small.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        assert not read_answer(sock).startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize("path", ["/health", "/mcp", "/api/status"])
def test_two_host_headers_get_a_json_421_from_the_real_server(server, path):
    """h11 refuses them before the guards see the request: uvicorn answered 400 in plain text."""
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 421"), answer[:300]
    assert "exactly one Host header" in refusal(answer, path)


def test_a_request_at_the_connection_cap_gets_a_json_503_naming_the_way_out(server):
    """uvicorn's limit_concurrency answered a plain-text "Service Unavailable"."""
    _, port = server
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        time.sleep(0.3)
        for path in ("/health", "/mcp", "/api/status"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                             "Accept: application/json, text/event-stream\r\n\r\n".encode())
                answer = read_answer(sock)
            assert answer.startswith(b"HTTP/1.1 503"), (path, answer[:300])
            said = refusal(answer, path)
            assert f"cap of {MAX_CONNECTIONS} open connections" in said and "try again" in said, said
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("path,line", [("/register", "hung up before sending the whole body"),
                                       ("/oauth/consent", "hung up before sending the whole body"),
                                       ("/token", "hung up before sending the whole body"),
                                       ("/mcp", "the client hung up or its body was refused")])
def test_a_client_hanging_up_mid_body_costs_one_log_line(server, path, line):
    proc, port = server
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            request = head(path, 500, token=True, extra="Accept: application/json, text/event-stream")
            if path == "/mcp":
                request = request.replace(b"x-www-form-urlencoded", b"json")
            sock.sendall(request + b"request=abc&tok")
            time.sleep(0.3)
    time.sleep(0.5)
    assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    err = stderr_of(proc)
    assert "Traceback" not in err and "ClientDisconnect" not in err, err[-3000:]
    assert err.count(line) == 3, err[-3000:]


def test_every_answer_carries_the_safety_headers(server):
    _, port = server
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    answers = {
        "health": httpx2.get(f"{base}/health"),
        "api": httpx2.get(f"{base}/api/status", headers=auth),
        "401": httpx2.get(f"{base}/api/status"),
        "404": httpx2.get(f"{base}/nothing-here"),
        "api 404": httpx2.get(f"{base}/api/tasks/999999", headers=auth),
        "421": httpx2.get(f"{base}/health", headers={"Host": "evil.example"}),
        "oauth metadata": httpx2.get(f"{base}/.well-known/oauth-authorization-server"),
        "board": httpx2.get(f"{base}/"),
    }
    assert answers["421"].status_code == 421 and answers["401"].status_code == 401
    for name, answer in answers.items():
        assert answer.headers.get("x-content-type-options") == "nosniff", name
        if answer.headers.get("content-type", "").startswith("application/json"):
            if name != "oauth metadata":   # public metadata keeps the SDK's own max-age
                assert answer.headers.get("cache-control") == "no-store", name
            assert "default-src 'none'" in answer.headers.get("content-security-policy", ""), name


def test_one_address_beyond_loopback_gets_only_its_share_of_the_connections(tmp_path):
    """Served on every interface, connections from this machine's own non-loopback address
    count as one remote peer: past MAX_PEER_CONNECTIONS they are closed at once, while loopback
    (where a tunnel connects from) still gets in."""
    address = next((a for a in socket.gethostbyname_ex(socket.gethostname())[2] if not a.startswith("127.")), None)
    if address is None:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            address = probe.getsockname()[0]
    if not address or address.startswith("127.") or address == "0.0.0.0":
        pytest.skip("this machine has no address beyond loopback")
    port, share = free_port(), 3
    proc = launch_limited(tmp_path, port, {"BODY_SEC": 30, "MAX_PEER_CONNECTIONS": share, "MAX_CONNECTIONS": 20},
                          host="0.0.0.0")
    held = []
    try:
        for _ in range(share):
            sock = socket.create_connection((address, port), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # a head that never ends
            held.append(sock)
        time.sleep(0.3)
        extra = socket.create_connection((address, port), timeout=5)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(extra) == b""   # closed without an answer
        extra.close()
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        for sock in held:
            sock.close()
        err = stderr_of(proc)
    assert "open connections from one address" in err


def test_one_client_behind_a_tunnel_gets_only_its_share_of_requests_in_progress(tmp_path):
    """Through a tunnel every connection comes from 127.0.0.1; the tunnel serve.py started (a
    stand-in here: tests/fake_tunnel.py) names the client (CF-Connecting-IP). Past
    MAX_PEER_REQUESTS slow requests in progress from one named client, its next request gets 429
    at once; other clients and local ones get in."""
    port, share = free_port(), 3
    tunnel, public = fake_tunnel.start(tmp_path, port)
    proc = launch_limited(tmp_path, port, {"BODY_SEC": 30, "MAX_PEER_REQUESTS": share, "MAX_CONNECTIONS": 40},
                          MCP_PUBLIC_URL=f"http://127.0.0.1:{port}", TASKBRIDGE_TUNNEL_PID=tunnel.identity())
    held = []
    try:
        for _ in range(share):
            sock = socket.create_connection(("127.0.0.1", public), timeout=5)
            sock.sendall(head("/token", 1000, extra="CF-Connecting-IP: 203.0.113.9") + b"grant")
            held.append(sock)
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", public), timeout=5) as extra:
            extra.sendall(head("/token", 1000, extra="CF-Connecting-IP: 203.0.113.9") + b"grant")
            assert read_answer(extra).startswith(b"HTTP/1.1 429")
        other = httpx2.get(f"http://127.0.0.1:{public}/health", headers={"CF-Connecting-IP": "198.51.100.1"}, timeout=5)
        assert other.status_code == 200
        # Straight to the port, the same header names no one: a local client, exempt.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as local:
            local.sendall(head("/token", 1000, extra="CF-Connecting-IP: 203.0.113.9") + b"grant")
            local.settimeout(0.5)
            with pytest.raises(socket.timeout):
                local.recv(1)   # not refused: it waits for its body like any local request
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        for sock in held:
            sock.close()
        tunnel.proc.kill()
        stderr_of(proc)
