"""What TaskBridge's two MCP servers share: tool registration, and turning failures into
messages a model can act on.

Shared by opencode_bridge_mcp.py (the queue tools) and claude_control_mcp.py (the reverse
bridge), so neither server imports the other's internals. Nothing happens at import time.

- ``ToolRegistry``: collects a module's tool functions so each ``build_server()`` makes a fresh
  server; every tool must declare all four behaviour hints (``hints()``), or the module does not load.
  A tool returning a TypedDict is registered through ``answering``: its result is redacted,
  sized and written as text once (``answer``, a ``ShownAnswer``), and the SDK only checks it
  against the output schema (it would otherwise dump it and write its text a second time).
- ``TranslatingServer``: an MCPServer whose tool errors read as one clear line, never the SDK's
  "Error executing tool …" or pydantic's multi-line dump; arguments holding a NUL character, and
  arguments the tool does not take, are refused before any tool runs. It lists every tool with a
  portable input schema (``portable_schema``: closed objects, no ``null`` type unions), the form
  strict clients (OpenAI strict mode, Gemini, Cursor) accept.
- ``RESULT_CHARS_MAX``, ``result_chars``, ``fit``: keep a tool result's text under the size at
  which clients stop showing it to the model (Claude Code: ~50,000 characters).
- ``StreamableEndpoint``: the ``/mcp`` route over two SDK session managers, answering a client
  that accepts only ``application/json`` with plain JSON responses (SSE for the rest), and
  marking a request whose client dropped the connection, so that the tool it runs is stopped
  (``TranslatingServer`` cancels it within a moment).
- ``TranslatingServer.run_stdio_async``: on stdin's end the requests already read still finish and
  their replies are written before the server exits (``DrainingReader``, ``ReplyTracker``).
- ``explain_validation``: one line naming every bad argument, what it must be and what was sent.
- ``database_problem``: a broken queue database (corrupt, a folder, read-only, locked) named with
  its path and the way out (the store's own message), for the tools and for the HTTP API alike.
- ``STOPPING``: set when the HTTP server begins to stop; long waits (wait_for, the board's long
  polls) answer at once rather than be cancelled mid-request.

Not run on its own; reads no env of its own.
"""
from __future__ import annotations

import collections
import copy
import functools
import inspect
import json
import logging
import threading
import time
import typing
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import pydantic
import pydantic_core
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.types import (
    CallToolResult,
    JSONRPCError,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    TextContent,
    ToolAnnotations,
)
from typing_extensions import is_typeddict

import os_faults
import task_store
import task_views

log = logging.getLogger("taskbridge.mcp")
# Set when the HTTP server begins to stop (http_app.serve, at the first SIGINT/SIGTERM): long
# waits (wait_for, the board's long polls) end at once with an answer, before the shutdown's grace
# period is over and it cancels them mid-request (the client got an empty stream).
STOPPING = threading.Event()


# --------------------------------------------------------------------------------------------
# Arguments that fail the input schema.


def _loc(error: pydantic_core.ErrorDetails) -> str:
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


def _phrase(error: pydantic_core.ErrorDetails) -> str:
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
        "finite_number": f"must be a finite number; got {shown}",
        "float_parsing": f"must be a number; got {shown}",
        "float_type": f"must be a number; got {shown}",
        "dict_type": f"must be an object (a JSON object); got {shown}",
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


def database_problem(exc: BaseException) -> str | None:
    """The message for a failure of the queue's storage itself: the store's DatabaseUnusable,
    DatabaseCorrupt or DatabaseBusy (its text names the file and the way out), or an OSError the
    OS raised on one of its files (a task log, the heartbeat file), named by os_faults in one line;
    None for any other failure. The store sorts its driver's errors; nothing here reads their words."""
    if isinstance(exc, (task_store.DatabaseUnusable, task_store.DatabaseBusy)):
        return str(exc)
    if isinstance(exc, OSError):
        fault = os_faults.describe(exc)
        return fault.line if fault else None
    return None


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


ERROR_MAX = 2_000   # characters of a tool's error text: an argument it echoes is cut past it


def capped_error(exc: ToolError) -> ToolError:
    """``exc`` as the caller reads it: a text over ERROR_MAX characters (it echoed a huge
    argument) keeps its head and its end (the way out) around a note of what was cut."""
    text = str(exc)
    if len(text) <= ERROR_MAX:
        return exc
    head, tail = ERROR_MAX * 2 // 3, ERROR_MAX // 4
    return ToolError(f"{text[:head]} … [{len(text) - head - tail:,} characters cut] … {text[-tail:]}")


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


def shown_result(result: Any) -> Any:
    """A tool's answer with TaskBridge's own secrets redacted in both forms a client gets (the
    structured content and its text blocks): ``task_views.shown``, the one place every tool of
    both servers passes through."""
    if not isinstance(result, CallToolResult):
        return task_views.shown(result)
    blocks = [b.model_copy(update={"text": task_views.shown(text)})
              if isinstance(text := getattr(b, "text", None), str) else b for b in result.content]
    return result.model_copy(update={"structured_content": task_views.shown(result.structured_content),
                                     "content": blocks})


class TranslatingServer(MCPServer):
    """MCPServer whose tool errors are one clear line (see ``translate``) and whose tools are
    listed with portable input schemas (see ``portable_schema``). Subclasses list in
    ``passthrough`` the exception types whose message is written for the caller."""

    passthrough: tuple[type[BaseException], ...] = (task_store.TaskStoreError,)

    async def list_tools(self) -> list[Any]:
        tools = await super().list_tools()
        return [tool.model_copy(update={"input_schema": portable_schema(tool.input_schema),
                                        "output_schema": lean_schema(tool.output_schema)}) for tool in tools]

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        gone = client_gone_event(context)
        if gone is None:
            return await self._call_tool(name, arguments, context)
        outcome: dict[str, Any] = {}
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_when_set, gone, group.cancel_scope)
            try:
                outcome["result"] = await self._call_tool(name, arguments, context)
            except Exception as exc:        # re-raised below, outside the task group
                outcome["error"] = exc
            group.cancel_scope.cancel()
        if "error" in outcome:
            raise outcome["error"]
        if "result" not in outcome:
            log.info("tool %s stopped after %.1f s: its client closed the connection", name,
                     time.monotonic() - started)
            raise ToolError(f"{name} stopped: the client closed its connection")
        return outcome["result"]

    async def _call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        bad = nul_argument(arguments or {})
        if bad:
            raise ToolError(f"invalid arguments for {name}: {bad} contains a NUL character (\\u0000), which "
                            "no path, command line or prompt can carry; remove it")
        unknown = self._unknown_arguments(name, arguments or {}) or self._odd_numbers(name, arguments or {})
        if unknown:
            raise capped_error(ToolError(unknown))
        try:
            result = await super().call_tool(name, arguments, context)
            if isinstance(result, ShownAnswer):     # redacted and sized where it was built (answer())
                return result
            return shown_result(_within_budget(name, cap_result(name, result)))
        except UnexpectedToolError as exc:
            raise capped_error(translate(name, exc, self.passthrough)) from None
        except ToolError as exc:
            raise capped_error(translate(name, exc, self.passthrough)) from exc.__cause__


    async def run_stdio_async(self) -> None:
        """Serve over stdio until stdin ends; the requests read before its end are answered first.

        The SDK cancels in-flight handlers when its read stream ends, so a client that pipes
        ``submit_task`` and closes stdin got no reply though the task was made (and would submit
        it again). Here the read stream the SDK sees ends only once every request read from stdin
        has its reply written (or was cancelled by the client), at most ``STDIN_END_GRACE_SEC``."""
        from mcp.server.stdio import stdio_server
        lowlevel = self._lowlevel_server
        async with stdio_server() as (read_stream, write_stream):
            tracker = ReplyTracker()
            await lowlevel.run(DrainingReader(read_stream, tracker), ReplyWriter(write_stream, tracker),
                               lowlevel.create_initialization_options())

    def _unknown_arguments(self, name: str, arguments: dict[str, Any]) -> str | None:
        """A message naming the arguments ``name`` does not take (its schema is closed, and a
        misspelt optional argument silently ignored would run the tool with its default)."""
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            return None
        known = list(tool.parameters.get("properties") or {})
        unknown = [key for key in arguments if key not in known]
        if not unknown:
            return None
        takes = f"it takes {', '.join(known)}" if known else "it takes no arguments"
        return (f"invalid arguments for {name}: unknown argument(s) {', '.join(map(repr, unknown))}; {takes}. "
                "The tool's input schema lists each field.")

    def _odd_numbers(self, name: str, arguments: dict[str, Any]) -> str | None:
        """A message naming the first number argument (at any depth: a submit_batch item's too)
        sent as true/false or as infinity/NaN, or None. pydantic's lax mode reads true as 1 for an
        int, so the store's own refusal (``task_store.odd_number``, same words) never saw it."""
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            return None
        found = odd_number_argument(arguments, tool.parameters, tool.parameters.get("$defs") or {}, "")
        return f"invalid arguments for {name}: {found}. The tool's input schema lists each field." if found else None


def _number_schemas(schema: dict[str, Any], defs: dict[str, Any]) -> list[dict[str, Any]]:
    """``schema`` and the members of its anyOf/oneOf, with each ``$ref`` to ``defs`` resolved."""
    ref = schema.get("$ref")
    if isinstance(ref, str):
        schema = defs.get(ref.rsplit("/", 1)[-1], {})
    members = [m for key in ("anyOf", "oneOf") for m in schema.get(key, [])]
    return [schema] + [s for m in members for s in _number_schemas(m, defs)]


def odd_number_argument(value: Any, schema: dict[str, Any], defs: dict[str, Any], where: str) -> str | None:
    """``<path> <problem>`` for the first value that ``schema`` (a tool's input schema, or a
    part of it) types as a number, integer or not boolean, while it is true/false, infinity or
    NaN (``task_store.odd_number``); None when there is none."""
    schemas = _number_schemas(schema, defs)
    types = {kind for s in schemas for kind in (s["type"] if isinstance(s.get("type"), list) else [s.get("type")])}
    if types & {"integer", "number"} and "boolean" not in types:
        problem = task_store.odd_number(value)
        if problem:
            return f"{where or 'arguments'} {problem}"
    for part in schemas:
        if isinstance(value, dict) and isinstance(part.get("properties"), dict):
            for key, item in value.items():
                if key in part["properties"]:
                    found = odd_number_argument(item, part["properties"][key], defs, f"{where}.{key}" if where else key)
                    if found:
                        return found
        if isinstance(value, list) and isinstance(part.get("items"), dict):
            for index, item in enumerate(value):
                found = odd_number_argument(item, part["items"], defs, f"{where}.{index}")
                if found:
                    return found
    return None


# --------------------------------------------------------------------------------------------
# Tool declarations every client accepts.

HINT_NAMES = ("read_only_hint", "destructive_hint", "idempotent_hint", "open_world_hint")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


STDIN_END_GRACE_SEC = 300.0    # longest wait, after stdin ends, for replies still owed


class ReplyTracker:
    """The ids of requests read from the client and not yet answered."""

    def __init__(self) -> None:
        self.owed: set[Any] = set()
        self.settled = anyio.Event()

    def read(self, message: Any) -> None:
        if isinstance(message, JSONRPCRequest):
            self.owed.add(message.id)
        elif isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled":
            self._done((message.params or {}).get("requestId"))   # a cancelled request may get no reply

    def written(self, message: Any) -> None:
        if isinstance(message, (JSONRPCResponse, JSONRPCError)):
            self._done(message.id)

    def _done(self, request_id: Any) -> None:
        self.owed.discard(request_id)
        if not self.owed:
            self.settled.set()
            self.settled = anyio.Event()

    async def drained(self, grace: float) -> None:
        """Return once no reply is owed, or after ``grace`` seconds (logged with the ids left)."""
        with anyio.move_on_after(grace) as scope:
            while self.owed:
                await self.settled.wait()
        if scope.cancelled_caught:
            log.warning("stdin ended; %d request(s) still unanswered after %.0f s: %s", len(self.owed), grace,
                        sorted(map(str, self.owed)))


class _WrappedStream:
    """What both stream wrappers share: the transport's stream and the ReplyTracker they report to;
    closing closes the wrapped stream; usable as ``async with``."""

    def __init__(self, inner: Any, tracker: ReplyTracker) -> None:
        self.inner, self.tracker = inner, tracker

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class DrainingReader(_WrappedStream):
    """A read stream over the transport's whose end waits for the replies still owed (ReplyTracker)."""

    @property
    def last_context(self) -> Any:      # the sender's contextvars, as the SDK's stream carries them
        return getattr(self.inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            item = await self.inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            await self.tracker.drained(STDIN_END_GRACE_SEC)
            raise anyio.EndOfStream from None
        self.tracker.read(getattr(item, "message", None))
        return item

    def __aiter__(self) -> DrainingReader:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


class ReplyWriter(_WrappedStream):
    """A write stream over the transport's that tells the ReplyTracker which requests are answered."""

    async def send(self, item: Any) -> None:
        await self.inner.send(item)
        self.tracker.written(getattr(item, "message", None))


def hints(*, read_only: bool, destructive: bool, idempotent: bool, open_world: bool) -> ToolAnnotations:
    """All four MCP behaviour hints, each stated (ChatGPT's apps require them; a client that
    misses one assumes the worst: destructive, not idempotent, open world).

    read_only: changes nothing; destructive: may overwrite or delete (not only add);
    idempotent: a repeat with the same arguments changes nothing more; open_world: reaches
    something beyond this machine's queue (a model provider, a service's catalogue)."""
    return ToolAnnotations(read_only_hint=read_only, destructive_hint=destructive and not read_only,
                           idempotent_hint=idempotent, open_world_hint=open_world)


def portable_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a tool's input schema, as pydantic writes it) in the form every client takes:
    an optional value is the plain type (``"type": ["string", "null"]`` and ``anyOf: [X,
    {"type": "null"}]`` become ``X``; a ``"default": null`` is dropped, so the field is simply
    optional), and every object with declared properties, the arguments object itself included,
    is closed (``additionalProperties: false``), and an exclusive bound is stated as an inclusive
    one plus words (``_inclusive_bounds``). The server still accepts ``null`` for such a field and
    still refuses the exclusive bound; only what clients are told changes. Returns a new dict."""
    node = _portable(copy.deepcopy(schema))
    node.setdefault("properties", {})
    node["additionalProperties"] = False
    return node


def _portable(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _portable(sub) for name, sub in node[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_portable(sub) for sub in node[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(node.get(key), dict):
            node[key] = _portable(node[key])
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        node["type"] = kinds[0] if len(kinds) == 1 else kinds
    for key in ("anyOf", "oneOf"):
        members = node.get(key)
        if isinstance(members, list) and any(m == {"type": "null"} for m in members):
            rest = [m for m in members if m != {"type": "null"}]
            del node[key]
            if len(rest) == 1:
                node = _merged(rest[0], node)
            else:
                node[key] = rest
    if "default" in node and node["default"] is None:
        del node["default"]
    _inclusive_bounds(node)
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def lean_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """``schema`` (a tool's output schema, as pydantic writes it) in the form that is cheapest to
    check and means the same: each ``$ref`` to its ``$defs`` entry written in place (when no
    definition refers back to itself), each union of bare types (``anyOf: [{"type": "string"},
    {"type": "null"}]``) as one type list (``"type": ["string", "null"]``), and pydantic's
    generated ``title`` of each property (its name, capitalised) left out. A client that checks
    every result against the listed schema (the Python SDK's does, with jsonschema) spent 70 ms
    on a page of 50 rows through the ``$ref`` and ``anyOf`` branches; the same check passes and
    fails on the same values. None stays None; returns a new dict."""
    if schema is None:
        return None
    defs = schema.get("$defs") or {}
    if any(_refers_to(name, body, defs, set()) for name, body in defs.items()):
        return _lean(copy.deepcopy(schema), {})   # recursive shapes keep their references
    lean = _lean({k: v for k, v in schema.items() if k != "$defs"}, defs)
    return lean


def _refers_to(name: str, node: Any, defs: dict[str, Any], seen: set[str]) -> bool:
    """Whether ``node`` reaches the definition ``name`` through its references."""
    if isinstance(node, list):
        return any(_refers_to(name, item, defs, seen) for item in node)
    if not isinstance(node, dict):
        return False
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        target = ref.removeprefix("#/$defs/")
        if target == name:
            return True
        if target not in seen:
            seen.add(target)
            if _refers_to(name, defs.get(target), defs, seen):
                return True
    return any(_refers_to(name, value, defs, seen) for key, value in node.items() if key != "$ref")


def _lean(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_lean(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    while defs and isinstance(ref := node.get("$ref"), str) and ref.removeprefix("#/$defs/") in defs:
        # A reference beside other keywords (a description) keeps them: both apply.
        node = defs[ref.removeprefix("#/$defs/")] | {k: v for k, v in node.items() if k != "$ref"}
    out = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _untitled(_lean(sub, defs), name) for name, sub in value.items()}
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _lean(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _lean(value, defs) if key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMA_ONE) else value
    members = out.get("anyOf")
    if isinstance(members, list) and "type" not in out and all(
            isinstance(m, dict) and set(m) == {"type"} and isinstance(m["type"], str) for m in members):
        out["type"] = [m["type"] for m in out.pop("anyOf")]
    return out


def _untitled(node: Any, name: str) -> Any:
    # pydantic titles a property with its own name ("task_id" -> "Task Id"): no news to a reader.
    if isinstance(node, dict) and node.get("title") == name.replace("_", " ").title():
        return {k: v for k, v in node.items() if k != "title"}
    return node


def _merged(member: dict[str, Any], outer: dict[str, Any]) -> dict[str, Any]:
    """The one non-null member of a union merged into the union's node; both descriptions kept
    (the member's says a bound in words, see _inclusive_bounds)."""
    merged = member | outer
    inner, said = member.get("description"), outer.get("description")
    if inner and said and inner != said:
        merged["description"] = f"{said} ({inner})"
    return merged


def _inclusive_bounds(node: dict[str, Any]) -> None:
    """exclusiveMinimum/Maximum become minimum/maximum with the strict bound said in words:
    Gemini-model routes refuse the exclusive keywords. The server still refuses the bound itself."""
    bounds = (("exclusiveMinimum", "minimum", "more"), ("exclusiveMaximum", "maximum", "less"))
    for exclusive, inclusive, word in bounds:
        if exclusive in node:
            bound = node.pop(exclusive)
            node.setdefault(inclusive, bound)
            said = f"must be {word} than {bound}"
            node["description"] = f"{node['description']} ({said})" if node.get("description") else said


async def _cancel_when_set(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


# --------------------------------------------------------------------------------------------
# Streamable HTTP: plain JSON for clients that do not take SSE; stop work for clients that left.

GONE_KEY = "taskbridge.client_gone"       # the scope key holding a request's "client left" event
JSON_SESSIONS_KEPT = 10_000


def client_gone_event(context: Any) -> anyio.Event | None:
    """The event StreamableEndpoint sets when the client of the HTTP request behind ``context``
    (a tool call's Context) closed its connection; None over stdio, sse and in memory."""
    try:
        request = context.request_context.request if context is not None else None
    except (AttributeError, LookupError, ValueError, RuntimeError):
        return None
    scope = getattr(request, "scope", None)
    return scope.get(GONE_KEY) if isinstance(scope, dict) else None


def _accepts(headers: list[tuple[bytes, bytes]]) -> tuple[bool, bool]:
    """(takes JSON, takes SSE) by the request's Accept header, as the SDK judges it."""
    accept = b",".join(v for k, v in headers if k == b"accept").decode("latin-1").lower()
    kinds = {part.split(";")[0].strip() for part in accept.split(",")}
    anything = "*/*" in kinds
    return (anything or bool(kinds & {"application/json", "application/*"}),
            anything or bool(kinds & {"text/event-stream", "text/*"}))


class StreamableEndpoint:
    """Pure ASGI app for ``/mcp`` over two SDK session managers built for the same server: one
    answering with SSE streams (progress notifications reach the client), one in the SDK's
    JSON-response mode. A request without a session goes to the SSE manager when its client
    accepts ``text/event-stream`` and to the JSON manager otherwise (several client libraries
    send ``Accept: application/json`` only, which the SSE manager answers with 406; a request
    with neither gets ``application/json`` added); a request with a session goes to the manager
    that made that session.

    Every request carries an ``anyio.Event`` under ``scope[GONE_KEY]``, set when its client closes
    the connection before the response is complete: ``TranslatingServer.call_tool`` then cancels
    the tool (the SDK itself keeps a streamable-http tool running after its client left)."""

    def __init__(self, sse_manager: Any, json_manager: Any) -> None:
        self.sse_manager, self.json_manager = sse_manager, json_manager
        self.json_sessions: collections.OrderedDict[str, None] = collections.OrderedDict()

    def _route(self, scope: dict) -> tuple[Any, dict]:
        headers = list(scope.get("headers") or [])
        session = next((v.decode("latin-1") for k, v in headers if k == b"mcp-session-id"), None)
        if session is not None:
            return (self.json_manager if session in self.json_sessions else self.sse_manager), scope
        takes_json, takes_sse = _accepts(headers)
        if takes_sse and takes_json:
            return self.sse_manager, scope
        if not takes_json and not takes_sse:
            scope = dict(scope, headers=[*headers, (b"accept", b"application/json")])
        return self.json_manager, scope

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.sse_manager.handle_request(scope, receive, send)
        manager, scope = self._route(scope)
        gone = anyio.Event()
        scope[GONE_KEY] = gone
        body_done = anyio.Event()
        state = {"complete": False}

        async def receive_marked() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not state["complete"]:
                    gone.set()
            elif not message.get("more_body", False):
                body_done.set()
            return message

        async def send_marked(message: dict) -> None:
            if message["type"] == "http.response.start" and manager is self.json_manager:
                self._remember(message.get("headers") or [])
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        async def watch() -> None:
            # Once the body is read, the server's next message can only be http.disconnect: when
            # it comes before the response is complete, the client has gone. (The SDK answers a
            # JSON-mode request only when the tool ends, and reads nothing more meanwhile.)
            await body_done.wait()
            if (await receive())["type"] == "http.disconnect" and not state["complete"]:
                gone.set()

        async with anyio.create_task_group() as group:
            group.start_soon(watch)
            try:
                await manager.handle_request(scope, receive_marked, send_marked)
            finally:
                if not state["complete"]:
                    gone.set()
                group.cancel_scope.cancel()
        if scope.get("method") == "DELETE":
            session = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"mcp-session-id"), None)
            if session is not None:
                self.json_sessions.pop(session, None)

    def _remember(self, headers: list[tuple[bytes, bytes]]) -> None:
        for key, value in headers:
            if key.lower() == b"mcp-session-id":
                self.json_sessions[value.decode("latin-1")] = None
                while len(self.json_sessions) > JSON_SESSIONS_KEPT:
                    self.json_sessions.popitem(last=False)


def _within_budget(tool: str, result: Any) -> Any:
    """A safety net under every tool: a structured result whose text exceeds RESULT_CHARS_MAX is
    sent with its texts cut (``fit``). Tools that can grow page themselves; this only catches a
    result nobody foresaw, and logs it."""
    structured = getattr(result, "structured_content", None)
    if getattr(result, "is_error", False) or not isinstance(structured, dict):
        return result
    size = sum(len(getattr(block, "text", "") or "") for block in result.content)
    if size <= RESULT_CHARS_MAX:
        return result
    log.warning("tool %s returned %d characters; its texts were cut to fit %d", tool, size, RESULT_CHARS_MAX)
    fitted, _ = fit(structured)
    text = pydantic_core.to_json(fitted, fallback=str, indent=2).decode()
    return result.model_copy(update={"structured_content": fitted,
                                     "content": [TextContent(type="text", text=text)]})


class ShownAnswer(CallToolResult):
    """A tool's answer built once by ``answer``: its structured content redacted and held to
    RESULT_CHARS_MAX, its one text block the JSON of that same content. TranslatingServer passes
    it on as it is (the general path would redact and measure it again)."""


def answer(tool: str, value: Any) -> ShownAnswer:
    """``value`` (a tool function's structured result, a dict) as the answer a client gets: every
    text redacted (``task_views.shown``), its longest texts cut when its JSON text would pass
    RESULT_CHARS_MAX characters (``fit``, logged), and the text content written once from the
    same content, as MCPServer writes it (indented JSON). The SDK then checks the structured
    content against the tool's output model and sends it without dumping or writing it again."""
    shown = task_views.shown(value)
    text = pydantic_core.to_json(shown, fallback=str, indent=2).decode()
    if len(text) > RESULT_CHARS_MAX:
        log.warning("tool %s returned %d characters; its texts were cut to fit %d", tool, len(text),
                    RESULT_CHARS_MAX)
        shown, _ = fit(shown)
        text = pydantic_core.to_json(shown, fallback=str, indent=2).decode()
    return ShownAnswer(content=[TextContent(type="text", text=text)], structured_content=shown)


def answering(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a tool function returning a TypedDict) as a tool returning its ``answer``, with the
    same name, docstring, parameters and output schema (its return annotated ``Annotated[
    CallToolResult, TheTypedDict]``, the SDK's form for a tool that builds its own result: the
    SDK validates the structured content once and neither dumps it again nor writes a second
    text). A function returning anything else is returned unchanged."""
    hints = typing.get_type_hints(fn, include_extras=True)
    returned = hints.get("return")
    if not is_typeddict(returned):
        return fn
    name = fn.__name__
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def tool(*args: Any, **kwargs: Any) -> Any:
            return answer(name, await fn(*args, **kwargs))
    else:
        @functools.wraps(fn)
        def tool(*args: Any, **kwargs: Any) -> Any:
            return answer(name, fn(*args, **kwargs))
    final = Annotated[CallToolResult, returned]
    tool.__signature__ = inspect.signature(fn, eval_str=True).replace(return_annotation=final)  # type: ignore[attr-defined]
    tool.__annotations__ = hints | {"return": final}
    return tool


class ToolRegistry:
    """Collects the tool functions as the module is read; no server exists until build_server().
    ``tool(hints(...), title="…")`` is the only way in: a tool without all four behaviour hints,
    or without a title (what clients show a person instead of the tool's name), stops the module
    from loading, so no tool reaches a client unannotated."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, ToolAnnotations, str]] = []

    def tool(self, annotations: ToolAnnotations | None = None, title: str | None = None) -> Any:
        """Decorator collecting a tool: ``annotations`` from ``hints()``, ``title`` a short
        human label (≤ 60 characters). Raises TypeError when either is missing."""
        missing = [h for h in HINT_NAMES if annotations is None or getattr(annotations, h) is None]
        if missing or annotations is None:   # None leaves every hint missing
            raise TypeError(f"every tool states all four behaviour hints: use @registry.tool(mcp_shared.hints("
                            f"read_only=…, destructive=…, idempotent=…, open_world=…)); missing {', '.join(missing)}")
        if not (title or "").strip() or len(title or "") > 60:
            raise TypeError("every tool has a title of 1 to 60 characters: "
                            "@registry.tool(hints, title=\"Show a task\")")


        def mark(fn: Any) -> Any:
            self.entries.append((fn, annotations, title or ""))
            return fn
        return mark

    def install(self, server: MCPServer, meta: dict[str, dict[str, Any]] | None = None) -> MCPServer:
        """Register every collected tool on ``server``; returns it. The title goes both on the
        tool (2025-06-18 and later) and in its annotations (what older clients read); ``meta``
        maps a tool name to its ``_meta`` (e.g. an MCP Apps ``ui.resourceUri``)."""
        for fn, hinted, title in self.entries:
            server.tool(title=title, annotations=hinted.model_copy(update={"title": title}),
                        meta=(meta or {}).get(fn.__name__))(answering(fn))
        return server


# --------------------------------------------------------------------------------------------
# Result sizes. Claude Code keeps a tool result above ~50,000 characters out of the model's
# context (it saves it to a file and shows a preview); OpenCode cuts MCP output near 50 KB. The
# SDK sends a result twice (structured, and as indented JSON text): the text is the larger.

RESULT_CHARS_MAX = 40_000
TEXT_FLOOR = 40                 # fit() never cuts a text shorter than this before it shortens lists


def result_chars(value: Any) -> int:
    """Characters of the text content the SDK makes of ``value`` (indented JSON, as MCPServer writes it)."""
    return len(pydantic_core.to_json(value, fallback=str, indent=2))


def _longest(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return max((_longest(v) for v in value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return max((_longest(v) for v in value), default=0)
    return 0


def _cut_strings(value: Any, limit: int, skip: frozenset[str] = frozenset()) -> Any:
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}… [{len(value) - limit} more characters cut]"
    if isinstance(value, dict):
        return {k: v if k in skip else _cut_strings(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut_strings(v, limit) for v in value]
    return value


def _cut_lists(value: Any, items: int) -> Any:
    if isinstance(value, dict):
        return {k: _cut_lists(v, items) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut_lists(v, items) for v in value[:items]]
    return value


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """The largest n in 0..high with fits(n) (fits is monotonic), 0 when none."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def fit(value: Any, budget: int = RESULT_CHARS_MAX, skip: tuple[str, ...] = ()) -> tuple[Any, bool]:
    """``value`` with its longest texts cut (each to the same length, as long as the budget
    allows, marked ``… [N more characters cut]``) so that ``result_chars`` of it is at most
    ``budget``; top-level keys in ``skip`` are left whole. Returns (value, whether anything was
    cut). Only when texts cut to TEXT_FLOOR characters still do not fit are lists shortened (a last
    resort: a tool whose item count can exceed the budget pages instead, see ``fit_page``)."""
    if result_chars(value) <= budget:
        return value, False
    frozen = frozenset(skip)
    limit = _largest(lambda n: result_chars(_cut_strings(value, n, frozen)) <= budget, _longest(value))
    if limit >= TEXT_FLOOR:
        return _cut_strings(value, limit, frozen), True
    value = _cut_strings(value, TEXT_FLOOR, frozen)
    items = _largest(lambda n: result_chars(_cut_lists(value, n)) <= budget, 100_000)
    return _cut_lists(value, items), True


def fit_page(build: Callable[[int], Any], limit: int, budget: int = RESULT_CHARS_MAX) -> Any:
    """``build(limit)`` (a page of at most ``limit`` bytes, rows or characters), with ``limit``
    lowered until ``result_chars`` of the page is at most ``budget``. The page's own next offset
    then continues exactly where the smaller page ended."""
    page = build(limit)
    while (size := result_chars(page)) > budget and limit > 1:
        limit = max(1, min(limit - 1, int(limit * budget / size * 0.95)))
        page = build(limit)
    return page
