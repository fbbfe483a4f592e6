"""The planner's seat (issue 22), through the real SDK client against the server, with real worker
passes (the real `opencode`, the scripted model) where a task must really run:

- no finished result is missed: a task that ends stays in `unseen` (wait_for, queue_status) until
  the planner reads it with get_task_result, also when the planner waited on another task; a
  retried task is announced again when it ends again; tasks finished before the migration are
  not announced;
- logs, diffs, transcripts and receipts are resources (resources/read), and the tools that show a
  task link to them (resource_link content blocks);
- the person is asked through the client's form (elicitation) when only a person should decide: a
  raised spending limit, a permission ask of an ask_human task, an apply; an answer that does not
  fit is asked again once; a decline, an auto-declining client or one without forms leaves it to
  the planner, and no task waits on a form;
"""
from __future__ import annotations

import json

import pytest
from mcp import Client
from mcp.types import ElicitResult, ErrorData, Implementation, ResourceLink

import opencode_bridge_mcp as bridge
import task_store
from fake_openai import text, tool_call
from helpers import call_tool, git, make_repo, run_script

pytestmark = pytest.mark.anyio
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = (
    '```json\n{"summary": "Wrote {name}", "files_touched": ["{name}"], "tests_run": [], "open_questions": []}\n```'
)


def client() -> Client:
    return Client(bridge.build_server(), mode="legacy", client_info=Implementation(name="claude-code", version="2.1"))


def script_writer(opencode, name: str) -> None:
    opencode.model.script(name, [tool_call("write", {"filePath": f"{{cwd}}/{name}.txt", "content": f"{name}\n"}),
                                 text("Done.\n" + RECEIPT.replace("{name}", f"{name}.txt"))])


def run_until_finished(ids: list[str]) -> None:
    for _ in range(len(ids) + 1):
        if all(task_store.get_task(t)["status"] in task_store.TERMINAL for t in ids):
            return
        assert run_script("worker.py").returncode == 0
    raise AssertionError({t: task_store.get_task(t)["status"] for t in ids})


# ---------------------------------------------------------------------------------------------
# 3. No finished result is ever missed.


@pytest.mark.real_opencode
async def test_a_finished_result_stays_unseen_until_the_planner_reads_it(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    for name in ("first", "second"):
        script_writer(opencode, name)
    async with client() as c:
        first = await call_tool(
            c, "submit_task", {"title": "first", "working_dir": str(repo), "instructions": "SCRIPT:first"}
        )
        second = await call_tool(
            c, "submit_task", {"title": "second", "working_dir": str(repo), "instructions": "SCRIPT:second"}
        )
        assert (await call_tool(c, "queue_status", {}))["unseen"] == []
        run_until_finished([first["id"], second["id"]])
        waited = await call_tool(c, "wait_for", {"task_ids": [first["id"]], "timeout_sec": 5})
        again = await call_tool(c, "wait_for", {"task_ids": [first["id"]], "timeout_sec": 5})   # nothing read yet
        await call_tool(c, "get_task_result", {"task_id": first["id"]})
        after_one = await call_tool(c, "queue_status", {})
        told = await call_tool(c, "wait_for", {"task_ids": [first["id"]], "timeout_sec": 5})
        await call_tool(c, "get_task_result", {"task_id": second["id"]})
        after_both = await call_tool(c, "queue_status", {})
    assert waited["ready"] == [first["id"]] and sorted(waited["unseen"]) == [first["id"], second["id"]]
    assert second["id"] in waited["hint"] and "not read yet" in waited["hint"]
    assert sorted(again["unseen"]) == sorted(waited["unseen"]) and again["unseen_total"] == 2
    assert after_one["unseen"] == [second["id"]] and after_one["unseen_total"] == 1
    assert told["unseen"] == [second["id"]] and second["id"] in told["hint"]
    assert after_both["unseen"] == [] and after_both["unseen_total"] == 0
    assert task_store.get_task(first["id"])["result_seen_at"] is not None


async def test_a_retried_task_is_announced_again_and_a_running_one_is_not_marked(tmp_path):
    (tmp_path / "p").mkdir()
    async with client() as c:
        task = await call_tool(
            c, "submit_task", {"title": "t", "working_dir": str(tmp_path / "p"), "instructions": "x"}
        )
        await call_tool(c, "get_task_result", {"task_id": task["id"]})          # pending: nothing to see yet
        await call_tool(c, "cancel_task", {"task_id": task["id"]})
        cancelled = await call_tool(c, "queue_status", {})
        await call_tool(c, "get_task_result", {"task_id": task["id"]})
        read = await call_tool(c, "queue_status", {})
        await call_tool(c, "retry_task", {"task_id": task["id"]})
        await call_tool(c, "cancel_task", {"task_id": task["id"]})
        ended_again = await call_tool(c, "queue_status", {})
    assert cancelled["unseen"] == [task["id"]]
    assert read["unseen"] == []
    assert ended_again["unseen"] == [task["id"]]


async def test_retry_task_says_a_cancelled_attempt_is_wrapped_up_first(tmp_path):
    """The retry succeeds at once; the planner reads that its start waits (no polling needed)."""
    (tmp_path / "p").mkdir()
    task = task_store.submit_task(title="t", instructions="x", working_dir=str(tmp_path / "p"))
    task_store.claim_next("worker:a:1", task_id=task["id"])
    async with client() as c:
        await call_tool(c, "cancel_task", {"task_id": task["id"]})
        retried = await call_tool(c, "retry_task", {"task_id": task["id"]})
        task_store.end_wrap_up(task["id"], "br-1-a1")
        await call_tool(c, "cancel_task", {"task_id": task["id"]})
        again = await call_tool(c, "retry_task", {"task_id": task["id"]})
    assert retried["status"] == "pending"
    assert retried["waits"].startswith("the cancelled attempt br-1-a1 is still being wrapped up by worker:a:1")
    assert again["waits"] is None


def test_tasks_that_finished_before_the_migration_are_not_announced(tmp_path, monkeypatch):
    (tmp_path / "p").mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(task_store, "MIGRATIONS", task_store.MIGRATIONS[:6])
        old = task_store.submit_task(title="old", instructions="x", working_dir=str(tmp_path / "p"))
        task_store.cancel_task(old["id"], "done with it")
        task_store.close_connections()
    assert task_store.unseen_results() == {"ids": [], "total": 0}
    new = task_store.submit_task(title="new", instructions="x", working_dir=str(tmp_path / "p"))
    task_store.cancel_task(new["id"], "this one is new")
    assert task_store.unseen_results() == {"ids": [new["id"]], "total": 1}


# ---------------------------------------------------------------------------------------------
# 4. Logs, diffs, transcripts and receipts as resources.


def links_of(result) -> dict[str, str]:
    return {str(b.uri).rsplit("/", 1)[1]: str(b.uri) for b in result.content if isinstance(b, ResourceLink)}


async def read_text(c: Client, uri: str) -> str:
    return (await c.read_resource(uri)).contents[0].text


@pytest.mark.real_opencode
async def test_a_finished_tasks_log_diff_transcript_and_receipt_are_linked_resources(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    script_writer(opencode, "linked")
    async with client() as c:
        task = await call_tool(
            c, "submit_task", {"title": "linked", "working_dir": str(repo), "instructions": "SCRIPT:linked"}
        )
        pending = await c.call_tool("get_task", {"task_id": task["id"]})
        run_until_finished([task["id"]])
        waited = await c.call_tool("wait_for", {"task_ids": [task["id"]], "timeout_sec": 5})
        result = await c.call_tool("get_task_result", {"task_id": task["id"]})
        links = links_of(result)
        diff, log = await read_text(c, links["diff"]), await read_text(c, links["log"])
        receipt = json.loads(await read_text(c, links["receipt"]))
        turns = json.loads(await read_text(c, links["transcript"]))
        listed = {str(r.uri) for r in (await c.list_resources()).resources}
        templates = {t.uri_template for t in (await c.list_resource_templates()).resource_templates}
        with pytest.raises(Exception, match="t_0999 not found"):
            await c.read_resource("taskbridge://tasks/t_0999/log")
    assert links_of(pending) == {}                                   # nothing ran yet
    assert set(links_of(waited)) == {"log", "transcript", "diff", "receipt"}
    assert set(links) == {"log", "transcript", "diff", "receipt"}
    assert links["diff"] == f"taskbridge://tasks/{task['id']}/diff"
    assert "+linked" in diff and "linked.txt" in diff and diff == task_store.get_task(task["id"])["diff"]
    assert '"type":"step_finish"' in log.replace(" ", "")
    assert receipt["result"]["summary"] == "Wrote linked.txt" and receipt["status"] == "done"
    assert turns["task_id"] == task["id"] and turns["turns"]
    assert set(links.values()) <= listed
    assert "taskbridge://tasks/{task_id}/diff" in templates


# ---------------------------------------------------------------------------------------------
# 2. Ask the person when only a person should decide (elicitation).

STEP_USAGE = {"prompt_tokens": 100_000, "completion_tokens": 1_000, "cached_tokens": 0, "reasoning_tokens": 0}


class Person:
    """An MCP client's elicitation handler that answers from a list and keeps what it was asked."""

    def __init__(self, *answers: ElicitResult) -> None:
        self.answers, self.asked = list(answers), []

    async def __call__(self, context, params):
        self.asked.append(params)
        return self.answers.pop(0)


def as_person(person: Person | None) -> Client:
    return Client(bridge.build_server(), mode="legacy", elicitation_callback=person,
                  client_info=Implementation(name="claude-code", version="2.1"))


def accept(**content) -> ElicitResult:
    return ElicitResult(action="accept", content=content)


@pytest.mark.real_opencode
async def test_the_person_raises_the_limit_and_confirms_the_apply_through_forms(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("count", [tool_call("bash", {"command": f"echo {n} >> n.txt", "description": "count"},
                                              usage=STEP_USAGE) for n in (1, 2, 3)]
                          + [text("Counted.\n" + RECEIPT.replace("{name}", "n.txt"), usage=STEP_USAGE)])
    async with as_person(None) as planner:
        task = await call_tool(planner, "submit_task", {"title": "count", "working_dir": str(repo),
                                                   "instructions": "SCRIPT:count", "max_cost_usd": 0.15})
    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["paused_for"] == "task_limit"
    ids = {"task_ids": [task["id"]], "timeout_sec": 2}

    declining = Person(ElicitResult(action="decline"))
    async with as_person(declining) as c:                 # Claude Code -p declines every form
        declined = await call_tool(c, "wait_for", ids)
    async with as_person(None) as c:                      # a client without forms
        formless = await call_tool(c, "wait_for", ids)
    person = Person(accept(decision="sideways"), accept(decision="raise", new_limit_usd=2))
    async with as_person(person) as c:
        raised = await call_tool(c, "wait_for", ids)

    assert declined["waiting"] == [task["id"]] and declined["asked_human"][0]["acted"] is False
    assert "decline: left to the planner" in declined["asked_human"][0]["outcome"]
    assert formless["waiting"] == [task["id"]] and formless["asked_human"] == []
    assert len(person.asked) == 2 and "did not fit the form" in person.asked[1].message
    assert "spending limit" in person.asked[0].message and "$0.15" in person.asked[0].message.replace("0.1500", "0.15")
    assert raised["asked_human"] == [{"task_id": task["id"], "about": "spending limit", "acted": True,
                                      "outcome": "the person answered: continue, up to $2.0"}]
    assert raised["timed_out"] and raised["tasks"][0]["status"] == "pending"
    assert task_store.get_task(task["id"])["max_cost_usd"] == 2.0

    assert run_script("worker.py").returncode == 0
    assert task_store.get_task(task["id"])["status"] == "done"
    head = git(repo, "rev-parse", "HEAD")
    no = Person(accept(apply=False))
    async with as_person(no) as c:
        refused = await c.call_tool("apply_task", {"task_id": task["id"]})
    assert refused.is_error and "chose not to apply" in refused.content[0].text
    assert git(repo, "rev-parse", "HEAD") == head and "apply" in no.asked[0].requested_schema["properties"]
    broken = Person(ErrorData(code=-32603, message="this client cannot show forms here"))
    async with as_person(broken) as c:                    # asked, the client failed: the planner's call stands
        applied = await call_tool(c, "apply_task", {"task_id": task["id"]})
    assert len(broken.asked) == 1 and applied["status"] == "applied" and git(repo, "rev-parse", "HEAD") != head
    assert (repo / "n.txt").read_text() == "1\n2\n3\n"
    yes = Person(accept(apply=True))
    async with as_person(yes) as c:
        again = await call_tool(c, "apply_task", {"task_id": task["id"]})
    assert len(yes.asked) == 1 and again["status"] == "already-applied"


async def test_an_apply_that_cannot_happen_is_not_asked_and_keeps_its_usual_error(tmp_path):
    (tmp_path / "p").mkdir()
    person = Person(accept(apply=True))
    async with as_person(person) as c:
        task = await call_tool(
            c, "submit_task", {"title": "t", "working_dir": str(tmp_path / "p"), "instructions": "x"}
        )
        result = await c.call_tool("apply_task", {"task_id": task["id"]})
    assert person.asked == []
    assert result.is_error and "pending" in result.content[0].text


@pytest.mark.real_opencode
async def test_a_permission_ask_of_an_ask_human_task_goes_to_the_person_and_others_stay_with_the_planner(
    opencode, tmp_path
):
    repo = make_repo(tmp_path / "repo")
    push = "echo pushed > {cwd}/pushed.txt # git push origin"
    for name in ("human", "planner"):
        opencode.model.script(name, [tool_call("bash", {"command": push, "description": "publish"}),
                                     text("Finished.\n" + RECEIPT.replace("{name}", "pushed.txt"))])
    rules = {"bash": [{"pattern": "*", "action": "allow"}, {"pattern": "echo pushed*", "action": "ask"}]}
    async with as_person(None) as c:
        human = await call_tool(
            c,
            "submit_task",
            {
                "title": "human",
                "working_dir": str(repo),
                "instructions": "SCRIPT:human",
                "rules": rules,
                "ask_human": True,
            },
        )
        planner = await call_tool(c, "submit_task", {"title": "planner", "working_dir": str(repo),
                                                "instructions": "SCRIPT:planner", "rules": rules})
    run_until_waiting = [run_script("worker.py") for _ in range(2)]
    assert all(r.returncode == 0 for r in run_until_waiting)
    assert [task_store.get_task(t["id"])["paused_for"] for t in (human, planner)] == ["permission", "permission"]
    person = Person(accept(decision="allow once"))
    async with as_person(person) as c:
        waited = await call_tool(c, "wait_for", {"task_ids": [human["id"], planner["id"]], "timeout_sec": 2})
    assert len(person.asked) == 1 and human["id"] in person.asked[0].message
    assert [(a["task_id"], a["acted"]) for a in waited["asked_human"]] == [(human["id"], True)]
    assert task_store.get_task(human["id"])["status"] == "pending"
    assert task_store.get_task(planner["id"])["status"] == "waiting" and waited["waiting"] == [planner["id"]]


# ---------------------------------------------------------------------------------------------
# 1. The dispatch card (MCP Apps); the browser test is tests/test_card_browser.py.


async def test_the_task_tools_point_at_the_card_which_is_served_as_an_app_without_network():
    async with client() as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        pointed = {name for name, t in tools.items() if (t.meta or {}).get("ui", {}).get("resourceUri")}
        uri = tools["wait_for"].meta["ui"]["resourceUri"]
        page = (await c.read_resource(uri)).contents[0]
    assert pointed == {"submit_task", "wait_for", "get_task", "get_task_result"}
    assert uri.startswith("ui://") and page.mime_type == "text/html;profile=mcp-app"
    assert "ui/initialize" in page.text and "innerHTML" not in page.text
    assert "http://" not in page.text and "https://" not in page.text     # nothing fetched from anywhere
