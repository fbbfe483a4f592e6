"""A task's numeric and text fields, their bounds and defaults, defined once: the store's
validation (task_store), the MCP tools' schemas (opencode_bridge_mcp: ``Bound.field``) and the
CLI's options (tasks_cli: ``Bound.click_type``) read them from here, so a bound or a default is
never spelled in two places.

    import task_spec
    task_spec.TIMEOUT.default                  # 1800 (seconds per attempt)
    task_spec.TIMEOUT.field("seconds per attempt")   # pydantic Field(ge=1, le=86400, description=…)
    task_spec.TIMEOUT.click_type()             # click.IntRange(1, 86400)

Env: none. Not run on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

N = TypeVar("N", int, float)   # a bound's number type: what ``kind`` says

DAY_SEC = 86_400


@dataclass(frozen=True)
class Bound(Generic[N]):
    """One numeric field: ``kind`` (int or float), ``default`` (None: absent unless given),
    the accepted range ``lo``..``hi`` (``lo`` itself refused when ``lo_open``: "above 0") and
    the ``unit`` a message names (seconds, USD, tokens, or "")."""

    name: str
    kind: type[N]
    default: N | None
    lo: N
    hi: N
    unit: str = ""
    lo_open: bool = False

    @property
    def range(self) -> tuple[N, N]:
        """``(lo, hi)``, for the store's ``coerce_int(name, value, *bound.range)``."""
        return self.lo, self.hi

    def field(self, description: str, **extra: Any) -> Any:
        """A pydantic ``Field`` with this bound's limits and ``description`` (a tool parameter)."""
        from pydantic import Field
        low: dict[str, Any] = {"gt": self.lo} if self.lo_open else {"ge": self.lo}
        finite: dict[str, Any] = {"allow_inf_nan": False} if self.kind is float else {}   # "NaN": not "≤ hi"
        return Field(le=self.hi, description=description, **low, **finite, **extra)

    def click_type(self, lo: int | float | None = None) -> Any:
        """A click range type for this bound (``lo`` overrides the lower end: 0 means "remove" in
        ``budget set``)."""
        import click
        low = self.lo if lo is None else lo
        if self.kind is float:
            kind = click.FloatRange(low, self.hi, min_open=self.lo_open and lo is None)
            kind.name = "number"    # click says "'x' is not a valid float range."
            return kind
        return int_range(int(low), int(self.hi))


def int_range(low: int, high: int) -> Any:
    """click's IntRange(low, high), whose refusal of a non-number reads "'abc' is not a valid
    integer." (click's own says "integer range")."""
    import click
    kind = click.IntRange(low, high)
    kind.name = "integer"
    return kind


PRIORITY = Bound("priority", int, 0, -1000, 1000)
TIMEOUT = Bound("timeout_sec", int, 1800, 1, DAY_SEC, "seconds")
RETRIES = Bound("max_retries", int, 1, 0, 10)
SCHEDULE_TIMEOUT = Bound("schedule_timeout_sec", int, None, 1, 30 * DAY_SEC, "seconds")
USD = Bound("max_cost_usd", float, None, 0, 1_000_000, "USD", lo_open=True)
TOKENS = Bound("max_tokens", int, None, 1, 10**12, "tokens")

TITLE_MAX = 200            # characters
INSTRUCTIONS_MAX = 200_000  # characters
BATCH_MAX = 20             # tasks in one submit_batch
