"""Past one machine, end to end: two workers acting as two machines share one PostgreSQL queue.

Each "machine" is a worker process with a world of its own: its own HOME (and OpenCode's config,
data and cache under it), its own TASK_LOG_DIR, worktree root, mirror cache and state folder, and
its own TASKBRIDGE_HOST. They share no folder; the only things between them are the PostgreSQL
server (a real one, tests/pg_server.py) and a bare git repository standing for the remote. Tasks
are submitted through the real MCP server over stdio (the SDK client), whose own TASK_LOG_DIR
stays empty: everything it shows (receipts, logs) comes from the database. The agent is the real
pinned opencode against the scripted model of tests/fake_openai.py.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from fake_openai import text, tool_call
from helpers import ROOT, call_tool, git, make_repo, worker_process
from opencode_env import opencode_env, require_opencode_bin

pytestmark = [pytest.mark.postgres, pytest.mark.real_opencode]
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "wrote %s", "files_touched": ["%s"], "tests_run": [], "open_questions": []}\n```'


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    """A bare repository with one commit on main: the remote every machine pushes to."""
    seed = make_repo(tmp_path / "seed", {"README.md": "# shared project\n"})
    bare = tmp_path / "remote.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(bare)], check=True)
    return bare


def machine(tmp_path: Path, name: str, model_url: str, db_url: str, **knobs: str) -> dict[str, str]:
    """The environment of one worker machine: nothing of it is shared with another."""
    root = tmp_path / name
    env = opencode_env(root, model_url)   # HOME and OpenCode's folders under root
    env.update({"TASK_DB_URL": db_url, "TASKBRIDGE_HOST": name, "WORKER_NOTIFY": "0",
                "TASK_DB_PATH": str(root / "state" / "tasks.db"),   # the worker's lock and heartbeat files
                "TASK_LOG_DIR": str(root / "logs"), "TASKBRIDGE_WORKTREE_ROOT": str(root / "worktrees"),
                "TASKBRIDGE_MIRROR_DIR": str(root / "mirrors"), **knobs})
    return env


def server_env(tmp_path: Path, db_url: str) -> dict[str, str]:
    """The MCP server's machine: its own HOME and an empty TASK_LOG_DIR (logs come from the DB)."""
    root = tmp_path / "server"
    (root / "logs").mkdir(parents=True)
    (root / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCODE_")}
    env.update({"TASK_DB_URL": db_url, "TASKBRIDGE_HOST": "planner-box", "HOME": str(root / "home"),
                "TASK_DB_PATH": str(root / "state" / "tasks.db"), "TASK_LOG_DIR": str(root / "logs")})
    return env


def worker(env: dict[str, str], *args: str):
    """``worker.py ARGS`` on one machine, its output in that machine's worker.out (see
    helpers.worker_process)."""
    return worker_process(env, Path(env["TASK_LOG_DIR"]).parent / "worker.out", *args)


def said(env: dict[str, str]) -> str:
    return (Path(env["TASK_LOG_DIR"]).parent / "worker.out").read_text(errors="replace")


def bridge(env: dict[str, str]) -> Any:
    from mcp import Client, StdioServerParameters
    from mcp.types import Implementation
    params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "opencode_bridge_mcp.py")], env=env)
    return Client(params, client_info=Implementation(name="claude-code", version="2.1.197"))


async def wait_all(client: Any, ids: list[str], seconds: float) -> dict[str, str]:
    deadline = time.monotonic() + seconds
    while True:
        waited = await call_tool(client, "wait_for", {"task_ids": ids, "mode": "all", "timeout_sec": 20})
        statuses = {t["id"]: t["status"] for t in waited["tasks"]}
        if all(s in ("done", "failed", "cancelled") for s in statuses.values()) or time.monotonic() > deadline:
            return statuses


def events_of(task_id: str) -> list[str]:
    import task_store
    return [e["kind"] for e in task_store.events_since(0, [task_id], limit=1000)]


def bare_git(bare: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(bare), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.anyio
async def test_two_machines_take_the_tasks_once_and_push_their_branches(tmp_path, scripted_model, pg_url, remote,
                                                                         monkeypatch):
    require_opencode_bin()
    monkeypatch.setenv("TASK_DB_URL", pg_url)   # this test reads the queue itself too
    for n in range(1, 5):
        scripted_model.script(f"scale-{n}", [
            tool_call("write", {"filePath": f"{{cwd}}/out-{n}.txt", "content": f"written by task {n}\n"}),
            text("Done.\n" + RECEIPT % (f"out-{n}.txt", f"out-{n}.txt"))])
    machines = {name: machine(tmp_path, name, scripted_model.url, pg_url) for name in ("machine-a", "machine-b")}
    server = server_env(tmp_path, pg_url)
    async with bridge(server) as client:
        ids = []
        for n in range(1, 5):
            task = await call_tool(
                client,
                "submit_task",
                {
                    "title": f"task {n}",
                    "repo": str(remote),
                    "base_ref": "main",
                    "instructions": f"Write it. SCRIPT:scale-{n}",
                },
            )
            ids.append(task["id"])
        # --max-tasks 2 each: four tasks done means each machine ran two of them.
        with worker(machines["machine-a"], "--watch", "--max-tasks", "2"), \
                worker(machines["machine-b"], "--watch", "--max-tasks", "2"):
            statuses = await wait_all(client, ids, 600)
        assert set(statuses.values()) == {"done"}, (statuses, said(machines["machine-a"]), said(machines["machine-b"]))

        import task_store
        hosts = []
        for n, task_id in enumerate(ids, 1):
            row = task_store.get_task(task_id)
            assert row["attempts"] == 1 and events_of(task_id).count("claimed") == 1, (row, events_of(task_id))
            hosts.append(row["lease_host"])
            # The branch is in the bare repository, holding the agent's change, at the receipt's commit.
            result = await call_tool(client, "get_task_result", {"task_id": task_id})
            branch = f"taskbridge/{task_id}"
            assert result["result"]["pushed_branch"] == branch and row["pushed_branch"] == branch
            assert bare_git(remote, "rev-parse", branch) == row["pushed_commit"] == result["result"]["pushed_commit"]
            assert bare_git(remote, "show", f"{branch}:out-{n}.txt") == f"written by task {n}"
            assert f"out-{n}.txt" in result["diff"] and result["result"]["summary"] == f"wrote out-{n}.txt"
            # The log, read on the server's side, which has no log file of its own.
            logs = await call_tool(client, "get_task_logs", {"task_id": task_id})
            assert '"type":"step_finish"' in logs["text"].replace(" ", ""), logs
        assert sorted(hosts) == ["machine-a", "machine-a", "machine-b", "machine-b"]
        assert not any((tmp_path / "server" / "logs").iterdir()), "the server read every log from the database"
        assert bare_git(remote, "rev-parse", "main") == git(tmp_path / "seed", "rev-parse", "HEAD"), "main untouched"
    for name, env in machines.items():
        assert any(Path(env["TASKBRIDGE_MIRROR_DIR"]).iterdir()), f"{name} fetched through its own mirror"


def live_tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def runs_command(pid: int, needle: str) -> bool:
    """Whether a process under ``pid`` has ``needle`` in its command line."""
    for proc in live_tree(pid):
        with contextlib.suppress(psutil.Error):
            if needle in " ".join(proc.cmdline()):
                return True
    return False


@pytest.mark.anyio
async def test_a_killed_machines_task_is_taken_over_only_once_its_heartbeat_is_stale(tmp_path, scripted_model,
                                                                                       pg_url, remote, monkeypatch):
    require_opencode_bin()
    monkeypatch.setenv("TASK_DB_URL", pg_url)
    stale = 20.0
    # Machine A's agent sits in a long command (A is killed there); machine B's runs straight on.
    scripted_model.script("takeover", [
        tool_call("bash", {"command": 'case "$HOME" in *machine-a*) sleep 300;; esac; echo taken-over > over.txt',
                           "description": "work"}),
        text("Done.\n" + RECEIPT % ("over.txt", "over.txt"))])
    a = machine(tmp_path, "machine-a", scripted_model.url, pg_url)
    b = machine(tmp_path, "machine-b", scripted_model.url, pg_url, WORKER_STALE_SEC=str(stale))
    import task_store
    async with bridge(server_env(tmp_path, pg_url)) as client:
        task_id = (await call_tool(client, "submit_task", {"title": "take over", "instructions": "SCRIPT:takeover",
                                                           "repo": str(remote), "base_ref": "main"}))["id"]
        with worker(a, "--watch") as proc_a:
            deadline = time.monotonic() + 180
            while not runs_command(proc_a.pid, "sleep 300"):
                assert time.monotonic() < deadline and proc_a.poll() is None, said(a)
                time.sleep(0.2)
            assert task_store.get_task(task_id)["lease_host"] == "machine-a"
            # Machine A dies: its worker and everything it started, at once.
            doomed = live_tree(proc_a.pid)
            for proc in doomed:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(doomed, timeout=10)
        # Its lease's last heartbeat (ISO, cut to the second): the stale limit counts from there.
        beat = datetime.fromisoformat(task_store.get_task(task_id)["heartbeat_at"]).timestamp()

        # While A's last heartbeat is fresh, B's passes (each reaps first) leave the task alone,
        # though A's pid is gone: on another host only the heartbeat's age counts.
        judged = 0
        while time.time() < beat + stale - 6:
            passed = subprocess.run([sys.executable, str(ROOT / "worker.py")], env=b, cwd=ROOT, capture_output=True,
                                    text=True, timeout=120, stdin=subprocess.DEVNULL)
            assert passed.returncode == 0, passed.stderr
            row = task_store.get_task(task_id)
            if time.time() < beat + stale - 1:   # the whole pass ran while the heartbeat was fresh
                assert (row["status"], row["lease_host"], row["attempts"]) == ("running", "machine-a", 1), row
                judged += 1
            time.sleep(0.5)
        assert judged >= 1, "no pass of B ran while A's heartbeat was fresh (the machine is too slow)"
        assert "requeued" not in events_of(task_id) and events_of(task_id).count("claimed") == 1

        # Stale now: B (watching, it reaps as it starts) requeues it, takes it and finishes it.
        time.sleep(max(0.0, beat + stale + 2 - time.time()))   # (beat is cut to the second)
        with worker(b, "--watch"):
            statuses = await wait_all(client, [task_id], 300)
        row = task_store.get_task(task_id)
        assert statuses[task_id] == "done", (row, said(b))
        assert row["lease_host"] == "machine-b" and row["attempts"] == 2
        assert events_of(task_id).count("claimed") == 2 and events_of(task_id).count("requeued") == 1
        assert bare_git(remote, "show", f"taskbridge/{task_id}:over.txt") == "taken-over"
        result = await call_tool(client, "get_task_result", {"task_id": task_id})
        assert result["result"]["pushed_commit"] == bare_git(remote, "rev-parse", f"taskbridge/{task_id}")
