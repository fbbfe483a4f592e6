"""A task whose run changed nothing leaves no empty branch (issue 24, section 6), with the real
`opencode`, the scripted model and real git repositories: its branch is deleted with its
worktree and the receipt, `branch`, `apply` and the MCP tools say "no change, nothing to apply";
a follow-up or fork of it starts from its base commit and commits; a task with changes, a
no-change follow-up on its parent's branch and a task that keeps its worktree keep their branch."""
from __future__ import annotations

import json

import anyio
import pytest
from click.testing import CliRunner

import task_store
import tasks_cli
from fake_openai import text, tool_call
from helpers import call_tool, checkout_state, git, make_repo, run_script, tool_error

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)


def _receipt(summary: str) -> str:
    return "```json\n" + json.dumps({"summary": summary, "files_touched": [], "tests_run": [],
                                     "open_questions": []}) + "\n```"


def _look() -> list:
    """An agent step that changes no file: a bash call, then the receipt."""
    return [
        tool_call("bash", {"command": "echo looked", "description": "look"}),
        text("Looked.\n" + _receipt("looked")),
    ]


def _write(name: str) -> list:
    return [
        tool_call("write", {"filePath": "{cwd}/" + name, "content": f"{name}\n"}),
        text("Wrote.\n" + _receipt(name)),
    ]


def _task_branches(repo) -> list[str]:
    return git(repo, "branch", "--list", "--format=%(refname:short)", "taskbridge/*").split()


def cli(*args: str):
    result = CliRunner().invoke(tasks_cli.cli, list(args), catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


def test_no_change_leaves_no_branch_and_says_nothing_to_apply(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("idle", _look())
    opencode.model.script("work", [*_write("lib.py"), *_look()])
    opencode.model.script("kept", _look())
    idle = task_store.submit_task(title="idle", instructions="SCRIPT:idle", working_dir=str(repo))
    work = task_store.submit_task(title="work", instructions="SCRIPT:work", working_dir=str(repo))
    after = task_store.submit_task(title="look again", instructions="Look again.", continue_from=work["id"])
    kept = task_store.submit_task(title="kept", instructions="SCRIPT:kept", working_dir=str(repo), worktree_keep=True)
    assert run_script("worker.py").returncode == 0
    idle, work, after, kept = (task_store.get_task(t["id"]) for t in (idle, work, after, kept))
    assert [t["status"] for t in (idle, work, after, kept)] == ["done"] * 4, [
        t["error"] for t in (idle, work, after, kept)
    ]

    assert idle["branch"] is None and idle["result"]["branch"] is None
    assert idle["result"]["no_change"] is True and idle["result"]["branch_deleted"] == f"taskbridge/{idle['id']}"
    assert idle["result"]["worktree_removed"] is True and idle["base_commit"] == git(repo, "rev-parse", "main")
    # Kept: the branch with a commit, the parent's branch under a no-change follow-up, a kept worktree's.
    assert sorted(_task_branches(repo)) == sorted([work["branch"], kept["branch"]])
    assert work["result"]["no_change"] is False and git(repo, "rev-parse", work["branch"]) == work["result"]["commit"]
    assert after["branch"] == work["branch"] and after["result"]["no_change"] is True
    assert "branch_deleted" not in after["result"]
    assert kept["result"]["no_change"] is True and kept["branch"] == f"taskbridge/{kept['id']}"

    before = checkout_state(repo)
    for command in ("branch", "apply"):
        said = cli(command, idle["id"])
        assert said.exit_code == 1, said.output
        assert f"task {idle['id']} made no change, nothing to apply (its empty branch taskbridge/{idle['id']} " \
               "was deleted)" in said.stderr
    assert "made no change, nothing to apply (nothing was committed on" in cli("apply", kept["id"]).stderr
    assert checkout_state(repo) == before
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token"))
    anyio.run(_mcp_says_nothing_to_apply, idle["id"])
    assert checkout_state(repo) == before


async def _mcp_says_nothing_to_apply(ident: str) -> None:
    from mcp import Client

    import opencode_bridge_mcp as bridge

    async with Client(bridge.build_server()) as c:
        result = await call_tool(c, "get_task_result", {"task_id": ident})
        assert result["branch"] is None and result["result"]["no_change"] is True
        assert result["hint"].startswith(f"task {ident} made no change, nothing to apply")
        assert "made no change, nothing to apply" in await tool_error(c, "apply_task", {"task_id": ident})


def test_follow_up_and_fork_of_a_no_change_task_start_from_its_base(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    # One script for the line (a step per assistant turn in the session): the follow-up runs first
    # and resumes the first task's session; the fork then copies it with the follow-up's turns.
    opencode.model.script("line", [*_look(), *_write("lib.py"), *_write("lib.py")])
    first = task_store.submit_task(title="look", instructions="Look. SCRIPT:line", working_dir=str(repo))
    follow = task_store.submit_task(title="write", instructions="Now write lib.py.", continue_from=first["id"])
    fork = task_store.submit_task(title="fork", instructions="Write lib.py your way.", fork_from=first["id"])
    assert run_script("worker.py").returncode == 0
    one, two, three = (task_store.get_task(t["id"]) for t in (first, follow, fork))
    assert [t["status"] for t in (one, two, three)] == ["done"] * 3, [t["error"] for t in (one, two, three)]

    assert one["branch"] is None
    assert two["session_id"] == one["session_id"], "the follow-up resumed the same OpenCode session"
    for task in (two, three):
        assert task["branch"] == f"taskbridge/{task['id']}", "a branch of its own"
        assert git(repo, "rev-parse", f"{task['result']['commit']}^") == one["base_commit"], \
            "it starts from the no-change task's base commit"
        assert git(repo, "show", f"{task['branch']}:lib.py") == "lib.py"
        assert task["result"]["line"]["base_commit"] == one["base_commit"]
        assert task["result"]["line"]["files"] == ["lib.py"]
    assert sorted(_task_branches(repo)) == sorted([two["branch"], three["branch"]])
    assert str(tmp_path / "worktrees") not in git(repo, "worktree", "list")


def test_a_cancelled_or_failed_task_that_committed_nothing_leaves_no_branch(opencode, tmp_path, monkeypatch):
    """A fresh user's finding: a cancelled task left its empty branch in the repository. A task
    cancelled while it runs, or failed for good, that committed nothing loses its branch as a done
    task that changed nothing does (the row and receipt say branch_deleted); a cancelled follow-up
    leaves its parent's branch, which holds work, as it was."""
    import subprocess
    import sys

    from fake_openai import hang
    from helpers import ROOT, until

    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("work", [*_write("lib.py"), hang()])
    opencode.model.script("hangs", [hang()])
    parent = task_store.submit_task(title="work", instructions="SCRIPT:work", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    parent = task_store.get_task(parent["id"])
    assert parent["status"] == "done" and parent["result"]["commit"], parent["error"]

    follow = task_store.submit_task(title="more", instructions="More.", continue_from=parent["id"])
    cancelled = task_store.submit_task(title="c", instructions="SCRIPT:hangs", working_dir=str(repo))
    failed = task_store.submit_task(title="f", instructions="SCRIPT:hangs", working_dir=str(repo), timeout_sec=5,
                                    max_retries=0)
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for task in (follow, cancelled):
        until(lambda t=task: (row := task_store.get_task(t["id"]))["status"] == "running" and row["agent_pid"],
              timeout=90, what=f"{task['id']}'s agent")
        task_store.cancel_task(task["id"])
    said = " ".join(proc.communicate(timeout=120)[0].split())
    follow, cancelled, failed = (task_store.get_task(t["id"]) for t in (follow, cancelled, failed))
    assert [follow["status"], cancelled["status"], failed["status"]] == ["cancelled", "cancelled", "failed"], said

    for task in (cancelled, failed):
        assert task["branch"] is None, task
        assert task["result"], (said, task["events"])
        assert task["result"]["branch_deleted"] == f"taskbridge/{task['id']}" and task["result"]["branch"] is None
        assert any(e["kind"] == "branch" and "was deleted" in e["message"] for e in task["events"]), task["events"]
    assert "timed out" in failed["error"]
    assert f"the task was cancelled; its run was ended; it committed nothing: its empty branch " \
           f"taskbridge/{cancelled['id']} was deleted" in said, said
    # the parent's branch, with its commit, stays under its cancelled follow-up
    assert follow["branch"] == parent["branch"] and "branch_deleted" not in (follow["result"] or {})
    assert _task_branches(repo) == [parent["branch"]]
    assert git(repo, "rev-parse", parent["branch"]) == parent["result"]["commit"]
    assert str(tmp_path / "worktrees") not in git(repo, "worktree", "list")
    for task in (cancelled, failed):
        refused = cli("branch", task["id"])
        assert refused.exit_code == 1 and "committed nothing, so its empty branch" in " ".join(refused.stderr.split())
