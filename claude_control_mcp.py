"""The reverse bridge: a stdio MCP server whose six tools let an OpenCode agent ask Claude.

Run it as a local MCP server (OpenCode starts it):   python claude_control_mcp.py
Over streamable-http (the worker starts it; see reverse_bridge.py):
    (echo TOKEN; cat) | python claude_control_mcp.py --transport streamable-http --port N
Register it in OpenCode's config (idempotent):       python claude_control_mcp.py --register-opencode [--config PATH]
Another queue than the default:                      python claude_control_mcp.py --db URL

Tools: ``claude_ask`` (answers synchronously), ``claude_submit`` / ``claude_poll`` /
``claude_result`` / ``claude_cancel`` (background jobs, durable in the ``claude_jobs`` table of the
TaskBridge queue), ``claude_status``.

Backends: with ``ANTHROPIC_API_KEY`` set, the official ``anthropic`` SDK (it reads
``ANTHROPIC_BASE_URL`` itself); otherwise ``claude -p --output-format json`` with stdin from
``/dev/null`` (a prompt over ~100 KB goes on stdin instead), ``--`` before the prompt, its own
process group and a hard timeout that kills the whole process tree.

Env, read at call time:
  ANTHROPIC_API_KEY        use the API (never logged, never returned)
  CLAUDE_API_MODEL         API model when a call names none (default claude-opus-5-5)
  CLAUDE_BACKEND           auto (default) | api | cli: force a backend
  CLAUDE_BIN               the claude CLI (default: `claude` on PATH)
  CLAUDE_CODE_MAX_RETRIES  retries on 429/5xx/529 (the CLI reads it itself; the SDK gets it too, default 2)
  CLAUDE_STALL_SEC         seconds without a byte of the API stream before it counts as stalled (default 60)
  CLAUDE_MAX_TOKENS        max_tokens of an API answer (default 8192)
  CLAUDE_MAX_PARALLEL      background jobs that run at once; the rest wait queued (default 4)
  CLAUDE_CONTROL_LOG_LEVEL log level on stderr (default WARNING; an unknown level warns and uses WARNING)
  TASK_DB_URL              the queue database that holds the jobs: a postgresql:// URL or a SQLite
                           file (``--db URL`` sets it; else TASK_DB_PATH; see task_store)

Tool errors are one line (mcp_shared): a bad argument named with what it must be, a Claude
failure as "kind: message", a queue database that cannot be used named with its path and the way
out (the server still starts and lists its tools then). A NUL character in any argument is refused.

Nothing but JSON-RPC is written to stdout: logs go to stderr, and every child process gets its
own pipes (stdin from /dev/null), so it can never read or write the protocol stream.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
import psutil
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field
from typing_extensions import TypedDict  # pydantic needs this TypedDict before Python 3.12

import knobs
import mcp_shared
import process_tree
import task_store

log = logging.getLogger("claude_control")

SERVER_NAME = "claude-control"
SERVER_VERSION = "1.0.0"
DEFAULT_API_MODEL = "claude-opus-5-5"
DEFAULT_TIMEOUT_SEC = 120
ASK_DEFAULT_SEC = 50  # claude_ask blocks its caller: OpenCode's MCP client ends a call after 60 s
TIMEOUT_MAX_SEC = 3600
PROMPT_MAX = 1_000_000
SYSTEM_MAX = 100_000  # one argv string; Linux refuses single arguments over 128 KiB
STDIN_PROMPT_BYTES = 100_000  # longer prompts go on stdin: argv strings are capped near 128 KiB
KILL_GRACE_SEC = 1.5
PROGRESS_EVERY_SEC = 5.0
API_DEADLINE_SLACK_SEC = 1.0  # lets the SDK's own, more specific timeout errors win the race
INTERRUPTED = "interrupted: the bridge server stopped before the job finished"
NOT_LOGGED_IN = "claude CLI is not logged in: run `claude login` or set ANTHROPIC_API_KEY"
MODEL_RE = re.compile(r"^[A-Za-z0-9][\w.\-:/@\[\]]{0,119}$")
ACTIVE = ("queued", "running")
CLAUDE_KNOBS = ("CLAUDE_CODE_MAX_RETRIES", "CLAUDE_STALL_SEC", "CLAUDE_MAX_TOKENS", "CLAUDE_MAX_PARALLEL")


# --------------------------------------------------------------------------------------------
# Configuration (read at call time).

def api_key_present() -> bool:
    return bool(os.environ.get("ANTHROPIC_API_KEY", "").strip())


def api_model() -> str:
    return os.environ.get("CLAUDE_API_MODEL", "").strip() or DEFAULT_API_MODEL


def api_retries() -> int:
    return int(knobs.knob("CLAUDE_CODE_MAX_RETRIES"))


def stall_sec() -> int:
    return int(knobs.knob("CLAUDE_STALL_SEC"))


def max_tokens() -> int:
    return int(knobs.knob("CLAUDE_MAX_TOKENS"))


def max_parallel() -> int:
    return int(knobs.knob("CLAUDE_MAX_PARALLEL"))


def claude_bin() -> str | None:
    """Absolute path of the claude CLI (``CLAUDE_BIN`` or ``claude`` on PATH), or None."""
    wanted = os.environ.get("CLAUDE_BIN", "").strip() or "claude"
    if os.sep in wanted:
        path = Path(wanted).expanduser()
        return str(path.absolute()) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which(wanted)


def choose_backend() -> tuple[Literal["api", "cli"], str]:
    """``(backend, why)``: ``api`` or ``cli``. Raises BridgeError for a bad CLAUDE_BACKEND."""
    forced = os.environ.get("CLAUDE_BACKEND", "").strip().lower()
    if forced in ("api", "cli"):
        return ("api" if forced == "api" else "cli"), f"CLAUDE_BACKEND={forced}"
    if forced not in ("", "auto"):
        raise BridgeError("config", f"CLAUDE_BACKEND must be auto, api or cli; got {forced!r}")
    if api_key_present():
        return "api", "ANTHROPIC_API_KEY is set, so the anthropic SDK answers"
    return "cli", "ANTHROPIC_API_KEY is not set, so `claude -p` answers"


def check_backend(backend: str) -> None:
    """Raise BridgeError("no_backend") when ``backend`` cannot run at all (no key, no binary), so
    a submit fails at once instead of leaving a job that fails later."""
    if backend == "api" and not api_key_present():
        raise BridgeError("no_backend", "CLAUDE_BACKEND=api but ANTHROPIC_API_KEY is not set: set it, or use "
                                        "CLAUDE_BACKEND=cli with a logged-in claude CLI")
    if backend == "cli" and claude_bin() is None:
        raise BridgeError("no_backend", _no_cli_message())


# --------------------------------------------------------------------------------------------
# Results and errors.

class BridgeError(Exception):
    """One Claude call failed. ``kind`` is a short code (auth, rate_limit, overloaded,
    server_error, timeout, stalled, not_logged_in, no_backend, empty_answer, cli_output,
    bad_request, connection, cancelled, config); ``str()`` is ``"kind: message"``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class Usage(TypedDict):
    """Tokens and cost of one answer; fields a backend does not report are null."""

    input_tokens: int | None
    output_tokens: int | None
    cache_creation_input_tokens: int | None
    cache_read_input_tokens: int | None
    cost_usd: float | None
    duration_ms: int
    num_turns: int | None
    model: str | None
    backend: str


class Answer(TypedDict):
    """Claude's answer: the text, the backend and model that gave it, and its usage."""

    answer: str
    backend: Literal["api", "cli"]
    model: str | None
    stop_reason: str | None
    session_id: str | None
    usage: Usage


class JobState(TypedDict):
    """A background job as claude_poll shows it. Times are ISO 8601 UTC; seconds are floats."""

    job_id: int
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    backend: str
    model: str | None
    timeout_sec: int
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    elapsed_sec: float | None
    answer_ready: bool
    error: str | None


class JobResult(TypedDict):
    """A finished job's answer (a page of it, by characters) and usage."""

    job_id: int
    status: Literal["done"]
    answer: str
    answer_offset: int
    answer_next_offset: int | None
    answer_total_chars: int
    backend: str
    model: str | None
    usage: Usage | None


class CancelResult(TypedDict):
    """What claude_cancel did: ``cancelled`` is false when the job had already finished."""

    job_id: int
    status: str
    cancelled: bool
    message: str


class SubmitResult(TypedDict):
    """A new background job: poll it with claude_poll, read it with claude_result."""

    job_id: int
    status: str
    backend: str
    timeout_sec: int


class Status(TypedDict):
    """Which backend answers and whether it can: never contains the key itself."""

    backend: Literal["api", "cli"] | None
    reason: str
    ready: bool
    problem: str | None
    api_key_present: bool
    base_url: str | None
    model: str | None
    claude_bin: str | None
    claude_version: str | None
    logged_in: bool | None
    auth_method: str | None
    sdk_version: str | None
    active_jobs: int
    server_pid: int


@dataclass(frozen=True)
class Request:
    """One question: prompt and optional system prompt (text), model name, timeout in seconds."""

    prompt: str
    system: str | None
    model: str | None
    timeout_sec: int


def make_request(prompt: Any, system: Any = None, model: Any = None,
                 timeout_sec: Any = DEFAULT_TIMEOUT_SEC) -> Request:
    """Validate tool arguments (odd shapes such as ``"null"`` or ``"600"`` accepted).
    Raises task_store.ValidationError with a message naming the field and the fix."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise task_store.ValidationError("prompt must be non-empty text: the question for Claude")
    if len(prompt) > PROMPT_MAX:
        raise task_store.ValidationError(
            f"prompt is {len(prompt)} characters; the limit is {PROMPT_MAX}: shorten it or summarise the material")
    system = task_store.optional(system)
    if system is not None and (not isinstance(system, str) or len(system) > SYSTEM_MAX):
        raise task_store.ValidationError(
            f"system must be text of at most {SYSTEM_MAX} characters; put long material in the prompt")
    model = task_store.optional(model)
    if model is not None and (not isinstance(model, str) or not MODEL_RE.match(model.strip())):
        raise task_store.ValidationError(
            f"model must be a model name such as claude-sonnet-4-6 (or an alias such as sonnet); got {model!r}")
    timeout = task_store.coerce_int("timeout_sec", task_store._or(timeout_sec, DEFAULT_TIMEOUT_SEC), 1,
                                    TIMEOUT_MAX_SEC)
    return Request(prompt, system, model.strip() if model else None, timeout)


# --------------------------------------------------------------------------------------------
# Processes.

def kill_tree(target: int | psutil.Process) -> None:
    """End a ``claude`` call's whole tree (our child's pid, or another server's verified process)."""
    process_tree.kill_tree(target, KILL_GRACE_SEC)


# --------------------------------------------------------------------------------------------
# One call, cancellable from any thread.

class Call:
    """One question to one backend. ``run()`` blocks (call it in a worker thread) and returns an
    Answer or raises BridgeError; ``cancel()`` from any thread ends it within seconds: the CLI's
    process tree is killed, an SDK request is abandoned."""

    def __init__(self, request: Request, backend: str, on_process: Any = None) -> None:
        self.request = request
        self.backend = backend
        self.on_process = on_process  # called with (pid, start_time) once the CLI runs
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._client: Any = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait_cancel(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking at once on a cancel; True when cancelled."""
        return self._cancel.wait(timeout)

    def run(self) -> Answer:
        if self.cancelled:
            raise BridgeError("cancelled", "cancelled before it started")
        return run_api(self) if self.backend == "api" else run_cli(self)

    def cancel(self) -> None:
        self._cancel.set()
        with self._lock:
            proc, client = self._proc, self._client
        if proc is not None and proc.returncode is None:
            kill_tree(proc.pid)
        if client is not None:
            self.close_client()

    def close_client(self) -> None:
        """Close the SDK client: an abandoned request fails soon instead of lingering."""
        with self._lock:
            client = self._client
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def attach_process(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._proc = proc
        if self.on_process is not None:
            try:
                self.on_process(proc.pid, process_tree.start_time(proc.pid))
            except Exception:  # recording the pid is a nicety; the call must go on (and be killable)
                log.warning("could not record the pid of %s", proc.pid, exc_info=True)
        if self.cancelled:
            kill_tree(proc.pid)

    def attach_client(self, client: Any) -> None:
        with self._lock:
            self._client = client


# --------------------------------------------------------------------------------------------
# Backend: the claude CLI.

def cli_command(binary: str, request: Request, prompt_on_stdin: bool) -> list[str]:
    """The argv for ``claude -p``: JSON output, no tools (a pure question and answer), no saved
    session; ``--`` ends the options so a prompt starting with ``-`` stays a prompt."""
    argv = [binary, "-p", "--output-format", "json", "--tools", "", "--no-session-persistence"]
    if request.model:
        argv += ["--model", request.model]
    if request.system:
        argv += ["--system-prompt", request.system]
    if not prompt_on_stdin:
        argv += ["--", request.prompt]
    return argv


def run_cli(call: Call) -> Answer:
    """Ask through ``claude -p``. Raises BridgeError (no_backend, timeout, cancelled, and every
    error parse_cli_output finds)."""
    check_backend("cli")
    binary = claude_bin() or "claude"
    data = call.request.prompt.encode()
    on_stdin = len(data) > STDIN_PROMPT_BYTES
    started = time.monotonic()
    try:
        proc = subprocess.Popen(cli_command(binary, call.request, on_stdin),
                                stdin=subprocess.PIPE if on_stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise BridgeError("no_backend", f"cannot start {binary}: {exc}") from None
    call.attach_process(proc)
    out, err, stopped = _communicate(call, proc, data if on_stdin else None)
    if stopped == "cancelled":
        raise BridgeError("cancelled", "cancelled; the claude CLI process tree was killed")
    if stopped == "timeout":
        raise BridgeError("timeout", f"claude -p gave no answer within {call.request.timeout_sec} s (the API "
                                     "may be slow or its stream stalled); its process tree was killed")
    result = parse_cli_output(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), proc.returncode)
    return _cli_answer(result, call.request, int((time.monotonic() - started) * 1000))


def _no_cli_message() -> str:
    wanted = os.environ.get("CLAUDE_BIN", "").strip()
    where = f"CLAUDE_BIN={wanted} is not an executable file" if wanted else "`claude` is not on PATH"
    return (f"ANTHROPIC_API_KEY is not set and {where}: set ANTHROPIC_API_KEY, or install the claude CLI "
            "(npm install -g @anthropic-ai/claude-code), run `claude login`, and set CLAUDE_BIN if it is "
            "not on PATH")


def _communicate(call: Call, proc: subprocess.Popen, stdin_data: bytes | None) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and drain stdout/stderr in threads (``communicate()`` cannot be retried with
    unsent input), wait for the exit, the deadline or a cancel. Returns (stdout, stderr, stop)
    where stop is None, "timeout" or "cancelled"."""
    pipes = _Pipes(proc, stdin_data)
    deadline = time.monotonic() + call.request.timeout_sec
    stop = None
    while not _exited(proc.pid):
        stop = "cancelled" if call.cancelled else "timeout" if time.monotonic() >= deadline else None
        if stop:
            kill_tree(proc.pid)
            break
        call.wait_cancel(0.1)
    if stop is None:
        _sweep_group(proc.pid)  # the CLI is a zombie here, so its group id cannot have been reused
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    pipes.join(5)  # a descendant that escaped the group may hold a pipe open: do not wait for it forever
    return pipes.stdout(), pipes.stderr(), "cancelled" if call.cancelled else stop


def _exited(pid: int) -> bool:
    """True once the child has exited, without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped (a concurrent kill_tree waited for it)
        return True


class _Pipes:
    """Threads that write the prompt to the child's stdin and collect its stdout and stderr."""

    def __init__(self, proc: subprocess.Popen, stdin_data: bytes | None) -> None:
        self._out, self._err = bytearray(), bytearray()
        self._threads = [threading.Thread(target=self._drain, args=(proc.stdout, self._out), daemon=True),
                         threading.Thread(target=self._drain, args=(proc.stderr, self._err), daemon=True)]
        if stdin_data is not None:
            self._threads.append(threading.Thread(target=self._feed, args=(proc.stdin, stdin_data), daemon=True))
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _drain(stream: Any, buffer: bytearray) -> None:
        with contextlib.suppress(OSError, ValueError):
            for chunk in iter(lambda: stream.read1(65536), b""):
                buffer.extend(chunk)

    @staticmethod
    def _feed(stream: Any, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):  # the CLI may exit before reading it all
            stream.write(data)
            stream.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stdout(self) -> bytes:
        return bytes(self._out)

    def stderr(self) -> bytes:
        return bytes(self._err)


def _sweep_group(pgid: int) -> None:
    # Anything the CLI left running in its group dies with the call.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def parse_cli_output(stdout: str, stderr: str, returncode: int) -> dict[str, Any]:
    """The ``result`` event of ``claude -p --output-format json``, from any shape it prints: one
    object, an array of events (``--verbose``), or JSON lines. Raises BridgeError for every
    failure shape: is_error (at any exit code), an empty result, errors only, text instead of
    JSON, truncated JSON, nothing at all."""
    text = stdout.strip()
    if not text:
        raise _no_output_error(stderr, returncode)
    parsed = _parse_json_shapes(text)
    if parsed is None:
        raise _plain_output_error(text, returncode)
    result = _result_event(parsed)
    if result is None:
        raise BridgeError("cli_output", f"claude -p printed JSON without a result event (exit {returncode}): "
                                        f"{_clip(text)}")
    return _check_result(result, returncode)


def _parse_json_shapes(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        try:
            return [json.loads(line) for line in lines]
        except json.JSONDecodeError:
            return None
    return None


def _result_event(parsed: Any) -> dict | None:
    if isinstance(parsed, dict):
        return parsed if parsed.get("type") == "result" or "is_error" in parsed or "result" in parsed else None
    if isinstance(parsed, list):
        results = [e for e in parsed if isinstance(e, dict) and e.get("type") == "result"]
        return results[-1] if results else None
    return None


def _check_result(result: dict, returncode: int) -> dict:
    answer = result.get("result")
    message = answer if isinstance(answer, str) and answer.strip() else "; ".join(map(str, result.get("errors") or []))
    if result.get("is_error"):
        raise classify_cli_error(message or f"subtype {result.get('subtype')}", result.get("api_error_status"))
    if returncode != 0:
        raise classify_cli_error(message or f"claude -p exited {returncode}", result.get("api_error_status"),
                                 returncode)
    if not isinstance(answer, str):
        why = message or f"subtype {result.get('subtype')!r}"
        raise BridgeError("cli_output", f"claude -p returned no result ({why})")
    if not answer.strip():
        raise BridgeError("empty_answer", "claude -p returned an empty answer (is_error false, stop_reason "
                                          f"{result.get('stop_reason')!r}); ask again or rephrase")
    return result


def classify_cli_error(message: str, status: Any = None, returncode: int | None = None) -> BridgeError:
    """Map the CLI's error text (and ``api_error_status`` when given) to a BridgeError.

    An ``api_error_status`` means the API answered: its status decides, whatever the CLI's text
    says (a refused ANTHROPIC_AUTH_TOKEN or expired login comes back as "Not logged in · Please run
    /login" with status 401). Only with no status is "not logged in" taken at its word."""
    lowered = message.lower()
    if isinstance(status, int) and not isinstance(status, bool) and status >= 400:
        return _api_status_error(status, message, returncode)
    if "not logged in" in lowered or "/login" in lowered:
        return BridgeError("not_logged_in", NOT_LOGGED_IN)
    code = status if isinstance(status, int) else _status_in_text(message)
    kind = _kind_for_status(code) or ("auth" if "invalid api key" in lowered else None)
    kind = kind or ("overloaded" if "overloaded" in lowered else "cli_error")
    exit_note = f" (exit {returncode})" if returncode not in (None, 0, 1) else ""
    return BridgeError(kind, f"claude -p: {message.strip().rstrip('.')}{exit_note}{_ADVICE.get(kind, '')}")


_ADVICE = {
    "auth": "; check ANTHROPIC_API_KEY or run `claude login`",
    "rate_limit": "; wait a minute and ask again",
    "overloaded": "; the API is overloaded, try again in a minute",
    "server_error": "; a server-side error, usually temporary: try again",
}


# The Messages API's error type for each status (https://docs.anthropic.com/en/api/errors); the
# CLI's JSON result carries the status only.
_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                 500: "api_error", 529: "overloaded_error"}
_STATUS_ADVICE = {
    401: "the API refused the credentials: check ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN), or "
         "run `claude login` again",
    403: "the credentials are valid but may not use this model or resource: pick another model or "
         "check the key's workspace permissions",
    429: "rate limited: wait a minute and ask again",
    529: "the API is overloaded: try again in a minute",
}


def _api_status_error(status: int, message: str, returncode: int | None) -> BridgeError:
    kind = _kind_for_status(status) or "cli_error"
    error_type = _STATUS_TYPES.get(status) or ("api_error" if status >= 500 else "error")
    advice = _STATUS_ADVICE.get(status) or _ADVICE.get(kind, "").lstrip("; ")
    exit_note = f", exit {returncode}" if returncode not in (None, 0, 1) else ""
    said = message.strip().rstrip(".")
    return BridgeError(kind, f"claude -p: the Anthropic API answered HTTP {status} {error_type}"
                             f" (the CLI said: {_clip(said)}{exit_note})" + (f"; {advice}" if advice else ""))


def _status_in_text(message: str) -> int | None:
    found = re.search(r"API Error:\D{0,30}?(\d{3})\b", message) or re.search(r"\((\d{3})\)", message)
    return int(found.group(1)) if found else None


def _kind_for_status(code: int | None) -> str | None:
    if code in (401, 403):
        return "auth"
    if code == 429:
        return "rate_limit"
    if code == 529:
        return "overloaded"
    if code is not None and code >= 500:
        return "server_error"
    if code is not None and code >= 400:
        return "bad_request"
    return None


def _no_output_error(stderr: str, returncode: int) -> BridgeError:
    if "not logged in" in stderr.lower():
        return BridgeError("not_logged_in", NOT_LOGGED_IN)
    if returncode < 0:
        return BridgeError("cli_output", f"claude -p was killed by {signal.Signals(-returncode).name} "
                                         "before it printed anything")
    return BridgeError("cli_output", f"claude -p printed nothing (exit {returncode}); stderr: "
                                     f"{_clip(stderr) or '(empty)'}")


def _plain_output_error(text: str, returncode: int) -> BridgeError:
    if text[:1] in "{[":
        return BridgeError("cli_output", f"claude -p printed JSON that does not parse (cut off after "
                                         f"{len(text)} characters?), exit {returncode}: {_clip(text)}")
    error = classify_cli_error(text, None, returncode)
    if error.kind != "cli_error" or returncode != 0:
        return error
    return BridgeError("cli_output", f"claude -p printed text instead of JSON (exit 0): {_clip(text)}; is "
                                     "CLAUDE_BIN a wrapper that drops --output-format json?")


def _clip(text: str, limit: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def _cli_answer(result: dict, request: Request, duration_ms: int) -> Answer:
    usage = given if isinstance(given := result.get("usage"), dict) else {}
    models = list((result.get("modelUsage") or {}).keys())
    model = re.sub(r"\[.*\]$", "", models[0]) if models else request.model
    return Answer(
        answer=result["result"], backend="cli", model=model, stop_reason=result.get("stop_reason"),
        session_id=result.get("session_id"),
        usage=Usage(input_tokens=usage.get("input_tokens"), output_tokens=usage.get("output_tokens"),
                    cache_creation_input_tokens=usage.get("cache_creation_input_tokens"),
                    cache_read_input_tokens=usage.get("cache_read_input_tokens"),
                    cost_usd=result.get("total_cost_usd"), duration_ms=result.get("duration_ms") or duration_ms,
                    num_turns=result.get("num_turns"), model=model, backend="cli"),
    )


# --------------------------------------------------------------------------------------------
# Backend: the anthropic SDK.

def run_api(call: Call) -> Answer:
    """Ask through the Messages API. The request runs in a daemon thread so a cancel or the
    deadline returns at once (the abandoned request ends by its own read timeout). Raises
    BridgeError."""
    check_backend("api")
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["answer"] = _api_request(call)
        except BaseException as exc:  # handed to the waiting thread, translated there
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="claude-api", daemon=True).start()
    deadline = time.monotonic() + call.request.timeout_sec + API_DEADLINE_SLACK_SEC
    while not done.wait(0.1):
        if call.cancelled:
            raise BridgeError("cancelled", "cancelled; the API request was abandoned")
        if time.monotonic() >= deadline:
            call.close_client()
            raise BridgeError("timeout", f"no answer from the Anthropic API within {call.request.timeout_sec} s")
    if "error" in box:
        raise api_error(box["error"], call.request.timeout_sec)
    return box["answer"]


def _api_request(call: Call) -> Answer:
    import anthropic
    import httpx2

    request = call.request
    timeout = float(request.timeout_sec)
    client = anthropic.Anthropic(
        api_key=os.environ["ANTHROPIC_API_KEY"].strip(), max_retries=api_retries(),
        timeout=httpx2.Timeout(min(float(stall_sec()), timeout), connect=min(10.0, timeout)))
    call.attach_client(client)
    model = request.model or api_model()
    kwargs: dict[str, Any] = {"model": model, "max_tokens": max_tokens(),
                              "messages": [{"role": "user", "content": request.prompt}]}
    if request.system:
        kwargs["system"] = request.system
    started = time.monotonic()
    try:
        with client.messages.stream(**kwargs) as stream:
            try:
                message = stream.get_final_message()
            except (anthropic.APITimeoutError, httpx2.TimeoutException) as exc:
                # The answer had begun: a read timeout now is a stall (SDK 2.x wraps it as
                # APITimeoutError, 0.x let httpx's own through), not a server that never answered.
                raise _stalled(request.timeout_sec) from exc
    finally:
        client.close()
    return _api_answer(message, int((time.monotonic() - started) * 1000))


def _stalled(timeout_sec: int) -> BridgeError:
    return BridgeError("stalled", f"the answer stream stalled: no data for {min(stall_sec(), timeout_sec)} s "
                                  "(CLAUDE_STALL_SEC); try again")


def _api_answer(message: Any, duration_ms: int) -> Answer:
    text = "".join(getattr(block, "text", "") for block in message.content if block.type == "text")
    if not text.strip():
        raise BridgeError("empty_answer", f"the API returned no text (stop_reason {message.stop_reason!r}); "
                                          "ask again or rephrase")
    usage = message.usage
    return Answer(
        answer=text, backend="api", model=message.model, stop_reason=message.stop_reason, session_id=message.id,
        usage=Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                    cache_creation_input_tokens=getattr(usage, "cache_creation_input_tokens", None),
                    cache_read_input_tokens=getattr(usage, "cache_read_input_tokens", None),
                    cost_usd=None, duration_ms=duration_ms, num_turns=1, model=message.model, backend="api"),
    )


_API_ERROR_TYPES = {
    "authentication_error": "auth", "permission_error": "auth", "rate_limit_error": "rate_limit",
    "overloaded_error": "overloaded", "api_error": "server_error", "invalid_request_error": "bad_request",
    "not_found_error": "bad_request", "request_too_large": "bad_request",
}


def api_error(exc: BaseException, timeout_sec: int) -> BridgeError:
    """Translate an SDK or HTTP exception to a BridgeError with a clear message."""
    import anthropic
    import httpx2

    if isinstance(exc, BridgeError):
        return exc
    if isinstance(exc, anthropic.APITimeoutError):
        return BridgeError("timeout", f"no response from the Anthropic API within {timeout_sec} s")
    if isinstance(exc, httpx2.TimeoutException):  # raised from inside the stream, not wrapped by the SDK
        return _stalled(timeout_sec)
    if isinstance(exc, anthropic.APIStatusError):
        return _status_error(exc)
    if isinstance(exc, (anthropic.APIConnectionError, httpx2.TransportError)):
        where = os.environ.get("ANTHROPIC_BASE_URL") or "https://api.anthropic.com"
        return BridgeError("connection", f"cannot reach the Anthropic API at {where}: {exc}")
    log.error("unexpected API failure", exc_info=exc)
    return BridgeError("api_error", f"the Anthropic API call failed: {type(exc).__name__}: {exc}")


def _status_error(exc: Any) -> BridgeError:
    body = exc.body if isinstance(getattr(exc, "body", None), dict) else {}
    error = given if isinstance(given := body.get("error"), dict) else body
    kind_name = str(error.get("type") or "")
    detail = str(error.get("message") or exc.message)
    status = exc.status_code
    kind = _API_ERROR_TYPES.get(kind_name) or _kind_for_status(status) or "api_error"
    label = f"HTTP {status} {kind_name}".strip() if status != 200 else f"stream error {kind_name}"
    return BridgeError(kind, f"the Anthropic API answered {label}: {detail}{_ADVICE.get(kind, '')}")


# --------------------------------------------------------------------------------------------
# Background jobs.

def server_identity() -> str:
    """``host:pid:start`` of this process: what a job's ``owner`` column holds."""
    me = psutil.Process()
    return f"{socket.gethostname()}:{me.pid}:{me.create_time():.2f}"


def owner_alive(owner: str | None) -> bool | None:
    """Whether the server that owns a job still runs: None when it is on another host."""
    try:
        host, pid, started = (owner or "").rsplit(":", 2)
        pid_n, started_f = int(pid), float(started)
    except ValueError:
        return False
    if host != socket.gethostname():
        return None
    return process_tree.same_process(pid_n, started_f, tolerance=1.0) is not None


def settle_orphan(job: dict[str, Any]) -> dict[str, Any]:
    """If ``job`` is queued/running but its server is gone, kill its CLI (pid and start time
    checked) and mark it failed as interrupted. Returns the job as it now stands."""
    if job["status"] not in ACTIVE or owner_alive(job.get("owner")) is not False:
        return job
    orphan = process_tree.same_process(job.get("pid"), job.get("pid_start"), tolerance=1.0)
    if orphan:
        kill_tree(orphan)
    log.warning("job %s: its server %s is gone; marking it failed", job["id"], job.get("owner"))
    return task_store.finish_claude_job(job["id"], "failed", error=INTERRUPTED)


def recover_interrupted_jobs() -> list[int]:
    """Mark every job left queued/running by a dead server failed; returns their ids."""
    settled = [settle_orphan(job) for job in task_store.list_claude_jobs(ACTIVE, limit=100_000)]
    return [job["id"] for job in settled if job.get("error") == INTERRUPTED]


class JobRunner:
    """Runs background jobs in threads of this process (never on the event loop), at most
    CLAUDE_MAX_PARALLEL at once; the rest wait ``queued``."""

    def __init__(self) -> None:
        self.owner = server_identity()
        self._calls: dict[int, Call] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_parallel())

    def submit(self, request: Request, backend: str) -> dict[str, Any]:
        job = task_store.create_claude_job(request.prompt, backend, request.timeout_sec, system=request.system,
                                           model=request.model, owner=self.owner)
        job_id = job["id"]
        call = Call(request, backend, on_process=lambda pid, start: task_store.start_claude_job(job_id, pid, start))
        thread = threading.Thread(target=self._run, args=(job_id, call), name=f"claude-job-{job_id}", daemon=True)
        with self._lock:
            self._calls[job_id] = call
            self._threads[job_id] = thread
        thread.start()
        return job

    def active(self) -> int:
        with self._lock:
            return len(self._calls)

    def _run(self, job_id: int, call: Call) -> None:
        try:
            _record_end(job_id, self._outcome(job_id, call))
        finally:
            with self._lock:
                self._calls.pop(job_id, None)
                self._threads.pop(job_id, None)

    def _outcome(self, job_id: int, call: Call) -> dict[str, Any]:
        """How the call ended, as finish_claude_job's keyword arguments."""
        try:
            answer = self._run_in_slot(job_id, call)
            return {"status": "done", "answer": answer["answer"], "usage": dict(answer["usage"])}
        except BridgeError as exc:
            return {"status": "cancelled" if exc.kind == "cancelled" else "failed", "error": str(exc)}
        except Exception as exc:  # a bug must still end the job, visibly
            log.exception("job %s crashed", job_id)
            return {"status": "failed", "error": f"internal error: {type(exc).__name__}: {exc}"}

    def _run_in_slot(self, job_id: int, call: Call) -> Answer:
        while not self._slots.acquire(timeout=0.2):
            if call.cancelled:
                raise BridgeError("cancelled", "cancelled while queued")
        finished = threading.Event()
        threading.Thread(target=_follow_record, args=(job_id, call, finished), name=f"claude-job-{job_id}-watch",
                         daemon=True).start()
        try:
            task_store.start_claude_job(job_id)
            return call.run()
        finally:
            finished.set()
            self._slots.release()

    def cancel(self, job_id: int, wait_sec: float = 10.0) -> bool:
        """Cancel a job of this process; True when it was running here."""
        with self._lock:
            call, thread = self._calls.get(job_id), self._threads.get(job_id)
        if call is None:
            return False
        call.cancel()
        if thread is not None:
            thread.join(wait_sec)
        return True

    def shutdown(self) -> None:
        """Stop every job of this process and mark it failed as interrupted (server exit)."""
        with self._lock:
            calls = dict(self._calls)
        for job_id, call in calls.items():
            with contextlib.suppress(Exception):
                task_store.finish_claude_job(job_id, "failed", error=INTERRUPTED)
            call.cancel()


def _record_end(job_id: int, outcome: dict[str, Any]) -> None:
    """Write a job's end. A database that cannot take it (broken, replaced, the row gone) is
    logged, never raised: the job's thread must end quietly whatever the queue's state."""
    try:
        task_store.finish_claude_job(job_id, **outcome)
    except Exception as exc:
        problem = mcp_shared.database_problem(exc) or f"{type(exc).__name__}: {exc}"
        log.error("job %s ended %s but that could not be recorded: %s", job_id, outcome["status"], problem)


def _follow_record(job_id: int, call: Call, finished: threading.Event, every: float = 1.0) -> None:
    """Cancel ``call`` once its job record is finished by someone else (another bridge server's
    claude_cancel, or a restart that marked it interrupted), so no answer is paid for in vain."""
    while not finished.wait(every):
        with contextlib.suppress(task_store.TaskStoreError, OSError):
            if task_store.get_claude_job(job_id)["status"] not in ACTIVE:
                call.cancel()
                return


def job_state(job: dict[str, Any]) -> JobState:
    return JobState(job_id=job["id"], status=job["status"], backend=job["backend"], model=job.get("model"),
                    timeout_sec=job["timeout_sec"], created_at=job["created_at"], started_at=job["started_at"],
                    finished_at=job["finished_at"], elapsed_sec=_elapsed(job), answer_ready=job["status"] == "done",
                    error=job.get("error"))


def _elapsed(job: dict[str, Any]) -> float | None:
    if not job.get("started_at"):
        return None
    start = datetime.fromisoformat(job["started_at"]).timestamp()
    end = datetime.fromisoformat(job["finished_at"]).timestamp() if job.get("finished_at") else time.time()
    return round(max(0.0, end - start), 1)


# --------------------------------------------------------------------------------------------
# Status.

_VERSION_CACHE: dict[tuple[str, float], str | None] = {}


def cli_version(binary: str) -> str | None:
    """``claude --version`` (cached per binary and mtime), or None when it fails."""
    key = (binary, os.path.getmtime(binary))
    if key not in _VERSION_CACHE:
        out = _quick_run([binary, "--version"])
        _VERSION_CACHE[key] = out.strip().splitlines()[0] if out and out.strip() else None
    return _VERSION_CACHE[key]


def cli_auth(binary: str) -> tuple[bool | None, str | None]:
    """``(logged_in, auth_method)`` from ``claude auth status --json`` (~0.3 s); (None, None) when
    the CLI cannot tell."""
    out = _quick_run([binary, "auth", "status", "--json"])
    try:
        data = json.loads(out or "")
    except json.JSONDecodeError:
        return None, None
    if not isinstance(data, dict) or "loggedIn" not in data:
        return None, None
    return bool(data["loggedIn"]), data.get("authMethod")


def _quick_run(argv: list[str], timeout: float = 15) -> str | None:
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              start_new_session=True)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.decode("utf-8", "replace")


def _sdk_version() -> str | None:
    try:
        import anthropic
    except ImportError:
        return None
    return anthropic.__version__


def status(runner: JobRunner) -> Status:
    """What claude_status reports (runs the CLI twice when it is the backend: ~0.5 s)."""
    binary = claude_bin()
    info = Status(backend=None, reason="", ready=False, problem=None, api_key_present=api_key_present(),
                  base_url=os.environ.get("ANTHROPIC_BASE_URL") or None, model=None, claude_bin=binary,
                  claude_version=cli_version(binary) if binary else None, logged_in=None, auth_method=None,
                  sdk_version=_sdk_version(), active_jobs=runner.active(), server_pid=os.getpid())
    try:
        info["backend"], info["reason"] = choose_backend()
    except BridgeError as exc:
        info["reason"], info["problem"] = str(exc), exc.message
        return info
    if info["backend"] == "api":
        info["model"] = api_model()
        info["ready"] = info["api_key_present"]
        info["problem"] = None if info["ready"] else "ANTHROPIC_API_KEY is not set"
        return info
    return _cli_status(info, binary)


def _cli_status(info: Status, binary: str | None) -> Status:
    info["model"] = "the claude CLI's default (pass model to choose)"
    if binary is None:
        info["problem"] = _no_cli_message()
        return info
    info["logged_in"], info["auth_method"] = cli_auth(binary)
    info["ready"] = info["logged_in"] is not False
    info["problem"] = None if info["ready"] else NOT_LOGGED_IN
    return info


# --------------------------------------------------------------------------------------------
# The MCP server.

INSTRUCTIONS = """Ask Claude (the planner) for judgement while you work. claude_ask waits for the
answer (up to timeout_sec); for long questions use claude_submit, then claude_poll until the status
is done, failed or cancelled, then claude_result. claude_status says which backend answers."""

Prompt = Annotated[str, Field(description="The question for Claude, as plain text (up to 1,000,000 characters).")]
System = Annotated[str | None, Field(description="Optional system prompt (up to 100,000 characters).")]
Model = Annotated[str | None, Field(description="Optional model name, e.g. claude-sonnet-4-6; default: "
                                                "CLAUDE_API_MODEL for the API, the CLI's own default for claude -p.")]
Timeout = Annotated[int, Field(ge=1, le=TIMEOUT_MAX_SEC, description="Seconds before the call is abandoned "
                                                                     "(and the claude CLI killed); 1-3600.")]
JobId = Annotated[int, Field(ge=1, le=task_store.MAX_ID, description="A job id returned by claude_submit.")]
AnswerOffset = Annotated[int, Field(ge=0, le=2**63 - 1, description="Character offset into the answer: the "
                                                                   "answer_next_offset of the previous call.")]


def _new_call(prompt: Any, system: Any, model: Any, timeout_sec: Any) -> Call:
    try:
        request = make_request(prompt, system, model, timeout_sec)
        backend, _ = choose_backend()
        check_backend(backend)
    except (task_store.TaskStoreError, BridgeError) as exc:
        raise ToolError(str(exc)) from None
    return Call(request, backend)


async def wait_for_call(call: Call, ctx: Context | None) -> Answer:
    """Run ``call`` in a worker thread; report progress every few seconds; cancel the call if
    the request is cancelled. Raises ToolError on any BridgeError."""
    box: dict[str, Any] = {}

    async def worker() -> None:
        try:
            box["answer"] = await anyio.to_thread.run_sync(call.run, abandon_on_cancel=True)
        except BridgeError as exc:
            box["error"] = exc
        except Exception as exc:  # a bug: say so instead of "Error executing tool"
            log.exception("claude_ask crashed")
            box["error"] = BridgeError("internal", f"{type(exc).__name__}: {exc}")
        group.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(worker)
            await _report_progress(call, ctx)
    except anyio.get_cancelled_exc_class():
        call.cancel()
        raise
    if "error" in box:
        raise ToolError(str(box["error"]))
    return box["answer"]


async def _report_progress(call: Call, ctx: Context | None) -> None:
    started = time.monotonic()
    while True:
        await anyio.sleep(PROGRESS_EVERY_SEC)
        if ctx is not None:
            elapsed = time.monotonic() - started
            with contextlib.suppress(Exception):
                await ctx.report_progress(elapsed, call.request.timeout_sec,
                                          f"waiting for Claude ({elapsed:.0f} s of {call.request.timeout_sec} s)")


def _get_job(job_id: Any) -> dict[str, Any]:
    try:
        return settle_orphan(task_store.get_claude_job(job_id))
    except task_store.TaskStoreError as exc:
        raise ToolError(str(exc)) from None


# Behaviour hints (mcp_shared.hints). Asking Claude reaches a model provider (open world) and is
# not idempotent (each call is a new, billed answer); polling, reading and cancelling a job touch
# only the queue database and this machine's processes.
READ_ONLY = mcp_shared.hints(read_only=True, destructive=False, idempotent=True, open_world=False)
ASKS_CLAUDE = mcp_shared.hints(read_only=False, destructive=False, idempotent=False, open_world=True)
ENDS_A_JOB = mcp_shared.hints(read_only=False, destructive=True, idempotent=True, open_world=False)
_RUNNER: list[JobRunner] = []  # this process's job runner, made by the first build_server()


registry = mcp_shared.ToolRegistry()


class ControlServer(mcp_shared.TranslatingServer):
    """MCPServer whose tool errors are one line each: bad arguments field by field, a Claude
    failure as "kind: message", a broken queue database with its path and the fix."""

    passthrough = (task_store.TaskStoreError, BridgeError)


def build_server(runner: JobRunner | None = None) -> MCPServer:
    """A fresh MCPServer with the six tools. Background jobs belong to the process: ``runner``
    (default: a new JobRunner) becomes the one every server of this process uses."""
    _RUNNER[:] = [runner or (_RUNNER[0] if _RUNNER else JobRunner())]
    mcp = ControlServer(SERVER_NAME, version=SERVER_VERSION, instructions=INSTRUCTIONS)
    return registry.install(mcp)


def job_runner() -> JobRunner:
    if not _RUNNER:
        _RUNNER.append(JobRunner())
    return _RUNNER[0]


@registry.tool(ASKS_CLAUDE, title="Ask Claude")
async def claude_ask(prompt: Prompt, system: System = None, model: Model = None,
                     timeout_sec: Timeout = ASK_DEFAULT_SEC, ctx: Context | None = None) -> Answer:
    """Ask Claude and wait for the answer (at most timeout_sec seconds, default 50: OpenCode and
    most MCP clients give a tool call 60 s). A question that may take longer goes through
    claude_submit (its timeout counts on its own), then claude_poll and claude_result.

    Returns {answer, backend: "api"|"cli", model, stop_reason, session_id, usage: {input_tokens,
    output_tokens, cache_*_input_tokens, cost_usd (claude -p only), duration_ms, num_turns, model,
    backend}}. Errors (as tool errors, text "kind: message"): auth (401/403), rate_limit (429),
    overloaded (529), server_error (5xx), timeout, stalled, not_logged_in, no_backend,
    empty_answer, cli_output (odd claude -p output), bad_request, connection. An answer too long
    for one result (over ~38,000 characters) is cut with "… [N more characters cut]": ask for a
    shorter answer, or use claude_submit and read it in pages with claude_result(job_id, offset).
    """
    answer = await wait_for_call(_new_call(prompt, system, model, timeout_sec), ctx)
    return mcp_shared.fit(answer, mcp_shared.RESULT_CHARS_MAX)[0]


@registry.tool(ASKS_CLAUDE, title="Start a Claude job")
def claude_submit(prompt: Prompt, system: System = None, model: Model = None,
                  timeout_sec: Timeout = DEFAULT_TIMEOUT_SEC) -> SubmitResult:
    """Start a background question to Claude and return at once with its job id.

    Returns {job_id, status: "queued"|"running", backend, timeout_sec}. The job is stored in the
    queue database and survives as a record: poll it with claude_poll(job_id), read the answer
    with claude_result(job_id), stop it with claude_cancel(job_id). The timeout counts from when
    the job starts running. Errors: invalid arguments, no backend configured.
    """
    call = _new_call(prompt, system, model, timeout_sec)
    job = job_runner().submit(call.request, call.backend)
    return SubmitResult(job_id=job["id"], status=job["status"], backend=job["backend"],
                        timeout_sec=job["timeout_sec"])


@registry.tool(READ_ONLY, title="Check a Claude job")
def claude_poll(job_id: JobId) -> JobState:
    """The state of a background job: {job_id, status: queued|running|done|failed|cancelled,
    backend, model, timeout_sec, created_at/started_at/finished_at (ISO 8601 UTC), elapsed_sec,
    answer_ready, error}. Poll every few seconds until status is done, failed or cancelled. A job
    whose server stopped shows failed with error "interrupted: ...". Errors: unknown id.
    """
    return job_state(_get_job(job_id))


@registry.tool(READ_ONLY, title="Read a Claude job's answer")
def claude_result(job_id: JobId, offset: AnswerOffset = 0) -> JobResult:
    """The answer of a finished job: {job_id, status: "done", answer, answer_offset,
    answer_next_offset, answer_total_chars, backend, model, usage}. An answer longer than fits
    in one result (~38,000 characters) comes in pages: pass answer_next_offset back as offset
    until it is null.

    Errors: the job is still queued/running (poll again), it failed (the error says why, e.g.
    "overloaded: ..."), it was cancelled, the offset is past the end, or the id is unknown.
    """
    job = _get_job(job_id)
    if job["status"] in ACTIVE:
        raise ToolError(f"job {job['id']} is still {job['status']} ({_elapsed(job) or 0:.0f} s so far); "
                        "call claude_poll until its status is done")
    if job["status"] != "done":
        raise ToolError(f"job {job['id']} {job['status']}: {job.get('error') or 'no reason recorded'}")
    usage = job.get("usage") or None
    answer = job["answer"] or ""
    if offset > len(answer):
        raise ToolError(f"offset {offset} is past the end of the answer ({len(answer)} characters); "
                        "pass the answer_next_offset of your last call")

    def page(limit: int) -> JobResult:
        end = min(len(answer), offset + limit)
        return JobResult(job_id=job["id"], status="done", answer=answer[offset:end], answer_offset=offset,
                         answer_next_offset=end if end < len(answer) else None, answer_total_chars=len(answer),
                         backend=job["backend"], model=(usage or {}).get("model") or job.get("model"), usage=usage)

    return mcp_shared.fit_page(page, max(1, len(answer) - offset), mcp_shared.RESULT_CHARS_MAX)


@registry.tool(ENDS_A_JOB, title="Cancel a Claude job")
def claude_cancel(job_id: JobId) -> CancelResult:
    """Cancel a background job: the claude CLI's process tree is killed within seconds (an API
    request is abandoned) and the job is marked cancelled.

    Returns {job_id, status, cancelled, message}; cancelled is false when the job had already
    finished (its status is left as it was). Errors: unknown id.
    """
    return _cancel(job_runner(), _get_job(job_id))


@registry.tool(READ_ONLY, title="Reverse bridge status")
def claude_status() -> Status:
    """Which backend answers and why, and whether it can: {backend: "api"|"cli", reason, ready,
    problem, api_key_present (never the key), base_url, model, claude_bin, claude_version,
    logged_in (from `claude auth status`; null when unknown), auth_method, sdk_version,
    active_jobs (running in this server), server_pid}."""
    return status(job_runner())


def _cancel(runner: JobRunner, job: dict[str, Any]) -> CancelResult:
    job_id = job["id"]
    if job["status"] in ACTIVE:
        # The record first: the running call's own late "failed" or "done" is then refused.
        job = task_store.finish_claude_job(job_id, "cancelled", error="cancelled by claude_cancel")
        active = job["status"] == "cancelled"
    else:
        active = False
    if not active:
        return CancelResult(job_id=job_id, status=job["status"], cancelled=False,
                            message=f"job {job_id} had already finished ({job['status']}); nothing to cancel")
    other = None if runner.cancel(job_id) else process_tree.same_process(
        job.get("pid"), job.get("pid_start"), tolerance=1.0)
    if other:
        kill_tree(other)  # a job of another live bridge server on this machine
    return CancelResult(job_id=job_id, status="cancelled", cancelled=True,
                        message=f"job {job_id} cancelled"
                        + (f"; claude (pid {job['pid']}) was killed" if job.get("pid") else ""))


# --------------------------------------------------------------------------------------------
# Registration in OpenCode's config.

def opencode_config_path() -> Path:
    """``$XDG_CONFIG_HOME/opencode/opencode.json`` (XDG default ``~/.config``)."""
    return knobs.xdg_home("XDG_CONFIG_HOME") / "opencode" / "opencode.json"


def opencode_entry() -> dict[str, Any]:
    """This server as an OpenCode local MCP server (absolute interpreter and script paths)."""
    return {"type": "local", "command": [str(Path(sys.executable).absolute()), str(Path(__file__).resolve())],
            "enabled": True}


def register_opencode(path: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Merge ``{"mcp": {"claude-control": ...}}`` into OpenCode's config, keeping every other key;
    idempotent. Returns (path, the mcp block). Raises ValueError for a config that is not a JSON
    object (for example one with comments)."""
    path = path or opencode_config_path()
    config = _read_config(path)
    servers = config.setdefault("mcp", {})
    if not isinstance(servers, dict):
        raise ValueError(f"{path}: \"mcp\" is not an object; fix it by hand, then run this again")
    servers[SERVER_NAME] = opencode_entry()
    config.setdefault("$schema", "https://opencode.ai/config.json")
    _write_atomic(path, json.dumps(config, indent=2) + "\n")
    return path, {"mcp": {SERVER_NAME: servers[SERVER_NAME]}}


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text() or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not plain JSON ({exc}); if it has comments, add the block printed by "
                         "--print-opencode-config by hand") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object; fix it by hand, then run this again")
    return config


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".opencode.", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Entry point.

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging() -> None:
    """Logs to stderr at ``$CLAUDE_CONTROL_LOG_LEVEL`` (default WARNING; an unknown level warns
    and falls back to WARNING instead of stopping the server)."""
    wanted = os.environ.get("CLAUDE_CONTROL_LOG_LEVEL", "").strip().upper() or "WARNING"
    logging.basicConfig(stream=sys.stderr, level=wanted if wanted in LOG_LEVELS else "WARNING",
                        format="%(asctime)s claude-control %(levelname)s %(message)s")
    if wanted not in LOG_LEVELS:
        log.warning("CLAUDE_CONTROL_LOG_LEVEL=%r is not one of %s; using WARNING", wanted, ", ".join(LOG_LEVELS))


def recover_at_start() -> None:
    """Settle the jobs a dead server left behind. A database that cannot be used is logged, not
    fatal: the server still starts, lists its tools, and each tool names the problem."""
    try:
        recovered = recover_interrupted_jobs()
    except Exception as exc:
        problem = mcp_shared.database_problem(exc)
        if problem is None:
            raise
        log.error("cannot check for interrupted jobs: %s", problem)
        return
    if recovered:
        log.warning("marked %d interrupted job(s) failed: %s", len(recovered), recovered)


def serve() -> None:
    """Serve MCP over stdio until stdin closes or SIGTERM; jobs in flight end as interrupted."""
    configure_logging()
    recover_at_start()
    runner = JobRunner()
    signal.signal(signal.SIGTERM, lambda signum, _frame: _stop_soon(runner, 128 + signum))
    try:
        build_server(runner).run("stdio")
    finally:
        runner.shutdown()


HTTP_HOSTS = ("127.0.0.1", "localhost", "[::1]")   # the Host names the HTTP transport answers (421 otherwise)


def serve_http(listen_fd: int | None, host: str, port: int) -> int:
    """Serve MCP over streamable-http at ``/mcp`` (and an open ``/health``) on the listening socket
    ``listen_fd`` a parent handed over, else on ``host:port``. The bearer token is the first line
    of stdin (never argv or the environment, which other processes may read); the server stops
    when stdin ends, so a parent that dies (even by SIGKILL) takes it along, and on SIGTERM.
    Returns the exit code: 2 when stdin gives no token."""
    configure_logging()
    token = sys.stdin.buffer.readline().decode("utf-8", "replace").strip()
    if not token:
        print("refusing to start: the HTTP transport reads its bearer token from the first line of stdin; "
              "got none (run it as `(echo TOKEN; cat) | python claude_control_mcp.py --transport "
              "streamable-http --port N`)", file=sys.stderr)
        return 2
    import uvicorn

    import http_app
    recover_at_start()
    runner = JobRunner()
    config = uvicorn.Config(http_bridge_app(build_server(runner), token), host=host, port=port, log_config=None,
                            access_log=False, log_level="warning", timeout_graceful_shutdown=3,
                            **http_app.connection_limits())
    server = uvicorn.Server(config)
    threading.Thread(target=_stop_at_stdin_end, args=(server,), name="stdin-end", daemon=True).start()
    sockets = [socket.socket(fileno=listen_fd)] if listen_fd is not None else None
    try:
        server.run(sockets=sockets)
    finally:
        runner.shutdown()
    return 0


def http_bridge_app(server: MCPServer, token: str) -> Any:
    """The Starlette app of the HTTP transport: http_app's guards (Shield, a loopback-only Host
    allowlist with 421, ``token`` required on ``/mcp`` with 401, compared in constant time) around
    the streamable-http route. Raises ValueError for an empty token: this server never runs open."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    import http_app
    if not token:
        raise ValueError("the reverse bridge's HTTP transport needs a bearer token")
    hosts = frozenset(HTTP_HOSTS)
    route, lifespan = http_app.streamable_route(server, http_app.transport_security(hosts))
    guards = [Middleware(http_app.HostGuard, hosts=hosts),
              Middleware(http_app.BearerGuard, tokens=token, where="the token the worker gave this run's OpenCode")]
    return http_app.Shield(Starlette(routes=[route, Route("/health", _health)], lifespan=lifespan, middleware=guards))


async def _health(_request: Any) -> Any:
    from starlette.responses import JSONResponse
    return JSONResponse({"ok": True, "server": SERVER_NAME})


def _stop_at_stdin_end(server: Any) -> None:
    # The parent holds the pipe's only write end: EOF means it closed it or died.
    with contextlib.suppress(OSError, ValueError):
        while sys.stdin.buffer.read(4096):
            pass
    server.should_exit = True


def _stop_soon(runner: JobRunner, code: int) -> None:
    # A signal handler must not do the work itself (it may interrupt a thread holding a lock it
    # needs), and unwinding the event loop would wait forever on the thread blocked reading stdin:
    # so a helper thread marks the jobs interrupted, kills their CLIs and ends the process.
    def stop() -> None:
        runner.shutdown()
        os._exit(code)

    threading.Thread(target=stop, name="sigterm", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The reverse bridge: MCP tools with which OpenCode asks Claude. "
                                                 "Without options it serves MCP on stdio.")
    parser.add_argument("--register-opencode", action="store_true",
                        help="add this server to OpenCode's config as a local MCP server (idempotent)")
    parser.add_argument("--print-opencode-config", action="store_true",
                        help="print the OpenCode config block without writing anything")
    parser.add_argument("--config", type=Path, help="OpenCode config file to edit (default: "
                                                     "$XDG_CONFIG_HOME/opencode/opencode.json)")
    parser.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio",
                        help="stdio (OpenCode starts the server) or streamable-http at /mcp (the worker starts it "
                             "outside the agent's box; bearer token on the first line of stdin; stops when stdin ends)")
    parser.add_argument("--host", default="127.0.0.1", help="streamable-http: the address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="streamable-http: the port to bind")
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="streamable-http: serve on this inherited listening socket instead of --host/--port")
    parser.add_argument("--db", metavar="URL", default=None,
                        help="the queue holding the Claude jobs: a postgresql:// URL or a SQLite file (default "
                             "$TASK_DB_URL, else $TASK_DB_PATH or <repo>/tasks.db); sets TASK_DB_URL for this process")
    args = parser.parse_args(argv)
    try:   # before anything touches the store
        knobs.select_database(args.db)
    except knobs.KnobError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    if args.print_opencode_config:
        print(json.dumps({"mcp": {SERVER_NAME: opencode_entry()}}, indent=2))
        return 0
    if args.register_opencode:
        return _register(args.config)
    refused = knobs.problems(CLAUDE_KNOBS)
    if refused:
        print(f"refusing to start: {refused[0]}", file=sys.stderr)
        return 2
    if args.transport == "streamable-http":
        return serve_http(args.listen_fd, args.host, args.port)
    serve()
    return 0


def _register(path: Path | None) -> int:
    try:
        written, block = register_opencode(path)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"registered {SERVER_NAME} in {written}:")
    print(json.dumps(block, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
