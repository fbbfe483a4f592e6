"""The queue file deleted or moved away under running processes (found by a fresh user: a
``worker.py --watch`` made a new, empty queue at that path on its next open and carried on; the
task it was running kept running against nothing, its worktree orphaned).

The store makes no new queue where one it had open went (QueueGone, until the file is put back);
a first open of a path that never held a queue still makes one. The worker says in one line that
its queue file is gone and the way out, ends its runs (their worktrees kept, named in the log),
claims nothing more and waits for the file: put back, it says so, hands the ended attempts back
(no retry spent) and claims again.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import task_store as store
from helpers import ROOT, fake_binary, make_repo, submit, until, worker_process


def queue_files(path: Path) -> list[Path]:
    return [Path(str(path) + suffix) for suffix in ("", "-wal", "-shm") if Path(str(path) + suffix).exists()]


def test_a_queue_file_that_went_is_not_made_again_until_it_is_put_back(tmp_path):
    submit(tmp_path, "mine")
    path = store.db_path()
    away = tmp_path / "moved-away.db"
    path.rename(away)
    for call in (store.counts, lambda: store.submit_task(title="t", instructions="i", working_dir=str(tmp_path)),
                 lambda: store.write_worker_heartbeat({"state": "idle"})):
        with pytest.raises(store.QueueGone) as gone:
            call()
        said = str(gone.value)
        assert str(path) in said and "put the file back" in said and "move tasks.db-wal and tasks.db-shm" in said, said
    assert not path.exists() and not store.state_path("worker.json").exists(), "nothing made in its place"
    away.rename(path)   # put back: carried on, its tasks there
    assert [t["title"] for t in store.list_tasks()["tasks"]] == ["mine"]


def test_a_lost_queue_is_said_lost_though_another_queue_has_taken_its_log_folder_meanwhile(tmp_path):
    """CI's finding: a worker waiting for its moved-away queue file, while another queue was made
    with the same TASK_LOG_DIR (which then names that queue), heard "the folder holds another
    queue's logs" instead of "your file is gone" (and later "replaced"). Its own file is said first."""
    store.open_task_log(submit(tmp_path, "mine")["id"]).close()   # its log folder, named as this queue's
    path = store.db_path()
    assert store.log_folder_queue() == path
    path.rename(tmp_path / "moved-away.db")   # under this process's kept connection, as a worker's
    other = other_queue(tmp_path)   # a new queue, the shared log folder now names it
    assert store.log_folder_queue() == other
    with pytest.raises(store.QueueGone):
        store.counts()
    os.replace(other, path)   # put where the lost one was, the old one's -wal beside it
    with pytest.raises(store.QueueReplaced):
        store.counts()


def test_a_first_open_still_makes_a_new_queue_and_a_let_go_one_is_made_again(tmp_path, monkeypatch):
    fresh = tmp_path / "new" / "tasks.db"
    monkeypatch.setenv("TASK_DB_PATH", str(fresh))
    assert store.counts()["pending"] == 0 and fresh.exists()
    store.close_connections()   # let go of on purpose (a process done with it): the next use is a first one
    fresh.unlink()
    assert store.counts()["pending"] == 0 and fresh.exists()


def long_task(tmp_path: Path) -> tuple[dict, Path, dict[str, str]]:
    """A task in a real repository, the queue's path, and a --watch worker's environment whose
    stand-in agent runs until it is ended (the real one would need a model's answer)."""
    repo = make_repo(tmp_path / "repo")
    fake = fake_binary(tmp_path / "bin", "opencode", '[ "$1" = run ] || exit 0\ncat > /dev/null\nexec sleep 300\n')
    task = submit(repo, "long", model="fake/model", timeout_sec=600)
    env = dict(os.environ, OPENCODE_BIN=str(fake), WORKER_MODEL="fake/model", WORKER_KILL_GRACE_SEC="1",
               WORKER_POLL_SEC="0.2")
    return task, store.db_path(), env


def test_a_watch_worker_whose_queue_file_goes_ends_its_run_keeps_the_worktree_and_waits_for_it(tmp_path):
    task, path, env = long_task(tmp_path)
    out = tmp_path / "worker.out"
    with worker_process(env, out, "--watch") as proc:
        running = until(lambda: (t := store.get_task(task["id"]))["agent_pid"] and t, 90, "the agent to start")
        agent = psutil.Process(running["agent_pid"])
        worktree = Path(running["worktree_path"])
        store.close_connections()   # this test's own connection: it reads the file again once it is back
        away = tmp_path / "away"
        away.mkdir()
        for file in queue_files(path):
            file.rename(away / file.name)
        said = until(lambda: "its run was ended" in (text := out.read_text()) and text, 60, "the run to end")
        gone = [line for line in said.splitlines() if "is gone (deleted or moved away)" in line]
        assert len(gone) == 1 and str(path) in gone[0], said
        assert "put the file back" in gone[0] and "stop the worker and move tasks.db-wal and tasks.db-shm" in gone[0]
        ended = next(line for line in said.splitlines() if "its run was ended" in line)
        assert task["id"] in ended and f"its worktree {worktree}" in ended and "is kept" in ended, ended
        until(lambda: not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE, 30, "the agent to end")
        assert worktree.is_dir(), "the worktree is kept"
        beat = store.state_path("worker.json").stat().st_mtime_ns
        time.sleep(2)   # the worker looks for its file again meanwhile
        assert proc.poll() is None, "a --watch worker waits for its file"
        assert not path.exists(), "no new queue in its place"
        assert store.state_path("worker.json").stat().st_mtime_ns == beat, "no heartbeat beside a queue that went"
        # The CLI and doctor say where it went (not "a typo?"), and a submit makes no new queue in its place
        from click.testing import CliRunner

        import doctor
        from tasks_cli import cli
        for args in (["status"], ["submit", "new work", "--dir", str(tmp_path)]):
            said = CliRunner().invoke(cli, args)
            assert said.exit_code != 0 and "Traceback" not in said.output, said.output
            assert f"the queue {path} is in no state to open" in said.output, said.output
            assert f"worker pid {proc.pid}" in said.output, said.output
            assert "stop that worker first" in said.output and not path.exists(), said.output
        check = doctor.check_database()
        assert check.status == "fail" and "in no state to open" in check.detail and "put its file back" in check.fix
        second = subprocess.run([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=60)   # a scheduled pass meanwhile: it makes no queue there
        assert second.returncode != 0 and "in no state to open" in second.stdout + second.stderr, second
        assert not path.exists() and "Traceback" not in second.stderr
        assert "Traceback" not in out.read_text()
        for file in away.iterdir():   # put back: it carries on with its own tasks
            file.rename(path.parent / file.name)
        until(lambda: f"a queue file is at {path} again" in out.read_text(), 60, "the worker to see its file back")
        assert b"[worker] the run was ended: the queue file was gone" in store.read_task_log(task["id"])
        again = until(lambda: (t := store.get_task(task["id"]))["attempts"] == 2 and t["agent_pid"] and t, 90,
                      "the handed-back task to run again")
        assert again["handbacks"] == 1, again
        store.cancel_task(task["id"])   # its run ends; the worker stops at once on leaving
        until(lambda: store.get_task(task["id"])["status"] == "cancelled", 60, "the cancel")
    assert "Traceback" not in out.read_text(), out.read_text()


def test_a_queue_put_back_without_the_attempts_it_ended_names_each_and_its_worktree(tmp_path):
    """A reviewer's finding: a queue file put back that does not hold the attempts the waiting
    worker ended (an older backup here; a new, empty queue another command made is refused now
    while the worker waits) was taken for its own coming back, and those attempts were dropped
    without a word, their worktrees orphaned. Each is named now, with where its work is."""
    import shutil
    task, path, env = long_task(tmp_path)
    store.close_connections()   # folded into the file: a backup taken before the claim
    backup = tmp_path / "backup.db"
    shutil.copyfile(path, backup)
    out = tmp_path / "worker.out"
    with worker_process(env, out, "--watch") as proc:
        running = until(lambda: (t := store.get_task(task["id"]))["agent_pid"] and t, 90, "the agent to start")
        worktree = Path(running["worktree_path"])
        store.close_connections()
        away = tmp_path / "away"
        away.mkdir()
        for file in queue_files(path):
            file.rename(away / file.name)
        until(lambda: "its run was ended" in out.read_text(), 60, "the run to end")
        shutil.copyfile(backup, path)   # the backup put back: the task pending in it, its attempt unknown
        said = until(lambda: "nothing hands it back" in (text := out.read_text()) and text, 60,
                     "the worker to name the attempt the queue put back does not hold")
        line = next(line for line in said.splitlines() if "nothing hands it back" in line)
        assert task["id"] in line and running["run_marker"] in line and str(worktree) in line, line
        assert proc.poll() is None, said
        # The backup's own t_0001 (pending there) is claimed again: ended, the worker stops at once
        until(lambda: store.get_task(task["id"])["agent_pid"], 90, "the backup's task to run")
        store.cancel_task(task["id"])
        until(lambda: store.get_task(task["id"])["status"] == "cancelled", 60, "the cancel")
    assert "Traceback" not in out.read_text(), out.read_text()


def test_another_queue_put_where_a_waiting_worker_lost_its_own_is_opened_by_nothing_and_said(tmp_path):
    """A fresh user's finding: a watched queue moved away, another queue's file put at its path
    with the old WAL left beside it; the worker said nothing, and the first CLI command read the
    new file with the old WAL and corrupted it (its two tasks lost). The worker says it was
    replaced, and no process started meanwhile opens the file while the worker waits for its own."""
    import sqlite3
    task, path, env = long_task(tmp_path)
    out = tmp_path / "worker.out"
    with worker_process(env, out, "--watch"):
        until(lambda: store.get_task(task["id"])["agent_pid"], 90, "the agent to start")
        store.close_connections()
        away = tmp_path / "away"
        away.mkdir()
        path.rename(away / path.name)   # the file alone: its -wal and -shm stay at the path
        until(lambda: "its run was ended" in out.read_text(), 60, "the run to end")
        os.replace(other_queue(tmp_path), path)
        said = until(lambda: "was replaced by another file" in (text := out.read_text()) and text, 60,
                     "the worker to say the file was replaced")
        assert "move tasks.db-wal and tasks.db-shm next to the old tasks.db" in said, said
        for args in (["status"], ["list"]):   # processes started meanwhile: nothing opened
            shown = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), *args], env=env, cwd=ROOT,
                                   capture_output=True, text=True, timeout=60)
            assert shown.returncode != 0 and "in no state to open" in shown.stderr, shown
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as check:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert [r[0] for r in check.execute("SELECT title FROM tasks")] == ["theirs"]


def test_a_one_pass_whose_queue_file_goes_ends_its_run_and_exits_1_without_making_one(tmp_path):
    import subprocess
    import sys

    from helpers import ROOT
    repo = make_repo(tmp_path / "repo")
    fake = fake_binary(tmp_path / "bin", "opencode", '[ "$1" = run ] || exit 0\ncat > /dev/null\nexec sleep 300\n')
    task = submit(repo, "long", model="fake/model", timeout_sec=600)
    path = store.db_path()
    env = dict(os.environ, OPENCODE_BIN=str(fake), WORKER_MODEL="fake/model", WORKER_KILL_GRACE_SEC="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        worktree = until(lambda: store.get_task(task["id"])["agent_pid"] and store.get_task(task["id"])[
            "worktree_path"], 90, "the agent to start")
        store.close_connections()
        path.rename(tmp_path / "away.db")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    gone = [line for line in out.splitlines() if "is gone (deleted or moved away)" in line]
    assert len(gone) == 1 and "this pass claims nothing more" in gone[0], out
    # What a next pass does (no memory of this one): its reaper requeues the attempt, spending a retry
    assert "the next pass's reaper then requeues them" in gone[0] and "spends a retry" in gone[0], gone[0]
    assert f"its worktree {worktree}" in out and Path(worktree).is_dir() and "Traceback" not in out, out
    assert not path.exists(), "no new queue in its place"


def other_queue(tmp_path: Path) -> Path:
    """Another queue's file, with one task ``theirs``, closed (no -wal or -shm beside it)."""
    other = tmp_path / "other" / "tasks.db"
    made = subprocess.run([sys.executable, "-c", "import sys, task_store\ntask_store.submit_task(title='theirs', "
                           "instructions='i', working_dir=sys.argv[1])", str(tmp_path)], cwd=ROOT, timeout=60,
                          env=dict(os.environ, TASK_DB_PATH=str(other)), capture_output=True, text=True)
    assert made.returncode == 0 and not Path(str(other) + "-wal").exists(), made.stderr
    return other


def intact(path: Path) -> list[str]:
    """The titles of the tasks in the queue file ``path`` alone (copied without any -wal), checked whole."""
    import shutil
    import sqlite3
    alone = path.parent / "alone" / path.name
    alone.parent.mkdir(exist_ok=True)
    shutil.copyfile(path, alone)
    with contextlib.closing(sqlite3.connect(alone)) as check:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return [row[0] for row in check.execute("SELECT title FROM tasks ORDER BY id")]


def test_a_queue_file_replaced_in_use_is_never_read_with_the_old_ones_wal(tmp_path):
    """A fresh user's finding: tasks.db replaced by another queue's file (its -wal and -shm left
    beside it, as `mv` leaves them) under a running worker; the worker's next open read the old
    file's WAL into the new file: the new queue's tasks vanished and its indexes were corrupt.
    SQLite never removes a moved file's WAL: a process that had the old file open refuses the new
    one while that WAL is beside it, and opens it once the person moved the WAL to the old file."""
    submit(tmp_path, "old queue's task")
    store.submit_task(title="old, in the WAL only", instructions="i", working_dir=str(tmp_path))
    path = store.db_path()
    assert Path(str(path) + "-wal").stat().st_size > 0
    aside = tmp_path / "aside" / "tasks.db"
    aside.parent.mkdir()
    path.rename(aside)     # moved away alone, as a person does
    os.replace(other_queue(tmp_path), path)
    for _ in range(2):     # for as long as the old WAL is there
        with pytest.raises(store.QueueReplaced) as refused:
            store.counts()
        said = str(refused.value)
        assert f"{path}-wal" in said and "stop every TaskBridge process" in said and "move tasks.db-wal" in said
    for suffix in ("-wal", "-shm"):   # the way out: the old file's WAL goes with the old file
        Path(str(path) + suffix).rename(str(aside) + suffix)
    assert [t["title"] for t in store.list_tasks()["tasks"]] == ["theirs"]
    store.close_connections()
    assert intact(path) == ["theirs"]
    import sqlite3
    with contextlib.closing(sqlite3.connect(aside)) as old:   # read with its own WAL: whole
        assert [r[0] for r in old.execute("SELECT title FROM tasks ORDER BY id")] == [
            "old queue's task", "old, in the WAL only"]


def test_a_lost_mark_of_a_worker_that_is_gone_or_whose_pid_was_reused_blocks_nothing(tmp_path):
    submit(tmp_path, "mine")
    me = psutil.Process()
    store.close_connections()
    for pid, started in ((me.pid + 10**6, me.create_time()), (me.ppid(), 1.0)):   # gone; a live pid reused
        store.state_path("worker.json").write_text(json.dumps({
            "state": store.QUEUE_LOST_STATE, "pid": pid, "pid_start": started, "host": store.host_name(),
            "ts": time.time()}))
        assert store.queue_left_in_use() is None
        assert store.counts()["pending"] == 1
        store.close_connections()
