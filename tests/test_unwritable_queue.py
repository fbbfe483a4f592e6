"""A queue this user can read but not write (the file, or its folder, another user's): the worker
refuses before it writes anything beside it, and doctor names what cannot be written and the way
out. Found by a fresh user: the worker refused, but only after it had written its heartbeat and
lock files beside the queue, and doctor said the database was fine.

Root writes anything, so as root the worker and doctor run as an ordinary user (helpers.normal_user):
a process that starts as root, imports TaskBridge, then drops to that user (the interpreter may sit
in a folder that user cannot enter). As an ordinary user the test runs them as itself.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import task_store
from helpers import ROOT, normal_user, submit

# Started as root, it imports what it runs before dropping to the user (uid -1: stays as it is).
AS_USER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import doctor, worker
uid, gid, what = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
if what == "worker":
    sys.exit(worker.main([]))
print(json.dumps(doctor.check_database().as_dict()))
"""


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user may enter (tmp_path is root's own under /tmp/pytest-of-root)."""
    base = Path(tempfile.mkdtemp(prefix="tb-unwritable-", dir="/var/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_user(base: Path, what: str) -> subprocess.CompletedProcess:
    """``worker.py`` (one pass) or doctor's database check, run by the ordinary user (or by this
    user when the test is not root) on the queue ``base/q/tasks.db``."""
    user = normal_user()
    ids = ["-1", "-1"] if user is None else [str(user.pw_uid), str(user.pw_gid)]
    own = base / "own"   # the user's own folders: logs, worktrees, home
    own.mkdir(exist_ok=True)
    if user is not None:
        os.chown(own, user.pw_uid, user.pw_gid)
    env = dict(os.environ, TASK_DB_PATH=str(base / "q" / "tasks.db"), TASK_LOG_DIR=str(own / "logs"),
               TASKBRIDGE_WORKTREE_ROOT=str(own / "worktrees"), HOME=str(own), XDG_STATE_HOME=str(own / "state"),
               XDG_CACHE_HOME=str(own / "cache"), XDG_DATA_HOME=str(own / "data"))
    return subprocess.run([sys.executable, "-c", AS_USER, str(ROOT), *ids, what], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(base), stdin=subprocess.DEVNULL)


def make_queue(base: Path, monkeypatch: pytest.MonkeyPatch, unwritable: str) -> Path:
    """A queue with one pending task under ``base/q``, made by this process, then made unwritable
    to the other user: ``file`` (the folder open to all, the file read-only to them) or ``folder``
    (the file open to all, the folder not). Returns what they cannot write."""
    queue = base / "q" / "tasks.db"
    monkeypatch.setenv("TASK_DB_PATH", str(queue))
    (base / "work").mkdir()
    submit(base / "work")
    task_store.close_connections()   # the last close folds the WAL in: no -wal or -shm left beside it
    blocked = queue if unwritable == "file" else queue.parent
    queue.chmod(0o444 if unwritable == "file" else 0o666)
    queue.parent.chmod(0o777 if unwritable == "file" else 0o555)
    return blocked


@pytest.mark.parametrize("unwritable", ["file", "folder"])
def test_a_worker_on_a_queue_it_cannot_write_refuses_before_writing_anything(shared, monkeypatch, unwritable):
    blocked = make_queue(shared, monkeypatch, unwritable)
    before = sorted(os.listdir(shared / "q"))
    refused = as_user(shared, "worker")
    assert refused.returncode == 1, refused.stderr
    assert sorted(os.listdir(shared / "q")) == before, "nothing was written beside the queue"
    assert not (shared / "own" / "logs").exists(), "nor in the log folder"
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in refused.stderr, lines
    assert f"{blocked} is not writable" in lines[0] and "TASK_DB_PATH" in lines[0], lines[0]
    (shared / "q").chmod(0o755)
    assert task_store.get_task("t_0001")["status"] == "pending"


@pytest.mark.parametrize("unwritable", ["file", "folder"])
def test_doctor_names_what_of_the_queue_cannot_be_written_and_the_way_out(shared, monkeypatch, unwritable):
    blocked = make_queue(shared, monkeypatch, unwritable)
    done = as_user(shared, "doctor")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)
    assert check["status"] == "fail", check
    assert f"{blocked} is not writable" in check["detail"], check
    assert "TASK_DB_PATH" in check["fix"] and "chown" in check["fix"], check
    queue = shared / "q" / "tasks.db"
    queue.chmod(0o666)
    (shared / "q").chmod(0o777)
    assert json.loads(as_user(shared, "doctor").stdout)["status"] == "ok", "writable again: all is well"


def test_a_queue_of_the_users_own_made_read_only_gets_chmod_and_every_file_named_at_once(shared, monkeypatch):
    """A fresh user's finding: a queue file of their own made read-only (SQLite makes its -wal and
    -shm with the file's mode, so a read leaves those read-only too) was named one file per run,
    with `sudo chown` to the user who already owned it as the way out."""
    queue = shared / "q" / "tasks.db"
    monkeypatch.setenv("TASK_DB_PATH", str(queue))
    (shared / "work").mkdir()
    submit(shared / "work")
    task_store.close_connections()
    shm = queue.with_name("tasks.db-shm")
    shm.write_bytes(b"")
    user = normal_user()
    for path in (queue.parent, queue, shm):
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)
    for path in (queue, shm):
        path.chmod(0o400)
    check = json.loads(as_user(shared, "doctor").stdout)
    assert check["status"] == "fail", check
    assert f"{queue} is not writable" in check["detail"] and f"{shm} is not writable" in check["detail"], check
    assert f"chmod u+w {queue} {shm}" in check["fix"] and "chown" not in check["fix"], check


def test_a_check_the_queue_stops_says_the_queues_words_not_an_exception_repr():
    """A fresh user's finding: doctor's worker line on a queue it could not read printed
    `the check itself failed: DatabaseUnusable('the task database ...')`."""
    import doctor

    def check_worker() -> doctor.Check:
        raise task_store.DatabaseUnusable("the task database /q/tasks.db cannot be used (disk I/O error); "
                                          "check the disk")

    said = doctor.run_check(check_worker)
    assert said.status == "fail" and said.detail == ("the queue cannot be read for this check: the task database "
                                                     "/q/tasks.db cannot be used (disk I/O error); check the disk")
    assert "DatabaseUnusable(" not in said.detail
