"""Soak: kill the worker mid-run N times against the real `opencode`, and count what went wrong.

    .venv/bin/python bench/soak_kill_worker.py 10

Each trial gets a fresh queue, a real git repo and the scripted model on 127.0.0.1. A task whose
agent runs a slow shell command (and leaves a background process) is started by a worker pass;
the pass is SIGKILLed at a random moment while the task runs; the next pass (default settings: the 15-min
stale limit does not come into it) sees the lease's worker is gone, reaps it and runs the task
to the end. It prints, over all trials, how many
  lost a task      (not done at the end),
  ran one twice    (more than one attempt finished, or the old run still alive when the new one
                    started),
  left a process   (anything tagged with the trial's queue alive at the end).
The goal is 0 of each.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import task_store  # noqa: E402
from fake_openai import ScriptedModel, text, tool_call  # noqa: E402
from helpers import make_repo, tagged  # noqa: E402
from opencode_env import opencode_bin, opencode_env  # noqa: E402

DONE = '```json\n{"summary": "slow job done", "files_touched": ["out.txt"], "tests_run": [], "open_questions": []}\n```'


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def trial(base: Path, model: ScriptedModel, rng: random.Random) -> dict[str, bool]:
    """One kill-and-recover trial in its own queue; returns which faults it showed."""
    os.environ.update(opencode_env(base, model.url))
    os.environ.update(TASK_DB_PATH=str(base / "q" / "tasks.db"), TASK_LOG_DIR=str(base / "q" / "logs"),
                      TASKBRIDGE_WORKTREE_ROOT=str(base / "wt"),
                      WORKER_KILL_GRACE_SEC="2", WORKER_NOTIFY="0")
    repo = make_repo(base / "repo")
    task = task_store.submit_task(title="slow", instructions="SCRIPT:slow", working_dir=str(repo),
                                  timeout_sec=120, max_retries=3)
    worker_argv = [sys.executable, str(ROOT / "worker.py")]
    first = subprocess.Popen(worker_argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    wait_until(lambda: task_store.get_task(task["id"])["agent_pid"], 60)
    time.sleep(rng.uniform(0.0, 3.0))  # somewhere in the model call or the slow shell command
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    second = subprocess.run(worker_argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    final = task_store.get_task(task["id"])
    events = task_store.events_since(0, [task["id"]], limit=1000)
    return {
        "lost": final["status"] != "done" or second.returncode != 0,
        "twice": sum(e["kind"] == "done" for e in events) != 1
                 or sum(e["kind"] == "requeued" for e in events) > 1,
        "leftover": bool(tagged()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trials", type=int, help="how many kill-the-worker trials to run")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not opencode_bin():
        print("opencode not found: run ./install.sh --test first", file=sys.stderr)
        return 1
    rng = random.Random(args.seed)
    totals = {"lost": 0, "twice": 0, "leftover": 0}
    started = time.monotonic()
    with ScriptedModel() as model, tempfile.TemporaryDirectory() as tmp:
        model.script("slow", [
            tool_call("bash", {"command": "sleep 600 > /dev/null 2>&1 & sleep 2; echo slow-step",
                               "description": "slow"}),
            tool_call("write", {"filePath": "{cwd}/out.txt", "content": "finished\n"}),
            text("Done.\n" + DONE),
        ])
        for number in range(args.trials):
            faults = trial(Path(tmp) / f"trial{number}", model, rng)
            for key, bad in faults.items():
                totals[key] += bad
            shown = ", ".join(k for k, v in faults.items() if v) or "ok"
            print(f"trial {number + 1}/{args.trials}: {shown}", flush=True)
    print(f"{args.trials} trials in {time.monotonic() - started:.0f} s: lost a task {totals['lost']}, "
          f"ran one twice {totals['twice']}, left a process {totals['leftover']}")
    return 0 if not any(totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
