"""`tasks_cli.py doctor`: is this TaskBridge set-up able to run tasks, and if not, what to do.

Each check returns one `Check` (ok / warn / fail, what was found, the fix): Python and the
packages of requirements.txt, the opencode binary and its version against the pinned one, the
default model (listed by `opencode models`; with ``live`` a one-line prompt runs through it), the
queue database (opens, integrity, journal mode, filesystem), the agent box (bubblewrap or sandbox-exec),
the engine (cold, or with WORKER_ENGINE=1 a kept `opencode serve` started once to see that it starts),
the worker (heartbeat, schedule, last pass), the token file's permissions, the MCP server on ``$PORT``
when one answers, and the reverse bridge's backend (an API key, or the `claude` CLI logged in).
A warn is worth knowing; a fail stops tasks from running (the command exits 1).

Env read at call time: those of the parts it checks (TASK_DB_PATH, OPENCODE_BIN, WORKER_MODEL,
MCP_TOKEN_FILE, MCP_BEARER_TOKEN, ANTHROPIC_API_KEY, CLAUDE_BIN, ...), ``PORT`` (the MCP server's
loopback port, default 8765, as serve.py). No SQL here.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import agent_box
import knobs
import opencode_runner as oc
import task_store as store
import task_views
from launchd import schedule

REPO = Path(__file__).resolve().parent
LIVE_PROMPT = "Reply with the single word: ok"
LIVE_TIMEOUT_SEC = 120
HEALTH_TIMEOUT_SEC = 2.0


@dataclass
class Check:
    """One line of the doctor's report."""
    name: str
    status: str          # "ok", "warn" or "fail"
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def run_checks(live: bool = False) -> list[Check]:
    """Every check in order; a check that breaks unexpectedly is a fail naming the error."""
    checks: list[Callable[[], Check]] = [check_python, check_knobs, check_box, check_opencode, check_engine,
                                         lambda: check_model(live), check_database, check_folders, check_worker,
                                         check_leftover_worktrees, check_token, check_server, check_reverse_bridge]
    return [run_check(check) for check in checks]


def run_check(check: Callable[[], Check]) -> Check:
    """One check's line; one that breaks is a fail: a bad setting it reads said in that setting's
    words (the settings line says it too), anything else naming the error."""
    name = getattr(check, "__name__", "check").removeprefix("check_").replace("<lambda>", "default model")
    try:
        return check()
    except knobs.KnobError as exc:
        return Check(name, "fail", str(exc), "fix or unset the knob named")
    except store.TaskStoreError as exc:   # the queue's own words: the problem and the way out (the database line too)
        return Check(name, "fail", f"the queue cannot be read for this check: {exc}")
    except Exception as exc:  # noqa: BLE001 - the doctor must report, not crash
        return Check(name, "fail", f"the check itself failed: {exc!r}")


def check_python() -> Check:
    """Python ≥ 3.11 and every package requirements.txt names, installed."""
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < (3, 11):  # noqa: UP036 - doctor says so when install.sh's floor is not met by this python

        return Check("python", "fail", f"Python {version} at {sys.executable}; TaskBridge needs 3.11 or newer",
                     "PYTHON=/path/to/python3.11 ./install.sh")
    missing = []
    names = required_packages()
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        return Check("python", "fail", f"Python {version}; missing packages: {', '.join(missing)}",
                     "./install.sh (or .venv/bin/python -m pip install -r requirements.txt), and run "
                     "TaskBridge with .venv/bin/python")
    return Check("python", "ok", f"Python {version} at {sys.executable}; {len(names)} packages installed")


def required_packages() -> list[str]:
    """The distribution names in requirements.txt."""
    names = []
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if match:
            names.append(match.group(1))
    return names


def pinned_opencode() -> str | None:
    """The opencode-ai version package.json pins."""
    try:
        return json.loads((REPO / "package.json").read_text())["dependencies"]["opencode-ai"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_opencode() -> Check:
    """The opencode binary is found and answers --version; a version other than the pin warns."""
    try:
        binary = oc.opencode_bin()
    except oc.OpencodeNotFound as exc:
        return Check("opencode", "fail", str(exc).split(";")[0], "./install.sh (it pins opencode in node_modules/), "
                     "or set OPENCODE_BIN to the binary")
    try:
        proc = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("opencode", "fail", f"{binary} does not run: {exc}", "./install.sh, or fix OPENCODE_BIN")
    version = (proc.stdout or "").strip().splitlines()[-1:] or [""]
    if proc.returncode != 0 or not version[0]:
        said = oc.opencode_error(proc, "opencode --version")
        return Check("opencode", "fail", f"{binary} --version failed: {said}", "./install.sh, or fix OPENCODE_BIN")
    pinned = pinned_opencode()
    if pinned and version[0] != pinned:
        return Check("opencode", "warn", f"opencode {version[0]} at {binary}; TaskBridge is tested with {pinned}",
                     f"./install.sh installs {pinned} in node_modules/; set OPENCODE_BIN to it "
                     "(an opencode on PATH comes first)")
    return Check("opencode", "ok", f"opencode {version[0]} at {binary}")


def check_model(live: bool) -> Check:
    """The default model is chosen, listed by `opencode models`, and (live) answers a prompt."""
    cache = task_views.models_cache_file()
    try:
        choice = oc.default_model(store.default_model() if store.queue_exists() else None, cache_file=cache)
        models = oc.known_models(cache_file=cache, refresh=True)
    except oc.OpencodeNotFound:
        return Check("default model", "fail", "cannot be chosen or checked: opencode is missing",
                     "see the opencode line")
    except (oc.NoDefaultModel, RuntimeError, subprocess.TimeoutExpired) as exc:
        return Check("default model", "fail", str(exc), "docs/models.md")
    except store.TaskStoreError as exc:
        return Check("default model", "fail", f"the queue's setting cannot be read: {exc}", "see the database line")
    named = f"{choice.model} (from {choice.source})"
    if choice.model not in {m["id"] for m in models}:
        near = oc.closest_models(choice.model, [m["id"] for m in models])
        return Check("default model", "fail",
                     f"{named} is not offered by OpenCode here" + (f"; similar: {', '.join(near)}" if near else ""),
                     fix_for_source(choice.source))
    hosted = oc.hosted_free_note(choice)
    if hosted:
        return Check("default model", "warn", hosted[0].upper() + hosted[1:], "docs/models.md")
    if not live:
        return Check("default model", "ok", f"{named}, listed by `opencode models` (--live runs a prompt through it)")
    said = live_prompt(choice.model)
    if said is None:
        return Check("default model", "ok", f"{named} answered a one-line prompt")
    return Check("default model", "fail", f"{named} is listed but a one-line prompt failed: {said}",
                 "check the provider's key (`opencode auth login`) or server; " + fix_for_source(choice.source))


def fix_for_source(source: str) -> str:
    """How to change the default model, where it came from."""
    return {"set_default_model": "set another with the MCP tool set_default_model (`tasks_cli.py models` lists them)",
            "WORKER_MODEL": "set WORKER_MODEL to one `tasks_cli.py models` lists, or unset it",
            "OpenCode config": "change `model` in your OpenCode config to one `tasks_cli.py models` lists",
            }.get(source, "configure a provider (docs/models.md)")


def live_prompt(model: str) -> str | None:
    """Run a one-line prompt through ``model`` with `opencode run` in an empty temp folder; None
    when it answered, else OpenCode's own error."""
    with tempfile.TemporaryDirectory(prefix="taskbridge-doctor-") as folder:
        argv = [oc.opencode_bin(), "run", "--format", "json", "-m", model, "--title", "taskbridge-doctor",
                "--print-logs", "--log-level", "ERROR"]
        try:
            proc = subprocess.run(argv, input=LIVE_PROMPT, capture_output=True, text=True, cwd=folder,
                                  env={**os.environ, "PWD": folder}, timeout=LIVE_TIMEOUT_SEC,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return f"no answer within {LIVE_TIMEOUT_SEC} s"
    stream = oc.EventStream()
    for text in proc.stdout.splitlines():
        stream.feed(text)
    if stream.finished and not stream.errors:
        return None
    said = "; ".join(stream.errors + oc.logged_errors(proc.stderr.splitlines()))
    return said or oc.opencode_error(proc, "opencode run") or f"opencode run exited {proc.returncode}"


def check_database() -> Check:
    """The queue database can be written by this user (the file, SQLite's files beside it, its
    folder, its filesystem), opens, passes SQLite's integrity check, and sits on a local disk; on
    PostgreSQL (TASK_DB_URL), the server answers and the queue's schema is there."""
    if store.backend() == "postgresql":
        return check_postgres()
    path = store.db_path()
    # SQLite opens a file it may only read read-only without a word: the health below would pass
    # while every write (a submit, a worker's claim) is refused.
    unwritable = store.write_problem(path)
    if unwritable is not None:
        return Check("database", "fail", f"{path} cannot be written: {unwritable[0]}", unwritable[1])
    if went := store.queue_left_in_use():   # before anything opens what is at the path
        return Check("database", "fail", f"{path} is in no state to open: {went}",
                     "put its file back there (with its -wal and -shm if they went with it) and the worker carries "
                     "on; to use a new or another file there, stop that worker first (and move the old file's -wal "
                     "and -shm next to the old file)")
    if not path.exists():
        return Check("database", "ok", f"{path}: not created yet (the first submit or worker pass makes it)")
    try:
        health = store.database_health(path)
    except store.ValidationError as exc:
        return Check("database", "fail", str(exc).split(";")[0], "; ".join(str(exc).split(";")[1:]).strip())
    except (store.DatabaseUnusable, store.DatabaseBusy, store.StorageFault, OSError) as exc:
        # A damaged queue is moved aside; any other file (/etc/passwd) or fault gets the store's way out.
        fix = getattr(exc, "way_out", "") if not isinstance(exc, store.DatabaseCorrupt) else ""
        return Check("database", "fail", f"{path} cannot be used: {getattr(exc, 'detail', exc)}",
                     fix or f"move it aside (mv {path} {path}.broken; a fresh queue is made on the next use) "
                            "or point TASK_DB_PATH at a good one")
    where = f" on {health['filesystem'][0]}" if health["filesystem"] else ""
    detail = (f"{path}: {health['tasks']} task(s), integrity {health['integrity']}, "
              f"journal {health['journal_mode']}{where}")
    if health["integrity"] != "ok":
        broken = store.shell_command("mv", path, f"{path}.broken")
        return Check("database", "fail", detail, f"copy what you need, then {broken} "
                     "(sqlite3 .recover can salvage rows)")
    if health["journal_mode"] != "wal":
        return Check("database", "warn", detail, "WAL lets readers work during writes; unset TASK_DB_JOURNAL "
                     "on a local disk")
    return Check("database", "ok", detail)


def check_folders() -> Check:
    """The worker's log and worktree folders can be made and written: a worker that finds one
    that cannot claims nothing (``worktrees.folders_problem``)."""
    import worktrees
    problem = worktrees.folders_problem()
    if problem:
        said, _, way_out = problem.partition("; ")
        return Check("folders", "fail", said, way_out)
    return Check("folders", "ok", f"task logs {store.log_dir()}, worktrees {worktrees.worktree_root()}: writable")


def check_postgres() -> Check:
    """The PostgreSQL queue: reachable, migrated, its server version and task count."""
    try:
        health = store.database_health()
    except store.TaskStoreError as exc:
        said, _, way_out = str(exc).partition("; ")
        return Check("database", "fail", said, way_out)
    return Check("database", "ok", f"{health['path']}: {health['tasks']} task(s), PostgreSQL "
                 f"{health['server_version'].split()[0]}, integrity {health['integrity']}")


def check_worker() -> Check:
    """The worker's heartbeat, the every-60-s schedule, the last pass."""
    try:
        beat = task_views.worker_state()
    except (store.TaskStoreError, OSError) as exc:
        return Check("worker", "fail", f"the heartbeat cannot be read: {exc}", "see the database line")
    schedule = schedule_line()
    installed = "not installed" not in schedule and not schedule.startswith("no launchd")
    if not beat["seen"]:
        return Check("worker", "warn", f"no worker has run on this queue yet; {schedule}",
                     f"{store.script_command('worker.py', '--watch')} "
                     "(or ./install.sh --schedule for a pass every 60 s)")
    detail = f"{beat['summary']}; {schedule}" + others_line()
    if beat.get("died"):
        return Check("worker", "warn", f"{detail}; {task_views.gone_words(beat)}",
                     f"{store.script_command('worker.py', '--watch')}, "
                     f"or {store.script_command('worker.py')} for one pass")
    if beat.get("pid_running") is False and "not installed" in schedule:
        # Its process ended cleanly (a one-pass run, a stopped --watch) and no schedule starts the
        # next pass: however young its heartbeat, nothing serves the queue now.
        return Check("worker", "warn", f"{detail}: no worker serves this queue now",
                     f"{store.script_command('worker.py', '--watch')}, or ./install.sh --schedule")
    if not beat["recent"] and not (beat.get("pid_running") and beat.get("state") == "idle"):
        return Check("worker", "warn", detail, f"{store.script_command('worker.py', '--watch')}, or ./install.sh "
                     "--schedule" if not installed else
                     f"the schedule is installed but quiet: {store.script_command('launchd/schedule.py', 'status')}")
    return Check("worker", "ok", detail)


def others_line() -> str:
    """``; 3 workers report: h1 pid 12 online, ...`` when more than one worker (any host) has
    reported to this queue; else nothing."""
    workers = task_views.workers_state()
    if len(workers) < 2:
        return ""
    shown = ", ".join(f"{w['host']} pid {w['pid']} {w['label']}" for w in workers[:10])
    return f"; {len(workers)} workers report: {shown}" + (", …" if len(workers) > 10 else "")


def schedule_line() -> str:
    """The first line of `launchd/schedule.py status` (installed or not)."""
    try:
        return "schedule: " + schedule.status().splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - systemctl/launchctl may be missing or refuse
        return f"schedule: unknown ({exc})"


def check_leftover_worktrees() -> Check:
    """Worktrees of remote tasks left on this machine that the queue no longer points at here
    (an attempt taken over by another host, a cleared task): listed with the command that
    removes each; one holding a commit the remote has not is named first (push it or lose it)."""
    import worktrees
    try:
        left = worktrees.leftover_remote_worktrees()
    except worktrees.Unrunnable as exc:
        return Check("leftover worktrees", "warn", str(exc), "set TASKBRIDGE_MIRROR_DIR to an absolute path")
    if not left:
        return Check("leftover worktrees", "ok", "no worktree of a remote task is left behind on this machine")
    unpushed = [item for item in left if item["unpushed"]]
    shown = "; ".join(f"{item['path']} ({item['why']}"
                      + (f"; holds commit {item['unpushed'][:12]}, on no branch of the remote"
                         if item["unpushed"] else "")
                      + ")" for item in left[:5])
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    fix = " ; ".join(item["remove"] for item in left[:5] if not item["unpushed"])
    if unpushed:
        fix = ("push or copy the unpushed commit(s) first (git -C <path> push <repo> HEAD:refs/heads/<branch>), "
               "then remove" + (f": {fix}" if fix else " them"))
    return Check("leftover worktrees", "warn",
                 f"{len(left)} worktree(s) of remote tasks nobody will remove: {shown}{more}", fix or "remove them")


def check_token() -> Check:
    """The bearer token's file exists and only its owner can read it."""
    import http_app
    if os.environ.get("MCP_BEARER_TOKEN", "").strip():
        return Check("token", "ok", "from MCP_BEARER_TOKEN")
    path = http_app.token_file()
    if not path.exists():
        return Check("token", "warn", f"no token file at {path}: the HTTP transport would refuse to start",
                     "./install.sh writes one (stdio clients need none)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Check("token", "fail", f"{path} is readable by others (mode {mode:o})",
                     store.shell_command("chmod", "600", path))
    try:
        http_app.bearer_token()
    except http_app.TokenConfigError as exc:
        return Check("token", "fail", str(exc), "./install.sh writes a good one (delete the bad file first)")
    return Check("token", "ok", f"{path} (mode {mode:o})")


def check_knobs() -> Check:
    """Every numeric env knob (knobs.REGISTRY) holds a number in its range, or is unset."""
    refused = knobs.problems()
    if refused:
        return Check("settings", "fail", "; ".join(refused),
                     "fix or unset " + ", ".join(line.split("=")[0] for line in refused))
    return Check("settings", "ok", f"the {len(knobs.REGISTRY)} numeric env knobs are unset or in range")


def check_box() -> Check:
    """The agent box: the mechanism every run gets (bubblewrap probed by making its namespaces
    once, sandbox-exec on macOS), or why none, with the fix; a bad box knob fails."""
    problems = agent_box.problems()
    if problems:
        return Check("agent box", "fail", "; ".join(problems), "fix or unset the knob named")
    box = agent_box.choose("auto")
    if box.mechanism and not shutil.which("rg"):
        return Check("agent box", "warn", f"{box.label}, but ripgrep (rg) is not on PATH: OpenCode's grep and glob "
                     "tools fail in the box, which cannot download it (its bin/ is read-only to runs)",
                     "install ripgrep (apt install ripgrep, brew install ripgrep)")
    if box.mechanism:
        return Check("agent box", "ok", f"{box.label}: every agent run is contained by the operating system")
    return Check("agent box", "warn", f"none: {box.reason}; agents run uncontained, and readonly, no-shell and "
                 "no-network tasks fail unless TASKBRIDGE_ALLOW_PROMPT_LEVEL=1", box.fix)


def check_engine() -> Check:
    """The engine the worker runs tasks on: cold (a new ``opencode run`` per attempt), or with
    ``WORKER_ENGINE=1`` a kept ``opencode serve`` per slot, which is then started once here
    (unboxed, in an empty temporary folder, the user's OpenCode config) and stopped: its start
    time, or its one-line reason it cannot start (binary, port, config)."""
    if knobs.knob("WORKER_ENGINE") != 1:
        return Check("engine", "ok", "cold: a new `opencode run` per attempt (worker.py --engine warm, or "
                     "WORKER_ENGINE=1, keeps an `opencode serve` per slot, started ahead)")
    import engine  # only here: the check starts a server
    with tempfile.TemporaryDirectory(prefix="taskbridge-doctor-") as folder:
        env = oc.run_env(agent_box.agent_env(dict(os.environ), None), folder, "doctor", store.queue_tag(), "auto")
        started = time.monotonic()
        try:
            with engine.Engine(env, folder).start() as server:
                version = server.health().get("version", "?")
        except engine.EngineError as exc:
            return Check("engine", "fail", f"warm (WORKER_ENGINE=1), but {exc}",
                         "fix what it names, or run cold (WORKER_ENGINE=0): the worker then runs every task cold")
    return Check("engine", "ok", f"warm (WORKER_ENGINE=1): a kept `opencode serve` {version} starts in "
                 f"{time.monotonic() - started:.1f} s and answers")


def check_server() -> Check:
    """When something answers on 127.0.0.1 at the port of the serve.py serving this queue (else
    $PORT): TaskBridge's /health, and the token accepted."""
    serving = store.served_by()
    try:
        port = serving[1] if serving else knobs.knob("PORT")
    except knobs.KnobError:
        return Check("mcp server", "warn", "not checked: PORT is not a port number", "see the settings line")
    base = f"http://127.0.0.1:{port}"
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=HEALTH_TIMEOUT_SEC) as answer:
            health = json.loads(answer.read() or b"{}")
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return Check("mcp server", "ok", f"none running on {base} (stdio clients start their own; "
                         "./install.sh or serve.py serves HTTP)")
        return Check("mcp server", "warn", f"{base}/health did not answer: {exc.reason}",
                     "is another program on this port? set PORT")
    except (OSError, ValueError) as exc:
        return Check("mcp server", "warn", f"{base}/health did not answer as TaskBridge does: {exc}",
                     "is another program on this port? set PORT")
    if not isinstance(health, dict) or health.get("ok") is not True:
        return Check("mcp server", "warn", f"{base}/health answered {str(health)[:80]}",
                     "set PORT to TaskBridge's port")
    return Check("mcp server", *token_accepted(base, health.get("version")))


def token_accepted(base: str, version: Any) -> tuple[str, str, str]:
    """(status, detail, fix) of /api/status asked with this set-up's token."""
    import http_app
    try:
        token = http_app.bearer_token()
    except http_app.TokenConfigError:
        token = None
    request = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"Bearer {token or ''}"})
    try:
        with urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT_SEC):
            return "ok", f"TaskBridge {version} answers on {base}; the token is accepted", ""
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return ("fail", f"TaskBridge {version} answers on {base} but refuses this set-up's token",
                    "restart the server after changing the token, "
                    "or set MCP_TOKEN_FILE / MCP_BEARER_TOKEN to its token")
        return "warn", f"TaskBridge {version} on {base}: /api/status answered {exc.code}", "see the server's log"
    except (urllib.error.URLError, OSError) as exc:
        return "warn", f"TaskBridge {version} on {base}: /api/status did not answer ({exc})", "see the server's log"


def check_reverse_bridge() -> Check:
    """The reverse bridge's backend: the API with a key, or the `claude` CLI logged in."""
    import claude_control_mcp as bridge
    try:
        backend, reason = bridge.choose_backend()
    except bridge.BridgeError as exc:
        return Check("reverse bridge", "warn", f"no backend: {exc.message}",
                     "set ANTHROPIC_API_KEY, or install the claude CLI and run `claude login` (only needed "
                     "when OpenCode asks Claude)")
    if backend == "api":
        if not bridge.api_key_present():
            return Check("reverse bridge", "warn",
                         f"the API backend is chosen ({reason}) but ANTHROPIC_API_KEY is not set",
                         "set ANTHROPIC_API_KEY, or CLAUDE_BACKEND=auto to use the claude CLI")
        return Check("reverse bridge", "ok", f"Anthropic API ({reason})")
    binary = bridge.claude_bin()
    if binary is None:
        return Check("reverse bridge", "warn", "no ANTHROPIC_API_KEY and no claude CLI found",
                     "set ANTHROPIC_API_KEY, or install the claude CLI and run `claude login` (only needed "
                     "when OpenCode asks Claude)")
    logged_in, method = bridge.cli_auth(binary) if binary else (None, None)
    if logged_in is False:
        return Check("reverse bridge", "warn", f"the claude CLI at {binary} is not logged in",
                     "run `claude login` or set ANTHROPIC_API_KEY (only needed when OpenCode asks Claude)")
    said = "logged in" + (f" ({method})" if method else "") if logged_in else "login state unknown"
    return Check("reverse bridge", "ok", f"the claude CLI at {binary}, {said}")
