"""The warm engine against a cold `opencode run`, side by side (issue 21's speed figures).

    .venv/bin/python bench/bench_engine.py [TRIALS] [--box] [--four]   # default 5 trials, ~2 min

One scripted model (tests/fake_openai.py, arrival times recorded) serves both. Each trial runs,
in random order: a bare cold ``opencode run`` (start → the model's first request, start → exit,
the peak RSS of its whole tree sampled every 50 ms); the warm engine in a folder it has already
opened (session create → first request, prompt → first request, prompt → idle); and the warm
engine in a new worktree of the repository it has not opened (the same, plus the RSS it adds).
The task is small: one write tool call, then the answer (2 model calls). Medians are printed, and
the engine's start time and idle RSS (its whole tree). ``--box``: the engine runs in the agent
box (bubblewrap) of the first worktree, the binds a worker run gets (the new-worktree trials are
skipped: that box hides every other worktree). ``--four``: four sessions at once in one engine
(four new worktrees), its peak RSS against four times one bare run's peak.
Env: none of its own (everything lives in a temporary folder; the pinned opencode is used).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import psutil  # noqa: E402

import engine  # noqa: E402
import opencode_runner  # noqa: E402
from fake_openai import ScriptedModel, text, tool_call  # noqa: E402
from helpers import git, make_repo  # noqa: E402
from opencode_env import MODEL, opencode_bin, opencode_env  # noqa: E402

MB = 2**20


class TimedModel(ScriptedModel):
    """The scripted model, each request stamped with its arrival (``time.monotonic``)."""

    def _record(self, entry: dict[str, Any]) -> None:
        entry["at"] = time.monotonic()
        super()._record(entry)


class PeakRss:
    """Samples the summed RSS of a process tree every 50 ms in a thread; ``peak`` in bytes."""

    def __init__(self, procs: Callable[[], list[psutil.Process]]) -> None:
        self.procs, self.peak, self.done = procs, 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.is_set():
            total = 0
            for proc in self.procs():
                try:
                    total += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
            self.peak = max(self.peak, total)
            self.done.wait(0.05)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def first_request(model: TimedModel, script: str) -> float:
    """When the first step request of ``script`` arrived (monotonic seconds)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        steps = model.step_requests(script)
        if steps:
            return float(steps[0]["at"])
        time.sleep(0.01)
    raise SystemExit(f"the model never saw a request for {script}")


def cold(model: TimedModel, env: dict[str, str], repo: Path, name: str) -> dict[str, float]:
    """One bare ``opencode run`` of the small task (see ``bare_run``)."""
    model.script(name, [tool_call("write", {"filePath": "{cwd}/" + name + ".txt", "content": "x\n"}), text("ok")])
    return bare_run(model, env, repo, name, f"SCRIPT:{name} write the file")


def bare_run(model: TimedModel, env: dict[str, str], repo: Path, name: str, prompt: str) -> dict[str, float]:
    """One bare ``opencode run`` of ``prompt`` (a script already given to ``model`` as ``name``):
    seconds to the first request and to exit, peak bytes of its tree."""
    run_env = opencode_runner.run_env(env, str(repo), "br-" + name, "bench", "auto")
    argv = [str(opencode_bin()), "run", "--auto", "--format", "json", "-m", MODEL, "--title", "br-" + name]
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=repo, env=run_env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    peak = PeakRss(lambda: tree(proc.pid))
    assert proc.stdin is not None
    proc.stdin.write(prompt)
    proc.stdin.close()
    proc.wait(300)
    ended = time.monotonic()
    return {"first": first_request(model, name) - started, "done": ended - started, "peak": peak.stop()}


def warm(model: TimedModel, eng: engine.Engine, folder: Path, name: str) -> dict[str, float]:
    """The same task on the engine in ``folder``: seconds from session create and from prompt
    to the first request, prompt to idle."""
    model.script(name, [tool_call("write", {"filePath": "{cwd}/" + name + ".txt", "content": "x\n"}), text("ok")])
    created = time.monotonic()
    session = eng.create_session(str(folder), "br-" + name)
    with eng.events(str(folder)) as stream:
        prompted = time.monotonic()
        eng.prompt(session, str(folder), f"SCRIPT:{name} write the file", model=MODEL)
        for _event in stream.follow(session):
            pass
        ended = time.monotonic()
    at = first_request(model, name)
    return {"first_from_create": at - created, "first": at - prompted, "done": ended - prompted,
            "done_from_create": ended - created}


def new_worktree(repo: Path, name: str) -> Path:
    folder = repo.parent / "wt" / name
    git(repo, "worktree", "add", "-q", "-b", "taskbridge/" + name, str(folder))
    return folder


def box_for(folder: Path, env: dict[str, str]) -> engine.Box:
    """The agent box of a worker run in ``folder`` (a worktree), as an Engine box."""
    import agent_box
    import worktrees
    run = folder.parent.parent / "runs" / folder.name
    for sub in ("control", "reply", "tmp", "objects"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    ws = worktrees.Workspace(mode="worktree", cwd=str(folder), top=str(folder), repo=str(folder.parent.parent / "repo"),
                             home=str(run / "home"))
    plan = agent_box.plan_for(ws, env, "auto", run)
    return lambda argv, run_env: (agent_box.bwrap_argv(plan, argv), agent_box.agent_env(run_env, MODEL))



def trials(model: TimedModel, eng: engine.Engine, env: dict[str, str], repo: Path, count: int,
           opened: Path) -> dict[str, list[dict[str, float]]]:
    """``count`` rounds of (cold, warm in ``opened``, warm in a new worktree), in random order.
    A boxed engine skips the new worktrees: its box, made for ``opened``, hides them."""
    results: dict[str, list[dict[str, float]]] = {"cold": [], "opened": [], "new": []}
    for n in range(count + 1):   # round 0 warms disks and caches and is not counted
        kinds = ["cold", "opened"] if eng.box else ["cold", "opened", "new"]
        random.shuffle(kinds)
        for kind in kinds:
            name = f"{kind}{n}"
            if kind == "cold":
                got = cold(model, env, repo, name)
            elif kind == "opened":
                got = warm(model, eng, opened, name)
            else:
                before = eng.rss()
                got = warm(model, eng, new_worktree(repo, name), name)
                folder = repo.parent / "wt" / name
                got["added_rss"] = eng.rss() - before
                eng.release(str(folder))
                time.sleep(1)
                got["released_rss"] = eng.rss() - before
            if n:
                results[kind].append(got)
    return results


def four_at_once(model: TimedModel, eng: engine.Engine, repo: Path) -> int:
    """Peak bytes of the engine's tree while four sessions in four new worktrees run at once."""
    peak = PeakRss(eng.processes)
    threads = [threading.Thread(target=warm, args=(model, eng, new_worktree(repo, f"four{i}"), f"four{i}"))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return peak.stop()


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def report(results: dict[str, Any]) -> None:
    c, o, n = results["cold"], results["opened"], results["new"]
    print(f"trials: {len(c)} each (medians); engine start → healthy and config loaded: {results['start']:.2f} s, "
          f"stop (whole tree gone): {results['stop']:.2f} s")
    print(f"cold `opencode run`: start → first model request {med(c, 'first'):.2f} s, "
          f"start → done {med(c, 'done'):.2f} s, peak RSS {med(c, 'peak') / MB:.0f} MB")
    for label, rows in (("opened folder", o), ("new worktree", n)) if n else (("opened folder, boxed", o),):
        print(f"warm engine, {label}: prompt → first request {med(rows, 'first') * 1000:.0f} ms "
              f"(from session create {med(rows, 'first_from_create') * 1000:.0f} ms), "
              f"prompt → done {med(rows, 'done'):.2f} s (from create {med(rows, 'done_from_create'):.2f} s), "
              f"{med(rows, 'done_from_create') / med(c, 'done'):.2f}× the cold run")
    if n:
        print(f"a new worktree adds {med(n, 'added_rss') / MB:.0f} MB to the engine; "
              f"{med(n, 'released_rss') / MB:.0f} MB stay after `release` (POST /instance/dispose)")
    print(f"engine idle RSS (whole tree): {results['idle'] / MB:.0f} MB; "
          f"after the trials: {results['after'] / MB:.0f} MB")
    if "four" in results:
        print(f"four sessions at once in one engine: peak {results['four'] / MB:.0f} MB "
              f"= {results['four'] / (4 * med(c, 'peak')):.2f}× four bare runs' peaks "
              f"({4 * med(c, 'peak') / MB:.0f} MB)")


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    count = int(args[0]) if args else 5
    if not opencode_bin():
        print("opencode is not installed (./install.sh --test)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp, TimedModel() as model:
        folder = Path(tmp)
        os.environ.update(TASK_DB_PATH=str(folder / "q" / "tasks.db"), TASK_LOG_DIR=str(folder / "q" / "logs"),
                          TASKBRIDGE_WORKTREE_ROOT=str(folder / "wt"), MCP_TOKEN_FILE=str(folder / "no-token"))
        env = opencode_env(folder, model.url)
        os.environ["OPENCODE_BIN"] = env["OPENCODE_BIN"]
        repo = make_repo(folder / "repo")
        opened = new_worktree(repo, "opened")
        box = box_for(opened, env) if "--box" in sys.argv else None
        started = time.monotonic()
        eng = engine.Engine(opencode_runner.run_env(env, str(opened), "br-engine", "bench", "auto"),
                            str(opened), box=box).start()
        results: dict[str, Any] = {"start": time.monotonic() - started}
        try:
            time.sleep(2)
            results["idle"] = eng.rss()
            results.update(trials(model, eng, env, repo, count, opened))
            results["after"] = eng.rss()
            if "--four" in sys.argv and not box:
                results["four"] = four_at_once(model, eng, repo)
        finally:
            stopping = time.monotonic()
            eng.stop()
            results["stop"] = time.monotonic() - stopping
    report(results)
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, list)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
