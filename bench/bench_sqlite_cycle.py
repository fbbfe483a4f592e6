"""TaskBridge's SQLite store cycle against huey's SqliteHuey storage and the same writes done raw.

    .venv/bin/python bench/bench_sqlite_cycle.py [--quick] [--procs 1,4,16] [--cycles N] [--trials N]
    .venv/bin/python bench/bench_sqlite_cycle.py --pages     # pages written per cycle, and each index's share
    bench/run --only cycles                                # the same figures as rows of bench/run's table

One cycle, three ways, each in its own fresh database on the same disk:
- store: ``submit_task`` -> ``claim_next`` -> ``complete_attempt`` (the store's public functions);
- huey: ``SqliteStorage.enqueue`` -> ``dequeue`` -> ``put_data`` (the result), huey's defaults
  (WAL; SQLite's default ``synchronous``, FULL, which syncs every commit to disk) but a 60 s busy
  timeout;
- huey_normal: the same with ``synchronous=NORMAL``, the store's own setting (durable across a
  process crash, not a power cut): the like-for-like reference. The store against ``huey`` moves
  with the disk's sync cost (a loaded disk makes every huey commit wait), against ``huey_normal``
  it does not;
- raw: the three writes as single statements (insert, claim by ``UPDATE … RETURNING``, finish) over
  one table with a status index, on a connection from the store's own factory (the same pragmas).
Each trial starts N processes at one instant (all connected already); the rate is every claimed
cycle over the wall time from the first start to the last end. The three ways alternate in a
rotating order trial by trial, so all see the same machine noise; figures are medians. A cycle
claimed by two processes is a double claim (there must be none).

``--pages`` counts the WAL frames (pages) each of the store's three writes adds, one process, and
then the same with each index, trigger set and table of the cycle's path dropped in turn: what
each costs per cycle. Needs huey (requirements-dev.txt). Env: none read.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
MODES = ("store", "huey", "huey_normal", "raw")
PROCS = (1, 4, 16)

CYCLER = r"""
import json, os, sqlite3, sys, time
mode, cycles, start_at, db = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
os.environ["TASK_DB_PATH"] = db
os.environ["TASK_LOG_DIR"] = os.path.join(os.path.dirname(db), "logs")
work = os.path.join(os.path.dirname(os.path.dirname(db)), "work")
got, tag = [], str(os.getpid())
if mode == "store":
    import task_store
    task_store.last_event_id()  # open the kept connection before the clock starts
    def cycle(i):
        task_store.submit_task(title="c", instructions="i", working_dir=work)
        task = task_store.claim_next("bench")
        if task is not None:
            task_store.complete_attempt(task["id"], task["run_marker"])
            got.append(task["id"])
elif mode in ("huey", "huey_normal"):
    from huey.storage import SqliteStorage
    # The tables exist already (prepare); a 60 s busy timeout as the store's 30 s: huey's 5 s
    # default gave up under 16 processes on this loaded 2-core machine.
    storage = SqliteStorage("bench", filename=db, create_tables=False, timeout=60)
    if mode == "huey_normal":
        storage.conn.execute("PRAGMA synchronous = NORMAL")
    storage.queue_size()
    def cycle(i):
        storage.enqueue(f"{tag}:{i}".encode())
        data = storage.dequeue()
        if data is not None:
            storage.put_data(bytes(data), b"result")
            got.append(bytes(data).decode())
else:
    # The reference: the same three writes as single raw statements (SQL outside task_store.py on
    # purpose: this is what the store is measured against), one kept connection.
    import task_store
    conn = task_store.connect(db)
    def run(sql, args=()):
        while True:
            try:
                return conn.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:  # a stale read snapshot: retried
                if "locked" not in str(exc) and "busy" not in str(exc): raise
    def cycle(i):
        run("INSERT INTO raw (status, created_at) VALUES ('pending', ?)", (time.time(),))
        rows = run("UPDATE raw SET status = 'running', owner = ? WHERE id = (SELECT id FROM raw"
                   " WHERE status = 'pending' ORDER BY id LIMIT 1) RETURNING id", (os.getpid(),))
        if rows:
            run("UPDATE raw SET status = 'done' WHERE id = ?", (rows[0][0],))
            got.append(rows[0][0])
while time.time() < start_at: time.sleep(0.001)
began = time.time()
for i in range(cycles):
    cycle(i)
print(json.dumps({"began": began, "ended": time.time(), "got": got}))
"""


def prepare(mode: str, db: Path) -> None:
    """A fresh database for ``mode`` (the store and huey make their own on first use)."""
    db.parent.mkdir(parents=True, exist_ok=True)
    (db.parent.parent / "work").mkdir(exist_ok=True)
    if mode.startswith("huey"):
        from huey.storage import SqliteStorage
        SqliteStorage("bench", filename=str(db)).close()
    if mode == "raw":
        import task_store
        conn = task_store.connect(db)
        conn.execute("CREATE TABLE raw (id INTEGER PRIMARY KEY, status TEXT, owner INT, created_at REAL)")
        conn.execute("CREATE INDEX raw_status ON raw (status, id)")
        conn.close()


def one_trial(mode: str, db: Path, procs: int, cycles: int) -> tuple[float, int]:
    """(cycles per second, double claims) of ``procs`` processes running ``cycles`` each."""
    prepare(mode, db)
    start_at = time.time() + 1.0 + 0.1 * procs
    children = [subprocess.Popen([PY, "-c", CYCLER, mode, str(cycles), str(start_at), str(db)], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    outs = [json.loads(child.communicate(timeout=900)[0]) for child in children]
    claimed = [t for out in outs for t in out["got"]]
    wall = max(o["ended"] for o in outs) - min(o["began"] for o in outs)
    return len(claimed) / wall, len(claimed) - len(set(claimed))


def measure(procs: tuple[int, ...] = PROCS, cycles: int = 400, trials: int = 3) -> dict[str, Any]:
    """Rates per (mode, processes): {"rates": {(mode, n): [cycles/s per trial]}, "doubles": {(mode,
    n): count}}. ``cycles`` per process per trial; the order of the modes rotates every trial."""
    rates: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in procs}
    doubles = dict.fromkeys(rates, 0)
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(trials):
            for n in procs:
                order = MODES[trial % len(MODES):] + MODES[:trial % len(MODES)]
                for mode in order:
                    rate, double = one_trial(mode, Path(tmp) / f"{mode}-{n}-{trial}" / "q" / "tasks.db", n,
                                             max(50, cycles // max(1, n // 4)))
                    rates[(mode, n)].append(rate)
                    doubles[(mode, n)] += double
                    print(f"  {mode:11} {n:2} processes trial {trial}: {rate:,.0f} cycles/s",
                          file=sys.stderr, flush=True)
    return {"rates": rates, "doubles": doubles}


# --------------------------------------------------------------------------------------------
# Pages written per cycle: the WAL's frame count before and after each write, one process.


def _frames(wal: Path, page_size: int) -> int:
    return max(0, (wal.stat().st_size - 32) // (page_size + 24)) if wal.exists() else 0


def store_pages(folder: Path, drop: tuple[str, ...] = (), cycles: int = 200) -> dict[str, float]:
    """Pages per write (submit, claim, finish) of the store's cycle in a fresh queue in ``folder``
    with the schema objects ``drop`` (index, trigger names) dropped first; averages over ``cycles``
    after 300 warm-up cycles (the B-trees past their first pages)."""
    import task_store
    folder.mkdir(parents=True)
    (folder / "work").mkdir()
    os.environ.update({"TASK_DB_PATH": str(folder / "tasks.db"), "TASK_LOG_DIR": str(folder / "logs")})
    conn = task_store._kept()
    for name in drop:
        kind = conn.execute("SELECT type FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
        conn.execute(f"DROP {kind.upper()} {name}")
    wal, size = folder / "tasks.db-wal", conn.execute("PRAGMA page_size").fetchone()[0]
    work = str(folder / "work")
    steps = {"submit": lambda _: task_store.submit_task(title="c", instructions="i", working_dir=work),
             "claim": lambda _: task_store.claim_next("bench"),
             "finish": lambda task: task_store.complete_attempt(task["id"], task["run_marker"])}
    pages = dict.fromkeys(steps, 0)
    for i in range(300 + cycles):
        if i == 300:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        task = None
        for step, call in steps.items():
            before = _frames(wal, size)
            task = call(task)   # submit's result is not claim's input; claim's is finish's
            if i >= 300:
                pages[step] += _frames(wal, size) - before
    task_store.close_connections()
    return {step: count / cycles for step, count in pages.items()}


def cycle_objects() -> list[tuple[str, tuple[str, ...]]]:
    """The schema objects a cycle writes besides the task row and its event: each index on tasks and
    events, and the counts triggers (one entry: the counts row); the unique index on
    idempotency_key and sqlite_sequence (the task ids) cannot be dropped and are left in."""
    return [("tasks_claim", ("tasks_claim",)), ("tasks_list", ("tasks_list",)),
            ("tasks_unseen", ("tasks_unseen",)), ("events_task", ("events_task",)),
            ("task_counts (triggers)", ("task_counts_insert", "task_counts_update", "task_counts_delete",
                                        "task_unseen_insert", "task_unseen_update", "task_unseen_delete"))]


def raw_pages(folder: Path, cycles: int = 200) -> float:
    """Pages per cycle of the raw reference (insert, claim, finish on one table with a status index)."""
    import task_store
    db = folder / "q" / "tasks.db"
    prepare("raw", db)
    conn = task_store.connect(db)
    wal, size = db.with_name("tasks.db-wal"), conn.execute("PRAGMA page_size").fetchone()[0]
    written = 0
    for i in range(300 + cycles):
        if i == 300:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = _frames(wal, size)
        conn.execute("INSERT INTO raw (status, created_at) VALUES ('pending', ?)", (time.time(),))
        got = conn.execute("UPDATE raw SET status = 'running', owner = 1 WHERE id = (SELECT id FROM raw"
                           " WHERE status = 'pending' ORDER BY id LIMIT 1) RETURNING id").fetchone()
        conn.execute("UPDATE raw SET status = 'done' WHERE id = ?", (got[0],))
        written += (_frames(wal, size) - before) if i >= 300 else 0
    conn.close()
    return written / cycles


def pages_report() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = store_pages(Path(tmp) / "all")
        total = sum(base.values())
        print(f"store, pages per cycle: {total:.1f} ({', '.join(f'{k} {v:.1f}' for k, v in base.items())}); "
              f"raw writes: {raw_pages(Path(tmp) / 'raw'):.1f}")
        for label, names in cycle_objects():
            without = sum(store_pages(Path(tmp) / label.split()[0], names).values())
            print(f"  {label:24} {total - without:4.1f} pages per cycle")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 trial of 150 cycles per process")
    parser.add_argument("--procs", default="1,4,16", help="comma list of process counts")
    parser.add_argument("--cycles", type=int, default=400, help="cycles per process per trial (fewer at 16)")
    parser.add_argument("--trials", type=int, default=3, help="trials per process count")
    parser.add_argument("--pages", action="store_true", help="pages written per cycle and each index's share")
    args = parser.parse_args()
    if args.pages:
        pages_report()
        return 0
    procs = tuple(int(n) for n in args.procs.split(","))
    result = measure(procs, 150 if args.quick else args.cycles, 1 if args.quick else args.trials)
    print("| processes | store | huey SqliteHuey (sync FULL) | huey, sync NORMAL | raw writes | store / huey | "
          "store / huey NORMAL | store / raw | double claims |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in procs:
        store, huey, normal, raw = (statistics.median(result["rates"][(m, n)]) for m in MODES)
        doubles = sum(result["doubles"][(m, n)] for m in MODES)
        print(f"| {n} | {store:,.0f}/s | {huey:,.0f}/s | {normal:,.0f}/s | {raw:,.0f}/s | {store / huey:.2f}× | "
              f"{store / normal:.2f}× | {store / raw:.0%} | {doubles} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
