"""Repository layouts real teams use, with real git: sparse checkouts (the task's worktree is
sparse too), worktree entries git left locked (a killed `git worktree add`, or someone's own
lock), and worktree paths longer than the system allows."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import task_store
import worker
import worktrees
from fake_openai import text, tool_call
from helpers import git, make_repo, run_script, submit

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "wrote docs and code", "files_touched": [], "tests_run": [], ' \
          '"open_questions": []}\n```'
TREE = {"README.md": "# top\n", "src/app.py": "x = 1\n", "docs/guide.md": "guide\n", "lib/util.py": "u = 1\n"}


def sparse_repo(tmp_path):
    """A repository whose checkout is sparse (cone: src): docs/ and lib/ are not on disk."""
    repo = make_repo(tmp_path / "mono", TREE)
    git(repo, "sparse-checkout", "set", "--cone", "src")
    assert not (repo / "docs").exists() and (repo / "src" / "app.py").exists()
    return repo


def claimed(repo, **fields):
    """Queue and claim a task in ``repo``; a test that lets the worker go past preparing takes the
    ``opencode`` fixture, so a regression runs the scripted model, never the user's OpenCode."""
    submit(repo, model="fake/model", **fields)
    return task_store.claim_next("test")


def test_work_in_a_sparse_checkout_is_committed_and_nothing_outside_the_cone_shows_deleted(opencode, tmp_path):
    repo = sparse_repo(tmp_path)
    opencode.model.script("sparse", [
        tool_call("bash", {"command": "test ! -e docs/guide.md && test ! -e lib", "description": "sparse here too"}),
        tool_call("write", {"filePath": "{cwd}/src/new.py", "content": "y = 2\n"}),
        tool_call("write", {"filePath": "{cwd}/docs/new.md", "content": "outside the cone\n"}),
        tool_call("write", {"filePath": "{cwd}/lib/util.py", "content": "u = 2\n"}),
        text("Done.\n" + RECEIPT),
    ])
    task = task_store.submit_task(title="sparse", instructions="SCRIPT:sparse", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    task = task_store.get_task(task["id"])
    assert task["status"] == "done", task["error"]
    receipt = task["result"]
    assert receipt["commands"][0]["exit"] == 0          # the task's worktree was sparse, as the checkout
    assert sorted(receipt["files_touched"]) == ["docs/new.md", "lib/util.py", "src/new.py"]
    assert "deleted file" not in task["diff"] and "+outside the cone" in task["diff"] and "+u = 2" in task["diff"]
    branch = task["branch"]
    assert git(repo, "diff", "--name-status", f"main..{branch}").splitlines() == \
        ["A\tdocs/new.md", "M\tlib/util.py", "A\tsrc/new.py"]
    assert git(repo, "show", f"{branch}:docs/guide.md") == "guide"   # left out, never deleted
    assert not (repo / "docs").exists()                               # the user's checkout stays sparse


def test_a_kept_sparse_worktree_commits_again_without_deleting_what_git_left_out(tmp_path):
    repo = sparse_repo(tmp_path)
    ws = worktrees.prepare_workspace(claimed(repo), resume=False)
    top = ws.top
    assert not os.path.exists(os.path.join(top, "docs"))
    os.makedirs(os.path.join(top, "docs"))
    with open(os.path.join(top, "docs", "first.md"), "w") as fh:
        fh.write("one\n")
    assert worktrees.observed_changes(ws)[0] == ["docs/first.md"]
    first = worktrees.commit_changes(ws, "first")
    with open(os.path.join(top, "src", "second.py"), "w") as fh:
        fh.write("two\n")
    assert worktrees.observed_changes(ws)[0] == ["docs/first.md", "src/second.py"]   # since the base
    second = worktrees.commit_changes(ws, "second")
    assert git(repo, "diff", "--name-status", first, second) == "A\tsrc/second.py"
    assert git(repo, "diff", "--name-status", "main", second).splitlines() == ["A\tdocs/first.md", "A\tsrc/second.py"]
    assert "S lib/util.py" in git(repo, "-C", top, "ls-files", "-t").splitlines()   # still left out


def killed_worktree_add(repo, path, branch):
    """What a killed `git worktree add` leaves (TaskBridge's git time limit, a cancel, a killed
    worker): the add is killed mid-checkout (a slow smudge filter holds it there), so git never
    lifts its `initializing` lock."""
    (repo / ".gitattributes").write_text("slow.txt filter=slow\n")
    (repo / "slow.txt").write_text("s\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "slow")
    git(repo, "config", "filter.slow.smudge", "sleep 30; cat")
    path.parent.mkdir(parents=True, exist_ok=True)
    add = subprocess.Popen(["git", "worktree", "add", "-B", branch, str(path), "HEAD"], cwd=repo,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not list((repo / ".git" / "worktrees").glob("*/locked")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.killpg(add.pid, signal.SIGKILL)
    add.wait()
    git(repo, "config", "--unset", "filter.slow.smudge")
    assert f"worktree {path}" in git(repo, "worktree", "list", "--porcelain")
    assert "locked initializing" in git(repo, "worktree", "list", "--porcelain")


@pytest.mark.parametrize("folder", ["half-made", "gone"])
def test_a_killed_worktree_add_at_the_tasks_own_path_is_cleared(tmp_path, folder):
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    task = claimed(repo)
    path = worktrees.worktree_root() / f"repo-{task['id']}"
    killed_worktree_add(repo, path, f"taskbridge/{task['id']}")
    if folder == "gone":
        subprocess.run(["rm", "-rf", str(path)], check=True)
    ws = worktrees.prepare_workspace(task, resume=False)
    assert ws.top == str(path) and ws.branch == f"taskbridge/{task['id']}"   # its own branch, not a new name
    assert sorted(os.listdir(path)) == [".git", ".gitattributes", "a.txt", "slow.txt"]
    assert git(repo, "-C", str(path), "status", "--porcelain") == ""
    assert "locked" not in git(repo, "worktree", "list", "--porcelain")


def test_someone_elses_lock_at_the_tasks_path_is_named_and_left_alone(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    task = claimed(repo, max_retries=3)
    path = worktrees.worktree_root() / f"repo-{task['id']}"
    path.parent.mkdir(parents=True)
    git(repo, "worktree", "add", "-q", "--lock", "--reason", "on the USB disk", str(path), "-b", "mine")
    (path / "precious.txt").write_text("keep\n")
    final = worker.run_task(task, worker.Knobs())
    assert final["status"] == "failed" and final["attempts"] == 1
    assert "on the USB disk" in final["error"] and "worktree unlock" in final["error"]
    assert "\n" not in final["error"] and "Traceback" not in final["error"]
    assert (path / "precious.txt").read_text() == "keep\n"


@pytest.mark.parametrize("lock", ["someone's", "killed add"])
def test_a_follow_up_reuses_a_worktree_someone_locked_and_remakes_a_half_made_one(tmp_path, lock):
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    first = claimed(repo, worktree_keep=True)
    kept = worktrees.prepare_workspace(first, resume=False)
    task_store.renew_lease(first["id"], first["run_marker"], worktree_path=kept.top, branch=kept.branch)
    if lock == "someone's":   # a lock only keeps git from pruning or moving it: the follow-up works there
        git(repo, "worktree", "lock", "--reason", "kept for review", kept.top)
    else:
        git(repo, "worktree", "remove", kept.top)
        killed_worktree_add(repo, Path(kept.top), kept.branch)
    follow = {**first, "id": "t_0002", "continue_from": first["id"], "branch": None, "base_commit": None}
    ws = worktrees.prepare_workspace(follow, resume=False)
    assert ws.top == kept.top and ws.branch == kept.branch and ws.reused == (lock == "someone's")
    assert os.path.isfile(os.path.join(ws.top, "a.txt"))
    if lock == "killed add":
        assert sorted(os.listdir(ws.top)) == [".git", ".gitattributes", "a.txt", "slow.txt"]


def test_a_repository_folder_name_too_long_for_a_worktree_name_is_cut(tmp_path):
    first = make_repo(tmp_path / ("r" * 250), {"a.txt": "a\n"})
    second = make_repo(tmp_path / ("r" * 249 + "s"), {"a.txt": "a\n"})
    one = worktrees.prepare_workspace(claimed(first), resume=False)
    two = worktrees.prepare_workspace(claimed(second), resume=False)
    assert os.path.isfile(os.path.join(one.top, "a.txt")) and os.path.isfile(os.path.join(two.top, "a.txt"))
    assert one.top != two.top and all(len(os.path.basename(ws.top)) < 255 for ws in (one, two))


def test_a_worktree_path_past_the_systems_limit_fails_at_once_naming_the_root(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    deep = tmp_path.joinpath(*["d" * 200] * 21)
    monkeypatch.setenv("TASKBRIDGE_WORKTREE_ROOT", str(deep))
    final = worker.run_task(claimed(repo, max_retries=3), worker.Knobs())
    assert final["status"] == "failed" and final["attempts"] == 1
    assert "limit of" in final["error"] and "TASKBRIDGE_WORKTREE_ROOT" in final["error"]
    assert "\n" not in final["error"] and len(final["error"]) < 800


def test_a_deep_worktree_whose_files_would_pass_the_limit_fails_naming_the_file(opencode, tmp_path, monkeypatch):
    nested = "/".join(["n" * 200] * 14) + "/leaf.txt"
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n", nested: "deep\n"})
    monkeypatch.setenv("TASKBRIDGE_WORKTREE_ROOT", str(tmp_path.joinpath(*["d" * 200] * 7)))
    final = worker.run_task(claimed(repo), worker.Knobs())
    assert final["status"] == "failed" and "leaf.txt" in final["error"] and "TASKBRIDGE_WORKTREE_ROOT" in final["error"]
    assert not (tmp_path / ("d" * 200)).exists()   # nothing was checked out
