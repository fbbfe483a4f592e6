"""The warm engine: a kept ``opencode serve`` driven through its HTTP API (issue 21, its foundation).

An ``Engine`` starts ``opencode serve`` on a free 127.0.0.1 port with a password of its own (HTTP
basic auth, user ``opencode``, from ``OPENCODE_SERVER_PASSWORD``), in the environment a run would
get (build it with ``opencode_runner.run_env``), optionally wrapped by a box (``box(argv, env) ->
(argv, env)``, the shape ``run_env`` takes: e.g. agent_box's bubblewrap argv for one slot). It waits
for ``GET /global/health``, then creates sessions in a folder with a permission ruleset, sends
prompts asynchronously, follows a session's events on the ``/event`` SSE stream (mapped to the
event shapes of ``opencode run --format json``, so ``opencode_runner.EventStream`` totals them as
it does for a cold run), answers permission asks, aborts a session, and stops the server with
its whole process tree (process_tree.py, plus a sweep by the engine's environment tag).

Not yet used by worker.py: the next step wires it in (see the design note in the branch's report).

Env read at call time: ``OPENCODE_BIN`` (through ``opencode_runner.opencode_bin``). Imports the
standard library, psutil, process_tree, opencode_runner and engine_client (the one copy of the event
mapping, shared with the drop-in client the worker is to launch); no SQL; not run on its own.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import secrets
import socket
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

import agent_box
import engine_client
import opencode_runner
import process_tree
import redaction

ENGINE_ENV = "TASKBRIDGE_ENGINE"   # the tag every process of one engine inherits (the stop's sweep)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
Box = Callable[[list[str], dict[str, str]], tuple[list[str], dict[str, str]]]


class EngineError(RuntimeError):
    """Something about the engine failed; the message is one line naming the cause and the way out."""


class EngineStartFailed(EngineError):
    """``opencode serve`` could not start: binary missing, port taken, config error, no health in time."""


class EngineGone(EngineError):
    """The server died or stopped answering within the timeout; replace it (and requeue the attempt)."""


class EngineRefused(EngineError):
    """The server answered a request with an HTTP error (``status``: 401 bad password, 404, 400...)."""

    def __init__(self, message: str, status: int, body: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.body = status, body


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; a race is possible and
    shows up as EngineStartFailed naming the port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prompt_body(text: str, model: str | None = None, agent: str | None = None) -> dict[str, Any]:
    """engine_client.prompt_body: ``text`` with ``model`` (``provider/model`` as OpenCode's
    ``{"providerID", "modelID"}``) and ``agent``. Raises EngineError when the model has no ``/``."""
    try:
        return engine_client.prompt_body(text, model, agent)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (a bind there fails)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def start_problem(log_text: str, port: int, exit_code: int | None) -> str:
    """One line for a server that did not come up: the port taken (OpenCode itself says only
    "Unexpected error / ServeError"), else the last line it printed and how it ended."""
    lines = [ANSI.sub("", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line]
    if exit_code is not None and port_in_use(port):
        return (f"opencode serve could not listen on 127.0.0.1:{port}: the port is in use; "
                "free it or let the engine pick one")
    last = " / ".join(lines[-2:])[:300] if lines else "no output"
    how = f"exited with code {exit_code}" if exit_code is not None else "gave no health answer in time"
    return f"opencode serve {how} ({last}); run `tasks_cli.py doctor`"


def config_problem(body: bytes) -> str:
    """One line for OpenCode's ``ConfigInvalidError`` answer: where the bad config came from and
    each issue (``path: message``)."""
    try:
        error = json.loads(body)
        data = error.get("data") or {}
        issues = "; ".join(f"{'.'.join(map(str, i.get('path') or [])) or '(top)'}: {i.get('message')}"
                           for i in data.get("issues") or [])
        said = f"{error.get('name')} in {data.get('path')}: {issues or data.get('message')}"
    except (ValueError, AttributeError, TypeError):
        said = body[:300].decode("utf-8", "replace")
    return f"opencode serve refused its configuration ({said[:400]}); fix it (OPENCODE_CONFIG, OPENCODE_CONFIG_CONTENT)"


class Engine:
    """One kept ``opencode serve`` process and a small client of its HTTP API.

    ``env``: the server's whole environment (e.g. ``opencode_runner.run_env(...)`` over an
    allowlisted base); the password, the engine tag and ``PWD`` are added. ``cwd``: the folder the
    server starts in (sessions name their own folder). ``box``: wraps the argv and env (None: no
    box). ``start_timeout``: seconds for the whole start; ``request_timeout``: seconds for one API
    call. Use as a context manager, or call ``start`` and ``stop``.
    """

    def __init__(self, env: dict[str, str], cwd: str, *, box: Box | None = None,
                 start_timeout: float = 90.0, request_timeout: float = 10.0) -> None:
        self.env, self.cwd, self.box = dict(env), cwd, box
        self.start_timeout, self.request_timeout = start_timeout, request_timeout
        self.password = secrets.token_urlsafe(24)
        self.tag = "eng-" + secrets.token_hex(6)
        self.port = 0
        self.argv: list[str] = []   # the server's command, unboxed (set by ``launch``)
        self.shell: str | None = None   # its $SHELL, as the box set it (set by ``launch``)
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> Engine:
        # ``with Engine(...).start() as eng`` is common: a started engine is not started twice.
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (the port is 0 before ``start``)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None) -> Engine:
        """Start the server on ``port`` (default: a free one) and wait for its health answer
        (``launch`` then ``wait_ready``). Raises EngineStartFailed as those do."""
        self.launch(port)
        return self.wait_ready()

    def launch(self, port: int | None = None) -> Engine:
        """Start the server process on ``port`` (default: a free one) without waiting for it.
        Call it from a thread that outlives the server: a box made with bubblewrap's
        ``--die-with-parent`` dies with the thread that started it (Linux's parent-death signal
        follows the thread). Raises EngineStartFailed (the binary missing)."""
        try:
            binary = opencode_runner.opencode_bin()
        except opencode_runner.OpencodeNotFound as exc:
            raise EngineStartFailed(str(exc)) from None
        self.port = port or free_port()
        argv = self.argv = [binary, "serve", "--hostname", "127.0.0.1", "--port", str(self.port),
                            "--print-logs", "--log-level", "WARN"]
        env = {**self.env, "PWD": self.cwd}
        # Under run_reaper.py (a child subreaper): a daemon the agent detaches with a cleared
        # environment stays in the server's tree, where the stop finds and ends it; and the
        # server ends with the thread that started it (a killed worker leaves none behind).
        status = os.open(os.devnull, os.O_WRONLY)
        try:   # closed however the launch ends (a box hook or the log file may fail first)
            self._spawn(argv, env, status)
        finally:
            os.close(status)
        return self

    def _spawn(self, argv: list[str], env: dict[str, str], status: int) -> None:
        """Start ``argv`` (``opencode serve``) under run_reaper.py and the box, ``status`` the
        reaper's status descriptor, its output in a log file of its own (``log_path``)."""
        python = agent_box.stdlib_python()
        plain = process_tree.reaper_argv(python, status, argv, die_with_parent=True, parent=os.getpid())
        if self.box is None:
            argv = plain
        else:
            boxed, boxed_env = self.box(plain, env)
            if boxed != plain:   # a box with pids of its own (bubblewrap): the reaper cannot name this process
                boxed, boxed_env = self.box(process_tree.reaper_argv(python, status, argv, die_with_parent=True), env)
            argv, env = boxed, boxed_env
        # Set after the box has had its say: an allowlisting box must not drop the password or the
        # tag the stop's sweep finds every process by.
        env = {**env, "OPENCODE_SERVER_PASSWORD": self.password, ENGINE_ENV: self.tag}
        # Its non-shell children (MCP servers, LSPs) inherit it: what they print is redacted.
        redaction.hold(self.password, "opencode server password")
        self.shell = env.get("SHELL")   # what the bash tool runs its commands with (a box's own shell)
        env.pop("OPENCODE_SERVER_USERNAME", None)
        fd, log = tempfile.mkstemp(prefix="opencode-serve-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "wb") as log_file:
            # Its own session: the stop ends the whole group, and a Ctrl-C at the worker's terminal
            # does not reach the server before the worker decides.
            self.proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                         stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(status,))

    def wait_ready(self) -> Engine:
        """Wait for the launched server's health answer, then load its folder's config. Raises
        EngineStartFailed (one line: port in use, config error, no answer within ``start_timeout``
        seconds); the half-started process tree is ended first."""
        self._wait_healthy()
        self._check_config()
        return self

    def _check_config(self) -> None:
        # The health answer comes before any config is read: a bad config only shows on the first
        # call that loads the folder. Loading it here names it at start (and warms that folder).
        try:
            self.request("GET", "/config", directory=self.cwd, timeout=max(self.request_timeout, 60))
        except EngineRefused as exc:
            self.stop()
            raise EngineStartFailed(config_problem(exc.body) if exc.status == 400 else str(exc)) from None
        except EngineGone as exc:
            self.stop()
            raise EngineStartFailed(str(exc)) from None

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError, EngineError, ValueError):
                if self.health(timeout=1.0).get("healthy"):
                    return
            time.sleep(0.1)
        problem = start_problem(self.log_tail(), self.port, self.proc.poll() if self.proc else None)
        self.stop()
        raise EngineStartFailed(problem)

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the server's stdout and stderr ("" before start)."""
        if not self.log_path:
            return ""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(max(0, os.path.getsize(self.log_path) - chars))
            return log.read().decode("utf-8", "replace")
        return ""

    def alive(self) -> bool:
        """Whether the server process is still running (not whether it answers: see ``health``)."""
        return self.proc is not None and self.proc.poll() is None

    def auth_header(self, password: str | None = None) -> str:
        """The ``Authorization`` value for ``password`` (default: the engine's own)."""
        return engine_client.basic_auth(password or self.password)

    def request(self, method: str, path: str, body: Any = None, *, directory: str | None = None,
                timeout: float | None = None, password: str | None = None) -> Any:
        """One API call: ``method path`` (``?directory=`` added when given) with a JSON ``body``;
        returns the decoded JSON answer (None for an empty one).

        Raises EngineRefused (HTTP status >= 400, its status kept; or an answer that is not JSON,
        such as the web app's page OpenCode serves for a path it does not know), EngineGone (no
        connection or no answer within ``timeout`` seconds, default ``request_timeout``)."""
        if directory:
            path += ("&" if "?" in path else "?") + "directory=" + urllib.parse.quote(directory)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout or self.request_timeout)
        headers = {"Authorization": self.auth_header(password), "Accept": "application/json",
                   "Content-Type": "application/json"}
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            answer = conn.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException) as exc:
            raise EngineGone(f"opencode serve on port {self.port} did not answer {method} {path.split('?')[0]} "
                             f"({exc.__class__.__name__}: {exc}); replace the engine") from None
        finally:
            conn.close()
        if answer.status >= 400:
            raise EngineRefused(f"opencode serve refused {method} {path.split('?')[0]}: HTTP {answer.status} "
                                f"{data[:200].decode('utf-8', 'replace')}", answer.status, data)
        try:
            return json.loads(data) if data.strip() else None
        except ValueError:
            raise EngineRefused(f"opencode serve answered {method} {path.split('?')[0]} with no JSON (HTTP "
                                f"{answer.status}: {data[:80].decode('utf-8', 'replace')!r})", answer.status,
                                data) from None

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """``GET /global/health``: ``{"healthy": true, "version": "1.18.33"}``. Raises as ``request``."""
        answer = self.request("GET", "/global/health", timeout=timeout)
        return answer if isinstance(answer, dict) else {}

    def create_session(self, directory: str, title: str,
                       permission: list[dict[str, str]] | None = None) -> str:
        """A new session in ``directory`` titled ``title`` (the run marker) carrying ``permission``,
        OpenCode's ruleset ``[{"permission": tool, "pattern": glob, "action": allow|ask|deny}]``;
        returns its id. The first session in a folder the server has not opened costs seconds
        (it loads the project), later ones tens of ms. Raises as ``request``."""
        body: dict[str, Any] = {"title": title}
        if permission:
            body["permission"] = permission
        answer = self.request("POST", "/session", body, directory=directory, timeout=max(self.request_timeout, 60))
        return str(answer["id"])

    def prompt(self, session_id: str, directory: str, text: str, *, model: str | None = None,
               agent: str | None = None) -> None:
        """Send ``text`` to the session without waiting for the answer (``prompt_async``; follow it
        with ``events``). ``model``: ``provider/model`` (default: the config's). Raises as ``request``."""
        self.request("POST", f"/session/{session_id}/prompt_async", prompt_body(text, model, agent),
                     directory=directory)

    def warm_up(self, directory: str, warm_up_file: Path, model: str | None = None,
                agent: str | None = None) -> None:
        """Open ``directory`` ahead of its task: one prompt, in a session of its own, goes as far
        as the model call, which the warm-up stop refuses (``warm_up.js``: the server must run with
        ``opencode_runner.with_warm_up(env, warm_up_file)``; this writes the session's id there
        first). The project, its config, the ``agent``'s tools and the ``model``'s provider are
        then loaded, and the task's first prompt there reaches the model in ~0.1–0.2 s instead
        of 1–2.5 s. Nothing is sent to the model, and the session is deleted after. Raises
        EngineGone (the server does not answer within 120 s); the stop's refusal is the expected end."""
        session_id = self.create_session(directory, "taskbridge-warm-up")
        partial = warm_up_file.with_name(warm_up_file.name + ".tmp")
        partial.write_text(json.dumps({"session": session_id}))
        os.replace(partial, warm_up_file)
        with contextlib.suppress(EngineRefused):
            self.request("POST", f"/session/{session_id}/message", prompt_body("warm-up", model, agent),
                         directory=directory, timeout=max(self.request_timeout, 120))
        with contextlib.suppress(EngineRefused):   # not left in OpenCode's session list
            self.request("DELETE", f"/session/{session_id}", directory=directory)

    def abort(self, session_id: str, directory: str) -> None:
        """Stop the session's turn: the model request is cancelled and its bash tool commands are
        killed by OpenCode. Raises as ``request``."""
        self.request("POST", f"/session/{session_id}/abort", directory=directory)

    def release(self, directory: str) -> None:
        """Unload ``directory`` from the server (``POST /instance/dispose``): its project state, file
        watcher and LSP go; a later session there loads it again (seconds). Call it when a task's
        worktree is done with, or every folder stays loaded. Raises as ``request``."""
        self.request("POST", "/instance/dispose", directory=directory, timeout=max(self.request_timeout, 30))

    def reply_permission(self, request_id: str, directory: str, reply: str) -> None:
        """Answer a permission ask (``permission_asked`` event's ``id``) with ``once``, ``always`` or
        ``reject``. Raises as ``request``."""
        self.request("POST", f"/permission/{request_id}/reply", {"reply": reply}, directory=directory)

    def session(self, session_id: str, directory: str) -> dict[str, Any]:
        """``GET /session/{id}``: the session with its totals (``cost`` USD, ``tokens``). Raises as ``request``."""
        answer = self.request("GET", f"/session/{session_id}", directory=directory)
        return answer if isinstance(answer, dict) else {}

    def events(self, directory: str, read_timeout: float = 60.0) -> SessionEvents:
        """Open the ``/event`` stream of ``directory`` (open it BEFORE sending the prompt, or the
        first events are missed). ``read_timeout``: seconds without a byte (the server sends a
        heartbeat every ~10 s) before EngineGone. Raises as ``request``."""
        return SessionEvents(self, directory, read_timeout)

    def processes(self) -> list[psutil.Process]:
        """The server and every live process it started (also those in sessions of their own)."""
        found = {p.pid: p for p in process_tree.tagged_processes({ENGINE_ENV: self.tag})}
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(*process_tree.GONE):
                root = psutil.Process(self.proc.pid)
                found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        return list(found.values())

    def rss(self) -> int:
        """Resident memory in bytes of the whole tree (the server and its children)."""
        total = 0
        for proc in self.processes():
            with contextlib.suppress(*process_tree.GONE):
                total += proc.memory_info().rss
        return total

    def stop(self, grace: float = 3.0) -> int:
        """End the server and its whole process tree (SIGTERM, ``grace`` seconds, SIGKILL; then a
        sweep by the engine's tag); returns how many processes were signalled. Safe to repeat."""
        signalled = 0
        if self.proc is not None:
            signalled = process_tree.kill_tree(
                self.proc.pid, grace, lambda: process_tree.tagged_processes({ENGINE_ENV: self.tag}))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if self.log_path:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            self.log_path = None
        redaction.release(self.password)
        return signalled


class SessionEvents:
    """The ``/event`` SSE stream of one folder, read as ``opencode run --format json`` events.

    ``follow(session_id)`` yields, for that session only: ``step_start``, ``text`` (a finished
    text part), ``tool_use`` (a finished tool call), ``step_finish`` (tokens, cost), ``error``
    (``session.error``), ``permission_asked`` and ``question_asked`` (the ask, with its ``id``),
    and stops after ``session.idle``. A context manager: closing drops the connection.
    """

    def __init__(self, engine: Engine, directory: str, read_timeout: float) -> None:
        self.engine, self.read_timeout = engine, read_timeout
        path = "/event?directory=" + urllib.parse.quote(directory)
        self.conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=read_timeout)
        try:
            self.conn.request("GET", path, headers={"Authorization": engine.auth_header(),
                                                    "Accept": "text/event-stream"})
            self.answer = self.conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self.conn.close()
            raise EngineGone(f"opencode serve on port {engine.port} did not open its event stream ({exc})") from None
        if self.answer.status >= 400:
            self.conn.close()
            raise EngineRefused(f"opencode serve refused the event stream: HTTP {self.answer.status}",
                                self.answer.status)
        self._seen: set[tuple[str, str]] = set()

    def __enter__(self) -> SessionEvents:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop the stream's connection."""
        self.conn.close()

    def raw(self) -> Iterator[dict[str, Any]]:
        """Every server event as sent (``{"type", "properties"}``). Raises EngineGone when the
        stream ends or is silent for ``read_timeout`` seconds."""
        while True:
            try:
                line = self.answer.readline()
            except (OSError, http.client.HTTPException) as exc:
                raise EngineGone(f"opencode serve's event stream went silent or broke ({exc.__class__.__name__}); "
                                 "replace the engine") from None
            if not line:
                raise EngineGone("opencode serve closed its event stream (did it die?); replace the engine")
            event = engine_client.sse_event(line)
            if event:
                yield event

    def follow(self, session_id: str) -> Iterator[dict[str, Any]]:
        """The session's events in the cold run's shapes (see the class), until it goes idle.
        Raises EngineGone as ``raw``."""
        for event in self.raw():
            props = event.get("properties") or {}
            if not isinstance(props, dict) or engine_client.session_of(props) != session_id:
                continue
            if event.get("type") == "session.idle":
                return
            mapped = self.mapped(event.get("type"), props)
            if mapped:
                yield mapped

    def mapped(self, kind: Any, props: dict[str, Any]) -> dict[str, Any] | None:
        """One server event as a cold run's event (``engine_client.cold_event``; None when it has no
        counterpart; a part is emitted once, when it is finished), or a permission or question ask as
        ``{"type": "permission_asked" | "question_asked", "timestamp", "sessionID", "request"}``."""
        if kind in ("permission.asked", "question.asked"):
            return {"type": kind.replace(".", "_"), "timestamp": int(time.time() * 1000),
                    "sessionID": engine_client.session_of(props), "request": props}
        return engine_client.cold_event(kind, props, self._seen)
