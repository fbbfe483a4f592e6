"""What the worker says, through a task's life and two Ctrl-Cs: into a pipe (plain lines) and on
a terminal (a real pty whose Ctrl-C byte the line discipline turns into SIGINT), with the real
`opencode` and a scripted model. Also the worker log beside the database."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest

import task_store
import worker_talk
from fake_openai import text, tool_call
from helpers import ROOT, make_repo

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "ok", "files_touched": [], "tests_run": [], "open_questions": []}\n```'
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Output:
    """Everything a stream of the worker printed, collected by a thread."""

    def __init__(self, read) -> None:
        self.text, self._read = "", read
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while True:
            chunk = self._read()
            if not chunk:
                return
            self.text += ANSI.sub("", chunk.decode(errors="replace"))

    def wait_for(self, needle: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert time.monotonic() < deadline, f"{needle!r} not in the output:\n{self.text}"
            time.sleep(0.1)


def script_tasks(opencode, repo) -> str:
    """A quick task that finishes; a slow one (its bash tool sleeps) to interrupt is scripted too."""
    opencode.model.script("quick", [tool_call("bash", {"command": "echo quick-step", "description": "q"}),
                                    text("Done.\n" + RECEIPT)])
    opencode.model.script("slow", [tool_call("bash", {"command": "echo first-step", "description": "a"}),
                                   tool_call("bash", {"command": "sleep 60", "description": "b"}),
                                   text("Done.\n" + RECEIPT)])
    return task_store.submit_task(title="Quick one", instructions="SCRIPT:quick", working_dir=str(repo))["id"]


def check_life(out: Output, opencode, repo, ctrl_c) -> None:
    """The lines of a task's life, then the two Ctrl-Cs and the hand-back."""
    quick = "t_0001"
    out.wait_for(f"{quick} done in ")
    assert "worker started (pid" in out.text and "model fake/model (default from WORKER_MODEL)" in out.text
    assert "1 slot;" in out.text and "watching for tasks" in out.text
    assert f"{quick} claimed: Quick one (attempt 1 of 2, model fake/model)" in out.text
    # Its bash call changed no file: the line says nothing was committed and its empty branch went.
    assert re.search(rf"{quick} done in \d+\.\d s, \$0\.\d{{4}}, no change: nothing committed; "
                     rf"its empty branch taskbridge/{quick} was deleted", out.text), out.text
    slow = task_store.submit_task(title="Slow one", instructions="SCRIPT:slow", working_dir=str(repo))["id"]
    out.wait_for(f"{slow} claimed: Slow one")
    deadline = time.monotonic() + 60
    while len(opencode.model.step_requests("slow")) < 2:     # the agent is now in `sleep 60`
        assert time.monotonic() < deadline, out.text
        time.sleep(0.2)
    time.sleep(1.0)
    ctrl_c()
    out.wait_for(f"finishing {slow} (Ctrl-C again to stop now)")
    assert task_store.get_task(slow)["status"] == "running"      # the first only asks to finish
    ctrl_c()
    out.wait_for(f"stopping now: ending the run of {slow} and handing it back to the queue")
    out.wait_for(f"{slow} handed back to the queue after")


@pytest.mark.real_opencode
def test_worker_talks_into_a_pipe(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    script_tasks(opencode, repo)
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = Output(lambda: os.read(proc.stderr.fileno(), 65536))
    try:
        check_life(out, opencode, repo, lambda: proc.send_signal(signal.SIGINT))
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    slow = task_store.get_task(2)
    assert slow["status"] == "pending" and slow["handbacks"] == 1, slow["error"]
    assert "\x1b" not in out.text and "⠋" not in out.text     # plain lines, no spinner into a pipe
    assert re.search(r"^\[\d\d:\d\d:\d\d\] t_0001 claimed", out.text, re.MULTILINE)
    log = task_store.state_path("worker.log").read_text()
    assert re.search(r"^\d{4}-\d\d-\d\dT\S+ worker started", log, re.MULTILINE)
    assert "t_0001 done in" in log and "t_0002 handed back" in log


@pytest.mark.real_opencode
def test_worker_talks_on_a_terminal_with_a_live_line(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    script_tasks(opencode, repo)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x00\x28\x00\xa0\x00\x00\x00\x00")   # 40 rows, 160 columns

    def controlling_tty() -> None:      # in the child: a session whose terminal is the pty
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")} | {"TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch", "-v"], stdin=slave,
                            stdout=slave, stderr=slave, env=env, preexec_fn=controlling_tty)
    os.close(slave)

    def read() -> bytes:
        ready, _, _ = select.select([master], [], [], 1.0)
        try:
            return os.read(master, 65536) if ready else b" "
        except OSError:
            return b""

    out = Output(read)
    try:
        # A real Ctrl-C: the byte the terminal sends; the pty's line discipline makes it SIGINT.
        check_life(out, opencode, repo, lambda: os.write(master, b"\x03"))
        out.wait_for("model call")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert task_store.get_task(2)["status"] == "pending"
    assert "t_0002" in out.text and "last tool: bash: echo first-step" in out.text   # the live line
    assert "t_0001 bash: echo quick-step" in out.text                               # -v: every tool call


def test_worker_lines_escape_control_characters_as_the_cli_does():
    """One escaping for the worker's lines and the CLI's one-line fields: ESC, C1, bidi overrides,
    tab, newline and CR all show as visible escapes, and the two agree."""
    import tasks_cli
    evil = "a\x1b]0;pwn\x07b\tc\nd\re\x9bf\u202eg"
    assert worker_talk.plain(evil) == tasks_cli.visible(evil, multiline=False) == \
        "a\\x1b]0;pwn\\x07b\\tc\\nd\\re\\x9bf\\u202eg"


def test_worker_log_stays_bounded(monkeypatch):
    monkeypatch.setattr(worker_talk, "LOG_MAX_BYTES", 4000)
    for n in range(400):
        worker_talk.write_log_line(f"line {n:04d} " + "x" * 40)
    log = task_store.state_path("worker.log").read_text()
    assert len(log.encode()) <= 4000 and log.splitlines()[-1].endswith("x" * 40)
    assert "line 0399" in log and "line 0000" not in log
    assert all(re.match(r"\d{4}-\d\d-\d\dT\S+ line \d{4} x+$", entry) for entry in log.splitlines())


@pytest.mark.parametrize("foreground", [True, False])
def test_live_line_only_on_a_terminal_the_worker_has_in_the_foreground(foreground):
    """serve.py starts the worker in a session of its own on the user's terminal: there it prints
    plain lines, not a live line drawn over serve's own output."""
    master, slave = pty.openpty()

    def session() -> None:
        os.setsid()
        if foreground:
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    probe = "import worker_talk as t; print('RICH' if t.Talk(terminal=None).console else 'PLAIN')"
    proc = subprocess.run([sys.executable, "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=slave, cwd=ROOT, preexec_fn=session, text=True, timeout=60)
    os.close(slave)
    os.close(master)
    assert proc.stdout.strip() == ("RICH" if foreground else "PLAIN")


def test_a_one_pass_run_by_hand_that_finds_nothing_to_claim_says_so():
    """A fresh user's finding: `worker.py` run by hand on a queue with nothing claimable printed
    nothing at all (no start line: a one-pass announces itself once it has work). On a terminal it
    says so in one line; a schedule's pass (output to a file) stays quiet."""
    task_store.connect().close()
    master, slave = pty.openpty()
    proc = subprocess.run([sys.executable, str(ROOT / "worker.py")], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=slave, cwd=ROOT, text=True, timeout=60)
    os.close(slave)
    said = b""
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        said += chunk
    os.close(master)
    assert proc.returncode == 0, proc.stdout
    assert f"one pass over {task_store.db_path()}: nothing to claim, no task is pending" in said.decode(), said
    piped = subprocess.run([sys.executable, str(ROOT / "worker.py")], capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and piped.stdout == piped.stderr == "", piped


def test_an_attempt_ended_from_outside_says_what_ended_it(tmp_path):
    """A fresh user's finding: a plain `tasks_cli.py cancel` of a running task was reported as
    "cancelled or taken over elsewhere". The task's row says which it was, and the end line says
    that one: a cancel (with its reason), the reaper's hand-back, another attempt that took the
    task over, a row removed."""
    repo = make_repo(tmp_path / "repo")
    one = task_store.submit_task(title="one", instructions="i", working_dir=str(repo))
    claimed = task_store.claim_next("worker:test")
    task_store.cancel_task(one["id"], "by the test")
    said, _ = worker_talk.ended_line(claimed, None, 2.0, now=task_store.get_task(one["id"]))
    assert said.startswith(f"{one['id']} attempt ended after 2.0 s: the task was cancelled (by the test)"), said
    assert "taken over" not in said, said

    two = task_store.submit_task(title="two", instructions="i", working_dir=str(repo))
    first = task_store.claim_next("worker:test")
    task_store.requeue_attempt(two["id"], first["run_marker"],
                               f"{worker_talk.REAPED_PREFIX}{first['run_marker']} ended: its worker is gone")
    said, _ = worker_talk.ended_line(first, None, 2.0, now=task_store.get_task(two["id"]))
    assert "the reaper handed it back to the queue" in said and "cancelled" not in said, said
    second = task_store.claim_next("worker:test", task_id=two["id"])
    assert second is not None and second["run_marker"] != first["run_marker"]
    said, _ = worker_talk.ended_line(first, None, 2.0, now=task_store.get_task(two["id"]))
    assert f"taken over by attempt {second['run_marker']}" in said and "cancelled" not in said, said
    said, _ = worker_talk.ended_line(first, None, 2.0, now={"status": "gone"})
    assert "no longer in the queue" in said and "cancelled" not in said, said
