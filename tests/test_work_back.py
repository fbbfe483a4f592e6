"""Reading a task's log and getting its work back: `logs` (rendered, --raw, --follow), `diff`,
`branch`, `apply`, `retry`, and the MCP tools `retry_task` / `apply_task`.

Runs the real opencode with the scripted model where a finished task is needed, and real git
repositories throughout."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import opencode_runner
import task_store
import tasks_cli
from fake_openai import http_error, text, tool_call
from helpers import call_tool, checkout_state, git, make_repo, run_script, submit, tool_error

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "Tried a few things", "files_touched": [], "tests_run": [], ' \
          '"open_questions": []}\n```'


def cli(*args: str):
    result = CliRunner().invoke(tasks_cli.cli, list(args), catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


@pytest.mark.real_opencode
def test_logs_of_a_finished_run_read_like_an_opencode_session(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("mix", [
        tool_call("bash", {"command": "echo checking && exit 3", "description": "a failing check"}),
        tool_call("read", {"filePath": "{cwd}/missing.txt"}),
        tool_call("write", {"filePath": "{cwd}/blocked.txt", "content": "no"}),
        text("I looked around.\n" + RECEIPT),
    ])
    opencode.model.script("bad", [http_error(400, "the scripted model refuses this request")])
    task = task_store.submit_task(title="mix", instructions="SCRIPT:mix", working_dir=str(repo),
                                  permission="readonly")
    bad = task_store.submit_task(title="bad", instructions="SCRIPT:bad", working_dir=str(repo), max_retries=0)
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "done"
    assert task_store.get_task(bad["id"])["status"] == "failed"

    shown = cli("logs", task["id"])
    assert shown.exit_code == 0
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("── attempt br-1-a1 started ")
    assert "| bash     echo checking && exit 3  (exit 3)" in lines
    assert lines[lines.index("| bash     echo checking && exit 3  (exit 3)") + 1] == "  checking"
    assert any(line.startswith("| read     ") and "missing.txt  error: File not found" in line for line in lines)
    assert any(line.startswith("| write     denied: Model tried to call unavailable tool 'write'") for line in lines)
    assert "I looked around." in lines
    steps = [line for line in lines if line.startswith("   step finished")]
    assert len(steps) == 4 and steps[-1].startswith("   step finished (stop): ") and "$0.00" in steps[-1]
    assert not any(line.lstrip().startswith('{"type"') for line in lines), "no raw JSON events"

    failed = cli("logs", bad["id"])
    assert "Error: APIError: the scripted model refuses this request (HTTP 400)" in failed.stdout

    # --raw is the file byte for byte (through a real pipe), --tail counts rendered entries.
    raw = run_script("tasks_cli.py", "logs", task["id"], "--raw")
    assert raw.returncode == 0 and raw.stdout == task_store.log_path(task["id"]).read_text()
    assert cli("logs", task["id"], "--tail", "1").stdout.startswith("   step finished (stop)")
    followed = cli("logs", task["id"], "--follow")
    assert followed.stdout == shown.stdout and "t_0001 is done; log ends" in followed.stderr


def test_render_log_line_kinds_and_fields():
    step = json.dumps({"type": "step_finish", "timestamp": 1_700_000_000_000, "part": {
        "reason": "stop", "cost": 0.5, "tokens": {"total": 12, "input": 5, "output": 4, "reasoning": 3,
                                                   "cache": {"read": 2, "write": 1}}}})
    entry = opencode_runner.render_log_line(step)
    assert entry["kind"] == "step" and entry["reason"] == "stop" and entry["cost_usd"] == 0.5
    assert entry["tokens"] == {"total": 12, "input": 5, "output": 4, "reasoning": 3, "cache_read": 2,
                               "cache_write": 1}
    assert entry["ts"] == 1_700_000_000
    assert opencode_runner.render_log_line('{"type":"step_start","part":{}}') is None
    assert opencode_runner.render_log_line("   ") is None
    assert opencode_runner.render_log_line("[stderr] boom") == {"kind": "stderr", "text": "boom"}
    assert opencode_runner.render_log_line("[worker] skipped") == {"kind": "worker", "text": "skipped"}
    assert opencode_runner.render_log_line("not json {") == {"kind": "other", "text": "not json {"}
    assert opencode_runner.render_log_line('{"type":"new_kind"}')["kind"] == "other"
    # Malformed events never raise: every field is checked for its type.
    for odd in ('{"type":"tool_use","part":{"state":"x"}}', '{"type":"error","error":"plain"}',
                '{"type":"step_finish","part":{"tokens":[],"cost":"1"}}', '{"type":"text","part":[]}', "[1]"):
        assert opencode_runner.render_log_line(odd)["kind"] in ("tool", "error", "step", "text", "other")
    chunk = "=== br-2-a1 2026-01-01T00:00:00+00:00 cwd=/x\n$ opencode run\n" + step + "\n"
    assert [e["kind"] for e in opencode_runner.render_log(chunk)] == ["attempt", "worker", "step"]
    assert opencode_runner.render_log(chunk)[0]["cwd"] == "/x"


# --------------------------------------------------------------------------------------------
# apply, diff, branch.

DONE = '```json\n{"summary": "Wrote hello.txt", "files_touched": ["hello.txt"], "tests_run": [], ' \
       '"open_questions": []}\n```'


def finished_by_hand(repo, files: dict[str, str], title: str = "hand work") -> dict:
    """A done task whose branch holds one commit with ``files`` (played without a worker)."""
    task = submit(repo, title)
    claimed = task_store.claim_next("test-worker", task_id=task["id"])
    branch, base = f"taskbridge/{task['id']}", git(repo, "rev-parse", "HEAD")
    work = repo.parent / f"wt-{task['id']}"
    git(repo, "worktree", "add", "-q", "-b", branch, str(work), base)
    for name, content in files.items():
        (work / name).write_text(content)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", f"taskbridge {task['id']}")
    commit = git(work, "rev-parse", "HEAD")
    diff = git(work, "diff", base, commit) + "\n"
    git(repo, "worktree", "remove", "--force", str(work))
    task_store.renew_lease(task["id"], claimed["run_marker"], branch=branch, base_commit=base)
    return task_store.complete_attempt(task["id"], claimed["run_marker"], diff=diff,
                                       result={"summary": "ok", "commit": commit})


@pytest.mark.real_opencode
def test_apply_merges_a_finished_run_refuses_a_dirty_checkout_and_a_conflict_changes_nothing(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo", {"README.md": "# demo\n", "notes.txt": "a\n"})
    opencode.model.script("hello", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello from the agent\n"}),
        text("Done.\n" + DONE),
    ])
    task = task_store.submit_task(title="hello", instructions="SCRIPT:hello", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]

    (repo / "notes.txt").write_text("edited, not committed\n")
    dirty = checkout_state(repo)
    refused = cli("apply", task["id"])
    assert refused.exit_code == 1 and "uncommitted changes (notes.txt)" in refused.stderr
    assert "git stash" in refused.stderr and checkout_state(repo) == dirty
    git(repo, "checkout", "notes.txt")

    # A conflicting commit on main: the merge stops, is aborted, and nothing moved.
    (repo / "hello.txt").write_text("hello from the person\n")
    (repo / "untracked.txt").write_text("mine\n")
    git(repo, "add", "hello.txt")
    git(repo, "commit", "-q", "-m", "person's hello")
    before = checkout_state(repo)
    own = task_store.get_task(task["id"])
    commit, base = own["result"]["commit"], own["base_commit"]
    # By hand, the same kind of apply of the task's own work (not the branch, which a follow-up may
    # have moved on): its commit, or its commits since its base.
    for args, by_hand in (((), f" merge {commit}"), (("--squash",), f" merge --squash {commit}"),
                          (("--cherry-pick",), f" cherry-pick {base}..{commit}")):
        conflict = cli("apply", task["id"], *args)
        assert conflict.exit_code == 1, conflict.stdout
        assert "conflicts in hello.txt" in conflict.stderr and "the checkout is as it was" in conflict.stderr
        assert by_hand in " ".join(conflict.stderr.split()), conflict.stderr   # the same kind of apply, by hand
        said = " ".join(conflict.stderr.split())
        assert f"submit a follow-up (--continue {task['id']})" in said and "retry" not in said   # a done task
        assert checkout_state(repo) == before
        assert not (repo / ".git" / "MERGE_HEAD").exists() and not (repo / ".git" / "CHERRY_PICK_HEAD").exists()

    git(repo, "reset", "-q", "--hard", "HEAD~1")
    head = git(repo, "rev-parse", "HEAD")
    merged = cli("apply", task["id"])
    assert merged.exit_code == 0, merged.stderr
    assert f"Merged taskbridge/{task['id']}" in merged.stdout and "1 file(s) changed" in merged.stdout
    assert (repo / "hello.txt").read_text() == "hello from the agent\n"
    assert git(repo, "merge-base", "--is-ancestor", done["result"]["commit"], "HEAD") == ""
    assert git(repo, "status", "--porcelain", "--untracked-files=no") == ""
    assert f"reset --hard {head[:12]}" in merged.stdout
    again = cli("apply", task["id"], "--json")
    assert json.loads(again.stdout)["status"] == "already-applied"

    info = json.loads(cli("branch", task["id"], "--json").stdout)
    assert info["branch"] == f"taskbridge/{task['id']}" and info["commit"] == done["result"]["commit"]
    assert info["applied"] is True and info["commands"]["switch"].endswith(f"switch taskbridge/{task['id']}")
    assert cli("diff", task["id"]).stdout == done["diff"]
    assert "hello.txt  +1 -0" in cli("diff", task["id"], "--stat").stdout


def test_apply_squash_and_cherry_pick(tmp_path):
    repo = make_repo(tmp_path / "repo")
    first = finished_by_hand(repo, {"a.txt": "a\n"}, title="add a")
    second = finished_by_hand(repo, {"b.txt": "b\n"}, title="add b")
    squashed = cli("apply", first["id"], "--squash", "--json")
    assert squashed.exit_code == 0, squashed.stderr
    result = json.loads(squashed.stdout)
    assert result["status"] == "applied" and result["files"] == ["a.txt"] and result["mode"] == "squash"
    assert (
        git(repo, "log", "-1", "--format=%s")
        == f"add a (TaskBridge {first['id']}, squashed from taskbridge/{first['id']})"
    )
    assert git(repo, "rev-list", "--count", "HEAD") == "2"  # one new commit, no merge
    picked = cli("apply", second["id"], "--cherry-pick")
    assert picked.exit_code == 0 and f"Cherry-picked taskbridge/{second['id']}" in picked.stdout
    assert git(repo, "log", "-1", "--format=%s") == f"taskbridge {second['id']}"
    assert (repo / "a.txt").exists() and (repo / "b.txt").exists()
    both = cli("apply", first["id"], "--squash", "--cherry-pick")
    assert both.exit_code == 2 and "not both" in both.stderr


@pytest.mark.parametrize("first,then", [("--cherry-pick", "merge"), ("--squash", "merge"),
                                         ("--squash", "--cherry-pick"), ("--cherry-pick", "--squash")])
def test_a_task_applied_once_is_already_applied_in_any_other_mode(tmp_path, first, then):
    # A merge after a cherry-pick of the same task made an empty merge commit (found by a tester).
    repo = make_repo(tmp_path / "repo")
    done = finished_by_hand(repo, {"a.txt": "a\n"}, title="add a")
    assert cli("apply", done["id"], first).exit_code == 0
    head = git(repo, "rev-parse", "HEAD")
    again = cli("apply", done["id"], *(() if then == "merge" else (then,)), "--json")
    assert again.exit_code == 0, again.stderr
    answer = json.loads(again.stdout)
    assert answer["status"] == "already-applied" and answer["files"] == [] and answer["head"] == head
    assert git(repo, "rev-parse", "HEAD") == head and git(repo, "status", "--porcelain") == ""


@pytest.mark.parametrize("mode", ["merge", "--squash", "--cherry-pick"])
def test_applying_a_task_a_follow_up_went_on_from_applies_its_own_commit(tmp_path, mode):
    """`apply` of a task merged its follow-up's commits too (the follow-up commits on the same
    branch), saying "Merged taskbridge/t_0056 (<the follow-up's commit>)": a fresh tester's finding."""
    repo = make_repo(tmp_path / "repo")
    done = finished_by_hand(repo, {"a.txt": "a\n"}, title="add a")
    work = repo.parent / "follow-up"
    git(repo, "worktree", "add", "-q", str(work), done["branch"])
    (work / "later.txt").write_text("the follow-up's\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "the follow-up")
    git(repo, "worktree", "remove", "--force", str(work))
    said = cli("apply", done["id"], *(() if mode == "merge" else (mode,)))
    assert said.exit_code == 0, said.stderr
    assert done["result"]["commit"][:12] in said.stdout and "1 later commit(s), a follow-up's work" in said.stdout
    assert (repo / "a.txt").exists() and not (repo / "later.txt").exists()
    again = json.loads(cli("apply", done["id"], "--json").stdout)
    assert again["status"] == "already-applied" and again["later"] == 1 and again["tip"] == done["result"]["commit"]
    said = cli("apply", done["id"]).stdout   # said "the work of the branch is in" with later work left out
    assert f"Already applied: the work of {done['id']}" in said and "1 later commit(s)" in said


def test_apply_refusals_leave_the_checkout_alone(tmp_path):
    repo = make_repo(tmp_path / "repo")
    done = finished_by_hand(repo, {"a.txt": "a\n"})
    pending = task_store.submit_task(title="p", instructions="i", working_dir=str(repo))
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    in_place = task_store.submit_task(title="q", instructions="i", working_dir=str(plain_dir))
    claimed = task_store.claim_next("w", task_id=in_place["id"])
    task_store.complete_attempt(in_place["id"], claimed["run_marker"],
                                result={"summary": "ok", "isolation": "in-place"})   # as a worker's receipt says
    by_hand = task_store.submit_task(title="h", instructions="i", working_dir=str(repo))
    claimed = task_store.claim_next("cli:me", task_id=by_hand["id"])
    task_store.complete_attempt(by_hand["id"], claimed["run_marker"], result={"summary": "did it myself"})
    before = checkout_state(repo)
    said = cli("apply", pending["id"]).stderr
    assert "is pending, not done" in said and f"(`{tasks_cli.CLI} logs --follow {pending['id']}`)" in said
    assert "has no branch: it ran in place" in cli("apply", in_place["id"]).stderr
    assert "has no branch: it ran in place" in cli("branch", in_place["id"]).stderr
    for command in ("apply", "branch"):   # not "it ran in place": no worker ran it at all
        assert "has no branch: it was completed by hand" in cli(command, by_hand["id"]).stderr
    assert "has no diff" in cli("diff", pending["id"]).stderr
    git(repo, "checkout", "-q", "--detach")
    assert "detached HEAD" in cli("apply", done["id"]).stderr
    git(repo, "checkout", "-q", "main")
    git(repo, "checkout", "-q", f"taskbridge/{done['id']}")
    assert "on the task's own branch" in cli("apply", done["id"]).stderr
    git(repo, "checkout", "-q", "main")
    assert checkout_state(repo) == before
    git(repo, "branch", "-q", "-D", f"taskbridge/{done['id']}")
    gone = cli("apply", done["id"])
    assert gone.exit_code == 1 and "no longer exists" in gone.stderr
    assert checkout_state(repo) == before


# --------------------------------------------------------------------------------------------
# retry.


@pytest.mark.real_opencode
def test_retry_reruns_a_failed_task_to_done_with_a_note_and_a_fresh_budget(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("flaky", [http_error(400, "the scripted model is not ready yet")])
    task = task_store.submit_task(title="flaky", instructions="SCRIPT:flaky", working_dir=str(repo), max_retries=0)
    assert run_script("worker.py").returncode == 0
    failed = task_store.get_task(task["id"])
    assert failed["status"] == "failed" and "not ready yet" in failed["error"]

    opencode.model.script("flaky", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "second time lucky\n"}),
        text("Done.\n" + DONE),
    ])
    # It committed nothing: its empty branch was deleted (the receipt says so); its base is kept
    assert failed["branch"] is None and failed["result"]["branch_deleted"] == f"taskbridge/{task['id']}"
    assert failed["base_commit"] == git(repo, "rev-parse", "HEAD")
    assert not git(repo, "branch", "--list", f"taskbridge/{task['id']}")
    # The person fixes something on main meanwhile: the retry starts from there, on a branch of that name.
    (repo / "fix.txt").write_text("fixed\n")
    git(repo, "add", "fix.txt")
    git(repo, "commit", "-q", "-m", "fix")
    fixed = git(repo, "rev-parse", "HEAD")
    retried = cli("retry", task["id"], "--note", "Use the word lucky.")
    assert retried.exit_code == 0, retried.stderr
    assert f"{task['id']} is pending again with 1 fresh attempt(s)" in retried.stdout
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert done["attempts"] == 2 and done["run_marker"] == "br-1-a2"  # attempt numbers go on
    assert "second time lucky" in done["diff"] and "fix.txt" not in done["diff"]
    assert done["base_commit"] == fixed and done["branch"] == f"taskbridge/{task['id']}"
    assert git(repo, "merge-base", "--is-ancestor", fixed, done["branch"]) == ""
    prompt = json.dumps(opencode.model.requests_for("flaky")[-1])
    assert "Use the word lucky." in prompt
    kinds = [e["kind"] for e in done["events"]]
    assert kinds.index("retried") > kinds.index("failed") and kinds[-1] == "done"


def test_retry_store_rules_budget_dependents_and_refusals(tmp_path):
    first = task_store.submit_task(title="a", instructions="i", working_dir=str(tmp_path), max_retries=1)
    child = task_store.submit_task(title="b", instructions="i", working_dir=str(tmp_path), depends_on=[first["id"]])
    grandchild = task_store.submit_task(
        title="c", instructions="i", working_dir=str(tmp_path), depends_on=[child["id"]]
    )
    for _ in range(2):
        claimed = task_store.claim_next("w", task_id=first["id"])
        task_store.fail_attempt(first["id"], claimed["run_marker"], "broke")
        conn = task_store.connect()
        conn.execute("UPDATE tasks SET not_before = NULL")  # skip the back-off
        conn.close()
    assert task_store.get_task(first["id"])["status"] == "failed"
    assert task_store.get_task(grandchild["id"])["error"] == f"dependency {child['id']} failed"

    events = task_store.last_event_id()
    for bad in ({"model": "no-slash"}, {"note": "   "}, {"note": "x" * (task_store.NOTE_MAX + 1)}):
        with pytest.raises(task_store.ValidationError):
            task_store.retry_task(first["id"], **bad)
    assert task_store.last_event_id() == events and task_store.get_task(first["id"])["status"] == "failed"

    retried = task_store.retry_task(first["id"], model="fake/other", note="try harder", author="cli:me")
    assert retried["status"] == "pending" and retried["model"] == "fake/other"
    assert retried["requeued_dependents"] == [child["id"], grandchild["id"]]
    assert task_store.get_task(grandchild["id"])["status"] == "pending"
    assert [n["text"] for n in task_store.get_task(first["id"])["notes"]] == ["try harder"]
    # A fresh budget: it may fail once more and be requeued before it fails for good.
    claimed = task_store.claim_next("w", task_id=first["id"])
    assert claimed["run_marker"] == "br-1-a3"
    assert task_store.fail_attempt(first["id"], claimed["run_marker"], "again")["status"] == "pending"
    row = next(t for t in task_store.list_tasks()["tasks"] if t["id"] == first["id"])
    assert tasks_cli.tries_cell(row) == "1/2 +2"
    assert "attempt 3 (1 of 2 counted; not counted: 2 before a retry)" in \
        tasks_cli.attempts_text(task_store.get_task(first["id"]))

    with pytest.raises(task_store.InvalidTransition, match="not failed or cancelled"):
        task_store.retry_task(first["id"])
    done = task_store.submit_task(title="d", instructions="i", working_dir=str(tmp_path))
    claimed = task_store.claim_next("w", task_id=done["id"])
    task_store.complete_attempt(done["id"], claimed["run_marker"], result={"summary": "ok"})
    with pytest.raises(task_store.InvalidTransition, match="is done; only a failed or cancelled"):
        task_store.retry_task(done["id"])
    with pytest.raises(task_store.TaskNotFound):
        task_store.retry_task(99)
    cancelled = task_store.cancel_task(
        task_store.submit_task(title="e", instructions="i", working_dir=str(tmp_path))["id"]
    )
    assert task_store.retry_task(cancelled["id"])["status"] == "pending"
    refused = cli("retry", done["id"])
    assert refused.exit_code == 1 and "is done" in refused.stderr


# --------------------------------------------------------------------------------------------
# The MCP tools, through the SDK client in memory.


@pytest.mark.anyio
async def test_mcp_retry_task_and_apply_task(tmp_path, monkeypatch):
    from mcp import Client

    import opencode_bridge_mcp as bridge

    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token"))
    repo = make_repo(tmp_path / "repo")
    done = finished_by_hand(repo, {"a.txt": "a\n"}, title="add a")
    failing = task_store.submit_task(title="f", instructions="i", working_dir=str(repo), max_retries=0)
    claimed = task_store.claim_next("w", task_id=failing["id"])
    task_store.fail_attempt(failing["id"], claimed["run_marker"], "broke", retryable=False)

    async with Client(bridge.build_server()) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert tools["apply_task"].annotations.read_only_hint is False
        assert tools["retry_task"].annotations.destructive_hint is False
        assert set(tools["apply_task"].input_schema["properties"]) == {"task_id", "mode"}
        assert set(tools["retry_task"].input_schema["properties"]) == {"task_id", "model", "note"}

        before = checkout_state(repo)
        (repo / "README.md").write_text("dirty\n")
        assert "uncommitted changes (README.md)" in await tool_error(c, "apply_task", {"task_id": done["id"]})
        git(repo, "checkout", "README.md")
        assert checkout_state(repo) == before
        assert "mode must be one of" in await tool_error(c, "apply_task", {"task_id": done["id"], "mode": "rebase"})
        # The way out in the tool's words (it said "retry it (tasks_cli.py retry t_0002)"); the CLI's
        # apply names its own retry command.
        refused = await tool_error(c, "apply_task", {"task_id": failing["id"]})
        assert f"is failed, not done; only a done task's work can be applied: retry it (retry_task {failing['id']}) " \
               "and apply once it is done" in refused and "tasks_cli" not in refused
        assert f"retry it (`{tasks_cli.CLI} retry {failing['id']}`)" in cli("apply", failing["id"]).stderr
        pending = task_store.submit_task(title="p", instructions="i", working_dir=str(repo))
        refused = await tool_error(c, "apply_task", {"task_id": pending["id"]})
        assert f"wait until it is done (wait_for {pending['id']})" in refused and "tasks_cli" not in refused
        task_store.cancel_task(pending["id"])
        assert checkout_state(repo) == before

        result = await call_tool(c, "apply_task", {"task_id": done["id"], "mode": "squash"})
        assert result["status"] == "applied" and result["files"] == ["a.txt"]
        assert result["head"] == git(repo, "rev-parse", "HEAD") and result["before"] == before[0]

        retried = await call_tool(c, "retry_task", {"task_id": failing["id"], "note": "look again"})
        assert retried["status"] == "pending" and retried["requeued_dependents"] == []
        twice = await tool_error(c, "retry_task", {"task_id": failing["id"]})
        assert "is pending, not failed or cancelled" in twice
        assert "t_0099 not found" in await tool_error(c, "retry_task", {"task_id": "t_0099"})
        await tool_error(c, "retry_task", {"task_id": failing["id"], "budget": 3})


def test_logs_follow_renders_events_as_they_come_and_says_why_there_is_no_log(tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    task = task_store.submit_task(title="f", instructions="i", working_dir=str(tmp_path))
    claimed = task_store.claim_next("worker@host", task_id=task["id"])
    # through the store, as the worker's log reaches readers: the file on SQLite, the database on PostgreSQL
    task_store.append_task_log(task["id"], b"=== br-1-a1 2026-01-01T00:00:00+00:00 cwd=/w\n")
    tool = json.dumps({"type": "tool_use", "part": {"tool": "bash", "state": {
        "status": "completed", "title": "make test", "input": {"command": "make test"},
        "output": "ok\n", "metadata": {"exit": 0}}}})
    said = json.dumps({"type": "text", "part": {"text": "All green."}})

    def agent() -> None:
        for piece in (tool[:40], tool[40:] + "\n", said + "\n"):
            time.sleep(0.1)
            task_store.append_task_log(task["id"], piece.encode())
        time.sleep(0.1)
        task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok"})

    thread = threading.Thread(target=agent)
    thread.start()
    followed = cli("logs", task["id"], "--follow")
    thread.join()
    assert followed.stdout.splitlines() == [
        "── attempt br-1-a1 started 2026-01-01T00:00:00+00:00 in /w", "| bash     make test", "  ok", "All green."]
    assert "t_0001 is done; log ends" in followed.stderr
    # A pending task: the person is told no worker has run it yet, and the follow waits for one.
    waiting = task_store.submit_task(title="w", instructions="i", working_dir=str(tmp_path))
    later = threading.Timer(0.3, task_store.cancel_task, args=(waiting["id"],))
    later.start()
    pending = cli("logs", waiting["id"], "--follow")
    later.join()
    assert "is pending: no worker has run it yet, so it has no log; waiting for a worker to start it" \
        in " ".join(pending.stderr.split())
    assert "t_0002 is cancelled; log ends" in pending.stderr

    by_hand = task_store.submit_task(title="h", instructions="i", working_dir=str(tmp_path))
    task_store.claim_next("cli:alice", task_id=by_hand["id"])
    hand = cli("logs", by_hand["id"], "--follow")
    assert hand.exit_code == 0 and "claimed by hand by cli:alice: no worker runs it" in hand.stderr


def test_apply_stopped_by_an_untracked_file_or_a_staged_rename_changes_nothing(tmp_path):
    repo = make_repo(tmp_path / "repo", {"README.md": "# demo\n", "old.txt": "o\n"})
    task = finished_by_hand(repo, {"a.txt": "from the task\n"})
    (repo / "a.txt").write_text("the person's own, never added\n")
    before = checkout_state(repo)
    for args in ((), ("--squash",), ("--cherry-pick",)):
        stopped = cli("apply", task["id"], *args)
        assert stopped.exit_code == 1 and "untracked working tree files would be overwritten" in stopped.stderr
        assert "the checkout is as it was" in stopped.stderr and checkout_state(repo) == before
    (repo / "a.txt").unlink()
    git(repo, "mv", "old.txt", "new name.txt")
    staged = cli("apply", task["id"])
    assert staged.exit_code == 1 and "uncommitted changes (new name.txt)" in staged.stderr


def test_applies_into_one_checkout_at_once_all_land(tmp_path):
    """Several applies into one checkout at the same moment (each MCP server or CLI is a process
    of its own; here threads, each with a lock descriptor of its own): each waits for the one
    before, so every task's commit is in the checkout's history and each says applied."""
    import threading

    import worktrees
    repo = make_repo(tmp_path / "repo")
    tasks = [finished_by_hand(repo, {f"f{n}.txt": f"{n}\n"}, title=f"add f{n}") for n in range(4)]
    results: dict[str, object] = {}

    def apply(task: dict, mode: str) -> None:
        try:
            results[task["id"]] = worktrees.apply_branch(task_store.get_task(task["id"]), mode)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[task["id"]] = exc
    threads = [threading.Thread(target=apply, args=(task, mode))
               for task, mode in zip(tasks, ["merge", "squash", "cherry-pick", "merge"], strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(isinstance(r, dict) and r["status"] == "applied" for r in results.values()), results
    assert all((repo / f"f{n}.txt").exists() for n in range(4))
    assert git(repo, "status", "--porcelain") == ""
    heads = [r["head"] for r in results.values()]   # each apply's head is in the final history
    for head in heads:
        git(repo, "merge-base", "--is-ancestor", head, "HEAD")   # raises when it is not


def test_an_apply_waits_for_one_under_way_and_says_so_when_it_takes_too_long(tmp_path, monkeypatch):
    import fcntl
    import os

    import worktrees
    repo = make_repo(tmp_path / "repo")
    task = finished_by_hand(repo, {"a.txt": "a\n"})
    monkeypatch.setattr(worktrees, "APPLY_LOCK_WAIT_SEC", 0.5)
    lock = os.open(repo / ".git" / "taskbridge-apply.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)   # another apply under way
    try:
        with pytest.raises(worktrees.ApplyRefused, match="another apply into .* is under way"):
            worktrees.apply_branch(task_store.get_task(task["id"]))
        assert not (repo / "a.txt").exists()
    finally:
        os.close(lock)
    assert worktrees.apply_branch(task_store.get_task(task["id"]))["status"] == "applied"
