"""Worktree removal as a normal (non-root) user, where file modes matter: an agent that leaves a
read-only folder (`chmod 555`, as package managers and build tools do) must not leave the
worktree behind while the receipt says it is gone, and `clear --remove-worktrees` must never
forget a path it could not delete. CI runs as root: the worker and the CLI are run as a
dedicated non-root user (created when missing); not root, they run as the current user."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import task_store
from fake_openai import text, tool_call
from helpers import ROOT, make_repo, normal_user
from opencode_env import opencode_env, require_opencode_bin

pytestmark = pytest.mark.real_opencode
DONE = '```json\n{"summary": "built", "files_touched": [], "tests_run": [], "open_questions": []}\n```'
READ_ONLY_BUILD = "mkdir -p build/cache && echo x > build/cache/blob && chmod 555 build/cache build"


class Sandbox:
    """A folder tree the normal user owns (queue, logs, worktrees, OpenCode's home, the repo),
    and the environment of TaskBridge's entry points run there as that user."""

    def __init__(self, user: pwd.struct_passwd | None, model_url: str):
        self.user = user
        self.base = Path(tempfile.mkdtemp(prefix="tb-nonroot-", dir="/tmp"))
        self.base.chmod(0o755)
        self.env = opencode_env(self.base, model_url)
        self.env.update(TASK_DB_PATH=str(self.base / "q" / "tasks.db"), TASK_LOG_DIR=str(self.base / "q" / "logs"),
                        TASKBRIDGE_WORKTREE_ROOT=str(self.base / "worktrees"), WORKER_NOTIFY="0",
                        OPENCODE_BIN=require_opencode_bin())
        self.env.pop("GIT_CONFIG_GLOBAL", None)

    def give_to_user(self, path: Path | None = None) -> None:
        """Hand ``path`` (default: everything) to the user: root made the repository and the
        database."""
        if self.user:
            subprocess.run(["chown", "-R", f"{self.user.pw_uid}:{self.user.pw_gid}", str(path or self.base)],
                           check=True)

    def run(self, script: str, *args: str) -> subprocess.CompletedProcess:
        """`python <script> args` as the normal user (the queue folder handed over first: the
        test read the database as root)."""
        self.give_to_user(self.base / "q")
        drop = ["setpriv", f"--reuid={self.user.pw_uid}", f"--regid={self.user.pw_gid}", "--clear-groups", "--"] \
            if self.user else []
        return subprocess.run([*drop, sys.executable, str(ROOT / script), *args], env=self.env, cwd=self.base,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)

    def cleanup(self) -> None:
        subprocess.run(["chmod", "-R", "u+rwx", str(self.base)], capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def sandbox(scripted_model, monkeypatch):
    box = Sandbox(normal_user(), scripted_model.url)
    for key in ("TASK_DB_PATH", "TASK_LOG_DIR", "TASKBRIDGE_WORKTREE_ROOT"):
        monkeypatch.setenv(key, box.env[key])     # the test reads the same queue
    yield box
    box.cleanup()


def test_read_only_folders_left_by_the_agent_are_really_removed(sandbox, scripted_model):
    repo = make_repo(sandbox.base / "repo")
    scripted_model.script("ro", [
        tool_call("bash", {"command": READ_ONLY_BUILD, "description": "build"}),
        text("Built.\n" + DONE),
    ])
    task = task_store.submit_task(title="build", instructions="SCRIPT:ro", working_dir=str(repo))
    sandbox.give_to_user()
    result = sandbox.run("worker.py")
    assert result.returncode == 0, result.stderr
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", final["error"]
    receipt = final["result"]
    worktree = Path(receipt["worktree_path"])
    assert "build/cache/blob" in receipt["files_touched"]
    assert receipt["worktree_removed"] is True and not os.path.lexists(worktree), \
        f"the receipt says removed; on disk: {os.path.lexists(worktree)}"
    listing = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True).stdout
    assert str(worktree) not in listing


def test_clear_remove_worktrees_never_forgets_a_path_it_could_not_delete(sandbox, scripted_model):
    if sandbox.user is None:
        pytest.skip("needs root to make a folder the normal user cannot delete")
    repo = make_repo(sandbox.base / "repo")
    scripted_model.script("kept", [
        tool_call("bash", {"command": READ_ONLY_BUILD, "description": "build"}),
        text("Built.\n" + DONE),
    ])
    task = task_store.submit_task(title="kept", instructions="SCRIPT:kept", working_dir=str(repo),
                                  worktree_keep=True)
    sandbox.give_to_user()
    assert sandbox.run("worker.py").returncode == 0
    worktree = Path(task_store.get_task(task["id"])["result"]["worktree_path"])
    assert task_store.get_task(task["id"])["status"] == "done" and worktree.is_dir()
    stuck = worktree / "owned-by-root"     # something the user cannot delete, e.g. a sudo build
    stuck.mkdir()
    (stuck / "artifact").write_text("x\n")

    first = sandbox.run("tasks_cli.py", "clear", "--yes", "--remove-worktrees")
    assert first.returncode == 0, first.stderr
    assert f"{task['id']} stays in the queue" in first.stderr
    assert "owned-by-root" in first.stderr and "could not be removed" in first.stderr
    assert task_store.get_task(task["id"])["worktree_path"] == str(worktree), "the path is not forgotten"
    assert stuck.is_dir() and not (worktree / "build").exists()

    subprocess.run(["chown", "-R", f"{sandbox.user.pw_uid}", str(stuck)], check=True)
    second = sandbox.run("tasks_cli.py", "clear", "--yes", "--remove-worktrees", "--json")
    assert second.returncode == 0, second.stderr
    assert [t["id"] for t in json.loads(second.stdout)] == [task["id"]]
    assert not os.path.lexists(worktree)
    with pytest.raises(task_store.TaskNotFound):
        task_store.get_task(task["id"])


def test_a_readonly_task_reverts_read_only_folders_too(sandbox, scripted_model):
    repo = make_repo(sandbox.base / "repo")
    scripted_model.script("ro-revert", [
        tool_call("bash", {"command": READ_ONLY_BUILD, "description": "build"}),
        text("Looked.\n" + DONE),
    ])
    task = task_store.submit_task(title="look", instructions="SCRIPT:ro-revert", working_dir=str(repo),
                                  permission="readonly")
    sandbox.give_to_user()
    assert sandbox.run("worker.py").returncode == 0
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", final["error"]
    receipt = final["result"]
    assert receipt["files_reverted"] == ["build/cache/blob"] and receipt["files_touched"] == []
    assert receipt["worktree_removed"] is True and not os.path.lexists(receipt["worktree_path"])
