"""TaskBridge's HTTP side: one Starlette app on one port for the MCP transports (/mcp
streamable-http; /sse and /messages/ sse), /health, the board's shell (GET /, /board/*) and its
JSON API (/api/*, see board_api).

Guards, outermost first: Shield (a whole-request body deadline and size cap on every route, 408 /
413, and the safety headers on every answer), HostGuard (421 for a malformed Host or one outside the allowlist, on
every route), BearerGuard (401 without the bearer token on /mcp, /sse, /messages and /api;
constant-time compare; the token is never logged; an OAuth access token from the oauth module is
accepted too; the token file is re-read when it changes, see TokenSource) and TransportGuard (the
SDK's Origin and Content-Type checks on the MCP transports, 403 / 400, answered as JSON). /health, the board's
static shell and the OAuth endpoints stay open and hold no
data. uvicorn runs with a request-head deadline and size cap, idle time-outs and a connection cap
(connection_limits). Every refusal, uvicorn's own included (RefusingAsJson), is JSON naming the
problem and the way out: on /mcp a JSON-RPC error, elsewhere ``{"error": ...}`` (refusal_body);
the SDK's own refusals get the way out added (McpWayOut on /mcp, JsonRefusals on /messages/).

Env read at call time: MCP_BEARER_TOKEN, else the token file MCP_TOKEN_FILE (default
<repo>/.taskbridge/token); MCP_ALLOWED_HOSTS (extra Host names, comma list); MCP_PUBLIC_URL (the
public base URL: its host is allowed, and OAuth for remote connectors is served);
TASKBRIDGE_TUNNEL_PID (set by serve.py: the tunnel whose connections may name their client,
client_address). Nothing happens at import time. Run it through ``python opencode_bridge_mcp.py
--transport streamable-http``.
"""
from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import os
import re
import secrets
import socket
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import ClientDisconnect

import board_api
import connectors
import mcp_shared
import oauth
import process_tree
import task_store
import task_views

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
PROTECTED_PREFIXES = ("/mcp", "/sse", "/messages", "/api")
REQUEST_HEAD_SEC = 10.0        # a connection must send a complete request head this soon, or it is closed
KEEP_ALIVE_SEC = 5             # idle time between requests on one connection
MAX_CONNECTIONS = 128          # open connections; more are closed at once (macOS's default ulimit -n is 256)
MAX_PEER_CONNECTIONS = 32      # of them from one address beyond this machine (a tunnel, on loopback, is exempt)
MAX_PEER_REQUESTS = 32         # requests in progress from one client address (a tunnel's named client too)
MAX_HEAD_BYTES = 16 * 1024     # a request head larger than this is refused (h11)
LOGGED_CHARS = 120             # of a request path in a log line
BODY_SEC = 30.0                # a request body must arrive whole this soon after its head (408 otherwise)
MAX_BODY_BYTES = 8 * 1024 * 1024       # of a request body to /mcp, /sse, /messages (413 beyond)
MAX_OAUTH_BODY_BYTES = 64 * 1024       # of a request body to the open routes (/register, /token, consent)

log = logging.getLogger("taskbridge.mcp")


def token_file() -> Path:
    """The bearer token file: ``$MCP_TOKEN_FILE`` or ``<repo>/.taskbridge/token``, absolute (read
    in one place, connectors.token_file, which serve.py and the set-up snippets use too)."""
    return connectors.token_file()


class TokenConfigError(Exception):
    """A bearer token source is configured but unusable; the message names the source and the
    fix, never the token."""


def bearer_token() -> str | None:
    """``$MCP_BEARER_TOKEN``, else the token file's content, else None (no token configured: the
    variable is unset and the file does not exist). Raises TokenConfigError when the variable is
    set but blank, or the file is a folder, unreadable, empty, or holds a token that an HTTP
    header cannot carry (whitespace inside, non-ASCII)."""
    if "MCP_BEARER_TOKEN" in os.environ:
        token = os.environ["MCP_BEARER_TOKEN"].strip()
        if not token:
            raise TokenConfigError("MCP_BEARER_TOKEN is set but blank: put the token in it, or unset it "
                                   f"to use the token file ({token_file()})")
        return _checked_token(token, "MCP_BEARER_TOKEN")
    path = token_file()
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise TokenConfigError(f"the token file {path} is a folder: point MCP_TOKEN_FILE at a file holding "
                               "the token (install.sh writes one), or set MCP_BEARER_TOKEN") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "it is not text"
        raise TokenConfigError(f"cannot read the token file {path} ({why}): fix its permissions for this "
                               "user, point MCP_TOKEN_FILE elsewhere, or set MCP_BEARER_TOKEN") from None
    if not token:
        raise TokenConfigError(f"the token file {path} is empty: write a token in it (install.sh does), "
                               "delete it, or set MCP_BEARER_TOKEN")
    _warn_if_readable(path)
    return _checked_token(token, f"the token file {path}")


class TokenSource:
    """The bearer token in force, re-read when the token file changes: each ``current()`` stats
    the file (inode, mtime, size; a few microseconds) and reads it again only when that changed,
    so ``serve.py --rotate`` takes effect on a running server at once. ``$MCP_BEARER_TOKEN``, when
    set at start, is fixed for the process. A token file that was in use and turns unusable
    (deleted, emptied, unreadable) refuses every token until it is fixed: it never opens the
    server."""

    def __init__(self) -> None:
        self.fixed = "MCP_BEARER_TOKEN" in os.environ
        self._stamp = self._stat()
        self._token = bearer_token()   # raises TokenConfigError for an unusable source at start
        self._broken = secrets.token_urlsafe(32)   # matches nothing anyone holds

    @classmethod
    def fixed_to(cls, token: str | None) -> TokenSource:
        """A source that always gives ``token`` (for a guard built around a known token)."""
        source = cls.__new__(cls)
        source.fixed, source._stamp, source._token, source._broken = True, None, token or None, ""
        return source

    def _stat(self) -> tuple[int, int, int] | None:
        if "MCP_BEARER_TOKEN" in os.environ:
            return None
        try:
            st = token_file().stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def current(self) -> str | None:
        """The token now in force, or None when none is configured (then the routes are open,
        loopback only). Never raises."""
        if self.fixed:
            return self._token
        stamp = self._stat()
        if stamp == self._stamp:
            return self._token
        self._stamp = stamp
        try:
            token = bearer_token()
        except TokenConfigError as exc:
            log.error("%s; until then every token is refused", exc)
            token = self._broken if self._token else None
        if token is None and self._token:
            log.error("the token file %s is gone; every token is refused until it is back (./install.sh or "
                      "serve.py --setup-only writes one)", loggable(str(token_file())))
            token = self._broken
        if token != self._token:
            if self._token and token != self._broken:
                log.warning("the bearer token file changed: the new token is in force, the old one and every "
                            "OAuth token made with it no longer work")
            self._token = token
        return self._token


def _warn_if_readable(path: Path) -> None:
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("the token file %s is readable by other users (mode %o): run %s "
                        "(./install.sh does)", loggable(str(path)), mode,
                        loggable(task_store.shell_command("chmod", "600", str(path))))


def loggable(text: str, limit: int = LOGGED_CHARS) -> str:
    """``text`` safe for one log line: control and other non-printable characters as ``\\xNN`` /
    ``\\uNNNN`` escapes (no fake line, no terminal escape sequence reaches a terminal), cut to
    ``limit`` characters with ``…`` when longer."""
    escaped = "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
                      for c in text[:limit * 2])
    return escaped if len(escaped) <= limit and len(text) <= limit * 2 else escaped[:limit] + "…"


def _checked_token(token: str, source: str) -> str:
    if not token.isascii() or any(c.isspace() or not c.isprintable() for c in token):
        raise TokenConfigError(f"{source} holds a token with whitespace or non-ASCII characters, which no "
                               "Authorization header can carry: use one line of printable ASCII "
                               "(install.sh makes one with secrets.token_urlsafe)")
    return token


_HOST_RE = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?\.?)(?::(?P<port>[0-9]{1,5}))?")


def parse_host(value: str) -> tuple[str, str | None] | None:
    """A Host header split into (lower-case name without a trailing dot, port or None); None when
    it is malformed: anything but a DNS name, an IPv4 address or a bracketed IPv6 address,
    optionally followed by ``:`` and a port of digits only (``localhost:evil.com`` and
    ``127.0.0.1:1@evil.com`` are malformed, ``[::1]:8765`` is not)."""
    match = _HOST_RE.fullmatch(value.strip().lower())
    if match is None or (match["port"] is not None and int(match["port"]) > 65535):
        return None
    return match["name"].rstrip("."), match["port"]


def host_name(value: str) -> str | None:
    """An allowlist entry (a name, ``name:port``, a bare IPv6 address or a URL) reduced to its
    lower-case name; None when it is not a host name at all."""
    name = value.strip().lower()
    if "://" in name:
        name = name.split("://", 1)[1]
    name = name.split("/", 1)[0]
    if name.count(":") > 1 and not name.startswith("["):   # a bare IPv6 address
        name = f"[{name}]"
    parsed = parse_host(name)
    return parsed[0] if parsed else None


def allowed_hosts() -> frozenset[str]:
    """Loopback names plus ``$MCP_ALLOWED_HOSTS`` (comma list; any port, any case) and the host of
    ``$MCP_PUBLIC_URL``. An entry that is not a host name is skipped with a warning."""
    extra = set()
    entries = (os.environ.get("MCP_ALLOWED_HOSTS") or "").split(",") + [os.environ.get("MCP_PUBLIC_URL") or ""]
    for entry in entries:
        if entry.strip():
            name = host_name(entry)
            if name is None:
                log.warning("MCP_ALLOWED_HOSTS: %r is not a host name; skipped", entry.strip())
            else:
                extra.add(name)
    return frozenset(LOOPBACK_NAMES) | frozenset(extra)


def transport_security(hosts: frozenset[str]) -> TransportSecuritySettings:
    """The SDK's own Host/Origin check with the same names (bare and any port)."""
    names = sorted(hosts)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[h for n in names for h in (n, f"{n}:*")],
        allowed_origins=[o for n in names for s in ("http", "https") for o in (f"{s}://{n}", f"{s}://{n}:*")],
    )


async def _plain(send: Any, status: int, body: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


MCP_PATH = "/mcp"
JSONRPC_INVALID_REQUEST, JSONRPC_INTERNAL_ERROR = -32600, -32603   # the codes the SDK's own /mcp refusals use


def refusal_body(path: str | None, status: int, message: str) -> dict[str, Any]:
    """What a refusal of a request to ``path`` says: on /mcp a JSON-RPC error without a request
    id, ``{"jsonrpc": "2.0", "id": null, "error": {"code": ..., "message": ...}}``, the shape of
    the SDK's own refusals there and the one its client hands its caller (it reads a non-2xx
    answer's body only when it is a JSON-RPC error); elsewhere ``{"error": message}``. ``path``
    is None when the request could not be read far enough to tell it."""
    if path == MCP_PATH:
        code = JSONRPC_INTERNAL_ERROR if status >= 500 else JSONRPC_INVALID_REQUEST
        return {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
    return {"error": message}


async def refuse(send: Any, path: str | None, status: int, message: str,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``status`` with ``message`` (naming the problem and the way out) in the shape
    refusal_body gives for ``path``, as JSON."""
    await _plain(send, status, refusal_body(path, status, message), headers)



# The SDK's SSE transport refuses a POST to /messages/ in plain text; each as a JSON refusal that
# names the way out (keyed by the start of the SDK's text; docs/http.md).
MESSAGES_WAY_OUT = {
    "session_id is required": "session_id is required: open GET /sse first; its endpoint event names the "
                              "/messages/?session_id=... URL to POST to",
    "Invalid session ID": "session_id is not a session id (32 hex digits): POST to the URL the /sse stream's "
                          "endpoint event gave",
    "Could not find session": "no open /sse stream has this session_id (it closed, or the server restarted): "
                              "open GET /sse again and POST to the URL its endpoint event gives",
}


class RewrittenRefusals:
    """Pure ASGI around one of the SDK's handlers: a refusal it answers (status 400 and above, and
    ``holds`` says so) is held whole and sent again by ``answer``; anything else passes as it is.
    Subclasses give ``holds`` and ``answer``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def holds(self, start: dict) -> bool:
        """Whether the refusal whose ``http.response.start`` message is ``start`` is rewritten:
        every one unless a subclass says otherwise."""
        return start["status"] >= 400

    async def answer(self, send: Any, start: dict, body: bytes) -> None:
        """Send the held refusal (``start``, its whole ``body``) as it is to go out."""
        raise NotImplementedError

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        held: dict[str, Any] = {}

        async def relay(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and self.holds(message):
                held["start"] = message
                return
            if "start" not in held:
                return await send(message)
            held["body"] = held.get("body", b"") + message.get("body", b"")
            if not message.get("more_body"):
                await self.answer(send, held["start"], held["body"])

        await self.app(scope, receive, relay)


class JsonRefusals(RewrittenRefusals):
    """Around the SDK's /messages/ handler: a refusal it answers in plain text goes out as the
    JSON ``{"error": ...}`` every other refusal is, with the way out (MESSAGES_WAY_OUT)."""

    def holds(self, start: dict) -> bool:
        return not any(k == b"content-type" and b"json" in v for k, v in start.get("headers", []))

    async def answer(self, send: Any, start: dict, body: bytes) -> None:
        text = body.decode("utf-8", "replace").strip()
        said = next((way for begins, way in MESSAGES_WAY_OUT.items() if text.startswith(begins)),
                    f"{loggable(text, 200) or 'refused'}: POST JSON-RPC to the URL the /sse stream's "
                    "endpoint event gave")
        await _plain(send, start["status"], {"error": said})


# The SDK's own refusals on /mcp are JSON-RPC errors already, but most name no way out; each
# gets one (keyed by the start of the SDK's message, which is kept: a client may look for it).
MCP_WAY_OUT = {
    "Session not found": "the session ended (the server restarted, or it sat idle for 30 minutes): start a "
                         "new one by sending initialize without an Mcp-Session-Id header",
    "Not Found:": "the session ended (the server restarted, or it sat idle for 30 minutes): start a new one by "
                  "sending initialize without an Mcp-Session-Id header",
    "Too many open sessions": "close sessions you no longer use (DELETE /mcp with their Mcp-Session-Id), or try "
                              "again once idle ones expire (30 minutes)",
    "Bad Request: Missing session ID": "send the Mcp-Session-Id header the initialize answer gave, or send "
                                       "initialize first",
    "Not Acceptable": "send Accept: application/json, text/event-stream",
    "Unsupported Media Type": "send Content-Type: application/json",
    "Method Not Allowed": "/mcp takes POST (messages), GET (the session's stream) and DELETE (end the session)",
    "Conflict": "close this session's other GET /mcp stream first",
    "Parse error": "send one JSON-RPC message (or a batch of them) as JSON",
    "Validation error": "send a JSON-RPC 2.0 message as the MCP specification gives it",
}


class McpWayOut(RewrittenRefusals):
    """Around the /mcp endpoint: a refusal the SDK answers (a JSON-RPC error) gets the way out
    MCP_WAY_OUT gives for it after its own words; an answer that is not a JSON-RPC error is sent
    as it came."""

    async def answer(self, send: Any, start: dict, body: bytes) -> None:
        await send_with_way_out(send, start, body)


async def send_with_way_out(send: Any, start: dict, body: bytes) -> None:
    """Send the SDK's refusal (``start``, ``body``), its message followed by MCP_WAY_OUT's way
    out when it is a JSON-RPC error that has one."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        said = json.loads(body)
        message = said["error"]["message"]
        way = next((way for begins, way in MCP_WAY_OUT.items() if message.startswith(begins)), None)
        if way and way not in message:
            said["error"]["message"] = f"{message}: {way}"
            body = json.dumps(said).encode()
    headers = [(k, str(len(body)).encode() if k.lower() == b"content-length" else v)
               for k, v in start.get("headers", [])]
    await send(dict(start, headers=headers))
    await send({"type": "http.response.body", "body": body})


def host_refusal(count: int, parsed: tuple[str, str | None] | None) -> str:
    """The 421's one line: the refused name and the knob that allows it, or what is malformed
    about the Host header (``count`` Host headers were sent; ``parsed`` is parse_host's answer for
    the one, None when malformed). A malformed value is never echoed; a parsed name holds only
    the characters a host name may."""
    if parsed is not None:
        return (f"the Host {parsed[0]!r} is not on this server's allowlist; if it is yours, add it to "
                "MCP_ALLOWED_HOSTS (comma-separated names) and restart")
    if count != 1:
        return f"a request needs exactly one Host header ({count} sent)"
    return ("the Host header is malformed: a host name or IP address, then optionally ':' and a port "
            "of at most 65535")


class HostGuard:
    """Pure ASGI: 421 for a malformed Host or one outside the allowlist, on every route. The Host
    header goes on in its canonical form (lower case, ``name`` or ``name:port``), so the SDK's own
    check (a prefix match on ``name:``) only ever sees a Host this guard has already judged."""

    def __init__(self, app: Any, hosts: frozenset[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers", []))
        values = [v.decode("latin-1") for k, v in headers if k == b"host"]
        parsed = parse_host(values[0]) if len(values) == 1 else None
        if parsed is None or parsed[0] not in self.hosts:
            log.warning("refused a request for a Host outside the allowlist (421)")
            return await refuse(send, scope.get("path"), 421, host_refusal(len(values), parsed))
        canonical = (parsed[0] if parsed[1] is None else f"{parsed[0]}:{parsed[1]}").encode("latin-1")
        scope = dict(scope, headers=[(k, canonical if k == b"host" else v) for k, v in headers])
        await self.app(scope, receive, send)


class RequestRefused(ClientDisconnect):
    """A request body broke its deadline or size cap; Shield has answered it already. A kind of
    ClientDisconnect, so every layer between treats it as the client gone."""


def _only_disconnects(exc: BaseException) -> bool:
    """Whether ``exc`` is a ClientDisconnect, or a group (from a task group) of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_disconnects(e) for e in exc.exceptions)
    return isinstance(exc, ClientDisconnect)


def _one_line_disconnects(record: logging.LogRecord) -> bool:
    """Logging filter for the SDK's transports: a handler's error that is only a client gone
    mid-body (or a body Shield refused) becomes one line without its traceback."""
    if record.exc_info and record.exc_info[1] is not None and _only_disconnects(record.exc_info[1]):
        said = record.getMessage()
        record.msg, record.args = "%s: the client hung up or its body was refused (no traceback)", (said,)
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
    return True


def body_cap(path: str) -> int:
    """The most bytes a request body to ``path`` may have: MAX_OAUTH_BODY_BYTES on the open
    OAuth endpoints, board_api.BODY_MAX on /api, MAX_BODY_BYTES elsewhere (MCP messages)."""
    if path.startswith("/api"):
        return board_api.BODY_MAX
    if _protected(path):
        return MAX_BODY_BYTES
    return MAX_OAUTH_BODY_BYTES


def too_large(path: str, cap: int) -> str:
    """The 413's one line for a body to ``path`` over ``cap`` bytes, with the way out."""
    if cap == MAX_BODY_BYTES and _protected(path):
        return (f"the MCP message is too large: at most {cap} bytes ({cap / 2**20:g} MiB) are accepted; send "
                "less (long instructions or data can go in a file in the task's working_dir, named in them)")
    return f"the request body is too large: at most {cap} bytes are accepted here; send less"


SAFETY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"))
DATA_HEADERS = ((b"cache-control", b"no-store"), (b"x-frame-options", b"DENY"),
                (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"))


def safety_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` plus the safety headers it lacks: nosniff and no-referrer on every answer; on
    anything but an HTML page (JSON, event streams, plain text) also no-store, DENY framing and
    a CSP that loads nothing. Headers the route set itself are kept."""
    have = {k.lower() for k, _ in headers}
    kind = next((v for k, v in headers if k.lower() == b"content-type"), b"").lower()
    extra = SAFETY_HEADERS + (() if kind.startswith(b"text/html") or kind.startswith(b"text/css")
                              or kind.startswith(b"text/javascript") or kind.startswith(b"application/javascript")
                              or kind.startswith(b"image/") else DATA_HEADERS)
    return [*headers, *((k, v) for k, v in extra if k not in have)]


class Shield:
    """Pure ASGI, outermost: every request body must arrive whole within BODY_SEC of the request
    head and stay under body_cap(path) bytes (408 / 413 otherwise, checked as it streams, chunked
    bodies too; a Content-Length over the cap is refused before reading); every answer gets the
    safety headers (safety_headers); a client that hangs up mid-body costs one log line, not a
    traceback. One client address (beyond this machine, or the client the tunnel names:
    client_address) may have at most MAX_PEER_REQUESTS requests in progress (429 beyond), so one
    peer behind a tunnel cannot hold every connection slot with slow requests."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.active: dict[str, int] = {}   # client address: its requests in progress

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        peer = client_address(scope)
        if is_loopback(peer) or peer == "::1":
            return await self._serve(scope, receive, send)
        if self.active.get(peer, 0) >= MAX_PEER_REQUESTS:
            log.warning("more than %d requests in progress from one address: refused one (429)", MAX_PEER_REQUESTS)
            return await refuse(send, scope.get("path"), 429, f"more than {MAX_PEER_REQUESTS} requests in progress "
                                "from this address; finish some first, or try again in 10 seconds",
                                safety_headers([(b"content-type", b"application/json"),
                                                (b"connection", b"close"), (b"retry-after", b"10")])[1:])
        self.active[peer] = self.active.get(peer, 0) + 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.active[peer] -= 1
            if not self.active[peer]:
                del self.active[peer]

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
        import anyio

        path, cap = scope.get("path", ""), body_cap(scope.get("path", ""))
        deadline = anyio.current_time() + BODY_SEC
        state = {"read": 0, "done": False, "started": False, "answered": False}

        async def answer(status: int, message: str) -> None:
            if not state["started"]:
                state["answered"] = True
                await refuse(send, path, status, message,
                             safety_headers([(b"content-type", b"application/json"), (b"connection", b"close")])[1:])
            raise RequestRefused(message)

        async def guarded_send(message: dict) -> None:
            if state["answered"]:
                return
            if message["type"] == "http.response.start":
                state["started"] = True
                message = dict(message, headers=safety_headers(list(message.get("headers", []))))
            await send(message)

        async def guarded_receive() -> dict:
            if state["done"]:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())) as scope_:
                message = await receive()
            if scope_.cancelled_caught:
                log.warning("%s %s: the request body did not arrive within %g s (408)",
                            loggable(scope.get("method", "")), loggable(path), BODY_SEC)
                await answer(408, f"the request body did not arrive within {BODY_SEC:g} seconds: send the whole "
                                  "body at once, on a connection that is not stalled")
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > cap:
                    log.warning("%s %s: a request body over %d bytes (413)", loggable(scope.get("method", "")),
                                loggable(path), cap)
                    await answer(413, too_large(path, cap))
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        try:
            if length is not None and length.strip().isdigit() and int(length) > cap:
                log.warning("%s %s: Content-Length over %d bytes (413)", loggable(scope.get("method", "")),
                            loggable(path), cap)
                await answer(413, too_large(path, cap))
            await self.app(scope, guarded_receive, guarded_send)
        except Exception as exc:   # a task group inside may wrap them (ExceptionGroup)
            if not _only_disconnects(exc):
                raise
            if not state["answered"]:
                log.info("%s %s: the client hung up before sending the whole body",
                         loggable(scope.get("method", "")), loggable(path))


def _supplied_token(scope: dict) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    # Hosted connectors cannot send headers: the token may come as ?token=… (never logged).
    for part in scope.get("query_string", b"").decode("latin-1").split("&"):
        if part.startswith("token="):
            return unquote(part[6:])
    return None


def _protected(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PROTECTED_PREFIXES)


class BearerGuard:
    """Pure ASGI: /mcp, /sse, /messages, /api need the bearer token (constant-time compare);
    401 with WWW-Authenticate otherwise, for plain HTTP and WebSocket requests alike (no route
    takes a WebSocket today; one added later must not be open). The token is never logged, and a
    refused path is logged escaped and cut short."""

    def __init__(self, app: Any, tokens: TokenSource | str | None, provider: Any = None,
                 where: str = "MCP_BEARER_TOKEN or the .taskbridge/token file") -> None:
        self.app, self.oauth, self.where = app, provider, where
        self.tokens = tokens if isinstance(tokens, TokenSource) else TokenSource.fixed_to(tokens)
        self.challenge = 'Bearer realm="taskbridge"'
        if provider is not None:   # where OAuth clients discover the authorization server (RFC 9728)
            self.challenge += f', resource_metadata="{oauth.resource_metadata_url(provider)}"'

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        token = self.tokens.current()
        if scope["type"] == "lifespan" or (scope["type"] in ("http", "websocket")
                                           and (not token or not _protected(scope.get("path", "")))):
            return await self.app(scope, receive, send)
        supplied = _supplied_token(scope) if scope["type"] in ("http", "websocket") else None
        if supplied is not None and hmac.compare_digest(supplied.encode(), (token or "").encode()):
            return await self.app(scope, receive, send)
        if supplied and self.oauth is not None and await self.oauth.load_access_token(supplied) is not None:
            return await self.app(scope, receive, send)
        log.info("refused %s %s: %s bearer token (401)", loggable(str(scope.get("method", scope["type"]))),
                 loggable(scope.get("path", "")), "wrong" if supplied else "no")
        error = "invalid_token" if supplied else "invalid_request"
        headers = [(b"www-authenticate", f'{self.challenge}, error="{error}"'.encode())]
        said = f"a valid bearer token is required: send Authorization: Bearer <token> ({self.where})"
        if scope["type"] == "http":
            return await refuse(send, scope.get("path"), 401, said, headers)
        if scope["type"] == "websocket":
            return await _deny_websocket(scope, receive, send, headers)


MCP_TRANSPORT_PREFIXES = ("/mcp", "/sse", "/messages")   # where the SDK's transport_security check runs


def origin_allowed(origin: str, allowed_origins: Sequence[str]) -> bool:
    """Whether the SDK's transport security admits the ``Origin`` value ``origin`` given
    ``allowed_origins`` (TransportSecuritySettings.allowed_origins: ``scheme://name``, or
    ``scheme://name:*`` for any port). The SDK's own rule, so that nothing this lets through is
    refused later in the SDK's plain-text shape."""
    return origin in allowed_origins or any(
        allowed.endswith(":*") and origin.startswith(allowed[:-1]) for allowed in allowed_origins)


def transport_refusal(scope: dict, allowed_origins: Sequence[str]) -> tuple[int, str] | None:
    """``(status, one line)`` for a request to an MCP transport the SDK's transport security would
    refuse: 400 for a POST whose Content-Type is not JSON, 403 for an Origin not allowed (absent is
    fine); None when it passes. Names the value sent (escaped, cut short) and the way out."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    content_type = headers.get("content-type")
    if scope.get("method") == "POST" and not (content_type or "").lower().startswith("application/json"):
        return 400, (f"an MCP message must be sent as JSON: send Content-Type: application/json "
                     f"(sent: {loggable(content_type, 80) if content_type is not None else 'none'})")
    origin = headers.get("origin")
    if origin and not origin_allowed(origin, allowed_origins):
        return 403, (f"the Origin {loggable(origin, 80)!r} is not one this server takes MCP requests from "
                     "(a web page elsewhere may not drive it): send no Origin header or one naming this "
                     "server's host, or if that site is yours add its host name to MCP_ALLOWED_HOSTS and restart")
    return None


class TransportGuard:
    """Pure ASGI: the SDK's Origin and Content-Type checks on /mcp, /sse and /messages, judged
    first with the SDK's rules so a refusal is a JSON ``{"error": ...}`` like every other one (the
    SDK answers them in plain text)."""

    def __init__(self, app: Any, allowed_origins: Sequence[str]) -> None:
        self.app, self.allowed_origins = app, list(allowed_origins)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and any(path == p or path.startswith(p + "/") for p in MCP_TRANSPORT_PREFIXES):
            refused = transport_refusal(scope, self.allowed_origins)
            if refused:
                log.warning("refused %s %s (%d): %s", loggable(str(scope.get("method"))), loggable(path), *refused)
                return await refuse(send, path, *refused)
        await self.app(scope, receive, send)


async def _deny_websocket(scope: dict, receive: Any, send: Any, headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a WebSocket handshake: a 401 where the server supports ASGI's denial response,
    else a close before accepting (the server answers 403)."""
    await receive()   # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        data = b'{"error": "a valid bearer token is required"}'
        await send({"type": "websocket.http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "websocket.http.response.body", "body": data})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def health(_request: Any) -> Any:
    """``GET /health``: open, and reveals nothing private."""
    from starlette.responses import JSONResponse
    return JSONResponse({"ok": True, "version": task_views.VERSION})


def is_loopback(host: str) -> bool:
    """Whether a bind address only reaches this machine."""
    return host_name(host) in LOOPBACK_NAMES or host.startswith("127.")


def build_app(server: MCPServer) -> Any:
    """The one Starlette app for every HTTP transport around ``server`` (the MCP server whose
    transports it mounts); reads the token and allowlist now.

    Each call builds fresh SDK transports (a session manager runs once per app lifespan)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Mount

    hosts = allowed_hosts()
    security = transport_security(hosts)
    mcp_route, lifespan = streamable_route(server, security)
    sse = server.sse_app(sse_path="/sse", message_path="/messages/", transport_security=security,
                         max_request_body_size=MAX_BODY_BYTES)
    tokens = TokenSource()
    token = tokens.current()
    beyond = sorted(h for h in hosts if h not in LOOPBACK_NAMES)
    if not token and beyond:
        raise TokenConfigError(f"MCP_ALLOWED_HOSTS admits {', '.join(beyond)} (beyond this machine) but no bearer "
                               "token is configured: anyone reaching that host could queue work that runs on this "
                               "machine. Run ./install.sh (it writes the token) or set MCP_BEARER_TOKEN, or drop "
                               "those names")
    if not token:
        # a MCP_TOKEN_FILE that names no file may be a typo: the file it names is said, and how to close the port
        named = (f" (MCP_TOKEN_FILE names {token_file()}, which does not exist: a typo? run ./install.sh to write "
                 "a token there, or fix the path)" if os.environ.get("MCP_TOKEN_FILE") else "")
        log.warning("no bearer token configured%s: /mcp, /sse and /api are open to anything that reaches this port",
                    named)
    provider = oauth_provider(tokens)
    auth_routes = oauth.routes(provider, client_address) if provider else []
    sse_routes = [Mount(r.path, app=JsonRefusals(r.app)) if isinstance(r, Mount) else r for r in sse.routes]
    return Shield(Starlette(routes=[mcp_route, *sse_routes, *auth_routes, *http_routes()], lifespan=lifespan,
                            exception_handlers={404: no_route, 405: no_route},
                            middleware=[Middleware(HostGuard, hosts=hosts),
                                        Middleware(BearerGuard, tokens=tokens, provider=provider),
                                        Middleware(TransportGuard, allowed_origins=security.allowed_origins)]))


async def no_route(request: Any, exc: Any) -> Any:
    """Starlette's 404 and 405 as the JSON ``{"error": ...}`` every other refusal is (Starlette
    answered them in plain text), naming the path or method and where the routes are listed."""
    from starlette.responses import JSONResponse

    path = loggable(request.url.path, 120)
    if exc.status_code == 405:
        said = f"{loggable(request.method, 10)} is not a method of {path}; docs/http.md lists each route's methods"
    else:
        said = (f"no route {path}: the board is /, its API /api/..., MCP /mcp and /sse, and /health "
                "(docs/http.md lists every route)")
    return JSONResponse({"error": said}, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def streamable_route(server: MCPServer, security: TransportSecuritySettings) -> tuple[Any, Any]:
    """``(route, lifespan)``: the ``/mcp`` streamable-http route around ``server`` and the
    lifespan that runs its session managers (each app that mounts the route must use it)."""
    from starlette.routing import Route

    for name in ("mcp.server.streamable_http", "mcp.server.sse", "mcp.server.auth"):
        logging.getLogger(name).addFilter(_one_line_disconnects)
    # Two session managers for /mcp: SSE streams for clients that take them, plain JSON for
    # clients that accept only application/json (mcp_shared.StreamableEndpoint routes between them).
    # The SDK caps a body at 4 MiB of its own, in plain text: it is given ours (Shield has
    # already refused anything larger, as JSON), so MAX_BODY_BYTES is the one cap in force.
    server.streamable_http_app(streamable_http_path=MCP_PATH, transport_security=security,
                               max_request_body_size=MAX_BODY_BYTES)
    streaming = server.session_manager
    server.streamable_http_app(streamable_http_path=MCP_PATH, transport_security=security, json_response=True,
                               max_request_body_size=MAX_BODY_BYTES)
    plain = server.session_manager

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any):
        async with streaming.run(), plain.run():
            yield

    return Route(MCP_PATH, endpoint=McpWayOut(mcp_shared.StreamableEndpoint(streaming, plain))), lifespan


def oauth_provider(tokens: TokenSource) -> Any:
    """The OAuth provider for remote connectors when ``$MCP_PUBLIC_URL`` is set and a bearer token
    exists (the consent page asks for it; it follows ``tokens`` as the token file changes), else
    None. Raises TokenConfigError for a public URL that cannot be an OAuth issuer."""
    try:
        base = oauth.public_url()
    except oauth.OAuthConfigError as exc:
        raise TokenConfigError(str(exc)) from None
    if not base or not tokens.current():
        return None
    return oauth.Provider(tokens.current, base, token_file().parent / "oauth.json")


# Connections (their client (ip, port)) that the tunnel serve.py started holds open: only these may
# name the client they carry. Filled and emptied by the deadline protocol, read by client_address.
TUNNEL_CONNECTIONS: set[tuple[str, int]] = set()


def tunnel_process() -> Any:
    """The tunnel serve.py started, from ``$TASKBRIDGE_TUNNEL_PID`` (``pid:start time``, set by
    serve.py for its server child), or None: none was started, or it is gone (a reused pid is not
    it). Anything else on this machine is a local client like any other."""
    pid, _, started = (os.environ.get("TASKBRIDGE_TUNNEL_PID") or "").partition(":")
    try:
        return process_tree.same_process(int(pid), float(started)) if pid else None
    except ValueError:
        return None


def from_tunnel(client: tuple[str, int] | None, server_port: int) -> bool:
    """Whether the loopback connection from ``client`` (ip, port) to our ``server_port`` is held
    by the tunnel serve.py started (the operating system says whose socket it is)."""
    if not client or client[0] not in ("127.0.0.1", "::1"):
        return False
    proc = tunnel_process()
    return proc is not None and process_tree.holds_connection(proc, client, server_port)


def client_address(scope: dict) -> str:
    """The address a request came from: the TCP peer; for a connection the tunnel serve.py
    started holds (TUNNEL_CONNECTIONS), the client the tunnel names (CF-Connecting-IP, else the
    last X-Forwarded-For entry, which the tunnel appended). Any other peer's forwarding headers
    are ignored: a local process, or a tunnel someone else runs, could write anything there."""
    client = scope.get("client") or ("?", 0)
    if tuple(client) not in TUNNEL_CONNECTIONS:
        return client[0]
    headers = {k: v.decode("latin-1") for k, v in scope.get("headers", [])}
    named = headers.get(b"cf-connecting-ip") or headers.get(b"x-forwarded-for", "").split(",")[-1]
    return named.strip()[:64] or client[0]


def http_routes() -> list[Any]:
    """The routes beside the MCP transports: /health, then the board's shell and API."""
    from starlette.routing import Route
    return [Route("/health", health), *board_api.routes()]


class PortTaken(OSError):
    """The address to serve on cannot be bound; the message names the holder and the way out."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR, as uvicorn binds), for uvicorn to listen on.
    Raises PortTaken naming the process that holds the port (when it can be told) and the way out,
    where uvicorn logged its start-up and then a raw "[Errno 98] address already in use"."""
    try:
        return process_tree.bind_port(host, port)
    except process_tree.AddressInUse as exc:
        who = f" by {exc.holder.info['name']} (pid {exc.holder.pid})" if exc.holder is not None else ""
        raise PortTaken(exc.errno, f"cannot serve on {host}:{port}: the port is taken{who}; stop it, or give "
                                   "another --port") from None
    except OSError as exc:   # a host name that does not resolve, an address not of this machine
        raise PortTaken(exc.errno, f"cannot serve on {host}:{port}: {exc.strerror}; give --host an address of "
                                   "this machine (127.0.0.1 for this machine alone)") from None


def serve(app: Any, sock: socket.socket, log_level: str) -> None:
    """Run ``app`` under uvicorn on ``sock`` (from ``listening_socket``) until SIGINT/SIGTERM
    (access log off: URLs may carry ?token=). At the first signal the board's long polls and
    wait_for calls answer at once (mcp_shared.STOPPING), so the shutdown neither waits for them
    nor cancels them mid-request."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            mcp_shared.STOPPING.set()
            super().handle_exit(sig, frame)

    logging.getLogger("uvicorn.error").addFilter(_quiet_upgrade_warnings)
    Server(uvicorn.Config(app, log_config=None, access_log=False,
                          log_level=log_level, timeout_graceful_shutdown=3, **connection_limits())).run(sockets=[sock])


def connection_limits() -> dict[str, Any]:
    """uvicorn settings that keep idle or hostile connections from holding the port: the h11
    protocol with a request-head deadline, the cap on connections and on a request head's size
    (deadline_protocol), and the keep-alive idle time. WebSocket upgrades are not served (no
    route takes one): such a request reaches the guards as plain HTTP, so a protected path
    answers 401. uvicorn's own
    proxy_headers is off: it would put any loopback peer's X-Forwarded-For in place of the real
    peer, and a tunnel, a local process alike are loopback peers (client_address decides)."""
    return {"http": deadline_protocol(), "ws": "none", "timeout_keep_alive": KEEP_ALIVE_SEC,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES, "proxy_headers": False}


def _quiet_upgrade_warnings(record: logging.LogRecord) -> bool:
    """Drop uvicorn's per-request advice to install a WebSocket library (not serving them is on
    purpose) and its line for a refused head (deadline_protocol logs its own, with the reason)."""
    text = record.getMessage()
    return not (text.startswith("Unsupported upgrade request") or text.startswith("No supported WebSocket library")
                or text == "Invalid HTTP request received.")   # the protocol logs its own line, with the reason


def _over_the_caps(client: tuple[str, int] | None, connections: Any) -> str | None:
    """The log line when a new connection from ``client`` (ip, port) is one too many (``connections``:
    uvicorn's set of open ones, the new one included), or None to keep it: past MAX_CONNECTIONS in
    all, or past MAX_PEER_CONNECTIONS from one address that is not this machine's loopback."""
    if len(connections) > MAX_CONNECTIONS:
        return f"more than {MAX_CONNECTIONS} open connections: closed a new one"
    peer = (client or ("", 0))[0]
    if peer and not is_loopback(peer) and peer != "::1" and MAX_PEER_CONNECTIONS < sum(
            1 for other in connections if (getattr(other, "client", None) or ("", 0))[0] == peer):
        return f"more than {MAX_PEER_CONNECTIONS} open connections from one address: closed a new one"
    return None


def head_refusal(error: Exception) -> tuple[int, str]:
    """``(status, one line)`` for a request head h11 could not take (``error``, its
    RemoteProtocolError): 431 for one over MAX_HEAD_BYTES, 421 for a Host header missing or
    repeated (what HostGuard answers a request that reaches it so), 400 for anything else. h11's
    own words are cut at their first ``:``, after which some quote what was sent."""
    said = str(error).split(":", 1)[0].strip()
    if getattr(error, "error_status_hint", 400) == 431:
        return 431, (f"the request head is too large: at most {MAX_HEAD_BYTES} bytes ({MAX_HEAD_BYTES // 1024} KiB) "
                     "of request line and headers are accepted; send fewer or shorter headers (a token goes in "
                     "Authorization, not the URL)")
    if said in ("Found multiple Host", "Missing mandatory Host"):
        return 421, "a request needs exactly one Host header: send one, naming this server's host"
    return 400, f"the request is not valid HTTP/1.1 ({loggable(said or 'unreadable', 80)}): send a well-formed request"


def refused_path(head_start: bytes) -> str | None:
    """The path of the request whose head begins with ``head_start``, or None when its request
    line has not arrived whole (only which shape a refusal takes depends on it)."""
    line, ended, _ = head_start.partition(b"\r\n")
    parts = line.split(b" ")
    if not ended or len(parts) != 3:
        return None
    return unquote(parts[1].split(b"?", 1)[0].decode("latin-1"))


@functools.cache
def head_connection() -> type:
    """h11's server connection, with a request head's size capped whether it arrives in pieces
    or whole. h11's own cap (max_incomplete_event_size) counts only bytes of a head still
    incomplete: a head that arrives in one read, up to the 64 KiB uvicorn reads at once, passed
    at any size. Keeps the start of each head so a refusal can tell the path."""
    import h11

    class HeadConnection(h11.Connection):
        def __init__(self, max_head: int) -> None:
            super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
            self.max_head, self.head_start = max_head, b""
            self.refused: h11.RemoteProtocolError | None = None   # the last head refused

        def receive_data(self, data: bytes) -> None:
            if self.their_state is h11.IDLE and len(self.head_start) < 2048:
                self.head_start += data[:2048 - len(self.head_start)]
            super().receive_data(data)

        def start_next_cycle(self) -> None:
            super().start_next_cycle()
            self.head_start = b""

        def next_event(self) -> Any:
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as exc:
                self.refused = exc
                raise
            if isinstance(event, h11.Request):
                size = len(event.method) + len(event.target) + len(b"  HTTP/1.1\r\n\r\n") + sum(
                    len(name) + len(value) + 4 for name, value in event.headers.raw_items())
                if size > self.max_head:
                    self.refused = h11.RemoteProtocolError("request head too large", error_status_hint=431)
                    raise self.refused
            return event

    return HeadConnection


async def unless_full(protocol: Any, app: Any, scope: dict, receive: Any, send: Any) -> None:
    """``app`` for a request on ``protocol``'s connection, unless MAX_CONNECTIONS connections are
    open or requests in progress (this one's included): then 503, naming the cap and the way out.
    uvicorn's limit_concurrency, answered as every other refusal is rather than in plain text."""
    if scope["type"] == "http" and (len(protocol.connections) >= MAX_CONNECTIONS
                                    or len(protocol.tasks) > MAX_CONNECTIONS):
        log.warning("%d connections or requests in progress, the cap: refused a request (503)", MAX_CONNECTIONS)
        return await refuse(send, scope.get("path"), 503,
                            f"the server is at its cap of {MAX_CONNECTIONS} open connections: try again in a few "
                            "seconds, or close idle connections (keep-alive pools) to this server",
                            safety_headers([(b"content-type", b"application/json"), (b"connection", b"close"),
                                            (b"retry-after", b"5")])[1:])
    await app(scope, receive, send)


def refuse_head(conn: Any, transport: Any, said_by_uvicorn: str) -> None:
    """Answer a request head that h11 refused on ``conn`` (a head_connection) as every other
    refusal is (head_refusal's status and words, refusal_body's shape, the safety headers), then
    close ``transport``. uvicorn answered them all 400 in plain text ("Invalid HTTP request
    received.")."""
    import h11

    error = getattr(conn, "refused", None) or h11.RemoteProtocolError(said_by_uvicorn)
    status, said = head_refusal(error)
    log.warning("refused a request head (%d): %s", status, said.split(":", 1)[0])
    data = json.dumps(refusal_body(refused_path(getattr(conn, "head_start", b"")), status, said)).encode()
    headers = safety_headers([(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data)),
                              (b"connection", b"close")])
    reason = HTTPStatus(status).phrase.encode()
    for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=data),
                  h11.EndOfMessage()):
        transport.write(conn.send(event))
    transport.close()


class RefusingAsJson:
    """Mixed into uvicorn's h11 protocol (deadline_protocol): its two refusals answered as every
    other is, not in plain text. A request that arrives while MAX_CONNECTIONS connections are
    open or requests in progress gets unless_full's 503 (uvicorn's limit_concurrency, taken over);
    a head h11 refuses gets refuse_head's answer, and a head over the cap is refused whether it
    arrived in pieces or whole (head_connection)."""

    limit_concurrency: int | None
    app: Any

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)   # type: ignore[call-arg]
        self.conn = head_connection()(config.h11_max_incomplete_event_size or MAX_HEAD_BYTES)
        self.limit_concurrency = None
        self.app = functools.partial(unless_full, self, self.app)

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls, with its fixed text, for any head h11 refuses."""
        refuse_head(self.conn, self.transport, msg)   # type: ignore[attr-defined]


@functools.cache
def deadline_protocol() -> type:
    """uvicorn's h11 protocol class: request-head deadline, connection caps, JSON refusals."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(RefusingAsJson, H11Protocol):
        """uvicorn's h11 protocol plus a deadline for each request head: a connection that sends
        no complete request line and headers within REQUEST_HEAD_SEC of connecting (or of its
        previous response) is closed. uvicorn arms its idle timer only after a response, so a
        client that connects and says nothing, or trickles a header, held a descriptor forever.
        Connections past MAX_CONNECTIONS, or past MAX_PEER_CONNECTIONS from one address that is
        not this machine's loopback (a tunnel's connections all come from 127.0.0.1 and share the
        whole cap), are closed at once."""

        head_timer: Any = None
        tunnel_client: tuple[str, int] | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            refused = _over_the_caps(self.client, self.connections)
            if refused:
                log.warning(refused)
                transport.close()
                return
            # Asked once per connection, after the caps (a refused one costs no lookup): ~1 ms.
            port = self.server[1] if self.server else None
            if self.client and port is not None and from_tunnel(self.client, port):
                self.tunnel_client = (self.client[0], self.client[1])
                TUNNEL_CONNECTIONS.add(self.tunnel_client)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(REQUEST_HEAD_SEC, self._head_overdue)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_overdue(self) -> None:
            self.head_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing() and self.transport.get_protocol() is self:
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            TUNNEL_CONNECTIONS.discard(self.tunnel_client)
            super().connection_lost(exc)

    return Protocol
