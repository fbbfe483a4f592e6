"""What TaskBridge's two MCP servers share: tool registration, and turning failures into
messages a model can act on.

Shared by opencode_bridge_mcp.py (the 17 queue tools) and claude_control_mcp.py (the reverse
bridge), so neither server imports the other's internals. Nothing happens at import time.

- ``ToolRegistry``: collects a module's tool functions so each ``build_server()`` makes a fresh server.
- ``TranslatingServer``: an MCPServer whose tool errors read as one clear line, never the SDK's
  "Error executing tool …" or pydantic's multi-line dump; arguments holding a NUL character are
  refused before any tool runs.
- ``explain_validation``: one line naming every bad argument, what it must be and what was sent.
- ``database_problem``: a broken queue database (corrupt, a folder, read-only, locked) named with
  its path and the way out, for the tools and for the HTTP API alike.
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import pydantic
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations

import task_store

log = logging.getLogger("taskbridge.mcp")

_STORE_FILE = Path(task_store.__file__).resolve()


# --------------------------------------------------------------------------------------------
# Arguments that fail the input schema.


def _loc(error: dict[str, Any]) -> str:
    parts = [str(p) for p in error["loc"]
             if isinstance(p, int) or not any(c in str(p) for c in "[(-") and str(p) not in
             ("str", "int", "float", "bool", "list", "dict", "none", "literal")]
    return ".".join(parts) or "arguments"


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:              # an int too long for repr (over 4300 digits)
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= 80 else text[:77] + "..."


def _phrase(error: dict[str, Any]) -> str:
    kind, ctx, shown = error["type"], error.get("ctx") or {}, _shown(error.get("input"))
    phrases = {
        "missing": "is required",
        "greater_than_equal": f"must be ≥ {ctx.get('ge')}; got {shown}",
        "less_than_equal": f"must be ≤ {ctx.get('le')}; got {shown}",
        "greater_than": f"must be > {ctx.get('gt')}; got {shown}",
        "less_than": f"must be < {ctx.get('lt')}; got {shown}",
        "int_parsing": f"must be a whole number; got {shown}",
        "int_parsing_size": f"must be a whole number of sensible size; got {shown}",
        "int_type": f"must be a whole number; got {shown}",
        "int_from_float": f"must be a whole number; got {shown}",
        "finite_number": f"must be a finite whole number; got {shown}",
        "bool_parsing": f"must be true or false; got {shown}",
        "bool_type": f"must be true or false; got {shown}",
        "string_type": f"must be text (a JSON string); got {shown}",
        "literal_error": f"must be one of {ctx.get('expected')}; got {shown}",
        "enum": f"must be one of {ctx.get('expected')}; got {shown}",
        "list_type": f"must be a list (a JSON array, or a string holding one); got {shown}",
        "too_long": f"may hold at most {ctx.get('max_length')} items; got {ctx.get('actual_length')}",
        "too_short": f"must hold at least {ctx.get('min_length')} item(s); got {ctx.get('actual_length')}",
    }
    if kind in phrases:
        return phrases[kind]
    message = str(error.get("msg", "is not valid")).removeprefix("Value error, ")
    return message if "got " in message else f"{message} (got {shown})"


def explain_validation(tool: str, exc: pydantic.ValidationError) -> str:
    """One line naming every bad argument, what it must be and what was sent."""
    seen: dict[str, str] = {}
    for error in exc.errors(include_url=False):
        seen.setdefault(_loc(error), _phrase(error))
    fields = "; ".join(f"{loc} {phrase}" for loc, phrase in seen.items())
    return f"invalid arguments for {tool}: {fields}. The tool's input schema lists each field."


def nul_argument(value: Any, where: str = "") -> str | None:
    """The dotted path of the first text (or key) in ``value`` holding a NUL character, or None.
    NUL cannot pass through a command line or a file path, so no tool accepts it."""
    if isinstance(value, str):
        return (where or "arguments") if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if "\x00" in str(key):
                return path
            found = nul_argument(item, path)
            if found:
                return found
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = nul_argument(item, f"{where}.{index}" if where else str(index))
            if found:
                return found
    return None


# --------------------------------------------------------------------------------------------
# The queue database.


def _from_store(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == _STORE_FILE:
            return True
        tb = tb.tb_next
    return False


def _db_shown() -> str:
    try:
        return str(task_store.db_path())
    except (OSError, ValueError):
        return repr(os.environ.get("TASK_DB_PATH", ""))


def _way_out(exc: BaseException) -> str:
    text = str(exc).lower()
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return ("it is not a SQLite database or it is damaged: restore it from a backup, or point "
                "TASK_DB_PATH at another file (a new queue starts empty)")
    if "readonly" in text or "read-only" in text or isinstance(exc, PermissionError):
        return ("it cannot be written: fix the permissions of the file and of its folder (SQLite "
                "writes -wal and -shm files beside it), or point TASK_DB_PATH elsewhere")
    if "locked" in text or "busy" in text:
        return "another process holds it locked: try again in a moment"
    if "unable to open" in text or isinstance(exc, (IsADirectoryError, NotADirectoryError, FileNotFoundError,
                                                    FileExistsError)):
        return ("it cannot be opened: TASK_DB_PATH must name a file (not a folder) in a folder this "
                "user can write")
    return "check TASK_DB_PATH and the file's permissions, or restore it from a backup"


def database_problem(exc: BaseException) -> str | None:
    """A message for a failure of the queue database itself (any sqlite3.Error, or an OSError
    raised inside task_store), naming the path and the way out; None for any other failure."""
    if not isinstance(exc, sqlite3.Error) and not (isinstance(exc, OSError) and _from_store(exc)):
        return None
    detail = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        detail = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"the task database {_db_shown()} cannot be used ({detail}): {_way_out(exc)}"


# --------------------------------------------------------------------------------------------
# The server.


def translate(tool: str, exc: ToolError, passthrough: tuple[type[BaseException], ...]) -> ToolError:
    """What the caller reads for ``exc`` (what the SDK raised around tool ``tool``): a schema
    failure explained field by field, a ``passthrough`` error's own message, a database problem
    with its way out, and for anything else a generic line (the traceback goes to the log)."""
    cause = exc.__cause__
    if type(exc) is ToolError and isinstance(cause, pydantic.ValidationError):
        return ToolError(explain_validation(tool, cause))
    if cause is not None and isinstance(cause, passthrough):
        return ToolError(str(cause))
    problem = database_problem(cause) if cause is not None else None
    if problem:
        log.warning("tool %s: %s", tool, problem)
        return ToolError(problem)
    if isinstance(cause, ToolError) and not isinstance(cause, UnexpectedToolError):
        return ToolError(str(cause))
    if isinstance(exc, UnexpectedToolError) or cause is not None:
        log.error("tool %s crashed", tool, exc_info=cause or exc)
        kind = type(cause).__name__ if cause else "error"
        return ToolError(f"{tool} failed with an internal error ({kind}); this is a fault of the server, "
                         "not of your arguments: its log on stderr has the details")
    return exc


# Characters a tool answer may have, counting both forms a client gets (structured content and its
# JSON text). The tools keep well under it by their own limits and paging; this is the last guard.
RESPONSE_MAX = 1_000_000


def _answer_size(result: CallToolResult) -> int:
    text = sum(len(getattr(block, "text", "") or "") for block in result.content)
    return text + (len(json.dumps(result.structured_content, default=str))
                   if result.structured_content is not None else 0)


def _shrink(value: Any, chars: int, items: int) -> Any:
    if isinstance(value, str) and len(value) > chars:
        return value[:chars] + f"… [cut: {len(value):,} characters; the answer was over its size cap]"
    if isinstance(value, list):
        return [_shrink(v, chars, items) for v in (value[-items:] if items else value)]
    if isinstance(value, dict):
        return {k: _shrink(v, chars, items) for k, v in value.items()}
    return value


def cap_result(name: str, result: Any) -> Any:
    """``result`` as it is when it has at most RESPONSE_MAX characters; else the same shape with
    its long strings cut (each cut says so), then, if that is not enough, long lists reduced to
    their last items, the text form rewritten from it, until it fits."""
    if not isinstance(result, CallToolResult) or _answer_size(result) <= RESPONSE_MAX:
        return result
    before = _answer_size(result)
    for chars, items in ((4000, 0), (1000, 0), (200, 100), (50, 20)):
        if result.structured_content is not None:
            data = _shrink(result.structured_content, chars, items)
            blocks = [TextContent(type="text", text=json.dumps(data, indent=2, ensure_ascii=False, default=str))]
        else:
            data, blocks = None, [_shrink_block(b, RESPONSE_MAX // (2 * max(1, len(result.content))))
                                  for b in result.content]
        result = result.model_copy(update={"structured_content": data, "content": blocks})
        if _answer_size(result) <= RESPONSE_MAX:
            break
    log.warning("%s answered %d characters; cut to %d (RESPONSE_MAX)", name, before, _answer_size(result))
    return result


def _shrink_block(block: Any, chars: int) -> Any:
    text = getattr(block, "text", None)
    return block.model_copy(update={"text": _shrink(text, chars, 0)}) if isinstance(text, str) else block


class TranslatingServer(MCPServer):
    """MCPServer whose tool errors are one clear line (see ``translate``). Subclasses list in
    ``passthrough`` the exception types whose message is written for the caller."""

    passthrough: tuple[type[BaseException], ...] = (task_store.TaskStoreError,)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        bad = nul_argument(arguments or {})
        if bad:
            raise ToolError(f"invalid arguments for {name}: {bad} contains a NUL character (\\u0000), which "
                            "no path, command line or prompt can carry; remove it")
        try:
            return cap_result(name, await super().call_tool(name, arguments, context))
        except UnexpectedToolError as exc:
            raise translate(name, exc, self.passthrough) from None
        except ToolError as exc:
            raise translate(name, exc, self.passthrough) from exc.__cause__


class ToolRegistry:
    """Collects the tool functions as the module is read; no server exists until build_server()."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, ToolAnnotations | None]] = []

    def tool(self, annotations: ToolAnnotations | None = None) -> Any:
        def mark(fn: Any) -> Any:
            self.entries.append((fn, annotations))
            return fn
        return mark
