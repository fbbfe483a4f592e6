"""What a fresh user ran into: a mistyped queue path growing a new queue, a refused worker leaving
files beside the path it refused, files beside the queue readable by others. Each through the
product's own entry points (the CLI and the worker as separate processes)."""
from __future__ import annotations

import os
import stat

import pytest

import task_store
from helpers import run_script


@pytest.mark.parametrize("command", [["status"], ["list"], ["show", "1"], ["logs", "1"], ["events"],
                                     ["clear", "--yes"], ["budget", "show"], ["diff", "1"], ["cancel", "1"]])
def test_a_mistyped_db_is_not_made_into_a_queue(tmp_path, command):
    typo = tmp_path / "no" / "such" / "tasks.db"
    result = run_script("tasks_cli.py", "--db", str(typo), *command, timeout=60)
    assert result.returncode == 1, result.stdout
    assert f"no queue at {typo}: check --db / TASK_DB_PATH" in result.stderr
    assert "tasks_cli.py submit` makes a new queue" in result.stderr
    assert not (tmp_path / "no").exists(), "nothing was created"


def test_doctor_reports_a_missing_queue_without_making_it(tmp_path):
    typo = tmp_path / "no" / "tasks.db"
    result = run_script("tasks_cli.py", "--db", str(typo), "doctor", timeout=120)
    assert "not created yet" in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "no").exists()


def test_submit_makes_the_queue_it_names(tmp_path):
    new = tmp_path / "new" / "tasks.db"
    result = run_script("tasks_cli.py", "--db", str(new), "submit", "first task", "--dir", str(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    assert new.exists()
    assert run_script("tasks_cli.py", "--db", str(new), "list", timeout=60).returncode == 0


@pytest.mark.parametrize("kind", ["not a database", "a folder"])
def test_a_refused_worker_leaves_nothing_beside_the_queue(tmp_path, kind):
    queue = tmp_path / "queue"
    queue.mkdir()
    db = queue / "tasks.db"
    if kind == "a folder":
        db.mkdir()
    else:
        db.write_text("these bytes are not SQLite " * 10)
    result = run_script("worker.py", env=dict(os.environ, TASK_DB_PATH=str(db)), timeout=60)
    assert result.returncode == 1 and "cannot use the queue database" in result.stderr, result.stderr
    assert sorted(p.name for p in queue.iterdir()) == ["tasks.db"], "no worker.json, lock, log or logs folder"


@pytest.mark.real_opencode
def test_the_models_cache_beside_the_queue_is_private(opencode):
    task_store.connect().close()
    result = run_script("tasks_cli.py", "models", timeout=120)
    assert result.returncode == 0, result.stderr
    cache = task_store.state_path("models.json")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
