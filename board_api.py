"""The dispatch board's HTTP side: its static shell (GET /, /board/<file>) and its JSON API
(/api/*), mounted by http_app beside the MCP transports.

The shell is plain files in ``board/`` (HTML, JS, CSS; no build step, no CDN) served with a
Content-Security-Policy that forbids inline script; it holds no data. Every /api/* route needs the
bearer token (http_app's BearerGuard) and answers JSON: 200 with the data, 400 with the store's
one-line message for bad input or a refused action, 404 for an unknown task, 415 for an action
without a JSON body, 503 naming the database and the fix when it cannot be used, a one-line 500
for anything else (never a traceback). GET never changes anything; actions are POST with a JSON
object body and go through the same store functions as the MCP tools and the CLI.

Reads:  /api/status, /api/tasks, /api/tasks/{id}, /api/tasks/{id}/log, /api/events, /api/jobs,
        /api/engine, /api/changes (long poll: returns within ~0.25 s of a change, else after
        ``wait`` seconds; the store's change watch wakes it at a commit or notification, and a
        stat of the database files decides whether the database is asked in between).
Writes: POST /api/tasks/{id}/answer {"answer"}, /note {"text"}, /cancel {"reason"?},
        /retry {"model"?, "note"?}: text fields only (a key not listed, a value not text, a body
        nested past 32 levels: 400 naming it).

Env: none of its own (the store reads TASK_DB_PATH and TASK_LOG_DIR at call time). Nothing
happens at import time.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

import mcp_shared
import opencode_runner
import task_store as store
import task_views

BOARD_DIR = Path(__file__).resolve().parent / "board"
LIST_PAGE_MAX = 200            # rows per /api/tasks page
LOG_CHUNK = 65_536             # bytes of a task log or the engine log per call
DIFF_SHOWN = 512 * 1024        # bytes of diff a task page carries
TEXT_SHOWN = 2_000             # characters of a job's prompt/answer head
EVENTS_MAX = 200               # events per /api/events or /api/changes answer
CHANGE_POLL_SEC = 0.25         # how often /api/changes looks (a few stat calls)
CHANGE_RECHECK_SEC = 5.0       # ...and asks the database even when the files look unchanged
WAIT_MAX_SEC = 30              # longest /api/changes wait
FOLLOW_MAX = 16                # running tasks' logs one /api/changes call follows for the feed
BODY_MAX = 300_000             # bytes of an action's JSON body
# The shell's policy: scripts and styles only from this origin, no inline script, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "board.css": "text/css; charset=utf-8"}

log = logging.getLogger("taskbridge.board")


class NotJson(Exception):
    """An action's body is not a JSON object (415 / 400)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# The shell.


def _static(name: str) -> Any:
    from starlette.responses import Response
    body = (BOARD_DIR / name).read_bytes()
    return Response(body, media_type=STATIC[name],
                    headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                             "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})


async def board_page(_request: Any) -> Any:
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
# Answering.


async def answer_json(work: Callable[[], Any]) -> Any:
    """Run ``work()`` off the event loop and answer JSON: its dict (200, TaskBridge's secrets
    redacted: ``task_views.shown``) or ``error_response``."""
    from starlette.responses import JSONResponse
    try:
        return JSONResponse(await anyio.to_thread.run_sync(lambda: task_views.shown(work())))
    except Exception as exc:
        return error_response(exc)


def error_response(exc: Exception) -> Any:
    """A failure as a one-line JSON error: an unknown task 404, another store error 400, a bad
    body its own status, a database problem naming the file and the fix 503, anything else 500.
    Never a traceback in the response."""
    from starlette.responses import JSONResponse
    if isinstance(exc, store.TaskNotFound):
        return JSONResponse({"error": str(exc)}, status_code=404)
    if isinstance(exc, (store.DatabaseUnavailable, store.DatabaseBusy,
                        store.DatabaseUnusable)):   # the database, not the request
        return JSONResponse({"error": str(exc)}, status_code=503)
    if isinstance(exc, store.TaskStoreError):
        return JSONResponse({"error": str(exc)}, status_code=400)
    if isinstance(exc, NotJson):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)
    problem = mcp_shared.database_problem(exc)
    if problem:
        log.warning("/api: %s", problem)
        return JSONResponse({"error": problem}, status_code=503)
    log.error("/api request crashed", exc_info=exc)
    return JSONResponse({"error": f"internal error ({type(exc).__name__}); the server's log on stderr "
                                  "has the details"}, status_code=500)


def takes(*names: str) -> Callable[[Callable], Callable]:
    """Refuse (400, one line) a query parameter the route does not read (``token`` is the
    bearer token's place for clients that cannot send headers): a misspelt filter such as
    ``?stauts=done`` was ignored and the whole list came back."""
    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)
        async def checked(request: Any) -> Any:
            unknown = [k for k in dict.fromkeys(request.query_params.keys()) if k not in names and k != "token"]
            if unknown:
                shown = ", ".join(repr(k[:60]) for k in unknown[:5])
                return error_response(store.ValidationError(
                    f"{request.url.path} does not take the query parameter(s) {shown}; it takes "
                    f"{', '.join(names) or 'none'}"))
            return await handler(request)
        return checked
    return wrap


def _offset(value: str | None, name: str = "offset") -> int | None:
    """A byte offset or size from the query (``name`` for the message), or None when absent."""
    return None if value in (None, "") else store.coerce_int(name, value, 0, 2**63 - 1)


# --------------------------------------------------------------------------------------------
# Reads.


@takes()
async def api_status(_request: Any) -> Any:
    """``GET /api/status``: what queue_status returns, plus the server version and the change
    marks (``marks.events`` is the newest event id: the feed's cursor)."""
    return await answer_json(lambda: task_views.queue_snapshot()
                             | {"version": task_views.VERSION, "marks": store.change_marks()})


def task_page(query: Any) -> dict[str, Any]:
    """A page of list rows for ``status`` (one or a comma list), ``origin``, ``search``,
    ``limit`` (1..200) and either ``cursor`` (the previous page's next_cursor: an index range
    read however deep) or ``offset``."""
    limit = store.coerce_int("limit", query.get("limit") or 50, 1, LIST_PAGE_MAX)
    status = query.get("status") or None
    found = store.list_tasks(status=status.split(",") if status else None, origin=query.get("origin"),
                             search=query.get("search"), limit=limit, offset=query.get("offset") or 0,
                             cursor=query.get("cursor") or None)
    return found | {"tasks": [task_views.row(t) | {"cost_usd": t.get("cost_usd"), "ran_model": t.get("ran_model")}
                              for t in found["tasks"]]}


@takes("status", "origin", "search", "limit", "cursor", "offset")
async def api_tasks(request: Any) -> Any:
    """``GET /api/tasks?status=&origin=&search=&limit=&cursor=|offset=``: a page of tasks with
    ``next_cursor`` (400 on bad input, 503 when the database cannot be used)."""
    return await answer_json(lambda: task_page(request.query_params))


def diff_files(diff: str) -> list[dict[str, Any]]:
    """The files of a git diff with their added and removed line counts, in diff order:
    ``[{"path", "added", "removed"}]`` (path from the ``diff --git a/… b/…`` header's b side)."""
    files: list[dict[str, Any]] = []
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            path = line[len("diff --git "):]
            path = path.split(" b/", 1)[1] if " b/" in path else path
            files.append({"path": path, "added": 0, "removed": 0})
        elif files and line.startswith("+") and not line.startswith("+++"):
            files[-1]["added"] += 1
        elif files and line.startswith("-") and not line.startswith("---"):
            files[-1]["removed"] += 1
    return files


def task_detail(task_id: str) -> dict[str, Any]:
    """Everything a task page shows: the task (TaskInfo), instructions, notes, questions, its
    last events, the receipt (long lists and strings cut), usage, the diff (first 512 KiB) with
    its file list, and the log's size in bytes."""
    task = store.get_task(task_id)
    diff = task.get("diff") or ""
    data = diff.encode()
    shown, _, end = task_views.page_utf8(data, 0, DIFF_SHOWN)
    result, cut = task_views.cap_json(task.get("result"))
    return task_views.info(task) | {
        "instructions": task["instructions"], "notes": task["notes"], "questions": task["questions"],
        "events": task["events"], "result": result, "result_truncated": cut, "usage": task.get("usage"),
        "base_commit": task.get("base_commit"), "diff": shown, "diff_bytes": len(data),
        "diff_truncated": end < len(data), "diff_files": diff_files(diff),
        "log_bytes": store.task_log_size(task["id"]),
    }


@takes()
async def api_task(request: Any) -> Any:
    """``GET /api/tasks/{id}``: one task's page (404 unknown id, 400 malformed id)."""
    return await answer_json(lambda: task_detail(request.path_params["task_id"]))


def whole_lines(source: Path | str, offset: int | None, chunk: int = LOG_CHUNK) -> dict[str, Any]:
    """Whole lines of a growing log, a file (Path) or a task's log (its id, through the store):
    from byte ``offset`` (at most ``chunk`` bytes, ending at the last complete line, so a line
    being written is read next time), or without offset the tail (the last ``chunk`` bytes' whole
    lines). An offset past the end means the log was cut or replaced meanwhile (the worker log
    keeps its newer half): the tail comes back with ``reset`` true. Returns {text, offset,
    next_offset, size, reset}."""
    size = task_views.file_size(source) if isinstance(source, Path) else store.task_log_size(source)
    reset = offset is not None and offset > size
    if reset:
        offset = None
    if offset is None:
        page = task_views.read_log_page(source, None, 10**9, chunk)
    else:
        page = task_views.read_log_page(source, offset, 1, chunk)
    text, start = page["text"], page["offset"]
    complete = text[: text.rfind("\n") + 1]
    if not complete and len(text.encode()) >= chunk:
        complete = text                   # one line longer than a chunk: show it as it is
    return {"text": complete, "offset": start, "next_offset": start + len(complete.encode()),
            "size": page["size"], "reset": reset}


def task_log(task_id: str, offset: int | None) -> dict[str, Any]:
    """A task log's whole lines from ``offset`` (or its tail) as readable entries
    (opencode_runner.render_log_line shapes), with ``model_calls`` (``model_calls_in``)."""
    task_id = next(iter(store.statuses_of([task_id])))
    part = whole_lines(task_id, offset)
    text = part.pop("text")
    return {"task_id": task_id, "entries": opencode_runner.render_log(text),
            "model_calls": model_calls_in(text)} | part


def model_calls_in(text: str) -> dict[str, Any]:
    """The model calls a chunk of a task log shows: ``{"started": N, "last": "start" | "finish" |
    None, "at": Unix seconds | None}`` (the chunk's last step event). OpenCode reports a tool call
    only when it ends, but a model call's start at once: a step started and not finished is the
    work in progress (the model answering, or the tool calls it asked for) that the board shows
    while nothing else arrives."""
    calls: dict[str, Any] = {"started": 0, "last": None, "at": None}
    for line in text.splitlines():
        if '"step_' not in line:          # most lines: no JSON parse
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("type") if isinstance(event, dict) else None
        if kind in ("step_start", "step_finish"):
            calls["started"] += kind == "step_start"
            stamp = event.get("timestamp")
            calls["last"] = "start" if kind == "step_start" else "finish"
            calls["at"] = stamp / 1000 if isinstance(stamp, (int, float)) else None
    return calls


@takes("offset")
async def api_task_log(request: Any) -> Any:
    """``GET /api/tasks/{id}/log?offset=``: the log as readable lines from a byte offset (the
    last call's next_offset) or, without one, its tail."""
    return await answer_json(lambda: task_log(request.path_params["task_id"],
                                              _offset(request.query_params.get("offset"))))


def engine_log(offset: int | None) -> dict[str, Any]:
    """The worker's own log (``worker.log`` beside the queue) as lines from ``offset`` or its tail."""
    part = whole_lines(store.state_path("worker.log"), offset)
    return {"lines": part.pop("text").splitlines()} | part


@takes("offset")
async def api_engine(request: Any) -> Any:
    """``GET /api/engine?offset=``: the worker's recent log lines."""
    return await answer_json(lambda: engine_log(_offset(request.query_params.get("offset"))))


def recent_events(after: int | None, limit: int) -> dict[str, Any]:
    """Events after the cursor ``after`` (oldest first), or without it the last ``limit``."""
    events = store.latest_events(limit) if after is None else store.events_since(after, limit=limit)
    return {"events": events, "cursor": events[-1]["id"] if events else (after or store.last_event_id())}


@takes("after", "limit")
async def api_events(request: Any) -> Any:
    """``GET /api/events?after=&limit=``: the events feed (ids are the cursor)."""
    query = request.query_params
    return await answer_json(lambda: recent_events(
        None if not query.get("after") else store.coerce_int("after", query["after"], 0, store.MAX_ID),
        store.coerce_int("limit", query.get("limit") or 50, 1, EVENTS_MAX)))


def job_rows(limit: int) -> dict[str, Any]:
    """The reverse bridge's newest jobs: id, status, backend, model, prompt and answer heads
    (2,000 characters), error, times."""
    rows = []
    for job in store.list_claude_jobs(limit=limit):
        rows.append({"id": job["id"], "status": job["status"], "backend": job.get("backend"),
                     "model": job.get("model"), "prompt": task_views.short(job.get("prompt"), TEXT_SHOWN),
                     "answer": task_views.short(job.get("answer"), TEXT_SHOWN),
                     "error": task_views.short(job.get("error"), TEXT_SHOWN),
                     "created_at": job.get("created_at"), "finished_at": job.get("finished_at")})
    return {"jobs": rows}


@takes("limit")
async def api_jobs(request: Any) -> Any:
    """``GET /api/jobs?limit=``: the reverse bridge's jobs (claude_submit and friends)."""
    return await answer_json(lambda: job_rows(
        store.coerce_int("limit", request.query_params.get("limit") or 20, 1, LIST_PAGE_MAX)))


# --------------------------------------------------------------------------------------------
# Live: a long poll on cheap marks.


def _stamp(*paths: Path) -> tuple:
    """(mtime_ns, size) of each file: SQLite writes the database or its -wal file on every commit,
    so an unchanged stamp means nothing was committed (checked again every 5 s regardless)."""
    out: list[tuple[int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


class Watch:
    """What one /api/changes call compares: the marks it was given and the files it follows."""

    def __init__(self, query: Any) -> None:
        self.cursor = store.coerce_int("cursor", query.get("cursor") or 0, 0, store.MAX_ID)
        self.jobs = query.get("jobs") or ""
        task = query.get("task") or None
        self.log = store.format_task_id(store.parse_task_id(task)) if task else None
        self.log_seen = _offset(query.get("log"), "log")
        self.engine_seen = _offset(query.get("engine"), "engine")
        self.follow = _follow_arg(query.get("follow") or "")
        db = store.db_path()
        self.db_files = (db, db.with_name(db.name + "-wal"))
        self.stamp: tuple | None = None
        self.asked = 0.0
        self.marks: dict[str, Any] = {}

    def sizes(self) -> dict[str, Any]:
        # Task logs through the store (a stat per file on SQLite, one query on PostgreSQL); the
        # engine log is this machine's worker's file.
        logs = store.task_log_sizes(([self.log] if self.log else []) + list(self.follow))
        return {"log_size": logs[self.log] if self.log else 0,
                "engine_size": task_views.file_size(store.state_path("worker.log")),
                "follow": {tid: logs[tid] for tid in self.follow}}

    def changed(self, woken: bool = False) -> bool:
        """Whether anything the page shows moved. ``woken``: the store's change watch fired (a
        commit on SQLite, a notification on PostgreSQL): the database is asked now, and again
        at the next look (a woken reader may beat the commit it was woken for)."""
        sizes = self.sizes()
        if any(sizes["follow"][tid] != seen for tid, seen in self.follow.items()):
            return True
        if self.log_seen is not None and sizes["log_size"] != self.log_seen:
            return True
        if self.engine_seen is not None and sizes["engine_size"] != self.engine_seen:
            return True
        stamp = _stamp(*self.db_files)
        if not woken and stamp == self.stamp and time.monotonic() - self.asked < CHANGE_RECHECK_SEC:
            return False
        self.stamp, self.asked = None if woken else stamp, time.monotonic()
        self.marks = store.change_marks()
        return self.marks["events"] != self.cursor or self.marks["jobs"] != self.jobs

    def answer(self) -> dict[str, Any]:
        marks = self.marks or store.change_marks()
        events = store.events_since(self.cursor, limit=EVENTS_MAX) if marks["events"] > self.cursor else []
        return {"cursor": events[-1]["id"] if events else marks["events"], "events": events,
                "jobs": marks["jobs"], "more": len(events) == EVENTS_MAX} | self.sizes()


def _follow_arg(text: str) -> dict[str, int]:
    """``t_0001:1234,t_0002:0`` (task id and the log size the page has seen) as a dict; at most 16."""
    follow: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        task_id, colon, size = item.partition(":")
        if not colon:
            raise store.ValidationError(f"follow takes task id:log size pairs joined by commas (t_0001:1234,t_0002:0); "
                                        f"got {store.shown_value(item, 40)}")
        follow[store.format_task_id(store.parse_task_id(task_id))] = store.coerce_int("follow size", size, 0, 2**63 - 1)
    if len(follow) > FOLLOW_MAX:
        raise store.ValidationError(f"follow names {len(follow)} task logs; at most {FOLLOW_MAX}")
    return follow


@takes("cursor", "jobs", "task", "log", "engine", "follow", "wait")
async def api_changes(request: Any) -> Any:
    """``GET /api/changes?cursor=&jobs=&task=&log=&engine=&follow=&wait=``: answers as soon as the
    events cursor or the jobs mark moved, or a log changed size: the open task's (``task``, size
    ``log``), the engine log (size ``engine``), or a running task's the feed follows (``follow``:
    ``t_0001:size,…``, at most 16), else after ``wait`` seconds (0..30, default 20). Returns
    {cursor, events (new ones, oldest first), jobs, log_size, engine_size, follow: {id: size},
    more}. While nothing changes it costs a look at the logs' sizes every 0.25 s (a few stat
    calls on SQLite, one small query on PostgreSQL) and one small query every 5 s; the store's
    change watch (``task_store.change_watch``) wakes it at once on a change of the database."""
    query = request.query_params

    try:
        wait = store.coerce_int("wait", query.get("wait") or 20, 0, WAIT_MAX_SEC)
        watch = await anyio.to_thread.run_sync(Watch, query)
        deadline = time.monotonic() + wait
        with await anyio.to_thread.run_sync(store.change_watch) as wake:
            woken = False
            while not mcp_shared.STOPPING.is_set() and not await anyio.to_thread.run_sync(watch.changed, woken) \
                    and time.monotonic() < deadline:
                woken = await anyio.to_thread.run_sync(wake.wait, CHANGE_POLL_SEC)
    except Exception as exc:
        return error_response(exc)
    return await answer_json(watch.answer)


# --------------------------------------------------------------------------------------------
# Actions: POST with a JSON object body, through the same store functions as the MCP tools.


JSON_DEPTH_MAX = 32             # nesting of an action's body (every field is flat text)


def _too_deep(raw: bytes, limit: int = JSON_DEPTH_MAX) -> bool:
    """Whether JSON text opens more than ``limit`` arrays/objects inside each other (brackets in
    strings not counted). Checked before parsing: the json module recurses once per level and a
    few KB of ``[[[…`` raised RecursionError."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False                       # the usual body: no walk at all
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:          # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


async def _body(request: Any) -> dict[str, Any]:
    """An action's body: a JSON object of at most BODY_MAX bytes and JSON_DEPTH_MAX levels
    (NotJson 415 without the JSON content type, 413 too large, 400 otherwise)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise NotJson("send the action as a JSON object with Content-Type: application/json", 415)
    raw = await request.body()   # http_app's Shield caps a body to /api at BODY_MAX bytes (413) as it streams
    if _too_deep(raw):
        raise NotJson(f"the body nests arrays or objects more than {JSON_DEPTH_MAX} deep; every field of "
                      "an action is plain text: send a flat JSON object such as {\"text\": \"...\"}")
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise NotJson("the body is not valid JSON: send a JSON object such as {\"answer\": \"...\"}") from None
    if not isinstance(body, dict):
        raise NotJson("the body must be a JSON object such as {\"answer\": \"...\"}")
    return body


# Each action's fields: name -> (required, most characters). Nothing else is accepted.
FIELDS: dict[str, dict[str, tuple[bool, int]]] = {
    "answer": {"answer": (True, store.ANSWER_MAX)},
    "note": {"text": (True, store.NOTE_MAX)},
    "cancel": {"reason": (False, store.NOTE_MAX)},
    "retry": {"model": (False, 200), "note": (False, store.NOTE_MAX)},
}


def _fields_shown(action: str) -> str:
    return ", ".join(f"{name} ({'required' if req else 'optional'} text)"
                     for name, (req, _) in FIELDS[action].items())


def action_fields(action: str, body: dict[str, Any]) -> dict[str, str | None]:
    """``body`` checked against the action's FIELDS: no unknown key, each value text (or null /
    absent when optional), within its size. Raises store.ValidationError with one line naming
    the key and what the action takes. Returns every field (None where absent)."""
    spec = FIELDS[action]
    unknown = [key for key in body if key not in spec]
    if unknown:
        shown = ", ".join(repr(k[:60] + ("…" if len(k) > 60 else "")) for k in unknown[:5])
        raise store.ValidationError(f"/{action} does not take {shown}; it takes {_fields_shown(action)}")
    out: dict[str, str | None] = {}
    for name, (required, limit) in spec.items():
        value = body.get(name)
        if value is None and not required:
            out[name] = None
            continue
        if not isinstance(value, str):
            got = "nothing" if name not in body else f"a JSON {_json_kind(value)}"
            raise store.ValidationError(f"{name} must be text (a JSON string), got {got}; "
                                        f"/{action} takes {_fields_shown(action)}")
        if len(value) > limit:
            raise store.ValidationError(f"{name} is {len(value)} characters; the limit is {limit}")
        out[name] = value
    return out


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def retry_action(task_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Requeue a failed or cancelled task with a fresh budget (store.retry_task, as the MCP tool
    and the CLI): optional ``model`` (provider/model) and ``note``."""
    task = store.retry_task(task_id, model=fields["model"], note=fields["note"], author="board")
    return task_views.info(task) | {"requeued_dependents": task["requeued_dependents"]}


ACTIONS: dict[str, Callable[[str, dict[str, Any]], Any]] = {
    "answer": lambda tid, f: task_views.info(store.answer_task(tid, f["answer"], author="board")),
    "note": lambda tid, f: store.add_note(tid, f["text"], author="board"),
    "cancel": lambda tid, f: task_views.info(store.cancel_task(tid, f["reason"] or "cancelled from the board")),
    "retry": retry_action,
}


@takes()
async def api_action(request: Any) -> Any:
    """``POST /api/tasks/{id}/{answer|note|cancel|retry}`` with a JSON object body: the store's
    answer_task, add_note, cancel_task or retry; a refusal answers 400 with the store's message,
    an unknown action 404."""
    from starlette.responses import JSONResponse
    name, task_id = request.path_params["action"], request.path_params["task_id"]
    if name not in ACTIONS:
        return JSONResponse({"error": f"no action {name!r}: use one of {', '.join(ACTIONS)}"}, status_code=404)
    try:
        fields = action_fields(name, await _body(request))
    except (NotJson, store.ValidationError) as exc:
        return error_response(exc)
    return await answer_json(lambda: ACTIONS[name](task_id, fields))


def routes() -> list[Any]:
    """The board's routes: the shell and /api/*."""
    from starlette.routing import Route
    return [Route("/", board_page), Route("/board/{name}", board_file),
            Route("/api/status", api_status), Route("/api/tasks", api_tasks),
            Route("/api/tasks/{task_id}", api_task), Route("/api/tasks/{task_id}/log", api_task_log),
            Route("/api/tasks/{task_id}/{action}", api_action, methods=["POST"]),
            Route("/api/events", api_events), Route("/api/jobs", api_jobs),
            Route("/api/engine", api_engine), Route("/api/changes", api_changes)]
