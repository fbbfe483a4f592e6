"""Git isolation for task runs: a worktree per task on branch ``taskbridge/t_0001`` outside
the user's checkout (its submodules initialised from what the repository has locally), what
changed in it (diff and files, untracked included), the commit on success, the revert for
readonly tasks, removal of worktrees that checks the folder is really gone, and the git guard
(what a run planted in git's configuration is undone before TaskBridge runs git again).

Every git command TaskBridge itself runs goes through `git()`: the user's hooks, signing, editor,
pager, credential prompts, locale, colour, diff and identity settings do not reach it, and each
command is bounded in time (its whole process tree is ended). The agent's own git commands are
not ours and stay as they are.

Shared by `worker.py` (runs), `tasks_cli.py` and `opencode_bridge_mcp.py` (clear_finished).
Env (read at call time): ``TASKBRIDGE_WORKTREE_ROOT``, ``XDG_STATE_HOME``,
``TASKBRIDGE_GIT_TIMEOUT_SEC``, ``TASKBRIDGE_MIRROR_DIR``, ``XDG_CACHE_HOME``; git's own
``GIT_CONFIG_GLOBAL``, ``GIT_CONFIG_SYSTEM``, ``GIT_CONFIG_NOSYSTEM``, ``XDG_CONFIG_HOME`` to find
the config files the git guard pins. No SQL here.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import knobs
import process_tree
import task_store as store

# Worker slots run in threads: git's worktree bookkeeping (add, remove, prune) is not safe to run
# concurrently on one repository, so those steps take this lock.
_ADMIN = threading.Lock()


class Unrunnable(Exception):
    """The task cannot run as given (missing directory, repo with no commits, detached HEAD, a
    repository git refuses to read, a bare repository): fail at once, no retry. The message says
    what to do."""


class GitError(RuntimeError):
    """A git command TaskBridge ran failed; the message names the command and git's reason."""


class Unreachable(Exception):
    """A task's remote could not be reached (network, a server error): the attempt fails before
    the agent runs and is retried like any failure. The message quotes git."""


class GitStopped(GitError):
    """A git command was ended before it finished (its time limit, or the phase's watcher said
    stop: timeout, cancel, shutdown); its whole process tree was ended. ``reason`` says why."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason



# Command-line ``-c`` settings win over every config file, so these neutralise what in the
# user's (or the repository's) configuration would run their programs, sign, wait on a person or
# reshape a diff, while the rest of it still applies: ``safe.directory`` (their security
# decision, reported, never overridden), ``core.excludesFile``, ``core.autocrlf``, the
# repository's own .gitattributes and filters (bounded in time like everything else).
NEUTRAL_CONFIG = (
    "core.hooksPath=/dev/null", "core.fsmonitor=false", "core.pager=cat", "core.editor=true",
    "core.quotePath=false", "sequence.editor=true",
    "commit.gpgSign=false", "tag.gpgSign=false", "tag.forceSignAnnotated=false",
    "log.showSignature=false",
    "color.ui=never", "color.diff=never", "color.status=never", "color.branch=never",
    "diff.noprefix=false", "diff.mnemonicPrefix=false", "diff.srcPrefix=a/", "diff.dstPrefix=b/",
    "diff.relative=false", "diff.suppressBlankEmpty=false",
    "submodule.recurse=false", "gc.auto=0", "maintenance.auto=false",
    "credential.interactive=never", "advice.detachedHead=false",
)
# Inherited variables that would point our commands at another repository or index, or carry
# settings past the -c flags above.
_DROPPED_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_NAMESPACE",
                "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_PREFIX",
                "GIT_CEILING_DIRECTORIES", "GIT_EXTERNAL_DIFF", "GIT_DIFF_OPTS", "GIT_CONFIG_PARAMETERS",
                "GIT_CONFIG_COUNT", "GIT_PAGER", "GIT_EDITOR", "GIT_SEQUENCE_EDITOR", "SSH_ASKPASS",
                "LANGUAGE", "LANG")
COMMIT_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")   # a SHA-1 or SHA-256 object name
# Options that keep a diff in the one shape `git apply` takes whatever the configuration says; a
# rename as the deletion and the addition it is (else the file list named only the new path, and
# the diff's stat showed the rename as a file with no change).
DIFF_FLAGS = ("--no-color", "--no-ext-diff", "--no-textconv", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/")
FALLBACK_IDENTITY = {"user.name": "TaskBridge", "user.email": "taskbridge@localhost"}

_watch = threading.local()


def git_timeout() -> float:
    """Seconds one git command may take (``TASKBRIDGE_GIT_TIMEOUT_SEC``, default 300, 0.1 s to a
    day). Raises knobs.KnobError for any other value (the entry points check it before starting)."""
    return knobs.knob("TASKBRIDGE_GIT_TIMEOUT_SEC")


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of TaskBridge's own git commands: the caller's, without variables that
    redirect git, with no terminal prompt, no editor, no pager, the C locale (git's messages are
    read), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))}
    env.update({"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "", "GCM_INTERACTIVE": "never",
                "GIT_EDITOR": "true", "GIT_SEQUENCE_EDITOR": "true", "GIT_PAGER": "cat", "PAGER": "cat",
                "LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0"})
    env.update(extra or {})
    return env


@contextlib.contextmanager
def watched(check: Callable[[], str | None] | None) -> Iterator[None]:
    """While inside, every `git()` call of this thread calls ``check`` about five times a second;
    when it returns a reason (the task timed out, was cancelled, the worker must stop), the git
    command's process tree is ended and GitStopped raised. The worker renews its lease there.
    ``None``: no watcher (only git's own time limit applies)."""
    previous = getattr(_watch, "check", None)
    _watch.check = check
    try:
        yield
    finally:
        _watch.check = previous


@contextlib.contextmanager
def _admin() -> Iterator[None]:
    """Hold ``_ADMIN`` (this process's lock on its worktree bookkeeping). The wait for it asks the
    thread's watcher about five times a second, as a git command does: a task waiting behind
    another thread's hung git step (a kept server's park, another slot's) ends at its timeout, a
    cancel or a stop with GitStopped, and its lease stays renewed meanwhile."""
    watcher = getattr(_watch, "check", None)
    while not _ADMIN.acquire(timeout=0.2):
        reason = watcher() if watcher else None
        if reason:
            raise GitStopped(f"the wait for another git step of this worker's to finish was ended: {reason}",
                             reason)
    try:
        yield
    finally:
        _ADMIN.release()


def git(args: list[str], cwd: str | Path, *, check: bool = True, env: dict | None = None,
        strip: bool = True, config: tuple[str, ...] = (), input: bytes | None = None,
        stderr_to: list[str] | None = None) -> str:
    """Run one of TaskBridge's own git commands (see NEUTRAL_CONFIG and `git_env`; ``env``: extra
    variables, ``config``: extra ``-c`` settings) with stdin from /dev/null (``input``: these
    bytes on stdin instead, for ``--stdin`` lists too long for a command line), in its own process
    group, bounded by ``git_timeout()`` and the thread's watcher. Returns stdout, stripped unless
    ``strip=False`` (a diff must keep its last newline to apply); bytes that are not UTF-8 are
    replaced, never fatal; ``stderr_to``: a list git's stderr (its warnings) is appended to.
    Raises GitError with git's message when ``check`` (else returns ""),
    and GitStopped, whatever ``check`` says, when the command was ended."""
    flags = [item for setting in (*NEUTRAL_CONFIG, *config) for item in ("-c", setting)]
    command = f"git {' '.join(args)}"
    watcher = getattr(_watch, "check", None)
    reason = watcher() if watcher else None   # also between quick commands: the lease stays renewed
    if reason:
        raise GitStopped(f"{command} was not started: {reason}", reason)
    try:
        proc = subprocess.Popen(["git", *flags, *args], cwd=cwd,
                                stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=git_env(env),
                                start_new_session=True)
    except OSError as exc:  # git missing, or cwd gone
        if check:
            raise GitError(f"{command} could not start in {cwd}: {exc.strerror or exc}") from exc
        return ""
    out, err = _supervise(proc, command, input)
    out_text, err_text = (b.decode("utf-8", errors="replace") for b in (out, err))
    if stderr_to is not None:
        stderr_to.append(err_text)
    if check and proc.returncode != 0:
        raise GitError(f"{command} failed: {(err_text or out_text).strip()}")
    if proc.returncode != 0:
        return ""
    return out_text.strip() if strip else out_text


def _supervise(proc: subprocess.Popen, command: str, data: bytes | None = None) -> tuple[bytes, bytes]:
    """Collect a git command's output (``data`` fed to its stdin) while watching its time limit
    and the thread's watcher; end its process tree (a filter or helper it started included) when
    either says stop."""
    limit = git_timeout()
    deadline = time.monotonic() + limit
    watcher = getattr(_watch, "check", None)
    while True:
        try:
            return proc.communicate(data, timeout=0.2)
        except subprocess.TimeoutExpired:
            data = None   # communicate keeps feeding what it was given once; a second input is refused
        try:
            reason = watcher() if watcher else None
        except BaseException:
            process_tree.kill_tree(proc.pid, 2)
            raise
        if reason is None and time.monotonic() > deadline:
            reason = f"did not finish in {limit:g} s (TASKBRIDGE_GIT_TIMEOUT_SEC)"
        if reason:
            process_tree.kill_tree(proc.pid, 2)
            proc.communicate()
            raise GitStopped(f"{command} was ended with its process tree: {reason}", reason)


def worktree_root() -> Path:
    """Where task worktrees live: ``$TASKBRIDGE_WORKTREE_ROOT`` or
    ``~/.local/state/taskbridge/worktrees/<queue tag>`` — never inside the user's checkout."""
    configured = os.environ.get("TASKBRIDGE_WORKTREE_ROOT")
    if configured:
        return Path(configured).expanduser().resolve()
    return knobs.xdg_home("XDG_STATE_HOME") / "taskbridge" / "worktrees" / store.queue_tag()


# A repository's folder name longer than this (in bytes) is cut in its task folder's name, with a
# hash of the whole name to keep two such repositories apart: the name plus "-t_0001" must stay
# under the file system's limit for one name (255 bytes on most), and git names the worktree's
# admin folder after it, adding a counter when that name is taken.
FOLDER_LABEL_MAX = 100


def task_folder(label: str, ident: str) -> Path:
    """The worktree folder of task ``ident`` of the repository whose folder is named ``label``:
    ``<worktree_root>/<folder_label(label)>-<ident>``."""
    return worktree_root() / f"{folder_label(label)}-{ident}"


def folder_label(label: str) -> str:
    """A repository's folder name as a worktree folder's name starts: past FOLDER_LABEL_MAX bytes
    cut (on a character boundary) and followed by 8 hex digits of its hash; a ``%`` made ``_``
    (see opencode_can_work_in)."""
    raw = label.encode("utf-8", "surrogateescape")
    if len(raw) > FOLDER_LABEL_MAX:
        digest = hashlib.sha1(raw).hexdigest()[:8]
        label = f"{raw[:FOLDER_LABEL_MAX - 20].decode('utf-8', 'ignore')}-{digest}"
    return label.replace("%", "_")


# Only a worktree this deep gets its files' depth checked too (a listing of the whole tree): below
# it, the repository's own paths would have to be thousands of bytes long to pass the limit.
DEEP_WORKTREE_BYTES = 1024


def check_path_fits(path: Path, repo: str, commit: str) -> None:
    """Before the worktree at ``path`` is made from ``commit`` of ``repo``: every name in its path
    within this file system's limit for one name, and the path (for a deep worktree, the longest
    path ``commit`` holds inside it too) within its limit for a whole path — past it git still
    checks files out by relative paths, but nothing that names them by their full path (the
    agent's tools, TaskBridge's own checks) can reach them. Raises Unrunnable naming the limit,
    the length and TASKBRIDGE_WORKTREE_ROOT."""
    name_max, path_max = _path_limits(path)
    way_out = (f"set TASKBRIDGE_WORKTREE_ROOT to a shorter folder (it is {_clip_middle(str(worktree_root()))}) "
               "and retry the task")
    long_name = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long_name is not None:
        raise Unrunnable(f"the worktree folder {_clip_middle(str(path))} has a name of {len(os.fsencode(long_name))} "
                         f"bytes, past this file system's limit of {name_max} for one name; {way_out}")
    own = len(os.fsencode(str(path)))
    if own + len("/.git") >= path_max:
        raise Unrunnable(f"the worktree folder {_clip_middle(str(path))} would be {own} bytes long, past this "
                         f"system's limit of {path_max - 1} for a path; {way_out}")
    if own <= DEEP_WORKTREE_BYTES:
        return
    names = git(["ls-tree", "-r", "-z", "--name-only", commit], repo, strip=False).split("\0")
    deepest = max(names, key=lambda name: len(os.fsencode(name)), default="")
    if own + 1 + len(os.fsencode(deepest)) >= path_max:
        raise Unrunnable(f"in the worktree folder {_clip_middle(str(path))} ({own} bytes) the repository's file "
                         f"{_clip_middle(deepest)} would have a path of {own + 1 + len(os.fsencode(deepest))} bytes, "
                         f"past this system's limit of {path_max - 1} for a path; {way_out}")


def _clip_middle(text: str, keep: int = 120) -> str:
    return text if len(text) <= keep else f"{text[:keep // 2]}…{text[-(keep // 2 - 10):]}"


def _path_limits(path: Path) -> tuple[int, int]:
    """(the longest name, the longest path incl. its NUL) the file system holding ``path``
    allows, asked of its nearest folder that exists; 255 and 4096 where it cannot say."""
    here = path
    while not os.path.isdir(here) and here != here.parent:   # never raises, as Path.exists can here
        here = here.parent
    try:
        return os.pathconf(here, "PC_NAME_MAX"), os.pathconf(here, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


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
    submodules: dict[str, Any] | None = None   # see init_submodules; None: the repo has none
    line_base: str | None = None   # where the whole line of work (first task, follow-ups) started
    remote: str | None = None      # a task on a remote: the URL or path its branch is pushed to
    push_lease: str | None = None  # the branch's commit on the remote when fetched ("": absent)
    mirror_cloned: bool = False    # this attempt made the mirror (else it fetched into it)
    own_branch: bool = False       # the branch was made for this task (not a parent's: drop_empty_branch)
    parked: bool = False           # a kept server's parked worktree, taken over (park_worktree)
    git_pin: dict[str, tuple] | None = None   # see pin_git_config: taken before the agent runs
    top_id: tuple[int, int] | None = None     # (device, inode) of the folder ``top`` then (pin_git_config)
    git_nested: set[str] | None = None          # the repositories inside the checkout then (relative)
    git_planted: list[dict[str, Any]] | None = None   # see undo_planted_git: after the run
    # In place in a git checkout: its tree as this attempt began (uncommitted work included; see
    # tree_now) and the paths then uncommitted; the receipt's changes are counted from that tree.
    start_tree: str | None = None
    uncommitted_before: list[str] = field(default_factory=list)
    # In place outside git: the folder as this attempt began (folder_listing); the receipt's
    # changes are what differs from it after the run. None: not compared, before or after the
    # run (too many entries, too deep, the folder replaced: see the note).
    start_listing: FolderListing | None = None
    home: str | None = None   # OpenCode's folders of the task's line of work in a box (agent_box.line_home)
    leftover: str | None = None   # where an earlier attempt's worktree was moved before this one (set_aside)

    def root(self) -> str:
        """``top``, which a ``worktree`` workspace always has. Raises ValueError for one without it
        (a caller that skipped its mode check)."""
        if self.top is None:
            raise ValueError(f"the {self.mode} workspace at {self.cwd} has no repository root")
        return self.top

    def base(self) -> str:
        """``base_commit``, which a ``worktree`` workspace always has. Raises ValueError without it."""
        if self.base_commit is None:
            raise ValueError(f"the {self.mode} workspace at {self.cwd} has no base commit")
        return self.base_commit


def repo_top(path: str) -> str | None:
    """The root of the repository holding ``path``, or None only when git says it is not inside
    one. Raises Unrunnable as `_repo_state` does."""
    return _repo_state(path)[0]


def _repo_state(path: str) -> tuple[str | None, str | None, bool]:
    """(the root of the repository holding ``path``, its HEAD commit or None before the first
    commit, whether ``path`` is in that commit: a worktree made from it has the folder), from one
    git run; (None, None, False) only when git says ``path`` is in no repository. Any other
    refusal (a repository owned by another user, a bare repository, a broken .git) raises
    Unrunnable with git's reason and the way out: the task must never fall back to running in
    place in a checkout git merely would not read."""
    try:
        # --revs-only drops a HEAD (or a HEAD:./, the folder's tree) that names nothing instead of
        # failing on it; the root comes first and may itself hold a newline.
        out = git(["rev-parse", "--show-toplevel", "--revs-only", "HEAD", "HEAD:./"], path).split("\n")
        here = os.path.realpath(path)
        for revs in (2, 1, 0):
            top = os.path.realpath("\n".join(out[:len(out) - revs])) if len(out) > revs else ""
            ids = out[len(out) - revs:]
            if top and (here + os.sep).startswith(top.rstrip(os.sep) + os.sep) and \
                    all(COMMIT_ID.fullmatch(i) for i in ids):
                return top, (ids[0] if ids else None), revs == 2
        raise GitError(f"git rev-parse in {path} answered {out!r}, which names no repository root")
    except GitStopped:
        raise
    except GitError as exc:
        if isinstance(exc.__cause__, OSError):   # git could not start (EMFILE, ...): not the repository's fault
            raise
        reason = str(exc).split(" failed: ", 1)[-1]
    if "not a git repository" in reason:
        unread = _dot_git_above(path)
        if unread is None:
            return None, None, False
        raise Unrunnable(f"{path} is inside {os.path.dirname(unread)}, whose {unread} git does not read "
                         f"as a repository (git: {_one_line(reason)}); repair that repository ("
                         f"{store.shell_command('git', '-C', os.path.dirname(unread), 'status')} says what is "
                         "wrong) and resubmit; the task was "
                         "not run in place")
    if "dubious ownership" in reason or "unsafe repository" in reason:
        raise Unrunnable(f"git refuses to read the repository at {path}: it belongs to another user "
                         f"(git: {_one_line(reason)}). If you trust it, mark it safe with the "
                         "`git config --global --add safe.directory` command git names above and "
                         "resubmit, or run the worker as the repository's owner")
    if "must be run in a work tree" in reason:
        raise Unrunnable(f"{path} is a bare repository or inside a .git folder, which has no working "
                         "tree to run in: use one of its worktrees (git worktree add PATH BRANCH) or "
                         "a clone and resubmit with that folder")
    raise Unrunnable(f"git cannot read the repository at {path} ({_one_line(reason)}); fix the "
                     "repository (or its permissions) and resubmit; the task was not run in place")


def _dot_git_above(path: str) -> str | None:
    """The nearest ``.git`` (folder or file) in ``path`` or a folder above it: when git says
    "not a git repository" although there is one (a broken repository, a mount boundary), the
    folder is not truly outside a repository."""
    here = os.path.realpath(path)
    while True:
        candidate = os.path.join(here, ".git")
        if os.path.lexists(candidate):
            return candidate
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:600]


def _repo_top_or_none(path: str) -> str | None:
    try:
        return repo_top(path)
    except (Unrunnable, GitError):
        return None


def _first_commit_needed(top: str, head: str | None) -> str:
    """``head``, the HEAD commit `_repo_state` found in the repository ``top``. Raises Unrunnable
    when it has no commit yet."""
    if not head:
        raise Unrunnable(f"{top} is a git repository with no commits; make a first commit "
                         "(git add -A && git commit -m init) and resubmit")
    return head


def refuse_unrunnable_folder(path: str | None, host: str | None = None, worktree: bool = True) -> bool | None:
    """Refuse at submit a folder a task could never run in here: a bare repository (or a .git
    folder), a repository with no commits, one git refuses to read, and for a ``worktree`` task a
    folder its worktree would not have (untracked or ignored: not in the HEAD commit). Raises
    store.ValidationError with the worker's own reason; a folder outside git and a missing one
    (the store names it) pass, and so do a git that cannot start (the worker names that) and a
    task for another ``host`` (its folder is on that machine). Returns whether a task there runs
    in place (see `runs_in_place`, answered by the same git run), None when that was not asked
    (no folder here, or git could not tell)."""
    if not path or not os.path.isdir(path) or (host and host != store.host_name()):
        return None
    try:
        top, head, tracked = _repo_state(path)
        if top is not None:
            _first_commit_needed(top, head)
    except Unrunnable as exc:
        raise store.ValidationError(str(exc)) from None
    except GitError:
        return None
    refused = in_place_refused(path, top) if top is None or not worktree else None
    if refused:
        raise store.ValidationError(refused)
    if top is not None and worktree and not tracked:
        raise store.ValidationError(
            f"{path} is not in the last commit of {top} (an untracked or ignored folder), so the task's worktree, "
            "made from that commit, would not have it: commit it (git add, git commit) and resubmit, or submit "
            "with worktree=false (--no-worktree) to run in the folder itself")
    return top is None


def in_place_refused(path: str, top: str | None) -> str | None:
    """Why an in-place task (worktree=false, or a folder in no repository) on ``path`` must not
    run: its box binds the whole repository ``top`` holding it writable (``path`` itself when
    None), so ``top`` must pass the working_dir checks too (a home folder kept in git gave the
    agent all of it: ``~/.bashrc``, ``~/.ssh``), and hold neither another TaskBridge queue below
    it (``store.queue_inside``: the agent could rewrite that queue's tasks), lie in a hidden
    folder of your home (``~/.ssh``: a key planted there outlives the task), OpenCode's own
    configuration (a plugin planted there runs unboxed), nor TaskBridge's own files
    (``agent_box.held_data``: the box hides them by binding over their paths, which a run could
    rename a folder around). None when it may run, or when ``path``
    itself fails the working_dir checks (they say why, first: the root, the home folder)."""
    try:
        real = store.validate_working_dir(path)
    except store.ValidationError:
        return None
    area = top or real
    where = (f"working_dir {path} is inside the git repository {top}, and an in-place task (worktree=false) gets "
             "that whole repository writable" if area != real else
             f"working_dir {path} is writable to an in-place task")
    way_out = ("submit it with worktree=true (a worktree of its own)" if top else "give a folder of the project alone")
    if area != real:
        try:
            store.validate_working_dir(area)
        except store.ValidationError as exc:
            return f"{where}, but {exc}; {way_out}, or give a folder with a repository of its own"
    hidden_home = _home_hidden_folder(area)
    if hidden_home:
        return (f"{where}, and it lies in {hidden_home}, a hidden folder of your home where programs keep their "
                f"settings and credentials (a key or a hook the agent planted there would outlive the task); "
                f"{way_out}")
    parts = Path(area).parts
    queue = store.queue_inside(area) or next((str(Path(*parts[:n + 1])) for n, part in enumerate(parts)
                                              if part == ".taskbridge"), None)
    if queue:
        return (f"{where}, and it holds another TaskBridge queue or token ({queue}) the agent could rewrite or read; "
                f"{way_out}, or move that queue out of the folder")
    config = _opencode_config_inside(area)
    if config:
        return (f"{where}, and it holds OpenCode's own configuration ({config}), where a plugin the agent "
                f"planted would run outside its box (in your OpenCode and TaskBridge's); {way_out}")
    import agent_box  # here, not at the top: agent_box imports this module
    held = agent_box.held_data(area)
    if held:
        return (f"{where}, and the folder {area} holds TaskBridge's own {held}: a run there could rename a folder "
                "around it and read or replace it, and a readonly run's changes are reverted there; move it out of "
                f"the folder (TASK_DB_PATH, TASK_LOG_DIR, MCP_TOKEN_FILE, XDG_CACHE_HOME), or {way_out}")
    return None


def _home_hidden_folder(area: str) -> str | None:
    """The hidden folder of your home (``~/.ssh``, ``~/.gnupg``, ``~/.aws``: a name beginning
    with a dot, right under it) that the folder ``area`` (resolved) is or lies in, or None."""
    home = os.path.realpath(os.path.expanduser("~"))
    if not area.startswith(home.rstrip(os.sep) + os.sep):
        return None
    first = area[len(home.rstrip(os.sep)) + 1:].split(os.sep, 1)[0]
    return os.path.join(home, first) if first.startswith(".") else None


def _opencode_config_inside(area: str) -> str | None:
    """OpenCode's configuration of this environment (its config folder, ``OPENCODE_CONFIG``,
    ``OPENCODE_CONFIG_DIR``) when it really lies in the folder ``area`` (resolved), at any depth:
    a dotfiles repository links ``~/.config/opencode`` into itself. Named with where it leads."""
    named = [str(knobs.xdg_home("XDG_CONFIG_HOME") / "opencode"), os.environ.get("OPENCODE_CONFIG"),
             os.environ.get("OPENCODE_CONFIG_DIR")]
    for path in filter(None, named):
        real = os.path.realpath(path)
        if real == area or real.startswith(area.rstrip(os.sep) + os.sep):
            return path if real == path else f"{path}, that is {real}"
    return None


def runs_in_place(path: str) -> bool:
    """Whether a task on the existing folder ``path`` would run in place: git says it is in no
    repository (a repository git cannot read fails the task instead, so it counts as not)."""
    try:
        return repo_top(path) is None
    except (Unrunnable, GitError):
        return False


def prepare_workspace(task: dict[str, Any], resume: bool, folder: Path | None = None) -> Workspace:
    """Isolate the attempt: a worktree on ``taskbridge/<id>`` for a git repo (reused when
    resuming after an answer), else in place; for a task on a remote (``repo``), a worktree of the
    worker's mirror of it (see `remote_workspace`). A new worktree goes in ``folder`` when given
    (a kept server's, engine_slots.py), else in the worktree root; a later attempt's at the place
    the earlier one recorded. The files that configure TaskBridge's git there are pinned
    (`pin_git_config`) for `undo_planted_git` after the run. Raises Unrunnable with what to do,
    and Unreachable when a remote cannot be reached (worth a retry)."""
    ws = _prepare(task, resume, folder)
    pin_git_config(ws)
    return ws


def opencode_can_work_in(folder: str) -> None:
    """Raise Unrunnable when OpenCode cannot work in ``folder``: 1.18.33 decodes a folder's path
    once more than it should ("my%20repo" is read as "my repo", which does not exist), so a path
    with a ``%`` fails every run there. A worktree's own folder name never has one (task_folder)."""
    if "%" in folder:
        raise Unrunnable(f"OpenCode cannot work in {folder}: it reads a '%' in a folder's path as an escape "
                         "('my%20repo' as 'my repo'); rename the folder without '%' (or point "
                         "TASKBRIDGE_WORKTREE_ROOT at a path without one) and retry the task")


def _folder_still_checked(wd: str) -> None:
    """The working_dir checks again when the task runs, in the worker's own environment. Raises
    Unrunnable for a folder gone, one that fails them now, or one that leads elsewhere than the
    real path it was queued as: a link put on its path since (an earlier run's agent can make
    one in a folder it may write), which would aim TaskBridge's own git and the box at it."""
    if not os.path.isdir(wd):
        raise Unrunnable(f"working_dir {wd} does not exist; create it or resubmit with an existing directory")
    try:
        real = store.validate_working_dir(wd)
    except store.ValidationError as exc:
        raise Unrunnable(f"{exc} (checked again when the task ran)") from None
    if real != wd:
        raise Unrunnable(f"working_dir {wd} now leads to {real}: a symbolic link was put on its path after the task "
                         "was queued (an earlier task's agent may have made it); put the folder itself back, or "
                         "resubmit the task with the folder you mean")


def _prepare(task: dict[str, Any], resume: bool, folder: Path | None = None) -> Workspace:
    if task.get("repo"):
        return remote_workspace(task, resume)
    wd = task["working_dir"]
    _folder_still_checked(wd)
    top, head, _ = _repo_state(wd)
    if (top is None or not task["worktree"]) and (refused := in_place_refused(wd, top)):
        raise Unrunnable(f"{refused} (checked when the task ran)")
    if top is None or not task["worktree"]:
        opencode_can_work_in(wd)
    if top is None:
        try:
            listing, note = folder_listing(wd), in_place_note()
        except NotListed as exc:   # too many entries, too deep: the tools' word, said
            listing, note = None, in_place_note(str(exc))
        return Workspace("in-place", wd, note=note, start_listing=listing)
    head = _first_commit_needed(top, head)
    if not task["worktree"]:
        start_tree, uncommitted = tree_now(top, head)
        note = "worktree=false: ran in place in the user's checkout"
        if uncommitted:
            more = f" and {len(uncommitted) - 10} more" if len(uncommitted) > 10 else ""
            note += (f"; it had uncommitted changes when this attempt began ({', '.join(uncommitted[:10])}{more}): "
                     "files_touched and the diff count only what the attempt changed from there "
                     "(see uncommitted_before)")
        return Workspace("in-place", wd, top=top, repo=top, base_commit=head, note=note,
                         start_tree=start_tree, uncommitted_before=uncommitted)
    if not git(["symbolic-ref", "-q", "HEAD"], top, check=False):
        raise Unrunnable(f"{top} has a detached HEAD; check out a branch (git switch main) and resubmit")
    sub = os.path.relpath(wd, top)
    if task.get("continue_from"):
        return _continued_workspace(task, top, sub, resume)
    path = task_folder(Path(top).name, task["id"])
    if task.get("worktree_path") and _inside(task["worktree_path"], worktree_root()):
        path = Path(task["worktree_path"])   # an earlier attempt's place (a kept server's folder)
    elif folder is not None:
        path = parked_path(folder, top)   # where the kept server's worktree was parked (park_worktree)
    base, base_from = (task["base_commit"], "earlier attempt") if task.get("base_commit") else \
        _fork_base(task, top) if task.get("fork_from") else dependency_base(task, top, head)
    if not task.get("worktree_path") and folder is None:
        path = _free_folder(top, path, base, task.get("branch"))
    line_base = task.get("line_base") or (_parent_line_base(task["fork_from"]) if task.get("fork_from") else base)
    if resume and task.get("worktree_path") == str(path) and _is_registered(top, path):
        return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top,
                         task.get("branch") or f"taskbridge/{task['id']}", base, reused=True,
                         base_from=base_from, line_base=line_base, own_branch=True)
    opencode_can_work_in(os.path.normpath(str(path / sub)))
    parked = folder is not None and _parked_at(path, base)
    if folder is not None and not parked:
        drop_parked(path)   # parked at another commit: the task's worktree is made anew there
    branch, leftover = (_take_parked(top, path, task, base), None) if parked else \
        _fresh_worktree(top, path, task, base)
    common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], top)
    return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top, branch, base,
                     base_from=base_from, submodules=init_submodules(str(path), common), line_base=line_base,
                     own_branch=True, parked=parked, leftover=leftover)


def _parent_tip(parent: dict[str, Any], top: str) -> str:
    """The head of the branch of the task a follow-up or fork builds on. Raises Unrunnable."""
    if not parent.get("branch"):
        raise Unrunnable(f"{parent['id']} has no branch (it was completed by hand, or ran in place outside git), "
                         "so a follow-up or fork has nothing to start from: submit a new task")
    tip = _branch_tip(top, parent["branch"])
    if not tip:
        raise Unrunnable(f"{parent['id']}'s branch {parent['branch']} is not in {top}; "
                         "a follow-up or fork starts from it: restore the branch or submit a new task")
    return tip


def _parent_line_base(parent_id: str) -> str | None:
    parent = store.get_task(parent_id)
    return parent.get("line_base") or parent.get("base_commit")


def _fork_base(task: dict[str, Any], top: str) -> tuple[str, str]:
    """Where a fork starts: the commit its origin task ended at (its own commit, or its base when
    it committed nothing), not the head of the origin's branch, which a follow-up of it may have
    moved on since; the head when that commit is not on the branch (an origin that did not end
    done)."""
    parent = store.get_task(task["fork_from"])
    if _branch_dropped(parent):
        return parent["base_commit"], f"{parent['id']}'s base commit ({parent['id']} changed nothing; fork)"
    tip = _parent_tip(parent, top)
    result = given if isinstance(given := parent.get("result"), dict) else {}
    ended = result.get("commit") or (parent.get("base_commit") if parent["status"] == "done" else None)
    return _where_it_ended(parent, top, tip, ended, f"{parent['id']}'s branch {parent['branch']}")


def _where_it_ended(parent: dict[str, Any], repo: str, tip: str, ended: str | None, branch: str) -> tuple[str, str]:
    """(commit, why) a fork of ``parent`` starts from: ``ended``, the commit it ended at (None: not
    known), when that commit is on its branch, whose head ``tip`` a follow-up may have moved on
    since; else ``tip``."""
    if ended and ended != tip and _is_ancestor(repo, ended, tip):
        return ended, f"the commit {parent['id']} ended at on {branch}, {ended[:12]} (fork)"
    return tip, f"the head of {branch} (fork)"


def _branch_dropped(parent: dict[str, Any]) -> bool:
    """Whether ``parent`` changed nothing and its empty branch was deleted (drop_empty_branch):
    what builds on it starts from its base commit."""
    result = given if isinstance(given := parent.get("result"), dict) else {}
    return not parent.get("branch") and bool(result.get("branch_deleted")) and bool(parent.get("base_commit"))


def _continued_workspace(task: dict[str, Any], top: str, sub: str, resume: bool = False) -> Workspace:
    """A follow-up works on the branch of the task it continues, in that task's worktree folder
    (OpenCode resumes a session only from the folder it was created in): the folder is reused
    when it is still there on that branch, else recreated there from the branch. A task that
    changed nothing left no branch: see `_after_no_change`."""
    parent = store.get_task(task["continue_from"])
    if _branch_dropped(parent):
        return _after_no_change(task, parent, top, sub, resume)
    tip = _parent_tip(parent, top)
    branch = parent["branch"]
    path = Path(parent.get("worktree_path") or task_folder(Path(top).name, parent["id"]))
    base = task.get("base_commit") or tip
    line_base = task.get("line_base") or parent.get("line_base") or parent.get("base_commit") or base
    how = f"the head of {parent['id']}'s branch {branch} (follow-up)"
    check_path_fits(path, top, tip)
    with _admin():
        git(["worktree", "prune"], top, check=False)
        clear_unfinished_add(top, path, task, replacing=False)   # a half-made folder is never reused
        reused = _is_registered(top, path)
        if reused:
            there = git(["symbolic-ref", "-q", "--short", "HEAD"], str(path), check=False)
            if there != branch:
                raise Unrunnable(f"the worktree {path} of {parent['id']} is on {there or 'a detached HEAD'}, "
                                 f"not {branch}; switch it back "
                                 f"({store.shell_command('git', '-C', path, 'switch', branch)}) or remove it")
        else:
            if os.path.lexists(path):
                _force_rmtree(str(path))
            path.parent.mkdir(parents=True, exist_ok=True)
            git(["worktree", "add", str(path), branch], top)
    return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top, branch, base,
                     reused=reused, base_from=how, line_base=line_base)


def _after_no_change(task: dict[str, Any], parent: dict[str, Any], top: str, sub: str, resume: bool) -> Workspace:
    """A follow-up of a task whose empty branch was deleted: a branch of its own from that task's
    base commit, in that task's worktree folder (where its OpenCode session was made)."""
    path = Path(parent.get("worktree_path") or task_folder(Path(top).name, parent["id"]))
    base = task.get("base_commit") or parent["base_commit"]
    line_base = task.get("line_base") or parent.get("line_base") or parent["base_commit"]
    how = f"{parent['id']}'s base commit {parent['base_commit'][:12]} ({parent['id']} changed nothing; follow-up)"
    if resume and task.get("branch") and task.get("worktree_path") == str(path) and _is_registered(top, path):
        return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top, task["branch"], base,
                         reused=True, base_from=how, line_base=line_base, own_branch=True)
    branch, leftover = _fresh_worktree(top, path, task, base)
    common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], top)
    return Workspace("worktree", os.path.normpath(str(path / sub)), str(path), top, branch, base,
                     base_from=how, submodules=init_submodules(str(path), common), line_base=line_base,
                     own_branch=True, leftover=leftover)


def drop_empty_branch(ws: Workspace) -> bool:
    """After a run that changed nothing, its worktree removed: delete the branch made for this
    task (``ws.own_branch``) while it still points at its base commit and no worktree has it
    checked out. Never a parent's branch (a follow-up's), a branch with commits of its own, or a
    task on a remote. Returns whether it was deleted. Raises GitStopped."""
    if ws.mode != "worktree" or ws.remote or not ws.own_branch or not ws.repo or not ws.branch \
            or not ws.base_commit:
        return False
    ref = f"refs/heads/{ws.branch}"
    with _admin():
        if _branch_tip(ws.repo, ws.branch) != ws.base_commit:
            return False
        if f"branch {ref}" in git(["worktree", "list", "--porcelain"], ws.repo, check=False).splitlines():
            return False   # someone checked it out (the user's checkout, say): theirs now
        # The old value makes the deletion conditional: a commit landing meanwhile keeps the branch.
        git(["update-ref", "-d", ref, ws.base_commit], ws.repo, check=False)
        return not _branch_tip(ws.repo, ws.branch)


def restore_branch(ws: Workspace) -> bool:
    """Put back the empty branch ``drop_empty_branch`` deleted, at ``ws.base_commit``, when the
    queue did not record its deletion; never over a branch of that name made since. Returns
    whether it is there now at that commit. Raises GitStopped."""
    if not ws.repo or not ws.branch or not ws.base_commit:
        return False
    with _admin():
        # An empty old value makes the update create-only: a branch made meanwhile stays as it is.
        git(["update-ref", f"refs/heads/{ws.branch}", ws.base_commit, ""], ws.repo, check=False)
        return _branch_tip(ws.repo, ws.branch) == ws.base_commit


def line_of_work(ws: Workspace, head: str | None) -> dict[str, Any]:
    """The whole line of work up to ``head`` (a follow-up's receipt): the commit it started from,
    the files changed since, the diff's size and the diff (clipped at LINE_DIFF_MAX characters)."""
    if ws.mode != "worktree" or not ws.line_base or not head or not ws.repo:
        return {}
    names = git(["diff", "--name-only", *DIFF_FLAGS, ws.line_base, head], ws.repo)
    diff = git(["diff", "--binary", "--full-index", *DIFF_FLAGS, ws.line_base, head], ws.repo, strip=False)
    clipped = diff if len(diff) <= LINE_DIFF_MAX else diff[:LINE_DIFF_MAX] + (
        f"\n… [whole-line diff cut at {LINE_DIFF_MAX:,} of {len(diff):,} characters; "
        f"{store.shell_command('git', 'diff', ws.line_base, head)} shows it all]\n")
    return {"base_commit": ws.line_base, "head": head, "files": [n for n in names.splitlines() if n],
            "diff_stat": diff_stat(diff), "diff": clipped}


LINE_DIFF_MAX = 200_000


def dependency_base(task: dict[str, Any], top: str, head: str) -> tuple[str, str]:
    """Where a task's branch starts: the commit of the dependency it builds on, when its
    dependencies that committed in this same repository end in one commit that contains the
    others; else the checkout's HEAD. Returns (commit, why)."""
    commits = []
    for dep_id in task.get("depends_on") or []:
        dep = store.get_task(dep_id)
        commit = (dep.get("result") or {}).get("commit")
        if commit and _repo_top_or_none(dep["working_dir"]) == top:
            commits.append((dep["id"], commit))
    if not commits:
        return head, "HEAD of the checkout"
    for dep_id, commit in commits:
        if all(_is_ancestor(top, other, commit) for _, other in commits):
            return commit, f"the commit of dependency {dep_id}"
    return head, "HEAD of the checkout (the dependencies' commits diverge; merge them to build on both)"


def _is_ancestor(repo: str, ancestor: str, commit: str) -> bool:
    try:
        git(["merge-base", "--is-ancestor", ancestor, commit], repo)
    except GitStopped:
        raise
    except GitError:
        return False
    return True


def _branch_tip(repo: str, branch: str) -> str:
    return git(["rev-parse", "--verify", "-q", f"refs/heads/{branch}"], repo, check=False)


def _free_branch(repo: str, task: dict[str, Any], base: str) -> tuple[str, bool]:
    """(the branch for a fresh attempt, whether it did not exist when picked: made with ``-b``,
    never reset). The task's own branch from an earlier attempt is reused
    while it still points at the base commit (nothing was committed on it); otherwise the first
    of ``taskbridge/t_0001``, ``taskbridge/t_0001-<queue>``, ``…-<queue>-2``, … that does not
    exist. An existing branch with other work on it (another queue's task t_0001, say) is never
    reset. The task's own branch is also reused when its tip is already in the base (a retried
    task starting again from a newer HEAD): moving it there loses no commit."""
    own = task.get("branch")
    if own:
        tip = _branch_tip(repo, own)
        if tip in ("", base) or _is_ancestor(repo, tip, base):
            return own, not tip
    name, queue = f"taskbridge/{task['id']}", store.queue_tag()
    for candidate in [name, f"{name}-{queue}", *(f"{name}-{queue}-{n}" for n in range(2, 100))]:
        if not _branch_tip(repo, candidate):
            return candidate, True
    raise Unrunnable(f"{repo} already has 100 branches named {name}-*; delete old ones and resubmit")


# git's words when a branch name is taken (2.39): by a branch made meanwhile, or checked out elsewhere.
_NAME_TAKEN = ("already exists", "already checked out", "is already used by worktree")


def _on_free_branch(repo: str, task: dict[str, Any], base: str, make: Callable[[str, bool], object]) -> str:
    """``make(branch, new)`` on the branch _free_branch picks, returned; ``new``: it did not exist
    when picked, so ``make`` must create it without resetting (``-b``, ``-c``: git refuses a name that appears
    meanwhile). A worker of another queue on this repository can take the name between the pick
    and the make (their tasks' ids repeat; _ADMIN locks only this process): then the next free
    name, up to 5 tries. Raises GitError as ``make`` does."""
    for tries in range(5):
        branch, new = _free_branch(repo, task, base)
        try:
            make(branch, new)
            return branch
        except GitError as exc:
            if not new or tries == 4 or not any(words in str(exc) for words in _NAME_TAKEN):
                raise
    raise AssertionError("unreachable: the last try raises")


def _free_folder(repo: str, path: Path, base: str, own: str | None) -> Path:
    """Where a task's first worktree goes: ``path`` (its folder by its id), unless a worktree of
    ``repo`` registered there, not on the task's own branch ``own`` (a crashed attempt's, which
    is made anew), holds work this attempt cannot account for (``_holds_work``: another
    queue's task of the same id, or one whose queue was replaced while its worktree was kept);
    then the first of ``<path>-<queue>``, ``<path>-<queue>-2``, ... that holds none. Such a worktree
    is never removed. Raises Unrunnable when a hundred are taken."""
    queue = store.queue_tag()
    names = [path.name, f"{path.name}-{queue}", *(f"{path.name}-{queue}-{n}" for n in range(2, 100))]
    for candidate in (path.with_name(name) for name in names):
        if not _holds_work(repo, candidate, base, own):
            return candidate
    raise Unrunnable(f"{path} and 99 more folders of its name hold other tasks' worktrees with work in them; "
                     f"remove the ones nothing needs ({store.shell_command('git', '-C', repo, 'worktree', 'list')}) "
                     "and retry")


def _holds_work(repo: str, path: Path, base: str, own: str | None) -> bool:
    """Whether ``path`` is a registered worktree of ``repo`` holding work that would be lost were it
    removed: uncommitted, untracked or git-ignored files (a person's ``.env.local``), or a HEAD
    with commits ``base`` does not have (a worktree git cannot read counts as holding work). One
    on the branch ``own`` is the task's own (a crashed attempt's); a locked one is left to the
    lock's own handling (``clear_unfinished_add``: an add killed midway is cleared, anyone
    else's lock named)."""
    if not _is_registered(repo, path):
        return False
    lock, branch = worktree_lock(repo, path)
    if lock is not None or (own and branch == own):
        return False
    try:
        head = git(["rev-parse", "HEAD"], str(path))
        changed = git(["status", "--porcelain", "--ignored=matching", "--ignore-submodules=all"], str(path))
    except GitStopped:
        raise
    except GitError:
        return True
    return bool(changed) or not _is_ancestor(repo, head, base)


def _is_registered(repo: str, path: Path) -> bool:
    if not os.path.isdir(path):  # the usual case: no git command needed to say no (never raises)
        return False
    return f"worktree {path}" in git(["worktree", "list", "--porcelain"], repo, check=False).splitlines()


# What git writes in a new worktree's lock until `git worktree add` has finished (TaskBridge's git
# runs in the C locale, so its own adds write exactly this): such a lock that outlived the add is
# what an add killed midway leaves (TaskBridge's git time limit, a cancel, a killed worker).
ADD_UNFINISHED = "initializing"


def worktree_lock(repo: str, path: Path) -> tuple[str | None, str]:
    """(the reason of git's lock on the worktree registered at ``path``, "" when it gave none, or
    None when nothing locked is registered there; that worktree's branch, "" when none)."""
    for lines in _listed_worktrees(repo):
        if lines[0] == f"worktree {path}":
            locks = [line[len("locked "):] for line in lines[1:] if line == "locked" or line.startswith("locked ")]
            branch = next((line[len("branch refs/heads/"):] for line in lines[1:]
                           if line.startswith("branch refs/heads/")), "")
            return (locks[0] if locks else None), branch
    return None, ""


def clear_unfinished_add(repo: str, path: Path, task: dict[str, Any], replacing: bool = True) -> str:
    """Before TaskBridge makes the task's worktree at ``path`` (under its own root, named for the
    task): a worktree git left there locked by an add that never finished is removed with its
    registration, and its branch name returned (it was made for this task; "" otherwise). Any
    other lock is someone's decision to keep that worktree: when ``replacing`` (what is there
    would be removed), Unrunnable naming git's reason and the way out; else (a follow-up reuses
    it as it is) left alone. Call with _ADMIN held."""
    reason, branch = worktree_lock(repo, path)
    if reason is None or (reason != ADD_UNFINISHED and not replacing):
        return ""
    if reason != ADD_UNFINISHED:
        said = f"git says: {reason}" if reason else "no reason given"
        raise Unrunnable(f"{path}, where task {task['id']}'s worktree goes, is a git worktree locked by someone "
                         f"({said}); if nothing needs it, unlock it "
                         f"({store.shell_command('git', '-C', repo, 'worktree', 'unlock', path)}) and retry the task")
    git(["worktree", "unlock", str(path)], repo)
    git(["worktree", "remove", "--force", "--force", str(path)], repo, check=False)
    if os.path.lexists(path):
        left = _leftover(str(path), _force_rmtree(str(path)))
        if left:
            raise Unrunnable(f"a killed git worktree add's leftover is still in the way: {left}")
    git(["worktree", "prune"], repo, check=False)
    return branch


def set_aside(repo: str, path: Path, task: dict[str, Any]) -> str | None:
    """Before a worktree registered at ``path`` is removed to make the task's worktree anew
    (_fresh_worktree, _detached_worktree: a retry, or the reaper's requeue, after an attempt whose
    worker died: its worktree kept as the run left it, perhaps with a person's edits since), its
    folder is moved whole to ``<worktree root>/left/<task id>-<n>`` (else beside it as
    ``<path>.left-<n>``), its ``.git`` pointer file removed and git's record of it pruned: what
    it held (uncommitted and ignored files too) stays, as plain files. No git command runs in
    what the agent left (its worktree's own git folder could carry a filter, its files could
    make `git add` slow or fail). Returns where it went, or None when no folder of a registered
    worktree is there. Raises Unrunnable when it cannot be moved."""
    if not os.path.isdir(path) or os.path.islink(path) or not _is_registered(repo, path):
        return None
    places = [worktree_root() / "left" / f"{task['id']}-{n}" for n in range(1, 100)]
    places += [path.with_name(f"{path.name}.left-{n}") for n in range(1, 100)]
    problem: OSError | None = None
    for aside in places:
        if os.path.lexists(aside):
            continue
        try:
            aside.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.rename(path, aside)
        except OSError as exc:   # another filesystem (EXDEV): the next place, beside it
            problem = exc
            continue
        dot = aside / ".git"   # a pointer file into the repository, or a git folder the run made there
        with contextlib.suppress(OSError):
            if dot.is_dir() and not dot.is_symlink():   # renamed: no git reads a config the agent wrote
                os.rename(dot, aside / ".git-the-run-left")
            else:
                os.unlink(dot)   # plain files from now on
        git(["worktree", "prune"], repo, check=False)
        _record_aside(task, str(aside))
        return str(aside)
    raise Unrunnable(f"an earlier attempt's worktree {path} holds what it left and could not be moved aside "
                     f"({problem or 'every place for it is taken'}); move it away yourself "
                     f"({store.shell_command('mv', path, str(path) + '.mine')}) and retry the task")


def _record_aside(task: dict[str, Any], aside: str) -> None:
    """The task's event naming where set_aside moved its worktree (task_store.record_leftover), so
    that an attempt failing before its receipt still leaves a trace, and clear removes the folder
    with the task. Only for a claimed task (one with a run marker). Best effort: the folder has
    moved already, and the worker's log and the receipt name it too, so a store error is not
    the attempt's. Written while the git-admin lock is held: it waits for a busy queue's write
    lock ASIDE_RECORD_WAIT_SEC at most, not the store's 30 s, so other slots' git steps are not
    held up behind it."""
    if task.get("run_marker"):
        with store.lock_wait(ASIDE_RECORD_WAIT_SEC), contextlib.suppress(store.TaskStoreError):
            store.record_leftover(task["id"], task["run_marker"], aside)


ASIDE_RECORD_WAIT_SEC = 2.0


def leftover_words(ws: Workspace) -> str:
    """Where the worktree an earlier attempt left went (``ws.leftover``, set_aside's answer)."""
    return (f"the worktree an earlier attempt left here (its uncommitted work included, as it was) was moved to "
            f"{ws.leftover} before this attempt made it anew, as plain files (no longer a git worktree): "
            "take what you need from it; clearing the task (clear) removes it")


def _fresh_worktree(repo: str, path: Path, task: dict[str, Any], base: str) -> tuple[str, str | None]:
    """Create the worktree on a free branch; (that branch, where set_aside moved a worktree
    registered there, or None). Recovers from a crash's leftovers
    first: a registered worktree whose folder is gone, a folder nobody registered, a branch
    checked out at a vanished path."""
    check_path_fits(path, repo, base)   # before anything looks at the path: the system refuses it whole
    with _admin():
        git(["worktree", "prune"], repo, check=False)
        unfinished = clear_unfinished_add(repo, path, task)
        in_the_way = _is_registered(repo, path)
        leftover = set_aside(repo, path, task) if in_the_way else None
        if in_the_way and leftover is None:
            git(["worktree", "remove", "--force", str(path)], repo, check=False)
        if os.path.isdir(path / ".git"):
            raise Unrunnable(f"{path}, where task {task['id']}'s worktree goes, holds a repository of its "
                             "own; move it away (or set TASKBRIDGE_WORKTREE_ROOT elsewhere) and resubmit")
        if os.path.lexists(path):
            in_the_way = True
            left = _leftover(str(path), _force_rmtree(str(path)))
            if left:
                raise Unrunnable(f"an earlier attempt's worktree is still in the way: {left}")
        if in_the_way:  # something was removed: forget its registration too (else nothing changed)
            git(["worktree", "prune"], repo, check=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        return _on_free_branch(repo, {**task, "branch": task.get("branch") or unfinished or None}, base,
                               lambda branch, new: git(["worktree", "add", "-b" if new else "-B", branch,
                                                        str(path), base], repo)), leftover


# --------------------------------------------------------------------------------------------
# Tasks on a remote: a mirror per remote, a worktree from it, the branch pushed back.


def mirror_dir() -> Path:
    """Where the worker keeps its mirrors of remotes: ``$TASKBRIDGE_MIRROR_DIR`` (an absolute
    path, ``~`` expanded), else ``$XDG_CACHE_HOME/taskbridge/mirrors``
    (``~/.cache/taskbridge/mirrors``). Raises Unrunnable for a relative value: it would put
    mirrors in whatever folder the worker was started from."""
    configured = os.environ.get("TASKBRIDGE_MIRROR_DIR")
    if configured:
        path = Path(configured).expanduser()
        if not path.is_absolute():
            raise Unrunnable(f"TASKBRIDGE_MIRROR_DIR={configured!r} is a relative path (it would put mirrors in "
                             "the folder the worker was started from); set it to an absolute path such as "
                             "~/.cache/taskbridge/mirrors, or unset it")
        return path.resolve()
    return knobs.xdg_home("XDG_CACHE_HOME") / "taskbridge" / "mirrors"


def mirror_path(url: str) -> Path:
    """The mirror of ``url``: ``<mirror_dir>/<sha1 of mirror_key(url)>.git``."""
    return mirror_dir() / f"{hashlib.sha1(mirror_key(url).encode()).hexdigest()}.git"


def mirror_key(url: str) -> str:
    """What names a remote's mirror: the URL as given, except that a repository on this
    machine — a ``file://`` URL (percent-escapes decoded) or a plain path — is keyed by its
    resolved path, so ``file:///srv/a.git``, ``file:///srv/./a.git`` and ``/srv/a.git`` share
    one mirror."""
    if url.startswith("file://"):
        from urllib.parse import unquote, urlsplit
        path = unquote(urlsplit(url).path)
    elif os.path.isabs(url):
        path = url
    else:
        return url
    return os.path.realpath(path)


# What git says when the remote refused us (not worth a retry) or could not find the repository.
_AUTH_SIGNS = ("authentication failed", "permission denied", "could not read username",
               "could not read password", "terminal prompts disabled", "access denied",
               "the requested url returned error: 401", "the requested url returned error: 403",
               "host key verification failed", "invalid username or password")
_MISSING_SIGNS = ("does not appear to be a git repository", "repository not found", "not found",
                  "no such file or directory", "the requested url returned error: 404")


def _remote_failure(url: str, step: str, exc: GitError) -> Exception:
    """git's answer to a fetch or clone of ``url`` as the exception the worker acts on:
    Unrunnable (auth refused, no such repository: a retry cannot help) or Unreachable."""
    said = _one_line(str(exc).split(" failed: ", 1)[-1])[:800]
    lowered = said.lower()
    if "dubious ownership" in lowered:
        return Unrunnable(f"{step} {url} was refused: git will not read a repository that belongs to another user "
                          f"(git: {said}). If you trust it, add it to safe.directory as git says, or run the worker "
                          "as its owner, then retry the task")
    if any(sign in lowered for sign in _AUTH_SIGNS):
        return Unrunnable(f"{step} {url} was refused (git: {said}); give this worker's git access to it (a "
                          "credential helper, an SSH key: TaskBridge never stores credentials) and retry the task")
    if any(sign in lowered for sign in _MISSING_SIGNS):
        return Unrunnable(f"{step} {url} failed: there is no repository there (git: {said}); check the repo "
                          "URL and resubmit")
    return Unreachable(f"{step} {url} failed (git: {said}); check the network and the server, the task is "
                       "retried while its retries last")


@contextlib.contextmanager
def _mirror_lock(path: Path) -> Iterator[None]:
    """The mirror's own lock (``<mirror>.lock``, an flock): two slots or workers on this machine
    never clone or fetch one mirror at once. Waiting for it calls the thread's watcher, so the
    lease stays renewed and a cancel or timeout ends the wait (GitStopped)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise Unrunnable(f"the mirror folder {path.parent} cannot be used ({exc.strerror}); point "
                         "TASKBRIDGE_MIRROR_DIR at a writable folder on this worker and retry the task") from None
    try:
        watcher = getattr(_watch, "check", None)
        reason = store.flock_wait(fd, lambda: watcher() if watcher else None)
        if reason:
            raise GitStopped(f"waiting for the mirror {path} was ended: {reason}", reason)
        yield
    finally:
        os.close(fd)   # closing the descriptor releases the flock


def sync_mirror(url: str) -> tuple[Path, bool]:
    """The worker's mirror of ``url``, brought up to date under its lock: ``git clone --mirror``
    the first time (into a temporary folder, renamed when complete, so a clone that was cut off
    leaves nothing half made), ``git fetch --prune`` after. Returns (its path, whether it was
    cloned now). Raises Unrunnable (auth refused, no repository), Unreachable, GitStopped."""
    path = mirror_path(url)
    with _mirror_lock(path):
        if path.is_dir() and git(["rev-parse", "--is-bare-repository"], str(path), check=False) == "true":
            try:
                git(["fetch", "--prune", "--quiet", "origin"], str(path))
            except GitStopped:
                raise
            except GitError as exc:
                raise _remote_failure(url, "fetching", exc) from None
            return path, False
        if os.path.lexists(path):       # a broken mirror: made again
            _force_rmtree(str(path))
        partial = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            git(["clone", "--mirror", "--quiet", "--", url, str(partial)], str(path.parent))
            os.rename(partial, path)
        except GitStopped:
            raise
        except GitError as exc:
            raise _remote_failure(url, "cloning", exc) from None
        finally:
            if partial.exists():
                _force_rmtree(str(partial))
        return path, True


def _remote_tip(mirror: str, branch: str) -> str:
    return _branch_tip(mirror, branch)


def _resolve_base(mirror: str, url: str, ref: str | None) -> str:
    """The commit a task on ``url`` starts from: ``ref`` (a branch, a tag, a full ref or a commit
    id) or, without one, the remote's HEAD branch. Raises Unrunnable naming what the remote has."""
    if ref is None:
        head = git(["symbolic-ref", "-q", "HEAD"], mirror, check=False)
        commit = git(["rev-parse", "--verify", "-q", "HEAD^{commit}"], mirror, check=False)
        if not commit:
            raise Unrunnable(f"the remote {url} has no commits on its HEAD branch ({head or 'none'}); push a "
                             "first commit there, or give base_ref")
        return commit
    for candidate in (f"refs/heads/{ref}", f"refs/tags/{ref}", ref):
        commit = git(["rev-parse", "--verify", "-q", "--end-of-options", f"{candidate}^{{commit}}"], mirror,
                     check=False)
        if commit:
            return commit
    branches = git(["for-each-ref", "--count=10", "--format=%(refname:short)", "refs/heads"], mirror, check=False)
    shown = ", ".join(branches.split()) or "none"
    raise Unrunnable(f"base_ref {ref} is not a branch, tag or commit of {url} (its branches: {shown}); "
                     "resubmit with one it has")


def _repo_label(url: str) -> str:
    """A short folder-name label for a remote: the last part of its path without ``.git``."""
    tail = url.rstrip("/").replace(":", "/").rsplit("/", 1)[-1]
    tail = tail[:-4] if tail.endswith(".git") else tail
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in tail)[:60] or "repo"


def _remote_branch(mirror: str, task: dict[str, Any]) -> tuple[str, str]:
    """(the branch a task pushes, its commit on the remote now or ""). The task's own branch
    from an earlier attempt while the remote still has what that attempt pushed there; else the
    first of ``taskbridge/t_0001``, ``…-<queue>``, ``…-<queue>-2``, … the remote does not have
    (another queue's t_0001 is never overwritten)."""
    own = task.get("pushed_branch") or task.get("branch")
    if own:
        tip = _remote_tip(mirror, own)
        if tip in ("", task.get("pushed_commit")):
            return own, tip
    name, queue = f"taskbridge/{task['id']}", store.queue_tag()
    for candidate in [name, f"{name}-{queue}", *(f"{name}-{queue}-{n}" for n in range(2, 100))]:
        if not _remote_tip(mirror, candidate):
            return candidate, ""
    raise Unrunnable(f"the remote already has 100 branches named {name}-*; delete old ones and resubmit")


def remote_workspace(task: dict[str, Any], resume: bool) -> Workspace:
    """A task on a remote: the mirror is cloned or fetched (under its lock), then a worktree of it
    at the task's base (``base_ref``, else the remote's HEAD branch; a follow-up or fork: the head
    of the branch its parent pushed; a retry: its first attempt's base) in a detached HEAD — the
    task branch exists only on the remote, so a fetch never fights a checked-out branch — and
    the branch to push (``push_branch``). Raises Unrunnable, Unreachable, GitError."""
    url = task["repo"]
    mirror_p, cloned = sync_mirror(url)
    mirror = str(mirror_p)
    parent = store.get_task(task.get("continue_from") or task.get("fork_from")) \
        if task.get("continue_from") or task.get("fork_from") else None
    if parent is not None:
        branch_of_parent = parent.get("pushed_branch")
        tip = _remote_tip(mirror, branch_of_parent) if branch_of_parent else ""
        if not tip or not branch_of_parent:
            raise Unrunnable(f"{parent['id']}'s branch {branch_of_parent or '(never pushed)'} is not on {url}; a "
                             "follow-up or fork starts from it: push it back or submit a new task")
        base, base_from = tip, f"the head of {parent['id']}'s branch {branch_of_parent} on the remote"
        if task.get("fork_from"):
            base, base_from = _where_it_ended(parent, mirror, tip, parent.get("pushed_commit"),
                                              f"{parent['id']}'s branch {branch_of_parent} on the remote")
        base = task.get("base_commit") or base
        line_base = task.get("line_base") or parent.get("line_base") or parent.get("base_commit") or base
        if task.get("continue_from"):
            branch, lease = branch_of_parent, _remote_tip(mirror, branch_of_parent)
            path = Path(parent.get("worktree_path") or worktree_root() / f"{_repo_label(url)}-{parent['id']}")
        else:
            branch, lease = _remote_branch(mirror, task)
            path = worktree_root() / f"{_repo_label(url)}-{task['id']}"
    else:
        base = (task.get("base_commit") or _remote_dependency_base(task, mirror)
                or _resolve_base(mirror, url, task.get("base_ref")))
        base_from = "earlier attempt" if task.get("base_commit") else \
            f"{task.get('base_ref') or 'the HEAD branch'} of {url}"
        line_base = task.get("line_base") or base
        branch, lease = _remote_branch(mirror, task)
        path = worktree_root() / f"{_repo_label(url)}-{task['id']}"
    note = (f"git worktree of this worker's mirror of {url}, at its base in a detached HEAD; the work is "
            f"committed and pushed there as {branch}; writes outside the worktree are not prevented (prompt-level)")
    ws = Workspace("worktree", str(path), str(path), mirror, branch, base, note=note, base_from=base_from,
                   line_base=line_base, remote=url, push_lease=lease, mirror_cloned=cloned)
    if resume and task.get("worktree_path") == str(path) and _is_registered(mirror, path):
        ws.reused = True
        return ws
    if parent is not None and task.get("continue_from") and _is_registered(mirror, path):
        here = git(["rev-parse", "HEAD"], str(path), check=False)
        if here != base:
            raise Unrunnable(f"the kept worktree {path} of {parent['id']} is at {here[:12] or 'nothing'}, not at "
                             f"{branch}'s head {base[:12]} on the remote; remove it ("
                             f"{store.shell_command('git', '-C', mirror, 'worktree', 'remove', path)}) and retry")
        ws.reused = True
        return ws
    with _mirror_lock(mirror_p):   # another process's fetch or prune never meets a half-made worktree
        ws.leftover = _detached_worktree(mirror, path, task, base)
    ws.submodules = None if not os.path.isfile(path / ".gitmodules") else {
        "initialised": [], "not_initialised": [{"path": "(all)", "why": "a task on a remote gets no submodules: "
                                                "TaskBridge never fetches them"}]}
    return ws


def _remote_dependency_base(task: dict[str, Any], mirror: str) -> str | None:
    """The commit a remote task's dependencies on the same remote pushed, when one contains the
    others (as `dependency_base` for a checkout); else None."""
    commits = []
    for dep_id in task.get("depends_on") or []:
        dep = store.get_task(dep_id)
        if dep.get("repo") == task["repo"] and dep.get("pushed_commit"):
            commits.append(dep["pushed_commit"])
    for commit in commits:
        if all(_is_ancestor(mirror, other, commit) for other in commits):
            return commit
    return None


def _detached_worktree(mirror: str, path: Path, task: dict[str, Any], base: str) -> str | None:
    """A fresh worktree of the mirror at ``base`` (detached), a crash's leftovers removed first —
    but never one that holds a commit the remote does not have (a push that failed): that is the
    only copy of a finished run's work, so the attempt is refused (Unrunnable) naming it. Returns
    where set_aside moved a worktree registered there, or None."""
    check_path_fits(path, mirror, base)
    with _admin():
        git(["worktree", "prune"], mirror, check=False)
        clear_unfinished_add(mirror, path, task)
        leftover = None
        if _is_registered(mirror, path):
            _refuse_unpushed(mirror, path, task, base)
            leftover = set_aside(mirror, path, task)
            if leftover is None:
                git(["worktree", "remove", "--force", "--force", str(path)], mirror, check=False)
        if os.path.lexists(path):
            left = _leftover(str(path), _force_rmtree(str(path)))
            if left:
                raise Unrunnable(f"an earlier attempt's worktree is still in the way: {left}")
            git(["worktree", "prune"], mirror, check=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        git(["worktree", "add", "--detach", str(path), base], mirror)
    return leftover


def _refuse_unpushed(mirror: str, path: Path, task: dict[str, Any], base: str) -> None:
    head = git(["rev-parse", "--verify", "-q", "HEAD"], str(path), check=False)
    if not head or head == base or git(["for-each-ref", "--count=1", "--contains", head], mirror, check=False):
        return
    raise Unrunnable(f"the kept worktree {path} holds commit {head[:12]}, which was never pushed to {task['repo']} "
                     f"(an earlier attempt's push failed); push it "
                     f"({push_command(str(path), task['repo'], task.get('branch') or 'taskbridge/' + task['id'])}) or "
                     "remove the worktree "
                     f"({store.shell_command('git', '-C', mirror, 'worktree', 'remove', '--force', path)}), "
                     "then retry the task")


def holds_unpushed_work(task: dict[str, Any]) -> bool:
    """Whether a task on a remote ended with its run's commit kept in a worktree because the push
    failed (the receipt's ``bookkeeping_error``, ``worktree_kept`` and ``commit``, never pushed):
    only the machine that ran it (``lease_host``) has that work. From the row alone, no disk."""
    receipt = task.get("result") or {}
    return bool(task.get("repo") and receipt.get("commit") and receipt.get("worktree_kept")
                and receipt.get("bookkeeping_error") and task.get("pushed_commit") != receipt["commit"])


def unpushed_note(task: dict[str, Any]) -> str | None:
    """For a person (show, retry): where a task's unpushed work is and what a retry does with it,
    or None when it holds none (see `holds_unpushed_work`)."""
    if not holds_unpushed_work(task):
        return None
    host = task.get("lease_host") or "the machine that ran it"
    return (f"its commit {task['result']['commit'][:12]} was never pushed to {task['repo']}: it is kept in "
            f"{task.get('worktree_path')} on host {host}, so only a worker on {host} takes this task; a retry "
            f"pushes that commit again without running the agent (if {host} is gone for good, that commit is "
            "lost with it: submit the task anew)")


def unpushed_workspace(task: dict[str, Any]) -> Workspace | None:
    """A claimed task on a remote whose earlier attempt's push failed (`holds_unpushed_work`) and
    whose kept worktree is here, registered in this machine's mirror and still at that commit:
    the Workspace to push it from (the mirror fetched first; the task's own branch while the
    remote has nothing else there, else the next free name, as `_remote_branch`), so the worker
    pushes it again without running the agent. None when there is no such worktree here.
    Raises Unrunnable, Unreachable, GitStopped (as `sync_mirror`)."""
    path = task.get("worktree_path")
    if not holds_unpushed_work(task) or not path or not os.path.isdir(path):
        return None
    commit = task["result"]["commit"]
    if not mirror_path(task["repo"]).is_dir():
        return None
    mirror_p, _ = sync_mirror(task["repo"])
    mirror = str(mirror_p)
    if not _is_registered(mirror, Path(path)) or \
            git(["rev-parse", "--verify", "-q", "HEAD"], path, check=False) != commit:
        return None
    own = task.get("branch") or f"taskbridge/{task['id']}"
    tip = _remote_tip(mirror, own)
    branch, lease = (own, tip) if tip in ("", commit, task.get("pushed_commit")) else _remote_branch(mirror, task)
    note = (f"git worktree of this worker's mirror of {task['repo']}, kept by an earlier attempt whose push "
            "failed; pushed again without running the agent")
    base = task["result"].get("base_commit") or task.get("base_commit")
    return Workspace("worktree", path, path, mirror, branch, base, note=note, remote=task["repo"], push_lease=lease)


def leftover_remote_worktrees() -> list[dict[str, Any]]:
    """This machine's worktrees of remote tasks (registered in its mirrors) that the queue no
    longer points at here: the task is not in this queue (cleared, or another queue's), or its
    latest attempt ran on another host (the attempt here was taken over after its heartbeat went
    stale, so nobody removes its folder). Reads only: nothing is removed. Each
    ``{"path", "mirror", "task_id" (None when the name holds none), "why", "unpushed" (a commit
    of the worktree the remote has no ref containing, else None), "remove" (the command that
    removes it, quoted)}``."""
    root = mirror_dir()
    here = store.host_name()
    found: list[dict[str, Any]] = []
    for mirror in sorted(root.glob("*.git")) if root.is_dir() else []:
        listing = git(["worktree", "list", "--porcelain"], str(mirror), check=False)
        for block in listing.split("\n\n"):
            lines = block.strip().splitlines()
            if not lines or not lines[0].startswith("worktree ") or "bare" in lines[1:]:
                continue
            path = lines[0][len("worktree "):]
            ident = path.rsplit("-", 1)[-1] if path.rsplit("-", 1)[-1].startswith("t_") else None
            try:
                task = store.get_task(ident) if ident and store.queue_exists() else None
            except (store.TaskNotFound, store.ValidationError):
                task = None
            if task is not None and task.get("repo") and mirror_path(task["repo"]) == mirror \
                    and task.get("lease_host") in (None, here):
                continue
            why = ("its task is not in this queue (cleared, or another queue's)" if task is None else
                   f"{task['id']}'s latest attempt ran on host {task['lease_host']}, not this one ({here})")
            head = git(["rev-parse", "--verify", "-q", "HEAD"], path, check=False) if os.path.isdir(path) else ""
            contained = bool(head) and bool(git(["for-each-ref", "--count=1", "--contains", head], str(mirror),
                                                check=False))
            found.append({"path": path, "mirror": str(mirror), "task_id": ident, "why": why,
                          "unpushed": head if head and not contained else None,
                          "remove": store.shell_command("git", "-C", str(mirror), "worktree", "remove", "--force",
                                                        path)})
    return found


def push_command(worktree: str, remote: str, branch: str) -> str:
    """The command a person runs to push a kept worktree's commit to ``remote`` as ``branch``
    (quoted: see task_store.shell_command)."""
    return store.shell_command("git", "-C", worktree, "push", remote, f"HEAD:refs/heads/{branch}")


def push_branch(ws: Workspace, commit: str) -> str:
    """Push ``commit`` to ``ws.remote`` as ``ws.branch`` with the worker's own git credentials,
    leased: the push goes through only while the remote's branch is still what the fetch saw
    (absent, or what an earlier attempt pushed), so nobody else's work there is overwritten,
    and a retried attempt replaces its own earlier push. Returns the pushed commit. Raises
    GitError quoting the remote's answer (GitStopped when ended)."""
    if ws.remote is None:
        raise ValueError(f"the workspace at {ws.cwd} is not a remote task's: it has nowhere to push")
    ref = f"refs/heads/{ws.branch}"
    git(["push", f"--force-with-lease={ref}:{ws.push_lease or ''}", "--", ws.remote,
         f"{commit}:{ref}"], ws.root())
    ws.push_lease = commit
    return commit


def init_submodules(worktree: str, source_git_dir: str) -> dict[str, Any] | None:
    """Check out a fresh worktree's submodules (recursively) from the clones the user's
    repository already holds under ``<git dir>/modules/<name>``, never from the network and
    without writing to the user's configuration. Returns None when there are none, else
    ``{"initialised": [path], "not_initialised": [{"path", "why"}]}`` (paths relative to the
    worktree) for the receipt."""
    if not os.path.isfile(os.path.join(worktree, ".gitmodules")):
        return None
    result: dict[str, Any] = {"initialised": [], "not_initialised": []}
    _init_level(worktree, source_git_dir, "", result)
    return result


def _init_level(tree: str, source_git_dir: str, prefix: str, result: dict[str, Any]) -> None:
    listing = git(["config", "-f", ".gitmodules", "--get-regexp", r"^submodule\..*\.path$"], tree, check=False)
    for line in listing.splitlines():
        key, _, rel = line.partition(" ")
        name = key[len("submodule."):-len(".path")]
        shown = f"{prefix}{rel}"
        local = os.path.join(source_git_dir, "modules", name)
        if not os.path.isdir(local):
            result["not_initialised"].append({"path": shown, "why": "the repository has no local copy "
                                              "(run git submodule update --init in your checkout first)"})
            continue
        try:
            git(["submodule", "update", "--init", "--", rel], tree,
                config=("protocol.file.allow=always", f"submodule.{name}.url={local}"))
        except GitStopped:
            raise
        except GitError as exc:
            result["not_initialised"].append({"path": shown, "why": _one_line(str(exc))[:300]})
            continue
        result["initialised"].append(shown)
        if os.path.isfile(os.path.join(tree, rel, ".gitmodules")):
            _init_level(os.path.join(tree, rel), local, f"{shown}/", result)


def remove_worktree(ws: Workspace) -> str | None:
    """Remove a task's worktree (the branch stays) and check that its folder is gone. Returns
    None when it is (or there was none), else what is left and why."""
    if ws.mode == "worktree" and ws.repo and ws.top:
        return _remove_tree(ws.top, ws.repo)
    return None


def _remove_tree(path: str, repo: str | None) -> str | None:
    """Remove the linked worktree at ``path`` for real: git's own removal, then whatever is left
    (read-only folders made writable first, as build tools and package managers leave them),
    then git's bookkeeping. Never touches a main checkout (a folder with a ``.git`` folder)."""
    if os.path.isdir(os.path.join(path, ".git")):
        return f"{path} is a repository's main checkout, not a task worktree; left in place"
    with _admin():
        if repo:
            git(["worktree", "remove", "--force", "--force", path], repo, check=False)
        problems = _force_rmtree(path) if os.path.lexists(path) else []
        if repo:
            git(["worktree", "prune"], repo, check=False)
    if not problems:
        drop_engine_folder(Path(path).parent, whole=True)
    return _leftover(path, problems)


def parked_path(folder: Path, top: str) -> Path:
    """Where a kept server's worktree of the checkout ``top`` goes in its ``folder``
    (engine_slots.py): ``<folder>/<folder_label>``, the folder being the task's alone."""
    return folder / folder_label(Path(top).name)


# The lock reason that marks a parked worktree (``git worktree lock``): what drop_parked removes.
PARKED = "taskbridge: parked for a kept opencode serve; no task has it yet"


def park_worktree(top: str, folder: Path) -> Path:
    """A worktree of ``top`` made ahead of a claim at ``parked_path(folder, top)`` (returned),
    detached at ``top``'s HEAD and locked with the reason PARKED, for a kept server to open
    before its task exists. The task claimed then takes it over with only a new branch
    (``_take_parked``); one no task took is removed by ``drop_parked``. Raises GitError."""
    path = parked_path(folder, top)
    with _admin():
        git(["worktree", "add", "-q", "--lock", "--reason", PARKED, "--detach", str(path), "HEAD"], top)
    return path


def _is_parked(path: Path) -> bool:
    """Whether ``path`` is a worktree parked by ``park_worktree`` that no task took (its lock
    reason is PARKED: a positive mark, which neither a task's nor a user's worktree carries)."""
    if not os.path.isfile(path / ".git"):
        return False
    admin = git(["rev-parse", "--path-format=absolute", "--git-dir"], path, check=False)
    try:
        return bool(admin) and Path(admin, "locked").read_text(encoding="utf-8").strip() == PARKED
    except OSError:
        return False


def _parked_at(path: Path, base: str) -> bool:
    """Whether ``path`` holds a parked worktree, untouched, at ``base``."""
    return (_is_parked(path) and git(["rev-parse", "--verify", "-q", "HEAD"], path, check=False) == base
            and not git(["status", "--porcelain", "--untracked-files=all", "--ignored"], path, check=False))


def _take_parked(repo: str, path: Path, task: dict[str, Any], base: str) -> str:
    """The parked worktree at ``path`` (already at ``base``) made the task's: unlocked, and only
    its branch is new (returned); no file changes, so what the kept server loaded stays true."""
    with _admin():
        git(["worktree", "unlock", str(path)], repo)
        return _on_free_branch(repo, task, base,
                               lambda branch, new: git(["switch", "-q", "-c" if new else "-C", branch], path))


def drop_parked(path: Path) -> None:
    """Remove the worktree at ``path`` and its registration when it is a parked one no task took
    (``_is_parked``); any other worktree is left as it is."""
    with _admin():   # waits for a park in progress (the kept server's thread)
        if not _is_parked(path):
            return
        common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], path, check=False)
        if common:
            git(["--git-dir", common, "worktree", "remove", "--force", "--force", str(path)], path.parent,
                check=False)


# The suffix of a kept server's folder's owner record, a file beside the folder (engine_slots.make_folder).
ENGINE_OWNER = ".owner"


def engine_owner_file(folder: Path) -> Path:
    """The owner record of the kept server's ``folder``: ``<folder>.owner`` beside it."""
    return folder.with_name(folder.name + ENGINE_OWNER)


def drop_engine_folder(folder: Path, whole: bool = False) -> None:
    """Remove ``folder`` when it is a kept server's (``<worktree root>/engine/<slot>-<hex>``,
    engine_slots.py) and empty, or ``whole`` (its task's worktree is removed already) with what
    the run left in it beside that worktree (the folder is the task's alone and was writable to
    it: files, folders, links, none followed), and its owner record (``engine_owner_file``); then
    the ``engine`` folder when that leaves it empty."""
    engine_root = worktree_root() / "engine"
    if folder.parent != engine_root:
        return
    if whole and not folder.is_symlink() and folder.is_dir():
        _force_rmtree(str(folder))
    with contextlib.suppress(OSError):   # not empty (a worktree is still there): kept
        folder.rmdir()
    if not os.path.lexists(folder):
        with contextlib.suppress(OSError):
            engine_owner_file(folder).unlink()
    with contextlib.suppress(OSError):   # another kept server's folder is still there: kept
        engine_root.rmdir()


def _force_rmtree(path: str) -> list[str]:
    """Delete ``path``'s tree, giving the owner write and search permission on each folder first
    (a non-root user cannot empty a ``chmod 555`` folder). A link at ``path`` (a run may have put
    one where its folder was) is removed itself; what it points at is never touched. Returns the
    errors met."""
    problems: list[str] = []
    if os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return problems
    _owner_writable_tree(path, problems)
    shutil.rmtree(path, onerror=lambda _fn, where, info:
                  problems.append(f"{where}: {getattr(info[1], 'strerror', info[1])}"))
    return problems


def _owner_writable_tree(path: str, problems: list[str]) -> None:
    """Give the owner rwx on every folder under ``path`` (top-down, so a folder is opened after
    it was made readable); errors are appended to ``problems``."""
    for dirpath, dirnames, _ in os.walk(path, onerror=lambda exc: problems.append(f"{exc.filename}: {exc.strerror}")):
        for folder in [dirpath, *(os.path.join(dirpath, d) for d in dirnames)]:
            _owner_rwx(folder)


def _owner_rwx(folder: str) -> None:
    with contextlib.suppress(OSError):
        mode = os.lstat(folder).st_mode
        if stat.S_ISDIR(mode) and mode & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(folder, mode | stat.S_IRWXU)


def _leftover(path: str, problems: list[str]) -> str | None:
    """None when ``path`` is gone; else how much is left, a few of its paths and the errors."""
    if not os.path.lexists(path):
        return None
    left = []
    for dirpath, dirnames, filenames in os.walk(path):
        left += [os.path.join(dirpath, n) for n in (*dirnames, *filenames)]
        if len(left) > 1000:
            break
    sample = ", ".join(os.path.relpath(p, path) for p in left[:5]) or "the empty folder itself"
    why = "; ".join(dict.fromkeys(problems))[:400] or "unknown"
    return (f"{path} could not be removed: {len(left)}{'+' if len(left) > 1000 else ''} entries left "
            f"({sample}); errors: {why}. Fix the permissions and remove it "
            f"({store.shell_command('chmod', '-R', 'u+rwx', path)} && {store.shell_command('rm', '-rf', path)}), "
            "or run clear --remove-worktrees again")


def folders_problem() -> str | None:
    """None when the worker's log and worktree folders can be made and written; else which
    cannot, and the knob that moves it. The worker checks before its first claim and before each
    claim of a pass (a folder that went away or read-only mid-pass holds claims instead of
    failing every task); doctor's ``folders`` line says it."""
    for what, folder, knob in (("log folder", store.log_dir(), "TASK_LOG_DIR"),
                               ("worktree folder", worktree_root(), "TASKBRIDGE_WORKTREE_ROOT")):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)   # task data: this user's only
        except OSError as exc:
            return f"the {what} {folder} cannot be created ({exc.strerror}); point {knob} at a writable folder"
        if not os.access(folder, os.W_OK):
            return f"the {what} {folder} is not writable; point {knob} at a writable folder"
    return None


def observed_changes(ws: Workspace) -> tuple[list[str], str]:
    """Files changed since the base commit (in place: since the tree the attempt began with,
    ``start_tree``) and the diff, untracked files included, computed with a throw-away index so
    neither the user's index nor the worktree's is touched. In place outside git: the paths
    (relative to the folder) that differ from ``start_listing``, and no diff; when the folder
    cannot be compared after the run (over LISTING_AFTER_MAX entries or WALK_DEPTH_MAX levels,
    replaced by a link or another folder), ``ws.start_listing`` becomes None and ``ws.note`` says
    why: the receipt then takes the write and edit tools' word, and claims no no_change."""
    if ws.mode == "in-place" and not ws.top:
        if ws.start_listing is None:
            return [], ""
        try:
            return listing_changes(ws.cwd, ws.start_listing), ""
        except NotListed as exc:
            ws.start_listing, ws.note = None, in_place_note(str(exc), after=True)
            return [], ""
    since = ws.start_tree or ws.base_commit
    if not ws.top or not since:
        return [], ""
    with _index_of_now(ws.top, since) as env:
        names = git(["diff", "--cached", "--name-only", *DIFF_FLAGS, since], ws.top, env=env)
        diff = git(["diff", "--cached", "--binary", "--full-index", *DIFF_FLAGS, since], ws.top,
                   env=env, strip=False)
    return [n for n in names.splitlines() if n], diff


def uncommitted_paths(folder: str) -> list[str]:
    """The paths of the checkout holding ``folder`` that differ from its last commit (changed,
    staged, or untracked and not ignored), as ``git status`` names them; [] when there are none,
    or git cannot tell (no repository: nothing is said then). A worktree task's worktree is made
    from a commit, so a person queuing one should hear that these stay out of it."""
    try:
        listed = git(["status", "--porcelain=v1", "-z", "--untracked-files=normal"], folder, strip=False)
    except (GitError, OSError):
        return []
    entries = listed.split("\0")
    paths, skip = [], False
    for entry in entries:
        if skip or len(entry) < 4:
            skip = False
            continue
        paths.append(entry[3:])
        skip = entry[0] in "RC"   # a rename or copy names its source in the next field
    return paths


def tree_now(top: str, head: str) -> tuple[str, list[str]]:
    """(the tree of the checkout ``top`` as it is now: tracked changes and untracked files in,
    ignored files out, as a commit of it would hold; the paths that differ from ``head``), written
    with a throw-away index (git write-tree: an object in the repository, no ref, no commit).
    Raises GitError / OSError."""
    with _index_of_now(top, head) as env:
        tree = git(["write-tree"], top, env=env)
        names = git(["diff", "--cached", "--name-only", *DIFF_FLAGS, head], top, env=env)
    return tree, [n for n in names.splitlines() if n]


@contextlib.contextmanager
def _index_of_now(top: str, base: str) -> Iterator[dict[str, str]]:
    """The environment of a throw-away index (GIT_INDEX_FILE) holding ``base`` (a commit or tree)
    with every file of ``top`` as it is now added; the paths a sparse checkout left out stay."""
    left_out = not_checked_out(top)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        git(["read-tree", base], top, env=env)
        keep_left_out(top, left_out, env)
        add_all(top, env)
        yield env


def add_all(top: str, env: dict | None = None) -> None:
    """``git add -A .`` in the worktree ``top`` (``env``: a throw-away index, say). A folder git
    could not open (its path past PATH_MAX, no permission) raises the OSError git met there: git
    only warns and leaves it out, and what the run wrote in it would be lost without a word.
    Raises GitError / GitStopped / OSError."""
    said: list[str] = []
    git(["add", "-A", "."], top, env=env, config=WHOLE_TREE_ADD, stderr_to=said)
    for rel, reason in re.findall(r"^warning: could not open directory '([^'\n]*)(': [^\n]*)?", "".join(said), re.M):
        where = os.path.join(top, rel)
        if not reason:   # git cuts a warning at 4 KB: only a path past PATH_MAX comes cut
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), where + "…")
        os.scandir(where).close()   # meets git's OSError itself, with its path
        raise GitError(f"git add -A could not open the folder {rel!r} in {top}{reason}: what is in it is not committed")


# TaskBridge's own `add -A` takes every file a run left, inside a sparse checkout's cone or not:
# with sparse checking on, git refuses a new file outside the cone, and the commit of a finished
# run failed. The paths git left out stay out by their skip-worktree marks (`keep_left_out`).
WHOLE_TREE_ADD = ("core.sparseCheckout=false",)


def not_checked_out(top: str) -> list[str]:
    """The tracked paths (relative to ``top``) a sparse checkout (``core.sparseCheckout``) left
    out of the worktree at ``top``: marked skip-worktree in its index and absent on disk; [] when
    it is not sparse. Read before an index is rebuilt from a commit (which drops the marks), they
    keep those paths from showing, and being committed, as deleted. A file the run wrote at such
    a path is on disk, so it counts as changed. Raises GitError when a sparse worktree's index
    cannot be read: committing without it would delete every path outside the cone."""
    if git(["config", "--bool", "--get", "core.sparseCheckout"], top, check=False) != "true":
        return []
    listing = git(["ls-files", "-t", "-z"], top, strip=False)
    return [entry[2:] for entry in listing.split("\0")
            if entry.startswith("S ") and not os.path.lexists(os.path.join(top, entry[2:]))]


def keep_left_out(top: str, paths: list[str], env: dict[str, str] | None = None) -> None:
    """Mark those of ``paths`` (see `not_checked_out`) that the index holds skip-worktree, in the
    worktree's index or the one ``env``'s ``GIT_INDEX_FILE`` names, so `add -A` leaves them as
    they are in the commit. Raises GitError."""
    if not paths:
        return
    held = set(git(["ls-files", "-z"], top, env=env, strip=False).split("\0"))
    kept = [path for path in paths if path in held]
    if kept:   # on stdin: a monorepo leaves out more paths than a command line holds
        git(["update-index", "-z", "--skip-worktree", "--stdin"], top, env=env,
            input="".join(f"{path}\0" for path in kept).encode())


def checkout_state(repo: str | None) -> dict[str, tuple]:
    """The user's checkout as git sees it: every changed or untracked path with its status,
    size and mtime. Taken before and after a run, it shows what an agent changed outside its
    worktree (which nothing prevents: the bash tool can write anywhere)."""
    if not repo:
        return {}
    out = git(["status", "--porcelain", "-z", "--untracked-files=all"], repo, check=False, strip=False)
    state: dict[str, tuple] = {}
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
    """Commit everything in the worktree on the task branch; returns the commit id or None when
    nothing changed. No hook runs, nothing is signed, no editor opens; the user's identity is
    used where configured, and TaskBridge's fills in a missing name or email (so
    ``user.useConfigOnly`` cannot refuse it). Raises GitError / GitStopped."""
    if ws.mode != "worktree":
        return None
    # The index from HEAD, not from the run: a boxed run's own `git add` wrote its objects to a
    # quarantine dropped after the run, so its index entries may name objects this repository
    # lacks (and an unchanged file's entry is trusted by `add -A`).
    top = ws.root()
    left_out = not_checked_out(top)   # read before read-tree drops the index's sparse marks
    git(["read-tree", "HEAD"], top)
    keep_left_out(top, left_out)
    add_all(top)
    if not git(["diff", "--cached", "--name-only", "--no-ext-diff", "HEAD"], top):
        return None
    identity = tuple(f"{key}={value}" for key, value in FALLBACK_IDENTITY.items()
                     if not git(["config", "--get", key], top, check=False))
    git(["commit", "-q", "--no-verify", "--no-gpg-sign", "--cleanup=verbatim", "-m", message], top,
        config=identity)
    return git(["rev-parse", "HEAD"], top)


COMMIT_TRAILER = "TaskBridge-Attempt"


def task_commit_message(task: dict[str, Any], summary: str, facts: dict[str, Any]) -> str:
    """The task branch's commit message: the title line, the agent's summary, and a trailer that
    names this queue and attempt with ``facts`` (usage, session_id: what the receipt needs). The
    commit lands on the repository's disk before the queue records the task: a pass that finds it
    without its record (the worker killed, or its disk full, in between) records it from here."""
    trailer = json.dumps({"attempt": task["run_marker"], "queue": store.queue_tag(), **facts},
                         separators=(",", ":"), default=str)
    body = commit_text(summary)[:2000]
    return f"taskbridge {task['id']}: {commit_text(task['title'])}\n\n" + (f"{body}\n\n" if body else "") + \
        f"{COMMIT_TRAILER}: {trailer}\n"


def commit_text(text: str) -> str:
    """``text`` (a title, a summary) as one line of a commit message: runs of whitespace as one
    space, every other control character (ESC, BEL, DEL, C1, the bidi overrides) as a visible
    escape (``\\x1b``): ``git log`` prints a message raw on the terminal, and a line break in a
    title would end the subject (or put a line of its own before the trailer)."""
    import task_views  # here, not at the top: task_views imports this module
    return task_views.CONTROL_OR_BREAK_RE.sub(task_views.escape_char, " ".join(str(text).split()))


def unrecorded_commit(task: dict[str, Any], marker: str) -> dict[str, Any] | None:
    """The commit attempt ``marker`` of ``task`` (a local one) made on its branch, straight on its
    base commit, by this queue (its trailer says so), which the queue never recorded: ``{"commit",
    "files", "diff", "summary", "usage", "session_id"}``; None when the branch holds no such
    commit. Raises GitError / GitStopped when git cannot read the repository."""
    if task.get("repo") or not task.get("branch") or not task.get("base_commit") or \
            not os.path.isdir(task["working_dir"]):
        return None
    top = _repo_top_or_none(task["working_dir"])
    tip = _branch_tip(top, task["branch"]) if top else ""
    if top is None or not tip or tip == task["base_commit"]:
        return None
    base = task["base_commit"]
    facts = _trailer_facts(git(["log", "-1", "--format=%B", tip], top, strip=False))
    if facts.get("attempt") != marker or facts.get("queue") != store.queue_tag() or \
            git(["rev-parse", f"{tip}^"], top, check=False) != base:
        return None
    names = git(["diff", "--name-only", *DIFF_FLAGS, base, tip], top)
    diff = git(["diff", "--binary", "--full-index", *DIFF_FLAGS, base, tip], top, strip=False)
    summary = ("\n" + git(["log", "-1", "--format=%b", tip], top)).split(f"\n{COMMIT_TRAILER}: ")[0].strip()
    return {"commit": tip, "files": [n for n in names.splitlines() if n], "diff": diff, "summary": summary,
            "usage": facts.get("usage"), "session_id": facts.get("session_id")}


def _trailer_facts(message: str) -> dict[str, Any]:
    for line in reversed(message.splitlines()):
        if line.startswith(f"{COMMIT_TRAILER}: "):
            with contextlib.suppress(ValueError):
                facts = json.loads(line.split(": ", 1)[1])
                return facts if isinstance(facts, dict) else {}
    return {}


def revert_changes(ws: Workspace, snapshot: dict[str, tuple] | None) -> tuple[list[str], list[str]]:
    """readonly: undo every change the run left. In a worktree, reset to the base commit and
    remove new files; in place, restore from the pre-run snapshot (``restore_snapshot``).
    Returns (the reverted paths, what could not be reverted as ``path: why`` lines)."""
    if ws.mode == "worktree":
        changed, _ = observed_changes(ws)
        _owner_writable_tree(ws.root(), [])     # a chmod 555 build folder must not stop the revert
        git(["reset", "-q", "--hard", ws.base()], ws.root())
        git(["clean", "-q", "-fdx"], ws.root())
        return changed, []
    return restore_snapshot(ws.cwd, snapshot or {})


SNAPSHOT_LIMIT_BYTES = 50 * 2**20
LISTING_MAX = 200_000   # entries of an in-place folder outside git listed to see what a run changed
# Entries listed after the run to compare (a revert reads them all): a run that made more is not
# compared (the receipt says so) rather than holding millions of paths.
LISTING_AFTER_MAX = 2 * LISTING_MAX
LISTING_READ_BYTES = 50 * 2**20   # of its files' bytes hashed, so a file rewritten as it was is no change
WALK_DEPTH_MAX = 256   # folder levels below the task's folder walked; a deeper one is not compared (said)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A file opened to read it: never through a link, and never waiting (a FIFO put where a file was
# opens at once; its fstat then says it is no file and it is not read).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class NotListed(Exception):
    """`walk_folder` would not walk a folder whole. The message says why, in words that follow
    "the folder" in a receipt ("holds over 200,000 entries", "goes over 256 folders deep", "was
    replaced during the run …")."""


@dataclass(frozen=True)
class Found:
    """One entry `walk_folder` met. ``rel``: its path relative to the root (``.``: the root
    itself); ``name``: its name in its folder, opened with ``dir_fd`` (the folder's descriptor,
    open only until the walk moves on); ``info``: its lstat, or None for a folder that could not
    be opened to list it (it was met before, with its lstat; ``error`` says why)."""
    rel: str
    name: str
    dir_fd: int
    info: os.stat_result | None
    error: str = ""


@dataclass
class FolderListing:
    """What `folder_listing` saw under a folder: ``root_id`` (device, inode) of the folder itself,
    and ``entries`` by path relative to it (see `folder_listing` for their shapes)."""
    root_id: tuple[int, int]
    entries: dict[str, tuple]


def walk_folder(root: str, *, max_entries: int | None, max_depth: int | None = WALK_DEPTH_MAX,
                root_id: tuple[int, int] | None = None) -> Generator[Found, None, None]:
    """Every entry under ``root``, the root itself first, each folder's entries before anything
    below them; a link is never followed, not even at ``root``. Iterative (an explicit stack, one
    folder open at a time): no depth of folders exhausts Python's recursion. Each folder below
    the root is opened by path without following a link and must be the folder (device, inode)
    its parent listed, else it is yielded as not opened (swapped during the walk). Skips the
    root's own ``.git`` only (see `_SKIPPED`). Raises NotListed when ``root`` is no folder (a
    link), is not ``root_id`` (device, inode) when given, cannot be opened, or the walk passes
    ``max_entries`` entries or ``max_depth`` levels below ``root`` (None: no limit)."""
    fd = _open_root(root, root_id)
    pending: list[tuple[str, str, int, tuple[int, int] | None]] = [(root, ".", 0, None)]
    count = 0
    try:
        yield Found(".", ".", fd, os.fstat(fd))
    except BaseException:   # the caller stopped at the root: its folder is closed all the same
        os.close(fd)
        raise
    while pending:
        path, rel, depth, ident = pending.pop()
        if ident is not None:
            try:
                fd = _open_dir(path, ident)
            except OSError as exc:
                yield Found(rel, os.path.basename(path), -1, None, exc.strerror or str(exc))
                continue
        try:
            with os.scandir(fd) as listing:   # read no further than the entries left to list
                names = []
                for entry in listing:
                    names.append(entry.name)
                    if max_entries is not None and count + len(names) > max_entries + len(_SKIPPED):
                        raise NotListed(f"holds over {max_entries:,} entries")
                names.sort()
            for name in names:
                if rel == "." and name in _SKIPPED:
                    continue
                count += 1
                if max_entries is not None and count > max_entries:
                    raise NotListed(f"holds over {max_entries:,} entries")
                child = name if rel == "." else os.path.join(rel, name)
                try:
                    info = os.lstat(name, dir_fd=fd)
                except OSError as exc:
                    yield Found(child, name, fd, None, exc.strerror or str(exc))
                    continue
                yield Found(child, name, fd, info)
                if stat.S_ISDIR(info.st_mode):
                    if max_depth is not None and depth + 1 > max_depth:
                        raise NotListed(f"goes over {max_depth:,} folders deep")
                    pending.append((os.path.join(path, name), child, depth + 1, (info.st_dev, info.st_ino)))
        except OSError as exc:   # the folder could not be read through (listed as not opened)
            yield Found(rel, os.path.basename(path), -1, None, exc.strerror or str(exc))
        finally:
            os.close(fd)


# The folder's own top-level .git is skipped, nothing deeper: in a checkout run in place (the
# readonly snapshot) it is git's database, which TaskBridge's own git writes during the attempt
# (tree_now's and the diff's objects) and whose configuration the git guard pins and restores
# (pin_git_config, undo_planted_git); reverting it would undo git's bookkeeping as the agent's.
# (Outside git a folder holding a .git that git cannot read is refused before the run:
# _repo_state.) A .git further down (a nested clone, a vendored repository) is the project's
# files, which the agent can write like any other: skipping it hid those writes.
_SKIPPED = (".git",)


def _open_root(root: str, root_id: tuple[int, int] | None) -> int:
    """``root`` opened as a folder, never through a link; raises NotListed when it is not one,
    or not the folder ``root_id`` (device, inode)."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotListed("is no longer a folder but a link or a file (the run replaced the folder itself)") from None
        raise NotListed(f"could not be opened ({exc.strerror})") from None
    info = os.fstat(fd)
    if root_id is not None and (info.st_dev, info.st_ino) != root_id:
        os.close(fd)
        raise NotListed("was replaced during the run (another folder is at its path now)")
    return fd


def _open_dir(path: str, ident: tuple[int, int]) -> int:
    """The folder at ``path`` opened without following a link at its end; raises OSError, and
    for one that is not the folder ``ident`` (device, inode) its parent listed (a path above
    it swapped for a link meanwhile)."""
    fd = os.open(path, _DIR_FLAGS)
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != ident:
        os.close(fd)
        raise OSError(errno.ESTALE, "replaced while it was being listed")
    return fd


def _read_file(found: Found) -> bytes | None:
    """The bytes of the regular file ``found`` names, read through its folder's descriptor: never
    through a link, never waiting on a FIFO, and at most one byte past the size the walk met (a
    file that grew since reads as changed, never as gigabytes held in memory). None when it is no
    longer the regular file (device, inode) the walk met. Raises OSError."""
    assert found.info is not None
    fd = os.open(found.name, _FILE_FLAGS, dir_fd=found.dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (found.info.st_dev, found.info.st_ino):
            return None
        chunks, left = [], found.info.st_size + 1   # one byte past its listed size: a file grown since is changed
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def folder_listing(root: str, before: FolderListing | None = None) -> FolderListing:
    """What is under ``root`` (its own ``.git`` excepted), by path relative to it: ``("file",
    permission bits, size in bytes, mtime in ns, ctime in ns, inode, sha256 or None)``, ``("link",
    target)``, ``("dir", permission bits)``, ``("other", permission bits)`` (FIFO, socket, device),
    ``("unreadable",)``. Files are hashed while their bytes stay within LISTING_READ_BYTES (then
    None). Given ``before`` (the listing to compare with, taken before the run), a file keeps its
    hash only when its size, mtime, ctime and inode are all unchanged (a person can set a
    file's mtime back, not its ctime or inode); one hashed then whose size matches is hashed
    again, and ``root`` must still be the folder listed then. Raises NotListed past LISTING_MAX
    entries (LISTING_AFTER_MAX given ``before``), WALK_DEPTH_MAX levels, or for a root that is a
    link or another folder. Compared after a run by `listing_changes`."""
    entries: dict[str, tuple] = {}
    budget = [LISTING_READ_BYTES]
    walk = walk_folder(root, max_entries=LISTING_AFTER_MAX if before else LISTING_MAX,
                       root_id=before.root_id if before else None)
    top = next(walk)
    assert top.info is not None
    was = before.entries if before else {}
    for found in walk:
        try:
            entries[found.rel] = _listed(found, was.get(found.rel), before is None, budget)
        except OSError:
            entries[found.rel] = ("unreadable",)
    return FolderListing((top.info.st_dev, top.info.st_ino), entries)


def _listed(found: Found, was: tuple | None, first: bool, budget: list[int]) -> tuple:
    """One entry of `folder_listing` (``was``: the path's entry before; ``first``: no listing
    before, so hash within ``budget``, the bytes left to read). Raises OSError."""
    info = found.info
    if info is None:
        return ("unreadable",)
    if stat.S_ISLNK(info.st_mode):
        return ("link", os.readlink(found.name, dir_fd=found.dir_fd))
    if stat.S_ISDIR(info.st_mode):
        return ("dir", stat.S_IMODE(info.st_mode))
    if not stat.S_ISREG(info.st_mode):
        return ("other", stat.S_IMODE(info.st_mode))
    seen = (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino)
    digest = None
    if first and info.st_size <= budget[0]:
        budget[0] -= info.st_size
        digest = _sha256(found)
    elif not first and was and was[0] == "file" and was[6] and was[2] == info.st_size:
        digest = was[6] if was[2:6] == seen else _sha256(found)
    return ("file", stat.S_IMODE(info.st_mode), *seen, digest)


def _sha256(found: Found) -> str:
    """The sha256 of the file ``found`` (hex); raises OSError when it is no longer that regular
    file (a link or FIFO swapped in after it was listed): the entry is then unreadable."""
    data = _read_file(found)
    if data is None:
        raise OSError(errno.ESTALE, "no longer the file listed")
    return hashlib.sha256(data).hexdigest()


def listing_changes(root: str, before: FolderListing) -> list[str]:
    """The paths under ``root`` (relative to it, sorted) that a run added, removed or changed
    since ``before`` (`folder_listing`): a file's bytes (by hash; unhashed, its size, mtime,
    ctime or inode), its permissions, a link's target; a folder only when it came or went or
    its permissions changed. A file rewritten with the bytes it had (a readonly run's revert) is
    no change. Raises NotListed (see `folder_listing`: too many, too deep, the folder replaced)."""
    after = folder_listing(root, before).entries

    def same(was: tuple | None, now: tuple | None) -> bool:
        if was is None or now is None or was[0] != "file" or now[0] != "file":
            return was == now
        if was[1:3] != now[1:3]:
            return False
        return was[2:6] == now[2:6] or (was[6] is not None and was[6] == now[6])

    return sorted(path for path in before.entries.keys() | after.keys()
                  if not same(before.entries.get(path), after.get(path)))


def in_place_note(why: str | None = None, after: bool = False) -> str:
    """The receipt's isolation words for a run in place outside git: its files_touched is what
    differs in the folder, or (``why``: what stopped the comparison, words after "the folder";
    ``after``: found after the run) what the agent's write and edit tools wrote."""
    head = "not a git repository: ran in place, changes are not isolated"
    if why is None:
        return (f"{head}; files_touched: what differs in the folder after the run (compared with it before; "
                "no diff is kept)")
    when = "after the run " if after else ""
    return (f"{head}; files_touched lists what the agent's write and edit tools wrote ({when}the folder {why}, "
            "so it was not compared before and after the run)")


def take_snapshot(root: str, before: dict[str, tuple] | None = None) -> dict[str, tuple] | None:
    """Everything under ``root`` (its own ``.git`` excepted) by relative path (``.`` is ``root``):
    ``("dir", mode)``, ``("file", mode, bytes)``, ``("link", target)``, ``("other", mode)`` (a
    FIFO, socket or device), or ``("opaque", mode)`` for a file or folder it cannot read (the
    revert leaves it and all below it alone, its mode aside); None when the files hold more than
    50 MB, or the folder holds more than LISTING_MAX entries or goes deeper than WALK_DEPTH_MAX
    levels (a root that is a link is not followed: None too). Modes are the permission bits
    (None when not even those could be read). Given ``before`` (an earlier snapshot), only files
    that were in it with the same size are read, the rest hold None; there is no size, entry or
    depth limit then (a revert walks it whole), and for a root that is a link it raises NotListed."""
    try:
        return _snapshot(root, before)
    except NotListed:
        if before is not None:
            raise
        return None


def _snapshot(root: str, before: dict[str, tuple] | None) -> dict[str, tuple] | None:
    entries: dict[str, tuple] = {}
    total = 0
    # After the run (``before``: a revert) the whole folder is walked: a run that makes more entries than
    # a listing holds must not get out of its revert that way.
    walk = walk_folder(root, max_entries=None if before is not None else LISTING_MAX,
                       max_depth=None if before is not None else WALK_DEPTH_MAX)
    for found in walk:
        info = found.info
        if info is None:   # a folder met before (its mode kept) that could not be opened
            entries[found.rel] = ("opaque", entries.get(found.rel, ("dir", None))[1])
        elif stat.S_ISDIR(info.st_mode):
            entries[found.rel] = ("dir", stat.S_IMODE(info.st_mode))
        elif stat.S_ISLNK(info.st_mode):
            entries[found.rel] = ("link", os.readlink(found.name, dir_fd=found.dir_fd))
        elif not stat.S_ISREG(info.st_mode):
            entries[found.rel] = ("other", stat.S_IMODE(info.st_mode))
        else:
            if before is None:
                total += info.st_size
                if total > SNAPSHOT_LIMIT_BYTES:
                    walk.close()
                    return None
            was = before.get(found.rel) if before is not None else None
            wanted = before is None or (was is not None and was[0] == "file" and len(was[2]) == info.st_size)
            entries[found.rel] = _snapshot_file(found, wanted)
    return entries


def _snapshot_file(found: Found, wanted: bool) -> tuple:
    """A regular file's snapshot entry: its bytes when ``wanted`` (else None); ``("opaque",
    mode)`` when it cannot be read or is no longer that file."""
    assert found.info is not None
    mode = stat.S_IMODE(found.info.st_mode)
    if not wanted:
        return ("file", mode, None)
    try:
        data = _read_file(found)
    except OSError:
        data = None
    return ("file", mode, data) if data is not None else ("opaque", mode)


GUARD_READ_MAX = 1 << 20   # bytes of one git configuration file the git guard reads (git's own are a few KB)


def _read_guarded(path: str, info: os.stat_result) -> bytes:
    """A configuration file's bytes for the git guard, without blocking (a link to a file that
    never ends a read, ``/proc/kmsg``, reads as an error) and at most GUARD_READ_MAX of them: a
    larger one (a sparse file of a terabyte costs no disk) stands for its size and change time."""
    if info.st_size > GUARD_READ_MAX:
        return f"(a file of {info.st_size:,} bytes, too big to read; changed at {info.st_mtime_ns})".encode()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        data = os.read(fd, GUARD_READ_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > GUARD_READ_MAX:   # grew past its size as read (a /proc file says 0)
        return f"(a file of over {GUARD_READ_MAX:,} bytes, too big to read)".encode()
    return data


def restore_snapshot(root: str, snapshot: dict[str, tuple]) -> tuple[list[str], list[str]]:
    """Put ``root`` back as ``take_snapshot`` saw it: new files, links and folders removed (a
    folder made unreadable or unsearchable, even ``chmod 000``, is opened first), changed or
    removed files, links and folders put back, changed modes restored. Returns (the paths that
    differed, sorted, a folder's ending in ``/``; ``path: why`` for each it could not revert)."""
    if not snapshot:
        return [], []
    failed: list[str] = []
    try:
        modes = _open_tree(root, failed)        # every folder searchable and writable, every file readable
        seen = take_snapshot(root, snapshot) or {}
    except NotListed as exc:   # never reverted through a link put where the folder was
        return [], [f".: nothing reverted: the folder {exc}"]
    now = {rel: (e[0], modes.get(rel, e[1]), *e[2:]) if e[0] != "link" else e for rel, e in seen.items()}
    hidden = [rel for rel, e in snapshot.items() if e[0] == "opaque"]

    def left_alone(rel: str) -> bool:
        return any(rel == h or rel.startswith(h + os.sep) for h in hidden)

    def shown(rel: str, kind: str) -> str:
        return rel + "/" if kind == "dir" else rel

    reverted: set[str] = set()
    for rel in sorted(now, key=lambda r: -r.count(os.sep)):          # deepest first
        if rel != "." and not left_alone(rel) and (rel not in snapshot or snapshot[rel][0] != now[rel][0]):
            if _remove_entry(root, rel, now[rel][0], failed):
                reverted.add(shown(rel, now[rel][0]))
    for rel in sorted(snapshot, key=lambda r: r.count(os.sep)):      # shallowest first
        entry = snapshot[rel]
        same_kind = rel in now and now[rel][0] == entry[0]
        if left_alone(rel) or (same_kind and now[rel] == entry):
            continue
        if same_kind and entry[0] != "link" and now[rel][2:] == entry[2:]:
            reverted.add(shown(rel, entry[0]))            # only its mode changed: set below
        elif _put_back(root, rel, entry, failed):
            reverted.add(shown(rel, entry[0]))
    for rel in sorted((r for r in snapshot if snapshot[r][0] != "link" and snapshot[r][1] is not None),
                      key=lambda r: -r.count(os.sep)):
        _chmod(root, rel, snapshot[rel][1], failed)   # modes last, deepest first (a folder after its contents)
    return sorted(reverted), sorted(dict.fromkeys(failed))


def _open_tree(root: str, failed: list[str]) -> dict[str, int]:
    """Give the owner rwx on every folder and read on every file under ``root`` (top-down: a
    ``chmod 000`` folder is opened before the walk enters it; links untouched, never followed);
    returns each one's mode before by relative path. Appends ``path: why`` to ``failed``.
    Raises NotListed (see `walk_folder`: the root a link)."""
    modes: dict[str, int] = {}
    with contextlib.suppress(OSError):
        top = os.lstat(root)
        if stat.S_ISDIR(top.st_mode) and top.st_mode & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(root, stat.S_IMODE(top.st_mode) | stat.S_IRWXU)
            modes["."] = stat.S_IMODE(top.st_mode)
    for found in walk_folder(root, max_entries=None, max_depth=None):   # the revert's: whole (see _snapshot)
        info = found.info
        if info is None:
            failed.append(f"{found.rel}: cannot open ({found.error})")
            continue
        if stat.S_ISLNK(info.st_mode):
            continue
        modes.setdefault(found.rel, stat.S_IMODE(info.st_mode))
        need = stat.S_IRWXU if stat.S_ISDIR(info.st_mode) else stat.S_IRUSR
        if info.st_mode & need != need:
            try:
                os.chmod(found.name, stat.S_IMODE(info.st_mode) | need, dir_fd=found.dir_fd)
            except OSError as exc:
                failed.append(f"{found.rel}: cannot open ({exc.strerror})")
    return modes


def _remove_entry(root: str, rel: str, kind: str, failed: list[str]) -> bool:
    path = os.path.join(root, rel)
    try:
        if kind == "dir":
            os.rmdir(path)                 # its children went first (deepest first)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        failed.append(f"{rel}: not removed ({exc.strerror})")
        return False


def _put_back(root: str, rel: str, entry: tuple, failed: list[str]) -> bool:
    path = os.path.join(root, rel)
    try:
        if entry[0] == "dir":
            os.makedirs(path, exist_ok=True)
            _owner_rwx(path)               # its own mode is set after its contents
        elif entry[0] == "other":
            failed.append(f"{rel}: a FIFO, socket or device; not put back")
            return False
        elif entry[0] == "link":
            if os.path.lexists(path):
                os.unlink(path)
            os.symlink(entry[1], path)
        else:
            if os.path.lexists(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(entry[2])
            os.chmod(path, entry[1])
        return True
    except OSError as exc:
        failed.append(f"{rel}: not restored ({exc.strerror})")
        return False


def _chmod(root: str, rel: str, mode: int, failed: list[str]) -> None:
    try:
        os.chmod(os.path.join(root, rel), mode)
    except FileNotFoundError:
        pass
    except OSError as exc:
        failed.append(f"{rel}: mode not restored ({exc.strerror})")


def remove_worktree_at(path: str) -> str | None:
    """Remove a kept worktree by its path alone (``clear_finished``); its branch stays.
    Returns None when removed (checked) or already gone, else what is left and why."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):   # a run put a link where its folder was (FolderReplaced): the link goes, never its target
        parent = os.path.realpath(os.path.dirname(path))
        if parent != os.path.realpath(worktree_root()) and not _inside(parent, worktree_root()):
            return f"{path}: a link, not under {worktree_root()}; left in place"
        os.unlink(path)
        drop_engine_folder(Path(path).parent, whole=True)
        return None
    repo = None
    if os.path.isfile(os.path.join(path, ".git")):
        common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], path, check=False)
        # A checkout's worktree shares <checkout>/.git; a remote task's, the bare mirror itself.
        repo = (os.path.dirname(common) if os.path.basename(common) == ".git" else common) if common else None
    elif not _inside(path, worktree_root()):
        return f"{path}: not a git worktree any more and not under {worktree_root()}; left in place"
    try:
        return _remove_tree(path, repo)
    except GitError as exc:
        return f"{path}: {str(exc)[:300]}"


def _inside(path: str, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real != base and real.startswith(base + os.sep)


def _clear_leftovers(task: dict[str, Any], recorded: list[dict[str, str]], purged: dict[str, Any]) -> bool:
    """Remove the finished ``task``'s leftover folders on this host (``recorded``: its entries of
    task_store.leftover_folders), adding to ``purged``'s ``leftovers_removed`` and ``problems``
    (those on another host are named there, with the command that removes them). Returns
    whether the task may go: False when one here could not be removed."""
    here = store.host_name()
    for entry in recorded:
        if entry["host"] != here:
            purged["problems"].append(f"{task['id']}'s leftover {entry['path']} (an earlier attempt's worktree, set "
                                      f"aside) is on host {entry['host']}, not this one ({here}); remove it there "
                                      f"({store.shell_command('rm', '-rf', entry['path'])})")
    removed, untouched, problems = remove_leftovers(task, [e["path"] for e in recorded if e["host"] == here])
    purged["leftovers_removed"] += removed
    purged["problems"] += [f"{task['id']}'s leftover {why}" for why in untouched]
    purged["problems"] += [f"{task['id']} stays in the queue: {problem}" for problem in problems]
    return not problems


def remove_leftovers(task: dict[str, Any], paths: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Remove ``paths``, the folders set_aside moved the worktrees of ``task`` (``{"id",
    "worktree_path"}``) to, as its events name them, each only when it is one of set_aside's own
    places for that task (``leftover_place``) and a plain folder there: never a link (nor one
    inside it: links are removed, never followed), a mount point, or a repository of its own;
    read-only folders inside are made writable first, as ``remove_worktree_at`` does. One already
    gone is skipped. Returns (the paths removed, why each one not removed was left untouched
    (not set_aside's, or no longer: the worktree root moved since), what is left of each whose
    removal failed and why)."""
    removed, untouched, problems = [], [], []
    for path in dict.fromkeys(paths):
        if not os.path.lexists(path):
            continue
        why = _not_removable_leftover(task, path)
        if why:
            untouched.append(why)
        elif left := _leftover(path, _force_rmtree(path)):
            problems.append(left)
        else:
            removed.append(path)
    return removed, untouched, problems


def leftover_place(task: dict[str, Any], path: str) -> bool:
    """Whether ``path`` is named as set_aside names the place of an earlier worktree of ``task``
    (``{"id", "worktree_path"}``): ``<worktree root>/left/<id>-<n>`` or, beside its worktree,
    ``<worktree>.left-<n>`` (n 1..99), exactly (no ``..``, no other name)."""
    place, n = Path(path), r"-[1-9][0-9]?"
    if place.parent == worktree_root() / "left" and re.fullmatch(re.escape(task["id"]) + n, place.name):
        return True
    own = task.get("worktree_path")
    if not own:
        return False
    return place.parent == Path(own).parent and re.fullmatch(re.escape(Path(own).name) + r"\.left" + n,
                                                            place.name) is not None


def _not_removable_leftover(task: dict[str, Any], path: str) -> str | None:
    """Why the folder at ``path`` (which exists) is not removed as ``task``'s leftover, or None."""
    if not leftover_place(task, path) or ".." in Path(path).parts:
        return f"{path}: not a place where TaskBridge sets {task['id']}'s worktree aside; left in place"
    if os.path.islink(os.path.dirname(path)):
        return f"{path}: the folder it is in is a link, which clear never follows; left in place"
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return f"{path}: {exc.strerror}; left in place"
    if not stat.S_ISDIR(mode):
        return f"{path}: not a folder (a link or a file), so not what TaskBridge set aside; left in place"
    if os.path.ismount(path) or (os.path.isdir(os.path.join(path, ".git"))
                                 and not os.path.islink(os.path.join(path, ".git"))):
        return f"{path}: a mount point or a repository of its own, not what TaskBridge set aside; left in place"
    return None


def clear_finished(older_than_sec: float = 0, statuses: Any = store.TERMINAL, remove_logs: bool = False,
                   remove_worktrees: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Remove finished tasks (``task_store.clear_finished``) and, when asked, their logs (with
    their OpenCode sessions, agent_box.forget_homes, but for one a task in the queue still holds)
    and worktrees (branches always stay). The folders set_aside moved their earlier worktrees to
    always go with them (``remove_leftovers``; one that cannot be removed keeps its task in the
    queue, named in the problems; one on another host is named there, with the command that
    removes it). A task whose worktree is still on disk stays in the queue
    unless ``remove_worktrees`` removes it first (the queue is what knows the worktree: a cleared
    task's worktree could never be found again), and so does one whose worktree could not be
    removed; the problem says what is left. A task whose worktree was kept on another machine
    (``lease_host`` is not this ``task_store.host_name()`` and its receipt does not say the
    worktree was removed) stays too, whatever ``remove_worktrees`` says: this disk cannot see or
    remove it (it may hold a commit that was never pushed). Returns (removed tasks,
    ``{"logs_removed": n, "worktrees_removed": [paths], "leftovers_removed": [paths], "kept_for_worktrees": [ids],
    "kept_on_hosts": {host: [ids]}, "kept_for_dependents": {id: [ids of the unfinished tasks that
    depend on it]}, "problems": [text]}``)."""
    only = []
    purged: dict[str, Any] = {"logs_removed": 0, "worktrees_removed": [], "leftovers_removed": [],
                              "kept_for_worktrees": [],
                              "kept_on_hosts": {}, "problems": [],
                              "kept_for_dependents": store.kept_for_dependents(older_than_sec, statuses)}
    here = store.host_name()
    finished = store.clear_finished(older_than_sec, statuses, dry_run=True)
    recorded = store.leftover_folders([task["id"] for task in finished])
    for task in finished:
        path = task.get("worktree_path")
        elsewhere = task.get("lease_host") and task["lease_host"] != here
        if path and elsewhere and not task.get("worktree_removed"):
            # Its worktree is on the worker's machine, not on this disk: only there can it be judged.
            purged["kept_on_hosts"].setdefault(task["lease_host"], []).append(task["id"])
            continue
        if path and os.path.lexists(path):
            if not remove_worktrees:
                purged["kept_for_worktrees"].append(task["id"])
                continue
            problem = remove_worktree_at(path)
            if problem:
                purged["problems"].append(f"{task['id']} stays in the queue: {problem}")
                continue
            purged["worktrees_removed"].append(path)
        if not _clear_leftovers(task, recorded.get(task["id"], []), purged):
            continue
        only.append(task["id"])
    removed = store.clear_finished(older_than_sec, statuses, only_ids=only) if only else []
    for task in removed:
        if remove_logs and Path(task["log"]).exists():
            Path(task["log"]).unlink()
            purged["logs_removed"] += 1
    if remove_logs and removed:
        import agent_box  # it imports this module
        agent_box.forget_homes({task["id"]: task["session_id"] for task in removed}, store.session_ids())
    return removed, purged


# --------------------------------------------------------------------------------------------
# The git guard: TaskBridge's own git never runs what a run planted in its configuration.
#
# Git runs programs named in configuration (filters, diff drivers, core.sshCommand, credential
# helpers, ...) under names the writer picks, so no list of keys can be neutralised with -c.
# Instead every file that configures our git for the workspace is pinned before the agent runs
# and put back byte for byte after it, before TaskBridge runs git there again.


class GitPlanted(Unrunnable):
    """A run changed a file that configures TaskBridge's git and the change could not be undone:
    the task stops before any further git command. The message names the file, the change and
    what to do."""


_PER_GIT_DIR = ("commondir", "gitdir", "config.worktree")
_PER_COMMON_DIR = ("config", "config.worktree", os.path.join("info", "attributes"),
                   os.path.join("info", "exclude"))
PLANTED_SHOWN = 400   # characters of what a run planted in one file, in the receipt


def pin_git_config(ws: Workspace) -> None:
    """Record in ``ws.git_pin`` the state (`_file_state`: bytes and mode, a link's target, or
    absence) of every file that configures TaskBridge's git for ``ws`` (see
    `git_config_files`). Call it before the agent runs; nothing is pinned without a repository
    (``ws.top`` None). Raises GitError / GitStopped."""
    ws.git_pin = {path: _file_state(path) for path in git_config_files(ws)} if ws.top else None
    ws.git_nested = nested_repositories(ws.top) if ws.top else None
    ws.top_id = _folder_id(ws.top) if ws.top else None


def _folder_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the folder at ``path`` itself (a link is not followed), or None when
    there is none."""
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino) if stat.S_ISDIR(found.st_mode) else None


def nested_repositories(top: str) -> set[str]:
    """Every ``.git`` (folder or pointer file) below ``top`` but its own, relative to it: the
    repositories inside the checkout. TaskBridge's git runs git in a nested repository that is
    staged as a gitlink, under that repository's own configuration, so one a run made is never
    left to it (see `undo_planted_git`). One walk, not descending into any ``.git``."""
    found = set()
    for folder, subdirs, files in os.walk(top):
        if ".git" in subdirs or ".git" in files:
            if folder != top:
                found.add(os.path.relpath(folder, top))
            with contextlib.suppress(ValueError):
                subdirs.remove(".git")
    return found


QUARANTINED_GIT = ".git-quarantined-by-taskbridge"


def quarantine_nested(top: str, made: list[str]) -> list[str]:
    """Rename the ``.git`` of each repository a run ``made`` inside ``top`` (relative folders) to
    QUARANTINED_GIT, so that git no longer finds a repository there; returns ``path: why`` for
    each that could not be renamed."""
    left = []
    for rel in made:
        dot = os.path.join(top, rel, ".git")
        try:
            os.rename(dot, _free_name(os.path.join(top, rel, QUARANTINED_GIT)))
        except OSError as exc:
            left.append(f"{dot}: {exc.strerror or exc}")
    return left


def _free_name(path: str) -> str:
    """``path``, or ``path.N`` for the first N not taken."""
    n, candidate = 1, path
    while os.path.lexists(candidate):
        candidate, n = f"{path}.{n}", n + 1
    return candidate


class FolderReplaced(GitPlanted):
    """The run renamed the task's folder away or put another in its place (a kept server's box
    may write the folder around the worktree): TaskBridge's git would run in a folder the agent
    made, or through a link to one of yours."""


class NestedRepository(GitPlanted):
    """The run made a git repository inside the checkout (its own ``.git``): TaskBridge's git would
    run git there under that repository's configuration, which the run wrote."""


def git_config_files(ws: Workspace) -> list[str]:
    """Absolute paths of the files git reads to configure TaskBridge's commands in ``ws.top``,
    present or not (a run may create one): the ``.git`` pointer (or folder) of the worktree; its
    git dir's ``commondir``, ``gitdir``, ``config.worktree``; the common dir's ``config``,
    ``config.worktree``, ``info/attributes``, ``info/exclude``; submodules' ``.git`` pointers and
    their git dirs' files; the user's and the system's config and attribute files; every file
    those name by ``include.path`` / ``includeIf.*.path``, ``core.attributesFile`` and
    ``core.excludesFile``. Read from the files as they are now: call it before the run. Raises
    GitError / GitStopped."""
    top = ws.top or ws.cwd
    git_dir = git(["rev-parse", "--absolute-git-dir"], top)
    common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], top)
    paths = [os.path.join(top, ".git"), *(os.path.join(git_dir, n) for n in _PER_GIT_DIR),
             *(os.path.join(common, n) for n in _PER_COMMON_DIR), *_user_git_files(),
             *_submodule_git_files(top, {git_dir, common})]
    for key in ("core.attributesFile", "core.excludesFile"):
        named = git(["config", "--path", "--get", key], top, check=False)
        if named:
            paths.append(os.path.join(top, os.path.expanduser(named)))
    return list(dict.fromkeys(os.path.normpath(p) for p in _with_includes(paths)))


def _user_git_files() -> list[str]:
    """The config and attribute files git reads outside the repository, as its env says."""
    xdg = str(knobs.xdg_home("XDG_CONFIG_HOME") / "git")
    files = [os.path.join(xdg, "attributes")]
    if not os.environ.get("GIT_CONFIG_NOSYSTEM"):
        files.append(os.environ.get("GIT_CONFIG_SYSTEM") or "/etc/gitconfig")
    files += [os.environ["GIT_CONFIG_GLOBAL"]] if os.environ.get("GIT_CONFIG_GLOBAL") else \
        [os.path.expanduser("~/.gitconfig"), os.path.join(xdg, "config")]
    return files


def _submodule_git_files(top: str, git_dirs: set[str]) -> list[str]:
    """Submodules' ``.git`` pointers (paths from ``.gitmodules``) and the config files of the
    submodule repositories kept under ``<git dir>/modules``: status and diff look inside them."""
    found = []
    if os.path.isfile(os.path.join(top, ".gitmodules")):
        listing = git(["config", "-f", ".gitmodules", "--get-regexp", r"^submodule\..*\.path$"], top, check=False)
        found += [os.path.join(top, line.partition(" ")[2], ".git") for line in listing.splitlines()]
    for base in git_dirs:
        for dirpath, dirnames, _ in os.walk(os.path.join(base, "modules")):
            dirnames[:] = [d for d in dirnames if d not in ("objects", "refs", "logs", "info", "hooks")]
            if os.path.isfile(os.path.join(dirpath, "HEAD")):   # a submodule's git dir
                found += [os.path.join(dirpath, n) for n in (*_PER_GIT_DIR, *_PER_COMMON_DIR)]
    return found


def _with_includes(paths: list[str], depth: int = 10) -> list[str]:
    """``paths`` and, recursively, the files their ``include.path`` / ``includeIf.*.path`` name
    (whatever the condition: a superset of what git reads), relative to the including file."""
    seen, queue = list(paths), list(paths)
    for _ in range(depth):
        named = []
        for path in queue:
            if not os.path.isfile(path):
                continue
            out = git(["config", "-f", path, "-z", "--get-regexp", r"^include(if\..*)?\.path$"],
                      os.path.dirname(path) or "/", check=False, strip=False)
            for item in filter(None, out.split("\0")):
                value = os.path.expanduser(item.partition("\n")[2])
                named.append(os.path.join(os.path.dirname(path), value))
        queue = [p for p in named if p not in seen]
        seen += queue
        if not queue:
            break
    return seen


def _file_state(path: str, follow: bool = True) -> tuple:
    """What git would read at ``path``: ``("absent",)``, ``("file", mode, bytes)``,
    ``("link", target, state of what it points to)``, ``("dir",)``, ``("other",)`` (a FIFO,
    socket or device) or ``("unreadable", why)``."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return ("absent",)
    except OSError as exc:
        return ("unreadable", exc.strerror)
    if stat.S_ISLNK(info.st_mode):
        inner = _file_state(os.path.realpath(path), follow=False) if follow else ("link",)
        return ("link", os.readlink(path), inner)
    if stat.S_ISDIR(info.st_mode):
        return ("dir",)
    if not stat.S_ISREG(info.st_mode):
        return ("other",)
    try:
        return ("file", stat.S_IMODE(info.st_mode), _read_guarded(path, info))
    except OSError as exc:
        return ("unreadable", exc.strerror)


def undo_planted_git(ws: Workspace) -> list[dict[str, Any]]:
    """After the run, before any further git command: compare every file `pin_git_config`
    pinned with its state now and put back each that changed (old bytes and mode written back,
    a file the run created removed, a link restored). Returns, and keeps in ``ws.git_planted``,
    one ``{"file", "change", "planted", "undone": True}`` per file put back (``planted``: what
    the run added, at most PLANTED_SHOWN characters). Raises GitPlanted, naming the file and the
    change, when one could not be put back (checked by reading it again)."""
    top = ws.top
    if top and ws.top_id is not None and _folder_id(top) != ws.top_id:
        raise FolderReplaced(
            f"the run replaced the task's folder {top} ({_what_is_at(top)} is there now, not the folder TaskBridge "
            "made): TaskBridge's own git would have run in a folder the agent made, so it ran no further git command "
            f"and committed nothing. What the agent left is in {os.path.dirname(top)}; look there, then retry the task")
    made = sorted(nested_repositories(top) - ws.git_nested) if top and ws.git_nested is not None else []
    if top and made:
        stuck = quarantine_nested(top, made)
        raise NestedRepository(
            f"the run made git repositories inside the checkout ({', '.join(made[:5])}): TaskBridge's own git "
            "would run git in them under configuration the run wrote, so it ran no further git command and "
            f"committed nothing; {top} is kept, and each one's .git was renamed {QUARANTINED_GIT} so that no "
            "later git (a task's on a folder inside, or yours) runs under it"
            + (f" (not renamed: {'; '.join(stuck[:5])})" if stuck else "")
            + ". Look at them, remove the folders (or rename .git back if one is yours), then retry the task")
    pinned = ws.git_pin or {}
    changed = {path: was for path, was in pinned.items() if _file_state(path) != was}
    found = [_describe(path, was, _file_state(path)) for path, was in changed.items()]
    problems = []
    for path, was in changed.items():
        try:
            _restore_state(path, was)
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
    left = [item for item in found if _file_state(item["file"]) != pinned[item["file"]]]
    if left:
        raise GitPlanted(_planted_message(ws, left, problems))
    ws.git_planted = found
    return found


def _what_is_at(path: str) -> str:
    """A few words on what ``path`` is now: nothing, a link (and its target), another folder, a file."""
    if os.path.islink(path):
        return f"a link to {os.readlink(path)}"
    return "another folder" if os.path.isdir(path) else "a file" if os.path.lexists(path) else "nothing"


def _describe(path: str, was: tuple, now: tuple) -> dict[str, Any]:
    """One planted change for the receipt: what kind of change, and what the run put there."""
    kinds = {"absent": "absent", "file": "a file", "link": "a link", "dir": "a folder",
             "other": "a special file", "unreadable": "unreadable"}
    if was[0] == "absent":
        change = f"created ({kinds[now[0]]})"
    elif now[0] == "absent":
        change = "removed"
    elif was[0] == now[0] == "file":
        change = "changed" if was[2] != now[2] else "mode changed"
    elif was[0] == now[0] == "link":
        change = "link retargeted" if was[1] != now[1] else "changed through its link"
    else:
        change = f"replaced ({kinds[was[0]]} before, {kinds[now[0]]} now)"
    return {"file": path, "change": change, "planted": _planted_text(was, now), "undone": True}


def _planted_text(was: tuple, now: tuple) -> str:
    """The lines the run added (a link: its new target), clipped to PLANTED_SHOWN characters."""
    def content(state: tuple) -> bytes:
        return state[2] if state[0] == "file" else content(state[2]) if state[0] == "link" else b""
    if now[0] == "link" and (was[0] != "link" or was[1] != now[1]):
        return f"a link to {now[1]}"
    old = set(content(was).decode("utf-8", "replace").splitlines())
    added = [line for line in content(now).decode("utf-8", "replace").splitlines() if line not in old]
    text = "\n".join(added)
    return text if len(text) <= PLANTED_SHOWN else text[:PLANTED_SHOWN] + "…"


def _restore_state(path: str, was: tuple) -> None:
    """Put ``path`` back to ``was`` (see `_file_state`). Raises OSError when it cannot: a
    folder or special file cannot be rebuilt from its pin, so one the run replaced stays changed."""
    now = _file_state(path, follow=False)
    if was[0] in ("dir", "other", "unreadable"):
        raise OSError(f"{was[0]} before the run; it cannot be rebuilt")
    if now[0] == "dir":
        problems = _force_rmtree(path)
        if problems:
            raise OSError("; ".join(problems[:3]))
    if was[0] == "absent":
        if os.path.lexists(path):
            os.unlink(path)
    elif was[0] == "link":
        if now[0] != "link" or now[1] != was[1]:
            _replace_with(path, lambda tmp: os.symlink(was[1], tmp))
        if _file_state(os.path.realpath(path), follow=False) != was[2]:
            _restore_state(os.path.realpath(path), was[2])
    else:
        _replace_with(path, lambda tmp: _write_file(tmp, was[2], was[1]))


def _replace_with(path: str, make: Callable[[str], None]) -> None:
    """Make the new entry beside ``path`` and rename it over whatever is there (a file or a
    link, never written through): git never reads a half-written config."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".taskbridge-{os.getpid()}-{os.path.basename(path)}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    make(tmp)
    os.replace(tmp, path)


def _write_file(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)


def _planted_message(ws: Workspace, left: list[dict[str, Any]], problems: list[str]) -> str:
    shown = "; ".join(f"{item['file']} {item['change']}" + (f" ({item['planted'][:120]!r})" if item["planted"] else "")
                      for item in left[:5])
    why = "; ".join(problems[:5]) or "it reads back changed"
    kept = f"the worktree {ws.top} is kept" if ws.mode == "worktree" else f"the changes stay in {ws.cwd}"
    return (f"the run changed the git configuration TaskBridge's own git reads: {shown}, and TaskBridge could "
            f"not undo it ({why}); no further git command was run, so nothing was committed and {kept}. "
            "Put the file back as it was (remove what the run added), then retry the task")


def git_guard_label(ws: Workspace) -> str:
    """The receipt's ``sandbox["git config"]``: what the git guard checked and what it undid."""
    if ws.git_pin is None:
        return "not a git repository: TaskBridge runs no git here"
    planted = ws.git_planted or []
    done = f"{len(planted)} change(s) the run made were undone, listed in git_planted" if planted else \
        "none had changed"
    return (f"enforced by TaskBridge after the run: the {len(ws.git_pin)} files that configure its own git here "
            f"(config, attributes, includes, the .git pointer) were compared with their bytes before the run "
            f"before it ran git again; {done}")


# --------------------------------------------------------------------------------------------
# Getting a task's work back into the user's checkout (`tasks_cli.py apply`, MCP `apply_task`).

APPLY_MODES = ("merge", "squash", "cherry-pick")
APPLY_BY_HAND = {"merge": ("merge",), "squash": ("merge", "--squash"), "cherry-pick": ("cherry-pick",)}   # + the work


class ApplyRefused(store.TaskStoreError):
    """A task's branch cannot be applied to its checkout; the message says why and what to do.
    ``conflicts`` lists the conflicting files when the merge conflicted (the checkout was restored)."""

    def __init__(self, message: str, conflicts: list[str] | None = None) -> None:
        super().__init__(message)
        self.conflicts = conflicts or []


def branch_info(task: dict[str, Any]) -> dict[str, Any]:
    """Where a task's work is: ``branch``, ``commit`` (the receipt's), ``tip`` (the branch's commit
    now, None when deleted), ``base_commit``, ``repo`` (the user's checkout, None when not a git
    repository), ``checkout_branch`` (what the checkout is on), ``has_commits`` (the branch has
    commits beyond its base), ``applied`` (it has, and its tip is already in the checkout's HEAD),
    ``worktree_path`` (a kept
    worktree that still exists, else None), ``checked_out_at`` (the worktree git says has the
    branch checked out, else None) and ``commands`` (git command lines to look at it, get to it —
    ``cd`` into the worktree that has it checked out, else switch to it or add a worktree for it —
    and for a done task apply it). A task on a remote has
    no checkout here: ``remote`` names where its branch was pushed (``pushed``: whether it was),
    ``repo`` is None and the commands fetch the branch from there into a clone of your own."""
    if task.get("repo"):
        return _remote_branch_info(task)
    repo = _repo_top_or_none(task["working_dir"]) if os.path.isdir(task["working_dir"]) else None
    branch, base = task.get("branch"), task.get("base_commit")
    tip = _branch_tip(repo, branch) if repo and branch else ""
    head = git(["rev-parse", "--verify", "-q", "HEAD"], repo, check=False) if repo else ""
    kept = task.get("worktree_path") if task.get("worktree_path") and os.path.isdir(task["worktree_path"]) else None
    commands: dict[str, str] = {}
    at = checked_out_at(repo, branch) if repo and branch and tip else None
    if repo and tip:
        sh = store.shell_command
        commands = {"log": sh("git", "-C", repo, "log", "-p", f"{base + '..' if base else ''}{branch}")}
        if at and os.path.isdir(at):   # git refuses a second checkout of it: switch and worktree add would fail
            commands["cd"] = sh("cd", at)
        else:   # a worktree git still lists though its folder is gone holds the branch until pruned
            commands |= {"prune": sh("git", "-C", repo, "worktree", "prune")} if at else {}
            commands |= {"switch": sh("git", "-C", repo, "switch", branch),
                         "worktree": sh("git", "-C", repo, "worktree", "add", f"../{Path(repo).name}-{task['id']}",
                                        branch)}
        if task["status"] == "done":   # apply takes a done task's work only
            commands["apply"] = store.script_command("tasks_cli.py", "apply", task["id"])
    return {"task_id": task["id"], "branch": branch, "commit": (task.get("result") or {}).get("commit"),
            "tip": tip or None, "base_commit": base, "repo": repo,
            "checkout_branch":
                git(["symbolic-ref", "-q", "--short", "HEAD"], repo, check=False) or None if repo else None,
            "has_commits": bool(tip and tip != base),
            "applied": bool(repo and tip and head and tip != base and _is_ancestor(repo, tip, head)),
            "worktree_path": kept, "checked_out_at": at, "commands": commands}


def checked_out_at(repo: str, branch: str) -> str | None:
    """The worktree of ``repo`` (the checkout itself or a linked one) that has ``branch`` checked
    out, as git's own list says (``git worktree list --porcelain``: a task's recorded path may be
    stale, and a person may have checked the branch out anywhere), or None. Its folder may be
    gone (git then lists it as prunable until ``git worktree prune``)."""
    for lines in _listed_worktrees(repo):
        if lines[0].startswith("worktree ") and f"branch refs/heads/{branch}" in lines[1:]:
            return lines[0][len("worktree "):]
    return None


def _listed_worktrees(repo: str) -> list[list[str]]:
    """``git worktree list --porcelain`` of ``repo``: each worktree's lines (the first is
    ``worktree <path>``); [] when git cannot say."""
    blocks = git(["worktree", "list", "--porcelain"], repo, check=False).split("\n\n")
    return [lines for block in blocks if (lines := block.strip().splitlines())]


def _remote_branch_info(task: dict[str, Any]) -> dict[str, Any]:
    branch, remote = task.get("pushed_branch") or task.get("branch"), task["repo"]
    kept = task.get("worktree_path") if task.get("worktree_path") and os.path.isdir(task["worktree_path"]) else None
    sh = store.shell_command
    commands = {"fetch": sh("git", "fetch", remote, branch), "log": "git log -p FETCH_HEAD",
                "switch": sh("git", "switch", "-c", branch, "FETCH_HEAD"), "merge": "git merge FETCH_HEAD"} \
        if task.get("pushed_branch") else {}
    return {"task_id": task["id"], "branch": branch, "commit": (task.get("result") or {}).get("commit"),
            "tip": task.get("pushed_commit"), "base_commit": task.get("base_commit"), "repo": None,
            "remote": remote, "pushed": bool(task.get("pushed_branch")), "checkout_branch": None,
            "has_commits": bool(task.get("pushed_commit") and task["pushed_commit"] != task.get("base_commit")),
            "applied": False, "worktree_path": kept, "checked_out_at": None, "commands": commands}


def remote_work(task: dict[str, Any]) -> str:
    """Where a task on a remote left its work, for a person at a shell: the branch pushed to the
    remote and how to fetch it into a clone of their own (there is no checkout of it here), or
    why nothing was pushed."""
    remote, branch = task["repo"], task.get("pushed_branch")
    if branch:
        return (f"task {task['id']} worked on the remote {remote}: its branch {branch} was pushed there "
                f"(commit {str(task.get('pushed_commit'))[:12]}), and there is no checkout of it on this machine. "
                f"In a clone of that repository: {store.shell_command('git', 'fetch', remote, branch)} "
                "&& git merge FETCH_HEAD "
                "(or open a pull request from the branch)")
    kept = f"; its worktree {task['worktree_path']} is kept" if task.get("worktree_path") else ""
    return (f"task {task['id']} works on the remote {remote} and has pushed no branch there yet "
            f"(it is {task['status']}{kept})")


def apply_branch(task: dict[str, Any], mode: str = "merge") -> dict[str, Any]:
    """Bring a done task's branch into the current branch of its user checkout: ``merge`` (a merge
    commit, or a fast-forward), ``squash`` (one new commit) or ``cherry-pick`` (the task's commits
    since its base, copied), up to the task's own commit: a follow-up that went on on the same
    branch is applied by applying the follow-up. Returns ``{"task_id", "mode", "status": "applied" |
    "already-applied" (the branch, or its changes from an earlier apply in another mode, were in
    HEAD: nothing changed), "branch", "tip" (the commit applied), "repo", "into" (the checkout's
    branch), "before", "head" (commits), "files" (paths changed by the apply), "later" (commits on
    the branch after ``tip``, left out: its follow-ups' work)}``.

    Raises ApplyRefused, the checkout untouched, when: the task is not done, has no branch or
    commit (ran in place, or changed nothing), its branch was deleted, the checkout is not a git
    repository, has a detached HEAD, is on the task's branch, is mid merge/rebase/cherry-pick, or
    has uncommitted changes to tracked files; and when git stops the apply (a conflict — the
    conflicting files are in ``conflicts`` — or untracked files in the way): the apply is aborted
    and HEAD, index and files are as they were. Raises store.ValidationError for an unknown mode.
    """
    if mode not in APPLY_MODES:
        raise store.ValidationError(f"mode {mode!r} is not one of {', '.join(APPLY_MODES)}")
    repo = _apply_target(task)[0]
    with _apply_lock(repo, task["id"]):
        repo, branch, tip, into = _apply_target(task)   # again: an apply before this one moved HEAD
        _refuse_unclean(repo, task["id"])
        before = git(["rev-parse", "HEAD"], repo)
        later = int(git(["rev-list", "--count", f"{tip}..refs/heads/{branch}"], repo, check=False) or 0)
        result = {"task_id": task["id"], "mode": mode, "branch": branch, "tip": tip, "repo": repo,
                  "into": into, "before": before, "later": later}
        if _is_ancestor(repo, tip, before):
            return result | {"status": "already-applied", "head": before, "files": []}
        try:
            _run_apply(repo, mode, task, branch, tip)
        except RuntimeError as exc:
            conflicts = git(["diff", "--name-only", "--diff-filter=U"], repo, check=False).splitlines()
            _undo_apply(repo, before)
            if not conflicts and any(said in str(exc) for said in ("nothing to commit", "is now empty")):
                # A squash or cherry-pick whose changes the checkout already holds (an earlier apply):
                # git stops with advice (commit --allow-empty, cherry-pick --skip) for a pick in
                # progress, but none is: the apply was undone and there is nothing to do.
                return result | {"status": "already-applied", "head": before, "files": []}
            raise ApplyRefused(_apply_failed(task, mode, repo, before, conflicts, exc, tip), conflicts) from None
        head = git(["rev-parse", "HEAD"], repo)
        files = git(["diff", "--name-only", "--no-renames", before, head], repo).splitlines()
        if not files:
            # The checkout held the task's changes already (applied before in another mode): the
            # merge made only an empty merge commit. Undone, as git's "nothing to commit" above.
            _undo_apply(repo, before)
            return result | {"status": "already-applied", "head": before, "files": []}
        return result | {"status": "applied", "head": head, "files": files}


APPLY_LOCK_WAIT_SEC = 60.0   # how long an apply waits for one under way into the same checkout


@contextlib.contextmanager
def _apply_lock(repo: str, ident: str) -> Iterator[None]:
    """One apply at a time into the checkout ``repo``, whatever process asks (each MCP server and
    CLI is one): an flock on ``<its git dir>/taskbridge-apply.lock``, waited for up to
    APPLY_LOCK_WAIT_SEC. Raises ApplyRefused when it cannot be made or stays held."""
    path = Path(git(["rev-parse", "--absolute-git-dir"], repo)) / "taskbridge-apply.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ApplyRefused(f"{repo}: the apply lock {path} cannot be made ({exc.strerror}); apply {ident} "
                           "as the checkout's owner, or with git (tasks_cli.py branch shows how)") from None
    try:
        held = store.flock_wait(fd, lambda: None, APPLY_LOCK_WAIT_SEC)
        if held:
            raise ApplyRefused(f"another apply into {repo} is under way ({path} {held}); apply {ident} again "
                               "once it has ended")
        yield
    finally:
        os.close(fd)   # closing the descriptor releases the flock


def no_change_note(task: dict[str, Any]) -> str | None:
    """For a done task whose run changed nothing: "no change, nothing to apply" and where its
    branch went (deleted when empty, or kept with its worktree); None for any other task."""
    result = given if isinstance(given := task.get("result"), dict) else {}
    if task["status"] != "done" or result.get("commit") or not result.get("no_change"):
        return None
    where = f"its empty branch {result['branch_deleted']} was deleted" if result.get("branch_deleted") else \
        f"nothing was committed on {task.get('branch')}" if task.get("branch") else \
        "it ran in place and changed no file there" if result.get("isolation") == "in-place" else "it left no branch"
    return f"task {task['id']} made no change, nothing to apply ({where})"


def no_branch_words(task: dict[str, Any]) -> str:
    """Why a task has no branch (its receipt says whether a worker ran it in place): "it ran in
    place ..., so its changes are already in its directory", "it was completed by hand ...", or
    it has not run on one yet."""
    result = given if isinstance(given := task.get("result"), dict) else {}
    if result.get("isolation") == "in-place":
        return ("it ran in place (worktree=false or not a git repository), so its changes are already in its "
                "directory")
    if result.get("branch_deleted"):
        return (f"it is {task['status']} and its attempt committed nothing, so its empty branch "
                f"{result['branch_deleted']} was deleted; nothing of it is on a branch")
    if task["status"] == "done":
        return "it was completed by hand (no worker ran it on a branch), so nothing of it is on one"
    return f"it is {task['status']} and has not run on one; its changes, if any, are in its directory"


def kept_work_words(task: dict[str, Any]) -> str | None:
    """For a task whose recorded worktree is still on disk (its worker was killed, or it was
    kept): where its agent's work, if any, is; None when there is no such folder. For the words on
    a task with no diff recorded. Told from the file system alone: no git command runs in what an
    agent left unattended (its worktree's own git folder could carry a filter)."""
    path = task.get("worktree_path")
    if not path or not os.path.isdir(path) or os.path.islink(path):
        return None
    return (f"its worktree {path} is still on disk as its run left it: what its agent changed and did not commit, "
            "if anything, is there")


def _apply_target(task: dict[str, Any]) -> tuple[str, str, str, str]:
    """(checkout, branch, the commit to apply up to, checkout's branch) or ApplyRefused naming what
    is missing. The commit is the branch's tip, or the task's own commit when follow-ups have
    gone on on its branch since (theirs are applied with them)."""
    ident, status = task["id"], task["status"]
    if status != "done":
        # In the MCP tools' words; the CLI puts its own commands in their place (tasks_cli.in_cli_words).
        hint = f"retry it (retry_task {ident}) and apply once it is done" if status in ("failed", "cancelled") \
            else f"wait until it is done (wait_for {ident})"
        raise ApplyRefused(f"task {ident} is {status}, not done; only a done task's work can be applied: {hint}")
    if task.get("repo"):
        raise ApplyRefused(remote_work(task))
    branch, commit = task.get("branch"), (task.get("result") or {}).get("commit")
    nothing = no_change_note(task)
    if not commit and nothing:
        raise ApplyRefused(nothing)
    if not branch:
        raise ApplyRefused(f"task {ident} has no branch: {no_branch_words(task)}")
    if not commit:
        raise ApplyRefused(f"task {ident} committed nothing on {branch} (it changed no files): nothing to apply")
    wd = task["working_dir"]
    try:
        repo = repo_top(wd) if os.path.isdir(wd) else None
    except Unrunnable as exc:
        raise ApplyRefused(f"task {ident}'s work is on branch {branch}, but {exc}") from None
    if not repo:
        raise ApplyRefused(f"{wd} is not a git repository (any more); task {ident}'s work is on branch {branch}")
    tip = _branch_tip(repo, branch)
    if not tip:
        raise ApplyRefused(f"branch {branch} of task {ident} no longer exists in {repo}; nothing to apply")
    if tip != commit and _is_ancestor(repo, commit, tip):   # its follow-ups went on on its branch: theirs to apply
        tip = commit
    into = git(["symbolic-ref", "-q", "--short", "HEAD"], repo, check=False)
    if not into:
        raise ApplyRefused(f"{repo} has a detached HEAD; check out the branch to apply to (git switch main) "
                           "and apply again")
    if into == branch:
        raise ApplyRefused(f"{repo} is on the task's own branch {branch}; switch to the branch to apply it to "
                           "and apply again")
    return repo, branch, tip, into


def _refuse_unclean(repo: str, ident: str) -> None:
    git_dir = Path(git(["rev-parse", "--absolute-git-dir"], repo))
    for name, what in (("MERGE_HEAD", "a merge"), ("CHERRY_PICK_HEAD", "a cherry-pick"), ("REVERT_HEAD", "a revert"),
                       ("rebase-merge", "a rebase"), ("rebase-apply", "a rebase or am")):
        if (git_dir / name).exists():
            raise ApplyRefused(f"{repo} is in the middle of {what}; finish or abort it first, then apply {ident} again")
    out = git(["status", "--porcelain", "-z", "--untracked-files=no"], repo, check=False, strip=False)
    dirty, entries = [], iter(out.split("\0"))
    for entry in entries:
        if entry:
            dirty.append(entry)
            if entry[0] in "RC":
                next(entries, None)  # a rename or copy is followed by its source path
    if dirty:
        shown = ", ".join(entry[3:] for entry in dirty[:10])
        shown += f" and {len(dirty) - 10} more" if len(dirty) > 10 else ""
        raise ApplyRefused(f"{repo} has uncommitted changes ({shown}); commit or stash them (git stash) "
                           f"and apply {ident} again")


def _identity(repo: str) -> list[str]:
    """The user's identity, with TaskBridge's filling a missing name or email (as commit_changes does)."""
    return [item for key, value in FALLBACK_IDENTITY.items()
            if not git(["config", "--get", key], repo, check=False) for item in ("-c", f"{key}={value}")]


def _run_apply(repo: str, mode: str, task: dict[str, Any], branch: str, tip: str) -> None:
    title = commit_text(task.get("title") or "")[:200]
    who = _identity(repo)
    if mode == "merge":
        git([*who, "merge", "--no-edit", "-m", f"Merge {branch}: {title} (TaskBridge {task['id']})", tip], repo)
    elif mode == "squash":
        git([*who, "merge", "--squash", tip], repo)
        git([*who, "commit", "-q", "--no-edit", "-m", f"{title} (TaskBridge {task['id']}, squashed from {branch})"],
            repo)
    else:
        git([*who, "cherry-pick", "--allow-empty", _picks(repo, task, tip)], repo)


def _picks(repo: str, task: dict[str, Any], tip: str) -> str:
    """What a cherry-pick of ``task`` up to ``tip`` copies: its commits since its base (``base..tip``)."""
    base = task.get("base_commit")
    return f"{base}..{tip}" if base and _is_ancestor(repo, base, tip) else tip


def _undo_apply(repo: str, before: str) -> None:
    """Put the checkout back as it was before a failed apply (HEAD, index, tracked files)."""
    git_dir = Path(git(["rev-parse", "--absolute-git-dir"], repo))
    if (git_dir / "CHERRY_PICK_HEAD").exists() or (git_dir / "sequencer").exists():
        git(["cherry-pick", "--abort"], repo, check=False)
    if (git_dir / "MERGE_HEAD").exists():
        git(["merge", "--abort"], repo, check=False)
    # A squash leaves no MERGE_HEAD; and a cherry-pick of several commits may have made some.
    git(["reset", "-q", "--merge", before], repo, check=False)


def _apply_failed(task: dict[str, Any], mode: str, repo: str, before: str, conflicts: list[str],  # noqa: PLR0913
                  exc: Exception, tip: str) -> str:
    restored = git(["rev-parse", "HEAD"], repo, check=False) == before and not \
        git(["status", "--porcelain", "--untracked-files=no"], repo, check=False)
    state = (f"the checkout is as it was (HEAD {before[:12]})" if restored else
             f"the checkout could NOT be fully restored: check `{store.shell_command('git', '-C', repo, 'status')}` "
             f"(HEAD was {before[:12]})")
    what = _picks(repo, task, tip) if mode == "cherry-pick" else tip   # the task's own work, as apply takes it
    if conflicts:
        shown = ", ".join(conflicts[:20]) + (f" and {len(conflicts) - 20} more" if len(conflicts) > 20 else "")
        return (f"applying task {task['id']} ({mode} of {task['branch']}) conflicts in {shown}; {state}. "
                f"Resolve it by hand ({store.shell_command('git', '-C', repo, *APPLY_BY_HAND[mode], what)}) "
                f"or submit a follow-up (continue_from {task['id']}) that merges the current code into "
                f"{task['branch']} and resolves the conflict, then apply that follow-up")
    reason = str(exc).split("failed: ", 1)[-1].strip().replace("\n", " ")[:500]
    return f"git refused to apply task {task['id']} ({mode} of {task['branch']}): {reason}; {state}"


def diff_stat(diff: str) -> dict[str, Any]:
    """Per file of a git diff text: ``{"files": [{"path", "added", "removed", "binary"}],
    "added", "removed"}`` (lines; a binary file counts none)."""
    files: list[dict[str, Any]] = []
    in_hunk = False
    for line in (diff or "").splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1] if " b/" in line else line[len("diff --git "):]
            files.append({"path": path, "added": 0, "removed": 0, "binary": False})
            in_hunk = False
        elif not files:
            continue
        elif line.startswith("@@"):
            in_hunk = True
        elif not in_hunk:
            files[-1]["binary"] |= line.startswith(("Binary files ", "GIT binary patch"))
        elif line.startswith("+"):
            files[-1]["added"] += 1
        elif line.startswith("-"):
            files[-1]["removed"] += 1
    return {"files": files, "added": sum(f["added"] for f in files), "removed": sum(f["removed"] for f in files)}
