"""How many workers one PostgreSQL server carries: a simulated fleet of N workers at the real
cadence (claim, a lease renewal every WORKER_LEASE_SEC, a log ship at most renewals, finish, claim
again; a feeder keeping the queue full), no agent, against one server; the largest N whose
renewals stay under 1 s at p99 with no lease lost.

    .venv/bin/python bench/bench_fleet.py [--fleet 400,1000,2000,5000] [--seconds S] [--procs P]
        [--threads T] [--task-sec S] [--lease-sec S]

Each fleet size gets a fresh database on a server of the bench's own (bench_scale.Postgres). The
N workers are shared out over P processes of T threads (each thread one connection of its own, as
a pooler would give a fleet): a thread keeps a schedule of its workers' next steps and runs each
when due, with the store's own functions (``claim_next``, ``renew_lease``, ``append_task_log``,
``complete_attempt``). A renewal's latency is from when it was due to when it returned, so a
server (or a client) that falls behind shows as late renewals. A lost lease is a renewal the
store refused (StaleAttempt). Tasks run ``--task-sec`` (±50 %), then finish.

Env: none read (TASK_DB_URL is set for the child processes).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from bench_scale import PY, ROOT, Postgres, queue_at  # noqa: E402

FLEET = (400, 1000, 2000, 5000)
LOG_CHUNK = b"x" * 300 + b"\n"   # an agent's step or two of output

SIMULATOR = r"""
import json, sys
sys.path[:0] = [sys.argv[1]]
import bench_fleet, task_store
task_store.last_event_id()   # imported and connected before the clock starts
print("ready", flush=True)
start_at = float(sys.stdin.readline())
workers, threads, seconds, task_sec, lease_sec = map(float, sys.argv[2:])
print(json.dumps(bench_fleet.simulate(workers, threads, start_at, start_at + seconds, task_sec, lease_sec)))
"""


def _thread(workers: int, start_at: float, stop_at: float, task_sec: float, lease_sec: float, out: list) -> None:
    """One connection's share of the fleet: a heap of (due, worker, step) run as each falls due."""
    import task_store
    task_store.last_event_id()   # connected before the clock starts
    rng, held = random.Random(), {}
    due = [(start_at + rng.random() * lease_sec, w, "claim") for w in range(workers)]
    heapq.heapify(due)
    late, lost, counts = [], 0, {"claims": 0, "finishes": 0, "ships": 0, "idle": 0}
    while due:
        at, w, step = heapq.heappop(due)
        if at >= stop_at:
            continue
        while (wait := at - time.time()) > 0:
            time.sleep(wait)
        if step == "claim":
            task = task_store.claim_next(f"sim-{os.getpid()}-{w}")
            if task is None:
                counts["idle"] += 1
                heapq.heappush(due, (time.time() + lease_sec, w, "claim"))
                continue
            counts["claims"] += 1
            held[w] = (task["id"], task["run_marker"], time.time() + task_sec * (0.5 + rng.random()))
            heapq.heappush(due, (at + lease_sec, w, "renew"))
        elif time.time() >= held[w][2]:
            task_store.complete_attempt(held[w][0], held[w][1])
            counts["finishes"] += 1
            heapq.heappush(due, (time.time(), w, "claim"))
        else:
            try:
                task_store.renew_lease(held[w][0], held[w][1])
            except task_store.StaleAttempt:
                lost += 1
                heapq.heappush(due, (time.time(), w, "claim"))
                continue
            late.append(time.time() - at)
            if rng.random() < 0.7:
                task_store.append_task_log(held[w][0], LOG_CHUNK)
                counts["ships"] += 1
            heapq.heappush(due, (at + lease_sec, w, "renew"))
    out.append({"late": late, "lost": lost, **counts})


def simulate(workers: float, threads: float, start_at: float, stop_at: float, task_sec: float,
             lease_sec: float) -> dict[str, Any]:
    """Run ``workers`` simulated workers over ``threads`` threads in this process; returns the
    renewal latencies (s), lost leases and step counts."""
    out: list = []
    share = [int(workers) // int(threads) + (i < int(workers) % int(threads)) for i in range(int(threads))]
    runs = [threading.Thread(target=_thread, args=(n, start_at, stop_at, task_sec, lease_sec, out)) for n in share]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    return {"late": [x for o in out for x in o["late"]], "lost": sum(o["lost"] for o in out),
            **{k: sum(o[k] for o in out) for k in ("claims", "finishes", "ships", "idle")}}


def top_up(keep: int, workdir: Path, stop_at: float = math.inf) -> int:
    """Submit batches (BATCH_MAX) until ``keep`` tasks are pending (or ``stop_at``); returns how
    many were submitted."""
    import task_store
    submitted = 0
    while task_store.counts().get("pending", 0) < keep and time.time() < stop_at:
        task_store.submit_batch([{"title": "sim", "instructions": "i", "working_dir": str(workdir)}]
                                * task_store.BATCH_MAX)
        submitted += task_store.BATCH_MAX
    return submitted


def feed(stop_at: float, keep: int, workdir: Path) -> int:
    """The feeder: keep at least ``keep`` tasks pending until ``stop_at``, looking every 0.2 s."""
    submitted = 0
    while time.time() < stop_at:
        submitted += top_up(keep, workdir, stop_at)
        time.sleep(0.2)
    return submitted


def run_fleet(n: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One fleet of ``n`` workers for ``args.seconds`` against the queue the environment names: the
    merged results."""
    top_up(n, workdir)   # a full queue before the clock starts
    procs = [subprocess.Popen([PY, "-c", SIMULATOR, str(Path(__file__).resolve().parent),
                               str(n // args.procs + (i < n % args.procs)), str(args.threads), str(args.seconds),
                               str(args.task_sec), str(args.lease_sec)], cwd=ROOT, env=dict(os.environ),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(args.procs)]
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a simulator process failed: {proc.communicate()[1].strip()[-2000:]}")
    start_at = time.time() + 1 + args.threads * 0.1   # its threads connect before then
    for proc in procs:
        proc.stdin.write(f"{start_at}\n")
        proc.stdin.flush()
    fed = feed(start_at + args.seconds, max(n // 4, 20), workdir)
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=args.seconds + 600)
        if proc.returncode != 0:
            raise RuntimeError(f"a simulator process failed: {err.strip()[-2000:]}")
        outs.append(json.loads(out))
    late = sorted(x for o in outs for x in o["late"])
    merged = {k: sum(o[k] for o in outs) for k in ("lost", "claims", "finishes", "ships", "idle")}
    return merged | {"fed": fed, "renewals": len(late), "p50": _pct(late, 0.5), "p99": _pct(late, 0.99),
                     "max": late[-1] if late else float("nan"), "seconds": args.seconds}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default=",".join(map(str, FLEET)), help="comma list of fleet sizes (workers)")
    parser.add_argument("--seconds", type=float, default=20, help="seconds each fleet runs (default 20)")
    parser.add_argument("--procs", type=int, default=4, help="simulator processes (default 4)")
    parser.add_argument("--threads", type=int, default=8, help="threads (connections) per process (default 8)")
    parser.add_argument("--task-sec", type=float, default=20, help="a task's run time, ±50 %% (default 20)")
    parser.add_argument("--lease-sec", type=float, default=1, help="renewal period, WORKER_LEASE_SEC (default 1)")
    args = parser.parse_args()
    rows, holds = [], 0
    pg = Postgres()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            (Path(tmp) / "work").mkdir()
            for n in (int(x) for x in args.fleet.split(",")):
                url = pg.create(f"fleet_{n}")
                try:
                    with queue_at(url, Path(tmp) / "logs"):
                        r = run_fleet(n, args, Path(tmp) / "work")
                finally:
                    pg.drop(f"fleet_{n}")
                ok = r["p99"] < 1.0 and r["lost"] == 0
                holds = n if ok else holds
                rows.append(f"| {n:,} | {r['renewals'] / r['seconds']:,.0f}/s | {r['p50'] * 1000:,.0f} ms "
                            f"| {r['p99'] * 1000:,.0f} ms | {r['max'] * 1000:,.0f} ms | {r['lost']} "
                            f"| {r['claims']:,} / {r['finishes']:,} / {r['ships']:,} / {r['fed']:,} "
                            f"| {'holds' if ok else 'no'} |")
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        pg.stop()
    print(f"\n`bench/bench_fleet.py` on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; {args.seconds:g} s a "
          f"fleet, renewals every {args.lease_sec:g} s, {args.procs}×{args.threads} connections, tasks of "
          f"{args.task_sec:g} s ±50 %\n")
    print("| workers | renewals | renewal p50 | p99 | max | lost leases | claims / finishes / log ships / fed "
          "| p99 < 1 s, none lost |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nlargest fleet that holds: {holds:,}" if holds else "\nno fleet size held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
