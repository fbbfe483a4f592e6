"""OAuth under an attacker who lacks the bearer token, against the running server (uvicorn on
127.0.0.1) with the MCP SDK's own OAuth client as the real connector: registration floods cannot
sign the connector out, waiting sign-ins cannot be used up, redirect URIs with a user name are
refused and the consent page names the host only, tokens are for this resource only and die
with their client, and rotating the token file takes effect on the running server at once."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx2
import pytest
from test_oauth import TOKEN, Browser, Storage, connector, ping_with, serving_oauth, status

import oauth
import serve
from helpers import free_port, serving

pytestmark = pytest.mark.anyio


@pytest.fixture
def base(tmp_path, monkeypatch):
    with serving_oauth(tmp_path, monkeypatch) as url:
        yield url


async def refresh(web: httpx2.AsyncClient, storage: Storage, **extra: str) -> httpx2.Response:
    return await web.post("/token", data={"grant_type": "refresh_token", "client_id": storage.client.client_id,
                                          "client_secret": storage.client.client_secret or "",
                                          "refresh_token": storage.tokens.refresh_token, **extra})


def registration(name: str, redirect: str = "https://x.example/cb") -> dict:
    return {"client_name": name, "redirect_uris": [redirect], "token_endpoint_auth_method": "none"}


async def test_a_registration_flood_cannot_sign_the_connector_out(base, monkeypatch):
    monkeypatch.setattr(oauth, "MAX_CLIENTS", 20)
    monkeypatch.setattr(oauth, "REGISTER_PER_PEER", 1000)   # as from many addresses (test_oauth_door: the tunnel's)
    storage = Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), storage))
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        for i in range(oauth.MAX_CLIENTS + 5):
            answer = await web.post("/register", json=registration(f"flood{i}"))
            assert answer.status_code == 201, answer.text
        first = (await web.post("/register", json=registration("flood-late"))).json()["client_id"]
        refreshed = await refresh(web, storage)
    assert refreshed.status_code == 200, refreshed.text
    assert await status(base, refreshed.json()["access_token"]) == 200
    assert first   # the newest unused registration is kept; the oldest unused ones went


async def test_registrations_and_sign_ins_are_rate_limited_per_address(base):
    async with httpx2.AsyncClient(base_url=base, timeout=10, follow_redirects=False) as web:
        codes = [(await web.post("/register", json=registration(f"r{i}"))).status_code
                 for i in range(oauth.REGISTER_PER_PEER + 1)]
        assert codes == [201] * oauth.REGISTER_PER_PEER + [429]
        # A local peer's forwarding header names no other address (only the tunnel's may: test_oauth_door).
        other = await web.post("/register", json=registration("elsewhere"),
                               headers={"CF-Connecting-IP": "198.51.100.7"})
        assert other.status_code == 429
        client_id = (await web.post("/register", json=registration("first"))).json().get("client_id") or \
            next(iter(oauth.Provider(TOKEN, base, Path(os.environ["MCP_TOKEN_FILE"]).parent / "oauth.json").clients))
        query = {"response_type": "code", "client_id": client_id, "redirect_uri": "https://x.example/cb",
                 "code_challenge": "a" * 43, "code_challenge_method": "S256"}
        codes = [(await web.get("/authorize", params=query)).status_code for _ in range(oauth.AUTHORIZE_PER_PEER + 1)]
        assert codes == [302] * oauth.AUTHORIZE_PER_PEER + [429]


async def test_full_waiting_sign_ins_make_room_for_the_newest(base, monkeypatch):
    """101 waiting sign-ins used to lock every new one out for 10 minutes."""
    monkeypatch.setattr(oauth, "AUTHORIZE_PER_PEER", 1000)
    async with httpx2.AsyncClient(base_url=base, timeout=10, follow_redirects=False) as web:
        client_id = (await web.post("/register", json=registration("p"))).json()["client_id"]
        query = {"response_type": "code", "client_id": client_id, "redirect_uri": "https://x.example/cb",
                 "code_challenge": "a" * 43, "code_challenge_method": "S256"}
        for _ in range(oauth.MAX_PENDING + 1):
            assert (await web.get("/authorize", params=query)).status_code == 302
    storage = Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), storage))   # the real connector still gets in


async def test_a_redirect_uri_with_a_user_name_is_refused_and_the_page_names_the_host(base):
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        answer = await web.post("/register", json=registration("Claude", "https://claude.ai@evil.example/cb"))
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_redirect_uri"
    browser = Browser(base, [TOKEN])
    await ping_with(base, connector(base, browser, Storage()))
    page = browser.pages[0][1]
    assert "<code>claude.ai</code>" in page and "https://claude.ai" not in page and "chose itself" in page


async def test_a_token_for_another_resource_is_refused_at_issue_and_at_use(base, tmp_path):
    storage = Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), storage))
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        answer = await refresh(web, storage, resource="https://other.example/mcp")
    assert answer.status_code == 400 and answer.json()["error"] == "invalid_target", answer.text
    signer = oauth.Provider(TOKEN, base, tmp_path / "tb" / "oauth.json")   # the server's own key
    now = int(time.time())
    for resource in ("https://other.example/mcp", None):
        forged = signer._sign({"c": storage.client.client_id, "s": [], "r": resource, "g": "g1", "k": "a",
                               "e": now + 600})
        assert await status(base, forged) == 401
    assert await status(base, storage.tokens.access_token) == 200


async def test_an_evicted_clients_access_token_stops_working(base, monkeypatch):
    monkeypatch.setattr(oauth, "MAX_CONSENTED", 1)
    first, second = Storage(), Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), first))
    assert await status(base, first.tokens.access_token) == 200
    await ping_with(base, connector(base, Browser(base, [TOKEN]), second))   # a newer consent evicts the first
    assert await status(base, first.tokens.access_token) == 401
    assert await status(base, second.tokens.access_token) == 200


async def test_rotating_the_token_file_takes_effect_on_the_running_server(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.delenv("MCP_BEARER_TOKEN", raising=False)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "tb" / "token"))
    monkeypatch.setenv("MCP_PUBLIC_URL", f"http://127.0.0.1:{port}")
    old, _ = serve.ensure_token()
    with serving(port) as url:
        storage = Storage()
        await ping_with(url, connector(url, Browser(url, [old]), storage))
        assert await status(url, old) == 200 and await status(url, storage.tokens.access_token) == 200
        new, how = serve.ensure_token(rotate=True)   # what serve.py --setup-only --rotate does
        assert how == "rotated" and new != old
        assert await status(url, old) == 401
        assert await status(url, storage.tokens.access_token) == 401
        assert await status(url, new) == 200
        async with httpx2.AsyncClient(base_url=url, timeout=10) as web:
            answer = await refresh(web, storage)
            assert answer.status_code in (400, 401), answer.text
        fresh = Storage()
        await ping_with(url, connector(url, Browser(url, [old, new]), fresh))   # consent wants the new token
        assert await status(url, fresh.tokens.access_token) == 200
        (tmp_path / "tb" / "token").unlink()   # a deleted token file never opens the server
        assert await status(url, new) == 401 and await status(url, "x") == 401
