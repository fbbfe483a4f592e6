"""Env knobs, read at call time, one reader for all of them: a value that is set but is not
a number in its range is refused with one line naming the variable, its value and the accepted
range (never silently replaced by the default, so a typo cannot hide). An unset or blank knob means
its default.

    import knobs
    knobs.knob("WORKER_SLOTS")                        # -> 1..16 (REGISTRY), or raises knobs.KnobError
    knobs.problems()                                  # every registered knob checked; [] when fine
    knobs.select_database(args.db)                    # --db URL / $TASK_DB_URL checked (and set)

Entry points (worker.py, serve.py, doctor.py, the MCP server) call ``problems()`` before they
start anything, so a bad value stops them at once with its message instead of mid-run; every entry
point with ``--db`` (worker, CLI, both MCP servers, serve.py) calls ``select_database`` first.

Env: the numeric knobs of REGISTRY; TASK_DB_URL (the database switch, checked by
``select_database``). Not run on its own.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

DAY_SEC = 86_400.0
# name -> (kind, default, lowest, highest): the knobs every entry point checks up front.
REGISTRY: dict[str, tuple[type, float, float, float]] = {
    "PORT": (int, 8765, 1, 65535),
    "WORKER_SLOTS": (int, 1, 1, 16),
    "WORKER_ENGINE": (int, 0, 0, 1),
    "WORKER_STALE_SEC": (float, 900, 0, 30 * DAY_SEC),
    "WORKER_INACTIVITY_SEC": (float, 600, 0.1, 30 * DAY_SEC),
    "WORKER_KILL_GRACE_SEC": (float, 5, 0, 3600),
    "WORKER_EXIT_GRACE_SEC": (float, 10, 0, 3600),
    "WORKER_POLL_SEC": (float, 0.5, 0.01, 60),
    "WORKER_LEASE_SEC": (float, 1, 0.01, 3600),
    "WORKER_LIMIT_HOLD_SEC": (float, 30, 0, DAY_SEC),
    "WORKER_LIMIT_MARGIN_SEC": (float, 5, 0, 3600),
    "WORKER_LIMIT_BACKOFF_SEC": (float, 60, 1, DAY_SEC),
    "WORKER_LIMIT_ROUNDS": (int, 3, 1, 20),
    "TASKBRIDGE_GIT_TIMEOUT_SEC": (float, 300, 0.1, DAY_SEC),
    "MCP_WAIT_POLL_SEC": (float, 0.2, 0.01, 5),
    "MCP_CHANNEL_PUSH": (int, 1, 0, 1),
    "CLAUDE_CODE_MAX_RETRIES": (int, 2, 0, 20),
    "CLAUDE_STALL_SEC": (int, 60, 1, 3600),
    "CLAUDE_MAX_TOKENS": (int, 8192, 1, 128_000),
    "CLAUDE_MAX_PARALLEL": (int, 4, 1, 64),
}

# The knobs that are on/off switches (a 0..1 int above): what each value means, for the message.
SWITCHES: dict[str, tuple[str, str]] = {
    "WORKER_ENGINE": ("a new `opencode run` per attempt", "the warm engine, a kept `opencode serve` per slot"),
    "MCP_CHANNEL_PUSH": ("no Claude Code channel notices", "a notice when a task ends or asks"),
}


class KnobError(ValueError):
    """An env knob is set to something that is not a number in its range (the message says which)."""


# Words a switch also takes for 0 and 1: the names its command-line flag uses.
SWITCH_WORDS: dict[str, tuple[str, str]] = {"WORKER_ENGINE": ("cold", "warm")}


def _read(name: str, kind: type, default: float, lo: float, hi: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return kind(default)
    words = SWITCH_WORDS.get(name, ())
    if raw.lower() in words:
        return kind(words.index(raw.lower()))
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not lo <= value <= hi:
        if name in SWITCHES:
            (off, on), (off_word, on_word) = SWITCHES[name], [f", {w}" for w in words] if words else ("", "")
            raise KnobError(f"{name}={raw!r} is not 0 or 1 (0{off_word}: {off}; 1{on_word}: {on}); fix it or "
                            f"unset it (default {default:g})")
        what = "a whole number" if kind is int else "a number"
        raise KnobError(f"{name}={raw!r} is not {what} from {lo:g} to {hi:g}; fix it or unset it "
                        f"(default {default:g})")
    return value


def knob(name: str) -> float:
    """A registered knob's value (its REGISTRY range and default). Raises KnobError."""
    kind, default, lo, hi = REGISTRY[name]
    return _read(name, kind, default, lo, hi)


# The stale limit against the lease renewal: a worker requeues a running task whose heartbeat is
# older than WORKER_STALE_SEC, and a live worker renews it every WORKER_LEASE_SEC. Heartbeats are
# stored to the second, a renewal is a database round trip that may wait behind the write lock
# (seconds on a loaded queue), and an unchanged worker row is refreshed every 5 s: a limit under
# ten renewals, or under STALE_FLOOR_SEC, requeues (and runs twice) tasks whose worker is alive.
STALE_LEASES_MIN = 10
STALE_FLOOR_SEC = 10.0


def stale_problem() -> str | None:
    """Why WORKER_STALE_SEC is too short for WORKER_LEASE_SEC (one line naming both), or None.
    Raises KnobError when either is not a number in its range."""
    stale, lease = knob("WORKER_STALE_SEC"), knob("WORKER_LEASE_SEC")
    least = max(STALE_FLOOR_SEC, STALE_LEASES_MIN * lease)
    if stale >= least:
        return None
    return (f"WORKER_STALE_SEC={stale:g} is below {least:g} s ({STALE_LEASES_MIN} x WORKER_LEASE_SEC={lease:g}, "
            f"and at least {STALE_FLOOR_SEC:g} s): workers would requeue tasks whose worker is alive; raise "
            f"WORKER_STALE_SEC (default {REGISTRY['WORKER_STALE_SEC'][1]:g}) or lower WORKER_LEASE_SEC")


def problems(names: tuple[str, ...] | None = None) -> list[str]:
    """One message per registered knob (or per one of ``names``) whose value is refused, then
    (when both are fine and checked) a WORKER_STALE_SEC too short for WORKER_LEASE_SEC
    (``stale_problem``)."""
    out = []
    names = names or tuple(REGISTRY)
    for name in names:
        try:
            knob(name)
        except KnobError as exc:
            out.append(str(exc))
    if not out and "WORKER_STALE_SEC" in names:
        with contextlib.suppress(KnobError):
            out += [problem for problem in [stale_problem()] if problem]
    return out


# --------------------------------------------------------------------------------------------
# The database switch: --db URL on every entry point, which only sets TASK_DB_URL.

DB_SCHEMES = ("postgresql", "postgres")


def database_problem(value: str, source: str = "TASK_DB_URL") -> str | None:
    """Why ``value`` cannot name the queue's database (one line naming ``source``, the flag or
    the variable it came from), or None. Accepted: a ``postgresql://`` / ``postgres://`` URL or a
    SQLite file path (not a folder). A URL is never quoted past its scheme: it may hold a password."""
    way_out = "give a postgresql://USER@HOST/DB URL or the SQLite file's path"
    if not value.strip():
        return f"{source} is empty; {way_out} (or leave it out for <repo>/tasks.db)"
    if is_keyword_dsn(value):
        return (f"{source} is a libpq key=value string; give it as a URL instead: "
                "postgresql://USER@HOST:PORT/DB (the password in ~/.pgpass, or postgresql://USER:PASSWORD@...)")
    if "\0" in value or any("\ud800" <= ch <= "\udfff" for ch in value):
        return f"{source} holds a NUL or bytes that are not UTF-8; {way_out}"
    if value.lower().startswith("postgres") and ":" in value and "://" not in value:
        return f"{source} is not a URL (it needs postgresql:// with two slashes); fix the URL"
    scheme, sep, _ = value.partition("://")
    if sep and _is_scheme(scheme):
        if scheme.lower() not in DB_SCHEMES:
            return (f"{source} is a {scheme}:// URL; only postgresql:// and postgres:// URLs are understood "
                    "(for SQLite give the file's path, e.g. /path/to/tasks.db)")
        try:
            urllib.parse.urlsplit(value).port   # noqa: B018 - reading it raises ValueError for a bad port
        except ValueError:
            return f"{source} is a {scheme}:// URL whose port is not a number from 0 to 65535; fix the URL"
        return None
    path = os.path.expanduser(value)
    if os.path.isdir(path):
        return f"{source} {value} is a folder; give the SQLite file in it (e.g. {os.path.join(value, 'tasks.db')})"
    if os.path.exists(path) and not os.path.isfile(path):
        return (f"{source} {value} is not a regular file (a device, pipe or socket); give the path of a queue "
                "file such as /path/to/tasks.db (a new one is made on first use)")
    return None


# libpq's connection keywords: "host=db port=5432 dbname=q" is a keyword/value connection string.
_DSN_WORD = re.compile(r"(?:^|\s)(?:host|hostaddr|port|dbname|user|password|passfile|sslmode|service)\s*=",
                       re.IGNORECASE)


def is_keyword_dsn(value: str) -> bool:
    """Whether ``value`` is a libpq keyword/value string (``host=… dbname=…``) rather than a URL or
    a file path: such a value must be refused, not taken for a file name (it holds a password)."""
    return "://" not in value and bool(_DSN_WORD.search(value))


def _is_scheme(text: str) -> bool:
    """Whether ``text`` looks like a URL scheme (RFC 3986: a letter, then letters, digits, + - .)."""
    return bool(text) and text[0].isascii() and text[0].isalpha() and \
        all(ch.isascii() and (ch.isalnum() or ch in "+-.") for ch in text)


# The XDG base folders and their defaults under HOME (the XDG Base Directory spec's).
XDG_DEFAULTS = {"XDG_CONFIG_HOME": ".config", "XDG_DATA_HOME": ".local/share", "XDG_STATE_HOME": ".local/state",
                "XDG_CACHE_HOME": ".cache"}


def xdg_home(name: str, env: Mapping[str, str] | None = None) -> Path:
    """The XDG base folder ``name`` (a key of XDG_DEFAULTS) as ``env`` (default os.environ) sets
    it, else its default under ``env``'s HOME (``~/.config``, ``~/.local/share``,
    ``~/.local/state``, ``~/.cache``): how TaskBridge and OpenCode (xdg-basedir) find them on every
    platform. Not resolved."""
    found = os.environ if env is None else env
    return Path(found.get(name) or Path(found.get("HOME") or Path.home()) / XDG_DEFAULTS[name])


def select_database(flag: str | None) -> None:
    """Apply an entry point's ``--db`` (``flag``; None when not given): checked, then set as
    TASK_DB_URL for this process and every child it starts (by environment, never argv, which
    ``ps`` shows). A file path is made absolute (children may run elsewhere); from ``--db`` it is
    set as TASK_DB_PATH too, which means the same. Without a flag, a set TASK_DB_URL is checked.
    Raises KnobError (one line, no password) when the value cannot be used."""
    value = flag if flag is not None else os.environ.get("TASK_DB_URL")
    if value is None:
        return   # unset: the SQLite default
    # Set but empty is refused, unlike a numeric knob: a service whose unit expands an unset
    # variable to "" would otherwise run a private SQLite queue beside the shared one, in silence.
    problem = database_problem(value, "--db" if flag is not None else "TASK_DB_URL")
    if problem:
        raise KnobError(problem)
    if "://" not in value:
        value = os.path.abspath(os.path.expanduser(value))
        if flag is not None:
            os.environ["TASK_DB_PATH"] = value
            GIVEN_DB_FILE[0] = value
    os.environ["TASK_DB_URL"] = value


# The queue file this process was given by --db (None: none given, or a URL, whose password a hint
# must not repeat): every command line TaskBridge suggests names it again (task_store.script_command),
# or a pasted hint would act on the default queue.
GIVEN_DB_FILE: list[str | None] = [None]
