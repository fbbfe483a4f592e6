"""Every fault of the SQLite queue file leaves the store as one of the store's own errors (issue 20).

A locked database, a full disk, a file that cannot be written and a file that is no database
each surface as the store error a caller can tell them by (DatabaseBusy, DiskFull,
DatabaseUnusable, DatabaseCorrupt), whose message names the file and the way out; no sqlite3 or
psycopg error reaches the modules above the store, and none of them reads a driver's words.
"""
from __future__ import annotations

import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest

import store_sqlite
import task_store
from helpers import submit

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The tasks' folder: beside the queue's files, not their folder (which submit refuses)."""
    folder = tmp_path / "project"
    folder.mkdir()
    return folder


def test_a_locked_database_is_database_busy_naming_the_file(project, monkeypatch):
    submit(project)
    monkeypatch.setattr(store_sqlite, "BUSY_WAIT_SEC", 0.05)
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")   # another process's write lock, held past the wait
    try:
        with pytest.raises(task_store.DatabaseBusy) as raised:
            submit(project)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert str(task_store.db_path()) in str(raised.value) and "try again" in str(raised.value)
    assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
    assert len(task_store.list_tasks()["tasks"]) == 1 and submit(project)   # nothing written; works again


def test_a_full_database_is_disk_full(project):
    submit(project)
    conn = task_store._kept()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages:d}")   # SQLite's own "database or disk is full"
    with pytest.raises(task_store.DiskFull) as raised:
        submit(project, instructions="x" * 200_000)
    assert "disk full" in str(raised.value) and "TASK_DB_PATH" in str(raised.value)


def test_a_database_that_cannot_be_written_is_unusable_with_the_way_out(project):
    submit(project)
    task_store._kept().execute("PRAGMA query_only = 1")   # SQLite's "attempt to write a readonly database"
    with pytest.raises(task_store.DatabaseUnusable) as raised:
        submit(project)
    message = str(raised.value)
    assert f"the task database {task_store.db_path()} cannot be used" in message
    assert "fix the permissions" in message and "TASK_DB_PATH" in message
    assert not isinstance(raised.value, task_store.StorageFault)   # the disk is fine: no remount advice
    assert task_store.list_tasks()["tasks"]                       # and the queue is read again


@pytest.mark.parametrize("call", ["read", "write", "connect", "health"])
def test_a_file_that_is_no_database_is_database_corrupt(project, tmp_path, monkeypatch, call):
    path = tmp_path / "broken.db"
    path.write_bytes(b"this is not a SQLite file\n" * 200)
    monkeypatch.setenv("TASK_DB_PATH", str(path))
    run = {"read": task_store.list_tasks, "write": lambda: submit(project),
           "connect": task_store.connect, "health": task_store.database_health}[call]
    with pytest.raises(task_store.DatabaseCorrupt) as raised:
        run()
    assert f"the task database {path} cannot be used (file is not a database)" in str(raised.value)
    assert "restore it from a backup" in str(raised.value) and raised.value.detail == "file is not a database"


@pytest.mark.parametrize("kind", ["a folder", "under a file"])
def test_a_path_that_cannot_be_opened_is_unusable(tmp_path, monkeypatch, kind):
    if kind == "a folder":
        path = tmp_path / "queue.db"
        path.mkdir()
    else:   # the folder cannot be made: an OSError met opening is the store's error too
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "queue.db"
    monkeypatch.setenv("TASK_DB_PATH", str(path))
    with pytest.raises(task_store.DatabaseUnusable) as raised:
        task_store.get_task(1)
    assert f"the task database {path} cannot be used" in str(raised.value)
    assert "must name a file (not a folder)" in str(raised.value)


def test_a_driver_error_raised_under_the_store_is_mapped_by_its_words_too(tmp_path, monkeypatch):
    # An error made without SQLite's result code (as a test double raises it) is told by its words.
    def readonly(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")
    monkeypatch.setattr(task_store, "connect", readonly)
    with pytest.raises(task_store.DatabaseUnusable, match="fix the permissions"):
        task_store.counts()


def test_a_busy_database_in_another_thread_does_not_close_its_connection(project, monkeypatch):
    # DatabaseBusy is no fault of the connection: the kept one stays (only a broken one reopens).
    submit(project)
    kept = task_store._kept()
    monkeypatch.setattr(store_sqlite, "BUSY_WAIT_SEC", 0.02)
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(task_store.DatabaseBusy):
            submit(project)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert task_store._kept() is kept and threading.active_count() >= 1


OUTSIDE = ["worker.py", "mcp_shared.py", "tasks_cli.py", "serve.py", "doctor.py", "task_views.py", "board_api.py",
           "http_app.py", "opencode_bridge_mcp.py", "claude_control_mcp.py"]


@pytest.mark.parametrize("module", OUTSIDE)
def test_no_module_above_the_store_catches_or_reads_driver_errors(module):
    text = (ROOT / module).read_text()
    assert not re.search(r"^\s*import (sqlite3|psycopg)|except[^:\n]*\b(sqlite3|psycopg)\.", text, re.MULTILINE)
    assert "tb_frame" not in text and "__traceback__" not in text


def test_in_a_lock_wait_block_a_lock_waited_for_in_vain_is_tried_once_until_a_write_lands(project):
    """A run's watch makes several writes a round (the renewal, the meter's step, a log ship):
    each waited its limit for a lock another program held, so the timeout was checked seconds
    late (a 10 s task still ran 15 s in). After one write waited in vain, the next ones try once;
    once a write lands, the full wait is back."""
    submit(project)
    task = task_store.claim_next("w")

    def renewal_took() -> float:
        started = time.monotonic()
        with pytest.raises(task_store.DatabaseBusy):
            task_store.renew_lease(task["id"], task["run_marker"])
        return time.monotonic() - started

    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    try:
        with task_store.lock_wait(0.5):
            holder.execute("BEGIN IMMEDIATE")
            assert renewal_took() >= 0.5
            assert renewal_took() < 0.25 and renewal_took() < 0.25
            holder.execute("ROLLBACK")
            task_store.renew_lease(task["id"], task["run_marker"])   # lands
            holder.execute("BEGIN IMMEDIATE")
            assert renewal_took() >= 0.5, "a write landed since: the whole wait again"
        with task_store.lock_wait(0.5):
            assert renewal_took() >= 0.5, "a new block starts with the whole wait"
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_writes_in_a_lock_wait_block_wait_for_the_write_lock_only_that_long(project):
    """A run's watch writes within lock_wait(worker.SHORT_LOCK_WAIT_SEC): while another program
    holds the queue's write lock, its renewal is DatabaseBusy after that wait, not after 30 s; the
    thread's wait is back to the default after the block."""
    submit(project)
    task = task_store.claim_next("w")
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with task_store.lock_wait(0.3), pytest.raises(task_store.DatabaseBusy):
            task_store.renew_lease(task["id"], task["run_marker"])
        assert 0.3 <= time.monotonic() - started < 5
        assert getattr(task_store._LOCK_WAIT, "sec", None) is None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    task_store.renew_lease(task["id"], task["run_marker"])   # the lock let go: renewed
