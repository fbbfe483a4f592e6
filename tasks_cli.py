"""TaskBridge's command line for people: submit, inspect, claim by hand, answer, cancel, clear.

Run it as ``.venv/bin/python tasks_cli.py COMMAND ...`` from the checkout (``.venv/bin/python tasks_cli.py -h``
lists the commands; ./install.sh makes the ``.venv``).
Tables are for people; ``--json`` on the listing commands prints plain JSON for scripts. Errors go
to stderr: exit 1 when the queue refuses (unknown task, wrong status), exit 2 for a bad option.
Task ids are accepted as ``t_0001``, ``0001`` or ``1``.

Env read at call time: ``TASK_DB_URL`` (also ``--db``: a postgresql:// URL or a SQLite file), ``TASK_DB_PATH``,
``TASK_LOG_DIR`` (the per-task logs),
``USER`` (the default name of a person who claims, notes or answers: ``cli:$USER``).

Every read and write goes through ``task_store``; this file holds no SQL.
"""
from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

import knobs
import opencode_runner
import os_faults
import task_spec
import task_store
import task_views
import worktrees

__version__ = "0.1.0"

ORIGIN_NAME = "tasks_cli"
FOLLOW_POLL_SEC = 0.5  # how often `logs --follow` looks for new lines and the task's status
FINISHED = set(task_store.TERMINAL)
OLDER_THAN_MAX_SEC = 100 * 365 * 86_400  # `clear --older-than`: a century is the most that means anything
PAGE_OFFSET_MAX = 10**9  # task_store.list_tasks refuses a larger offset
TAIL_MAX = 10**9  # `logs --tail`: more lines than any log holds


# --------------------------------------------------------------------------------------------
# Consoles and errors: the store's errors become click errors here and nowhere else.


def out() -> Console:
    """The stdout console for tables (made at call time so tests and pipes get the current stream)."""
    return Console(highlight=False, soft_wrap=False)


def err() -> Console:
    """The stderr console for errors and hints."""
    return Console(stderr=True, highlight=False)


class CliError(click.ClickException):
    """A refusal shown to the person on stderr (exit 1); the message names the way out."""

    def show(self, file: Any = None) -> None:  # noqa: ARG002  (click's ClickException.show signature; always stderr)
        # Store messages may quote task text (titles, owners), so they are made visible too.
        err().print(Text(f"Error: {visible(self.format_message())}", style="red"), soft_wrap=True)


class CliUsageError(CliError):
    """A refusal of a bad option value shown like CliError, but exit 2 as click's own bad options."""

    exit_code = 2


# The store's messages name the MCP tools as the way out; a person at the shell needs the commands.
# Every hint names the command as the README runs it (task_store.script_command); cli_command()
# and worker_command() also name a --db given (parsed after import, so asked at each hint).
CLI = task_store.script_command("tasks_cli.py")


def cli_command() -> str:
    """This CLI's command line for a hint, with the ``--db`` it was given."""
    return task_store.script_command("tasks_cli.py")


def worker_command() -> str:
    """worker.py's command line for a hint, with the ``--db`` this CLI was given."""
    return task_store.script_command("worker.py")


def cli_words() -> dict[str, str]:
    """The MCP tool names in the store's messages -> the CLI commands a person runs instead."""
    cli_ = cli_command()
    return {"list_tasks": f"`{cli_} list`", "add_task_note": f"`{cli_} note`", "answer_task": f"`{cli_} answer`",
            "cancel_task": f"`{cli_} cancel`", "retry_task": f"`{cli_} retry`", "TASK_DB_PATH": "--db / TASK_DB_PATH",
            "continue_from": "--continue", "fork_from": "--fork", "wait_for": f"`{cli_} logs --follow`"}


def in_cli_words(message: str) -> str:
    """A store message with MCP tool names replaced by the matching CLI commands (and the
    environment's TASK_DB_PATH by the CLI's --db beside it)."""
    words = cli_words()

    def command(match: re.Match[str]) -> str:   # "retry_task t_0003": the id inside the command's quotes
        said, task = words[match.group(1)], match.group(2) or ""
        return f"{said[:-1]}{task}`" if task and said.endswith("`") else said + task
    return re.sub(r"\b({})\b( t_\d+)?".format("|".join(words)), command, message)


# The commands that may make a new queue (they write to it). Every other command reads or changes
# an existing queue and refuses a path where none is: a mistyped --db must not grow a new one.
MAKES_QUEUE = {"submit", "budget set"}
# Commands that work without a queue (doctor reports a missing one; connect never opens it).
NO_QUEUE_NEEDED = {"doctor", "connect", "models"}


def queue_missing_error() -> CliError:
    path = task_store.db_path()
    went = task_store.queue_left_in_use()
    if went:
        return CliError(f"the queue {path} is in no state to open: {went}. Put its file back there (with its -wal "
                        "and -shm if they went with it) and that worker carries on. To use a new or another file "
                        "there, stop that worker first (and move the old file's -wal and -shm, if they are beside "
                        "the path, next to the old file: another file opened with them is corrupted). Nothing was "
                        "opened or made")
    return CliError(f"no queue at {path}: check --db / TASK_DB_PATH (a typo?); `{cli_command()} submit` "
                    "makes a new queue there, as do serve.py and the worker (not from its --db)")


class QueueCommand(click.Command):
    """A command that refuses to run on a queue that does not exist, unless it may make one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:   # click's hint for it was "Did you mean '--dir'?"
            if exc.option_name.split("=", 1)[0] != "--db":
                raise
            raise click.UsageError(f"--db goes before the command: {CLI} --db FILE_OR_URL "
                                   f"{ctx.info_name} ...", ctx) from None

    def invoke(self, ctx: click.Context) -> Any:
        name = ctx.command_path.removeprefix(ctx.find_root().info_name or "").strip()   # "budget set"
        bad = not_utf8_param(ctx)
        if bad:
            raise bad
        missing = task_store.backend() == "sqlite" and not task_store.db_path().exists()
        if name not in NO_QUEUE_NEEDED and task_store.queue_left_in_use():   # a worker waits for its file there
            raise queue_missing_error()
        if missing and name not in MAKES_QUEUE | NO_QUEUE_NEEDED:   # a PostgreSQL queue is made by its first use
            raise queue_missing_error()
        done = super().invoke(ctx)
        if missing and name in MAKES_QUEUE and task_store.db_path().exists():
            err().print(Text(f"made a new queue at {task_store.db_path()}: a worker runs its tasks only when started "
                             f"with the same --db / TASK_DB_PATH (a typo? `{cli_command()} status` there says whether "
                             "a worker serves it)", style="yellow"), soft_wrap=True)
        return done


class TaskGroup(click.Group):
    """The command group; translates store and database errors into clear messages (no traceback)."""

    command_class = QueueCommand

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except task_store.QueueGone as exc:   # mid-command (logs --follow): "this process carries on" is not this one's
            if isinstance(exc, task_store.QueueReplaced):
                raise CliError(in_cli_words(str(exc))) from None
            went = task_store.queue_left_in_use()
            raise CliError(f"the queue {task_store.db_path()} went away while this command used it ("
                           f"{went or 'deleted or moved away'}): put the file back there and run the command "
                           "again") from None
        except task_store.TaskStoreError as exc:   # its message names the queue and the way out
            raise CliError(in_cli_words(str(exc))) from None
        except knobs.KnobError as exc:
            raise CliError(str(exc)) from None
        except OSError as exc:   # the same line the worker and the MCP server give (os_faults)
            raise CliError(str(os_faults.describe(exc) or exc)) from None


def emit_json(value: Any) -> None:
    """Print ``value`` as indented JSON on stdout (for scripts); it decodes to the exact stored text.

    json.dumps escapes C0 controls itself but, with ensure_ascii off, leaves DEL, C1 (0x9b is a
    one-byte CSI) and the bidi overrides raw; they can only sit inside strings, so they become
    ``\\uXXXX`` escapes there and the JSON stays exact and terminal-safe.
    """
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    click.echo(CONTROL_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


def person(name: str | None = None) -> str:
    """The lease owner / author name of a person: ``cli:NAME``, default ``cli:$USER``."""
    if not name:
        name = os.environ.get("USER") or _login_name()
    return name if name.startswith("cli:") else f"cli:{name}"


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "person"


# --------------------------------------------------------------------------------------------
# Terminal safety: task text comes from planners, agents and repositories, so it never reaches the
# terminal raw. An ESC in a title could otherwise clear the screen or retitle the window (OSC).

# The characters and their escapes live in task_views (the worker's lines use them too).
CONTROL_RE, CONTROL_OR_BREAK_RE = task_views.CONTROL_RE, task_views.CONTROL_OR_BREAK_RE
escape_char = task_views.escape_char


def visible(value: Any, *, multiline: bool = True) -> str:
    """``value`` as text that is safe to print on a terminal.

    Every C0/C1 control character, DEL and the bidi overrides become visible escapes (ESC is
    shown as ``\\x1b``), so the text cannot move the cursor, clear the screen, retitle the window
    or reorder itself. With ``multiline`` newline and tab stay (instructions, notes, errors); for
    one-line fields (titles, names, paths) they are escaped too (CRLF in multi-line text is read
    as a line break). The stored text is unchanged;
    ``--json`` prints it exactly.
    """
    text = "" if value is None else str(value)
    if multiline:
        return CONTROL_RE.sub(escape_char, text.replace("\r\n", "\n"))
    return CONTROL_OR_BREAK_RE.sub(escape_char, text)


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (``logs`` and ``show --diff`` print exactly into pipes)."""
    return sys.stdout.isatty()


def raw_or_visible(text: str) -> str:
    """Log and diff text: exact when piped or redirected, control characters made visible on a
    terminal (the way ``ls`` hides them only on a terminal)."""
    return visible(text) if stdout_is_terminal() else text


# --------------------------------------------------------------------------------------------
# Option callbacks: a bad value is a click.BadParameter (exit 2) before anything is written.


def task_id_arg(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
    """Parse ``t_0001`` / ``0001`` / ``1`` (or a tuple of them) to ``t_0001`` form."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(task_id_arg(_ctx, _param, v) for v in value)
    try:
        return task_store.format_task_id(task_store.parse_task_id(value))
    except task_store.ValidationError as exc:
        raise click.BadParameter(str(exc)) from None


def working_dir_arg(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """An existing directory as an absolute path; a relative one (``.``, ``../app``) is taken from
    the current directory. None when ``--dir`` was not given (submit then asks about the cwd)."""
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))
    try:
        return task_store.validate_working_dir(path)
    except task_store.ValidationError as exc:
        hint = "; create it first or point --dir at the project folder" if "does not exist" in str(exc) else ""
        raise click.BadParameter(f"{exc}{hint}") from None


def default_working_dir(yes: bool) -> str:
    """The current directory as the task's folder when ``--dir`` is omitted. Outside a git
    repository the agent would work in place (no worktree, no branch), so a person confirms it
    (``--yes`` skips the question; without a terminal to ask on it is refused)."""
    cwd = os.getcwd()
    if _has_surrogates(cwd):
        raise CliError(f"the current folder {cwd.encode('utf-8', 'surrogateescape')!r} has a name that is not "
                       "UTF-8, which the queue cannot store; pass --dir with a UTF-8 path, or rename the folder")
    if yes or worktrees.git(["rev-parse", "--show-toplevel"], cwd, check=False):
        return cwd
    question = (f"{cwd} is not a git repository: the agent would change files in place there "
                "(no worktree, no branch). Queue it anyway?")
    if not sys.stdin.isatty():
        raise CliError(f"{cwd} is not a git repository, so the agent would change files in place; "
                       "pass --dir PATH for the project, or --yes to run here")
    click.confirm(question, abort=True, err=True)
    return cwd


def checked_model(model: str | None) -> str | None:
    """A model given at submit, checked against ``opencode models`` (cached for a minute beside
    the database): an unknown one is refused (exit 2) naming the closest ids. When OpenCode
    cannot be asked the model is queued unchecked, with a warning on stderr."""
    if model is None:
        return None
    try:
        models = opencode_runner.known_models(cache_file=task_views.models_cache_file())
    except (opencode_runner.OpencodeNotFound, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        err().print(Text(visible(f"Could not check {model} against OpenCode ({exc}); queued unchecked."),
                         style="yellow"), soft_wrap=True)
        return model
    try:
        return opencode_runner.match_model(model, models)
    except opencode_runner.UnknownModel as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None


def usd_arg(_ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """An amount in USD above 0 (``0.50`` or ``$0.50``), or None."""
    try:
        return task_store.coerce_usd(param.name or "amount", value)
    except task_store.ValidationError as exc:
        raise click.BadParameter(str(exc)) from None


def checked_names(skills: Iterable[str], subagents: Iterable[str], agent: str | None, working_dir: str | None,
                  parent: str | None) -> None:
    """Skills, sub-agents and the agent given at submit, checked against what OpenCode offers for
    the task's folder (a follow-up's: its task's): an unknown one is refused (exit 2) naming those
    offered. When OpenCode cannot be asked they are queued unchecked, with a warning."""
    skills, subagents = list(skills), list(subagents)
    agent = task_store.optional(agent)   # "null" and "" say absent, as the store takes them
    if not (skills or subagents or agent):
        return
    folder = working_dir or (task_store.get_task(parent)["working_dir"] if parent else None)
    if not folder:
        return
    try:
        opencode_runner.check_names(skills, subagents, folder, agent)
    except opencode_runner.UnknownName as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{exc.option}'") from None
    except (opencode_runner.OpencodeNotFound, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        err().print(Text(visible(f"Could not check the agent, skills or sub-agents against OpenCode ({exc}); "
                                 "queued unchecked."), style="yellow"), soft_wrap=True)


def model_arg(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``provider/model`` or None (not given). An empty one is refused: the store reads a blank as
    not given (MCP clients send "" for that), which would silently mean the default model here."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"it is empty; give provider/model (`{cli_command()} models` lists them) or leave "
                                 "--model out for the default")
    try:
        return task_store.validate_model(value)
    except task_store.ValidationError as exc:
        raise click.BadParameter(str(exc)) from None


def finite_arg(_ctx: click.Context, _param: click.Parameter, value: float | None) -> float | None:
    """Refuse ``nan``, which passes click's FloatRange (every comparison with it is false)."""
    if value is not None and value != value:
        raise click.BadParameter("nan is not a number of seconds; give one like 3600")
    return value


def db_arg(_ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """Point ``task_store`` at ``--db`` (a postgresql:// URL or a SQLite file) by setting
    TASK_DB_URL for this process; a value that cannot be one is refused in one line, exit 2, its
    password never shown."""
    if value is not None and _has_surrogates(value):
        raise CliUsageError(f"--db {value.encode('utf-8', 'surrogateescape')!r} holds bytes that are not UTF-8; "
                            "give the queue a UTF-8 path")
    try:
        knobs.select_database(value)
    except knobs.KnobError as exc:
        raise CliUsageError(str(exc)) from None


def json_option(command: Callable) -> Callable:
    """The ``--json`` flag shared by the listing commands."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print plain JSON for scripts instead of a table.")(command)


# --------------------------------------------------------------------------------------------
# Rendering helpers: plain functions from store dicts to rich objects.


def parse_time(value: str | None) -> datetime | None:
    """An ISO time from the store -> aware datetime (None stays None)."""
    if not value:
        return None
    stamp = datetime.fromisoformat(value)
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def age(seconds: float | None) -> str:
    """Seconds -> ``"3m ago"`` (or ``"in 20s"`` for the future; ``"-"`` for None)."""
    if seconds is None:
        return "-"
    ahead, seconds = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            text = f"{int(seconds // size)}{unit}"
            break
    else:
        text = f"{int(seconds)}s"
    return f"in {text}" if ahead else f"{text} ago"


def ago(value: str | None) -> str:
    """An ISO time -> relative age for people (``"3m ago"``), ``"-"`` when unset."""
    stamp = parse_time(value)
    return age(time.time() - stamp.timestamp()) if stamp else "-"


STATUS_STYLE = {"pending": "yellow", "running": "cyan", "waiting": "magenta", "done": "green",
                "failed": "red", "cancelled": "dim"}


def status_text(status: str) -> Text:
    """A status coloured by kind."""
    return Text(status, style=STATUS_STYLE.get(status, ""))


def plain(value: Any) -> Text:
    """Any value as literal, terminal-safe text: never parsed as rich markup (titles may contain
    brackets), control characters made visible. A list shows one item a line (each on one line)."""
    if isinstance(value, (list, tuple)) and value:
        return Text("\n".join(visible(flat(v), multiline=False) for v in value))
    text = flat(value)
    return Text(visible(text)) if text else Text("-", style="dim")


def line(value: Any, style: str = "") -> Text | None:
    """A one-line field (title, name, path) as terminal-safe text; None when empty (row left out)."""
    if value is None or value == "":
        return None
    return Text(visible(flat(value), multiline=False), style=style)


def flat(value: Any) -> str:
    """A value on one line: dicts as ``k=v, ...`` (keys with nothing in them left out), lists
    comma-joined, booleans as yes / no, nothing at all as ""."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        shown = ((k, flat(v), isinstance(v, dict)) for k, v in value.items())
        return ", ".join(f"{k}={{{text}}}" if nested else f"{k}={text}" for k, text, nested in shown if text)
    if isinstance(value, (list, tuple)):
        return ", ".join(flat(v) for v in value)
    return str(value)


def short(value: str | None, limit: int = 60) -> str:
    """First line of ``value``, cut to ``limit`` characters."""
    text = (value or "").strip().splitlines()[0] if (value or "").strip() else ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def origin_of(task: dict[str, Any]) -> str:
    """``name version`` of whoever submitted the task."""
    return " ".join(p for p in (task.get("origin_name"), task.get("origin_version")) if p) or "-"


def tasks_table(tasks: list[dict[str, Any]]) -> Table:
    """One row per task (the list/pending view)."""
    table = Table(show_lines=False)
    for name, opts in (("ID", {"no_wrap": True}), ("Status", {}), ("Pri", {"justify": "right"}),
                       ("Title", {"overflow": "fold"}), ("Tries", {}), ("Origin", {}),
                       ("Created", {"no_wrap": True}), ("Detail", {"overflow": "fold"})):
        table.add_column(name, **opts)
    for task in tasks:
        detail = task.get("question") if task["status"] == "waiting" else task.get("error")
        table.add_row(
            Text(task["id"]), status_text(task["status"]), Text(str(task["priority"])),
            line(task["title"]), Text(tries_cell(task)), line(origin_of(task)),
            Text(ago(task.get("created_at"))), Text(visible(short(detail), multiline=False)),
        )
    return table


def tries_cell(task: dict[str, Any]) -> str:
    """``counted/allowed`` attempts for the list table, hand-backs (which do not count) as ``+N``.

    A listing row without ``handbacks`` shows the bare attempt number once it passes the allowed
    count, rather than an impossible ``3/2``.
    """
    if task.get("handbacks") is None:
        allowed, attempts = task["max_retries"] + 1, task["attempts"]
        return f"{attempts}/{allowed}" if attempts <= allowed else str(attempts)
    counted, allowed, uncounted = task_views.attempt_counts(task)
    return f"{counted}/{allowed}" + (f" +{uncounted}" if uncounted else "")


def attempts_text(task: dict[str, Any]) -> str:
    """``attempt 3 (2 of 3 counted; not counted: 1 hand-back); retries allowed 2`` for ``show`` (the worker's
    claimed line says the same, from task_views.attempt_text).

    The store allows another try while ``attempts - handbacks <= max_retries``: a hand-back (the
    worker stopping, not the task failing) keeps its attempt number but spends no retry.
    """
    text = task_views.attempt_text(task) if task["attempts"] else "not started yet"
    return f"{text}; retries allowed {task['max_retries']}"


def page_footer(page: dict[str, Any]) -> str:
    """``showing 1–50 of 120; next page: --offset 50``."""
    shown = len(page["tasks"])
    if not shown:
        return "no tasks match" if page["total"] == 0 else f"no tasks at offset {page['offset']} (of {page['total']})"
    text = f"showing {page['offset'] + 1}–{page['offset'] + shown} of {page['total']}"
    return text + (f"; next page: --offset {page['next_offset']}" if page["next_offset"] is not None else "")


def fields_table(rows: Iterable[tuple[str, Any]], title: str | None = None) -> Table:
    """A two-column key/value table; keys whose value is empty are left out."""
    table = Table(show_header=False, title=title, title_justify="left", box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        if value not in (None, "", [], {}):
            # Keys can come from a receipt or the heartbeat file: literal and visible too.
            table.add_row(line(key), value if isinstance(value, Text) else plain(value))
    return table


def when(value: str | None) -> str | None:
    """``"3m ago (2025-01-01T10:00:00+00:00)"`` or None."""
    return f"{ago(value)} ({value})" if value else None


def worktree_words(task: dict[str, Any]) -> str:
    """Whether the task runs (ran) in a worktree of its own: a task that asked for one but whose
    folder is in no git repository runs in place, and is said to."""
    if not task["worktree"]:
        return "no (runs in place)"
    if ((task.get("result") or {}).get("isolation") == "in-place"
            or (task["status"] not in task_store.TERMINAL and task_views.place_warnings(task))):
        return "no: its folder is in no git repository, so it runs in place"
    return "yes, kept" if task["worktree_keep"] else "yes"


def overview_rows(task: dict[str, Any]) -> list[tuple[str, Any]]:
    """The task's identity, settings and timing."""
    return [
        ("working dir", line(task["working_dir"])), ("repo", line(task.get("repo"))),
        ("base ref", line(task.get("base_ref") or ("the remote's HEAD branch" if task.get("repo") else None))),
        ("host", line(task.get("host") or ("any" if task.get("repo") else None))),
        ("model", line(task_views.model_shown(task))),
        ("agent", line(task["agent"])), ("priority", task["priority"]), ("permission", task["permission"]),
        ("worktree", worktree_words(task)),
        ("timeout", f"{task['timeout_sec']} s per attempt"),
        ("attempts", attempts_text(task)),
        ("depends on", task.get("depends_on")),
        ("continues", task.get("continue_from")), ("forked from", task.get("fork_from")),
        ("rules", line(json.dumps(task["rules"])) if task.get("rules") else None),
        ("skills", line(", ".join(task["skills"])) if task.get("skills") else None),
        ("sub-agents", line(", ".join(task["subagents"])) if task.get("subagents") else None),
        ("idempotency key", line(task["idempotency_key"])),
        ("origin", line(f"{origin_of(task)} ({task['origin_kind']})" if task["origin_kind"] else origin_of(task))),
        ("created", when(task["created_at"])), ("started", when(task["started_at"])),
        ("heartbeat", when(task["heartbeat_at"])), ("finished", when(task["finished_at"])),
        ("next try", f"{ago(task['not_before'])}" if task["status"] == "pending" and task["not_before"] else None),
        ("waits for", line(f"{task['lease_owner']} to wrap up the cancelled attempt {task['wrapping_up']} (seconds)")
         if task["status"] == "pending" and task.get("wrapping_up") else None),
        ("resumes at", line(f"{task['resume_at']} by itself (paused at {task.get('limit_account')}'s usage limit; "
                            "`answer ID continue` resumes now, `answer ID stop` fails it)")
         if task["status"] == "waiting" and task.get("resume_at") else None),
        ("start overdue", Text(visible(task["start_overdue"]), style="yellow") if task.get("start_overdue") else None),
    ]


def run_rows(task: dict[str, Any]) -> list[tuple[str, Any]]:
    """Where and by whom the task runs or ran."""
    lease = task["lease_owner"] if task["status"] == "running" else None
    return [
        ("lease", line(f"{lease} (pid {task['lease_pid']})" if lease and task["lease_pid"] else lease)),
        # the agent's pid means something only while its attempt runs
        ("run marker", line(task["run_marker"])), ("agent pid", task["agent_pid"] if lease else None),
        ("lease host", line(task.get("lease_host"))),
        ("session", line(task["session_id"])), ("branch", line(task["branch"])),
        ("pushed", line(f"{task['pushed_branch']} at {str(task.get('pushed_commit'))[:12]} to {task['repo']}")
         if task.get("pushed_branch") else None),
        ("unpushed work", Text(visible(worktrees.unpushed_note(task) or ""), style="yellow")
         if worktrees.unpushed_note(task) else None),
        ("worktree path", line(worktree_path_words(task))), ("base commit", line(task["base_commit"])),
        ("spent", f"{money(task['spent_usd'])}, {task['spent_tokens']:,} tokens"
                  + (" so far" if task["status"] == "running" else f" over {task['attempts']} attempts")
         if task["status"] == "running" or task["attempts"] > 1 else None),
        ("limit", None if task["max_cost_usd"] is None and task["max_tokens"] is None else
         ", ".join(x for x in (task["max_cost_usd"] is not None and money(task["max_cost_usd"]),
                              task["max_tokens"] is not None and f"{task['max_tokens']:,} tokens") if x)
         + (f" (paused: {task['paused_for'].replace('_', ' ')})" if task.get("paused_for") else "")),
    ]


def worktree_path_words(task: dict[str, Any]) -> str | None:
    """The task's recorded worktree path; once its attempt is over, said to be gone when it is
    (the worker removes it at the end of a run, unless kept); on another host, said so."""
    path = task["worktree_path"]
    if path and task.get("lease_host") and task["lease_host"] != task_store.host_name():
        return f"{path} (on {task['lease_host']})"   # this machine's disk says nothing of it
    if path and task["status"] != "running" and not os.path.lexists(path):
        return f"{path} (removed)"
    return path


RECEIPT_KEYS = ("summary", "files_touched", "files_reverted", "commands", "tests_run", "open_questions",
                "tool_errors", "sandbox", "latency_sec")
RECEIPT_LABELS = {"tests_run": "tests run (the agent's word)"}   # the rest from git or the event stream
# Receipt keys `show` leaves out: shown once elsewhere on the page (branch, session, notes, the
# model in the Task block, ...)
# or the worker's own bookkeeping; the ones that mean trouble come back as warnings in words.
RECEIPT_HIDDEN = frozenset({
    "block_found", "files_claimed", "tool_calls", "attempt", "max_retries", "isolation", "branch", "repo",
    "mirror", "base_commit", "base_from", "submodules", "worktree_path", "session_id", "session",
    "exit_code", "agent_exited", "non_json_lines", "replies_not_believed", "ended_with_run",
    "notes", "questions", "limit_pauses", "usage", "model"})


def receipt_rows(task: dict[str, Any]) -> list[tuple[str, Any]]:
    """The receipt (``result``) a person reads: its fields, the attempt's tokens and cost, what
    went wrong in words, then any key the worker recorded that this view does not know."""
    result = task["result"] if isinstance(task["result"], dict) else {"result": task["result"]}
    rows = [(RECEIPT_LABELS.get(key, key.replace("_", " ")), result.get(key)) for key in RECEIPT_KEYS]
    rows = [(k, f"{v} s") if k == "latency sec" and v is not None else (k, v) for k, v in rows]
    rows += [(key.replace("_", " "), value) for key, value in result.items()
             if key not in RECEIPT_KEYS and key not in RECEIPT_HIDDEN]
    usage = task["usage"] or result.get("usage")
    if isinstance(usage, dict):
        rows += [("tokens", usage.get("tokens")),
                 ("cost", money(usage["cost_usd"]) if usage.get("cost_usd") is not None else None)]
    rows.append(("warnings", receipt_warnings(task["id"], result) or None))
    if task["diff"]:
        rows.append(("diff", f"{len(task['diff'].splitlines())} line(s) (show --diff prints it)"))
    for earlier in task.get("earlier_attempts") or []:
        files = len(earlier["files_touched"])
        rows.append((f"attempt {earlier['attempt']}", f"{earlier['status']}, {files} file(s) changed, kept when a "
                     f"retry started afresh" + (f" (diff {task['id']} --attempt {earlier['attempt']})"
                                               if earlier["diff_bytes"] else "")))
    return rows


def receipt_warnings(task_id: str, result: dict[str, Any]) -> list[str]:
    """The receipt's internal flags that mean something went wrong, each as a sentence; none when
    the run was clean (a flag at its normal value is not news)."""
    said = []
    if result.get("non_json_lines"):
        said.append(f"{result['non_json_lines']} line(s) of the agent's output were not JSON events "
                    f"(logs {task_id} --raw shows them)")
    if result.get("block_found") is False:
        said.append("the agent ended without a receipt block: the summary is its last text")
    if result.get("exit_code") not in (None, 0):
        said.append(f"opencode exited with code {result['exit_code']}")
    if result.get("replies_not_believed"):
        said.append(f"replies not believed: {flat(result['replies_not_believed'])}")
    return said + claims_unseen(result)


def claims_unseen(result: dict[str, Any]) -> list[str]:
    """Where the agent's receipt block says more than the run showed: tests it says it ran that
    no bash command of the run contains, files it says it touched that git does not list."""
    ran = [c if isinstance(c, str) else str(c.get("command") or "") if isinstance(c, dict) else ""
           for c in result.get("commands") or []]
    tests = [t for t in result.get("tests_run") or [] if isinstance(t, str) and not any(t.strip() in c for c in ran)]
    seen = set(result.get("files_touched") or [])
    files = [f for f in result.get("files_claimed") or []
             if isinstance(f, str) and f not in seen and not any(s.endswith("/" + f) for s in seen)]
    said = []
    if tests:
        said.append(f"the agent says it ran {flat(tests)}, but no command of its run was that")
    if files:
        said.append(f"the agent says it touched {flat(files)}, which git did not see changed")
    return said


def next_step(task: dict[str, Any]) -> str:
    """The command a person most likely runs next for a task in its status."""
    tid, cli_ = task["id"], cli_command()
    if task["status"] == "waiting":
        return f"{cli_} answer {tid} \"your answer\""
    if task["status"] == "running" and task_views.holder_gone(task):
        then = ("hands the task back to the queue" if task_store.retries_left(task) else
                f"fails it, its retries spent ({cli_} retry {tid} then gives it a fresh budget)")
        return (f"its worker (pid {task['lease_pid']}) is gone: the next worker pass {then} "
                f"({worker_command()} runs one now), or {cli_} cancel {tid}")
    if task["status"] == "running":
        return f"{cli_} logs {tid} --follow (watch it), {cli_} note {tid} \"...\" (tell it something)"
    if task["status"] == "pending":
        return f"wait for a worker ({cli_} status shows it), or {cli_} cancel {tid}"
    in_place = (task.get("result") or {}).get("isolation") == "in-place"
    if task["status"] == "done" and in_place:
        return (f"nothing to apply: it ran in place and its changes are already in {task['working_dir']} "
                f"({cli_} diff {tid} names the files it changed)")
    if task["status"] == "done":
        return (f"{cli_} diff {tid} (read the changes), then {cli_} apply {tid}" if task["diff"]
                else f"nothing to apply: the run changed no files; {cli_} submit --continue {tid} \"...\" asks "
                     "for more in the same session")
    blocker = re.match(r"dependency (t_\d+) (failed|cancelled)", task.get("error") or "")
    if blocker:
        return f"{cli_} retry {blocker[1]} (this task is requeued with it)"
    return f"{cli_} retry {tid} (add --model provider/model to try another model)"


def headline(task: dict[str, Any]) -> Text:
    """``t_0001  Title  failed``: who the page is about, once."""
    head = Text(f"{task['id']}  ", style="bold")
    head.append(visible(task["title"], multiline=False), style="bold")
    head.append("  ")
    return head.append_text(status_text(task["status"]))


def why_line(task: dict[str, Any]) -> Text | None:
    """Why a task stopped, or what its last attempt hit, in the page's first lines."""
    if not task["error"]:
        return None
    head = {"failed": "Why it failed: ", "cancelled": "Why it was cancelled: "}.get(
        task["status"], "The last attempt hit: ")
    return Text(head + visible(task["error"]), style="red" if task["status"] == "failed" else "yellow")


def notes_table(task: dict[str, Any]) -> Table:
    """Notes and questions with their answers, in order."""
    table = Table(title="Notes and questions", title_justify="left")
    for name in ("When", "Who", "Text"):
        table.add_column(name, overflow="fold")
    rows = [(n["created_at"], line(n["author"]), plain(n["text"])) for n in task["notes"]]
    for q in task["questions"]:
        rows.append((q["asked_at"], Text(f"agent (attempt {q['attempt']})"), Text(f"Q: {visible(q['question'])}")))
        if q["answer"] is not None:
            rows.append((q["answered_at"], Text("answer"), Text(f"A: {visible(q['answer'])}")))
    for stamp, who, text in sorted(rows, key=lambda r: r[0] or ""):
        table.add_row(Text(ago(stamp)), who, text)
    return table


def events_table(events: list[dict[str, Any]], with_task: bool = True) -> Table:
    """Events oldest first."""
    table = Table(title=None if with_task else "Last events", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("When", no_wrap=True)
    if with_task:
        table.add_column("Task", no_wrap=True)
    table.add_column("Kind")
    table.add_column("Message", overflow="fold")
    for event in events:
        cells = [Text(str(event["id"])), Text(ago(event["ts"]))]
        cells += [plain(event["task_id"])] if with_task else []
        table.add_row(*cells, line(event["kind"]), Text(visible(short(event["message"], 200), multiline=False)))
    return table


def print_fields(rows: list[tuple[str, Any]], title: str) -> None:
    """A titled key/value table, unless every value is empty."""
    if any(value not in (None, "", [], {}) for _, value in rows):
        out().print(fields_table(rows, title=title))


def print_task(task: dict[str, Any]) -> None:
    """Everything about one task, for a person: what it is and why it stands where it does, the
    next step, then its settings, run, receipt, instructions, notes and events (each field once)."""
    console = out()
    # soft_wrap: the head lines hold commands to copy; a fold would split them.
    console.print(headline(task), soft_wrap=True)
    why = why_line(task)
    if why is not None:
        console.print(why, soft_wrap=True)
    if task["status"] == "waiting":
        console.print(Text(f"Question: {visible(task['question'])}", style="magenta"), soft_wrap=True)
    console.print(Text(f"Next step: {next_step(task)}", style="bold"), soft_wrap=True)
    print_fields(overview_rows(task), "Task")
    print_fields(run_rows(task), "Run")
    if task["result"] or task["usage"] or task["diff"] or task.get("earlier_attempts"):
        print_fields(receipt_rows(task), "Result")
    print_fields([("instructions", task["instructions"])], "Instructions")
    if task["notes"] or task["questions"]:
        console.print(notes_table(task))
    if task["events"]:
        console.print(events_table(task["events"], with_task=False))


def print_marker_help(task: dict[str, Any]) -> None:
    """After a hand claim: the marker and the commands that finish the attempt."""
    console = out()
    claimed = visible(f"Claimed {task['id']} ({task['title']}) as {task['lease_owner']}", multiline=False)
    console.print(Text(claimed, style="green"))
    console.print(Text(f"run marker: {task['run_marker']}", style="bold"))
    console.print(Text(
        f"Finish with: {cli_command()} complete {task['id']} --summary \"...\"  "
        f"or: {cli_command()} fail {task['id']} --reason \"...\"\n"
        f"Renew the lease with `{cli_command()} heartbeat {task['id']}` while you work: a lease idle "
        "past the worker's stale limit (15 min by default) is requeued.", style="dim"))


# --------------------------------------------------------------------------------------------
# Store lookups the commands share.


def hand_lease(task_id: str, marker: str | None, action: str) -> tuple[dict[str, Any], str]:
    """The task and the run marker a person's complete/fail/heartbeat names.

    ``action`` is the command's verb: "complete", "fail" or "renew". A finished or waiting task is
    refused whatever the marker. Without ``marker`` the task must be running under a ``cli:`` lease
    (a person's); a worker's lease is refused, so nobody finishes a live run by accident (complete
    and fail offer --marker as the deliberate override). Raises CliError.
    """
    task = task_store.get_task(task_id)
    refuse_unless_running(task, action, marker_given=bool(marker))
    if marker:
        return task, marker
    owner = task["lease_owner"] or ""
    if not owner.startswith("cli:"):
        override = (", or if you really mean to override the worker, pass --marker with its run marker "
                    "(shown by `show`)") if action != "renew" else ""
        raise CliError(
            f"task {task_id} is being run by {owner or 'a worker'}, not claimed by hand; refusing to "
            f"{action} a worker's attempt. Cancel it ({cli_command()} cancel {task_id}){override}"
        )
    return task, task["run_marker"]


NOTHING_TO = {"complete": "nothing can be completed", "fail": "nothing can be marked failed",
              "renew": "there is no lease to renew"}


def refuse_unless_running(task: dict[str, Any], action: str, marker_given: bool) -> None:
    """CliError naming why ``action`` cannot touch a task that is not running, and what to do.

    A pending task with an explicit marker is left to the store (it names the stale attempt).
    """
    ident, status = task["id"], task["status"]
    what = NOTHING_TO[action]
    if status in FINISHED:
        raise CliError(f"task {ident} is {status}: it has finished, so {what}; "
                       f"`{cli_command()} show {ident}` tells what happened")
    if status == "waiting":
        raise CliError(f"task {ident} is waiting for an answer to its question, so {what}; answer it "
                       f"({cli_command()} answer {ident} \"...\") and it resumes")
    if status == "pending" and not marker_given:
        raise CliError(f"task {ident} is pending, not running; claim it first "
                       f"({cli_command()} claim {ident})")


def read_text_source(instructions: str | None, file: Any) -> str | None:
    """Instructions from ``--instructions`` (``-`` reads stdin) or ``--file`` (``-`` is stdin)."""
    if instructions is not None and file is not None:
        raise click.UsageError("give the instructions once: --instructions or --file, not both")
    if file is not None:
        name = getattr(file, "name", "-")
        what = "--file" if name in ("-", "<stdin>") else f"--file {name}"
        text = read_bounded(file, task_store.INSTRUCTIONS_MAX, what)
    elif instructions == "-":
        what, text = "--instructions -", read_stdin("--instructions -", task_store.INSTRUCTIONS_MAX)
    else:
        return instructions
    if not text.strip():   # else the title would silently stand in for what was meant to be read
        raise click.UsageError(f"{what} read no instructions (empty input); give them, or leave the option "
                               "out to use the title")
    return text


def read_stdin(what: str, limit: int) -> str:
    """Standard input as text of at most ``limit`` characters (``read_bounded``); UsageError naming
    ``what`` when it is longer or not UTF-8."""
    stream = getattr(sys.stdin, "buffer", None)
    return read_bounded(stream, limit, f"{what} (stdin)") if stream is not None else sys.stdin.read(limit + 1)


def read_bounded(stream: Any, limit: int, what: str) -> str:
    """Text of at most ``limit`` characters from the binary ``stream``, read no further than the
    bytes that many characters can take in UTF-8 (4 each): longer input is refused before it is
    all read (``-f /dev/zero`` was read until memory ran out). UsageError naming ``what`` when it
    is longer or not UTF-8; the store counts the characters of what passes."""
    data = stream.read(limit * 4 + 1)
    if len(data) > limit * 4:
        raise click.UsageError(f"{what} is longer than the limit of {limit:,} characters; give a shorter text "
                               "(the agent can read a long one from a file in its folder)")
    return utf8_text(data, what)


def utf8_text(data: bytes, what: str) -> str:
    """``data`` decoded as UTF-8; a UsageError naming where it came from when it is not text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise click.UsageError(f"{what} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}: a binary "
                               "file?); give text, converted with iconv -t UTF-8 if need be") from None


def not_utf8_param(ctx: click.Context) -> click.BadParameter | None:
    """The first parameter holding bytes that are not UTF-8 (the shell passed them through as
    lone surrogates): they could be neither stored nor shown. None when every value is text."""
    for param in ctx.command.params:
        values = ctx.params.get(param.name)
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, str) and _has_surrogates(value):
                shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                path_hint = ("; rename the folder to a UTF-8 name (or run from a UTF-8 path)"
                             if param.name in ("working_dir", "db") else "; give it as UTF-8 text")
                return click.BadParameter(f"{shown!r} holds bytes that are not UTF-8{path_hint}", ctx=ctx,
                                          param=param)
    return None


def _has_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# --------------------------------------------------------------------------------------------
# Log following.


def read_new(task_id: str, offset: int) -> tuple[bytes, int]:
    """Bytes appended to a task's log since ``offset`` (a shrunk log is read from the start),
    through the store: the file on SQLite, the database on PostgreSQL."""
    if task_store.task_log_size(task_id) < offset:
        offset = 0
    return task_views.shown_log(task_id, offset)


def write_raw(data: bytes) -> None:
    """Log bytes exactly as stored into a pipe; on a terminal control characters made visible."""
    if not data:
        return
    if stdout_is_terminal():
        click.echo(visible(data.decode("utf-8", errors="replace")), nl=False)
        return
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


LOG_STYLE = {"text": "", "reasoning": "dim italic", "step": "dim", "error": "bold red", "stderr": "yellow",
             "worker": "dim", "attempt": "bold cyan", "other": ""}
TOOL_STATUS_STYLE = {"completed": "green", "error": "red", "denied": "yellow"}
LOG_OUTPUT_LINES = 10  # lines of a tool's output shown under it


def log_entry_text(entry: dict[str, Any]) -> Text:
    """One rendered log entry (see opencode_runner.render_log_line) as terminal-safe rich text."""
    kind = entry["kind"]
    if kind == "tool":
        return tool_entry_text(entry)
    prefix = {"error": "Error: ", "stderr": "stderr: ", "attempt": "── ", "step": "   "}.get(kind, "")
    return Text(prefix + visible(entry["text"]), style=LOG_STYLE.get(kind, ""))


def tool_entry_text(entry: dict[str, Any]) -> Text:
    """``| bash     cat hello.txt`` in the status's colour, the error or a short output below."""
    failed = entry["status"] != "completed" or entry.get("exit") not in (None, 0)
    style = "red" if failed and entry["status"] == "completed" else TOOL_STATUS_STYLE.get(entry["status"], "red")
    text = Text("| ", style=style)
    text.append(f"{visible(entry['tool'], multiline=False):<8}", style=f"bold {style}")
    if entry["title"]:
        text.append(" " + visible(entry["title"], multiline=False))
    if entry["status"] == "denied":
        text.append(f"  denied: {visible(entry['detail'] or '')}", style=style)
    elif entry["status"] == "error":
        text.append(f"  error: {visible(entry['detail'] or '')}", style=style)
    elif entry.get("exit") not in (None, 0):
        text.append(f"  (exit {entry['exit']})", style=style)
    lines = (entry.get("output") or "").rstrip("\n").splitlines() if entry["tool"] == "bash" else []
    for out_line in lines[:LOG_OUTPUT_LINES]:
        text.append("\n  " + visible(out_line, multiline=False), style="dim")
    if len(lines) > LOG_OUTPUT_LINES:
        text.append(f"\n  … {len(lines) - LOG_OUTPUT_LINES} more line(s) (logs --raw has them all)", style="dim")
    return text


def print_log_entry(entry: dict[str, Any]) -> None:
    """Print one rendered log entry on stdout (never hard-wrapped: paths stay copyable)."""
    out().print(log_entry_text(entry), soft_wrap=True)


WORKER_GONE = "running, but its worker is gone (the next worker pass hands it back to the queue)"


def say_if_no_worker() -> bool:
    """On stderr, `status`'s line about the missing worker when none runs this queue (see
    `missing_worker_line`); True when said."""
    missing = missing_worker_line(last_worker())
    if missing:
        err().print(Text(missing, style="yellow"), soft_wrap=True)
    return missing is not None


def follow_log(task_id: str, offset: int, raw: bool = False) -> str:
    """Print lines appended to a task's log from byte ``offset`` until the task is finished or
    waiting, or its worker is gone (rendered, or as stored with ``raw``); returns its status in
    words (a status, or WORKER_GONE). While the task is pending and no worker runs the queue, says
    so once on stderr (`say_if_no_worker`) and goes on following."""
    pending, warned = b"", False
    while True:
        task = task_store.get_task(task_id)
        if task["status"] == "pending" and not warned:   # said once: a pending task waits for a worker
            warned = say_if_no_worker()
        status = WORKER_GONE if task_views.holder_gone(task) else task["status"]
        data, offset = read_new(task_id, offset)
        pending += data
        done = status in FINISHED or status in ("waiting", WORKER_GONE)
        cut = len(pending) if done else pending.rfind(b"\n") + 1
        chunk, pending = pending[:cut], pending[cut:]
        if raw:
            write_raw(chunk)
        else:
            for entry in opencode_runner.render_log(chunk.decode("utf-8", errors="replace")):
                print_log_entry(entry)
        if done:
            return status
        time.sleep(FOLLOW_POLL_SEC)


# --------------------------------------------------------------------------------------------
# The commands.


@click.group(cls=TaskGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", metavar="URL", callback=db_arg, expose_value=False, is_eager=True,
              help="The queue: a postgresql:// URL or a SQLite file; sets TASK_DB_URL for this run "
                   "(default: $TASK_DB_URL, else $TASK_DB_PATH or <repo>/tasks.db).")
@click.version_option(__version__, "--version", prog_name="tasks_cli", message="%(prog)s %(version)s")
def cli() -> None:
    """TaskBridge: queue coding tasks for the OpenCode worker, and follow, answer or run them by hand.

    Task ids are accepted as t_0001, 0001 or 1. Listings print tables; --json prints JSON.
    """


@cli.command()
@click.argument("title")
@click.option("--dir", "-d", "working_dir", callback=working_dir_arg,
              help="The project folder the agent works in; relative paths start from the current folder "
                   "(default: the current folder, confirmed when it is not a git repository).")
@click.option("--instructions", "-i", help="What the agent should do; '-' reads stdin (default: the title).")
@click.option("--file", "-f", type=click.File("rb"), help="Read the instructions from a file; '-' is stdin.")
@click.option("--model", "-m", callback=model_arg,
              help="Model as provider/model, checked against `opencode models` "
                   "(default: chosen at claim; see `models`).")
@click.option("--priority", "-p", type=task_spec.PRIORITY.click_type(), default=task_spec.PRIORITY.default,
              show_default=True, help="Higher runs first.")
@click.option("--depends-on", multiple=True, callback=task_id_arg, help="A task that must be done first (repeatable).")
@click.option("--timeout", "timeout_sec", type=task_spec.TIMEOUT.click_type(), default=task_spec.TIMEOUT.default,
              show_default=True, help="Seconds per attempt.")
@click.option("--max-retries", type=task_spec.RETRIES.click_type(), default=task_spec.RETRIES.default,
              show_default=True, help="Retries after a failed attempt.")
@click.option("--permission", type=click.Choice(task_store.PERMISSIONS), default=None,
              help="What the agent may do, on top of the OS box every run gets: readonly (worktree read-only), "
                   "no-shell, no-network (bash gets no network); see docs/tasks.md, Permissions.  "
                   "[default: auto; with --continue or --fork: that task's, its rules and agent too]")
@click.option("--no-worktree", is_flag=True, help="Run in the directory itself, not in a git worktree.")
@click.option("--keep-worktree", is_flag=True,
              help="Keep the worktree after a successful run (the branch always stays).")
@click.option("--agent", help="OpenCode agent name (for example build or plan).")
@click.option("--key", "idempotency_key",
              help="Idempotency key: submitting the same task with it again returns the first task; "
                   "another task with it is refused.")
@click.option("--yes", "-y", is_flag=True,
              help="Without --dir, queue for the current folder even when it is not a git repository.")
@click.option("--max-cost", "max_cost_usd", callback=usd_arg,
              help="USD the task may spend over all its attempts; at the limit it pauses and asks "
                   "(default: the queue's).")
@click.option("--max-tokens", type=task_spec.TOKENS.click_type(),
              help="Tokens the task may use, for a model that reports no price (default: the queue's).")
@click.option("--continue", "continue_from", callback=task_id_arg,
              help="Follow-up of this task: resume its OpenCode session and commit on its branch (waits for it).")
@click.option("--fork", "fork_from", callback=task_id_arg,
              help="Fork of this task: a new branch from the commit it ended at, with a copy of its session as "
                   "it ended (waits for it).")
@click.option("--rules", help='Permission rules in OpenCode\'s format, e.g. \'{"bash": {"git push*": "ask"}}\' '
                              "(ask pauses the task for your answer).")
@click.option("--skill", "skills", multiple=True,
              help="An OpenCode skill the agent loads first (repeatable; checked against OpenCode).")
@click.option("--subagent", "subagents", multiple=True,
              help="An OpenCode sub-agent it may hand work to (repeatable; checked).")
@click.option("--repo", help="A git remote to work on instead of a folder (https://, ssh://, git@host:path, file://, "
                             "or a repository's absolute path): a worker clones it, runs, and pushes branch "
                             "taskbridge/<id> back with its own git credentials.")
@click.option("--base-ref",
              help="With --repo: the branch, tag or commit to start from (default: the remote's HEAD branch).")
@click.option("--host",
              help="Only workers with this TASKBRIDGE_HOST may run it "
                   "(default: this machine for --dir, any for --repo).")
@click.option("--schedule-timeout", "schedule_timeout_sec", type=task_spec.SCHEDULE_TIMEOUT.click_type(),
              help="Seconds it may stay queued without starting; past it `show` and `status` warn.")
@json_option
def submit(  # noqa: PLR0913  (click passes each of submit's options as one parameter)
           title: str, working_dir: str | None, instructions: str | None, file: Any, model: str | None,
           priority: int, depends_on: tuple[str, ...], timeout_sec: int, max_retries: int,
           permission: str | None, no_worktree: bool, keep_worktree: bool, agent: str | None,
           idempotency_key: str | None, yes: bool, max_cost_usd: float | None, max_tokens: int | None,
           continue_from: str | None, fork_from: str | None, rules: str | None, skills: tuple[str, ...],
           subagents: tuple[str, ...], repo: str | None, base_ref: str | None, host: str | None,
           schedule_timeout_sec: int | None, as_json: bool) -> None:
    """Queue a task for the worker.

    TITLE is a short name (up to 200 characters). The instructions come from --instructions,
    --file, or stdin ('-'); without them the title is the instruction. With --continue or --fork
    the task runs where that task ran (--dir may be left out). With --repo it works on a git
    remote instead of a folder, and its branch is pushed back there.
    """
    text = read_text_source(instructions, file)
    if repo is not None and working_dir is not None:
        raise click.UsageError("give --dir (a folder) or --repo (a git remote), not both")
    if not (continue_from or fork_from or repo is not None):
        working_dir = working_dir or default_working_dir(yes)
    model = checked_model(model)
    checked_names(skills, subagents, agent, working_dir, continue_from or fork_from)
    in_place = {working_dir: worktrees.refuse_unrunnable_folder(working_dir, host, not no_worktree)} \
        if working_dir else {}
    task = task_store.submit_task(
        title=title, instructions=text if text is not None and text.strip() else title,
        working_dir=working_dir, model=model, priority=priority, depends_on=list(depends_on),
        timeout_sec=timeout_sec, max_retries=max_retries, permission=permission,
        worktree=not no_worktree, worktree_keep=keep_worktree, agent=agent,
        idempotency_key=idempotency_key, origin_name=ORIGIN_NAME, origin_version=__version__,
        max_cost_usd=max_cost_usd, max_tokens=max_tokens,
        continue_from=continue_from, fork_from=fork_from, rules=rules, skills=list(skills),
        subagents=list(subagents), repo=repo, base_ref=base_ref, host=host,
        schedule_timeout_sec=schedule_timeout_sec,
    )
    warnings = task_views.submit_warnings(task, in_place)
    if as_json:
        return emit_json(task | {"warnings": warnings})
    verb = "Already queued as" if task["duplicate"] else "Submitted"
    said = visible(f"{verb} {task['id']}: {task['title']} ({task['status']})", multiline=False)
    out().print(Text(said, style="green"))
    for warning in warnings:
        err().print(Text(f"Warning: {visible(warning)}", style="yellow"), soft_wrap=True)
    if not task["duplicate"] and task["worktree"] and in_place.get(working_dir or "") is False and \
            (changed := worktrees.uncommitted_paths(working_dir or "")):
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        err().print(Text(visible(f"Note: {task['id']}'s worktree is made from a commit, so your {len(changed)} "
                                 f"uncommitted change(s) in its repository ({shown}) are not in it; if it needs them, "
                                 f"cancel it, commit them and submit again"), style="yellow"), soft_wrap=True)
    if not task["duplicate"] and (note := task_views.no_worker_note()):
        err().print(Text(f"Note: {visible(note)}", style="yellow"), soft_wrap=True)


def list_options(command: Callable) -> Callable:
    """--limit, --offset and --json, shared by list and pending."""
    command = json_option(command)
    command = click.option("--offset", type=task_spec.int_range(0, PAGE_OFFSET_MAX), default=0,
                           help=f"Skip this many tasks (paging; 0..{PAGE_OFFSET_MAX}).")(command)
    return click.option("--limit", type=task_spec.int_range(1, 500), default=50, show_default=True,
                        help="At most this many tasks (1..500).")(command)


def render_page(page: dict[str, Any], as_json: bool) -> None:
    """A page of tasks as JSON or a table with a paging footer."""
    if as_json:
        return emit_json(task_views.shown(page))
    page = task_views.shown(page)
    if page["tasks"]:
        out().print(tasks_table(page["tasks"]))
    out().print(Text(page_footer(page), style="dim"))


@cli.command("list")
@click.option("--status", "-s", multiple=True, type=click.Choice(task_store.STATUSES),
              help="Only tasks in this status (repeatable; default: all).")
@click.option("--origin", help="Only tasks from this caller: a kind (claude, chatgpt, other) or a client name.")
@list_options
def list_cmd(status: tuple[str, ...], origin: str | None, limit: int, offset: int, as_json: bool) -> None:
    """List tasks: running, waiting, pending first, then the finished ones."""
    render_page(task_store.list_tasks(list(status) or None, origin, limit, offset), as_json)


@cli.command()
@list_options
def pending(limit: int, offset: int, as_json: bool) -> None:
    """List the tasks still waiting for a worker to claim them."""
    render_page(task_store.list_tasks("pending", None, limit, offset), as_json)


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--diff", "diff_only", is_flag=True,
              help="Print only the task's diff: exact when piped (for patch); on a terminal control characters "
                   "show as escapes.")
@json_option
def show(task_id: str, diff_only: bool, as_json: bool) -> None:
    """Show everything about one task: status, run, receipt, notes, questions, events."""
    task = task_views.shown_task(task_id)
    if diff_only:
        if not task["diff"]:
            raise CliError(f"task {task_id} has no diff ({no_diff_words(task)}); "
                           f"`{cli_command()} show {task_id}` tells more")
        if as_json:   # as `diff --json` gives it
            return emit_json({"task_id": task_id, "diff": task["diff"]})
        return click.echo(raw_or_visible(task["diff"]), nl=not task["diff"].endswith("\n"), color=True)
    if as_json:
        return emit_json(task)
    print_task(task)


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--offset", type=task_spec.int_range(0, 1_000_000), default=0, show_default=True,
              help="The first turn to show (paging).")
@click.option("--limit", type=task_spec.int_range(1, task_views.TRANSCRIPT_PAGE_MAX), default=20, show_default=True,
              help=f"At most this many turns (1..{task_views.TRANSCRIPT_PAGE_MAX}).")
@json_option
def transcript(task_id: str, offset: int, limit: int, as_json: bool) -> None:
    """Show the conversation of a task's line of work (its follow-ups' and forks' origins too).

    From OpenCode's own session record, else rebuilt from the task logs; paged by turn.
    """
    page = task_views.shown(task_views.transcript(task_id, offset, limit))
    if as_json:
        return emit_json(page)
    out().print(Text(visible(f"{page['task_id']}: line {' -> '.join(page['line'])}, {page['total']} turns "
                             f"from the {page['source']}" + (f" ({page['note']})" if page["note"] else ""),
                             multiline=False), style="bold"))
    for turn in page["turns"]:
        out().print(Text(visible(f"[{turn['index']}] {turn['role']} {turn['at'] or ''}", multiline=False),
                         style="cyan"))
        if turn["text"]:
            out().print(Text(visible(turn["text"])))
        for call in turn["tools"]:
            out().print(Text(visible(f"  · {call['tool']} {call['title']} ({call['status']})", multiline=False),
                             style="dim"))
    if page["next_offset"] is not None:
        out().print(Text(f"more: transcript {page['task_id']} --offset {page['next_offset']}", style="dim"))


@cli.command()
@click.argument("task_id", required=False, callback=task_id_arg)
@click.option("--as", "name", help="Your name; the lease owner becomes cli:NAME (default: cli:$USER).")
@json_option
def claim(task_id: str | None, name: str | None, as_json: bool) -> None:
    """Claim a task to do it by hand (TASK_ID, or the best claimable one).

    Prints the run marker that complete and fail name. Exits 0 with a note when nothing is claimable.
    """
    task = task_store.claim_next(person(name), task_id=task_id)
    if as_json:
        return emit_json(task)
    if task is None:
        waiting = task_store.counts()["pending"]
        hint = (f" {waiting} pending task(s) wait for dependencies, a retry back-off or their cancelled attempt's "
                "wrap-up (see `list --status pending`)."
                if waiting else "")
        return err().print("Nothing to claim: no pending task is ready." + hint)
    print_marker_help(task)


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--summary", default="completed by hand", show_default=True,
              help=f"What was done (the receipt's summary), at most {task_store.SUMMARY_MAX:,} characters, "
                   "as an agent's (refused above: put the details in a note first).")
@click.option("--marker", help="The attempt's run marker (default: the current one of your hand claim).")
def complete(task_id: str, summary: str, marker: str | None) -> None:
    """Mark a task you claimed by hand as done."""
    if len(summary) > task_store.SUMMARY_MAX:
        raise click.BadParameter(
            f"it is {len(summary):,} characters; the limit is {task_store.SUMMARY_MAX:,}: shorten it, and put the "
            f"details in a note first ({cli_command()} note {task_id} TEXT, up to {task_store.NOTE_MAX:,} characters)",
            param_hint="--summary")
    task, marker = hand_lease(task_id, marker, "complete")
    receipt = {"summary": summary, "completed_by": _finisher(task)}
    done = task_store.complete_attempt(task_id, marker, result=receipt)
    out().print(Text(f"{done['id']} is done.", style="green"))


def _finisher(task: dict[str, Any]) -> str:
    owner = task.get("lease_owner") or ""
    return owner if owner.startswith("cli:") else person()


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--reason", required=True,
              help=f"Why the attempt failed, stored as the task's error: up to {task_store.ERROR_MAX:,} characters; "
                   "a longer one is stored clipped (its head and tail) and kept whole in the task's log.")
@click.option("--marker", help="The attempt's run marker (default: the current one of your hand claim).")
@click.option("--no-retry", is_flag=True, help="Fail for good instead of requeueing when retries remain.")
def fail(task_id: str, reason: str, marker: str | None, no_retry: bool) -> None:
    """Mark a task you claimed by hand as failed (requeued while retries remain)."""
    if not reason.strip():
        raise click.BadParameter("must not be empty; say why the attempt failed", param_hint="--reason")
    task, marker = hand_lease(task_id, marker, "fail")
    after = task_store.fail_attempt(task_id, marker, reason, retryable=not no_retry)
    if after["status"] == "pending":
        out().print(Text(f"{after['id']} failed this attempt; requeued for a retry.", style="yellow"))
    else:
        out().print(Text(f"{after['id']} failed.", style="red"))
    if len(reason) > task_store.ERROR_MAX:
        kept = (f"the whole text is in its log ({cli_command()} logs {after['id']})"
                if "the whole text is in the task's log" in (after["error"] or "") else
                "it could not be written whole to its log (the error says why)")
        out().print(Text(visible(f"The reason has {len(reason):,} characters: the task's error keeps "
                                 f"{task_store.ERROR_MAX:,} of them (head and tail); {kept}.", multiline=False),
                         style="yellow"), soft_wrap=True)


@cli.command()
@click.argument("task_id", callback=task_id_arg)
def heartbeat(task_id: str) -> None:
    """Renew the lease of a task you claimed by hand (so it is not requeued as stale)."""
    task, _ = hand_lease(task_id, None, action="renew")
    task_store.heartbeat(task_id, owner=task["lease_owner"])
    out().print(f"Lease of {task_id} renewed.")


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.argument("text")
def answer(task_id: str, text: str) -> None:
    """Answer a waiting task's question; it requeues and resumes with the answer. TEXT '-' reads stdin."""
    if text == "-":
        text = read_stdin("TEXT -", task_store.ANSWER_MAX)
    task = task_store.answer_task(task_id, text, author=person())
    if task["status"] == "failed":
        return out().print(Text(f"Stopped {task['id']} at its spending limit: it failed, its receipt kept.",
                                style="yellow"))
    out().print(Text(f"Answered {task['id']}; it is {task['status']} again and resumes with your answer.",
                     style="green"))


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.argument("text")
@click.option("--author", help="Who writes the note (default: cli:$USER).")
def note(task_id: str, text: str, author: str | None) -> None:
    """Add a note for the agent: a running task gets it in its session at the next step, else its next prompt.
    TEXT '-' reads stdin."""
    if text == "-":
        text = read_stdin("TEXT -", task_store.NOTE_MAX)
    result = task_store.add_note(task_id, text, author=author or person())
    out().print(f"Note added to {result['task_id']} ({result['status']}); it reaches {result['delivery']}.")


def confirm(question: str, what: str) -> None:
    """Ask ``question`` (a "no": click.Abort, exit 1 "Aborted!"). No answer at all (stdin closed:
    no terminal to ask on) is a CliError saying to pass --yes to ``what``: click alone printed
    only "Aborted!"."""
    try:
        answered = click.confirm(question, err=True)
    except click.Abort:
        raise CliError(f"no answer to whether to {what} (no terminal to ask on?); pass --yes to go ahead") from None
    if not answered:
        raise click.Abort()


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--reason", default="cancelled by hand", show_default=True, help="Stored as the task's error.")
def cancel(task_id: str, yes: bool, reason: str) -> None:
    """Cancel a pending, waiting or running task (a running attempt is killed); dependents fail."""
    task = task_store.get_task(task_id)
    if not yes:
        title = visible(short(task["title"]), multiline=False)
        confirm(f"Cancel {task_id} ({task['status']}: {title})?", f"cancel {task_id}")
    done = task_store.cancel_task(task_id, f"{reason} ({person()})")
    out().print(Text(f"{done['id']} cancelled.", style="yellow"))


@cli.command()
@click.option("--older-than", type=click.FloatRange(0, OLDER_THAN_MAX_SEC), default=0, show_default=True,
              callback=finite_arg,
              help=f"Only tasks finished at least this many seconds ago (0..{OLDER_THAN_MAX_SEC}).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--purge-logs", is_flag=True,
              help="Also delete the removed tasks' log files (on PostgreSQL a log is in the database and always "
                   "goes with its task) and their OpenCode sessions (those a remaining follow-up resumes stay).")
@click.option("--remove-worktrees", is_flag=True,
              help="Also remove worktrees kept with --keep-worktree (task branches stay); without it their tasks stay.")
@json_option
def clear(older_than: float, yes: bool, purge_logs: bool, remove_worktrees: bool, as_json: bool) -> None:
    """Remove finished tasks (done, failed, cancelled) from the queue; events stay as history.

    A task whose kept worktree is still on disk stays (the queue is what knows where it is) until
    --remove-worktrees removes the worktree with it. The folders its earlier worktrees were set
    aside to (<worktree root>/left/<id>-<n>, named in its events and receipt) always go with it.
    """
    finished = sum(task_store.counts()[s] for s in task_store.TERMINAL)
    if not finished:
        return emit_json([]) if as_json else out().print("No finished tasks to clear.")
    if not yes:
        since = f" finished more than {older_than:g} s ago" if older_than else ""
        confirm(f"Remove up to {finished} finished task(s){since}, with the folders their earlier worktrees were set "
                "aside to? Events stay.", "clear finished tasks")
    removed, purged = worktrees.clear_finished(older_than, remove_logs=purge_logs, remove_worktrees=remove_worktrees)
    if as_json:
        emit_json(removed)
    else:
        print_cleared(removed, purge_logs, purged)
    print_left(purged)   # on stderr: with --json too, the removed list stays alone on stdout


def print_cleared(removed: list[dict[str, Any]], purged_logs: bool, purged: dict[str, Any]) -> None:
    """What clear removed (stdout)."""
    ids = ", ".join(item["id"] for item in removed) or "none"
    out().print(f"Removed {len(removed)} task(s): {ids}" + (" (logs deleted)" if purged_logs and removed else ""))
    for path in purged["worktrees_removed"]:
        # soft_wrap: a path cut by a hard line break cannot be copied.
        out().print(Text(f"Removed worktree {visible(path, multiline=False)} (its branch stays)."), soft_wrap=True)
    for path in purged["leftovers_removed"]:
        out().print(Text(f"Removed leftover {visible(path, multiline=False)} (an earlier attempt's worktree, "
                         "set aside)."), soft_wrap=True)


def print_left(purged: dict[str, Any]) -> None:
    """What clear left, and why (stderr): problems, tasks kept for their hosts, their dependents
    or their worktrees on disk."""
    for problem in purged["problems"]:
        err().print(Text(visible(problem), style="yellow"), soft_wrap=True)
    for host, ids in purged.get("kept_on_hosts", {}).items():
        err().print(Text(visible(f"Kept {len(ids)} task(s) whose worktrees were kept on host {host}, not this "
                                 f"one ({task_store.host_name()}): {', '.join(ids)}; this machine cannot see or "
                                 f"remove them (not even with --remove-worktrees): run clear on {host}",
                                 multiline=False), style="dim"), soft_wrap=True)
    for kept_id, waiting in purged["kept_for_dependents"].items():
        err().print(Text(f"Kept {kept_id}: {', '.join(waiting)} (not finished) depend(s) on it or continue(s) it",
                         style="dim"), soft_wrap=True)
    kept = purged["kept_for_worktrees"]
    if kept:
        err().print(Text(f"Kept {len(kept)} task(s) whose worktrees are on disk: {', '.join(kept)}; "
                         f"`{cli_command()} clear --remove-worktrees` removes those worktrees and the tasks "
                         "(branches stay)", style="dim"), soft_wrap=True)


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--tail", "-n", type=task_spec.int_range(0, TAIL_MAX),
              help=f"Only the last N entries (with --raw: lines) (0..{TAIL_MAX}).")
@click.option("--follow", "-F", is_flag=True, help="Keep printing new lines until the task finishes (Ctrl-C stops).")
@click.option("--raw", is_flag=True,
              help="Print the log file as stored (OpenCode's JSON events, stderr lines): byte for byte when "
                   "piped; on a terminal control characters show as escapes.")
def logs(task_id: str, tail: int | None, follow: bool, raw: bool) -> None:
    """Show a task's agent log the way `opencode run` shows a session.

    The agent's text, its tool calls with their titles and status (completed, error, denied), errors,
    and each model call's tokens and cost. Control characters from the agent or the project's files
    are shown as escapes like \\x1b. --raw prints the stored event stream instead.
    """
    task = task_store.get_task(task_id)
    offset = print_log(task_id, tail, raw)
    if not offset and not say_why_no_log(task, task_store.task_log_location(task_id), follow):
        return
    if not follow:
        return
    try:
        status = follow_log(task_id, offset, raw)
    except KeyboardInterrupt:
        return
    err().print(Text(f"{task_id} is {status}; log ends.", style="dim"))


def no_diff_words(task: dict[str, Any]) -> str:
    """Why ``task`` (as task_views.shown_task gives it) holds no diff, in words after "has no
    diff (": only a done task's receipt can say its run changed nothing; a failed one's diff may
    not have been seen, and a task still queued, running or waiting has not finished an attempt
    (its receipt, if any, is an earlier attempt's). A failed or cancelled task whose worktree is
    still on disk: where its agent's uncommitted work is, and how to see it."""
    why = no_diff_reason(task)
    kept = worktrees.kept_work_words(task) if task["status"] in ("failed", "cancelled") else None
    return f"{why}; {kept}" if kept else why


def no_diff_reason(task: dict[str, Any]) -> str:
    """no_diff_words without the kept worktree."""
    receipt, status = task.get("result") or {}, task["status"]
    in_place, in_checkout = receipt.get("isolation") == "in-place", bool(receipt.get("base_commit"))
    files = ", ".join(receipt.get("files_touched") or []) or "none named"
    if status == "done":
        return ("it ran in place in your checkout and changed no files" if in_place and in_checkout else
                f"it ran in place, outside git: no diff is kept; files it changed: {files}" if in_place else
                "it changed no files")
    if status != "failed":
        return ("it was cancelled before an attempt's changes were recorded" if status == "cancelled" else
                "it is waiting: a diff is kept when its answered attempt finishes" if status == "waiting" else
                f"it is {status}: a diff is kept when an attempt finishes")
    if receipt.get("diff_error"):
        return f"it failed, and what its last attempt changed could not be read: {receipt['diff_error']}"
    if receipt.get("bookkeeping_error"):
        return f"it failed: {receipt['bookkeeping_error']}"
    if in_place and not in_checkout:
        return f"it failed; it ran in place, outside git: no diff is kept; files its last attempt changed: {files}"
    if not receipt:
        return "it failed before its agent's work was recorded"
    return ("it failed; its last attempt changed no files" if not receipt.get("files_touched") else
            f"it failed; no diff was kept of its last attempt, which changed: {files}")


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--stat", is_flag=True, help="Only the files changed, with lines added and removed.")
@click.option("--attempt", metavar="ATTEMPT", default=None,
              help="An earlier attempt's diff, kept when a retry started the task afresh: its run marker "
                   "(br-42-a1) or its last part (a1); `show` lists those kept.")
@json_option
def diff(task_id: str, stat: bool, attempt: str | None, as_json: bool) -> None:
    """Print a task's diff, from its receipt (exact when piped, for git apply / patch).

    On a terminal control characters show as escapes. --stat lists the files instead.
    """
    task = task_views.shown_task(task_id)
    if attempt is not None:
        earlier = task_store.earlier_receipt(task_id, attempt)
        if not earlier.get("diff"):
            raise CliError(f"attempt {earlier['attempt']} of task {task_id} ({earlier['status']}) recorded no diff")
        task = task | {"diff": earlier["diff"]}
    if not task["diff"]:
        raise CliError(f"task {task_id} has no diff ({no_diff_words(task)}); "
                       f"`{cli_command()} show {task_id}` tells more")
    if as_json:
        return emit_json(worktrees.diff_stat(task["diff"]) if stat else {"task_id": task_id, "diff": task["diff"]})
    if task.get("repo"):   # stdout stays the exact diff; where the work is goes to stderr
        err().print(Text(visible(worktrees.remote_work(task)), style="dim"), soft_wrap=True)
    if not stat:
        return click.echo(raw_or_visible(task["diff"]), nl=not task["diff"].endswith("\n"), color=True)
    summary = worktrees.diff_stat(task["diff"])
    for item in summary["files"]:
        counts = "binary" if item["binary"] else f"+{item['added']} -{item['removed']}"
        out().print(Text(f"{visible(item['path'], multiline=False)}  {counts}"), soft_wrap=True)
    out().print(Text(f"{len(summary['files'])} file(s) changed, {summary['added']} insertion(s)(+), "
                     f"{summary['removed']} deletion(s)(-)", style="dim"))


def no_branch_way(task: dict[str, Any]) -> str:
    """The way on from a failed or cancelled task with no branch, after no_branch_words: its
    diff, when one was recorded (a cancelled run's changes are, though its branch went), and
    retry; "" for any other task."""
    if task["status"] not in ("failed", "cancelled"):
        return ""
    ident, cli_ = task["id"], cli_command()
    seen = f"`{cli_} diff {ident}` shows the changes its agent made before it ended; " if task.get("diff") else ""
    return f". {seen}`{cli_} retry {ident}` runs it again"


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@json_option
def branch(task_id: str, as_json: bool) -> None:
    """Show the git branch holding a task's work, its commit, and how to check it out or apply it."""
    task = task_store.get_task(task_id)
    if not task["branch"] and not task.get("repo"):
        note = worktrees.no_change_note(task)
        if note:
            raise CliError(note)
        raise CliError(f"task {task_id} has no branch: {worktrees.no_branch_words(task)}{no_branch_way(task)}")
    info = worktrees.branch_info(task)
    if as_json:
        return emit_json(info)
    if task.get("repo"):
        out().print(Text(visible(worktrees.remote_work(task)), style="yellow"), soft_wrap=True)
        commands = [(name, line(command)) for name, command in info["commands"].items()]
        return out().print(fields_table([("kept worktree", line(info["worktree_path"])), *commands],
                                        title=f"Work of {task_id}"))
    commit = info["commit"] or ("none (no changes committed)" if task["status"] == "done" else
                                f"none recorded (it is {task['status']}: no attempt of it ended done)")
    rows: list[tuple[str, Any]] = [
            ("branch", line(info["branch"])), ("commit", line(commit)),
            ("tip now", line(info["tip"] or "the branch no longer exists")), ("base commit", line(info["base_commit"])),
            ("repository", line(info["repo"])), ("checkout is on", line(info["checkout_branch"])),
            ("applied", "yes: the checkout's HEAD contains it" if info["applied"] else
             "nothing to apply: the branch has no commit beyond its base"
             if info["tip"] and not info["has_commits"] else "no"),
            ("kept worktree", line(info["worktree_path"])),
            ("checked out at", line(info["checked_out_at"] and (
                f"{info['checked_out_at']} (git allows one checkout of a branch: work on it there)"
                if "cd" in info["commands"] else
                f"{info['checked_out_at']}, a worktree git still lists though its folder is gone: prune it first")))]
    rows += [(name, line(command)) for name, command in info["commands"].items()]
    out().print(fields_table(rows, title=f"Work of {task_id}"))


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--squash", is_flag=True, help="One new commit with all the task's changes (instead of a merge).")
@click.option("--cherry-pick", "cherry_pick", is_flag=True,
              help="Copy the task's commits onto the current branch (instead of a merge).")
@json_option
def apply(task_id: str, squash: bool, cherry_pick: bool, as_json: bool) -> None:
    """Bring a done task's branch into the current branch of its checkout (a git merge by default).

    Refused on a checkout with uncommitted changes, a detached HEAD or an unfinished merge. A
    conflict aborts the apply and leaves the checkout exactly as it was, naming the conflicting files.
    Applies into one checkout run one at a time (another one under way, from any process, is
    waited for up to 60 s).
    """
    if squash and cherry_pick:
        raise click.UsageError("give --squash or --cherry-pick, not both (neither: a merge)")
    mode = "squash" if squash else "cherry-pick" if cherry_pick else "merge"
    result = worktrees.apply_branch(task_store.get_task(task_id), mode)
    if as_json:
        return emit_json(result)
    where = visible(f"{result['into']} of {result['repo']}", multiline=False)
    if result["status"] == "already-applied":
        out().print(Text(f"Already applied: the work of {result['task_id']} ({result['tip'][:12]} on "
                         f"{result['branch']}) is in {where}; nothing to do.", style="yellow"), soft_wrap=True)
    else:
        verb = {"merge": "Merged", "squash": "Squashed", "cherry-pick": "Cherry-picked"}[mode]
        out().print(Text(f"{verb} {result['branch']} ({result['tip'][:12]}) into {where}: {len(result['files'])} "
                         f"file(s) changed; HEAD is now {result['head'][:12]}.", style="green"), soft_wrap=True)
        undo = task_store.shell_command("git", "-C", result["repo"], "reset", "--hard", result["before"][:12])
        out().print(Text("Undo with: " + visible(undo, multiline=False), style="dim"), soft_wrap=True)
    if result["later"]:
        out().print(Text(f"{result['branch']} has {result['later']} later commit(s), a follow-up's work, not "
                         "applied: apply that follow-up for them.", style="yellow"), soft_wrap=True)


@cli.command()
@click.argument("task_id", callback=task_id_arg)
@click.option("--model", "-m", callback=model_arg, help="Run it with this model (provider/model) from now on.")
@click.option("--note", help="Extra instructions for the agent; they reach its next prompt as a note.")
@json_option
def retry(task_id: str, model: str | None, note: str | None, as_json: bool) -> None:
    """Requeue a failed or cancelled task with a fresh budget of attempts.

    Its next attempt starts a new OpenCode session; tasks that failed only because it failed are
    requeued too. A task cancelled while it ran starts once its worker has wrapped that attempt up
    (its receipt, a readonly run's revert, its worktree; seconds) or is found gone.
    """
    task = task_store.retry_task(task_id, model=checked_model(model), note=note, author=person())
    if as_json:
        return emit_json(task)
    said = f"{task['id']} is pending again with {task['max_retries'] + 1} fresh attempt(s)"
    said += f", model {task['model']}" if model else ""
    said += f"; requeued with it: {', '.join(task['requeued_dependents'])}" if task["requeued_dependents"] else ""
    out().print(Text(visible(said + ".", multiline=False), style="green"), soft_wrap=True)
    held = worktrees.unpushed_note(task)
    if held:
        out().print(Text(visible(f"Its {held[4:]}.", multiline=False), style="yellow"), soft_wrap=True)
    if task["waits"]:
        out().print(Text(visible(f"It waits: {task['waits']}.", multiline=False), style="yellow"), soft_wrap=True)


def agent_started(task: dict[str, Any]) -> bool:
    """Whether a worker started the task's agent in some attempt (so a log was written): its pid
    recorded (this attempt), an OpenCode session, or a receipt of a run (an earlier attempt)."""
    result = task.get("result")
    return bool(task.get("agent_pid") or task.get("session_id")
                or (isinstance(result, dict) and result.get("latency_sec") is not None))


def lease_live(task: dict[str, Any]) -> bool:
    """Whether a worker holds a running task now: not claimed by hand, its worker process not gone
    (task_views.holder_gone), its lease's heartbeat younger than WORKER_STALE_SEC (the reaper's
    limit). Claiming clears the agent's pid, so such a task may still be preparing its run."""
    beat = parse_time(task.get("heartbeat_at"))
    if task["status"] != "running" or str(task.get("lease_owner") or "cli:").startswith("cli:") or beat is None:
        return False
    return not task_views.holder_gone(task) and time.time() - beat.timestamp() <= knobs.knob("WORKER_STALE_SEC")


def say_why_no_log(task: dict[str, Any], where: str, follow: bool) -> bool:
    """Tell the person why a task has no log; True when following it still makes sense. A task
    whose agent a worker started (`agent_started`) had a log at ``where``: it is missing now. A
    running task whose worker holds it (`lease_live`) is preparing its run: its agent is starting."""
    ident, status = task["id"], task["status"]
    owner = task.get("lease_owner") or ""
    if task["attempts"] and agent_started(task) and not owner.startswith("cli:"):
        then = "; a later attempt writes a new log there" if status not in task_store.TERMINAL else ""
        err().print(f"{ident}'s log is missing: it was expected at {where}, and a worker did run the task "
                    f"({task['attempts']} attempt(s); it is {status}), so the log was deleted or moved after it was "
                    f"written{then}. What the run did is still in its receipt: `{cli_command()} show {ident}`.",
                    soft_wrap=True)
        return status not in task_store.TERMINAL
    if lease_live(task):
        wait = "; waiting for it (Ctrl-C stops)" if follow else ""
        remote = f"; a clone of {visible(task['repo'], multiline=False)} can take a while" if task.get("repo") else ""
        err().print(f"{ident} has no log yet: its agent is starting. {visible(owner, multiline=False)} claimed it "
                    f"{ago(task.get('claimed_at'))} ({task_views.attempt_text(task)}) and is preparing its run (its "
                    f"worktree{remote}); the agent's log appears at {where} once it starts{wait}.", soft_wrap=True)
        return True
    if task["attempts"] and not owner.startswith("cli:"):
        err().print(f"{ident} has no log: a worker claimed it ({task['attempts']} attempt(s); it is {status}) but "
                    "no attempt got as far as starting its agent, so nothing was written to "
                    f"{where}; `{cli_command()} show {ident}` says why.", soft_wrap=True)
        return status not in task_store.TERMINAL
    if status in task_store.TERMINAL:
        err().print(f"{ident} has no log: it is {status} and no worker ever ran it (finished by hand or before a run).",
                    soft_wrap=True)
        return False
    if status == "running" and owner.startswith("cli:"):
        err().print(f"{ident} is claimed by hand by {visible(owner, multiline=False)}: no worker runs it, "
                    "so it has no log.", soft_wrap=True)
        return False
    if status == "pending":
        wait = "; waiting for a worker to start it (Ctrl-C stops)" if follow else ""
        err().print(f"{ident} is pending: no worker has run it yet, so it has no log{wait}. "
                    f"The worker writes its log to {where} when it runs it.", soft_wrap=True)
    else:
        err().print(f"{ident} has no log yet ({status}); the worker writes it to {where} when it runs it.",
                    soft_wrap=True)
    return True


def print_log(task_id: str, tail: int | None, raw: bool) -> int:
    """Print a task's log (rendered, or raw), its last ``tail`` entries when given; returns the
    byte offset read up to (where --follow goes on; 0: it has no log yet)."""
    data, end = task_views.shown_log(task_id)
    if raw:
        lines = data.splitlines(keepends=True)
        write_raw(b"".join(lines if tail is None else lines[-tail:] if tail else []))
    else:
        entries = opencode_runner.render_log(data.decode("utf-8", errors="replace"))
        for entry in entries if tail is None else entries[-tail:] if tail else []:
            print_log_entry(entry)
    return end


STATUS_MARK = {"ok": ("ok  ", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "red")}


@cli.command()
@click.option("--live", is_flag=True, help="Also run a one-line prompt through the default model (costs a request).")
@json_option
def doctor(live: bool, as_json: bool) -> None:
    """Check the set-up: one line per part, ok / warn / fail, with the fix. Exit 1 on a fail.

    Python and packages, opencode and its version, the default model (listed; --live runs a
    prompt), the database, the worker and its schedule, the token file, a running MCP server,
    the reverse bridge's backend.
    """
    import doctor as checks  # the checks import the HTTP and reverse-bridge modules: only here
    results = checks.run_checks(live)
    failed = any(r.status == "fail" for r in results)
    if as_json:
        emit_json({"ok": not failed, "checks": [r.as_dict() for r in results]})
    else:
        for result in results:
            mark, style = STATUS_MARK[result.status]
            said = Text(f"{mark}  {result.name:<19}", style=style) + Text(visible(result.detail, multiline=False))
            if result.fix and result.status != "ok":
                said += Text(f"  → {visible(result.fix, multiline=False)}", style="dim")
            out().print(said, soft_wrap=True)
    if failed:
        sys.exit(1)


@cli.command()
@click.argument("query", required=False)
@click.option("--provider", help="Only this provider's models (for example anthropic).")
@click.option("--refresh", is_flag=True, help="Ask OpenCode again instead of using its answer from the last minute.")
@json_option
def models(query: str | None, provider: str | None, refresh: bool, as_json: bool) -> None:
    """List the models OpenCode offers here: provider, name, context, price, free.

    QUERY words must all appear in the id or name (as list_models searches). The last line names
    the model a task without one runs with, and where that choice comes from.
    """
    try:
        found = opencode_runner.known_models(provider, refresh=refresh, cache_file=task_views.models_cache_file())
    except (opencode_runner.OpencodeNotFound, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise CliError(f"cannot list OpenCode's models: {exc}") from None
    chosen = opencode_runner.search_models(found, query)
    default = default_model_choice()
    if as_json:
        return emit_json({"models": chosen, "total": len(chosen),
                          "default_model": default.model if default else None,
                          "default_from": default.source if default else None})
    if chosen:
        out().print(models_table(chosen))
    said = f"{len(chosen)} of {len(found)} model(s)" if query else f"{len(found)} model(s)"
    out().print(Text(said + (f"; tasks without a model run with {default.model} (from {default.source})"
                             if default else "; no default model: see docs/models.md"),
                     style="dim"), soft_wrap=True)


def default_model_choice() -> opencode_runner.ModelChoice | None:
    """The default model and its source, or None when there is none (OpenCode lists nothing)."""
    try:
        has_queue = task_store.backend() == "postgresql" or task_store.db_path().exists()
        stored = task_store.default_model() if has_queue else None   # models makes no queue
        return opencode_runner.default_model(stored, cache_file=task_views.models_cache_file())
    except (opencode_runner.NoDefaultModel, opencode_runner.OpencodeNotFound):
        return None


def models_table(models: list[dict[str, Any]]) -> Table:
    """One row per model: id, provider, name, context (tokens), price (USD per million tokens)."""
    table = Table()
    for name, opts in (("Model", {"no_wrap": True}), ("Provider", {}), ("Name", {"overflow": "fold"}),
                       ("Context", {"justify": "right"}), ("USD/M in / out", {"justify": "right"}), ("Free", {})):
        table.add_column(name, **opts)
    for model in models:
        cost = model.get("cost") or {}
        price = f"{cost.get('input', 0):g} / {cost.get('output', 0):g}" if cost else "-"
        table.add_row(line(model["id"]), line(model["provider"]), line(model["name"]),
                      Text(f"{model['context']:,}" if model.get("context") else "-"), Text(price),
                      Text("yes" if opencode_runner.is_free(model) else "", style="green"))
    return table


@cli.command()
@json_option
def status(as_json: bool) -> None:
    """Show the queue's counts, the last worker heartbeat and every worker on every host."""
    summary = task_store.queue_summary()
    workers = task_views.workers_state()
    worker = last_worker(workers)
    budget = task_store.budget_state()
    held, overdue = task_store.held_accounts(), task_store.overdue_tasks()
    if as_json:
        return emit_json(summary | {"worker": worker, "workers": workers, "db": task_store.database_label(),
                                    "budget": budget, "held_accounts": held, "start_overdue": overdue})
    out().print(fields_table(queue_rows(summary), title="Queue"))
    out().print(fields_table(budget_rows(budget), title="Spending"))
    out().print(fields_table(worker_rows(worker), title="Worker"))
    if len(workers) > 1:
        out().print(workers_table(workers))
    if budget["reason"]:
        err().print(Text(f"Nothing new is claimed: {budget['reason']}", style="yellow"), soft_wrap=True)
    for hold in held:
        err().print(Text(visible(f"Provider {hold['account']} is at its usage limit until {hold['until']} (paused: "
                                 f"{', '.join(hold['tasks'])}): its other tasks stay queued until then"),
                         style="yellow"), soft_wrap=True)
    for late in overdue:
        err().print(Text(visible(f"{late['id']}: {late['warning']}"), style="yellow"), soft_wrap=True)
    missing = missing_worker_line(worker)
    if missing:
        err().print(Text(missing, style="yellow"), soft_wrap=True)


def last_worker(workers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The queue's newest worker, judged (task_views.WorkerState): the first of ``workers``
    (``task_views.workers_state()``, read when not given), else the heartbeat file's."""
    workers = task_views.workers_state() if workers is None else workers
    return workers[0] if workers else task_views.worker_state()


def missing_worker_line(worker: dict[str, Any]) -> str | None:
    """What `status` (and `logs --follow` on a pending task) says when no worker runs the queue:
    ``worker`` (a WorkerState, see `last_worker`) never checked in, went silent or died mid-run;
    the line names how to start one. None while it runs."""
    if not worker["recent"] and worker["pid_running"] is None and worker["seen"]:
        return (f"The worker on {worker.get('host')} has not checked in for over "
                f"{task_views.WORKER_ELSEWHERE_SILENT_SEC} s (it said: {worker.get('state')}): is it still "
                "running there?")
    if not worker["recent"]:
        run = worker_command()
        return ("No worker is running this queue: the worker has not checked in recently (is its launchd agent / "
                f"systemd timer running?); {run} --watch starts one, {run} runs one pass by hand")
    if worker["died"]:
        return (f"The worker (pid {worker.get('pid')}) that wrote this heartbeat is gone: "
                f"{task_views.gone_words(worker)}. {worker_command()} --watch starts one, "
                f"{worker_command()} runs one pass.")
    return None


def queue_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """Counts per status, claimable, the oldest pending task."""
    rows: list[tuple[str, Any]] = [("database", task_store.database_label())]
    rows += [(s, str(n)) for s, n in summary["counts"].items()]
    rows.append(("claimable now", str(summary["claimable"])))
    if summary["oldest_pending"]:
        rows.append(("oldest pending", f"{summary['oldest_pending']} ({age(summary['oldest_pending_age_sec'])})"))
    return rows


def money(usd: float | None) -> str:
    """An amount in USD as a person reads it; ``none`` for no limit."""
    return "none" if usd is None else f"${usd:,.4f}"


def budget_rows(budget: dict[str, Any]) -> list[tuple[str, Any]]:
    """Today's spend against the daily budget, and the default task limits (task_store.budget_state)."""
    daily = money(budget["daily_usd"])
    token_limit = f" of {budget['daily_tokens']:,}" if budget["daily_tokens"] else ""
    rows: list[tuple[str, Any]] = [
            ("spent today", f"{money(budget['spent_usd'])} of {daily} ({budget['spent_tokens']:,} tokens"
                            f"{token_limit}) on {budget['day']}"),
            ("resets", f"at local midnight ({budget['resets_at']})"),
            ("default task limit", money(budget["default_max_cost_usd"])
             + (f", {budget['default_max_tokens']:,} tokens" if budget["default_max_tokens"] else ""))]
    if budget["reason"]:
        rows.append(("claims", Text("nothing new: " + budget["reason"], style="yellow")))
    return rows


def workers_table(workers: list[dict[str, Any]]) -> Table:
    """One row per worker that reported (task_views.workers_state): host, pid, label, state, its
    tasks, the heartbeat's age."""
    table = Table(title="Workers (every host)", title_justify="left")
    for name in ("Host", "Pid", "Worker", "State", "Tasks", "Heartbeat"):
        table.add_column(name)
    for worker in workers:
        # A worker gone or stopped runs nothing now: its state and tasks are what it said last (a stale
        # one keeps its tasks: it may still run them).
        state, tasks, had = worker["state"] or "-", ", ".join(worker["tasks"]), ", ".join(worker["last_tasks"])
        if worker["gone_since"]:
            state, tasks = f"was {state}", f"none now (had {had})" if had else ""
        table.add_row(line(worker["host"]), Text(str(worker["pid"])), worker_label_text(worker, short=True),
                      line(state), line(tasks or "-"), Text(age(worker["age_sec"])))
    return table


def worker_label_text(worker: dict[str, Any], short: bool = False) -> Text:
    """The worker's one-word label (task_views.worker_label), styled; for one gone or stopped the
    time of its last heartbeat: ``gone since 15:01:24`` in local time (``short``, `local_clock`),
    else ISO UTC with how long ago; for a stale one how long it has been silent: ``stale: not heard
    from for 45 s`` (it may still run its tasks)."""
    said = worker["label"]
    if worker.get("gone_since"):
        since = worker["gone_since"]
        said += f" since {local_clock(since)}" if short else f" since {since} ({ago(since)})"
    elif worker["label"] == "stale" and worker.get("age_sec") is not None:
        said += f": not heard from for {worker['age_sec']:.0f} s"
    return Text(said, style=WORKER_LABEL_STYLE.get(worker["label"], ""))


def local_clock(value: str) -> str:
    """An ISO time from the store as this machine's local wall clock, as the worker's and serve's
    lines stamp theirs: ``15:01:24`` today, ``2025-01-01 15:01:24`` another day."""
    stamp = parse_time(value)
    if stamp is None:
        return "-"
    here = stamp.astimezone()
    day = "" if here.date() == datetime.now().astimezone().date() else f"{here:%Y-%m-%d} "
    return f"{day}{here:%H:%M:%S}"


WORKER_LABEL_STYLE = {"online": "green", "stale": "yellow", "gone": "red", "stopped": "dim"}


ENGINE_WORDS = {"cold": "cold: an `opencode run` per attempt",
                "warm": "warm: a kept `opencode serve` per slot (WORKER_ENGINE=1)"}


def worker_rows(worker: dict[str, Any]) -> list[tuple[str, Any]]:
    """The judged heartbeat (task_views.worker_state) in words: the worker's one-word label with
    its pid and host, what its process is, what it runs, its heartbeat's age; the worker's own
    extra fields (an ``error``) last."""
    if not worker["seen"]:
        return [("worker", "never seen: no worker pass has run against this queue")]
    label = worker_label_text(worker)
    label.append(f", pid {worker['pid']} on {worker.get('host') or 'this host'}")
    return [("worker", label), ("process", worker_process_words(worker)), ("runs", worker_runs_words(worker)),
            ("slots", worker.get("slots")), ("engine", ENGINE_WORDS.get(str(worker.get("engine")), "not said")),
            ("started", when(worker.get("started_at"))),
            ("heartbeat", f"{age(worker['age_sec'])} ({worker['at']})")] + list(worker["extra"].items())


def worker_process_words(worker: dict[str, Any]) -> str:
    """Whether the heartbeat's process still runs, as a person reads it (never a Python bool)."""
    if worker["pid_running"] is None:
        return f"on another host ({worker.get('host')}): not checked from here"
    if worker["died"]:
        return f"gone: {task_views.gone_words(worker)}"
    return "running" if worker["pid_running"] else "ended"


def worker_runs_words(worker: dict[str, Any]) -> str:
    """What the worker does: its tasks, or its state when it runs none (a stale worker's: what it
    may still run); for one gone or stopped nothing now, and what it said when last seen."""
    if worker.get("gone_since"):
        had = ", ".join(worker.get("last_tasks") or [])
        last = f"{had} ({worker.get('state') or 'no state'})" if had else f"no task ({worker.get('state') or 'idle'})"
        return f"nothing now; when last seen ({worker['gone_since']}): {last}"
    tasks = worker.get("tasks") or ([worker["task"]] if worker.get("task") else [])
    if tasks:
        return ", ".join(tasks) + (f" ({worker['state']})" if worker.get("state") else "")
    return f"no task ({worker.get('state') or 'idle'})"


@cli.group(cls=TaskGroup)
def budget() -> None:
    """Spending: today's spend and the daily budget (show), set it and the default task limits
    (set), raise one task's limit and resume it when it is paused there (raise).

    The daily budget is metered per local calendar day: it resets at local midnight.
    """


@budget.command("show")
@json_option
def budget_show(as_json: bool) -> None:
    """Show today's spend, the daily budget, the default task limits and whether claims stopped."""
    state = task_store.budget_state()
    if as_json:
        return emit_json(state)
    out().print(fields_table(budget_rows(state), title="Spending"))


@budget.command("set")
@click.option("--daily", "daily_usd", type=task_spec.USD.click_type(lo=0),
              help="USD the whole queue may spend per local day (0 removes the budget).")
@click.option("--daily-tokens", type=task_spec.TOKENS.click_type(lo=0),
              help="Tokens the queue may use per local day (0 removes).")
@click.option("--default-max-cost", "default_max_cost_usd", type=task_spec.USD.click_type(lo=0),
              help="USD limit a new task gets when it names none (0 removes).")
@click.option("--default-max-tokens", type=task_spec.TOKENS.click_type(lo=0),
              help="Token limit a new task gets when it names none (0 removes).")
@json_option
def budget_set(daily_usd: float | None, daily_tokens: int | None, default_max_cost_usd: float | None,
               default_max_tokens: int | None, as_json: bool) -> None:
    """Set the daily budget and the default task limits; options left out stay as they are."""
    given = {"daily_usd": daily_usd, "daily_tokens": daily_tokens,
             "default_max_cost_usd": default_max_cost_usd, "default_max_tokens": default_max_tokens}
    if all(v is None for v in given.values()):
        raise click.UsageError("give at least one of --daily, --daily-tokens, --default-max-cost, --default-max-tokens")
    state = task_store.set_budget(**{k: v for k, v in given.items() if v is not None})
    if as_json:
        return emit_json(state)
    out().print(fields_table(budget_rows(state), title="Spending"))


class NegativeAmountCommand(QueueCommand):
    """A command whose argument is an amount: click takes a negative one ("-5") for an unknown
    option ("No such option '-5'"); here it reaches the amount's own check, which says what is
    allowed. A mistyped option, with no negative number beside it, is still click's to refuse."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.ignore_unknown_options = any(NEGATIVE_AMOUNT.fullmatch(arg) for arg in args)
        return super().parse_args(ctx, args)


NEGATIVE_AMOUNT = re.compile(r"-\$?(\d[\d,_]*(\.\d*)?|\.\d+)")


@budget.command("raise", cls=NegativeAmountCommand)
@click.argument("task_id", callback=task_id_arg)
@click.argument("usd", required=False, callback=usd_arg)
@click.option("--tokens", "max_tokens", type=task_spec.TOKENS.click_type(), help="The new token limit.")
@json_option
def budget_raise(task_id: str, usd: float | None, max_tokens: int | None, as_json: bool) -> None:
    """Raise TASK_ID's limit to USD (or --tokens N); a task paused at its limit resumes its session."""
    task = task_store.raise_limit(task_id, max_cost_usd=usd, max_tokens=max_tokens, author=person())
    if as_json:
        return emit_json(task)
    said = f"{task['id']}: limit now {money(task['max_cost_usd'])}" + (
        f", {task['max_tokens']:,} tokens" if task["max_tokens"] else "")
    out().print(Text(said + (f"; it is {task['status']} and resumes its session" if task["status"] == "pending"
                             and task.get("answer") else f"; it is {task['status']}"), style="green"))


@cli.command()
@click.option("--since", type=task_spec.int_range(0, task_store.MAX_ID),
              help="Events after this event id (default: the most recent ones).")
@click.option("--limit", type=task_spec.int_range(1, 10_000), default=50, show_default=True,
              help="At most this many events.")
@json_option
def events(since: int | None, limit: int, as_json: bool) -> None:
    """Show the queue's event log (every state change), oldest first."""
    rows = task_store.latest_events(limit) if since is None else task_store.events_since(since, limit=limit)
    if as_json:
        return emit_json(rows)
    if rows:
        out().print(events_table(rows))
    out().print(Text(f"next: --since {rows[-1]['id']}" if rows else "no events", style="dim"))


@cli.command()
@click.option("--port", type=task_spec.int_range(1, 65535), envvar="PORT",
              help="The port ./install.sh serves on, for the HTTP snippets (default: the port of the TaskBridge "
                   "serving this queue now, else 8765).")
@click.option("--public-url", help="The public https://host of your tunnel, for claude.ai / ChatGPT connectors.")
@click.option("--write-claude-desktop", is_flag=True,
              help="Merge the taskbridge entry into Claude Desktop's config (other servers kept, backup made).")
def connect(port: int | None, public_url: str | None, write_claude_desktop: bool) -> None:
    """Print how each MCP client connects: Claude Desktop and Code, Cursor, VS Code, Codex, Gemini, OpenCode,
    claude.ai, ChatGPT."""
    import connectors
    if port is None:
        serving = task_store.served_by()
        port = serving[1] if serving else 8765
    if public_url and not re.fullmatch(r"https://[A-Za-z0-9.-]+(:[0-9]+)?/?", public_url):
        raise click.BadParameter("give the tunnel's base URL, like https://abc.trycloudflare.com",
                                 param_hint="--public-url")
    click.echo(connectors.snippets(port, public_url))
    hosted = task_views.hosted_model_note(ask=True)
    if hosted:
        err().print(Text(f"Note: {visible(hosted)}", style="yellow"), soft_wrap=True)
    if write_claude_desktop:
        try:
            path, backup = connectors.write_claude_desktop()
        except (ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        err().print(f"Claude Desktop: added taskbridge to {path}" + (f" (backup: {backup})" if backup else "")
                    + "; restart Claude Desktop.", markup=False, highlight=False)


def main() -> None:
    """Entry point: ``.venv/bin/python tasks_cli.py``."""
    cli(prog_name=CLI)   # click's usage lines and "Try ... -h" name the command that works too


if __name__ == "__main__":
    main()
