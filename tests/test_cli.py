"""tasks_cli.py through click's CliRunner (and once as a real script): every command, by hand."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import task_store
import tasks_cli
from helpers import make_repo, submit
from tasks_cli import cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder for tasks to run in, beside the test's queue (tmp_path holds the queue, its logs
    and worktrees: an in-place task in tmp_path itself is refused at submit)."""
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def run(*args: str, input: str | None = None):
    """Invoke the CLI in-process; never lets an exception escape as a traceback."""
    result = CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


TITLE = "Fix the README"     # a task's title where the test names none


def snapshot() -> tuple:
    """What bad input must leave untouched: tasks per status, the newest event, notes seen."""
    return task_store.counts(), task_store.last_event_id()


# --------------------------------------------------------------------------------------------
# Help and the script entry.


def test_every_command_and_option_has_help():
    assert set(cli.commands) >= {"submit", "pending", "list", "show", "claim", "complete", "fail",
                                 "heartbeat", "answer", "note", "cancel", "clear", "logs", "status",
                                 "events"}
    for name, command in cli.commands.items():
        assert command.help and command.help.strip().splitlines()[0], name
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"{name} {param.opts} has no help"
        result = run(name, "-h")
        assert result.exit_code == 0, name
        assert command.help.strip().split()[0] in result.output
    for param in cli.params:
        if isinstance(param, click.Option):
            assert param.help, param.opts


def test_script_runs_as_python_tasks_cli(tmp_path):
    env = os.environ | {"TASK_DB_PATH": str(tmp_path / "script.db")}
    proc = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "submit" in proc.stdout and f"Usage: {tasks_cli.CLI}" in proc.stdout
    version = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "--version"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert version.stdout.strip() == f"tasks_cli {tasks_cli.__version__}"
    assert not (tmp_path / "script.db").exists()  # help and version touch no database


# --------------------------------------------------------------------------------------------
# Submit, list, show.


def test_submit_list_show_round_trip(tmp_path, work, monkeypatch):
    # Without OpenCode here the model cannot be checked: it is queued with a warning saying so.
    monkeypatch.setenv("OPENCODE_BIN", str(tmp_path / "no-opencode"))
    result = run("submit", "Add a [/red] test", "-d", str(work), "-i", "write tests", "-p", "7",
                 "--timeout", "600", "--max-retries", "2", "--permission", "readonly",
                 "--no-worktree", "--agent", "build", "--model", "opencode/cat-jam-free")
    assert result.exit_code == 0, result.output
    assert "Submitted t_0001" in result.stdout
    assert "Could not check opencode/cat-jam-free against OpenCode" in result.stderr
    assert "queued unchecked" in result.stderr
    task = task_store.get_task(1)
    assert (task["title"], task["instructions"], task["working_dir"]) == (
        "Add a [/red] test",
        "write tests",
        str(work),
    )
    assert (task["priority"], task["timeout_sec"], task["max_retries"]) == (7, 600, 2)
    assert (task["permission"], task["worktree"], task["agent"]) == ("readonly", False, "build")
    assert (task["origin_name"], task["origin_version"]) == ("tasks_cli", tasks_cli.__version__)

    listing = run("list")
    assert listing.exit_code == 0
    assert "t_0001" in listing.stdout and "pending" in listing.stdout and "[/red]" in listing.stdout
    assert "showing 1–1 of 1" in listing.stdout

    for ident in ("t_0001", "0001", "1"):
        shown = run("show", ident)
        assert shown.exit_code == 0
        assert "write tests" in shown.stdout and "readonly" in shown.stdout and "tasks_cli" in shown.stdout
    as_json = json.loads(run("show", "1", "--json").stdout)
    assert as_json["id"] == "t_0001" and as_json["events"][0]["kind"] == "submitted"
    page = json.loads(run("list", "--json", "--status", "pending").stdout)
    assert [t["id"] for t in page["tasks"]] == ["t_0001"]
    assert json.loads(run("list", "--json", "--status", "done").stdout)["total"] == 0


def test_instructions_longer_than_the_limit_are_refused_before_they_are_all_read(tmp_path):
    """`submit -f /dev/zero` read without end (12 GB resident after 16 s, found by a tester), and
    `-i -` or `answer TEXT -` read a 300 MB stdin whole before the limit was checked. Input is
    read no further than the limit's bytes; the process here may use 1 GB."""
    def limited() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    before = snapshot()
    for args, stdin in ((["-f", "/dev/zero"], subprocess.DEVNULL), (["-f", "-"], "/dev/zero"),
                        (["-i", "-"], "/dev/zero")):
        with open(stdin, "rb") if isinstance(stdin, str) else open(os.devnull, "rb") as source:
            done = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "submit", "t", "--dir", str(tmp_path),
                                   *args], stdin=source, capture_output=True, text=True, timeout=60,
                                  preexec_fn=limited)
        assert done.returncode == 2, (args, done.stderr[-500:])
        assert "is longer than the limit of 200,000 characters" in done.stderr and "Traceback" not in done.stderr
    assert snapshot() == before, "nothing was queued"
    task = submit(tmp_path)
    with open("/dev/zero", "rb") as zeros:
        done = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "answer", task["id"], "-"], stdin=zeros,
                              capture_output=True, text=True, timeout=60, preexec_fn=limited)
    assert done.returncode == 2 and "TEXT - (stdin) is longer than the limit of 50,000 characters" in done.stderr


def test_submit_defaults_dir_to_cwd_and_reads_stdin(tmp_path, work, monkeypatch):
    monkeypatch.chdir(work)
    # Not a git repository: the agent would run in place, so it takes --yes (no terminal to ask on).
    refused = run("submit", "Here", input="")
    assert refused.exit_code == 1 and "is not a git repository" in refused.stderr
    assert "--yes" in refused.stderr and task_store.counts()["pending"] == 0
    result = run("submit", "From stdin", "--file", "-", "--json", "--yes", input="line one\nline two\n")
    task = json.loads(result.stdout)
    assert task["working_dir"] == str(work)
    assert task_store.get_task(task["id"])["instructions"] == "line one\nline two\n"
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "init"], check=True)   # a repository with no commits is refused
    plain = run("submit", "Title only", "--json")        # a git repository: no question
    assert task_store.get_task(json.loads(plain.stdout)["id"])["instructions"] == "Title only"
    # An empty pipe was taken silently, the title standing in (found by a new-user test).
    for option in (["-i", "-"], ["--file", "-"]):
        empty = run("submit", "Empty", *option, input="\n")
        assert empty.exit_code == 2 and "read no instructions (empty input)" in empty.stderr, empty.stderr
    assert task_store.counts()["pending"] == 2, "nothing queued by the refused submits"


def test_submit_to_a_named_folder_outside_git_says_it_runs_in_place(tmp_path):
    from helpers import make_repo
    loose = tmp_path / "loose"
    loose.mkdir()
    said = run("submit", "Loose", "--dir", str(loose))
    assert said.exit_code == 0 and "Submitted t_0001" in said.stdout
    assert "Warning:" in said.stderr and f"{loose} is not in a git repository" in said.stderr
    assert "in place" in said.stderr and "git init" in said.stderr
    as_json = json.loads(run("submit", "Loose", "--dir", str(loose), "--json").stdout)
    assert any("in place" in w for w in as_json["warnings"])
    # `show` said "worktree yes" for it (a fresh user's finding).
    assert "its folder is in no git repository, so it runs in place" in run("show", "t_0001").stdout
    task_store.claim_next("w", task_id="t_0001")   # running too
    assert "its folder is in no git repository, so it runs in place" in run("show", "t_0001").stdout
    repo = make_repo(tmp_path / "repo", {"sub/f.txt": "x\n"})
    in_repo = run("submit", "Kept apart", "--dir", str(repo / "sub"))
    assert in_repo.exit_code == 0 and "Warning" not in in_repo.stderr
    shown = run("show", "t_0003").stdout.splitlines()
    assert next(row for row in shown if row.startswith("worktree ")).split(None, 1)[1].strip() == "yes", shown
    unasked = run("submit", "Asked for in place", "--dir", str(loose), "--no-worktree")
    assert "Warning" not in unasked.stderr


def test_submit_with_key_is_idempotent_and_depends_on(tmp_path, work):
    first = json.loads(run("submit", "A", "-d", str(work), "--key", "k1", "--json").stdout)
    again = run("submit", "A", "-d", str(work), "--key", "k1")
    assert "Already queued as t_0001" in again.stdout
    assert task_store.counts()["pending"] == 1
    child = json.loads(run("submit", "B", "-d", str(work), "--depends-on", first["id"], "--json").stdout)
    assert child["depends_on"] == ["t_0001"]


def test_pending_lists_only_pending(tmp_path):
    submit(tmp_path, "queued one")
    done = submit(tmp_path, "finished one")
    claimed = task_store.claim_next("cli:x", task_id=done["id"])
    task_store.complete_attempt(done["id"], claimed["run_marker"], result={"summary": "ok"})
    page = json.loads(run("pending", "--json").stdout)
    assert [t["title"] for t in page["tasks"]] == ["queued one"]
    assert "queued one" in run("pending").stdout


def test_show_renders_the_receipt_and_prints_the_diff(tmp_path):
    task = submit(tmp_path, TITLE)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    usage = {"tokens": {"input": 1234, "output": 56, "cache": {"read": 7}}, "cost_usd": 0.0042}
    receipt = {"summary": "changed README", "files_touched": ["README.md"], "commands": ["pytest -q"],
               "tests_run": ["tests/test_x.py"], "open_questions": ["ship it?"], "usage": usage,
               "sandbox": {"isolation": "git worktree", "permission": "auto"},
               "tool_errors": [{"tool": "bash", "error": "denied"}], "worktree_path": None}
    diff = "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-old\n+new\n"
    task_store.complete_attempt(task["id"], claimed["run_marker"], result=receipt, diff=diff, usage=usage)
    shown = run("show", "1").stdout
    for text in ("changed README", "README.md", "pytest -q", "tests/test_x.py", "ship it?",
                 "isolation=git worktree", "tool=bash, error=denied", "input=1234, output=56, cache={read=7}",
                 "$0.0042", "5 line(s)", "br-1-a1"):
        assert text in shown, text
    assert run("show", "1", "--diff").stdout == diff
    # --json beside --diff was ignored (the raw diff came out): it gives what `diff --json` gives
    assert json.loads(run("show", "1", "--diff", "--json").stdout) == {"task_id": "t_0001", "diff": diff}
    assert run("show", "1", "--diff", "--json").stdout == run("diff", "1", "--json").stdout
    bare = submit(tmp_path, "no diff")
    refused = run("show", bare["id"], "--diff")
    assert refused.exit_code == 1 and "has no diff" in refused.stderr


def hinted_scripts(text: str) -> list[str]:
    """Each command a hint names to start one of this checkout's scripts: what stands before
    ``NAME.py`` (the interpreter, if any) and the script, e.g. ``python worker.py``."""
    return re.findall(r"(?:[^\s`(]*python[^\s`]* )?[\w/]+\.py\b", text)


def test_every_hint_names_a_command_that_runs_from_the_checkout(tmp_path):
    # A fresh machine's `python` (when there is one) lacks the dependencies: a hint's command
    # must run from the checkout with nothing but what ./install.sh made, no python on PATH.
    import doctor
    import task_views
    submit(tmp_path, TITLE)
    hand = submit(tmp_path, "by hand")
    texts = {"show": run("show", "1").stdout, "status": run("status").stderr,
             "claim": run("claim", hand["id"]).stdout, "judge_worker": task_views.judge_worker(None)["summary"],
             "doctor": doctor.check_worker().fix, "not running": run("complete", "1", "--summary", "x").stderr}
    empty = tmp_path / "no-python-on-path"
    empty.mkdir()
    for where, text in texts.items():
        commands = hinted_scripts(text)
        assert commands, (where, text)
        for command in set(commands):
            proc = subprocess.run(f"{command} --help", shell=True, executable="/bin/sh", cwd=ROOT,
                                  capture_output=True, text=True, timeout=60,
                                  env={"PATH": str(empty), "TASK_DB_PATH": str(tmp_path / "help.db")})
            assert proc.returncode == 0, (where, command, proc.stderr)


def test_show_says_where_the_agents_word_goes_beyond_what_the_run_showed(tmp_path):
    """A fresh tester's agent claimed b.txt and `pytest -q`; show printed both as facts, though git
    saw a.txt only and no command ran. Tests are the agent's word, and a claim unseen is said."""
    task = submit(tmp_path, TITLE)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    receipt = {"summary": "Added b.txt and ran tests, all pass", "files_touched": ["a.txt"],
               "files_claimed": ["b.txt", "a.txt"], "tests_run": ["pytest -q", "npm test"],
               "commands": [{"command": "cd web && npm test", "status": "completed", "exit": 0}]}
    task_store.complete_attempt(task["id"], claimed["run_marker"], result=receipt)
    shown = " ".join(run("show", task["id"]).stdout.split())
    assert "tests run (the agent's word)" in shown
    assert "the agent says it ran pytest -q, but no command of its run was that" in shown
    assert "the agent says it touched b.txt, which git did not see changed" in shown
    assert "npm test, but" not in shown and "a.txt, which" not in shown


def test_show_leads_with_why_and_the_next_step_and_says_each_field_once(tmp_path):
    task = submit(tmp_path, TITLE, max_retries=0)
    assert f"or {tasks_cli.CLI} cancel t_0001" in run("show", "1").stdout
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    receipt = {"summary": "half done", "model": "fake/model", "branch": "taskbridge/t_0001", "attempt": 1,
               "max_retries": 0, "session_id": "ses_1", "non_json_lines": 0, "block_found": True,
               "exit_code": 0, "agent_exited": True, "ended_with_run": [], "isolation": "worktree"}
    task_store.fail_attempt(task["id"], claimed["run_marker"], "tests stayed red", retryable=False, result=receipt)
    lines = run("show", "1").stdout.splitlines()
    assert lines[0].split() == ["t_0001", "Fix", "the", "README", "failed"]
    assert lines[1] == "Why it failed: tests stayed red"
    assert lines[2].startswith(f"Next step: {tasks_cli.CLI} retry t_0001")
    shown = "\n".join(lines).split("Last events")[0]   # the event log keeps its own record
    for internal in ("non json lines", "block found", "exit code", "agent exited", "ended with run",
                     "max retries", "session id", "isolation"):
        assert internal not in shown, internal
    assert shown.count("tests stayed red") == 1 and shown.count("Fix the README") == 1
    assert "fake/model (the default)" in shown and "warnings" not in shown
    noisy = submit(tmp_path, "noisy")
    marker = task_store.claim_next("worker@host", task_id=noisy["id"])["run_marker"]
    task_store.complete_attempt(noisy["id"], marker, result={"summary": "ok", "non_json_lines": 3,
                                                             "block_found": False, "exit_code": 0})
    shown = squash(run("show", noisy["id"]).stdout)
    assert "3line(s)oftheagent'soutputwerenotJSONevents" in shown and "withoutareceiptblock" in shown
    assert "Nextstep:nothingtoapply" in shown
    assert f"submit--continue{noisy['id']}" in shown   # retry refuses a done task: a follow-up asks for more
    # A fresh user read `repo config  files=, restrictions=` and `no change  True`: empty parts go,
    # a yes/no reads as one.
    plain_run = submit(tmp_path, "plain")
    marker = task_store.claim_next("worker@host", task_id=plain_run["id"])["run_marker"]
    task_store.complete_attempt(plain_run["id"], marker, result={
        "summary": "ok", "no_change": True, "repo_config": {"files": [], "restrictions": [], "housekeeping_undone": []},
        "pushed": {"branch": "b", "remote": None}})
    shown = run("show", plain_run["id"]).stdout
    assert re.search(r"no change\s+yes *\n", shown) and re.search(r"repo config\s+- *\n", shown), shown
    assert re.search(r"pushed\s+branch=b *\n", shown) and "=," not in shown and "True" not in shown, shown


def test_a_gone_workers_task_is_said_to_fail_when_its_retries_are_spent(tmp_path, monkeypatch):
    """A fresh user was told the next pass hands the task back, and it failed: the kill had
    spent its last retry."""
    monkeypatch.setattr(tasks_cli.task_views, "holder_gone", lambda _task: True)
    for retries, said in ((1, "the next worker pass hands the task back to the queue"),
                          (0, f"the next worker pass fails it, its retries spent ({tasks_cli.CLI} retry")):
        task = submit(tmp_path, TITLE, max_retries=retries)
        task_store.claim_next("worker@host", task_id=task["id"])
        assert squash(said) in squash(run("show", task["id"]).stdout), retries


def test_a_submit_says_when_no_worker_serves_the_queue(tmp_path, work):
    """A fresh user queued tasks with the server stopped and heard nothing: the task waits, and
    how to start a worker is said; with a worker serving the queue, nothing is."""
    alone = run("submit", "first", "-d", str(work), "--yes")
    assert alone.exit_code == 0 and "Note: no worker serves this queue now, so it waits" in alone.stderr
    assert "worker.py" in alone.stderr
    task_store.write_worker_heartbeat({"state": "idle"})    # this live process serves it
    served = run("submit", "second", "-d", str(work), "--yes")
    assert served.exit_code == 0 and "no worker" not in served.stderr


def test_a_tool_named_with_its_task_id_becomes_one_command():
    said = tasks_cli.in_cli_words("retry it first (retry_task t_0014), or set TASK_DB_PATH; see list_tasks")
    assert said == (f"retry it first (`{tasks_cli.CLI} retry t_0014`), or set --db / TASK_DB_PATH; "
                    f"see `{tasks_cli.CLI} list`")


def test_show_names_the_command_for_a_waiting_task(tmp_path):
    waiting_task(tmp_path)
    lines = run("show", "1").stdout.splitlines()
    assert lines[1] == "Question: Which branch?"
    assert lines[2] == f'Next step: {tasks_cli.CLI} answer t_0001 "your answer"'


# --------------------------------------------------------------------------------------------
# Claiming by hand.


def test_claim_then_complete_by_hand(tmp_path):
    submit(tmp_path, TITLE)
    claimed = run("claim", "1", "--as", "alice")
    assert claimed.exit_code == 0
    assert "br-1-a1" in claimed.stdout and "cli:alice" in claimed.stdout
    assert task_store.get_task(1)["lease_owner"] == "cli:alice"
    assert run("heartbeat", "1").exit_code == 0
    done = run("complete", "t_0001", "--summary", "fixed by hand")
    assert done.exit_code == 0 and "done" in done.stdout
    task = task_store.get_task(1)
    assert task["status"] == "done"
    assert task["result"] == {"summary": "fixed by hand", "completed_by": "cli:alice"}


def test_claim_defaults_owner_to_user_and_best_task(tmp_path, monkeypatch):
    monkeypatch.setenv("USER", "bob")
    submit(tmp_path, "low")
    submit(tmp_path, "high", priority=5)
    claimed = json.loads(run("claim", "--json").stdout)
    assert claimed["title"] == "high" and claimed["lease_owner"] == "cli:bob"
    run("claim")
    nothing = run("claim")
    assert nothing.exit_code == 0 and "Nothing to claim" in nothing.stderr


def test_claim_then_fail_requeues_then_fails_for_good(tmp_path, monkeypatch):
    monkeypatch.setattr(task_store, "RETRY_BACKOFF_SEC", (0, 0))  # no back-off wait in the test
    submit(tmp_path, TITLE, max_retries=1)
    run("claim", "1")
    failed = run("fail", "1", "--reason", "tests red")
    assert failed.exit_code == 0 and "requeued" in failed.stdout
    task = task_store.get_task(1)
    assert (task["status"], task["error"]) == ("pending", "tests red")
    assert "br-1-a2" in run("claim", "1").stdout
    final = run("fail", "1", "--reason", "still red", "--no-retry")
    assert final.exit_code == 0 and "failed." in final.stdout
    assert task_store.get_task(1)["status"] == "failed"


def test_fail_without_retry_ends_the_task_at_once(tmp_path):
    submit(tmp_path, TITLE, max_retries=3)
    dependent = submit(tmp_path, "after", depends_on=["t_0001"])
    run("claim", "1")
    assert run("fail", "1", "--reason", "cannot be done", "--no-retry").exit_code == 0
    assert task_store.get_task(1)["status"] == "failed"
    assert "dependency t_0001 failed" in task_store.get_task(dependent["id"])["error"]


def test_a_retry_right_after_a_cancel_says_it_waits_for_the_old_workers_wrap_up(tmp_path):
    submit(tmp_path, TITLE)
    task_store.claim_next("worker:a:1", task_id=1)
    task_store.cancel_task(1)
    retried = run("retry", "1")
    assert retried.exit_code == 0
    said = " ".join(retried.stdout.split())
    assert "It waits: the cancelled attempt br-1-a1 is still being wrapped up by worker:a:1" in said, said
    assert "worker:a:1 to wrap up the cancelled attempt br-1-a1" in " ".join(run("show", "1").stdout.split())
    assert "cancelled attempt's wrap-up" in run("claim").stderr


def test_a_long_fail_reason_is_kept_whole_in_the_log_its_clipped_error_names(tmp_path):
    """A reason past ERROR_MAX was stored clipped with a note naming the task's log as holding the
    whole text, and a task claimed by hand has no log: the note named a file that did not exist."""
    submit(tmp_path, TITLE)
    run("claim", "1")
    reason = "head " + "x" * 6_000 + " tail"
    failed = run("fail", "1", "--reason", reason, "--no-retry")
    assert failed.exit_code == 0, failed.output
    said = " ".join(failed.stdout.split())
    assert "The reason has 6,010 characters: the task's error keeps 4,000 of them (head and tail); the whole " \
           "text is in its log" in said, said
    error = task_store.get_task(1)["error"]
    log = task_store.log_path(1)
    assert error.startswith("head x") and error.endswith("x tail") and f"the task's log, {log}]" in error
    assert reason in log.read_text(), "the log the error names holds the whole reason"
    assert "4,000 characters" in " ".join(run("fail", "--help").stdout.split())
    assert "the whole text is in the task's error" in task_store.get_task(1)["events"][-1]["message"]


def test_a_summary_past_the_limit_is_refused_and_a_long_one_is_marked_where_it_is_cut(tmp_path):
    """complete --summary: a summary longer than an agent's receipt may hold is refused, naming the
    limit and the way out; one the done event cannot hold whole is marked there as cut."""
    submit(tmp_path, TITLE)
    run("claim", "1")
    refused = run("complete", "1", "--summary", "s" * 9_000)
    assert refused.exit_code == 2
    said = " ".join(refused.stderr.split())
    assert "--summary: it is 9,000 characters; the limit is 8,000: shorten it, and put the details in a note " \
           "first" in said and "note t_0001 TEXT" in said, said
    assert task_store.get_task(1)["status"] == "running"
    assert "8,000 characters" in " ".join(run("complete", "--help").stdout.split())
    done = run("complete", "1", "--summary", "s" * 8_000)
    assert done.exit_code == 0, done.output
    task = task_store.get_task(1)
    assert task["result"]["summary"] == "s" * 8_000
    event = [e for e in task["events"] if e["kind"] == "done"][-1]["message"]
    assert event.endswith("… [8,000 characters; the whole text is in the receipt]") and len(event) == 500


def test_a_workers_lease_is_not_finished_by_hand_without_marker(tmp_path):
    submit(tmp_path, TITLE)
    claimed = task_store.claim_next("worker@host:123", task_id=1)
    before = snapshot()
    for args in (("complete", "1"), ("fail", "1", "--reason", "x")):
        result = run(*args)
        assert result.exit_code == 1, args
        assert "worker@host:123" in result.stderr and "pass --marker" in result.stderr
    renew = run("heartbeat", "1")
    assert renew.exit_code == 1 and "refusing to renew a worker's attempt" in renew.stderr
    assert "--marker" not in renew.stderr
    assert snapshot() == before
    forced = run("complete", "1", "--marker", claimed["run_marker"], "--summary", "override")
    assert forced.exit_code == 0 and task_store.get_task(1)["status"] == "done"


def test_complete_with_a_stale_marker_is_refused(tmp_path):
    submit(tmp_path, TITLE)
    run("claim", "1")
    result = run("complete", "1", "--marker", "br-1-a9")
    assert result.exit_code == 1 and "is not the current attempt" in result.stderr
    assert task_store.get_task(1)["status"] == "running"


def test_complete_a_task_that_is_not_claimed(tmp_path):
    submit(tmp_path, TITLE)
    result = run("complete", "1")
    assert result.exit_code == 1 and "not running; claim it first" in result.stderr


# --------------------------------------------------------------------------------------------
# Questions, notes, cancel, clear.


def waiting_task(tmp_path: Path) -> dict:
    task = submit(tmp_path, TITLE)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    return task_store.pause_for_question(task["id"], claimed["run_marker"], "Which branch?")


def test_answer_a_waiting_task(tmp_path, monkeypatch):
    monkeypatch.setenv("USER", "carol")
    waiting_task(tmp_path)
    assert "Which branch?" in run("show", "1").stdout
    result = run("answer", "1", "use main")
    assert result.exit_code == 0 and "resumes" in result.stdout
    task = task_store.get_task(1)
    assert (task["status"], task["answer"]) == ("pending", "use main")
    assert task["questions"][0]["answer"] == "use main"
    assert "by cli:carol" in task["events"][-1]["message"]


def test_note_reaches_the_task(tmp_path):
    submit(tmp_path, TITLE)
    result = run("note", "1", "mind the [bold]tests[/bold]", "--author", "dana")
    assert result.exit_code == 0 and "next prompt" in result.stdout
    assert task_store.get_task(1)["notes"][0] | {"created_at": None} == {
        "author": "dana", "text": "mind the [bold]tests[/bold]", "created_at": None, "delivered": False,
        "delivered_at": None, "delivered_how": None}
    assert "mind the [bold]tests[/bold]" in run("show", "1").stdout
    # TEXT - reads stdin, as `answer` does (a fresh user's note came out as "-"; one too long for a
    # command line could not be given at all).
    long_note = "line one\n" + "x" * 200_000
    assert run("note", "1", "-", input=long_note[:15_000]).exit_code == 0
    assert task_store.get_task(1)["notes"][1]["text"] == long_note[:15_000]
    too_long = run("note", "1", "-", input=long_note)
    assert too_long.exit_code == 2 and "TEXT - (stdin) is longer than the limit" in too_long.stderr
    # Claimed by hand: no session for it to reach (a fresh tester was told it would reach one).
    task_store.claim_next("cli:alice", task_id=1)
    by_hand = " ".join(run("note", "1", "done yet?").stdout.split())
    assert "it reaches alice, who claimed it by hand" in by_hand and "session" not in by_hand


def test_cancel_asks_first(tmp_path):
    submit(tmp_path, TITLE)
    declined = run("cancel", "1", input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert task_store.get_task(1)["status"] == "pending"
    unanswered = run("cancel", "1", input="")   # no terminal to ask on (a script, a pipe)
    assert unanswered.exit_code == 1 and "pass --yes to go ahead" in unanswered.stderr, unanswered.output
    assert task_store.get_task(1)["status"] == "pending"
    accepted = run("cancel", "1", input="y\n")
    assert accepted.exit_code == 0 and task_store.get_task(1)["status"] == "cancelled"
    submit(tmp_path, "second")
    assert run("cancel", "2", "--yes").exit_code == 0
    assert task_store.get_task(2)["status"] == "cancelled"
    again = run("cancel", "2", "--yes")
    assert again.exit_code == 1 and "already cancelled" in again.stderr


def test_show_of_an_ended_attempt_names_no_agent_pid_and_says_its_worktree_was_removed(tmp_path):
    """`show` of a cancelled task still gave its dead agent's pid and the path of the worktree the
    worker had removed, as if both were there."""
    submit(tmp_path, TITLE)
    claimed = task_store.claim_next("w")
    kept = tmp_path / "kept-worktree"
    kept.mkdir()
    task_store.renew_lease(1, claimed["run_marker"], worktree_path=str(tmp_path / "gone"), agent_pid=4242)
    running = "".join(run("show", "1").stdout.split())   # a long path wraps
    assert "agentpid4242" in running and f"worktreepath{tmp_path / 'gone'}spent" in running, running
    task_store.cancel_task(1)
    ended = "".join(run("show", "1").stdout.split())
    assert "agentpid" not in ended and f"worktreepath{tmp_path / 'gone'}(removed)" in ended, ended
    assert "worktreeyes" in ended, "the Task block's worktree row is another"
    submit(tmp_path, "second")
    claimed = task_store.claim_next("w")
    task_store.renew_lease(2, claimed["run_marker"], worktree_path=str(kept), agent_pid=4243)
    task_store.cancel_task(2)
    shown = "".join(run("show", "2").stdout.split())
    assert f"worktreepath{kept}" in shown and "(removed)" not in shown, shown
    # seen from another machine of a shared queue, this disk says nothing of it
    here = task_store.host_name()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TASKBRIDGE_HOST", "another-host")
        elsewhere = "".join(run("show", "1").stdout.split())
    assert f"worktreepath{tmp_path / 'gone'}(on{here})" in elsewhere, elsewhere


def test_clear_removes_finished_tasks_and_logs(tmp_path):
    submit(tmp_path, "keep me")
    submit(tmp_path, "drop me")
    task_store.cancel_task(2)
    log = task_store.log_path(2)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("old output\n")
    declined = run("clear", input="n\n")
    assert declined.exit_code == 1 and task_store.counts()["cancelled"] == 1
    assert json.loads(run("clear", "--yes", "--older-than", "3600", "--json").stdout) == []
    result = run("clear", "--yes", "--purge-logs")
    assert result.exit_code == 0 and "t_0002" in result.stdout
    assert task_store.counts()["cancelled"] == 0 and task_store.counts()["pending"] == 1
    assert not log.exists()
    assert "No finished tasks" in run("clear", "--yes").stdout
    # A finished task a pending follow-up continues stays, and clear says why ("Removed 0 task(s)"
    # alone, after "Remove up to 1 finished task(s)?", left a fresh tester guessing).
    claimed = task_store.claim_next("w", task_id="t_0001")
    task_store.renew_lease("t_0001", claimed["run_marker"], branch="taskbridge/t_0001")   # as a worktree run
    task_store.complete_attempt("t_0001", claimed["run_marker"], result={"summary": "ok"})
    follow = task_store.submit_task(title="next", instructions="more", continue_from="t_0001")
    kept = run("clear", "--yes", "--json")   # the JSON list on stdout; what was kept, and why, on stderr
    assert json.loads(kept.stdout) == [] and f"Kept t_0001: {follow['id']} (not finished)" in kept.stderr
    kept = run("clear", "--yes")
    assert "Removed 0 task(s)" in kept.stdout and f"Kept t_0001: {follow['id']} (not finished)" in kept.stderr


# --------------------------------------------------------------------------------------------
# Logs.


def write_log(task_id: int, text: str) -> None:
    # through the store, as the worker's log reaches readers: the file on SQLite, the database on PostgreSQL
    task_store.append_task_log(task_id, text.encode())


def test_logs_prints_whole_file_and_tail(tmp_path):
    submit(tmp_path, TITLE)
    write_log(1, "one\ntwo\nthree [red]x[/red]\n")
    assert run("logs", "1").stdout == "one\ntwo\nthree [red]x[/red]\n"
    assert run("logs", "1", "--tail", "2").stdout == "two\nthree [red]x[/red]\n"
    submit(tmp_path, "never ran")
    empty = run("logs", "2")
    assert empty.exit_code == 0 and empty.stdout == "" and "no worker has run it yet" in empty.stderr


def test_logs_follow_streams_until_the_task_finishes(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    submit(tmp_path, TITLE)
    claimed = task_store.claim_next("worker@host", task_id=1)
    write_log(1, "started\n")

    def agent() -> None:
        for n in range(3):
            time.sleep(0.1)
            write_log(1, f"step {n}\n")
        write_log(1, "partial line without newline")
        time.sleep(0.1)
        task_store.complete_attempt(1, claimed["run_marker"], result={"summary": "ok"})

    thread = threading.Thread(target=agent)
    thread.start()
    result = run("logs", "1", "--follow", "--tail", "1")
    thread.join()
    assert result.exit_code == 0
    assert result.stdout == "started\nstep 0\nstep 1\nstep 2\npartial line without newline\n"
    assert "t_0001 is done; log ends" in result.stderr


def test_logs_follow_whose_queue_file_goes_says_so_in_its_own_words(tmp_path, monkeypatch):
    """A fresh user's finding: the queue file moved away under `logs --follow`, it ended with the
    store's words for a long-running process ("... and this process carries on")."""
    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    submit(tmp_path, TITLE)
    task_store.claim_next("worker@host", task_id=1)
    write_log(1, "started\n")
    path = task_store.db_path()

    def away() -> None:
        time.sleep(0.3)
        path.rename(tmp_path / "away.db")

    thread = threading.Thread(target=away)
    thread.start()
    result = CliRunner().invoke(cli, ["logs", "1", "--follow"])
    thread.join()
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    said = result.stderr
    assert f"the queue {path} went away while this command used it" in said, said
    assert "run the command again" in said and "this process carries on" not in said, said


def test_a_running_task_whose_worker_died_is_named_by_show_and_ends_logs_follow(tmp_path, monkeypatch):
    # A worker killed with -9 mid-run: `logs --follow` waited forever and `show` said "running,
    # watch it" until the next pass requeued the task (found by a new-user test).
    import psutil
    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    submit(tmp_path, TITLE)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    task_store.claim_next("worker@host", worker.pid, psutil.Process(worker.pid).create_time(), task_id=1)
    write_log(1, "started\n")
    alive = run("show", "1")
    assert "logs t_0001 --follow (watch it)" in alive.stdout and "is gone" not in alive.stdout
    worker.kill()
    worker.wait()
    shown = run("show", "1")
    assert f"its worker (pid {worker.pid}) is gone: the next worker pass hands the task back" in shown.stdout
    followed = run("logs", "1", "--follow")             # returns instead of waiting for ever
    assert followed.exit_code == 0 and followed.stdout == "started\n"
    assert "t_0001 is running, but its worker is gone" in followed.stderr


def finish_later(task_id: str, delay: float) -> threading.Thread:
    """A thread that claims and completes ``task_id`` after ``delay`` seconds, as a worker would."""
    def finish() -> None:
        time.sleep(delay)
        claimed = task_store.claim_next("worker@host", task_id=task_id)
        task_store.complete_attempt(task_id, claimed["run_marker"], result={"summary": "ok"})
    thread = threading.Thread(target=finish)
    thread.start()
    return thread


def test_logs_follow_on_a_pending_task_says_once_that_no_worker_runs_the_queue(tmp_path, monkeypatch):
    # It waited in silence for ever on a queue no worker serves (found by a new-user test).
    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    task = submit(tmp_path, TITLE)
    finisher = finish_later(task["id"], 0.5)             # ten polls and more before it ends
    followed = run("logs", "1", "--follow")
    finisher.join()
    said = [line for line in followed.stderr.splitlines() if "No worker is running this queue" in line]
    assert followed.exit_code == 0 and len(said) == 1, followed.stderr
    assert any(command.endswith("worker.py") for command in hinted_scripts(said[0])), said[0]   # how to start one
    assert said[0] in run("status").stderr                # the words status uses
    assert "t_0001 is done; log ends" in followed.stderr


def test_logs_follow_on_a_pending_task_says_nothing_of_a_worker_that_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    task = submit(tmp_path, TITLE)
    task_store.write_worker_heartbeat({"state": "idle"})   # this process, alive
    finisher = finish_later(task["id"], 0.3)
    followed = run("logs", "1", "--follow")
    finisher.join()
    assert followed.exit_code == 0 and "No worker" not in followed.stderr and "checked in" not in followed.stderr


def test_logs_follow_stops_cleanly_on_ctrl_c(tmp_path, monkeypatch):
    submit(tmp_path, TITLE)
    write_log(1, "waiting for a worker\n")

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks_cli.time, "sleep", interrupt)
    result = run("logs", "1", "--follow")
    assert result.exit_code == 0 and result.stdout == "waiting for a worker\n"


# --------------------------------------------------------------------------------------------
# Status, events, --db, ages.


def test_status_shows_counts_and_worker_heartbeat(tmp_path):
    submit(tmp_path, TITLE)
    bare = run("status")
    assert bare.exit_code == 0 and "no worker pass has run" in bare.stdout
    assert "has not checked in" in bare.stderr
    task_store.write_worker_heartbeat({"task": "t_0001"})
    shown = run("status")
    assert "ago" in shown.stdout and "t_0001" in shown.stdout and str(os.getpid()) in shown.stdout
    assert "has not checked in" not in shown.stderr
    data = json.loads(run("status", "--json").stdout)
    assert data["counts"]["pending"] == 1 and data["worker"]["task"] == "t_0001"


def test_status_tells_the_worker_in_words_not_python_values(tmp_path):
    task_store.write_worker_heartbeat({"task": "t_0001", "state": "running"})   # this process: alive
    worker = squash(run("status").stdout.split("Worker", 1)[1])
    assert f"online,pid{os.getpid()}on" in worker and "processrunning" in worker and "runst_0001(running)" in worker
    for internal in ("True", "False", "None", "pid_running", "died", "recent", "label", "started_at"):
        assert internal not in worker, internal


@pytest.mark.parametrize("engine", ["0", "1"])
def test_status_names_the_engine_a_worker_pass_runs_on(tmp_path, engine):
    """A pass writes its engine (WORKER_ENGINE) in its heartbeat; status and the JSON say it (a
    person could not tell a warm worker from a cold one)."""
    task_store.connect().close()   # an empty queue: the pass starts and ends
    passed = subprocess.run([sys.executable, str(Path(tasks_cli.__file__).with_name("worker.py"))],
                            env=os.environ | {"WORKER_ENGINE": engine}, capture_output=True, text=True, timeout=120)
    assert passed.returncode == 0, passed.stderr
    name = {"0": "cold", "1": "warm"}[engine]
    assert json.loads(run("status", "--json").stdout)["worker"]["engine"] == name
    assert f"engine{tasks_cli.ENGINE_WORDS[name].split(':')[0]}:" in squash(run("status").stdout)


def test_events_lists_state_changes(tmp_path):
    submit(tmp_path, TITLE)
    task_store.cancel_task(1)
    rows = json.loads(run("events", "--json").stdout)
    assert [e["kind"] for e in rows] == ["submitted", "cancelled"]
    assert json.loads(run("events", "--since", str(rows[0]["id"]), "--json").stdout)[0]["kind"] == "cancelled"
    table = run("events")
    assert "cancelled" in table.stdout and f"--since {rows[-1]['id']}" in table.stdout


def test_db_option_points_the_store_elsewhere(tmp_path, work):
    other = tmp_path / "other" / "queue.db"
    result = run("--db", str(other), "submit", "Elsewhere", "-d", str(work))
    assert result.exit_code == 0
    assert other.exists()
    assert task_store.db_path() == other.resolve()


def test_ages_read_for_people():
    assert tasks_cli.age(5) == "5s ago"
    assert tasks_cli.age(200) == "3m ago"
    assert tasks_cli.age(7300) == "2h ago"
    assert tasks_cli.age(-20) == "in 20s"
    assert tasks_cli.age(None) == "-"


# --------------------------------------------------------------------------------------------
# Bad input: a clear message, exit 1 or 2, nothing written, never a traceback.


BAD_SUBMITS = [
    (["-d", "/no/such/dir/anywhere"], 2, "does not exist"),
    (["-d", "relative/path"], 2, "/relative/path' does not exist"),
    (["--timeout", "-5"], 2, "-5 is not in the range"),
    (["--priority", "high"], 2, "'high' is not a valid integer"),
    (["--max-retries", "99"], 2, "99 is not in the range"),
    (["--permission", "root"], 2, "'root' is not one of"),
    (["--model", "gpt"], 2, "not of the form provider/model"),
    (["--depends-on", "t_0099"], 1, "t_0099, which does not exist"),
    (["--depends-on", "zzz"], 2, "use t_0001, 0001 or 1"),
    (["--agent", "bad name!"], 1, "must be an OpenCode agent name"),
    (["-i", "x", "--file", "-"], 2, "not both"),
]


@pytest.mark.parametrize("extra,code,message", BAD_SUBMITS)
def test_bad_submit_is_refused_and_writes_nothing(tmp_path, work, extra, code, message):
    submit(tmp_path, "existing")
    before = snapshot()
    args = ["submit", "Title"] + (extra if "-d" in extra else ["-d", str(work)] + extra)
    result = run(*args, input="")
    assert result.exit_code == code, result.output
    assert message in result.stderr
    assert snapshot() == before


def test_relative_dir_is_taken_from_the_current_folder(tmp_path, work, monkeypatch):
    (work / "proj").mkdir()
    monkeypatch.chdir(work / "proj")
    for given, expected in ((".", work / "proj"), ("..", work), ("../proj/", work / "proj")):
        task = json.loads(run("submit", "Title", "-d", given, "--json").stdout)
        assert task["working_dir"] == str(expected)
    missing = run("submit", "Title", "-d", "nope")
    assert missing.exit_code == 2 and f"{work}/proj/nope' does not exist" in missing.stderr


def test_in_place_tasks_stay_out_of_homes_hidden_folders_and_other_checkouts_state(tmp_path, monkeypatch):
    """Found by a fresh user: an in-place task in ~/.ssh ran and wrote there (an authorized_keys
    would outlive the task), and one in another TaskBridge checkout's folder or its .taskbridge/
    was queued (the agent would read that install's token). Refused at submit, naming the folder."""
    home = tmp_path / "home"
    (home / ".ssh" / "keys").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    other = tmp_path / "other-checkout"
    (other / ".taskbridge").mkdir(parents=True)
    (other / ".taskbridge" / "token").write_text("theirs\n")
    for folder, says in ((home / ".ssh", f"lies in {home}/.ssh, a hidden folder of your home"),
                         (home / ".ssh" / "keys", f"lies in {home}/.ssh, a hidden folder of your home"),
                         (other, f"another TaskBridge queue or token ({other}/.taskbridge)"),
                         (other / ".taskbridge", f"another TaskBridge queue or token ({other}/.taskbridge)")):
        refused = run("submit", "x", "-d", str(folder), "--no-worktree", "--yes")
        assert refused.exit_code == 1 and says in refused.stderr, (folder, refused.stderr)
        assert "Traceback" not in refused.stderr
    assert task_store.counts().get("pending", 0) == 0
    (home / "proj").mkdir()
    assert run("submit", "x", "-d", str(home / "proj"), "--no-worktree", "--yes").exit_code == 0


def test_a_worktree_submit_says_which_uncommitted_changes_stay_out_of_it(tmp_path):
    """A fresh user's finding: with a changed file and a new one in the checkout, submit said only
    `Submitted`, and the agent worked from the last commit without them. It says so now."""
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    clean = run("submit", "clean", "-d", str(repo))
    assert clean.exit_code == 0 and "uncommitted" not in clean.stderr, clean.stderr
    (repo / "a.txt").write_text("changed\n")
    (repo / "new file.txt").write_text("new\n")
    said = run("submit", "dirty", "-d", str(repo))
    assert said.exit_code == 0, said.stderr
    assert ("t_0002's worktree is made from a commit, so your 2 uncommitted change(s) in its repository "
            "(a.txt, new file.txt) are not in it") in " ".join(said.stderr.split()), said.stderr
    in_place = run("submit", "here", "-d", str(repo), "--no-worktree", "--yes")
    assert in_place.exit_code == 0 and "uncommitted change(s) in its repository" not in in_place.stderr


BAD_COMMANDS = [
    (["list", "--limit", "x"], 2, "'x' is not a valid integer."),   # click's own said "integer range"
    (["submit", "t", "--priority", "abc"], 2, "'abc' is not a valid integer."),
    (["show", "99"], 1, "t_0099 not found"),
    (["show", "t_abc"], 2, "use t_0001, 0001 or 1"),
    (["claim", "99"], 1, "t_0099 not found"),
    (["complete", "99"], 1, "t_0099 not found"),
    (["fail", "99", "--reason", "x"], 1, "t_0099 not found"),
    (["fail", "1", "--reason", "  "], 2, "must not be empty"),
    (["fail", "1"], 2, "Missing option '--reason'"),
    (["heartbeat", "99"], 1, "t_0099 not found"),
    (["answer", "99", "yes"], 1, "t_0099 not found"),
    (["answer", "1", "yes"], 1, "not waiting"),
    (["note", "99", "hi"], 1, "t_0099 not found"),
    (["note", "1", "  "], 1, "note must not be empty"),
    (["cancel", "99", "--yes"], 1, "t_0099 not found"),
    (["logs", "99"], 1, "t_0099 not found"),
    (["logs", "1", "--tail", "-1"], 2, "not in the range"),
    (["list", "--status", "bogus"], 2, "'bogus' is not one of"),
    (["list", "--limit", "0"], 2, "not in the range"),
    (["events", "--since", "-1"], 2, "not in the range"),
    (["clear", "--older-than", "-3", "--yes"], 2, "not in the range"),
]


@pytest.mark.parametrize("args,code,message", BAD_COMMANDS)
def test_bad_input_to_each_command(tmp_path, args, code, message):
    submit(tmp_path, TITLE)
    before = snapshot()
    result = run(*args)
    assert result.exit_code == code, result.output
    assert message in result.stderr
    assert snapshot() == before


@pytest.mark.parametrize("status", ["pending", "done", "cancelled"])
def test_an_answer_to_a_task_not_waiting_names_the_way_out_for_its_state(tmp_path, status):
    """A pending (or running) task is reached by a note; an ended one by a follow-up, and one that
    did not succeed by a retry too: the note a cancelled task cannot take was suggested."""
    task = submit(tmp_path, TITLE)
    if status == "done":
        claimed = task_store.claim_next("w")
        task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})
    elif status == "cancelled":
        task_store.cancel_task(task["id"])
    result = run("answer", task["id"], "yes")
    assert result.exit_code == 1 and f"is {status}, not waiting" in result.stderr, result.stderr
    said = " ".join(result.stderr.split())
    if status == "pending":
        assert f"`{tasks_cli.CLI} note` reaches a running task" in said and "--continue" not in said, said
    else:   # a cancelled one was told --continue, which submit then refused: "retry it first" (a tester)
        assert (f"--continue {task['id']} submits a follow-up in its session" in said) == (status == "done"), said
        assert (f"`{tasks_cli.CLI} retry {task['id']}` runs it again" in said) == (status == "cancelled"), said
        assert " note" not in said, said
    if status == "cancelled":
        follow = run("submit", "next", "--continue", task["id"])
        assert follow.exit_code != 0 and "retry it first" in follow.stderr, "as the answer's refusal said"


def test_store_messages_name_cli_commands_not_mcp_tools(tmp_path):
    task_store.connect().close()   # an empty queue
    result = run("show", "42")
    assert f"`{tasks_cli.CLI} list` shows the ids that exist" in result.stderr
    assert "list_tasks" not in result.stderr


def test_claiming_a_running_task_is_refused(tmp_path):
    submit(tmp_path, TITLE)
    run("claim", "1")
    before = snapshot()
    result = run("claim", "1", "--as", "x")
    assert result.exit_code == 1 and "only a pending task can be claimed" in result.stderr
    assert snapshot() == before


def test_a_broken_database_is_a_clear_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"this is not sqlite" * 100)
    monkeypatch.setenv("TASK_DB_PATH", str(broken))
    result = run("list")
    assert result.exit_code == 1
    assert "task database" in result.stderr and str(broken) in result.stderr
    assert "--db" in result.stderr


# --------------------------------------------------------------------------------------------
# Terminal safety: task text is shown with control characters made visible; --json stays exact.

EVIL = "esc\x1b[2J\x1b]0;pwned\x07 c1\x9b31m rtl\u202eabc del\x7f"
SHOWN = "esc\\x1b[2J\\x1b]0;pwned\\x07 c1\\x9b31m rtl\\u202eabc del\\x7f"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\x7f")


def assert_no_raw_controls(text: str) -> None:
    for char in RAW:
        assert char not in text, (repr(char), text)


def test_visible_escapes_controls_and_keeps_line_breaks_only_where_they_make_sense():
    assert tasks_cli.visible(EVIL) == SHOWN
    assert tasks_cli.visible("a\tb\nc\r\nd\re") == "a\tb\nc\nd\\re"
    assert tasks_cli.visible("a\tb\nc", multiline=False) == "a\\tb\\nc"
    assert tasks_cli.visible("plain [red]text[/red] ünïcode") == "plain [red]text[/red] ünïcode"


def evil_task(tmp_path: Path, monkeypatch) -> dict:
    """A task whose every free-text field carries escape sequences, with a question, an answer,
    a note, a failed attempt and a receipt."""
    monkeypatch.setattr(task_store, "RETRY_BACKOFF_SEC", (0, 0))
    task = submit(tmp_path, EVIL, instructions=f"do\n{EVIL}", origin_name=f"client{EVIL}",
               idempotency_key=f"key{EVIL}", max_retries=3)
    first = task_store.claim_next(f"worker{EVIL}", task_id=task["id"])
    task_store.pause_for_question(task["id"], first["run_marker"], f"question {EVIL}")
    task_store.answer_task(task["id"], f"answer {EVIL}", author=f"author{EVIL}")
    task_store.add_note(task["id"], f"note {EVIL}", author=f"noter{EVIL}")
    second = task_store.claim_next("worker@host", task_id=task["id"])
    task_store.fail_attempt(task["id"], second["run_marker"], f"error {EVIL}",
                            result={"summary": f"summary {EVIL}", "files_touched": [f"file{EVIL}.py"],
                                    "commands": [f"cmd {EVIL}"], f"key{EVIL}": "value"})
    return task


def test_every_human_view_makes_control_characters_visible(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # wide enough that table cells do not fold mid-text
    evil_task(tmp_path, monkeypatch)
    task_store.write_worker_heartbeat({"task": f"t_0001 {EVIL}", f"field{EVIL}": 1})
    views = {args: run(*args) for args in (("list",), ("pending",), ("show", "1"), ("events",), ("status",))}
    for args, result in views.items():
        assert result.exit_code == 0, args
        assert_no_raw_controls(result.output)
    shown = squash(views[("show", "1")].stdout)
    for text in (f"t_0001{SHOWN}", f"error{SHOWN}", f"summary{SHOWN}", f"file{SHOWN}.py", f"cmd{SHOWN}",
                 f"Q:question{SHOWN}", f"A:answer{SHOWN}", f"note{SHOWN}", f"noter{SHOWN}",
                 f"client{SHOWN}", f"key{SHOWN}value", f"worker{SHOWN}"):
        assert squash(text) in shown, text
    assert squash(f"submitted{SHOWN}") in squash(views[("events",)].stdout)
    assert squash(f"field{SHOWN}") in squash(views[("status",)].stdout)
    assert squash(SHOWN) in squash(views[("list",)].stdout)


def squash(text: str) -> str:
    """Text without spaces, line breaks and table rules, so wrapped table cells compare whole."""
    return "".join(c for c in text if not c.isspace() and c not in "│┃")


def test_messages_and_prompts_that_quote_task_text_make_it_visible(tmp_path, work):
    submitted = run("submit", EVIL, "-d", str(work))
    assert SHOWN in submitted.stdout
    claimed = run("claim", "1", "--as", f"me{EVIL}")
    assert claimed.exit_code == 0 and SHOWN in claimed.stdout
    submit(tmp_path, EVIL)
    prompt = run("cancel", "2", input="n\n")
    assert "esc\\x1b[2J" in prompt.output
    for result in (submitted, claimed, prompt):
        assert_no_raw_controls(result.output)


def test_json_stays_exact_and_terminal_safe(tmp_path, monkeypatch):
    evil_task(tmp_path, monkeypatch)
    for args in (("show", "1", "--json"), ("list", "--json"), ("events", "--json")):
        result = run(*args)
        assert_no_raw_controls(result.stdout)  # C0 by json.dumps, DEL/C1/bidi by emit_json
    task = json.loads(run("show", "1", "--json").stdout)
    assert task["title"] == EVIL and task["questions"][0]["question"] == f"question {EVIL}"
    assert task["result"]["commands"] == [f"cmd {EVIL}"] and task["error"] == f"error {EVIL}"
    assert json.loads(run("list", "--json").stdout)["tasks"][0]["title"] == EVIL


def test_raw_logs_and_diff_are_exact_in_a_pipe_and_visible_on_a_terminal(tmp_path, monkeypatch):
    task = submit(tmp_path, TITLE)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    diff = f"--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+{EVIL}\n"
    task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"}, diff=diff)
    write_log(1, f"line one\n{EVIL}\n")
    assert run("logs", "1", "--raw").stdout == f"line one\n{EVIL}\n"
    assert run("logs", "1").stdout == f"line one\n{SHOWN}\n"  # rendered for people: always visible
    assert run("show", "1", "--diff").stdout == diff
    # --json beside --diff was ignored (the raw diff came out): it gives what `diff --json` gives
    assert json.loads(run("show", "1", "--diff", "--json").stdout) == {"task_id": "t_0001", "diff": diff}
    assert run("show", "1", "--diff", "--json").stdout == run("diff", "1", "--json").stdout
    monkeypatch.setattr(tasks_cli, "stdout_is_terminal", lambda: True)
    assert run("logs", "1", "--raw").stdout == f"line one\n{SHOWN}\n"
    assert run("logs", "1").stdout == f"line one\n{SHOWN}\n"
    assert run("show", "1", "--diff").stdout == diff.replace(EVIL, SHOWN)


def test_errors_quoting_task_text_make_it_visible(tmp_path):
    submit(tmp_path, TITLE)
    task_store.claim_next(f"worker{EVIL}", task_id=1)
    result = run("complete", "1")
    assert result.exit_code == 1 and "worker" + SHOWN in result.stderr
    assert_no_raw_controls(result.stderr)


# --------------------------------------------------------------------------------------------
# complete / fail / heartbeat on a task that is not running say why, not "claim it first".


def finished_task(tmp_path: Path, status: str) -> dict:
    task = submit(tmp_path, TITLE, max_retries=0)
    if status == "cancelled":
        return task_store.cancel_task(task["id"])
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    if status == "done":
        return task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})
    return task_store.fail_attempt(task["id"], claimed["run_marker"], "broke", retryable=False)


HAND_COMMANDS = [
    (("complete", "1"), "nothing can be completed"),
    (("complete", "1", "--marker", "br-1-a1"), "nothing can be completed"),
    (("fail", "1", "--reason", "x"), "nothing can be marked failed"),
    (("heartbeat", "1"), "there is no lease to renew"),
]


@pytest.mark.parametrize("status", ["cancelled", "done", "failed"])
@pytest.mark.parametrize("args,says", HAND_COMMANDS)
def test_finishing_a_finished_task_names_its_status(tmp_path, status, args, says):
    finished_task(tmp_path, status)
    before = snapshot()
    result = run(*args)
    assert result.exit_code == 1
    assert f"task t_0001 is {status}: it has finished, so {says}" in result.stderr
    assert "show t_0001" in result.stderr and "claim it first" not in result.stderr
    assert snapshot() == before


@pytest.mark.parametrize("args,says", HAND_COMMANDS)
def test_finishing_a_waiting_task_points_to_answer(tmp_path, args, says):
    waiting_task(tmp_path)
    result = run(*args)
    assert result.exit_code == 1
    assert f"is waiting for an answer to its question, so {says}" in result.stderr
    assert "tasks_cli.py answer t_0001" in result.stderr and "claim it first" not in result.stderr
    assert task_store.get_task(1)["status"] == "waiting"


# --------------------------------------------------------------------------------------------
# Attempts: hand-backs do not spend a retry, and the view says so.


def test_show_counts_attempts_without_an_impossible_fraction(tmp_path, monkeypatch):
    monkeypatch.setattr(task_store, "RETRY_BACKOFF_SEC", (0, 0))
    monkeypatch.setenv("COLUMNS", "400")  # wide enough that table cells do not fold mid-text
    submit(tmp_path, TITLE, max_retries=1)
    first = task_store.claim_next("worker@host", task_id=1)
    task_store.requeue_attempt(1, first["run_marker"], "worker shut down", count_attempt=False)
    second = task_store.claim_next("worker@host", task_id=1)
    task_store.fail_attempt(1, second["run_marker"], "tests red")
    task_store.claim_next("worker@host", task_id=1)
    task = task_store.get_task(1)
    assert (task["attempts"], task["handbacks"], task["max_retries"]) == (3, 1, 1)
    shown = run("show", "1").stdout
    assert "attempt 3 (2 of 2 counted; not counted: 1 hand-back); retries allowed 1" in shown
    assert "3 of 2" not in shown
    assert "3/2" not in run("list").stdout


def test_attempt_texts():
    base = {"attempts": 0, "handbacks": 0, "max_retries": 2}
    assert tasks_cli.attempts_text(base) == "not started yet; retries allowed 2"
    assert tasks_cli.attempts_text(base | {"attempts": 1}) == "attempt 1 of 3; retries allowed 2"
    assert tasks_cli.attempts_text(base | {"attempts": 4, "handbacks": 2}) == \
        "attempt 4 (2 of 3 counted; not counted: 2 hand-backs); retries allowed 2"
    assert tasks_cli.attempts_text(base | {"attempts": 4, "handbacks": 1, "spent_before_retry": 2}) == \
        "attempt 4 (1 of 3 counted; not counted: 1 hand-back, 2 before a retry); retries allowed 2"
    assert tasks_cli.tries_cell(base | {"attempts": 4, "handbacks": 2}) == "2/3 +2"
    assert tasks_cli.tries_cell({"attempts": 2, "max_retries": 2}) == "2/3"
    assert tasks_cli.tries_cell({"attempts": 3, "max_retries": 1}) == "3"  # listing without handbacks


# --------------------------------------------------------------------------------------------
# Absurd numbers: a clear message and exit 2, never an OverflowError.

HUGE = "99999999999999999999999"
HUGE_NUMBERS = [
    (["show", HUGE], "is too large"),
    (["show", f"t_{HUGE}"], "is too large"),
    (["cancel", HUGE, "--yes"], "is too large"),
    (["answer", HUGE, "yes"], "is too large"),
    (["note", HUGE, "hi"], "is too large"),
    (["complete", HUGE], "is too large"),
    (["fail", HUGE, "--reason", "x"], "is too large"),
    (["heartbeat", HUGE], "is too large"),
    (["claim", HUGE], "is too large"),
    (["logs", HUGE], "is too large"),
    (["submit", "x", "--depends-on", HUGE], "is too large"),
    (["events", "--since", HUGE], "not in the range"),
    (["events", "--limit", HUGE], "not in the range"),
    (["list", "--limit", HUGE], "not in the range"),
    (["list", "--offset", HUGE], "not in the range"),
    (["pending", "--offset", HUGE], "not in the range"),
    (["logs", "1", "--tail", HUGE], "not in the range"),
    (["clear", "--yes", "--older-than", HUGE], "not in the range"),
    (["clear", "--yes", "--older-than", "inf"], "not in the range"),
    (["clear", "--yes", "--older-than", "nan"], "nan is not a number of seconds"),
    (["submit", "x", "--timeout", HUGE], "not in the range"),
    (["submit", "x", "--priority", HUGE], "not in the range"),
    (["submit", "x", "--priority", f"-{HUGE}"], "not in the range"),
    (["submit", "x", "--max-retries", HUGE], "not in the range"),
]


@pytest.mark.parametrize("args,message", HUGE_NUMBERS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_absurd_numbers_are_refused_clearly(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    done = submit(tmp_path, TITLE)
    task_store.cancel_task(done["id"])  # something clear could remove
    before = snapshot()
    result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert snapshot() == before


def test_events_since_the_largest_id_is_simply_empty(tmp_path):
    submit(tmp_path, TITLE)
    result = run("events", "--since", str(2**63 - 1))
    assert result.exit_code == 0 and "no events" in result.stdout


# --------------------------------------------------------------------------------------------
# clear --remove-worktrees on a real git repository.


def test_clear_remove_worktrees_removes_a_kept_worktree_and_keeps_its_branch(tmp_path):
    import worktrees
    from helpers import git, make_repo

    repo = make_repo(tmp_path / "repo")
    task = submit(repo, "kept", worktree_keep=True)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    ws = worktrees.prepare_workspace(claimed, resume=False)
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=ws.top, branch=ws.branch)
    task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})
    assert os.path.isdir(ws.top)

    # A plain clear keeps the task whose worktree is on disk: it is what knows the worktree, and
    # the advice it prints must work afterwards.
    kept = run("clear", "--yes")
    assert kept.exit_code == 0 and "Removed 0 task(s)" in kept.stdout
    assert "Kept 1 task(s) whose worktrees are on disk: t_0001" in kept.stderr
    assert f"`{tasks_cli.CLI} clear --remove-worktrees` removes those worktrees and the tasks" in kept.stderr
    assert os.path.isdir(ws.top) and task_store.counts()["done"] == 1

    task2 = submit(repo, "kept too", worktree_keep=True)
    claimed2 = task_store.claim_next("worker@host", task_id=task2["id"])
    ws2 = worktrees.prepare_workspace(claimed2, resume=False)
    task_store.renew_lease(task2["id"], claimed2["run_marker"], worktree_path=ws2.top, branch=ws2.branch)
    task_store.complete_attempt(task2["id"], claimed2["run_marker"], result={"summary": "ok"})
    removed = run("clear", "--yes", "--remove-worktrees")
    assert removed.exit_code == 0, removed.output
    assert "Removed 2 task(s): t_0001, t_0002" in removed.stdout
    for top in (ws.top, ws2.top):
        assert f"Removed worktree {top} (its branch stays)." in removed.stdout
        assert not os.path.exists(top) and top not in git(repo, "worktree", "list")
    assert git(repo, "branch", "--list", ws2.branch).strip().endswith(ws2.branch)
    assert task_store.counts()["done"] == 0


def running_in_a_worktree(repo, title: str):
    """(the task, its claim, its workspace): a task claimed in ``repo`` and its worktree made and
    recorded, as a worker's attempt has it before its agent runs."""
    import worktrees

    task = submit(repo, title)
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    ws = worktrees.prepare_workspace(claimed, resume=False)
    task_store.renew_lease(task["id"], claimed["run_marker"], worktree_path=ws.top, branch=ws.branch,
                           base_commit=ws.base_commit)
    return task, claimed, ws


def test_branch_of_a_task_whose_branch_has_no_commit_says_nothing_to_apply_not_applied(tmp_path):
    """A failed attempt leaves its branch at its base, which the checkout's HEAD contains: that
    said "applied: yes". Applied means the branch's own commits are in the checkout."""
    from helpers import git, make_repo

    repo = make_repo(tmp_path / "repo")
    task, claimed, ws = running_in_a_worktree(repo, "fails")
    task_store.fail_attempt(task["id"], claimed["run_marker"], "the model was not found")
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["tip"] == info["base_commit"] == git(repo, "rev-parse", "HEAD") and info["applied"] is False
    assert info["has_commits"] is False
    shown = run("branch", task["id"])
    assert shown.exit_code == 0 and "nothing to apply: the branch has no commit beyond its base" in shown.stdout
    git(ws.top, "commit", "-q", "--allow-empty", "-m", "work")
    git(repo, "merge", "-q", "--ff-only", ws.branch)
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["applied"] is True and info["has_commits"] is True
    assert "yes: the checkout's HEAD contains it" in run("branch", task["id"]).stdout


def test_branch_of_a_cancelled_task_with_commits_offers_no_apply_and_says_why_no_commit_is_recorded(tmp_path):
    """A fresh user's finding: a task cancelled with work committed on its branch showed "commit
    none (no changes committed)" over its tip, and offered `apply`, which refuses a task not done."""
    from helpers import git, make_repo

    repo = make_repo(tmp_path / "repo")
    task, _claimed, ws = running_in_a_worktree(repo, "cancelled with work")
    git(ws.top, "commit", "-q", "--allow-empty", "-m", "work")
    task_store.cancel_task(task["id"])
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["has_commits"] is True and "apply" not in info["commands"] and "cd" in info["commands"]
    shown = run("branch", task["id"]).stdout
    assert "none recorded (it is cancelled: no attempt of it ended done)" in shown
    assert "no changes committed" not in shown


def test_branch_checked_out_in_a_kept_worktree_says_cd_there_not_switch_or_worktree_add(tmp_path, monkeypatch):
    """A fresh user's finding: for a task whose worktree is kept on disk (its worker killed, or
    --keep-worktree) branch printed `git switch` and `git worktree add` lines, which git refuses
    ("already checked out at ..."). Where git says the branch is checked out, the way is `cd`."""
    import shlex

    from helpers import git, make_repo

    monkeypatch.setenv("COLUMNS", "400")  # wide enough that table cells do not fold mid-text
    repo = make_repo(tmp_path / "repo")
    task, _claimed, ws = running_in_a_worktree(repo, "killed mid-run")
    git(ws.top, "commit", "-q", "--allow-empty", "-m", "work")
    task_store.cancel_task(task["id"])   # its worker dead: nobody removes the worktree
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["checked_out_at"] == ws.top and set(info["commands"]) == {"log", "cd"}
    assert shlex.split(info["commands"]["cd"]) == ["cd", ws.top]
    shown = run("branch", task["id"]).stdout
    assert "(git allows one checkout of a branch: work on it there)" in shown
    assert "switch" not in shown and "worktree add" not in shown

    # git's own list, not the recorded path: the folder gone but still registered holds the
    # branch until pruned, and the commands say so in the order that works.
    import shutil
    shutil.rmtree(ws.top)
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["checked_out_at"] == ws.top and list(info["commands"]) == ["log", "prune", "switch", "worktree"]
    assert "its folder is gone: prune it first" in run("branch", task["id"]).stdout
    for name in ("prune", "switch"):
        done = subprocess.run(shlex.split(info["commands"][name]), capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr)
    # Checked out in the user's own checkout (the switch just run): cd there, no switch to fail.
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["checked_out_at"] == str(repo) and info["commands"]["cd"] == task_store.shell_command("cd", repo)
    git(repo, "switch", "-q", "main")
    info = json.loads(run("branch", task["id"], "--json").stdout)
    assert info["checked_out_at"] is None and {"switch", "worktree"} <= set(info["commands"])


def test_branch_of_a_task_whose_empty_branch_was_deleted_names_its_diff_and_retry(tmp_path):
    """A fresh user's finding: `branch` of a cancelled task whose empty branch was deleted said
    "nothing of it is on a branch" and stopped there, though `diff` showed what its agent changed
    before the cancel (the worker records a cancelled run's receipt and diff)."""
    from helpers import make_repo

    repo = make_repo(tmp_path / "repo")
    diff = "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-old\n+new\n"
    cancelled, claimed, ws = running_in_a_worktree(repo, "cancelled")
    task_store.cancel_task(cancelled["id"])
    task_store.record_cancelled_receipt(cancelled["id"], claimed["run_marker"], {"files_touched": ["README.md"]}, diff)
    task_store.record_branch_dropped(cancelled["id"], claimed["run_marker"], ws.branch)
    failed, claimed, ws = running_in_a_worktree(repo, "failed")
    task_store.fail_attempt(failed["id"], claimed["run_marker"], "broke", retryable=False)
    task_store.record_branch_dropped(failed["id"], claimed["run_marker"], ws.branch)
    said = " ".join(run("branch", cancelled["id"]).stderr.split())
    assert "nothing of it is on a branch. " in said
    assert f"`{tasks_cli.CLI} diff t_0001` shows the changes its agent made before it ended; " \
           f"`{tasks_cli.CLI} retry t_0001` runs it again" in said
    assert run("diff", cancelled["id"]).stdout == diff, "the command named works"
    said = " ".join(run("branch", failed["id"]).stderr.split())
    assert f"nothing of it is on a branch. `{tasks_cli.CLI} retry t_0002` runs it again" in said
    assert " diff " not in said, "no diff was recorded: none is offered"


def test_diff_of_an_earlier_attempt_that_a_retry_started_afresh_from(tmp_path):
    """A fresh user's finding: a retry's receipt replaced the cancelled attempt's diff, the only
    copy of its work. `show` names the earlier attempts kept, `diff --attempt` prints one."""
    (tmp_path / "w").mkdir()
    task = task_store.submit_task(title="t", instructions="i", working_dir=str(tmp_path / "w"))
    first = task_store.claim_next("w")
    task_store.fail_attempt(task["id"], first["run_marker"], "no", retryable=False,
                            result={"files_touched": ["A.txt"]}, diff="+A\n")
    run("retry", task["id"])
    second = task_store.claim_next("w")
    task_store.complete_attempt(task["id"], second["run_marker"], result={"files_touched": ["B.txt"]}, diff="+B\n")
    shown = " ".join(run("show", task["id"]).stdout.split())
    assert f"attempt {first['run_marker']} failed, 1 file(s) changed, kept when a retry started afresh (diff " \
           f"t_0001 --attempt {first['run_marker']})" in shown
    assert run("diff", task["id"]).stdout == "+B\n"
    assert run("diff", task["id"], "--attempt", "a1").stdout == "+A\n"
    missing = run("diff", task["id"], "--attempt", "a5")
    assert missing.exit_code != 0
    assert f"keeps no earlier attempt 'a5'; it keeps: {first['run_marker']}" in " ".join(missing.stderr.split())


@pytest.mark.parametrize("end", ["failed", "cancelled"])
def test_no_diff_of_a_task_whose_worktree_is_on_disk_says_where_its_work_is(tmp_path, end):
    """A fresh user's finding: a task failed by the reaper after its worker was killed, or
    cancelled while its worker was dead, "has no diff" and said nothing of its worktree, still
    on disk with the agent's uncommitted work in it. Said from the file system alone: no git
    command runs in what an agent left (a review's finding: its git folder could carry a filter)."""
    from helpers import make_repo

    repo = make_repo(tmp_path / "repo")
    task, claimed, ws = running_in_a_worktree(repo, "worker killed")
    (Path(ws.top) / "new.txt").write_text("the agent's\n")
    if end == "failed":   # as the reaper fails it: no receipt, no diff
        task_store.fail_attempt(task["id"], claimed["run_marker"], "its worker died", retryable=False)
    else:
        task_store.cancel_task(task["id"])
    git_ran = tmp_path / "git-ran"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(f"#!/bin/sh\necho \"$@\" >> {git_ran}\nexec {shutil.which('git')} \"$@\"\n")
    (bin_dir / "git").chmod(0o755)
    said = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        for command, flag in (("diff", ""), ("diff", "--stat"), ("show", "--diff")):
            said[f"{command} {flag}".strip()] = run(command, task["id"], *flag.split()).stderr
    for how, text in said.items():
        text = " ".join(text.split())   # the terminal's folds
        assert f"its worktree {ws.top} is still on disk as its run left it: what its agent changed" in text, how
    assert ws.top not in (git_ran.read_text() if git_ran.exists() else ""), "git ran in the agent's worktree"
    shutil.rmtree(ws.top)
    assert "worktree" not in run("diff", task["id"]).stderr   # gone: nothing to point at


@pytest.mark.parametrize("beat,said", [
    ("{'state': 'running', 'task': 't_0001', 'tasks': ['t_0001']}", "it died mid-run; the next pass requeues t_0001"),
    # Killed while idle: before, it too "died mid-run" and "the next pass requeues its task".
    ("{'state': 'idle'}", "it ended without saying it stopped (killed?) while it held no task"),
])
def test_status_says_when_the_worker_that_wrote_the_heartbeat_is_gone(tmp_path, beat, said):
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", f"import task_store; task_store.write_worker_heartbeat({beat})"])
    dead.wait()
    task_store.connect().close()   # the queue the heartbeat sits beside
    result = CliRunner().invoke(tasks_cli.cli, ["status"])
    assert result.exit_code == 0
    assert f"The worker (pid {dead.pid}) that wrote this heartbeat is gone: {said}." in result.stderr
    assert ("requeue" in result.output + result.stderr) == ("tasks" in beat)


def status_rows(output: str) -> dict[str, str]:
    """`status`'s field tables as {field: value} (the first of each name)."""
    rows: dict[str, str] = {}
    for row in output.splitlines():
        name, _, value = row.strip().partition("  ")
        rows.setdefault(name, value.strip())
    return rows


def test_status_never_shows_a_dead_worker_running_its_last_task_but_a_silent_one_may_be(tmp_path, monkeypatch):
    """A fresh user's finding: a worker killed mid-run was listed as running its task still. A real
    `worker.py --watch` runs a task (a stand-in agent that runs until ended) and is killed. A worker
    on another host gone silent is another matter: nobody can tell it stopped, so its tasks stay its."""
    import psutil

    from helpers import fake_binary, tagged, until, worker_process
    fake = fake_binary(tmp_path / "bin", "opencode", '[ "$1" = run ] || exit 0\ncat > /dev/null\nexec sleep 300\n')
    task = submit(make_repo(tmp_path / "repo"), "long", model="fake/model", timeout_sec=600)
    env = dict(os.environ, OPENCODE_BIN=str(fake), WORKER_MODEL="fake/model")
    with worker_process(env, tmp_path / "worker.out", "--watch") as proc:
        running = until(lambda: (t := task_store.get_task(task["id"]))["agent_pid"] and t, 90, "the agent to start")
        until(lambda: task_views_worker()["tasks"] == [task["id"]], 30, "the heartbeat to name the task")
        alive = CliRunner().invoke(cli, ["status"], env={"COLUMNS": "200"})
        assert status_rows(alive.stdout)["runs"] == f"{task['id']} (running)", alive.stdout
        proc.kill()   # dies mid-run: no last heartbeat
        proc.wait(30)
    for orphan in tagged(running["run_marker"]):   # its run, orphaned by the kill (the next pass's to end)
        with contextlib.suppress(psutil.Error):
            orphan.kill()
    shown = CliRunner().invoke(cli, ["status"], env={"COLUMNS": "200"})
    rows = status_rows(shown.stdout)
    assert rows["worker"].startswith("gone since ") and f"pid {proc.pid}" in rows["worker"], shown.stdout
    assert rows["runs"].startswith("nothing now; when last seen") and f"{task['id']} (running)" in rows["runs"]
    worker = json.loads(CliRunner().invoke(cli, ["status", "--json"]).stdout)["worker"]
    assert worker["tasks"] == [] and worker["task"] is None and worker["last_tasks"] == [task["id"]], worker
    assert worker["label"] == "gone" and worker["gone_since"] == worker["at"]
    # A worker on another host that went silent (stale) may still be running its task: the reaper
    # leaves its lease alone until WORKER_STALE_SEC. Shown as running it, with how long it has been
    # silent (before, "none now (had t_0009)": a planner reading that would retry or cancel it).
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "build-server")
        task_store.write_worker_heartbeat({"state": "running", "task": "t_0009", "tasks": ["t_0009"], "slots": 1})
    import task_views
    monkeypatch.setattr(task_views, "WORKER_ELSEWHERE_SILENT_SEC", -1)   # its heartbeat is old already
    table = CliRunner().invoke(cli, ["status"], env={"COLUMNS": "200"}).stdout
    silent = next(row for row in table.splitlines() if "build-server" in row and "│" in row)
    assert re.search(r"stale: not heard from for \d+ s", silent) and "t_0009" in silent, silent
    assert "none now" not in silent and "was running" not in silent and "since" not in silent, silent
    assert status_rows(table)["runs"] == "t_0009 (running)", table   # the newest: the silent one
    stale = json.loads(CliRunner().invoke(cli, ["status", "--json"]).stdout)["worker"]
    assert stale["label"] == "stale" and stale["host"] == "build-server", stale
    assert stale["tasks"] == ["t_0009"] and stale["task"] == "t_0009" and stale["gone_since"] is None, stale
    assert "it may still be running t_0009: the reaper leaves their leases to it until their heartbeat is 900 s old" \
        in stale["summary"], stale["summary"]


@pytest.fixture
def kathmandu(monkeypatch):
    """This process's local time zone set to UTC+05:45 (a POSIX rule: no tz database needed), and
    back to the test run's own afterwards."""
    from datetime import timedelta, timezone
    before = os.environ.get("TZ")
    monkeypatch.setenv("TZ", "<+0545>-05:45")
    time.tzset()
    yield timezone(timedelta(hours=5, minutes=45))
    if before is None:   # put back now, for tzset (monkeypatch's own undo comes after this teardown)
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_the_workers_table_says_since_when_a_worker_is_gone_in_local_time(tmp_path, kathmandu):
    """A reviewer's finding: the table's ``gone since 15:01:24`` was cut from a UTC time with no zone
    (5 h 45 min off here). A worker here that wrote its heartbeat and died, beside another that runs."""
    from datetime import datetime
    dead = subprocess.Popen([sys.executable, "-c", "import task_store; task_store.write_worker_heartbeat("
                             "{'state': 'running', 'task': 't_0001', 'tasks': ['t_0001']})"])
    dead.wait()
    task_store.write_worker_heartbeat({"state": "idle"})   # this process: a second worker, online
    workers = json.loads(CliRunner().invoke(cli, ["status", "--json"]).stdout)["workers"]
    gone = next(w for w in workers if w["pid"] == dead.pid)
    assert gone["label"] == "gone", gone
    there = datetime.fromisoformat(gone["gone_since"]).astimezone(kathmandu)
    day = "" if there.date() == datetime.now(kathmandu).date() else f"{there:%Y-%m-%d} "
    table = CliRunner().invoke(cli, ["status"], env={"COLUMNS": "200"}).stdout
    row = next(row for row in table.splitlines() if f"│ {dead.pid} " in row)
    assert f"gone since {day}{there:%H:%M:%S}" in row, row
    assert gone["gone_since"][11:19] not in row, row   # not the UTC clock


def task_views_worker() -> dict:
    import task_views
    return task_views.worker_state()


def test_logs_of_a_task_a_live_worker_is_preparing_says_its_agent_is_starting(tmp_path):
    """A reviewer's finding: claiming counts an attempt and clears the agent's pid, so a task whose
    worker was still preparing its worktree (a remote clone takes a while) got "no attempt got as
    far as starting its agent ... `show` says why": false, it is starting. Its worker lives here
    (this process holds the lease); once that worker is gone the old words hold again."""
    import psutil
    task = submit(make_repo(tmp_path / "repo"), "slow start")
    me = psutil.Process()
    task_store.claim_next(f"worker:{task_store.host_name()}:{me.pid}", me.pid, me.create_time())
    where = str(task_store.task_log_location(task["id"]))
    said = CliRunner().invoke(cli, ["logs", task["id"]])
    words = " ".join(said.stderr.split())
    assert said.exit_code == 0 and "Traceback" not in said.output, said.output
    assert f"{task['id']} has no log yet: its agent is starting." in words, words
    assert re.search(r"claimed it \d+s ago \(attempt 1 of 2\) and is preparing its run \(its worktree\);", words), words
    assert f"the agent's log appears at {where} once it starts." in words, words
    assert "no attempt got as far" not in words and "show" not in words, words

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other = submit(make_repo(tmp_path / "repo2"), "its worker died")
    task_store.claim_next(f"worker:{task_store.host_name()}:{dead.pid}", dead.pid, time.time() - 5)
    words = " ".join(CliRunner().invoke(cli, ["logs", other["id"]]).stderr.split())
    assert "a worker claimed it (1 attempt(s); it is running) but no attempt got as far as starting its agent" \
        in words, words


def test_claim_says_why_nothing_is_ready_and_logs_says_why_there_is_none(tmp_path):
    runner = CliRunner()
    first = submit(tmp_path, "a")
    submit(tmp_path, "b", depends_on=[first["id"]])
    claimed = task_store.claim_next("cli:me")
    nothing = runner.invoke(tasks_cli.cli, ["claim"])
    assert nothing.exit_code == 0 and "1 pending task(s) wait for dependencies" in " ".join(nothing.stderr.split())
    task_store.complete_attempt(first["id"], claimed["run_marker"], result={"summary": "by hand"})
    logs = runner.invoke(tasks_cli.cli, ["logs", first["id"]])
    assert logs.exit_code == 0 and "no worker ever ran it" in logs.stderr


def test_diff_of_a_task_that_ran_in_place_says_so_and_names_its_files(tmp_path):
    """A task outside git keeps no diff; `diff` said "it changed no files" while `show` listed the
    file it wrote (seen by a fresh user)."""
    task = submit(tmp_path, "in place")
    claimed = task_store.claim_next("cli:x", task_id=task["id"])
    task_store.complete_attempt(
        task["id"],
        claimed["run_marker"],
        diff="",
        result={"summary": "ok", "isolation": "in-place", "files_touched": [str(tmp_path / "hello.txt")]},
    )
    said = run("diff", task["id"])
    assert said.exit_code != 0 and "ran in place" in said.stderr and "hello.txt" in said.stderr
    assert "changed no files" not in said.stderr
    shown = run("show", task["id"]).stdout   # said "the run changed no files" beside it (a new-user test)
    assert "it ran in place and its changes are already in" in shown and "changed no files" not in shown
    assert "so it runs in place" in shown


def test_a_write_the_database_refuses_by_a_constraint_is_said_in_the_stores_words(tmp_path, monkeypatch):
    # ConstraintViolated is a DatabaseUnusable; the CLI's catch of the latter told the person to
    # check --db and the file's permissions, which a refused write is not about.
    submit(tmp_path, TITLE)
    said = "the task database x refused a write (UNIQUE constraint failed): nothing was written; try again"

    def refuse(*_args, **_kw):
        raise task_store.ConstraintViolated(said, "UNIQUE constraint failed")
    monkeypatch.setattr(task_store, "cancel_task", refuse)
    result = run("cancel", "1", "--yes")
    assert result.exit_code == 1 and said in result.stderr.replace("\n", " ")
    assert "check --db" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("argv", [["submit", "x", "--db", "/tmp/q.db"], ["status", "--db=/tmp/q.db"]])
def test_db_after_the_command_says_where_it_goes(tmp_path, argv):
    # click answered "No such option '--db'. Did you mean '--dir'?" (found by a new-user test).
    result = run(*argv)
    assert result.exit_code == 2 and f"--db goes before the command: {tasks_cli.CLI} --db FILE_OR_URL" in result.stderr
    assert "Did you mean" not in result.stderr


def test_an_empty_model_is_refused_not_read_as_the_default(tmp_path):
    # `submit --model ""` queued the task on the default model without a word (a new-user test).
    result = run("submit", "x", "--dir", str(tmp_path), "--model", "", "--yes")
    assert result.exit_code == 2 and "it is empty; give provider/model" in result.stderr, result.stderr
    assert task_store.counts()["pending"] == 0


def test_diff_says_a_run_changed_nothing_only_of_a_done_task(tmp_path, monkeypatch):
    """`diff` said "it ran in place in your checkout and changed no files" of any in-place task
    without a diff: one running again on a retry, one failed where the diff could not be read."""
    in_checkout = {"summary": "ok", "isolation": "in-place", "base_commit": "a" * 40, "files_touched": []}
    failed = submit(tmp_path, "unread")
    marker = task_store.claim_next("cli:x", task_id=failed["id"])["run_marker"]
    task_store.fail_attempt(failed["id"], marker, "git diff failed", retryable=False,
                            result=dict(in_checkout, diff_error="git diff: index.lock exists"))
    said = " ".join(run("diff", failed["id"]).stderr.split())
    assert "changed no files" not in said and "it failed, and what its last attempt changed could not be read: " \
        "git diff: index.lock exists" in said, said

    monkeypatch.setattr(task_store, "RETRY_BACKOFF_SEC", (0, 0))   # claimed again at once
    retried = submit(tmp_path, "again", max_retries=1)
    marker = task_store.claim_next("cli:x", task_id=retried["id"])["run_marker"]
    task_store.fail_attempt(retried["id"], marker, "model error", result=in_checkout)
    task_store.claim_next("cli:x", task_id=retried["id"])
    said = " ".join(run("diff", retried["id"]).stderr.split())
    assert "changed no files" not in said and "it is running: a diff is kept when an attempt finishes" in said, said

    done = submit(tmp_path, "idle")
    marker = task_store.claim_next("cli:x", task_id=done["id"])["run_marker"]
    task_store.complete_attempt(done["id"], marker, diff="", result=in_checkout)
    said = " ".join(run("diff", done["id"]).stderr.split())
    assert "it ran in place in your checkout and changed no files" in said, said
