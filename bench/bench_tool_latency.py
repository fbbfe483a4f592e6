"""A TaskBridge tool call's latency against a bare MCPServer tool on the same machine.

    .venv/bin/python bench/bench_tool_latency.py [CALLS]     # default 300 calls per tool, ~20 s

Two servers answer side by side, in memory (SDK client, handshake protocol) and over
streamable-http on 127.0.0.1 (uvicorn in a thread): a bare `MCPServer` whose only tool `ping`
returns {"ok": true}, and TaskBridge (`ping`: reads the queue and the worker heartbeat;
`get_task`: one task with notes and events; `list_tasks`: a page of 50 from 500 tasks). Calls
are interleaved in rounds so both see the same machine noise. Prints median and p95 per tool
and the ratio of medians to the bare ping.
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from typing_extensions import TypedDict

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CASES = [("bare", "ping", {}), ("taskbridge", "ping", {}), ("taskbridge", "get_task", {"task_id": "t_0001"}),
         ("taskbridge", "list_tasks", {"limit": 50})]


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


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 300)
