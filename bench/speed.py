"""Every speed figure of issue 12 against its reference, measured in one run: `bench/run`.

    bench/run [--quick]          # ~6 min on a 2-core machine (--quick: fewer trials, ~2 min)

Each row is a median and p95 over repeated trials, with the reference measured in the same run,
interleaved trial by trial where the two can run side by side, so both see the same machine noise.
Prints one Markdown table (paste it into the README with the date and the machine) and exits 0.
Needs ./install.sh --test (the pinned opencode; the scripted model from tests/ stands in for the
provider). Runs everything in a temporary folder; reads no env of its own.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
ROWS: list[dict[str, Any]] = []
PARTS = ("real", "box", "cycles", "wake", "tools", "scale", "rss", "workers")


def pct(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def med(values: list[float]) -> float:
    return statistics.median(values)


def add(figure: str, ours: list[float] | None, ref: list[float] | None, ref_name: str, target: str,
        met: Callable[[float, float, float], bool] | None, unit: str = "ms", note: str = "") -> None:
    """One table row; ``met(ours_median, ours_p95, ratio)`` judges the target."""
    row = {"figure": figure, "ref_name": ref_name, "target": target, "unit": unit, "note": note}
    if ours:
        row |= {"ours": (med(ours), pct(ours, 0.95))}
    if ref:
        row |= {"ref": (med(ref), pct(ref, 0.95))}
    if ours and ref:
        row["ratio"] = med(ours) / med(ref)
    if ours and met:
        row["met"] = met(med(ours), pct(ours, 0.95), row.get("ratio", 0.0))
    ROWS.append(row)
    print(f"  measured: {figure}", file=sys.stderr, flush=True)


def fmt(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value * 1000:,.1f} ms" if value < 10 else f"{value:,.1f} s"
    if unit == "/s":
        return f"{value:,.0f}/s"
    if unit == "MB":
        return f"{value / 2**20:,.1f} MB"
    return f"{value:,.2f} {unit}"


def table() -> str:
    lines = ["| figure | ours: median / p95 | reference | reference: median / p95 | ratio | target | met |",
             "|---|---|---|---|---|---|---|"]
    for row in ROWS:
        ours = " / ".join(fmt(v, row["unit"]) for v in row["ours"]) if "ours" in row else "—"
        ref = " / ".join(fmt(v, row["unit"]) for v in row["ref"]) if "ref" in row else "—"
        ratio = f"{row['ratio']:.2f}×" if "ratio" in row else "—"
        met = {True: "yes", False: "**no**"}.get(row.get("met"), "—")
        note = f" ({row['note']})" if row["note"] else ""
        lines.append(f"| {row['figure']}{note} | {ours} | {row['ref_name']} | {ref} | {ratio} "
                     f"| {row['target']} | {met} |")
    return "\n".join(lines)


def use_queue(folder: Path) -> Path:
    """Point the queue at ``folder``; returns a project folder beside it for the tasks' working_dir
    (the queue's own folder is refused as one)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TASK_DB_PATH"] = str(folder / "tasks.db")
    os.environ["TASK_LOG_DIR"] = str(folder / "logs")
    (folder / "work").mkdir(exist_ok=True)
    return folder / "work"


# --------------------------------------------------------------------------------------------
# Store throughput: submit -> claim -> finish at 1, 4 and 16 processes, against huey's SqliteHuey
# storage and the same writes done raw (bench_sqlite_cycle.py), trials interleaved.


def store_throughput(quick: bool) -> None:
    import bench_sqlite_cycle
    counts = bench_sqlite_cycle.PROCS
    result = bench_sqlite_cycle.measure(counts, 150 if quick else 400, 1 if quick else 3)
    for n in counts:
        store, huey, normal, raw = (result["rates"][(mode, n)] for mode in bench_sqlite_cycle.MODES)
        doubles = sum(result["doubles"][(mode, n)] for mode in bench_sqlite_cycle.MODES)
        procs = f"{n} process{'es' if n > 1 else ''}"
        note = f"{doubles} double claims; second figure: slowest trial"
        for ref, name, target, good in ((huey, f"huey `SqliteHuey` storage, {procs}", "≥ 1× and 0 double claims", 1.0),
                                        (normal, f"huey `SqliteHuey`, `synchronous=NORMAL` as the store, {procs}",
                                         "(like for like: no target)", 0.0),
                                        (raw, f"the same 3 writes raw, {procs}", "≥ 30 % and 0 double claims", 0.3)):
            ratio = med(store) / med(ref)
            ROWS.append({"figure": f"submit → claim → finish, {procs}, SQLite", "ref_name": name, "target": target,
                         "unit": "/s", "note": note, "ours": (med(store), min(store)), "ref": (med(ref), min(ref)),
                         "ratio": ratio, "met": ratio >= good and doubles == 0 if good else None})
    print("  measured: store throughput", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Reads at 100,000 tasks against the same at 1,000.


def populate(folder: Path, count: int, workdir: str) -> list[str]:
    """``count`` tasks, all but 30 finished (a long-lived queue: the history grows, the live part
    does not); returns cursors of every 50-row page."""
    import task_store
    use_queue(folder)
    for start in range(0, count, task_store.BATCH_MAX):
        task_store.submit_batch([{"title": f"task {start + i}", "instructions": "x" * 200, "working_dir": workdir,
                                  "priority": (start + i) % 3} for i in range(task_store.BATCH_MAX)])
        if start % 5000 == 0:
            task_store.add_note(start + 1, "a note")
    # The history is made done in one statement (the store has no bulk finish; 100,000 claim and
    # finish cycles would take the whole time budget). Triggers keep the counts as for any update.
    conn = task_store.connect()
    conn.execute("UPDATE tasks SET status = 'done', finished_at = created_at WHERE id <= ?", (count - 30,))
    conn.close()
    for _ in range(5):
        task = task_store.claim_next("bench")
        task_store.complete_attempt(task["id"], task["run_marker"]) if _ % 2 else None
    cursors, cursor = [None], None
    while True:
        cursor = task_store.list_tasks(limit=50, cursor=cursor)["next_cursor"]
        if cursor is None:
            return cursors
        cursors.append(cursor)


def scale(folder: Path, calls: int) -> None:
    import task_store
    small, large = folder / "q1k", folder / "q100k"
    pages = {"1k": populate(small, 1_000, str(folder)), "100k": populate(large, 100_000, str(folder))}
    sizes = {"1k": 1_000, "100k": 100_000}
    rng = random.Random(5)
    ops = {
        "get_task": lambda size: task_store.get_task(rng.randint(1, sizes[size])),
        "list_tasks, a random page (cursor)":
            lambda size: task_store.list_tasks(limit=50, cursor=rng.choice(pages[size])),
        "list_tasks, a deep page by offset": lambda size: task_store.list_tasks(limit=50, offset=sizes[size] * 9 // 10),
        "queue_status (counts, oldest, claimable)": lambda _size: task_store.queue_summary(),
    }
    times = {(op, size): [] for op in ops for size in sizes}
    for round_ in range(calls):
        for size, where in (("1k", small), ("100k", large)):
            use_queue(where)
            for op, call in ops.items():
                if "offset" in op and round_ % 5:  # ~150 ms a call at 100,000: every fifth round
                    continue
                started = time.perf_counter()
                call(size)
                times[(op, size)].append(time.perf_counter() - started)
    for op in ops:
        strict = "offset" not in op
        add(f"{op} at 100,000 tasks", times[(op, "100k")], times[(op, "1k")], "the same at 1,000 tasks",
            "p95 ≤ 20 ms and ≤ 1.5×" if strict else "(offset kept for old callers)",
            (lambda _m, p, r: p <= 0.020 and r <= 1.5) if strict else None)


# --------------------------------------------------------------------------------------------
# MCP tool latency in memory against a bare MCPServer tool.


async def tool_latency(folder: Path, rounds: int) -> None:
    import logging

    from mcp.client.session import ClientSession

    import bench_tool_latency

    logging.getLogger("taskbridge").setLevel(logging.ERROR)
    bench_tool_latency.seed(str(use_queue(folder)))
    await tool_rounds(folder, rounds, "")
    # The same without the SDK client's jsonschema check of each structured result against the
    # tool's output schema: the part of a call that grows with the rows a result holds.
    check = ClientSession.validate_tool_result

    async def unchecked(_self, _name, _result):
        return None
    ClientSession.validate_tool_result = unchecked
    try:
        await tool_rounds(folder, rounds, ", client's output-schema check off")
    finally:
        ClientSession.validate_tool_result = check


async def tool_rounds(folder: Path, rounds: int, label: str) -> None:
    import anyio
    from mcp import Client

    import bench_tool_latency
    import opencode_bridge_mcp as bridge

    cases = [("bare", "ping", {}), ("ours", "get_task", {"task_id": "t_0001"}),
             ("ours", "list_tasks", {"limit": 50}), ("ours", "queue_status", {}),
             ("ours", "submit_task", {"title": "b", "instructions": "x", "working_dir": str(folder / "work")})]
    times: dict[str, list[float]] = {tool: [] for _, tool, _ in cases}
    async with Client(bench_tool_latency.bare_server(), mode="legacy") as bare, \
            Client(bridge.build_server(), mode="legacy") as ours:
        clients = {"bare": bare, "ours": ours}
        for round_ in range(rounds + 10):
            for side, tool, args in cases:
                started = time.perf_counter()
                result = await clients[side].call_tool(tool, args)
                if round_ >= 10:  # the first rounds warm caches and are not counted
                    times[tool].append(time.perf_counter() - started)
                assert not result.is_error, result
                if tool == "submit_task":    # its commit wakes the session's channel watcher: let
                    await anyio.sleep(0.02)  # that settle before the next call (the bare ping) is timed
    for _, tool, _ in cases[1:]:
        rows = " (50 rows)" if tool == "list_tasks" else ""
        add(f"MCP `{tool}` in memory{rows}{label}", times[tool], times["ping"],
            "bare `MCPServer` tool returning a constant", "≤ 1.3× at p50", lambda _m, _p, r: r <= 1.3)


async def wake(folder: Path, rounds: int) -> None:
    from mcp import Client

    import bench_wait_for
    import opencode_bridge_mcp as bridge

    work = use_queue(folder)
    rng = random.Random(7)
    waits, polls = [], []
    async with Client(bridge.build_server(), mode="legacy") as client:
        for _ in range(rounds):
            waited, polled = await bench_wait_for.one_round(client, str(work), rng)
            waits.append(waited)
            polls.append(polled)
    add("wake, task finished → `wait_for` returns", waits, polls, "a client polling `get_task` every 4 s",
        "median ≤ 50 ms", lambda m, _p, _r: m <= 0.050)


# --------------------------------------------------------------------------------------------
# With the real opencode: pickup by `--watch`, one task end to end against a bare `opencode run`,
# the worker's idle memory.

DONE = '```json\n{"summary": "ok", "files_touched": [], "tests_run": [], "open_questions": []}\n```'


def real_runs(folder: Path, trials: int) -> None:
    import psutil

    from fake_openai import ScriptedModel, text
    from helpers import make_repo
    from opencode_env import opencode_bin, opencode_env

    if not opencode_bin():
        print("  opencode is not installed (./install.sh --test): its rows are skipped", file=sys.stderr)
        return
    use_queue(folder / "q")
    model = ScriptedModel().start()
    model.script("ok", [text("fine\n" + DONE)])
    env = opencode_env(folder, model.url) | {"TASK_DB_PATH": os.environ["TASK_DB_PATH"],
                                             "TASK_LOG_DIR": os.environ["TASK_LOG_DIR"],
                                             "TASKBRIDGE_WORKTREE_ROOT": str(folder / "worktrees"),
                                             "WORKER_NOTIFY": "0"}
    os.environ.update(env)
    repo = make_repo(folder / "repo")
    worker = subprocess.Popen([PY, str(ROOT / "worker.py"), "--watch"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bare_env = env | {"PWD": str(repo)}
    bare_cmd = [opencode_bin(), "run", "--auto", "--format", "json", "-m", "fake/model", "SCRIPT:ok say fine"]
    pickups, agents, ends, bares, idle_rss, python_rss = [], [], [], [], [], []
    try:
        idle_worker(worker)
        for trial in range(trials + 1):
            bare_first = trial % 2 == 1
            if bare_first:
                bare_run(bare_cmd, repo, bare_env, bares, trial)
            picked, agent, end = one_task(repo)
            if trial:  # the first run warms OpenCode's caches and database and is not counted
                pickups.append(picked)
                agents.append(agent)
                ends.append(end)
            if not bare_first:
                bare_run(bare_cmd, repo, bare_env, bares, trial)
            idle_worker(worker)
            time.sleep(0.5)
            bare = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
            time.sleep(0.5)
            idle_rss.append(psutil.Process(worker.pid).memory_info().rss)
            python_rss.append(psutil.Process(bare.pid).memory_info().rss)
            bare.kill()
            bare.wait()
    finally:
        worker.terminate()
        worker.wait(60)
        model.stop()
    add("pickup, submit → claimed by `--watch`", pickups, None, "60 s schedule: median 30 s, p95 57 s",
        "median ≤ 50 ms", lambda m, _p, _r: m <= 0.050, note="reference computed, not waited for")
    add("pickup, submit → agent process started", agents, None, "60 s schedule: median 30 s, p95 57 s",
        "median ≤ 50 ms", lambda m, _p, _r: m <= 0.050, note="worktree made, opencode spawned")
    add("one task end to end, cold (submit → done)", ends, bares, "bare `opencode run`, same prompt",
        "≤ 1.05×", lambda _m, _p, r: r <= 1.05)
    add("one task end to end, warm engine", None, None, "bare `opencode run`", "≤ 0.6×", None,
        note="not built")
    add("idle RSS of `worker.py --watch`", idle_rss, python_rss, "a bare Python", "≤ 3×",
        lambda _m, _p, r: r <= 3, unit="MB")


def box(trials: int) -> None:
    """The agent box's cost (bench_box.py): a run's start boxed against bare, interleaved."""
    import agent_box
    import bench_box
    if agent_box.support().mechanism != "bubblewrap":
        print(f"  skipped: the agent box ({agent_box.support().reason})", file=sys.stderr)
        return
    result = bench_box.measure(trials)
    added = [b - a for a, b in zip(result["bare"], result["boxed"], strict=False)]
    add("what the agent box adds to a run's start (bwrap with a task's binds)", added, None,
        "the same command unboxed, interleaved", "median ≤ 50 ms", lambda m, _p, _r: m <= 0.050)
    add("memory of the box's own processes (bwrap)", result["rss"], None, "", "a few MB", None, unit="MB")


def bare_run(cmd: list[str], repo: Path, env: dict, times: list[float], trial: int) -> None:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=300, check=True)
    if trial:
        times.append(time.perf_counter() - started)


def idle_worker(worker: subprocess.Popen) -> None:
    import task_store
    deadline = time.monotonic() + 60
    while (task_store.read_worker_heartbeat() or {}).get("state") != "idle":
        if time.monotonic() > deadline or worker.poll() is not None:
            raise SystemExit("the --watch worker never went idle; run ./install.sh --test and retry")
        time.sleep(0.02)


def one_task(repo: Path) -> tuple[float, float, float]:
    """Submit one task to the idle --watch worker; (to claimed, to agent started, to done) seconds."""
    import task_store
    started = time.perf_counter()
    task = task_store.submit_task(title="bench", instructions="SCRIPT:ok say fine", working_dir=str(repo))
    picked = agent = None
    with task_store.change_watch() as watch:
        while True:
            now = time.perf_counter()
            row = task_store.get_task(task["id"])
            if picked is None and row["status"] != "pending":
                picked = now - started
            if agent is None and row["agent_pid"]:
                agent = now - started
            if row["status"] in task_store.TERMINAL:
                assert row["status"] == "done", row["error"]
                return picked, agent or picked, now - started
            if now - started > 300:
                raise SystemExit(f"task {task['id']} did not finish in 300 s")
            # A commit wakes it; until the agent is seen, 5 ms also catches the lease renewal that
            # records agent_pid; then only commits matter (the done event), not a busy poll.
            watch.wait(0.005 if agent is None else 0.5)


# --------------------------------------------------------------------------------------------
# Idle memory of the MCP server against a bare MCPServer.

BARE_STDIO = """
from mcp.server.mcpserver import MCPServer
server = MCPServer("bare")
@server.tool()
def ping() -> dict:
    return {"ok": True}
server.run("stdio")
"""


def mcp_rss(folder: Path, samples: int) -> None:
    import psutil
    use_queue(folder)
    ours, bare = [], []
    for _ in range(samples):
        procs = {"ours": subprocess.Popen([PY, str(ROOT / "opencode_bridge_mcp.py")], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy()),
                 "bare": subprocess.Popen([PY, "-c", BARE_STDIO], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)}
        time.sleep(4)
        ours.append(psutil.Process(procs["ours"].pid).memory_info().rss)
        bare.append(psutil.Process(procs["bare"].pid).memory_info().rss)
        for proc in procs.values():
            proc.kill()
            proc.wait()
    add("idle RSS of the MCP server (stdio)", ours, bare, "a bare `MCPServer`", "≤ 1.1×",
        lambda _m, _p, r: r <= 1.1, unit="MB")


# --------------------------------------------------------------------------------------------
# Past one machine: claim -> renew -> finish with 1-16 worker processes, PostgreSQL against SQLite.


def workers(quick: bool) -> None:
    import bench_scale
    counts = (1, 4, 16) if quick else bench_scale.WORKERS
    result = bench_scale.measure(counts, 300 if quick else 1500, 1 if quick else 3)
    for n in counts:
        pg, lite = result["rates"].get(("postgresql", n)), result["rates"][("sqlite", n)]
        doubles = result["doubles"][("sqlite", n)] + result["doubles"][("postgresql", n)]
        row = {"figure": f"claim → renew → finish, {n} worker process{'es' if n > 1 else ''}, PostgreSQL",
               "ref_name": f"SQLite, {n} process{'es' if n > 1 else ''}", "target": "0 double claims", "unit": "/s",
               "note": f"{doubles} double claims; second figure: slowest trial",
               "ref": (med(lite), min(lite)), "met": doubles == 0}
        if pg:
            row |= {"ours": (med(pg), min(pg)), "ratio": med(pg) / med(lite)}
        else:
            row["note"] += f"; PostgreSQL not measured: {result['postgres']}"
        ROWS.append(row)
    print("  measured: worker processes on PostgreSQL and SQLite", file=sys.stderr, flush=True)


def main() -> int:
    import anyio
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials (~2 min), for a smoke run")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma list of parts to run: {', '.join(PARTS)}")
    args = parser.parse_args()
    quick, only = args.quick, set(args.only.split(","))
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        os.environ["MCP_TOKEN_FILE"] = str(base / "no-token")
        os.environ.pop("MCP_BEARER_TOKEN", None)
        parts = {
            "real": lambda: real_runs(base / "real", 3 if quick else 8),
            "box": lambda: box(50 if quick else 300),
            "cycles": lambda: store_throughput(quick),
            "wake": lambda: anyio.run(wake, base / "wake", 4 if quick else 12),
            "tools": lambda: anyio.run(tool_latency, base / "tools", 50 if quick else 200),
            "scale": lambda: scale(base / "scale", 30 if quick else 200),
            "rss": lambda: mcp_rss(base / "rss", 1 if quick else 3),
            "workers": lambda: workers(quick),
        }
        for name in PARTS:
            if name in only:
                parts[name]()
    print(f"\n`bench/run` on {time.strftime('%Y-%m-%d')}, {platform.system()} {platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, SQLite "
          f"{__import__('sqlite3').sqlite_version}; {time.monotonic() - began:.0f} s\n")
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
