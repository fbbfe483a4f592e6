"""engine.py: the kept `opencode serve`, driven through its HTTP API.

The real-opencode tests (marked by the `opencode` fixture) start the pinned binary against the
scripted model; the others check the event mapping and the one-line errors without it.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import agent_box
import engine
import opencode_runner
import redaction
import worktrees
from fake_openai import default_usage, hang, http_error, text, tool_call
from helpers import git, make_repo, until

MODEL = "fake/model"


def start_engine(opencode, cwd: Path, **kwargs) -> engine.Engine:
    """An engine in the run environment opencode_runner builds for an `auto` task in `cwd`."""
    env = opencode_runner.run_env(opencode.env, str(cwd), "br-eng-a1", "q-test", "auto")
    return engine.Engine(env, str(cwd), **kwargs).start()


def follow_all(stream: engine.SessionEvents, session_id: str) -> list[dict]:
    return list(stream.follow(session_id))


# -- the real server ------------------------------------------------------------------------------

def test_start_answers_health_and_refuses_a_wrong_password(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    with start_engine(opencode, repo) as eng:
        assert eng.health() == {"healthy": True, "version": "1.18.33"}
        servers = [p for p in eng.processes() if p.ppid() == os.getpid()]
        assert [p.pid for p in servers] == [eng.proc.pid]   # `with` on a started engine starts no second one
        with pytest.raises(engine.EngineRefused) as refused:
            eng.request("GET", "/session", password="not-the-password")
        assert refused.value.status == 401
        conn = http.client.HTTPConnection("127.0.0.1", eng.port, timeout=10)
        conn.request("GET", "/session")   # no Authorization at all
        assert conn.getresponse().status == 401
        conn.close()
        # Its children that are no shell (MCP servers, LSPs) inherit the password: stored text never holds it.
        assert redaction.redact(f"env: {eng.password}") == "env: [redacted: opencode server password]"
    assert redaction.redact(eng.password) != eng.password, "the receipt is stored after the server stopped"


def test_a_session_writes_through_the_model_and_reports_its_usage(opencode, tmp_path):
    """The file the model's write call names appears, and the step_finish events carry the very
    tokens and cost the scripted model reported (totalled by the cold run's EventStream)."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("write", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hi\n"}),
        text("All done."),
    ])
    rules = [{"permission": "webfetch", "pattern": "*", "action": "deny"}]
    with start_engine(opencode, repo) as eng:
        session_id = eng.create_session(str(repo), "br-1-a1", rules)
        assert eng.session(session_id, str(repo))["permission"] == rules
        with eng.events(str(repo)) as stream:
            eng.prompt(session_id, str(repo), "SCRIPT:write please", model=MODEL)
            events = follow_all(stream, session_id)
        eng.release(str(repo))   # unloaded; a later session there loads it again
        assert eng.create_session(str(repo), "br-1-a2").startswith("ses_")
    assert (repo / "hello.txt").read_text() == "hi\n"
    run = opencode_runner.EventStream()
    for event in events:
        run.feed(json.dumps(event))
    assert [e["type"] for e in events] == ["step_start", "tool_use", "step_finish",
                                           "step_start", "text", "step_finish"]
    sent = [default_usage(step) for step in (0, 1)]
    assert run.tokens["input"] == sum(u["prompt_tokens"] - u["cached_tokens"] for u in sent)
    assert run.tokens["output"] == sum(u["completion_tokens"] for u in sent)
    assert run.tokens["cache_read"] == sum(u["cached_tokens"] for u in sent)
    prices = {"input": 1.0, "output": 2.0, "cache_read": 0.1}   # opencode_env's, USD per million
    expected = sum(run.tokens[k] * price for k, price in prices.items()) / 1e6
    assert run.cost_usd == pytest.approx(expected)
    assert run.finished and run.final_text == "All done."
    assert run.tool_calls[0]["tool"] == "write" and run.tool_calls[0]["status"] == "completed"


def test_abort_ends_a_slow_model_turn_and_kills_the_bash_child(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("slow", [hang()])
    opencode.model.script("shell", [
        tool_call("bash", {"command": "echo $$ > {cwd}/shell.pid; sleep 600", "description": "wait"}),
        text("never"),
    ])
    with start_engine(opencode, repo) as eng:
        slow = eng.create_session(str(repo), "br-slow")
        with eng.events(str(repo)) as stream:
            eng.prompt(slow, str(repo), "SCRIPT:slow", model=MODEL)
            until(lambda: opencode.model.step_requests("slow"), 60, "the slow model request")
            threading.Timer(0.5, eng.abort, (slow, str(repo))).start()
            started = time.monotonic()
            follow_all(stream, slow)
            assert time.monotonic() - started < 15
        shell = eng.create_session(str(repo), "br-shell")
        with eng.events(str(repo)) as stream:
            eng.prompt(shell, str(repo), "SCRIPT:shell", model=MODEL)
            pid_file = repo / "shell.pid"
            until(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, "the bash command")
            child = psutil.Process(int(pid_file.read_text()))
            eng.abort(shell, str(repo))
            follow_all(stream, shell)
        psutil.wait_procs([child], timeout=10)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert eng.health()["healthy"]   # the server itself goes on
        # A server that stops answering (frozen here) is named within the timeouts, not waited on.
        stream = eng.events(str(repo), read_timeout=3)
        server = psutil.Process(eng.proc.pid).children()[0]   # OpenCode itself, under run_reaper.py
        assert server.cmdline()[1:] == eng.argv[1:]
        server.send_signal(signal.SIGSTOP)
        with pytest.raises(engine.EngineGone, match="did not answer"):
            eng.health(timeout=1)
        with pytest.raises(engine.EngineGone, match="silent"):
            follow_all(stream, shell)
        stream.close()
    assert not eng.alive()   # the stop ends a frozen server too


def test_stop_leaves_no_process_and_a_dead_server_breaks_the_stream(opencode, tmp_path):
    """A detached grandchild (re-parented away from the server) is found by the engine's tag."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("detach", [
        tool_call("bash", {"command": "nohup sleep 600 >/dev/null 2>&1 & echo $! > {cwd}/bg.pid",
                           "description": "detach"}),
        text("left it running"),
    ])
    eng = start_engine(opencode, repo)
    try:
        session_id = eng.create_session(str(repo), "br-detach")
        with eng.events(str(repo)) as stream:
            eng.prompt(session_id, str(repo), "SCRIPT:detach", model=MODEL)
            follow_all(stream, session_id)
        detached = psutil.Process(int((repo / "bg.pid").read_text()))
        procs = eng.processes()
        assert detached.pid in {p.pid for p in procs}
        assert eng.rss() > 50 * 1024 * 1024
        stream = eng.events(str(repo), read_timeout=30)
        eng.stop()
        with pytest.raises(engine.EngineGone):
            follow_all(stream, session_id)
    finally:
        eng.stop()
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not engine.process_tree.tagged_processes({engine.ENGINE_ENV: eng.tag})


def test_a_permission_ask_is_held_until_the_engine_replies(opencode, tmp_path):
    """A session whose ruleset says ``ask`` for bash waits at the call (what a headless `opencode
    run` cannot do); the reply lets the command run."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ask", [
        tool_call("bash", {"command": "echo ran > {cwd}/asked.txt", "description": "asked"}),
        text("done"),
    ])
    rules = [{"permission": "bash", "pattern": "*", "action": "ask"}]
    with start_engine(opencode, repo) as eng:
        session_id = eng.create_session(str(repo), "br-ask", rules)
        with eng.events(str(repo)) as stream:
            eng.prompt(session_id, str(repo), "SCRIPT:ask", model=MODEL)
            seen = []
            for event in stream.follow(session_id):
                seen.append(event["type"])
                if event["type"] == "permission_asked":
                    assert event["request"]["permission"] == "bash"
                    assert not (repo / "asked.txt").exists()
                    eng.reply_permission(event["request"]["id"], str(repo), "once")
    assert "permission_asked" in seen
    assert (repo / "asked.txt").read_text() == "ran\n"


def test_a_boxed_engine_writes_only_its_own_worktree(opencode, tmp_path):
    """The engine in the agent box of one worktree (the binds a worker run gets): its sessions
    write there, and neither another task's worktree nor the user's checkout, even with OpenCode's
    own rules allowing everything (the box, not the rules, holds)."""
    if agent_box.support().mechanism != "bubblewrap":
        pytest.skip(f"no bubblewrap box here: {agent_box.support().reason}")
    repo = make_repo(tmp_path / "repo")
    mine, other = (worktrees.worktree_root() / name for name in ("repo-t_0001", "repo-t_0002"))
    for n, tree in enumerate((mine, other), 1):
        git(repo, "worktree", "add", "-q", "-b", f"taskbridge/t_000{n}", str(tree))
    run = tmp_path / "q" / "task_logs" / "t_0001.run"
    for sub in ("control", "reply", "tmp", "objects"):
        (run / sub).mkdir(parents=True)
    env = opencode_runner.run_env(agent_box.agent_env(opencode.env, MODEL), str(mine), "br-box", "q", "auto")
    plan = agent_box.plan_for(worktrees.Workspace(mode="worktree", cwd=str(mine), top=str(mine), repo=str(repo),
                                                  home=str(tmp_path / "home")), env, "auto", run)
    steal = f"echo x > {other}/stolen.txt; echo x > {repo}/stolen.txt; echo done"
    opencode.model.script("box", [
        tool_call([("write", {"filePath": "{cwd}/mine.txt", "content": "ok\n"}),
                   ("bash", {"command": steal, "description": "steal"})]),
        text("done"),
    ])
    everything = [{"permission": "*", "pattern": "*", "action": "allow"}]
    box = lambda argv, e: (agent_box.bwrap_argv(plan, argv), {**e, "TMPDIR": "/tmp"})  # noqa: E731
    with engine.Engine(env, str(mine), box=box).start() as eng:
        session_id = eng.create_session(str(mine), "br-box", everything)
        with eng.events(str(mine)) as stream:
            eng.prompt(session_id, str(mine), "SCRIPT:box", model=MODEL)
            calls = [e for e in stream.follow(session_id) if e["type"] == "tool_use"]
    assert (mine / "mine.txt").read_text() == "ok\n"
    assert len(calls) == 2
    assert not (other / "stolen.txt").exists() and not (repo / "stolen.txt").exists()


def test_a_taken_port_is_named_in_one_line(opencode, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = opencode_runner.run_env(opencode.env, str(tmp_path), "br-x", "q", "auto")
        eng = engine.Engine(env, str(tmp_path))
        with pytest.raises(engine.EngineStartFailed) as failed:
            eng.start(port=port)
    message = str(failed.value)
    assert f"127.0.0.1:{port}" in message and "in use" in message and "\n" not in message
    assert not eng.alive()


def test_a_bad_config_is_named_in_one_line(opencode, tmp_path):
    env = opencode_runner.run_env(opencode.env, str(tmp_path), "br-x", "q", "auto")
    content = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    env["OPENCODE_CONFIG_CONTENT"] = json.dumps({**content, "model": 5})
    eng = engine.Engine(env, str(tmp_path))
    with pytest.raises(engine.EngineStartFailed) as failed:
        eng.start()
    message = str(failed.value)
    assert "configuration" in message and "model" in message and "OPENCODE_CONFIG_CONTENT" in message
    assert "\n" not in message
    assert not eng.alive()


# -- without the binary ---------------------------------------------------------------------------

def test_a_missing_binary_is_a_start_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCODE_BIN", str(tmp_path / "no-such-opencode"))
    with pytest.raises(engine.EngineStartFailed, match="not found"):
        engine.Engine({}, str(tmp_path)).start()


def test_server_events_map_to_the_cold_runs_shapes_once_each():
    stream = engine.SessionEvents.__new__(engine.SessionEvents)
    stream._seen = set()
    sid = "ses_1"
    tool = {"id": "prt_2", "sessionID": sid, "type": "tool", "tool": "bash",
            "state": {"status": "running", "input": {"command": "ls"}}}
    finished_tool = {**tool, "state": {"status": "completed", "input": {"command": "ls"},
                                       "output": "x", "metadata": {"exit": 0}}}
    streaming = {"id": "prt_3", "sessionID": sid, "type": "text", "text": "Al", "time": {"start": 1}}
    done_text = {**streaming, "text": "All done.", "time": {"start": 1, "end": 2}}
    finish = {"id": "prt_4", "sessionID": sid, "type": "step-finish", "reason": "stop", "cost": 0.5,
              "tokens": {"total": 3, "input": 1, "output": 2, "reasoning": 0, "cache": {"read": 0, "write": 0}}}
    parts = [{"id": "prt_1", "sessionID": sid, "type": "step-start"}, tool, finished_tool, finished_tool,
             streaming, done_text, finish]
    mapped = [stream.mapped("message.part.updated", {"sessionID": sid, "part": p}) for p in parts]
    assert [m and m["type"] for m in mapped] == ["step_start", None, "tool_use", None, None, "text",
                                                  "step_finish"]
    run = opencode_runner.EventStream()
    for event in filter(None, mapped):
        run.feed(json.dumps(event))
    assert run.usage() == {"tokens": {"input": 1, "output": 2, "reasoning": 0, "cache_read": 0,
                                      "cache_write": 0, "total": 3}, "cost_usd": 0.5, "steps": 1}
    assert run.commands == [{"command": "ls", "status": "completed", "exit": 0}]
    assert run.final_text == "All done." and run.finished
    error = stream.mapped("session.error", {"sessionID": sid, "error": {"name": "APIError",
                                                                        "data": {"message": "boom"}}})
    assert opencode_runner.error_text(error) == "APIError: boom"
    # The error event of the real opencode 1.18.33 when the model server refuses connections (its
    # own retries over, ~66 s): the URL sits in metadata only. Its query and user part stay out.
    unreachable = {"type": "error", "error": {"name": "APIError", "data": {
        "message": "Cannot connect to API: Unable to connect. Is the computer able to access the url?",
        "isRetryable": True, "metadata": {"url": "http://u:pw@127.0.0.1:42333/chat/completions?key=k"}}}}
    assert opencode_runner.error_text(unreachable) == (
        "APIError: Cannot connect to API: Unable to connect. Is the computer able to access the url? "
        "(request to http://127.0.0.1:42333/chat/completions)")
    assert opencode_runner.error_text({"error": {"name": "E", "data": {"message": "m",
                                                                      "metadata": {"url": "not a url"}}}}) == "E: m"
    ask = stream.mapped("permission.asked", {"id": "per_1", "sessionID": sid, "permission": "bash"})
    assert ask["type"] == "permission_asked" and ask["request"]["id"] == "per_1"


def test_one_line_errors_for_config_and_start():
    body = json.dumps({"name": "ConfigInvalidError", "data": {
        "path": "OPENCODE_CONFIG_CONTENT", "issues": [{"path": ["model"], "message": "Expected string"}]}})
    line = engine.config_problem(body.encode())
    assert "ConfigInvalidError in OPENCODE_CONFIG_CONTENT: model: Expected string" in line
    said = engine.start_problem("\x1b[91mError: \x1b[0mUnexpected error\n\nServeError\n", engine.free_port(), 1)
    assert said.startswith("opencode serve exited with code 1 (Error: Unexpected error / ServeError)")
    assert "\n" not in said


def test_a_model_name_without_a_provider_is_refused():
    assert engine.prompt_body("hi", "fake/model")["model"] == {"providerID": "fake", "modelID": "model"}
    with pytest.raises(engine.EngineError, match="provider/model"):
        engine.prompt_body("hi", "model")


def test_the_password_is_basic_auth_for_the_opencode_user():
    eng = engine.Engine({}, "/tmp")
    user, _, password = base64.b64decode(eng.auth_header().split()[1]).decode().partition(":")
    assert (user, password) == ("opencode", eng.password)
    assert engine.Engine({}, "/tmp").password != eng.password


def test_a_warm_up_sends_nothing_and_the_spend_gate_still_holds_the_tasks_session(opencode, tmp_path):
    """A kept server opens a folder ahead with a prompt whose model call the warm-up stop refuses
    (nothing reaches the model); TaskBridge's plugins must not take that session for the run's
    own: the spend gate then holds the task session's third call (without isWarmUp it gated the
    warm-up session and let every call of the task's go)."""
    folder = make_repo(tmp_path / "repo")
    opencode.model.script("gate", [tool_call("bash", {"command": f"echo {n}", "description": "n"})
                                   for n in range(4)] + [text("done")])
    control = tmp_path / "run" / "control"
    control.mkdir(parents=True)
    (tmp_path / "run" / "reply").mkdir()
    gate = control / "gate"
    gate.write_text('{"allow_usd": 0.0015, "allow_tokens": null, "stop": null}')
    env = opencode_runner.run_env(opencode.env, str(folder), "br-eng-a1", "q-test", "auto")
    env = opencode_runner.with_warm_up(opencode_runner.with_spend_gate(env, str(gate)), str(control / "warm-up.json"))
    with engine.Engine(env, str(tmp_path)).start() as eng:
        eng.warm_up(str(folder), control / "warm-up.json", MODEL)
        assert opencode.model.requests == [], "the warm-up reached no model"
        session_id = eng.create_session(str(folder), "br-eng-a1")
        eng.prompt(session_id, str(folder), "SCRIPT:gate go", model=MODEL)
        held = Path(opencode_runner.reply_path(str(gate), ".held"))
        until(held.exists, 120, "the gate to hold the third call")
        assert json.loads(held.read_text())["steps"] == 2
        time.sleep(2)
        assert len(opencode.model.step_requests("gate")) == 2, "the third call was never sent"


def test_after_a_warm_up_the_retry_watch_reports_the_tasks_session(opencode, tmp_path):
    """The retry watch reports the run's own session's retries (a usage limit pauses the task):
    the warm-up session came first and was taken for it, so no retry of the task was reported."""
    folder = make_repo(tmp_path / "repo")
    opencode.model.script("lim", [http_error(429, "usage limit reached", {"retry-after": "40"})])
    control = tmp_path / "run" / "control"
    control.mkdir(parents=True)
    (tmp_path / "run" / "reply").mkdir()
    retry = control / "retry"
    env = opencode_runner.run_env(opencode.env, str(folder), "br-eng-a1", "q-test", "auto")
    env = opencode_runner.with_warm_up(opencode_runner.with_retry_watch(env, str(retry)), str(control / "warm-up.json"))
    with engine.Engine(env, str(tmp_path)).start() as eng:
        eng.warm_up(str(folder), control / "warm-up.json", MODEL)
        session_id = eng.create_session(str(folder), "br-eng-a1")
        eng.prompt(session_id, str(folder), "SCRIPT:lim go", model=MODEL)
        reported = Path(opencode_runner.reply_path(str(retry), ".json"))
        until(reported.exists, 60, "the retry watch to report the task's retry")
        assert json.loads(reported.read_text())["sessionID"] == session_id


def test_a_reaper_whose_parent_died_during_its_start_starts_nothing(tmp_path):
    """run_reaper.py --die-with-parent asks Linux for SIGTERM when its parent ends; a parent that
    ended before it asked (a worker killed the moment its kept server launched) went unseen, and
    the server lived on under init. The parent's pid now comes with the flag."""
    marker = tmp_path / "started"
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import os, subprocess, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import process_tree\n"
        "_, status = os.pipe()\n"
        "argv = ['sh', '-c', 'touch ' + sys.argv[2] + '; sleep 301']\n"
        "subprocess.Popen(process_tree.reaper_argv(sys.executable, status, argv, True, os.getpid()),\n"
        "                 pass_fds=(status,))\n"
        "os._exit(0)   # at once: before the reaper's own Python is up\n")
    ended = subprocess.run([sys.executable, str(launcher), str(Path(engine.__file__).parent), str(marker)], timeout=30)
    assert ended.returncode == 0
    time.sleep(3)
    assert not marker.exists(), "the command was started although its parent was gone"
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "301"]]


def test_an_answer_that_is_not_json_is_a_refusal_and_no_server_is_called_ready(tmp_path, monkeypatch):
    """A reviewer's finding: OpenCode answers a path it does not know with its web app's page; a
    200 that is not JSON escaped Engine.request as a ValueError, killed the kept server's start
    thread with a traceback, and left the server called ready though its start never finished."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import engine_slots

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"healthy": true}' if self.path.startswith("/global/health") else b"<!doctype html>app"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        eng = engine.Engine({}, str(tmp_path))
        eng.port = server.server_address[1]
        assert eng.health() == {"healthy": True}
        with pytest.raises(engine.EngineRefused, match="with no JSON"):
            eng.request("GET", "/config")
        kept = engine_slots.Kept(tmp_path / "slot", tmp_path / "run", str(tmp_path), {}, None)
        monkeypatch.setattr(kept.engine, "wait_ready", lambda: (_ for _ in ()).throw(KeyError("id")))
        kept._start()
        assert kept.problem and "KeyError" in kept.problem and not kept.ready(0)
    finally:
        server.shutdown()
        server.server_close()


def test_a_launch_that_fails_before_the_server_starts_leaks_no_descriptor(tmp_path, monkeypatch):
    """A reviewer's finding: the reaper's status descriptor was closed only around Popen, so a box
    hook or the log file failing first leaked one per launch."""
    def broken_box(argv, env):
        raise OSError("the box's shell could not be written")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(OSError, match="box's shell"):
            engine.Engine({}, str(tmp_path), box=broken_box).launch()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_pass_start_ends_what_a_killed_workers_unboxed_servers_left_running(tmp_path):
    """A reviewer's finding: an unboxed kept server's children carry the slot's marker, not their
    task's, so the next pass's reaper (by task marker) never found what they left running after
    the worker was killed. The sweep ends this queue's processes of slot markers, and no other."""
    import engine_slots
    import task_store

    def started(queue: str, marker: str) -> subprocess.Popen:
        env = {**os.environ, opencode_runner.QUEUE_ENV: queue, opencode_runner.MARKER_ENV: marker}
        return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    ours = started(task_store.queue_tag(), engine_slots.new_marker("slot_0"))
    doctor_check = started(task_store.queue_tag(), "doctor")
    other_queue = started("another-queue", engine_slots.new_marker("slot_0"))
    try:
        until(lambda: all(psutil.Process(p.pid).environ() for p in (ours, doctor_check, other_queue)), 5)
        engine_slots.sweep(tmp_path / "engine", tmp_path, task_store.queue_tag(), grace=1)   # none made yet
        assert ours.poll() is None
        (tmp_path / "engine").mkdir()   # a kept server's folder, left by the killed worker
        engine_slots.sweep(tmp_path / "engine", tmp_path, task_store.queue_tag(), grace=1)
        assert ours.wait(5) is not None
        assert doctor_check.poll() is None and other_queue.poll() is None
    finally:
        for proc in (ours, doctor_check, other_queue):
            proc.kill()
            proc.wait()


def test_a_pass_start_sweeps_only_its_own_queues_engine_folders_whose_worker_is_gone(tmp_path):
    """A tester's finding: two queues sharing one TASKBRIDGE_WORKTREE_ROOT; a warm worker's start
    on queue B removed queue A's live worker's slot folder and parked worktree (A's next task
    failed: ENOENT on the folder its server was in). Each folder's owner is recorded beside it
    (engine_slots.make_folder); the sweep leaves another queue's and a live worker's alone."""
    import engine_slots
    import task_store
    repo = make_repo(tmp_path / "repo")
    root, ours = worktrees.worktree_root() / "engine", task_store.queue_tag()
    live = subprocess.Popen(["sleep", "60"])   # a worker of this queue's that still runs (a reused root)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        folders = {name: root / f"slot_0-{name}" for name in ("other", "live", "dead", "legacy", "used")}
        engine_slots.make_folder(folders["other"], "another-queue")   # queue A's: this process is its worker
        engine_slots.make_folder(folders["live"], ours, pid=live.pid)
        engine_slots.make_folder(folders["dead"], ours, pid=dead.pid)   # a killed worker's
        for name in ("legacy", "used"):   # an earlier version's: no owner record
            folders[name].mkdir()
        parked = {name: worktrees.park_worktree(str(repo), folder) for name, folder in folders.items()}
        (tmp_path / "logs").mkdir()
        runs = {name: tmp_path / "logs" / f"engine-slot_0-{name}.run" for name in folders}
        for run in runs.values():
            run.mkdir()
        in_used = subprocess.Popen(["sleep", "60"], cwd=parked["used"])   # a server of an earlier version
        try:
            engine_slots.sweep(root, tmp_path / "logs", ours, grace=1)
        finally:
            in_used.kill()
            in_used.wait()
        listed = git(repo, "worktree", "list", "--porcelain")
        for name in ("other", "live", "used"):
            assert parked[name].is_dir() and f"worktree {parked[name]}" in listed, name
            admin = Path(git(parked[name], "rev-parse", "--absolute-git-dir"))
            assert (admin / "locked").read_text().strip() == worktrees.PARKED, name   # still locked
            assert runs[name].is_dir(), name
        for name in ("dead", "legacy"):
            assert not folders[name].exists() and f"worktree {parked[name]}" not in listed, name
            assert not worktrees.engine_owner_file(folders[name]).exists() and not runs[name].exists(), name
    finally:
        live.kill()
        live.wait()
