"""Channel push: a short notice to the MCP client when a task ends or asks, as a Claude Code
channel (``notifications/claude/channel``), so no finished result waits unseen for a wait_for
that nobody called. wait_for stays the fallback for clients that do not listen.

The server declares ``capabilities.experimental["claude/channel"] = {}`` at ``initialize``; once
a session is initialized (``notifications/initialized``: stdio, and streamable-http sessions of
the handshake protocols; not the deprecated HTTP+SSE transport) a watcher follows the store's
events log from its newest event at that moment and, for each task that ends (``done``,
``failed``, ``cancelled``) or starts waiting (a question, a spending limit, a permission ask:
``waiting``; a usage-limit pause: ``paused``), sends one notification::

    {"method": "notifications/claude/channel",
     "params": {"content": "t_0003 done: <title> — call get_task_result",
                "meta": {"task_id": "t_0003", "status": "done", "event": "done"}}}

Claude Code shows it to the model as ``<channel source="taskbridge" task_id=... status=...
event=...>content</channel>``. Clients declare nothing for channels (Claude Code listens when
launched with ``--channels``), so every initialized session gets them; a client that does not know
the method drops it, as JSON-RPC asks. Task text is redacted (task_views.shown) and clipped to one
line. The watcher runs in the ``notifications/initialized`` handler's own task, which the SDK ends
with the session; it never holds a tool call, writes only JSON-RPC (through the session), and a
store it cannot read is logged to stderr once and retried every ``RETRY_SEC``.

Env: MCP_CHANNEL_PUSH (1, the default: push; 0: none, and the capability is not declared);
MCP_WAIT_POLL_SEC (the fallback poll of the events log where no change watch wakes it, as
wait_for's; at least ``WATCHED_POLL_SEC`` where one does).
Used by opencode_bridge_mcp.py (``install``); not run on its own.
"""
from __future__ import annotations

import html
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp_types import Notification

import knobs
import task_store as store
import task_views

log = logging.getLogger("taskbridge.channel")

CAPABILITY = "claude/channel"
METHOD = "notifications/claude/channel"
ENDED = {"done": "done", "failed": "failed", "cancelled": "cancelled"}   # event kind -> task status
ASKED = {"waiting": "waiting", "paused": "waiting"}
TITLE_SHOWN = 120           # characters of the title in a notice
QUESTION_SHOWN = 300        # characters of the question (task_views.ROW_TEXT_MAX, as list rows show it)
EVENTS_READ = 200           # events read a round
RETRY_SEC = 5.0             # how soon a watcher whose store failed reads again
WATCHED_POLL_SEC = 1.0      # the fallback read where the change watch wakes the watcher at each commit

Send = Callable[[dict[str, Any]], Awaitable[None]]


def enabled() -> bool:
    """``$MCP_CHANNEL_PUSH`` is not 0. A value that is not 0 or 1 counts as off here (logged);
    the server's start refuses it first (knobs.problems)."""
    try:
        return knobs.knob("MCP_CHANNEL_PUSH") != 0
    except knobs.KnobError as exc:
        log.warning("channel push off: %s", exc)
        return False


def install(server: MCPServer) -> MCPServer:
    """Add the channel's middleware to ``server`` (declares the capability, starts a session's
    watcher). Returns ``server``."""
    server.middleware.append(middleware)
    return server


async def middleware(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Declare ``claude/channel`` in the ``initialize`` result; after ``notifications/initialized``
    follow the events log for the session until it ends (this notification's own task; its
    result is discarded). Every other message passes untouched."""
    result = await call_next(ctx)
    if ctx.method == "initialize" and ctx.request_id is not None and isinstance(result, dict) and enabled():
        caps = result.get("capabilities") or {}
        return result | {"capabilities": caps | {"experimental": {**(caps.get("experimental") or {}), CAPABILITY: {}}}}
    if ctx.method == "notifications/initialized" and ctx.request_id is None and not _over_sse(ctx) and enabled():
        session = ctx.session

        async def send(params: dict[str, Any]) -> None:
            # Notification is the SDK's generic base; send_notification dumps any model.
            await session.send_notification(cast(Any, Notification[dict[str, Any], str](method=METHOD, params=params)))

        await follow(send)
    return result


def _over_sse(ctx: ServerRequestContext[Any, Any]) -> bool:
    """The message came over the deprecated HTTP+SSE transport (POST /messages/), which gets no
    notices: channels are stdio (Claude Code) and streamable-http, and the SDK's own SSE client
    fails its exit when a server notification lands as it closes (a race wait_for's caller hits:
    the notice of the end it waited for comes just after wait_for's answer)."""
    path = getattr(getattr(ctx.request, "url", None), "path", None)
    return isinstance(path, str) and path.rstrip("/").endswith("/messages")


async def follow(send: Send) -> None:
    """Send a notice (``send(params)``) for each end or ask recorded after this call starts,
    forever (the caller cancels it). A store error is logged once, then read again every
    ``RETRY_SEC`` until the store answers (logged again when it does)."""
    cursor: list[int] = []   # the last event seen, moved as each is sent: a failure midway resends none
    failing = False
    while True:
        try:
            if not cursor:
                cursor.append(await anyio.to_thread.run_sync(store.last_event_id))
            # Opened off the event loop: on PostgreSQL the watch is a connection of its own, whose
            # connect may wait on a server that is down (every session would stall with it).
            with await anyio.to_thread.run_sync(store.change_watch) as watch:
                while True:
                    await _push_new(send, cursor)
                    if failing:   # said once a read went through (a watch opens on a queue file gone, too)
                        log.info("channel push: the task store answers again")
                        failing = False
                    await _changed(watch, _poll_sec())
        except (store.TaskStoreError, OSError) as exc:
            if not failing:
                log.warning("channel push: cannot read the task store (%s); trying again every %g s",
                            exc, RETRY_SEC)
            failing = True
            await anyio.sleep(RETRY_SEC)


async def _push_new(send: Send, cursor: list[int]) -> None:
    """Send the notices of the events after ``cursor[0]``, moving it past each event once its
    notice is sent (a store error midway leaves it at the last one sent)."""
    while True:
        events = await anyio.to_thread.run_sync(store.events_since, cursor[0], None, EVENTS_READ)
        for event in events:
            if event["kind"] in ENDED or event["kind"] in ASKED:
                task = await anyio.to_thread.run_sync(_task_or_none, event["task_id"])
                await send(notice(event, task))
            cursor[0] = event["id"]
        if len(events) < EVENTS_READ:
            return


async def _changed(watch: Any, timeout: float) -> None:
    """Return once the events log may have moved (the store's change watch woke, and the commit
    had time to show: store.SETTLE_PAUSES), or after ``timeout`` seconds."""
    if not watch.available:
        await anyio.sleep(timeout)
        return
    # A session's watcher idles for hours: where commits wake it, the poll only covers a wake-up
    # that came before its commit showed, so it need not read as often as a blocked wait_for.
    with anyio.move_on_after(max(timeout, WATCHED_POLL_SEC)):
        await anyio.wait_readable(watch.fd)
        if watch.drain():
            await anyio.sleep(sum(store.SETTLE_PAUSES))


def _poll_sec() -> float:
    try:
        return knobs.knob("MCP_WAIT_POLL_SEC")
    except knobs.KnobError:
        return knobs.REGISTRY["MCP_WAIT_POLL_SEC"][1]


def _task_or_none(task_id: str | None) -> dict[str, Any] | None:
    """The task as it may be shown, or None when it is gone (cleared) or the event names none."""
    if task_id is None:
        return None
    try:
        return task_views.shown_task(task_id)
    except store.TaskNotFound:
        return None


def _line(text: str | None, limit: int) -> str:
    """``text`` on one line (control characters and breaks as spaces), clipped to ``limit``, with
    ``&``, ``<`` and ``>`` escaped: Claude Code wraps the content in a ``<channel>`` tag, and a
    question is the agent's word (untrusted), so a ``</channel>`` in it must stay text."""
    flat = task_views.CONTROL_OR_BREAK_RE.sub(" ", text or "").strip()
    return html.escape(task_views.short(flat, limit) or "", quote=False)


def notice(event: dict[str, Any], task: dict[str, Any] | None) -> dict[str, Any]:
    """The notification params for an end or ask ``event`` (as store.events_since gives it) of
    ``task`` (as task_views.shown gives it; None when gone): ``{"content": str, "meta":
    {"task_id", "status", "event"}}``, every value a string."""
    kind, task_id = event["kind"], event["task_id"] or "?"
    status = ENDED.get(kind) or ASKED[kind]
    title = _line(task["title"] if task else None, TITLE_SHOWN)
    head = f"{task_id} {status}: {title}" if title else f"{task_id} {status}"
    if kind in ENDED:
        text = f"{head} — call get_task_result"
    else:
        asked = _line((task or {}).get("question") or task_views.shown(event["message"]), QUESTION_SHOWN)
        text = f"{head} — asks: {asked} — read it with get_task, reply with answer_task"
    return {"content": text, "meta": {"task_id": task_id, "status": status, "event": kind}}
