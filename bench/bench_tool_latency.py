"""A TaskBridge tool call's latency against a bare MCPServer tool on the same machine.

    .venv/bin/python bench/bench_tool_latency.py [CALLS]     # default 300 calls per tool, ~20 s
    .venv/bin/python bench/bench_tool_latency.py --against REV [--rounds N] [--split]

Two servers answer side by side, in memory (SDK client, handshake protocol) and over
streamable-http on 127.0.0.1 (uvicorn in a thread): a bare `MCPServer` whose only tool `ping`
returns {"ok": true}, and TaskBridge (`ping`: reads the queue and the worker heartbeat;
`get_task`: one task with notes and events; `list_tasks`: a page of 50 from 500 tasks). Calls
are interleaved in rounds so both see the same machine noise. Prints median and p95 per tool
and the ratio of medians to the bare ping.

``--against REV``: this tree's tools against those of git revision REV (exported to a temporary
folder), in memory: two processes, one per tree, each with its own bare server and queue, taking
rounds in turn (which goes first alternates), so before and after see the same machine; the bare
server also answers `page`, the same 50 rows as `list_tasks` returned as a constant (what the SDK
alone costs for that page). Each tool is called with the SDK client's output-schema check and
without it (the server's own cost; the check is the client's). ``--split`` also times the
layers of each call in each tree: the tool function, the SDK's server side around it (argument
validation, the worker thread, the result's conversion, the wire dump), TaskBridge's server
wrapper, the client's check.
Reads no env of its own.
"""
from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from typing_extensions import TypedDict

ROOT = Path(__file__).resolve().parent.parent
if "--child" not in sys.argv:            # a child puts the tree it measures first instead
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CASES = [("bare", "ping", {}), ("taskbridge", "ping", {}), ("taskbridge", "get_task", {"task_id": "t_0001"}),
         ("taskbridge", "list_tasks", {"limit": 50})]
AB_TOOLS = ("get_task", "list_tasks", "queue_status", "submit_task")


class Pong(TypedDict):
    ok: bool


def bare_server():
    from mcp.server.mcpserver import MCPServer

    bare = MCPServer("bare")

    @bare.tool()
    def ping() -> Pong:
        """Answer at once."""
        return {"ok": True}
    return bare


def seed(workdir: str) -> None:
    import task_store
    for start in range(0, 500, 20):
        task_store.submit_batch([{"title": f"task {start + i}", "instructions": "x", "working_dir": workdir}
                                 for i in range(20)])
    task_store.add_note("t_0001", "a note")


async def measure(clients: dict, calls: int) -> dict[tuple[str, str], list[float]]:
    times: dict[tuple[str, str], list[float]] = {(s, t): [] for s, t, _ in CASES}
    for _ in range(calls):
        for server, tool, args in CASES:
            started = time.perf_counter()
            result = await clients[server].call_tool(tool, args)
            times[(server, tool)].append(time.perf_counter() - started)
            assert not result.is_error, result
    return times


def report(title: str, times: dict[tuple[str, str], list[float]]) -> None:
    base = statistics.median(times[("bare", "ping")])
    print(title)
    for (server, tool), values in times.items():
        median = statistics.median(values)
        p95 = sorted(values)[int(0.95 * (len(values) - 1))]
        print(f"  {server:10} {tool:10} median {median * 1000:6.2f} ms   p95 {p95 * 1000:6.2f} ms   "
              f"x{median / base:4.1f} of the bare ping")


async def main(calls: int) -> None:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    import opencode_bridge_mcp as bridge
    from helpers import serving  # tests/helpers.py: the app under uvicorn in a thread

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update({"TASK_DB_PATH": f"{tmp}/q/tasks.db", "TASK_LOG_DIR": f"{tmp}/q/logs",
                           "MCP_TOKEN_FILE": f"{tmp}/none"})
        os.environ.pop("MCP_BEARER_TOKEN", None)
        seed(tmp)
        async with Client(bare_server(), mode="legacy") as bare, \
                Client(bridge.build_server(), mode="legacy") as ours:
            report(f"in memory, {calls} calls each:", await measure({"bare": bare, "taskbridge": ours}, calls))
        bare_app = bare_server().streamable_http_app()
        with serving(app=bare_app) as bare_base, serving() as our_base:
            async with Client(streamable_http_client(f"{bare_base}/mcp", http_client=httpx2.AsyncClient()),
                              mode="legacy") as bare, \
                    Client(streamable_http_client(f"{our_base}/mcp", http_client=httpx2.AsyncClient()),
                           mode="legacy") as ours:
                report(f"streamable-http on 127.0.0.1, {calls // 2} calls each:",
                       await measure({"bare": bare, "taskbridge": ours}, calls // 2))


# --------------------------------------------------------------------------------------------
# Before and after: two trees in two processes, rounds in turn.


def ab_cases(workdir: str) -> list[tuple[str, str, dict[str, Any]]]:
    args = {"get_task": {"task_id": "t_0001"}, "list_tasks": {"limit": 50}, "queue_status": {},
            "submit_task": {"title": "b", "instructions": "x", "working_dir": workdir}}
    return [("bare", "ping", {}), ("bare", "page", {})] + [("ours", tool, args[tool]) for tool in AB_TOOLS]


def add_constant_page(bare: Any) -> None:
    """A tool ``page`` on the bare server returning, as a constant, the page of 50 rows that
    ``list_tasks`` answers, with the same output model: what the SDK alone costs for that page
    (no store, no TaskBridge wrapper)."""
    import typing

    import opencode_bridge_mcp as bridge
    rows = bridge.list_tasks(limit=50)

    def page() -> Any:
        """The same 50 rows every time."""
        return rows
    page.__annotations__ = {"return": typing.get_type_hints(bridge.list_tasks)["return"]}
    bare.tool()(page)


def _timed(layers: dict[str, float], key: str, fn: Any) -> Any:
    """``fn`` (sync or async) adding its run time to ``layers[key]``: a measuring shim, in this
    process only."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                layers[key] += time.perf_counter() - started
        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            layers[key] += time.perf_counter() - started
    return timed


def _split_layers(layers: dict[str, float]) -> None:
    """Time the SDK's layers of a call (before any server is built: a server binds its handlers)."""
    from mcp.client.session import ClientSession
    from mcp.server import runner
    from mcp.server.mcpserver import MCPServer
    ClientSession.validate_tool_result = _timed(layers, "client check", ClientSession.validate_tool_result)
    MCPServer._handle_call_tool = _timed(layers, "server handler", MCPServer._handle_call_tool)
    MCPServer.call_tool = _timed(layers, "SDK call_tool", MCPServer.call_tool)
    runner.ServerRunner._serialize = _timed(layers, "wire dump", runner.ServerRunner._serialize)


def _split_tools(layers: dict[str, float], servers: list[Any]) -> None:
    for server in servers:
        for tool in server._tool_manager.list_tools():
            tool.fn = _timed(layers, "tool function", tool.fn)


async def child(split: bool) -> None:
    """One side of --against: serve rounds on request ("go" on stdin; one JSON line of timings out)."""
    from mcp import Client
    from mcp.client.session import ClientSession

    import opencode_bridge_mcp as bridge
    logging.getLogger("taskbridge").setLevel(logging.ERROR)
    folder = Path(tempfile.mkdtemp())
    os.environ.update({"TASK_DB_PATH": f"{folder}/q/tasks.db", "TASK_LOG_DIR": f"{folder}/q/logs",
                       "MCP_TOKEN_FILE": f"{folder}/none"})
    os.environ.pop("MCP_BEARER_TOKEN", None)
    (folder / "work").mkdir()
    seed(str(folder / "work"))
    cases = ab_cases(str(folder / "work"))
    layers: dict[str, float] = collections.defaultdict(float)
    if split:
        _split_layers(layers)
    check = ClientSession.validate_tool_result

    async def unchecked(_self: Any, _name: str, _result: Any) -> None:
        return None
    servers = [bare_server(), bridge.build_server()]
    add_constant_page(servers[0])
    if split:
        _split_tools(layers, servers)
    async with Client(servers[0], mode="legacy") as bare, Client(servers[1], mode="legacy") as ours:
        clients = {"bare": bare, "ours": ours}
        while sys.stdin.readline().strip() == "go":
            out: dict[str, Any] = {}
            for checked in (True, False):
                ClientSession.validate_tool_result = check if checked else unchecked
                for side, tool, args in cases:
                    layers.clear()
                    started = time.perf_counter()
                    result = await clients[side].call_tool(tool, args)
                    took = time.perf_counter() - started
                    assert not result.is_error, result
                    out[f"{tool}{'' if checked else '/unchecked'}"] = {"total": took, **layers}
                    if tool == "submit_task":    # its commit wakes the session's channel watcher:
                        await anyio.sleep(0.02)  # let that settle before the next call is timed
            print(json.dumps(out), flush=True)


def export(rev: str, into: Path) -> Path:
    """The tree of git revision ``rev`` written under ``into`` (with this tree's .venv linked)."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    (tree / ".venv").symlink_to((ROOT / ".venv").resolve())
    return tree


def against(rev: str, rounds: int, split: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": export(rev, Path(tmp)), "after": ROOT}
        flags = ["--split"] if split else []
        procs = {side: subprocess.Popen([sys.executable, __file__, "--child", str(tree), *flags],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(tree))
                 for side, tree in trees.items()}
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in procs}
        try:
            for round_ in range(rounds + 5):
                order = list(procs) if round_ % 2 else list(reversed(procs))
                for side in order:
                    procs[side].stdin.write("go\n")
                    procs[side].stdin.flush()
                    line = procs[side].stdout.readline()
                    if round_ >= 5:          # the first rounds warm caches and are not counted
                        runs[side].append(json.loads(line))
        finally:
            for proc in procs.values():
                proc.stdin.close()
                proc.wait(timeout=30)
    ab_report(rev, runs, split)


def ab_report(rev: str, runs: dict[str, list[dict[str, Any]]], split: bool) -> None:
    def med(side: str, key: str, layer: str = "total") -> float:
        return statistics.median(r[key].get(layer, 0.0) for r in runs[side])
    print(f"{len(runs['after'])} rounds; medians in ms; × = over the same process's bare ping")
    print(f"{'call':32} {'before ' + rev[:10]:>22} {'after':>22}")
    for suffix, label in (("", "with the client's check"), ("/unchecked", "client's check off")):
        for tool in AB_TOOLS:
            key = tool + suffix
            cells = [f"{med(s, key) * 1000:8.2f} ({med(s, key) / med(s, 'ping' + suffix):5.2f}×)" for s in runs]
            print(f"{tool + ', ' + label:32} {cells[0]:>22} {cells[1]:>22}")
        for ref, name in (("ping", "bare ping"), ("page", "bare constant page")):
            cells = [f"{med(s, ref + suffix) * 1000:8.2f} ({med(s, ref + suffix) / med(s, 'ping' + suffix):5.2f}×)"
                     for s in runs]
            print(f"{name + ', ' + label:32} {cells[0]:>22} {cells[1]:>22}")
    if split:
        layers = ("tool function", "SDK call_tool", "server handler", "wire dump", "client check")
        print("\nlayers (client's check on), medians in ms: " + ", ".join(layers))
        for side in runs:
            for tool in ("ping", "page", *AB_TOOLS):
                print(f"  {side:6} {tool:13}" + "".join(f"{med(side, tool, layer) * 1000:9.3f}" for layer in layers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", nargs="?", type=int, default=300, help="calls per tool (default 300)")
    parser.add_argument("--against", metavar="REV", help="compare with the tools of git revision REV, in memory")
    parser.add_argument("--rounds", type=int, default=200, help="rounds of --against (default 200)")
    parser.add_argument("--split", action="store_true", help="with --against: time each call's layers")
    parser.add_argument("--child", metavar="TREE", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        sys.path[:0] = [options.child, str(Path(options.child) / "tests")]
        anyio.run(child, options.split)
    elif options.against:
        against(options.against, options.rounds, options.split)
    else:
        anyio.run(main, options.calls)
