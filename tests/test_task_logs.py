"""Task logs and workers readable from any machine (issue 13): the store's log functions on the
file (SQLite) and on the database's chunks (what PostgreSQL uses; on SQLite switched on through
``task_store.logs_in_database`` here), every reader going through them, the worker shipping its
log, and the workers table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import board_api
import opencode_bridge_mcp as bridge
import task_store
import task_views
import tasks_cli
import worker
from helpers import submit

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)> \x1b[31mred\x1b[0m"


@pytest.fixture(params=["file", "database", pytest.param("postgresql", marks=pytest.mark.postgres)])
def where(request, monkeypatch):
    """Where task logs live: the file (SQLite), the chunks table of SQLite switched on by hand (the
    same statements), or a real PostgreSQL's (``TASK_DB_URL`` = a fresh ``pg_url``)."""
    if request.param == "database":
        monkeypatch.setattr(task_store, "logs_in_database", lambda: True)
    if request.param == "postgresql":
        monkeypatch.setenv("TASK_DB_URL", request.getfixturevalue("pg_url"))
        assert task_store.logs_in_database()
    return request.param


@pytest.fixture(params=["database", pytest.param("postgresql", marks=pytest.mark.postgres)])
def in_db(request, monkeypatch):
    """Logs in the database: SQLite's chunks table switched on by hand, or a real PostgreSQL."""
    if request.param == "database":
        monkeypatch.setattr(task_store, "logs_in_database", lambda: True)
    else:
        monkeypatch.setenv("TASK_DB_URL", request.getfixturevalue("pg_url"))
    return request.param


def chunk_lengths(task_id: str) -> list[int]:
    conn = task_store.connect()
    try:
        return [row[0] for row in conn.execute("SELECT length(data) FROM task_log_chunks WHERE task_id = ?"
                                               " ORDER BY seq", (task_store.parse_task_id(task_id),))]
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# The store's three functions.


def test_append_read_and_size_agree_across_chunk_boundaries(tmp_path, where):
    tid = submit(tmp_path)["id"]
    assert task_store.task_log_size(tid) == 0 and task_store.read_task_log(tid) == b""
    data = os.urandom(3 * task_store.LOG_CHUNK_MAX + 123)
    size = 0
    for piece in (data[:10], data[10:70_000], data[70_000:200_001], data[200_001:]):
        size = task_store.append_task_log(tid, piece)
    assert size == task_store.task_log_size(tid) == len(data)
    assert task_store.read_task_log(tid) == data
    edge = task_store.LOG_CHUNK_MAX
    for offset, limit in [(0, 1), (edge - 1, 2), (edge, edge), (edge - 5, 2 * edge + 10), (len(data) - 1, 10),
                          (len(data), 5), (len(data) + 100, None), (1000, None), (5, 0)]:
        assert task_store.read_task_log(tid, offset, limit) == data[offset:None if limit is None else offset + limit], \
            (offset, limit)
    tail = 70_000                        # a tail the way the readers take it: size, then the last bytes
    assert task_store.read_task_log(tid, task_store.task_log_size(tid) - tail) == data[-tail:]
    if where != "file":
        assert max(chunk_lengths(tid)) <= task_store.LOG_CHUNK_MAX and sum(chunk_lengths(tid)) == len(data)
    else:
        assert task_store.log_path(tid).read_bytes() == data and chunk_lengths(tid) == []
    assert task_store.task_log_sizes([tid, submit(tmp_path)["id"]]) == {tid: len(data), "t_0002": 0}
    with pytest.raises(task_store.ValidationError):
        task_store.read_task_log(tid, -1)


def test_a_retried_ship_never_writes_its_bytes_twice(tmp_path, where):
    tid = submit(tmp_path)["id"]
    task_store.append_task_log(tid, b"line 1\nline 2\n", at=0)
    # the first ship landed but its acknowledgement was lost: the retry carries the same bytes and more
    assert task_store.append_task_log(tid, b"line 1\nline 2\nline 3\n", at=0) == 21
    assert task_store.append_task_log(tid, b"line 3\n", at=14) == 21           # all there already
    assert task_store.read_task_log(tid) == b"line 1\nline 2\nline 3\n"
    # another writer's bytes at that offset are not ours: ours go after them, whole
    task_store.append_task_log(tid, b"other\n")
    task_store.append_task_log(tid, b"mine\n", at=21)
    assert task_store.read_task_log(tid) == b"line 1\nline 2\nline 3\nother\nmine\n"


def test_writers_appending_at_once_lose_nothing_and_never_collide(tmp_path, where):
    from concurrent.futures import ThreadPoolExecutor
    tid = submit(tmp_path)["id"]

    def write(n: int) -> None:
        for i in range(40):
            task_store.append_task_log(tid, f"writer {n} line {i}\n".encode())

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))
    lines = task_store.read_task_log(tid).decode().splitlines()
    assert sorted(lines) == sorted(f"writer {n} line {i}" for n in range(4) for i in range(40))
    for n in range(4):  # each writer's lines stay in its order
        assert [line for line in lines if line.startswith(f"writer {n} ")] == [
            f"writer {n} line {i}" for i in range(40)
        ]


def test_clearing_a_task_drops_its_log_chunks(tmp_path, where):
    tid = submit(tmp_path)["id"]
    task_store.append_task_log(tid, b"x" * 100_000)
    task_store.cancel_task(tid)
    task_store.clear_finished()
    assert chunk_lengths(tid) == []
    if where != "file":                          # a late ship for a cleared task writes nothing
        with pytest.raises(task_store.TaskNotFound):
            task_store.append_task_log(tid, b"late ship")
        assert chunk_lengths(tid) == []


# --------------------------------------------------------------------------------------------
# Every reader goes through them: a log written on machine A is read whole on machine B.


def on_machine(monkeypatch, tmp_path: Path, name: str) -> Path:
    """Act as another machine sharing only the database: its own, empty task log folder."""
    folder = tmp_path / name / "task_logs"
    monkeypatch.setenv("TASK_LOG_DIR", str(folder))
    return folder


def ship_like_a_worker(task_id: str, lines: list[bytes]) -> bytes:
    """Write a task log the way the worker does: its local file, shipped by LogShipper after
    every few lines and at the end."""
    with task_store.open_task_log(task_id) as log:
        shipper = worker.LogShipper(task_id, log)
        for n, line in enumerate(lines):
            log.write(line)
            if n % 7 == 0:
                shipper.ship()
        shipper.ship()
    return task_store.log_path(task_id).read_bytes()


def log_lines(count: int) -> list[bytes]:
    event = {"type": "text", "timestamp": 1, "part": {"text": "żółć 日本語 " + "x" * 3000}}
    lines = [json.dumps(event | {"part": {"text": f"{n} " + event["part"]["text"]}}).encode() + b"\n"
             for n in range(count)]
    return lines + [(json.dumps({"type": "text", "timestamp": 2, "part": {"text": HOSTILE}}) + "\n").encode()]


def test_a_log_written_on_machine_a_is_read_whole_on_machine_b(tmp_path, monkeypatch, in_db):
    tid = submit(tmp_path)["id"]
    on_machine(monkeypatch, tmp_path, "machine-a")
    written = ship_like_a_worker(tid, log_lines(100))
    assert len(written) > 4 * task_store.LOG_CHUNK_MAX
    folder_b = on_machine(monkeypatch, tmp_path, "machine-b")

    assert task_store.read_task_log(tid) == written and task_store.task_log_size(tid) == len(written)
    raw = CliRunner().invoke(tasks_cli.cli, ["logs", tid, "--raw"])
    assert raw.exit_code == 0 and raw.stdout_bytes == written
    tail = CliRunner().invoke(tasks_cli.cli, ["logs", tid, "--raw", "--tail", "2"])
    assert tail.stdout_bytes == b"".join(written.splitlines(keepends=True)[-2:])
    page = bridge.get_task_logs(tid, tail_lines=3)
    assert page["size"] == len(written) and written.decode().endswith(page["text"])
    assert page["text"].count("\n") == 3 and "queue database" in page["path"]
    pieces, offset = [], 0
    while True:
        page = bridge.get_task_logs(tid, offset=offset)
        pieces.append(page["text"])
        offset = page["next_offset"]
        if not page["truncated"]:
            break
    assert "".join(pieces).encode() == written
    assert bridge.get_task(tid)["log_bytes"] == len(written)
    assert board_api.task_detail(tid)["log_bytes"] == len(written)
    board = board_api.task_log(tid, None)
    assert board["entries"][-1]["kind"] == "text" and board["entries"][-1]["text"] == HOSTILE
    assert board["next_offset"] == len(written) and board["size"] == len(written)
    assert not folder_b.exists(), "machine B read everything from the database, not from a file"


def test_cli_follow_reads_a_log_that_grows_in_the_database(tmp_path, monkeypatch, in_db):
    import threading
    import time
    monkeypatch.setattr(tasks_cli, "FOLLOW_POLL_SEC", 0.05)
    tid = submit(tmp_path)["id"]
    claimed = task_store.claim_next("worker:elsewhere:1", task_id=1)
    task_store.append_task_log(tid, b"started\n")

    def agent() -> None:
        for n in range(3):
            time.sleep(0.1)
            task_store.append_task_log(tid, f"step {n}\n".encode())
        task_store.append_task_log(tid, b"partial line without newline")
        time.sleep(0.1)
        task_store.complete_attempt(tid, claimed["run_marker"], result={"summary": "ok"})

    thread = threading.Thread(target=agent)
    thread.start()
    result = CliRunner().invoke(tasks_cli.cli, ["logs", tid, "--follow", "--raw"])
    thread.join()
    assert result.exit_code == 0
    assert result.stdout == "started\nstep 0\nstep 1\nstep 2\npartial line without newline"
    assert f"{tid} is done; log ends" in result.stderr


def test_the_board_follows_a_log_growing_in_the_database(tmp_path, monkeypatch, in_db):
    tid = submit(tmp_path)["id"]
    marks = task_store.change_marks()
    watch = board_api.Watch({"cursor": str(marks["events"]), "jobs": marks["jobs"], "task": tid, "log": "0",
                             "follow": f"{tid}:0"})
    assert not watch.changed()
    task_store.append_task_log(tid, b"[worker] hello\n")
    assert watch.changed()
    assert watch.answer()["log_size"] == len(b"[worker] hello\n") == watch.answer()["follow"][tid]
    first = board_api.task_log(tid, None)
    task_store.append_task_log(tid, b"[stderr] half a li")
    task_store.append_task_log(tid, b"ne\n")
    more = board_api.task_log(tid, first["next_offset"])
    assert more["entries"] == [{"kind": "stderr", "text": "half a line"}]
    assert board_api.task_log(tid, 10**6)["reset"] is True


# --------------------------------------------------------------------------------------------
# The worker's shipping.


def test_a_ship_that_fails_is_retried_with_nothing_lost_or_doubled(tmp_path, monkeypatch, in_db):
    tid = submit(tmp_path)["id"]
    on_machine(monkeypatch, tmp_path, "machine-a")
    real = task_store.append_task_log
    calls = {"n": 0}

    def flaky(task_id, data, *, at=None):
        calls["n"] += 1
        if calls["n"] == 2:
            real(task_id, data, at=at)                       # it landed, but the answer was lost
            raise ConnectionError("server closed the connection unexpectedly")
        if calls["n"] == 3:
            raise ConnectionError("could not connect to server")   # it did not land
        return real(task_id, data, at=at)

    monkeypatch.setattr(task_store, "append_task_log", flaky)
    with task_store.open_task_log(tid) as log:
        shipper = worker.LogShipper(tid, log)
        for n in range(5):
            log.write(f"line {n}\n".encode())
            shipper.ship()
    assert calls["n"] == 5
    assert task_store.read_task_log(tid) == task_store.log_path(tid).read_bytes() == \
        b"".join(f"line {n}\n".encode() for n in range(5))


def test_a_new_attempt_on_another_machine_appends_after_the_first(tmp_path, monkeypatch, in_db):
    tid = submit(tmp_path)["id"]
    on_machine(monkeypatch, tmp_path, "machine-a")
    first = ship_like_a_worker(tid, [b"=== attempt 1\n", b"one\n"])
    on_machine(monkeypatch, tmp_path, "machine-b")
    (tmp_path / "machine-b" / "task_logs").mkdir(parents=True)
    task_store.log_path(tid).write_bytes(b"an older local run, shipped long ago\n")
    second = ship_like_a_worker(tid, [b"=== attempt 2\n", b"two\n"])
    assert task_store.read_task_log(tid) == first + second.split(b"\n", 1)[1]


def test_on_sqlite_the_worker_ships_nothing(tmp_path):
    tid = submit(tmp_path)["id"]
    ship_like_a_worker(tid, [b"hello\n"])
    assert chunk_lengths(tid) == [] and task_store.read_task_log(tid) == b"hello\n"


# --------------------------------------------------------------------------------------------
# Workers on every host.


def test_every_worker_on_every_host_is_listed_and_judged(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "import task_store; task_store.write_worker_heartbeat("
                             "{'state': 'running', 'task': 't_0001', 'tasks': ['t_0001'], 'slots': 1})"],
                            cwd=Path(task_store.__file__).parent)
    dead.wait()
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "build-server")
        task_store.write_worker_heartbeat({"state": "idle", "tasks": [], "slots": 4, "pid_start": 1.5})
    rows = task_store.list_workers()
    assert [(r["host"], r["pid"]) for r in rows] == [("build-server", os.getpid()),
                                                     (task_store.host_name(), dead.pid)]
    assert rows[0]["pid_running"] is None and rows[1]["pid_running"] is False
    assert rows[0]["name"] == f"worker:build-server:{os.getpid()}" and rows[0]["pid_start"] == 1.5
    judged = task_views.workers_state()
    assert [w["label"] for w in judged] == ["online", "gone"]
    assert "on another host (build-server)" in judged[0]["summary"]
    status = bridge.queue_status()
    assert [w["host"] for w in status["workers"]] == ["build-server", task_store.host_name()]
    assert status["worker"]["host"] == "build-server"
    cli = json.loads(CliRunner().invoke(tasks_cli.cli, ["status", "--json"]).stdout)
    assert [w["label"] for w in cli["workers"]] == ["online", "gone"]
    shown = CliRunner().invoke(tasks_cli.cli, ["status"], env={"COLUMNS": "200"}).stdout
    assert "Workers (every host)" in shown and "build-server" in shown and str(dead.pid) in shown
    dead_row = next(row for row in shown.splitlines() if str(dead.pid) in row)
    # the dead worker's last words are not shown as what it does now (found by new-user tests)
    assert "gone since" in dead_row and "was running" in dead_row and "none now (had t_0001)" in dead_row, dead_row
    # the local heartbeat file still tells this machine's last worker
    assert task_store.read_worker_heartbeat()["host"] == "build-server"


def test_a_new_worker_replaces_its_hosts_stopped_ones_and_keeps_the_dead(tmp_path):
    for state in ("running", "stopped"):
        subprocess.run([sys.executable, "-c", "import task_store; task_store.write_worker_heartbeat("
                        f"{{'state': '{state}'}})"], cwd=Path(task_store.__file__).parent, check=True)
    assert sorted(r["state"] for r in task_store.list_workers()) == ["running", "stopped"]
    task_store.write_worker_heartbeat({"state": "starting"})
    task_store.write_worker_heartbeat({"state": "idle"})
    assert [r["state"] for r in task_store.list_workers()] == ["idle", "running"]


@pytest.mark.real_opencode
def test_a_real_run_shipped_from_machine_a_reads_whole_on_machine_b(opencode, tmp_path, monkeypatch, in_db):
    from fake_openai import text
    from helpers import make_repo
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("say", [text("Hello from machine A " + HOSTILE + "\n```json\n{\"summary\": \"said it\", "
                                       "\"files_touched\": [], \"tests_run\": [], \"open_questions\": []}\n```")])
    task_store.submit_task(title="say", instructions="SCRIPT:say", working_dir=str(repo))
    on_machine(monkeypatch, tmp_path, "machine-a")
    final = worker.run_task(task_store.claim_next("worker:machine-a:1"), worker.Knobs())
    assert final["status"] == "done", final["error"]
    written = task_store.log_path(final["id"]).read_bytes()
    assert b"Hello from machine A" in written
    on_machine(monkeypatch, tmp_path, "machine-b")
    raw = CliRunner().invoke(tasks_cli.cli, ["logs", final["id"], "--raw"])
    assert raw.exit_code == 0 and raw.stdout_bytes == written
    assert bridge.get_task_logs(final["id"], offset=0, max_bytes=65_536)["text"].encode() == written
    entries = board_api.task_log(final["id"], None)["entries"]
    assert any(e["kind"] == "text" and HOSTILE in e["text"] for e in entries)
    assert any(e["kind"] == "attempt" for e in entries)


@pytest.mark.postgres
@pytest.mark.real_opencode
def test_a_worker_process_ships_its_log_live_to_a_reader_on_another_machine(opencode, tmp_path, monkeypatch, pg_url):
    import signal
    import time

    import psutil

    from fake_openai import hang, tool_call
    from helpers import make_repo
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("live", [tool_call("bash", {"command": "echo shipped-live-$((6*7))", "description": "say"}),
                                   hang()])
    tid = task_store.submit_task(title="live", instructions="SCRIPT:live", working_dir=str(repo),
                                 timeout_sec=300, max_retries=0)["id"]
    folder_a = tmp_path / "machine-a" / "task_logs"
    proc = subprocess.Popen([sys.executable, str(Path(worker.__file__))],
                            env=dict(os.environ, TASK_LOG_DIR=str(folder_a)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder_b = on_machine(monkeypatch, tmp_path, "machine-b")
    try:
        deadline = time.monotonic() + 90
        while b"shipped-live-42" not in task_store.read_task_log(tid) and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = task_store.read_task_log(tid)
        assert b"shipped-live-42" in seen and seen.startswith(b"=== br-"), seen[:300]
        running = [w for w in task_views.workers_state() if w["pid"] == proc.pid]
        assert running and running[0]["tasks"] == [tid] and running[0]["label"] == "online"
        page = bridge.get_task_logs(tid, tail_lines=50)
        assert "shipped-live-42" in page["text"] and page["size"] >= len(seen)
        agent = task_store.get_task(tid)["agent_pid"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    assert worker.reap(worker.Knobs()) == 1               # the orphaned agent is ended, the task failed
    assert not psutil.pid_exists(agent) or psutil.Process(agent).status() == psutil.STATUS_ZOMBIE
    local = (folder_a / f"{tid}.log").read_bytes()
    # The reaper's own line, where every machine reads the log, says how the attempt ended.
    shipped, _, reaped = task_store.read_task_log(tid).rpartition(b"\n[worker] lease of attempt ")
    assert reaped.endswith(b"the reaper ended it: failed, its retries spent\n"), reaped
    assert local.startswith(shipped) and b"shipped-live-42" in shipped   # at most the unshipped tail is lost
    assert not folder_b.exists()
    assert [w["label"] for w in task_views.workers_state() if w["pid"] == proc.pid] == ["gone"]


def test_an_unchanged_heartbeat_refreshes_the_worker_row_only_every_few_seconds(tmp_path, monkeypatch):
    task_store.write_worker_heartbeat({"state": "idle"})
    first = task_store.list_workers()[0]["ts"]
    task_store.write_worker_heartbeat({"state": "idle"})                 # a second later in the worker
    assert task_store.list_workers()[0]["ts"] == first
    assert task_store.read_worker_heartbeat()["ts"] > first              # the local file is always fresh
    task_store.write_worker_heartbeat({"state": "running", "task": "t_0001"})
    assert task_store.list_workers()[0]["state"] == "running"            # a change is written at once
    monkeypatch.setattr(task_store, "WORKER_ROW_EVERY_SEC", 0)
    task_store.write_worker_heartbeat({"state": "running", "task": "t_0001"})
    assert task_store.list_workers()[0]["ts"] > first


def test_doctor_names_every_worker_and_its_host(tmp_path, monkeypatch):
    import doctor
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "build-server")
        task_store.write_worker_heartbeat({"state": "idle"})
    dead = subprocess.Popen([sys.executable, "-c", "import task_store; task_store.write_worker_heartbeat("
                             "{'state': 'running', 'task': 't_0001'})"], cwd=Path(task_store.__file__).parent)
    dead.wait()
    check = doctor.check_worker()
    assert "2 workers report" in check.detail and f"build-server pid {os.getpid()} online" in check.detail
    assert f"{task_store.host_name()} pid {dead.pid} gone" in check.detail


@pytest.mark.postgres
def test_ships_go_on_after_the_server_dropped_the_connection(tmp_path, monkeypatch, pg_server, pg_url):
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    tid = submit(tmp_path)["id"]
    database = pg_url.rsplit("/", 1)[1].split("?")[0]
    with task_store.open_task_log(tid) as log:
        shipper = worker.LogShipper(tid, log)
        log.write(b"one\n")
        shipper.ship()
        pg_server.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")
        for line in (b"two\n", b"three\n"):
            log.write(line)
            shipper.ship()                   # the first may fail on the dead connection; the next retries
    assert task_store.read_task_log(tid) == b"one\ntwo\nthree\n"


def test_a_new_queue_in_place_of_a_moved_one_never_shows_the_old_tasks_logs(tmp_path):
    # doctor's way out for a broken file is to move it aside; the new queue numbers from t_0001
    # again, and its t_0001 showed the old t_0001's run first (found by a new-user test).
    old = submit(tmp_path, title="old")
    task_store.append_task_log(old["id"], b"the old queue's run\n")
    db = task_store.db_path()
    moved = tmp_path / "moved"
    moved.mkdir()
    for part in db.parent.glob(db.name + "*"):
        part.rename(moved / part.name)
    # A later command's process (this one, having had the file open, refuses a queue it lost: QueueGone)
    task_store.close_connections()
    new = submit(tmp_path, title="new")
    assert new["id"] == old["id"], "the premise: a new queue reuses the id"
    assert task_store.read_task_log(new["id"]) == b""
    task_store.append_task_log(new["id"], b"the new run\n")
    assert task_store.read_task_log(new["id"]) == b"the new run\n"
    (aside,) = task_store.log_dir().glob("earlier-*/")
    assert (aside / f"{old['id']}.log").read_bytes() == b"the old queue's run\n"
    assert oct(aside.stat().st_mode & 0o777) == "0o700"


def _new_queue_beside(tmp_path, monkeypatch, name="c.db"):
    """Point this process at a second queue file (not made yet) with the same TASK_LOG_DIR."""
    task_store.close_connections()
    monkeypatch.setenv("TASK_DB_PATH", str(tmp_path / "q" / name))
    return tmp_path / "q" / name


def test_a_new_queue_never_moves_or_writes_the_logs_of_another_live_queue_in_its_log_folder(tmp_path, monkeypatch):
    # A tester's finding: any new queue made while TASK_LOG_DIR named a live queue's folder moved
    # every log there into earlier-…/, a running task's too (its worker wrote on into the moved file).
    first = task_store.db_path()
    old = submit(tmp_path, title="live")
    running = task_store.open_task_log(old["id"])   # a worker's handle on the running task's log
    running.write(b"before\n")
    running.flush()
    assert task_store.log_folder_queue() == first
    mark = task_store.log_dir() / task_store.LOG_FOLDER_MARK
    assert oct(mark.stat().st_mode & 0o777) == "0o600"
    other = _new_queue_beside(tmp_path, monkeypatch)
    with pytest.raises(task_store.LogFolderTaken) as refused:
        submit(tmp_path, title="new")
    said = str(refused.value)
    assert f"TASK_LOG_DIR {task_store.log_dir()} holds the logs of the queue {first}, not of {other}" in said
    assert "a log folder of its own" in said and "unset it" in said and "\n" not in said
    assert not other.exists(), "no queue was made"
    assert not list(task_store.log_dir().glob("earlier-*")), "nothing was moved"
    running.write(b"after\n")
    running.close()
    monkeypatch.setenv("TASK_DB_PATH", str(first))
    task_store.close_connections()
    assert task_store.read_task_log(old["id"]) == b"before\nafter\n"
    # Given a folder of its own (TASK_LOG_DIR unset: <db>_logs), the new queue is made
    monkeypatch.setenv("TASK_DB_PATH", str(other))
    monkeypatch.delenv("TASK_LOG_DIR")
    task_store.close_connections()
    assert submit(tmp_path, title="new")["id"] == old["id"]


def test_the_cli_refuses_a_new_queue_in_another_queues_log_folder_in_one_line(tmp_path):
    first = task_store.db_path()
    old = submit(tmp_path, title="live")
    task_store.append_task_log(old["id"], b"the live queue's run\n")
    task_store.close_connections()
    other = tmp_path / "q" / "c.db"
    (tmp_path / "work").mkdir()
    result = subprocess.run([sys.executable, str(Path(tasks_cli.__file__).parent / "tasks_cli.py"), "--db",
                             str(other), "submit", "x", "--dir", str(tmp_path / "work"), "--yes"],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"holds the logs of the queue {first}" in result.stderr and "Traceback" not in result.stderr
    assert not other.exists()
    assert sorted(p.name for p in task_store.log_dir().iterdir()) == [task_store.LOG_FOLDER_MARK, f"{old['id']}.log"]


def test_an_existing_queues_log_folder_without_a_mark_is_marked_on_first_use(tmp_path, monkeypatch):
    # A log folder made before folders named their queue: the queue carries on, and its folder
    # says whose it is from its first use on.
    first = task_store.db_path()
    old = submit(tmp_path, title="old")
    task_store.append_task_log(old["id"], b"run\n")
    task_store.close_connections()
    (task_store.log_dir() / task_store.LOG_FOLDER_MARK).unlink()
    assert task_store.get_task(old["id"])["title"] == "old"
    assert task_store.log_folder_queue() == first
    assert task_store.read_task_log(old["id"]) == b"run\n"
    # Unmarked, holding logs: a new queue there cannot tell whose they are, and moves nothing
    (task_store.log_dir() / task_store.LOG_FOLDER_MARK).unlink()
    _new_queue_beside(tmp_path, monkeypatch)
    with pytest.raises(task_store.LogFolderTaken, match="holds task logs .* of a queue it does not name"):
        submit(tmp_path, title="new")
    assert task_store.log_path(old["id"]).read_bytes() == b"run\n"


def test_a_queue_moved_to_another_path_takes_its_log_folder_along(tmp_path, monkeypatch):
    old = submit(tmp_path, title="old")
    task_store.append_task_log(old["id"], b"run\n")
    task_store.close_connections()
    moved = tmp_path / "q" / "renamed.db"
    task_store.db_path().rename(moved)
    monkeypatch.setenv("TASK_DB_PATH", str(moved))
    assert task_store.read_task_log(old["id"]) == b"run\n" and task_store.get_task(old["id"])["title"] == "old"
    assert task_store.log_folder_queue() == moved


def test_a_new_queue_in_place_of_a_moved_one_sets_aside_its_default_unmarked_log_folder(tmp_path, monkeypatch):
    # An install from before log folders were marked, TASK_LOG_DIR unset (<db>_logs): the replaced
    # queue's logs are still set aside.
    monkeypatch.delenv("TASK_LOG_DIR")
    old = submit(tmp_path, title="old")
    task_store.append_task_log(old["id"], b"old run\n")
    task_store.close_connections()
    (task_store.log_dir() / task_store.LOG_FOLDER_MARK).unlink()
    db = task_store.db_path()
    (tmp_path / "moved").mkdir()
    for part in db.parent.glob(db.name + "*"):
        part.rename(tmp_path / "moved" / part.name)
    new = submit(tmp_path, title="new")
    assert new["id"] == old["id"] and task_store.read_task_log(new["id"]) == b""
    (aside,) = task_store.log_dir().glob("earlier-*/")
    assert (aside / f"{old['id']}.log").read_bytes() == b"old run\n"


def test_logs_of_a_task_whose_log_folder_went_mid_run_say_the_log_is_missing(opencode, tmp_path):
    """A fresh user's finding: the log folder deleted while the task ran, `logs` said "no worker
    ever ran it". It says the log is missing, where it was expected, and that a worker ran the
    task; a task claimed whose run never started (its folder gone) is told apart from both."""
    import shutil

    from fake_openai import text, tool_call
    from helpers import make_repo, run_script, until

    repo = make_repo(tmp_path / "repo")
    done = '```json\n{"summary": "ok", "files_touched": [], "tests_run": [], "open_questions": []}\n```'
    opencode.model.script("slow", [tool_call("bash", {"command": "sleep 2", "description": "wait"}),
                                   text("Done.\n" + done)])
    task = submit(repo, script="slow")
    worker_pass = subprocess.Popen([sys.executable, str(Path(tasks_cli.__file__).parent / "worker.py")],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    until(lambda: b"sleep 2" in task_store.read_task_log(task["id"]), what="the run's first tool call in its log")
    shutil.rmtree(task_store.log_dir(), ignore_errors=True)   # the worker's run folders in it may go meanwhile
    assert not task_store.log_path(task["id"]).exists()
    worker_pass.communicate(timeout=120)
    assert task_store.get_task(task["id"])["status"] == "done"
    said = CliRunner().invoke(tasks_cli.cli, ["logs", task["id"]])
    where = str(task_store.log_path(task["id"]))
    assert said.exit_code == 0 and "Traceback" not in said.output, said.output
    words = " ".join(said.stderr.split())
    assert "no worker ever ran it" not in words, words
    assert f"{task['id']}'s log is missing: it was expected at {where}" in words, words
    assert "a worker did run the task (1 attempt(s); it is done)" in words and f"show {task['id']}" in words, words

    gone = tmp_path / "gone"
    gone.mkdir()
    never = submit(gone, script="slow", max_retries=0)
    gone.rmdir()
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(never["id"])["status"] == "failed"
    words = " ".join(CliRunner().invoke(tasks_cli.cli, ["logs", never["id"]]).stderr.split())
    assert "no worker ever ran it" not in words and "is missing" not in words, words
    assert "a worker claimed it (1 attempt(s); it is failed) but no attempt got as far as starting its agent" in words
