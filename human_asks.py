"""Asking the person, not the planner model, through the MCP client's elicitation forms (issue 22,
part 2): raising a task's spending limit, a permission ask whose task was submitted with
``ask_human``, and applying a task to the checkout's current branch.

Only a client that declares the elicitation capability (form mode) is asked. A decline, a
cancel, a client without elicitation, one that auto-declines (Claude Code in ``-p`` mode), an
elicitation that cannot be sent or is not answered within the time the tool call has left: the
question stays with the planner exactly as before, and no task ever waits on the form. An answer
that does not fit its form (or that the store refuses, e.g. a limit below the spend) is asked
again once, then left to the planner.

Not run on its own; opencode_bridge_mcp's wait_for and apply_task call it. Reads no env.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import anyio
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

import task_store as store

log = logging.getLogger("taskbridge.mcp")

TRIES = 2                 # an answer that does not fit is asked again once
MIN_WAIT_SEC = 30.0       # the least time a form is given, even late in a wait_for call


class HumanAsk(TypedDict):
    task_id: str
    about: str            # "spending limit", "permission", "apply"
    outcome: str          # what the person answered, or why it was left to the planner
    acted: bool           # the answer changed the task (or the checkout)


RAISE_OR_STOP = "raise: let it go on up to the new limit; stop: fail it with its receipt"


class RaiseUsd(BaseModel):
    decision: Literal["raise", "stop"] = Field(description=RAISE_OR_STOP)
    new_limit_usd: float = Field(default=0, ge=0, description="the new limit in USD (above what it spent)")


class RaiseTokens(BaseModel):
    decision: Literal["raise", "stop"] = Field(description=RAISE_OR_STOP)
    new_limit_tokens: int = Field(default=0, ge=0, description="the new limit in tokens (above what it used)")


class Permission(BaseModel):
    decision: Literal["allow once", "allow always", "deny once", "deny always"] = Field(
        description="always: a rule for exactly this request is added to the task's rules")


class Apply(BaseModel):
    apply: bool = Field(description="bring the task's work into this branch now")


def can_ask(ctx: Any) -> bool:
    """Whether the client behind ``ctx`` (a tool call's Context) declared elicitation (form mode;
    a bare ``elicitation: {}`` means form too)."""
    try:
        caps = ctx.session.client_params.capabilities
    except (AttributeError, ValueError, RuntimeError, LookupError):
        return False
    elicitation = getattr(caps, "elicitation", None)
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


async def ask(ctx: Any, message: str, form: type[BaseModel], act: Callable[[Any], str],
              seconds: float) -> tuple[str, bool]:
    """Ask ``message`` with ``form``; ``act(data)`` applies an accepted answer and returns what it
    did (raising store.ValidationError / InvalidTransition when it does not fit). Returns
    (outcome, acted). At most TRIES forms, within ``seconds`` (at least MIN_WAIT_SEC)."""
    note = ""
    with anyio.move_on_after(max(seconds, MIN_WAIT_SEC)):
        for _ in range(TRIES):
            try:
                answer = await ctx.elicit(note + message, form)
            except ValueError:            # accepted, but the content does not fit the form
                note = "That answer did not fit the form; please answer again. "
                continue
            except Exception as exc:      # the client cannot take the request: leave it to the planner
                log.info("elicitation not possible (%s): left to the planner", exc)
                return "the client could not show the form: left to the planner", False
            if answer.action != "accept":
                return f"the person chose {answer.action}: left to the planner", False
            try:
                return act(answer.data), True
            except (store.ValidationError, store.InvalidTransition) as exc:
                note = f"{exc}. "
        else:
            return f"no fitting answer after {TRIES} forms: left to the planner", False
    return "no answer in time: left to the planner", False


def limit_form(task: dict[str, Any]) -> tuple[str, type[BaseModel], Callable[[Any], str]]:
    """The form for a task paused at its spending limit: in USD, or tokens for a token limit."""
    in_tokens = task.get("max_cost_usd") is None and task.get("max_tokens") is not None
    message = f"Task {task['id']} ({task['title']}) paused at its spending limit. {task.get('question') or ''}".strip()

    def act(data: Any) -> str:
        if data.decision == "stop":
            text = "stop"
        elif in_tokens:
            text = f"continue, up to {data.new_limit_tokens} tokens"
        else:
            text = f"continue, up to ${data.new_limit_usd}"
        store.answer_task(task["id"], text, author="person (via the MCP client)")
        return f"the person answered: {text}"
    return message, (RaiseTokens if in_tokens else RaiseUsd), act


def permission_form(task: dict[str, Any]) -> tuple[str, type[BaseModel], Callable[[Any], str]]:
    """The form for a permission ask of a task submitted with ask_human."""
    message = f"Task {task['id']} ({task['title']}) asks for permission. {task.get('question') or ''}".strip()

    def act(data: Any) -> str:
        store.answer_task(task["id"], data.decision, author="person (via the MCP client)")
        return f"the person answered: {data.decision}"
    return message, Permission, act


def form_for(task: dict[str, Any]) -> tuple[str, tuple[str, type[BaseModel], Callable[[Any], str]]] | None:
    """(about, form) for a waiting task only a person should decide, or None (the planner's)."""
    if task.get("status") != "waiting":
        return None
    if task.get("paused_for") == "task_limit":
        return "spending limit", limit_form(task)
    if task.get("paused_for") == "permission" and task.get("ask_human"):
        return "permission", permission_form(task)
    return None


async def ask_waiting(ctx: Any, task_ids: list[str], asked: list[HumanAsk], seconds: float) -> bool:
    """Ask the person about each waiting task in ``task_ids`` that only a person should decide and
    that this call has not asked about yet; appends to ``asked``. Returns whether an answer acted."""
    if not can_ask(ctx):
        return False
    acted = False
    for task_id in task_ids:
        if any(a["task_id"] == task_id for a in asked):
            continue
        found = form_for(store.get_task(task_id))
        if found is None:
            continue
        about, (message, form, act) = found
        outcome, changed = await ask(ctx, message, form, act, seconds)
        asked.append({"task_id": task_id, "about": about, "outcome": outcome, "acted": changed})
        acted = acted or changed
    return acted


async def confirm_apply(ctx: Any, task: dict[str, Any], mode: str, seconds: float = 120) -> bool | None:
    """Ask the person whether to apply ``task`` (its branch) to the checkout's current branch:
    True (apply), False (the person said no), None (not asked, declined or no fitting answer:
    the planner's call stands, as before)."""
    if not can_ask(ctx):
        return None
    chosen: dict[str, bool] = {}

    def act(data: Any) -> str:
        chosen["apply"] = bool(data.apply)
        return "apply" if data.apply else "not now"
    message = (f"Apply task {task['id']} ({task['title']}): {mode} its branch {task.get('branch')} into the "
               f"current branch of {task.get('working_dir')}?")
    await ask(ctx, message, Apply, act, seconds)
    return chosen.get("apply")
