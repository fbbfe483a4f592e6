"""What the spending-limit check costs the worker per event, and the metering per step.

    .venv/bin/python bench/bench_spend_meter.py [EVENTS]     # default 200,000 events, ~20 s

Feeds realistic `opencode run --format json` lines (text and tool_use events; step_finish apart)
through the worker's own line handler (worker.OutputLines._line, as a Supervisor wires it: log
write, parse, the limit check, the live line) on a temporary queue, interleaved in rounds with and without a Meter, and
prints the median per-event time of each: their difference is what the check adds to an event
that is not a step. Then times Meter.step (record_spend: the live spend and today's meter in one
write transaction, the check, the gate file rewritten) per step_finish, next to a model call's
own seconds. Env: none (TASK_DB_PATH and TASK_LOG_DIR are set to a temporary folder).
"""
from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def lines() -> list[bytes]:
    tool = {"type": "tool_use", "timestamp": 1, "sessionID": "ses_1", "part": {"tool": "bash", "state": {
        "status": "completed", "input": {"command": "npm test", "description": "run the tests"},
        "output": "ok\n" * 40, "metadata": {"exit": 0}}}}
    text = {"type": "text", "timestamp": 1, "sessionID": "ses_1", "part": {"text": "Looking at the failing test. " * 8}}
    return [json.dumps(tool).encode(), json.dumps(text).encode()]


def per_event(lines, batch: list[bytes], rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        for line in batch:
            lines._line("out", line)
    return (time.perf_counter() - start) / (rounds * len(batch))


def main() -> int:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    folder = tempfile.mkdtemp(prefix="bench-spend-")
    os.environ["TASK_DB_PATH"] = str(Path(folder) / "q" / "tasks.db")
    os.environ["TASK_LOG_DIR"] = str(Path(folder) / "q" / "logs")
    project = Path(folder) / "project"   # the queue's own folder is refused as a task's working_dir
    project.mkdir()
    import agent_box
    import opencode_runner as oc
    import task_store as store
    import worker
    from worker_talk import Talk

    worker.fresh_state(voice=Talk(0))   # quiet: the worker's voice says nothing while it is timed
    store.set_budget(daily_usd=1000)
    task = store.submit_task(title="bench", instructions="x", working_dir=str(project), max_cost_usd=500)
    task = store.claim_next("bench")
    # Real Supervisors' line handling (one without a Meter, one with), fed lines by hand: no
    # OpenCode runs, the log is in memory.
    launch = worker.Launch(["opencode"], {oc.QUEUE_ENV: "bench"}, str(project), "")
    box = agent_box.Support(None, reason="bench: no run")
    meter = worker.Meter(task, str(Path(folder) / "bench.gate"))
    log = io.BytesIO()
    unmetered = worker.Supervisor(task, launch, worker.Knobs(), box)._lines(log)
    metered = worker.Supervisor(task, launch, worker.Knobs(), box, meter=meter)._lines(log)
    batch = lines() * 500
    rounds = max(total // (2 * len(batch)), 1)
    plain, checked = [], []
    for n in range(rounds):          # interleaved, each first in turn, so noise falls on both
        for which in ((unmetered, plain), (metered, checked))[:: 1 if n % 2 else -1]:
            which[1].append(per_event(which[0], batch, 1))
            log.seek(0)
            log.truncate()
    a, b = statistics.median(plain) * 1e6, statistics.median(checked) * 1e6
    print(f"per event, {2 * rounds * len(batch):,} events: without a meter {a:.2f} µs, with one {b:.2f} µs "
          f"(difference {b - a:+.2f} µs, {100 * (b - a) / a:+.1f} %)")
    import timeit
    event, number = json.loads(batch[0]), 2_000_000
    check = timeit.timeit("event.get('type') == 'step_finish' and meter is not None",
                          globals={"event": event, "meter": meter}, number=number) / number
    print(f"the check alone (the expression Supervisor._event runs per event): {check * 1e9:.0f} ns")
    step = {"type": "step_finish", "timestamp": 1, "sessionID": "ses_1", "part": {
        "reason": "tool-calls", "cost": 0.0021, "tokens": {"total": 12000, "input": 11000, "output": 1000}}}
    step_line, times = json.dumps(step).encode(), []
    for _ in range(300):
        start = time.perf_counter()
        metered._line("out", step_line)
        times.append(time.perf_counter() - start)
    times.sort()
    print("per step_finish (parse + record_spend + check + gate file): "
          f"median {statistics.median(times) * 1e3:.2f} ms, "
          f"p95 {times[int(len(times) * 0.95)] * 1e3:.2f} ms; a model call takes seconds")
    meter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
