"""Tasks that name a repository (issue 13): submit validation, hosts and claims, the reaper across
machines. Real git repositories on disk; a bare repository plays the remote."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_board_browser import board, browser  # noqa: F401 - fixtures of the board tests

import task_store
import worker
import worktrees
from helpers import fake_binary, git, make_repo, run_script, submit


@pytest.fixture
def remote(tmp_path):
    """A bare repository with one commit on main: the remote the tasks name."""
    work = make_repo(tmp_path / "seed", {"README.md": "# remote\n"})
    bare = tmp_path / "remote.git"
    git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    return bare


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
    ({"repo": "ssh://-oProxyCommand=touch%20x/a.git"}, "would be read as an ssh option"),
    ({"repo": "ssh://-oProxyCommand=x@example.com/a.git"}, "would be read as an ssh option"),
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



def no_repository_urls(tmp_path: Path) -> list[str]:
    """file:// URLs of folders on this machine that are no git repository: a plain folder, /etc,
    a missing path, the localhost form and a percent-escaped one."""
    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    return [f"file://{plain}", "file:///etc", f"file://{tmp_path}/missing.git", f"file://localhost{plain}",
            f"file://{str(plain).replace('plain', 'pl%61in')}", f"file://{plain}/sub"]


def test_a_file_url_that_is_no_repository_is_refused_at_submit(tmp_path):
    # It was queued and failed only when a worker ran it (found by a new-user test).
    for url in no_repository_urls(tmp_path):
        with pytest.raises(task_store.ValidationError) as caught:
            submit(repo=url)
        said = str(caught.value)
        assert repr(url) in said and "not a git repository here" in said and "\n" not in said, said
    assert task_store.counts()["pending"] == 0
    checkout = make_repo(tmp_path / "checkout")
    assert submit(repo=f"file://{checkout}")["repo"] == f"file://{checkout}"   # a checkout, not bare


def test_cli_and_mcp_refuse_a_file_url_that_is_no_repository(tmp_path):
    import anyio
    from mcp import Client
    from mcp.types import Implementation

    import opencode_bridge_mcp as bridge
    url = no_repository_urls(tmp_path)[0]
    made = run_script("tasks_cli.py", "submit", "x", "--repo", url)
    assert made.returncode != 0 and "not a git repository here" in made.stderr and "Traceback" not in made.stderr

    async def tools() -> list[str]:
        async with Client(bridge.build_server(), client_info=Implementation(name="claude-ai", version="1")) as c:
            one = await c.call_tool("submit_task", {"title": "t", "instructions": "i", "repo": url})
            batch = await c.call_tool("submit_batch", {"tasks": [{"title": "t", "instructions": "i", "repo": url}]})
            return [r.content[0].text for r in (one, batch) if r.is_error]
    refusals = anyio.run(tools)
    assert len(refusals) == 2 and all("not a git repository here" in text for text in refusals), refusals
    assert task_store.counts()["pending"] == 0

# ------------------------------------------------------------------------------------------
# Hosts: where a task may be claimed.


def test_a_local_task_is_for_the_submitting_host_and_a_remote_task_for_any(
    remote, tmp_path, monkeypatch, store_backend
):
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


def test_a_worker_never_claims_a_task_for_another_host(remote, tmp_path, monkeypatch, store_backend):
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


def test_a_worker_pass_on_another_host_leaves_the_task_alone(tmp_path, monkeypatch, store_backend):
    monkeypatch.setenv("TASKBRIDGE_HOST", "a")
    task = submit(working_dir=str(tmp_path))
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "pending"
    assert task_store.events_since(0, [task["id"]])[-1]["kind"] == "submitted"


def test_a_worker_with_a_bad_host_name_refuses_to_start(monkeypatch):
    monkeypatch.setenv("TASKBRIDGE_HOST", "a/b")
    done = run_script("worker.py")
    assert done.returncode == 2 and "TASKBRIDGE_HOST='a/b' is not a plain host name" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_follow_up_of_a_remote_task_inherits_its_repo(remote, store_backend):
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


def test_the_reaper_judges_a_foreign_lease_by_its_heartbeat_only(remote, monkeypatch, store_backend):
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


def test_the_reaper_checks_the_pid_of_a_lease_on_its_own_host(remote, monkeypatch, store_backend):
    task = submit(repo=str(remote))
    _claim_as("here", monkeypatch)                    # the worker pid is gone
    monkeypatch.setenv("TASKBRIDGE_HOST", "here")
    assert worker.reap(worker.Knobs()) == 1
    task = task_store.get_task(task["id"])
    assert task["status"] == "pending" and "is gone" in task["error"]


# ------------------------------------------------------------------------------------------
# The worker: mirror, worktree, push (real git; the real opencode where an agent runs).


def _receipt(summary: str, files: list[str]) -> str:
    return "```json\n" + json.dumps({"summary": summary, "files_touched": files, "tests_run": [],
                                     "open_questions": []}) + "\n```"


def _writes(name: str, content: str, summary: str) -> list:
    from fake_openai import text, tool_call
    return [tool_call("write", {"filePath": "{cwd}/" + name, "content": content}),
            text("Done.\n" + _receipt(summary, [name]))]


def _bare_branches(bare) -> list[str]:
    return git(bare, "for-each-ref", "--format=%(refname:short)", "refs/heads").split()


@pytest.mark.real_opencode
@pytest.mark.parametrize("as_url", [True, False], ids=["file-url", "plain-path"])
def test_a_remote_task_pushes_its_branch_with_the_agents_change(opencode, remote, as_url, tmp_path):
    repo = f"file://{remote}" if as_url else str(remote)
    opencode.model.script("remote", _writes("hello.txt", "hello from the agent\n", "wrote hello.txt"))
    task = submit(instructions="Write hello.txt. SCRIPT:remote", repo=repo)
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    branch, commit = done["pushed_branch"], done["pushed_commit"]
    assert branch == f"taskbridge/{task['id']}" and commit == done["result"]["commit"]
    receipt = done["result"]
    assert (receipt["repo"], receipt["pushed_branch"], receipt["pushed_commit"]) == (done["repo"], branch, commit)
    assert receipt["mirror"]["cloned"] is True and receipt["files_touched"] == ["hello.txt"]
    # The branch arrived in the bare repository, on top of its HEAD branch, with the agent's file.
    assert git(remote, "rev-parse", f"refs/heads/{branch}") == commit
    assert git(remote, "show", f"{branch}:hello.txt") == "hello from the agent"
    assert git(remote, "rev-parse", f"{commit}^") == git(remote, "rev-parse", "main")
    assert _bare_branches(remote) == ["main", branch]
    assert not done["worktree_path"] or not os.path.exists(done["worktree_path"]), "the worktree is removed"
    mirror = receipt["mirror"]["path"]
    assert mirror.startswith(os.environ["TASKBRIDGE_MIRROR_DIR"]) and mirror.endswith(".git")
    # Where the work is, for a person: no checkout here, the branch is on the remote.
    shown = run_script("tasks_cli.py", "branch", task["id"], env=os.environ | {"COLUMNS": "400"})
    assert shown.returncode == 0 and f"git fetch {repo} {branch}" in shown.stdout
    refused = run_script("tasks_cli.py", "apply", task["id"])
    assert refused.returncode != 0 and "was pushed there" in refused.stderr and "git fetch" in refused.stderr
    diff = run_script("tasks_cli.py", "diff", task["id"])
    assert diff.stdout == done["diff"] and "pushed there" in diff.stderr
    listed = run_script("tasks_cli.py", "show", task["id"], env=os.environ | {"COLUMNS": "400"})
    assert branch in listed.stdout and "repo" in listed.stdout


@pytest.mark.real_opencode
def test_a_follow_up_continues_the_pushed_branch_and_the_mirror_is_fetched_not_cloned(opencode, remote):
    opencode.model.script("line", [*_writes("lib.py", "def add(a, b):\n    return a + b\n", "lib"),
                                   *_writes("test_lib.py", "from lib import add\n", "tests")])
    first = submit(instructions="Write lib.py. SCRIPT:line", repo=str(remote), base_ref="main")
    follow = submit(instructions="Now the tests.", continue_from=first["id"])
    assert run_script("worker.py").returncode == 0
    one, two = task_store.get_task(first["id"]), task_store.get_task(follow["id"])
    assert (one["status"], two["status"]) == ("done", "done"), (one["error"], two["error"])
    assert two["pushed_branch"] == one["pushed_branch"], "the follow-up continues on the same branch"
    assert git(remote, "rev-parse", f"{two['pushed_commit']}^") == one["pushed_commit"]
    assert git(remote, "show", f"{two['pushed_branch']}:lib.py").startswith("def add")
    assert git(remote, "show", f"{two['pushed_branch']}:test_lib.py") == "from lib import add"
    assert one["result"]["mirror"]["cloned"] is True and two["result"]["mirror"]["cloned"] is False
    assert one["result"]["mirror"]["path"] == two["result"]["mirror"]["path"]
    assert two["session_id"] == one["session_id"], "same machine: the OpenCode session is resumed"
    # A fork of the first task starts where it ended, not at its follow-up's commit on the branch.
    opencode.model.script("line", [*_writes("lib.py", "def add(a, b):\n    return a + b\n", "lib"),
                                   *_writes("other.txt", "another way\n", "other")])
    fork = submit(instructions="Another way.", fork_from=first["id"])
    assert run_script("worker.py").returncode == 0
    forked = task_store.get_task(fork["id"])
    assert forked["status"] == "done", forked["error"]
    assert git(remote, "rev-parse", f"{forked['pushed_commit']}^") == one["pushed_commit"], forked["result"]
    assert "test_lib.py" not in git(remote, "ls-tree", "--name-only", forked["pushed_branch"]).split()


@pytest.mark.real_opencode
def test_a_refused_push_keeps_the_worktree_and_never_reruns_the_agent(opencode, remote):
    hook = fake_binary(remote / "hooks", "pre-receive", "echo 'policy: this branch is protected' >&2\nexit 1\n")
    opencode.model.script("refused", _writes("hello.txt", "hello\n", "wrote hello.txt"))
    task = submit(instructions="Write hello.txt. SCRIPT:refused", repo=str(remote), max_retries=2)
    assert run_script("worker.py").returncode == 0
    failed = task_store.get_task(task["id"])
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert (
        "the push of taskbridge/t_0001 to" in failed["error"] and "policy: this branch is protected" in failed["error"]
    )
    assert "The agent is not run again" in failed["error"] and "push" in failed["error"]
    receipt = failed["result"]
    assert receipt["worktree_kept"] is True and receipt["bookkeeping_error"] == failed["error"]
    kept = failed["worktree_path"]
    assert (Path(kept) / "hello.txt").read_text() == "hello\n"
    assert git(Path(kept), "rev-parse", "HEAD") == receipt["commit"], "the work is committed in the kept worktree"
    assert failed["pushed_branch"] is None and _bare_branches(remote) == ["main"]
    steps = len(opencode.model.step_requests("refused"))
    assert run_script("worker.py").returncode == 0
    assert len(opencode.model.step_requests("refused")) == steps, "the agent ran once"
    assert task_store.get_task(task["id"])["status"] == "failed"
    # The task is pinned to the machine holding the commit: a worker elsewhere never takes its retry.
    assert failed["host"] == failed["lease_host"] == task_store.host_name()
    task_store.retry_task(task["id"])
    assert run_script("worker.py", env=os.environ | {"TASKBRIDGE_HOST": "elsewhere"}).returncode == 0
    assert task_store.get_task(task["id"])["status"] == "pending"
    # There, a retry pushes the kept commit again, never the agent; refused again, it fails the same way.
    assert run_script("worker.py").returncode == 0
    again = task_store.get_task(task["id"])
    assert again["status"] == "failed" and "failed again: " in again["error"] and "policy" in again["error"]
    assert len(opencode.model.step_requests("refused")) == steps and (Path(kept) / "hello.txt").exists()
    # The push command it names is the one a person can paste.
    assert worktrees.push_command(kept, str(remote), "taskbridge/t_0001") in again["error"]
    # Once the remote takes it, a retry pushes it and the task is done with the first run's receipt.
    hook.unlink()
    task_store.retry_task(task["id"])
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert git(remote, "rev-parse", "taskbridge/t_0001") == receipt["commit"] == done["pushed_commit"]
    assert len(opencode.model.step_requests("refused")) == steps, "the agent ran once in all"


def _pass_fails_before_the_agent(task: dict) -> dict:
    assert run_script("worker.py").returncode == 0
    return task_store.get_task(task["id"])


def test_an_unknown_base_ref_fails_before_the_agent_without_a_retry(remote):
    task = submit(repo=str(remote), base_ref="no-such-branch", model="fake/model", max_retries=3)
    failed = _pass_fails_before_the_agent(task)
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert "base_ref no-such-branch is not a branch, tag or commit of" in failed["error"]
    assert "its branches: main" in failed["error"] and failed["session_id"] is None


def test_a_missing_repository_fails_without_a_retry(tmp_path):
    gone = tmp_path / "gone.git"
    git(tmp_path, "init", "-q", "--bare", str(gone))
    task = submit(repo=f"file://{gone}", model="fake/model", max_retries=3)
    shutil.rmtree(gone)                                   # there at submit, gone by the run
    failed = _pass_fails_before_the_agent(task)
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert "there is no repository there" in failed["error"] and "gone.git" in failed["error"]


def test_a_remote_that_wants_credentials_fails_without_a_retry_naming_the_way_out():
    # An HTTP git server that answers every request with 401: git may not prompt (no terminal).
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        task = submit(repo=f"http://127.0.0.1:{server.server_address[1]}/team/app.git", model="fake/model",
                      max_retries=3)
        failed = _pass_fails_before_the_agent(task)
    finally:
        server.shutdown()
    assert failed["status"] == "failed" and failed["attempts"] == 1, failed["error"]
    assert "was refused" in failed["error"] and "credential helper" in failed["error"]
    assert "never stores credentials" in failed["error"]


def test_an_unreachable_remote_fails_the_attempt_and_is_retried():
    from helpers import free_port
    task = submit(repo=f"http://127.0.0.1:{free_port()}/team/app.git", model="fake/model", max_retries=1)
    again = _pass_fails_before_the_agent(task)
    assert again["status"] == "pending" and again["attempts"] == 1, again["error"]
    assert "check the network" in again["error"]


def test_the_mirror_is_cloned_once_then_fetched_under_its_lock(remote, tmp_path):
    url = f"file://{remote}"
    path, cloned = worktrees.sync_mirror(url)
    assert cloned and path == worktrees.mirror_path(url)
    assert path.name == hashlib.sha1(str(remote.resolve()).encode()).hexdigest() + ".git"
    seed = tmp_path / "seed"
    (seed / "new.txt").write_text("new\n")
    git(seed, "add", "-A")
    git(seed, "commit", "-q", "-m", "more")
    git(seed, "push", "-q", str(remote), "main")
    again, cloned = worktrees.sync_mirror(url)
    assert again == path and not cloned, "the second task fetches into the mirror"
    assert git(path, "rev-parse", "main") == git(remote, "rev-parse", "main"), "and sees the new commit"
    # Another holder of the mirror's lock makes a sync wait; the watcher's word ends the wait.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a');"
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)",
                               f"{path}.lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with worktrees.watched(lambda: "cancelled" if time.monotonic() - started > 0.5 else None):
            with pytest.raises(worktrees.GitStopped, match="waiting for the mirror"):
                worktrees.sync_mirror(url)
        assert time.monotonic() - started >= 0.5
    finally:
        holder.kill()
        holder.wait()


def test_a_retry_replaces_its_own_push_but_never_anothers(remote, tmp_path, store_backend):
    """The lease: a retried task's push replaces what its earlier attempt pushed; a branch
    someone else moved in between is not overwritten (another branch name is taken)."""
    task = submit(repo=str(remote))
    claimed = task_store.claim_next("me")
    ws = worktrees.prepare_workspace(claimed, False)
    (Path(ws.top) / "a.txt").write_text("first\n")
    first = worktrees.push_branch(ws, worktrees.commit_changes(ws, "first"))
    task_store.renew_lease(task["id"], claimed["run_marker"], branch=ws.branch, pushed_branch=ws.branch,
                           pushed_commit=first)
    worktrees.remove_worktree(ws)
    # Its worker died after the push, before the task was marked done: the reaper requeues it.
    task_store.requeue_attempt(task["id"], claimed["run_marker"], "its worker is gone")
    again = task_store.claim_next("me", task_id=task["id"])
    ws = worktrees.prepare_workspace(again, False)
    assert ws.branch == "taskbridge/t_0001" and ws.push_lease == first
    (Path(ws.top) / "a.txt").write_text("second\n")
    second = worktrees.push_branch(ws, worktrees.commit_changes(ws, "second"))
    assert git(remote, "rev-parse", "taskbridge/t_0001") == second
    # Someone else pushes to the branch: a stale lease is refused by the remote.
    other = make_repo(tmp_path / "other")
    git(other, "push", "-q", "--force", str(remote), "main:refs/heads/taskbridge/t_0001")
    (Path(ws.top) / "a.txt").write_text("third\n")
    with pytest.raises(worktrees.GitError, match="stale info|rejected"):
        worktrees.push_branch(ws, worktrees.commit_changes(ws, "third"))
    assert git(remote, "rev-parse", "taskbridge/t_0001") == git(other, "rev-parse", "main")


# ------------------------------------------------------------------------------------------
# The boundaries: MCP tools and the CLI take repo, base_ref and host.


@pytest.mark.anyio
async def test_mcp_submit_takes_a_repo_and_refuses_bad_ones_in_one_line(remote, tmp_path):
    from mcp import Client
    from mcp.types import Implementation

    import opencode_bridge_mcp as bridge
    async with Client(bridge.build_server(), client_info=Implementation(name="claude-ai", version="1")) as c:
        got = await c.call_tool("submit_task", {"title": "t", "instructions": "i", "repo": str(remote),
                                                "base_ref": "main", "host": "buildbox"})
        assert not got.is_error, got.content[0].text
        task = got.structured_content
        assert (task["repo"], task["base_ref"], task["host"], task["working_dir"]) == \
            (str(remote.resolve()), "main", "buildbox", "")
        batch = await c.call_tool("submit_batch", {"tasks": [
            {"ref": "@a", "title": "a", "instructions": "i", "repo": "git@example.com:team/app.git"},
            {"title": "b", "instructions": "i", "continue_from": "@a"}]})
        assert not batch.is_error, batch.content[0].text
        assert [t["repo"] for t in batch.structured_content["tasks"]] == ["git@example.com:team/app.git"] * 2
        for args, said in [({"repo": "https://u:pw@example.com/a.git"}, "must not carry credentials"),
                           ({"repo": str(remote), "working_dir": str(tmp_path)}, "not both"),
                           ({}, "working_dir or repo is required"),
                           ({"repo": str(remote), "base_ref": "a..b"}, "not a valid git ref name"),
                           ({"repo": str(remote), "hots": "x"}, "hots")]:
            refused = await c.call_tool("submit_task", {"title": "t", "instructions": "i", **args})
            assert refused.is_error and said in refused.content[0].text, refused.content[0].text
            assert "\n" not in refused.content[0].text.strip() and "Traceback" not in refused.content[0].text
    assert task_store.counts()["pending"] == 3


def test_cli_submit_takes_repo_base_ref_and_host(remote, tmp_path):
    made = run_script("tasks_cli.py", "submit", "fix it", "--repo", f"file://{remote}", "--base-ref", "main",
                      "--host", "buildbox", "--json")
    assert made.returncode == 0, made.stderr
    task = json.loads(made.stdout)
    assert (task["repo"], task["base_ref"], task["host"]) == (f"file://{remote}", "main", "buildbox")
    shown = run_script("tasks_cli.py", "show", task["id"], env=os.environ | {"COLUMNS": "400"})
    assert f"file://{remote}" in shown.stdout and "buildbox" in shown.stdout
    both = run_script("tasks_cli.py", "submit", "x", "--repo", str(remote), "--dir", str(tmp_path))
    assert both.returncode == 2 and "not both" in both.stderr
    secret = run_script("tasks_cli.py", "submit", "x", "--repo", "https://tok@example.com/a.git")
    assert secret.returncode != 0 and "must not carry credentials" in secret.stderr
    assert "Traceback" not in secret.stderr and "tok@" not in secret.stderr.replace("https://tok@", "")


@pytest.mark.browser
def test_the_board_shows_repo_base_ref_and_pushed_branch_as_text(remote, board, browser):  # noqa: F811 (fixtures)
    import test_board_browser as tb
    waiting = submit(title="on a branch", repo=f"file://{remote}", base_ref="release/2.1")
    task = submit(title="pushed one", repo=f"file://{remote}")
    claimed = task_store.claim_next("worker:x:1", task_id=task["id"])
    task_store.renew_lease(task["id"], claimed["run_marker"], branch="taskbridge/t_0002",
                           pushed_branch="taskbridge/t_0002", pushed_commit="ab" * 20)
    task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})
    tb.log_in(browser, board)
    tb.wait(browser, lambda d: "→ taskbridge/t_0002" in tb.text_of(d, "tasks"), what="the pushed branch in the list")
    assert f"file://{remote} @ release/2.1" in tb.text_of(browser, "tasks")
    browser.get(f"{board}/#/task/{task['id']}")
    tb.wait(browser, lambda d: "taskbridge/t_0002 at abababababab to file://" in tb.text_of(d, "task-view"),
            what="the pushed branch on the task page")
    browser.get(f"{board}/#/task/{waiting['id']}")
    tb.wait(browser, lambda d: "release/2.1" in tb.text_of(d, "task-view"), what="the base ref")
    assert "any" in tb.text_of(browser, "task-view")
    assert tb.console_errors(browser) == []


def test_a_kept_remote_worktree_is_cleared_with_its_mirror_registration(remote):
    task = submit(repo=str(remote), worktree_keep=True)
    claimed = task_store.claim_next("me")
    ws = worktrees.prepare_workspace(claimed, False)
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=ws.top)
    task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "kept"})
    assert ws.top in git(Path(ws.repo), "worktree", "list")
    removed, purged = worktrees.clear_finished(remove_worktrees=True)
    assert [t["id"] for t in removed] == [task["id"]] and purged["worktrees_removed"] == [ws.top]
    assert not os.path.exists(ws.top) and ws.top not in git(Path(ws.repo), "worktree", "list")


def test_a_question_pins_a_remote_task_to_the_host_holding_its_worktree(remote, monkeypatch, store_backend):
    task = submit(repo=str(remote))
    claimed = _claim_as("a", monkeypatch)
    waiting = task_store.pause_for_question(task["id"], claimed["run_marker"], "which one?")
    assert waiting["host"] == "a"
    task_store.answer_task(task["id"], "the first")
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    assert task_store.claim_next("worker:b:1") is None, "its worktree and session are on a"
    monkeypatch.setenv("TASKBRIDGE_HOST", "a")
    assert task_store.claim_next("worker:a:1")["id"] == task["id"]


def test_the_workers_done_line_names_the_pushed_branch_and_remote():
    import worker_talk
    final = {"status": "done", "repo": "git@example.com:team/app.git", "pushed_branch": "taskbridge/t_0001",
             "branch": "taskbridge/t_0001", "usage": {"cost_usd": 0.01}}
    said, _ = worker_talk.ended_line({"id": "t_0001"}, final, 3.0)
    assert said.endswith("pushed taskbridge/t_0001 to git@example.com:team/app.git")
    said, _ = worker_talk.ended_line({"id": "t_0001"}, final | {"pushed_branch": None}, 3.0)
    assert said.endswith("nothing pushed to git@example.com:team/app.git (no change)")


def test_a_repository_of_another_user_fails_without_a_retry_naming_safe_directory(remote):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the repository to another user")
    subprocess.run(["chown", "-R", "nobody", str(remote)], check=True)
    task = submit(repo=str(remote), model="fake/model", max_retries=3)
    failed = _pass_fails_before_the_agent(task)
    assert failed["status"] == "failed" and failed["attempts"] == 1, failed["error"]
    assert "belongs to another user" in failed["error"] and "safe.directory" in failed["error"]


def test_two_slots_syncing_one_new_remote_clone_it_once(remote):
    url = str(remote)
    results, errors = [], []

    def sync():
        try:
            results.append(worktrees.sync_mirror(url))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=sync) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and len(results) == 4
    assert sorted(cloned for _, cloned in results) == [False, False, False, True]
    assert [p.name for p in worktrees.mirror_dir().iterdir() if not p.name.endswith(".lock")] == [results[0][0].name]


def test_an_unusable_mirror_folder_fails_the_task_naming_the_knob(remote, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    monkeypatch.setenv("TASKBRIDGE_MIRROR_DIR", str(blocker / "mirrors"))
    task = submit(repo=str(remote), model="fake/model", max_retries=3)
    failed = _pass_fails_before_the_agent(task)
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert "point TASKBRIDGE_MIRROR_DIR at a writable folder" in failed["error"]
    assert "internal error" not in failed["error"]


# ------------------------------------------------------------------------------------------
# Found by a fresh user: printed commands, another host's kept work, clear elsewhere, echoed
# secrets, mirror keys.

HOSTILE = "q$(touch${IFS}PWNED)`touch${IFS}PWNED2`;touch${IFS}PWNED3|x'y"


def _pushed_task(repo: str, branch_tip: str) -> dict:
    task = submit(repo=repo)
    claimed = task_store.claim_next("worker:x:1", task_id=task["id"])
    task_store.renew_lease(task["id"], claimed["run_marker"], branch=f"taskbridge/{task['id']}",
                           pushed_branch=f"taskbridge/{task['id']}", pushed_commit=branch_tip)
    return task_store.complete_attempt(
        task["id"], claimed["run_marker"], result={"summary": "ok", "commit": branch_tip}
    )


def _run_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed command line pasted into a shell, as a person would."""
    return subprocess.run(["sh", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_every_printed_command_quotes_a_hostile_repository_path(tmp_path, store_backend):
    """A repo path holding $(...), backticks, ';', '|' and a quote: each command TaskBridge prints
    for a person to paste (branch, apply, diff, the push refusal, a kept worktree's refusal, a
    local task's branch commands) is one literal argument per value, and pasting it runs nothing."""
    from worktrees import Workspace
    seed = make_repo(tmp_path / "seed", {"README.md": "# r\n"})
    bare = tmp_path / f"{HOSTILE}.git"
    git(tmp_path, "clone", "-q", "--bare", str(seed), str(bare))
    git(seed, "push", "-q", str(bare), "main:refs/heads/taskbridge/t_0001")
    tip = git(bare, "rev-parse", "taskbridge/t_0001")
    task = _pushed_task(str(bare), tip)
    assert task["repo"] == str(bare.resolve())
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(seed), str(clone))
    info = worktrees.branch_info(task)
    printed = [info["commands"]["fetch"], info["commands"]["switch"], worktrees.remote_work(task)]
    shown = run_script("tasks_cli.py", "branch", task["id"], env=os.environ | {"COLUMNS": "1000"})
    assert shown.returncode == 0 and info["commands"]["fetch"] in shown.stdout, shown.stdout
    refused = run_script("tasks_cli.py", "apply", task["id"], env=os.environ | {"COLUMNS": "1000"})
    assert refused.returncode != 0 and info["commands"]["fetch"] in refused.stderr.replace("\n", "")
    ws = Workspace("worktree", str(tmp_path / f"wt{HOSTILE}"), str(tmp_path / f"wt{HOSTILE}"), str(bare),
                   "taskbridge/t_0001", tip, remote=str(bare))
    printed.append(worktrees.push_command(ws.top, ws.remote, ws.branch))
    assert shlex_split_one(printed[-1]) == ["git", "-C", ws.top, "push", str(bare), "HEAD:refs/heads/taskbridge/t_0001"]
    assert shlex_split_one(info["commands"]["fetch"]) == ["git", "fetch", str(bare), "taskbridge/t_0001"]
    # The fetch line, pasted in a clone of one's own, fetches the branch and runs nothing else.
    done = _run_printed(info["commands"]["fetch"], clone)
    assert done.returncode == 0, done.stderr
    assert git(clone, "rev-parse", "FETCH_HEAD") == tip
    paste = worktrees.remote_work(task).split("In a clone of that repository: ", 1)[1].split(" (or open", 1)[0]
    assert _run_printed(paste, clone).returncode == 0
    # A local checkout with such a name: branch's commands are quoted as well.
    local = make_repo(tmp_path / f"co{HOSTILE}", {"b.txt": "b\n"})
    git(local, "branch", "taskbridge/t_0009")
    commands = worktrees.branch_info({"id": "t_0009", "repo": None, "working_dir": str(local), "status": "done",
                                       "branch": "taskbridge/t_0009", "base_commit": None})["commands"]
    assert shlex_split_one(commands["switch"]) == ["git", "-C", str(local), "switch", "taskbridge/t_0009"]
    assert _run_printed(commands["log"], tmp_path).returncode == 0
    # The worker's message for a refused push names the same quoted command.
    text = task_store.shell_command("git", "-C", ws.top, "add", "-A")
    assert shlex_split_one(text) == ["git", "-C", ws.top, "add", "-A"]
    for name in ("PWNED", "PWNED2", "PWNED3"):
        assert not any(p.name == name for p in tmp_path.rglob(name)), f"pasting a printed command ran {name}"


def shlex_split_one(command: str) -> list[str]:
    import shlex
    return shlex.split(command)


def test_a_kept_remote_worktrees_refusal_prints_quoted_commands(tmp_path):
    seed = make_repo(tmp_path / "seed", {"README.md": "# r\n"})
    bare = tmp_path / f"{HOSTILE}.git"
    git(tmp_path, "clone", "-q", "--bare", str(seed), str(bare))
    submit(repo=str(bare))
    claimed = task_store.claim_next("me")
    ws = worktrees.prepare_workspace(claimed, False)
    (Path(ws.top) / "work.txt").write_text("work\n")
    commit = worktrees.commit_changes(ws, "work")
    with pytest.raises(worktrees.Unrunnable) as caught:
        worktrees._refuse_unpushed(ws.repo, Path(ws.top), claimed | {"branch": ws.branch}, ws.base_commit)
    said = str(caught.value)
    push = said.split("push it (", 1)[1].split(") or remove", 1)[0]
    assert shlex_split_one(push) == ["git", "-C", ws.top, "push", str(bare.resolve()),
                                     f"HEAD:refs/heads/{ws.branch}"]
    assert _run_printed(push, tmp_path).returncode == 0
    assert git(bare, "rev-parse", ws.branch) == commit
    assert not list(tmp_path.rglob("PWNED*"))


def _failed_push_on(host: str, remote, monkeypatch) -> tuple[dict, str]:
    """A task on ``remote`` whose run on ``host`` committed but whose push was refused, as the
    worker records it (receipt with the commit, worktree kept, host pinned)."""
    task = submit(repo=str(remote), max_retries=2)
    claimed = _claim_as(host, monkeypatch)
    ws = worktrees.prepare_workspace(claimed, False)
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=ws.top, branch=ws.branch,
                           base_commit=ws.base_commit)
    (Path(ws.top) / "work.txt").write_text("the agent's work\n")
    commit = worktrees.commit_changes(ws, "taskbridge t_0001: work")
    receipt = {"summary": "did the work", "commit": commit, "worktree_kept": True,
               "bookkeeping_error": "the agent finished, but the push failed: refused"}
    failed = task_store.fail_attempt(task["id"], claimed["run_marker"], receipt["bookkeeping_error"],
                                     retryable=False, result=receipt, diff="the diff\n", pin_host=True)
    return failed, commit


def test_a_retry_after_a_refused_push_runs_only_on_the_host_holding_the_commit(remote, monkeypatch, store_backend):
    failed, commit = _failed_push_on("b", remote, monkeypatch)
    assert failed["status"] == "failed" and failed["host"] == "b" and failed["lease_host"] == "b"
    note = worktrees.unpushed_note(failed)
    assert f"commit {commit[:12]} was never pushed" in note and "on host b" in note
    again = task_store.retry_task(failed["id"])
    assert again["host"] == "b", "the retry keeps the pin"
    monkeypatch.setenv("TASKBRIDGE_HOST", "a")
    assert task_store.claim_next("worker:a:1") is None, "host a has not the commit: it never takes the task"
    shown = run_script("tasks_cli.py", "show", failed["id"], env=os.environ | {"COLUMNS": "400"})
    assert "on host b" in shown.stdout and "was never pushed" in shown.stdout


def test_the_holding_hosts_worker_pushes_the_kept_commit_without_running_the_agent(remote, monkeypatch):
    hook = fake_binary(remote / "hooks", "pre-receive", "echo 'policy: protected' >&2\nexit 1\n")
    failed, commit = _failed_push_on("b", remote, monkeypatch)
    task_store.retry_task(failed["id"])
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    monkeypatch.setenv("OPENCODE_BIN", "/nonexistent/opencode")   # the agent must not be needed
    claimed = task_store.claim_next("worker:b:1")
    refused = worker.run_task(claimed, worker.Knobs())
    assert (
        refused["status"] == "failed"
        and "failed again: " in refused["error"]
        and "policy: protected" in refused["error"]
    )
    assert refused["host"] == "b" and refused["result"]["commit"] == commit and refused["attempts"] == 2
    assert os.path.isdir(failed["worktree_path"]) and _bare_branches(remote) == ["main"]
    hook.unlink()
    task_store.retry_task(failed["id"])
    done = worker.run_task(task_store.claim_next("worker:b:1"), worker.Knobs())
    assert done["status"] == "done", done["error"]
    assert done["pushed_commit"] == commit and done["pushed_branch"] == "taskbridge/t_0001"
    assert git(remote, "rev-parse", "taskbridge/t_0001") == commit
    assert "the agent was not run again" in done["result"]["pushed_again"]
    assert done["result"]["summary"] == "did the work" and done["diff"] == "the diff\n"
    assert "bookkeeping_error" not in done["result"] and not os.path.exists(failed["worktree_path"])


def test_clear_on_another_host_keeps_tasks_whose_worktrees_were_kept_there(remote, monkeypatch, store_backend):
    failed, _ = _failed_push_on("a", remote, monkeypatch)
    other = submit(repo=str(remote))
    claimed = _claim_as("a", monkeypatch)
    task_store.renew_lease(other["id"], claimed["run_marker"], worktree_path="/on/host/a/keep-t_0002")
    task_store.complete_attempt(
        other["id"], claimed["run_marker"], result={"summary": "kept", "worktree_removed": False}
    )
    gone = submit(repo=str(remote))
    claimed = _claim_as("a", monkeypatch)
    task_store.renew_lease(gone["id"], claimed["run_marker"], worktree_path="/on/host/a/gone-t_0003")
    task_store.complete_attempt(gone["id"], claimed["run_marker"], result={"summary": "ok", "worktree_removed": True})
    monkeypatch.setenv("TASKBRIDGE_HOST", "c")
    removed, purged = worktrees.clear_finished(remove_worktrees=True)
    assert [t["id"] for t in removed] == [gone["id"]], "only the task whose worktree is known to be gone"
    assert {h: sorted(ids) for h, ids in purged["kept_on_hosts"].items()} == {"a": sorted([failed["id"], other["id"]])}
    assert os.path.isdir(failed["worktree_path"]), "another host's folder is never touched"
    said = run_script("tasks_cli.py", "clear", "--yes", "--remove-worktrees", env=os.environ | {"COLUMNS": "400"})
    assert said.returncode == 0
    assert "Kept 2 task(s) whose worktrees were kept on host a" in said.stderr and "run clear on a" in said.stderr
    assert "not even with --remove-worktrees" in said.stderr
    assert {t["id"] for t in task_store.list_tasks()["tasks"]} == {failed["id"], other["id"]}


@pytest.mark.parametrize("repo", [
    "deploy:S3cretPassw0rd@github.com:team/app.git",
    "https://deploy:S3cretPassw0rd@github.com/team/app.git",
    "https://S3cretPassw0rd@github.com/team/app.git",
    "https://deploy:S3cretPassw0rd@github.com:team/app.git",
    "ssh://deploy:S3cretPassw0rd@-bad/x.git",
    "ftp://deploy:S3cretPassw0rd@github.com/x.git",
    "https://github.com/team/app.git?token=S3cretPassw0rd",
    "deploy:S3cretPassw0rd @github.com:team/app.git",
    "-deploy:S3cretPassw0rd@github.com:team/app.git",
    "/nonexistent/deploy:S3cretPassw0rd@x.git",
])
def test_a_refused_repo_never_echoes_its_credentials(repo):
    with pytest.raises(task_store.ValidationError) as caught:
        submit(repo=repo)
    assert "S3cret" not in str(caught.value) and "repo" in str(caught.value), str(caught.value)


@pytest.mark.anyio
async def test_mcp_refuses_a_repo_with_a_password_without_echoing_or_logging_it(caplog):
    import logging

    from mcp import Client
    from mcp.types import Implementation

    import opencode_bridge_mcp as bridge
    caplog.set_level(logging.DEBUG)
    async with Client(bridge.build_server(), client_info=Implementation(name="claude-ai", version="1")) as c:
        refused = await c.call_tool("submit_task", {"title": "t", "instructions": "i",
                                                    "repo": "deploy:S3cretPassw0rd@github.com:team/app.git"})
    assert refused.is_error and "'***@github.com:team/app.git'" in refused.content[0].text, refused.content[0].text
    assert "S3cret" not in refused.content[0].text and "S3cret" not in caplog.text


def test_a_relative_mirror_dir_is_refused_naming_the_knob(remote, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TASKBRIDGE_MIRROR_DIR", "relmirrors")
    with pytest.raises(worktrees.Unrunnable, match="TASKBRIDGE_MIRROR_DIR='relmirrors' is a relative path"):
        worktrees.sync_mirror(str(remote))
    task = submit(repo=str(remote), model="fake/model", max_retries=3)
    failed = _pass_fails_before_the_agent(task)
    assert failed["status"] == "failed" and failed["attempts"] == 1 and "relative path" in failed["error"]
    assert not (tmp_path / "relmirrors").exists()
    monkeypatch.setenv("TASKBRIDGE_MIRROR_DIR", "~/mirrors-here")
    assert worktrees.mirror_dir() == Path.home() / "mirrors-here"


def test_one_local_repository_has_one_mirror_however_it_is_named(remote):
    names = [f"file://{remote}", f"file://{remote.parent}/./{remote.name}", str(remote), f"{remote}/",
             f"file://{str(remote).replace('remote', 'rem%6fte')}"]
    assert len({worktrees.mirror_path(name) for name in names}) == 1
    first, cloned = worktrees.sync_mirror(names[0])
    again, cloned_again = worktrees.sync_mirror(names[2])
    assert cloned and not cloned_again and first == again


def test_list_json_carries_the_pushed_commit(remote, store_backend):
    task = _pushed_task(str(remote), "ab" * 20)
    listed = run_script("tasks_cli.py", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(t for t in json.loads(listed.stdout)["tasks"] if t["id"] == task["id"])
    assert row["pushed_commit"] == "ab" * 20 and row["pushed_branch"] == "taskbridge/t_0001"


def test_the_token_files_hints_quote_its_path(tmp_path, monkeypatch, caplog):
    """doctor's fix, the server's warning and serve.py's copy line for a token file whose folder
    name holds shell syntax: each is one literal argument, and pasting the line runs nothing."""
    import logging

    import doctor
    import http_app
    import serve
    folder = tmp_path / HOSTILE
    folder.mkdir()
    token = folder / "token"
    token.write_text("t" * 40 + "\n")
    token.chmod(0o644)
    monkeypatch.delenv("MCP_BEARER_TOKEN", raising=False)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token))
    fix = doctor.check_token().fix
    assert shlex_split_one(fix) == ["chmod", "600", str(token)]
    caplog.set_level(logging.WARNING)
    http_app._warn_if_readable(token)
    assert "run chmod 600 '/" in caplog.text, "the path is quoted (the log line cuts it: a cut quote runs nothing)"
    box = serve.connector_box(8765, "t" * 40, None)
    copy = next(line for line in box.splitlines() if "cat " in line).split("(or ", 1)[1].rsplit(")", 1)[0].strip()
    assert shlex_split_one(copy) == ["cat", str(token)]
    assert _run_printed(fix, tmp_path).returncode == 0 and _run_printed(copy, tmp_path).returncode == 0
    assert token.stat().st_mode & 0o077 == 0
    assert not list(tmp_path.rglob("PWNED*")), "pasting a printed command ran what the path holds"


def test_doctor_lists_the_worktree_of_an_attempt_taken_over_by_another_host(
    remote, tmp_path, monkeypatch, store_backend
):
    import doctor
    taken = submit(repo=str(remote))
    mine = submit(repo=str(remote))
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    first = task_store.claim_next("worker:b:1", task_id=taken["id"])
    left = worktrees.prepare_workspace(first, False)
    task_store.renew_lease(taken["id"], first["run_marker"], worktree_path=left.top)
    current = task_store.claim_next("worker:b:1", task_id=mine["id"])
    kept = worktrees.prepare_workspace(current, False)
    task_store.renew_lease(mine["id"], current["run_marker"], worktree_path=kept.top)
    assert doctor.check_leftover_worktrees().status == "ok", "a running attempt's worktree is not left over"
    # b's heartbeat went stale: the reaper requeued the attempt and host a took it over.
    task_store.requeue_attempt(taken["id"], first["run_marker"], "no heartbeat")
    _claim_as("a", monkeypatch)
    monkeypatch.setenv("TASKBRIDGE_HOST", "b")
    check = doctor.check_leftover_worktrees()
    assert check.status == "warn" and left.top in check.detail and "ran on host a" in check.detail, check.detail
    assert kept.top not in check.detail and "holds commit" not in check.detail
    assert _run_printed(check.fix, tmp_path).returncode == 0, check.fix
    assert not os.path.exists(left.top) and os.path.isdir(kept.top)
    assert doctor.check_leftover_worktrees().status == "ok"
    # One holding a commit the remote has not is named, and not in the removal command.
    (Path(kept.top) / "w.txt").write_text("w\n")
    commit = worktrees.commit_changes(kept, "w")
    task_store.clear_finished()   # nothing finished: stays
    monkeypatch.setenv("TASKBRIDGE_HOST", "c")
    check = doctor.check_leftover_worktrees()
    assert f"holds commit {commit[:12]}" in check.detail and "push or copy the unpushed" in check.fix
    assert kept.top not in check.fix
