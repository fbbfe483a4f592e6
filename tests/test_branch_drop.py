"""An empty task branch is deleted only together with the queue's record of it (a reviewer's
finding: the ref went first, then the row's write was refused, by a retry landing meanwhile or
the queue away, and the row went on naming a branch that was gone, so a follow-up or fork of the
task failed asking to restore it). A refused or failed record puts the branch back."""
from __future__ import annotations

from pathlib import Path

import pytest

import task_store as store
import worker
import worktrees
from helpers import git, make_repo


def workspace(tmp_path: Path) -> tuple[worktrees.Workspace, Path]:
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    git(repo, "branch", "taskbridge/t_0001", base)
    return worktrees.Workspace(mode="worktree", cwd=str(tmp_path / "wt"), top=str(tmp_path / "wt"), repo=str(repo),
                               branch="taskbridge/t_0001", base_commit=base, own_branch=True), repo


def tip(repo: Path) -> str:
    return git(repo, "branch", "--list", "--format=%(objectname)", "taskbridge/t_0001")


def test_an_empty_branch_whose_deletion_the_queue_does_not_record_is_put_back(tmp_path):
    ws, repo = workspace(tmp_path)
    task = {"id": "t_0001", "run_marker": "br-1-a1"}
    assert worker._branch_dropped(task, ws, lambda: False) is False   # the record refused
    assert tip(repo) == ws.base_commit

    def superseded() -> bool:
        raise store.StaleAttempt("attempt br-1-a1 is no longer the task's")

    with pytest.raises(store.StaleAttempt):
        worker._branch_dropped(task, ws, superseded)
    assert tip(repo) == ws.base_commit

    assert worker._branch_dropped(task, ws, lambda: True) is True   # recorded: gone
    assert tip(repo) == ""


def test_a_branch_made_again_meanwhile_is_never_overwritten(tmp_path):
    ws, repo = workspace(tmp_path)
    git(repo, "branch", "-D", "taskbridge/t_0001")
    (repo / "new.txt").write_text("a new attempt's work\n")
    git(repo, "add", "new.txt")
    git(repo, "commit", "-qm", "work")
    git(repo, "branch", "taskbridge/t_0001", "HEAD")   # the next attempt's branch, with work on it
    work = git(repo, "rev-parse", "HEAD")
    assert worktrees.restore_branch(ws) is False
    assert tip(repo) == work
