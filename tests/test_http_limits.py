"""The HTTP side under a hostile peer, against a real server process on 127.0.0.1 (uvicorn, the
guards, the SDK's OAuth endpoints): request bodies have a deadline and a size cap on every route
(so trickling bodies cannot take every connection slot), a client hanging up mid-body costs one
log line, and every answer carries the safety headers. The process is started with two of
http_app's limits lowered (BODY_SEC, MAX_CONNECTIONS) so the test takes seconds, not minutes."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

import fake_tunnel
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


@pytest.mark.parametrize("path,cap", [("/register", 64 * 1024), ("/api/tasks/1/cancel", 300_000), ("/mcp", 8 << 20)])
def test_a_content_length_over_the_cap_is_refused_before_reading(server, path, cap):
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head(path, cap + 1, token=True))
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert str(cap).encode() in answer


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
