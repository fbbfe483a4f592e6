"""Two queues' workers on one repository: their tasks' ids repeat (each queue has its t_0001), so
the branch TaskBridge picks for a task can be taken by the other worker between the pick and
git's make. Real git repositories; the other worker is played by a git command run at that moment."""
from __future__ import annotations

from pathlib import Path

import pytest

import task_store
import worktrees
from helpers import git, make_repo


@pytest.fixture
def other_queue_takes_the_name(monkeypatch, tmp_path):
    """The first branch name picked is made and checked out by "another queue's worker" (a worktree
    of its own) right after the pick; returns where that worktree is."""
    real, other = worktrees._free_branch, tmp_path / "other-queue-worktree"

    def pick(repo: str, task: dict, base: str) -> tuple[str, bool]:
        name, new = real(repo, task, base)
        if not other.exists():
            git(Path(repo), "worktree", "add", "-q", "-b", name, str(other), base)
        return name, new
    monkeypatch.setattr(worktrees, "_free_branch", pick)
    return other


def test_a_new_worktree_takes_the_next_free_branch_when_its_name_was_taken_meanwhile(
        other_queue_takes_the_name, tmp_path):
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    path = tmp_path / "wt" / "t_0001"
    branch, saved = worktrees._fresh_worktree(str(repo), path, {"id": "t_0001"}, base)
    assert saved is None
    assert branch == f"taskbridge/t_0001-{task_store.queue_tag()}"
    assert git(path, "branch", "--show-current") == branch
    # the other queue's branch is where it made it, and still its worktree's
    assert git(other_queue_takes_the_name, "branch", "--show-current") == "taskbridge/t_0001"
    assert git(repo, "rev-parse", "taskbridge/t_0001") == base


def test_a_parked_worktree_taken_over_never_resets_a_branch_made_meanwhile(other_queue_takes_the_name, tmp_path):
    """`git switch -C` would have reset the other queue's branch and checked it out a second time
    (git 2.39 lets it); `-c` refuses, and the next free name is used."""
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    other = other_queue_takes_the_name
    parked = worktrees.park_worktree(str(repo), tmp_path / "engine" / "slot_0-ab")
    branch = worktrees._take_parked(str(repo), parked, {"id": "t_0001"}, base)
    assert branch == f"taskbridge/t_0001-{task_store.queue_tag()}"
    assert git(parked, "branch", "--show-current") == branch
    assert git(other, "branch", "--show-current") == "taskbridge/t_0001"
    listed = git(repo, "worktree", "list", "--porcelain").splitlines()
    assert listed.count("branch refs/heads/taskbridge/t_0001") == 1, listed   # checked out once only
