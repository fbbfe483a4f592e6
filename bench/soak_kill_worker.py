"""Soak: kill the worker at every phase of a task N times against the real `opencode`, and count
what went wrong, per phase.

    .venv/bin/python bench/soak_kill_worker.py 10            # 10 trials of each phase
    .venv/bin/python bench/soak_kill_worker.py 3 --phase commit --phase record

Each trial gets a fresh queue, a real git repo and the scripted model on 127.0.0.1. A task whose
agent runs a slow shell command (and leaves a background process) and writes a large file is
started by a worker pass; the pass is SIGKILLed in one phase:
  claim     the row says running, nothing prepared yet;
  worktree  the task's worktree exists, the agent has not started;
  run       the agent runs (at a random moment of its model calls and shell command);
  commit    TaskBridge's own commit (`git add`, `git commit`) runs (git runs on, orphaned, in its
            own session);
  record    the commit is on the task branch, the row does not say done yet.
The next pass (default settings: the 15-min stale limit does not come into it) sees the lease's
worker is gone, reaps it and brings the task to its end. It prints, per phase, how many
  lost a task      (not done at the end),
  ran one twice    (more than one attempt finished, the agent's work committed twice, or the
                    agent run again after its work was committed),
  orphaned commit  (a commit on a taskbridge/<id>* branch that the receipt does not name),
  left a process   (anything tagged with the trial's queue alive at the end),
and how often the kill landed in the phase asked for (a commit can end before it is seen).
The goal is 0 of each.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import task_store  # noqa: E402
from fake_openai import ScriptedModel, text, tool_call  # noqa: E402
from helpers import make_repo, tagged  # noqa: E402
from opencode_env import opencode_bin, opencode_env  # noqa: E402

DONE = '```json\n{"summary": "slow job done", "files_touched": ["out.txt"], "tests_run": [], "open_questions": []}\n```'


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


PHASES = ("claim", "worktree", "run", "commit", "record")


def branch_commits(repo: Path, task_id: str) -> set[str]:
    """Every commit on the task's branches (``taskbridge/<id>``, ``…-<queue>``, …) past main."""
    names = subprocess.run(["git", "branch", "--list", "--format=%(refname:short)", f"taskbridge/{task_id}*"],
                           cwd=repo, capture_output=True, text=True).stdout.split()
    found: set[str] = set()
    for name in names:
        found |= set(subprocess.run(["git", "rev-list", f"main..{name}"], cwd=repo, capture_output=True,
                                    text=True).stdout.split())
    return found


def git_commit_running(worktree_root: Path) -> bool:
    """Whether TaskBridge's commit of the task (read-tree, add, commit in its worktree) runs now."""
    for proc in psutil.process_iter(["name", "cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if proc.info["name"] == "git" and {"add", "commit", "read-tree"} & set(proc.info["cmdline"]) and \
                    str(proc.info["cwd"]).startswith(str(worktree_root)):
                return True
    return False


def reached(phase: str, task_id: str, repo: Path, base: Path, rng: random.Random) -> bool:
    """Wait for ``phase`` of the task's first attempt; False when it went by unseen."""
    row = lambda: task_store.get_task(task_id)   # noqa: E731
    if phase == "claim":
        return wait_until(lambda: row()["status"] == "running", 60, 0.002)
    if phase == "worktree":
        return wait_until(lambda: (base / "wt").is_dir() and any((base / "wt").iterdir())
                          and not row()["agent_pid"], 60, 0.002)
    if phase == "run":
        ok = wait_until(lambda: row()["agent_pid"], 60)
        time.sleep(rng.uniform(0.0, 3.0))  # somewhere in the model call or the slow shell command
        return ok
    if phase == "commit":
        return wait_until(lambda: git_commit_running(base / "wt"), 120, 0.0)
    return wait_until(lambda: branch_commits(repo, task_id) and row()["status"] == "running", 120, 0.002)


def trial(base: Path, model: ScriptedModel, rng: random.Random, phase: str) -> dict[str, bool]:
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
    hit = reached(phase, task["id"], repo, base, rng)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    committed_before = bool(branch_commits(repo, task["id"]))
    asked_before = len(model.step_requests("slow"))
    second = subprocess.run(worker_argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    final = task_store.get_task(task["id"])
    events = task_store.events_since(0, [task["id"]], limit=1000)
    commits = branch_commits(repo, task["id"])
    named = (final.get("result") or {}).get("commit")
    return {
        "lost": final["status"] != "done" or second.returncode != 0,
        "twice": sum(e["kind"] == "done" for e in events) != 1 or len(commits) > 1
                 or (committed_before and len(model.step_requests("slow")) > asked_before),
        "orphan": bool(commits - {named}),
        "leftover": bool(tagged()),
        "missed": not hit,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trials", type=int, help="how many kill-the-worker trials to run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--phase", action="append", choices=PHASES, help="only this phase (repeatable)")
    args = parser.parse_args()
    if not opencode_bin():
        print("opencode not found: run ./install.sh --test first", file=sys.stderr)
        return 1
    rng = random.Random(args.seed)
    phases = args.phase or list(PHASES)
    keys = ("lost", "twice", "orphan", "leftover", "missed")
    totals = {phase: dict.fromkeys(keys, 0) for phase in phases}
    started = time.monotonic()
    with ScriptedModel() as model, tempfile.TemporaryDirectory() as tmp:
        model.script("slow", [
            tool_call("bash", {"command": "sleep 600 > /dev/null 2>&1 & head -c 64M /dev/urandom > big.bin; "
                               "sleep 2; echo slow-step", "description": "slow"}),
            tool_call("write", {"filePath": "{cwd}/out.txt", "content": "finished\n"}),
            text("Done.\n" + DONE),
        ])
        for number in range(args.trials):
            for phase in phases:
                faults = trial(Path(tmp) / f"trial{number}-{phase}", model, rng, phase)
                for key, bad in faults.items():
                    totals[phase][key] += bad
                shown = ", ".join(k for k, v in faults.items() if v) or "ok"
                print(f"trial {number + 1}/{args.trials} {phase}: {shown}", flush=True)
    print(f"{args.trials} trials of each phase in {time.monotonic() - started:.0f} s:")
    for phase, t in totals.items():
        print(f"  {phase:9} lost a task {t['lost']}, ran one twice {t['twice']}, orphaned commit {t['orphan']}, "
              f"left a process {t['leftover']} (kill missed its phase {t['missed']})")
    return 0 if not any(t[k] for t in totals.values() for k in keys if k != "missed") else 1


if __name__ == "__main__":
    sys.exit(main())
