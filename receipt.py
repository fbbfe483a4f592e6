"""The receipt: what one attempt of a task did, as the worker stores it in the task's ``result``.

Used by ``worker.py`` only: ``build`` makes an attempt's receipt from what was observed, and the
worker's later steps (revert check, commit, push, worktree removal, a pause, a failed bookkeeping
step) set the fields that depend on how the attempt ended. ``Receipt.to_json`` is the dict stored;
its readers (task_views.py, the MCP tools, the board, the CLI) read plain JSON and never this
module. Env: none.

Where each field comes from: **git** (the worktree, its branch and diff), **stream** (OpenCode's
event stream: ``opencode_runner.EventStream``), **block** (the fenced JSON block that ends the
agent's final message: the agent's word, not checked), **queue** (the task's row), **worker**
(what the worker itself saw or did).

A field is either ``always`` (every receipt ``build`` makes has it) or ``sometimes`` (set only on
some outcomes; left ``UNSET`` it is absent from the JSON, as it always was). Receipts made without
``build`` (a commit recovered after the worker stopped, a bookkeeping failure before the receipt
could be built) carry only the fields they set.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import agent_box
import task_store as store
import worktrees

# Characters of receipt texts; the whole text stays in the task's log (the raw event stream).
SUMMARY_MAX = store.SUMMARY_MAX   # a hand completion's summary has the same limit (tasks_cli complete)
ITEM_MAX = 2_000              # one open question, test command, claimed file
ITEMS_MAX = 100               # items of each list


class _Unset:
    """A field not set on this receipt: absent from its JSON (falsy, so ``if receipt.commit`` reads
    as ``receipt.get("commit")`` did)."""
    _one: _Unset | None = None

    def __new__(cls) -> _Unset:
        cls._one = cls._one or super().__new__(cls)
        return cls._one

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def always() -> Any:
    """A field every built receipt has."""
    return field(default=UNSET, metadata={"always": True})


def sometimes() -> Any:
    """A field set only on some outcomes (absent from the JSON otherwise)."""
    return field(default=UNSET, metadata={"always": False})


@dataclass(slots=True)
class Receipt:
    """One attempt's receipt. Field comments: type, unit, meaning, source. Setting a name not
    declared here raises AttributeError (slots): the definition cannot drift from the writes."""

    # -- always: what build() fills from the run ---------------------------------------------
    summary: str = always()             # block: the agent's summary (or its question), clipped at SUMMARY_MAX chars
    block_found: bool = always()        # block: whether the final message ended with a fenced JSON/question block
    files_touched: list[str] = always()   # git: paths changed in the worktree (untracked included); in place
    #                                       without git: what differs in the folder after the run (relative to
    #                                       it), or for a folder too large to list, stream: the write/edit tools'
    #                                       completed paths, relative to it
    files_claimed: list[str] = always()   # block: files_touched as the agent claims it (clipped items)
    files_reverted: list[str] = always()  # worker: readonly runs, the paths whose writes were reverted
    commands: list[dict[str, Any]] = always()   # stream: the bash tool's commands, as EventStream.commands
    tool_calls: int = always()          # stream: how many tool calls the run made
    tool_errors: list[dict[str, Any]] = always()   # stream: calls that ended error/denied: {tool, status, error}
    tests_run: list[str] = always()     # block: test commands the agent says it ran (clipped items)
    open_questions: list[str] = always()   # block: what the agent left open (clipped items)
    usage: dict[str, Any] = always()    # stream: {tokens: {input, output, reasoning, cache_read, cache_write,
    #                                     total}, cost_usd (USD, OpenCode's figure), steps (model calls)}
    model: str = always()               # worker: "provider/model" the attempt ran with
    latency_sec: float = always()       # worker: seconds the `opencode run` took (wall clock, 0.01 s)
    attempt: int = always()             # queue: this attempt's number (1 for the first)
    max_retries: int = always()         # queue: the task's retry allowance
    sandbox: dict[str, str] = always()  # worker: per rule what enforced it ({isolation, permission, box,
    #                                     environment, files, …, git config, rules?, shell writes?}); words
    git_planted: list[dict[str, Any]] = always()   # git: git config the run planted and the worker undid:
    #                                                {file, change}
    isolation: str = always()           # git: the workspace mode, "worktree" or "in-place"
    branch: str | None = always()       # git: the task branch (None in place, or once an empty one is deleted)
    repo: str | None = always()         # queue: the git remote the task names (None: a local repository)
    mirror: dict[str, Any] | None = always()   # git: a remote task's local mirror {path, cloned}; else None
    base_commit: str | None = always()  # git: the commit the worktree started from
    base_from: str | None = always()    # git: why that base ("earlier attempt", a dependency's commit …), or None
    submodules: dict[str, Any] | None = always()   # git: see worktrees.init_submodules; None: the repo has none
    worktree_path: str | None = always()   # git: the worktree's folder (None in place)
    session_id: str | None = always()   # stream: the OpenCode session (an answer resumes it)
    session: str = always()             # worker: how the session came about ("new session", "resumed …")
    exit_code: int | None = always()    # worker: OpenCode's exit code (None: never started or not reaped)
    agent_exited: bool = always()       # worker: False when the worker ended it after its terminal event
    non_json_lines: int = always()      # stream: stdout lines that were not events (or too long to parse)
    replies_not_believed: list[str] = always()   # worker: plugin replies set aside, each with why (≤ 20)
    ended_with_run: list[dict[str, Any]] = always()   # worker: processes still running at the end and ended
    #                                                   with it: {pid, command, ports}
    mcp_servers_unavailable: list[dict[str, Any]] = always()   # stderr: MCP servers OpenCode gave up on:
    #                                                            {server, type, status, after_sec (s)}
    notes: list[dict[str, Any]] = always()   # queue: the planner's notes {author, text, delivered_at, delivered_how}
    questions: list[dict[str, Any]] = always()   # queue: the task's questions and answers so far
    permission_asks: list[dict[str, Any]] = always()   # queue: permission asks decided {tool, subject, reason,
    #                                                    decision}, carried from receipt to receipt
    limit_pauses: list[dict[str, Any]] = always()   # queue: the task's usage-limit pauses so far

    # -- sometimes: set by the worker's later steps, by outcome ------------------------------
    not_reverted: list[str] = sometimes()   # worker: readonly, "path: why" for writes that could not be reverted
    uncommitted_before: list[str] = sometimes()   # git: in place in a checkout, the paths already uncommitted
    #                                               when the attempt began (files_touched and the diff count from there)
    changed_outside_worktree: list[str] = sometimes()   # git: paths of your checkout changed during the run
    #                                                     (worktree runs on a local repo; else [])
    repo_config: dict[str, Any] = sometimes()   # worker: the project's OpenCode config files {files,
    #                                             restrictions, housekeeping_undone} (relative paths)
    diff_error: str = sometimes()       # git: why the diff could not be read (a failed or interrupted run)
    limit: dict[str, Any] = sometimes()   # stream/log: a provider usage-limit pause {provider, said,
    #                                       reset_at (ISO), seen_in ("retry", "log", "error")}
    commit: str | None = sometimes()    # git: the commit made on the task branch (None: nothing changed)
    no_change: bool = sometimes()       # git: a run that changed nothing (a worktree's: nothing committed; in
    #                                     place: git, or outside git the folder's listing, saw no file change)
    line: dict[str, Any] = sometimes()  # git: a follow-up's or fork's whole line of work {continues,
    #                                     forked_from, base, files, diff, …} (worktrees.line_of_work)
    pushed_branch: str | None = sometimes()   # git: the branch pushed to the remote (None: nothing pushed)
    pushed_commit: str | None = sometimes()   # git: the commit pushed (None: nothing pushed)
    pushed: str = sometimes()           # worker: the push in words
    pushed_again: str = sometimes()     # worker: a retry pushed an earlier attempt's kept commit, in words
    worktree_removed: bool = sometimes()   # worker: the worktree's folder is really gone
    worktree_left: str = sometimes()    # worker: what is left of the worktree and why
    branch_deleted: str = sometimes()   # git: the empty task branch deleted (branch is then None)
    bookkeeping_error: str = sometimes()   # worker: the step after the agent that failed, and the way on
    worktree_kept: bool = sometimes()   # worker: after a bookkeeping error, the worktree is kept for you
    recovered: str = sometimes()        # git: recorded from a commit an attempt made before its worker stopped
    leftover_saved: str = sometimes()   # worker: where the worktree an earlier attempt left (its uncommitted work
    #                                     included) was moved before this attempt made it anew (worktrees.set_aside)

    # Keys of a stored receipt this type does not name (an older worker's): kept as they were.
    extra: dict[str, Any] = field(default_factory=dict, metadata={"always": None})

    def to_json(self) -> dict[str, Any]:
        """The dict stored as the task's ``result``: the fields set, in declared order, then ``extra``."""
        out = {f.name: getattr(self, f.name) for f in _FIELDS if getattr(self, f.name) is not UNSET}
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Receipt:
        """A stored receipt (a task's ``result``) back as a Receipt; unknown keys go to ``extra``."""
        known = {k: v for k, v in data.items() if k in _NAMES}
        return cls(**known, extra={k: v for k, v in data.items() if k not in _NAMES})

    def get(self, name: str, default: Any = None) -> Any:
        """``name``'s value, or ``default`` when it is not set (as ``dict.get`` on the JSON)."""
        value = getattr(self, name)
        return default if value is UNSET else value

    def unset(self, name: str) -> None:
        """Take ``name`` out of the receipt (absent from its JSON again)."""
        setattr(self, name, UNSET)

    def update(self, **values: Any) -> None:
        """Set several fields; a name the type does not declare raises AttributeError."""
        for name, value in values.items():
            if name not in _NAMES:
                raise AttributeError(f"Receipt has no field {name!r}")
            setattr(self, name, value)


_FIELDS = tuple(f for f in dataclasses.fields(Receipt) if f.name != "extra")
_NAMES = frozenset(f.name for f in _FIELDS)
ALWAYS = tuple(f.name for f in _FIELDS if f.metadata["always"])        # every built receipt's keys
SOMETIMES = tuple(f.name for f in _FIELDS if not f.metadata["always"])  # keys set by outcome


def clip_items(items: list[str], where: str) -> list[str]:
    """At most ITEMS_MAX items of at most ITEM_MAX characters each; a last item says what was cut."""
    kept = [store.clip(item, ITEM_MAX, where) for item in items[:ITEMS_MAX]]
    if len(items) > ITEMS_MAX:
        kept.append(f"… [{len(items) - ITEMS_MAX:,} more items; all are in {where}]")
    return kept


def permission_asks(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The permission asks the planner decided over the task's attempts, each ``{tool, subject,
    reason, decision}`` (``deny once`` …): a refused call never reaches the event stream, so
    this is its only trace in the receipt. Carried over from the previous attempt's receipt."""
    result = task.get("result")
    asks = list((result.get("permission_asks") if isinstance(result, dict) else None) or [])
    ask = task.get("pending_ask") or {}
    if ask.get("decision"):
        record = {key: ask.get(key) for key in ("tool", "subject", "reason", "decision")}
        if record not in asks:
            asks.append(record)
    return asks


def sandbox_labels(task: dict[str, Any], ws: worktrees.Workspace, box: agent_box.Support) -> dict[str, str]:
    """The receipt's ``sandbox``: the isolation, the permission, what enforced each rule (words)."""
    isolation = ws.note or (f"git worktree on {ws.branch}; " + (
        f"{box.mechanism} lets the agent write only there" if box.mechanism else
        "writes outside it are not prevented (no box): changes to your checkout are listed in "
        "changed_outside_worktree"))
    sandbox = {"isolation": isolation, "permission": task["permission"],
               **agent_box.labels(task["permission"], box, ws), "git config": worktrees.git_guard_label(ws) + (
                   f"; {box.mechanism} kept the rest (the repository's config, hooks, info/, the .git pointer, your "
                   "own git config) read-only to the run" if box.mechanism and ws.git_pin is not None else "")}
    if task.get("rules"):
        sandbox["rules"] = ("enforced by TaskBridge's OpenCode plugin before each tool call (main agent and "
                            "sub-agents): deny refuses the call, ask pauses the task for the planner; "
                            "the preset's own rules still apply")
    return sandbox


def _workspace_fields(ws: worktrees.Workspace) -> dict[str, Any]:
    """The receipt's fields that git's workspace gives (isolation, branch, base, remote …)."""
    return {"git_planted": ws.git_planted or [], "isolation": ws.mode, "branch": ws.branch, "repo": ws.remote,
            "mirror": {"path": ws.repo, "cloned": ws.mirror_cloned} if ws.remote else None,
            "base_commit": ws.base_commit, "base_from": ws.base_from or None, "submodules": ws.submodules,
            "worktree_path": ws.top if ws.mode == "worktree" else None}


def whole_text_at(task: dict[str, Any], run: Any) -> str:
    """Where a receipt text clipped from the agent's final message can be read whole: the task's
    log, with the final message's size when it was longer than what was kept."""
    size = run.stream.final_text_chars
    return f"the task's log, {store.task_log_location(task['id'])}" + (
        f" (the agent's final message has {size:,} characters)" if size > len(run.stream.final_text) else "")


def build(task: dict[str, Any], current: dict[str, Any], ws: worktrees.Workspace, run: Any, model: str,
          block: dict[str, Any], git_seen: tuple[list[str], list[str]], session_note: str) -> Receipt:
    """The receipt of one finished run (every ``always`` field set): what git and the event stream
    showed, beside what the agent says. ``task``: the task as claimed; ``current``: as it is now
    (its notes and questions); ``run``: the worker's RunResult; ``block``: the parsed closing
    block (``opencode_runner.parse_closing_block``); ``git_seen``: (the changed paths git saw,
    the paths reverted for readonly)."""
    files, reverted = git_seen
    where = whole_text_at(task, run)
    stream = run.stream
    if ws.mode == "in-place" and not ws.top and ws.start_listing is None:   # too large to compare: the tools' word
        files = sorted({os.path.relpath(os.path.join(ws.cwd, path), ws.cwd) for c in stream.tool_calls
                        if c["tool"] in ("write", "edit") and c["status"] == "completed"
                        and (path := c["input"].get("filePath"))})
    box = run.box or agent_box.Support(None, reason="the run did not start")
    denied = [c for c in stream.tool_calls if c["status"] in ("error", "denied")]
    return Receipt(
        summary=store.clip(block.get("summary") or block.get("question") or "", SUMMARY_MAX, where),
        block_found=block.get("block_found", block["kind"] == "question"),
        files_touched=files,
        files_claimed=clip_items(block.get("files_touched", []), where),
        files_reverted=reverted,
        commands=stream.commands,
        tool_calls=len(stream.tool_calls),
        tool_errors=[{"tool": c["tool"], "status": c["status"], "error": c.get("error")} for c in denied],
        tests_run=clip_items(block.get("tests_run", []), where),
        open_questions=clip_items(block.get("open_questions", []), where),
        usage=stream.usage(),
        model=model,
        latency_sec=run.seconds,
        attempt=task["attempts"],
        max_retries=task["max_retries"],
        sandbox=sandbox_labels(task, ws, box),
        **_workspace_fields(ws),
        session_id=stream.session_id,
        session=session_note,
        exit_code=run.returncode,
        agent_exited=run.agent_exited,
        non_json_lines=stream.bad_lines,
        replies_not_believed=run.not_believed,
        ended_with_run=run.ended,
        mcp_servers_unavailable=run.mcp_down,
        notes=[{"author": n["author"], "text": n["text"], "delivered_at": n["delivered_at"],
                "delivered_how": n["delivered_how"]} for n in current["notes"]],
        questions=current["questions"],
        permission_asks=permission_asks(task),
        limit_pauses=current.get("limit_pauses") or [],
    )
