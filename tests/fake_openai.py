"""A scripted OpenAI-compatible chat model on 127.0.0.1, for driving the real `opencode` in tests.

Stdlib only. Usage::

    with ScriptedModel() as model:
        model.script("hello", [
            tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hi\\n"}),
            tool_call("bash", {"command": "echo ran-it", "description": "marker"}),
            text("All done."),
        ])
        # point a client at model.url ("http://127.0.0.1:PORT/v1"); put "SCRIPT:hello" in the prompt

How a request is answered (statelessly, so resumed sessions and parallel tasks share one server):
- the script is the one whose token `SCRIPT:<name>` appears in any message of the request (the
  `default` script when there is none);
- the step is the number of assistant messages already in `messages` (past the last step: the last
  step again if it is text, else the text "done");
- a request without `tools` (OpenCode's session-title generator) gets a short text reply;
- `{cwd}` in step strings becomes the directory named by the system prompt's line
  `Working directory: …`.

Streaming answers use the OpenAI SSE chunk format and end with a usage chunk (`choices: []`);
`stream: false` gets a `chat.completion` object. Reads no environment.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "ScriptedModel",
    "Step",
    "default_usage",
    "hang",
    "http_error",
    "stall_after",
    "text",
    "tool_call",
]

SCRIPT_TOKEN = re.compile(r"SCRIPT:([A-Za-z0-9_\-]+)")  # no ".": "SCRIPT:x." ends a sentence
WORKDIR_LINE = re.compile(r"^\s*Working directory:\s*(.+?)\s*$", re.MULTILINE)
TITLE_REPLY = "Scripted test session"
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


# ---------------------------------------------------------------------------------------------
# steps


@dataclass
class Step:
    """One scripted model answer.

    kind: "text" | "tool_calls" | "http_error" | "hang" | "stall".
    text: the reply text (text, stall); calls: [(tool name, args dict)] (tool_calls);
    status/message/headers: the error response (http_error); usage: overrides merged over
    `default_usage(step)` (keys prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens).
    """

    kind: str
    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 200
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    delay: float = 0.0   # seconds the answer waits after the request arrived
    before: Callable[[str | None], None] | None = None   # called with the cwd before it is answered


def text(s: str, usage: dict[str, int] | None = None, delay: float = 0.0,
         before: Callable[[str | None], None] | None = None) -> Step:
    """A text answer (finish_reason "stop"), sent ``delay`` seconds after the request came. `s`
    may contain `{cwd}`. ``before``: called in the server with the request's working directory
    (or None) before the answer goes out: what the world does while the model "thinks" (a test's
    own change to the worktree, after the agent's tools have run)."""
    return Step(kind="text", text=s, usage=usage, delay=delay, before=before)


def tool_call(
    name: str | list[tuple[str, dict[str, Any]]],
    args: dict[str, Any] | None = None,
    usage: dict[str, int] | None = None,
) -> Step:
    """A tool-call answer (finish_reason "tool_calls").

    `tool_call("bash", {"command": "ls"})` makes one call; `tool_call([("read", {...}),
    ("bash", {...})])` makes several in one step. Strings anywhere in args may contain `{cwd}`.
    Raises ValueError on an empty list or on a single name without an args dict.
    """
    if isinstance(name, list):
        if not name or args is not None:
            raise ValueError("tool_call(list) takes a non-empty [(name, args), ...] and no args")
        calls = [(str(n), dict(a)) for n, a in name]
    else:
        if not isinstance(args, dict):
            raise ValueError(f"tool_call({name!r}, args): args must be a dict of tool arguments")
        calls = [(name, dict(args))]
    return Step(kind="tool_calls", calls=calls, usage=usage)


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> Step:
    """An HTTP error with OpenAI's body shape `{"error": {message, type, param, code}}`.

    headers: extra response headers, e.g. {"retry-after-ms": "10"} to make OpenCode's retry fast.
    """
    return Step(kind="http_error", status=status, message=message, headers=dict(headers or {}))


def hang() -> Step:
    """Accept the request and never answer (until the server stops)."""
    return Step(kind="hang")


def stall_after(s: str) -> Step:
    """Send the SSE head and the text `s` as content chunks, then go silent until the server stops."""
    return Step(kind="stall", text=s)


def default_usage(step: int) -> dict[str, int]:
    """The usage sent for `step` unless overridden: distinct per step so tests can check sums."""
    return {
        "prompt_tokens": 1000 + step * 10,
        "completion_tokens": 50 + step,
        "cached_tokens": 100,
        "reasoning_tokens": 0,
    }


# ---------------------------------------------------------------------------------------------
# reading a request


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the `text` of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict)
        )
    return ""


def find_script_name(messages: list[dict[str, Any]]) -> str | None:
    """The `<name>` of the first `SCRIPT:<name>` token in any message, or None."""
    for message in messages:
        found = SCRIPT_TOKEN.search(_content_text(message.get("content")))
        if found:
            return found.group(1)
    return None


def find_cwd(messages: list[dict[str, Any]]) -> str | None:
    """The directory on the system prompt's `Working directory:` line, or None."""
    for message in messages:
        if message.get("role") == "system":
            found = WORKDIR_LINE.search(_content_text(message.get("content")))
            if found:
                return found.group(1)
    return None


def count_assistant_messages(messages: list[dict[str, Any]]) -> int:
    """How many assistant turns the request already carries: the index of the step to answer."""
    return sum(1 for message in messages if message.get("role") == "assistant")


def _substitute(value: Any, cwd: str | None) -> Any:
    """Replace `{cwd}` in every string of `value` (nested dicts and lists included)."""
    if isinstance(value, str):
        if "{cwd}" in value and cwd is None:
            raise LookupError("no 'Working directory:' line in the system prompt to fill {cwd}")
        return value.replace("{cwd}", cwd) if cwd is not None else value
    if isinstance(value, dict):
        return {k: _substitute(v, cwd) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(v, cwd) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# writing a response


def _usage_body(usage: dict[str, int]) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
        "completion_tokens_details": {"reasoning_tokens": usage["reasoning_tokens"]},
    }


def _error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error JSON for `status`."""
    if status == 429:
        kind, code = "requests", "rate_limit_exceeded"
    elif status >= 500:
        kind, code = "server_error", None
    elif status == 401:
        kind, code = "invalid_request_error", "invalid_api_key"
    else:
        kind, code = "invalid_request_error", None
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _chunks(s: str) -> list[str]:
    """`s` cut in pieces so clients see a real stream: 12 characters each, at most ~16 pieces."""
    size = max(12, -(-len(s) // 16))
    return [s[i : i + size] for i in range(0, len(s), size)] or [""]


def _tool_call_deltas(calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Stream deltas for tool calls: a head (id, name) then the arguments in two halves."""
    deltas: list[dict[str, Any]] = []
    for index, (name, args) in enumerate(calls):
        arguments = json.dumps(args)
        half = len(arguments) // 2
        deltas.append({"tool_calls": [{
            "index": index, "id": f"call_{uuid.uuid4().hex[:20]}", "type": "function",
            "function": {"name": name, "arguments": ""},
        }]})
        for piece in (arguments[:half], arguments[half:]):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas


class _Reply:
    """What one request gets: a resolved step (cwd filled) and its usage."""

    def __init__(self, step: Step, usage: dict[str, int]) -> None:
        self.step = step
        self.usage = usage
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def chunk(self, model: str, delta: dict | None, finish: str | None = None) -> dict[str, Any]:
        """One `chat.completion.chunk` object."""
        choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": model, "choices": [choice]}

    def stream_body_chunks(self, model: str) -> list[dict[str, Any]]:
        """Every chunk of a complete streamed answer, the usage chunk last."""
        step = self.step
        out = [self.chunk(model, {"role": "assistant", "content": ""})]
        if step.kind == "text":
            out += [self.chunk(model, {"content": piece}) for piece in _chunks(step.text)]
            out.append(self.chunk(model, {}, "stop"))
        else:
            out += [self.chunk(model, delta) for delta in _tool_call_deltas(step.calls)]
            out.append(self.chunk(model, {}, "tool_calls"))
        out.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": model, "choices": [], "usage": _usage_body(self.usage)})
        return out

    def completion(self, model: str) -> dict[str, Any]:
        """The non-streamed `chat.completion` object."""
        step = self.step
        message: dict[str, Any] = {"role": "assistant", "content": step.text or None}
        if step.kind == "tool_calls":
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:20]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}
                for name, args in step.calls
            ]
        finish = "tool_calls" if step.kind == "tool_calls" else "stop"
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": _usage_body(self.usage)}


# ---------------------------------------------------------------------------------------------
# the server


class _Handler(BaseHTTPRequestHandler):
    """Routes to the owning ScriptedModel; quiet about clients that hang up."""

    server: _Server
    protocol_version = "HTTP/1.0"  # close-delimited bodies: no chunked encoding to get wrong

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        self.server.model._handle(self)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self.server.model._handle(self)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    model: ScriptedModel

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Swallow client disconnects; anything else is a bug in the fake and is printed."""
        if isinstance(sys.exc_info()[1], DISCONNECTS):
            return
        super().handle_error(request, client_address)


class ScriptedModel:
    """An OpenAI-compatible chat server answering from registered scripts.

    `.start()` / `.stop()` or use it as a context manager. `.url` is "http://127.0.0.1:PORT/v1".
    `.requests` is a snapshot list of every request seen: dicts with `path`, `headers` (dict),
    `json` (the body, or None), `script` (name or None), `step` (int, or None for title and
    unroutable requests), `kind` ("step" | "title" | "error" | "not_found"), `usage` (what was
    sent, or None), `cwd`, and `finished` (False while the answer is being sent or held back).
    """

    def __init__(self) -> None:
        self._scripts: dict[str, list[Step]] = {}
        self._requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> ScriptedModel:
        """Listen on a free 127.0.0.1 port and serve in a daemon thread."""
        if self._server is not None:
            return self
        self._stopping.clear()
        server = _Server(("127.0.0.1", 0), _Handler)
        server.model = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05},
            name="scripted-model", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; hanging and stalled requests are released. Returns well within 1 s."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def __enter__(self) -> ScriptedModel:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The listening port (the server must be started)."""
        if self._server is None:
            raise RuntimeError("ScriptedModel is not started: call .start() or use `with`")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The base URL clients take as `baseURL`: http://127.0.0.1:PORT/v1."""
        return f"http://127.0.0.1:{self.port}/v1"

    # -- scripts and records ------------------------------------------------------------------

    def script(self, name: str, steps: list[Step]) -> None:
        """Register (or replace) script `name`; "default" answers requests without a token."""
        if not SCRIPT_TOKEN.fullmatch(f"SCRIPT:{name}"):
            raise ValueError(f"script name {name!r}: use letters, digits, '_' and '-' only")
        if not steps or not all(isinstance(s, Step) for s in steps):
            raise ValueError(f"script {name!r}: give a non-empty list of steps (text(), tool_call()…)")
        with self._lock:
            self._scripts[name] = list(steps)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A snapshot of every request recorded so far, oldest first."""
        with self._lock:
            return list(self._requests)

    def requests_for(self, script_name: str) -> list[dict[str, Any]]:
        """The recorded requests routed to `script_name` (title requests included; see `kind`)."""
        return [r for r in self.requests if r["script"] == script_name]

    def step_requests(self, script_name: str) -> list[dict[str, Any]]:
        """The recorded requests that were answered with a step of `script_name`, oldest first."""
        return [r for r in self.requests_for(script_name) if r["kind"] == "step"]

    # -- answering ----------------------------------------------------------------------------

    def _record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._requests.append(entry)

    def _handle(self, handler: _Handler) -> None:
        entry: dict[str, Any] = {
            "path": handler.path, "headers": dict(handler.headers.items()), "json": None,
            "script": None, "step": None, "kind": "error", "usage": None, "cwd": None,
            "finished": False,
        }
        self._record(entry)  # at arrival, so a test can see a hanging request; filled in below
        try:
            self._route(handler, entry)
        finally:
            entry["finished"] = True

    def _route(self, handler: _Handler, entry: dict[str, Any]) -> None:
        if handler.command != "POST" or handler.path.split("?")[0].rstrip("/") != "/v1/chat/completions":
            entry["kind"] = "not_found"
            return self._send_json(handler, 404, _error_body(404, f"no route {handler.command} {handler.path}"))
        try:
            length = int(handler.headers.get("Content-Length") or 0)
            body = json.loads(handler.rfile.read(length) or b"null")
        except (ValueError, json.JSONDecodeError) as exc:
            return self._send_json(handler, 400, _error_body(400, f"request body is not JSON: {exc}"))
        entry["json"] = body
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return self._send_json(handler, 400, _error_body(400, "body needs a 'messages' list"))
        self._answer(handler, body, entry)

    def _answer(self, handler: _Handler, body: dict[str, Any], entry: dict[str, Any]) -> None:
        messages = body["messages"]
        entry["script"] = find_script_name(messages)
        entry["cwd"] = find_cwd(messages)
        if not body.get("tools"):
            entry["kind"] = "title"
            step, usage = text(TITLE_REPLY), default_usage(0)
        else:
            picked = self._pick_step(entry, messages)
            if isinstance(picked, str):
                return self._send_json(handler, 400, _error_body(400, picked))
            step, usage = picked
        try:
            step = Step(**{**step.__dict__, "text": _substitute(step.text, entry["cwd"]),
                           "calls": _substitute(step.calls, entry["cwd"])})
        except LookupError as exc:
            return self._send_json(handler, 400, _error_body(400, str(exc)))
        if step.kind in ("text", "tool_calls"):
            entry["usage"] = usage
        if step.before is not None:
            step.before(entry["cwd"])
        self._respond(handler, body, _Reply(step, usage))

    def _pick_step(self, entry: dict[str, Any], messages: list) -> tuple[Step, dict[str, int]] | str:
        """The step for this request and its usage, or an error message."""
        name = entry["script"] or "default"
        with self._lock:
            steps = self._scripts.get(name)
        if steps is None:
            known = ", ".join(sorted(self._scripts)) or "none"
            return (f"no script {name!r} registered (known: {known}); put SCRIPT:<name> in the "
                    "prompt or register a 'default' script")
        entry["script"] = name
        index = count_assistant_messages(messages)
        entry["step"], entry["kind"] = index, "step"
        if index < len(steps):
            step = steps[index]
        elif steps[-1].kind == "text":
            step = steps[-1]
        else:
            step = text("done")
        return step, {**default_usage(index), **(step.usage or {})}

    def _respond(self, handler: _Handler, body: dict[str, Any], reply: _Reply) -> None:
        step = reply.step
        if step.delay:
            self._stopping.wait(step.delay)
        if step.kind == "http_error":
            return self._send_json(handler, step.status, _error_body(step.status, step.message), step.headers)
        if step.kind == "hang" or (step.kind == "stall" and not body.get("stream")):
            self._stopping.wait()
            return None
        model = str(body.get("model") or "model")
        if not body.get("stream"):
            return self._send_json(handler, 200, reply.completion(model))
        self._stream(handler, reply, model)

    def _stream(self, handler: _Handler, reply: _Reply, model: str) -> None:
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Cache-Control", "no-cache")
            handler.send_header("Connection", "close")
            handler.end_headers()
            if reply.step.kind == "stall":
                self._write_events(handler, [reply.chunk(model, {"role": "assistant", "content": ""})]
                                   + [reply.chunk(model, {"content": p}) for p in _chunks(reply.step.text)])
                self._stopping.wait()
                return
            self._write_events(handler, reply.stream_body_chunks(model))
            handler.wfile.write(b"data: [DONE]\n\n")
            handler.wfile.flush()
        except DISCONNECTS:
            handler.close_connection = True

    @staticmethod
    def _write_events(handler: _Handler, chunks: list[dict[str, Any]]) -> None:
        for chunk in chunks:
            handler.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            handler.wfile.flush()

    @staticmethod
    def _send_json(handler: _Handler, status: int, payload: Any,
                   headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(data)
        except DISCONNECTS:
            handler.close_connection = True
