"""Small helpers shared by the tests: real git repos, subprocess entry points, process checks.

The one way each to do what many tests do (use these rather than writing another):
- queue a task without a client: ``submit`` (``run_task`` also runs one worker pass over it);
- call an MCP tool through an SDK client: ``call_tool`` (its structured result) and
  ``tool_error`` (the error text of a call that must fail);
- stand in for a program on PATH or behind a knob (OPENCODE_BIN, CLAUDE_BIN...): ``fake_binary``;
- the real server as its own process on HTTP: ``bridge_process``; in a thread: ``serving``.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
# How many MCP tools opencode_bridge_mcp.py has: the one number every test that counts them
# asserts (README.md's file table states it too; tests/test_docs.py holds the two together).
BRIDGE_TOOL_COUNT = 21
GIT_ID = ["-c", "user.name=Test", "-c", "user.email=test@example.com"]


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` with a fixed identity; return stdout stripped (raises on failure)."""
    return subprocess.run(["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def make_repo(path: Path, files: dict[str, str] | None = None) -> Path:
    """A real git repository with one commit on branch main holding `files`."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    for name, content in (files or {"README.md": "# demo\n"}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def checkout_state(repo: Path) -> tuple[str, str, dict[str, str]]:
    """(HEAD, porcelain status, {file: content}) of a checkout, to prove it was not touched."""
    files = {str(p.relative_to(repo)): p.read_text(errors="replace")
             for p in sorted(repo.rglob("*")) if p.is_file() and ".git" not in p.parts}
    return git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), files


def fake_binary(folder: Path, name: str, body: str, *, shebang: str = "#!/bin/sh") -> Path:
    """An executable stand-in for a program the test cannot or must not run for real (``opencode``,
    ``claude``, ``launchctl``, ``notify-send``, a git hook...): ``folder/name`` (folder made when
    missing) holding ``shebang``, a newline and ``body`` (shell unless ``shebang`` says otherwise,
    e.g. ``f"#!{sys.executable}"`` for Python), mode 0755. Returns its path; the test puts it to
    use itself: first on PATH (``monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")``)
    or named by a knob such as OPENCODE_BIN or CLAUDE_BIN. A stand-in that should record its calls
    appends them to a file the test reads: ``f'echo "$@" >> {calls}'``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"{shebang}\n{body}")
    path.chmod(0o755)
    return path


def run_script(name: str, *args: str, timeout: float = 300, env: dict | None = None,
               input: str | None = None) -> subprocess.CompletedProcess:
    """`python <repo>/<name> args...` as launchd would run it (a separate process)."""
    return subprocess.run([sys.executable, str(ROOT / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ), input=input,
                          stdin=None if input is not None else subprocess.DEVNULL)


def submit(working_dir: Path | str | None = None, title: str | None = None, *, instructions: str = "i",
           script: str | None = None, **fields: Any) -> dict:
    """Queue one task straight through the store (``task_store.submit_task``) and return it as
    stored (its public dict: id, status, ...). The one way tests queue a task without a client.

    working_dir: the task's folder (a Path or a str), or None when ``fields`` name a ``repo``, a
    ``continue_from`` or a ``fork_from`` instead. title: "t" unless given (or the script's name).
    script: the name of a fake model's script (tests/fake_openai.py) for a task a real worker
    runs: the instructions become ``SCRIPT:<script>``. fields: any other submit_task field as it
    takes it (``model=``, ``max_retries=``, ``depends_on=``, ...). Raises what submit_task raises
    (``task_store.ValidationError`` for a field it refuses)."""
    import task_store
    if working_dir is not None:
        fields["working_dir"] = str(working_dir)
    return task_store.submit_task(title=title if title is not None else script or "t",
                                  instructions=f"SCRIPT:{script}" if script else instructions, **fields)


def run_task(script: str, working_dir: str, *, title: str | None = None, **fields) -> dict:
    """Queue a task whose instructions name the fake model's ``script`` (title: the script's
    name unless given; ``fields``: more submit_task fields), run one worker pass (it must exit 0)
    and return the task as stored after it."""
    import task_store
    task = submit(working_dir, title, script=script, **fields)
    assert run_script("worker.py").returncode == 0
    return task_store.get_task(task["id"])


def tagged(marker_prefix: str = "br-") -> list[psutil.Process]:
    """Live processes whose environment carries a TaskBridge run marker of this test's queue."""
    import task_store
    out = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("TASKBRIDGE_QUEUE") == task_store.queue_tag() and \
                env.get("TASKBRIDGE_RUN", "").startswith(marker_prefix):
            out.append(proc)
    return out


def step_finish_sums(log_text: str) -> dict:
    """Sum tokens and cost over every step_finish event found in a task log."""
    sums = {"input": 0, "output": 0, "reasoning": 0, "cache_read": 0, "cache_write": 0, "cost": 0.0}
    for line in log_text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "step_finish":
            tokens = event["part"]["tokens"]
            sums["input"] += tokens["input"]
            sums["output"] += tokens["output"]
            sums["reasoning"] += tokens["reasoning"]
            sums["cache_read"] += tokens["cache"]["read"]
            sums["cache_write"] += tokens["cache"]["write"]
            sums["cost"] += event["part"]["cost"]
    return sums


_CLAIMER = """
import json, sys, task_store
got = []
while True:
    task = task_store.claim_next(sys.argv[1])
    if task is None:
        break
    got.append(task["id"])
    if sys.argv[2] == "renew":
        task_store.renew_lease(task["id"], task["run_marker"], session_id="s")
    task_store.complete_attempt(task["id"], task["run_marker"])
print(json.dumps(got))
"""


def claim_in_processes(workers: int, timeout: float, *, renew: bool = False) -> list[str]:
    """``workers`` separate processes claim and complete (``renew``: renewing each lease once
    between) until the queue is empty; returns every claimed id. Fails on a process that exits
    non-zero or says "locked"."""
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, f"w{i}", "renew" if renew else "-"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(workers)]
    claimed = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0 and "locked" not in err, err
        claimed += json.loads(out)
    return claimed


async def call_tool(client: Any, tool: str, args: dict[str, Any] | None = None, **call_kw: Any) -> Any:
    """Call ``tool`` with ``args`` (default none) through a connected MCP SDK client (an
    ``mcp.Client`` on the server in memory, over stdio or over HTTP: the helper does not care)
    and return its structured result (``structuredContent``, usually a dict). A tool error fails
    the test, showing the error's text. ``call_kw`` go to ``Client.call_tool`` as they are (e.g.
    ``progress_callback``, ``meta``). For a call that must fail, ``tool_error``."""
    result = await client.call_tool(tool, args or {}, **call_kw)
    assert not result.is_error, result.content[0].text
    return result.structured_content


async def tool_error(client: Any, tool: str, args: dict[str, Any] | None = None, **call_kw: Any) -> str:
    """Call ``tool`` as ``call_tool`` does, where it must fail: return the error's text (what the
    planner reads). Fails the test when the call succeeds, and when the text is not the tool's own
    message but the SDK's wrapping of an unexpected exception ("Error executing tool ...") or a
    traceback: bad input gets a clear one-line error, never a crash."""
    result = await client.call_tool(tool, args or {}, **call_kw)
    assert result.is_error, f"{tool} accepted {args}: {result.structured_content}"
    text = result.content[0].text
    assert "Error executing tool" not in text and "Traceback" not in text, text
    return text


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(port: int | None = None, app: Any = None) -> Iterator[str]:
    """An ASGI ``app`` (default: the bridge's whole HTTP app, build_app()) under uvicorn in a
    thread on 127.0.0.1 (on ``port``, or a free one); yields the base URL and stops the server on
    leaving. The benches use it too."""
    import threading
    import time

    import uvicorn

    import http_app
    import opencode_bridge_mcp as bridge
    port = port or free_port()
    # The server's own connection settings (proxy headers off, the head deadline): a test must
    # see the peer addresses the real server sees.
    config = uvicorn.Config(app or bridge.build_app(), host="127.0.0.1", port=port, log_config=None,
                            access_log=False, log_level="warning", timeout_graceful_shutdown=1,
                            **http_app.connection_limits())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def bridge_process(env: dict[str, str] | None = None, log_level: str | None = None) -> Iterator[str]:
    """The real MCP server as users serve it, a process of its own: ``opencode_bridge_mcp.py
    --transport streamable-http`` on a free 127.0.0.1 port, with ``env`` (default: this process's
    environment as it is now; put MCP_BEARER_TOKEN in it for the token the test uses) and
    ``--log-level log_level`` when given. Yields the base URL (``http://127.0.0.1:PORT``, the MCP
    endpoint is ``/mcp``) once /health answers; fails with its stderr if it exits or does not come
    up in 30 s. Ended on leaving (SIGTERM, then up to 30 s for it to exit)."""
    port = free_port()
    argv = [sys.executable, str(ROOT / "opencode_bridge_mcp.py"), "--transport", "streamable-http", "--port", str(port)]
    if log_level:
        argv += ["--log-level", log_level]
    proc = subprocess.Popen(argv, env=env or dict(os.environ), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield base
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def require_pinned(binary: str | None, what: str) -> str:
    """A pinned real binary the tests drive (`./install.sh --test` installs them); a missing one
    skips the test locally and fails it under CI=true, where it must never be silently skipped."""
    import pytest
    if binary and os.access(binary, os.X_OK):
        return binary
    message = f"{what} is not installed: run ./install.sh --test (pinned in package.json)"
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 30) -> None:
    """Wait until a server started as `proc` answers 200 on `base`/health (Host 127.0.0.1);
    fail with its stderr if it exits or does not come up in `timeout` seconds."""
    import time

    import httpx2
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx2.get(f"{base}/health").status_code == 200:
                return
        except httpx2.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.1)


NORMAL_USER = "taskbridge-test"


def normal_user() -> pwd.struct_passwd | None:
    """The non-root user the steps run as: None when this process is not root (it is one
    already); created when missing; skips when root cannot create it."""
    import shutil

    import pytest
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(NORMAL_USER)
    except KeyError:
        pass
    if not shutil.which("useradd"):
        pytest.skip("running as root without useradd: cannot drop to a normal user")
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", NORMAL_USER],
                   capture_output=True)
    try:
        return pwd.getpwnam(NORMAL_USER)
    except KeyError:
        pytest.skip(f"could not create the user {NORMAL_USER}")


@contextlib.contextmanager
def worker_process(env: dict[str, str], out: Path, *args: str) -> Iterator[subprocess.Popen]:
    """``worker.py ARGS`` with ``env`` as a process of its own session, its output appended to
    ``out``; ended on leaving (SIGTERM to its whole group, SIGKILL after 60 s)."""
    import signal
    with open(out, "ab") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), *args], env=env, cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


AGENT_DONE = '```json\n{"summary": "tried", "files_touched": [], "tests_run": [], "open_questions": []}\n```'


def bash_step(command: str, what: str = "probe") -> Any:
    """A scripted model step: one bash tool call running ``command``."""
    from fake_openai import tool_call
    return tool_call("bash", {"command": command, "description": what})


def tool_outputs(task: dict) -> str:
    """Every tool output of a task's runs, from its log's event stream (what the model saw), one
    ``tool: output`` block per call."""
    import task_store
    seen = []
    for line in task_store.log_path(task["id"]).read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "tool_use":
            state = event["part"]["state"]
            seen.append(f"{event['part']['tool']}: {state.get('output') or state.get('error') or ''}")
    return "\n".join(seen)


def run_attack(opencode: Any, repo: Path, name: str, commands: list[str], **fields: Any) -> dict:
    """One real worker pass over a task whose scripted agent runs ``commands`` in bash, then ends
    with a receipt; returns the task as stored."""
    import task_store
    from fake_openai import text
    opencode.model.script(name, [*(bash_step(c) for c in commands), text("Tried.\n" + AGENT_DONE)])
    task = submit(repo, script=name, **fields)
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    return task_store.get_task(task["id"])


def until(check: Any, timeout: float = 60.0, what: str = "the condition", every: float = 0.1) -> Any:
    """Poll ``check()`` every ``every`` seconds until it returns something truthy (returned), for
    up to ``timeout`` seconds; then fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
