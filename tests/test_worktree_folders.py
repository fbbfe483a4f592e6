"""A task's first worktree never removes another's that holds work (a fresh user's finding: a new
queue made where the old one went numbered from t_0001 again, and its t_0002 removed the old
t_0002's kept worktree, with the person's uncommitted file in it, to make its own there)."""
from __future__ import annotations

import os
from pathlib import Path

import task_store
import worktrees
from helpers import git, make_repo, submit


def first_attempt(repo: Path, title: str) -> worktrees.Workspace:
    task = submit(repo, title, worktree_keep=True)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    ws = worktrees.prepare_workspace(claimed, resume=False)
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=ws.top, branch=ws.branch)
    return ws


def test_another_queues_worktree_holding_work_is_kept_and_the_task_gets_a_folder_of_its_own(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    old = first_attempt(repo, "the old queue's t_0001")
    (repo / ".git" / "info" / "exclude").write_text("*.local\n")
    (Path(old.top) / ".env.local").write_text("a person's secret\n")   # git-ignored: all it holds
    monkeypatch.setenv("TASK_DB_PATH", str(tmp_path / "new" / "tasks.db"))   # a new queue: t_0001 again
    new = first_attempt(repo, "the new queue's t_0001")
    assert new.top != old.top and Path(new.top).name == f"{Path(old.top).name}-{task_store.queue_tag()}"
    assert (Path(old.top) / ".env.local").read_text() == "a person's secret\n"
    listed = git(repo, "worktree", "list")
    assert old.top in listed and new.top in listed


def test_a_worktree_with_commits_its_base_lacks_is_kept_too_but_an_empty_one_is_replaced(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    old = first_attempt(repo, "committed")
    (Path(old.top) / "done.txt").write_text("committed work\n")
    git(Path(old.top), "add", "done.txt")
    git(Path(old.top), "commit", "-qm", "work")
    empty = first_attempt(repo, "nothing in it")   # t_0002: clean, at its base
    monkeypatch.setenv("TASK_DB_PATH", str(tmp_path / "new" / "tasks.db"))
    first = first_attempt(repo, "t_0001 of the new queue")
    assert first.top != old.top and git(Path(old.top), "log", "-1", "--format=%s") == "work"
    second = first_attempt(repo, "t_0002 of the new queue")
    assert second.top == empty.top and os.path.isdir(second.top)   # nothing was in it: made anew there


def test_a_crashed_attempts_worktree_on_the_tasks_own_branch_is_made_anew_in_its_place(tmp_path):
    repo = make_repo(tmp_path / "repo")
    task = submit(repo, "crashed before its folder was recorded")
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    ws = worktrees.prepare_workspace(claimed, resume=False)
    (Path(ws.top) / "junk.txt").write_text("the crashed attempt's\n")
    again = worktrees.prepare_workspace(dict(claimed, branch=ws.branch), resume=False)   # its branch recorded only
    assert again.top == ws.top and not (Path(ws.top) / "junk.txt").exists()


def test_a_worktree_made_anew_over_a_kept_one_moves_it_aside_whole_first(tmp_path, monkeypatch):
    """Both ways a worktree is made anew where one is registered (a checkout's, a remote's
    mirror's) move that one aside whole first, as plain files (its uncommitted and ignored files
    kept; no git command in it); a folder holding nothing is not moved. (tests/test_worker_faults.py
    drives it through a killed worker.)"""
    monkeypatch.setenv("TASKBRIDGE_WORKTREE_ROOT", str(tmp_path / "root"))
    repo = make_repo(tmp_path / "repo")
    base = git(repo, "rev-parse", "HEAD")
    mirror = tmp_path / "mirror.git"
    git(tmp_path, "clone", "-q", "--mirror", str(repo), str(mirror))
    for n, (where, make) in enumerate(((repo, worktrees._fresh_worktree), (mirror, worktrees._detached_worktree))):
        path = tmp_path / "root" / where.name
        task = {"id": f"t_000{n + 7}"}
        made = make(str(where), path, task, base)
        assert (made[1] if isinstance(made, tuple) else made) is None, "a new folder held nothing"
        (path / "README.md").write_text("changed by hand\n")
        (path / ".env.local").write_text("ignored or not, kept\n")
        again = make(str(where), path, task, base)
        aside = Path(again[1] if isinstance(again, tuple) else again)
        assert aside == tmp_path / "root" / "left" / f"{task['id']}-1", aside
        assert (aside / "README.md").read_text() == "changed by hand\n"
        assert (aside / ".env.local").read_text() == "ignored or not, kept\n"
        assert not (aside / ".git").exists(), "plain files: no git command may run in what an agent left"
        assert str(aside) not in git(where, "worktree", "list")
        assert not (path / ".env.local").exists() and git(path, "status", "--porcelain") == ""
        assert git(path, "rev-parse", "HEAD") == base
    # a run that made its worktree's .git a git folder of its own (a config of its choosing): set aside, that
    # folder is renamed, so that no git command run there reads it
    path = tmp_path / "root" / "again"
    worktrees._fresh_worktree(str(repo), path, {"id": "t_0009"}, base)
    (path / ".git").unlink()
    git(tmp_path, "init", "-q", str(path))
    _, aside = worktrees._fresh_worktree(str(repo), path, {"id": "t_0009"}, base)
    assert aside and not os.path.lexists(Path(aside) / ".git") and (Path(aside) / ".git-the-run-left" / "HEAD").exists()
