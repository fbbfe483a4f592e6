"""Everything about invoking the `opencode` binary and reading what it prints.

Shared by `worker.py` (runs tasks) and `opencode_bridge_mcp.py` (lists models): the command line
of `opencode run`, its environment (run marker, permissions), the JSON event stream parser
(`--format json`, one object per line: step_start, text, tool_use, step_finish, error), the
receipt-block parser, and `opencode models`.

Env read at call time: ``OPENCODE_BIN`` (default ``opencode`` on PATH), ``OPENCODE_CONFIG_CONTENT``
(merged, never replaced), ``OPENCODE_AUTO_SHARE`` (dropped: sharing is always off).

No SQL here; imports the standard library only.
"""
from __future__ import annotations

import contextlib
import difflib
import email.utils
import fcntl
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import knobs
from task_store import AGENT_NAME, flock_wait, shown_value, validate_provider, validate_working_dir, write_private

MARKER_ENV = "TASKBRIDGE_RUN"
QUEUE_ENV = "TASKBRIDGE_QUEUE"

# What each permission asks of OpenCode's permission config ("edit" covers every file-writing tool:
# write, edit, patch). How each restriction is enforced, and labelled, is agent_box's business.
PERMISSION_RULES: dict[str, dict[str, str]] = {
    "auto": {},
    "readonly": {"edit": "deny"},
    "no-shell": {"bash": "deny"},
    "no-network": {"webfetch": "deny", "websearch": "deny"},
}
# OpenCode's agents that exist without any config (build and plan are primary; the rest are
# sub-agents the task tool can start).
NATIVE_AGENTS = ("build", "plan", "general", "explore")
# Files a project's OpenCode config can come from, looked up from the run's folder upwards.
PROJECT_CONFIG_FILES = ("opencode.json", "opencode.jsonc", ".opencode/opencode.json",
                        ".opencode/opencode.jsonc")
# OpenCode adds this line to a project config that lacks it, the first time it loads it.
SCHEMA_LINE = '{\n  "$schema": "https://opencode.ai/config.json",'


class OpencodeNotFound(RuntimeError):
    """The `opencode` binary cannot be found (set OPENCODE_BIN or fix PATH)."""


class ConfigProblem(RuntimeError):
    """OpenCode's configuration keeps a task from running as labelled; retrying cannot help."""


def opencode_bin() -> str:
    """The absolute path of the opencode binary: ``$OPENCODE_BIN``, else ``opencode`` on PATH,
    else the pinned copy install.sh put in ``<repo>/node_modules`` (one copy, which the tests
    drive too).

    Raises OpencodeNotFound with a message naming PATH and OPENCODE_BIN (launchd's PATH is bare).
    """
    wanted = os.environ.get("OPENCODE_BIN") or "opencode"
    found = shutil.which(wanted)
    if not found and not os.environ.get("OPENCODE_BIN"):
        found = shutil.which(str(Path(__file__).resolve().parent / "node_modules" / ".bin" / "opencode"))
    if not found:
        raise OpencodeNotFound(
            f"opencode binary {wanted!r} not found (PATH={os.environ.get('PATH', '')}); run ./install.sh "
            "(it pins opencode in node_modules/), or set OPENCODE_BIN to its absolute path"
        )
    return found


def run_command(model: str, marker: str, *, session_id: str | None = None,
                agent: str | None = None) -> list[str]:
    """argv of one headless run: ``opencode run --auto --format json -m MODEL --title MARKER
    --print-logs --log-level WARN`` (plus ``-s SESSION`` to resume, ``--agent`` when given). The
    prompt goes on stdin. The ERROR log lines on stderr carry the cause an ``error`` event hides
    behind "Unexpected server error" (see `logged_errors`); the WARN ones name the MCP servers
    OpenCode gave up on (see `mcp_unavailable`), which the event stream never mentions."""
    argv = [opencode_bin(), "run", "--auto", "--format", "json", "-m", model, "--title", marker,
            "--print-logs", "--log-level", "WARN"]
    if session_id:
        argv += ["-s", session_id]
    if agent:
        argv += ["--agent", agent]
    return argv


class UnknownName(ValueError):
    """A skill, sub-agent or agent OpenCode does not offer here; the message names those it
    offers, ``option`` the CLI option that gave it (``--skill``, ``--subagent``, ``--agent``)."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


def offered_skills(cwd: str, timeout_sec: float = 60) -> list[str]:
    """The names of the skills OpenCode offers for a run in ``cwd`` (``opencode debug skill``:
    built-in, global, project and external skill folders), asked as `own_call` asks, cached like
    `known_models`. Raises OpencodeNotFound, or RuntimeError with OpenCode's message."""
    def run() -> list[str]:
        with own_call(cwd) as (hook, where):
            argv, env = hook([opencode_bin(), "debug", "skill"], dict(os.environ))
            try:
                proc = subprocess.run(argv, cwd=where, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                      text=True, timeout=timeout_sec, start_new_session=True)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"`opencode debug skill` did not answer in {timeout_sec:g} s") from None
        start = proc.stdout.find("[")
        try:
            if proc.returncode == 0 and start >= 0:
                return [str(item.get("name")) for item in json.loads(proc.stdout[start:]) if isinstance(item, dict)]
        except ValueError:
            pass
        raise RuntimeError(opencode_error(proc, "opencode debug skill"))
    return _cached("skills " + _setup_key(os.path.abspath(cwd)), run, False, None)


NATIVE_PRIMARY = ("build", "plan")   # OpenCode's own primary agents


def offered_agents(cwd: str) -> list[str]:
    """The agents a task may run as (``--agent``) in ``cwd``: OpenCode's native primary agents
    (build, plan) and every agent of the resolved config (`own_config`) whose mode is primary or
    all, or says none (OpenCode's default), and not disabled. Raises ConfigProblem /
    OpencodeNotFound."""
    return _agents_of_modes(cwd, list(NATIVE_PRIMARY), ("primary", "all", None))


def offered_subagents(cwd: str) -> list[str]:
    """The agents the task tool can start in ``cwd``: OpenCode's native sub-agents (general,
    explore) and every agent of the resolved config (`own_config`) whose mode is subagent or all
    (and not disabled). Raises ConfigProblem / OpencodeNotFound."""
    return _agents_of_modes(cwd, ["general", "explore"], ("subagent", "all"))


def _agents_of_modes(cwd: str, native: list[str], modes: tuple[str | None, ...]) -> list[str]:
    found = list(native)
    for name, block in (own_config(cwd).get("agent") or {}).items():
        block = block if isinstance(block, dict) else {}
        if block.get("disable"):
            found = [n for n in found if n != name]
        elif block.get("mode") in modes and name not in found:
            found.append(name)
    return found


@contextlib.contextmanager
def own_call(cwd: str | None, provider_keys: bool = False) -> Iterator[tuple[Callable[..., Any], str]]:
    """How TaskBridge's own OpenCode call that reads configuration runs (``debug config``,
    ``debug skill``, ``models``): yields ``(hook, where)``, ``where`` the folder to run in
    (``cwd``, or an empty folder of its own when ``cwd`` is None) and ``hook`` the
    ``(argv, env) -> (argv, env)`` to run the call through: the box of a readonly run there
    (agent_box.call_box) when runs are boxed here, else the environment alone
    (agent_box.call_env). OpenCode loads the plugins of the project folder and of the
    configuration its data folder names (an account's, a ``wellknown`` entry's); a run may have
    written the first (an in-place task's folder), so its code runs boxed, with none of
    TaskBridge's secrets, and the box keeps its data apart from the runs' (agent_box.calls_home:
    the calls with ``provider_keys`` apart from those in a project), one call at a time
    (agent_box.calls_lock). ``provider_keys``: see call_env; only for a call in no project
    (``cwd`` None). Raises RuntimeError for a bad TASKBRIDGE_SANDBOX / BWRAP_BIN knob."""
    import agent_box  # here, not at the top: agent_box imports this module
    with agent_box.scratch("ask-") as scratch:
        try:
            kind = "models" if provider_keys else "config"
            box = agent_box.call_box(Path(scratch), cwd, provider_keys=provider_keys, home=agent_box.calls_home(kind))
        except agent_box.BoxSettingError as exc:
            raise RuntimeError(str(exc)) from None
        where = cwd or str(Path(scratch) / "cwd")
        os.makedirs(where, exist_ok=True)
        with agent_box.calls_lock(kind) if box else contextlib.nullcontext():
            yield box or (lambda argv, env: (argv, agent_box.call_env(env, where, provider_keys))), where


def own_config(cwd: str | None, timeout_sec: float = 60) -> dict[str, Any]:
    """`resolved_config` for a run in ``cwd`` (None: outside any project), asked as `own_call`
    asks. Raises ConfigProblem / OpencodeNotFound, RuntimeError for a bad box knob."""
    with own_call(cwd) as (hook, where):
        return resolved_config(dict(os.environ), where, timeout_sec, box=hook)


def check_names(skills: list[str], subagents: list[str], cwd: str, agent: str | None = None) -> None:
    """Refuse skills, sub-agents and an agent OpenCode does not offer for a run in ``cwd`` (an
    unknown agent: OpenCode would run the default one and say so only in its log). Raises
    task_store.ValidationError for a ``cwd`` no task may run in, checked first (OpenCode loads
    the folder's plugins to answer, and the box shows the folder it is asked about); UnknownName
    naming the missing ones and what is offered; OpencodeNotFound, RuntimeError or ConfigProblem
    when OpenCode cannot be asked."""
    # OpenCode's own are always there (no call to OpenCode for them); a name no agent can have is
    # the store's to refuse, in its words.
    agent = None if agent in NATIVE_PRIMARY or not AGENT_NAME.fullmatch(agent or "") else agent
    if skills or subagents or agent:
        cwd = validate_working_dir(cwd)
    for kind, option, wanted, offered in (("skill", "--skill", skills, offered_skills),
                                          ("sub-agent", "--subagent", subagents, offered_subagents),
                                          ("agent", "--agent", [agent] if agent else [], offered_agents)):
        if not wanted:
            continue
        have = offered(cwd)
        missing = list(dict.fromkeys(name for name in wanted if name not in have))
        if missing:
            named = ", ".join(shown_value(m) for m in missing[:5]) + (f" and {len(missing) - 5} more"
                                                                     if len(missing) > 5 else "")
            raise UnknownName(f"{kind} {named} is not offered by OpenCode for "
                              f"{cwd} (offered: {', '.join(have) or 'none'}); add it to OpenCode's config "
                              f"or leave it out", option)


# For TaskBridge's own OpenCode calls outside the agent's box in a folder an agent wrote (export
# and import of a session): no project config and no `.opencode/` folders, whose plugins are code
# OpenCode would run here, out of the box.
NO_PROJECT_CODE = {"OPENCODE_DISABLE_PROJECT_CONFIG": "1"}


class SessionCopyFailed(RuntimeError):
    """An OpenCode session could not be exported or imported (the message quotes OpenCode)."""


def export_session(session_id: str, cwd: str, env: dict[str, str] | None = None,
                   timeout_sec: float = 60, box: Any = None) -> dict[str, Any]:
    """OpenCode's own record of a session (``opencode export ID``): ``{"info": {...},
    "messages": [{"info": {"role", "time": {"created": ms}, ...}, "parts": [...]}]}``. ``box``:
    ``(argv, env) -> (argv, env)`` running it in the agent's box (agent_box.call_box: boxed
    runs' sessions are in the box's data folder, which only a box may read; ``cwd`` is then the
    box's). Raises SessionCopyFailed quoting OpenCode (an unknown id, say)."""
    run_env = {**(env if env is not None else os.environ), "PWD": cwd, **NO_PROJECT_CODE}
    argv = [opencode_bin(), "export", session_id]
    if box is not None:
        argv, run_env = box(argv, run_env)
    proc = subprocess.run(argv, cwd=cwd, env=run_env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_sec)
    start = proc.stdout.find("{")
    try:
        if proc.returncode == 0 and start >= 0:
            data = json.loads(proc.stdout[start:])
            if isinstance(data, dict) and isinstance(data.get("messages"), list):
                return data
    except ValueError:
        pass
    raise SessionCopyFailed(f"opencode export {session_id}: {opencode_error(proc, 'opencode export')}")


TURN_TEXT_MAX = 8_000     # characters of one turn's text in a transcript
TOOL_OUTPUT_MAX = 1_000   # characters of one tool call's output in a transcript
TOOLS_PER_TURN = 20       # tool calls listed per turn; one more entry counts the rest


def session_turns(export: dict[str, Any]) -> list[dict[str, Any]]:
    """A session export as readable turns, oldest first: ``{"role": "user" | "assistant", "at":
    ISO UTC | None, "text": the message's text parts (≤ TURN_TEXT_MAX characters, a clipped one
    says so), "tools": [{"tool", "status", "title", "output"}] (output ≤ TOOL_OUTPUT_MAX; at most
    TOOLS_PER_TURN calls, then one ``omitted`` entry counting the rest)}``.
    OpenCode's synthetic parts (step markers, snapshots) are left out."""
    turns = []
    for message in export.get("messages") or []:
        info = _dict(message.get("info"))
        texts, tools = [], []
        for part in message.get("parts") or []:
            part = _dict(part)
            if part.get("type") == "text" and not part.get("synthetic"):
                texts.append(str(part.get("text") or ""))
            elif part.get("type") == "tool":
                tools.append(_turn_tool(part))
        created = _dict(info.get("time")).get("created")
        turns.append({"role": str(info.get("role") or "?"),
                      "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created / 1000))
                      if isinstance(created, (int, float)) else None,
                      "text": clip_turn("\n\n".join(t.strip() for t in texts if t.strip()), TURN_TEXT_MAX),
                      "tools": cap_tools(tools)})
    return turns


def cap_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most TOOLS_PER_TURN tool calls, then one ``omitted`` entry saying how many more."""
    if len(tools) <= TOOLS_PER_TURN:
        return tools
    more = len(tools) - TOOLS_PER_TURN
    return tools[:TOOLS_PER_TURN] + [{"tool": "…", "status": "omitted", "title": f"{more:,} more tool calls "
                                      "(the task log has them all)", "output": None}]


def _turn_tool(part: dict[str, Any]) -> dict[str, Any]:
    state = _dict(part.get("state"))
    entry = _render_tool({**part, "state": state})
    output = state.get("output") if state.get("status") == "completed" else state.get("error")
    return {"tool": entry.get("tool"), "status": entry.get("status"), "title": entry.get("title"),
            "output": clip_turn(str(output), TOOL_OUTPUT_MAX) if output is not None else None}


def clip_turn(text: str, limit: int) -> str:
    """``text`` cut at ``limit`` characters, saying how many more there were."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"… [{len(text) - limit:,} more characters]"


# OpenCode's ids: a prefix, 12 hex digits of time (they sort by it) and 14 random characters.
_OPENCODE_ID = re.compile(r"\b(?:ses|msg|prt)_[0-9a-f]{12}[A-Za-z0-9]{14}\b")
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _literally(replacement: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement that inserts ``replacement`` as it is (a path's backslashes are no escapes)."""
    return lambda _match: replacement


def copy_session(session_id: str, old_dir: str, new_dir: str, env: dict[str, str],  # noqa: PLR0913
                 timeout_sec: float = 120, box: Any = None, scratch: str | None = None,
                 source_box: Any = None, until: float | None = None) -> str:
    """A copy of OpenCode session ``session_id`` (its whole history) that lives in ``new_dir``;
    returns the copy's id. ``opencode run -s ID --fork`` forks only in the session's own folder
    (run from another worktree it hangs, measured with 1.18.33), so the session is exported
    (``opencode export``), given fresh session, message and part ids (same time prefix: the
    order is kept) and the new folder in place of ``old_dir``, and imported (``opencode import``).
    ``box``: ``(argv, env) -> (argv, env)`` running the import in the task's box (boxed runs'
    sessions are in their line's OpenCode folders, which only a box may read), with the file
    imported written in ``scratch``, a folder the box shows at its own path; ``source_box`` the
    export (in the box showing the origin's folders; default ``box``). ``until``: a time (epoch
    seconds) after which no message is copied (a fork of a task that a follow-up continued in the
    same session copies the task's turns, not the follow-up's). Raises SessionCopyFailed quoting
    OpenCode."""
    run_env = {**env, "PWD": new_dir, **NO_PROJECT_CODE}

    def boxed(argv: list[str], hook: Any = box) -> tuple[list[str], dict[str, str]]:
        return hook(argv, run_env) if hook is not None else (argv, run_env)

    argv, call_env = boxed([opencode_bin(), "export", session_id], source_box or box)
    proc = subprocess.run(argv, cwd=new_dir, env=call_env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_sec)
    start = proc.stdout.find("{")
    if proc.returncode != 0 or start < 0:
        raise SessionCopyFailed(f"opencode export {session_id}: {opencode_error(proc, 'opencode export')}")
    text = proc.stdout[start:]
    if until is not None:
        text = _messages_until(text, until, session_id)
    fresh: dict[str, str] = {}

    def renamed(match: re.Match) -> str:
        old = match.group(0)
        if old not in fresh:
            fresh[old] = old[:16] + "".join(_ID_ALPHABET[b % 62] for b in os.urandom(14))
        return fresh[old]

    text = _OPENCODE_ID.sub(renamed, text)
    for old, new in ((old_dir, new_dir), (json.dumps(old_dir)[1:-1], json.dumps(new_dir)[1:-1])):
        text = re.sub(re.escape(old) + r"(?![\w.\-])", _literally(new), text)
    try:
        json.loads(text)
    except ValueError as exc:
        raise SessionCopyFailed(f"opencode export {session_id} printed no JSON ({exc})") from None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, dir=scratch) as handle:
        handle.write(text)
    try:
        argv, call_env = boxed([opencode_bin(), "import", handle.name])
        proc = subprocess.run(argv, cwd=new_dir, env=call_env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_sec)
    finally:
        os.unlink(handle.name)
    if proc.returncode != 0 or session_id not in fresh:
        raise SessionCopyFailed(f"opencode import: {opencode_error(proc, 'opencode import')}")
    return fresh[session_id]


def _messages_until(text: str, until: float, session_id: str) -> str:
    """The export ``text`` without the messages OpenCode created after ``until`` (epoch seconds;
    a message's ``info.time.created`` is in milliseconds). Raises SessionCopyFailed for an export
    that is no JSON object."""
    try:
        export = json.loads(text)
    except ValueError as exc:
        raise SessionCopyFailed(f"opencode export {session_id} printed no JSON ({exc})") from None
    if not isinstance(export, dict) or not isinstance(export.get("messages"), list):
        return text

    def created(message: Any) -> float:
        stamp = _dict(_dict(_dict(message).get("info")).get("time")).get("created")
        return stamp if isinstance(stamp, (int, float)) else 0

    export["messages"] = [m for m in export["messages"] if created(m) <= until * 1000]
    return json.dumps(export)


_LOGGED_ERROR = re.compile(r'\blevel=ERROR\b.*?\berror="((?:[^"\\]|\\.)*)"')
_MODEL_MISSING = re.compile(r"ProviderModelNotFoundError|Model not found", re.IGNORECASE)


def logged_errors(stderr_lines: list[str]) -> list[str]:
    """OpenCode's own error messages from the ERROR log lines a run prints on stderr
    (``... level=ERROR ... error="ProviderModelNotFoundError: Model not found: x/y."``), in order,
    each once: the cause behind an ``UnknownError: Unexpected server error`` event."""
    found = [m.group(1).replace('\\"', '"') for line in stderr_lines if (m := _LOGGED_ERROR.search(line))]
    return list(dict.fromkeys(found))


_MCP_DOWN = re.compile(r'^timestamp=(\S+) level=WARN\b.*\bmessage="server unavailable"(?P<rest>.*)$')


def mcp_unavailable(line: str) -> dict[str, Any] | None:
    """An MCP server OpenCode gave up on, from one ``--print-logs`` stderr line
    (``timestamp=… level=WARN … message="server unavailable" key=NAME type=local status=failed``):
    ``{"server", "type", "status", "at"}`` (``at``: Unix seconds, None if unreadable), or None.
    OpenCode waits for every configured MCP server before its first model call, so a silent one
    costs each run its connect timeout (measured: ~30 s more per run with 1.18.33)."""
    match = _MCP_DOWN.match(line.strip())
    if not match:
        return None
    fields = dict(re.findall(r'\b(key|type|status)=(\S+)', match.group("rest")))
    try:
        at = datetime.fromisoformat(match.group(1)).timestamp()
    except ValueError:
        at = None
    return {"server": fields.get("key", "?"), "type": fields.get("type"), "status": fields.get("status"), "at": at}


def model_missing(text: str) -> bool:
    """Whether OpenCode's error text says the model is not one it offers."""
    return bool(_MODEL_MISSING.search(text or ""))


def reply_path(control_file: str, suffix: str) -> str:
    """Where a plugin answers ``control_file`` (``<run>/control/NAME``): ``<run>/reply/NAME<suffix>``,
    the one folder of the run the agent's box lets OpenCode write (``replyPath`` in
    opencode_plugins/files.js)."""
    run = os.path.dirname(os.path.dirname(control_file))
    return os.path.join(run, "reply", os.path.basename(control_file) + suffix)


def run_env(base: dict[str, str], cwd: str, marker: str, queue: str, permission: str,
            agent: str | None = None, box: Any = None) -> dict[str, str]:
    """The environment of one run: ``PWD`` (OpenCode trusts it over the real cwd), the run marker
    and queue tag (inherited by every descendant, so a sweep can find stragglers), sharing off
    (``OPENCODE_DISABLE_SHARE=1`` and ``"share": "disabled"`` over every config: no session goes
    to OpenCode's public share service, whatever the user's or the repository's config says),
    OpenCode's own snapshots off (``"snapshot": false``: TaskBridge reads the changes from git;
    OpenCode would keep a git repository per task worktree in its data folder and snapshot the
    worktree into it at every step), and for a restricted task its rules
    pinned for every agent (see ``pin_rules``) inside ``OPENCODE_CONFIG_CONTENT`` (merged over
    the user's own content, never replacing it).

    A restricted task reads OpenCode's resolved config once (``opencode debug config``, ~1.5 s),
    in the agent's box when ``box`` is given (``box(argv, env) -> (argv, env)``: the worktree's
    own OpenCode plugins load there, and the agent wrote them). Raises ConfigProblem when the rules
    cannot be pinned or that config cannot be read.
    """
    env = dict(base)
    env["PWD"] = cwd
    env[MARKER_ENV] = marker
    env[QUEUE_ENV] = queue
    env.pop("OPENCODE_AUTO_SHARE", None)
    env["OPENCODE_DISABLE_SHARE"] = "1"
    content = _config_content(env)
    content["share"] = "disabled"
    content["snapshot"] = False
    env["OPENCODE_CONFIG_CONTENT"] = json.dumps(content)
    rules = PERMISSION_RULES[permission]
    if rules:
        content = pin_rules(content, resolved_config(env, cwd, box=box), rules, agent, permission)
        env["OPENCODE_CONFIG_CONTENT"] = json.dumps(content)
    return env


# The OpenCode plugins runs load (JavaScript files OpenCode itself runs; see each file's header).
PLUGIN_DIR = Path(__file__).resolve().parent / "opencode_plugins"
SPEND_GATE_ENV = "TASKBRIDGE_GATE"


def spend_gate_plugin() -> Path:
    """The OpenCode plugin (``spend_gate.js`` in opencode_plugins/) that holds each model call until
    the worker has metered the steps before it (see that file)."""
    return PLUGIN_DIR / "spend_gate.js"


def with_spend_gate(env: dict[str, str], gate_file: str) -> dict[str, str]:
    """``env`` with the spend gate loaded: its plugin appended to ``OPENCODE_CONFIG_CONTENT``'s
    ``plugin`` list (the user's own plugins stay) and ``TASKBRIDGE_GATE`` naming ``gate_file``,
    where the worker writes ``{"steps": n, "stop": reason | null}`` after each step."""
    return _with_plugin(env, spend_gate_plugin(), SPEND_GATE_ENV, gate_file)


NOTES_ENV = "TASKBRIDGE_NOTES"


def with_notes_courier(env: dict[str, str], notes_file: str) -> dict[str, str]:
    """``env`` with the note courier loaded (``notes_courier.js`` in opencode_plugins/, appended to
    ``OPENCODE_CONFIG_CONTENT``'s ``plugin`` list; the user's own plugins stay) and
    ``TASKBRIDGE_NOTES`` naming ``notes_file``, where the worker writes the task's undelivered
    notes ``{"notes": [{"id", "author", "text"}]}``; the plugin acknowledges in
    ``<notes_file>.ack``."""
    return _with_plugin(env, PLUGIN_DIR / "notes_courier.js", NOTES_ENV, notes_file)


RULES_ENV = "TASKBRIDGE_RULES"


def with_permission_rules(env: dict[str, str], rules_file: str) -> dict[str, str]:
    """``env`` with the permission-rules plugin loaded (``permission_rules.js`` in opencode_plugins/,
    appended to ``OPENCODE_CONFIG_CONTENT``'s ``plugin`` list) and ``TASKBRIDGE_RULES`` naming
    ``rules_file`` (``{"rules": the task's rules, "once": [{"tool", "subject"}]}``); a call that
    matches an ``ask`` rule is written to ``<rules_file>.ask`` and failed (status "held" in the
    stream, RULES_REFUSALS), and the session's next model call is held until the worker ends the
    run."""
    return _with_plugin(env, PLUGIN_DIR / "permission_rules.js", RULES_ENV, rules_file)


def _with_plugin(env: dict[str, str], plugin: Path, variable: str, file: str) -> dict[str, str]:
    """A copy of ``env`` with ``plugin`` appended to ``OPENCODE_CONFIG_CONTENT``'s ``plugin`` list
    (the user's own plugins stay) and ``variable`` naming ``file``. Raises ConfigProblem."""
    env = dict(env)
    content = _config_content(env)
    listed = content.get("plugin")
    plugins = listed if isinstance(listed, list) else []
    content["plugin"] = [*plugins, plugin.as_uri()]
    env["OPENCODE_CONFIG_CONTENT"] = json.dumps(content)
    env[variable] = file
    return env


def _config_content(env: dict[str, str]) -> dict[str, Any]:
    try:
        content = json.loads(env.get("OPENCODE_CONFIG_CONTENT") or "{}")
    except ValueError:
        raise ConfigProblem("OPENCODE_CONFIG_CONTENT is not valid JSON; fix or unset it") from None
    if not isinstance(content, dict):
        raise ConfigProblem("OPENCODE_CONFIG_CONTENT is not a JSON object; fix or unset it")
    return content


def resolved_config(env: dict[str, str], cwd: str, timeout_sec: float = 60, box: Any = None) -> dict[str, Any]:
    """OpenCode's own view of its merged config for a run in ``cwd`` with ``env``
    (``opencode debug config``: global, ``OPENCODE_CONFIG``, project files, agent folders, inline
    content, in OpenCode's order); ``box`` as in ``run_env``. Raises ConfigProblem with OpenCode's
    message when it fails."""
    argv, env = box([opencode_bin(), "debug", "config"], env) if box else ([opencode_bin(), "debug", "config"], env)
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_sec, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise ConfigProblem(f"`opencode debug config` did not answer in {timeout_sec:g} s") from None
    start = proc.stdout.find("{")
    try:
        if proc.returncode == 0 and start >= 0:
            return json.loads(proc.stdout[start:])
    except ValueError:
        pass
    lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip()]
    said = environment_fault(lines) or opencode_error(proc, "opencode debug config")
    raise ConfigProblem(f"cannot read OpenCode's resolved config (`opencode debug config` exited "
                        f"{proc.returncode}: {said})")


def pin_rules(content: dict[str, Any], resolved: dict[str, Any], rules: dict[str, str],
              agent: str | None, permission: str) -> dict[str, Any]:
    """``content`` (the inline config) with ``rules`` pinned globally and for every agent.

    OpenCode evaluates an agent's permissions as defaults, then the global block, then the agent's
    own block, and the LAST matching rule wins; configs are deep-merged, so a key that already
    exists keeps its place. A user agent whose block says ``{"bash": "deny", "*": "allow"}`` would
    keep bash allowed if we only set ``bash``. Each rule is therefore added under a key the block
    does not have yet (``bash``, else an equivalent wildcard such as ``bas?``), which lands last.
    Every agent in ``resolved`` (user agents, markdown agents, sub-agents the task tool can start)
    and OpenCode's native ones is pinned; then the result is checked rule by rule.
    Raises ConfigProblem naming the agent and the rule when a rule would not be the last word.
    """
    content = json.loads(json.dumps(content))
    agents = dict.fromkeys([*NATIVE_AGENTS, *((resolved.get("agent") or {}).keys())])
    if agent and agent not in agents:
        raise ConfigProblem(f"agent {agent!r} is not defined in OpenCode's config for this folder "
                            f"(known: {', '.join(agents)}); a {permission} task cannot pin its rules "
                            "for it; define it or drop --agent")
    targets = [(content, resolved.get("permission"), "the global permission block")]
    for name in agents:
        block = ((resolved.get("agent") or {}).get(name) or {})
        if block.get("disable"):
            continue
        slot = content.setdefault("agent", {}).setdefault(name, {})
        if not isinstance(slot, dict):
            raise ConfigProblem(f"OPENCODE_CONFIG_CONTENT's agent.{name} is not an object")
        targets.append((slot, block.get("permission"), f"agent {name!r}"))
    for slot, existing, where in targets:
        slot["permission"] = _pinned_block(slot.get("permission"), existing, rules)
        final = _merged_block(existing, slot["permission"])
        for key, action in rules.items():
            if _last_action(final, key) != action:
                raise ConfigProblem(f"cannot pin {key}={action} for {where} in OpenCode's config (a "
                                    f"{permission} task); simplify that agent's permission block or "
                                    "run the task with permission auto")
    return content


def _pinned_block(ours: Any, existing: Any, rules: dict[str, str]) -> dict[str, Any]:
    block: dict[str, Any] = dict(ours) if isinstance(ours, dict) else {}
    if isinstance(existing, str) and "*" not in block:
        block["*"] = existing  # an object replaces a bare action when configs merge: keep its word
    taken = set(existing) if isinstance(existing, dict) else set()
    for key, action in rules.items():
        alias = next(k for k in _aliases(key) if k not in taken)
        block.pop(alias, None)
        block[alias] = action
    return block


def _aliases(key: str) -> list[str]:
    """Permission names that match exactly ``key`` in OpenCode's wildcard syntax (``?`` is one
    character): ``bash``, ``bas?``, ``ba?h``, ... and finally ``key*`` forms."""
    found = [key] + [key[:i] + "?" + key[i + 1:] for i in range(len(key) - 1, -1, -1)]
    return found + [key + "*" * n for n in range(1, 8)]


def _merged_block(existing: Any, ours: dict[str, Any]) -> dict[str, Any]:
    # OpenCode's deep merge: keys already present keep their place, new keys go last.
    merged: dict[str, Any] = dict(existing) if isinstance(existing, dict) else {}
    merged.update(ours)
    return merged


def wildcard_match(text: str, pattern: str, escapes: bool = False) -> bool:
    """OpenCode's permission wildcard: ``*`` any run of characters, ``?`` one, all else literal.
    ``escapes`` (a task's own rules, matched by TaskBridge's plugin): ``\\*``, ``\\?`` and
    ``\\\\`` stand for the character itself (``wildcard`` in opencode_plugins/permission_rules.js)."""
    tokens = re.findall(r"\\[*?\\]|.", pattern, re.DOTALL) if escapes else list(pattern)
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c[-1]) for c in tokens)
    return re.fullmatch(regex, text, re.DOTALL) is not None


# Blanks spelled out: Python's \s and strip() and JavaScript's differ beyond these.
_BLANK_RUN = re.compile(r"[ \t\n\r\f\v]+")
# What may stand before a command's own words: NAME=value assignments, grouping and negation,
# compound-command keywords, and wrappers that run the rest as a command.
_LEAD = re.compile(r"""^(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|"[^"]*"|[^ '"])* |(?:[{}!]|if|then|else|elif|fi|do|done"""
                   r"""|while|until|time|exec|command|builtin|nohup|sudo|env)(?: |$))+""")
_SEVERITY = {"deny": 3, "ask": 2, "allow": 1}


def shell_commands(line: str) -> list[str]:
    """The simple commands of a shell command line, as a ``bash`` rule is matched against each:
    split at ``;`` ``&`` ``|`` (so ``&&`` ``||``; not the ``&`` of a redirection such as
    ``2>&1``), line breaks, parentheses, ``$(`` … ``)`` and backticks (a substitution is read as
    a line of its own, inside double quotes too; ``$((…))`` is arithmetic, a word, when it ends
    in ``))``), never inside single quotes or after a backslash; a ``#`` that starts a word
    comments out the rest of its line; blanks run together to one space, and leading
    assignments, ``{`` ``}`` ``!``, compound-command keywords (``if`` ``then`` ``do`` …) and
    wrappers (``time`` ``sudo`` ``env`` ``nohup`` ``exec`` ``command`` ``builtin``) left out;
    empty ones dropped. ``cd x && git push`` is ``["cd x", "git push"]``. A command inside a
    quoted word (``sh -c '…'``, ``eval "…"``), a heredoc's body read as lines, a script, or
    behind another wrapper (``xargs``) is not seen. The twin of ``shellCommands`` in
    opencode_plugins/shell_commands.js (tests/test_rules_matching.py holds both to one table and
    to random lines)."""
    return [stripped for _, stripped in command_forms(line) if stripped]


def command_forms(line: str) -> list[tuple[str, str]]:
    """Each simple command of ``line`` (see ``shell_commands``) in two forms: as written (blanks
    run together) and without its leading assignments, keywords and wrappers (maybe empty: a
    bare ``sudo``). A rule is matched against both, so ``sudo *`` meets ``sudo apt install``
    and ``apt *`` does too. Commands empty as written are dropped. The twin of ``commandForms``."""
    parts, current, quote, i = [], [], "", 0
    opened: list[tuple[str, str]] = []   # substitutions open: (their opener, the quote around them)
    while i < len(line):
        char, two = line[i], line[i:i + 2]
        cut = 0   # characters of a separator to skip
        arithmetic = _arithmetic_end(line, i + 3) if quote != "'" and line.startswith("$((", i) else None
        if quote == "'":
            quote = "" if char == "'" else quote
        elif char == "\\":
            current.append(two)
            i += 2
            continue
        elif arithmetic is not None:   # $(( … )): a word
            current.append(line[i:arithmetic])
            i = arithmetic
            continue
        elif char == "#" and not quote and (not current or current[-1] in " \t"):
            end = line.find("\n", i)   # a word starting with #: a comment up to the line's end
            i = len(line) if end < 0 else end
            continue
        elif opened and ((char == ")" and opened[-1][0] == "$(" and not quote)
                         or (char == "`" and opened[-1][0] == "`")):
            quote, cut = opened.pop()[1], 1   # a substitution ends: the quoting around it again
        elif two == "$(" or char == "`":      # a substitution: a line of its own, unquoted inside
            opened.append((two if two == "$(" else "`", quote))
            quote, cut = "", len(opened[-1][0])
        elif not quote and (char in ";|\n()" or (char == "&" and line[i - 1:i] not in ("<", ">") and
                                                 line[i + 1:i + 2] != ">")):
            cut = 1
        elif char == '"' or (char == "'" and not quote):
            quote = "" if quote == char else char if not quote else quote
        if cut:
            parts.append("".join(current))
            current = []
            i += cut
            continue
        current.append(char)
        i += 1
    parts.append("".join(current))
    written = [_BLANK_RUN.sub(" ", part).strip(" ") for part in parts]
    return [(command, _LEAD.sub("", command).strip(" ")) for command in written if command]


def _arithmetic_end(line: str, start: int) -> int | None:
    """Where ``$((`` … ``))`` that opened before ``start`` ends (past its ``))``), or the line's
    end; None when its first ``(`` closes apart from the other (``$((cmd) )``: bash runs that as
    a subshell inside a command substitution)."""
    depth = 2
    for at in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[at], 0)
        if depth == 1:
            return at + 2 if line[at + 1:at + 2] == ")" else None
    return len(line)


def rule_action(rules: dict[str, Any], tool: str, subject: str, directory: str = "") -> str | None:
    """What a task's ``rules`` (``{"bash": {"git push*": "ask"}}``) say of a call of ``tool`` (the
    rule key: bash, edit, read, ...) on ``subject`` (the command, path, URL, ...): allow, deny, ask,
    or None when no rule speaks; the last matching pattern wins. A path under ``directory`` also
    matches in its relative form. A ``bash`` command line is matched command by command
    (``shell_commands``), as OpenCode does, and the strictest answer wins (deny, then ask, then
    allow): ``cd x && git push`` meets a ``git push*`` rule. The Python twin of ``actionFor`` in
    permission_rules.js."""
    actions = [_action_of(rules, tool, s, directory) for s in _subjects(tool, subject)]
    return max(actions, key=lambda action: _SEVERITY.get(action or "", 0), default=None)


def asking_commands(rules: dict[str, Any], tool: str, subject: str) -> list[str]:
    """The commands of a ``bash`` call that its task's ``rules`` mark ``ask`` (``shell_commands``);
    [] for another tool. What an ``always`` answer to the ask adds a rule for."""
    return [c for c in _subjects(tool, subject) if _action_of(rules, tool, c, "") == "ask"] if tool == "bash" else []


def _subjects(tool: str, subject: str) -> list[str]:
    if tool != "bash":
        return [subject]
    forms = [form for pair in command_forms(subject) for form in dict.fromkeys(pair) if form]
    return forms or [subject]


def _action_of(rules: dict[str, Any], tool: str, subject: str, directory: str) -> str | None:
    """The last of the ``tool`` rules whose pattern matches ``subject`` (or its form relative to
    ``directory``): its action, or None."""
    rule = rules.get(tool)
    if rule is None:
        return None
    subjects = [subject]
    base = directory.rstrip("/")
    if tool in ("edit", "read", "list") and base and subject.startswith(base + "/"):
        subjects.append(subject[len(base) + 1:])
    action = None
    for pattern, act in (rule if isinstance(rule, dict) else {"*": rule}).items():
        if any(wildcard_match(s, pattern, escapes=True) for s in subjects):
            action = act
    return action


def _last_action(block: dict[str, Any], permission: str) -> str | None:
    """The action of the last key in ``block`` that matches ``permission`` (a pattern map counts
    only when every pattern in it has the same action)."""
    action = None
    for key, value in block.items():
        if wildcard_match(permission, key):
            actions = set(value.values()) if isinstance(value, dict) else {value}
            action = actions.pop() if len(actions) == 1 else None
    return action


def environment_fault(lines: list[str]) -> str | None:
    """The line naming an operating-system fault (``EACCES: permission denied, mkdir '…'``) in
    OpenCode's output, if any: Bun prints it above a stack and a version banner."""
    for line in lines:
        match = re.search(r"\b(E[A-Z]{3,})\b[:,]", line)
        if match and match.group(1) in ENV_FAULTS:
            return line.strip()[:500]
    return None


# Faults of the machine, not of the run: a retry seconds later meets the same folder.
ENV_FAULTS = ("EACCES", "EPERM", "EROFS", "ENOTDIR", "ENOSPC", "EDQUOT", "ENAMETOOLONG", "ELOOP", "EMFILE", "ENFILE",
              "EISDIR")


# --------------------------------------------------------------------------------------------
# Provider limits: a rate limit, a usage window or a quota the model's provider reports.
# Measured with 1.18.33 against a 429 with ``retry-after``: OpenCode retries 5 times, sleeping what
# the header says each time (``session.status {type: "retry", next}``, which retry_watch.js hands
# the worker); each try prints a ``level=ERROR … message="stream error" providerID=…
# error.error="AI_APICallError: …"`` line with --print-logs, and the ``--format json`` stream shows
# nothing until it gives up with one ``error`` event carrying ``statusCode`` and the response
# headers. Those three are what the functions below read.

_LIMIT_WORDS = re.compile(
    r"rate.?limit|usage.?limit|quota|too many requests|resource.?exhausted|limit (?:reached|exceeded)"
    r"|insufficient_quota|resets? (?:at|in|on)|free tier|credits? (?:exhausted|used up)",
    re.IGNORECASE)
_IN_DURATION = re.compile(
    r"(?:try again|retry|resets?|available again)\s+(?:in|after)\s+((?:\d+(?:\.\d+)?\s*(?:ms|milliseconds?|s|secs?|"
    r"seconds?|m|mins?|minutes?|h|hrs?|hours?|d|days?)\s*,?\s*(?:and\s+)?)+)", re.IGNORECASE)
_AT_TIME = re.compile(
    r"(?:try again|resets?|available again|retry)\s+(?:at|after|on)\s+"
    r"(\d{4}-\d\d-\d\d[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?(?:Z|[+-]\d\d:?\d\d)?|\d{1,2}(?::\d\d)?\s*(?:am|pm)?)",
    re.IGNORECASE)
_PIECE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)", re.IGNORECASE)
# Reset headers of the common providers: OpenAI (x-ratelimit-reset-*: "6m0s", "20ms"), Anthropic
# (anthropic-ratelimit-*-reset: RFC 3339), others (x-ratelimit-reset: seconds or epoch seconds).
_RESET_HEADERS = ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens", "anthropic-ratelimit-requests-reset",
                  "anthropic-ratelimit-tokens-reset", "anthropic-ratelimit-input-tokens-reset",
                  "anthropic-ratelimit-output-tokens-reset", "x-ratelimit-reset")


def is_limit(text: str | None, status: Any = None) -> bool:
    """Whether a provider's error (``text``, its HTTP ``status``) reports a rate limit, a usage
    window or a quota: HTTP 429, or the words providers use ("rate limit", "usage limit",
    "quota", "too many requests", "resets at 3pm", …) with no status or a 402 / 403 (billing and
    plan refusals); a server error (5xx) that mentions a quota is not one."""
    if status is not None and str(status) not in ("429", "402", "403"):
        return False
    return str(status) == "429" or bool(_LIMIT_WORDS.search(text or ""))


def duration_sec(text: str) -> float | None:
    """Seconds in a duration as providers write it ("17s", "6m0s", "1h 30m", "250ms",
    "2 minutes"), or None."""
    total, seen = 0.0, False
    for number, unit in _PIECE.findall(text or ""):
        unit = unit.lower()
        scale = (0.001 if unit in ("ms", "millisecond", "milliseconds") else
                 60 if unit.startswith("m") and not unit.startswith("ms") else
                 3600 if unit.startswith("h") else 86400 if unit.startswith("d") else
                 1 if unit.startswith("s") else None)
        if scale is None:
            return None
        total, seen = total + float(number) * scale, True
    return total if seen else None


def reset_from_text(text: str | None, now: float) -> float | None:
    """The reset time (epoch seconds) a provider's words give ("Please try again in 17s",
    "resets at 3pm", "try again at 2026-05-01T15:00:00Z"; a bare clock time is the next such
    local time), or None."""
    text = text or ""
    match = _IN_DURATION.search(text)
    if match and (seconds := duration_sec(match.group(1))) is not None:
        return now + seconds
    match = _AT_TIME.search(text)
    return _clock_time(match.group(1), now) if match else None


def _clock_time(said: str, now: float) -> float | None:
    said = said.strip()
    if "-" in said[:5]:
        with contextlib.suppress(ValueError):
            when = datetime.fromisoformat(said.replace("Z", "+00:00"))
            return (when if when.tzinfo else when.astimezone()).timestamp()
        return None
    match = re.fullmatch(r"(\d{1,2})(?::(\d\d))?\s*(am|pm)?", said, re.IGNORECASE)
    if not match or (match.group(2) is None and match.group(3) is None):
        return None   # a bare number ("at 3") is not a time
    hour, minute = int(match.group(1)) % 12 if match.group(3) else int(match.group(1)), int(match.group(2) or 0)
    hour += 12 if (match.group(3) or "").lower() == "pm" else 0
    if hour > 23 or minute > 59:
        return None
    local = datetime.fromtimestamp(now).astimezone()
    when = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return (when if when.timestamp() > now else when + timedelta(days=1)).timestamp()


def reset_from_headers(headers: Any, now: float) -> float | None:
    """The reset time (epoch seconds) a provider's response headers give: ``retry-after-ms``,
    ``retry-after`` (seconds or an HTTP date), then the providers' own reset headers (the
    latest of them: every window must be open again), or None."""
    headers = {str(k).lower(): str(v) for k, v in _dict(headers).items()}
    with contextlib.suppress(ValueError):
        if "retry-after-ms" in headers:
            return now + float(headers["retry-after-ms"]) / 1000
    if "retry-after" in headers:
        value = headers["retry-after"].strip()
        with contextlib.suppress(ValueError):
            return now + float(value)
        with contextlib.suppress(TypeError, ValueError, IndexError):
            return email.utils.parsedate_to_datetime(value).timestamp()
    resets = [r for name in _RESET_HEADERS if name in headers
              and (r := _header_reset(headers[name], now)) is not None]
    return max(resets) if resets else None


def _header_reset(value: str, now: float) -> float | None:
    value = value.strip()
    with contextlib.suppress(ValueError):
        number = float(value)
        return number if number > 1e9 else now + number   # epoch seconds, or seconds from now
    if "-" in value[:5]:
        return _clock_time(value, now)
    seconds = duration_sec(value)
    return now + seconds if seconds is not None else None


def limit_from_error(event: dict[str, Any], now: float) -> dict[str, Any] | None:
    """A provider limit in an ``error`` event (OpenCode gave up retrying): ``{"said": the
    provider's words, "status": HTTP status or None, "reset_at": epoch seconds or None}``, or
    None when the error is not a limit."""
    error = _dict(event.get("error"))
    data = _dict(error.get("data"))
    said = str(data.get("message") or error.get("message") or "")
    status = data.get("statusCode")
    if not is_limit(said, status):
        return None
    reset = reset_from_headers(data.get("responseHeaders"), now) or reset_from_text(said, now)
    return {"said": said[:1000], "status": status, "reset_at": reset}


_STREAM_ERROR = re.compile(r'\blevel=ERROR\b.*\bmessage="stream error".*?\bproviderID=(\S+).*?'
                           r'\berror\.error="((?:[^"\\]|\\.)*)"')


def limit_from_log(line: str, now: float) -> dict[str, Any] | None:
    """A provider limit in one ``--print-logs`` stderr line (a failed model call that OpenCode
    will retry: ``message="stream error" providerID=P … error.error="AI_APICallError: …"``):
    ``{"said", "provider", "reset_at", "session_id"}``, or None. The line carries no status or
    headers."""
    match = _STREAM_ERROR.search(line)
    if not match:
        return None
    said = re.sub(r"^\w*Error:\s*", "", match.group(2).replace('\\"', '"'))
    if not is_limit(said):
        return None
    session = re.search(r"\bsession\.id=(ses_\w+)", line)
    return {"said": said[:1000], "provider": match.group(1), "reset_at": reset_from_text(said, now),
            "session_id": session.group(1) if session else None}


WARM_UP_ENV = "TASKBRIDGE_WARM_UP"


def with_warm_up(env: dict[str, str], warm_up_file: str) -> dict[str, str]:
    """``env`` for a kept ``opencode serve``: the warm-up stop loaded (``warm_up.js`` in
    opencode_plugins/, appended to ``OPENCODE_CONFIG_CONTENT``'s ``plugin`` list) and
    ``TASKBRIDGE_WARM_UP`` naming ``warm_up_file``, where the worker writes ``{"session": id}``
    of the session that opens the task's folder: that session's model call is stopped before it
    is sent, and TaskBridge's other plugins leave it alone. Raises ConfigProblem."""
    return _with_plugin(env, PLUGIN_DIR / "warm_up.js", WARM_UP_ENV, warm_up_file)


RETRY_ENV = "TASKBRIDGE_RETRY"


def with_retry_watch(env: dict[str, str], retry_file: str) -> dict[str, str]:
    """``env`` with the retry watch loaded (``retry_watch.js`` in opencode_plugins/, appended to
    ``OPENCODE_CONFIG_CONTENT``'s ``plugin`` list) and ``TASKBRIDGE_RETRY`` naming ``retry_file``:
    the plugin writes each retry OpenCode schedules for the run's session to
    ``<run>/reply/<name>.json`` (``{"attempt", "message", "next": epoch ms, "at": epoch ms}``).
    Raises ConfigProblem."""
    return _with_plugin(env, PLUGIN_DIR / "retry_watch.js", RETRY_ENV, retry_file)


# --------------------------------------------------------------------------------------------
# The repository's own OpenCode config.


def project_config_files(cwd: str, top: str | None) -> dict[str, str]:
    """``{path: text}`` of every project OpenCode config file OpenCode reads for a run in ``cwd``
    (``opencode.json[c]`` and ``.opencode/opencode.json[c]`` from ``cwd`` up to ``top``)."""
    found: dict[str, str] = {}
    folder, stop = Path(cwd).resolve(), Path(top).resolve() if top else Path(cwd).resolve()
    while True:
        for name in PROJECT_CONFIG_FILES:
            path = folder / name
            try:
                found[str(path)] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
        if folder == stop or folder.parent == folder or stop not in folder.parents:
            return found
        folder = folder.parent


def repo_restrictions(files: dict[str, str], root: str | None = None) -> list[str]:
    """What the repository's OpenCode config takes away from the agent, one line each:
    ``opencode.json: permission.bash = deny``, ``... agent.build.tools.webfetch = false``. Rules
    that allow are left out (TaskBridge's own pins win over them for a restricted task)."""
    found = []
    for path, text in files.items():
        data = loads_jsonc(text)
        name = os.path.relpath(path, root) if root else path
        if not isinstance(data, dict):
            continue
        scopes = [("", data)] + [(f"agent.{a}.", v) for a, v in (data.get("agent") or {}).items()
                                 if isinstance(v, dict)]
        for prefix, scope in scopes:
            found += [f"{name}: {prefix}{line}" for line in _restrictions_in(scope)]
    return found


def _restrictions_in(scope: dict[str, Any]) -> list[str]:
    lines = []
    permission = scope.get("permission")
    if isinstance(permission, str) and permission != "allow":
        lines.append(f"permission = {permission}")
    for tool, value in (permission.items() if isinstance(permission, dict) else []):
        if isinstance(value, str) and value != "allow":
            lines.append(f"permission.{tool} = {value}")
        elif isinstance(value, dict):
            lines += [f"permission.{tool}[{pat}] = {act}" for pat, act in value.items() if act != "allow"]
    for tool, enabled in (scope.get("tools") or {}).items() if isinstance(scope.get("tools"), dict) else []:
        if enabled is False:
            lines.append(f"tools.{tool} = false")
    if scope.get("disable") is True:
        lines.append("disable = true")
    return lines


def loads_jsonc(text: str) -> Any:
    """JSON with comments and trailing commas (OpenCode's ``.jsonc``); None when unreadable."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else n
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    try:
        return json.loads(re.sub(r",(\s*[}\]])", r"\1", "".join(out)))
    except ValueError:
        return None


def undo_housekeeping(before: dict[str, str]) -> list[str]:
    """Take back OpenCode's own edit of project config files: the ``$schema`` line it inserts into
    a file that lacks one when it loads it. ``before``: ``project_config_files`` taken before the
    run. Any change the agent made beside it stays. Returns the paths restored."""
    restored = []
    for path, old in before.items():
        try:
            now = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if now == old or '"$schema"' in old or not now.startswith(SCHEMA_LINE):
            continue
        head = old[:len(old) - len(old.lstrip())]
        if not old.lstrip().startswith("{"):
            continue
        Path(path).write_text(head + "{" + now[len(SCHEMA_LINE):], encoding="utf-8")
        restored.append(path)
    return restored


# --------------------------------------------------------------------------------------------
# The event stream.

TOKEN_KEYS = ("input", "output", "reasoning", "cache_read", "cache_write", "total")
TEXT_KEEP = 262_144      # characters of the final step's text held in memory (its tail)
INPUT_KEEP = 4_000       # characters of a tool call's command / path kept for the receipt


def _slim_input(data: Any) -> dict[str, Any]:
    """What the receipt needs of a tool call's input (command, filePath; the denied tool's name
    and error), clipped: a write call's whole file content is not kept in memory."""
    if not isinstance(data, dict):
        return {}
    return {k: v[:INPUT_KEEP] if isinstance(v, str) else v for k, v in data.items()
            if k in ("command", "filePath", "tool", "error", "description")}


@dataclass
class EventStream:
    """Accumulates the `opencode run --format json` stream (see reference: event types).

    Run totals are sums over every ``step_finish``; the final answer is the text of the last step.
    """
    session_id: str | None = None
    events: int = 0
    bad_lines: int = 0
    steps: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_KEYS, 0))
    cost_usd: float = 0.0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    limit: dict[str, Any] | None = None   # the provider limit an error event reported (limit_from_error)
    refused_status: int | None = None     # an HTTP status no retry can change (refused_by_provider)
    held_in_step: int | None = None       # ``steps`` when a call held for the planner was printed
    finished: bool = False          # a step_finish with reason "stop" was seen (and no turn after it)
    last_reason: str | None = None
    note_turns: list[tuple[list[Any], float]] = field(default_factory=list)   # see _on_note_turn
    _step_texts: list[str] = field(default_factory=list)
    final_text: str = ""            # the last step's text: its last TEXT_KEEP characters only
    final_text_chars: int = 0       # the last step's whole text length (the whole is in the log)
    _step_chars: int = 0
    _kept_chars: int = 0

    def feed(self, line: str) -> dict[str, Any] | None:
        """Parse one stdout line; a non-JSON line is counted and skipped. Returns the event."""
        line = line.strip()
        if not line:
            return None
        try:
            event = json.loads(line)
        except ValueError:
            self.bad_lines += 1
            return None
        if not isinstance(event, dict):
            self.bad_lines += 1
            return None
        self.events += 1
        self.session_id = event.get("sessionID") or self.session_id
        handler = getattr(self, "_on_" + str(event.get("type")), None)
        if handler:
            handler(event.get("part") or {}, event)
        return event

    def _on_step_start(self, _part: dict, _event: dict) -> None:
        self._step_texts, self._step_chars, self._kept_chars = [], 0, 0

    def _on_text(self, part: dict, _event: dict) -> None:
        if part.get("text"):
            # Only a bounded tail is kept: the closing block sits at the end, the log has it all.
            self._step_chars += len(part["text"]) + (1 if self._step_texts else 0)
            self._step_texts.append(part["text"])
            self._kept_chars += len(part["text"]) + 1
            if self._kept_chars > TEXT_KEEP:
                self._step_texts = ["\n".join(self._step_texts)[-TEXT_KEEP:]]
                self._kept_chars = len(self._step_texts[0])

    def _on_tool_use(self, part: dict, _event: dict) -> None:
        state = part.get("state") or {}
        call = {
            "tool": part.get("tool"),
            "status": state.get("status"),
            "input": _slim_input(state.get("input")),
        }
        denied = _denied_tool(part)
        if denied:
            call = {"tool": denied[0], "status": "denied", "input": {}, "error": denied[1][:500]}
        if state.get("status") == "error":
            error = str(state.get("error"))[:500]
            call["error"] = error
            if call["status"] == "error":   # an OpenCode denial (the invalid tool) stays "denied"
                call["status"] = _refused_by_rules(error) or "error"
            if call["status"] == "held":
                self.held_in_step = self.steps
        exit_code = (state.get("metadata") or {}).get("exit")
        if exit_code is not None:
            call["exit"] = exit_code
        self.tool_calls.append(call)

    def _on_step_finish(self, part: dict, _event: dict) -> None:
        self.steps += 1
        tokens = part.get("tokens") or {}
        cache = tokens.get("cache") or {}
        for key, value in (("input", tokens.get("input")), ("output", tokens.get("output")),
                           ("reasoning", tokens.get("reasoning")), ("cache_read", cache.get("read")),
                           ("cache_write", cache.get("write")), ("total", tokens.get("total"))):
            self.tokens[key] += int(value or 0)
        self.cost_usd += float(part.get("cost") or 0)
        self.last_reason = part.get("reason")
        if self._step_texts:
            self.final_text = "\n".join(self._step_texts)
            self.final_text_chars = self._step_chars
        if self.last_reason == "stop":
            self.finished = True

    def _on_note_turn(self, _part: dict, event: dict) -> None:
        # TaskBridge's own line (engine_client.py, the warm engine): planner notes that came after
        # the last model call were sent as the session's next turn: (their ids, epoch seconds).
        notes = event.get("notes")
        self.note_turns.append((list(notes) if isinstance(notes, list) else [],
                                float(event.get("timestamp") or 0) / 1000))
        self.finished = False

    def _on_error(self, _part: dict, event: dict) -> None:
        # Bounded like the text: the last 20 errors, each clipped (the log has them whole).
        self.errors = (self.errors + [error_text(event)[:INPUT_KEEP]])[-20:]
        self.limit = limit_from_error(event, time.time()) or self.limit
        self.refused_status = refused_by_provider(event) or self.refused_status

    @property
    def commands(self) -> list[dict[str, Any]]:
        """Shell commands the agent ran (bash tool calls, denied and held ones excepted): command,
        status, exit."""
        return [
            {"command": c["input"].get("command"), "status": c["status"], "exit": c.get("exit")}
            for c in self.tool_calls if c["tool"] == "bash" and c["status"] not in ("denied", "held")
        ]

    @property
    def held_step_ended(self) -> bool:
        """Whether the step that made a call held for the planner has ended (its step_finish,
        with its tokens and cost, was printed after that call)."""
        return self.held_in_step is not None and self.steps > self.held_in_step

    def usage(self) -> dict[str, Any]:
        """Tokens summed over step_finish events and cost in USD (OpenCode's own figure)."""
        return {"tokens": dict(self.tokens), "cost_usd": round(self.cost_usd, 8), "steps": self.steps}


# 408 (timeout), 409 (conflict), 425 (too early) and 429 (limits, handled above) may pass later.
_PASSING_4XX = (408, 409, 425, 429)


def refused_by_provider(event: dict[str, Any]) -> int | None:
    """The HTTP status of an ``error`` event when the provider refused the request itself (a 4xx
    such as 400 bad request or 401 bad key, which the same request meets again on a retry), else
    None."""
    status = _dict(_dict(event.get("error")).get("data")).get("statusCode")
    if isinstance(status, int) and 400 <= status < 500 and status not in _PASSING_4XX:
        return status
    return None


def error_text(event: dict[str, Any]) -> str:
    """An ``error`` event as ``"Name: message"`` (``error.name``, ``error.data.message``), and
    the address the request went to when no server answered it and OpenCode names it
    (``error.data.metadata.url`` without ``statusCode``, as an unreachable model server's
    ``APIError`` has: "Cannot connect to API: Unable to connect. Is the computer able to access
    the url?" names none itself), without its query or user part."""
    error = event.get("error") or {}
    if not isinstance(error, dict):
        return f"error: {str(error)[:500]}"
    data = _dict(error.get("data"))
    message = data.get("message") or error.get("message") or json.dumps(error)[:500]
    url = _dict(data.get("metadata")).get("url")
    if data.get("statusCode") is None and isinstance(url, str) and (where := _bare_url(url)):   # no answer came
        message = f"{message} (request to {where})"
    return f"{error.get('name') or 'error'}: {message}"


def _bare_url(url: str) -> str | None:
    """``url`` as scheme, host, port and path (a key may ride in its query or user part), or None
    when it is no URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return None
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"[:300] if parts.scheme and parts.hostname else None


def _dict(value: Any) -> dict[str, Any]:
    """``value`` when it is a dict, else an empty one (an event's fields are not trusted)."""
    return value if isinstance(value, dict) else {}


# How TaskBridge's permission-rules plugin (opencode_plugins/permission_rules.js) fails a call, by
# the start of its error: a deny rule's ("denied"), an ask rule's, waiting for the planner ("held").
RULES_REFUSALS = (("TaskBridge: the task's rules deny ", "denied"),
                  ("TaskBridge: this task's permission rules cannot be read", "denied"),
                  ("TaskBridge: this call waits for the planner's permission:", "held"))


def _refused_by_rules(error: str) -> str | None:
    """"denied" or "held" when a tool call's ``error`` is the permission-rules plugin's, else None."""
    text = error.removeprefix("Error: ")
    return next((status for start, status in RULES_REFUSALS if text.startswith(start)), None)


def _denied_tool(part: dict[str, Any]) -> tuple[str, str] | None:
    """(tool asked for, OpenCode's message) when a tool call was refused as not allowed.

    A denied tool is removed from the model's tools; calling it anyway comes back as the
    ``invalid`` tool naming the one that was asked for."""
    state = _dict(part.get("state"))
    given = _dict(state.get("input"))
    if part.get("tool") == "invalid" and isinstance(given.get("tool"), str):
        return given["tool"], str(given.get("error") or "not allowed")
    return None


# --------------------------------------------------------------------------------------------
# The task log rendered for people: the board's log view and `tasks_cli.py logs` share this.

LOG_OUTPUT_MAX = 4000  # characters of a tool's output kept in a rendered line
# Input keys that say what a tool call was about when OpenCode gave it no title.
_TOOL_SUBJECT_KEYS = ("command", "filePath", "pattern", "url", "path", "description")


def render_log_line(line: str) -> dict[str, Any] | None:
    """One line of a task log (``task_logs/t_0001.log``) as a readable entry, or None for a line
    that shows nothing (blank, ``step_start``).

    The log holds the worker's own lines (``=== <marker> <time> cwd=…`` at each attempt, ``$ argv``,
    ``[worker] …``), OpenCode's stderr as ``[stderr] …`` and its ``--format json`` events, one per
    line. Every entry has ``kind`` and ``text`` (one readable line; an agent's text keeps its line
    breaks); events also carry ``ts`` (Unix seconds, from the event's ``timestamp`` in ms):

    - ``text`` / ``reasoning``: the agent's words.
    - ``tool``: ``tool`` (OpenCode's tool name), ``status`` (``completed``, ``error`` or
      ``denied``: the permission config removed the tool and the model called it anyway),
      ``title`` (OpenCode's title: the command, the file), ``exit`` (bash's exit code or None),
      ``detail`` (the error message, or None) and ``output`` (the tool's output, at most
      4,000 characters, or None).
    - ``step``: a model call finished: ``reason`` (``tool-calls``, ``stop``…), ``tokens``
      (``total``, ``input``, ``output``, ``reasoning``, ``cache_read``, ``cache_write``) and
      ``cost_usd`` (OpenCode's figure, USD).
    - ``error``: an ``error`` event (``Name: message``); ``status_code`` when OpenCode gave one.
    - ``stderr``, ``worker``: those lines without their prefix; ``attempt`` for the ``===``
      header (``marker``, ``at``, ``cwd``).
    - ``other``: anything else (a non-JSON line, an event type this version does not know), as is.

    Text is returned as logged: escaping control characters is the caller's job (terminal, HTML).
    """
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    for prefix, kind in (("[stderr] ", "stderr"), ("[worker] ", "worker")):
        if line.startswith(prefix):
            return {"kind": kind, "text": line[len(prefix):]}
    if line.startswith("=== "):
        return _attempt_header(line)
    if line.startswith("$ "):
        return {"kind": "worker", "text": line}
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return {"kind": "other", "text": line}
    return _render_event(event)


def render_log(text: str) -> list[dict[str, Any]]:
    """Every line of a log chunk rendered with ``render_log_line`` (lines that show nothing are
    left out). A chunk that ends mid-line renders that part too: pass whole lines when following."""
    return [entry for entry in map(render_log_line, text.splitlines()) if entry is not None]


def _attempt_header(line: str) -> dict[str, Any]:
    marker, _, rest = line[4:].partition(" ")
    at, _, cwd = rest.partition(" cwd=")
    return {"kind": "attempt", "marker": marker, "at": at, "cwd": cwd,
            "text": f"attempt {marker} started {at}" + (f" in {cwd}" if cwd else "")}


def _render_event(event: dict[str, Any]) -> dict[str, Any] | None:
    kind = event["type"]
    part = _dict(event.get("part"))
    if kind == "step_start":
        return None
    if kind in ("text", "reasoning"):
        entry = {"kind": kind, "text": str(part.get("text") or "").strip()}
    elif kind == "tool_use":
        entry = _render_tool(part)
    elif kind == "step_finish":
        entry = _render_step(part)
    elif kind == "error":
        data = _dict(_dict(event.get("error")).get("data"))
        entry = {"kind": "error", "text": error_text(event), "status_code": data.get("statusCode")}
        if entry["status_code"]:
            entry["text"] += f" (HTTP {entry['status_code']})"
    else:
        entry = {"kind": "other", "text": f"{kind} event"}
    if isinstance(event.get("timestamp"), (int, float)):
        entry["ts"] = event["timestamp"] / 1000
    return entry


def _render_tool(part: dict[str, Any]) -> dict[str, Any]:
    state = _dict(part.get("state"))
    given = _dict(state.get("input"))
    tool, status = str(part.get("tool") or "tool"), str(state.get("status") or "unknown")
    title = state.get("title") or next((str(given[k]) for k in _TOOL_SUBJECT_KEYS if given.get(k)), "")
    metadata = _dict(state.get("metadata"))
    exit_code, output = metadata.get("exit"), state.get("output")
    detail = str(state.get("error")) if status == "error" else None
    denied = _denied_tool(part)
    if denied:
        tool, status, title, detail, output = denied[0], "denied", "", denied[1], None
    text = f"{tool} {title}".strip()
    if status == "denied":
        text += f": denied ({detail})"
    elif status == "error":
        text += f": error: {detail}"
    elif exit_code not in (None, 0):
        text += f" (exit {exit_code})"
    if isinstance(output, str) and len(output) > LOG_OUTPUT_MAX:
        output = output[:LOG_OUTPUT_MAX] + f"\n… {len(output) - LOG_OUTPUT_MAX} more characters"
    return {"kind": "tool", "text": text, "tool": tool, "status": status, "title": str(title),
            "exit": exit_code, "detail": detail, "output": output if isinstance(output, str) else None}


def _render_step(part: dict[str, Any]) -> dict[str, Any]:
    raw = _dict(part.get("tokens"))
    cache = _dict(raw.get("cache"))
    tokens = {"total": raw.get("total"), "input": raw.get("input"), "output": raw.get("output"),
              "reasoning": raw.get("reasoning"), "cache_read": cache.get("read"),
              "cache_write": cache.get("write")}
    tokens = {key: int(value) if isinstance(value, (int, float)) else 0 for key, value in tokens.items()}
    cost = float(part.get("cost") or 0) if isinstance(part.get("cost"), (int, float)) else 0.0
    reason = str(part.get("reason") or "")
    detail = f"{tokens['input']:,} in, {tokens['output']:,} out"
    detail += f", {tokens['reasoning']:,} reasoning" if tokens["reasoning"] else ""
    detail += f", {tokens['cache_read']:,} cache read" if tokens["cache_read"] else ""
    detail += f", {tokens['cache_write']:,} cache write" if tokens["cache_write"] else ""
    text = f"step finished ({reason or 'no reason given'}): {tokens['total']:,} tokens ({detail}), ${cost:.6f}"
    return {"kind": "step", "text": text, "reason": reason, "tokens": tokens, "cost_usd": cost}


# --------------------------------------------------------------------------------------------
# The agent's closing block.

_FENCE = re.compile(r"```([A-Za-z_-]*)[ \t]*\n(.*?)```", re.DOTALL)


def parse_closing_block(text: str) -> dict[str, Any]:
    """Find the agent's closing block in its final text, tolerantly.

    Returns ``{"kind": "question", "question": str}`` when the agent paused to ask (a fenced
    ``question`` block, or a JSON block with a ``question`` key and no ``summary``), else
    ``{"kind": "receipt", "summary", "files_touched", "tests_run", "open_questions"}`` from the
    last fenced JSON block; with no block (or a broken one) the whole final text is the summary.
    """
    blocks = _FENCE.findall(text or "")
    for lang, body in reversed(blocks):
        if lang.lower() == "question" and body.strip():
            return {"kind": "question", "question": body.strip()}
        data = _loads_object(body)
        if data is None:
            continue
        if isinstance(data.get("question"), str) and data["question"].strip() and "summary" not in data:
            return {"kind": "question", "question": data["question"].strip()}
        return {
            "kind": "receipt",
            "summary": str(data.get("summary") or "").strip() or _strip_blocks(text),
            "files_touched": _str_list(data.get("files_touched")),
            "tests_run": _str_list(data.get("tests_run")),
            "open_questions": _str_list(data.get("open_questions")),
            "block_found": True,
        }
    return {"kind": "receipt", "summary": (text or "").strip(), "files_touched": [], "tests_run": [],
            "open_questions": [], "block_found": False}


def _loads_object(body: str) -> dict | None:
    try:
        data = json.loads(body)
    except ValueError:
        match = re.search(r"\{.*\}", body, re.DOTALL)
        if not match:
            return None
        try:
            data = json.loads(match.group(0))
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


def _str_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, int, float)):
        return [str(value)]
    if isinstance(value, list):
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [json.dumps(value)]


def _strip_blocks(text: str) -> str:
    return _FENCE.sub("", text or "").strip()


# --------------------------------------------------------------------------------------------
# Models.


MODELS_CACHE_SEC = 60.0   # how long `opencode models` / `opencode debug config` answers are reused


class UnknownModel(ValueError):
    """A model OpenCode does not offer here; the message names the closest ids and the way out."""


class NoDefaultModel(RuntimeError):
    """No model to run with: none chosen, none in OpenCode's config, none listed by OpenCode."""


@dataclass
class ModelChoice:
    """The model a task without one runs with, and where that choice came from."""
    model: str
    source: str   # "set_default_model", "WORKER_MODEL", "OpenCode config", "opencode models"


def list_models(provider: str | None = None, timeout_sec: float = 60) -> list[dict[str, Any]]:
    """Models OpenCode knows, from ``opencode models [PROVIDER] --verbose`` (an id line followed
    by a pretty-printed JSON object; not JSON Lines). Each: ``{"id": "provider/model", "provider",
    "name", "cost": {input, output, ...} USD per million tokens | None, "context": tokens | None,
    "output_limit": tokens | None}``.

    Raises ValidationError for a provider that is not a provider id (``-m`` would reach OpenCode
    as an option), OpencodeNotFound, or RuntimeError with OpenCode's own message (e.g. unknown
    provider).
    """
    provider = validate_provider(provider)
    with own_call(None, provider_keys=True) as (hook, where):
        argv, env = hook([opencode_bin(), "models", *([provider] if provider else []), "--verbose"], dict(os.environ))
        # A session of its own: a worker's first Ctrl-C (which finishes the work in hand) must not
        # kill a listing it needs.
        proc = subprocess.run(argv, cwd=where, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_sec, start_new_session=True)
    if proc.returncode != 0:
        raise RuntimeError(opencode_error(proc, "opencode models"))
    return _parse_verbose_models(proc.stdout)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# OpenCode creates and migrates its own database (``<XDG_DATA_HOME>/opencode/opencode.db``) in the
# first process that opens it, and 1.18.33 does not serialise that across processes: of four
# `opencode serve` started together on a fresh data folder, two died with "Unexpected error /
# Failed query: CREATE TABLE ..." (upstream issues #33320, #48416). The same holds for runs that
# start together (one worker's slots, or workers of several queues), and after an upgrade that
# brings new migrations.
OPENCODE_DB = "opencode.db"
DB_PREPARED = ".taskbridge-prepared"       # beside the database: {"binary": key, "migrations": n}
DB_PREPARE_LOCK = ".taskbridge-prepare.lock"
DB_LOCK_WAIT_SEC = 15.0   # how long a preparation waits for another's (it takes ~1.3 s here)


def opencode_db_path(env: dict[str, str] | None = None) -> Path:
    """Where OpenCode keeps its database for ``env`` (default os.environ), made absolute:
    ``$XDG_DATA_HOME/opencode/opencode.db``, ``$HOME/.local/share`` when XDG_DATA_HOME is unset
    (what ``opencode db path`` prints, 1.18.33)."""
    return Path(os.path.abspath(knobs.xdg_home("XDG_DATA_HOME", env) / "opencode" / OPENCODE_DB))


def config_dir(env: dict[str, str] | None = None) -> Path:
    """OpenCode's global config folder for ``env`` (default os.environ): ``$XDG_CONFIG_HOME/opencode``,
    ``~/.config/opencode`` when XDG_CONFIG_HOME is unset. Not resolved."""
    return knobs.xdg_home("XDG_CONFIG_HOME", env) / "opencode"


def _migrations_done(db: Path) -> int | None:
    """How many of OpenCode's migrations ``db`` records (its ``migration`` table, 1.18.33), or None
    when it cannot be read (no file, no table, locked)."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return int(conn.execute("SELECT count(*) FROM migration").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return None


def prepare_opencode_db(timeout_sec: float = 60, lock_wait_sec: float = DB_LOCK_WAIT_SEC,
                        stopping: Callable[[], bool] = lambda: False,
                        say: Callable[[str], None] | None = None, data_home: str | None = None,
                        box: Any = None) -> str | None:
    """Have one OpenCode process create and migrate OpenCode's database before others start beside
    it (see above): ``opencode session list --pure`` (~1.3 s), run only when this binary (its path,
    size and mtime) has not done it for this database yet: ``.taskbridge-prepared`` beside the
    database records the binary and the migration count it left, and the database must still hold
    that count. An flock beside it (every queue of the user shares that folder) keeps two workers
    from doing it at once; it is waited for up to ``lock_wait_sec`` seconds, or until
    ``stopping()`` (whoever holds it longer, an agent's shell included, is not waited for; a wait
    is told to ``say`` in one line first), and OpenCode's command up to ``timeout_sec`` (its whole
    process group is ended then). ``data_home``: the database's ``XDG_DATA_HOME`` (default the
    environment's); ``box``: ``(argv, env) -> (argv, env)`` running OpenCode in the agent's box
    (agent_box.call_box: the box's data folder, which runs write, is only read in a box).

    Returns None when the database is ready, else one line saying why it could not be made ready
    (the runs then start as they would have: nothing is lost)."""
    try:
        binary = opencode_bin()
        found = os.stat(binary)
    except (OpencodeNotFound, OSError) as exc:
        return f"OpenCode's database was not prepared: {exc}"
    db = opencode_db_path({**os.environ, "XDG_DATA_HOME": data_home} if data_home else None)
    stamp, lock = db.parent / DB_PREPARED, db.parent / DB_PREPARE_LOCK
    key = [binary, found.st_size, found.st_mtime_ns]

    def ready() -> bool:
        return _db_ready(db, key)

    if ready():
        return None
    try:
        os.makedirs(db.parent, exist_ok=True)   # OpenCode makes it too, with the same default mode
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)   # runs write there
    except OSError as exc:
        return f"OpenCode's database was not prepared: {exc}"
    try:
        waiting = (f"waiting up to {lock_wait_sec:g} s for another process that prepares OpenCode's "
                   f"database ({lock})")
        refused = flock_wait(fd, lambda: "the worker is stopping" if stopping() else None, lock_wait_sec,
                             lambda: say(waiting) if say else None)
        if refused:
            return f"OpenCode's database was not prepared: {refused if stopping() else f'{lock} was {refused}'}"
        if ready():   # another worker did it while this one waited
            return None
        problem = _run_session_list(binary, db, timeout_sec, box)
        if problem:
            return f"OpenCode's database was not prepared ({problem})"
        done = _migrations_done(db)
        if done is None:
            return f"OpenCode's database was not prepared (opencode session list left no database at {db})"
        with contextlib.suppress(OSError):   # unstamped: the next pass asks again (~1.3 s)
            write_private(stamp, json.dumps({"binary": key, "migrations": done}))
        return None
    finally:
        os.close(fd)   # releases the flock


def _db_ready(db: Path, key: list[Any]) -> bool:
    """Whether ``db`` was prepared by the binary ``key`` names and still holds the migrations it left."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        said = json.loads((db.parent / DB_PREPARED).read_text())
        return said.get("binary") == key and _migrations_done(db) == said.get("migrations")
    return False


@contextlib.contextmanager
def prepared_db_shared(db: Path) -> Iterator[bool]:
    """Yields True, holding the preparation lock beside ``db`` shared (so no preparation of it runs
    meanwhile), when ``db`` is prepared for the OpenCode binary found now (prepare_opencode_db);
    else False (not prepared, being prepared, no binary): the caller does without it."""
    try:
        found = os.stat(opencode_bin())
        fd = os.open(db.parent / DB_PREPARE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except (OpencodeNotFound, OSError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield _db_ready(db, [opencode_bin(), found.st_size, found.st_mtime_ns])
    finally:
        os.close(fd)


def _run_session_list(binary: str, db: Path, timeout_sec: float, box: Any = None) -> str | None:
    """``opencode session list --pure`` with the database folder named absolutely (in ``box``
    when given, see prepare_opencode_db); None, or what went wrong in a few words. On a timeout
    its whole process group is ended."""
    argv, env = [binary, "session", "list", "--pure"], {**os.environ, "XDG_DATA_HOME": str(db.parent.parent)}
    if box is not None:
        argv, env = box(argv, env)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    except OSError as exc:
        return f"opencode session list: {exc}"
    try:
        out, err = proc.communicate(timeout=timeout_sec)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"opencode session list did not end within {timeout_sec:g} s"
    if proc.returncode != 0:
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return opencode_error(done, "opencode session list")
    return None


def opencode_error(proc: subprocess.CompletedProcess, what: str) -> str:
    """OpenCode's own error line (``Error: ...``) from a failed command, colours removed."""
    lines = [_ANSI.sub("", line).strip() for line in (proc.stderr or proc.stdout or "").splitlines()]
    lines = [line for line in lines if line]
    said = next((line for line in lines if line.startswith("Error")), lines[-1] if lines else "")
    return said or f"{what} exited {proc.returncode}"


def user_config_files() -> list[Path]:
    """The files this user's OpenCode reads its config and provider credentials from, outside any
    project: the global config (``$XDG_CONFIG_HOME/opencode/opencode.json[c]``, ``config.json``),
    ``auth.json`` (what `opencode auth login` stores) and ``$OPENCODE_CONFIG``; missing ones too."""
    config, data = config_dir(), opencode_db_path().parent
    files = [config / "opencode.json", config / "opencode.jsonc", config / "config.json", data / "auth.json"]
    return files + ([Path(os.environ["OPENCODE_CONFIG"])] if os.environ.get("OPENCODE_CONFIG") else [])


def _setup_key(*extra: Any) -> str:
    """What an answer of OpenCode's depends on: its binary, config env, whether and where it is boxed
    (TASKBRIDGE_SANDBOX, the box's folders under XDG_CACHE_HOME) and config files' mtimes."""
    names = ("OPENCODE_BIN", "OPENCODE_CONFIG", "OPENCODE_CONFIG_CONTENT", "OPENCODE_CONFIG_DIR",
             "OPENCODE_DISABLE_PROJECT_CONFIG", "PATH", "HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
             "XDG_CACHE_HOME", "TASKBRIDGE_SANDBOX")
    parts: list[Any] = [os.environ.get(name) for name in names]
    for path in user_config_files():
        try:
            parts.append(path.stat().st_mtime_ns)
        except OSError:
            parts.append(None)
    return json.dumps(parts + list(extra), default=str)


_memory_cache: dict[str, tuple[float, Any]] = {}


def _cached(key: str, compute: Any, refresh: bool, cache_file: Path | None, ask: bool = True) -> Any:
    """``compute()``, reused for MODELS_CACHE_SEC seconds per key: in memory, and in
    ``cache_file`` (JSON) when given, so short-lived processes (the CLI) share one answer.
    With ``ask`` false only a cached answer is returned, however old (the key already names the
    config files' mtimes); none raises LookupError."""
    now = time.time()
    hit = _memory_cache.get(key)
    if hit is None and cache_file is not None:
        try:
            stored = json.loads(cache_file.read_text()).get(key)
            hit = (float(stored[0]), stored[1]) if stored else None
        except (OSError, ValueError, TypeError, AttributeError, IndexError):
            hit = None
    if hit and not refresh and 0 <= now - hit[0] < MODELS_CACHE_SEC:
        return hit[1]
    if not ask:
        if hit:
            return hit[1]    # the last answer for this very set-up, however old: a status view
        raise LookupError(key)
    value = compute()
    _memory_cache[key] = (now, value)
    if cache_file is not None:
        _store_cache(cache_file, key, now, value)
    return value


def _store_cache(cache_file: Path, key: str, now: float, value: Any) -> None:
    try:
        entries = json.loads(cache_file.read_text())
        # Old answers stay for status views (ask=False), but not forever: a day, and 50 set-ups.
        entries = {k: v for k, v in entries.items() if now - float(v[0]) < 86_400}
        entries = dict(sorted(entries.items(), key=lambda kv: kv[1][0])[-50:])
    except (OSError, ValueError, TypeError, AttributeError, IndexError):
        entries = {}
    entries[key] = [now, value]
    try:   # 0600 like every file beside the queue; no folder is made for it (a read must not)
        write_private(cache_file, json.dumps(entries))
    except OSError:
        pass   # a cache that cannot be written only costs time


def known_models(provider: str | None = None, *, refresh: bool = False,
                 cache_file: Path | None = None, ask: bool = True) -> list[dict[str, Any]]:
    """`list_models`, cached for MODELS_CACHE_SEC (60) seconds per provider and OpenCode setup
    (binary, config env, config files): in memory and in ``cache_file`` when given. ``refresh``
    asks OpenCode again; ``ask`` false answers only from the cache (LookupError when nothing is
    cached). Raises as `list_models` (and subprocess.TimeoutExpired after 60 s)."""
    provider = validate_provider(provider)
    return _cached("models " + _setup_key(provider), lambda: list_models(provider), refresh, cache_file, ask)


def configured_model(cwd: str | None = None, *, refresh: bool = False,
                     cache_file: Path | None = None, ask: bool = True) -> str | None:
    """The ``model`` of OpenCode's own resolved config, as ``opencode debug config`` prints it
    in ``cwd`` (default: an empty folder, outside any project; `own_config`): the global config
    (``$XDG_CONFIG_HOME/opencode/opencode.json[c]``), ``OPENCODE_CONFIG``, the project's
    ``opencode.json`` and ``OPENCODE_CONFIG_CONTENT``, merged the way OpenCode merges them.
    None when no model is set. Cached like `known_models`.

    Raises OpencodeNotFound, or RuntimeError with OpenCode's message (a config that is not valid
    JSON(C), for example)."""
    where = os.path.abspath(cwd) if cwd else None

    def run() -> str | None:
        model = own_config(where).get("model")
        return model.strip() if isinstance(model, str) and model.strip() else None

    return _cached("config " + _setup_key(where or "-"), run, refresh, cache_file, ask)


def first_usable(models: list[dict[str, Any]]) -> str | None:
    """The model to fall back on: the first of a provider the user set up (any provider but
    OpenCode's built-in ``opencode``, which is listed without a key), else the first free
    ``opencode/*`` one, else the first listed; None for an empty list."""
    own = [m for m in models if m["provider"] != "opencode"]
    free = [m for m in models if is_free(m)]
    chosen = own or free or models
    return chosen[0]["id"] if chosen else None


def default_model(setting: str | None = None, cwd: str | None = None, *,
                  cache_file: Path | None = None, ask: bool = True) -> ModelChoice:
    """The model for a task that names none, first found of:

    1. ``setting``: the queue's setting (``set_default_model``), a choice made for this queue;
    2. ``$WORKER_MODEL``: a choice made for this worker's environment;
    3. the ``model`` of the user's own OpenCode config (`configured_model`, in ``cwd``);
    4. the first usable model ``opencode models`` lists (`first_usable`).

    Never a hard-coded name. Raises NoDefaultModel naming how to set one (OpencodeNotFound when
    the binary is missing and 3–4 are needed). With ``ask`` false OpenCode is not run: 3–4 come
    from the cache only, LookupError when they are not there."""
    if setting and setting.strip():
        return ModelChoice(setting.strip(), "set_default_model")
    if os.environ.get("WORKER_MODEL", "").strip():
        return ModelChoice(os.environ["WORKER_MODEL"].strip(), "WORKER_MODEL")
    try:
        configured = configured_model(cwd, cache_file=cache_file, ask=ask)
        if configured:
            return ModelChoice(configured, "OpenCode config")
        listed = first_usable(known_models(cache_file=cache_file, ask=ask))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise NoDefaultModel(f"no model to run with: OpenCode could not be asked ({exc}); "
                             "fix that or set WORKER_MODEL / set_default_model") from None
    if listed:
        return ModelChoice(listed, "opencode models")
    raise NoDefaultModel("no model to run with: OpenCode lists none; run `opencode auth login` or "
                         "configure a provider in OpenCode's config (see docs/models.md), "
                         "or set WORKER_MODEL / set_default_model")


def hosted_free_note(choice: ModelChoice) -> str | None:
    """What to tell a person whose tasks fall back on OpenCode's hosted free model (nothing set,
    nothing configured, no provider of their own: `first_usable` took an ``opencode/*`` one),
    naming the ways to choose; None for any other choice."""
    if choice.source != "opencode models" or not choice.model.startswith("opencode/"):
        return None
    return (f"no model is configured, so tasks that name none run on {choice.model}, OpenCode's hosted free "
            "model (the code and prompts go to OpenCode's service); choose one with `tasks_cli.py models` "
            "and set_default_model, WORKER_MODEL, or a model in your OpenCode config")


def search_models(models: list[dict[str, Any]], query: str | None) -> list[dict[str, Any]]:
    """The models whose id or name contains every word of ``query`` (case-insensitive), in
    OpenCode's order; all of them for an empty query. (`list_models` and `tasks_cli.py models`.)"""
    words = (query or "").lower().split()
    return [m for m in models if all(w in f"{m['id']} {m['name']}".lower() for w in words)]


def is_free(model: dict[str, Any]) -> bool:
    """Whether OpenCode prices the model at 0 USD for input and output (or gives no price)."""
    cost = model.get("cost") or {}
    return not any(cost.get(k) for k in ("input", "output"))


def match_model(name: str, models: list[dict[str, Any]]) -> str:
    """A full ``provider/model`` id for ``name``: an exact id (case-insensitive), or a plain
    model name that exactly one provider offers.

    Raises UnknownModel naming the closest ids (substring matches, then difflib's closest) or,
    for a plain name several providers offer, every candidate."""
    wanted = name.strip()
    if not wanted:
        raise UnknownModel("a model must be named: give a provider/model id "
                           "(`tasks_cli.py models` or list_models shows what is offered)")
    ids = [m["id"] for m in models]
    exact = [i for i in ids if i.lower() == wanted.lower()]
    if exact:
        return exact[0]
    plain = [i for i in ids if i.split("/", 1)[1].lower() == wanted.lower()] if "/" not in wanted else []
    if len(plain) == 1:
        return plain[0]
    if len(plain) > 1:
        raise UnknownModel(f"model name {wanted!r} is ambiguous: {', '.join(plain)}; give one of these ids")
    near = closest_models(wanted, ids)
    hint = f"; similar: {', '.join(near)}" if near else ""
    raise UnknownModel(f"model {shown_value(wanted)} is not offered by OpenCode here{hint} "
                       "(`tasks_cli.py models` or list_models shows what is)")


def closest_models(wanted: str, ids: list[str], count: int = 5) -> list[str]:
    """Up to ``count`` ids near ``wanted``: those containing it first, then difflib's closest by
    the whole id and by the model part."""
    low = wanted.lower()
    found = [i for i in ids if low in i.lower()]
    by_id = {i.lower(): i for i in ids}
    by_name = {i.split("/", 1)[1].lower(): i for i in ids}
    found += [by_id[m] for m in difflib.get_close_matches(low, list(by_id), n=count, cutoff=0.5)]
    found += [by_name[m] for m in difflib.get_close_matches(low.split("/")[-1], list(by_name), n=count, cutoff=0.5)]
    return list(dict.fromkeys(found))[:count]


def _parse_verbose_models(out: str) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    pos, text = 0, out
    while pos < len(text):
        newline = text.find("\n", pos)
        line = text[pos:newline if newline >= 0 else len(text)].strip()
        pos = newline + 1 if newline >= 0 else len(text)
        if not line or "/" not in line or line.startswith(("{", "}")):
            continue
        details: dict[str, Any] = {}
        rest = text[pos:].lstrip()
        if rest.startswith("{"):
            try:
                details, used = decoder.raw_decode(rest)
                pos = len(text) - len(rest) + used
            except ValueError:
                details = {}
        provider, _, name = line.partition("/")
        limit = details.get("limit") or {}
        models.append({
            "id": line, "provider": provider, "name": details.get("name") or name,
            "cost": details.get("cost"), "context": limit.get("context"),
            "output_limit": limit.get("output"),
        })
    return models
