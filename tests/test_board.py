"""The board's HTTP API and shell without a browser: the shell is open and holds no data, /api/*
needs the token, a foreign Host gets 421, actions are POST with a JSON body and refused with the
store's message, the live long poll answers on a change, logs are read as whole readable lines."""
from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.testclient import TestClient

import board_api
import opencode_bridge_mcp as bridge
import task_store
from helpers import submit

TOKEN = "board-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE = (
    '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2"><a href="javascript:window.__pwned=3">x</a>'
)


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)


@pytest.fixture
def client() -> TestClient:
    return TestClient(bridge.build_app(), base_url="http://127.0.0.1:8765")


def finish(task, diff="", question=None):
    claimed = task_store.claim_next("test-worker", task_id=task["id"])
    if question:
        return task_store.pause_for_question(task["id"], claimed["run_marker"], question)
    return task_store.complete_attempt(task["id"], claimed["run_marker"], diff=diff,
                                       result={"summary": "ok", "files_touched": ["a.txt"]},
                                       usage={"cost_usd": 0.25, "tokens": {"input": 3}})


def test_shell_is_open_holds_no_data_and_forbids_inline_script(client, tmp_path):
    submit(tmp_path, title="secret-title-xyz")
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "secret-title-xyz" not in page.text and "t_0001" not in page.text
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert "<script>" not in page.text.replace('<script src="/board/app.js" defer></script>', "")
    for name in ("app.js", "board.css"):
        assert client.get(f"/board/{name}").status_code == 200
    assert client.get("/board/..%2Ftask_store.py").status_code == 404
    assert "innerHTML" not in client.get("/board/app.js").text


@pytest.mark.parametrize("method,path", [
    ("GET", "/api/status"), ("GET", "/api/tasks"), ("GET", "/api/tasks/1"), ("GET", "/api/tasks/1/log"),
    ("GET", "/api/events"), ("GET", "/api/jobs"), ("GET", "/api/engine"), ("GET", "/api/changes?wait=0"),
    ("POST", "/api/tasks/1/answer"), ("POST", "/api/tasks/1/note"), ("POST", "/api/tasks/1/cancel"),
    ("POST", "/api/tasks/1/retry")])
def test_every_api_route_needs_the_token_and_an_allowed_host(client, tmp_path, method, path):
    submit(tmp_path)
    assert client.request(method, path).status_code == 401
    assert client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    foreign = TestClient(bridge.build_app(), base_url="http://evil.example.com")
    assert foreign.request(method, path, headers=AUTH).status_code == 421
    assert foreign.get("/").status_code == 421
    assert task_store.get_task(1)["status"] == "pending"        # nothing acted without the token


def test_task_page_api_has_everything_the_page_shows(client, tmp_path):
    dep = submit(tmp_path, title="dep")
    task = submit(tmp_path, title=HOSTILE, instructions=HOSTILE, depends_on=[dep["id"]])
    task_store.add_note(task["id"], HOSTILE)
    finish(dep)
    diff = ("diff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -1 +1,2 @@\n-old\n+new\n+" + HOSTILE + "\n"
            "diff --git a/b c.txt b/b c.txt\n+++ b/b c.txt\n+x\n")
    finish(task, diff=diff)
    page = client.get(f"/api/tasks/{task['id']}", headers=AUTH).json()
    assert page["title"] == HOSTILE and page["instructions"] == HOSTILE       # as stored: the page escapes
    assert page["depends_on"] == [dep["id"]] and page["notes"][0]["text"] == HOSTILE
    assert page["result"]["summary"] == "ok" and page["usage"]["cost_usd"] == 0.25
    assert page["diff"] == diff and page["diff_truncated"] is False
    assert page["diff_files"] == [{"path": "a.txt", "added": 2, "removed": 1},
                                  {"path": "b c.txt", "added": 1, "removed": 0}]
    rows = client.get("/api/tasks?status=done", headers=AUTH).json()["tasks"]
    assert {r["id"] for r in rows} == {dep["id"], task["id"]} and rows[0]["cost_usd"] == 0.25
    assert client.get("/api/tasks?status=done,pending&search=dep", headers=AUTH).json()["total"] == 1
    assert client.get("/api/tasks/t_0999", headers=AUTH).status_code == 404
    assert "task id" in client.get("/api/tasks/nonsense", headers=AUTH).json()["error"]


def test_actions_go_through_the_store_and_are_refused_with_its_message(client, tmp_path):
    task = submit(tmp_path)

    def post(action, body):
        return client.post(f"/api/tasks/{task['id']}/{action}", headers=AUTH, json=body)

    refused = post("answer", {"answer": "42"})
    assert refused.status_code == 400 and "not waiting" in refused.json()["error"]
    finish(task, question="Which port?")
    assert post("answer", {"answer": 42}).status_code == 400                     # not text
    answered = post("answer", {"answer": "8080"})
    assert answered.status_code == 200 and answered.json()["status"] == "pending"
    assert task_store.get_task(task["id"])["questions"][-1]["answer"] == "8080"
    noted = post("note", {"text": "use tabs"})
    assert noted.status_code == 200 and task_store.get_task(task["id"])["notes"][0]["author"] == "board"
    assert post("cancel", {}).json()["status"] == "cancelled"
    again = post("cancel", {})
    assert again.status_code == 400 and again.json()["error"] == _store_refusal(task_store.cancel_task, task["id"])
    retried = post("retry", {"note": "try again with tabs"})
    assert retried.status_code == 200 and retried.json()["status"] == "pending"
    assert task_store.get_task(task["id"])["notes"][-1]["text"] == "try again with tabs"
    refused = post("retry", {})
    assert refused.status_code == 400 and refused.json()["error"] == _store_refusal(task_store.retry_task, task["id"])
    assert client.post(f"/api/tasks/{task['id']}/explode", headers=AUTH, json={}).status_code == 404


def test_an_unknown_route_or_method_is_refused_in_json_naming_it(client):
    """Starlette answered both in plain text ("Not Found"), unlike every other refusal."""
    for path, headers in (("/api/nowhere", AUTH), ("/nowhere", {})):
        missing = client.get(path, headers=headers)
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
        assert missing.json()["error"].startswith(f"no route {path}: the board is /")
    wrong = client.delete("/health")
    assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
    assert wrong.json()["error"] == "DELETE is not a method of /health; docs/http.md lists each route's methods"
    assert client.get("/api/nowhere").status_code == 401   # the token is asked first, as on every /api route


def _store_refusal(fn, *args) -> str:
    with pytest.raises(task_store.TaskStoreError) as caught:
        fn(*args)
    return str(caught.value)


def test_actions_need_a_json_object_body_and_get_changes_nothing(client, tmp_path):
    task = submit(tmp_path)
    url = f"/api/tasks/{task['id']}/cancel"
    form = client.post(url, headers=AUTH, data={"reason": "x"})
    assert form.status_code == 415 and "application/json" in form.json()["error"]
    bad = client.post(url, headers=AUTH | {"Content-Type": "application/json"}, content=b"{nope")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]
    listed = client.post(url, headers=AUTH, json=["x"])
    assert listed.status_code == 400 and "JSON object" in listed.json()["error"]
    assert client.get(url, headers=AUTH).status_code == 405
    assert task_store.get_task(task["id"])["status"] == "pending"


def test_log_tail_and_offsets_return_whole_readable_lines(client, tmp_path):
    task = submit(tmp_path)
    event = json.dumps({"type": "text", "timestamp": 1, "part": {"text": HOSTILE}})
    task_store.append_task_log(task["id"], f"[worker] starting\n{event}\n[stderr] half a li".encode())
    first = client.get(f"/api/tasks/{task['id']}/log", headers=AUTH).json()
    assert [e["kind"] for e in first["entries"]] == ["worker", "text"]
    assert first["entries"][1]["text"] == HOSTILE
    assert first["next_offset"] == len(f"[worker] starting\n{event}\n".encode()) < first["size"]
    task_store.append_task_log(task["id"], b"ne\n")
    more = client.get(f"/api/tasks/{task['id']}/log?offset={first['next_offset']}", headers=AUTH).json()
    assert more["entries"] == [{"kind": "stderr", "text": "half a line"}]
    past = client.get(f"/api/tasks/{task['id']}/log?offset=999999", headers=AUTH).json()
    assert past["reset"] is True and past["next_offset"] == past["size"]       # the log was replaced: its tail


def test_engine_tail_reads_the_worker_log_from_an_offset(client):
    assert client.get("/api/engine", headers=AUTH).json()["lines"] == []
    path = task_store.state_path("worker.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("10:00 pass started\n10:01 claimed t_0001\n")
    tail = client.get("/api/engine", headers=AUTH).json()
    assert tail["lines"] == ["10:00 pass started", "10:01 claimed t_0001"]
    with path.open("a") as handle:
        handle.write("10:02 done t_0001\n")
    assert client.get(f"/api/engine?offset={tail['next_offset']}", headers=AUTH).json()["lines"] == [
        "10:02 done t_0001"
    ]
    path.write_text("10:03 kept half\n")                 # the worker cut its log: the page starts over
    cut = client.get(f"/api/engine?offset={tail['next_offset']}", headers=AUTH).json()
    assert cut["reset"] is True and cut["lines"] == ["10:03 kept half"] and cut["next_offset"] == cut["size"]


def test_jobs_and_events_feed(client, tmp_path):
    job = task_store.create_claude_job("review " + HOSTILE, "cli", 60)
    jobs = client.get("/api/jobs", headers=AUTH).json()["jobs"]
    assert jobs[0]["id"] == job["id"] and jobs[0]["prompt"].startswith("review <script>")
    submit(tmp_path)
    feed = client.get("/api/events?limit=5", headers=AUTH).json()
    assert [e["kind"] for e in feed["events"]] == ["claude_job", "submitted"] and feed["cursor"] == feed["events"][-1][
        "id"
    ]
    assert client.get(f"/api/events?after={feed['cursor']}", headers=AUTH).json()["events"] == []


def test_changes_answers_within_a_second_of_an_event_and_waits_while_idle(client, tmp_path, store_backend):
    status = client.get("/api/status", headers=AUTH).json()
    cursor, jobs = status["marks"]["events"], status["marks"]["jobs"]
    started = time.monotonic()
    idle = client.get(f"/api/changes?cursor={cursor}&jobs={jobs}&wait=1", headers=AUTH).json()
    assert time.monotonic() - started >= 0.9 and idle["events"] == []
    timer = threading.Timer(0.5, lambda: submit(tmp_path, title="late"))
    timer.start()
    started = time.monotonic()
    woke = client.get(f"/api/changes?cursor={cursor}&jobs={jobs}&wait=10", headers=AUTH).json()
    took = time.monotonic() - started
    timer.join()
    assert [e["kind"] for e in woke["events"]] == ["submitted"] and woke["cursor"] > cursor
    assert took < 1.5, f"the change reached the poll after {took:.2f} s"
    task_store.create_claude_job("hello", "cli", 60)
    moved = client.get(f"/api/changes?cursor={woke['cursor']}&jobs={jobs}&wait=5", headers=AUTH).json()
    assert moved["jobs"] != jobs
    bad = client.get("/api/changes?cursor=-1", headers=AUTH)
    assert bad.status_code == 400 and "cursor" in bad.json()["error"]


def test_changes_follows_a_task_log_and_the_engine_log(client, tmp_path):
    task = submit(tmp_path)
    marks = client.get("/api/status", headers=AUTH).json()["marks"]
    base = f"/api/changes?cursor={marks['events']}&jobs={marks['jobs']}&task={task['id']}&log=0&engine=0&wait=5"
    threading.Timer(0.3, lambda: task_store.append_task_log(task["id"], b"[worker] hello\n")).start()
    started = time.monotonic()
    seen = client.get(base, headers=AUTH).json()
    assert seen["log_size"] == len("[worker] hello\n") and time.monotonic() - started < 2
    other = submit(tmp_path)
    marks = client.get("/api/status", headers=AUTH).json()["marks"]
    threading.Timer(0.3, lambda: task_store.append_task_log(other["id"], b"[worker] running\n")).start()
    followed = client.get(f"/api/changes?cursor={marks['events']}&jobs={marks['jobs']}&follow={other['id']}:0&wait=5",
                          headers=AUTH).json()
    assert followed["follow"] == {other["id"]: len("[worker] running\n")}
    too_many = ",".join(f"{n}:0" for n in range(1, 18))
    assert "at most 16" in client.get(f"/api/changes?follow={too_many}", headers=AUTH).json()["error"]
    garbled = client.get("/api/changes?follow=garbage", headers=AUTH)   # said: follow size ... got ''
    assert garbled.status_code == 400 and "task id:log size pairs" in garbled.json()["error"]


def test_diff_files_counts_lines_per_file():
    diff = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert board_api.diff_files(diff) == [{"path": "x.py", "added": 1, "removed": 1}]
    assert board_api.diff_files("") == []


def test_task_list_pages_by_cursor_without_gaps_or_repeats(client, tmp_path):
    for n in range(7):
        submit(tmp_path, title=f"task {n}")
    seen, cursor = [], None
    while True:
        page = client.get("/api/tasks?limit=3" + (f"&cursor={cursor}" if cursor else ""), headers=AUTH).json()
        seen += [t["id"] for t in page["tasks"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == [f"t_{n:04d}" for n in range(7, 0, -1)] and page["total"] == 7
    bad = client.get("/api/tasks?cursor=nonsense", headers=AUTH)
    assert bad.status_code == 400 and "cursor" in bad.json()["error"]


def test_worker_liveness_is_judged_once_for_the_cli_the_tools_and_the_board(client):
    import subprocess
    import sys

    from click.testing import CliRunner

    import tasks_cli
    dead = subprocess.Popen([sys.executable, "-c", "import task_store; task_store.write_worker_heartbeat("
                             "{'state': 'running', 'task': 't_0001', 'tasks': ['t_0001'], 'slots': 2})"])
    dead.wait()
    board = client.get("/api/status", headers=AUTH).json()["worker"]
    cli = json.loads(CliRunner().invoke(tasks_cli.cli, ["status", "--json"]).stdout)["worker"]
    tool = bridge.worker_heartbeat()
    for view in (board, cli, tool):
        assert view["died"] is True and view["recent"] is True and view["pid"] == dead.pid
        assert view["tasks"] == [] and view["task"] is None, "a dead worker runs nothing now"
        assert view["last_tasks"] == ["t_0001"] and view["slots"] == 2 and "gone" in view["summary"]
        assert view["label"] == "gone" and view["gone_since"] == view["at"]


def test_a_silent_worker_on_another_host_keeps_its_tasks_in_every_view(client, monkeypatch):
    """A worker elsewhere not heard from for over 30 s may still run its tasks (the reaper leaves
    their leases alone until WORKER_STALE_SEC): the board, the CLI and the tool all say it runs
    t_0009, none says it is gone since, and the summary says why not to retry or cancel it yet."""
    from click.testing import CliRunner

    import task_views
    import tasks_cli
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "build-server")
        task_store.write_worker_heartbeat({"state": "running", "task": "t_0009", "tasks": ["t_0009"]})
    monkeypatch.setattr(task_views, "WORKER_ELSEWHERE_SILENT_SEC", -1)   # (30 s in life)
    board = client.get("/api/status", headers=AUTH).json()["worker"]
    cli = json.loads(CliRunner().invoke(tasks_cli.cli, ["status", "--json"]).stdout)["worker"]
    for view in (board, cli, bridge.worker_heartbeat()):
        assert view["label"] == "stale" and view["host"] == "build-server" and view["gone_since"] is None, view
        assert view["tasks"] == ["t_0009"] and view["task"] == "t_0009" and view["last_tasks"] == ["t_0009"]
        assert "it may still be running t_0009" in view["summary"] and "WORKER_STALE_SEC" in view["summary"]


@pytest.mark.parametrize("beat,label", [
    ("{'state': 'stopped'}", "stopped"),     # a one-pass worker that ended cleanly is not online
    ("{'state': 'pass'}", "stopped"),
    ("{'state': 'running', 'task': 't_0001'}", "gone"),
    ("{'state': 'pass', 'task': 't_0001', 'tasks': ['t_0001']}", "gone"),   # --max-tasks reached, its task in hand
])
def test_a_worker_whose_process_ended_is_never_shown_online(client, beat, label):
    import subprocess
    import sys
    ended = subprocess.Popen([sys.executable, "-c", f"import task_store; task_store.write_worker_heartbeat({beat})"])
    ended.wait()
    assert client.get("/api/status", headers=AUTH).json()["worker"]["label"] == label
    task_store.write_worker_heartbeat({"state": "idle"})     # this live process: online
    assert client.get("/api/status", headers=AUTH).json()["worker"]["label"] == "online"


def test_a_worker_that_said_it_stopped_is_stopped_while_it_exits(client):
    """Between its last heartbeat ("stopped") and its exit the worker's process still runs; the
    board read it then as online and, with nothing changing after, kept showing it so (a flaky
    browser test under load)."""
    task_store.write_worker_heartbeat({"state": "stopped"})     # this live process says it stopped
    assert client.get("/api/status", headers=AUTH).json()["worker"]["label"] == "stopped"


def test_status_lists_every_worker_with_its_host(client, monkeypatch):
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "build-server")
        task_store.write_worker_heartbeat({"state": "running", "task": "t_0001", "tasks": ["t_0001"]})
    task_store.write_worker_heartbeat({"state": "idle"})
    workers = client.get("/api/status", headers=AUTH).json()["workers"]
    assert [(w["host"], w["label"], w["pid_running"]) for w in workers] == [
        (task_store.host_name(), "online", True), ("build-server", "online", None)]
    assert workers[1]["tasks"] == ["t_0001"] and "on another host (build-server)" in workers[1]["summary"]


@pytest.mark.parametrize("path,named", [
    ("/api/changes?log=abc&task=1", "log"), ("/api/changes?engine=-5", "engine"), ("/api/changes?wait=99", "wait"),
    ("/api/changes?task=zzz", "task id"), ("/api/tasks/1/log?offset=-1", "offset"), ("/api/engine?offset=x", "offset"),
    ("/api/events?after=x", "after"), ("/api/jobs?limit=0", "limit"), ("/api/tasks?limit=abc", "limit")])
def test_bad_query_values_get_one_line_naming_the_parameter(client, tmp_path, path, named):
    submit(tmp_path)
    answer = client.get(path, headers=AUTH)
    assert answer.status_code == 400 and named in answer.json()["error"]
    assert "\n" not in answer.json()["error"] and "Traceback" not in answer.text


def test_an_idle_long_poll_asks_the_database_only_when_its_files_change(client, tmp_path, monkeypatch):
    submit(tmp_path)
    marks = client.get("/api/status", headers=AUTH).json()["marks"]
    calls = []
    real = task_store.change_marks
    monkeypatch.setattr(task_store, "change_marks", lambda: calls.append(1) or real())
    answer = client.get(f"/api/changes?cursor={marks['events']}&jobs={marks['jobs']}&wait=2", headers=AUTH).json()
    assert answer["events"] == [] and len(calls) <= 2        # the first look, and the answer's own read


def test_a_task_page_names_the_task_it_continues_or_forks(client, tmp_path):
    first = submit(tmp_path)
    follow = submit(tmp_path, continue_from=first["id"])
    fork = submit(tmp_path, fork_from=first["id"])
    assert client.get(f"/api/tasks/{follow['id']}", headers=AUTH).json()["continue_from"] == first["id"]
    assert client.get(f"/api/tasks/{fork['id']}", headers=AUTH).json()["fork_from"] == first["id"]


def _step(kind: str, ms: int) -> str:
    return json.dumps({"type": kind, "timestamp": ms, "sessionID": "s", "part": {"reason": "tool-calls"}})


def test_the_log_tells_the_model_call_in_progress_before_any_tool_call_ends(client, tmp_path):
    task = submit(tmp_path)
    task_store.claim_next("test-worker", task_id=task["id"])
    task_store.append_task_log(task["id"], f"[worker] starting\n{_step('step_start', 1_700_000_000_000)}\n".encode())
    first = client.get(f"/api/tasks/{task['id']}/log", headers=AUTH).json()
    assert first["entries"] == [{"kind": "worker", "text": "starting"}]     # nothing else to show yet
    assert first["model_calls"] == {"started": 1, "last": "start", "at": 1_700_000_000.0}
    task_store.append_task_log(task["id"], f"{_step('step_finish', 1_700_000_005_000)}\n"
                                           f"{_step('step_start', 1_700_000_006_000)}\n".encode())
    more = client.get(f"/api/tasks/{task['id']}/log?offset={first['next_offset']}", headers=AUTH).json()
    assert more["model_calls"] == {"started": 1, "last": "start", "at": 1_700_000_006.0}
    task_store.append_task_log(task["id"], b"[worker] still going\n")
    idle = client.get(f"/api/tasks/{task['id']}/log?offset={more['next_offset']}", headers=AUTH).json()
    assert idle["model_calls"] == {"started": 0, "last": None, "at": None}   # no news: the page keeps what it knew


def test_the_list_names_the_model_a_default_run_used(client, tmp_path, store_backend):
    named = submit(tmp_path, title="named", model="fake/named")
    ran = submit(tmp_path, title="ran")
    submit(tmp_path, title="queued")
    for task, model in ((named, "fake/named"), (ran, "fake/picked")):
        claimed = task_store.claim_next("test-worker", task_id=task["id"])
        task_store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "ok", "model": model})
    rows = {t["title"]: t for t in client.get("/api/tasks", headers=AUTH).json()["tasks"]}
    assert (rows["named"]["model"], rows["ran"]["model"], rows["queued"]["model"]) == ("fake/named", None, None)
    assert (rows["ran"]["ran_model"], rows["queued"]["ran_model"]) == ("fake/picked", None)


def test_the_shell_says_loading_before_the_script_runs(client):
    page = client.get("/").text
    assert '<p id="loading" class="loading">loading the board…</p>' in page
