"""How long `wait_for` takes to wake after a task finishes, against a client polling every 4 s.

    .venv/bin/python bench/bench_wait_for.py [ROUNDS]       # default 12 rounds, ~30 s

Each round, on a fresh temporary queue: submit a task over MCP (in-memory SDK client, handshake
protocol), then side by side
  - a `wait_for([id])` call that blocks in the server, and
  - a client-side poller calling `get_task` every 4 s (starting at a random phase, as a planner's
    polling would be relative to a task's end),
while a thread finishes the task (claim + complete in the store) after a random 0.2–1.0 s. Each
side's latency is the time from the store commit to the moment it saw `done`. Prints median and
p95 of both and their ratio. MCP_WAIT_POLL_SEC (default 0.2) sets wait_for's events-log poll.
"""
from __future__ import annotations

import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

POLL_EVERY_SEC = 4.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def finish_after(task_id: str, delay: float, stamp: dict) -> threading.Thread:
    import task_store

    def run() -> None:
        time.sleep(delay)
        claimed = task_store.claim_next("bench", task_id=task_id)
        task_store.complete_attempt(task_id, claimed["run_marker"], result={"summary": "bench"})
        stamp["done"] = time.perf_counter()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


async def one_round(client, workdir: str, rng: random.Random) -> tuple[float, float]:
    sent = await client.call_tool("submit_task", {"title": "bench", "instructions": "x", "working_dir": workdir})
    task_id = sent.structured_content["id"]
    stamp: dict[str, float] = {}
    seen: dict[str, float] = {}

    async def waiter() -> None:
        result = await client.call_tool("wait_for", {"task_ids": [task_id], "timeout_sec": 60})
        assert result.structured_content["met"], result
        seen["wait_for"] = time.perf_counter()

    async def poller() -> None:
        await anyio.sleep(rng.uniform(0, POLL_EVERY_SEC))
        while True:
            got = await client.call_tool("get_task", {"task_id": task_id})
            if got.structured_content["status"] == "done":
                seen["poll"] = time.perf_counter()
                return
            await anyio.sleep(POLL_EVERY_SEC)

    thread = finish_after(task_id, rng.uniform(0.2, 1.0), stamp)
    async with anyio.create_task_group() as group:
        group.start_soon(waiter)
        group.start_soon(poller)
    thread.join()
    return seen["wait_for"] - stamp["done"], seen["poll"] - stamp["done"]


async def main(rounds: int) -> None:
    from mcp import Client

    import opencode_bridge_mcp as bridge

    logging.basicConfig(level=logging.WARNING)
    rng = random.Random(7)
    waits, polls = [], []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TASK_DB_PATH"] = f"{tmp}/q/tasks.db"
        os.environ["TASK_LOG_DIR"] = f"{tmp}/q/logs"
        async with Client(bridge.build_server(), mode="legacy") as client:
            for _ in range(rounds):
                wake, poll = await one_round(client, tmp, rng)
                waits.append(wake)
                polls.append(poll)
    poll_sec = os.environ.get("MCP_WAIT_POLL_SEC") or "0.2"
    print(f"wait_for wake-up after a task finishes ({rounds} rounds, events-log poll {poll_sec} s):")
    print(f"  wait_for (server-side)   median {statistics.median(waits) * 1000:7.0f} ms   "
          f"p95 {percentile(waits, 0.95) * 1000:7.0f} ms")
    print(f"  client polling every 4 s median {statistics.median(polls) * 1000:7.0f} ms   "
          f"p95 {percentile(polls, 0.95) * 1000:7.0f} ms")
    print(f"  ratio (polling / wait_for): median {statistics.median(polls) / statistics.median(waits):.1f}x, "
          f"p95 {percentile(polls, 0.95) / percentile(waits, 0.95):.1f}x")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 12)
