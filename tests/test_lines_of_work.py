"""Working with a task after it ran (issue 15), with the real `opencode` and the scripted model:
a follow-up resumes the same OpenCode session on the same branch; a fork starts a branch of its
own from the same head with a copy of the session; the transcript of a line of work; a note sent
while a task runs reaches that run; an `ask` rule pauses a task until the planner allows or
denies; unknown skills and sub-agents are refused at submit."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import task_store
import task_views
from fake_openai import text, tool_call
from helpers import ROOT, git, make_repo, run_script, submit, tool_error, until

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)


def _receipt(summary: str, files: list[str]) -> str:
    return "```json\n" + json.dumps({"summary": summary, "files_touched": files, "tests_run": [],
                                     "open_questions": []}) + "\n```"


def _step(call: dict, said: str, summary: str, files: list[str]) -> list[dict]:
    """One scripted agent step: a tool call, then a reply that ends with its receipt."""
    return [call, text(said + "\n" + _receipt(summary, files))]


def _body(request) -> str:
    return json.dumps(request["json"]["messages"])


def test_follow_up_resumes_the_session_and_commits_on_the_same_branch(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    # One script for the whole line: the step is the number of assistant turns already in the
    # session, so the follow-up's steps come after the first task's.
    opencode.model.script("line", [
        *_step(tool_call("write", {"filePath": "{cwd}/lib.py", "content": "def add(a, b):\n    return a + b\n"}),
               "Wrote it.", "wrote lib.py", ["lib.py"]),
        *_step(tool_call("write", {"filePath": "{cwd}/test_lib.py", "content": "from lib import add\n"}),
               "Tests added.", "added test_lib.py", ["test_lib.py"]),
    ])
    first = task_store.submit_task(title="lib", instructions="Write lib.py. SCRIPT:line first-brief-token",
                                   working_dir=str(repo))
    follow = task_store.submit_task(title="tests", instructions="Now add tests. follow-up-brief-token",
                                    continue_from=first["id"])
    assert follow["continue_from"] == first["id"] and follow["depends_on"] == [first["id"]]
    assert follow["working_dir"] == str(repo)

    assert run_script("worker.py").returncode == 0
    one, two = task_store.get_task(first["id"]), task_store.get_task(follow["id"])
    assert one["status"] == "done", one["error"]
    assert two["status"] == "done", two["error"]

    assert two["session_id"] == one["session_id"], "the follow-up resumed the same OpenCode session"
    assert two["result"]["session"] == f"continued {one['id']}'s OpenCode session {one['session_id']}"
    later = [r for r in opencode.model.step_requests("line") if "follow-up-brief-token" in _body(r)]
    assert later, "the follow-up's brief reached the model"
    assert "first-brief-token" in _body(later[0]) and "lib.py" in _body(later[0]), \
        "its request carries the earlier turns"

    branch = one["branch"]
    assert two["branch"] == branch
    assert git(repo, "rev-parse", f"{two['result']['commit']}^") == one["result"]["commit"], \
        "the follow-up's commit sits on top of the first task's"
    assert git(repo, "rev-parse", branch) == two["result"]["commit"]
    assert two["result"]["files_touched"] == ["test_lib.py"], "this step's diff"
    assert "test_lib.py" in two["diff"] and "lib.py\n" not in two["result"]["files_touched"]
    line = two["result"]["line"]
    assert line["continues"] == one["id"] and line["base_commit"] == one["base_commit"]
    assert line["files"] == ["lib.py", "test_lib.py"], "the whole line's diff"
    assert "def add" in line["diff"] and "from lib import add" in line["diff"]
    assert str(tmp_path / "worktrees") not in git(repo, "worktree", "list")

    # The transcript of the line: both briefs as user turns, the agent's turns between them.
    page = task_views.transcript(two["id"], 0, 100)
    assert page["source"] == "opencode session" and page["line"] == [one["id"], two["id"]]
    users = [t["text"] for t in page["turns"] if t["role"] == "user"]
    assert len(users) == 2 and "first-brief-token" in users[0] and "follow-up-brief-token" in users[1]
    assert any(c["tool"] == "write" and c["title"] for t in page["turns"] for c in t["tools"])
    assert "Tests added." in page["turns"][-1]["text"] and page["next_offset"] is None
    second = task_views.transcript(two["id"], 1, 2)
    assert [t["index"] for t in second["turns"]] == [1, 2] and second["next_offset"] == 3
    shown = run_script("tasks_cli.py", "transcript", two["id"], "--limit", "100")
    assert shown.returncode == 0 and "follow-up-brief-token" in shown.stdout and "Tests added." in shown.stdout


def test_fork_makes_two_branches_from_one_head_with_both_histories(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("forks", [
        *_step(tool_call("write", {"filePath": "{cwd}/base.txt", "content": "shared start\n"}),
               "Base done.", "base", ["base.txt"]),
        *_step(tool_call("bash", {"command": "pwd > {cwd}/approach.txt", "description": "try"}),
               "Tried.", "an approach", ["approach.txt"]),
    ])
    first = task_store.submit_task(title="base", instructions="Start. SCRIPT:forks", working_dir=str(repo))
    fork_a = task_store.submit_task(title="approach A", instructions="Try approach A.", fork_from=first["id"])
    fork_b = task_store.submit_task(title="approach B", instructions="Try approach B.", fork_from=first["id"])

    assert run_script("worker.py").returncode == 0
    one = task_store.get_task(first["id"])
    a, b = task_store.get_task(fork_a["id"]), task_store.get_task(fork_b["id"])
    assert [t["status"] for t in (one, a, b)] == ["done"] * 3, (one["error"], a["error"], b["error"])

    assert len({one["branch"], a["branch"], b["branch"]}) == 3, "a branch each"
    for fork in (a, b):
        assert git(repo, "rev-parse", f"{fork['result']['commit']}^") == one["result"]["commit"], \
            "both forks start from the first task's head"
        assert git(repo, "show", f"{fork['branch']}:base.txt") == "shared start"
        assert fork["session_id"] not in (None, one["session_id"]), "a session of its own"
        assert fork["result"]["session"].startswith("a copy (")
        assert fork["result"]["line"]["forked_from"] == one["id"]
        assert fork["result"]["line"]["files"] == ["approach.txt", "base.txt"]
    # Each fork's model request carried the first task's turns, and ran in its own worktree.
    for fork in (a, b):
        request = [r for r in opencode.model.step_requests("forks") if f"approach {fork['title'][-1]}" in _body(r)][0]
        assert "Start. SCRIPT:forks" in _body(request) and "base.txt" in _body(request)
        assert request["cwd"].endswith(fork["id"])
    assert git(repo, "show", f"{a['branch']}:approach.txt") != git(repo, "show", f"{b['branch']}:approach.txt")
    assert git(repo, "rev-parse", one["branch"]) == one["result"]["commit"], "the first branch is untouched"


def test_a_fork_of_a_task_a_follow_up_continued_starts_from_that_tasks_work_and_turns(opencode, tmp_path):
    """A follow-up moves its task's branch on and adds its turns to the task's own session: a
    fork of the task made after that started from the follow-up's commit with the follow-up's
    turns. It starts from the commit the task ended at, with the turns the task had then."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("line", [
        *_step(tool_call("write", {"filePath": "{cwd}/a.txt", "content": "one\n"}), "Wrote.", "one", ["a.txt"]),
        *_step(tool_call("bash", {"command": "cat {cwd}/a.txt; echo more >> {cwd}/a.txt", "description": "add"}),
               "Added.", "more", ["a.txt"]),
    ])
    first = task_store.submit_task(title="first", instructions="Begin. SCRIPT:line", working_dir=str(repo))
    follow = task_store.submit_task(title="follow", instructions="follow-up-brief-token", continue_from=first["id"])
    assert run_script("worker.py").returncode == 0
    one, two = task_store.get_task(first["id"]), task_store.get_task(follow["id"])
    assert [one["status"], two["status"]] == ["done", "done"], (one["error"], two["error"])
    assert git(repo, "rev-parse", one["branch"]) == two["result"]["commit"] != one["result"]["commit"]
    fork = task_store.submit_task(title="fork", instructions="fork-brief-token", fork_from=first["id"])
    assert run_script("worker.py").returncode == 0
    forked = task_store.get_task(fork["id"])
    assert forked["status"] == "done", forked["error"]
    assert git(repo, "rev-parse", f"{forked['result']['commit']}^") == one["result"]["commit"], forked["result"]
    assert git(repo, "show", f"{forked['branch']}:a.txt") == "one\nmore"   # its own step on the first's file
    request = [r for r in opencode.model.step_requests("line") if "fork-brief-token" in _body(r)][0]
    assert "Begin. SCRIPT:line" in _body(request) and "follow-up-brief-token" not in _body(request)
    assert forked["result"]["session"].startswith("a copy (")


def test_a_follow_ups_retry_is_told_what_became_of_its_earlier_attempts_work(opencode, tmp_path):
    """A follow-up timed out after writing a file; its retry resumed the line's session, whose turns
    say the file was written, in a worktree made again without it, and the agent was not told (a
    fresh tester's finding). The retry's first message now says that work is gone."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("lost", [
        *_step(tool_call("write", {"filePath": "{cwd}/a.txt", "content": "a\n"}), "Begun.", "begun", ["a.txt"]),
        tool_call("write", {"filePath": "{cwd}/s1.txt", "content": "from the attempt that timed out\n"}),
        tool_call("bash", {"command": "sleep 120", "description": "a long step"}),
        text("Redone.\n" + _receipt("redone", [])),
    ])
    first = task_store.submit_task(title="first", instructions="Begin. SCRIPT:lost", working_dir=str(repo))
    follow = task_store.submit_task(title="next", instructions="Go on.", continue_from=first["id"], timeout_sec=25)
    assert run_script("worker.py").returncode == 0
    timed_out = task_store.get_task(follow["id"])
    assert timed_out["status"] == "pending" and "timed out" in timed_out["error"], timed_out["error"]
    time.sleep(task_store.RETRY_BACKOFF_SEC[0] + 1)   # the retry's back-off
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(follow["id"])
    assert done["status"] == "done", done["error"]
    last = _body(opencode.model.step_requests("lost")[-1])
    assert "your earlier attempt at this step ended before its work was kept" in last
    assert "its changes are gone: the worktree holds only what is committed on" in last
    assert "s1.txt" not in git(repo, "ls-tree", "-r", "--name-only", task_store.get_task(first["id"])["branch"])


def test_follow_up_refusals(tmp_path):
    here = str(tmp_path)
    (tmp_path / "other").mkdir()
    first = task_store.submit_task(title="a", instructions="x", working_dir=here)
    with pytest.raises(task_store.ValidationError, match="not both"):
        task_store.submit_task(title="b", instructions="y", continue_from=first["id"], fork_from=first["id"])
    task_store.submit_task(title="b", instructions="y", continue_from=first["id"])
    with pytest.raises(task_store.ValidationError, match="already continues it.*fork_from"):
        task_store.submit_task(title="c", instructions="y", continue_from=first["id"])
    with pytest.raises(task_store.ValidationError, match="working_dir must be"):
        task_store.submit_task(title="c", instructions="y", fork_from=first["id"], working_dir=str(tmp_path / "other"))
    with pytest.raises(task_store.ValidationError, match="fork_from names t_0999, which does not exist"):
        task_store.submit_task(title="c", instructions="y", fork_from="t_0999")
    kept = task_store.submit_task(title="k", instructions="x", working_dir=here, worktree_keep=True)
    assert task_store.submit_task(title="k2", instructions="y", continue_from=kept["id"])["worktree_keep"], \
        "a follow-up keeps the folder its task kept"
    assert not task_store.submit_task(title="k3", instructions="y", fork_from=kept["id"])["worktree_keep"]
    flat = task_store.submit_task(title="d", instructions="x", working_dir=here, worktree=False)
    with pytest.raises(task_store.ValidationError, match="worktree=false"):
        task_store.submit_task(title="e", instructions="y", continue_from=flat["id"])


def test_a_line_of_work_never_has_two_live_follow_ups_after_a_retry(tmp_path):
    """Cancel a follow-up, submit another, retry the first: before, both ran in the same worktree
    and session at once and one lost its work (a fresh tester's finding). The retry is refused,
    and a follow-up a retried parent would requeue stays failed when its line went on."""
    first = task_store.submit_task(title="a", instructions="x", working_dir=str(tmp_path))
    cancelled = task_store.submit_task(title="b", instructions="y", continue_from=first["id"])
    task_store.cancel_task(cancelled["id"])
    later = task_store.submit_task(title="c", instructions="z", continue_from=first["id"])
    said = f"{later['id']} continues now .* cancel {later['id']} first, or .*continue_from {later['id']}"
    with pytest.raises(task_store.InvalidTransition, match=said):
        task_store.retry_task(cancelled["id"])
    assert task_store.get_task(cancelled["id"])["status"] == "cancelled"
    task_store.cancel_task(later["id"])
    assert task_store.retry_task(cancelled["id"])["status"] == "pending", "no other live follow-up: it may go again"
    # After a done follow-up the line goes on from it: not "cancel it first", which cannot be done.
    claimed = task_store.claim_next("w", task_id=first["id"])
    task_store.complete_attempt(first["id"], claimed["run_marker"], result={"summary": "ok"})
    claimed = task_store.claim_next("w", task_id=cancelled["id"])
    task_store.complete_attempt(cancelled["id"], claimed["run_marker"], result={"summary": "ok"})
    with pytest.raises(task_store.InvalidTransition, match=f"{cancelled['id']} continued since .*"
                                                           f"continue_from {cancelled['id']}"):
        task_store.retry_task(later["id"])
    # A follow-up failed with a dependency: when that is retried after the line went on, it stays failed.
    root = task_store.submit_task(title="r", instructions="x", working_dir=str(tmp_path))
    claimed = task_store.claim_next("w", task_id=root["id"])
    task_store.renew_lease(root["id"], claimed["run_marker"], branch=f"taskbridge/{root['id']}")   # a worktree run
    task_store.complete_attempt(root["id"], claimed["run_marker"], result={"summary": "ok"})
    dep = task_store.submit_task(title="d", instructions="x", working_dir=str(tmp_path))
    waiting = task_store.submit_task(title="w", instructions="y", continue_from=root["id"], depends_on=[dep["id"]])
    task_store.cancel_task(dep["id"])   # its follow-up fails: dependency cancelled
    assert task_store.get_task(waiting["id"])["status"] == "failed"
    went_on = task_store.submit_task(title="g", instructions="z", continue_from=root["id"])
    assert task_store.retry_task(dep["id"])["requeued_dependents"] == []
    assert task_store.get_task(waiting["id"])["status"] == "failed"
    assert task_store.get_task(went_on["id"])["status"] == "pending"


def test_follow_ups_and_forks_keep_their_tasks_restrictions_unless_they_name_their_own(tmp_path):
    """A follow-up of a readonly task with an ask rule ran as auto without the rule, and pushed
    (a fresh tester's finding): the line's preset, rules, agent, skills and sub-agents carry on."""
    rules = {"bash": {"git push*": "ask"}}
    first = task_store.submit_task(title="a", instructions="x", working_dir=str(tmp_path), permission="readonly",
                                   rules=rules, agent="plan", skills=["review"], subagents=["general"])
    follow = task_store.submit_task(title="b", instructions="y", continue_from=first["id"])
    fork = task_store.submit_task(title="c", instructions="z", fork_from=first["id"])
    for task in (follow, fork):
        assert (task["permission"], task["rules"], task["agent"], task["skills"], task["subagents"]) == (
            "readonly", rules, "plan", ["review"], ["general"]), task
    own = task_store.submit_task(title="d", instructions="z", fork_from=first["id"], permission="auto", agent="build")
    assert (own["permission"], own["agent"], own["rules"]) == ("auto", "build", rules), "what it names is its own"
    batch = task_store.submit_batch([{"title": "e", "instructions": "x", "working_dir": str(tmp_path), "ref": "@e",
                                      "permission": "no-shell"},
                                     {"title": "f", "instructions": "y", "continue_from": "@e"}])
    assert batch[1]["permission"] == "no-shell" and batch[0]["permission"] == "no-shell"
    assert task_store.submit_task(title="g", instructions="x", working_dir=str(tmp_path))["permission"] == "auto"
    cli = run_script("tasks_cli.py", "submit", "h", "--continue", follow["id"], "--json")
    assert cli.returncode == 0 and json.loads(cli.stdout)["permission"] == "readonly", cli.stderr


def test_a_repeated_idempotency_key_with_another_parent_or_preset_is_refused(tmp_path):
    """The key returned an earlier follow-up for a fork, and an auto task for a readonly request
    with a deny rule (a fresh tester's finding): those are other tasks."""
    first = task_store.submit_task(title="a", instructions="x", working_dir=str(tmp_path))
    keyed = task_store.submit_task(title="k", instructions="y", continue_from=first["id"], idempotency_key="K")
    assert task_store.submit_task(title="k", instructions="y", continue_from=first["id"],
                                  idempotency_key="K")["id"] == keyed["id"], "the same request: the first task"
    with pytest.raises(task_store.ValidationError, match="whose fork_from differs"):
        task_store.submit_task(title="k", instructions="y", fork_from=first["id"], idempotency_key="K")
    plain = task_store.submit_task(title="m", instructions="y", working_dir=str(tmp_path), idempotency_key="M")
    with pytest.raises(task_store.ValidationError, match="whose permission and rules differ"):
        task_store.submit_task(title="m", instructions="y", working_dir=str(tmp_path), idempotency_key="M",
                               permission="readonly", rules={"bash": "deny"})
    with pytest.raises(task_store.ValidationError, match="whose continue_from differs"):   # now no follow-up
        task_store.submit_task(title="k", instructions="y", working_dir=str(tmp_path), idempotency_key="K")
    assert task_store.get_task(plain["id"])["permission"] == "auto"
    assert task_store.counts()["pending"] == 3
    # What the store changed itself is no difference: an always answer's rule (one added after the
    # task's own; or, for an ask on an exact pattern, that pattern's action replaced, which refused
    # the identical resubmit as "rules differ"). Rule order decides (the last match wins), so the
    # same patterns in another order are another request.
    for key, given, subject, after, other in (
            ("R", {"bash": {"git push*": "ask"}}, "git push", {"git push*": "ask", "git push": "allow"},
             {"bash": {"git push*": "deny"}}),
            ("X", {"bash": {"*": "allow", "make deploy": "ask"}}, "make deploy", {"*": "allow", "make deploy": "allow"},
             {"bash": {"make deploy": "ask", "*": "allow"}})):
        ruled = task_store.submit_task(title=key, instructions="y", working_dir=str(tmp_path), idempotency_key=key,
                                       rules=given)
        claimed = task_store.claim_next("w", task_id=ruled["id"])
        task_store.pause_for_question(ruled["id"], claimed["run_marker"], "may I?", paused_for="permission",
                                      ask={"tool": "bash", "subject": subject, "reason": ""})
        task_store.answer_task(ruled["id"], "allow always")
        assert task_store.get_task(ruled["id"])["rules"] == {"bash": after}
        again = task_store.submit_task(title=key, instructions="y", working_dir=str(tmp_path), idempotency_key=key,
                                       rules=given)
        assert again["id"] == ruled["id"] and again["duplicate"] and "rules_given" not in again
        with pytest.raises(task_store.ValidationError, match="whose rules differ;"):
            task_store.submit_task(title=key, instructions="y", working_dir=str(tmp_path), idempotency_key=key,
                                   rules=other)
    with pytest.raises(task_store.ValidationError, match="^task 1 of the batch: idempotency_key 'M'"):
        task_store.submit_batch([{"title": "n", "instructions": "y", "working_dir": str(tmp_path)},
                                 {"title": "other", "instructions": "y", "working_dir": str(tmp_path),
                                  "idempotency_key": "M"}])


def test_cli_submit_continue_and_fork_without_dir(tmp_path):
    repo = make_repo(tmp_path / "repo")
    first = task_store.submit_task(title="a", instructions="x", working_dir=str(repo))
    follow = run_script("tasks_cli.py", "submit", "next step", "--continue", "1", "--json")
    assert follow.returncode == 0, follow.stderr
    assert json.loads(follow.stdout)["continue_from"] == first["id"]
    fork = run_script("tasks_cli.py", "submit", "other way", "--fork", first["id"], "--json")
    assert json.loads(fork.stdout)["fork_from"] == first["id"]
    again = run_script("tasks_cli.py", "submit", "again", "--continue", "1")
    assert again.returncode != 0 and "already continues it" in again.stderr and "Traceback" not in again.stderr
    shown = run_script("tasks_cli.py", "show", json.loads(fork.stdout)["id"])
    assert shown.returncode == 0 and re.search(r"forked from\s+" + first["id"], shown.stdout), shown.stdout
    shown = run_script("tasks_cli.py", "show", json.loads(follow.stdout)["id"])
    assert re.search(r"continues\s+" + first["id"], shown.stdout), shown.stdout


def test_transcript_without_a_session_comes_from_the_task_logs(tmp_path):
    task = task_store.submit_task(title="never ran", instructions="brief-token", working_dir=str(tmp_path))
    log = task_store.log_path(task["id"])
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text('{"type":"tool_use","timestamp":1000,"sessionID":"s","part":{"tool":"bash","state":'
                   '{"status":"completed","input":{"command":"ls"},"output":"a.txt"}}}\n'
                   '{"type":"text","timestamp":2000,"sessionID":"s","part":{"text":"looked around"}}\n')
    page = task_views.transcript(task["id"])
    assert page["source"] == "task logs" and page["session_id"] is None
    assert [t["role"] for t in page["turns"]] == ["user", "assistant"]
    assert "brief-token" in page["turns"][0]["text"]
    assert page["turns"][1]["text"] == "looked around" and page["turns"][1]["tools"][0]["output"] == "a.txt"
    with pytest.raises(task_store.ValidationError, match="limit"):
        task_views.transcript(task["id"], 0, 101)
    call = ('{"type":"tool_use","timestamp":3000,"sessionID":"s","part":{"tool":"bash","state":'
            '{"status":"completed","input":{"command":"yes"},"output":"' + "y" * 5000 + '"}}}\n')
    with log.open("a") as handle:
        handle.write(call * 25 + '{"type":"text","timestamp":4000,"sessionID":"s","part":{"text":"busy"}}\n')
    busy = task_views.transcript(task["id"])["turns"][2]
    assert (
        len(busy["tools"]) == 21 and busy["tools"][-1]["status"] == "omitted" and "5 more" in busy["tools"][-1]["title"]
    )
    assert len(busy["tools"][0]["output"]) < 1100
    refused = run_script("tasks_cli.py", "transcript", "t_0099")
    assert refused.returncode != 0 and "not found" in refused.stderr and "Traceback" not in refused.stderr


def _note_mid_run(opencode, repo, script: str, ready, text_: str) -> tuple[dict, dict, str]:
    """Submit SCRIPT:``script`` in ``repo``, run a worker pass, add the note ``text_`` once
    ``ready(the script's step requests)`` holds; (add_note's answer, the task after the pass,
    the worker's stderr)."""
    task = task_store.submit_task(title=script, instructions=f"Work. SCRIPT:{script}", working_dir=str(repo))
    worker = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: ready(opencode.model.step_requests(script)) or worker.poll() is not None, 120, "the model call")
        sent = task_store.add_note(task["id"], text_)
        _, stderr = worker.communicate(timeout=180)
    finally:
        if worker.poll() is None:
            worker.kill()
    return sent, task_store.get_task(task["id"]), stderr


def test_a_note_sent_while_a_task_runs_reaches_the_agent_in_that_run(opencode, tmp_path, worker_engine):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("steer", [
        tool_call("bash", {"command": "sleep 6", "description": "long step"}),
        text("Heard you.\n" + _receipt("took the note", [])),
    ])
    sent, done, stderr = _note_mid_run(opencode, repo, "steer", lambda steps: any(r["finished"] and r["step"] == 0
                                                                                   for r in steps),
                                       "use-the-blue-approach-token")
    assert sent["status"] == "running" and "running session" in sent["delivery"]
    assert done["status"] == "done", (done["error"], stderr)
    steps = opencode.model.step_requests("steer")
    assert len(steps) == 2 and steps[1]["json"]["messages"][-1]["role"] == "user"
    assert "use-the-blue-approach-token" in _body(steps[1]), "the note reached the running session"
    assert "use-the-blue-approach-token" not in _body(steps[0])
    note = done["result"]["notes"][0]
    assert note["delivered_how"] == "in the running session, at a step boundary" and note["delivered_at"]
    assert done["attempts"] == 1 and done["result"]["session"] == "new session"
    assert not list(task_store.log_path(done["id"]).parent.glob("*.notes*")), "the notes files are removed"


def test_a_note_that_comes_during_the_last_model_call(opencode, tmp_path, worker_engine):
    """The agent's last model call is under way when the note comes, so no step boundary is left
    for it. On the warm engine it goes to the session as its next turn and the agent answers it
    in the same run; a cold `opencode run` ends at idle, and the note waits for a later attempt."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("late", [
        text("First answer.\n" + _receipt("before the note", []), delay=4),
        text("Heard the late note.\n" + _receipt("took the late note", [])),
    ])
    _, done, stderr = _note_mid_run(opencode, repo, "late", bool, "use-the-late-token")
    assert done["status"] == "done", (done["error"], stderr)
    steps = opencode.model.step_requests("late")
    note = done["result"]["notes"][0]
    if worker_engine == "warm":
        assert len(steps) == 2 and "use-the-late-token" not in _body(steps[0])
        assert _body(steps[1]).count("use-the-late-token") == 1, "given once: as the turn, not by the plugin too"
        assert note["delivered_how"] == "in the running session, as a turn of its own after the agent had finished"
        assert done["result"]["summary"] == "took the late note"
    else:
        assert len(steps) == 1 and not note.get("delivered_at"), note
        assert done["result"]["summary"] == "before the note"


PUSH = "git push origin main; echo pushed > {cwd}/pushed.txt"


def test_a_call_a_deny_rule_refused_is_named_denied_not_run(opencode, tmp_path):
    """The receipt called a call the task's deny rule refused an "error" among the commands run
    (a fresh user's finding): it is "denied" now, and not among the commands."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("denied", [tool_call("bash", {"command": PUSH, "description": "publish"}),
                                     text("Done.\n" + _receipt("left the push", []))])
    task = task_store.submit_task(title="push", instructions="SCRIPT:denied", working_dir=str(repo),
                                  rules={"bash": {"git push*": "deny"}})
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert not [c for c in done["result"]["commands"] if "git push" in c["command"]], done["result"]["commands"]
    refused = done["result"]["tool_errors"]
    assert [(c["tool"], c["status"]) for c in refused] == [("bash", "denied")], refused
    assert "the task's rules deny bash git push origin main" in refused[0]["error"], refused


@pytest.mark.parametrize("decision", ["deny", "allow once"])
def test_an_ask_rule_pauses_the_task_and_the_answer_resumes_the_same_session(opencode, tmp_path, decision):
    repo = make_repo(tmp_path / "repo")
    steps = [tool_call("bash", {"command": PUSH, "description": "publish the branch"})]
    if decision == "allow once":
        steps.append(tool_call("bash", {"command": PUSH, "description": "publish the branch"}))
    opencode.model.script("push", steps + [text("Finished.\n" + _receipt("handled the push", []))])
    task = task_store.submit_task(title="push", instructions="Publish. SCRIPT:push", working_dir=str(repo),
                                  rules={"bash": {"git push*": "ask"}})
    assert task["rules"] == {"bash": {"git push*": "ask"}}

    paused = run_script("worker.py")
    assert paused.returncode == 0
    said_then = paused.stdout + paused.stderr
    assert f"{task['id']} waiting after" in said_then and "it asks permission" in said_then, said_then
    assert "spending limit" not in said_then, said_then
    waiting = task_store.get_task(task["id"])
    assert waiting["status"] == "waiting", waiting["error"]
    command = PUSH.replace("{cwd}", waiting["worktree_path"])
    assert f"bash `{command}`" in waiting["question"] and "publish the branch" in waiting["question"]
    assert waiting["paused_for"] == "permission" and waiting["pending_ask"]["subject"] == command
    assert not (tmp_path / "worktrees" / f"repo-{task['id']}" / "pushed.txt").exists(), "held, not run"
    # The step that made the held call is paid for: its tokens and cost are booked (they were lost
    # while the call itself was held: a step's step_finish comes only once its calls have ended).
    assert waiting["usage"]["steps"] == 1 and waiting["spent_usd"] > 0, waiting["usage"]

    with pytest.raises(task_store.ValidationError, match="allow once, allow always"):
        task_store.answer_task(task["id"], "sure, go ahead")
    task_store.answer_task(task["id"], decision)
    second = run_script("worker.py", "-v")
    assert second.returncode == 0, second.stdout + second.stderr
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", (done["error"], second.stdout + second.stderr,
                                      task_store.log_path(task["id"]).read_text(errors="replace")[-4000:])
    assert done["session_id"] == waiting["session_id"], "the same session resumed"
    resumed = opencode.model.step_requests("push")[1]
    said = _body(resumed)
    ran = [c for c in done["result"]["commands"] if "git push" in c["command"]]
    asked = done["result"]["permission_asks"]
    assert asked == [{"tool": "bash", "subject": command, "reason": waiting["pending_ask"].get("reason"),
                      "decision": {"deny": "deny once", "allow once": "allow once"}[decision]}], asked
    if decision == "deny":
        assert "refused your bash call" in said
        assert ran == [] and "pushed.txt" not in done["diff"], "the call was refused"
    else:
        assert "allowed your bash call" in said
        assert len(ran) == 1 and "pushed" in done["diff"], "allowed once, it ran"
    assert "rules" in done["result"]["sandbox"]


def test_rules_are_validated_at_submit(tmp_path):
    for rules, needle in [({"shell": "ask"}, "unknown tool 'shell'"), ({"bash": {"x": "maybe"}}, "an action is one of"),
                          ("{nope", "JSON object"), ({"bash": {}}, "is empty")]:
        with pytest.raises(task_store.ValidationError, match=needle):
            task_store.submit_task(title="r", instructions="x", working_dir=str(tmp_path), rules=rules)


def test_an_unknown_skill_subagent_or_agent_is_refused_at_submit(opencode, tmp_path):
    """An unknown --agent was queued and ran as OpenCode's default agent, its receipt naming the
    unknown one (a fresh user's finding); each is refused at submit naming its option."""
    repo = make_repo(tmp_path / "repo")
    skill = Path(opencode.env["XDG_CONFIG_HOME"]) / "opencode" / "skills" / "house-style"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text("---\nname: house-style\ndescription: Use for this repo's style\n---\nTabs.\n")
    refused = run_script("tasks_cli.py", "submit", "styled", "--dir", str(repo), "--skill", "no-such-skill")
    assert refused.returncode == 2 and "'no-such-skill' is not offered" in refused.stderr
    assert "house-style" in refused.stderr and task_store.counts()["pending"] == 0
    agent = run_script("tasks_cli.py", "submit", "styled", "--dir", str(repo), "--subagent", "ghost")
    assert agent.returncode == 2 and "sub-agent 'ghost'" in agent.stderr and "explore" in agent.stderr
    assert "'--subagent'" in agent.stderr and "'--skill'" in refused.stderr
    primary = run_script("tasks_cli.py", "submit", "styled", "--dir", str(repo), "--agent", "nosuchagent")
    assert primary.returncode == 2 and "agent 'nosuchagent' is not offered" in primary.stderr, primary.stderr
    assert "'--agent'" in primary.stderr and "build" in primary.stderr and task_store.counts()["pending"] == 0
    queued = run_script("tasks_cli.py", "submit", "styled", "--dir", str(repo), "--skill", "house-style",
                        "--subagent", "explore", "--json")
    assert queued.returncode == 0, queued.stderr
    task = task_store.get_task(json.loads(queued.stdout)["id"])
    assert task["skills"] == ["house-style"] and task["subagents"] == ["explore"]

    import anyio
    from mcp import Client

    import opencode_bridge_mcp as bridge

    async def over_mcp() -> str:
        async with Client(bridge.build_server()) as client:
            return await tool_error(client, "submit_task", {"title": "t", "instructions": "x", "working_dir": str(repo),
                                                            "skills": ["no-such-skill"]})

    assert "'no-such-skill' is not offered" in anyio.run(over_mcp)

    async def agent_over_mcp() -> str:
        async with Client(bridge.build_server()) as client:
            return await tool_error(client, "submit_task", {"title": "t", "instructions": "x", "working_dir": str(repo),
                                                            "agent": "nosuchagent"})

    assert "agent 'nosuchagent' is not offered" in anyio.run(agent_over_mcp)
    assert task_store.counts()["pending"] == 1   # the one queued above


def test_clearing_with_the_logs_removes_the_opencode_sessions_no_remaining_task_holds(tmp_path, monkeypatch):
    """A line of work's OpenCode session lives in folders named by the task that began it
    (agent_box.line_home), found by its id (agent_box.session_home): clearing with the logs
    (`clear --purge-logs`, the MCP `remove_logs`) removes them too, but for a session a task
    still in the queue holds (a follow-up resumes it, and the next follow-up after that)."""
    import agent_box
    import worktrees
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path.parent / f"{tmp_path.name}-cache"))

    def ran(task: dict, session: str, failed: bool = False) -> None:
        home = agent_box.session_home(session) or agent_box.line_home(task["id"])
        Path(home, "data", "opencode").mkdir(parents=True, exist_ok=True)
        agent_box.remember_session(session, home)
        marker = task_store.claim_next("test-worker", task_id=task["id"])["run_marker"]
        task_store.renew_lease(task["id"], marker, branch=f"taskbridge/{task['id']}")   # as a worktree run
        if failed:
            task_store.fail_attempt(task["id"], marker, "broke", retryable=False, session_id=session)
        else:
            task_store.complete_attempt(task["id"], marker, result={"summary": "done"}, session_id=session)

    first, alone = submit(tmp_path, "first"), submit(tmp_path, "alone")
    ran(first, "ses_first")
    ran(alone, "ses_alone")
    follow = task_store.submit_task(title="follow", instructions="i", continue_from=first["id"])
    ran(follow, "ses_first", failed=True)   # it resumed the first task's session
    removed, _purged = worktrees.clear_finished(0, ("done",), remove_logs=True)
    assert sorted(task["id"] for task in removed) == sorted([first["id"], alone["id"]])
    assert agent_box.session_home("ses_first") == os.path.realpath(agent_box.line_home(first["id"]))   # kept
    assert agent_box.session_home("ses_alone") is None and not Path(agent_box.line_home(alone["id"])).exists()
    worktrees.clear_finished(0, remove_logs=True)   # the follow-up goes too: nothing holds the session now
    assert agent_box.session_home("ses_first") is None and not Path(agent_box.line_home(first["id"])).exists()


def test_a_line_never_takes_another_lines_opencode_session(tmp_path, monkeypatch):
    """A run's session id is what its event stream printed, and a plugin in the box can print
    any, another task's included (commit trailers carry them): the first home recorded for an id
    keeps it (agent_box.remember_session), so a follow-up of the printing task never resumes the
    other line's session in the other line's folders."""
    import agent_box
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path.parent / f"{tmp_path.name}-cache"))
    theirs, mine = agent_box.line_home("t_0001"), agent_box.line_home("t_0002")
    for home in (theirs, mine):
        os.makedirs(home)
    assert agent_box.remember_session("ses_theirs", theirs) is True
    assert agent_box.remember_session("ses_theirs", theirs) is True   # its own again: still so
    assert agent_box.remember_session("ses_theirs", mine) is False
    assert agent_box.session_home("ses_theirs") == os.path.realpath(theirs)
    assert agent_box.remember_session("ses_mine", mine) is True and agent_box.session_home("ses_mine") == mine
    assert agent_box.session_home("../ses_mine") is None and agent_box.session_home(None) is None
