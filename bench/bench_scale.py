"""Claim → renew → finish cycles per second with 1, 4, 8 and 16 worker processes, on PostgreSQL
against SQLite on the same machine in the same run, counting double claims (there must be none).

    .venv/bin/python bench/bench_scale.py [--quick] [--workers 1,4,8,16] [--tasks N] [--trials N]
    bench/run --only workers        # the same figures as rows of bench/run's table

Each trial fills a fresh queue with N tasks (SQLite: a new file; PostgreSQL: a new database), then
starts that many worker processes, each with the store's own public functions only
(``claim_next``, ``renew_lease``, ``complete_attempt``), looping until nothing is left to claim.
The clock runs from a common start instant (every process already connected) to the last
process's end. Backends alternate trial by trial so both see the same machine noise. Afterwards
the queue itself is checked: every task done, ``attempts`` 1, exactly one ``claimed`` and one
``done`` event each, and no id claimed by two processes; any other outcome is a double claim.

PostgreSQL: Debian's ``postgresql`` binaries (``/usr/lib/postgresql/*/bin``), a cluster made with
``initdb`` in a temporary folder and run on a free loopback port, as ``taskbridge-test`` when run
as root (as tests/pg_server.py does), with the durability SQLite has here: ``fsync`` on,
``synchronous_commit=off`` (SQLite's WAL with ``synchronous=NORMAL`` does not sync each commit
either). Without the binaries or psycopg the PostgreSQL rows say so and SQLite is still measured.

Env: none read (everything runs in a temporary folder; TASK_DB_URL is set for the child
processes).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
WORKERS = (1, 4, 8, 16)
PG_PASSWORD = "bench-pw"
PG_USER = "taskbridge"

CYCLER = r"""
import json, sys, time
owner, start_at = sys.argv[1], float(sys.argv[2])
import task_store
task_store.last_event_id()   # connect (and migrate) before the clock starts
while time.time() < start_at:
    time.sleep(0.001)
began, got = time.time(), []
while True:
    task = task_store.claim_next(owner)
    if task is None:
        break
    task_store.renew_lease(task["id"], task["run_marker"])
    task_store.complete_attempt(task["id"], task["run_marker"])
    got.append(task["id"])
print(json.dumps({"began": began, "ended": time.time(), "got": got}))
"""


# --------------------------------------------------------------------------------------------
# A PostgreSQL server of the bench's own.


class Postgres:
    """initdb + postgres in a new temporary folder on a free loopback port (as a normal user when
    root: the folder is its own, outside any folder that user could not enter)."""

    def __init__(self) -> None:
        import pg_server  # tests/pg_server.py: where the binaries are, a free port
        bindir = pg_server.pg_bin_dir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        import psycopg  # noqa: F401  (a clear message below when missing)
        folder = Path(tempfile.mkdtemp(prefix="bench-scale-pg-"))
        self.folder, self.port = folder, pg_server.free_port()
        run_as = self._as_user()
        (folder / "sock").mkdir()
        (folder / "pwfile").write_text(PG_PASSWORD + "\n")
        for path in (folder, folder / "sock", folder / "pwfile"):
            if run_as:
                os.chown(path, run_as["user"], run_as["group"])
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": str(folder)}
        init = subprocess.run([str(bindir / "initdb"), "-D", str(folder / "data"), "-U", PG_USER, "--pwfile",
                               str(folder / "pwfile"), "--auth-local=trust", "--auth-host=scram-sha-256", "-E",
                               "UTF8", "--locale=C"], cwd=folder, env=env, capture_output=True, text=True, **run_as)
        if init.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"initdb failed: {(init.stderr or init.stdout).strip()[-500:]}")
        log = open(folder / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            [str(bindir / "postgres"), "-D", str(folder / "data"), "-h", "127.0.0.1", "-p", str(self.port),
             "-k", str(folder / "sock"), "-c", "synchronous_commit=off", "-c", "max_connections=200",
             "-c", "log_min_messages=warning"],
            cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, **run_as)
        log.close()
        self.admin = self._connect()

    @staticmethod
    def _as_user() -> dict[str, Any]:
        if os.geteuid() != 0:
            return {}
        import helpers
        user = helpers.normal_user()
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def _connect(self) -> Any:
        import psycopg
        deadline = time.monotonic() + 30
        while True:
            try:
                return psycopg.connect(host=str(self.folder / "sock"), port=self.port, user=PG_USER,
                                       dbname="postgres", autocommit=True, connect_timeout=5)
            except psycopg.OperationalError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("postgres did not start: "
                                       + (self.folder / "postgres.log").read_text(errors="replace")[-2000:]) from exc
                time.sleep(0.05)

    def url(self, dbname: str) -> str:
        return f"postgresql://{PG_USER}:{PG_PASSWORD}@127.0.0.1:{self.port}/{dbname}"

    def create(self, name: str) -> str:
        self.admin.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop(self, name: str) -> None:
        self.admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.admin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# One trial.


@contextlib.contextmanager
def queue_at(url: str, logs: Path) -> Iterator[None]:
    """The store (this process's and the children's) pointed at ``url`` while inside (a SQLite
    path also as TASK_DB_PATH, which means the same), task logs in ``logs``."""
    import task_store
    names = ("TASK_DB_URL", "TASK_DB_PATH", "TASK_LOG_DIR")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"TASK_DB_URL": url, "TASK_LOG_DIR": str(logs)})
    if "://" not in url:
        os.environ["TASK_DB_PATH"] = url
    try:
        yield
    finally:
        task_store.close_connections()
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def fill(tasks: int, workdir: Path) -> None:
    import task_store
    for start in range(0, tasks, task_store.BATCH_MAX):
        task_store.submit_batch([{"title": f"cycle {start + i}", "instructions": "i", "working_dir": str(workdir)}
                                 for i in range(min(task_store.BATCH_MAX, tasks - start))])


def check(tasks: int, claimed: list[str]) -> int:
    """Double claims seen in the queue and in what the processes claimed (0 when all is well)."""
    import task_store
    rows, cursor = [], None
    while True:
        page = task_store.list_tasks(limit=200, cursor=cursor)
        rows += page["tasks"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    kinds: Counter = Counter()
    after = 0
    while True:
        events = task_store.events_since(after, limit=10_000)
        if not events:
            break
        kinds.update((e["task_id"], e["kind"]) for e in events if e["kind"] in ("claimed", "done"))
        after = events[-1]["id"]
    doubles = len(claimed) - len(set(claimed)) + (tasks - len(set(claimed)))
    doubles += sum(1 for t in rows if t["status"] != "done" or t["attempts"] != 1)
    doubles += sum(1 for t in rows if kinds[(t["id"], "claimed")] != 1 or kinds[(t["id"], "done")] != 1)
    return doubles


def trial(url: str, workers: int, tasks: int, workdir: Path) -> tuple[float, int]:
    """(cycles per second, double claims) of one run of ``workers`` processes over ``tasks``."""
    import task_store
    with queue_at(url, workdir.parent / "logs"):
        speaks = getattr(task_store, "backend", lambda: "sqlite")()   # (a store before PostgreSQL)
        assert speaks == ("postgresql" if "://" in url else "sqlite"), speaks
        fill(tasks, workdir)
        start_at = time.time() + 1.0 + 0.25 * workers   # every process connected by then
        procs = [subprocess.Popen([PY, "-c", CYCLER, f"bench-{i}", str(start_at)], cwd=ROOT, env=dict(os.environ),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(workers)]
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"a worker process failed: {err.strip()[-2000:]}")
            outs.append(json.loads(out))
        if max(o["began"] for o in outs) > start_at + 0.5:
            print(f"  (a process started {max(o['began'] for o in outs) - start_at:.1f} s late)", file=sys.stderr)
        claimed = [t for o in outs for t in o["got"]]
        wall = max(o["ended"] for o in outs) - start_at
        return len(claimed) / wall, check(tasks, claimed)


def measure(workers: tuple[int, ...], tasks: int, trials: int) -> dict[str, Any]:
    """{"rates": {(backend, n): [cycles/s, …]}, "doubles": {(backend, n): int}, "postgres": reason or None}."""
    rates: dict[tuple[str, int], list[float]] = {}
    doubles: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        base = Path(tmp)
        (base / "work").mkdir()
        pg, why = None, None
        try:
            import task_store
            if not hasattr(task_store, "backend"):
                raise RuntimeError("this task_store speaks SQLite only")
            pg = Postgres()
        except Exception as exc:   # no server: SQLite is still measured, the rows say why
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        try:
            for n in workers:
                for t in range(trials):
                    order = ("sqlite", "postgresql") if t % 2 == 0 else ("postgresql", "sqlite")
                    for name in order:
                        if name == "postgresql" and pg is None:
                            continue
                        db = f"w{n}_t{t}"
                        url = pg.create(db) if name == "postgresql" else str(base / f"{db}.db")
                        try:
                            rate, bad = trial(url, n, tasks, base / "work")
                        finally:
                            if name == "postgresql":
                                pg.drop(db)
                        rates.setdefault((name, n), []).append(rate)
                        doubles[(name, n)] += bad
                        print(f"  {name:10} {n:2} workers, trial {t + 1}: {rate:,.0f} cycles/s, {bad} double claims",
                              file=sys.stderr, flush=True)
        finally:
            if pg is not None:
                pg.stop()
    return {"rates": rates, "doubles": doubles, "postgres": why}


def table(result: dict[str, Any], workers: tuple[int, ...]) -> str:
    rates, doubles = result["rates"], result["doubles"]
    lines = ["| worker processes | SQLite: median (slowest) | PostgreSQL: median (slowest) | PostgreSQL ÷ SQLite "
             "| PostgreSQL vs its 1 process | double claims (SQLite / PostgreSQL) |",
             "|---|---|---|---|---|---|"]
    med = {key: statistics.median(v) for key, v in rates.items()}
    for n in workers:
        cells = []
        for name in ("sqlite", "postgresql"):
            values = rates.get((name, n))
            cells.append(f"{med[(name, n)]:,.0f}/s ({min(values):,.0f})" if values else "—")
        ratio = f"{med[('postgresql', n)] / med[('sqlite', n)]:.2f}×" if ("postgresql", n) in med else "—"
        scale = (f"{med[('postgresql', n)] / med[('postgresql', workers[0])]:.2f}×"
                 if ("postgresql", n) in med and ("postgresql", workers[0]) in med else "—")
        pg_doubles = doubles[("postgresql", n)] if ("postgresql", n) in rates else "—"
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {ratio} | {scale} | {doubles[('sqlite', n)]} / {pg_doubles} |")
    if result["postgres"]:
        lines.append(f"\nPostgreSQL not measured: {result['postgres']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks and trials (~1 min), for a smoke run")
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)), help="comma list of process counts")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per trial (default 1500; --quick 300)")
    parser.add_argument("--trials", type=int, default=None, help="trials per backend and count (default 3; --quick 1)")
    args = parser.parse_args()
    workers = tuple(int(n) for n in args.workers.split(","))
    tasks = args.tasks or (300 if args.quick else 1500)
    trials = args.trials or (1 if args.quick else 3)
    began = time.monotonic()
    result = measure(workers, tasks, trials)
    import platform
    import sqlite3
    print(f"\n`bench/bench_scale.py` on {time.strftime('%Y-%m-%d')}, {platform.system()} {platform.machine()}, "
          f"{os.cpu_count()} cores, SQLite {sqlite3.sqlite_version}; {tasks} tasks a trial, {trials} trial(s) each; "
          f"{time.monotonic() - began:.0f} s\n")
    print(table(result, workers))
    return 0 if not sum(result["doubles"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
