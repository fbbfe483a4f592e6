"""A drop-in for ``opencode run --auto --format json --print-logs`` that drives a kept ``opencode serve``.

The worker is to launch this script where it launches a cold ``opencode run``, so its supervision
(stdout JSON lines, stderr, the exit code, SIGTERM/SIGKILL) stays as it is while the task runs on a
pre-started server (engine.py's ``Engine``). It imports the standard library only, so any Python
3.11 runs it (``/usr/bin/python3``, outside the virtualenv); engine.py imports its event mapping.

    python engine_client.py --port PORT --directory DIR --title TITLE [--model provider/model]
                            [--agent NAME] [--session SESSION_ID] [--server-log FILE] [--permission JSON]
                            [--notes FILE --notes-ack FILE]

The prompt is read from stdin to EOF. ``--permission``: a JSON list of OpenCode ruleset entries
``[{"permission", "pattern", "action"}]`` for a new session; a rule denying the ``question`` tool is
always appended (a headless ``opencode run`` denies it too). ``--server-log``: the server's own log
file (``--print-logs --log-level WARN``); every line appended to it after the start is copied to
stderr, as a cold run's stderr carries OpenCode's log lines. Env read: ``OPENCODE_SERVER_PASSWORD``
(HTTP basic auth, user ``opencode``), never taken from argv.

What it does: opens the folder's ``GET /event`` SSE stream first, checks (``--session``) or creates
the session, sends the prompt with ``prompt_async``, then prints the main session's events in the
shapes of ``opencode run --format json`` (``step_start``, ``text``, ``tool_use``, ``step_finish``,
``error``: one JSON object a line, flushed at once) until that session goes idle. Permission asks of
the session and of its sub-agent sessions are approved ``once`` (what ``--auto`` does) and not
printed. SIGTERM / SIGINT / SIGHUP abort the session (OpenCode kills its bash children) and exit.

Notes that came too late for the running turn (``--notes``: the file the worker writes the task's
undelivered planner notes to, ``{"notes": [{"id", "author", "text"}]}``; ``--notes-ack``: where the
note courier plugin acknowledges those it gave the model, ``{"delivered": [{"id"}]}``): when the
session goes idle with notes in the first file that are in neither the second nor sent already,
they go to the session as its next turn, announced first by a line of TaskBridge's own,
``{"type": "note_turn", "timestamp": ms, "sessionID", "notes": [ids]}``, and the events are
followed to idle again. (A cold ``opencode run`` ends at idle: such a note waits for a later
attempt there.)

Exit codes: 0 idle with no ``error`` event printed; 1 an ``error`` event was printed, the
``--session`` is unknown (``Error: Session not found``, as ``opencode run -s`` says) or the server
refused a request; 3 (``ENGINE_GONE``) the engine cannot be reached, refuses the password, or its
stream ends, breaks or is silent for ``STREAM_TIMEOUT`` seconds before idle; 128 + the signal
(143, 130, 129) after a signal. Every failure is one line on stderr; stdout carries only events.

Formats: OpenCode 1.18.33's ``/event`` stream (``data: {"type", "properties"}`` lines) and the
``--format json`` shapes of the same version (docs: shared/reference/opencode.md).
"""
from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, NoReturn

ENGINE_GONE = 3          # exit code: the engine died or cannot be used (the worker replaces it, requeues)
STREAM_TIMEOUT = 120.0   # seconds without a byte on /event (the server sends a heartbeat every ~10 s)
REQUEST_TIMEOUT = 60.0   # seconds for one API call (a session in a folder not yet loaded takes seconds)
ABORT_TIMEOUT = 2.0      # seconds for the abort sent on a signal
LOG_POLL = 0.1           # seconds between two reads of --server-log
NOTES_HANDOFF = 2.0      # seconds a late note's turn waits for the worker to take it off --notes
USER = "opencode"        # OpenCode's default basic-auth user (OPENCODE_SERVER_USERNAME)
DENY_QUESTIONS = {"permission": "question", "pattern": "*", "action": "deny"}
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# -- the event mapping (engine.py imports it) -----------------------------------------------------

def session_of(props: dict[str, Any]) -> str | None:
    """The session id an event's ``properties`` belong to (``sessionID``, else ``part.sessionID``;
    ``info.id`` for ``session.created`` / ``session.updated``), or None."""
    part, info = props.get("part"), props.get("info")
    found = (props.get("sessionID") or (part.get("sessionID") if isinstance(part, dict) else None)
             or (info.get("id") if isinstance(info, dict) else None))
    return str(found) if found else None


def cold_type(part: dict[str, Any]) -> str | None:
    """The ``--format json`` type of a finished part (None while it is still streaming, or for a
    part a cold run does not print)."""
    kind = part.get("type")
    if kind == "step-start":
        return "step_start"
    if kind == "step-finish":
        return "step_finish"
    if kind == "text" and (part.get("time") or {}).get("end"):
        return "text"
    if kind == "tool" and (part.get("state") or {}).get("status") in ("completed", "error"):
        return "tool_use"
    return None


def cold_event(kind: Any, props: dict[str, Any], seen: set[tuple[str, str]]) -> dict[str, Any] | None:
    """One server event (``type`` ``kind``, ``properties`` ``props``) as the event a cold run prints:
    ``{"type", "timestamp" (ms), "sessionID", "part" | "error"}``, or None when it has none. A part
    is emitted once, when finished: ``seen`` holds the ``(part id, type)`` pairs already emitted
    (the caller keeps it for the stream's life)."""
    session = session_of(props)
    now = int(time.time() * 1000)
    if kind == "session.error":
        return {"type": "error", "timestamp": now, "sessionID": session, "error": props.get("error")}
    part = props.get("part")
    if kind != "message.part.updated" or not isinstance(part, dict):
        return None
    cold = cold_type(part)
    key = (str(part.get("id")), str(cold))
    if not cold or key in seen:
        return None
    seen.add(key)
    return {"type": cold, "timestamp": now, "sessionID": session, "part": part}


def sse_event(line: bytes) -> dict[str, Any] | None:
    """One line of the ``/event`` stream as its event ``{"type", "properties"}``; None for any other
    line (blank separators, comments, undecodable data)."""
    if not line.startswith(b"data:"):
        return None
    try:
        event = json.loads(line[5:])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def split_model(model: str) -> dict[str, str]:
    """``"provider/model"`` as OpenCode's prompt body wants it: ``{"providerID", "modelID"}``.
    Raises ValueError when a part is missing."""
    provider, slash, name = model.partition("/")
    if not slash or not provider or not name:
        raise ValueError(f"model {model!r} is not provider/model; give it as e.g. anthropic/claude-sonnet-4")
    return {"providerID": provider, "modelID": name}


def prompt_body(text: str, model: str | None = None, agent: str | None = None) -> dict[str, Any]:
    """The body of OpenCode's prompt routes (``prompt_async``, ``message``): ``text`` as the one
    part, with ``model`` (``provider/model``, see split_model) and ``agent`` when given. Raises
    ValueError for a model without its provider."""
    body: dict[str, Any] = {"parts": [{"type": "text", "text": text}]}
    if model:
        body["model"] = split_model(model)
    if agent:
        body["agent"] = agent
    return body


def basic_auth(password: str) -> str:
    """The ``Authorization`` header value for user ``opencode`` and ``password``."""
    return "Basic " + base64.b64encode(f"{USER}:{password}".encode()).decode()


# -- talking to the server ------------------------------------------------------------------------

class ClientError(Exception):
    """A failure worth one stderr line and exit 1 (unknown session, a request the server refused:
    ``status`` its HTTP status, 0 when no request was made)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class EngineGone(Exception):
    """The engine cannot be used (unreachable, wrong password, stream ended): one line, exit 3."""


class Stopped(BaseException):
    """A signal arrived (``signum``). A BaseException so no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Server:
    """The HTTP API of the ``opencode serve`` on 127.0.0.1:``port``, for the folder ``directory``."""

    def __init__(self, port: int, directory: str, password: str) -> None:
        self.port, self.directory, self.auth = port, directory, basic_auth(password)

    def gone(self, what: str) -> EngineGone:
        """The exit-3 error: ``Error: the OpenCode engine on 127.0.0.1:PORT <what>``."""
        return EngineGone(f"Error: the OpenCode engine on 127.0.0.1:{self.port} {what}")

    def path(self, path: str) -> str:
        """``path`` with the folder as its ``?directory=`` query."""
        return f"{path}?directory={urllib.parse.quote(self.directory)}"

    def connect(self, method: str, path: str, body: Any, timeout: float) -> http.client.HTTPResponse:
        """Send one request and return the answer with its body unread. Raises EngineGone when the
        server cannot be reached or refuses the password (HTTP 401)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Authorization": self.auth, "Accept": "application/json, text/event-stream",
                   "Content-Type": "application/json"}
        try:
            conn.request(method, self.path(path), body=None if body is None else json.dumps(body),
                         headers=headers)
            answer = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise self.gone(f"cannot be reached ({method} {path}: {exc.__class__.__name__}: {exc})") from None
        if answer.status == 401:
            conn.close()
            raise self.gone("refused the password (HTTP 401); check OPENCODE_SERVER_PASSWORD")
        return answer

    def call(self, method: str, path: str, body: Any = None, timeout: float = REQUEST_TIMEOUT) -> Any:
        """One API call; the decoded JSON answer (None when empty). Raises EngineGone as ``connect``
        (also for no answer within ``timeout`` seconds), ClientError for another HTTP error."""
        answer = self.connect(method, path, body, timeout)
        try:
            data = answer.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self.gone(f"broke off its answer to {method} {path} ({exc.__class__.__name__})") from None
        finally:
            answer.close()
        if answer.status >= 400:
            said = data[:300].decode("utf-8", "replace").replace("\n", " ")
            raise ClientError(f"Error: opencode serve refused {method} {path}: HTTP {answer.status} {said}",
                              answer.status)
        return json.loads(data) if data.strip() else None

    def stream(self) -> http.client.HTTPResponse:
        """The folder's ``/event`` SSE stream, read with a ``STREAM_TIMEOUT`` per read."""
        answer = self.connect("GET", "/event", None, STREAM_TIMEOUT)
        if answer.status >= 400:
            raise ClientError(f"Error: opencode serve refused its event stream: HTTP {answer.status}")
        return answer


# -- one run --------------------------------------------------------------------------------------

class Run:
    """One prompt in one session, followed to idle. ``args``: the parsed command line."""

    def __init__(self, args: argparse.Namespace, server: Server) -> None:
        self.args, self.server = args, server
        self.session_id: str | None = args.session
        self.family: set[str] = set()    # the main session and its sub-agents' sessions
        self.seen: set[tuple[str, str]] = set()
        self.errors = 0
        self.notes_sent: set[Any] = set()   # ids of the notes sent as a turn of their own

    def start(self, prompt: str) -> http.client.HTTPResponse:
        """Open the stream, check or create the session, send the prompt; returns the stream."""
        stream = self.server.stream()   # first: events sent before it opens are lost
        if self.session_id:
            self.check_session(self.session_id)
        else:
            body = {"title": self.args.title, "permission": [*self.args.permission, DENY_QUESTIONS]}
            self.session_id = str(self.server.call("POST", "/session", body)["id"])
        self.family.add(self.session_id)
        self.prompt(prompt)
        return stream

    def prompt(self, text: str) -> None:
        """Send ``text`` as the session's next turn (``prompt_async``) with the run's model and agent."""
        self.server.call("POST", f"/session/{self.session_id}/prompt_async",
                         prompt_body(text, self.args.model, self.args.agent))

    def late_notes(self) -> bool:
        """Send the notes the session has not had (see the module docstring) as its next turn,
        announced by a ``note_turn`` line; False when there are none."""
        if not self.args.notes:
            return False
        acked = {item.get("id") for item in listed(self.args.notes_ack, "delivered")}
        fresh = [note for note in listed(self.args.notes, "notes") if note.get("id") not in acked | self.notes_sent]
        if not fresh:
            return False
        ids = [note.get("id") for note in fresh]
        self.notes_sent.update(ids)
        self.emit({"type": "note_turn", "timestamp": int(time.time() * 1000), "sessionID": self.session_id,
                   "notes": ids})
        # The worker takes them off the notes file once it has read that line; until then the note
        # courier plugin would give them to the new turn's model call a second time.
        deadline = time.monotonic() + NOTES_HANDOFF
        while time.monotonic() < deadline and set(ids) & {note.get("id") for note in listed(self.args.notes, "notes")}:
            time.sleep(0.05)
        self.prompt("\n\n".join(
            f"A note from the planner ({note.get('author')}), sent while you worked on this task; take it "
            f"into account now:\n\n{note.get('text')}" for note in fresh))
        return True

    def check_session(self, session_id: str) -> None:
        """Raise ClientError with what ``opencode run -s`` prints when the session does not exist."""
        try:
            self.server.call("GET", f"/session/{session_id}")
        except ClientError as exc:
            raise ClientError("Error: Session not found") if exc.status == 404 else exc from None

    def follow(self, stream: http.client.HTTPResponse) -> int:
        """Print the session's events until it goes idle; the exit code (1 if an error was printed).
        Raises EngineGone when the stream ends, breaks or stays silent ``STREAM_TIMEOUT`` seconds."""
        while True:
            try:
                line = stream.readline()
            except (OSError, http.client.HTTPException) as exc:
                raise self.server.gone(f"broke or went silent on its event stream before the session went "
                                       f"idle ({exc.__class__.__name__}: {exc})") from None
            if not line:
                raise self.server.gone("closed its event stream before the session went idle (did it die?)")
            event = sse_event(line)
            if event and self.handle(event.get("type"), event.get("properties")) and not self.late_notes():
                return 1 if self.errors else 0

    def handle(self, kind: Any, props: Any) -> bool:
        """Act on one server event; True once the main session is idle."""
        if not isinstance(props, dict):
            return False
        session = session_of(props)
        if kind in ("session.created", "session.updated"):
            if (props.get("info") or {}).get("parentID") in self.family and session:
                self.family.add(session)
        elif kind == "permission.asked" and session in self.family:
            self.approve(str(props.get("id")))
        elif session == self.session_id:
            if kind == "session.idle":
                return True
            self.emit(cold_event(kind, props, self.seen))
        return False

    def approve(self, request_id: str) -> None:
        """Answer a permission ask ``once``, as ``--auto`` does. A refused answer (the ask was
        already settled) is named on stderr and the run goes on."""
        try:
            self.server.call("POST", f"/permission/{request_id}/reply", {"reply": "once"})
        except ClientError as exc:
            print(f"{exc} (permission ask {request_id})", file=sys.stderr, flush=True)

    def emit(self, event: dict[str, Any] | None) -> None:
        """Print one cold-run event as a JSON line, flushed at once."""
        if event is None:
            return
        self.errors += event["type"] == "error"
        sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    def abort(self) -> None:
        """Stop the session's turn (OpenCode kills its bash children); errors are ignored: the
        client is exiting anyway."""
        if not self.session_id:
            return
        try:
            self.server.call("POST", f"/session/{self.session_id}/abort", timeout=ABORT_TIMEOUT)
        except (EngineGone, ClientError):
            pass


# -- the server's log -----------------------------------------------------------------------------

class LogTail:
    """Copies the lines appended to ``path`` after the start to stderr: a daemon thread reads it
    every ``LOG_POLL`` seconds; ``finish`` stops it and copies what is left. A missing or
    unreadable file copies nothing; a file that shrank (rotated) is read from its start."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.offset = self.size()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="server-log", daemon=True)
        self.thread.start()

    def size(self) -> int:
        """The file's size in bytes (0 when it cannot be read)."""
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def loop(self) -> None:
        """The thread: copy whole new lines every ``LOG_POLL`` seconds until ``finish``."""
        while not self.done.wait(LOG_POLL):
            self.copy(whole_lines=True)

    def copy(self, whole_lines: bool) -> None:
        """Write the new bytes to stderr (up to the last newline when ``whole_lines``)."""
        if self.size() < self.offset:
            self.offset = 0
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except OSError:
            return
        if whole_lines:
            data = data[:data.rfind(b"\n") + 1]
        if data:
            self.offset += len(data)
            sys.stderr.write(data.decode("utf-8", "replace"))
            sys.stderr.flush()

    def finish(self) -> None:
        """Stop the thread and copy the rest (also a last line without its newline)."""
        self.done.set()
        self.thread.join(timeout=1.0)
        self.copy(whole_lines=False)


# -- the command line -----------------------------------------------------------------------------

def listed(path: str | None, key: str) -> list[dict[str, Any]]:
    """The objects listed under ``key`` in the JSON file ``path``; [] when it is unset, missing,
    unreadable, caught mid-write or not of that shape."""
    if not path:
        return []
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return []
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def ruleset(text: str) -> list[dict[str, str]]:
    """``--permission``: a JSON list of ``{"permission", "pattern", "action"}`` objects."""
    try:
        rules = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(rules, list) or not all(
            isinstance(r, dict) and {"permission", "pattern", "action"} <= r.keys() for r in rules):
        raise argparse.ArgumentTypeError('give a list of {"permission", "pattern", "action"} objects')
    return rules


def model_name(text: str) -> str:
    """``--model``: ``provider/model``."""
    try:
        split_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); argparse exits 2 on a bad one."""
    parser = argparse.ArgumentParser(description="Run one prompt on a kept `opencode serve`, printing "
                                     "`opencode run --format json` events. The prompt is read from stdin.")
    parser.add_argument("--port", type=int, required=True, help="the server's port on 127.0.0.1")
    parser.add_argument("--directory", required=True, help="the folder the session works in")
    parser.add_argument("--title", required=True, help="a new session's title (the run marker)")
    parser.add_argument("--model", type=model_name, help="provider/model (default: the server's config)")
    parser.add_argument("--agent", help="the OpenCode agent (default: build)")
    parser.add_argument("--session", help="continue this session instead of creating one")
    parser.add_argument("--server-log", help="the server's log file: new lines are copied to stderr")
    parser.add_argument("--notes", help="the task's undelivered notes (JSON), sent as a turn when they come late")
    parser.add_argument("--notes-ack", help="the note courier plugin's acknowledgements (JSON)")
    parser.add_argument("--permission", type=ruleset, default=[],
                        help='a new session\'s ruleset: JSON [{"permission","pattern","action"}]')
    return parser.parse_args(argv)


def stop_on_signal(signum: int, _frame: Any) -> NoReturn:
    # Raising rather than setting a flag: the main thread sits in a socket read for up to
    # STREAM_TIMEOUT seconds, and an exception is what breaks it off at once (as KeyboardInterrupt
    # does). The handlers are reset to "ignore" before the abort, so it is not broken off in turn.
    raise Stopped(signum)


def drive(run: Run, prompt: str) -> int:
    """Start the run and follow it; the exit code. Raises Stopped, EngineGone, ClientError."""
    if not prompt.strip():
        raise ClientError("Error: no prompt on stdin")
    stream = run.start(prompt)
    try:
        return run.follow(stream)
    finally:
        stream.close()


def main(argv: list[str] | None = None) -> int:
    """Parse, run, report; returns the exit code (see the module docstring)."""
    args = parse_args(argv)
    for signum in SIGNALS:
        signal.signal(signum, stop_on_signal)
    tail = LogTail(args.server_log) if args.server_log else None
    run = Run(args, Server(args.port, args.directory, os.environ.get("OPENCODE_SERVER_PASSWORD", "")))
    message = ""
    try:
        code = drive(run, sys.stdin.read())
    except Stopped as stop:
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        run.abort()
        code = 128 + stop.signum
    except EngineGone as exc:
        message, code = str(exc), ENGINE_GONE
    except ClientError as exc:
        message, code = str(exc), 1
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if tail:
        tail.finish()
    if message:
        print(message, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
