"""A disk that fills up or turns read-only under the queue (issue 24 §1), made for real: the worker
runs in a mount namespace of its own (``unshare -m``, or ``unshare -rm`` as an ordinary user) on a
small tmpfs that holds the queue and the worktrees; the repository stays on the test's disk, as a
user's checkout does. The agent (the real `opencode`, scripted) fills that tmpfs with an ignored
file in its worktree, and the test keeps it full from then on, so the disk is full when the run
finishes and TaskBridge records it.

A paid, finished run is never run again because a bookkeeping write failed: the worker holds the
result and retries while the disk is full, and a worker killed meanwhile (or after its commit)
leaves the commit on the task branch, from which the next pass records the task."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import task_store
from fake_openai import text, tool_call
from helpers import ROOT, git, make_repo, run_script, submit

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
DONE = '```json\n{"summary": "wrote the feature", "files_touched": ["feature.txt"], "tests_run": [], ' \
       '"open_questions": []}\n```'
DISK_MB = 24


def namespaces_work() -> bool:
    probe = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    return shutil.which("unshare") is not None and subprocess.run(
        [*probe, "sh", "-c", "mount -t tmpfs -o size=1M none /mnt || mount -t tmpfs -o size=1M none /tmp"],
        capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not namespaces_work(), reason="no mount namespaces here (unshare)")


class SmallDisk:
    """``disk`` (a folder of the test) mounted as a ``DISK_MB`` tmpfs for each worker pass: its
    contents are carried in before the pass and out after it, so the test reads the queue there
    between passes as if the disk were always mounted."""

    def __init__(self, disk: Path):
        self.disk, self.saved = disk, disk.with_name(disk.name + ".saved")
        self.proc: subprocess.Popen | None = None

    def start(self, *worker_args: str) -> None:
        task_store.close_connections()
        self.disk.rename(self.saved)
        self.disk.mkdir()
        d, s = str(self.disk), str(self.saved)
        script = (f'mount -t tmpfs -o size={DISK_MB}M none "{d}" && cp -a "{s}/." "{d}/" && rm -rf "{s}" || exit 97\n'
                  f'"{sys.executable}" "{ROOT / "worker.py"}" "$@"; rc=$?\n'
                  f'cp -a "{d}" "{s}"; exit $rc\n')
        unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        self.err = open(self.disk.parent / "worker.err", "w+")   # noqa: SIM115 - read while it runs
        self.proc = subprocess.Popen([*unshare, "sh", "-c", script, "sh", *worker_args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self.err, text=True)

    def inside(self, rel: str) -> Path:
        """A path on the mounted tmpfs, seen through the pass's own mount namespace."""
        return Path(f"/proc/{self.proc.pid}/root") / self.disk.relative_to("/") / rel

    def stderr(self) -> str:
        return (self.disk.parent / "worker.err").read_text()

    def wait_said(self, words: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if words in self.stderr():
                return self.stderr()
            assert self.proc.poll() is None, f"the worker ended without saying {words!r}:\n{self.stderr()}"
            time.sleep(0.2)
        raise AssertionError(f"the worker never said {words!r}:\n{self.stderr()}")

    def keep_full(self) -> None:
        """From now on, whatever space frees up on the tmpfs is taken again at once (a filler
        file grows into it), as on a disk other programs keep filling; ``release`` ends it."""
        self.filling = True

        def fill() -> None:
            with open(self.inside("filler"), "ab", buffering=0) as handle:
                while self.filling:
                    try:
                        handle.write(b"\0" * 65536)
                    except OSError:
                        time.sleep(0.01)
        self.filler = threading.Thread(target=fill, daemon=True)
        self.filler.start()

    def release(self, *also: str) -> None:
        """End ``keep_full`` and delete the filler and the files the ``also`` patterns match (glob,
        relative to the disk)."""
        self.filling = False
        self.filler.join()
        for pattern in ("filler", *also):
            for path in self.inside(".").glob(pattern):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def worker(self) -> psutil.Process:
        return next(p for p in psutil.Process(self.proc.pid).children(recursive=True)
                    if "worker.py" in " ".join(p.cmdline()))

    def end(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.err.close()
        assert rc != 97, "the tmpfs could not be mounted"
        shutil.rmtree(self.disk)
        self.saved.rename(self.disk)
        return rc


@pytest.fixture
def small_disk(tmp_path, monkeypatch, opencode):
    disk = tmp_path / "disk"
    # The logs (and with them each run's private temp folder) stay on the test's disk: the agent
    # is not what fills up here, the queue and the worktrees are.
    for var, sub in (("TASK_DB_PATH", "q/tasks.db"), ("TASKBRIDGE_WORKTREE_ROOT", "worktrees")):
        monkeypatch.setenv(var, str(disk / sub))
    (disk / "q").mkdir(parents=True)
    return SmallDisk(disk)


def fill_the_disk(opencode, name: str) -> None:
    """A run that writes its feature, then fills the disk under its worktree (an ignored file,
    so the commit leaves it out; bounded, should it ever run on a real disk), then finishes."""
    opencode.model.script(name, [
        tool_call("write", {"filePath": "{cwd}/feature.txt", "content": "the feature\n"}),
        tool_call("bash", {"command": f"head -c {DISK_MB + 8}M /dev/zero > ballast; df -k . | tail -1",
                           "description": "fill"}),
        text("Done.\n" + DONE),
    ])


def committed(repo: Path, task: dict, disk: SmallDisk, timeout: float = 120) -> str:
    """Wait until the task's branch (in the repository, on the test's own disk) has a commit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = subprocess.run(["git", "rev-parse", "-q", "--verify", f"taskbridge/{task['id']}^{{commit}}"],
                               cwd=repo, capture_output=True, text=True).stdout.strip()
        if found and found != git(repo, "rev-parse", "main"):
            return found
        time.sleep(0.1)
    raise AssertionError(f"the task's commit never came:\n{disk.stderr()}")


@needs_namespaces
def test_a_full_disk_at_the_final_write_holds_the_result_until_space_returns(opencode, small_disk, tmp_path):
    repo = make_repo(tmp_path / "repo", {".gitignore": "ballast\n", "README.md": "x\n"})
    fill_the_disk(opencode, "fills")
    task = submit(repo, script="fills", worktree_keep=True, max_retries=2)
    small_disk.start()
    small_disk.wait_said("disk full")
    small_disk.keep_full()
    committed(repo, task, small_disk)
    time.sleep(2)   # the worker holds the result and retries
    assert small_disk.proc.poll() is None, "the worker holds the finished result"
    small_disk.release("worktrees/**/ballast")   # space comes back (warm, the worktree is in its server's folder)
    assert small_disk.end() == 0, small_disk.stderr()
    err = small_disk.stderr()
    assert "Traceback" not in err
    full_lines = [line for line in err.splitlines() if "disk full" in line]   # said once, whichever write met it
    assert len(full_lines) == 1 and str(small_disk.disk) in full_lines[0], err
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", (final["error"], err)
    assert len(opencode.model.step_requests("fills")) == 3, "the agent ran once"
    assert git(repo, "show", f"{final['branch']}:feature.txt") == "the feature"
    assert final["result"]["commit"] == git(repo, "rev-parse", final["branch"])


@needs_namespaces
def test_a_worker_killed_after_its_commit_is_finished_from_the_commit_not_rerun(opencode, small_disk, tmp_path):
    repo = make_repo(tmp_path / "repo", {".gitignore": "ballast\n", "README.md": "x\n"})
    fill_the_disk(opencode, "killed")
    task = submit(repo, script="killed", worktree_keep=True, max_retries=2)
    small_disk.start()
    small_disk.wait_said("disk full")
    small_disk.keep_full()
    committed(repo, task, small_disk)
    time.sleep(1)
    os.kill(small_disk.worker().pid, signal.SIGKILL)   # committed; the row still says running
    small_disk.filling = False
    small_disk.end()
    mid = task_store.get_task(task["id"])
    assert mid["status"] == "running"
    (small_disk.disk / "filler").unlink()
    Path(mid["worktree_path"], "ballast").unlink()   # warm, the worktree is in its kept server's folder
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    assert "Traceback" not in passed.stderr
    final = task_store.get_task(task["id"])
    assert final["status"] == "done", final["error"]
    assert len(opencode.model.step_requests("killed")) == 3, "the agent was not run again"
    branches = git(repo, "branch", "--list", "--format=%(refname:short)", f"taskbridge/{task['id']}*").split()
    assert branches == [f"taskbridge/{task['id']}"], branches
    tip = git(repo, "rev-parse", f"taskbridge/{task['id']}")
    assert git(repo, "rev-list", "--count", f"main..{tip}") == "1", "one commit, not a second copy"
    assert final["result"]["commit"] == tip
    assert "feature.txt" in final["result"]["files_touched"] and "the feature" in final["diff"]
    assert "not run again" in final["result"]["recovered"]


def on_read_only_disk(folder: Path, *argv: str) -> list[str]:
    """``argv`` run in a mount namespace where ``folder`` (holding the queue) is a tmpfs with the
    folder's files, remounted read-only (as ``errors=remount-ro`` leaves a disk)."""
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    seed = folder.with_name(folder.name + ".seed")
    shutil.copytree(folder, seed, dirs_exist_ok=True)
    script = (f'mount -t tmpfs none "{folder}" && cp -a "{seed}/." "{folder}/" && '
              f'mount -o remount,ro,bind "{folder}" || exit 97\nexec "$@"')
    return [*unshare, "sh", "-c", script, "sh", *argv]


@needs_namespaces
def test_a_read_only_queue_is_still_read_and_a_write_names_the_read_only_filesystem(tmp_path):
    work = tmp_path / "work"   # not tmp_path: it holds the queue's seed copy, another queue to the folder checks
    work.mkdir()
    task_store.submit_task(title="finished before", instructions="x", working_dir=str(work))
    claimed = task_store.claim_next("worker:x:1", pid=1, pid_start=1.0)
    task_store.complete_attempt(claimed["id"], claimed["run_marker"], result={"summary": "the result"})
    task_store.close_connections()
    queue = tmp_path / "q"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(on_read_only_disk(queue, sys.executable, *args), capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    listed = run(str(ROOT / "tasks_cli.py"), "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert "finished before" in listed.stdout
    for argv in ([str(ROOT / "tasks_cli.py"), "submit", "new", "--dir", str(work), "--instructions", "y"],
                 [str(ROOT / "worker.py")]):
        refused = run(*argv)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "read-only filesystem" in lines[0] and str(queue) in lines[0], lines
        assert "may not be" not in lines[0] and "remounted read-write" in lines[0]


@needs_namespaces
@pytest.mark.anyio
async def test_the_planner_reads_results_from_a_read_only_queue(tmp_path):
    from mcp import Client, StdioServerParameters

    work = tmp_path / "work"   # not tmp_path: it holds the queue's seed copy, another queue to the folder checks
    work.mkdir()
    task_store.submit_task(title="finished before", instructions="x", working_dir=str(work))
    claimed = task_store.claim_next("worker:x:1", pid=1, pid_start=1.0)
    task_store.complete_attempt(claimed["id"], claimed["run_marker"], result={"summary": "the result"})
    task_store.close_connections()
    argv = on_read_only_disk(tmp_path / "q", sys.executable, str(ROOT / "opencode_bridge_mcp.py"))
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
    async with Client(params) as client:
        result = await client.call_tool("get_task_result", {"task_id": claimed["id"]})
        sent = await client.call_tool("submit_task", {"title": "t", "instructions": "x",
                                                      "working_dir": str(work)})
    assert not result.is_error and "the result" in json.dumps(result.structured_content)
    assert sent.is_error and "read-only filesystem" in sent.content[0].text
