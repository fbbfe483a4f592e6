"""Skewed clocks (issue 24, part 3), with real skewed processes: Debian's ``faketime`` runs the
Python worker (or a store call) a fixed offset away from this test's clock, while the agent, git,
PostgreSQL and this test keep the machine's. Leases and heartbeats are stamped and compared on one
clock (the database server's on PostgreSQL), and on one machine a live worker process is never
called dead by its heartbeat's age alone. Without ``faketime`` the tests skip (fail under
CI=true; ``./install.sh --test`` installs it)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime

import anyio
import pytest
from click.testing import CliRunner
from mcp import Client

import doctor
import opencode_bridge_mcp as bridge
import task_store
import task_views
import tasks_cli
from fake_openai import text
from helpers import AGENT_DONE, ROOT, bash_step, call_tool, make_repo

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

HOUR = 3600


def skewed(offset: str, *argv: str, env: dict[str, str] | None = None) -> list[str]:
    """``argv`` run with its clock ``offset`` away (``-3600s``: an hour behind)."""
    faketime = shutil.which("faketime")
    if faketime is None:
        message = "faketime is not installed: apt-get install faketime (./install.sh --test as root)"
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return [faketime, "-f", offset, *argv]


def store_call(offset: str, code: str, env: dict[str, str]) -> str:
    """Run ``code`` (Python, task_store and worker importable) with a skewed clock; its stdout."""
    done = subprocess.run(skewed(offset, sys.executable, "-c", code), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.postgres
def test_postgresql_leases_and_worker_rows_are_on_the_database_clock(pg_url, monkeypatch, tmp_path):
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    monkeypatch.setenv("TASKBRIDGE_HOST", "host-behind")   # the task's folder is on that host
    task = task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path))
    monkeypatch.delenv("TASKBRIDGE_HOST")
    behind = dict(os.environ, TASKBRIDGE_HOST="host-behind")
    # A worker an hour behind claims, renews its lease and reports itself.
    store_call(f"-{HOUR}s", f"import time, task_store as s; assert time.time() < {time.time() - 3000};"
               "t = s.claim_next('worker:host-behind:7', pid=7, pid_start=1.0);"
               "s.renew_lease(t['id'], t['run_marker']); s.write_worker_heartbeat({'state': 'running'})", behind)
    lease = task_store.get_task(task["id"])
    assert lease["status"] == "running" and lease["lease_host"] == "host-behind"
    stamped = datetime.fromisoformat(lease["heartbeat_at"]).timestamp()
    assert abs(stamped - time.time()) < 60, f"the lease was stamped {stamped - time.time():.0f} s off"
    assert task_store.stale_leases(900) == [], "a fresh lease taken by a host an hour behind looked stale"
    worker = task_views.workers_state()[0]
    assert worker["host"] == "host-behind" and worker["recent"] and worker["label"] == "online", worker
    # A host an hour ahead reaps with its own worker.reap: the live attempt stays.
    ahead = dict(os.environ, TASKBRIDGE_HOST="host-ahead")
    reaped = store_call(f"+{HOUR}s", f"import time, worker; assert time.time() > {time.time() + 3000};"
                        "print(worker.reap(worker.Knobs()))", ahead)
    assert reaped == "0", "a host an hour ahead reaped another host's live attempt"
    assert task_store.get_task(task["id"])["status"] == "running"


@pytest.mark.real_opencode
def test_a_worker_an_hour_behind_is_alive_to_every_view(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("slow", [bash_step("sleep 25", "a long check"), text("Checked.\n" + AGENT_DONE)])
    task = task_store.submit_task(title="slow", instructions="SCRIPT:slow", working_dir=str(repo))
    argv = skewed(f"-{HOUR}s", sys.executable, str(ROOT / "worker.py"), "--max-tasks", "1")
    with open(tmp_path / "worker.out", "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True)
    try:
        _wait_running(proc, task["id"], tmp_path / "worker.out")
        beat = anyio.run(_worker_heartbeat_tool)
        status = CliRunner().invoke(tasks_cli.cli, ["status", "--json"])
        checked = doctor.check_worker()
        assert proc.wait(120) == 0, (tmp_path / "worker.out").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert beat["age_sec"] > HOUR - 300, "the worker's clock was not an hour behind (faketime)"
    assert beat["recent"] and beat["pid_running"] and beat["label"] == "online", beat
    assert "no heartbeat for over" not in beat["summary"] and "restart_worker" not in beat["summary"]
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["worker"]["recent"] and "not checked in" not in status.stderr
    assert checked.status == "ok", checked
    final = task_store.get_task(task["id"])
    assert final["status"] == "done" and final["attempts"] == 1, final["error"]


def _wait_running(proc: subprocess.Popen, task_id: str, out, timeout: float = 90) -> None:
    """Until the worker has started the agent on ``task_id`` (its lease names the agent's pid)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, out.read_text()
        if task_store.get_task(task_id).get("agent_pid"):
            return
        time.sleep(0.3)
    pytest.fail(f"the worker did not start the agent in {timeout} s: {out.read_text()[-2000:]}")


async def _worker_heartbeat_tool() -> dict:
    async with Client(bridge.build_server(), mode="legacy") as client:
        return await call_tool(client, "worker_heartbeat")
