"""TaskBridge's HTTP side: one Starlette app on one port for the MCP transports (/mcp
streamable-http; /sse and /messages/ sse), /health, the board's shell (GET /, /board/*) and its
JSON API (/api/*, see board_api).

Guards, outermost first: HostGuard (421 for a malformed Host or one outside the allowlist, on
every route) and BearerGuard (401 without the bearer token on /mcp, /sse, /messages and /api;
constant-time compare; the token is never logged; an OAuth access token from the oauth module is
accepted too). /health, the board's static shell and the OAuth endpoints stay open and hold no
data. uvicorn runs with a request-head deadline, idle time-outs and a connection cap
(connection_limits).

Env read at call time: MCP_BEARER_TOKEN, else the token file MCP_TOKEN_FILE (default
<repo>/.taskbridge/token); MCP_ALLOWED_HOSTS (extra Host names, comma list); MCP_PUBLIC_URL (the
public base URL: its host is allowed, and OAuth for remote connectors is served). Nothing happens
at import time. Run it through ``python opencode_bridge_mcp.py --transport streamable-http``.
"""
from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import board_api
import mcp_shared
import oauth
import task_views
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

REPO_DIR = Path(__file__).resolve().parent
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
PROTECTED_PREFIXES = ("/mcp", "/sse", "/messages", "/api")
REQUEST_HEAD_SEC = 10.0        # a connection must send a complete request head this soon, or it is closed
KEEP_ALIVE_SEC = 5             # idle time between requests on one connection
MAX_CONNECTIONS = 128          # open connections; more are closed at once (macOS's default ulimit -n is 256)
MAX_HEAD_BYTES = 16 * 1024     # a request head larger than this is refused (h11)
LOGGED_CHARS = 120             # of a request path in a log line

log = logging.getLogger("taskbridge.mcp")


def token_file() -> Path:
    """The bearer token file: ``$MCP_TOKEN_FILE`` or ``<repo>/.taskbridge/token``."""
    return Path(os.environ.get("MCP_TOKEN_FILE") or REPO_DIR / ".taskbridge" / "token").expanduser()


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


def _warn_if_readable(path: Path) -> None:
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("the token file %s is readable by other users (mode %o): run chmod 600 %s "
                        "(./install.sh does)", loggable(str(path)), mode, loggable(str(path)))


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


async def _plain(send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


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
            return await _plain(send, 421, {"error": "this Host is not allowed (a host name, then optionally "
                                                     "':' and a port of digits); add the name to MCP_ALLOWED_HOSTS"})
        canonical = (parsed[0] if parsed[1] is None else f"{parsed[0]}:{parsed[1]}").encode("latin-1")
        scope = dict(scope, headers=[(k, canonical if k == b"host" else v) for k, v in headers])
        await self.app(scope, receive, send)


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

    def __init__(self, app: Any, token: str | None, provider: Any = None) -> None:
        self.app, self.token, self.oauth = app, (token or "").encode(), provider
        self.challenge = 'Bearer realm="taskbridge"'
        if provider is not None:   # where OAuth clients discover the authorization server (RFC 9728)
            self.challenge += f', resource_metadata="{oauth.resource_metadata_url(provider)}"'

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" or (scope["type"] in ("http", "websocket")
                                           and (not self.token or not _protected(scope.get("path", "")))):
            return await self.app(scope, receive, send)
        supplied = _supplied_token(scope) if scope["type"] in ("http", "websocket") else None
        if supplied is not None and hmac.compare_digest(supplied.encode(), self.token):
            return await self.app(scope, receive, send)
        if supplied and self.oauth is not None and await self.oauth.load_access_token(supplied) is not None:
            return await self.app(scope, receive, send)
        log.info("refused %s %s: %s bearer token (401)", loggable(str(scope.get("method", scope["type"]))),
                 loggable(scope.get("path", "")), "wrong" if supplied else "no")
        error = "invalid_token" if supplied else "invalid_request"
        headers = [(b"www-authenticate", f'{self.challenge}, error="{error}"'.encode())]
        body = {"error": "a valid bearer token is required: send Authorization: Bearer <token> "
                         "(MCP_BEARER_TOKEN or the .taskbridge/token file)"}
        if scope["type"] == "http":
            return await _plain(send, 401, body, headers)
        if scope["type"] == "websocket":
            return await _deny_websocket(scope, receive, send, headers)


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


async def health(request: Any) -> Any:
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
    from starlette.routing import Route

    hosts = allowed_hosts()
    security = transport_security(hosts)
    # Two session managers for /mcp: SSE streams for clients that take them, plain JSON for
    # clients that accept only application/json (mcp_shared.StreamableEndpoint routes between them).
    server.streamable_http_app(streamable_http_path="/mcp", transport_security=security)
    streaming = server.session_manager
    server.streamable_http_app(streamable_http_path="/mcp", transport_security=security, json_response=True)
    plain = server.session_manager
    sse = server.sse_app(sse_path="/sse", message_path="/messages/", transport_security=security)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        async with streaming.run(), plain.run():
            yield

    token = bearer_token()
    beyond = sorted(h for h in hosts if h not in LOOPBACK_NAMES)
    if not token and beyond:
        raise TokenConfigError(f"MCP_ALLOWED_HOSTS admits {', '.join(beyond)} (beyond this machine) but no bearer "
                               "token is configured: anyone reaching that host could queue work that runs on this "
                               "machine. Run ./install.sh (it writes the token) or set MCP_BEARER_TOKEN, or drop "
                               "those names")
    if not token:
        log.warning("no bearer token configured: /mcp, /sse and /api are open to anything that reaches this port")
    provider = oauth_provider(token)
    auth_routes = oauth.routes(provider) if provider else []
    mcp_route = Route("/mcp", endpoint=mcp_shared.StreamableEndpoint(streaming, plain))
    return Starlette(routes=[mcp_route, *sse.routes, *auth_routes, *http_routes()], lifespan=lifespan,
                     middleware=[Middleware(HostGuard, hosts=hosts),
                                 Middleware(BearerGuard, token=token, provider=provider)])


def oauth_provider(token: str | None) -> Any:
    """The OAuth provider for remote connectors when ``$MCP_PUBLIC_URL`` is set and a bearer token
    exists (the consent page asks for it), else None. Raises TokenConfigError for a public URL
    that cannot be an OAuth issuer."""
    try:
        base = oauth.public_url()
    except oauth.OAuthConfigError as exc:
        raise TokenConfigError(str(exc)) from None
    if not base or not token:
        return None
    return oauth.Provider(token, base, token_file().parent / "oauth.json")


def http_routes() -> list[Any]:
    """The routes beside the MCP transports: /health, then the board's shell and API."""
    from starlette.routing import Route
    return [Route("/health", health), *board_api.routes()]


def serve(app: Any, host: str, port: int, log_level: str) -> None:
    """Run ``app`` under uvicorn on host:port until SIGINT/SIGTERM (access log off: URLs may carry
    ?token=). At the first signal the board's long polls answer at once, so the shutdown neither
    waits for them nor cancels them mid-request."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            board_api.STOPPING.set()
            super().handle_exit(sig, frame)

    logging.getLogger("uvicorn.error").addFilter(_quiet_upgrade_warnings)
    Server(uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                          log_level=log_level, timeout_graceful_shutdown=3, **connection_limits())).run()


def connection_limits() -> dict[str, Any]:
    """uvicorn settings that keep idle or hostile connections from holding the port: the h11
    protocol with a request-head deadline, the keep-alive idle time, a cap on connections and on
    a request head's size. WebSocket upgrades are not served (no route takes one): such a request
    reaches the guards as plain HTTP, so a protected path answers 401."""
    return {"http": deadline_protocol(), "ws": "none", "timeout_keep_alive": KEEP_ALIVE_SEC,
            "limit_concurrency": MAX_CONNECTIONS, "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def _quiet_upgrade_warnings(record: logging.LogRecord) -> bool:
    """Drop uvicorn's per-request advice to install a WebSocket library: not serving them is on purpose."""
    text = record.getMessage()
    return not (text.startswith("Unsupported upgrade request") or text.startswith("No supported WebSocket library"))


@functools.cache
def deadline_protocol() -> type:
    """uvicorn's h11 protocol class with the request-head deadline and the connection cap."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        """uvicorn's h11 protocol plus a deadline for each request head: a connection that sends
        no complete request line and headers within REQUEST_HEAD_SEC of connecting (or of its
        previous response) is closed. uvicorn arms its idle timer only after a response, so a
        client that connects and says nothing, or trickles a header, held a descriptor forever.
        Connections past MAX_CONNECTIONS are closed at once."""

        head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > MAX_CONNECTIONS:
                log.warning("more than %d open connections: closed a new one", MAX_CONNECTIONS)
                transport.close()
                return
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
            super().connection_lost(exc)

    return Protocol
