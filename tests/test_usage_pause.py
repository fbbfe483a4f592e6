"""A provider's usage limit pauses the work and resumes it at the reset (issue 23), with the real
`opencode` and the scripted model answering 429 with a reset, two providers configured."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import task_store
from fake_openai import http_error, text, tool_call
from helpers import ROOT, make_repo, run_script, tagged, until

RECEIPT = '```json\n{"summary": "done", "files_touched": [], "tests_run": [], "open_questions": []}\n```'
# No time in the words: only the retry-after header (through OpenCode's retry, which the retry
# watch plugin hands the worker) says when the window opens.
LIMIT = "Rate limit reached for requests."
OTHER = {"provider": {"other": {"npm": "@ai-sdk/openai-compatible", "name": "Other",
                                "options": {"apiKey": "x", "headerTimeout": 60000, "chunkTimeout": 60000},
                                "models": {"model": {"name": "Other", "limit": {"context": 128000, "output": 8192}}}}},
         "enabled_providers": ["fake", "other"]}


BOTH_ENGINES = True   # the retry watch runs in a kept server too (conftest)

def _two_providers(opencode):
    other = json.loads(json.dumps(OTHER))
    other["provider"]["other"]["options"]["baseURL"] = opencode.model.url
    opencode.configure(other)


def test_limit_pauses_frees_the_slot_holds_the_account_and_resumes_the_session(opencode, tmp_path, monkeypatch):
    _two_providers(opencode)
    monkeypatch.setenv("WORKER_LIMIT_HOLD_SEC", "3")
    monkeypatch.setenv("WORKER_LIMIT_MARGIN_SEC", "1")
    repo = make_repo(tmp_path / "repo")
    model = opencode.model
    # A 40 s window: the other provider's cold run (10-25 s on a loaded 2-core machine) must end
    # inside it, or the watching worker resumes the paused task before the checks below.
    model.script("lim", [http_error(429, LIMIT, {"retry-after": "40"})])
    model.script("same", [text("Same provider.\n" + RECEIPT)])
    model.script("other", [text("Other provider.\n" + RECEIPT)])
    a = task_store.submit_task(title="limited", instructions="Write a.txt. SCRIPT:lim", working_dir=str(repo),
                               model="fake/model", priority=5, max_retries=0)
    b = task_store.submit_task(title="same", instructions="SCRIPT:same", working_dir=str(repo), model="fake/model")
    c = task_store.submit_task(title="other", instructions="SCRIPT:other", working_dir=str(repo), model="other/model")

    watcher = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--watch"], env=dict(os.environ),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        until(lambda: task_store.get_task(c["id"])["status"] == "done", 150, "the other provider's task", every=0.3)
    finally:
        watcher.send_signal(signal.SIGKILL)   # killed during the pause: nothing may be lost
        watcher.wait(10)
    paused, same = task_store.get_task(a["id"]), task_store.get_task(b["id"])
    assert paused["status"] == "waiting" and paused["paused_for"] == "usage_limit", paused["error"]
    assert "fake" in paused["question"] and LIMIT in paused["question"] and paused["resume_at"] in paused["question"]
    limit = paused["result"]["limit"]
    assert paused["limit_account"] == "fake" and limit["said"] == LIMIT and limit["seen_in"] == "retry"
    reset = datetime.fromisoformat(limit["reset_at"]).timestamp()
    pause_at = datetime.fromisoformat(paused["limit_pauses"][0]["at"]).timestamp()
    assert 34 <= reset - pause_at <= 41   # the header's 40 s, counted from the failed call
    # OpenCode was stopped at its first retry instead of sleeping out the 20 s window in the slot.
    assert len(model.step_requests("lim")) == 1
    assert paused["attempts"] - paused["handbacks"] == 0   # no retry spent (max_retries is 0)
    assert os.path.isdir(paused["worktree_path"]) and paused["session_id"]
    assert same["status"] == "pending"   # held: same provider account
    done_other = task_store.get_task(c["id"])
    assert done_other["finished_at"] < paused["resume_at"]   # the freed slot ran the other provider
    assert tagged() == []

    model.script("lim", [tool_call("write", {"filePath": "{cwd}/a.txt", "content": "after the reset\n"}),
                         text("Wrote it.\n" + RECEIPT)])
    time.sleep(max(0.0, datetime.fromisoformat(paused["resume_at"]).timestamp() + 1 - time.time()))
    until(lambda: not task_store.held_accounts(), 40, "the reset")
    assert run_script("worker.py").returncode == 0
    resumed, same = task_store.get_task(a["id"]), task_store.get_task(b["id"])
    assert resumed["status"] == "done", resumed["error"]
    assert same["status"] == "done" and same["started_at"] >= paused["resume_at"]
    assert resumed["session_id"] == paused["session_id"]
    first = model.step_requests("lim")[1]["json"]["messages"]
    said = json.dumps(first)
    assert "Write a.txt" in said and "usage limit" in said   # the same session: the brief, then the resume
    pause = resumed["result"]["limit_pauses"][0]
    assert pause["provider"] == "fake" and pause["said"] == LIMIT and pause["resumed"] == "at its reset"
    assert pause["at"] < pause["resumed_at"] and pause["until"] == paused["resume_at"]
    assert resumed["attempts"] - resumed["handbacks"] == 1


def test_a_limit_opencode_gives_up_on_pauses_instead_of_failing(opencode, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKER_LIMIT_MARGIN_SEC", "600")
    repo = make_repo(tmp_path / "repo")
    # A short window (50 ms): OpenCode retries it itself, five times, and gives up.
    opencode.model.script("quota", [http_error(429, "You exceeded your current quota.", {"retry-after-ms": "50"})])
    task = task_store.submit_task(title="quota", instructions="SCRIPT:quota", working_dir=str(repo),
                                  model="fake/model", max_retries=0)
    started = time.time()
    assert run_script("worker.py").returncode == 0
    task = task_store.get_task(task["id"])
    assert task["status"] == "waiting" and task["paused_for"] == "usage_limit", task["error"]
    assert len(opencode.model.step_requests("quota")) == 6
    assert task["result"]["limit"]["seen_in"] == "error" and "quota" in task["result"]["limit"]["said"]
    assert task["resume_at"] >= task_store.iso(started + 600)
    assert task["attempts"] - task["handbacks"] == 0
