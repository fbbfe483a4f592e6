"""Runs that end oddly, with the real `opencode` and the scripted model: lock, reaper, orphans,
watchdog, cancel, background processes, shutdown."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

import agent_box
import opencode_runner
import process_tree
import task_store
import worker
from fake_openai import hang, text, tool_call
from helpers import ROOT, git, make_repo, run_script, tagged, until

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
DONE = '```json\n{"summary": "ok", "files_touched": [], "tests_run": [], "open_questions": []}\n```'


def start_worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "worker.py"), *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def own_sleep() -> tuple[str, list[str]]:
    """A `sleep` command line no other process on the machine has (another checkout's suite may
    run the same test side by side): (shell command, its argv)."""
    seconds = f"300.{uuid.uuid4().int % 10**9:09d}"
    return f"sleep {seconds}", ["sleep", seconds]


def alive_with_cmdline(argv: list[str]) -> list[psutil.Process]:
    """Live processes with exactly this argv (ours alone: the argv is unique to this test)."""
    return [p for p in psutil.process_iter(["cmdline", "status"])
            if p.info["cmdline"] == argv and p.info["status"] != psutil.STATUS_ZOMBIE]


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie its parent has not reaped yet has ended)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running_with_agent(task_id):
    task = task_store.get_task(task_id)
    return task if task["status"] == "running" and task["agent_pid"] else None


def a_running_agent(opencode, repo: Path, steps: list, **fields) -> tuple[dict, subprocess.Popen, dict,
                                                                             psutil.Process]:
    """A task in ``repo`` whose scripted model answers ``steps``, with ``fields`` for submit_task,
    run by a worker started now (start_worker), waited for until its agent runs: (the task as
    queued, the worker, the task as running, the agent's process)."""
    opencode.model.script("long", steps)
    task = task_store.submit_task(title="long", instructions="SCRIPT:long", working_dir=str(repo), **fields)
    proc = start_worker()
    running = until(lambda: running_with_agent(task["id"]))
    return task, proc, running, psutil.Process(running["agent_pid"])


def test_two_passes_started_together_one_runs_one_exits(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("slow", [hang()])
    task_store.submit_task(title="slow", instructions="SCRIPT:slow", working_dir=str(repo),
                           timeout_sec=5, max_retries=0)
    first, second = start_worker(), start_worker()
    outs = [p.communicate(timeout=120) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0
    held = [out for out, _ in outs if "holds the lock" in out]
    assert len(held) == 1, outs
    assert "up to 1 task(s) at once" in held[0] and "--slots N" in held[0], held[0]
    assert task_store.get_task("t_0001")["status"] == "failed"
    assert tagged() == []


def test_sigkilled_worker_is_reaped_once_and_its_run_killed(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    task, proc, running, agent = a_running_agent(opencode, repo, [hang()], timeout_sec=300, max_retries=2)
    os.kill(proc.pid, signal.SIGKILL)
    # Not reaped by its parent yet (a shell script's `kill -9 $pid; worker.py`): a zombie, which
    # the next pass took for a live worker and left its task running (a fresh user's finding).
    until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    assert agent.is_running(), "the orphaned agent outlives its worker until the reaper comes"
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    # The default stale limit is 15 min, but the lease's worker (pid + start time) is gone.
    assert worker.reap(worker.Knobs()) == 1
    assert worker.reap(worker.Knobs()) == 0
    after = task_store.get_task(task["id"])
    assert after["status"] == "pending" and f"its worker (pid {proc.pid}) is gone" in after["error"]
    kinds = [e["kind"] for e in task_store.events_since(0, [task["id"]])]
    assert kinds.count("requeued") == 1
    assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
    assert tagged() == []
    with pytest.raises(task_store.StaleAttempt):
        task_store.complete_attempt(task["id"], running["run_marker"], result={"summary": "late"})
    proc.wait()


def test_the_next_attempt_saves_what_a_killed_attempts_worktree_held_before_making_it_anew(opencode, tmp_path,
                                                                                             monkeypatch):
    """A fresh user's finding: a worker killed mid-run leaves the task's worktree as the run left
    it (and a person may edit it then); the next attempt removed it to start from the base, and
    that work was gone without a trace. It is moved aside whole first, and the worker's log and
    the new attempt's receipt say where."""
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    repo = make_repo(tmp_path / "repo")
    task, proc, running, _agent = a_running_agent(
        opencode, repo, [tool_call("write", {"filePath": "{cwd}/slow.txt", "content": "first\n"}), hang()],
        timeout_sec=300, max_retries=1)
    worktree = Path(running["worktree_path"])
    until(lambda: (worktree / "slow.txt").exists(), what="the first attempt's write")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (worktree / "mine.txt").write_text("my precious edit\n")
    opencode.model.script("long", [tool_call("write", {"filePath": "{cwd}/slow.txt", "content": "second\n"}),
                                   text("Done.\n" + DONE)])
    final, aside, passed = _next_pass_finishes(task)
    assert (aside / "mine.txt").read_text() == "my precious edit\n"
    assert (aside / "slow.txt").read_text() == "first\n"
    assert git(repo, "show", f"{final['result']['commit']}:slow.txt") == "second"
    assert "mine.txt" not in final["result"]["files_touched"]
    said = " ".join((passed.stdout + passed.stderr).split())
    for words in (final["result"]["leftover_saved"], said):
        assert f"was moved to {aside} before this attempt made it anew" in words, words


def test_lease_of_a_worker_elsewhere_is_reaped_only_when_its_heartbeat_is_stale(tmp_path, monkeypatch):
    task = task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path), host="another-host")
    monkeypatch.setenv("TASKBRIDGE_HOST", "another-host")   # the lease records the claimer's host
    task_store.claim_next("worker:another-host:4242", pid=4242, pid_start=1.0)
    monkeypatch.delenv("TASKBRIDGE_HOST")
    assert worker.reap(worker.Knobs()) == 0, "a live heartbeat from another host is respected"
    monkeypatch.setenv("WORKER_STALE_SEC", "1")
    time.sleep(1.2)
    assert worker.reap(worker.Knobs()) == 1
    assert "no heartbeat since" in task_store.get_task(task["id"])["error"]
    # Its log said nothing of how the attempt ended; its worker could not (a fresh tester's finding).
    said = [e["text"] for e in opencode_runner.render_log(task_store.log_path(task["id"]).read_text())]
    assert said[-1].startswith("lease of attempt br-1-a1 ended: no heartbeat since") and \
        said[-1].endswith("; the reaper handed it back"), said


def test_a_live_workers_lease_is_not_reaped(tmp_path):
    task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path))
    owner, pid, start = worker.worker_identity()
    task_store.claim_next(owner, pid, start)
    assert worker.reap(worker.Knobs()) == 0
    assert task_store.get_task("t_0001")["status"] == "running"


def test_reaper_never_signals_a_recycled_pid(tmp_path, monkeypatch):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        task = task_store.submit_task(title="x", instructions="i", working_dir=str(tmp_path))
        claimed = task_store.claim_next("worker:gone:1", pid=bystander.pid, pid_start=1.0)
        # The recorded agent pid is now an unrelated program (different start time).
        task_store.renew_lease(task["id"], claimed["run_marker"], agent_pid=bystander.pid,
                               agent_pid_start=psutil.Process(bystander.pid).create_time() - 500)
        monkeypatch.setenv("WORKER_STALE_SEC", "0")
        time.sleep(0.05)
        assert worker.reap(worker.Knobs()) == 1
        assert bystander.poll() is None, "an unrelated process was signalled"
    finally:
        bystander.kill()


def test_background_process_killed_after_normal_finish(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    command, argv = own_sleep()
    opencode.model.script("bg", [
        tool_call("bash", {"command": f"{command} > /dev/null 2>&1 &", "description": "background"}),
        text("started it\n" + DONE),
    ])
    task = task_store.submit_task(title="bg", instructions="SCRIPT:bg", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "done"
    assert tagged() == []
    assert alive_with_cmdline(argv) == []


def test_background_process_killed_after_timeout(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    command, argv = own_sleep()
    opencode.model.script("bgslow", [
        tool_call("bash", {"command": f"{command} > /dev/null 2>&1 &", "description": "background"}),
        hang(),
    ])
    task = task_store.submit_task(title="bg", instructions="SCRIPT:bgslow", working_dir=str(repo),
                                  timeout_sec=8, max_retries=0)
    assert run_script("worker.py").returncode == 0
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed" and "timed out after 8 s" in final["error"]
    assert "SIGKILL" in final["error"]
    # its log says how it ended (it stopped at the last event, where a reaped one got a line)
    assert "[worker] the run was ended: timed out after 8 s" in task_store.read_task_log(task["id"]).decode()
    assert tagged() == []
    assert alive_with_cmdline(argv) == []


def test_silent_run_ended_by_inactivity_watchdog(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("WORKER_INACTIVITY_SEC", "4")
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    opencode.model.script("quiet", [hang()])
    task = task_store.submit_task(title="quiet", instructions="SCRIPT:quiet", working_dir=str(repo),
                                  timeout_sec=600, max_retries=0)
    started = time.monotonic()
    assert run_script("worker.py").returncode == 0
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed" and "inactivity watchdog" in final["error"]
    assert time.monotonic() - started < 60
    assert tagged() == []


def test_cancel_running_task_ends_it_within_5_seconds(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    task, proc, _running, agent = a_running_agent(opencode, repo, [hang()], timeout_sec=300)
    cancelled_at = time.monotonic()
    task_store.cancel_task(task["id"])
    psutil.wait_procs([agent], timeout=5)
    assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - cancelled_at < 5
    out, err = proc.communicate(timeout=30)
    final = task_store.get_task(task["id"])
    assert final["status"] == "cancelled"
    assert final["wrapping_up"] is None, "its worker said it was done with it: a retry may start"
    assert tagged() == []
    # the worker says it was a cancel (it said "cancelled or taken over elsewhere")
    said = " ".join((out + err).split())
    assert f"{task['id']} attempt ended after" in said and "the task was cancelled; its run was ended" in said, said
    assert "taken over" not in said, said


def test_a_cancelled_run_keeps_its_receipt_and_diff_and_a_readonly_one_is_reverted(opencode, tmp_path, monkeypatch):
    """A cancel ended a run with nothing observed: the agent's uncommitted changes went with its
    worktree (a timeout's receipt and diff kept them), and a readonly run in place without a box
    kept its shell's writes in the user's folder (the revert ran only at a run's own end). A
    cancelled run is now observed as any run's end: its receipt and diff say what it changed,
    and a readonly run's writes are undone."""
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    repo = make_repo(tmp_path / "repo")
    task, proc, running, _agent = a_running_agent(
        opencode, repo, [tool_call("write", {"filePath": "{cwd}/lib.py", "content": "half done\n"}), hang()],
        timeout_sec=300)
    until(lambda: (Path(running["worktree_path"]) / "lib.py").exists(), what="the agent's write")
    task_store.cancel_task(task["id"])
    proc.communicate(timeout=60)
    final = task_store.get_task(task["id"])
    assert final["status"] == "cancelled" and final["result"], final
    assert final["result"]["files_touched"] == ["lib.py"], final["result"]
    assert "+half done" in final["diff"], final["diff"]
    assert not Path(running["worktree_path"]).exists()
    assert any(e["kind"] == "receipt" and "had changed 1 file(s)" in e["message"] for e in final["events"])

    # readonly, in place, no box: the revert after the run is all that keeps the folder
    plain, sneaky = _sneaking_readonly_task(opencode, tmp_path, monkeypatch)
    proc = start_worker()
    until(lambda: (plain / "made.txt").exists(), timeout=90, what="the shell's write")
    task_store.cancel_task(sneaky["id"])
    proc.communicate(timeout=60)
    final = task_store.get_task(sneaky["id"])
    assert final["status"] == "cancelled" and final["wrapping_up"] is None
    assert sorted(os.listdir(plain)) == ["a.txt"] and (plain / "a.txt").read_text() == "a\n"
    assert sorted(final["result"]["files_reverted"]) == ["a.txt", "made.txt"], final["result"]
    assert tagged() == []


def _sneaking_readonly_task(opencode, tmp_path: Path, monkeypatch) -> tuple[Path, dict]:
    """(a folder holding a.txt, a readonly task in place there, unboxed, whose agent's shell
    writes made.txt and appends to a.txt, then hangs): only the worker's revert keeps the folder."""
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")
    monkeypatch.setenv("TASKBRIDGE_ALLOW_PROMPT_LEVEL", "1")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("a\n")
    opencode.model.script("sneaks", [
        tool_call("bash", {"command": "echo x > made.txt && echo more >> a.txt", "description": "sh"}), hang()])
    return plain, task_store.submit_task(title="look", instructions="SCRIPT:sneaks", working_dir=str(plain),
                                         worktree=False, permission="readonly", timeout_sec=300)


def test_a_retry_right_after_a_cancel_starts_only_once_the_cancelled_run_is_wrapped_up(opencode, tmp_path,
                                                                                         monkeypatch):
    """A retry right after a cancel was claimed by another slot while the old one still observed
    the cancelled run: for a readonly run in place, the new attempt's snapshot took in the writes
    the old one had not reverted yet, and they stayed. The new attempt now waits for the wrap-up."""
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    plain, task = _sneaking_readonly_task(opencode, tmp_path, monkeypatch)
    proc = start_worker("--watch", "--slots", "2")
    try:
        until(lambda: (plain / "made.txt").exists(), timeout=90, what="the shell's write")
        task_store.cancel_task(task["id"])
        opencode.model.script("sneaks", [text("Looked.\n" + DONE)])
        assert task_store.retry_task(task["id"])["waits"]
        final = until(lambda: (t := task_store.get_task(task["id"]))["status"] == "done" and t, timeout=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert sorted(os.listdir(plain)) == ["a.txt"] and (plain / "a.txt").read_text() == "a\n"
    assert final["attempts"] == 2 and not final["result"].get("files_reverted"), final["result"]
    kinds = [e["kind"] for e in task_store.events_since(0, [task["id"]])]
    assert "wrapped-up" in kinds and kinds.index("wrapped-up") < len(kinds) - 1 - kinds[::-1].index("claimed"), kinds
    assert tagged() == []


def test_watch_first_sigterm_finishes_the_current_task(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ok", [text("fine\n" + DONE)])
    opencode.model.script("waits", [hang()])
    first = task_store.submit_task(title="a", instructions="SCRIPT:ok", working_dir=str(repo))
    proc = start_worker("--watch")
    until(lambda: task_store.get_task(first["id"])["status"] == "done", timeout=90)
    second = task_store.submit_task(title="b", instructions="SCRIPT:waits", working_dir=str(repo),
                                    timeout_sec=300)
    running = until(lambda: running_with_agent(second["id"]))
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert proc.poll() is None, "the first SIGTERM lets the current task go on"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    after = task_store.get_task(second["id"])
    assert after["status"] == "pending"
    assert after["error"] == "worker stopped at once (a second Ctrl-C or SIGTERM); handed back"
    assert after["attempts"] == 1 and after["handbacks"] == 1
    # By pid *and* start time: a recycled pid now owned by another program is not our agent.
    agent = process_tree.same_process(running["agent_pid"], running["agent_pid_start"])
    assert agent is None or agent.status() == psutil.STATUS_ZOMBIE
    assert tagged() == []


def _next_pass_finishes(task: dict) -> tuple[dict, Path, subprocess.CompletedProcess]:
    """Run one worker pass, which must finish ``task`` done: (the task, where its first attempt's
    worktree was set aside: ``<worktree root>/left/<id>-1``, the pass's process)."""
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", final["error"]
    return final, Path(os.environ["TASKBRIDGE_WORKTREE_ROOT"]) / "left" / f"{task['id']}-1", passed


def test_a_stop_at_once_keeps_the_runs_worktree_and_commit_for_the_next_attempt_to_set_aside(opencode, tmp_path,
                                                                                             monkeypatch):
    """A tester's finding: a worker stopped at once (serve.py's one Ctrl-C, a second SIGTERM)
    handed the task back and removed its worktree, with what the agent had written and not
    committed, and nothing recorded it. It is kept as a killed worker's is: the next attempt moves
    it aside whole (worktrees.set_aside), and the branch keeps the commit the agent made."""
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")   # the box keeps the agent's git from committing
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("long", [
        tool_call("bash", {"command": "echo mine > ch.txt && git add ch.txt && "
                                      "git -c user.name=a -c user.email=a@b commit -qm 'agent commit' && "
                                      "echo half > after.txt && echo wrote", "description": "work"}),
        hang()])
    task = task_store.submit_task(title="long", instructions="SCRIPT:long", working_dir=str(repo),
                                  timeout_sec=300, max_retries=1)
    proc = start_worker("--watch", "--stop-at-once")
    running = until(lambda: running_with_agent(task["id"]))
    worktree, branch = Path(running["worktree_path"]), running["branch"]
    until(lambda: (worktree / "after.txt").exists(), what="the agent's work")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    after = task_store.get_task(task["id"])
    assert after["status"] == "pending" and after["handbacks"] == 1, after
    assert "handing it back" in out + err
    assert (worktree / "after.txt").read_text() == "half\n" and (worktree / "ch.txt").read_text() == "mine\n"
    assert git(repo, "show", f"{branch}:ch.txt") == "mine", "the agent's commit left its branch"

    opencode.model.script("long", [tool_call("write", {"filePath": "{cwd}/done.txt", "content": "done\n"}),
                                   text("Done.\n" + DONE)])
    final, aside, _ = _next_pass_finishes(task)
    assert (aside / "after.txt").read_text() == "half\n" and (aside / "ch.txt").read_text() == "mine\n"
    assert any(e["kind"] == "leftover" and str(aside) in e["message"] for e in final["events"]), final["events"]
    assert git(repo, "show", f"{branch}:ch.txt") == "mine", "the agent's commit left its branch"
    assert tagged() == []


def test_slots_run_tasks_side_by_side(opencode, tmp_path):
    """Also the start race: OpenCode processes starting together on a fresh OpenCode data folder
    (two runs; on the warm engine two kept servers) used to fail one of them on OpenCode's own
    migrations ("Failed query: CREATE TABLE"), until the pass had OpenCode's database made first."""
    fresh_opencode_data()
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("slow", [hang()])
    tasks = [task_store.submit_task(title=f"slow {i}", instructions="SCRIPT:slow", working_dir=str(repo),
                                    timeout_sec=6, max_retries=0) for i in range(2)]
    started = time.monotonic()
    result = run_script("worker.py", "--slots", "2")
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    finals = [task_store.get_task(t["id"]) for t in tasks]
    assert all(f["status"] == "failed" and "timed out after 6 s" in f["error"] for f in finals), \
        [(f["status"], f["error"]) for f in finals]
    assert elapsed < 6 * 2, "two 6 s timeouts in one pass ran side by side"
    first, second = sorted(finals, key=lambda f: f["started_at"])
    assert second["started_at"] < first["finished_at"]
    assert tagged() == []


def fresh_opencode_data() -> Path:
    """Remove the prepared OpenCode database the fixture copied into the template of the boxed
    runs' homes (which a pass prepares: agent_box.template_home), as at a first run; its path."""
    db = opencode_runner.opencode_db_path({"XDG_DATA_HOME": agent_box.box_vars(agent_box.template_home())[
        "XDG_DATA_HOME"]})
    for path in (db, db.parent / opencode_runner.DB_PREPARED):
        path.unlink(missing_ok=True)
    return db


def prepare(db: Path, **kw: Any) -> str | None:
    """``prepare_opencode_db`` for ``db`` (the box's, made here without a box)."""
    return opencode_runner.prepare_opencode_db(data_home=str(db.parent.parent), **kw)


def test_opencodes_database_is_made_once_per_binary(opencode, monkeypatch):
    db = fresh_opencode_data()
    stamp = db.parent / opencode_runner.DB_PREPARED
    real_popen, calls = subprocess.Popen, []
    monkeypatch.setattr(opencode_runner.subprocess, "Popen",
                        lambda argv, **kw: calls.append(argv) or real_popen(argv, **kw))
    assert prepare(db) is None
    assert db.exists() and [argv[1:] for argv in calls] == [["session", "list", "--pure"]]
    mark = json.loads(stamp.read_text())
    assert mark["binary"][0] == opencode_runner.opencode_bin() and mark["migrations"] > 0
    assert prepare(db) is None
    assert len(calls) == 1, "a second pass with the same binary and database asks OpenCode nothing"
    db.unlink()   # the database gone: made again
    assert prepare(db) is None and len(calls) == 2 and db.exists()
    stamp.write_text(json.dumps({**mark, "binary": ["/elsewhere/opencode", 1, 1]}))   # another binary's mark
    assert prepare(db) is None and len(calls) == 3


def test_a_held_preparation_lock_is_waited_for_briefly_said_and_left_at_a_stop(opencode):
    """The lock sits beside OpenCode's database, which an agent's shell can reach: held, it is
    waited for (said once) up to lock_wait_sec, or until the worker stops; nothing runs without it."""
    db = fresh_opencode_data()
    held = os.open(db.parent / opencode_runner.DB_PREPARE_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        said: list[str] = []
        problem = prepare(db, lock_wait_sec=0.5, say=said.append)
        assert problem is not None and "was held for over 0.5 s" in problem and not db.exists()
        assert len(said) == 1 and said[0].startswith("waiting up to 0.5 s for another process"), said
        stopping = prepare(db, lock_wait_sec=60, stopping=lambda: True)
        assert stopping is not None and stopping.endswith("the worker is stopping")
        # a worker told to stop while it waits stops at once, and said why it waited
        proc = start_worker("--watch")
        time.sleep(4)   # started, and waiting on the lock
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        assert time.monotonic() - started < opencode_runner.DB_LOCK_WAIT_SEC / 2, err
        assert "for another process that prepares OpenCode's database" in err, err
    finally:
        os.close(held)


def test_a_database_that_cannot_be_made_is_said_and_nothing_is_stamped(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENCODE_BIN", shutil.which("false") or "/bin/false")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    said = opencode_runner.prepare_opencode_db()
    assert said is not None and said.startswith("OpenCode's database was not prepared") \
        and "opencode session list exited 1" in said, said
    assert not (tmp_path / "data" / "opencode" / opencode_runner.DB_PREPARED).exists()
    monkeypatch.setenv("OPENCODE_BIN", str(tmp_path / "nowhere" / "opencode"))
    assert "not found" in opencode_runner.prepare_opencode_db()


def test_the_preparation_follows_no_link_a_run_planted_beside_the_database(monkeypatch, tmp_path):
    """The box's data folder is writable to runs: a link planted as the preparation's lock, or as
    the temporary file its stamp is written through, makes TaskBridge (outside the box) create or
    overwrite nothing where it leads (a hostile tester's finding)."""
    monkeypatch.setenv("OPENCODE_BIN", shutil.which("true") or "/bin/true")
    data = tmp_path / "data" / "opencode"
    data.mkdir(parents=True)
    victim = tmp_path / "victim"
    (data / opencode_runner.DB_PREPARE_LOCK).symlink_to(victim)
    said = prepare(data / "opencode.db")
    assert said is not None and "was not prepared" in said and not victim.exists(), said
    victim.write_text("yours\n")
    stamp = data / opencode_runner.DB_PREPARED
    planted = stamp.with_name(f".{stamp.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    planted.symlink_to(victim)
    task_store.write_private(stamp, "{}")
    assert stamp.read_text() == "{}" and not stamp.is_symlink() and victim.read_text() == "yours\n"


def test_a_one_slot_worker_prepares_opencodes_database_too(opencode, tmp_path):
    """Workers of several queues (one slot each) starting together on a fresh data folder raced
    too: every pass prepares the database, not only one with slots or kept servers."""
    db = fresh_opencode_data()
    opencode.model.script("one", [text("Fine.\n" + DONE)])
    task = task_store.submit_task(title="one", instructions="SCRIPT:one", working_dir=str(make_repo(tmp_path / "r")))
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "done"
    assert json.loads((db.parent / opencode_runner.DB_PREPARED).read_text())["migrations"] > 0


def test_bad_slots_value_is_refused(tmp_path):
    result = run_script("worker.py", "--slots", "0")
    assert result.returncode == 2 and "--slots must be from 1 to 16" in result.stderr


@pytest.mark.parametrize("steps", [0, 6], ids=["silent", "metered-steps"])
def test_a_locked_queue_database_does_not_stretch_a_running_tasks_timeout(opencode, tmp_path, monkeypatch, steps):
    """Another program holds the SQLite queue's write lock for longer than the task's timeout
    (a backup, a `sqlite3` shell left in a transaction): the run is still ended at its timeout,
    not when the lock is let go; its end is written once the database answers again. Every write
    of the run's watch is bounded: the lease renewals and, with model steps, the spend meter's."""
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    step = tool_call("bash", {"command": "sleep 1", "description": "wait"},
                     usage={"prompt_tokens": 10, "completion_tokens": 5})
    task, proc, _running, agent = a_running_agent(opencode, repo, [step] * steps + [hang()], timeout_sec=10,
                                                  max_retries=0, max_tokens=10**9)
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")   # the write lock, held past the timeout
    held_at = time.monotonic()
    try:
        until(lambda: not alive(agent), timeout=45, what="the run's end at its timeout")
        ended_after = time.monotonic() - held_at
        assert proc.poll() is None   # the worker is still waiting to write the task's end
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    # timeout 10 s from the claim (before the lock) + the kill grace 2 s, with room for a loaded machine
    assert ended_after < 14, ended_after
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed" and "timed out after 10 s" in final["error"], final["error"]
    assert tagged() == []


def test_a_stop_at_once_under_a_locked_queue_exits_at_once_and_says_it_was_the_stop(opencode, tmp_path):
    """--stop-at-once (serve.py's worker) with a task in hand while another program holds the
    queue's write lock: the run ends and the worker exits now, not when the lock goes (each write
    of the hand-back waited 30 s for it). The hand-back cannot be written, so the task is left
    running for the next pass's reaper, and the log says the stop gave the write up (it said
    "after WORKER_STALE_SEC (900 s) of outage")."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("long", [hang()])
    task = task_store.submit_task(title="long", instructions="SCRIPT:long", working_dir=str(repo), timeout_sec=300)
    proc = start_worker("--stop-at-once")
    agent = psutil.Process(until(lambda: running_with_agent(task["id"]))["agent_pid"])
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        out, err = proc.communicate(timeout=90)
        stopped_after = time.monotonic() - started
        left = task_store.get_task(task["id"])   # a read answers under the lock (WAL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    said = " ".join((out + err).split())
    assert proc.returncode == 0, said
    assert stopped_after < 10, (stopped_after, said)
    assert not alive(agent) and tagged() == []
    assert left["status"] == "running" and left["run_marker"] == task_store.get_task(task["id"])["run_marker"]
    assert "WORKER_STALE_SEC" not in said, said
    assert f"{task['id']}: the worker stopped before the queue database could be written" in said, said
    assert "left to the next pass" in said, said
    assert f"{task['id']} attempt ended after" in said and "could not be written to the queue; left running" in said
    assert "cancelled or taken over" not in said and "retrying (the running agents go on)" not in said, said


def test_a_cancel_just_before_the_queue_is_locked_ends_the_run_while_it_stays_locked(opencode, tmp_path, monkeypatch):
    """The cancel commits, then another program takes the queue's write lock before the worker's
    next renewal: the renewal cannot write, but a read still answers (WAL), so the worker sees the
    cancel and ends the run now, not when the lock is let go."""
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "2")
    task, proc, _running, agent = a_running_agent(opencode, repo, [hang()], timeout_sec=300, max_retries=0)
    holder = sqlite3.connect(task_store.db_path(), isolation_level=None)
    task_store.cancel_task(task["id"], "by the test")
    holder.execute("BEGIN EXCLUSIVE")
    held_at = time.monotonic()
    try:
        until(lambda: not alive(agent), timeout=30, what="the cancelled run's end under the lock")
        assert time.monotonic() - held_at < 10
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    proc.communicate(timeout=120)
    assert task_store.get_task(task["id"])["status"] == "cancelled"
    assert tagged() == []
