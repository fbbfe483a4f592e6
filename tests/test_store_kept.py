"""The store's fast paths keep its guarantees: kept connections under processes, threads and fork;
cursor paging; counts kept by triggers; the schema migration; wake-ups on change. The tests that
are not about SQLite's files run on PostgreSQL too (store_backend)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import task_store as store
from helpers import ROOT, claim_in_processes


def submit_many(tmp_path: Path, count: int, **fields) -> None:
    for start in range(0, count, store.BATCH_MAX):
        store.submit_batch([{"title": f"t{start + i}", "instructions": "i", "working_dir": str(tmp_path)} | fields
                            for i in range(min(store.BATCH_MAX, count - start))])


def test_eight_processes_claim_4000_tasks_exactly_once_on_kept_connections(tmp_path):
    """8 processes x ~500 claims each: every task claimed once, none lost, no 'locked' error."""
    submit_many(tmp_path, 4000)
    claimed = claim_in_processes(8, timeout=240, renew=True)   # each exits 0 without a "locked" error
    assert len(claimed) == 4000 and len(set(claimed)) == 4000
    assert store.counts() == dict.fromkeys(store.STATUSES, 0) | {"done": 4000}
    events = store.events_since(0, limit=10_000)
    events += store.events_since(events[-1]["id"], limit=10_000)
    claims = [e for e in events if e["kind"] == "claimed"]
    assert len(claims) == 4000 and len({e["task_id"] for e in claims}) == 4000


def test_threads_each_use_their_own_connection_and_claim_exactly_once(tmp_path, store_backend):
    """The worker's --slots threads and the MCP server's threads: one connection per thread, no
    transaction of one thread ever runs on another's connection."""
    submit_many(tmp_path, 400)
    got: list[list[str]] = [[] for _ in range(8)]
    conns: list[int] = [0] * 8
    errors: list[BaseException] = []

    def claimer(slot: int) -> None:
        try:
            conns[slot] = id(store._kept())
            while (task := store.claim_next(f"slot{slot}")) is not None:
                got[slot].append(task["id"])
                store.get_task(task["id"])
                store.complete_attempt(task["id"], task["run_marker"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    flat = [t for slot in got for t in slot]
    assert len(flat) == 400 and len(set(flat)) == 400
    assert len(set(conns)) == 8
    assert store.counts()["done"] == 400


def test_a_forked_child_never_uses_its_parents_connection(tmp_path, store_backend):
    submit_many(tmp_path, 3)
    parent_conn = store._kept()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its store calls must open a connection of its own
        try:
            task = store.claim_next("child")
            report = {"own": store._kept() is not parent_conn, "claimed": task["id"]}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            report = {"error": repr(exc)}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        report = json.loads(pipe.read())
    assert status == 0 and report == {"own": True, "claimed": "t_0001"}
    # The parent's connection still works and sees the child's write.
    assert store._kept() is parent_conn
    assert store.get_task("t_0001")["status"] == "running"
    assert store.claim_next("parent")["id"] == "t_0002"


def test_a_replaced_database_file_is_reopened_not_written_through_a_stale_connection(tmp_path):
    """Deleted, the file is not made again by this process (QueueGone: test_queue_gone.py); another
    queue put in its place is opened, never written through the connection to the old file."""
    submit_many(tmp_path, 2)
    path = store.db_path()
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    with pytest.raises(store.QueueGone):
        store.counts()
    subprocess.run([sys.executable, "-c", "import sys, task_store\ntask_store.submit_task(title='fresh', "
                    "instructions='i', working_dir=sys.argv[1])", str(tmp_path)], cwd=ROOT, check=True, timeout=60)
    assert store.counts() == dict.fromkeys(store.STATUSES, 0) | {"pending": 1}
    store.submit_task(title="second", instructions="i", working_dir=str(tmp_path))
    assert path.exists() and [t["title"] for t in store.list_tasks()["tasks"]] == ["second", "fresh"]


def test_a_failed_transaction_leaves_the_kept_connection_usable(tmp_path):
    with pytest.raises(store.ValidationError):
        store.submit_batch([{"title": "ok", "instructions": "i", "working_dir": str(tmp_path)},
                            {"title": "bad", "instructions": "i", "working_dir": str(tmp_path),
                             "depends_on": ["t_0099"]}])
    assert store.counts()["pending"] == 0 and not store._kept().in_transaction
    assert store.submit_task(title="next", instructions="i", working_dir=str(tmp_path))["id"] == "t_0001"


def test_cursor_pages_walk_the_same_rows_as_offset_pages(tmp_path, store_backend):
    submit_many(tmp_path, 45)
    submit_many(tmp_path, 7, priority=5)
    submit_many(tmp_path, 6, priority=-2)
    for _ in range(5):
        task = store.claim_next("w")
        store.complete_attempt(task["id"], task["run_marker"])
    store.claim_next("w")
    store.cancel_task("t_0030")
    for status in (None, "done", ["pending", "cancelled"]):
        whole = [t["id"] for t in store.list_tasks(status, limit=500)["tasks"]]
        walked, cursor = [], None
        while True:
            page = store.list_tasks(status, limit=4, cursor=cursor)
            walked += [t["id"] for t in page["tasks"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert walked == whole and len(whole) == page["total"]
        by_offset = store.list_tasks(status, limit=4, offset=8)
        assert [t["id"] for t in by_offset["tasks"]] == whole[8:12]
    assert store.list_tasks(limit=500)["tasks"][0]["status"] == "running"
    with pytest.raises(store.ValidationError, match="next_cursor exactly as given"):
        store.list_tasks(cursor="3.0.x")


def test_counts_follow_every_change(tmp_path, store_backend):
    def listed() -> dict[str, int]:
        return {s: len(store.list_tasks(s, limit=500)["tasks"]) for s in store.STATUSES}

    submit_many(tmp_path, 6)
    store.submit_task(title="dep", instructions="i", working_dir=str(tmp_path), depends_on=["t_0001"])
    first = store.claim_next("w")
    store.fail_attempt(first["id"], first["run_marker"], "boom", retryable=False)  # fails its dependent too
    second = store.claim_next("w")
    store.pause_for_question(second["id"], second["run_marker"], "why?")
    third = store.claim_next("w")
    store.complete_attempt(third["id"], third["run_marker"])
    store.claim_next("w")
    store.cancel_task("t_0006")
    assert store.counts() == listed() == {"pending": 1, "running": 1, "waiting": 1, "done": 1,
                                           "failed": 2, "cancelled": 1}
    store.clear_finished()
    assert store.counts() == listed() == {"pending": 1, "running": 1, "waiting": 1, "done": 0,
                                           "failed": 0, "cancelled": 0}
    assert store.list_tasks()["total"] == 3


def test_a_version_1_database_migrates_with_its_counts(tmp_path, monkeypatch):
    # Rows written as version 1 wrote them (raw SQL: today's store writes columns v1 lacks).
    # Only the migration list is put back afterwards: monkeypatch.undo() also restored the env as
    # it was before the autouse fixture, where a TASK_DB_URL an earlier in-process `--db` had set
    # pointed this test at another queue (seen in a full CI run).
    with monkeypatch.context() as patch:
        patch.setattr(store, "MIGRATIONS", store.MIGRATIONS[:1])
        conn = store.connect()
        conn.executemany("INSERT INTO tasks (title, instructions, working_dir, created_at, status)"
                         " VALUES (?, 'i', ?, ?, ?)",
                         [(f"t{n}", str(tmp_path), n, "done" if n == 0 else "pending") for n in range(5)])
        conn.close()
        store.close_connections()
    assert store.counts() == dict.fromkeys(store.STATUSES, 0) | {"pending": 4, "done": 1}
    assert store.get_task("t_0001")["status"] == "done"


def test_store_calls_reuse_one_connection_and_keep_the_wal(tmp_path, monkeypatch):
    """A connection is opened once per thread, not per call, so no close checkpoints and deletes
    the WAL after every call."""
    submit_many(tmp_path, 1)
    opened = []
    real_connect = store.connect
    monkeypatch.setattr(store, "connect", lambda *a, **k: opened.append(1) or real_connect(*a, **k))
    for _ in range(50):
        task = store.claim_next("w")
        if task:
            store.complete_attempt(task["id"], task["run_marker"])
        store.get_task("t_0001")
        store.list_tasks()
        store.queue_summary()
    assert opened == []
    assert Path(str(store.db_path()) + "-wal").exists()


@pytest.mark.anyio
async def test_concurrent_mcp_tool_calls_each_get_a_connection_of_their_own(tmp_path, store_backend):
    """The MCP server runs sync tools in worker threads: 16 submits and reads at once all succeed,
    with distinct ids, and no thread's transaction runs on another's connection."""
    import anyio
    from mcp import Client

    import opencode_bridge_mcp as bridge
    results: list = []
    work = tmp_path / "work"   # beside the queue, which tmp_path holds
    work.mkdir()

    async with Client(bridge.build_server()) as client:
        async def one(i: int) -> None:
            sent = await client.call_tool("submit_task", {"title": f"t{i}", "instructions": "i",
                                                          "working_dir": str(work)})
            read = await client.call_tool("get_task", {"task_id": sent.structured_content["id"]})
            results.append((sent.is_error, read.is_error, sent.structured_content["id"]))

        async with anyio.create_task_group() as group:
            for i in range(16):
                group.start_soon(one, i)
    assert all(not a and not b for a, b, _ in results)
    assert len({tid for _, _, tid in results}) == 16
    assert store.counts()["pending"] == 16


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_a_replaced_file_never_loses_the_new_databases_wal(tmp_path):
    """Another process replaced the database while this one held a connection to the old file:
    closing that old connection (the last one to the removed file) must not take the new
    database's WAL, still holding the other process's commit, with it."""
    submit_many(tmp_path, 2)
    path = store.db_path()
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys, time, task_store\n"
            "task_store.submit_task(title='theirs', instructions='i', working_dir=sys.argv[1])\n"
            "print(os.path.exists(str(task_store.db_path()) + '-wal'), flush=True)  # _exit skips the flush\n"
            "os._exit(0)  # keep its WAL: no last close checkpoints it away\n",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.stdout.strip() == "True", other.stderr
    assert store.get_task("t_0001")["title"] == "theirs"   # reopened; the old connection closed
    assert Path(str(path) + "-wal").exists()
    store.close_connections()
    assert store.get_task("t_0001")["title"] == "theirs"


@pytest.mark.anyio
async def test_mcp_list_tasks_pages_by_cursor_like_by_offset(tmp_path, store_backend):
    from mcp import Client

    import opencode_bridge_mcp as bridge
    submit_many(tmp_path, 23)
    submit_many(tmp_path, 4, priority=3)
    task = store.claim_next("w")
    store.complete_attempt(task["id"], task["run_marker"])
    async with Client(bridge.build_server()) as client:
        whole = (await client.call_tool("list_tasks", {"limit": 200})).structured_content
        walked, cursor = [], None
        while True:
            args = {"limit": 5} | ({"cursor": cursor} if cursor else {})
            page = (await client.call_tool("list_tasks", args)).structured_content
            walked += [t["id"] for t in page["tasks"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        bad = await client.call_tool("list_tasks", {"cursor": "nonsense"})
    assert walked == [t["id"] for t in whole["tasks"]] and len(walked) == 27
    assert whole["next_cursor"] is None and page["next_offset"] is None
    assert bad.is_error and "next_cursor exactly as given" in bad.content[0].text
    assert "Traceback" not in bad.content[0].text


def test_a_fork_while_another_thread_holds_the_connection_lock_does_not_hang_the_child(tmp_path, store_backend):
    submit_many(tmp_path, 1)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._KEPT_LOCK:
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                ok = store.claim_next("child") is not None
            except BaseException:  # noqa: BLE001 - reported by the exit code
                ok = False
            os._exit(0 if ok else 3)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the connection lock its parent's thread held")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        release.set()
        thread.join(10)


def test_threads_making_a_new_queue_at_once_all_open_it(tmp_path, monkeypatch):
    # Each thread's first store call makes the queue (its file, WAL, tables) at the same moment,
    # as an MCP server's tool call and its channel watcher do. SQLite refused the later switches
    # to WAL at once ("database is locked", no busy wait): they must wait for the first instead.
    monkeypatch.delenv("TASK_DB_URL", raising=False)
    failed: list[str] = []
    for round_ in range(150):
        monkeypatch.setenv("TASK_DB_PATH", str(tmp_path / str(round_) / "tasks.db"))
        start = threading.Barrier(5)

        def first_call(start: threading.Barrier = start) -> None:
            start.wait()
            try:
                store.list_tasks()
            except store.TaskStoreError as exc:
                failed.append(str(exc))
            finally:
                store._discard()

        threads = [threading.Thread(target=first_call) for _ in range(5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failed == []
