"""The board's API with 10,000 tasks in the queue: latency of what an open page calls.

    .venv/bin/python bench/bench_board.py [CALLS]      # default 200 calls per route, ~1 min

A fresh queue in a temporary folder gets 10,000 tasks (a tenth done with a receipt, a diff and
usage; some failed, waiting, running; three callers), then the real server process
(`opencode_bridge_mcp.py --transport streamable-http`) answers on 127.0.0.1 and a client with
the bearer token calls, interleaved in rounds: /api/status, /api/tasks (first page of 50), a
filtered page (status=done&origin=claude, 50 rows), the page after it by cursor, a title search,
and a task page's call (/api/tasks/t_5000, with notes, events and a diff). Prints median and p95
in milliseconds per route.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]
TASKS = 10_000
TOKEN = "bench-token"


def seed(workdir: str) -> None:
    import task_store
    callers = ["claude-ai", "openai-mcp", "tasks_cli"]
    diff = "diff --git a/app.py b/app.py\n--- a/app.py\n+++ b/app.py\n@@ -1,3 +1,4 @@\n" + \
        "".join(f"+line {i}\n-old {i}\n" for i in range(40))
    for start in range(0, TASKS, 20):
        task_store.submit_batch([{"title": f"task {start + i} refactor module {(start + i) % 97}",
                                  "instructions": "Refactor the module and run the tests.\n" * 20,
                                  "working_dir": workdir, "origin_name": callers[(start + i) % 3]}
                                 for i in range(20)])
    for num in range(1, TASKS + 1, 10):
        claimed = task_store.claim_next("bench", task_id=num)
        if num % 30 == 1:
            task_store.fail_attempt(num, claimed["run_marker"], "model error: quota", retryable=False)
        elif num % 50 == 11:
            task_store.pause_for_question(num, claimed["run_marker"], "Which port?")
        else:
            task_store.complete_attempt(num, claimed["run_marker"], diff=diff,
                                        result={"summary": "done", "files_touched": ["app.py"]},
                                        usage={"cost_usd": 0.0123, "tokens": {"input": 1200, "output": 300}})
    task_store.claim_next("bench", task_id=5002)
    for n in range(5):
        task_store.add_note(5000, f"note {n}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    import httpx2
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    folder = tempfile.mkdtemp(prefix="taskbridge-bench-board-")
    os.environ.update(TASK_DB_PATH=f"{folder}/tasks.db", TASK_LOG_DIR=f"{folder}/logs", WORKER_NOTIFY="0",
                      MCP_BEARER_TOKEN=TOKEN)
    started = time.monotonic()
    seed(folder)
    print(f"seeded {TASKS} tasks in {time.monotonic() - started:.1f} s")
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "opencode_bridge_mcp.py"), "--transport",
                               "streamable-http", "--port", str(port), "--log-level", "WARNING"],
                              stdin=subprocess.DEVNULL, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        client = httpx2.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        for _ in range(300):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        cursor = client.get("/api/tasks?status=done&origin=claude&limit=50").json()["next_cursor"]
        routes = {
            "/api/status": "/api/status",
            "/api/tasks (first page)": "/api/tasks?limit=50",
            "/api/tasks (status=done, caller)": "/api/tasks?status=done&origin=claude&limit=50",
            "/api/tasks (next page, cursor)": f"/api/tasks?status=done&origin=claude&limit=50&cursor={cursor}",
            "/api/tasks (title search)": "/api/tasks?search=module%2042&limit=50",
            "/api/tasks/t_5000 (task page)": "/api/tasks/t_5000",
        }
        times: dict[str, list[float]] = {name: [] for name in routes}
        for path in routes.values():                           # warm up, and check the answer
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text)
        for _ in range(calls):
            for name, path in routes.items():
                t0 = time.perf_counter()
                answer = client.get(path)
                times[name].append((time.perf_counter() - t0) * 1000)
                assert answer.status_code == 200
        print(f"{calls} calls each, {TASKS} tasks, over HTTP on 127.0.0.1 (ms):")
        print(f"{'route':40} {'median':>8} {'p95':>8}")
        for name, values in times.items():
            values.sort()
            print(f"{name:40} {statistics.median(values):8.2f} {values[int(len(values) * 0.95) - 1]:8.2f}")
        status = client.get("/api/status").json()
        print("tallies:", json.dumps(status["counts"]))
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
