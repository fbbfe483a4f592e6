"""Any OS error at any phase of a worker pass (too many open files, a name too long, ...) is named
once with its path and the way out, without a traceback, and not retried when retrying cannot help."""
from __future__ import annotations

import subprocess
import sys

import task_store
from fake_openai import text, tool_call
from helpers import ROOT, make_repo, submit

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

DONE = '```json\n{"summary": "ok", "files_touched": [], "tests_run": [], "open_questions": []}\n```'

# Measured here (Python 3, opencode 1.18.33): with 10-15 open files allowed the first git command
# of the workspace phase cannot start (16: it starts); with 20-22 git runs and OpenCode's own
# realpath meets EMFILE. 14, not the middle: the worker's threads open a few files of their own at
# moments that vary with the load (at 12, one CI run in a loaded machine's had no file left for the
# heartbeat after the task failed, and the worker exited 1).
GIT_CANNOT_START, OPENCODE_RUNS_OUT = 14, 21


# Twenty folders of 240 bytes each, one inside the other: a file ~4,900 bytes deep, past PATH_MAX
# (4096), made with relative names as a shell can; git only warns that it cannot open them.
DEEP = "d=$(printf 'n%.0s' $(seq 240)); for i in $(seq 20); do mkdir $d && cd $d; done; echo work > f.txt"


def worker_with_open_files_limit(limit: int) -> subprocess.CompletedProcess:
    """One worker pass whose process (and so git and opencode under it) may hold ``limit`` files."""
    return subprocess.run(["prlimit", f"--nofile={limit}", sys.executable, str(ROOT / "worker.py")],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, check=False)


def one_task_under_limit(opencode, tmp_path, limit: int) -> tuple[dict, str]:
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("w", [tool_call("write", {"filePath": "{cwd}/a.txt", "content": "a\n"}), text(DONE)])
    task = submit(repo, script="w", max_retries=1)
    done = worker_with_open_files_limit(limit)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "Traceback" not in said
    return task_store.get_task(task["id"]), said


def test_git_that_cannot_start_for_open_files_names_the_limit_not_the_repository(opencode, tmp_path):
    task, said = one_task_under_limit(opencode, tmp_path, GIT_CANNOT_START)
    assert task["status"] == "failed" and task["attempts"] == 1, task   # a retry meets the same limit
    assert "too many open files (EMFILE)" in task["error"]
    assert f"may hold {GIT_CANNOT_START} (ulimit -n" in task["error"]
    assert str(tmp_path / "repo") in task["error"]   # what failed: git could not start in the repository
    assert "fix the repository" not in task["error"]   # the repository is not what is wrong
    assert said.count("too many open files (EMFILE)") == 1   # named once


def test_opencode_running_out_of_open_files_is_named_and_not_retried(opencode, tmp_path):
    task, _ = one_task_under_limit(opencode, tmp_path, OPENCODE_RUNS_OUT)
    assert task["status"] == "failed" and task["attempts"] == 1, task
    assert "EMFILE" in task["error"] and f"may hold {OPENCODE_RUNS_OUT} (ulimit -n" in task["error"]
    assert f" at {tmp_path}" in task["error"] or " at /" in task["error"]   # the path that could not be opened


def test_work_git_cannot_see_past_path_max_is_named_and_kept_not_reported_as_no_change(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("deep", [tool_call("bash", {"command": DEEP, "description": "deep"}), text(DONE)])
    task = task_store.submit_task(title="deep", instructions="SCRIPT:deep", working_dir=str(repo), max_retries=1)
    done = subprocess.run([sys.executable, str(ROOT / "worker.py")], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stderr
    task = task_store.get_task(task["id"])
    assert task["status"] == "failed" and task["attempts"] == 1, task   # the paid run is not repeated
    assert "file name too long (ENAMETOOLONG)" in task["error"] and "4096 per path" in task["error"]
    kept = task["result"]["worktree_kept"] and task["worktree_path"]
    assert kept and kept in task["error"]
    found = subprocess.run(["find", kept, "-name", "f.txt"], capture_output=True, text=True, check=False)
    assert found.stdout.count("/n") == 20   # the agent's file is still there, 20 folders down
    assert "no change" not in done.stdout + done.stderr


def too_long_log_dir(tmp_path, monkeypatch) -> str:
    """TASK_LOG_DIR with one folder name past the 255 bytes a name may have here."""
    folder = str(tmp_path / ("L" * 300))
    monkeypatch.setenv("TASK_LOG_DIR", folder)
    return folder


def test_the_cli_names_a_name_too_long_with_the_knob_to_change(tmp_path, monkeypatch):
    task = task_store.submit_task(title="w", instructions="x", working_dir=str(tmp_path))
    too_long_log_dir(tmp_path, monkeypatch)
    shown = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "logs", task["id"]], capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert shown.returncode == 1 and "Traceback" not in shown.stderr
    said = " ".join(shown.stderr.split())
    assert "file name too long (ENAMETOOLONG)" in said and "255 per name" in said and "TASK_LOG_DIR" in said



def test_only_an_error_raised_from_an_os_error_is_named_as_that_fault():
    """An error raised *from* an OSError (git could not start) is that fault; one merely raised
    while handling it (a bug in the handler) is not, so its traceback is kept. And a named
    fault handed on is still described (recording a finished run described its Fault again and
    crashed with AttributeError, losing the receipt)."""
    import errno

    import os_faults
    emfile = OSError(errno.EMFILE, "Too many open files", "/repo")
    try:
        try:
            raise emfile
        except OSError as exc:
            raise RuntimeError("git could not start") from exc
    except RuntimeError as named:
        fault = os_faults.describe(named)
    assert fault is not None and "ulimit -n" in fault.line and fault.retry is False
    assert os_faults.describe(fault) is fault
    try:
        try:
            raise emfile
        except OSError:
            raise KeyError("a bug in the handler")  # noqa: B904  (implicitly chained, as a buggy handler's is)
    except KeyError as bug:
        assert os_faults.describe(bug) is None
