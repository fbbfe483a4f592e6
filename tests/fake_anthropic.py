"""A fake Anthropic Messages API on 127.0.0.1 for the reverse-bridge tests (stdlib only).

It answers ``POST /v1/messages`` (the ``?beta=true`` query the claude CLI adds is ignored) as JSON,
or as SSE in the real event order when the body says ``"stream": true``; errors come in the real
shape ``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}``.

A mode is chosen per request, first match wins:
1. the header ``x-fake-mode`` (the claude CLI and the anthropic SDK both send extra headers listed
   in ``ANTHROPIC_CUSTOM_HEADERS``, one ``Name: value`` a line);
2. a token ``MODE:<mode>`` anywhere in the messages' text;
3. a server-wide ``fail_next(k, status)`` budget (the next k requests fail);
4. ``normal``.

Modes: ``normal``; ``slow`` / ``slow:SEC`` (wait before the response starts, default 30 s);
``stall`` / ``stall:SEC`` (start the stream, send one text delta, then no byte for SEC, default
60 s); ``401``; ``403``; ``429``; ``500``; ``529``; ``failnext:K:STATUS`` (the first K requests
carrying this exact mode fail with STATUS, later ones are normal); ``stream-error`` (the SSE
stream ends with an ``error`` event, overloaded); ``empty`` (a reply with no text).

The answer is ``FakeAnthropic.answer`` followed by `` | echo: `` and the first 200 characters of
the last user text, so tests can check both that the fake answered and what it was asked.

Run by hand: ``python tests/fake_anthropic.py --port 8765``.
"""
from __future__ import annotations

import argparse
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_ANSWER = "The fake Claude says hello."
MODE_TOKEN = re.compile(r"MODE:([A-Za-z0-9:._-]+)")
ERRORS = {
    400: ("invalid_request_error", "invalid request"),
    401: ("authentication_error", "invalid x-api-key"),
    403: ("permission_error", "your API key does not have permission to use the specified resource"),
    404: ("not_found_error", "not found"),
    429: ("rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit"),
    500: ("api_error", "Internal server error"),
    529: ("overloaded_error", "Overloaded"),
}


@dataclass
class RecordedRequest:
    """One request as the fake saw it: headers lower-cased, the parsed JSON body, the mode used."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    mode: str
    at: float = field(default_factory=time.time)

    def user_text(self) -> str:
        return last_user_text(self.body)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def _own_text(content: Any) -> str:
    """The text the user typed: the CLI puts ``<system-reminder>`` blocks before it."""
    if isinstance(content, list):
        texts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        texts = [t for t in texts if not t.lstrip().startswith("<system-reminder>")]
        return texts[-1] if texts else ""
    return _text_of(content)


def last_user_text(body: Any) -> str:
    """The text of the last user message of a Messages API body ('' when there is none)."""
    if not isinstance(body, dict):
        return ""
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return _own_text(message.get("content"))
    return ""


def _all_message_text(body: Any) -> str:
    if not isinstance(body, dict):
        return ""
    return "\n".join(_text_of(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class FakeAnthropic:
    """The fake server. Use as a context manager or call start()/stop(); ``url`` is the base URL
    to put in ANTHROPIC_BASE_URL. ``requests`` lists every request received."""

    def __init__(self, answer: str = DEFAULT_ANSWER, port: int = 0) -> None:
        self.answer = answer
        self.requests: list[RecordedRequest] = []
        self._port = port
        self._lock = threading.Lock()
        self._fail_budget: list[int] = []  # statuses the next requests get
        self._per_mode_counts: dict[str, int] = {}
        self._release = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FakeAnthropic:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-anthropic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()  # wake stalled and slow handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the fake first"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- test controls -----------------------------------------------------------------------
    def fail_next(self, count: int, status: int = 529) -> None:
        """Make the next ``count`` requests (of any mode) fail with HTTP ``status``."""
        with self._lock:
            self._fail_budget.extend([status] * count)

    def message_requests(self) -> list[RecordedRequest]:
        """The recorded ``POST /v1/messages`` requests."""
        return [r for r in list(self.requests) if r.path == "/v1/messages"]

    # -- mode selection ----------------------------------------------------------------------
    def choose_mode(self, headers: dict[str, str], body: Any) -> str:
        mode = headers.get("x-fake-mode", "").strip()
        if not mode:
            found = MODE_TOKEN.search(_all_message_text(body))
            mode = found.group(1) if found else ""
        with self._lock:
            if mode.startswith("failnext:"):
                return self._fail_next_mode(mode)
            if not mode and self._fail_budget:
                return str(self._fail_budget.pop(0))
        return mode or "normal"

    def _fail_next_mode(self, mode: str) -> str:
        try:
            _, count, status = mode.split(":")
            seen = self._per_mode_counts.get(mode, 0)
            self._per_mode_counts[mode] = seen + 1
            return status if seen < int(count) else "normal"
        except ValueError:
            return "400"

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; returns early when the fake stops."""
        self._release.wait(seconds)

    def reply_text(self, body: Any) -> str:
        return f"{self.answer} | echo: {last_user_text(body)[:200]}"


class _Handler(BaseHTTPRequestHandler):
    fake: FakeAnthropic
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    # -- plumbing ----------------------------------------------------------------------------
    def _read_body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return {"_unparsed": raw.decode("utf-8", "replace")}

    def _send_json(self, status: int, payload: dict, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("request-id", payload.get("request_id") or f"req_{uuid.uuid4().hex[:20]}")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int) -> None:
        kind, message = ERRORS.get(status, ("api_error", f"fake error {status}"))
        extra = {"retry-after": "0"} if status in (429, 529) else {}
        self._send_json(status, {"type": "error", "error": {"type": kind, "message": message},
                                 "request_id": f"req_{uuid.uuid4().hex[:20]}"}, extra)

    # -- routes ------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._send_error(404)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        if path == "/v1/messages/count_tokens":
            self._record(path, headers, body, "count_tokens")
            self._send_json(200, {"input_tokens": len(json.dumps(body)) // 4})
            return
        if path != "/v1/messages":
            self._record(path, headers, body, "404")
            self._send_error(404)
            return
        mode = self.fake.choose_mode(headers, body)
        self._record(path, headers, body, mode)
        if not (headers.get("x-api-key") or headers.get("authorization")):
            self._send_error(401)
            return
        self._answer(mode, body)

    def _record(self, path: str, headers: dict[str, str], body: Any, mode: str) -> None:
        with self.fake._lock:
            self.fake.requests.append(RecordedRequest("POST", path, headers, body, mode))

    def _answer(self, mode: str, body: Any) -> None:
        name, _, arg = mode.partition(":")
        if name.isdigit():
            self._send_error(int(name))
            return
        if name == "slow":
            self.fake.wait(float(arg or 30))
        text = "" if name == "empty" else self.fake.reply_text(body)
        if isinstance(body, dict) and body.get("stream"):
            self._stream(body, text, stall=float(arg or 60) if name == "stall" else None,
                         error=name == "stream-error")
        else:
            self._send_json(200, self._message(body, text))

    def _message(self, body: Any, text: str) -> dict:
        return {
            "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": (body or {}).get("model", "claude-fake"),
            "content": [{"type": "text", "text": text}] if text else [],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": self._usage(body, text),
        }

    @staticmethod
    def _usage(body: Any, text: str) -> dict:
        return {"input_tokens": max(1, len(json.dumps(body)) // 4), "output_tokens": max(1, len(text.split())),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def _stream(self, body: Any, text: str, stall: float | None, error: bool) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:20]}")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        start = self._message(body, "")
        start["usage"] = {**self._usage(body, ""), "output_tokens": 1}
        start["stop_reason"] = None
        self._write(_sse("message_start", {"type": "message_start", "message": start}))
        self._write(_sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}))
        self._write(_sse("ping", {"type": "ping"}))
        words = re.findall(r"\S+\s*", text) or [""]
        half = max(1, len(words) // 2)
        for number, chunk in enumerate([words[:half], words[half:]]):
            if chunk:
                self._write(_sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": "".join(chunk)}}))
            if number == 0 and stall is not None:
                self.fake.wait(stall)
                return
            if number == 0 and error:
                self._write(_sse("error", {"type": "error", "error": {"type": "overloaded_error",
                                                                      "message": "Overloaded"}}))
                return
        self._write(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
        self._write(_sse("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                           "usage": {"output_tokens": max(1, len(text.split()))}}))
        self._write(_sse("message_stop", {"type": "message_stop"}))

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the fake Anthropic Messages API on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
    parser.add_argument("--answer", default=DEFAULT_ANSWER, help="the text every answer starts with")
    args = parser.parse_args()
    with FakeAnthropic(answer=args.answer, port=args.port) as fake:
        print(f"fake Anthropic API on {fake.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
