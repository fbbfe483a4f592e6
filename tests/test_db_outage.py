"""The queue database away for a while: a PostgreSQL restart (``pg_ctl -m fast stop``, then a
start) is weathered by the worker and by serve.py, never turned into a task's failure.

Before: the worker's lease renewal met DatabaseUnavailable ("terminating connection due to
administrator command"), printed a traceback, failed the attempt as a worker internal error and
exited; the agent died with it, idle --watch workers exited too, and serve.py, seeing its worker
exit, stopped the MCP server and the board. The real cluster of tests/pg_server.py is stopped
and started again (``PgServer.restart``) under a real worker running the real opencode against
the scripted model.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

import store_sqlite
import task_store
import task_views
import worker
from fake_openai import text, tool_call
from helpers import ROOT, free_port, make_repo, worker_process

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)


@pytest.fixture(autouse=True)
def fresh_worker_state():
    """Each test starts with a worker process's state of its own (no outage said yet)."""
    worker.fresh_state()

RECEIPT = '```json\n{"summary": "wrote %s", "files_touched": ["%s"], "tests_run": [], "open_questions": []}\n```'


def watching(env: dict[str, str], out: Path, *args: str):
    """``worker.py --watch ARGS``: see helpers.worker_process."""
    return worker_process(env, out, "--watch", *args)


def runs_command(pid: int, needle: str) -> bool:
    with contextlib.suppress(psutil.Error):
        for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if needle in " ".join(proc.cmdline()):
                    return True
    return False


def running(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def settle(task_id: str, seconds: float, proc: subprocess.Popen, out: Path) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(task_store.DatabaseUnavailable):
            task = task_store.get_task(task_id)
            if task["status"] in ("done", "failed", "cancelled", "waiting"):
                return task
        assert proc.poll() is None, out.read_text(errors="replace")
        assert time.monotonic() < deadline, out.read_text(errors="replace")
        time.sleep(0.3)


def kinds(task_id: str) -> list[str]:
    return [e["kind"] for e in task_store.events_since(0, [task_id], limit=1000)]


@pytest.mark.postgres
def test_a_running_task_and_an_idle_watch_worker_ride_out_a_postgresql_restart(opencode, tmp_path, pg_server,
                                                                                pg_url, monkeypatch):
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("through-restart", [
        tool_call("bash", {"command": "sleep 4; echo survived > out.txt", "description": "long step"}),
        text("Done.\n" + RECEIPT % ("out.txt", "out.txt"))])
    opencode.model.script("after-restart", [
        tool_call("write", {"filePath": "{cwd}/later.txt", "content": "later\n"}),
        text("Done.\n" + RECEIPT % ("later.txt", "later.txt"))])
    out = tmp_path / "worker.out"
    first = task_store.submit_task(title="long", instructions="SCRIPT:through-restart", working_dir=str(repo))
    with watching(dict(os.environ), out) as proc:
        deadline = time.monotonic() + 120
        while not runs_command(proc.pid, "sleep 4"):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.2)
        agent = task_store.get_task(first["id"])["agent_pid"]
        # The agent's step goes on while the server is down, and the agent finishes before it is
        # back: its lease renewals, its log's last ship and its result wait for the database.
        pg_server.halt()
        while proc.poll() is None and running(agent):   # the run's process (warm: its engine client)
            time.sleep(0.2)
        assert time.monotonic() < deadline + 30
        time.sleep(2)
        pg_server.start()
        task = settle(first["id"], 120, proc, out)
        said = out.read_text(errors="replace")
        assert task["status"] == "done", (task, said)
        assert task["attempts"] == 1 and kinds(first["id"]).count("claimed") == 1, kinds(first["id"])
        assert "requeued" not in kinds(first["id"]) and "failed" not in kinds(first["id"])
        assert task["result"]["summary"] == "wrote out.txt" and "out.txt" in task["diff"]
        assert (repo / "out.txt").exists() is False and task["result"]["commit"], "committed on its branch"
        assert agent and task["agent_pid"] == agent, "the same agent ran on"
        assert b'"type":"step_finish"' in task_store.read_task_log(first["id"]).replace(b" ", b""), "shipped at last"
        assert "Traceback" not in said and "internal error" not in said, said
        assert said.count("queue database unreachable since") == 1, said
        assert "queue database reachable again" in said, said

        # Idle now: another restart, then a new task is claimed by the same worker.
        pg_server.restart(down_sec=3)
        time.sleep(1.5)
        assert proc.poll() is None, out.read_text(errors="replace")
        second = worker.db(task_store.submit_task, title="later", instructions="SCRIPT:after-restart",
                           working_dir=str(repo))
        task = settle(second["id"], 120, proc, out)
        assert task["status"] == "done" and task["attempts"] == 1, (task, out.read_text(errors="replace"))
        assert task["lease_pid"] == proc.pid
        said = out.read_text(errors="replace")
        assert "Traceback" not in said and said.count("queue database unreachable since") == 2, said
    assert proc.returncode == 0, "stopped when asked, not before"


@pytest.mark.postgres
def test_a_one_pass_worker_lets_its_task_finish_through_an_outage_and_exits_1_in_one_line(opencode, tmp_path,
                                                                                            pg_server, pg_url,
                                                                                            monkeypatch):
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("one-pass", [
        tool_call("bash", {"command": "sleep 5; echo ok > pass.txt", "description": "long step"}),
        text("Done.\n" + RECEIPT % ("pass.txt", "pass.txt"))])
    task = task_store.submit_task(title="pass", instructions="SCRIPT:one-pass", working_dir=str(repo))
    out = tmp_path / "pass.out"
    with open(out, "ab") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not runs_command(proc.pid, "sleep 5"):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.2)
        pg_server.restart(down_sec=3)
        assert proc.wait(120) == 1, out.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = out.read_text(errors="replace")
    final = task_store.get_task(task["id"])
    assert final["status"] == "done" and final["attempts"] == 1, (final, said)
    assert "Traceback" not in said and said.count("error: the queue database is unreachable") == 1, said


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.postgres
def test_serve_keeps_the_server_board_and_worker_through_a_postgresql_restart(tmp_path, pg_server, pg_url,
                                                                              monkeypatch):
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    port, token = free_port(), "s3cret-token"
    env = dict(os.environ, PORT=str(port), MCP_BEARER_TOKEN=token)
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none", "--db", pg_url], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while not any(line.strip().startswith("Stop:") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        while not [w for w in task_views.workers_state() if w["state"] == "idle"]:   # past its start-up
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        kids = {" ".join(k.cmdline()).split("/")[-1].split()[0]: k.pid for k in psutil.Process(proc.pid).children()}
        assert get(f"{base}/api/status", token)[0] == 200
        pg_server.halt()
        try:
            time.sleep(2)
            assert get(f"{base}/health")[0] == 200
            assert get(f"{base}/")[0] == 200, "the board's shell"
            status, body = get(f"{base}/api/status", token)
            assert status == 503 and "Traceback" not in body, (status, body)
            assert get(f"{base}/api/changes?wait=0", token)[0] == 503, "the board's live feed says so"
        finally:
            pg_server.start()
        deadline = time.monotonic() + 30
        while get(f"{base}/api/status", token)[0] != 200:
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        assert get(f"{base}/api/changes?wait=0", token)[0] == 200
        time.sleep(2)
        assert proc.poll() is None, "".join(lines)
        now = {" ".join(k.cmdline()).split("/")[-1].split()[0]: k.pid for k in psutil.Process(proc.pid).children()}
        assert now == kids, ("the same server and worker serve on", "".join(lines))
        assert "stopped by itself" not in "".join(lines)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines)


# --------------------------------------------------------------------------------------------
# What the worker does with an outage, each kind (PostgreSQL away or busy, SQLite locked).

OUTAGES = [task_store.DatabaseUnavailable("cannot use the PostgreSQL queue postgresql://u@h/db: terminating "
                                          "connection due to administrator command; check TASK_DB_URL"),
           task_store.DatabaseBusy("the PostgreSQL queue is busy"),
           task_store.DatabaseBusy("the task database /q/tasks.db cannot be used (database is locked): another "
                                   "process holds it locked: try again in a moment")]


def test_a_busy_queue_is_said_back_only_when_a_write_that_waited_lands(monkeypatch, capsys):
    """Another program holds SQLite's write lock: writes fail (DatabaseBusy) while reads answer
    (WAL). Every answered read counted as the queue being back, so the worker's log alternated
    "unreachable since" / "reachable again after 0 s" for as long as the lock was held. A busy
    outage now ends only when a call that met it lands; an outage of another kind ends at any answer."""
    monkeypatch.setattr(worker, "OUTAGE_BACKOFF_SEC", (0.01, 0.02))
    busy = OUTAGES[2]
    writes = iter(range(3))

    def write_under_lock() -> int:
        if next(writes, None) is not None:
            raise busy
        return 1

    outage = worker.Outage(worker.FullDisk())   # this test's own view, whatever an earlier test left
    monkeypatch.setattr(worker.current(), "outage", outage)
    for _ in range(3):   # a write fails (a lease renewal, a heartbeat row), then a read answers, three times over
        outage.failed(busy)
        assert worker.db(task_store.last_event_id) == 0
    said = capsys.readouterr().err
    assert said.count("queue database unreachable since") == 1 and "reachable again" not in said, said
    assert worker.db(write_under_lock) == 1   # a write that waited for the lock lands
    assert capsys.readouterr().err.count("queue database reachable again") == 1
    unavailable = OUTAGES[0]
    outage.failed(unavailable), outage.failed(unavailable)
    assert worker.db(task_store.last_event_id) == 0   # PostgreSQL back: any answer says so
    assert capsys.readouterr().err.count("queue database reachable again") == 1


@pytest.mark.parametrize("outage", OUTAGES, ids=["unavailable", "busy", "sqlite-locked"])
def test_a_store_call_is_retried_through_an_outage_and_said_once(outage, monkeypatch, capsys):
    """A fault injected into a real store call (the database itself cannot be made to fail on cue
    in-process): the call is retried with back-off until it lands; the outage is said once."""
    monkeypatch.setattr(worker, "OUTAGE_BACKOFF_SEC", (0.01, 0.02))
    real, failures = task_store.last_event_id, iter(range(5))

    def flaky() -> int:
        if next(failures, None) is not None:
            raise outage
        return real()

    assert worker.db(flaky) == 0
    said = capsys.readouterr().err
    assert said.count("queue database unreachable since") == 1 and said.count("reachable again") == 1, said
    with pytest.raises(type(outage)):
        worker.db(lambda: (_ for _ in ()).throw(outage), patience=0.05)
    assert worker.db_outage(outage) and not worker.db_outage(task_store.StaleAttempt("x"))


def test_a_task_is_never_failed_because_the_database_stayed_away(tmp_path, monkeypatch):
    task = task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path))
    owner, pid, start = worker.worker_identity()
    claimed = task_store.claim_next(owner, pid, start)
    monkeypatch.setattr(worker, "run_task", lambda *_: (_ for _ in ()).throw(OUTAGES[0]))
    worker._run_guarded(claimed, worker.Knobs())
    assert task_store.get_task(task["id"])["status"] == "running", "left to the reaper, not failed"
    assert "failed" not in kinds(task["id"])


# --------------------------------------------------------------------------------------------
# Workers on other hosts: judged by a heartbeat they refresh every few seconds.


def test_a_silent_worker_on_another_host_is_not_online(monkeypatch):
    beat = {"name": "worker:hostA:20430", "host": "hostA", "pid": 20430, "state": "idle", "tasks": [],
            "pid_running": None, "age_sec": 12.0}
    assert task_views.judge_worker(beat)["label"] == "online"
    judged = task_views.judge_worker(beat | {"age_sec": 120.0})
    assert judged["label"] == "stale" and not judged["recent"]
    assert "no heartbeat for over 30 s: is the worker on hostA still running?" in judged["summary"]
    assert task_views.judge_worker(beat | {"age_sec": 2.0, "state": "stopped"})["label"] == "stopped"
    here = beat | {"pid_running": True, "age_sec": 120.0}
    assert task_views.judge_worker(here)["label"] == "online", "a local worker's process is checked instead"


def test_another_hosts_worker_that_exits_shows_stopped_and_a_killed_one_goes_silent(tmp_path, monkeypatch):
    env = dict(os.environ, TASKBRIDGE_HOST="hostA", WORKER_POLL_SEC="0.2")
    with watching(env, tmp_path / "a.out") as clean:
        deadline = time.monotonic() + 60
        while not [w for w in task_views.workers_state() if w["pid"] == clean.pid and w["state"] == "idle"]:
            assert clean.poll() is None and time.monotonic() < deadline, (tmp_path / "a.out").read_text()
            time.sleep(0.1)
        assert [w["label"] for w in task_views.workers_state() if w["pid"] == clean.pid] == ["online"]
    assert [w["label"] for w in task_views.workers_state() if w["pid"] == clean.pid] == ["stopped"]
    with watching(env, tmp_path / "b.out") as killed:
        while not [w for w in task_views.workers_state() if w["pid"] == killed.pid]:
            assert killed.poll() is None and time.monotonic() < deadline + 60
            time.sleep(0.1)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(10)
    monkeypatch.setattr(task_views, "WORKER_ELSEWHERE_SILENT_SEC", 1.5)   # (30 s in life)
    time.sleep(2)
    assert [w["label"] for w in task_views.workers_state() if w["pid"] == killed.pid] == ["stale"]


def test_serve_starts_a_worker_that_stopped_by_itself_again_and_keeps_serving(tmp_path):
    """Before, any exit of the worker but the lock-held one stopped the server and the board too."""
    port, token = free_port(), "s3cret-token"
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none"],
                            env=dict(os.environ, PORT=str(port), MCP_BEARER_TOKEN=token),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()

    def worker_pid() -> int | None:
        for kid in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error):   # a zombie until serve.py reaps it
                if "worker.py" in " ".join(kid.cmdline()):
                    return kid.pid
        return None
    try:
        deadline = time.monotonic() + 60
        while not any(line.strip().startswith("Stop:") for line in lines) or worker_pid() is None:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        first = worker_pid()
        os.killpg(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while worker_pid() in (None, first):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            assert get(f"http://127.0.0.1:{port}/health")[0] == 200
            time.sleep(0.3)
        said = "".join(lines)
        assert "the worker was killed by SIGKILL" in said and "stopped by itself" not in said, said
        assert get(f"http://127.0.0.1:{port}/api/status", token)[0] == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines)


def test_the_meter_records_a_step_the_locked_database_missed_with_the_next_and_at_the_end(tmp_path, monkeypatch):
    """SQLite's write lock really held by another connection (its wait shortened from 30 s): a
    step's spend that could not be recorded was dropped from today's spend for good."""
    import sqlite3
    monkeypatch.setattr(store_sqlite, "BUSY_WAIT_SEC", 0.2)
    monkeypatch.setattr(worker, "OUTAGE_BACKOFF_SEC", (0.1, 0.2))
    task = task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path))
    claimed = task_store.claim_next("w", task_id=task["id"])
    meter = worker.Meter(claimed, None)
    monkeypatch.setenv("WORKER_STALE_SEC", "20")   # how long settle may retry
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None, check_same_thread=False)
    try:
        holder.execute("BEGIN IMMEDIATE")
        meter.add(0.1, 100)                        # locked: not recorded, not lost
        holder.execute("ROLLBACK")
        assert task_store.budget_state()["spent_usd"] == 0
        meter.add(0.3, 300)
        assert task_store.budget_state()["spent_usd"] == pytest.approx(0.3)
        holder.execute("BEGIN IMMEDIATE")
        meter.add(0.5, 500)
        threading.Timer(0.8, lambda: holder.execute("ROLLBACK")).start()
        meter.settle()                             # the run's end: retried until the lock is free
        assert task_store.budget_state()["spent_usd"] == pytest.approx(0.5)
        assert task_store.budget_state()["spent_tokens"] == 500
    finally:
        time.sleep(0.9)
        holder.close()


def test_status_asks_about_a_silent_worker_on_another_host_by_name(monkeypatch):
    from click.testing import CliRunner

    import tasks_cli
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "hostA")
        task_store.write_worker_heartbeat({"state": "idle"})
    monkeypatch.setattr(task_views, "WORKER_ELSEWHERE_SILENT_SEC", 0)   # (30 s in life)
    time.sleep(0.2)
    result = CliRunner().invoke(tasks_cli.cli, ["status"])
    said = " ".join(result.output.split())
    assert "stale" in said and "The worker on hostA has not checked in for over 0 s (it said: idle)" in said, said
    assert "launchd" not in said, "not this machine's schedule"


def test_the_warm_engine_start_weathers_an_outage_instead_of_ending_the_pass(monkeypatch, tmp_path):
    """With the engine on, the pass's first servers are predicted from the queue before the loop
    (which rides out outages) runs: an outage there ended a --watch pass at its start."""
    monkeypatch.setattr(task_store, "list_tasks", lambda **_: (_ for _ in ()).throw(OUTAGES[0]))
    engines = worker._start_engines(1, watch=True)
    assert engines.first is None and engines.kept == {}, "no prediction: each slot's first task runs cold"
    monkeypatch.setattr(task_store, "list_tasks", lambda **_: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError):
        worker._start_engines(1, watch=True)   # a fault of our own is not taken for an outage


def test_a_watch_worker_stops_at_once_while_another_program_holds_the_queue(opencode, tmp_path):
    """A SQLite queue whose write lock another program holds (a backup, a `sqlite3` shell left in
    a transaction): the idle worker's turns wait on it, but a SIGTERM ends the wait and the worker
    exits at once, not after the 30 s a write waits for the lock."""
    out = tmp_path / "worker.log"
    with watching({**os.environ, "WORKER_POLL_SEC": "0.2"}, out) as proc:
        until_said = time.monotonic() + 60
        while "watching for tasks" not in out.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < until_said, out.read_text(errors="replace")
            time.sleep(0.2)
        holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            time.sleep(3)   # its turns now wait for the lock
            assert proc.poll() is None, out.read_text(errors="replace")
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            proc.wait(timeout=40)
            stopped_after = time.monotonic() - started
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    assert proc.returncode == 0, out.read_text(errors="replace")
    assert stopped_after < 5, (stopped_after, out.read_text(errors="replace"))
