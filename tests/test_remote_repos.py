"""Tasks that name a repository (issue 13): submit validation, hosts and claims, the reaper across
machines. Real git repositories on disk; a bare repository plays the remote."""
from __future__ import annotations

import socket
import time

import pytest

import task_store
import worker
from helpers import git, make_repo


@pytest.fixture
def remote(tmp_path):
    """A bare repository with one commit on main: the remote the tasks name."""
    work = make_repo(tmp_path / "seed", {"README.md": "# remote\n"})
    bare = tmp_path / "remote.git"
    git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    return bare


def submit(**fields):
    return task_store.submit_task(title=fields.pop("title", "t"), instructions=fields.pop("instructions", "i"),
                                  **fields)


# ------------------------------------------------------------------------------------------
# Validation: each bad input is refused with a message naming it; nothing is written.


@pytest.mark.parametrize("fields, said", [
    ({}, "working_dir or repo is required"),
    ({"repo": "https://example.com/a.git", "working_dir": "/tmp"}, "not both"),
    ({"repo": "https://user:secret@example.com/a.git"}, "must not carry credentials"),
    ({"repo": "https://ghp_token@example.com/a.git"}, "must not carry credentials"),
    ({"repo": "ssh://git:pw@example.com/a.git"}, "must not carry credentials"),
    ({"repo": "https://example.com/a.git?private_token=x"}, "must not carry credentials"),
    ({"repo": "ext::sh -c touch% /tmp/pwned"}, "without spaces"),
    ({"repo": "ext::sh"}, "neither a git URL"),
    ({"repo": "fd::17"}, "neither a git URL"),
    ({"repo": "ftp://example.com/a.git"}, "scheme 'ftp' is not one of"),
    ({"repo": "https:///a.git"}, "names no host"),
    ({"repo": "file://host/srv/a.git"}, "a file URL names an absolute path"),
    ({"repo": "-uhttps://example.com/a.git"}, "starts with '-'"),
    ({"repo": "relative/path.git"}, "neither a git URL"),
    ({"repo": "/nonexistent/repo.git"}, "not a git repository here"),
    ({"repo": "https://example.com/a b.git"}, "without spaces"),
    ({"repo": 42}, "repo must be text"),
    ({"base_ref": "main", "working_dir": "@tmp"}, "base_ref goes with repo"),
    ({"repo": "@remote", "base_ref": "a..b"}, "not a valid git ref name"),
    ({"repo": "@remote", "base_ref": "-main"}, "not a valid git ref name"),
    ({"repo": "@remote", "base_ref": "main.lock"}, "not a valid git ref name"),
    ({"repo": "@remote", "base_ref": "a b"}, "not a valid git ref name"),
    ({"repo": "@remote", "base_ref": "x@{1}"}, "not a valid git ref name"),
    ({"repo": "@remote", "base_ref": "feat/.hidden"}, "not a valid git ref name"),
    ({"repo": "@remote", "base_ref": "a~1"}, "not a valid git ref name"),
    ({"repo": "@remote", "host": "bad host"}, "not a plain host name"),
    ({"repo": "@remote", "host": "-x"}, "not a plain host name"),
    ({"repo": "@remote", "worktree": False}, "worktree=false cannot go with repo"),
])
def test_bad_submissions_are_refused_naming_the_problem(fields, said, remote, tmp_path):
    fields = {k: str(remote) if v == "@remote" else str(tmp_path) if v == "@tmp" else v for k, v in fields.items()}
    with pytest.raises(task_store.ValidationError, match=None) as caught:
        submit(**fields)
    assert said in str(caught.value)
    assert "\n" not in str(caught.value)
    assert task_store.counts()["pending"] == 0


@pytest.mark.parametrize("repo", [
    "https://example.com/team/app.git", "http://git.local/app", "ssh://git@example.com:2222/app.git",
    "git@github.com:team/app.git", "git://example.com/app.git",
])
def test_remote_urls_are_kept_as_given(repo):
    task = submit(repo=repo, base_ref="release/2.1")
    assert task["repo"] == repo and task["base_ref"] == "release/2.1"
    assert task["working_dir"] == "" and task["host"] is None


def test_a_path_or_file_url_of_a_repository_is_accepted(remote, tmp_path):
    assert submit(repo=f"file://{remote}")["repo"] == f"file://{remote}"
    assert submit(repo=str(remote) + "/")["repo"] == str(remote.resolve())
    checkout = make_repo(tmp_path / "checkout")
    assert submit(repo=str(checkout))["repo"] == str(checkout.resolve())


# ------------------------------------------------------------------------------------------
# Hosts: where a task may be claimed.


def test_a_local_task_is_for_the_submitting_host_and_a_remote_task_for_any(remote, tmp_path, monkeypatch):
    monkeypatch.delenv("TASKBRIDGE_HOST", raising=False)
    assert submit(working_dir=str(tmp_path))["host"] == socket.gethostname()
    monkeypatch.setenv("TASKBRIDGE_HOST", "laptop")
    assert submit(working_dir=str(tmp_path))["host"] == "laptop"
    assert submit(repo=str(remote))["host"] is None
    assert submit(repo=str(remote), host="buildbox")["host"] == "buildbox"
    assert submit(working_dir=str(tmp_path), host="buildbox")["host"] == "buildbox"


def test_a_bad_taskbridge_host_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TASKBRIDGE_HOST", "not a host")
    with pytest.raises(task_store.ValidationError, match="TASKBRIDGE_HOST="):
        submit(working_dir=str(tmp_path))
    with pytest.raises(task_store.ValidationError, match="TASKBRIDGE_HOST="):
        task_store.claim_next("w")
    monkeypatch.setenv("TASKBRIDGE_HOST", "  ")   # blank: the default
    assert task_store.host_name() == socket.gethostname()


def test_a_worker_never_claims_a_task_for_another_host(remote, tmp_path, monkeypatch):
    monkeypatch.setenv("TASKBRIDGE_HOST", "a")
    local = submit(working_dir=str(tmp_path), priority=5)          # for host a
    anywhere = submit(repo=str(remote))                              # for any host
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    claimed = task_store.claim_next("worker:b:1", pid=1, pid_start=1.0)
    assert claimed["id"] == anywhere["id"] and claimed["lease_host"] == "b"
    assert task_store.claim_next("worker:b:1", pid=1, pid_start=1.0) is None
    with pytest.raises(task_store.InvalidTransition, match="is for host a .* this machine is b"):
        task_store.claim_next("cli:me", task_id=local["id"])
    assert task_store.get_task(local["id"])["status"] == "pending"
    assert task_store.queue_summary()["claimable"] == 1, "the queue-wide count still counts it"
    monkeypatch.setenv("TASKBRIDGE_HOST", "a")
    claimed = task_store.claim_next("worker:a:1", pid=1, pid_start=1.0)
    assert claimed["id"] == local["id"] and claimed["lease_host"] == "a"


def test_a_worker_pass_on_another_host_leaves_the_task_alone(tmp_path, monkeypatch):
    from helpers import run_script
    monkeypatch.setenv("TASKBRIDGE_HOST", "a")
    task = submit(working_dir=str(tmp_path))
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "pending"
    assert task_store.events_since(0, [task["id"]])[-1]["kind"] == "submitted"


def test_a_worker_with_a_bad_host_name_refuses_to_start(monkeypatch):
    from helpers import run_script
    monkeypatch.setenv("TASKBRIDGE_HOST", "a/b")
    done = run_script("worker.py")
    assert done.returncode == 2 and "TASKBRIDGE_HOST='a/b' is not a plain host name" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_follow_up_of_a_remote_task_inherits_its_repo(remote):
    first = submit(repo=str(remote), base_ref="main")
    follow = submit(continue_from=first["id"])
    assert (follow["repo"], follow["base_ref"], follow["working_dir"]) == (str(remote.resolve()), "main", "")
    with pytest.raises(task_store.ValidationError, match="leave base_ref out"):
        submit(fork_from=first["id"], base_ref="dev")
    with pytest.raises(task_store.ValidationError, match="works on the remote"):
        submit(fork_from=first["id"], repo="https://example.com/other.git")


# ------------------------------------------------------------------------------------------
# Liveness across machines: pids are checked only on the lease's own host.


def _claim_as(host: str, monkeypatch, pid: int = 4_000_000) -> dict:
    monkeypatch.setenv("TASKBRIDGE_HOST", host)
    claimed = task_store.claim_next(f"worker:{host}:{pid}", pid=pid, pid_start=1.0)
    monkeypatch.delenv("TASKBRIDGE_HOST")
    return claimed


def test_the_reaper_judges_a_foreign_lease_by_its_heartbeat_only(remote, monkeypatch):
    task = submit(repo=str(remote), timeout_sec=1)
    claimed = _claim_as("elsewhere", monkeypatch)     # a pid that does not exist here
    assert claimed["lease_host"] == "elsewhere"
    time.sleep(1.1)                                   # past its timeout, heartbeat renewed below
    task_store.renew_lease(task["id"], claimed["run_marker"])
    monkeypatch.setenv("TASKBRIDGE_HOST", "here")
    assert worker.reap(worker.Knobs()) == 0, "a fresh heartbeat from another host is never requeued"
    assert task_store.get_task(task["id"])["status"] == "running"
    monkeypatch.setenv("WORKER_STALE_SEC", "0.5")
    time.sleep(0.6)
    assert worker.reap(worker.Knobs()) == 1
    task = task_store.get_task(task["id"])
    assert task["status"] == "pending" and "no heartbeat since" in task["error"]


def test_the_reaper_checks_the_pid_of_a_lease_on_its_own_host(remote, monkeypatch):
    task = submit(repo=str(remote))
    _claim_as("here", monkeypatch)                    # the worker pid is gone
    monkeypatch.setenv("TASKBRIDGE_HOST", "here")
    assert worker.reap(worker.Knobs()) == 1
    task = task_store.get_task(task["id"])
    assert task["status"] == "pending" and "is gone" in task["error"]
