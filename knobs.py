"""Numeric env knobs, read at call time, one reader for all of them: a value that is set but is not
a number in its range is refused with one line naming the variable, its value and the accepted
range (never silently replaced by the default, so a typo cannot hide). An unset or blank knob means
its default.

    import knobs
    knobs.knob("WORKER_SLOTS")                        # -> 1..16 (REGISTRY), or raises knobs.KnobError
    knobs.problems()                                  # every registered knob checked; [] when fine

Entry points (worker.py, serve.py, doctor.py, the MCP server) call ``problems()`` before they
start anything, so a bad value stops them at once with its message instead of mid-run.
"""
from __future__ import annotations

import math
import os

DAY_SEC = 86_400.0
# name -> (kind, default, lowest, highest): the knobs every entry point checks up front.
REGISTRY: dict[str, tuple[type, float, float, float]] = {
    "PORT": (int, 8765, 1, 65535),
    "WORKER_SLOTS": (int, 1, 1, 16),
    "WORKER_STALE_SEC": (float, 900, 0, 30 * DAY_SEC),
    "WORKER_INACTIVITY_SEC": (float, 600, 0.1, 30 * DAY_SEC),
    "WORKER_KILL_GRACE_SEC": (float, 5, 0, 3600),
    "WORKER_EXIT_GRACE_SEC": (float, 10, 0, 3600),
    "WORKER_POLL_SEC": (float, 0.5, 0.01, 60),
    "WORKER_LEASE_SEC": (float, 1, 0.01, 3600),
    "TASKBRIDGE_GIT_TIMEOUT_SEC": (float, 300, 0.1, DAY_SEC),
    "MCP_WAIT_POLL_SEC": (float, 0.2, 0.01, 5),
    "CLAUDE_CODE_MAX_RETRIES": (int, 2, 0, 20),
    "CLAUDE_STALL_SEC": (int, 60, 1, 3600),
    "CLAUDE_MAX_TOKENS": (int, 8192, 1, 128_000),
    "CLAUDE_MAX_PARALLEL": (int, 4, 1, 64),
}


class KnobError(ValueError):
    """An env knob is set to something that is not a number in its range (the message says which)."""


def _read(name: str, kind: type, default: float, lo: float, hi: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not lo <= value <= hi:
        what = "a whole number" if kind is int else "a number"
        raise KnobError(f"{name}={raw!r} is not {what} from {lo:g} to {hi:g}; fix it or unset it "
                        f"(default {default:g})")
    return value


def knob(name: str) -> float:
    """A registered knob's value (its REGISTRY range and default). Raises KnobError."""
    kind, default, lo, hi = REGISTRY[name]
    return _read(name, kind, default, lo, hi)


def problems(names: tuple[str, ...] | None = None) -> list[str]:
    """One message per registered knob (or per one of ``names``) whose value is refused."""
    out = []
    for name in names or tuple(REGISTRY):
        try:
            knob(name)
        except KnobError as exc:
            out.append(str(exc))
    return out
