"""The remote door checks who knocks (issue 24, part 5), against the running server (uvicorn on
127.0.0.1 with the server's own connection settings) and the MCP SDK's OAuth client: redirect URIs
only https or loopback, /authorize never redirects an error to a client's page, registrations are
capped, forwarded client addresses are believed only from the tunnel serve.py started (a stand-in
process, tests/fake_tunnel.py: there is no tunnel binary here), the store's writes leave the event
loop free, replayed codes and refresh tokens revoke their sign-in, public clients revoke their
own tokens, and deny needs the bearer token."""
from __future__ import annotations

import json
import time
from urllib.parse import parse_qs, urlparse

import anyio
import httpx2
import pytest
from test_oauth import (
    REDIRECT,
    TOKEN,
    Browser,
    Storage,
    connector,
    ping_with,
    serving_oauth,
    status,
)
from test_oauth_abuse import refresh, registration

import fake_tunnel
import oauth
import serve

pytestmark = pytest.mark.anyio


@pytest.fixture
def base(tmp_path, monkeypatch):
    with serving_oauth(tmp_path, monkeypatch) as url:
        yield url


def query(client_id: str, redirect: str, **extra: str) -> dict:
    return {"response_type": "code", "client_id": client_id, "redirect_uri": redirect,
            "code_challenge": "a" * 43, "code_challenge_method": "S256", **extra}


@pytest.mark.parametrize("redirect", ["javascript:alert(document.cookie)//", "data:text/html,<script>x</script>",
                                      "file:///etc/passwd", "http://evil.example/cb", "https://claude.ai/cb#x",
                                      "ftp://claude.ai/cb"])
async def test_a_redirect_uri_that_is_not_https_or_loopback_is_refused(base, redirect):
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        answer = await web.post("/register", json=registration("Claude", redirect))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_redirect_uri" and "redirect URI" in answer.json()["error_description"]


async def test_loopback_and_https_redirect_uris_are_accepted(base):
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        for redirect in ("http://127.0.0.1:33418/callback", "http://localhost/cb", "http://[::1]:9/cb", REDIRECT):
            answer = await web.post("/register", json=registration("Claude", redirect))
            assert answer.status_code == 201, (redirect, answer.text)


async def test_authorize_shows_its_errors_instead_of_redirecting_to_the_clients_page(base):
    """The open redirector: an attacker registers its own https page, then sends people to
    /authorize with a broken request; the SDK answered 302 to the attacker's page, no consent shown."""
    evil = "https://evil.example/landing"
    async with httpx2.AsyncClient(base_url=base, timeout=10, follow_redirects=False) as web:
        client_id = (await web.post("/register", json=registration("Claude", evil))).json()["client_id"]
        broken = [query(client_id, evil, code_challenge_method="plain"),
                  query(client_id, evil, resource="https://other.example/mcp"),
                  query(client_id, evil, response_type="token")]
        for params in broken:
            answer = await web.get("/authorize", params=params)
            assert answer.status_code == 400, (params, answer.status_code, answer.headers.get("location"))
            assert "location" not in answer.headers and "cannot go on" in answer.text
            assert answer.headers["content-security-policy"].startswith("default-src 'none'")
        good = await web.get("/authorize", params=query(client_id, evil))
    assert good.status_code == 302 and good.headers["location"].startswith(f"{base}/oauth/consent?request=")


@pytest.mark.parametrize("field, value, error", [
    ("client_name", "n" * 60_000, "invalid_client_metadata"),
    ("client_name", "Claude\u202eevil", "invalid_client_metadata"),   # a fresh tester's: it reversed the consent page
    ("client_name", "Claude\x1b[2J", "invalid_client_metadata"),
    ("redirect_uris", [f"https://x.example/cb{i}" for i in range(oauth.MAX_REDIRECT_URIS + 1)], "invalid_redirect_uri"),
    ("redirect_uris", ["https://x.example/" + "p" * 2000], "invalid_redirect_uri"),
    ("contacts", ["a" * 50] * 200, "invalid_client_metadata")])
async def test_oversized_registrations_are_refused(base, field, value, error):
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        answer = await web.post("/register", json=registration("Claude") | {field: value})
    assert answer.status_code == 400 and answer.json()["error"] == error, answer.text


async def test_the_client_store_stays_small_at_its_cap(base, tmp_path, monkeypatch):
    """230 registrations of the largest accepted size used to grow oauth.json to 12 MB."""
    monkeypatch.setattr(oauth, "REGISTER_PER_PEER", 10_000)
    big = registration("n" * oauth.MAX_NAME_CHARS, "https://x.example/" + "p" * 600) | {"contacts": ["c" * 30] * 60}
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        assert (await web.post("/register", json=big | {"contacts": ["c" * 30] * 200})).status_code == 400
        for _ in range(oauth.MAX_CLIENTS + 30):
            assert (await web.post("/register", json=big)).status_code == 201
    size = (tmp_path / "tb" / "oauth.json").stat().st_size
    assert size <= oauth.MAX_CLIENTS * oauth.MAX_CLIENT_BYTES + 10_000, size
    assert len(json.loads((tmp_path / "tb" / "oauth.json").read_text())["clients"]) == oauth.MAX_CLIENTS


async def test_a_slow_store_write_does_not_stall_health(base, monkeypatch):
    """The store used to be rewritten on the event loop: every request waited for the disk."""
    real = oauth.store.write_private

    def slow(path, data):
        time.sleep(1.0)
        real(path, data)
    monkeypatch.setattr(oauth.store, "write_private", slow)
    async def register() -> None:
        async with httpx2.AsyncClient(base_url=base, timeout=10) as other:
            assert (await other.post("/register", json=registration("slow"))).status_code == 201
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web, anyio.create_task_group() as group:
        group.start_soon(register)
        await anyio.sleep(0.2)
        started = time.monotonic()
        assert (await web.get("/health")).status_code == 200
        took = time.monotonic() - started
    assert took < 0.5, f"/health took {took:.2f} s behind a store write"


async def rotating_registrations(url: str, count: int) -> list[int]:
    """Registrations each naming another client address, as a flooder rotating the headers does."""
    async with httpx2.AsyncClient(base_url=url, timeout=10) as web:
        return [(await web.post("/register", json=registration(f"r{i}"), headers={
            "X-Forwarded-For": f"203.0.113.{i}", "CF-Connecting-IP": f"198.51.100.{i}"})).status_code
            for i in range(count)]


async def test_forwarded_addresses_from_a_local_process_are_not_believed(base):
    """Both uvicorn's own proxy_headers and TaskBridge's peer lookup took them from any loopback peer."""
    codes = await rotating_registrations(base, oauth.REGISTER_PER_PEER + 3)
    assert codes == [201] * oauth.REGISTER_PER_PEER + [429] * 3


async def test_the_tunnel_serve_started_may_name_its_clients_and_no_one_else(base, tmp_path, monkeypatch):
    tunnel, public_port = fake_tunnel.start(tmp_path, int(urlparse(base).port))
    try:
        monkeypatch.setenv("TASKBRIDGE_TUNNEL_PID", tunnel.identity())
        through = f"http://127.0.0.1:{public_port}"
        # Each client the tunnel names has its own budget: the edge writes CF-Connecting-IP.
        assert await rotating_registrations(through, oauth.REGISTER_PER_PEER + 3) == [201] * (
            oauth.REGISTER_PER_PEER + 3
        )
        async with httpx2.AsyncClient(base_url=through, timeout=10) as web:
            one = [(await web.post("/register", json=registration("x"), headers={"CF-Connecting-IP": "192.0.2.9"})
                    ).status_code for _ in range(oauth.REGISTER_PER_PEER + 1)]
        assert one == [201] * oauth.REGISTER_PER_PEER + [429]
        # A local process sending the same headers straight to the port is one local client.
        assert (await rotating_registrations(base, oauth.REGISTER_PER_PEER + 1))[-1] == 429
        # A tunnel whose identity does not match (another process, a reused pid) is not believed.
        monkeypatch.setenv("TASKBRIDGE_TUNNEL_PID", f"{tunnel.proc.pid}:1")
        async with httpx2.AsyncClient(base_url=through, timeout=10) as web:
            late = await web.post("/register", json=registration("y"), headers={"CF-Connecting-IP": "192.0.2.77"})
        assert late.status_code == 429
    finally:
        tunnel.proc.terminate()
        tunnel.proc.wait(5)


def test_serve_tells_the_server_which_tunnel_it_started(tmp_path, monkeypatch):
    """serve._serve hands the tunnel's identity to the server child, never to anything it did not start."""
    started = {}

    class Recorder(serve.Services):
        def start(self, name, argv, env):
            started[name] = dict(env)
            raise serve.SetupError("recorded")
    fake_tunnel.start(tmp_path, 1)[0].proc.kill()   # writes the stand-in binary
    monkeypatch.setenv("TUNNEL_BIN", str(tmp_path / "cloudflared"))
    monkeypatch.delenv("TUNNEL_HOST", raising=False)
    sup = Recorder()
    try:
        assert serve._serve(sup, 1, "cloudflare", "t") == 1
        pid, started_at = started["server"]["TASKBRIDGE_TUNNEL_PID"].split(":")
        assert int(pid) == sup.children["tunnel"].pid and float(started_at) > 0
    finally:
        sup.stop()


async def test_a_replayed_refresh_token_revokes_the_tokens_issued_from_it(base):
    storage = Storage()
    await ping_with(base, connector(base, Browser(base, [TOKEN]), storage))
    stolen = storage.tokens.refresh_token
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        fresh = await refresh(web, storage)
        assert fresh.status_code == 200, fresh.text
        replay = await refresh(web, storage)   # storage still holds the spent one: the copy's holder
        assert replay.status_code == 400 and replay.json()["error"] == "invalid_grant"
        storage.tokens = type(storage.tokens).model_validate(fresh.json())
        assert await status(base, storage.tokens.access_token) == 401
        assert (await refresh(web, storage)).status_code == 400
    assert stolen != storage.tokens.refresh_token


async def test_a_replayed_authorization_code_revokes_its_tokens(base):
    storage, browser = Storage(), Browser(base, [TOKEN])
    await ping_with(base, connector(base, browser, storage))
    assert await status(base, storage.tokens.access_token) == 200
    async with httpx2.AsyncClient(base_url=base, timeout=10) as web:
        again = await web.post("/token", data={
            "grant_type": "authorization_code", "code": browser.code, "redirect_uri": REDIRECT,
            "client_id": storage.client.client_id, "client_secret": storage.client.client_secret or "",
            "code_verifier": "x" * 64})
        assert again.status_code == 400
        assert await status(base, storage.tokens.access_token) == 401
        assert (await refresh(web, storage)).status_code == 400


async def test_a_public_client_revokes_its_own_token_without_a_secret(base):
    storage = Storage()
    from mcp.client.auth import OAuthClientProvider
    from mcp.shared.auth import OAuthClientMetadata
    public = OAuthClientMetadata(client_name="Public", redirect_uris=[REDIRECT], token_endpoint_auth_method="none",
                                 grant_types=["authorization_code", "refresh_token"], response_types=["code"])
    browser = Browser(base, [TOKEN])
    await ping_with(base, OAuthClientProvider(f"{base}/mcp", public, storage, redirect_handler=browser.open,
                                              callback_handler=browser.callback))
    async with httpx2.AsyncClient(timeout=10) as web:
        answer = await web.post(f"{base}/revoke", data={"token": storage.tokens.refresh_token,
                                                        "client_id": storage.client.client_id})
        assert answer.status_code == 200, answer.text
        assert await status(base, storage.tokens.access_token) == 401
        secret_holder = Storage()
        await ping_with(base, connector(base, Browser(base, [TOKEN]), secret_holder))
        unsigned = await web.post(f"{base}/revoke", data={"token": secret_holder.tokens.access_token,
                                                          "client_id": secret_holder.client.client_id})
        assert unsigned.status_code == 401   # a client with a secret still needs it
    assert await status(base, secret_holder.tokens.access_token) == 200


async def test_deny_needs_the_bearer_token(base):
    async with httpx2.AsyncClient(base_url=base, timeout=10, follow_redirects=False) as web:
        client_id = (await web.post("/register", json=registration("Claude", REDIRECT))).json()["client_id"]
        consent = (await web.get("/authorize", params=query(client_id, REDIRECT, state="s1"))).headers["location"]
        request_id = parse_qs(urlparse(consent).query)["request"][0]
        stranger = await web.post("/oauth/consent", data={"request": request_id, "action": "deny"})
        assert stranger.status_code == 401 and "Deny needs the bearer token" in stranger.text
        assert (await web.get(consent)).status_code == 200, "the sign-in is still waiting"
        owner = await web.post("/oauth/consent", data={"request": request_id, "action": "deny", "token": TOKEN})
        assert owner.status_code == 302
        assert parse_qs(urlparse(owner.headers["location"]).query) == {"error": ["access_denied"], "state": ["s1"]}
        assert (await web.get(consent)).status_code == 400
