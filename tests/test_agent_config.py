"""The user's and the repository's OpenCode configs cannot loosen a task's rules, share its
session or hide what they changed (issue 8 §4, §5), with the real opencode and a scripted model."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import opencode_runner as oc
import task_store
from fake_openai import text, tool_call
from helpers import git, make_repo, run_script, run_task

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
DONE = '```json\n{"summary": "tried", "files_touched": [], "tests_run": [], "open_questions": []}\n```'
# A user agent whose own permission block allows everything, with bash named before "*" (so a
# plain {"bash": "deny"} merged into it would stay before the "*": "allow" that wins).
REVIEWER = {"description": "reviews code", "mode": "primary",
            "permission": {"bash": "allow", "edit": "allow", "*": "allow"}}


def user_config(opencode, config: dict) -> None:
    """The user's global OpenCode config ($XDG_CONFIG_HOME/opencode/opencode.json)."""
    (Path(opencode.env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json").write_text(json.dumps(config))


def tool_names(request) -> set[str]:
    return {t["function"]["name"] for t in request["json"].get("tools") or []}


@pytest.mark.parametrize("permission,denied", [("no-shell", "bash"), ("readonly", "write")])
def test_restriction_holds_for_a_permissive_user_agent(opencode, tmp_path, permission, denied):
    user_config(opencode, {"agent": {"reviewer": REVIEWER, "helper": {**REVIEWER, "mode": "subagent"}}})
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("rev", [
        tool_call("bash", {"command": "echo shell-ran > shell.txt", "description": "try"}),
        tool_call("write", {"filePath": "{cwd}/written.txt", "content": "x"}),
        text("Tried.\n" + DONE),
    ])
    done = run_task("rev", str(repo), permission=permission, agent="reviewer")
    assert done["status"] == "done", done["error"]
    receipt = done["result"]
    sent = opencode.model.step_requests("rev")
    assert sent and all(denied not in tool_names(r) for r in sent), "the tool reached the model"
    assert denied in {c["tool"] for c in receipt["tool_errors"]}
    if denied == "bash":
        assert receipt["commands"] == [] and "shell.txt" not in done["diff"]
        assert receipt["sandbox"]["shell"].startswith("enforced")
    else:
        assert "written.txt" not in done["diff"]
        assert receipt["sandbox"]["file writes"].startswith("enforced")


def test_pins_reach_every_agent_of_the_resolved_config(opencode, tmp_path):
    user_config(opencode, {"agent": {"reviewer": REVIEWER,
                                     "odd": {"permission": {"bash": "allow", "bas?": "allow", "*": "allow"}}}})
    agents = Path(opencode.env["XDG_CONFIG_HOME"]) / "opencode" / "agent"
    agents.mkdir()
    (agents / "mdrev.md").write_text("---\ndescription: a markdown agent\npermission:\n  bash: allow\n"
                                     "  \"*\": allow\n---\nYou review.\n")
    env = oc.run_env(dict(opencode.env), str(tmp_path), "br-x", "q", "no-shell", "mdrev")
    content = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    assert content["share"] == "disabled" and env["OPENCODE_DISABLE_SHARE"] == "1"
    for name in ("build", "plan", "general", "explore", "reviewer", "odd", "mdrev"):
        pinned = content["agent"][name]["permission"]
        assert list(pinned.values()) == ["deny"], (name, pinned)
    assert "bas?" not in content["agent"]["odd"]["permission"]  # a key the user has is not reused


def test_unknown_agent_with_a_restriction_is_refused_clearly(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    done = run_task("none", str(repo), title="x", permission="no-shell", agent="nobody")
    assert done["status"] == "failed" and done["attempts"] == 1
    assert "agent 'nobody' is not defined" in done["error"] and "drop --agent" in done["error"]
    assert opencode.model.requests == []


class ShareRecorder:
    """A stand-in for OpenCode's share service (config `enterprise.url`): records every request."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - stdlib name
                seen.append(self.path)
                self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.dumps({"id": "s1", "url": "http://127.0.0.1/s1", "secret": "k"}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_DELETE = do_POST

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_sharing_is_off_whatever_the_configs_say_and_repo_rules_are_named(opencode, tmp_path):
    recorder = ShareRecorder()
    try:
        # The fixture's own config file says "share": "disabled"; a user's would not.
        config = json.loads(Path(opencode.env["OPENCODE_CONFIG"]).read_text())
        config.pop("share")
        Path(opencode.env["OPENCODE_CONFIG"]).write_text(json.dumps(config))
        user_config(opencode, {"share": "auto", "enterprise": {"url": recorder.url}})
        repo_cfg = '{\n  "share": "auto",\n  "permission": {"webfetch": "deny"},\n' \
                   '  "agent": {"build": {"tools": {"todowrite": false}}}\n}\n'
        repo = make_repo(tmp_path / "repo", {"opencode.json": repo_cfg, "README.md": "# r\n"})
        opencode.model.script("sh", [tool_call("write", {"filePath": "{cwd}/out.txt", "content": "made\n"}),
                                     text("Done.\n" + DONE)])
        ids = [task_store.submit_task(title=p, instructions="SCRIPT:sh", working_dir=str(repo),
                                      permission=p)["id"] for p in ("auto", "no-network")]
        assert run_script("worker.py").returncode == 0
        for task_id in ids:
            done = task_store.get_task(task_id)
            assert done["status"] == "done", done["error"]
            receipt = done["result"]
            assert receipt["repo_config"]["files"] == ["opencode.json"]
            assert receipt["repo_config"]["restrictions"] == [
                "opencode.json: permission.webfetch = deny",
                "opencode.json: agent.build.tools.todowrite = false"]
            # OpenCode inserted its $schema line; that is not the agent's change.
            assert receipt["repo_config"]["housekeeping_undone"] == ["opencode.json"]
            assert receipt["files_touched"] == ["out.txt"] and "$schema" not in done["diff"]
            branch = f"taskbridge/{task_id}"
            assert git(repo, "show", f"{branch}:opencode.json") + "\n" == repo_cfg
        assert opencode.model.step_requests("sh")
        assert recorder.seen == [], f"sessions went to the share service: {recorder.seen}"
    finally:
        recorder.close()


def test_an_environment_fault_names_its_line_and_is_not_retried(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    # OpenCode's data folder below a regular file: its mkdir fails (ENOTDIR), as it fails with
    # EACCES for a folder the user cannot write (root could write anywhere, so this form). Unboxed:
    # the box makes OpenCode's folders itself and names such a folder before the run
    # (test_agent_box.test_a_box_folder_that_cannot_be_made_fails_once_named).
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker / "data"))
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")
    done = run_task("none", str(repo), title="t", max_retries=3)
    assert done["status"] == "failed" and done["attempts"] == 1, done
    assert "ENOTDIR" in done["error"] and "mkdir" in done["error"] and str(blocker) in done["error"]
    assert "not retried" in done["error"]
    assert "Bun v" not in done["error"]
