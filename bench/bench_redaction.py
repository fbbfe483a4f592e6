"""The cost of redaction on the worker's hot log path: a 10 MB task log through the worker's
line handling (``worker.OutputLines.feed``: lines assembled, redacted, parsed, written), with
and without secrets held (three: token, API key, database password), and the same log through
``redaction.redact`` alone.

    .venv/bin/python bench/bench_redaction.py [MB]      # default 10 MB, ~10 s

The log is OpenCode event lines (a tool call's output of ~300 bytes each), one in 500 carrying
the bearer token. Prints seconds and MB/s per case; the difference between the first two is
what redaction costs a run.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]
TOKEN = "bench-bearer-token-4c2b9e1f7d6a5b8c0011"
HELD = {"MCP_BEARER_TOKEN": TOKEN, "ANTHROPIC_API_KEY": "sk-ant-api03-bench-9f8e7d6c5b4a3210",
        "PGPASSWORD": "bench-pg-password-e3d2c1"}


def event_lines(megabytes: float) -> list[bytes]:
    """OpenCode-like tool_use lines totalling ``megabytes``; every 500th prints the token."""
    lines, size, n = [], 0, 0
    while size < megabytes * 1_000_000:
        output = ("ordinary build output line, nothing secret in it " * 6) + (TOKEN if n % 500 == 0 else "")
        line = json.dumps({"type": "tool_use", "timestamp": n, "sessionID": "ses_x", "part": {
            "tool": "bash", "state": {"status": "completed", "input": {"command": "make"}, "output": output,
                                      "metadata": {"exit": 0}}}}).encode()
        lines.append(line)
        size, n = size + len(line) + 1, n + 1
    return lines


def through_worker(data: bytes, secrets_held: bool) -> float:
    import agent_box
    import opencode_runner as oc
    import worker
    for name, value in HELD.items():
        os.environ.pop(name, None)
        if secrets_held:
            os.environ[name] = value
    # A real Supervisor's line handling (its redactor made now, from the secrets just set), fed
    # OpenCode's output by hand: no OpenCode runs, its log is in memory.
    task = {"id": "t_0001", "run_marker": "br-1-a1", "attempts": 1}
    launch = worker.Launch(["opencode"], {oc.QUEUE_ENV: "bench"}, os.getcwd(), "")
    sup = worker.Supervisor(task, launch, worker.Knobs(), agent_box.Support(None, reason="bench: no run"))
    log = io.BytesIO()
    lines = sup._lines(log)
    started = time.perf_counter()
    for at in range(0, len(data), worker.SPOOL_READ):   # as the worker reads OpenCode's stdout file
        lines.feed("out", data[at:at + worker.SPOOL_READ])
    seconds = time.perf_counter() - started
    assert (TOKEN.encode() in log.getvalue()) is not secrets_held
    return seconds


def main() -> int:
    megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 10
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(TASK_DB_PATH=f"{tmp}/tasks.db", TASK_LOG_DIR=f"{tmp}/logs",
                          MCP_TOKEN_FILE=f"{tmp}/no-token", PGPASSFILE=f"{tmp}/no-pgpass")
        for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "PGPASSWORD", "TASK_DB_URL"):
            os.environ.pop(name, None)
        lines = event_lines(megabytes)
        data = b"\n".join(lines) + b"\n"
        mb = len(data) / 1e6
        plain = through_worker(data, secrets_held=False)
        held = through_worker(data, secrets_held=True)
        import redaction
        redactor = redaction.current()
        started = time.perf_counter()
        for line in lines:
            redactor.redact(line)
        alone = time.perf_counter() - started
    print(f"{mb:.1f} MB, {len(lines):,} lines")
    print(f"worker line path, no secret held : {plain:6.3f} s  ({mb / plain:6.1f} MB/s)")
    print(f"worker line path, 3 secrets held : {held:6.3f} s  ({mb / held:6.1f} MB/s)")
    print(f"redact() alone, per line         : {alone:6.3f} s  ({mb / alone:6.1f} MB/s, "
          f"{alone / len(lines) * 1e6:.2f} µs a line)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
