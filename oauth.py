"""OAuth for remote MCP connectors that cannot send a header (claude.ai's and ChatGPT's custom
connectors), as the MCP authorization specification defines it, on the MCP SDK's own
authorization-server support (``mcp.server.auth``).

The SDK serves the protocol: authorization-server metadata (RFC 8414), dynamic client
registration (RFC 7591), ``/authorize`` with PKCE (S256 only), ``/token`` (authorization code and
refresh grants), ``/revoke``, and the protected-resource metadata (RFC 9728) naming this server as
the authorization server of ``<public URL>/mcp``. This module is the provider the SDK asks for
clients, codes and tokens, plus the one page the SDK leaves to us: consent.

Consent: ``/authorize`` sends the person's browser to ``/oauth/consent``, which asks once for the
bearer token (``.taskbridge/token``; whoever holds it may queue work here anyway). The right token
issues a one-time code (valid CODE_SEC); five wrong ones end the request.

Tokens: access tokens live ACCESS_TOKEN_SEC (1 h), refresh tokens REFRESH_TOKEN_SEC (30 days; each
refresh replaces both). Both are signed (HMAC-SHA256) with a key derived from the bearer token,
so rotating it (``./install.sh --rotate``) revokes every one, on the running server at once (the
provider asks for the token in force on every use), while a restart keeps them. Tokens name this
server's ``/mcp`` as their resource and are refused for any other, or once their client is gone.

Abuse without the token: never-consented registrations are capped at MAX_CLIENTS (oldest out),
consented clients kept apart (MAX_CONSENTED); registrations and ``/authorize`` are rate-limited
per client address (PeerLimit; the HTTP side says which address); a full set of waiting sign-ins
drops its oldest; redirect URIs are https or loopback http only, without fragment or userinfo,
and registrations are capped in size (registration_problem); /authorize shows its errors rather
than redirecting them to a client's page (ErrorsShown); a spent code or refresh token presented
again revokes its whole sign-in (token families); deny needs the token as allow does. Registered
clients, consents and revoked grants persist in ``oauth.json`` beside the token file (0600),
written off the event loop.

Not run on its own: http_app mounts it, so it serves with ``python serve.py`` (public mode) or
``python opencode_bridge_mcp.py --transport streamable-http``.

Env, read when the app is built: MCP_PUBLIC_URL (the issuer and resource base, e.g.
``https://abc.trycloudflare.com``; OAuth is served only when it is set and a bearer token exists).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import html
import json
import logging
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

import anyio
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    AuthorizeError,
    RefreshToken,
    RegistrationError,
    TokenError,
    construct_redirect_uri,
)
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

import task_store as store

log = logging.getLogger("taskbridge.oauth")

ACCESS_TOKEN_SEC = 3600
REFRESH_TOKEN_SEC = 30 * 86400
CODE_SEC = 300
CONSENT_SEC = 600             # a consent page answers for this long
CONSENT_TRIES = 5
MAX_CLIENTS = 200             # registrations never consented to: the oldest go first (anyone may register)
MAX_CONSENTED = 50            # clients the token holder consented to: kept apart; only a newer consent evicts one
MAX_PENDING = 100             # sign-ins waiting on the consent page: the oldest goes when full
RATE_WINDOW_SEC = 600
REGISTER_PER_PEER = 10        # registrations per client address per RATE_WINDOW_SEC (429 beyond)
AUTHORIZE_PER_PEER = 20       # GET /authorize per client address per RATE_WINDOW_SEC (429 beyond)
MAX_PEERS = 10_000            # client addresses remembered by the rate limits
MAX_NAME_CHARS = 100          # of a registered client_name (the consent page shows it)
NAME_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
MAX_REDIRECT_URIS = 5         # per registration
MAX_URI_CHARS = 1024          # of each redirect URI
MAX_CLIENT_BYTES = 4096       # of one stored registration: the store stays under ~1 MB (MAX_CLIENTS of them)
MAX_USED_CODES = 1000         # spent authorization codes remembered, so a replay revokes what they issued
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class OAuthConfigError(Exception):
    """MCP_PUBLIC_URL cannot serve as the OAuth issuer; the message says what it must be."""


def public_url() -> str | None:
    """``$MCP_PUBLIC_URL`` without a trailing slash, or None. Raises OAuthConfigError unless it is
    ``https://host[:port]`` (``http://`` only for 127.0.0.1 / localhost) with no path or query."""
    value = (os.environ.get("MCP_PUBLIC_URL") or "").strip().rstrip("/")
    if not value:
        return None
    parsed = urlparse(value)
    local = parsed.hostname in ("127.0.0.1", "localhost", "::1")
    if parsed.scheme not in ("https", "http") or (parsed.scheme == "http" and not local) or not parsed.hostname \
            or parsed.path or parsed.query or parsed.fragment:
        raise OAuthConfigError(f"MCP_PUBLIC_URL={value!r} must be the public base URL, https://host "
                               "(http:// only for 127.0.0.1 or localhost), without a path")
    return value


def redirect_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be a client's redirect URI, or None when it can: ``https://`` with a host,
    or ``http://`` to a loopback host (the MCP authorization spec and OAuth 2.1), with no user
    name or password and no fragment, at most MAX_URI_CHARS long."""
    parsed = urlparse(uri)
    if len(uri) > MAX_URI_CHARS:
        return f"a redirect URI may be at most {MAX_URI_CHARS} characters"
    if parsed.username is not None or parsed.password is not None or "@" in parsed.netloc:
        return "a redirect URI may not carry a user name or password (the part before @)"
    if "#" in uri:
        return "a redirect URI may not have a fragment (#...)"
    if parsed.scheme == "https" and parsed.hostname:
        return None
    if parsed.scheme == "http" and parsed.hostname in LOOPBACK_HOSTS:
        return None
    return ("a redirect URI must be https://host/... or http:// to 127.0.0.1, localhost or [::1]; "
            f"{parsed.scheme or 'no scheme'}:// is refused")


def registration_problem(info: dict[str, Any]) -> str | None:
    """Why a registration (``model_dump(mode="json")`` of the client) is refused, or None: a name
    over MAX_NAME_CHARS, no or more than MAX_REDIRECT_URIS redirect URIs, a URI redirect_problem
    refuses, or a record over MAX_CLIENT_BYTES."""
    if len(info.get("client_name") or "") > MAX_NAME_CHARS:
        return f"client_name may be at most {MAX_NAME_CHARS} characters"
    if NAME_CONTROLS.search(info.get("client_name") or ""):
        # the consent page shows the name beside the host the browser goes to: a U+202E in it
        # reversed that warning
        return "client_name may hold no control or bidirectional-override characters (U+202E and the like)"
    uris = info.get("redirect_uris") or []
    if not uris or len(uris) > MAX_REDIRECT_URIS:
        return f"register 1 to {MAX_REDIRECT_URIS} redirect URIs"
    problem = next(filter(None, (redirect_problem(str(u)) for u in uris)), None)
    if problem:
        return problem
    if len(json.dumps(info)) > MAX_CLIENT_BYTES:
        return f"the registration is larger than {MAX_CLIENT_BYTES} bytes; send less metadata"
    return None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Provider:
    """The SDK's OAuthAuthorizationServerProvider for TaskBridge (see the module docstring)."""

    def __init__(self, bearer: str | Callable[[], str | None], base_url: str, state_file: Path) -> None:
        """``bearer``: the bearer token, or a function giving the one in force now (asked on every
        use, so a rotated token file revokes every grant at once); ``state_file``: oauth.json."""
        self._bearer = bearer if callable(bearer) else (lambda: bearer)
        self.base_url, self.state_file = base_url, state_file
        self.resource = f"{base_url}/mcp"
        self._keyed_by: str | None = None
        self._writes = anyio.Lock()
        self._rekey()

    def _rekey(self) -> None:
        """Derive the signing key from the bearer token in force and load the state made with it
        (none after a rotation: every client, code, pending sign-in and grant starts clean)."""
        self._keyed_by = self._bearer() or ""
        self.key = hmac.new(self._keyed_by.encode(), b"taskbridge oauth v1", hashlib.sha256).digest()
        self.codes: dict[str, AuthorizationCode] = {}
        self.families: dict[str, str] = {}           # unspent code -> the grant family it will start
        self.used_codes: dict[str, str] = {}         # spent code -> the family it started
        self.pending: dict[str, dict[str, Any]] = {}
        state = self._load()
        # A registration stored before the redirect rule (or edited by hand) is dropped, not served.
        self.clients: dict[str, dict[str, Any]] = {c: info for c, info in state.get("clients", {}).items()
                                                   if registration_problem(info) is None}
        self.consented: dict[str, float] = {c: t for c, t in state.get("consented", {}).items() if c in self.clients}
        self.revoked: dict[str, float] = state.get("revoked", {})

    @property
    def bearer(self) -> str:
        """The bearer token in force; when it changed since the key was derived, re-key first."""
        current = self._bearer() or ""
        if current != self._keyed_by:
            log.warning("the bearer token changed: every OAuth client, sign-in and token of the old one is void")
            self._rekey()
        return current

    def _current_key(self) -> bytes:
        self.bearer   # noqa: B018 - re-keys after a rotation
        return self.key

    # -- persistence ---------------------------------------------------------------------------

    def _load(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        # Grants signed with another bearer token are dead anyway: start clean after a rotation.
        return state if state.get("key_id") == self._key_id() else {}

    def _key_id(self) -> str:
        return _b64(hmac.new(self.key, b"key id", hashlib.sha256).digest()[:9])

    def _snapshot(self) -> str:
        now = time.time()
        self.revoked = {g: exp for g, exp in self.revoked.items() if exp > now}
        return json.dumps({"key_id": self._key_id(), "clients": self.clients, "consented": self.consented,
                           "revoked": self.revoked})

    async def _save(self) -> None:
        """Write oauth.json in a worker thread, one write at a time and in order: the snapshot is
        taken on the event loop (no dict changes under it), the disk write never blocks the loop."""
        async with self._writes:
            data = self._snapshot()
            await anyio.to_thread.run_sync(self._write, data)

    def _write(self, data: str) -> None:
        self.state_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        store.write_private(self.state_file, data)

    # -- clients -------------------------------------------------------------------------------

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        self.bearer   # noqa: B018 - re-keys after a rotation
        found = self.clients.get(client_id)
        return OAuthClientInformationFull.model_validate(found) if found else None

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        """Keep a new client. Raises RegistrationError (400 invalid_redirect_uri or
        invalid_client_metadata) for what registration_problem refuses: a redirect URI that is not
        https or loopback http, has a fragment or a user name (``https://claude.ai@evil.example/``
        goes to evil.example); a long name, too many URIs, a large record. Past MAX_CLIENTS
        registrations never consented to, the oldest of those goes; consented clients (kept apart,
        at most MAX_CONSENTED) are never evicted by registrations."""
        info = client_info.model_dump(mode="json", exclude_none=True)
        problem = registration_problem(info)
        if problem:
            kind: Literal["invalid_redirect_uri", "invalid_client_metadata"]
            kind = "invalid_redirect_uri" if "redirect URI" in problem else "invalid_client_metadata"
            raise RegistrationError(kind, problem)
        self.bearer   # noqa: B018 - re-keys after a rotation
        self.clients[client_info.client_id] = info
        unused = [c for c in self.clients if c not in self.consented]
        for client_id in unused[:max(0, len(unused) - MAX_CLIENTS)]:
            self.clients.pop(client_id)
        await self._save()
        log.info("OAuth client registered: %r", (client_info.client_name or "")[:80])

    async def _mark_consented(self, client_id: str) -> None:
        self.consented.pop(client_id, None)
        self.consented[client_id] = time.time()
        while len(self.consented) > MAX_CONSENTED:   # only the token holder's consents get here
            gone = next(iter(self.consented))
            self.consented.pop(gone)
            self.clients.pop(gone, None)
        await self._save()

    # -- authorization and consent -------------------------------------------------------------

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        if params.resource and params.resource.rstrip("/") != self.resource:
            raise AuthorizeError("invalid_target", f"this server is the resource {self.resource}")
        self.bearer   # noqa: B018 - re-keys after a rotation
        now = time.time()
        self.pending = {k: v for k, v in self.pending.items() if v["expires"] > now}
        while len(self.pending) >= MAX_PENDING:   # the oldest waiting sign-in goes, never the newest
            self.pending.pop(next(iter(self.pending)))
        request_id = secrets.token_urlsafe(24)
        self.pending[request_id] = {"client": client, "params": params, "expires": now + CONSENT_SEC, "tries": 0}
        return f"{self.base_url}/oauth/consent?request={request_id}"

    def consent_request(self, request_id: str) -> dict[str, Any] | None:
        found = self.pending.get(request_id)
        return found if found and found["expires"] > time.time() else None

    def _token_ok(self, request_id: str, token: str) -> dict[str, Any] | None:
        """The waiting request when ``token`` is the bearer token; None when it is not (counted:
        the request ends after CONSENT_TRIES wrong tokens) or the request is gone."""
        request = self.consent_request(request_id)
        if request is None:
            return None
        if not hmac.compare_digest(token.strip().encode(), self.bearer.encode()):
            request["tries"] += 1
            if request["tries"] >= CONSENT_TRIES:
                self.pending.pop(request_id, None)
            return None
        return self.pending.pop(request_id, None)

    async def approve(self, request_id: str, token: str) -> str | None:
        """The redirect URL carrying a one-time code when ``token`` is the bearer token; None when
        it is not (the request ends after CONSENT_TRIES wrong tokens)."""
        request = self._token_ok(request_id, token)
        if request is None:
            return None
        await self._mark_consented(request["client"].client_id)
        params: AuthorizationParams = request["params"]
        code = secrets.token_urlsafe(32)
        self.codes[code] = AuthorizationCode(
            code=code, scopes=params.scopes or [], expires_at=time.time() + CODE_SEC,
            client_id=request["client"].client_id, code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri, redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource)
        self.families[code] = secrets.token_urlsafe(12)
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    def deny(self, request_id: str, token: str) -> str | None:
        """The redirect URL carrying access_denied when ``token`` is the bearer token (else None,
        counted as a wrong try): a request id alone must not end someone else's sign-in."""
        request = self._token_ok(request_id, token)
        if request is None:
            return None
        params: AuthorizationParams = request["params"]
        return construct_redirect_uri(str(params.redirect_uri), error="access_denied", state=params.state)

    # -- codes and tokens ----------------------------------------------------------------------
    # Every token carries its grant ("g", one per issue) and its family ("f", one per consent,
    # kept across refreshes). A spent code or a rotated-out refresh token presented again means
    # one of two parties holds a copy: the whole family is revoked (RFC 9700 4.14, RFC 6749 4.1.2).

    async def load_authorization_code(self, client: OAuthClientInformationFull, code: str) -> AuthorizationCode | None:
        if code in self.used_codes:
            log.warning("a spent authorization code was presented again: its tokens are revoked")
            await self._revoke_family(self.used_codes[code])
            return None
        found = self.codes.get(code)
        return found if found is not None and found.client_id == client.client_id else None

    async def exchange_authorization_code(self, client: OAuthClientInformationFull,
                                          authorization_code: AuthorizationCode) -> OAuthToken:
        if self.codes.pop(authorization_code.code, None) is None:   # two exchanges raced: the loser is a replay
            await self._revoke_family(self.used_codes.get(authorization_code.code))
            raise TokenError("invalid_grant", "this authorization code was already used")
        family = self.families.pop(authorization_code.code, None) or secrets.token_urlsafe(12)
        self.used_codes[authorization_code.code] = family
        while len(self.used_codes) > MAX_USED_CODES:
            self.used_codes.pop(next(iter(self.used_codes)))
        return self._issue(client.client_id, authorization_code.scopes, authorization_code.resource, family)

    async def load_refresh_token(self, client: OAuthClientInformationFull, refresh_token: str) -> RefreshToken | None:
        claims = self._verify(refresh_token, "r", revoked_ok=True)
        if claims is None or claims["c"] != client.client_id:
            return None
        if self._is_revoked(claims):
            if claims["g"] in self.revoked and claims.get("f") not in self.revoked:
                log.warning("a used refresh token was presented again: every token of its sign-in is revoked")
                await self._revoke_family(claims.get("f"))
            return None
        return RefreshToken(token=refresh_token, client_id=claims["c"], scopes=claims["s"], expires_at=claims["e"],
                            resource=claims.get("r"))

    async def exchange_refresh_token(self, client: OAuthClientInformationFull, refresh_token: RefreshToken,
                                     scopes: list[str]) -> OAuthToken:
        claims = self._verify(refresh_token.token, "r")
        if claims is None:
            raise TokenError("invalid_grant", "this refresh token is no longer valid")
        await self._revoke(claims)   # a refresh replaces the whole grant: the old tokens stop working
        return self._issue(client.client_id, scopes, refresh_token.resource, claims.get("f") or claims["g"])

    async def load_access_token(self, token: str) -> AccessToken | None:
        """The access token's grant when this server signed it with the key of the bearer token in
        force, for this resource (``<public URL>/mcp``), for a client still registered, unexpired
        and unrevoked; else None."""
        claims = self._verify(token, "a")
        if claims is None or claims.get("r") != self.resource or claims.get("c") not in self.clients:
            return None
        return AccessToken(token=token, client_id=claims["c"], scopes=claims["s"], expires_at=claims["e"],
                           resource=claims.get("r"))

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        """RFC 7009: revoking either token of a grant ends both (a refresh token ends its family)."""
        claims = self._verify(token.token, "a") or self._verify(token.token, "r")
        if claims is not None:
            await self._revoke(claims)
            if claims["k"] == "r":
                await self._revoke_family(claims.get("f"))

    async def exchange_identity_assertion(self, client: Any, params: Any) -> OAuthToken:  # noqa: ARG002 - the SDK provider's signature
        raise TokenError("unsupported_grant_type", "identity assertions are not accepted here")

    def _issue(self, client_id: str, scopes: list[str], resource: str | None, family: str) -> OAuthToken:
        if resource and resource.rstrip("/") != self.resource:
            raise TokenError("invalid_target", f"this server is the resource {self.resource}")
        now, grant = int(time.time()), secrets.token_urlsafe(12)
        base = {"c": client_id, "s": scopes, "r": self.resource, "g": grant, "f": family}
        access = self._sign(base | {"k": "a", "e": now + ACCESS_TOKEN_SEC})
        refresh = self._sign(base | {"k": "r", "e": now + REFRESH_TOKEN_SEC})
        return OAuthToken(access_token=access, token_type="Bearer", expires_in=ACCESS_TOKEN_SEC,
                          refresh_token=refresh, scope=" ".join(scopes) or None)

    def _sign(self, claims: dict[str, Any]) -> str:
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"tb1.{body}.{_b64(hmac.new(self._current_key(), body.encode(), hashlib.sha256).digest())}"

    def _verify(self, token: str, kind: str, revoked_ok: bool = False) -> dict[str, Any] | None:
        """The claims of a token this server signed with the current key, of ``kind``, unexpired
        and (unless ``revoked_ok``) not revoked; else None."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != "tb1" or len(token) > 4096:
            return None
        expected = _b64(hmac.new(self._current_key(), parts[1].encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected, parts[2]):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
        except ValueError:
            return None
        if claims.get("k") != kind or claims.get("e", 0) < time.time():
            return None
        return claims if revoked_ok or not self._is_revoked(claims) else None

    def _is_revoked(self, claims: dict[str, Any]) -> bool:
        return claims.get("g") in self.revoked or (claims.get("f") or "") in self.revoked

    async def _revoke(self, claims: dict[str, Any]) -> None:
        self.revoked[claims["g"]] = time.time() + REFRESH_TOKEN_SEC
        await self._save()

    async def _revoke_family(self, family: str | None) -> None:
        # Grant and family ids are drawn from one random space, so one map holds both.
        if family:
            self.revoked[family] = time.time() + REFRESH_TOKEN_SEC
            await self._save()


# --------------------------------------------------------------------------------------------
# The consent page (the only page the SDK leaves to the server).


CONSENT_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>Connect to TaskBridge</title>
<style>body{{font:16px system-ui,sans-serif;max-width:34em;margin:3em auto;padding:0 1em}}
input[type=password]{{width:100%;padding:.5em;font:inherit}}
button{{padding:.5em 1.2em;font:inherit;margin:.8em .5em 0 0}}
.error{{color:#b00020}}code{{background:#f3f3f3;padding:0 .2em}}</style></head>
<body><h1>Connect to TaskBridge</h1>
<p>A client that calls itself <b>{client}</b> (a name it chose itself: anyone can claim any name)
wants to use the TaskBridge server on this machine: queue coding tasks that run with your user's
rights, and read their results. After you allow it, your browser goes to the site
<code>{redirect}</code>: allow only if that is the site you are connecting from.</p>
<p>To allow or deny it, paste the bearer token once (on the machine running TaskBridge:
<code>cat .taskbridge/token</code>, or the <i>Token</i> line of the box ./install.sh printed).</p>
{error}
<form method="post" action="/oauth/consent">
<input type="hidden" name="request" value="{request}">
<label>Bearer token <input type="password" name="token" autocomplete="off" autofocus></label>
<button name="action" value="allow">Allow</button><button name="action" value="deny">Deny</button>
</form></body></html>
"""

PAGE_HEADERS = {"X-Frame-Options": "DENY",
                "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                           "form-action 'self'; frame-ancestors 'none'",
                "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}


def consent_routes(provider: Provider) -> list[Any]:
    """``GET /oauth/consent`` (the page) and ``POST /oauth/consent`` (allow or deny)."""
    from starlette.responses import HTMLResponse, RedirectResponse
    from starlette.routing import Route

    def page(request_id: str, request: dict[str, Any], error: str = "", status: int = 200) -> Any:
        client = request["client"]
        redirect = urlparse(str(request["params"].redirect_uri))
        text = CONSENT_PAGE.format(client=html.escape((client.client_name or "An MCP client")[:100]),
                                   redirect=html.escape(redirect.hostname or "(no host)"),
                                   request=html.escape(request_id), error=error)
        return HTMLResponse(text, status_code=status, headers=PAGE_HEADERS)

    def gone() -> Any:
        return HTMLResponse("<!doctype html><title>TaskBridge</title><p>This sign-in request has expired or "
                            "was ended. Start connecting again from your MCP client.</p>", status_code=400,
                            headers=PAGE_HEADERS)

    async def show(request: Any) -> Any:
        request_id = request.query_params.get("request", "")
        found = provider.consent_request(request_id)
        return page(request_id, found) if found else gone()

    async def answer(request: Any) -> Any:
        try:
            form = await request.form()
        except AssertionError:   # python-multipart's answer to a malformed body
            return HTMLResponse("<!doctype html><title>TaskBridge</title><p>That form could not be read; "
                                "start connecting again from your MCP client.</p>", status_code=400,
                                headers=PAGE_HEADERS)
        request_id, token = str(form.get("request", "")), str(form.get("token", ""))
        found = provider.consent_request(request_id)
        if found is None:
            return gone()
        deny = form.get("action") == "deny"
        target = provider.deny(request_id, token) if deny else await provider.approve(request_id, token)
        if target:
            log.info("OAuth consent %s %r", "refused to" if deny else "given to",
                     (found["client"].client_name or "")[:80])
            return RedirectResponse(target, status_code=302, headers={"Cache-Control": "no-store"})
        log.warning("OAuth consent page: a wrong bearer token was entered")
        if provider.consent_request(request_id) is None:
            return gone()
        why = ("Deny needs the bearer token too (so no one else can end your sign-in); without it, close this "
               "page: the request ends by itself." if deny else "That is not the bearer token. Try again.")
        return page(request_id, found, f'<p class="error">{why}</p>', 401)

    return [Route("/oauth/consent", show, methods=["GET"]), Route("/oauth/consent", answer, methods=["POST"])]


def routes(provider: Provider, peer_of: Callable[[dict], str] = lambda scope: (scope.get("client") or ("?",))[0]
           ) -> list[Any]:
    """Every OAuth route: the SDK's authorization server and protected-resource metadata (also at
    the root well-known path, where some clients look first), and the consent page. ``peer_of``
    gives a request's client address (an ASGI scope to a string) for the rate limits; the HTTP
    side passes the one that knows its tunnel (default: the TCP peer)."""
    from mcp.server.auth.routes import create_auth_routes, create_protected_resource_routes
    from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions, RevocationOptions
    from starlette.routing import Route

    # AuthSettings keeps a path-less issuer without a trailing slash (RFC 8414 compares exactly).
    settings = AuthSettings.model_validate({"issuer_url": provider.base_url, "resource_server_url": provider.resource,
                                            "validate_token_resource": True})
    issuer = settings.issuer_url
    server = create_auth_routes(provider, issuer, client_registration_options=ClientRegistrationOptions(enabled=True),
                                revocation_options=RevocationOptions(enabled=True))
    register_limit, authorize_limit = PeerLimit(lambda: REGISTER_PER_PEER), PeerLimit(lambda: AUTHORIZE_PER_PEER)
    wrapped: dict[str, Callable[[Any], Any]] = {
        "/register": lambda app: RateLimited(app, register_limit, "registrations", peer_of),
        "/authorize": lambda app: RateLimited(ErrorsShown(app, provider), authorize_limit, "sign-ins", peer_of),
        "/token": lambda app: ResourceChecked(app, provider), "/revoke": PublicRevoke}
    server = [Route(r.path, endpoint=wrapped[r.path](r.app), methods=list(r.methods or []))
              if isinstance(r, Route) and r.path in wrapped else r for r in server]
    server = [_metadata_route(issuer) if isinstance(r, Route) and r.path == METADATA_PATH else r for r in server]
    assert settings.resource_server_url is not None   # provider.resource, given above
    resource = create_protected_resource_routes(settings.resource_server_url, [issuer], resource_name="TaskBridge")
    root = Route("/.well-known/oauth-protected-resource", endpoint=resource[0].endpoint, methods=["GET", "OPTIONS"])
    return [*server, *resource, root, *consent_routes(provider)]


METADATA_PATH = "/.well-known/oauth-authorization-server"


def _metadata_route(issuer: Any) -> Any:
    """The authorization-server metadata as the SDK writes it, plus ``none`` among the token and
    revocation endpoints' client authentications: /register accepts public clients (PKCE, no
    secret), and a client that reads the metadata first would otherwise think it must hold one."""
    from mcp.server.auth.handlers.metadata import MetadataHandler
    from mcp.server.auth.routes import build_metadata, cors_middleware
    from mcp.server.auth.settings import ClientRegistrationOptions, RevocationOptions
    from starlette.routing import Route

    metadata = build_metadata(issuer, None, ClientRegistrationOptions(enabled=True), RevocationOptions(enabled=True))
    for field in ("token_endpoint_auth_methods_supported", "revocation_endpoint_auth_methods_supported"):
        setattr(metadata, field, [*(getattr(metadata, field) or []), "none"])
    return Route(METADATA_PATH, endpoint=cors_middleware(MetadataHandler(metadata).handle, ["GET", "OPTIONS"]),
                 methods=["GET", "OPTIONS"])


class PeerLimit:
    """At most ``limit()`` events per client address per RATE_WINDOW_SEC (MAX_PEERS addresses
    remembered; the stalest forgotten first)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.seen: dict[str, deque[float]] = {}   # peer: its events' monotonic times, stalest peer first

    def allow(self, peer: str) -> bool:
        now = time.monotonic()
        times = self.seen.pop(peer, None) or deque()
        while times and times[0] < now - RATE_WINDOW_SEC:
            times.popleft()
        self.seen[peer] = times
        while len(self.seen) > MAX_PEERS:
            self.seen.pop(next(iter(self.seen)))
        if len(times) >= self.limit():
            return False
        times.append(now)
        return True


class RateLimited:
    """Pure ASGI around an open OAuth endpoint: 429 (with Retry-After) past its PeerLimit."""

    def __init__(self, app: Any, limit: PeerLimit, what: str, peer_of: Callable[[dict], str]) -> None:
        self.app, self.limit, self.what, self.peer_of = app, limit, what, peer_of

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and not self.limit.allow(self.peer_of(scope)):
            log.warning("too many OAuth %s from one address: refused (429)", self.what)
            data = json.dumps({"error": "temporarily_unavailable", "error_description":
                               f"too many {self.what} from this address; try again in {RATE_WINDOW_SEC // 60} "
                               "minutes"}).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(RATE_WINDOW_SEC).encode())]})
            return await send({"type": "http.response.body", "body": data})
        await self.app(scope, receive, send)


async def _whole_body(receive: Any) -> tuple[bytes, None] | tuple[None, dict]:
    """(the request body, None), or (None, the message that ended it early: a disconnect)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None, message
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks), None


async def _body_or_pass(app: Any, scope: dict, receive: Any, send: Any) -> bytes | None:
    """The request's whole body, or None once ``app`` has been handed the request as it came (a
    body that did not arrive whole: the app answers it as it would)."""
    body, early = await _whole_body(receive)
    if early is not None:
        await app(scope, _replay([early]), send)
    return body


class ResourceChecked:
    """Pure ASGI around ``/token``: a ``resource`` parameter (RFC 8707) naming anything but this
    server's MCP endpoint gets 400 invalid_target; the body (already capped by the HTTP side) is
    read here and handed on unchanged."""

    def __init__(self, app: Any, provider: Provider) -> None:
        self.app, self.provider = app, provider

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        body = await _body_or_pass(self.app, scope, receive, send)
        if body is None:
            return None
        resources = parse_qs(body.decode("latin-1")).get("resource", [])
        if any(r.rstrip("/") != self.provider.resource for r in resources):
            data = json.dumps({"error": "invalid_target", "error_description":
                               f"this server is the resource {self.provider.resource}"}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]})
            return await send({"type": "http.response.body", "body": data})
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


class PublicRevoke:
    """Pure ASGI around ``/revoke``: RFC 7009 lets a public client (no secret) revoke its own
    token, but the SDK's form model requires a client_secret field; one left out is sent on as
    empty. Clients are authenticated before the form is read, so a client with a secret still
    needs it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        body = await _body_or_pass(self.app, scope, receive, send)
        if body is None:
            return None
        if "client_secret" not in parse_qs(body.decode("latin-1"), keep_blank_values=True):
            body += b"&client_secret=" if body else b"client_secret="
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


class ErrorsShown:
    """Pure ASGI around ``/authorize``: its only redirect is to the consent page. The SDK would send
    errors (a bad parameter, a wrong resource) to the client's redirect URI without any consent
    shown, and anyone may register a client: that made this host an open redirector. They are
    shown to the person instead (400), as errors before the redirect URI is trusted must be."""

    def __init__(self, app: Any, provider: Provider) -> None:
        self.app, self.consent = app, f"{provider.base_url}/oauth/consent?"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held = {"swallow": False}

        async def guarded(message: dict) -> None:
            if message["type"] == "http.response.start" and 300 <= message["status"] < 400:
                location = dict(message.get("headers", [])).get(b"location", b"").decode("latin-1")
                if not location.startswith(self.consent):
                    held["swallow"] = True
                    return await self._show(send, location)
            if not held["swallow"]:
                await send(message)

        await self.app(scope, receive, guarded)

    async def _show(self, send: Any, location: str) -> None:
        query = parse_qs(urlparse(location).query)
        error = (query.get("error") or ["invalid_request"])[0]
        detail = (query.get("error_description") or [""])[0]
        text = (f"<!doctype html><title>TaskBridge</title><p>This sign-in request cannot go on: "
                f"<code>{html.escape(error[:80])}</code> {html.escape(detail[:300])}</p>"
                "<p>Start connecting again from your MCP client.</p>").encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                *((k.lower().encode(), v.encode()) for k, v in PAGE_HEADERS.items())]})
        await send({"type": "http.response.body", "body": text})


def _replay(messages: list[dict], then: Any = None) -> Any:
    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        return await then() if then else {"type": "http.disconnect"}
    return receive


def resource_metadata_url(provider: Provider) -> str:
    """Where a client finds the protected-resource metadata (named in 401 answers)."""
    return f"{provider.base_url}/.well-known/oauth-protected-resource/mcp"
