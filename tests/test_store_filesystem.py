"""The queue refuses a database folder on a filesystem where SQLite's WAL is unsafe (issue 8 §6).

A real NFS, SMB, 9p or virtiofs mount cannot be made inside this test machine (no privileges, no
server), so the detection is pointed at a fake mount table in /proc/self/mountinfo's format
(``TASKBRIDGE_MOUNTINFO``); everything after the detection (the CLI, the worker, the pragma on
the real SQLite file) runs for real.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import task_store
from helpers import run_script


def fake_mountinfo(tmp_path: Path, mounts: dict[str, str]) -> Path:
    """A mountinfo file: '/' on ext4 plus each {mount point: filesystem type}."""
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"]
    for n, (point, fstype) in enumerate(mounts.items(), start=30):
        escaped = point.replace(" ", "\\040")
        lines.append(f"{n} 22 0:{n} / {escaped} rw,relatime shared:{n} - {fstype} server:/export rw")
    table = tmp_path / "mountinfo"
    table.write_text("\n".join(lines) + "\n")
    return table


@pytest.mark.parametrize("fstype", ["nfs4", "cifs", "9p", "virtiofs", "fuse.sshfs", "smb3"])
def test_cli_refuses_a_queue_on_a_network_filesystem(tmp_path, monkeypatch, fstype):
    share = tmp_path / "my share"
    monkeypatch.setenv("TASKBRIDGE_MOUNTINFO", str(fake_mountinfo(tmp_path, {str(share): fstype})))
    monkeypatch.setenv("TASK_DB_PATH", str(share / "queue" / "tasks.db"))
    (tmp_path / "work").mkdir()   # beside the queue: a folder holding it is no place for a task
    result = run_script(
        "tasks_cli.py", "submit", "a title", "--dir", str(tmp_path / "work")
    )  # submit makes a queue; list would not
    assert result.returncode != 0
    message = result.stderr.strip()
    assert "Traceback" not in message
    assert f"on a {fstype} filesystem" in message and str(share / "queue") in message
    assert "TASK_DB_PATH" in message and "TASK_DB_JOURNAL=delete" in message
    assert not (share / "queue" / "tasks.db-wal").exists()


def test_worker_refuses_too_and_local_folders_keep_wal(tmp_path, monkeypatch):
    share = tmp_path / "nfs"
    monkeypatch.setenv("TASKBRIDGE_MOUNTINFO", str(fake_mountinfo(tmp_path, {str(share): "nfs"})))
    monkeypatch.setenv("TASK_DB_PATH", str(share / "tasks.db"))
    passed = run_script("worker.py")
    assert passed.returncode == 1 and "on a nfs filesystem" in passed.stderr
    monkeypatch.setenv("TASK_DB_PATH", str(tmp_path / "local" / "tasks.db"))
    task_store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    with sqlite3.connect(tmp_path / "local" / "tasks.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_override_uses_a_rollback_journal_there(tmp_path, monkeypatch):
    share = tmp_path / "nfs"
    monkeypatch.setenv("TASKBRIDGE_MOUNTINFO", str(fake_mountinfo(tmp_path, {str(share): "nfs4"})))
    monkeypatch.setenv("TASK_DB_PATH", str(share / "tasks.db"))
    monkeypatch.setenv("TASK_DB_JOURNAL", "delete")
    (tmp_path / "work").mkdir()
    submitted = run_script("tasks_cli.py", "submit", "t", "--dir", str(tmp_path / "work"), "--instructions", "x")
    assert submitted.returncode == 0, submitted.stderr
    with sqlite3.connect(share / "tasks.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert not (share / "tasks.db-wal").exists()
    monkeypatch.setenv("TASK_DB_JOURNAL", "sometimes")
    bad = run_script("tasks_cli.py", "list")
    assert bad.returncode != 0 and "TASK_DB_JOURNAL='sometimes'" in bad.stderr


def test_longest_mount_point_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("TASKBRIDGE_MOUNTINFO", str(fake_mountinfo(
        tmp_path, {str(tmp_path / "net"): "nfs", str(tmp_path / "net" / "local"): "ext4"})))
    assert task_store.db_filesystem(tmp_path / "net" / "local" / "x")[0] == "ext4"
    assert task_store.db_filesystem(tmp_path / "net" / "other")[0] == "nfs"
    assert task_store.db_filesystem(tmp_path / "netx")[0] == "ext4"
    assert task_store.is_network_filesystem("fuse.overlayfs")  # every FUSE mount counts as unsafe
    assert not task_store.is_network_filesystem("overlay")
