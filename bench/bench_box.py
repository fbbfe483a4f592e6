"""What the agent box costs a run: start time and memory, boxed against unboxed, side by side.

    .venv/bin/python bench/bench_box.py [TRIALS]      # default 200 trials, ~10 s

The box of a real task (agent_box.plan_for over a real git worktree, the same binds a worker run
gets) wraps ``/bin/true``, and each trial times the wrapped and the bare command, interleaved, in
random order: the difference of the medians is what the box adds to a run's start. Then one
boxed ``sleep`` shows the resident memory of bubblewrap's own processes (the outer bwrap and the
namespace's init). Env: none (the queue and folders are a temporary folder's).
"""
from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def boxed_true(folder: Path) -> list[str]:
    """The argv of ``/bin/true`` inside the box a task in a fresh repository under ``folder`` gets."""
    os.environ.update(TASK_DB_PATH=str(folder / "q" / "tasks.db"), TASK_LOG_DIR=str(folder / "q" / "logs"),
                      TASKBRIDGE_WORKTREE_ROOT=str(folder / "wt"), MCP_TOKEN_FILE=str(folder / "no-token"))
    import agent_box
    import worktrees
    from helpers import git, make_repo
    repo = make_repo(folder / "repo")
    tree = folder / "wt" / "repo-t_0001"
    git(repo, "worktree", "add", "-q", "-b", "taskbridge/t_0001", str(tree))
    run = folder / "q" / "logs" / "t_0001.run"
    for sub in ("control", "reply", "tmp", "objects"):
        (run / sub).mkdir(parents=True)
    ws = worktrees.Workspace(mode="worktree", cwd=str(tree), top=str(tree), repo=str(repo), home=str(folder / "home"))
    plan = agent_box.plan_for(ws, dict(os.environ), "auto", run)
    return agent_box.bwrap_argv(plan, ["/bin/true"])


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - started


def box_rss(argv: list[str]) -> int:
    """Bytes resident in bubblewrap's own processes while the boxed command sleeps."""
    import psutil
    proc = subprocess.Popen([*argv[:-1], "/bin/sleep", "3"])
    try:
        time.sleep(1.5)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        return sum(p.memory_info().rss for p in tree if p.name() == "bwrap")
    finally:
        proc.wait(10)


def measure(trials: int) -> dict[str, list[float]]:
    """{"boxed": seconds, "bare": seconds, "rss": [bytes]} over ``trials`` interleaved trials."""
    with tempfile.TemporaryDirectory() as tmp:
        boxed = boxed_true(Path(tmp))
        times: dict[str, list[float]] = {"boxed": [], "bare": []}
        for _ in range(trials):
            pair = [("boxed", boxed), ("bare", ["/bin/true"])]
            random.shuffle(pair)
            for name, argv in pair:
                times[name].append(timed(argv))
        return {**times, "rss": [float(box_rss(boxed))]}


def main() -> int:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    result = measure(trials)
    boxed, bare = statistics.median(result["boxed"]), statistics.median(result["bare"])
    print(f"start, median of {trials}: boxed {boxed * 1000:.1f} ms, bare {bare * 1000:.1f} ms, "
          f"the box adds {(boxed - bare) * 1000:.1f} ms")
    print(f"bubblewrap's own processes: {result['rss'][0] / 2**20:.1f} MB resident")
    return 0


if __name__ == "__main__":
    sys.exit(main())
