"""OAuth for remote connectors, driven the way claude.ai's or ChatGPT's connector does it, by the
MCP SDK's own client-side OAuth support (OAuthClientProvider) against the running server:
discovery (401 → protected-resource metadata → authorization-server metadata), dynamic client
registration, the consent page (the bearer token, once), the code exchange with PKCE, tool calls
with the access token, refresh; refused: a wrong consent token, a reused code, an expired or
revoked access token, every token after the bearer token is rotated. Plain bearer clients keep
working beside it. The "browser" is an httpx client following the redirects by hand."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import parse_qs, urlparse

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata, OAuthToken
from mcp.types import Implementation

import http_app
import oauth
import opencode_bridge_mcp as bridge
from helpers import call_tool, free_port, serving

pytestmark = pytest.mark.anyio
TOKEN = "bearer-token-for-the-oauth-tests"
REDIRECT = "https://claude.ai/api/mcp/auth_callback"


@contextlib.contextmanager
def serving_oauth(tmp_path, monkeypatch) -> Iterator[str]:
    """The running server with TOKEN as its bearer token and its own URL as the public one (so
    OAuth is on); yields the base URL."""
    port = free_port()
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "tb" / "token"))
    monkeypatch.setenv("MCP_PUBLIC_URL", f"http://127.0.0.1:{port}")
    with serving(port) as url:
        yield url


@pytest.fixture
def base(tmp_path, monkeypatch) -> Iterator[str]:
    with serving_oauth(tmp_path, monkeypatch) as url:
        yield url


class Storage:
    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client

    async def set_client_info(self, client_info):
        self.client = client_info


class Browser:
    """What the person does: open the authorization URL, read the consent page, paste tokens."""

    def __init__(self, base: str, tokens: list[str]) -> None:
        self.base, self.tokens, self.result = base, list(tokens), None
        self.pages: list[tuple[int, str]] = []
        self.code: str | None = None

    async def open(self, url: str) -> None:
        async with httpx2.AsyncClient(timeout=10) as web:
            answer = await web.get(url)
            assert answer.status_code in (302, 307), answer.text
            consent = answer.headers["location"]
            assert consent.startswith(f"{self.base}/oauth/consent?request=")
            page = await web.get(consent)
            self.pages.append((page.status_code, page.text))
            request_id = parse_qs(urlparse(consent).query)["request"][0]
            for token in self.tokens:
                answer = await web.post(f"{self.base}/oauth/consent",
                                        data={"request": request_id, "token": token, "action": "allow"})
                self.pages.append((answer.status_code, answer.text))
                if answer.status_code == 302:
                    target = answer.headers["location"]
                    assert target.startswith(REDIRECT)
                    query = parse_qs(urlparse(target).query)
                    self.code = query["code"][0]
                    self.result = AuthorizationCodeResult(code=self.code, state=query["state"][0])
                    return

    async def callback(self) -> AuthorizationCodeResult:
        assert self.result is not None, self.pages
        return self.result


def connector(base: str, browser: Browser, storage: Storage) -> OAuthClientProvider:
    metadata = OAuthClientMetadata(client_name="Claude", redirect_uris=[REDIRECT],
                                   grant_types=["authorization_code", "refresh_token"], response_types=["code"])
    return OAuthClientProvider(f"{base}/mcp", metadata, storage, redirect_handler=browser.open,
                               callback_handler=browser.callback)


async def ping_with(base: str, auth: OAuthClientProvider) -> dict:
    transport = streamable_http_client(f"{base}/mcp", http_client=httpx2.AsyncClient(auth=auth, timeout=30))
    async with Client(transport, mode="legacy", client_info=Implementation(name="claude-ai", version="0.1")) as c:
        return await call_tool(c, "ping")


async def status(base: str, token: str, path: str = "/api/status") -> int:
    async with httpx2.AsyncClient(timeout=10) as web:
        return (await web.get(f"{base}{path}", headers={"Authorization": f"Bearer {token}"})).status_code


async def test_oauth_round_trip_as_a_remote_connector_does_it(base, monkeypatch):
    storage = Storage()
    browser = Browser(base, ["not-the-token", TOKEN])
    ping = await ping_with(base, connector(base, browser, storage))
    # The caller is stamped with the client's own name (its clientInfo), not the OAuth client.
    assert ping["caller"]["name"] == "claude-ai"
    first_page = browser.pages[0][1]
    assert browser.pages[0][0] == 200 and "Claude" in first_page and "chose itself" in first_page
    assert "<code>claude.ai</code>" in first_page
    assert browser.pages[1][0] == 401 and "not the bearer token" in browser.pages[1][1]
    assert storage.client is not None and storage.tokens.access_token.startswith("tb1.")
    access = storage.tokens.access_token
    assert await status(base, access) == 200, "the access token opens /api too"

    # A reused code is refused.
    async with httpx2.AsyncClient(timeout=10) as web:
        again = await web.post(f"{base}/token", data={
            "grant_type": "authorization_code", "code": browser.code, "redirect_uri": REDIRECT,
            "client_id": storage.client.client_id, "client_secret": storage.client.client_secret or "",
            "code_verifier": "x" * 64})
    assert again.status_code == 400 and again.json()["error"] == "invalid_grant"

    # Plain bearer clients are unchanged.
    assert await status(base, TOKEN) == 200
    assert await status(base, "tb1.forged.token") == 401


async def test_discovery_documents_name_the_server_and_its_endpoints(base):
    async with httpx2.AsyncClient(timeout=10) as web:
        refused = await web.post(f"{base}/mcp", json={})
        assert refused.status_code == 401
        assert f'resource_metadata="{base}/.well-known/oauth-protected-resource/mcp"' in \
            refused.headers["www-authenticate"]
        resource = (await web.get(f"{base}/.well-known/oauth-protected-resource/mcp")).json()
        assert resource["resource"] == f"{base}/mcp" and resource["authorization_servers"] == [base]
        assert (await web.get(f"{base}/.well-known/oauth-protected-resource")).json() == resource
        server = (await web.get(f"{base}/.well-known/oauth-authorization-server")).json()
        assert server["registration_endpoint"] == f"{base}/register"
        assert server["code_challenge_methods_supported"] == ["S256"]


async def test_the_metadata_offers_public_clients_and_one_signs_in_without_a_secret(base):
    """/register takes `none` (a public client: PKCE, no secret); the metadata says so, and such a
    client, configured as the metadata allows, completes the flow and calls a tool."""
    async with httpx2.AsyncClient(timeout=10) as web:
        server = (await web.get(f"{base}/.well-known/oauth-authorization-server")).json()
    assert "none" in server["token_endpoint_auth_methods_supported"]
    assert "none" in server["revocation_endpoint_auth_methods_supported"]
    assert {"client_secret_post", "client_secret_basic"} <= set(server["token_endpoint_auth_methods_supported"])
    storage = Storage()
    metadata = OAuthClientMetadata(client_name="Public", redirect_uris=[REDIRECT], token_endpoint_auth_method="none",
                                   grant_types=["authorization_code", "refresh_token"], response_types=["code"])
    browser = Browser(base, [TOKEN])
    await ping_with(base, OAuthClientProvider(f"{base}/mcp", metadata, storage, redirect_handler=browser.open,
                                              callback_handler=browser.callback))
    assert storage.client.client_secret is None and storage.tokens.access_token.startswith("tb1.")


async def test_expired_access_tokens_are_refused_and_the_refresh_token_gets_a_new_one(base, monkeypatch):
    monkeypatch.setattr(oauth, "ACCESS_TOKEN_SEC", 2)
    storage = Storage()
    auth = connector(base, Browser(base, [TOKEN]), storage)
    await ping_with(base, auth)
    expired = storage.tokens.access_token
    await anyio.sleep(3)
    assert await status(base, expired) == 401
    await ping_with(base, auth)   # the SDK client refreshes on its own
    assert storage.tokens.access_token != expired and await status(base, storage.tokens.access_token) == 200


async def test_five_wrong_consent_tokens_end_the_request(base):
    browser = Browser(base, ["wrong"] * 5 + [TOKEN])
    # The refusal surfaces through the SDK's OAuth flow and transport, whose exception type is theirs to choose.
    with pytest.raises(Exception):  # noqa: B017
        await ping_with(base, connector(base, browser, Storage()))
    assert [code for code, _ in browser.pages[1:]] == [401, 401, 401, 401, 400, 400]


async def test_a_rotated_bearer_token_revokes_every_oauth_token(base, monkeypatch, tmp_path):
    storage = Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), storage))
    old = oauth.Provider(TOKEN, base, tmp_path / "tb" / "oauth.json")
    assert await old.load_access_token(storage.tokens.access_token) is not None
    rotated = oauth.Provider("a-new-bearer-token", base, tmp_path / "tb" / "oauth.json")
    assert await rotated.load_access_token(storage.tokens.access_token) is None
    client = await old.get_client(storage.client.client_id)
    assert await rotated.load_refresh_token(client, storage.tokens.refresh_token) is None


async def test_a_revoked_token_is_refused(base):
    storage = Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), storage))
    async with httpx2.AsyncClient(timeout=10) as web:
        answer = await web.post(f"{base}/revoke", data={
            "token": storage.tokens.access_token, "client_id": storage.client.client_id,
            "client_secret": storage.client.client_secret or ""})
        assert answer.status_code == 200, answer.text
    assert await status(base, storage.tokens.access_token) == 401


async def test_oauth_is_off_without_a_public_url(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)
    monkeypatch.delenv("MCP_PUBLIC_URL", raising=False)
    with serving(free_port()) as url:
        async with httpx2.AsyncClient(timeout=10) as web:
            assert (await web.get(f"{url}/.well-known/oauth-authorization-server")).status_code == 404
            assert "resource_metadata" not in (await web.post(f"{url}/mcp", json={})).headers["www-authenticate"]


def test_a_public_url_that_cannot_be_an_issuer_is_refused(monkeypatch):
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)
    for bad in ("http://abc.trycloudflare.com", "https://abc.trycloudflare.com/mcp", "abc.trycloudflare.com"):
        monkeypatch.setenv("MCP_PUBLIC_URL", bad)
        with pytest.raises(http_app.TokenConfigError, match="MCP_PUBLIC_URL"):
            bridge.build_app()
