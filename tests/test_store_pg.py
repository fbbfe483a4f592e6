"""The queue on PostgreSQL (a real server, tests/pg_server.py): many processes claim without a
double claim, an events cursor never skips an id under concurrent writers, a commit elsewhere
wakes a waiter through NOTIFY, migrations run on an empty database, forked children never touch
their parent's connection, and a bad URL, an unreachable server or a missing driver is one line
naming the URL without its password."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import store_pg
import task_store as store
from helpers import ROOT
from pg_server import PASSWORD

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg(pg_url, monkeypatch):
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    return pg_url


def _claimer(url: str, name: str, out: multiprocessing.Queue) -> None:
    os.environ["TASK_DB_URL"] = url
    got = []
    while (task := store.claim_next(name)) is not None:
        store.complete_attempt(task["id"], task["run_marker"])
        got.append(task["id"])
    out.put(got)


def test_forked_processes_claim_concurrently_and_never_twice(pg, tmp_path):
    for _ in range(15):
        store.submit_batch([{"title": "t", "instructions": "i", "working_dir": str(tmp_path)}] * 20)
    before = store.last_event_id()    # the parent's kept connection exists before the forks
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(pg, f"w{i}", out)) for i in range(8)]
    for proc in procs:
        proc.start()
    claimed = [tid for _ in procs for tid in out.get(timeout=120)]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert len(claimed) == 300 and len(set(claimed)) == 300
    # The children opened their own connections: the parent's still works after they exited.
    assert store.counts()["done"] == 300 and store.last_event_id() > before
    assert len({e["task_id"] for e in store.events_since(before, limit=10_000) if e["kind"] == "claimed"}) == 300


WRITER = r"""
import os, sys, task_store as store
os.environ["TASK_DB_URL"] = sys.argv[1]
for i in range(int(sys.argv[2])):
    task = store.submit_task(title="w", instructions="i", working_dir=sys.argv[3])
    claimed = store.claim_next("w", task_id=task["id"])
    if claimed is not None:
        store.add_note(task["id"], "n") if i % 2 else None
        store.complete_attempt(task["id"], claimed["run_marker"])
"""


def test_an_events_cursor_never_skips_an_id_under_concurrent_writers(pg, tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, pg, "60", str(tmp_path)], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True) for _ in range(4)]
    seen, cursor = [], 0
    while any(w.poll() is None for w in writers):
        batch = store.events_since(cursor, limit=10_000)
        seen += [e["id"] for e in batch]
        cursor = batch[-1]["id"] if batch else cursor
    for w in writers:
        assert w.wait(60) == 0, w.stderr.read()
    seen += [e["id"] for e in store.events_since(cursor, limit=10_000)]
    every = [e["id"] for e in store.events_since(0, limit=10_000)]
    assert len(every) == 4 * 60 * 3 + 4 * 30   # submitted, claimed, done; a note every other task
    # Read while they were written, by cursor only: each id once, none skipped.
    assert seen == every


WAKER = r"""
import os, sys, time, task_store as store
os.environ["TASK_DB_URL"] = sys.argv[1]
store.last_event_id()                  # connected before the clock starts
time.sleep(float(sys.argv[2]))
began = time.time()
store.submit_task(title="later", instructions="i", working_dir=sys.argv[3])
print(began, time.time(), flush=True)   # the commit is done by the second
"""


def test_a_commit_in_another_process_wakes_the_wait_within_100_ms(pg, tmp_path):
    since = store.last_event_id()
    lags = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WAKER, pg, "0.7", str(tmp_path)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        newest = store.wait_for_change(since, timeout=20, poll=5)
        woke = time.time()
        began, committed = map(float, proc.communicate(timeout=30)[0].split())
        assert newest > since and woke > began
        lags.append(woke - committed)
        since = store.last_event_id()
    # The poll is 5 s: only the NOTIFY explains a wake within 100 ms of the commit (best of three
    # on a busy machine; the child's clock reading after its commit may even come after the wake).
    assert min(lags) < 0.1, lags


def test_migrations_run_on_an_empty_database_and_once(pg_server, pg, monkeypatch):
    url = pg_server.create_database("empty_db")
    try:
        monkeypatch.setenv("TASK_DB_URL", url)
        assert store.counts()["pending"] == 0
        conn = store.connect()
        try:
            assert conn.execute("SELECT version FROM schema_version").fetchall() == [(len(store.MIGRATIONS),)]
            columns = {r[0] for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'tasks'")}
            assert {"continue_from", "max_cost_usd", "repo_url", "host", "pushed_commit"} <= columns
            assert conn.execute("SELECT to_regclass('task_counts')").fetchone()[0] is None
        finally:
            conn.close()
    finally:
        store.close_connections()
        pg_server.drop_database("empty_db")


def test_store_sql_is_adapted_once_and_rows_read_like_sqlite(pg):
    assert store.pg_sql("SELECT a::text, '50%?:x' FROM t WHERE b = ? AND c = :name AND d LIKE '%z'") == \
        "SELECT a::text, '50%%?:x' FROM t WHERE b = %s AND c = %(name)s AND d LIKE '%%z'"
    conn = store._kept()
    row = conn.execute("SELECT 1 AS one, 'x' AS two, '%' AS pct WHERE 1 = ?", (1,)).fetchone()
    assert conn.execute("SELECT CAST(:n AS bigint) AS four", {"n": 4}).fetchone()["four"] == 4
    assert row["one"] == row[0] == 1 and dict(row) == {"one": 1, "two": "x", "pct": "%"}
    assert list(row) == [1, "x", "%"] and row.keys() == ["one", "two", "pct"]


@pytest.mark.parametrize("url", [
    "postgresql://bob:{pw}@127.0.0.1:{port}/nodb",                 # nothing listens there
    "postgresql://bob:{pw}@127.0.0.1:notaport/db",                 # not a URL libpq takes
    "postgres://taskbridge:wrong-{pw}@127.0.0.1:{server}/postgres",  # the server refuses the login
    "postgresql://taskbridge@127.0.0.1:{server}/postgres?password={pw}&sslmode=disable",
])
def test_a_bad_url_is_one_line_naming_it_without_the_password(pg_server, monkeypatch, url):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = url.format(pw="s3cr3t-pw", port=port, server=pg_server.port)
    if "?password=" in url:   # a wrong password given as a parameter
        url = url.replace("password=s3cr3t-pw", "password=s3cr3t-pw-x")
    monkeypatch.setenv("TASK_DB_URL", url)
    assert "s3cr3t" not in store.database_label() and store.backend() == "postgresql"
    with pytest.raises(store.DatabaseUnavailable) as caught:
        store.list_tasks()
    said = str(caught.value)
    assert "s3cr3t" not in said and store.database_label() in said and "TASK_DB_URL" in said, said
    assert "\n" not in said
    import tasks_cli
    result = CliRunner().invoke(tasks_cli.cli, ["list"])
    # The CLI refuses it in one line too (a bad port already when it checks --db / TASK_DB_URL).
    assert result.exit_code in (1, 2) and "s3cr3t" not in result.output and "Traceback" not in result.output
    assert result.output.count("\n") == 1 and "TASK_DB_URL" in result.output


def test_the_password_never_shows_in_labels_health_or_status(pg_server, pg, monkeypatch, tmp_path):
    assert PASSWORD in pg
    assert PASSWORD not in store.database_label() and store.database_label().startswith("postgresql://taskbridge@")
    assert PASSWORD not in store.database_health()["path"]
    assert store.redact_url("postgresql://u:p%40ss@h:5/d?sslmode=require&password=zz") == \
        "postgresql://u@h:5/d?sslmode=require"
    proc = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "status"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=os.environ | {"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr and store.database_label() in proc.stdout + proc.stderr
    import tasks_cli
    shown = CliRunner().invoke(tasks_cli.cli, ["status", "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["db"] == store.database_label()


def test_missing_psycopg_is_one_line_with_the_way_out(monkeypatch):
    monkeypatch.setenv("TASK_DB_URL", "postgresql://bob:s3cr3t@db.example:5432/queue")
    monkeypatch.setitem(sys.modules, "psycopg", None)   # `import psycopg` raises ImportError
    with pytest.raises(store.DatabaseUnavailable, match="psycopg is not installed: run ./install.sh") as caught:
        store.counts()
    assert "s3cr3t" not in str(caught.value) and "postgresql://bob@db.example:5432/queue" in str(caught.value)


def test_a_dropped_connection_is_reopened_without_failing_the_call(pg_server, pg, tmp_path):
    task = store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    claimed = store.claim_next("w")

    def drop() -> int:
        pid = store._kept().raw.info.backend_pid
        pg_server.execute(f"SELECT pg_terminate_backend({pid})")   # as a server restart would
        time.sleep(0.1)
        return pid

    first = drop()
    assert store.counts()["running"] == 1                    # a read: logged in again, run once more
    second = drop()
    store.renew_lease(task["id"], claimed["run_marker"])     # a write: its BEGIN is run again
    assert len({first, second, store._kept().raw.info.backend_pid}) == 3
    store._kept().execute("BEGIN")                          # but never inside a transaction
    drop()
    with pytest.raises(store.DatabaseUnavailable, match="cannot use the PostgreSQL queue"):
        store._kept().execute("SELECT 1")
    assert store.get_task(task["id"])["status"] == "running"   # the next call has a new connection


def test_doctor_reports_the_server_or_the_way_out(pg, monkeypatch):
    import doctor
    check = doctor.check_database()
    assert check.status == "ok" and check.detail.startswith(store.database_label() + ": 0 task(s), PostgreSQL ")
    monkeypatch.setenv("TASK_DB_URL", pg.rsplit(":", 1)[0] + ":1/nowhere")
    check = doctor.check_database()
    assert check.status == "fail" and PASSWORD not in check.detail + check.fix and "TASK_DB_URL" in check.fix


def _listener_pid(out: multiprocessing.Queue) -> None:
    with store.change_watch() as watch:
        out.put((watch.available, watch.conn.info.backend_pid))


def test_a_change_watch_reuses_the_process_listen_connection_not_a_forked_parents(pg, tmp_path):
    with store.change_watch() as first:
        pid = first.conn.info.backend_pid
    store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))   # notified while idle
    time.sleep(0.3)   # delivery is asynchronous: a notice still on its way may wake a waiter once (harmless)
    with store.change_watch() as again:
        assert again.conn.info.backend_pid == pid       # no new login per wait
        assert not again.wait(0.2), "an old notification was left for the next waiter"
        store.submit_task(title="u", instructions="i", working_dir=str(tmp_path))
        assert again.wait(5)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_listener_pid, args=(out,))
    child.start()
    available, child_pid = out.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0 and available and child_pid != pid
    with store.change_watch() as mine:                  # the parent's is untouched by the child
        assert mine.conn.info.backend_pid == pid and not mine.wait(0.1)


def test_a_write_waiting_too_long_for_the_lock_is_busy_not_a_traceback(pg, monkeypatch, tmp_path):
    import psycopg
    monkeypatch.setattr(store_pg, "PG_LOCK_TIMEOUT_SEC", 0.5)
    store.close_connections()
    task = store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    other_task = store.submit_task(title="u", instructions="i", working_dir=str(tmp_path))
    with psycopg.connect(pg, autocommit=True) as other:   # another process in the middle of a write
        other.execute("BEGIN")
        other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (store.parse_task_id(task["id"]),))
        started = time.monotonic()
        with pytest.raises(store.DatabaseBusy, match="is busy .*nothing was written: try again") as caught:
            store.add_note(task["id"], "waits")
        assert 0.4 < time.monotonic() - started < 5 and PASSWORD not in str(caught.value)
        # No global lock: a write to another task goes through, and a claim skips the locked row.
        store.add_note(other_task["id"], "goes through")
        assert store.claim_next("w")["id"] == other_task["id"]
        other.execute("ROLLBACK")
    store.add_note(task["id"], "now it goes")          # the same kept connection, usable again
    assert [n["text"] for n in store.get_task(task["id"])["notes"]] == ["now it goes"]


def test_the_board_answers_503_naming_an_unreachable_queue(monkeypatch):
    from starlette.testclient import TestClient

    import opencode_bridge_mcp as bridge
    monkeypatch.setenv("MCP_BEARER_TOKEN", "board-token")
    monkeypatch.setenv("TASK_DB_URL", "postgresql://bob:s3cr3t@127.0.0.1:1/queue")
    client = TestClient(bridge.build_app(), base_url="http://127.0.0.1:8765")
    answer = client.get("/api/tasks", headers={"Authorization": "Bearer board-token"})
    assert answer.status_code == 503, answer.text
    assert "postgresql://bob@127.0.0.1:1/queue" in answer.json()["error"] and "s3cr3t" not in answer.text


def _drop_inherited(out: multiprocessing.Queue) -> None:
    import gc
    store.counts()                         # the child's own connection
    store._INHERITED.clear()               # the parent's copies finalised here (libpq says goodbye)
    store_pg._INHERITED.clear()
    gc.collect()
    out.put("ok")


def test_a_forked_child_finalising_its_parents_connections_leaves_them_working(pg, tmp_path):
    store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    pid = store._kept().raw.info.backend_pid
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_drop_inherited, args=(out,))
    child.start()
    assert out.get(timeout=30) == "ok"
    child.join(30)
    assert child.exitcode == 0
    assert store.counts()["pending"] == 1 and store._kept().raw.info.backend_pid == pid


@pytest.mark.parametrize("url", [
    "postgresql://taskbridge@127.0.0.1:5432?password=S3cretPW&dbname=q",   # no path: the query follows the port
    "postgresql://taskbridge@127.0.0.1:5432/q?%70assword=S3cretPW",        # libpq decodes the key
    "postgresql://taskbridge@127.0.0.1:5432/q?sslmode=require&sslpassword=S3cretPW",
    "postgresql://taskbridge:S3cretPW@127.0.0.1:5432/q?application_name=x&PASSWORD=S3cretPW",
    "postgres://taskbridge:S3%63retPW@127.0.0.1:5432/q",
])
def test_no_spelling_of_a_password_shows_in_the_label_or_an_error(url, monkeypatch):
    """A fresh user saw ?password= after a path-less URL, %70assword= and sslpassword= shown by
    `status`, `connect` and the schedule; only the parameters known to be harmless are shown now."""
    monkeypatch.setenv("TASK_DB_URL", url)
    label = store.database_label()
    assert "S3cret" not in label and "S3%63ret" not in label
    assert label.startswith(url.partition(":")[0] + "://taskbridge@127.0.0.1:5432")
    said = str(store_pg.unavailable(url, RuntimeError(f"server said: {url} S3cretPW")))
    assert "S3cret" not in said and "S3%63ret" not in said and "***" in said


def test_shown_parameters_survive_redaction():
    assert store.redact_url("postgresql://u@h:5/d?sslmode=require&application_name=tb&password=x") == \
        "postgresql://u@h:5/d?sslmode=require&application_name=tb"
    assert store.redact_url("/srv/queue/tasks.db") == "/srv/queue/tasks.db"


DSN = "host=127.0.0.1 port=5432 password=S3cretPW dbname=taskbridge user=taskbridge"


@pytest.mark.parametrize("value", [DSN, ""])
def test_a_keyword_dsn_or_an_empty_url_is_refused_and_makes_no_file(value, tmp_path):
    """A libpq key=value string was taken for a SQLite file name (the worker made
    '<checkout>/host=127.0.0.1 port=… password=…' and its lock files); an empty TASK_DB_URL, as a
    service unit makes from an unset variable, quietly ran a private SQLite queue."""
    env = {k: v for k, v in os.environ.items() if k != "TASK_DB_PATH"} | {"TASK_DB_URL": value}
    for script in ("worker.py", "tasks_cli.py"):
        args = [sys.executable, str(ROOT / script)] + (["status"] if script == "tasks_cli.py" else [])
        proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2, (script, proc.stdout, proc.stderr)
        said = proc.stdout + proc.stderr
        assert "TASK_DB_URL" in said and "S3cret" not in said and "Traceback" not in said
        assert ("key=value" in said) if value else ("empty" in said)
    assert list(tmp_path.iterdir()) == [] and not (ROOT / DSN).exists()
    with pytest.raises(store.ValidationError, match="libpq key=value"):
        store._sqlite_setting(DSN)


def test_a_role_that_may_not_create_the_tables_gets_one_line_with_the_fix(pg_server, tmp_path):
    """PostgreSQL 15 gives PUBLIC no CREATE on schema public: a login role that does not own the
    database could not migrate it, and the CLI and the worker printed psycopg's traceback."""
    pg_server.execute("DROP ROLE IF EXISTS tb_limited")
    pg_server.execute("CREATE ROLE tb_limited LOGIN PASSWORD 'LimitedPW'")
    url = pg_server.create_database("tb_not_owned")
    try:
        limited = url.replace(url.split("://", 1)[1].split("@", 1)[0], "tb_limited:LimitedPW")
        env = os.environ | {"TASK_DB_URL": limited}
        for args in (["tasks_cli.py", "status"], ["worker.py"]):
            proc = subprocess.run([sys.executable, str(ROOT / args[0]), *args[1:]], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60, env=env)
            said = proc.stdout + proc.stderr
            assert proc.returncode != 0 and "Traceback" not in said, said
            assert "permission denied" in said and "GRANT CREATE ON SCHEMA public" in said
            assert "LimitedPW" not in said
    finally:
        pg_server.drop_database("tb_not_owned")
        pg_server.execute("DROP ROLE IF EXISTS tb_limited")


LATE_TRIGGER = """
CREATE FUNCTION hold_late() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.message LIKE '%hold me%' THEN PERFORM pg_advisory_xact_lock(4242); END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER hold_late AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION hold_late();
"""


def test_an_event_that_commits_late_is_never_skipped_by_a_cursor(pg, tmp_path):
    import threading

    import psycopg
    late_task = store.submit_task(title="late", instructions="i", working_dir=str(tmp_path))
    early_task = store.submit_task(title="early", instructions="i", working_dir=str(tmp_path))
    with psycopg.connect(pg, autocommit=True) as test:
        test.execute(LATE_TRIGGER)   # a real store write that holds its event, then commits last
        test.execute("SELECT pg_advisory_lock(4242)")
        cursor, seen = store.last_event_id(), []
        late = threading.Thread(target=store.add_note, args=(late_task["id"], "hold me"))
        late.start()
        while not test.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory'").fetchone():
            time.sleep(0.01)
        store.add_note(early_task["id"], "goes first")   # commits while the late one is open
        # No global lock either: another task's claim and renewals go on beside the open write.
        claimed = store.claim_next("w", task_id=early_task["id"])
        started = time.monotonic()
        for _ in range(5):
            store.renew_lease(claimed["id"], claimed["run_marker"])
        assert time.monotonic() - started < 2
        for _ in range(3):
            batch = store.events_since(cursor)
            seen += batch
            cursor = batch[-1]["id"] if batch else cursor
        assert seen == [] and store.last_event_id() == cursor   # nothing past the open transaction
        test.execute("SELECT pg_advisory_unlock(4242)")
        late.join(10)
    assert store.wait_for_change(cursor, timeout=5) > cursor
    seen += store.events_since(cursor)
    assert [e["message"] for e in seen] == ["planner: hold me", "planner: goes first", "attempt 1 by w"]
    every = store.events_since(0, limit=10_000)
    assert [e["id"] for e in every] == sorted(e["id"] for e in every) and every[-3:] == seen


MIXED = r"""
import json, os, sys, time, task_store as store
os.environ["TASK_DB_URL"] = sys.argv[1]
store.RETRY_BACKOFF_SEC = (0.01, 0.01)
name, got = sys.argv[2], []
while True:
    task = store.claim_next(name)
    if task is None:
        if not store.counts().get("pending"):
            break
        time.sleep(0.01)   # a retry backing off
        continue
    got.append([task["id"], task["attempts"]])
    store.renew_lease(task["id"], task["run_marker"])
    if task["attempts"] == 1 and int(task["id"][2:]) % 3 == 0:
        store.fail_attempt(task["id"], task["run_marker"], "once more")
    else:
        store.complete_attempt(task["id"], task["run_marker"])
print(json.dumps(got))
"""


def test_sixteen_claimers_that_retry_and_finish_never_claim_an_attempt_twice(pg, tmp_path):
    for _ in range(6):
        store.submit_batch([{"title": "t", "instructions": "i", "working_dir": str(tmp_path),
                             "max_retries": 1}] * 20)
    procs = [subprocess.Popen([sys.executable, "-c", MIXED, pg, f"w{i}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(16)]
    claimed = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        claimed += [tuple(c) for c in json.loads(out)]
    retried = {f"t_{n:04d}" for n in range(1, 121) if n % 3 == 0}
    assert sorted(claimed) == sorted([(f"t_{n:04d}", 1) for n in range(1, 121)] + [(t, 2) for t in retried])
    assert store.counts()["done"] == 120
    kinds = [e["kind"] for e in store.events_since(0, limit=10_000)]
    assert kinds.count("claimed") == 160 and kinds.count("retry") == 40 and kinds.count("done") == 120


class _Counted:
    """A psycopg connection that counts the statements sent on it (each one round trip)."""

    def __init__(self, raw, sent: list) -> None:
        self._raw, self._sent = raw, sent

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def execute(self, query, *args, **kwargs):
        self._sent.append(query)
        return self._raw.execute(query, *args, **kwargs)


def test_the_hot_calls_are_one_statement_each_and_still_evented_and_fenced(pg, tmp_path):
    store.last_event_id()
    sent: list = []
    store._kept().raw = _Counted(store._kept().raw, sent)

    def trips(call):
        before = len(sent)
        return call(), len(sent) - before

    with store.change_watch() as watch:
        task, submit_trips = trips(lambda: store.submit_task(title="t", instructions="i", working_dir=str(tmp_path)))
        claimed, claim_trips = trips(lambda: store.claim_next("w"))
        assert claimed["id"] == task["id"] and claimed["depends_on"] == [] and watch.wait(5)
        _, renew_trips = trips(lambda: store.renew_lease(task["id"], claimed["run_marker"]))
        size, ship_trips = trips(lambda: store.append_task_log(task["id"], b"step\n", at=0))
        done, done_trips = trips(lambda: store.complete_attempt(task["id"], claimed["run_marker"],
                                                                usage={"cost_usd": 0.5, "steps": 1}))
    # Before: 4, 6, 1, 6 and 4 (BEGIN, reads, the write, COMMIT each); then 2 for submit (it read the
    # default limits first).
    assert (submit_trips, claim_trips, renew_trips, ship_trips, done_trips) == (1, 1, 1, 1, 2)
    assert size == 5 and store.read_task_log(task["id"]) == b"step\n"
    assert done["status"] == "done" and done["spent_usd"] == 0.5 and "notified" not in done
    assert [e["kind"] for e in store.events_since(0)] == ["submitted", "claimed", "done"]
    with pytest.raises(store.StaleAttempt, match="task is now done"):   # the one statement is fenced
        store.complete_attempt(task["id"], claimed["run_marker"])
    # A queue with default limits: the one statement writes nothing, and the task is written with them.
    store.set_budget(default_max_tokens=5000)
    limited, trips_taken = trips(lambda: store.submit_task(title="d", instructions="i", working_dir=str(tmp_path)))
    own = store.submit_task(title="o", instructions="i", working_dir=str(tmp_path), max_cost_usd=2)
    assert (limited["max_cost_usd"], limited["max_tokens"], trips_taken) == (None, 5000, 3)
    assert (own["max_cost_usd"], own["max_tokens"]) == (2.0, None)   # its own limit replaces the defaults
    assert [e["kind"] for e in store.events_since(0)].count("submitted") == 3


def test_a_claim_still_stops_at_a_spent_daily_budget_and_waits_for_dependencies(pg, tmp_path):
    first = store.submit_task(title="a", instructions="i", working_dir=str(tmp_path))
    store.set_budget(daily_usd=1)
    claimed = store.claim_next("w")   # a budget set but not spent: claimed in the checking transaction
    store.record_spend(first["id"], claimed["run_marker"], 2.0, 10, 2.0, 10)
    later = store.submit_task(title="b", instructions="i", working_dir=str(tmp_path), depends_on=[first["id"]])
    assert store.claim_next("w") is None                      # spent
    store.set_budget(daily_usd=None)
    assert store.claim_next("w") is None                      # no budget now, but b waits for a
    store.complete_attempt(first["id"], claimed["run_marker"])
    again = store.claim_next("w")
    assert again["id"] == later["id"] and again["depends_on"] == [first["id"]]


def test_a_retry_racing_a_new_follow_up_of_the_same_task_leaves_one_live(pg, tmp_path):
    """A line of work has one live follow-up: a retry of a failed follow-up that comes while
    another follow-up's submit is still open waits for it (the parent's row lock) and is refused;
    before, each read the other's row as not there and both went live, in one worktree."""
    import threading

    import psycopg
    parent = store.submit_task(title="p", instructions="i", working_dir=str(tmp_path))
    marker = store.claim_next("w", task_id=parent["id"])["run_marker"]
    store.renew_lease(parent["id"], marker, branch=f"taskbridge/{parent['id']}")   # as a worktree run
    store.complete_attempt(parent["id"], marker)
    first = store.submit_task(title="f1", instructions="i", working_dir=str(tmp_path), continue_from=parent["id"],
                              max_retries=0)
    store.fail_attempt(first["id"], store.claim_next("w", task_id=first["id"])["run_marker"], "broke")
    outcome: dict[str, object] = {}

    def submit_held() -> None:
        outcome["submitted"] = store.submit_task(title="hold me", instructions="i", working_dir=str(tmp_path),
                                                 continue_from=parent["id"])["id"]

    def retry() -> None:
        try:
            outcome["retried"] = store.retry_task(first["id"])["status"]
        except store.InvalidTransition as exc:
            outcome["refused"] = str(exc)

    with psycopg.connect(pg, autocommit=True) as test:
        test.execute(LATE_TRIGGER)   # the new follow-up's submit stays open on its event
        test.execute("SELECT pg_advisory_lock(4242)")
        held = threading.Thread(target=submit_held)
        held.start()
        while not test.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory'").fetchone():
            time.sleep(0.01)
        racing = threading.Thread(target=retry)
        racing.start()
        time.sleep(0.5)   # the retry reaches the line's check while the submit is open
        test.execute("SELECT pg_advisory_unlock(4242)")
        held.join(10)
        racing.join(10)
    assert outcome.get("submitted") and "refused" in outcome, outcome
    assert store.get_task(first["id"])["status"] == "failed"
