"""serve.py: however it ends (the terminal closed, SIGTERM, killed outright), the MCP server and
the worker it started end too, so a second serve.py finds the port and the queue's lock free."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import ROOT, free_port

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)


def start_serving(port: int) -> tuple[subprocess.Popen, list[str]]:
    env = dict(os.environ, PORT=str(port), MCP_BEARER_TOKEN="s3cret-token")
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 60
    while not any(line.strip().startswith("Stop:") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    return proc, lines


def children_of(pid: int) -> list[psutil.Process]:
    kids = psutil.Process(pid).children()
    assert {" ".join(k.cmdline()).split("/")[-1].split()[0] for k in kids} >= {"worker.py", "opencode_bridge_mcp.py"}
    return kids


def all_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    for proc in alive:     # don't leave them behind for the next test
        proc.kill()
    return alive


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_closed_terminal_or_sigterm_stops_the_server_and_the_worker(signum):
    proc, lines = start_serving(free_port())
    kids = children_of(proc.pid)
    os.kill(proc.pid, signum)
    assert proc.wait(timeout=40) == 0, "".join(lines)
    assert all_gone(kids, 5) == [], "".join(lines)


def test_a_killed_serve_takes_its_children_with_it():
    """SIGKILL runs no handler of ours: the children learn of it from the kernel (Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    port = free_port()
    proc, lines = start_serving(port)
    kids = children_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert all_gone(kids, 30) == [], "".join(lines)
    again, _ = start_serving(port)     # the port and the queue's lock are free again
    again_kids = children_of(again.pid)
    os.kill(again.pid, signal.SIGTERM)
    assert again.wait(timeout=40) == 0
    assert all_gone(again_kids, 5) == []


@pytest.mark.real_opencode
def test_one_ctrl_c_hands_a_running_task_back_and_says_so_once(opencode, tmp_path):
    """The terminal's Ctrl-C reaches serve.py alone; its worker (--stop-at-once) ends the run in
    hand at its one SIGTERM, hands the task back, and says that in one line, not in the two of
    a worker stopped twice ("Ctrl-C again to stop now", then "stopping now")."""
    import task_store
    from fake_openai import hang
    from helpers import make_repo
    opencode.model.script("waits", [hang()])
    task = task_store.submit_task(
        title="waits", instructions="SCRIPT:waits", working_dir=str(make_repo(tmp_path / "repo")), timeout_sec=300
    )
    proc, lines = start_serving(free_port())
    deadline = time.monotonic() + 90
    while not (task_store.get_task(task["id"])["agent_pid"] and opencode.model.step_requests("waits")):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 0, "".join(lines)
    said = "".join(lines)
    after = task_store.get_task(task["id"])
    assert after["status"] == "pending" and after["handbacks"] == 1 and after["attempts"] == 1, said
    assert after["error"] == "worker stopped (Ctrl-C or SIGTERM); handed back", "one signal, not 'second signal'"
    assert said.count(f"stopping now: ending the run of {task['id']}") == 1, said
    assert "Ctrl-C again" not in said, said


def test_a_second_serve_of_the_same_queue_on_another_port_is_refused_and_rotate_only_rotates(tmp_path):
    """A second ./install.sh --port N (or --rotate) while the first serves the same queue started a
    second server and a second --watch worker that only retried the queue's lock (found by a
    new-user test). Now it is refused by name; --rotate rotates the token file and stops there."""
    port = free_port()
    first, lines = start_serving(port)
    try:
        other_port = free_port()
        env = dict(os.environ, PORT=str(other_port), MCP_BEARER_TOKEN="s3cret-token")
        second = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none"], env=env,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr
        said = second.stderr.strip()
        assert len(said.splitlines()) == 1 and "Traceback" not in said, said
        assert f"another TaskBridge (serve.py pid {first.pid}) already serves the queue" in said
        assert f"on 127.0.0.1:{port}" in said and "--db" in said
        # connect's snippets name the port this queue is served on, not the default 8765
        env_cli = {k: v for k, v in os.environ.items() if k != "PORT"}
        snippets = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "connect"], env=env_cli,
                                  capture_output=True, text=True, timeout=60)
        assert f"http://127.0.0.1:{port}/mcp" in snippets.stdout and ":8765/" not in snippets.stdout
        token_file = tmp_path / "token"
        token_file.write_text("old-token\n")
        env = {k: v for k, v in env.items() if k != "MCP_BEARER_TOKEN"} | {"MCP_TOKEN_FILE": str(token_file)}
        rotated = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none", "--rotate"], env=env,
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert rotated.returncode == 0, rotated.stderr
        assert token_file.read_text().strip() not in ("", "old-token")
        assert "it uses the new token from now on" in rotated.stderr and "Stop:" not in rotated.stderr
        # the clients to update are the serving one's: its port, not this call's (a fresh user's finding)
        assert f"`tasks_cli.py connect` (port {port})" in rotated.stderr, rotated.stderr
        assert f"(port {other_port})" not in rotated.stderr
        assert first.poll() is None
    finally:
        os.kill(first.pid, signal.SIGTERM)
        assert first.wait(timeout=40) == 0, "".join(lines)


def test_a_second_serve_on_a_served_port_names_the_first_and_the_way_out():
    """A second ./install.sh (serve.py) while the first serves: refused at once, before any box,
    naming the TaskBridge that serves there by its serve.py's pid and how to pick another port
    (it printed a connector box as if serving, then uvicorn's raw "address already in use"); for
    the same queue, another queue (another port would be refused too: a fresh user's finding)."""
    port = free_port()
    first, lines = start_serving(port)
    kids = children_of(first.pid)
    try:
        env = dict(os.environ, PORT=str(port), MCP_BEARER_TOKEN="s3cret-token")
        other_queue = dict(env, TASK_DB_PATH=str(Path(os.environ["TASK_DB_PATH"]).parent / "other.db"))
        for extra, given, who, way in (
                ([], env, "a TaskBridge already serves this queue", "serve another queue with --db"),
                (["--check-port"], env, "a TaskBridge already serves this queue", "serve another queue with --db"),
                ([], other_queue, "another TaskBridge already serves", f"--port {port + 1}")):
            second = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none", *extra], env=given,
                                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
            assert second.returncode == 1, second.stderr
            assert f"{who} on 127.0.0.1:{port} (serve.py pid {first.pid})" in second.stderr, second.stderr
            assert way in second.stderr and "Stop:" not in second.stderr
            assert ("--port" in second.stderr) == (given is other_queue), second.stderr
            assert "address already in use" not in second.stderr and "Traceback" not in second.stderr
            assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    finally:
        os.kill(first.pid, signal.SIGTERM)
        assert first.wait(timeout=40) == 0, "".join(lines)
        all_gone(kids, 5)
    free = subprocess.run(
        [sys.executable, str(ROOT / "serve.py"), "--check-port"],
        env=dict(os.environ, PORT=str(port)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert free.returncode == 0 and free.stderr == "", free.stderr


def test_a_queue_folder_where_no_lock_can_be_made_is_served_unlocked(monkeypatch):
    # A read-only queue opens read-only (reads work); making the serve lock there raised EROFS
    # out of main() as a traceback.
    import errno

    import serve
    import task_store

    def read_only(_path):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(task_store, "take_lock", read_only)
    assert serve.hold_queue(8765) == (None, None)


def test_serving_a_queue_that_was_not_there_says_it_made_one_once():
    """serve.py --db with a typo made a new, empty queue in silence (a fresh user's finding): its
    clients then saw none of their tasks. The first serve of a new path says so; the next does not."""
    import task_store
    path = task_store.db_path()
    assert not path.exists()
    for first in (True, False):
        proc, lines = start_serving(free_port())
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=40) == 0, "".join(lines)
        said = [line for line in lines if "made a new queue" in line]
        assert len(said) == int(first) and (not first or f"made a new queue at {path}: " in said[0]), "".join(lines)
        assert "a typo in --db / TASK_DB_PATH?" in "".join(said) or not first
