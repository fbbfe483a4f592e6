"""SQLite's write path and read plans (issue 25): the pages a submit -> claim -> finish cycle writes
(the WAL's frames), the migration that took AUTOINCREMENT off the events and the oldest pending
task's own index, and that every read the tools make goes through an index, never a scan of the
tasks or events table."""
from __future__ import annotations

import sqlite3

import task_store as store
from helpers import submit


def frames() -> int:
    wal = store.db_path().with_name(store.db_path().name + "-wal")
    return (wal.stat().st_size - 32) // (4096 + 24) if wal.exists() else 0


def test_a_cycle_writes_fewer_pages(tmp_path):
    """Claim and finish no longer write sqlite_sequence, submit and claim no longer the pending-age
    index: 25.6 pages a cycle before, 21.6 now (the raw three writes: 6)."""
    for _ in range(100):   # past the B-trees' first pages
        task = submit(tmp_path)
        store.complete_attempt(task["id"], store.claim_next("w")["run_marker"])
    store._kept().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    written = {"submit": 0, "claim": 0, "finish": 0}
    for _ in range(50):
        before = frames()
        submit(tmp_path)
        after_submit = frames()
        claimed = store.claim_next("w")
        after_claim = frames()
        store.complete_attempt(claimed["id"], claimed["run_marker"])
        written["submit"] += after_submit - before
        written["claim"] += after_claim - after_submit
        written["finish"] += frames() - after_claim
    per = {step: n / 50 for step, n in written.items()}
    assert per["claim"] <= 6.5 and per["finish"] <= 7.5 and per["submit"] <= 8.5, per
    assert sum(per.values()) <= 22.5, per


def test_migration_9_keeps_event_ids_and_counts_unread_results(tmp_path, monkeypatch):
    db = tmp_path / "old" / "tasks.db"
    db.parent.mkdir()
    conn = sqlite3.connect(db, isolation_level=None)
    for number, step in enumerate(store.MIGRATIONS[:8], start=1):   # a queue as version 8 left it
        step(conn)
        conn.execute(f"PRAGMA user_version = {number}")
    for n in range(3):
        conn.execute("INSERT INTO tasks (title, instructions, working_dir, created_at, status, finished_at)"
                     " VALUES ('t', 'i', ?, 1, ?, 2)", (str(tmp_path), "done" if n else "pending"))
        conn.execute("INSERT INTO events (task_id, ts, kind) VALUES (?, 1, 'submitted')", (n + 1,))
    conn.execute("INSERT INTO events (task_id, ts, kind) VALUES (1, 1, 'noted')")
    conn.close()
    monkeypatch.setenv("TASK_DB_PATH", str(db))
    assert [e["id"] for e in store.events_since(0)] == [1, 2, 3, 4]
    assert store.unseen_results()["total"] == 2 and store.counts()["done"] == 2
    store.add_note(1, "after the migration")
    assert store.last_event_id() == 5
    raw = store._kept()
    assert raw.execute("SELECT count(*) FROM sqlite_sequence WHERE name = 'events'").fetchone()[0] == 0
    assert "AUTOINCREMENT" not in raw.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()[0]
    assert raw.execute("SELECT count(*) FROM sqlite_master WHERE name = 'tasks_pending_age'").fetchone()[0] == 0


def test_the_oldest_pending_task_across_priorities(tmp_path):
    ids = [submit(tmp_path, priority=p)["id"] for p in (0, 5, 0, -3, 5)]
    assert store.queue_summary()["oldest_pending"] == ids[0]
    store._kept().execute("UPDATE tasks SET created_at = created_at - 100 WHERE id = 4")   # an older one, low priority
    assert store.queue_summary()["oldest_pending"] == ids[3]
    store.claim_next("w", task_id=ids[3])
    assert store.queue_summary()["oldest_pending"] == ids[0]
    for _ in range(4):
        store.claim_next("w")
    assert store.queue_summary()["oldest_pending"] is None


def _plans(call) -> list[tuple[str, str]]:
    """(statement, plan line) of every statement ``call`` runs on the store's kept connection."""
    conn, seen = store._kept(), []
    conn.set_trace_callback(seen.append)
    try:
        call()
    finally:
        conn.set_trace_callback(None)
    lines = []
    for sql in seen:
        if sql.lstrip().upper().startswith(("SELECT", "WITH")):
            lines += [(sql, row[3]) for row in conn.execute("EXPLAIN QUERY PLAN " + sql).fetchall()]
    return lines


def test_every_read_a_tool_makes_goes_through_an_index(tmp_path):
    """At 3,000 finished tasks and a few live ones, no read of queue_status, list_tasks (first and a
    deep page), get_task, unseen_results or wait_for's event reads scans tasks or events."""
    work = str(tmp_path)
    for start in range(0, 3000, 20):
        store.submit_batch([{"title": f"t{start + i}", "instructions": "x", "working_dir": work,
                             "priority": i % 3} for i in range(20)])
    store._kept().execute("UPDATE tasks SET status = 'done', finished_at = created_at WHERE id <= 2990")
    store.claim_next("w")
    submit(tmp_path, schedule_timeout_sec=60)
    page = store.list_tasks(limit=50)
    reads = {
        "queue_summary": store.queue_summary, "counts": store.counts, "unseen": store.unseen_results,
        "list first page": lambda: store.list_tasks(limit=50),
        "list next page": lambda: store.list_tasks(limit=50, cursor=page["next_cursor"]),
        "list running": lambda: store.list_tasks(status="running"),
        "get_task": lambda: store.get_task(1500), "events of a task": lambda: store.events_since(0, [1500]),
        "events since": lambda: store.events_since(store.last_event_id() - 5),
        "running leases": store.running_leases, "overdue": store.overdue_tasks,
    }
    for name, call in reads.items():
        for sql, plan in _plans(call):
            scanned = plan.startswith("SCAN") and " USING " not in plan and plan.split()[1] in ("tasks", "t", "events")
            assert not scanned, f"{name}: {plan}\n{sql}"
            # A sort of every match grows with the history; only the live filters, the walk over the
            # pending priorities and get_task's last 20 events (put back in order) sort, a few rows each.
            sorted_all = "TEMP B-TREE" in plan and name not in (
                "list running",
                "running leases",
                "queue_summary",
                "get_task",
            )
            assert not sorted_all, f"{name}: {plan}\n{sql}"
