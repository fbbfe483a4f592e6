"""Git isolation for task runs: a worktree per task on branch ``taskbridge/t_0001`` outside
the user's checkout, what changed in it (diff and files, untracked included), the commit on
success, the revert for readonly tasks, and removal of kept worktrees.

Shared by `worker.py` (runs), `tasks_cli.py` and `opencode_bridge_mcp.py` (clear_finished).
Env (read at call time): ``TASKBRIDGE_WORKTREE_ROOT``, ``XDG_STATE_HOME``. No SQL here.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import task_store as store


# Worker slots run in threads: git's worktree bookkeeping (add, remove, prune) is not safe to run
# concurrently on one repository, so those steps take this lock.
_ADMIN = threading.Lock()


class Unrunnable(Exception):
    """The task cannot run as given (missing directory, repo with no commits, detached HEAD):
    fail at once, no retry. The message says what to do."""


def git(args: list[str], cwd: str | Path, *, check: bool = True, env: dict | None = None,
        strip: bool = True) -> str:
    """Run git (paths unquoted: ``core.quotePath=false``); return stdout, stripped unless
    ``strip=False`` (a diff must keep its last newline to apply). Bytes that are not UTF-8 (a
    Latin-1 file in a diff) are replaced, never fatal. Raises RuntimeError with git's message
    when ``check``."""
    proc = subprocess.run(["git", "-c", "core.quotePath=false", *args], cwd=cwd, capture_output=True,
                          text=True, encoding="utf-8", errors="replace", stdin=subprocess.DEVNULL, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
    if proc.returncode != 0:
        return ""
    return proc.stdout.strip() if strip else proc.stdout


def worktree_root() -> Path:
    """Where task worktrees live: ``$TASKBRIDGE_WORKTREE_ROOT`` or
    ``~/.local/state/taskbridge/worktrees/<queue tag>`` — never inside the user's checkout."""
    configured = os.environ.get("TASKBRIDGE_WORKTREE_ROOT")
    if configured:
        return Path(configured).expanduser().resolve()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "taskbridge" / "worktrees" / store.queue_tag()


@dataclass
class Workspace:
    """Where one attempt runs. ``mode``: ``worktree`` or ``in-place``."""
    mode: str
    cwd: str                       # the agent's working directory
    top: str | None = None         # the worktree (or in-place repo) root
    repo: str | None = None        # the user's repository root
    branch: str | None = None
    base_commit: str | None = None
    note: str = ""
    reused: bool = False
    base_from: str = ""


def _repo_top(path: str) -> str | None:
    top = git(["rev-parse", "--show-toplevel"], path, check=False)
    return os.path.realpath(top) if top else None


def prepare_workspace(task: dict[str, Any], resume: bool) -> Workspace:
    """Isolate the attempt: a worktree on ``taskbridge/<id>`` for a git repo (reused when
    resuming after an answer), else in place. Raises Unrunnable with what to do."""
    wd = task["working_dir"]
    if not os.path.isdir(wd):
        raise Unrunnable(f"working_dir {wd} does not exist; create it or resubmit with an existing directory")
    top = _repo_top(wd)
    if top is None:
        return Workspace("in-place", wd, note="not a git repository: ran in place, changes are not isolated")
    head = git(["rev-parse", "--verify", "-q", "HEAD"], top, check=False)
    if not head:
        raise Unrunnable(f"{top} is a git repository with no commits; make a first commit "
                         "(git add -A && git commit -m init) and resubmit")
    if not task["worktree"]:
        return Workspace("in-place", wd, top=top, repo=top, base_commit=head,
                         note="worktree=false: ran in place in the user's checkout")
    if not git(["symbolic-ref", "-q", "HEAD"], top, check=False):
        raise Unrunnable(f"{top} has a detached HEAD; check out a branch (git switch main) and resubmit")
    sub = os.path.relpath(wd, top)
    path = worktree_root() / f"{Path(top).name}-{task['id']}"
    base, base_from = (task["base_commit"], "earlier attempt") if task.get("base_commit") else \
        dependency_base(task, top, head)
    if resume and task.get("worktree_path") == str(path) and _is_registered(top, path):
        return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top,
                         task.get("branch") or f"taskbridge/{task['id']}", base, reused=True,
                         base_from=base_from)
    branch = _fresh_worktree(top, path, task, base)
    return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top, branch, base,
                     base_from=base_from)


def dependency_base(task: dict[str, Any], top: str, head: str) -> tuple[str, str]:
    """Where a task's branch starts: the commit of the dependency it builds on, when its
    dependencies that committed in this same repository end in one commit that contains the
    others; else the checkout's HEAD. Returns (commit, why)."""
    commits = []
    for dep_id in task.get("depends_on") or []:
        dep = store.get_task(dep_id)
        commit = (dep.get("result") or {}).get("commit")
        if commit and _repo_top(dep["working_dir"]) == top:
            commits.append((dep["id"], commit))
    if not commits:
        return head, "HEAD of the checkout"
    for dep_id, commit in commits:
        if all(_is_ancestor(top, other, commit) for _, other in commits):
            return commit, f"the commit of dependency {dep_id}"
    return head, "HEAD of the checkout (the dependencies' commits diverge; merge them to build on both)"


def _is_ancestor(repo: str, ancestor: str, commit: str) -> bool:
    proc = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=repo,
                          capture_output=True, stdin=subprocess.DEVNULL)
    return proc.returncode == 0


def _branch_tip(repo: str, branch: str) -> str:
    return git(["rev-parse", "--verify", "-q", f"refs/heads/{branch}"], repo, check=False)


def _free_branch(repo: str, task: dict[str, Any], base: str) -> str:
    """The branch for a fresh attempt. The task's own branch from an earlier attempt is reused
    while it still points at the base commit (nothing was committed on it); otherwise the first
    of ``taskbridge/t_0001``, ``taskbridge/t_0001-<queue>``, ``…-<queue>-2``, … that does not
    exist. An existing branch with other work on it (another queue's task t_0001, say) is never
    reset."""
    own = task.get("branch")
    if own and _branch_tip(repo, own) in ("", base):
        return own
    name, queue = f"taskbridge/{task['id']}", store.queue_tag()
    for candidate in [name, f"{name}-{queue}", *(f"{name}-{queue}-{n}" for n in range(2, 100))]:
        if not _branch_tip(repo, candidate):
            return candidate
    raise Unrunnable(f"{repo} already has 100 branches named {name}-*; delete old ones and resubmit")


def _is_registered(repo: str, path: Path) -> bool:
    listing = git(["worktree", "list", "--porcelain"], repo, check=False)
    return path.is_dir() and f"worktree {path}" in listing.splitlines()


def _fresh_worktree(repo: str, path: Path, task: dict[str, Any], base: str) -> str:
    """Create the worktree on a free branch (returned), recovering from a crash's leftovers
    first: a registered worktree whose folder is gone, a folder nobody registered, a branch
    checked out at a vanished path."""
    with _ADMIN:
        git(["worktree", "prune"], repo, check=False)
        if _is_registered(repo, path):
            git(["worktree", "remove", "--force", str(path)], repo, check=False)
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
        git(["worktree", "prune"], repo, check=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        branch = _free_branch(repo, task, base)
        git(["worktree", "add", "-B", branch, str(path), base], repo)
        return branch


def remove_worktree(ws: Workspace) -> None:
    """Remove a task's worktree (the branch stays)."""
    if ws.mode == "worktree" and ws.repo and ws.top:
        with _ADMIN:
            git(["worktree", "remove", "--force", ws.top], ws.repo, check=False)
            shutil.rmtree(ws.top, ignore_errors=True)
            git(["worktree", "prune"], ws.repo, check=False)


def observed_changes(ws: Workspace) -> tuple[list[str], str]:
    """Files changed since the base commit and the diff, untracked files included, computed
    with a throw-away index so neither the user's index nor the worktree's is touched."""
    if not ws.top or not ws.base_commit:
        return [], ""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        git(["read-tree", ws.base_commit], ws.top, env=env)
        git(["add", "-A", "."], ws.top, env=env)
        names = git(["diff", "--cached", "--name-only", ws.base_commit], ws.top, env=env)
        diff = git(["diff", "--cached", "--binary", ws.base_commit], ws.top, env=env, strip=False)
    return [n for n in names.splitlines() if n], diff


def checkout_state(repo: str | None) -> dict[str, tuple]:
    """The user's checkout as git sees it: every changed or untracked path with its status,
    size and mtime. Taken before and after a run, it shows what an agent changed outside its
    worktree (which nothing prevents: the bash tool can write anywhere)."""
    if not repo:
        return {}
    out = git(["status", "--porcelain", "-z", "--untracked-files=all"], repo, check=False, strip=False)
    state = {}
    for entry in filter(None, out.split("\0")):
        path = entry[3:]
        try:
            info = os.stat(os.path.join(repo, path))
            state[path] = (entry[:2], info.st_size, info.st_mtime_ns)
        except OSError:
            state[path] = (entry[:2], None, None)
    return state


def changed_outside(before: dict[str, tuple], repo: str | None) -> list[str]:
    """Paths of the user's checkout whose state differs from ``before`` (see checkout_state)."""
    after = checkout_state(repo)
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def commit_changes(ws: Workspace, message: str) -> str | None:
    """Commit everything in the worktree on the task branch; returns the commit id or None."""
    if ws.mode != "worktree":
        return None
    git(["add", "-A", "."], ws.top)
    if not git(["status", "--porcelain"], ws.top):
        return None
    identity = [] if git(["config", "user.email"], ws.top, check=False) else [
        "-c", "user.name=TaskBridge", "-c", "user.email=taskbridge@localhost"]
    git([*identity, "commit", "-q", "--no-verify", "-m", message], ws.top)
    return git(["rev-parse", "HEAD"], ws.top)


def revert_changes(ws: Workspace, snapshot: dict[str, bytes] | None) -> list[str]:
    """readonly: undo every change the run left. In a worktree, reset to the base commit and
    remove new files; in place, restore from the pre-run snapshot. Returns the reverted files."""
    if ws.mode == "worktree":
        changed, _ = observed_changes(ws)
        git(["reset", "-q", "--hard", ws.base_commit], ws.top)
        git(["clean", "-q", "-fdx"], ws.top)
        return changed
    return restore_snapshot(ws.cwd, snapshot or {})


SNAPSHOT_LIMIT_BYTES = 50 * 2**20


def take_snapshot(root: str) -> dict[str, bytes] | None:
    """Contents of every file under ``root`` (``.git`` excepted), or None past 50 MB."""
    files: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            total += os.path.getsize(path)
            if total > SNAPSHOT_LIMIT_BYTES:
                return None
            with open(path, "rb") as fh:
                files[os.path.relpath(path, root)] = fh.read()
    return files


def restore_snapshot(root: str, snapshot: dict[str, bytes]) -> list[str]:
    """Put ``root`` back as the snapshot saw it; returns the paths that differed."""
    after = take_snapshot(root) or {}
    reverted = []
    for rel in sorted(set(after) | set(snapshot)):
        if after.get(rel) == snapshot.get(rel):
            continue
        path = os.path.join(root, rel)
        if rel in snapshot:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(snapshot[rel])
        else:
            os.remove(path)
        reverted.append(rel)
    return reverted


def remove_worktree_at(path: str) -> str | None:
    """Remove a kept worktree by its path alone (``clear_finished``); its branch stays.
    Returns None when removed or already gone, else what went wrong."""
    if not os.path.isdir(path):
        return None
    common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], path, check=False)
    if not common:
        return f"{path}: not a git worktree any more; left in place"
    try:
        git(["--git-dir", common, "worktree", "remove", "--force", path], os.path.dirname(common))
    except RuntimeError as exc:
        return f"{path}: {str(exc)[:200]}"
    return None


def purge_files(removed: list[dict[str, Any]], logs: bool, kept_worktrees: bool) -> dict[str, Any]:
    """After ``task_store.clear_finished``: delete the removed tasks' logs and/or kept worktrees
    (branches always stay). Returns ``{"logs_removed": n, "worktrees_removed": [paths],
    "problems": [text]}``."""
    result: dict[str, Any] = {"logs_removed": 0, "worktrees_removed": [], "problems": []}
    for task in removed:
        if logs and Path(task["log"]).exists():
            Path(task["log"]).unlink()
            result["logs_removed"] += 1
        if kept_worktrees and task.get("worktree_path") and os.path.isdir(task["worktree_path"]):
            problem = remove_worktree_at(task["worktree_path"])
            if problem:
                result["problems"].append(problem)
            else:
                result["worktrees_removed"].append(task["worktree_path"])
    return result

