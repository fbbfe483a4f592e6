"""Every phase of a task, not only the agent run, keeps its lease and honours the task's timeout
and a cancel: workspace preparation, the receipt, the commit, the cleanup. A git step that hangs
(here a filter of the repository's own, as git-lfs or git-crypt install) is ended with its
process tree and named. A worker never reaps an attempt its own live process runs."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
import uuid

import psutil
import pytest

import task_store
import worker
from fake_openai import text, tool_call
from helpers import ROOT, make_repo, run_script, tagged

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

DONE = '```json\n{"summary": "ok", "files_touched": [], "tests_run": [], "open_questions": []}\n```'


def hanging_filter(repo, kind: str) -> list[str]:
    """Make the repository's `slow` filter (for *.slow files) hang in its `kind` step (clean:
    git add; smudge: checkout). Returns the argv of the hanging process, unique to this test."""
    seconds = f"300.{uuid.uuid4().int % 10**9:09d}"
    subprocess.run(["git", "config", f"filter.slow.{kind}", f"sleep {seconds}"], cwd=repo, check=True)
    return ["sleep", seconds]


def alive(argv: list[str]) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline", "status"])
            if p.info["cmdline"] == argv and p.info["status"] != psutil.STATUS_ZOMBIE]


def wait_until(predicate, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.mark.real_opencode
def test_a_hung_commit_step_keeps_its_lease_and_a_cancel_ends_it(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", {".gitattributes": "*.slow filter=slow\n", "README.md": "x\n"})
    hang = hanging_filter(repo, "clean")
    monkeypatch.setenv("TASKBRIDGE_GIT_TIMEOUT_SEC", "120")
    opencode.model.script("hangs", [tool_call("write", {"filePath": "{cwd}/data.slow", "content": "x\n"}),
                                    text("Done.\n" + DONE)])
    task = task_store.submit_task(title="hangs", instructions="SCRIPT:hangs", working_dir=str(repo))
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: alive(hang))
        beat = task_store.get_task(task["id"])["heartbeat_at"]
        time.sleep(2.5)
        during = task_store.get_task(task["id"])
        assert during["status"] == "running" and during["heartbeat_at"] > beat, "the lease is renewed while git hangs"
        cancelled_at = time.monotonic()
        task_store.cancel_task(task["id"])
        proc.communicate(timeout=30)
        assert time.monotonic() - cancelled_at < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert task_store.get_task(task["id"])["status"] == "cancelled"
    assert alive(hang) == [] and tagged() == []


@pytest.mark.real_opencode
def test_a_hung_workspace_preparation_honours_the_task_timeout(opencode, tmp_path, worker_engine):
    repo = make_repo(tmp_path / "repo", {".gitattributes": "*.slow filter=slow\n", "data.slow": "x\n"})
    hang = hanging_filter(repo, "smudge")
    opencode.model.script("never", [text("Done.\n" + DONE)])
    task = task_store.submit_task(title="prep", instructions="SCRIPT:never", working_dir=str(repo),
                                  timeout_sec=4, max_retries=0)
    started = time.monotonic()
    assert run_script("worker.py").returncode == 0
    assert time.monotonic() - started < 40
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed"
    # warm, the kept server hangs making the worktree ahead of the claim (its park): the task waits
    # for it half its timeout at most, then makes its own worktree (cold), which hangs the same way
    assert final["error"].startswith("preparing the workspace: git worktree add"), final["error"]
    assert "ended with its process tree: timed out after 4 s" in final["error"]
    assert opencode.model.step_requests("never") == [], "the agent never started"
    assert alive(hang) == []


@pytest.mark.real_opencode
def test_a_hung_workspace_preparation_under_a_locked_queue_still_ends_at_the_timeout(opencode, tmp_path):
    """Another program takes the queue's write lock while a task's workspace is prepared: the
    phase's lease renewal waited 30 s for it, between the checks of the timeout, so the hung git
    step ran on ~30 s past a 6 s timeout. It ends at the timeout; the failure is written when the
    lock goes."""
    repo = make_repo(tmp_path / "repo", {".gitattributes": "*.slow filter=slow\n", "data.slow": "x\n"})
    hang = hanging_filter(repo, "smudge")
    opencode.model.script("never", [text("Done.\n" + DONE)])
    task = task_store.submit_task(title="prep", instructions="SCRIPT:never", working_dir=str(repo),
                                  timeout_sec=6, max_retries=0)
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: alive(hang))
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    held_at = time.monotonic()
    try:
        wait_until(lambda: not alive(hang), timeout=60)
        ended_after = time.monotonic() - held_at
        assert proc.poll() is None   # still waiting to write the failure
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert ended_after < 12, ended_after   # the 6 s timeout ran from the claim, before the lock
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed" and "timed out after 6 s" in final["error"], final["error"]
    assert opencode.model.step_requests("never") == []


def test_a_worker_never_reaps_the_attempt_its_own_live_process_runs(tmp_path, monkeypatch):
    task = task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path))
    owner, pid, start = worker.worker_identity()
    claimed = task_store.claim_next(owner, pid, start)
    monkeypatch.setenv("WORKER_STALE_SEC", "0")
    time.sleep(0.05)
    beat = worker.fresh_state().beat
    beat.running(claimed, True)     # a slot of this process runs it (a long commit, say)
    assert worker.reap(worker.Knobs()) == 0
    assert task_store.get_task(task["id"])["status"] == "running"
    beat.running(claimed, False)
    assert worker.reap(worker.Knobs()) == 1, "a stale lease no slot of ours runs is reaped"
