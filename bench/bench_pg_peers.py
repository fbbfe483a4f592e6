"""TaskBridge's store cycle against procrastinate's on the same PostgreSQL server, in one run:
submit → claim → finish (procrastinate: defer → fetch → finish) with 1, 4 and 16 processes.

    .venv/bin/python bench/bench_pg_peers.py [--quick] [--workers 1,4,16] [--seconds S] [--trials N]
    .venv/bin/python bench/bench_pg_peers.py --trips     # round trips per store call, then stop

Each trial makes a fresh database on one server of the bench's own (bench_scale.Postgres: initdb
in a temporary folder, ``fsync`` on, ``synchronous_commit=off``), sets up the queue (TaskBridge's
migrations, procrastinate's schema), then starts that many processes; each loops over one cycle
for ``--seconds`` from a common start instant (given once every process said it is connected), with the
library's own public calls only: ``task_store.submit_task`` / ``claim_next`` /
``complete_attempt``; procrastinate's ``JobManager.defer_job_async`` / ``fetch_job`` /
``finish_job`` over its ``PsycopgConnector``. The two systems alternate trial by trial (and which
goes first alternates) so both see the same machine noise; the table shows medians. A double
claim is an id fetched by two processes (or twice): there must be none.

``--trips`` counts the round trips each of the queue's hot calls makes (``submit_task``,
``claim_next``, ``renew_lease``, ``append_task_log``, ``complete_attempt``): every message the
store's connection sends and waits on (psycopg's ``execute``, ``executemany``), counted by a
wrapper around it, in a warm process (connected, statements prepared).

procrastinate is a benchmark-only dependency (requirements-dev.txt). Env: none read.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from bench_scale import PY, ROOT, Postgres, queue_at  # noqa: E402

WORKERS = (1, 4, 16)
SYSTEMS = ("taskbridge", "procrastinate")

TASKBRIDGE = r"""
import json, sys, time
url, owner, seconds, workdir = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
import task_store
task_store.last_event_id()   # connect (and migrate) before the clock starts
print("ready", flush=True)
start_at = float(sys.stdin.readline())
stop_at = start_at + seconds
while time.time() < start_at:
    time.sleep(0.001)
got = []
while time.time() < stop_at:
    task_store.submit_task(title="cycle", instructions="i", working_dir=workdir)
    task = task_store.claim_next(owner)
    if task is not None:
        task_store.complete_attempt(task["id"], task["run_marker"])
        got.append(task["id"])
print(json.dumps(got))
"""

PROCRASTINATE = r"""
import asyncio, json, sys, time
url, owner, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
import procrastinate
from procrastinate import jobs

async def main():
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=1))
    async with app.open_async():
        manager = app.job_manager
        worker_id = await manager.register_worker()
        print("ready", flush=True)
        start_at = float(sys.stdin.readline())
        stop_at = start_at + seconds
        while time.time() < start_at:
            await asyncio.sleep(0.001)
        got = []
        while time.time() < stop_at:
            await manager.defer_job_async(jobs.Job(id=None, queue="default", lock=None, queueing_lock=None,
                                                   task_name="cycle", task_kwargs={}))
            job = await manager.fetch_job(None, worker_id)
            if job is not None:
                await manager.finish_job(job, jobs.Status.SUCCEEDED, delete_job=False)
                got.append(job.id)
        print(json.dumps(got))

asyncio.run(main())
"""


def prepare(system: str, url: str) -> None:
    """Set up ``system``'s tables in the empty database at ``url``."""
    if system == "taskbridge":
        import task_store
        task_store.last_event_id()   # migrates on open
        task_store.close_connections()
        return
    import procrastinate
    app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=url))
    with app.open():
        app.schema_manager.apply_schema()


def trial(system: str, url: str, workers: int, seconds: float, workdir: Path) -> tuple[float, int]:
    """(cycles per second, double claims) of ``workers`` processes cycling for ``seconds``."""
    prepare(system, url)
    script = TASKBRIDGE if system == "taskbridge" else PROCRASTINATE
    procs = [subprocess.Popen([PY, "-c", script, url, f"bench-{i}", str(seconds), str(workdir)], cwd=ROOT,
                              env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(workers)]
    for proc in procs:   # every process connected and set up before the common start
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a {system} process failed: {proc.communicate()[1].strip()[-2000:]}")
    start_at = time.time() + 0.2
    got = []
    for proc in procs:
        proc.stdin.write(f"{start_at}\n")
        proc.stdin.flush()
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"a {system} process failed: {err.strip()[-2000:]}")
        got += json.loads(out)
    doubles = sum(n - 1 for n in Counter(got).values())
    return len(got) / seconds, doubles


def measure(workers: tuple[int, ...], seconds: float, trials: int) -> dict[str, Any]:
    """{"rates": {(system, n): [cycles/s, …]}, "doubles": {(system, n): int}}."""
    rates: dict[tuple[str, int], list[float]] = {}
    doubles: Counter = Counter()
    pg = Postgres()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-pg-peers-") as tmp:
            work = Path(tmp) / "work"
            work.mkdir()
            for t in range(trials):
                for n in workers:
                    for system in (SYSTEMS if (t + n) % 2 == 0 else SYSTEMS[::-1]):
                        db = f"{system}_w{n}_t{t}"
                        url = pg.create(db)
                        try:
                            with queue_at(url, Path(tmp) / "logs"):
                                rate, bad = trial(system, url, n, seconds, work)
                        finally:
                            pg.drop(db)
                        rates.setdefault((system, n), []).append(rate)
                        doubles[(system, n)] += bad
                        print(f"  {system:13} {n:2} processes, trial {t + 1}: {rate:,.0f} cycles/s, "
                              f"{bad} double claims",
                              file=sys.stderr, flush=True)
    finally:
        pg.stop()
    return {"rates": rates, "doubles": doubles}


def table(result: dict[str, Any], workers: tuple[int, ...]) -> str:
    """The Markdown table of medians (slowest in brackets), the ratio and TaskBridge's growth."""
    rates, doubles = result["rates"], result["doubles"]
    med = {key: statistics.median(v) for key, v in rates.items()}
    lines = ["| processes | TaskBridge: median (slowest) | procrastinate: median (slowest) "
             "| TaskBridge ÷ procrastinate "
             "| TaskBridge vs its 1 process | double claims (TaskBridge / procrastinate) |",
             "|---|---|---|---|---|---|"]
    for n in workers:
        cells = [f"{med[(s, n)]:,.0f}/s ({min(rates[(s, n)]):,.0f})" for s in SYSTEMS]
        ratio = med[("taskbridge", n)] / med[("procrastinate", n)]
        growth = med[("taskbridge", n)] / med[("taskbridge", workers[0])]
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {ratio:.2f}× | {growth:.2f}× "
                     f"| {doubles[('taskbridge', n)]} / {doubles[('procrastinate', n)]} |")
    return "\n".join(lines)


class _CountingConnection:
    """A psycopg connection that counts what is sent and waited on (one round trip each)."""

    def __init__(self, raw: Any, tally: Counter) -> None:
        self._raw, self._tally = raw, tally

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._tally["trips"] += 1
        return self._raw.execute(*args, **kwargs)

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return _CountingCursor(self._raw.cursor(*args, **kwargs), self._tally)


class _CountingCursor:
    """A psycopg cursor whose ``executemany`` counts one round trip when it has rows to send (the
    store's only use of a cursor; psycopg sends them pipelined)."""

    def __init__(self, raw: Any, tally: Counter) -> None:
        self._raw, self._tally = raw, tally

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _CountingCursor:
        self._raw.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.__exit__(*exc)

    def executemany(self, query: Any, rows: list) -> None:
        self._tally["trips"] += bool(rows)
        self._raw.executemany(query, rows)


def round_trips() -> dict[str, int]:
    """{call: round trips} for the queue's hot calls on a fresh PostgreSQL database: each call made
    a few times first (connected, statements prepared), then counted once."""
    import store_pg
    import task_store
    tally: Counter = Counter()
    opened = store_pg._pg_open
    pg = Postgres()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-pg-trips-") as tmp:
            url = pg.create("trips")
            store_pg._pg_open = lambda u: _CountingConnection(opened(u), tally)
            try:
                with queue_at(url, Path(tmp) / "logs"):
                    return _count_calls(task_store, tally, tmp)
            finally:
                store_pg._pg_open = opened
    finally:
        pg.stop()


def _count_calls(task_store: Any, tally: Counter, workdir: str) -> dict[str, int]:
    calls = {
        "submit_task": lambda _: task_store.submit_task(title="cycle", instructions="i", working_dir=workdir),
        "claim_next": lambda t: t.update(task_store.claim_next("bench")),
        "renew_lease": lambda t: task_store.renew_lease(t["id"], t["run_marker"]),
        "append_task_log": lambda t: task_store.append_task_log(t["id"], b"x" * 300 + b"\n"),
        "complete_attempt": lambda t: task_store.complete_attempt(t["id"], t["run_marker"]),
    }
    counted: dict[str, int] = {}
    for _ in range(8):   # psycopg prepares a statement at its 5th run: count a later one
        task: dict[str, Any] = {}
        for name, call in calls.items():
            before = tally["trips"]
            call(task)
            counted[name] = tally["trips"] - before
    counted["cycle (submit, claim, finish)"] = sum(counted[k] for k in ("submit_task", "claim_next",
                                                                        "complete_attempt"))
    return counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter and fewer trials (~1 min), for a smoke run")
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)), help="comma list of process counts")
    parser.add_argument("--seconds", type=float, default=None, help="seconds each trial cycles (default 5; --quick 2)")
    parser.add_argument("--trials", type=int, default=None, help="trials per system and count (default 3; --quick 1)")
    parser.add_argument("--trips", action="store_true", help="count round trips per store call, then stop")
    args = parser.parse_args()
    if args.trips:
        for name, trips in round_trips().items():
            print(f"{name:30} {trips} round trips")
        return 0
    workers = tuple(int(n) for n in args.workers.split(","))
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    trials = args.trials or (1 if args.quick else 3)
    import platform

    import procrastinate
    began = time.monotonic()
    result = measure(workers, seconds, trials)
    print(f"\n`bench/bench_pg_peers.py` on {time.strftime('%Y-%m-%d')}, {platform.system()} {platform.machine()}, "
          f"{os.cpu_count()} cores, procrastinate {procrastinate.__version__}; {seconds:g} s a trial, "
          f"{trials} trial(s) each; {time.monotonic() - began:.0f} s\n")
    print(table(result, workers))
    return 0 if not sum(result["doubles"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
