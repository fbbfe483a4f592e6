"""The main job end to end with the real `opencode` binary and a scripted model on 127.0.0.1."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import task_store
from fake_openai import hang, http_error, text, tool_call
from helpers import checkout_state, git, make_repo, run_script, step_finish_sums, tagged

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "Wrote hello.txt and ran it", "files_touched": ["hello.txt"], ' \
          '"tests_run": ["cat hello.txt"], "open_questions": []}\n```'


def test_cli_submit_worker_pass_receipt(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    before = checkout_state(repo)
    opencode.model.script("write-run", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello from the agent\n"}),
        tool_call("bash", {"command": "cat hello.txt && echo ran-the-check", "description": "check"}),
        text("All done.\n" + RECEIPT),
    ])
    submitted = run_script("tasks_cli.py", "submit", "Write hello", "--dir", str(repo),
                           "--instructions", "Create hello.txt. SCRIPT:write-run", "--json")
    assert submitted.returncode == 0, submitted.stderr
    task_id = json.loads(submitted.stdout)["id"]

    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr

    task = task_store.get_task(task_id)
    assert task["status"] == "done", task["error"]
    receipt = task["result"]
    assert receipt["files_touched"] == ["hello.txt"]
    assert "hello from the agent" in task["diff"] and "hello.txt" in task["diff"]
    assert any("ran-the-check" in c["command"] and c["exit"] == 0 for c in receipt["commands"])
    assert receipt["summary"] == "Wrote hello.txt and ran it"
    assert receipt["tests_run"] == ["cat hello.txt"]

    log_text = task_store.log_path(task_id).read_text()
    assert '"type":"step_finish"' in log_text.replace(" ", "")
    sums = step_finish_sums(log_text)
    tokens = task["usage"]["tokens"]
    assert sums["input"] > 0 and tokens["input"] == sums["input"]
    assert tokens["output"] == sums["output"] and tokens["cache_read"] == sums["cache_read"]
    assert task["usage"]["cost_usd"] == pytest.approx(sums["cost"]) and sums["cost"] > 0
    assert task["usage"]["steps"] == 3

    branch = f"taskbridge/{task_id}"
    assert git(repo, "log", "-1", "--format=%s", branch).startswith(f"taskbridge {task_id}")
    assert git(repo, "show", f"{branch}:hello.txt") == "hello from the agent"
    assert receipt["commit"] == git(repo, "rev-parse", branch)
    assert not (tmp_path / "worktrees").exists() or not any((tmp_path / "worktrees").iterdir())
    assert str(tmp_path / "worktrees") not in git(repo, "worktree", "list")
    assert checkout_state(repo) == before
    assert tagged() == []


def test_model_http_500_fails_with_model_error(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script(
        "boom", [http_error(500, "the scripted model is down: quota gone", headers={"retry-after-ms": "50"})]
    )
    task = task_store.submit_task(title="boom", instructions="SCRIPT:boom", working_dir=str(repo),
                                  max_retries=0)
    assert run_script("worker.py").returncode == 0
    task = task_store.get_task(task["id"])
    assert task["status"] == "failed"
    assert "quota gone" in task["error"] and task["error"].startswith("model error")


def test_a_provider_refusing_the_request_itself_is_not_retried(opencode, tmp_path):
    """HTTP 400 meets the same request again on a retry: the task fails at its first attempt
    with its retry unspent, and says why."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("bad", [http_error(400, "the scripted model refuses these tools")])
    task = task_store.submit_task(title="bad", instructions="SCRIPT:bad", working_dir=str(repo), max_retries=1)
    assert run_script("worker.py").returncode == 0
    task = task_store.get_task(task["id"])
    assert task["status"] == "failed" and task["attempts"] == 1, (task["status"], task["error"])
    assert "refuses these tools" in task["error"] and "not retried" in task["error"] and "HTTP 400" in task["error"]
    assert len(opencode.model.step_requests("bad")) == 1


def test_silent_model_killed_at_timeout_then_retried_with_full_budget(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("silent", [hang()])
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    task = task_store.submit_task(title="silent", instructions="SCRIPT:silent", working_dir=str(repo),
                                  timeout_sec=30, max_retries=1)   # OpenCode's first request can take 15 s here
    started = time.monotonic()
    result = run_script("worker.py", "--max-tasks", "1")
    first = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    mid = task_store.get_task(task["id"])
    assert mid["status"] == "pending" and "timed out after 30 s" in mid["error"]
    assert tagged() == []
    time.sleep(2.1)  # the store's back-off before the retry
    started = time.monotonic()
    assert run_script("worker.py").returncode == 0
    second = time.monotonic() - started
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed" and final["attempts"] == 2
    assert "timed out after 30 s" in final["error"]
    assert second >= 30 and first >= 30, "each attempt gets the full timeout"
    assert tagged() == []
    assert len(opencode.model.requests_for("silent")) == 2


def test_a_folder_with_a_percent_in_its_path_gets_a_worktree_without_one_or_a_clear_refusal(opencode, tmp_path):
    """OpenCode reads a '%' in its folder's path as an escape ("my%20repo" as "my repo"), so every
    run there failed with a bare ENOENT and a retry was offered. A worktree's folder is now named
    without it (the task is done); a run in place there fails at once, saying why and what to do."""
    repo = make_repo(tmp_path / "my%20repo")
    opencode.model.script("pct", [tool_call("write", {"filePath": "{cwd}/a.txt", "content": "x\n"}),
                                  text("Fine.\n" + RECEIPT)])
    task = task_store.submit_task(title="pct", instructions="SCRIPT:pct", working_dir=str(repo))
    in_place = task_store.submit_task(title="here", instructions="SCRIPT:pct", working_dir=str(repo),
                                      worktree=False, max_retries=2)
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert "%" not in done["worktree_path"] and done["result"]["files_touched"] == ["a.txt"]
    assert git(repo, "show", f"{done['result']['commit']}:a.txt") == "x"
    refused = task_store.get_task(in_place["id"])
    assert refused["status"] == "failed" and refused["attempts"] == 1, refused
    assert "reads a '%' in a folder's path as an escape" in refused["error"] and "rename the folder" in refused["error"]
    assert not (repo / "a.txt").exists()


def test_in_place_the_receipt_counts_from_the_uncommitted_work_the_attempt_began_with(opencode, tmp_path):
    """A task in place (worktree=false) in a checkout with the person's uncommitted work: its
    receipt and diff show what the attempt changed, not the person's work-in-progress, which it
    names (uncommitted_before); the files are left as the agent left them."""
    repo = make_repo(tmp_path / "repo", {"a.txt": "committed\n", "b.txt": "b\n"})
    (repo / "a.txt").write_text("user wip\n")
    (repo / "wip.txt").write_text("the person's new file\n")
    opencode.model.script("here", [tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hi\n"}),
                                   tool_call("write", {"filePath": "{cwd}/a.txt", "content": "agent\n"}),
                                   text("Fine.\n" + RECEIPT)])
    task = task_store.submit_task(title="here", instructions="SCRIPT:here", working_dir=str(repo), worktree=False)
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    receipt = done["result"]
    assert receipt["files_touched"] == ["a.txt", "hello.txt"], receipt["files_touched"]
    assert receipt["uncommitted_before"] == ["a.txt", "wip.txt"]
    assert "uncommitted changes when this attempt began (a.txt, wip.txt)" in receipt["sandbox"]["isolation"]
    diff = done["diff"]
    assert "-user wip" in diff and "+agent" in diff and "the person's new file" not in diff and "committed" not in diff
    assert (repo / "wip.txt").read_text() == "the person's new file\n" and (repo / "a.txt").read_text() == "agent\n"
    assert git(repo, "diff", "--cached", "--name-only") == ""   # the person's index untouched
    assert git(repo, "diff", "--name-only") == "a.txt"
    assert git(repo, "ls-files", "--others", "--exclude-standard").splitlines() == ["hello.txt", "wip.txt"]


def test_in_place_receipts_list_what_the_run_changed_by_observation_with_true_sandbox_words(opencode, tmp_path):
    """A fresh user's finding: an in-place run outside git listed only what the agent's write tool
    wrote, by absolute path (a file a shell command made or changed was missing), and its
    sandbox words spoke of a worktree and a repository. Its files_touched is what differs in the
    folder after the run (relative to it), as git's view is in a checkout; a run that changed
    nothing says no change; the box's words name the folder it wrote, in place."""
    from click.testing import CliRunner

    import tasks_cli

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("a\n")
    (plain / "gone.txt").write_text("old\n")
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("here", [
        tool_call("bash", {"command": "echo hi > shell.txt && echo more >> a.txt && rm gone.txt", "description": "sh"}),
        tool_call("write", {"filePath": "{cwd}/w.txt", "content": "w\n"}), text("Fine.\n" + RECEIPT)])
    opencode.model.script("idle", [text("Nothing to do.\n" + RECEIPT)])
    outside = task_store.submit_task(title="here", instructions="SCRIPT:here", working_dir=str(plain), worktree=False)
    idle = task_store.submit_task(title="idle", instructions="SCRIPT:idle", working_dir=str(plain), worktree=False)
    inside = task_store.submit_task(title="here", instructions="SCRIPT:here", working_dir=str(repo), worktree=False)
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    outside, idle, inside = (task_store.get_task(t["id"]) for t in (outside, idle, inside))
    assert [t["status"] for t in (outside, idle, inside)] == ["done"] * 3, [t["error"] for t in (outside, idle, inside)]

    receipt = outside["result"]
    assert receipt["files_touched"] == ["a.txt", "gone.txt", "shell.txt", "w.txt"], receipt["files_touched"]
    assert receipt["no_change"] is False and not outside["diff"]
    assert idle["result"]["files_touched"] == [] and idle["result"]["no_change"] is True
    assert inside["result"]["files_touched"] == ["a.txt", "shell.txt", "w.txt"], inside["result"]["files_touched"]
    for task, place in ((outside, f"its folder {plain} (in place"), (inside, f"your checkout {repo} (in place")):
        sandbox = task["result"]["sandbox"]
        assert place in sandbox["files"] and "worktree" not in sandbox["files"], sandbox
    assert "repository" not in outside["result"]["sandbox"]["files"], outside["result"]["sandbox"]
    assert outside["result"]["sandbox"]["git config"] == "not a git repository: TaskBridge runs no git here"
    shown = " ".join(CliRunner().invoke(tasks_cli.cli, ["diff", outside["id"]]).stderr.split())
    assert "files it changed: a.txt, gone.txt, shell.txt, w.txt" in shown, shown


def test_a_working_dir_that_became_a_link_into_opencodes_data_is_refused_when_the_task_runs(opencode, tmp_path):
    """submit checked the folder; the worker checks it again at the run, in its own environment:
    a folder swapped for a link into OpenCode's data folder meanwhile fails the task, untouched."""
    project = tmp_path / "project"
    project.mkdir()
    opencode.model.script("intrude", [tool_call("write", {"filePath": "{cwd}/intruder.txt", "content": "x\n"}),
                                      text("Fine.\n" + RECEIPT)])
    task = task_store.submit_task(title="swap", instructions="SCRIPT:intrude", working_dir=str(project),
                                  worktree=False, max_retries=0)
    project.rmdir()
    data = Path(opencode.env["XDG_DATA_HOME"]) / "opencode"
    project.symlink_to(data)
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    failed = task_store.get_task(task["id"])
    assert failed["status"] == "failed" and "OpenCode's data folder" in failed["error"], failed["error"]
    assert "checked again when the task ran" in failed["error"]
    assert not (data / "intruder.txt").exists()


def test_in_place_uncommitted_work_is_named_whole_renames_and_at_most_200_paths(opencode, tmp_path):
    """A staged rename names both its paths; thousands of untracked files do not swell the receipt:
    200 paths, then how many more."""
    repo = make_repo(tmp_path / "repo", {"d.txt": "d\n"})
    git(repo, "mv", "d.txt", "e.txt")
    (repo / "many").mkdir()
    for n in range(250):
        (repo / "many" / f"f{n:03d}.txt").write_text(f"{n}\n")
    opencode.model.script("here", [text("Fine.\n" + RECEIPT)])
    task = task_store.submit_task(title="here", instructions="SCRIPT:here", working_dir=str(repo), worktree=False)
    assert run_script("worker.py").returncode == 0
    receipt = task_store.get_task(task["id"])["result"]
    named = receipt["uncommitted_before"]
    assert len(named) == 201 and named[-1].startswith("… and 52 more"), named[-3:]
    assert named[:2] == ["d.txt", "e.txt"] and receipt["files_touched"] == []
