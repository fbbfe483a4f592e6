"""The warm engine measured through the real worker, where users feel it (issue 21's targets).

    .venv/bin/python bench/bench_engine_worker.py [TRIALS] [--quick]   # default 5 trials, ~3.5 min;
                                                                      # --quick: 2 trials, ~1.5 min

Two ``worker.py --watch`` subprocesses run side by side, each on a queue of its own: one with
``--engine warm``, one with ``--engine cold`` (one slot each). Each has finished a first throwaway
task, and the warm one's slot holds its next kept server, up and quiet, before every trial. Each
trial runs, in random order: a task submitted to the warm worker, the same task to the cold one,
and a bare ``opencode run`` of the same prompt. Measured: submit (``task_store.submit_task``) →
the model's first request and → the task's status ``done`` (a bare run: its start → first request
and → exit, and the peak RSS of its tree). Then the warm worker again with ``--slots 4``: its idle
tree RSS with four kept servers, and the peak while four tasks in the same repository run at once,
against four times one bare run's peak. RSS is summed over the worker's whole process tree and every
process carrying its queue's tag (``TASKBRIDGE_QUEUE``), sampled every 50 ms (psutil). Between
the two, a backlog: three longer tasks (a bash tool call sleeps BACKLOG_SLEEP_SEC) submitted
together to the warm worker, to a warm worker with the policy before ba98ed0 (the slot's next
server started at the run's end: ``worker.ENGINE_NEXT_AFTER_SEC`` set to infinity) and to the cold
one, in random order: each task's wait (the task before it done → its first model request) and
the whole backlog.

The task is small: one write tool call, then the answer with its receipt block (2 model calls), on
the scripted model (tests/fake_openai.py, arrival times recorded). The warm worker runs with
``-v``; its lines, stamped on arrival, give the last warm trial's timeline (where the time goes).
Prints a table of medians and ratios, then one JSON line.
Env: none of its own (everything lives in a temporary folder; the pinned opencode is used).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import psutil  # noqa: E402

import task_store  # noqa: E402  (reads its env at call time: each queue is named just before use)
from bench_engine import MB, PeakRss, TimedModel, bare_run, first_request, tree  # noqa: E402
from fake_openai import text, tool_call  # noqa: E402
from helpers import AGENT_DONE, make_repo  # noqa: E402
from opencode_env import opencode_bin, opencode_env  # noqa: E402

GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def script(model: TimedModel, name: str) -> str:
    """The small task's script under ``name``; returns the instructions that play it."""
    model.script(name, [tool_call("write", {"filePath": "{cwd}/" + name + ".txt", "content": "x\n"}),
                        text("Done.\n" + AGENT_DONE)])
    return f"SCRIPT:{name} write the file"


class Worker:
    """A ``worker.py --watch`` subprocess on a queue of its own under ``folder/name``; its output
    lines kept with their arrival time (``time.monotonic``)."""

    def __init__(self, folder: Path, name: str, base: dict[str, str], engine: str) -> None:
        self.name, self.engine, self.db, self.repo = name, engine, folder / name / "tasks.db", folder / "repo"
        self.env = {**base, "TASK_DB_PATH": str(self.db), "TASK_LOG_DIR": str(folder / name / "logs"),
                    "TASKBRIDGE_WORKTREE_ROOT": str(folder / name / "wt"),
                    "TASKBRIDGE_MIRROR_DIR": str(folder / name / "mirrors")}
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[tuple[float, str]] = []
        with self.queue():
            self.tag = task_store.queue_tag()

    @contextlib.contextmanager
    def queue(self) -> Iterator[None]:
        """The in-process store talks to this worker's queue inside the block."""
        before = os.environ.get("TASK_DB_PATH")
        os.environ["TASK_DB_PATH"] = str(self.db)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TASK_DB_PATH", None)
            else:
                os.environ["TASK_DB_PATH"] = before

    def start(self, slots: int) -> Worker:
        kind = "warm" if self.engine.startswith("warm") else "cold"
        args = ["--watch", "--engine", kind, "--slots", str(slots), "-v"]
        argv = [sys.executable, "worker.py", *args]
        if self.engine == "warm-after":   # the policy before: the slot's next server starts at the run's end
            argv = [sys.executable, "-c", "import sys, worker; worker.ENGINE_NEXT_AFTER_SEC = float('inf'); "
                    f"sys.exit(worker.main({args!r}))"]
        self.lines = []
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def stop(self) -> float:
        """SIGTERM, wait for the exit (its kept servers stopped); seconds it took."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - started

    def submit(self, instructions: str, title: str) -> tuple[str, float]:
        """Queue the task in a worktree of the bench's repository: (its id, when it was queued)."""
        with self.queue():
            at = time.monotonic()
            task = task_store.submit_task(title=title, instructions=instructions,
                                          working_dir=str(self.repo), worktree=True)
        return str(task["id"]), at

    def wait_done(self, ids: list[str], timeout: float = 300) -> dict[str, float]:
        """When each task reached ``done`` (polled every 20 ms); exits on a failure or a timeout."""
        ended: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < len(ids) and time.monotonic() < deadline:
            with self.queue():
                for task_id in [i for i in ids if i not in ended]:
                    task = task_store.get_task(task_id)
                    if task["status"] == "done":
                        ended[task_id] = time.monotonic()
                    elif task["status"] in ("failed", "cancelled"):
                        raise SystemExit(f"{self.name}: task {task_id} {task['status']}: {task['error']}")
            time.sleep(0.02)
        if len(ended) < len(ids):
            raise SystemExit(f"{self.name}: tasks not done after {timeout:g} s:\n" + self.output())
        return ended

    def output(self) -> str:
        return "\n".join(line for _at, line in self.lines[-40:])

    def tagged(self) -> list[psutil.Process]:
        """Live processes carrying this worker's queue tag (its kept servers, their boxes, runs)."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(*GONE, OSError):
                if proc.environ().get("TASKBRIDGE_QUEUE") == self.tag:
                    found.append(proc)
        return found

    def processes(self) -> list[psutil.Process]:
        """The worker's whole tree and every process carrying its queue tag, once each."""
        assert self.proc is not None
        procs = {p.pid: p for p in [*tree(self.proc.pid), *self.tagged()]}
        return list(procs.values())


class Sampled:
    """``worker.processes()`` for PeakRss: the tree every call, the tagged set every 0.5 s (reading
    every process's environ each 50 ms would load the machine being measured)."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.at = worker, 0.0
        self.kept: list[psutil.Process] = []

    def __call__(self) -> list[psutil.Process]:
        assert self.worker.proc is not None
        if time.monotonic() - self.at > 0.5:
            self.kept, self.at = self.worker.tagged(), time.monotonic()
        procs = {p.pid: p for p in [*tree(self.worker.proc.pid), *self.kept]}
        return list(procs.values())


def servers(worker: Worker) -> dict[str, list[psutil.Process]]:
    """The worker's kept ``opencode serve`` processes (not their bwrap), by run marker."""
    found: dict[str, list[psutil.Process]] = {}
    for proc in worker.tagged():
        with contextlib.suppress(*GONE):
            marker = proc.environ().get("TASKBRIDGE_RUN", "")
            if marker.startswith("eng-") and "serve" in proc.cmdline() and proc.name() != "bwrap":
                found.setdefault(marker, []).append(proc)
    return found


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(*GONE):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def listening(procs: list[psutil.Process]) -> bool:
    for proc in procs:
        with contextlib.suppress(*GONE):
            if any(c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp")):
                return True
    return False


def wait_warm(worker: Worker, count: int, timeout: float = 180) -> float:
    """Wait until ``count`` kept servers listen and the worker's whole tree has been quiet (under
    50 ms of CPU per server) for a second: its slots are idle and warm. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        kept = servers(worker)
        if len(kept) >= count and all(listening(procs) for procs in kept.values()):
            procs = worker.processes()
            before = cpu_seconds(procs)
            time.sleep(1.0)
            if cpu_seconds(procs) - before < 0.05 * count:
                return time.monotonic() - started
        else:
            time.sleep(0.2)
    raise SystemExit(f"{worker.name}: {count} kept server(s) not up and quiet after {timeout:g} s:\n"
                     + worker.output())


def idle_rss(worker: Worker) -> int:
    """The worker's tree RSS (with its kept servers), the median of ten samples over a second."""
    samples = []
    for _ in range(10):
        total = 0
        for proc in worker.processes():
            with contextlib.suppress(*GONE):
                total += proc.memory_info().rss
        samples.append(total)
        time.sleep(0.1)
    return int(statistics.median(samples))


def through(worker: Worker, model: TimedModel, name: str) -> dict[str, float]:
    """One small task through ``worker``: seconds from submit to the first request and to done."""
    task_id, at = worker.submit(script(model, name), name)
    done = worker.wait_done([task_id])[task_id]
    last = max(float(step["at"]) for step in model.step_requests(name))
    return {"first": first_request(model, name) - at, "done": done - at, "after": done - last, "submitted": at}


def bare(model: TimedModel, env: dict[str, str], repo: Path, name: str) -> dict[str, float]:
    """A bare ``opencode run`` of the same prompt (bench_engine.bare_run)."""
    return bare_run(model, env, repo, name, script(model, name))


def timeline(worker: Worker, since: float) -> list[str]:
    """The worker's lines from ``since`` on, each with its milliseconds after ``since``."""
    return [f"+{(at - since) * 1000:7.0f} ms  {line}" for at, line in worker.lines if at >= since]


def trials(model: TimedModel, env: dict[str, str], repo: Path, warm: Worker, cold: Worker,
           count: int) -> dict[str, Any]:
    """``count`` rounds of (warm worker, cold worker, bare run) in random order, each started with
    the warm worker's slot idle and warm."""
    rows: dict[str, list[dict[str, float]]] = {"warm": [], "cold": [], "bare": []}
    waits: list[float] = []
    last_warm: list[str] = []
    for n in range(count):
        kinds = list(rows)
        random.shuffle(kinds)
        for kind in kinds:
            waits.append(wait_warm(warm, 1))
            name = f"{kind}{n}"
            if kind == "bare":
                rows[kind].append(bare(model, env, repo, name))
            else:
                got = through(warm if kind == "warm" else cold, model, name)
                rows[kind].append(got)
                if kind == "warm":
                    last_warm = timeline(warm, got["submitted"])
                    last_warm.append(f"  (model requests: first +{got['first'] * 1000:.0f} ms, last "
                                     f"+{(got['done'] - got['after']) * 1000:.0f} ms; status done "
                                     f"+{got['done'] * 1000:.0f} ms)")
        print(f"  round {n + 1}/{count} done", file=sys.stderr, flush=True)
    return {"rows": rows, "timeline": last_warm,
            "next_server_ready": statistics.median(waits[1:] or waits)}


def long_script(model: TimedModel, name: str) -> str:
    """A longer task under ``name`` (a write, then a bash tool call that sleeps BACKLOG_SLEEP_SEC,
    then the answer); returns its instructions."""
    model.script(name, [tool_call("write", {"filePath": "{cwd}/" + name + ".txt", "content": "x\n"}),
                        tool_call("bash", {"command": f"sleep {BACKLOG_SLEEP_SEC:g}", "description": "wait"}),
                        text("Done.\n" + AGENT_DONE)])
    return f"SCRIPT:{name} write the file and wait"


BACKLOG_SLEEP_SEC = 8


def backlog(model: TimedModel, workers: list[Worker], count: int) -> dict[str, Any]:
    """A queue with work waiting: ``count`` longer tasks (long_script) submitted together to each of
    ``workers`` (one slot each, idle and warm at the start), one worker after the other. For every
    task after the first: the seconds from the task before it reaching ``done`` to its own first
    model request (the gap a task of a backlog waits); and the whole backlog, submit → last done."""
    got: dict[str, Any] = {}
    for worker in workers:
        wait_warm(worker, 1) if worker.engine.startswith("warm") else time.sleep(1)
        names = [f"backlog-{worker.name}-{n}" for n in range(count)]
        submitted = [worker.submit(long_script(model, name), name) for name in names]
        ended = worker.wait_done([task_id for task_id, _at in submitted])
        dones = [ended[task_id] for task_id, _at in submitted]
        firsts = [first_request(model, name) for name in names]
        gaps = [first - done for first, done in zip(firsts[1:], dones, strict=False)]
        got[f"gap_{worker.name}"] = statistics.median(gaps)
        got[f"backlog_{worker.name}"] = max(dones) - submitted[0][1]
    return got


def four_at_once(model: TimedModel, warm: Worker, rounds: int) -> dict[str, Any]:
    """The warm worker with ``--slots 4``: idle tree RSS with four kept servers, then ``rounds``
    times four tasks submitted together: the peak tree RSS and each task's submit → done."""
    warm.start(4)
    got: dict[str, Any] = {}
    peaks, dones = [], []
    try:
        got["start4"] = wait_warm(warm, 4)
        got["idle4"] = idle_rss(warm)
        for n in range(rounds):
            if n:
                wait_warm(warm, 4)
            peak = PeakRss(Sampled(warm))
            submitted = [warm.submit(script(model, f"four{n}x{i}"), f"four{n}x{i}") for i in range(4)]
            ended = warm.wait_done([task_id for task_id, _at in submitted])
            peaks.append(peak.stop())
            dones += [ended[task_id] - at for task_id, at in submitted]
    finally:
        got["stop4"] = warm.stop()
    got["peak4"], got["done4"] = statistics.median(peaks), statistics.median(dones)
    return got


def med(rows: list[dict[str, float]], key: str) -> float:
    return float(statistics.median(row[key] for row in rows))


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The medians, ratios and targets (issue 21) of a run."""
    rows = results["rows"]
    out = {f"{kind}_{key}": med(rows[kind], key) for kind in rows for key in ("first", "done")}
    out["bare_peak"] = med(rows["bare"], "peak")
    out.update({f"{kind}_after": med(rows[kind], "after") for kind in ("warm", "cold")})
    out["warm_done_vs_bare"] = out["warm_done"] / out["bare_done"]
    out["cold_done_vs_bare"] = out["cold_done"] / out["bare_done"]
    out["peak4_vs_4_bare"] = results["peak4"] / (4 * out["bare_peak"])
    out["met_first_500ms"] = out["warm_first"] <= 0.5
    out["met_done_0.3x"] = out["warm_done_vs_bare"] <= 0.3
    out["met_rss_0.5x"] = out["peak4_vs_4_bare"] <= 0.5
    out.update({key: results[key] for key in ("trials", "next_server_ready", "idle1", "start4", "idle4",
                                              "peak4", "done4", "stop1", "stop4")})
    out.update({key: value for key, value in results.items() if key.startswith(("gap_", "backlog_"))})
    return out


def report(s: dict[str, Any], timeline_lines: list[str]) -> None:
    yes = {True: "met", False: "NOT met"}
    print(f"\ntrials: {s['trials']} each, interleaved (medians); 2-core machine")
    print("| figure | warm worker | cold worker | bare `opencode run` | warm ÷ bare | target |")
    print("|---|---|---|---|---|---|")
    print(f"| submit → first model request | {s['warm_first'] * 1000:.0f} ms | {s['cold_first']:.2f} s "
          f"| {s['bare_first']:.2f} s (start →) | {s['warm_first'] / s['bare_first']:.2f}× "
          f"| ≤ 500 ms: {yes[s['met_first_500ms']]} |")
    print(f"| submit → done (small task) | {s['warm_done']:.2f} s | {s['cold_done']:.2f} s "
          f"({s['cold_done_vs_bare']:.2f}×) | {s['bare_done']:.2f} s (start → exit) "
          f"| {s['warm_done_vs_bare']:.2f}× | ≤ 0.3×: {yes[s['met_done_0.3x']]} |")
    print(f"| 4 tasks at once, peak tree RSS | {s['peak4'] / MB:.0f} MB (--slots 4) | — "
          f"| 4 × {s['bare_peak'] / MB:.0f} MB = {4 * s['bare_peak'] / MB:.0f} MB "
          f"| {s['peak4_vs_4_bare']:.2f}× | ≤ 0.5×: {yes[s['met_rss_0.5x']]} |")
    print(f"idle warm worker tree RSS: {s['idle1'] / MB:.0f} MB with 1 slot, {s['idle4'] / MB:.0f} MB "
          f"with 4 (kept servers included); 4 servers up and quiet {s['start4']:.1f} s after the start; "
          f"4 tasks at once: submit → done {s['done4']:.2f} s each (median)")
    print(f"last model request → status done: {s['warm_after']:.2f} s warm, {s['cold_after']:.2f} s cold")
    print(f"a warm slot's next server up and quiet {s['next_server_ready']:.1f} s after the trial before; "
          f"worker stop (SIGTERM → exit): {s['stop1']:.1f} s with 1 slot, {s['stop4']:.1f} s with 4")
    print(f"a backlog of 3 tasks of ~{BACKLOG_SLEEP_SEC} s each, 1 slot: a task's wait, the task before it done → its "
          f"first model request (median): {s['gap_warm']:.2f} s warm, {s['gap_warm-after']:.2f} s warm with the "
          f"next server started at the run's end (before), {s['gap_cold']:.2f} s cold; the whole backlog "
          f"{s['backlog_warm']:.1f} / {s['backlog_warm-after']:.1f} / {s['backlog_cold']:.1f} s")
    print("\nthe last warm trial, from submit (the warm worker's -v lines, stamped on arrival):")
    print("\n".join(timeline_lines))


def bench_env(folder: Path, model: TimedModel) -> dict[str, str]:
    """The workers' environment: OpenCode isolated in ``folder``, the scripted model, no
    notifications, no bearer token, a ``PORT`` nothing listens on (as the tests' own)."""
    env = opencode_env(folder, model.url)
    for name in ("TASK_DB_URL", "TASKBRIDGE_HOST", "MCP_BEARER_TOKEN", "MCP_ALLOWED_HOSTS", "ANTHROPIC_API_KEY"):
        env.pop(name, None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env.update(WORKER_NOTIFY="0", MCP_TOKEN_FILE=str(folder / "no-token"), PORT=str(port))
    return env


def run(folder: Path, model: TimedModel, count: int) -> dict[str, Any]:
    repo = make_repo(folder / "repo")
    env = bench_env(folder, model)
    os.environ.update(env)
    warm, cold = Worker(folder, "warm", env, "warm"), Worker(folder, "cold", env, "cold")
    results: dict[str, Any] = {"trials": count}
    try:
        firsts = [(worker, worker.submit(script(model, "first" + worker.name), "first")[0])
                  for worker in (warm.start(1), cold.start(1))]   # a first task each, not counted
        for worker, task_id in firsts:
            worker.wait_done([task_id])
        results.update(trials(model, env, repo, warm, cold, count))
        wait_warm(warm, 1)
        results["idle1"] = idle_rss(warm)
        before = Worker(folder, "warm-after", env, "warm-after").start(1)   # the next server at the run's end
        try:
            before.wait_done([before.submit(script(model, "firstwarm-after"), "first")[0]])
            order = [warm, before, cold]
            random.shuffle(order)
            results.update(backlog(model, order, 3))
        finally:
            before.stop()
    finally:
        results["stop1"] = warm.stop()
        cold.stop()
    results.update(four_at_once(model, warm, 1 if count < 4 else 2))
    return results


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    count = 2 if "--quick" in sys.argv else int(args[0]) if args else 5
    if not opencode_bin():
        print("opencode is not installed (./install.sh --test)", file=sys.stderr)
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, TimedModel() as model:
        results = run(Path(tmp), model, count)
    figures = summary(results)
    report(figures, results["timeline"])
    figures["seconds"] = time.monotonic() - started
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
