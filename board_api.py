"""The dispatch board's HTTP side: its static shell (GET /, /board/<file>) and its JSON API
(/api/*), mounted by http_app beside the MCP transports.

The shell is plain files in ``board/`` (HTML, JS, CSS; no build step, no CDN) served with a
Content-Security-Policy that forbids inline script; it holds no data. Every /api/* route needs the
bearer token (http_app's BearerGuard) and answers JSON: 200 with the data, 400 with the store's
one-line message for bad input or a refused action, 503 naming the database and the fix when it
cannot be used, a one-line 500 for anything else (never a traceback).

Env: none of its own (the store reads TASK_DB_PATH and TASK_LOG_DIR at call time). Nothing
happens at import time.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import anyio

import mcp_shared
import task_store as store
import task_views

BOARD_DIR = Path(__file__).resolve().parent / "board"
LIST_PAGE_MAX = 200            # rows per /api/tasks page
# The shell's policy: scripts and styles only from this origin, no inline script, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "board.css": "text/css; charset=utf-8"}

log = logging.getLogger("taskbridge.board")


# --------------------------------------------------------------------------------------------
# The shell.


def _static(name: str) -> Any:
    from starlette.responses import Response
    body = (BOARD_DIR / name).read_bytes()
    return Response(body, media_type=STATIC[name],
                    headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                             "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})


async def board_page(request: Any) -> Any:
    """``GET /``: the board's shell (board/index.html); open, no data in it."""
    return _static("index.html")


async def board_file(request: Any) -> Any:
    """``GET /board/<file>``: the shell's script and style (only the files it is made of; 404 else)."""
    from starlette.responses import JSONResponse
    name = request.path_params["name"]
    if name not in STATIC:
        return JSONResponse({"error": f"no board file {name!r}: the board is /"}, status_code=404)
    return _static(name)


# --------------------------------------------------------------------------------------------
# The API.


async def answer_json(work: Callable[[], Any]) -> Any:
    """Run ``work()`` off the event loop and answer JSON: its dict (200), a store error (400), a
    database problem naming the file and the fix (503), anything else a one-line 500. Never a
    traceback in the response."""
    from starlette.responses import JSONResponse
    try:
        return JSONResponse(await anyio.to_thread.run_sync(work))
    except store.TaskStoreError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    except Exception as exc:
        problem = mcp_shared.database_problem(exc)
        if problem:
            log.warning("/api: %s", problem)
            return JSONResponse({"error": problem}, status_code=503)
        log.error("/api request crashed", exc_info=exc)
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); the server's log on stderr "
                                      "has the details"}, status_code=500)


async def api_status(request: Any) -> Any:
    """``GET /api/status``: what queue_status returns, plus the server version (503 when the
    database cannot be used)."""
    return await answer_json(lambda: task_views.queue_snapshot() | {"version": task_views.VERSION})


async def api_tasks(request: Any) -> Any:
    """``GET /api/tasks?status=&origin=&search=&limit=&offset=``: a page of tasks (400 on bad
    input, 503 when the database cannot be used)."""
    query = request.query_params

    def page() -> dict[str, Any]:
        limit = store.coerce_int("limit", query.get("limit") or 50, 1, LIST_PAGE_MAX)
        found = store.list_tasks(status=query.get("status"), origin=query.get("origin"),
                                 search=query.get("search"), limit=limit, offset=query.get("offset") or 0)
        return found | {"tasks": [task_views.row(t) for t in found["tasks"]]}

    return await answer_json(page)


def routes() -> list[Any]:
    """The board's routes: the shell and /api/*."""
    from starlette.routing import Route
    return [Route("/", board_page), Route("/board/{name}", board_file),
            Route("/api/status", api_status), Route("/api/tasks", api_tasks)]
