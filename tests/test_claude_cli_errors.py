"""The reverse bridge's `claude -p` backend names what the API said (issue 8 §9): the real pinned
claude CLI against tests/fake_anthropic.py, through the MCP SDK client in memory."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

import claude_control_mcp as ccm
from fake_anthropic import FakeAnthropic
from helpers import require_pinned, tool_error

pytestmark = [pytest.mark.anyio, pytest.mark.real_claude]
REAL_CLAUDE = Path(__file__).resolve().parent.parent / "node_modules" / ".bin" / "claude"


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def cli_env(tmp_path: Path, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI backend pointed at the fake, its files under tmp_path, no retries."""
    monkeypatch.setenv("CLAUDE_BIN", require_pinned(str(REAL_CLAUDE), "the claude CLI (@anthropic-ai/claude-code)"))
    monkeypatch.setenv("CLAUDE_BACKEND", "cli")
    values = {"ANTHROPIC_BASE_URL": fake.url, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
              "CLAUDE_CODE_MAX_RETRIES": "0"}
    for name in ("HOME", "CLAUDE_CONFIG_DIR", "TMPDIR"):
        (tmp_path / "claude" / name.lower()).mkdir(parents=True)
        values[name] = str(tmp_path / "claude" / name.lower())
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_CUSTOM_HEADERS", "CLAUDE_API_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def server() -> Iterator[Any]:
    runner = ccm.JobRunner()
    yield ccm.build_server(runner)
    runner.shutdown()


async def ask_error(server: Any) -> str:
    async with Client(server, mode="legacy") as client:
        return await tool_error(client, "claude_ask", {"prompt": "hello", "timeout_sec": 60})


@pytest.mark.parametrize("credential", ["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"])
@pytest.mark.parametrize("status, kind, words", [
    (401, "auth", ["HTTP 401 authentication_error", "refused the credentials", "ANTHROPIC_API_KEY"]),
    (403, "auth", ["HTTP 403 permission_error", "may not use this model"]),
    (429, "rate_limit", ["HTTP 429 rate_limit_error", "wait a minute"]),
    (529, "overloaded", ["HTTP 529 overloaded_error", "try again in a minute"]),
])
async def test_the_api_status_reaches_the_caller_with_the_way_out(
        server: Any, cli_env: None, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch,
        credential: str, status: int, kind: str, words: list[str]) -> None:
    # With a token (or an expired login) the CLI words a refused 401 "Not logged in · Please run
    # /login"; its JSON result still carries api_error_status, which must win.
    monkeypatch.setenv(credential, "sk-refused-secret")
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", f"x-fake-mode: {status}")
    error = await ask_error(server)
    assert error.startswith(f"{kind}: "), error
    for word in words:
        assert word in error, error
    assert "claude CLI is not logged in" not in error and "sk-refused-secret" not in error
    assert [r.mode for r in fake.message_requests()] == [str(status)]


async def test_no_credentials_at_all_is_still_not_logged_in(server: Any, cli_env: None, fake: FakeAnthropic) -> None:
    error = await ask_error(server)
    assert error.startswith("not_logged_in: ") and fake.message_requests() == []
