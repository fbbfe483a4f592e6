"""The dispatch card inside the chat: TaskBridge's MCP Apps view (issue 22, part 1).

The page (``board/task_card.html``, inline CSS and JS, no network) is served as the ``ui://``
resource CARD_URI with the MIME type ``text/html;profile=mcp-app``; submit_task, wait_for,
get_task and get_task_result name it in their ``_meta.ui.resourceUri``. A host that speaks MCP
Apps shows the card beside the tool's result: the task's status, spend, a live log tail, the
question or permission being asked, the receipt (summary, files, diff, cost), and buttons that
call the server's own tools (answer, allow or deny, raise the limit, cancel, apply). Hosts
without Apps ignore the ``_meta`` and get the tools' usual text and structured content.

Not run on its own; opencode_bridge_mcp installs it. Env: none (the page is read when a server is built).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mcp.server.apps import Apps

CARD_URI = "ui://taskbridge/task-card.html"
CARD_FILE = Path(__file__).resolve().parent / "board" / "task_card.html"
CARD_TOOLS = ("submit_task", "wait_for", "get_task", "get_task_result")


def card_html() -> str:
    """The card's page as served (read from CARD_FILE)."""
    return CARD_FILE.read_text(encoding="utf-8")


def apps() -> Apps:
    """The MCP Apps extension carrying the card's resource (no tools of its own: the queue tools
    are registered by the tool registry and only point at it, see ``tool_meta``). No CSP domains
    are granted: the page reaches nothing but its host."""
    extension = Apps()
    extension.add_html_resource(CARD_URI, card_html(), name="task card", title="TaskBridge task",
                                description="a task's status, log tail, question, receipt and actions",
                                prefers_border=True)
    return extension


def tool_meta() -> dict[str, dict[str, Any]]:
    """``_meta`` per tool name for the tools whose results the card shows."""
    return {name: {"ui": {"resourceUri": CARD_URI}} for name in CARD_TOOLS}
