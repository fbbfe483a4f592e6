"""Wake-ups on change: the store's wait, the MCP wait_for and the worker's --watch pickup react to
a commit by another process at once, with their poll interval set far longer than the test waits
(so only the change notification can explain the wake). The store's wait and the MCP wait_for run on
both backends (inotify on SQLite's files; LISTEN/NOTIFY on PostgreSQL)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from mcp import Client

import file_watch
import opencode_bridge_mcp as bridge
import task_store
from fake_openai import text
from helpers import ROOT, make_repo

SUBMIT_LATER = """
import sys, time, task_store

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
time.sleep(float(sys.argv[1]))
print(time.time(), flush=True)  # when the commit starts
task_store.submit_task(title="later", instructions="i", working_dir=sys.argv[2])
"""
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


def submit_later(delay: float, wd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SUBMIT_LATER, str(delay), str(wd)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)


@linux_only
def test_a_commit_in_another_process_wakes_the_wait_not_the_poll(tmp_path, store_backend):
    task_store.submit_task(title="first", instructions="i", working_dir=str(tmp_path))
    since = task_store.last_event_id()
    with task_store.change_watch() as watch:
        assert watch.available
    proc = submit_later(0.5, tmp_path)
    newest = task_store.wait_for_change(since, timeout=20, poll=5)
    woke = time.time()
    committed = float(proc.communicate(timeout=30)[0])
    # The poll is 5 s: only the change notification explains a wake within a second of the commit.
    assert newest > since and 0 <= woke - committed < 1.0, woke - committed


def test_the_wait_returns_at_once_when_already_changed_and_on_timeout_otherwise(tmp_path, store_backend):
    since = task_store.last_event_id()
    task_store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    started = time.monotonic()
    assert task_store.wait_for_change(since, timeout=10) > since
    assert time.monotonic() - started < 1
    newest = task_store.last_event_id()
    started = time.monotonic()
    assert task_store.wait_for_change(newest, timeout=0.3, poll=0.1) == newest
    assert 0.25 < time.monotonic() - started < 2


def test_without_inotify_the_poll_still_finds_the_change(tmp_path, monkeypatch):
    monkeypatch.setattr(file_watch, "_LIBC", [None])
    since = task_store.last_event_id()
    proc = submit_later(0.2, tmp_path)
    newest = task_store.wait_for_change(since, timeout=20, poll=0.1)
    proc.communicate(timeout=30)
    assert newest > since


@linux_only
@pytest.mark.anyio
async def test_mcp_wait_for_wakes_on_the_finish_not_its_poll(tmp_path, monkeypatch, store_backend):
    monkeypatch.setenv("MCP_WAIT_POLL_SEC", "5")
    task = task_store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))

    finished: list[float] = []

    def finish() -> None:
        claimed = task_store.claim_next("w", task_id=task["id"])
        task_store.complete_attempt(task["id"], claimed["run_marker"])
        finished.append(time.monotonic())

    timer = threading.Timer(0.5, finish)
    async with Client(bridge.build_server()) as client:
        timer.start()
        result = await client.call_tool("wait_for", {"task_ids": [task["id"]], "timeout_sec": 30})
        returned = time.monotonic()
    timer.join()
    assert not result.is_error and result.structured_content["ready"] == [task["id"]]
    assert returned - finished[0] < 1.5, returned - finished[0]   # its poll is 5 s


@pytest.fixture
def anyio_backend():
    return "asyncio"


@linux_only
@pytest.mark.real_opencode
def test_watch_picks_a_submitted_task_up_on_the_commit_not_the_poll(opencode, tmp_path, store_backend):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ok", [text("fine\n```json\n{\"summary\": \"ok\", \"files_touched\": [], "
                                      "\"tests_run\": [], \"open_questions\": []}\n```")])
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"WORKER_POLL_SEC": "5"})
    try:
        deadline = time.monotonic() + 30
        while (task_store.read_worker_heartbeat() or {}).get("state") != "idle":
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never went idle"
            time.sleep(0.05)
        time.sleep(0.5)  # well inside its 5 s sleep now
        started = time.monotonic()
        task = task_store.submit_task(title="t", instructions="SCRIPT:ok", working_dir=str(repo))
        while task_store.get_task(task["id"])["status"] == "pending":
            assert time.monotonic() - started < 3, "not picked up within 3 s (the poll is 5 s)"
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
