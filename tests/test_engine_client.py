"""engine_client.py: the drop-in for `opencode run --format json` that drives a kept `opencode serve`.

The client runs as the worker will run it: a subprocess of a Python without site-packages (``-S``:
the standard library only), the password in its env, the prompt on stdin. Most real-opencode tests
share one engine (``served``, module-scoped: the ``opencode`` fixture is per test, so it is built
here from the same parts, opencode_env and the scripted model); the one that kills its server starts
its own through the ``opencode`` fixture. The others check the mapping and the one-line failures
without the binary.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import engine
import engine_client
import opencode_runner
from fake_openai import ScriptedModel, hang, http_error, text, tool_call
from helpers import make_repo, until
from opencode_env import MODEL, opencode_env, require_opencode_bin

CLIENT = Path(__file__).resolve().parent.parent / "engine_client.py"
real_opencode = pytest.mark.real_opencode


@dataclass
class Served:
    """The shared engine, the scripted model behind it and the repository its sessions work in."""

    eng: engine.Engine
    model: ScriptedModel
    repo: Path


def engine_for(env: dict[str, str], repo: Path) -> engine.Engine:
    """A started engine in the run environment of an `auto` task in `repo` (as test_engine's)."""
    run_env = opencode_runner.run_env(env, str(repo), "br-cli-a1", "q-test", "auto")
    return engine.Engine(run_env, str(repo)).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    binary = require_opencode_bin()
    root = tmp_path_factory.mktemp("served")
    with ScriptedModel() as model, pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENCODE_BIN", binary)
        eng = engine_for(opencode_env(root, model.url), make_repo(root / "repo"))
        try:
            yield Served(eng, model, Path(eng.cwd))
        finally:
            eng.stop()


def client_argv(port: int, repo: Path, *args: str) -> list[str]:
    return [sys.executable, "-S", str(CLIENT), "--port", str(port), "--directory", str(repo),
            "--title", "br-client", *args]


def client_env(password: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "OPENCODE_SERVER_PASSWORD": password}


def run_client(eng: engine.Engine, prompt: str, *args: str, password: str | None = None,
               repo: Path | None = None) -> subprocess.CompletedProcess:
    """The client to its end against `eng` (model fake/model unless `args` say otherwise)."""
    argv = client_argv(eng.port, repo or Path(eng.cwd), "--model", MODEL, *args)
    return subprocess.run(argv, input=prompt, capture_output=True, text=True, timeout=180,
                          env=client_env(password or eng.password))


def start_client(eng: engine.Engine, prompt: str, stderr: Path, *args: str) -> subprocess.Popen:
    """The client running against `eng`, its stderr going to the file `stderr`."""
    with open(stderr, "w") as err:
        proc = subprocess.Popen(client_argv(eng.port, Path(eng.cwd), "--model", MODEL, *args),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=client_env(eng.password))
    assert proc.stdin is not None
    proc.stdin.write(prompt)
    proc.stdin.close()
    return proc


def events_of(stdout: str) -> list[dict]:
    """Every stdout line as JSON (a line that is not fails the test)."""
    return [json.loads(line) for line in stdout.splitlines()]


# -- the real server ------------------------------------------------------------------------------

@real_opencode
def test_a_write_task_prints_the_cold_runs_events_and_exits_0(served):
    served.model.script("write", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hi\n"}),
        text("All done."),
    ])
    done = run_client(served.eng, "SCRIPT:write please")
    assert done.returncode == 0, done.stderr
    events = events_of(done.stdout)
    assert [e["type"] for e in events] == ["step_start", "tool_use", "step_finish",
                                           "step_start", "text", "step_finish"]
    assert {e["sessionID"] for e in events} == {events[0]["sessionID"]}
    assert all(isinstance(e["timestamp"], int) for e in events)
    run = opencode_runner.EventStream()
    for line in done.stdout.splitlines():
        run.feed(line)
    assert run.finished and run.final_text == "All done." and not run.errors
    assert run.tool_calls[0]["tool"] == "write" and run.tool_calls[0]["status"] == "completed"
    assert (served.repo / "hello.txt").read_text() == "hi\n"
    session = served.eng.session(run.session_id, str(served.repo))
    assert session["title"] == "br-client"
    assert {"permission": "question", "pattern": "*", "action": "deny"} in session["permission"]


@real_opencode
def test_an_unknown_session_is_refused_as_opencode_run_does(served):
    done = run_client(served.eng, "hello", "--session", "ses_doesnotexist000000000000")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.strip() == "Error: Session not found"


@real_opencode
def test_sigterm_aborts_the_session_and_kills_its_bash_command(served, tmp_path):
    served.model.script("shell", [
        tool_call("bash", {"command": "echo $$ > {cwd}/shell.pid; sleep 600", "description": "wait"}),
        text("never"),
    ])
    pid_file = served.repo / "shell.pid"
    proc = start_client(served.eng, "SCRIPT:shell", tmp_path / "stderr")
    until(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, "the bash command")
    shell = psutil.Process(int(pid_file.read_text()))   # bash runs its last command (the sleep) in place
    tree = [shell, *shell.children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 143
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert proc.stdout is not None and all(json.loads(line) for line in proc.stdout.read().splitlines())
    proc.stdout.close()


@real_opencode
def test_a_model_error_is_an_error_line_and_exit_1(served):
    served.model.script("refused", [http_error(400, "the scripted model refuses")])
    done = run_client(served.eng, "SCRIPT:refused")
    assert done.returncode == 1, done.stderr
    errors = [e for e in events_of(done.stdout) if e["type"] == "error"]
    assert len(errors) == 1
    assert "the scripted model refuses" in opencode_runner.error_text(errors[0])


@real_opencode
def test_an_ask_rule_is_approved_as_auto_does_and_not_printed(served):
    served.model.script("ask", [
        tool_call("bash", {"command": "echo ran > {cwd}/asked.txt", "description": "asked"}),
        text("done"),
    ])
    rules = json.dumps([{"permission": "bash", "pattern": "*", "action": "ask"}])
    done = run_client(served.eng, "SCRIPT:ask", "--permission", rules)
    assert done.returncode == 0, done.stderr
    assert (served.repo / "asked.txt").read_text() == "ran\n"
    events = events_of(done.stdout)
    assert [e["type"] for e in events] == ["step_start", "tool_use", "step_finish",
                                           "step_start", "text", "step_finish"]
    assert events[1]["part"]["state"]["status"] == "completed"


@real_opencode
def test_new_server_log_lines_reach_stderr_and_sigint_exits_130(served, tmp_path):
    """Only lines written after the client started are copied, while it runs and at its exit."""
    log = tmp_path / "server.log"
    log.write_text("ERROR old line from before\n")
    served.model.script("slow", [hang()])
    stderr = tmp_path / "stderr"
    proc = start_client(served.eng, "SCRIPT:slow", stderr, "--server-log", str(log))
    until(lambda: served.model.step_requests("slow"), 60, "the slow model request")
    with open(log, "a") as out:
        out.write("WARN new line one\n")
    until(lambda: "WARN new line one" in stderr.read_text(), 10, "the log line on stderr")
    with open(log, "a") as out:
        out.write("WARN last words")   # no newline yet: copied by the pass at exit
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 130
    said = stderr.read_text()
    assert "old line" not in said and said.endswith("WARN new line one\nWARN last words")
    assert proc.stdout is not None and proc.stdout.read() == ""
    proc.stdout.close()


@real_opencode
def test_a_wrong_password_is_engine_gone(served):
    done = run_client(served.eng, "hello", password="not-the-password")
    assert (done.returncode, done.stdout) == (engine_client.ENGINE_GONE, "")
    assert done.stderr.startswith(f"Error: the OpenCode engine on 127.0.0.1:{served.eng.port} refused the password")
    assert done.stderr.count("\n") == 1


def test_a_killed_server_mid_turn_is_engine_gone(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("slow", [hang()])
    eng = engine_for(opencode.env, repo)
    try:
        proc = start_client(eng, "SCRIPT:slow", tmp_path / "stderr")
        until(lambda: opencode.model.step_requests("slow"), 60, "the slow model request")
        eng.stop(grace=0)
        assert proc.wait(timeout=30) == engine_client.ENGINE_GONE
    finally:
        eng.stop()
    said = (tmp_path / "stderr").read_text()
    assert said.startswith(f"Error: the OpenCode engine on 127.0.0.1:{eng.port} ")
    assert "before the session went idle" in said and said.count("\n") == 1
    assert proc.stdout is not None
    assert "step_finish" not in [e["type"] for e in events_of(proc.stdout.read())]
    proc.stdout.close()


# -- without the binary ---------------------------------------------------------------------------

def test_no_server_on_the_port_is_engine_gone(tmp_path):
    port = engine.free_port()
    done = subprocess.run(client_argv(port, tmp_path), input="hello", capture_output=True, text=True,
                          timeout=30, env=client_env("pw"))
    assert (done.returncode, done.stdout) == (engine_client.ENGINE_GONE, "")
    assert done.stderr.startswith(f"Error: the OpenCode engine on 127.0.0.1:{port} cannot be reached")
    assert done.stderr.count("\n") == 1


def test_bad_arguments_and_an_empty_prompt_are_one_line(tmp_path):
    port = str(engine.free_port())
    bad = subprocess.run([*client_argv(int(port), tmp_path), "--permission", '{"bash": "ask"}'],
                         input="hello", capture_output=True, text=True, timeout=30, env=client_env("pw"))
    assert bad.returncode == 2 and "--permission" in bad.stderr and "Traceback" not in bad.stderr
    empty = subprocess.run(client_argv(int(port), tmp_path), input=" \n", capture_output=True, text=True,
                           timeout=30, env=client_env("pw"))
    assert (empty.returncode, empty.stdout, empty.stderr) == (1, "", "Error: no prompt on stdin\n")


def test_only_the_main_sessions_parts_print_and_its_sub_agents_asks_are_followed():
    """The family of the main session grows through session.created's parentID; a sub-agent's
    parts are not printed; the main session's idle ends the run."""
    args = engine_client.parse_args(["--port", "1", "--directory", "/tmp", "--title", "t"])
    run = engine_client.Run(args, engine_client.Server(1, "/tmp", "pw"))
    run.session_id = "ses_main"
    run.family.add("ses_main")
    assert not run.handle("session.created", {"info": {"id": "ses_sub", "parentID": "ses_main"}})
    assert not run.handle("session.created", {"info": {"id": "ses_subsub", "parentID": "ses_sub"}})
    assert not run.handle("session.created", {"info": {"id": "ses_other"}})
    assert run.family == {"ses_main", "ses_sub", "ses_subsub"}
    step = {"id": "prt_1", "type": "step-start"}
    assert not run.handle("message.part.updated", {"part": {**step, "sessionID": "ses_sub"}})
    assert not run.handle("session.idle", {"sessionID": "ses_sub"})
    assert run.handle("session.idle", {"sessionID": "ses_main"})


def test_the_cold_mapping_prints_a_part_once_when_finished():
    seen: set[tuple[str, str]] = set()
    streaming = {"id": "prt_3", "sessionID": "ses_1", "type": "text", "text": "Al", "time": {"start": 1}}
    done = {**streaming, "text": "All done.", "time": {"start": 1, "end": 2}}
    mapped = [engine_client.cold_event("message.part.updated", {"part": p}, seen)
              for p in (streaming, done, done)]
    assert [m and m["type"] for m in mapped] == [None, "text", None]
    assert mapped[1]["sessionID"] == "ses_1" and mapped[1]["part"]["text"] == "All done."
    assert engine_client.cold_event("permission.asked", {"id": "per_1", "sessionID": "ses_1"}, seen) is None
    assert engine_client.sse_event(b'data: {"type": "server.heartbeat", "properties": {}}\n') == {
        "type": "server.heartbeat", "properties": {}}
    assert engine_client.sse_event(b": comment\n") is None and engine_client.sse_event(b"data: [1]\n") is None
