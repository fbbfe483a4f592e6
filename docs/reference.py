"""The generated parts of docs/*.md, written into the files by cog (cogapp) between their
``[[[cog`` and ``[[[end]]]`` markers: the CLI's help, the numeric knobs' ranges, the MCP tools'
titles, descriptions and parameters (from the servers' own tool listings), the HTTP routes and
the HTTP side's limits.

    .venv/bin/cog -r docs/*.md         # regenerate after changing a command, knob, tool or route
    .venv/bin/cog --check docs/*.md    # what tests/test_docs.py runs: fails when a file is stale

Env: none (the servers are built, never started; no queue is opened). Used by cog, not run on its own.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _import(name: str) -> Any:
    """A project module by name (cog restores sys.path after each block, so add the root each time)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


def _cell(text: Any) -> str:
    """``text`` fit for one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def cli_help() -> str:
    """Every ``tasks_cli.py`` command's ``--help``, as click prints it (80 columns)."""
    from click.testing import CliRunner

    tasks_cli = _import("tasks_cli")
    parts = []
    for name in sorted(tasks_cli.cli.commands):
        command = tasks_cli.cli.commands[name]
        groups = [[name, sub] for sub in sorted(getattr(command, "commands", {}))] or [[name]]
        for argv in groups if len(groups) == 1 else [[name], *groups]:
            shown = CliRunner().invoke(tasks_cli.cli, [*argv, "--help"], terminal_width=80,
                                       prog_name="tasks_cli.py").output.rstrip()
            parts.append(f"### `{' '.join(argv)}`\n\n```\n{shown}\n```\n")
    return "\n".join(parts)


def knob_ranges() -> str:
    """The numeric knobs (knobs.REGISTRY) as a table: kind, default, accepted range."""
    knobs = _import("knobs")
    rows = ["| variable | kind | default | lowest | highest |", "|---|---|---|---|---|"]
    for name, (kind, default, lo, hi) in sorted(knobs.REGISTRY.items()):
        shown = [f"{kind(v):g}" if kind is float else str(kind(v)) for v in (default, lo, hi)]
        rows.append(f"| `{name}` | {kind.__name__} | {' | '.join(shown)} |")
    return "\n".join(rows)


def _bounds(schema: dict) -> str:
    marks = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"),
             ("minLength", "length ≥"), ("maxLength", "length ≤"), ("maxItems", "items ≤"))
    return ", ".join(f"{sign} {schema[key]}" for key, sign in marks if key in schema)


def _kind(schema: dict) -> str:
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_kind(s) for s in schema["anyOf"] if s.get("type") != "null")
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = " or ".join(k for k in kind if k != "null")
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"list of {_kind(schema['items'])}"
    return str(kind)


def _tool_section(tool: Any) -> str:
    schema = tool.input_schema
    required = set(schema.get("required", []))
    head = f"### `{tool.name}`" + (f" — {tool.title}" if tool.title else "")
    rows = ["| parameter | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        default = "required" if name in required else f"`{json.dumps(prop.get('default'))}`"
        described = _cell(prop.get("description", ""))
        rows.append(f"| `{name}` | {_kind(prop)} | {default} | {_bounds(prop)} | {described} |")
    body = [head, "", inspect.cleandoc(tool.description or ""), ""]
    if len(rows) > 2:
        body += rows
    else:
        body.append("No parameters.")
    return "\n".join(body) + "\n"


def mcp_tools(module_name: str) -> str:
    """One section per MCP tool of ``module_name``'s server (its ``build_server()``), in the order
    the server lists them: the title, the description the planner reads, the parameters."""
    module = _import(module_name)
    tools = asyncio.run(module.build_server().list_tools())
    return "\n".join(_tool_section(tool) for tool in tools)


def http_routes() -> str:
    """The HTTP routes beside the MCP transports (http_app.http_routes and the OAuth routes), a
    row each: methods, path, and the first line of its handler's docstring."""
    import tempfile

    http_app, oauth = _import("http_app"), _import("oauth")
    rows = ["| methods | path | token | what |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        provider = oauth.Provider("x", "https://taskbridge.example", Path(folder) / "oauth.json")
        shown = [(route, "yes" if route.path.startswith("/api/") else "no") for route in http_app.http_routes()]
        shown += [(route, "no (public mode only)") for route in oauth.routes(provider)]
    for route, token in shown:
        methods = ", ".join(sorted(set(getattr(route, "methods", None) or ["any"]) - {"HEAD"}))
        doc = re.sub(r"^``[A-Z]+ [^`]*``: ", "", (inspect.getdoc(route.endpoint) or "").split("\n\n")[0])
        rows.append(f"| {methods} | `{route.path}` | {token} | {_cell(doc)} |")
    return "\n".join(rows)


def _size(count: int) -> str:
    """A byte count as the refusals give it, with its binary unit when it has one."""
    unit = next(((count >> shift, name) for shift, name in ((20, "MiB"), (10, "KiB")) if count % (1 << shift) == 0),
                None)
    return f"{unit[0]} {unit[1]} ({count} bytes)" if unit else f"{count} bytes"


def http_limits() -> str:
    """The HTTP side's limits, a row each, from the constants the code enforces (http_app and
    board_api): what is limited, the figure, the answer past it, the constant."""
    http_app, board_api = _import("http_app"), _import("board_api")
    rows = [
        ("request head (request line and headers), whole or in pieces", _size(http_app.MAX_HEAD_BYTES), "431",
         "http_app.MAX_HEAD_BYTES"),
        ("time to send a request head, from connecting or the previous answer", f"{http_app.REQUEST_HEAD_SEC:g} s",
         "closed", "http_app.REQUEST_HEAD_SEC"),
        ("idle time between requests on one connection", f"{http_app.KEEP_ALIVE_SEC:g} s", "closed",
         "http_app.KEEP_ALIVE_SEC"),
        ("open connections (a request while all are open: 503)", str(http_app.MAX_CONNECTIONS),
         "new ones closed", "http_app.MAX_CONNECTIONS"),
        ("open connections from one address beyond this machine", str(http_app.MAX_PEER_CONNECTIONS),
         "new ones closed", "http_app.MAX_PEER_CONNECTIONS"),
        ("requests in progress from one client address", str(http_app.MAX_PEER_REQUESTS), "429",
         "http_app.MAX_PEER_REQUESTS"),
        ("time to send a request body whole, from its head", f"{http_app.BODY_SEC:g} s", "408",
         "http_app.BODY_SEC"),
        ("request body to `/mcp`, `/sse`, `/messages/` (one MCP message)", _size(http_app.MAX_BODY_BYTES), "413",
         "http_app.MAX_BODY_BYTES"),
        ("request body to `/api/*`", _size(board_api.BODY_MAX), "413", "board_api.BODY_MAX"),
        ("request body to the open routes (OAuth, consent)", _size(http_app.MAX_OAUTH_BODY_BYTES), "413",
         "http_app.MAX_OAUTH_BODY_BYTES"),
    ]
    lines = ["| what | at most | past it | constant |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {what} | {figure} | {answer} | `{name}` |" for what, figure, answer, name in rows])
