"""start_public.sh: the tunnel's host is learnt and admitted, everything else keeps its guard.
No tunnel can run offline here, so a stand-in `cloudflared` prints a quick-tunnel URL the way
the real one does and then waits; the server it fronts is the real one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers import ROOT, fake_binary, free_port


def get(port: int, path: str, host: str, token: str | None = None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Host": host})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_for_box(proc: subprocess.Popen, lines: list[str], timeout: float = 60) -> None:
    """Until serve.py has printed its box (everything answers then), from its stderr lines."""
    deadline = time.monotonic() + timeout
    while not any(line.strip().startswith("Stop:") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)


@pytest.fixture
def fake_tunnel(tmp_path):
    return fake_binary(tmp_path, "cloudflared", "echo 'INF |  https://quiet-river-42.trycloudflare.com  |' >&2\n"
                                                "exec sleep 300\n")


def test_public_start_admits_the_tunnel_host_only(fake_tunnel, tmp_path):
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("needs ./install.sh (the script runs .venv/bin/python)")
    port = free_port()
    env = dict(os.environ, PORT=str(port), TUNNEL_BIN=str(fake_tunnel), MCP_BEARER_TOKEN="s3cret-token")
    proc = subprocess.Popen(["bash", str(ROOT / "start_public.sh")], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        wait_for_box(proc, lines)
        tunnel_host = "quiet-river-42.trycloudflare.com"
        assert get(port, "/health", tunnel_host) == 200
        assert get(port, "/health", tunnel_host.upper() + ":443") == 200
        assert get(port, "/health", "evil.example.com") == 421
        assert get(port, "/api/status", tunnel_host) == 401
        assert get(port, "/api/status", tunnel_host, token="wrong") == 401
        assert get(port, "/api/status", tunnel_host, token="s3cret-token") == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    time.sleep(0.2)
    err = "".join(lines)
    assert f"https://{tunnel_host}/mcp" in err
    assert "Token:              s3c…(12 characters)" in err, "the box shows the token masked"
    assert "s3cret-token" not in err, "the whole token is never printed"


def test_public_start_without_a_tunnel_says_what_to_do(tmp_path):
    env = dict(os.environ, PATH="/usr/bin:/bin", MCP_BEARER_TOKEN="x")
    env.pop("TUNNEL_BIN", None)
    result = subprocess.run(["bash", str(ROOT / "start_public.sh")], env=env, capture_output=True,
                            text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert "no tunnel binary" in result.stderr and "cloudflared" in result.stderr


def test_public_start_refuses_a_blank_token(tmp_path):
    env = dict(os.environ, MCP_BEARER_TOKEN="   ", TUNNEL_BIN="/bin/true")
    result = subprocess.run(["bash", str(ROOT / "start_public.sh")], env=env, capture_output=True,
                            text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and "MCP_BEARER_TOKEN is set but blank" in result.stderr


@pytest.mark.parametrize("answer,public", [("c", True), ("", False)])
def test_a_terminal_is_asked_and_stays_on_loopback_unless_the_answer_is_a_tunnel(fake_tunnel, tmp_path, answer, public):
    import pty
    port = free_port()
    bins = fake_tunnel.parent
    env = dict(os.environ, PORT=str(port), MCP_BEARER_TOKEN="s3cret-token", PATH=f"{bins}:{os.environ['PATH']}")
    env.pop("TUNNEL_BIN", None)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py")], env=env,
                            stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    os.close(follower)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    tunnel_host = "quiet-river-42.trycloudflare.com"
    try:
        os.write(leader, f"{answer}\n".encode())
        wait_for_box(proc, lines)
        assert get(port, "/health", tunnel_host) == (200 if public else 421)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        os.close(leader)
    time.sleep(0.2)
    err = "".join(lines)
    assert "Serve on a public URL too" in err and "[n] no, this machine only (default)" in err
    assert (f"https://{tunnel_host}/mcp" in err) == public


def test_a_served_worker_that_finds_the_lock_taken_keeps_the_server_up(tmp_path, monkeypatch):
    """A scheduled pass holds the queue's lock: serving goes on, and the worker tries again later."""
    import task_store
    port = free_port()
    env = dict(os.environ, PORT=str(port), MCP_BEARER_TOKEN="s3cret-token")
    lock = task_store.take_lock(task_store.worker_lock_path())  # what a scheduled pass holds
    assert lock is not None
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        wait_for_box(proc, lines)
        deadline = time.monotonic() + 30
        while not any("another pass holds this queue's lock" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        time.sleep(1.5)
        assert proc.poll() is None and get(port, "/health", "127.0.0.1") == 200
    finally:
        os.close(lock)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_restarting_public_mode_keeps_the_token_file_and_pairs_the_new_host(fake_tunnel, tmp_path):
    token_file = tmp_path / "tb" / "token"
    token_file.parent.mkdir(mode=0o700)
    token_file.write_text("kept-token-from-install\n")
    token_file.chmod(0o600)
    port = free_port()
    env = dict(os.environ, PORT=str(port), TUNNEL_BIN=str(fake_tunnel), MCP_TOKEN_FILE=str(token_file))
    env.pop("MCP_BEARER_TOKEN", None)
    proc = subprocess.Popen(["bash", str(ROOT / "start_public.sh")], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        wait_for_box(proc, lines)
        host = "quiet-river-42.trycloudflare.com"
        assert get(port, "/api/status", host, token="kept-token-from-install") == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert token_file.read_text() == "kept-token-from-install\n"
    err = "".join(lines)
    assert "Token:              kep…(23 characters)" in err and f"cat {token_file}" in err, \
        "the box masks the token and says how to copy it"
    assert "kept-token-from-install" not in err
