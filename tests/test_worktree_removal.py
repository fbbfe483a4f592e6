"""Worktree removal as a normal (non-root) user, where file modes matter: an agent that leaves a
read-only folder (`chmod 555`, as package managers and build tools do) must not leave the
worktree behind while the receipt says it is gone, and `clear --remove-worktrees` must never
forget a path it could not delete. CI runs as root: the worker and the CLI are run as a
dedicated non-root user (created when missing); not root, they run as the current user."""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import task_store
import worktrees
from fake_openai import text, tool_call
from helpers import ROOT, git, make_repo, normal_user
from opencode_env import opencode_env, require_opencode_bin

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
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
    # The revert behind the box (boxed, the read-only worktree refuses these writes when made).
    sandbox.env.update(TASKBRIDGE_SANDBOX="off", TASKBRIDGE_ALLOW_PROMPT_LEVEL="1")
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


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` with its kind, permission bits and content (root's view)."""
    state = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            state[str(path.relative_to(root))] = ("link", os.readlink(path))
        elif path.is_dir():
            state[str(path.relative_to(root))] = ("dir", oct(info.st_mode & 0o7777))
        else:
            state[str(path.relative_to(root))] = ("file", oct(info.st_mode & 0o7777), path.read_bytes())
    return state


# New folders made unreadable, an existing file's and folder's modes changed, an empty folder
# removed, a symlink and a file added, a file changed.
SHELL_WRITES = ("echo changed > keep.txt; chmod 600 keep.txt; echo new > d/new.txt; chmod 700 d; rmdir empty; "
                "ln -s /etc/hostname link; mkdir -p ro/sub && echo x > ro/sub/f && chmod -R 000 ro")


def test_readonly_in_a_plain_folder_reverts_new_folders_modes_and_links(sandbox, scripted_model):
    # The revert behind the box (boxed, the read-only worktree refuses these writes when made).
    sandbox.env.update(TASKBRIDGE_SANDBOX="off", TASKBRIDGE_ALLOW_PROMPT_LEVEL="1")
    """`submit --dir <not a repo> --permission readonly`: only files were restored, so ro/sub
    (mode 000) stayed although the receipt said shell writes were reverted. Now the folder is
    exactly as before: contents, folders, links and modes."""
    plain = sandbox.base / "plain"
    (plain / "d").mkdir(parents=True)
    (plain / "empty").mkdir()
    (plain / "keep.txt").write_text("original\n")
    (plain / "d" / "old.txt").write_text("old\n")
    (plain / "keep.txt").chmod(0o644)
    (plain / "d").chmod(0o755)
    sandbox.give_to_user()
    before = tree_state(plain)
    scripted_model.script("plain-ro", [
        tool_call("bash", {"command": SHELL_WRITES, "description": "write"}),
        text("Looked.\n" + DONE),
    ])
    task = task_store.submit_task(title="look", instructions="SCRIPT:plain-ro", working_dir=str(plain),
                                  permission="readonly")
    result = sandbox.run("worker.py")
    assert result.returncode == 0, result.stderr
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", final["error"]
    receipt = final["result"]
    assert tree_state(plain) == before
    assert receipt["files_reverted"] == ["d/", "d/new.txt", "empty/", "keep.txt", "link", "ro/", "ro/sub/",
                                         "ro/sub/f"]
    assert "not_reverted" not in receipt and "reverted" in receipt["sandbox"]["shell writes"]


def test_what_an_in_place_revert_cannot_undo_is_named(tmp_path):
    """A change the worker's user may not undo (here a folder root made inside the task's folder
    during the run) is listed as ``path: why``; everything else is still reverted. What the user
    could not read before the run (a chmod 000 folder and file of theirs) is left alone."""
    user = normal_user()
    if user is None:
        pytest.skip("needs root to make a folder the worker's user cannot delete")
    plain = Path(tempfile.mkdtemp(prefix="tb-revert-", dir="/tmp"))
    try:
        (plain / "keep.txt").write_text("original\n")
        (plain / "secret").mkdir()
        (plain / "secret" / "inside").write_text("mine\n")
        (plain / "locked.txt").write_text("mine too\n")
        subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(plain)], check=True)
        (plain / "secret").chmod(0)        # the user's own unreadable things: left alone, never deleted
        (plain / "locked.txt").chmod(0)
        shot = plain.parent / f"snap-{plain.name}"
        code = ("import pickle, sys, worktrees; root = sys.argv[1]; snap = worktrees.take_snapshot(root); "
                "open(root + '/keep.txt', 'w').write('changed'); open(root + '/new.txt', 'w').write('x'); "
                "open(sys.argv[2], 'wb').write(pickle.dumps(snap))")
        drop = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        shot.touch()
        shot.chmod(0o666)
        subprocess.run([*drop, sys.executable, "-c", code, str(plain), str(shot)], cwd=ROOT, check=True)
        (plain / "rootdir").mkdir()
        (plain / "rootdir" / "f").write_text("root's\n")        # owned by root: the user cannot delete it
        undo = ("import json, pickle, sys, worktrees; snap = pickle.loads(open(sys.argv[2], 'rb').read()); "
                "print(json.dumps(worktrees.restore_snapshot(sys.argv[1], snap)))")
        done = subprocess.run([*drop, sys.executable, "-c", undo, str(plain), str(shot)], cwd=ROOT,
                              capture_output=True, text=True, check=True)
        reverted, failed = json.loads(done.stdout)
        assert reverted == ["keep.txt", "new.txt"]
        assert failed == ["rootdir/f: not removed (Permission denied)", "rootdir: not removed (Directory not empty)"]
        assert (plain / "keep.txt").read_text() == "original\n" and not (plain / "new.txt").exists()
        assert (plain / "secret").stat().st_mode & 0o777 == 0 and (plain / "locked.txt").stat().st_mode & 0o777 == 0
        assert (plain / "secret" / "inside").read_text() == "mine\n" and (
            plain / "locked.txt"
        ).read_text() == "mine too\n"
    finally:
        shutil.rmtree(plain, ignore_errors=True)
        (plain.parent / f"snap-{plain.name}").unlink(missing_ok=True)


def test_only_a_parked_worktree_no_task_took_is_dropped(tmp_path):
    """drop_parked removes a kept server's parked worktree no task took (git-locked with
    TaskBridge's reason) and leaves any other, a detached one included: the sweep of a warm pass
    deleted a kept task worktree whose HEAD a person had detached, with their files."""
    repo = make_repo(tmp_path / "repo")
    engine_folder = worktrees.worktree_root() / "engine"
    parked = worktrees.park_worktree(str(repo), engine_folder / "a")
    taken = worktrees.park_worktree(str(repo), engine_folder / "b")
    task = {"id": "t_0001", "branch": None}
    worktrees._take_parked(str(repo), taken, task, git(repo, "rev-parse", "HEAD"))
    users = engine_folder / "c" / "repo"
    git(repo, "worktree", "add", "-q", "--detach", str(users), "HEAD")
    (users / "my-notes.txt").write_text("precious\n")
    for path in (parked, taken, users):
        worktrees.drop_parked(path)
    listed = git(repo, "worktree", "list")
    assert not parked.exists() and str(parked) not in listed
    assert git(taken, "symbolic-ref", "--short", "HEAD") == "taskbridge/t_0001"
    for kept in (taken, users):
        assert kept.is_dir() and str(kept) in listed, kept
    assert (users / "my-notes.txt").read_text() == "precious\n"


def test_a_wait_behind_another_threads_hung_git_step_ends_at_the_watchers_reason(tmp_path):
    """A kept server's park (``git worktree add``) hung in a filter holds worktrees' lock; a task
    whose workspace step waits for that lock ends at its own timeout with GitStopped naming the
    reason (it waited without end), and the lease is renewed meanwhile (the watcher is asked)."""
    repo = make_repo(tmp_path / "repo", {".gitattributes": "*.slow filter=slow\n", "data.slow": "x\n"})
    git(repo, "config", "filter.slow.smudge", "sleep 60")
    folder = worktrees.worktree_root() / "engine" / "slot_0-hung"
    started = threading.Event()

    def park() -> None:   # the kept server's start thread; its recycle ends the hung step
        with worktrees.watched(lambda: "its server was recycled" if recycled.is_set() else None):
            started.set()
            with contextlib.suppress(worktrees.GitError):
                worktrees.park_worktree(str(repo), folder)

    recycled = threading.Event()
    parker = threading.Thread(target=park, daemon=True)
    parker.start()
    started.wait(5)
    time.sleep(0.5)   # the park's git is under way, the lock held
    asked: list[float] = []
    deadline = time.monotonic() + 1.0

    def check() -> str | None:
        asked.append(time.monotonic())
        return "timed out after 1 s" if time.monotonic() > deadline else None

    outcome: list[BaseException | None] = []

    def wait_for_lock() -> None:
        try:
            with worktrees.watched(check):
                worktrees.drop_parked(worktrees.parked_path(folder, str(repo)))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_lock, daemon=True)
    try:
        waiter.start()
        waiter.join(10)
        assert outcome, "the wait for the lock went on past the watcher's reason"
        assert isinstance(outcome[0], worktrees.GitStopped) and outcome[0].reason == "timed out after 1 s"
        assert "timed out after 1 s" in str(outcome[0])
        assert len(asked) >= 3, "the watcher (the lease's renewal) was asked while it waited"
    finally:
        recycled.set()
        parker.join(10)
    assert not parker.is_alive(), "the recycle ended the hung park"
