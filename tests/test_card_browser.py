"""The dispatch card (MCP Apps view, issue 22 part 1) in real headless Chromium, inside a host page
that speaks the MCP Apps protocol (ext-apps 2.x: ui/initialize, then tool input and result
notifications; the view's tools/call and resources/read forwarded to the MCP server), against the
real server process, with real worker passes (real opencode, scripted model).

The host page is this test's: it loads the card's ui:// resource as the server serves it into a
sandboxed iframe (scripts only, no same origin, as hosts do), makes the tool call a model would
make, and forwards the card's requests over streamable HTTP (through a small same-origin proxy
that adds the bearer token)."""
from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
from test_board_browser import HOSTILE, browser  # noqa: F401  (the Chromium fixture)

import task_store
from fake_openai import text, tool_call
from helpers import bridge_process, git, make_repo, run_script

pytestmark = [pytest.mark.browser, pytest.mark.real_opencode]

TOKEN = "card-browser-token-0123456789"
STEP_USAGE = {"prompt_tokens": 100_000, "completion_tokens": 1_000, "cached_tokens": 0, "reasoning_tokens": 0}
RECEIPT = (
    '```json\n{"summary": "counted to three", "files_touched": ["n.txt"], "tests_run": [], "open_questions": []}\n```'
)

HOST_PAGE = """<!doctype html><html><body>\
<iframe id="view" sandbox="allow-scripts" style="width:900px;height:700px"></iframe>
<script>
const CALL = %(call)s, CARD = %(card)s;
window.__seen = [];
let session = null, nextId = 1;
async function mcp(method, params) {
  const headers = {"content-type": "application/json", "accept": "application/json",
                   "mcp-protocol-version": "2025-11-25"};
  if (session) headers["mcp-session-id"] = session;
  const body = {jsonrpc: "2.0", id: nextId++, method, params};
  const answer = await fetch("/mcp", {method: "POST", headers, body: JSON.stringify(body)});
  session = answer.headers.get("mcp-session-id") || session;
  return (await answer.json());
}
async function connect() {
  await mcp("initialize", {protocolVersion: "2025-11-25", capabilities: {},
                           clientInfo: {name: "card-host", version: "1"}});
  await fetch("/mcp", {method: "POST", headers: {"content-type": "application/json", "accept": "application/json",
                       "mcp-session-id": session, "mcp-protocol-version": "2025-11-25"},
                       body: JSON.stringify({jsonrpc: "2.0", method: "notifications/initialized"})});
}
const view = document.getElementById("view");
function toView(message) { view.contentWindow.postMessage(Object.assign({jsonrpc: "2.0"}, message), "*"); }
window.addEventListener("message", async (event) => {
  if (event.source !== view.contentWindow) return;
  const m = event.data;
  window.__seen.push(m.method || "response");
  if (m.method === "ui/initialize") {
    toView({id: m.id, result: {protocolVersion: "2026-01-26", hostInfo: {name: "card-host", version: "1"},
            hostCapabilities: {serverTools: {}, serverResources: {}}, hostContext: {theme: "light"}}});
  } else if (m.method === "ui/notifications/initialized") {
    toView({method: "ui/notifications/tool-input", params: {arguments: CALL.arguments}});
    const answer = await mcp("tools/call", CALL);
    window.__result = answer.result;
    toView({method: "ui/notifications/tool-result", params: answer.result});
  } else if (m.method === "tools/call" || m.method === "resources/read") {
    const answer = await mcp(m.method, m.params);
    toView(answer.error ? {id: m.id, error: answer.error} : {id: m.id, result: answer.result});
  }
});
connect().then(() => { view.srcdoc = CARD; });
</script></body></html>"""


class Proxy(http.server.BaseHTTPRequestHandler):
    """The host's origin: GET / is the host page; POST /mcp goes to the real server with the token."""
    page = b""
    upstream = ""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._reply(200, {"content-type": "text/html; charset=utf-8"}, self.page)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        keep = ("content-type", "accept", "mcp-session-id", "mcp-protocol-version")
        headers = {k: v for k, v in self.headers.items() if k.lower() in keep} | {"authorization": f"Bearer {TOKEN}"}
        answer = httpx2.post(f"{self.upstream}/mcp", content=body, headers=headers, timeout=60)
        passed = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "mcp-session-id")}
        self._reply(answer.status_code, passed, answer.content)

    def _reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server(tmp_path, monkeypatch) -> Iterator[str]:
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)
    with bridge_process(log_level="WARNING") as base:
        yield base


def card_resource(base: str) -> dict[str, Any]:
    """The card as the server serves it (resources/read of the ui:// URI the tools name)."""
    headers = {"authorization": f"Bearer {TOKEN}", "accept": "application/json", "content-type": "application/json"}
    with httpx2.Client(base_url=base, headers=headers, timeout=30) as web:
        init = web.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        session = {"mcp-session-id": init.headers["mcp-session-id"]}
        web.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session)
        tools = web.post("/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=session).json()
        uri = next(t for t in tools["result"]["tools"] if t["name"] == "submit_task")["_meta"]["ui"]["resourceUri"]
        read = web.post("/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "resources/read", "params": {"uri": uri}},
                        headers=session).json()
    return read["result"]["contents"][0]


def open_host(driver, base: str, call: dict[str, Any]) -> None:
    Proxy.upstream = base
    def js(value: Any) -> str:          # inside a <script>: "</" would end it
        return json.dumps(value).replace("</", "<\\/")
    Proxy.page = (HOST_PAGE % {"call": js(call), "card": js(card_resource(base)["text"])}).encode()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    driver.get(f"http://127.0.0.1:{httpd.server_address[1]}/")
    driver.switch_to.frame(driver.find_element("id", "view"))


def until(driver, check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    body = driver.find_element("tag name", "body").text
    driver.switch_to.default_content()
    seen = driver.execute_script("return [window.__seen, window.__result]")
    raise AssertionError(f"{what}; the card shows: {body!r}; the host saw {seen!r}")


def shown(driver, element_id: str) -> str:
    """The element's visible text; "" while the card's page is not loaded yet."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    try:
        return driver.find_element("id", element_id).text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def test_the_card_follows_a_task_raises_its_limit_and_applies_it(server, browser, opencode, tmp_path):  # noqa: F811
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("count", [tool_call("bash", {"command": f"echo {n} >> n.txt", "description": HOSTILE},
                                              usage=STEP_USAGE) for n in (1, 2, 3)]
                          + [text("Counted.\n" + RECEIPT, usage=STEP_USAGE)])
    resource = card_resource(server)
    assert resource["mimeType"] == "text/html;profile=mcp-app" and "https://" not in resource["text"]
    call = {"name": "submit_task", "arguments": {"title": HOSTILE, "working_dir": str(repo), "max_cost_usd": 0.15,
                                                 "instructions": "SCRIPT:count"}}
    open_host(browser, server, call)
    until(browser, lambda: shown(browser, "status") == "pending", "the card shows the submitted task")
    assert shown(browser, "title") == HOSTILE
    task_id = shown(browser, "ident")

    assert run_script("worker.py").returncode == 0          # the run pauses at its limit
    until(browser, lambda: shown(browser, "status") == "waiting", "the card follows the task to its pause")
    assert "spending limit" in shown(browser, "ask-kind") and "$0.2040" in shown(browser, "question")
    until(browser, lambda: "step_finish" in shown(browser, "log"), "the live log tail")
    browser.find_element("id", "limit").send_keys("2")
    browser.execute_script("document.getElementById('raise').click(); document.getElementById('raise').click();")
    until(browser, lambda: "not waiting" in shown(browser, "error"), "the stale second click gets the tool's error")
    assert task_store.get_task(task_id)["max_cost_usd"] == 2.0 and task_store.get_task(task_id)["status"] == "pending"

    assert run_script("worker.py").returncode == 0
    until(browser, lambda: shown(browser, "status") == "done", "the card shows the finished task", timeout=40)
    until(browser, lambda: "counted to three" in shown(browser, "summary"), "the receipt")
    assert shown(browser, "files") == "n.txt"
    browser.find_element("tag name", "details").click()
    assert "+3" in shown(browser, "diff")
    head = git(repo, "rev-parse", "HEAD")
    browser.find_element("id", "apply").click()
    until(browser, lambda: "applied" in shown(browser, "done-note"), "the apply button applies")
    assert git(repo, "rev-parse", "HEAD") != head and (repo / "n.txt").read_text() == "1\n2\n3\n"
    assert browser.execute_script("return window.__pwned") is None
    browser.switch_to.default_content()
    assert browser.execute_script("return window.__pwned") is None
    seen = browser.execute_script("return window.__seen")
    assert seen[:2] == ["ui/initialize", "ui/notifications/initialized"] and "resources/read" in seen
