"""Which model a task runs with, and what happens to a model OpenCode does not offer: the real
`opencode` binary, a scripted model on 127.0.0.1, real git repositories and real MCP clients."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mcp import Client

import opencode_bridge_mcp
import opencode_runner
import task_store
from fake_openai import text
from helpers import make_repo, run_script
from opencode_env import opencode_config

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

OTHER = {"provider": {"fake": {"models": {"other": {"name": "Other", "limit": {"context": 64000, "output": 4096}}}}}}
RECEIPT = '```json\n{"summary": "nothing to do", "files_touched": [], "tests_run": [], "open_questions": []}\n```'


def models_asked(model) -> list[str]:
    """The `model` field of every agent step request the scripted server answered."""
    return [r["json"]["model"] for r in model.requests if r["kind"] == "step" and r["json"]]


@pytest.mark.real_opencode
def test_default_model_follows_the_users_opencode_config(opencode, tmp_path, monkeypatch):
    monkeypatch.delenv("WORKER_MODEL")
    opencode.configure(OTHER | {"model": "fake/other"})        # the user's own OpenCode choice
    choice = opencode_runner.default_model()
    assert (choice.model, choice.source) == ("fake/other", "OpenCode config")
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("cfg", [text("Nothing to change.\n" + RECEIPT)])
    task = task_store.submit_task(title="cfg", instructions="SCRIPT:cfg", working_dir=str(repo))
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    assert done["result"]["model"] == "fake/other"
    assert models_asked(opencode.model) == ["other"]
    assert "model fake/other (default from OpenCode config)" in passed.stderr   # the start line
    assert "t_0001 claimed: cfg (attempt 1 of 2, model fake/other)" in passed.stderr

    # The precedence: WORKER_MODEL beats the config, the queue's setting beats both.
    monkeypatch.setenv("WORKER_MODEL", "fake/model")
    assert opencode_runner.default_model().source == "WORKER_MODEL"
    assert opencode_runner.default_model("fake/other").source == "set_default_model"
    # No model in the config: the first model a provider the user set up offers.
    monkeypatch.delenv("WORKER_MODEL")
    config = opencode_config(opencode.model.url, extra_config=OTHER)
    del config["model"]
    Path(opencode.env["OPENCODE_CONFIG"]).write_text(json.dumps(config))
    assert opencode_runner.default_model() == opencode_runner.ModelChoice("fake/model", "opencode models")


@pytest.mark.real_opencode
def test_unknown_model_is_refused_at_submit_over_the_cli_with_close_names(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    refused = run_script("tasks_cli.py", "submit", "x", "--dir", str(repo), "--model", "fake/modle")
    assert refused.returncode == 2
    assert "model 'fake/modle' is not offered by OpenCode here; similar: fake/model" in refused.stderr
    assert "Traceback" not in refused.stderr and task_store.counts()["pending"] == 0
    accepted = run_script("tasks_cli.py", "submit", "x", "--dir", str(repo), "--model", "FAKE/model", "--json")
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout)["model"] == "fake/model"
    assert task_store.state_path("models.json").exists()      # the answer is kept for a minute
    # retry --model is checked the same way.
    task = task_store.claim_next("cli:test", task_id=json.loads(accepted.stdout)["id"])
    task_store.fail_attempt(task["id"], task["run_marker"], "by hand", retryable=False)
    again = run_script("tasks_cli.py", "retry", task["id"], "--model", "fake/mdel")
    assert again.returncode == 2 and "similar: fake/model" in again.stderr
    assert task_store.get_task(task["id"])["status"] == "failed"


@pytest.mark.real_opencode
@pytest.mark.anyio
async def test_unknown_model_is_refused_at_submit_over_mcp_with_close_names(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    args = {"title": "x", "instructions": "y", "working_dir": str(repo)}
    async with Client(opencode_bridge_mcp.build_server()) as client:
        single = await client.call_tool("submit_task", args | {"model": "fake/mdoel"})
        batch = await client.call_tool("submit_batch", {"tasks": [args, args | {"model": "fakes/model"}]})
        good = await client.call_tool("submit_task", args | {"model": "fake/model"})
    assert single.is_error and "similar: fake/model" in single.content[0].text
    assert batch.is_error and "similar: fake/model" in batch.content[0].text
    assert not good.is_error and task_store.counts()["pending"] == 1


@pytest.mark.real_opencode
def test_a_model_removed_after_submit_fails_once_naming_it(opencode, tmp_path, worker_engine):
    opencode.configure(OTHER)
    repo = make_repo(tmp_path / "repo")
    submitted = run_script("tasks_cli.py", "submit", "gone", "--dir", str(repo), "--model", "fake/other", "--json")
    assert submitted.returncode == 0, submitted.stderr
    opencode.configure({})                                   # the user drops the model from their config
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    task = task_store.get_task(json.loads(submitted.stdout)["id"])
    assert task["status"] == "failed" and task["attempts"] == 1       # not retried (max_retries is 1)
    assert task["error"].startswith("model fake/other is not offered by OpenCode here (not retried")
    # OpenCode's own words: `opencode run` prints the error's class, its server's API calls it unknown
    named = "UnknownError" if worker_engine == "warm" else "ProviderModelNotFoundError"
    assert f"{named}: Model not found: fake/other" in task["error"], task["error"]


@pytest.mark.real_opencode
def test_models_command_lists_and_searches_what_opencode_offers(opencode):
    opencode.configure(OTHER)
    listed = run_script("tasks_cli.py", "models")
    assert listed.returncode == 0, listed.stderr
    assert "fake/model" in listed.stdout and "fake/other" in listed.stdout
    assert "128,000" in listed.stdout and "1 / 2" in listed.stdout          # context, USD/M in / out
    assert "tasks without a model run with fake/model (from WORKER_MODEL)" in listed.stdout
    found = json.loads(run_script("tasks_cli.py", "models", "OTH", "--json").stdout)
    assert [m["id"] for m in found["models"]] == ["fake/other"] and found["total"] == 1
    assert found["models"][0]["context"] == 64000 and found["default_from"] == "WORKER_MODEL"
    nope = run_script("tasks_cli.py", "models", "--provider", "nope")
    assert nope.returncode == 1 and "cannot list OpenCode's models" in nope.stderr and "nope" in nope.stderr


def test_answers_are_kept_a_minute_and_the_last_one_serves_status_views(tmp_path, monkeypatch):
    calls: list[int] = []

    def ask() -> int:
        calls.append(1)
        return len(calls)

    cache = tmp_path / "models.json"
    assert opencode_runner._cached("k", ask, False, cache) == 1
    opencode_runner._memory_cache.clear()
    assert opencode_runner._cached("k", ask, False, cache) == 1           # another process: the file
    assert opencode_runner._cached("k", ask, True, cache) == 2            # refresh asks again
    monkeypatch.setattr(opencode_runner, "MODELS_CACHE_SEC", 0)
    assert opencode_runner._cached("k", ask, False, cache, ask=False) == 2   # stale, but not asking
    assert opencode_runner._cached("k", ask, False, cache) == 3           # past the minute: asked
    with pytest.raises(LookupError):
        opencode_runner._cached("other", ask, False, cache, ask=False)
    assert len(calls) == 3
