"""A task's first worktree never removes another's that holds work (a fresh user's finding: a new
queue made where the old one went numbered from t_0001 again, and its t_0002 removed the old
t_0002's kept worktree, with the person's uncommitted file in it, to make its own there)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import task_store
import tasks_cli
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


def a_claimed_worktree(repo: Path) -> tuple[dict, worktrees.Workspace]:
    """A claimed task's worktree, its place recorded on the lease, as the worker leaves it."""
    task = submit(repo, "runs in a worktree")
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    ws = worktrees.prepare_workspace(claimed, resume=False)
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=ws.top, branch=ws.branch)
    return claimed, ws


def test_a_worktree_set_aside_is_named_in_the_tasks_events_even_when_the_attempt_then_fails(tmp_path, monkeypatch):
    """Before, only the worker's log and the receipt named where set_aside moved an earlier
    attempt's worktree: an attempt that failed after the move (here: making the worktree anew)
    wrote no receipt, and the folder was known to the log alone."""
    repo = make_repo(tmp_path / "repo")
    claimed, ws = a_claimed_worktree(repo)
    (Path(ws.root()) / "work.txt").write_text("the killed attempt's\n")

    def refused(*_args, **_kw):
        raise worktrees.Unrunnable("git worktree add failed")
    monkeypatch.setattr(worktrees, "_on_free_branch", refused)
    with pytest.raises(worktrees.Unrunnable):
        worktrees.prepare_workspace(dict(claimed, branch=ws.branch), resume=False)
    aside = tmp_path / "worktrees" / "left" / f"{claimed['id']}-1"
    assert (aside / "work.txt").read_text() == "the killed attempt's\n"
    said = [e for e in task_store.events_since(0, [claimed["id"]]) if e["kind"] == "leftover"]
    assert len(said) == 1 and str(aside) in said[0]["message"] and claimed["run_marker"] in said[0]["message"]
    assert task_store.leftover_folders([claimed["id"]]) == {claimed["id"]: [
        {"attempt": claimed["run_marker"], "host": task_store.host_name(), "path": str(aside)}]}
    shown = CliRunner().invoke(tasks_cli.cli, ["events", "--json"], catch_exceptions=False)
    assert shown.exit_code == 0 and said[0] in json.loads(shown.output)


def test_clear_removes_the_leftovers_of_the_tasks_it_clears_and_nothing_else(tmp_path):
    """A leftover folder is what an agent left: links (never followed: their targets stay), a
    read-only folder, a fifo. clear removes the cleared task's (both of set_aside's places), not
    another task's, not one its events do not name, not a path outside set_aside's places."""
    root = tmp_path / "worktrees"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("not TaskBridge's\n")
    repo = make_repo(tmp_path / "repo")
    claimed, ws = a_claimed_worktree(repo)
    top = Path(ws.root())
    (top / "link-to-file").symlink_to(outside / "precious.txt")
    (top / "link-to-folder").symlink_to(outside)
    os.mkfifo(top / "fifo")
    (top / "locked").mkdir()
    (top / "locked" / "inside.txt").write_text("x\n")
    (top / "locked").chmod(0o555)
    again = worktrees.prepare_workspace(dict(claimed, branch=ws.branch), resume=False)   # a retry: set aside
    aside = root / "left" / f"{claimed['id']}-1"
    assert again.leftover == str(aside) and (aside / "locked" / "inside.txt").exists()
    beside = Path(f"{top}.left-1")   # set_aside's other place, beside the worktree
    beside.mkdir()
    (beside / "link-to-folder").symlink_to(outside)
    task_store.record_leftover(claimed["id"], claimed["run_marker"], str(beside))
    task_store.record_leftover(claimed["id"], claimed["run_marker"], str(outside))   # not a place of set_aside's
    unnamed = root / "left" / f"{claimed['id']}-2"   # in no event of this queue (another queue's t_0001)
    unnamed.mkdir()
    other = submit(repo, "still pending")
    task_store.claim_next("worker@host", task_id=other["id"])
    others = root / "left" / f"{other['id']}-1"
    others.mkdir(parents=True)
    task_store.record_leftover(other["id"], "br-2-a1", str(others))
    worktrees.remove_worktree(again)
    task_store.complete_attempt(claimed["id"], claimed["run_marker"], result={"summary": "ok"})
    cleared = CliRunner().invoke(tasks_cli.cli, ["clear", "--yes"], catch_exceptions=False)
    assert cleared.exit_code == 0, cleared.output
    assert task_store.counts()["done"] == 0
    said = " ".join(cleared.output.split())
    assert f"Removed leftover {aside}" in said and f"Removed leftover {beside}" in said
    assert f"{outside}: not a place where TaskBridge sets" in said
    assert not os.path.lexists(aside) and not os.path.lexists(beside)
    assert (outside / "precious.txt").read_text() == "not TaskBridge's\n" and os.path.isdir(outside)
    assert unnamed.is_dir() and others.is_dir()
