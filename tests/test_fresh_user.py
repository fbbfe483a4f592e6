"""What a fresh user ran into: a mistyped queue path growing a new queue, a refused worker leaving
files beside the path it refused, files beside the queue readable by others. Each through the
product's own entry points (the CLI and the worker as separate processes)."""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

import task_store
import tasks_cli
from helpers import ROOT, run_script

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)


@pytest.mark.parametrize("command", [["status"], ["list"], ["show", "1"], ["logs", "1"], ["events"],
                                     ["clear", "--yes"], ["budget", "show"], ["diff", "1"], ["cancel", "1"]])
def test_a_mistyped_db_is_not_made_into_a_queue(tmp_path, command):
    typo = tmp_path / "no" / "such" / "tasks.db"
    result = run_script("tasks_cli.py", "--db", str(typo), *command, timeout=60)
    assert result.returncode == 1, result.stdout
    assert f"no queue at {typo}: check --db / TASK_DB_PATH" in result.stderr
    assert f"tasks_cli.py --db {typo} submit` makes a new queue" in result.stderr   # the same queue named
    assert not (tmp_path / "no").exists(), "nothing was created"


def test_doctor_reports_a_missing_queue_without_making_it(tmp_path):
    typo = tmp_path / "no" / "tasks.db"
    result = run_script("tasks_cli.py", "--db", str(typo), "doctor", timeout=120)
    assert "not created yet" in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "no").exists()


def test_submit_makes_the_queue_it_names(tmp_path):
    new = tmp_path / "new" / "tasks.db"
    (tmp_path / "work").mkdir()
    result = run_script("tasks_cli.py", "--db", str(new), "submit", "first task", "--dir", str(tmp_path / "work"),
                        timeout=60)
    assert result.returncode == 0, result.stderr
    assert new.exists()
    assert run_script("tasks_cli.py", "--db", str(new), "list", timeout=60).returncode == 0


@pytest.mark.parametrize("kind", ["not a database", "a folder"])
def test_a_refused_worker_leaves_nothing_beside_the_queue(tmp_path, kind):
    queue = tmp_path / "queue"
    queue.mkdir()
    db = queue / "tasks.db"
    if kind == "a folder":
        db.mkdir()
    else:
        db.write_text("these bytes are not SQLite " * 10)
    result = run_script("worker.py", env=dict(os.environ, TASK_DB_PATH=str(db)), timeout=60)
    assert result.returncode == 1 and f"error: the task database {db} cannot be used" in result.stderr, result.stderr
    assert sorted(p.name for p in queue.iterdir()) == ["tasks.db"], "no worker.json, lock, log or logs folder"


@pytest.mark.real_opencode
def test_the_models_cache_beside_the_queue_is_private(opencode):
    task_store.connect().close()
    result = run_script("tasks_cli.py", "models", timeout=120)
    assert result.returncode == 0, result.stderr
    cache = task_store.state_path("models.json")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600


def run_bytes(*args: bytes, stdin: bytes = b"", cwd: str | None = None):
    """tasks_cli.py with raw byte arguments, as a shell passes them."""
    import subprocess
    import sys

    from helpers import ROOT
    return subprocess.run([sys.executable.encode(), str(ROOT / "tasks_cli.py").encode(), *args], input=stdin,
                          capture_output=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("case", ["file", "stdin", "title", "dir", "db", "answer stdin"])
def test_text_that_is_not_utf8_is_refused_naming_the_argument(tmp_path, case):
    task_store.connect().close()
    (tmp_path / "bin.dat").write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00\x86" * 8)
    odd = tmp_path / "d\udcff"   # a folder whose name is not UTF-8
    os.mkdir(os.fsencode(odd))
    d = str(tmp_path).encode()
    args, stdin, said = {
        "file": (
            [b"submit", b"x", b"--dir", d, b"--file", os.fsencode(tmp_path / "bin.dat")],
            b"",
            f"--file {tmp_path / 'bin.dat'} is not UTF-8 text",
        ),
        "stdin": (
            [b"submit", b"y", b"--dir", d, b"-i", b"-"],
            b"ok\xff\xfe",
            "--instructions - (stdin) is not UTF-8 text",
        ),
        "title": ([b"submit", b"bad\xffutf", b"--dir", d], b"", "Invalid value for 'TITLE'"),
        "dir": ([b"submit", b"z", b"--dir", os.fsencode(odd)], b"", "Invalid value for '--dir'"),
        "db": ([b"--db", d + b"/q\xff.db", b"status"], b"", "holds bytes that are not UTF-8"),
        "answer stdin": ([b"answer", b"1", b"-"], b"bad\xff", "TEXT - (stdin) is not UTF-8 text"),
    }[case]
    result = run_bytes(*args, stdin=stdin)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert said in err and "Traceback" not in err
    assert sum(task_store.queue_summary()["counts"].values()) == 0, "nothing was queued"


def test_a_note_that_is_not_utf8_is_refused(tmp_path):
    task = task_store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    result = run_bytes(b"note", task["id"].encode(), b"bad\xff")
    assert result.returncode == 2 and "Invalid value for 'TEXT'" in result.stderr.decode()
    assert "not UTF-8" in result.stderr.decode() and b"Traceback" not in result.stderr


def test_a_current_folder_that_is_not_utf8_is_refused(tmp_path):
    task_store.connect().close()
    odd = os.fsencode(tmp_path) + b"/d\xff"
    os.mkdir(odd)
    result = run_bytes(b"submit", b"here", cwd=odd)
    assert result.returncode == 1 and "has a name that is not UTF-8" in result.stderr.decode()


def wide_dirs(tmp_path) -> dict[str, tuple[str, str]]:
    """working_dir values that would hand an agent far more than a project, and what is said."""
    from helpers import ROOT
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "link-to-root").symlink_to("/")
    return {"/": ("/", "is the root of the filesystem"),
            "root by a link": (str(tmp_path / "link-to-root"), "(that is /) is the root of the filesystem"),
            "home": (str(home), "is your home folder itself"),
            "own checkout": (str(ROOT), "is TaskBridge's own folder"),
            "own cwd": ("/proc/self/cwd", f"(that is {ROOT}) is TaskBridge's own folder"),
            "queue folder": (str(task_store.db_path().parent), "is the folder of TaskBridge's queue")}


CASES = ["/", "root by a link", "home", "own checkout", "own cwd", "queue folder"]


@pytest.mark.anyio
@pytest.mark.parametrize("case", CASES)
async def test_mcp_submit_refuses_a_working_dir_wider_than_a_project(tmp_path, monkeypatch, case):
    from mcp import Client

    import opencode_bridge_mcp as bridge
    from helpers import ROOT, tool_error
    monkeypatch.chdir(ROOT)     # the server runs from its checkout, as serve.py starts it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token"))
    task_store.connect().close()
    value, said = wide_dirs(tmp_path)[case]
    async with Client(bridge.build_server(), mode="legacy") as c:
        refused = await tool_error(c, "submit_task", {"title": "t", "instructions": "i", "working_dir": value})
    assert said in refused and "give the project's own folder" in refused, refused
    assert sum(task_store.queue_summary()["counts"].values()) == 0


@pytest.mark.parametrize("case", [c for c in CASES if c != "own cwd"])
def test_cli_submit_refuses_a_working_dir_wider_than_a_project(tmp_path, case):
    task_store.connect().close()
    value, said = wide_dirs(tmp_path)[case]
    result = run_script("tasks_cli.py", "submit", "t", "--dir", value,
                        env=dict(os.environ, HOME=str(tmp_path / "home")), timeout=60)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert "create it first" not in result.stderr


@pytest.mark.parametrize("entry", ["tasks_cli.py", "serve.py"])
def test_a_claude_desktop_config_that_is_a_folder_is_named_with_the_way_out(tmp_path, entry):
    folder = tmp_path / "Claude"
    folder.mkdir()
    args = ["connect", "--write-claude-desktop"] if entry == "tasks_cli.py" else \
        ["--setup-only", "--quiet", "--write-claude-desktop"]
    env = dict(os.environ, CLAUDE_DESKTOP_CONFIG=str(folder), MCP_TOKEN_FILE=str(tmp_path / "tb" / "token"))
    result = run_script(entry, *args, env=env, timeout=60)
    assert result.returncode == 1
    assert f"cannot write Claude Desktop's config {folder}: it is a folder, not a file" in result.stderr
    assert "point CLAUDE_DESKTOP_CONFIG at the config file itself" in result.stderr
    assert "Errno" not in result.stderr and list(folder.iterdir()) == []


@pytest.mark.real_opencode
def test_the_worker_and_show_count_attempts_alike_after_a_hand_back(opencode, tmp_path, monkeypatch):
    """A hand-back spends no retry: the worker's claimed line must not say 'attempt 3 of 2'."""
    from fake_openai import text
    from helpers import make_repo
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ok", [text('Done.\n```json\n{"summary": "ok", "files_touched": [], "tests_run": [], '
                                      '"open_questions": []}\n```')])
    monkeypatch.setattr(task_store, "RETRY_BACKOFF_SEC", (0, 0))   # claimable again at once
    task = task_store.submit_task(title="counted", instructions="SCRIPT:ok", working_dir=str(repo), max_retries=1)
    first = task_store.claim_next("w", task_id=task["id"])
    task_store.requeue_attempt(task["id"], first["run_marker"], "worker stopped", count_attempt=False)
    second = task_store.claim_next("w", task_id=task["id"])
    task_store.fail_attempt(task["id"], second["run_marker"], "tests red")
    ran = run_script("worker.py", "--max-tasks", "1", timeout=180)
    assert "claimed: counted (attempt 3 (2 of 2 counted; not counted: 1 hand-back), " in ran.stderr, ran.stderr
    shown = run_script("tasks_cli.py", "show", task["id"], timeout=60).stdout
    assert "attempt 3 (2 of 2 counted; not counted: 1 hand-back)" in shown
    assert "3 of 2" not in ran.stderr + shown


@pytest.mark.real_opencode
def test_an_agent_that_deletes_its_worktrees_git_pointer_gets_it_back(opencode, tmp_path, monkeypatch):
    """Unboxed (in the box the pointer is read-only and cannot be removed), `rm -rf .git` in the
    worktree once failed the task with advice; the git guard now puts the pointer back before
    TaskBridge's git runs, names it, and the work is committed."""
    from fake_openai import text, tool_call
    from helpers import git, make_repo
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("rmgit", [tool_call("bash", {"command": "echo new > new.txt && rm -rf .git",
                                                       "description": "x"}),
                                    text('Done.\n```json\n{"summary": "ok", "files_touched": ["new.txt"], '
                                         '"tests_run": [], "open_questions": []}\n```')])
    task = task_store.submit_task(title="rm git", instructions="SCRIPT:rmgit", working_dir=str(repo))
    ran = run_script("worker.py", "--max-tasks", "1", timeout=180)
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", ran.stderr
    assert [p["change"] for p in final["result"]["git_planted"]] == ["removed"]
    assert git(repo, "show", f"taskbridge/{task['id']}:new.txt") == "new"


def test_a_repeated_cherry_pick_says_it_is_already_applied(tmp_path):
    from test_work_back import cli, finished_by_hand

    from helpers import git, make_repo
    repo = make_repo(tmp_path / "repo")
    task = finished_by_hand(repo, {"a.txt": "a\n"})
    for mode in ("--cherry-pick", "--squash"):
        first = cli("apply", task["id"], mode) if mode == "--cherry-pick" else None
        assert first is None or first.exit_code == 0, first.stderr
        head = git(repo, "rev-parse", "HEAD")
        again = cli("apply", task["id"], mode)
        assert again.exit_code == 0, again.stderr
        assert "Already applied" in again.stdout and "allow-empty" not in again.stdout + again.stderr
        assert git(repo, "rev-parse", "HEAD") == head and not git(repo, "status", "--porcelain")


def test_depending_on_a_failed_task_names_retry(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    task = task_store.submit_task(title="t", instructions="i", working_dir=str(work))
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.fail_attempt(task["id"], claimed["run_marker"], "red", retryable=False)
    result = run_script(
        "tasks_cli.py", "submit", "next", "--dir", str(work), "--depends-on", task["id"], timeout=60
    )
    assert result.returncode == 1 and "can never be done" not in result.stderr
    assert f"retry it first (`{tasks_cli.CLI} retry {task['id']}`)" in result.stderr, result.stderr


def test_a_task_whose_dependency_failed_is_retried_through_that_dependency(tmp_path):
    """`retry` of a task that failed because its dependency failed made it pending for good (it
    waited for a dependency that would never finish) and `show` suggested exactly that (a fresh
    user's finding): the retry is refused naming the dependency, and `show` suggests retrying it."""
    parent = task_store.submit_task(title="p", instructions="i", working_dir=str(tmp_path), max_retries=0)
    child = task_store.submit_task(title="c", instructions="i", working_dir=str(tmp_path), depends_on=[parent["id"]])
    claimed = task_store.claim_next("w", task_id=parent["id"])
    task_store.fail_attempt(parent["id"], claimed["run_marker"], "red", retryable=False)
    assert task_store.get_task(child["id"])["status"] == "failed"
    shown = run_script("tasks_cli.py", "show", child["id"], timeout=60, env=os.environ | {"COLUMNS": "300"})
    assert f"Next step: {tasks_cli.CLI} retry {parent['id']} (this task is requeued with it)" in shown.stdout
    refused = run_script("tasks_cli.py", "retry", child["id"], timeout=60)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"depends on {parent['id']}, which is failed, so it could never start" in refused.stderr
    assert f"`{tasks_cli.CLI} retry {parent['id']}`" in refused.stderr, refused.stderr
    assert task_store.get_task(child["id"])["status"] == "failed"
    assert run_script("tasks_cli.py", "retry", parent["id"], timeout=60).returncode == 0
    assert [task_store.get_task(t["id"])["status"] for t in (parent, child)] == ["pending", "pending"]
    # A dependent with a second dependency that ended stays failed when the first is retried (a
    # hostile tester had it pending for good through that path).
    first = task_store.submit_task(title="a", instructions="i", working_dir=str(tmp_path))
    second = task_store.submit_task(title="e", instructions="i", working_dir=str(tmp_path))
    both = task_store.submit_task(title="d", instructions="i", working_dir=str(tmp_path),
                                  depends_on=[first["id"], second["id"]])
    task_store.cancel_task(first["id"])
    task_store.cancel_task(second["id"])
    assert task_store.retry_task(first["id"])["requeued_dependents"] == []
    assert task_store.get_task(both["id"])["status"] == "failed"


def test_a_submit_that_makes_a_new_queue_says_so(tmp_path):
    # A mistyped --db on submit made a queue no worker watches and said only "Submitted t_0001".
    (tmp_path / "repo").mkdir()
    typo = tmp_path / "no" / "tasks.db"
    made = run_script("tasks_cli.py", "--db", str(typo), "submit", "x", "--dir", str(tmp_path / "repo"),
                      "-i", "do it", timeout=60)
    assert made.returncode == 0, made.stderr
    assert f"made a new queue at {typo}" in made.stderr.replace("\n", "") and "same --db" in made.stderr
    again = run_script("tasks_cli.py", "--db", str(typo), "submit", "y", "--dir", str(tmp_path / "repo"),
                       "-i", "do it", timeout=60)
    assert again.returncode == 0 and "made a new queue" not in again.stderr, again.stderr


def test_every_file_kept_beside_the_default_queue_is_ignored_by_git():
    # tasks.models.json and tasks.serve.lock showed as untracked in the checkout, ready to be
    # committed by mistake (found by a new-user test).
    import re
    names = set()
    for source in ROOT.glob("*.py"):
        names.update(re.findall(r'state_path\("([^"]+)"\)', source.read_text()))
    assert {"worker.lock", "serve.lock", "models.json"} <= names
    for name in sorted(names):
        checked = subprocess.run(["git", "check-ignore", "--no-index", "-q", f"tasks.{name}"], cwd=ROOT)
        assert checked.returncode == 0, f"tasks.{name} is not in .gitignore"
