"""Repository layouts real teams use, with real git: sparse checkouts (the task's worktree is
sparse too)."""
from __future__ import annotations

import os

import task_store
import worktrees
from fake_openai import text, tool_call
from helpers import git, make_repo, run_script

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
    task_store.submit_task(title="t", instructions="i", working_dir=str(repo), model="fake/model", **fields)
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
