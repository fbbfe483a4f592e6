"""The warm engine in the worker (``worker.py --engine warm``): tasks run on a kept `opencode serve`
per slot (engine_slots.py), driven by engine_client.py under the same Supervisor, in the agent box
made for the slot. The real opencode, the scripted model, a real git repository per test, the real
bubblewrap where the box is asserted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import agent_box
import engine_slots
import task_store
import worker
import worktrees
from fake_openai import text, tool_call
from helpers import AGENT_DONE as DONE
from helpers import ROOT, checkout_state, fake_binary, git, make_repo, run_script, submit, tagged, until
from helpers import bash_step as bash
from helpers import tool_outputs as outputs

pytestmark = pytest.mark.real_opencode


def warm(*args: str) -> object:
    return run_script("worker.py", "--engine", "warm", "-v", *args)


def ran_on_engine(task_id: str) -> bool:
    """The task log's command line is engine_client.py's (a cold run's is `opencode run`)."""
    return "engine_client.py --port" in task_store.log_path(task_id).read_text()


def engine_processes() -> list[psutil.Process]:
    """Live `opencode serve` processes of this test's OpenCode (its config home in the env)."""
    home = os.environ["XDG_CONFIG_HOME"]
    found = []
    for proc in psutil.process_iter():
        try:
            if "serve" in proc.cmdline() and proc.environ().get("XDG_CONFIG_HOME") == home:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def test_two_tasks_run_on_kept_servers_with_the_same_receipts(opencode, tmp_path):
    """The pass's first server is made for the queue's first task; the second task finds the
    slot's next one. Receipts come from observation as in a cold run; nothing is left running."""
    repo = make_repo(tmp_path / "repo")
    before = checkout_state(repo)
    for name in ("one", "two"):
        opencode.model.script(name, [
            tool_call("write", {"filePath": "{cwd}/" + name + ".txt", "content": name + "\n"}),
            bash(f"cat {name}.txt && git status --short && git add {name}.txt && echo git-ok-{name}"),
            text("Done.\n" + DONE),
        ])
    tasks = [submit(repo, script=name) for name in ("one", "two")]
    passed = warm()
    assert passed.returncode == 0, passed.stderr
    # each slot's worktree was parked and opened ahead; opening it sent the model nothing
    assert passed.stderr.count("parked and opened before the claim") == 2, passed.stderr
    assert {r["script"] for r in opencode.model.requests} == {"one", "two"}
    for task, name in zip(tasks, ("one", "two"), strict=True):
        done = task_store.get_task(task["id"])
        assert done["status"] == "done", done["error"]
        assert ran_on_engine(task["id"]), passed.stdout + passed.stderr
        assert done["result"]["files_touched"] == [f"{name}.txt"]
        assert git(repo, "show", f"{done['result']['commit']}:{name}.txt") == name
        assert f"git-ok-{name}" in outputs(done)     # the bash tool's git works (its own index)
        assert done["usage"]["steps"] == 3 and done["usage"]["cost_usd"] > 0
        engine_root = worktrees.worktree_root() / "engine"
        assert Path(done["worktree_path"]).parent.parent == engine_root
    assert checkout_state(repo) == before
    assert git(repo, "fsck", "--no-dangling") == ""
    assert tagged() == [] and tagged("eng-") == []
    assert engine_processes() == []
    # a server's folder is removed with its worktree, or with the server when it got none
    assert not (worktrees.worktree_root() / "engine").exists()


def test_the_box_holds_on_a_kept_server(opencode, tmp_path):
    """The agent of an engine run reaches neither the queue, nor another task's worktree, nor the
    repository's config, nor a folder outside its worktree."""
    repo = make_repo(tmp_path / "repo")
    other = make_repo(tmp_path / "other")
    before_other = checkout_state(other)
    config_before = (repo / ".git" / "config").read_bytes()
    db = task_store.db_path()
    opencode.model.script("first", [text("Nothing.\n" + DONE)])
    first = submit(repo, script="first", worktree_keep=True)
    assert warm("--max-tasks", "1").returncode == 0
    first_wt = task_store.get_task(first["id"])["worktree_path"]
    assert first_wt and Path(first_wt).is_dir()
    theirs = Path(agent_box.line_home(first["id"])) / "data" / "opencode" / "opencode.db"   # its OpenCode sessions
    assert theirs.is_file()
    opencode.model.script("raid", [
        bash(f"ls {first_wt} >/dev/null 2>&1; echo peer-$?; cat {db} >/dev/null 2>&1; echo db-$?; "
             f"echo x 2>/dev/null > {other}/planted.txt; echo other-$?; "   # 2> first: a refusal says nothing
             f"echo x 2>/dev/null >> {repo}/.git/config; echo config-$?; "
             f"ls {worktrees.worktree_root()} 2>&1 | grep -c {first['id']}; echo listed; "
             "(env; cat /proc/[0-9]*/environ) 2>/dev/null | tr '\\0' '\\n' | grep -c OPENCODE_SERVER_PASSWORD; "
             "echo password-looked; "
             f"cat {theirs} >/dev/null 2>&1; echo sessions-$?"),
        text("Tried.\n" + DONE),
    ])
    task = submit(repo, script="raid")
    assert warm().returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert ran_on_engine(task["id"])
    seen = outputs(done)
    assert "peer-0" not in seen and "db-0" not in seen and "other-0" not in seen and "config-0" not in seen, seen
    assert "0\nlisted" in seen, seen   # the worktree root shows none of the other tasks
    assert "0\npassword-looked" in seen, seen   # the server's password: not in its env, nor in /proc
    # OpenCode's folders of its own line (the kept server's, taken over when the task ran on it),
    # where its session is found; the first task's sessions out of sight
    assert "sessions-1" in seen, seen
    assert agent_box.session_home(done["session_id"]) == os.path.realpath(agent_box.line_home(task["id"]))
    assert list(Path(agent_box.slot_home("x")).parent.iterdir()) == []   # the kept servers' own: none left
    assert (repo / ".git" / "config").read_bytes() == config_before
    assert checkout_state(other) == before_other
    assert done["result"]["sandbox"]["box"].startswith("bubblewrap")


def test_timeout_ends_the_tool_processes_of_a_kept_server(opencode, tmp_path, monkeypatch):
    """The task's timeout ends the run; the server is recycled with every process the agent
    started (a detached one too), and what was still running is named in the receipt."""
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("WORKER_KILL_GRACE_SEC", "1")
    opencode.model.script("stuck", [
        bash("nohup sleep 613 >/dev/null 2>&1 & sleep 612"),
        text("never"),
    ])
    task = submit(repo, script="stuck", timeout_sec=25, max_retries=0)
    assert warm().returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "failed" and "timed out after 25 s" in done["error"], done["error"]
    assert ran_on_engine(task["id"])
    # pids inside the box are the box's own: the sleeps are looked for by their command lines
    until(lambda: not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] in
                       (["sleep", "612"], ["sleep", "613"])], 10, "the sleeps to end")
    assert engine_processes() == [] and tagged() == [] and tagged("eng-") == []
    ended = [item["command"] for item in done["result"]["ended_with_run"]]
    assert "sleep 612" in ended and "sleep 613" in ended, ended


def test_a_task_unlike_the_prediction_runs_cold_and_the_next_is_warm(opencode, tmp_path):
    """The server is made for a task like the queue's first; a task in another repository does
    not fit its box: it runs cold, and the slot's next server is made like it."""
    repo = make_repo(tmp_path / "repo")
    elsewhere = make_repo(tmp_path / "elsewhere")
    for name in ("a", "b", "c"):
        opencode.model.script(name, [text("Fine.\n" + DONE)])
    first = submit(repo, script="a", priority=5)
    second = submit(elsewhere, script="b", priority=4)
    third = submit(elsewhere, script="c", priority=3)
    passed = run_script("worker.py", "--engine", "warm")   # not -v: a cold run is said at the default level
    assert passed.returncode == 0, passed.stderr
    states = [task_store.get_task(t["id"]) for t in (first, second, third)]
    assert [s["status"] for s in states] == ["done"] * 3, [s["error"] for s in states]
    assert [ran_on_engine(t["id"]) for t in (first, second, third)] == [True, False, True]
    said = [line for line in passed.stderr.splitlines() if f"] {second['id']}: " in line and "runs cold" in line]
    assert said, passed.stderr
    assert engine_processes() == []


def test_a_server_dying_mid_run_hands_the_task_back_once_for_a_cold_attempt(opencode, tmp_path):
    """The agent kills its own server (it can: they share the box): the attempt is handed back
    without spending a retry, and the next runs cold, in the worktree the first one recorded.
    What the first wrote is kept: its worktree stays, and the next attempt moves it aside whole."""
    repo = make_repo(tmp_path / "repo")
    kill_server = ("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^[^ ]*opencode serve' "
                   "&& kill -9 ${p#/proc/}; done; sleep 5")
    opencode.model.script("suicide", [bash("echo one step > step.txt"), bash(kill_server), text("Survived.\n" + DONE)])
    task = submit(repo, script="suicide", max_retries=0)
    first = warm("--max-tasks", "1")
    assert first.returncode == 0
    mid = task_store.get_task(task["id"])
    assert mid["status"] == "pending" and "handed back" in mid["error"], (mid["status"], mid["error"])
    # It said "failed attempt 1 …; requeued for a retry" though no retry was spent (a tester's finding).
    assert f"{task['id']} handed back to the queue after " in first.stderr
    assert "requeued for a retry" not in first.stderr
    # The model call made before the server died stays booked (it was dropped before).
    assert mid["usage"]["steps"] == 1 and mid["spent_usd"] > 0, mid["usage"]
    # max_retries=0: a counted failure would have failed it
    assert engine_processes() == [] and tagged() == [] and tagged("eng-") == []
    assert warm().returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert len(done["usage"]["by_attempt"]) == 2 and done["spent_usd"] > mid["spent_usd"], done["usage"]
    aside = worktrees.worktree_root() / "left" / f"{task['id']}-1"
    assert (aside / "step.txt").read_text() == "one step\n", "the handed-back attempt's work was removed"
    headers = [line for line in task_store.log_path(task["id"]).read_text().splitlines() if line.startswith("$ ")]
    assert "engine_client.py" in headers[0] and " run --auto " in headers[1], headers


def test_the_first_server_is_made_for_the_task_a_claim_takes_first(opencode, tmp_path):
    """Two tasks of the same priority in two repositories: the pass's first server is made for
    the older one (the claim's order), which then runs warm."""
    older, newer = make_repo(tmp_path / "older"), make_repo(tmp_path / "newer")
    for name in ("old", "new"):
        opencode.model.script(name, [text("Fine.\n" + DONE)])
    first = submit(older, script="old")
    submit(newer, script="new")
    assert warm("--max-tasks", "1").returncode == 0
    assert task_store.get_task(first["id"])["status"] == "done"
    assert ran_on_engine(first["id"])


def test_a_server_that_never_answers_costs_a_bounded_wait_and_the_task_runs_cold(opencode, tmp_path, monkeypatch):
    """`opencode serve` hangs (a plugin install without a network, say): the task waits at most
    ENGINE_WAIT_SEC for it, says why, runs cold, and the pass ends at once after it."""
    real = opencode.bin
    wrapper = fake_binary(tmp_path / "bin", "opencode",
                          f'[ "$1" = serve ] && exec sleep 615\nexec {real} "$@"\n')
    monkeypatch.setenv("OPENCODE_BIN", str(wrapper))
    opencode.model.script("fine", [text("Fine.\n" + DONE)])
    task = submit(make_repo(tmp_path / "repo"), script="fine")
    started = time.monotonic()
    passed = warm()
    elapsed = time.monotonic() - started
    done = task_store.get_task(task["id"])
    assert passed.returncode == 0 and done["status"] == "done", (passed.stdout, done["error"])
    assert not ran_on_engine(task["id"])
    assert "opencode serve did not answer within 20 s); runs cold" in passed.stderr, passed.stderr
    assert elapsed < 20 + 45, elapsed   # the wait, a cold run; no wait for the hung server at the end
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "615"]]


def test_a_cancel_while_the_task_waits_for_its_server_ends_the_wait(opencode, tmp_path, monkeypatch):
    """A task claimed while its slot's server still starts waits up to ENGINE_WAIT_SEC for it; a
    cancel meanwhile used to be seen only after that wait (9 s in a tester's run, 20 s with a
    server that never answers). The wait now looks at the attempt's fence as a run does."""
    real = opencode.bin
    wrapper = fake_binary(tmp_path / "bin", "opencode", f'[ "$1" = serve ] && exec sleep 616\nexec {real} "$@"\n')
    monkeypatch.setenv("OPENCODE_BIN", str(wrapper))
    task = submit(make_repo(tmp_path / "repo"), script="never")
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--engine", "warm", "-v"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: task_store.get_task(task["id"])["status"] == "running", 60, "the claim")
        time.sleep(1)   # in the wait for the server
        task_store.cancel_task(task["id"])
        cancelled = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - cancelled
    finally:
        proc.kill()
    assert proc.returncode == 0 and elapsed < 8, (elapsed, err)
    assert "ended while it waited for its kept server: " in err and "now cancelled" in err, err
    assert task_store.get_task(task["id"])["status"] == "cancelled"
    log = task_store.log_path(task["id"])
    assert not log.exists() or " run --auto " not in log.read_text()   # no cold run after the cancel
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "616"]]


def test_an_unboxed_kept_server_ends_with_a_killed_worker(opencode, tmp_path, monkeypatch):
    """Without a box (TASKBRIDGE_SANDBOX=off) nothing but the server's own parent-death signal
    (run_reaper.py --die-with-parent) ends it when the worker is killed with SIGKILL."""
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")
    opencode.model.script("seed", [text("Fine.\n" + DONE)])
    submit(make_repo(tmp_path / "repo"), script="seed")
    worker = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch", "--engine", "warm"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until(lambda: engine_processes(), 60, "a kept server")
    finally:
        worker.kill()
        worker.wait()
    until(lambda: not engine_processes(), 15, "the kept server to end with the worker")


def test_a_killed_workers_empty_engine_folders_and_parked_worktrees_are_swept_at_the_next_pass(opencode, tmp_path):
    stale = worktrees.worktree_root() / "engine" / "slot_0-deadbeef"
    stale.mkdir(parents=True)
    run = task_store.log_dir() / "engine-slot_0-deadbeef.run"
    (run / "control").mkdir(parents=True)
    kept = worktrees.worktree_root() / "engine" / "slot_0-cafef00d" / "repo-t_0009"
    kept.mkdir(parents=True)   # a worktree a task still has: stays
    repo = make_repo(tmp_path / "repo")
    parked = worktrees.park_worktree(str(repo), worktrees.worktree_root() / "engine" / "slot_0-0ddba11")
    assert str(parked) in git(repo, "worktree", "list")
    assert warm().returncode == 0
    assert not stale.exists() and not run.exists() and kept.is_dir()
    assert not parked.parent.exists() and str(parked) not in git(repo, "worktree", "list"), "no task took it"


def test_a_task_whose_base_differs_from_the_parked_one_keeps_its_work(opencode, tmp_path, monkeypatch):
    """B depends on A, so its base (A's commit) is not the parked HEAD: its worktree is made anew
    where the parked one was. Recycling the server after B's run removed that worktree (a
    detached HEAD looked parked) before B's receipt; only a worktree TaskBridge parked and no task
    took is removed now. Unboxed, so the agent can detach HEAD (the box's git folder is read-only)."""
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("a", [tool_call("write", {"filePath": "{cwd}/a.txt", "content": "a\n"}),
                                text("Done.\n" + DONE)])
    opencode.model.script("b", [tool_call("write", {"filePath": "{cwd}/b.txt", "content": "b\n"}),
                                bash("git checkout -q --detach && echo detached"),
                                text("Done.\n" + DONE)])
    a = submit(repo, script="a")
    b = submit(repo, script="b", depends_on=[a["id"]])
    passed = warm()
    assert passed.returncode == 0, passed.stderr
    done = task_store.get_task(b["id"])
    assert done["status"] == "done" and ran_on_engine(b["id"]), (done["error"], passed.stderr)
    assert "made after the claim" in passed.stderr
    assert git(repo, "show", f"{done['result']['commit']}:b.txt") == "b"
    assert str(worktrees.worktree_root() / "engine") not in git(repo, "worktree", "list")


def test_a_worker_stopped_while_a_worktree_is_being_parked_leaves_none(opencode, tmp_path):
    """The slot's next server parks its worktree while the worker is told to stop; the park (slow
    here: a smudge filter, as Git LFS or a large checkout) is waited for and its worktree
    removed. Before, the worktree stayed registered in the user's repository."""
    repo = make_repo(tmp_path / "repo", {"README.md": "# r\n", ".gitattributes": "*.dat filter=slow\n",
                                         "big.dat": "data\n"})
    git(repo, "config", "filter.slow.smudge", "sleep 4; cat")
    git(repo, "config", "filter.slow.clean", "cat")
    opencode.model.script("s", [text("Fine.\n" + DONE)])
    submit(repo, script="s")
    worker = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch", "--engine", "warm"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: task_store.list_tasks(status="done")["total"] == 1, 120, "the first task")
        engine_root = worktrees.worktree_root() / "engine"
        until(lambda: list(engine_root.glob("slot_0-*/repo")), 60, "the next server's park to begin")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.stderr.read() if worker.stderr else ""
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "engine" not in git(repo, "worktree", "list"), git(repo, "worktree", "list")
    assert not (worktrees.worktree_root() / "engine").exists()


@pytest.mark.parametrize("permission", ["auto", "readonly"])
def test_the_next_server_starts_beside_a_long_run_so_the_next_task_finds_it_ready(opencode, tmp_path, permission):
    """A queue with tasks waiting: once a run has gone on for ENGINE_NEXT_AFTER_SEC, the slot's
    next kept server starts beside it (it used to start only at the run's end, so every task of a
    backlog waited for a server's start, 2-9 s, more than a cold run's). For a restricted preset
    the server's build reads OpenCode's resolved config (~1.5 s), off the run's watch."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("long", [bash("sleep 8 && echo slept"), text("Slept.\n" + DONE)])
    opencode.model.script("next", [text("Fine.\n" + DONE)])
    first = submit(repo, script="long", permission=permission)
    second = submit(repo, script="next", permission=permission)
    passed = warm()
    assert passed.returncode == 0, passed.stderr
    assert [task_store.get_task(t["id"])["status"] for t in (first, second)] == ["done", "done"]
    lines = passed.stderr.splitlines()
    said = (f"{first['id']} has run {worker.ENGINE_NEXT_AFTER_SEC:g} s: "
            "slot_0's next kept OpenCode server starts beside it")
    beside = [n for n, line in enumerate(lines) if said in line]
    first_ended = [n for n, line in enumerate(lines) if f"] {first['id']} done in " in line]
    assert beside and first_ended and beside[0] < first_ended[0], passed.stderr
    assert ran_on_engine(second["id"])
    assert passed.stderr.count("parked and opened before the claim") == 2, passed.stderr
    assert engine_processes() == [] and tagged() == [] and tagged("eng-") == []


def test_a_worker_finishing_its_task_after_a_stop_starts_no_next_server(opencode, tmp_path):
    """SIGTERM during a long run: the worker finishes that task and starts no server beside it,
    since no task will take it."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("long", [bash("sleep 8 && echo slept"), text("Slept.\n" + DONE)])
    task = submit(repo, script="long")
    err_file = tmp_path / "worker.err"
    with open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--engine", "warm", "--watch", "-v"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        until(lambda: f"{task['id']} attempt 1:" in err_file.read_text(), 120, "the attempt to start")
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        proc.kill()
    said = err_file.read_text()
    assert task_store.get_task(task["id"])["status"] == "done", said
    assert "starts beside it" not in said, said
    assert engine_processes() == [] and tagged() == [] and tagged("eng-") == []


class _StandIn:
    """Stands in for engine_slots.Kept in the test of Slots' scheduling alone (the real servers
    are started by the tests above): records which thread began it and whether it was recycled."""

    def __init__(self) -> None:
        self.begun_in: str | None = None
        self.recycled = False
        self.thread = threading.Thread(target=lambda: None)   # a start thread, never started here

    def begin(self) -> _StandIn:
        self.begun_in = threading.current_thread().name
        return self

    def recycle(self, grace: float) -> list:
        self.recycled = True
        return []


def test_a_next_server_is_built_off_the_slots_thread_and_started_from_it():
    """make_ahead returns at once while the build (a slow ``make``) goes on in a thread of its own;
    launch_made says it is not done until the build is, then starts it from the calling thread;
    prepare waits for a build under way instead of making a second; stop_all recycles a server
    still being built."""
    release = threading.Event()
    made: list[_StandIn] = []

    def make(slot: str, prediction: object) -> _StandIn:
        release.wait(10)
        made.append(_StandIn())
        return made[-1]

    slots = engine_slots.Slots(make, first="a task like it")   # type: ignore[arg-type]
    started = time.monotonic()
    slots.make_ahead("slot_0")
    assert time.monotonic() - started < 0.5
    assert slots.launch_made("slot_0") == (False, None) and not slots.has("slot_0")
    release.set()
    assert slots.launch_made("slot_0", wait=10) == (True, None)
    assert made[0].begun_in == threading.current_thread().name and slots.has("slot_0")
    assert slots.prepare("slot_0") is None and len(made) == 1   # the slot has its server: kept
    release.clear()
    slots.make_ahead("slot_1")
    threading.Timer(0.3, release.set).start()
    assert slots.prepare("slot_1") is None and len(made) == 2   # the build under way, waited for
    assert made[1].begun_in == threading.current_thread().name
    release.clear()
    slots.make_ahead("slot_2")
    threading.Timer(0.3, release.set).start()
    slots.stop_all(0)
    assert len(made) == 3 and all(m.recycled for m in made) and made[2].begun_in is None
