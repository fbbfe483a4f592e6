"""Questions, notes and permissions with the real `opencode` and the scripted model."""
from __future__ import annotations

import json

import pytest

import task_store
from fake_openai import text, tool_call
from helpers import checkout_state, git, make_repo, run_script

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
DONE = '```json\n{"summary": "used port 8080", "files_touched": ["port.txt"], "tests_run": [], ' \
       '"open_questions": []}\n```'


def _messages_text(request) -> str:
    return json.dumps(request["json"]["messages"])


def test_question_waits_then_answer_resumes_same_session(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ask", [
        text("I need to know one thing.\n```question\nWhich port should the server use?\n```"),
        tool_call("write", {"filePath": "{cwd}/port.txt", "content": "8080\n"}),
        text("Done.\n" + DONE),
    ])
    task = task_store.submit_task(title="port", instructions="Pick the port. SCRIPT:ask",
                                  working_dir=str(repo))
    task_store.add_note(task["id"], "prefer well-known ports")
    assert run_script("worker.py").returncode == 0
    waiting = task_store.get_task(task["id"])
    assert waiting["status"] == "waiting", waiting["error"]
    assert waiting["question"] == "Which port should the server use?"
    assert waiting["worktree_path"] and waiting["session_id"]
    first_request = opencode.model.requests_for("ask")[0]
    assert "prefer well-known ports" in _messages_text(first_request)

    task_store.answer_task(task["id"], "Use 8080, the answer-token-42")
    task_store.add_note(task["id"], "note-after-the-question")
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    resumed = [r for r in opencode.model.requests_for("ask") if r["step"] == 1][0]
    body = _messages_text(resumed)
    assert "Which port should the server use?" in body, "the session kept the agent's own question"
    assert "answer-token-42" in body and "note-after-the-question" in body
    assert done["session_id"] == waiting["session_id"]
    receipt = done["result"]
    assert receipt["session"].startswith("resumed OpenCode session")
    assert receipt["questions"][0]["question"] == "Which port should the server use?"
    assert "answer-token-42" in receipt["questions"][0]["answer"]
    assert [n["text"] for n in receipt["notes"]] == ["prefer well-known ports", "note-after-the-question"]
    assert receipt["files_touched"] == ["port.txt"]
    assert git(repo, "show", f"taskbridge/{task['id']}:port.txt") == "8080"


def test_lost_session_falls_back_to_new_session_with_history(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ask2", [
        text("```question\nTabs or spaces?\n```"),
        text("Done.\n" + DONE),
    ])
    task = task_store.submit_task(title="style", instructions="SCRIPT:ask2", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    task_store.answer_task(task["id"], "spaces-please")
    # A new session starts at step 0 again: this time the model has the answer in its prompt.
    opencode.model.script("ask2", [text("Done.\n" + DONE)])
    # The session is gone (OpenCode's data wiped): the resume must fall back, not fail.
    conn = task_store.connect()
    conn.execute("UPDATE tasks SET session_id = 'ses_doesnotexist' WHERE id = 1")
    conn.close()
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert "earlier OpenCode session was gone" in done["result"]["session"]
    last = opencode.model.requests_for("ask2")[-1]
    assert "Tabs or spaces?" in _messages_text(last) and "spaces-please" in _messages_text(last)


def test_readonly_denies_writes_and_reverts_shell_writes(opencode, tmp_path, monkeypatch):
    """The layers behind the box (test_agent_box has it boxed): with no box and prompt-level
    allowed, the pinned edit deny holds and shell writes are reverted or reported."""
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")
    monkeypatch.setenv("TASKBRIDGE_ALLOW_PROMPT_LEVEL", "1")
    repo = make_repo(tmp_path / "repo")
    (repo / "opencode.json").write_text(json.dumps({"permission": "allow"}))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "permissive project config")
    before = checkout_state(repo)
    opencode.model.script("ro", [
        tool_call("write", {"filePath": "{cwd}/blocked.txt", "content": "should not exist"}),
        tool_call("bash", {"command": f"echo sneaky > via_shell.txt; echo escaped > {repo}/escaped.txt",
                           "description": "write via shell, inside and outside the worktree"}),
        text("Tried.\n" + DONE),
    ])
    task = task_store.submit_task(title="ro", instructions="SCRIPT:ro", working_dir=str(repo),
                                  permission="readonly", worktree_keep=True)
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    receipt = done["result"]
    assert done["status"] == "done", done["error"]
    assert [c["tool"] for c in receipt["tool_errors"] if c["status"] == "denied"] == ["write"]
    assert receipt["files_reverted"] == ["via_shell.txt"]
    assert receipt["files_touched"] == [] and done["diff"] == ""
    assert "enforced" in receipt["sandbox"]["file writes"]
    assert not (tmp_path / "worktrees" / f"repo-{task['id']}" / "blocked.txt").exists()
    assert not (tmp_path / "worktrees" / f"repo-{task['id']}" / "via_shell.txt").exists()
    # Nothing stops the shell writing into the user's checkout: the receipt must say so.
    assert receipt["changed_outside_worktree"] == ["escaped.txt"]
    assert "elsewhere: not prevented" in receipt["sandbox"]["shell writes"]
    (repo / "escaped.txt").unlink()
    assert checkout_state(repo) == before


def test_no_shell_refuses_bash_even_with_permissive_repo_config(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo", {"opencode.json": json.dumps({"permission": {"bash": "allow"}})})
    opencode.model.script("nosh", [
        tool_call("bash", {"command": "echo shell-ran > shell.txt", "description": "try"}),
        text("Tried.\n" + DONE),
    ])
    task = task_store.submit_task(title="nosh", instructions="SCRIPT:nosh", working_dir=str(repo),
                                  permission="no-shell")
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    receipt = done["result"]
    assert done["status"] == "done", done["error"]
    assert receipt["commands"] == []
    assert [c["tool"] for c in receipt["tool_errors"]] == ["bash"]
    assert "shell.txt" not in receipt["files_touched"]
    assert receipt["sandbox"]["shell"].startswith("enforced")
