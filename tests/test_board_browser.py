"""The dispatch board in real headless Chromium (Debian's chromium + chromedriver, driven by
Selenium) against the real server process: the token prompt, live tallies and feed, a real worker
pass (real opencode, scripted model) whose log lines and diff appear on the open page, answering a
waiting task from the page, screenshots that are not blank, and hostile strings that stay text.
The list screenshot becomes docs/board.png (the README's) when that file is missing or
TASKBRIDGE_UPDATE_SCREENSHOT=1.

`./install.sh --test` installs chromium, chromium-driver and selenium; a missing one skips these
tests locally and fails them under CI=true."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

import task_store
from fake_openai import text, tool_call
from helpers import ROOT, free_port, make_repo, run_script

pytestmark = pytest.mark.browser

TOKEN = "browser-test-token-0123456789"
HOSTILE = ('<script>window.__pwned="script"</script><img src=x onerror="window.__pwned=\'img\';alert(1)">'
           '<a href="javascript:window.__pwned=\'link\'">click me</a>')
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")
RECEIPT = '```json\n{"summary": "Wrote hello.txt", "files_touched": ["hello.txt"], ' \
          '"tests_run": ["cat hello.txt"], "open_questions": []}\n```'


def _missing(what: str) -> None:
    message = f"{what} is missing: run ./install.sh --test (as root it apt-gets chromium and chromium-driver)"
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def browser(tmp_path):
    """A fresh headless Chromium (its own profile under tmp_path) driven through chromedriver."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium (requirements-dev.txt)")
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_bin:
        _missing("chromium or chromedriver (Debian packages chromium, chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(service=Service(executable_path=driver_bin), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def board(tmp_path, monkeypatch):
    """The real server (`opencode_bridge_mcp.py --transport streamable-http`) on a free port."""
    monkeypatch.setenv("MCP_BEARER_TOKEN", TOKEN)
    port = free_port()
    errors = tmp_path / "server.err"
    with errors.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, str(ROOT / "opencode_bridge_mcp.py"), "--transport",
                                 "streamable-http", "--port", str(port)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=sink, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _healthy(base):
            assert proc.poll() is None and time.monotonic() < deadline, errors.read_text()
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in errors.read_text(), errors.read_text()


def _healthy(base: str) -> bool:
    import httpx2
    try:
        return httpx2.get(f"{base}/health").status_code == 200
    except httpx2.TransportError:
        return False


def wait(driver, condition, timeout: float = 30, what: str = "the page"):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def by_id(driver, name: str):
    from selenium.webdriver.common.by import By
    found = driver.find_elements(By.ID, name)
    return found[0] if found else None


def click(driver, name: str, timeout: float = 10) -> None:
    """Click the element with id ``name``; a live update that replaced it between the find and the
    click (stale: the click did not happen) is met by finding it again."""
    from selenium.common.exceptions import StaleElementReferenceException
    deadline = time.monotonic() + timeout
    while True:
        node = by_id(driver, name)
        try:
            if node is not None:
                node.click()
                return
        except StaleElementReferenceException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"#{name} could not be clicked within {timeout:g} s")
        time.sleep(0.05)


def open_task(driver, task_id: str, timeout: float = 30) -> None:
    """Click task ``task_id``'s row in the list, waiting for the row: the list renders after the
    tallies that ``log_in`` waits for (CI, loaded, found no row right after it); a row replaced by
    a live update between the find and the click is found again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def clicked(d) -> bool:
        links = d.find_elements(By.CSS_SELECTOR, f"tr[data-id='{task_id}'] a")
        try:
            return bool(links) and links[0].click() is None
        except StaleElementReferenceException:
            return False
    wait(driver, clicked, timeout, what=f"the row of {task_id}")


def text_of_node(node) -> str:
    try:
        return node.text
    except Exception:           # replaced while read (the page re-renders): read again
        return ""


def text_of(driver, name: str) -> str:
    try:
        node = by_id(driver, name)
        return node.text if node is not None else ""
    except Exception:           # replaced while read (the page re-renders): read again
        return ""


def log_in(driver, base: str) -> None:
    driver.get(base + "/")
    wait(driver, lambda d: by_id(d, "token-input").is_displayed(), what="the token prompt")
    by_id(driver, "token-input").send_keys(TOKEN)
    by_id(driver, "token-save").click()
    wait(driver, lambda d: text_of(d, "tally-pending") != "", what="the tallies")


def png_colours(path: Path) -> int:
    """How many distinct pixel values an 8-bit RGB/RGBA PNG holds (decoded here: no imaging
    library needed). A blank screenshot has one."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, chunks, head = 8, [], None
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + size]
        if kind == b"IHDR":
            head = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + size
    width, height, depth, colour = head
    assert depth == 8 and colour in (2, 6), f"unexpected PNG format {depth}/{colour}"
    bpp = 3 if colour == 2 else 4
    raw, stride, prev, seen = zlib.decompress(b"".join(chunks)), width * bpp, bytearray(width * bpp), set()
    for row in range(height):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if row % 7 == 0:
            seen.update(bytes(line[i:i + bpp]) for i in range(0, stride, bpp * 5))
        prev = line
    return len(seen)


def screenshot(driver, path: Path) -> Path:
    driver.save_screenshot(str(path))
    assert png_colours(path) > 20, f"{path} looks blank"
    return path


def console_errors(driver) -> list[str]:
    """The browser console's errors so far (a CSP violation or a script error shows here)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def no_script_ran(driver) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    with pytest.raises(NoAlertPresentException):
        _ = driver.switch_to.alert.text
    assert driver.execute_script("return window.__pwned === undefined")
    assert driver.find_elements(By.CSS_SELECTOR, "img") == []
    assert driver.find_elements(By.CSS_SELECTOR, "a[href^='javascript']") == []
    assert len(driver.find_elements(By.TAG_NAME, "script")) == 1


# --------------------------------------------------------------------------------------------


@pytest.mark.real_opencode
def test_board_live_worker_pass_diff_log_and_answer(opencode, board, browser, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("write-run", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello from the agent\n"}),
        tool_call("bash", {"command": "cat hello.txt", "description": "check"}),
        text("All done.\n" + RECEIPT),
    ])
    opencode.model.script("ask", [text("One thing first.\n```question\nWhich port should the server use?\n```")])
    log_in(browser, board)
    assert "token" not in browser.current_url
    assert browser.execute_script("return localStorage.getItem('taskbridge.token')") == TOKEN
    assert text_of(browser, "tally-pending") == "0" and "never seen" in text_of(browser, "worker")

    submitted = run_script("tasks_cli.py", "submit", "Write hello", "--dir", str(repo), "--instructions",
                           "Create hello.txt. SCRIPT:write-run", "--json")
    assert submitted.returncode == 0, submitted.stderr
    seen_at = time.monotonic()
    wait(browser, lambda d: text_of(d, "tally-pending") == "1" and "submitted" in text_of(d, "feed"),
         timeout=10, what="the new task in the tallies and the feed")
    lag = time.monotonic() - seen_at
    assert lag < 2.0, f"the board showed the new task after {lag:.2f} s"
    first = json.loads(submitted.stdout)["id"]
    asked = run_script("tasks_cli.py", "submit", "Ask first", "--dir", str(repo), "--instructions",
                       "Ask which port. SCRIPT:ask", "--json")
    second = json.loads(asked.stdout)["id"]
    wait(browser, lambda d: text_of(d, "tally-pending") == "2", timeout=10, what="two pending")

    from selenium.webdriver.common.by import By
    open_task(browser, first)
    wait(browser, lambda d: first in text_of(d, "task-title"), what="the task page")
    worker = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait(browser, lambda d: "hello.txt" in text_of(d, "log"), timeout=120, what="log lines of the run")
        wait(browser, lambda d: "tool call" in text_of(d, "feed"), timeout=60, what="tool calls in the feed")
        wait(browser, lambda d: "hello from the agent" in text_of(d, "diff"), timeout=120, what="the diff")
        assert "hello.txt" in text_of(browser, "diff-files") and text_of(browser, "task-status") == "done"
        log_text = text_of(browser, "log")
        assert "write" in log_text and "cat hello.txt" in log_text and '"type"' not in log_text
        added = browser.find_elements(By.CSS_SELECTOR, "#diff span.add")
        assert any("hello from the agent" in s.text for s in added)
        screenshot(browser, tmp_path / "task.png")
        worker.wait(180)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, worker.stdout.read().decode()

    browser.find_element(By.LINK_TEXT, "← all tasks").click()
    wait(browser, lambda d: text_of(d, "tally-waiting") == "1" and text_of(d, "tally-done") == "1",
         timeout=20, what="the waiting and done tallies")
    wait(browser, lambda d: first in text_of(d, "engine"), what="the worker's own lines in the engine tail")
    wait(browser, lambda d: "worker stopped" in text_of(d, "worker"), what="the ended one-pass worker shown stopped")
    shot = screenshot(browser, tmp_path / "list.png")
    readme_copy = ROOT / "docs" / "board.png"       # the README's picture: refreshed on request only
    if not readme_copy.exists() or os.environ.get("TASKBRIDGE_UPDATE_SCREENSHOT") == "1":
        readme_copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, readme_copy)

    open_task(browser, second)
    wait(browser, lambda d: "Which port" in text_of(d, "question"), what="the question")
    by_id(browser, "answer-text").send_keys("Use 8080")
    click(browser, "answer-send")
    wait(browser, lambda d: text_of(d, "task-status") == "pending", what="the task requeued")
    task = task_store.get_task(second)
    assert task["status"] == "pending" and task["questions"][-1]["answer"] == "Use 8080"
    wait(browser, lambda d: text_of(d, "tally-waiting") == "0", what="the waiting tally")
    assert console_errors(browser) == []


def _hostile_queue(tmp_path: Path) -> tuple[str, str]:
    """A waiting task and a done task whose every shown string carries the hostile payload."""
    asking = task_store.submit_task(title="Q " + HOSTILE, instructions=HOSTILE, working_dir=str(tmp_path))
    task_store.add_note(asking["id"], HOSTILE)
    claimed = task_store.claim_next("test-worker", task_id=asking["id"])
    task_store.pause_for_question(asking["id"], claimed["run_marker"], HOSTILE)
    done = task_store.submit_task(title="D " + HOSTILE, instructions="x", working_dir=str(tmp_path))
    claimed = task_store.claim_next("test-worker", task_id=done["id"])
    diff = f"diff --git a/x.html b/x.html\n+++ b/x.html\n@@ -0,0 +1 @@\n+{HOSTILE}\n"
    task_store.complete_attempt(done["id"], claimed["run_marker"], diff=diff,
                                result={"summary": HOSTILE, "files_touched": [HOSTILE]})
    # through the store: the log file on SQLite, the database's chunks on PostgreSQL
    task_store.append_task_log(done["id"], (f"[worker] {HOSTILE}\n" + json.dumps(
        {"type": "text", "part": {"text": HOSTILE}}) + "\n").encode())
    engine = task_store.state_path("worker.log")
    engine.parent.mkdir(parents=True, exist_ok=True)
    engine.write_text(f"engine {HOSTILE}\n")
    task_store.create_claude_job("job " + HOSTILE, "cli", 60)
    return asking["id"], done["id"]


def test_hostile_strings_stay_text_and_run_nothing(store_backend, board, browser, tmp_path):
    asking, done = _hostile_queue(tmp_path)
    log_in(browser, board)
    wait(browser, lambda d: text_of(d, "tally-waiting") == "1", what="the tallies")
    wait(browser, lambda d: HOSTILE in text_of(d, "tasks") and HOSTILE in text_of(d, "jobs")
         and HOSTILE in text_of(d, "engine") and HOSTILE in text_of(d, "feed"), what="hostile rows as text")
    no_script_ran(browser)

    browser.get(f"{board}/#/task/{asking}")
    wait(browser, lambda d: HOSTILE in text_of(d, "question"), what="the question as text")
    assert text_of(browser, "instructions") == HOSTILE and HOSTILE in text_of(browser, "task-view")
    no_script_ran(browser)

    browser.get(f"{board}/#/task/{done}")
    wait(browser, lambda d: HOSTILE in text_of(d, "diff") and HOSTILE in text_of(d, "log"), what="diff and log")
    assert HOSTILE in text_of(browser, "summary")
    assert text_of(browser, "task-view").count(HOSTILE) >= 5     # summary, files touched, diff, 2 log lines
    no_script_ran(browser)
    assert console_errors(browser) == []


def test_bidirectional_controls_in_task_text_show_as_escapes(board, browser, tmp_path):
    """A fresh tester's finding: a title holding U+202E (right-to-left override) reordered the
    page after it, pulling the status badge into the title. Such controls show as escapes, as the
    CLI shows them, everywhere the board puts a string of the queue."""
    task = task_store.submit_task(title="Bidi \u202e txt.exe \u2066 tricks", instructions="x\u202ey",
                                  working_dir=str(tmp_path))
    log_in(browser, board)
    wait(browser, lambda d: "Bidi \\u202e txt.exe \\u2066 tricks" in text_of(d, "tasks"), what="the escaped title")
    open_task(browser, task["id"])
    wait(browser, lambda d: "\\u202e txt.exe" in text_of(d, "task-title"), what="the task page's title")
    assert text_of(browser, "instructions") == "x\\u202ey"
    assert "\u202e" not in text_of(browser, "task-view") and "\u202e" not in text_of(browser, "tasks")


def test_every_worker_shows_with_its_host(board, browser, monkeypatch):
    with monkeypatch.context() as elsewhere:
        elsewhere.setenv("TASKBRIDGE_HOST", "build-server")
        task_store.write_worker_heartbeat({"state": "running", "task": "t_0001", "tasks": ["t_0001"]})
    task_store.write_worker_heartbeat({"state": "idle"})
    log_in(browser, board)
    wait(browser, lambda d: "2 workers" in text_of(d, "workers"), what="the workers")
    shown = text_of(browser, "workers")
    assert (
        f"build-server pid {os.getpid()} online" in shown
        and f"{task_store.host_name()} pid {os.getpid()} online" in shown
    )
    assert console_errors(browser) == []


def test_a_silent_worker_on_another_host_shows_what_it_may_still_run(board, browser):
    """A reviewer's finding: a worker on another host not heard from for over 30 s was shown
    running nothing ("since 2 min ago ... when last seen running with t_0009"), while its task
    still ran under it; the reaper leaves its lease alone until WORKER_STALE_SEC. Its heartbeat row
    is written by a real process whose clock is 2 minutes behind (faketime)."""
    faketime = shutil.which("faketime")
    if faketime is None:
        _missing("faketime (Debian package faketime)")
    said = subprocess.run([faketime, "-f", "-120s", sys.executable, "-c", "import task_store; "
                           "task_store.write_worker_heartbeat({'state': 'running', 'tasks': ['t_0009']})"],
                          cwd=ROOT, env=dict(os.environ, TASKBRIDGE_HOST="build-server"), capture_output=True,
                          text=True, timeout=60, check=False)
    assert said.returncode == 0, said.stderr
    log_in(browser, board)
    wait(browser, lambda d: "worker stale" in text_of(d, "worker"), what="the silent worker")
    shown = text_of(browser, "worker")
    assert "on build-server, running; not heard from for 2 min, may still run t_0009" in shown, shown
    assert "since" not in shown and "when last seen" not in shown, shown
    assert console_errors(browser) == []


def test_a_token_in_the_address_is_not_taken(board, browser):
    """A ``#token=`` link left the token in the browser's history database: the board takes none
    from its URL, drops the fragment and asks for the token to be pasted."""
    browser.get(f"{board}/#token={TOKEN}")
    wait(browser, lambda d: by_id(d, "token-input").is_displayed(), what="the token prompt")
    assert "history would keep it" in text_of(browser, "login-msg")
    assert browser.execute_script("return localStorage.getItem('taskbridge.token')") is None
    assert "token" not in browser.current_url
    log_in(browser, board)   # pasting it still works
    browser.get(f"{board}/#token=another")
    wait(browser, lambda d: "history would keep it" in text_of(d, "error"), what="the notice")
    assert browser.execute_script("return localStorage.getItem('taskbridge.token')") == TOKEN


def test_a_refused_token_goes_back_to_the_prompt(board, browser):
    browser.get(board + "/")
    browser.execute_script("localStorage.setItem('taskbridge.token', 'stale-token')")
    browser.get(board + "/")
    wait(browser, lambda d: by_id(d, "token-input").is_displayed(), what="the token prompt")
    assert "refused" in text_of(browser, "login-msg")
    assert browser.execute_script("return localStorage.getItem('taskbridge.token')") is None
    assert not by_id(browser, "board").is_displayed()


def test_cancel_then_retry_from_the_page_and_a_refusal_shows_the_store_message(board, browser, tmp_path):
    task = task_store.submit_task(title="to cancel", instructions="x", working_dir=str(tmp_path))
    log_in(browser, board)
    open_task(browser, task["id"])
    wait(browser, lambda d: text_of(d, "task-status") == "pending", what="the task page")
    by_id(browser, "note-text").send_keys("   ")
    click(browser, "note-send")
    wait(browser, lambda d: "note refused" in text_of(d, "action-msg"), what="the store's refusal")
    click(browser, "cancel")                       # arms the button
    assert task_store.get_task(task["id"])["status"] == "pending"
    click(browser, "cancel")
    wait(browser, lambda d: text_of(d, "task-status") == "cancelled", what="the task cancelled")
    wait(browser, lambda d: text_of(d, "tally-cancelled") == "1", what="the cancelled tally")
    click(browser, "retry")
    wait(browser, lambda d: text_of(d, "task-status") == "pending", what="the task retried")
    # The live update can show the new status before the POST's answer writes the message.
    wait(browser, lambda d: text_of(d, "action-msg") == "retry: done", what="the retry's message")
    assert task_store.get_task(task["id"])["status"] == "pending"
    no_script_ran(browser)


def test_an_armed_cancel_stays_armed_when_a_live_update_rebuilds_the_page(board, browser, tmp_path):
    """The first click arms the cancel button; a live update (here: a note added elsewhere) that
    rebuilt the task page between the two clicks used to disarm it, so the second click only armed
    it again and nothing was cancelled."""
    from selenium.webdriver.common.by import By
    task = task_store.submit_task(title="to cancel", instructions="x", working_dir=str(tmp_path))
    log_in(browser, board)
    open_task(browser, task["id"])
    wait(browser, lambda d: text_of(d, "task-status") == "pending", what="the task page")
    click(browser, "cancel")                       # arms the button
    task_store.add_note(task["id"], "a note from elsewhere", author="planner")
    wait(browser, lambda d: any("a note from elsewhere" in text_of_node(n)   # the Notes section, not the events
                                for n in d.find_elements(By.CSS_SELECTOR, "pre.note")), what="the rebuilt page")
    assert text_of(browser, "cancel") == f"Click again to cancel {task['id']}"
    click(browser, "cancel")
    wait(browser, lambda d: text_of(d, "task-status") == "cancelled", what="the task cancelled")
    assert task_store.get_task(task["id"])["status"] == "cancelled"
    no_script_ran(browser)


def test_an_actions_answer_shows_even_when_a_live_update_rebuilt_the_page_first(board, browser, tmp_path):
    """The live update can show a retry's new status, and rebuild the task page, before the
    retry's own answer arrives: that answer used to go to the old, detached message line, and the
    page kept the cancel's "cancel: done" (this test holds the answer back 2 s to make it so)."""
    task = task_store.submit_task(title="to retry", instructions="x", working_dir=str(tmp_path))
    task_store.cancel_task(task["id"])
    log_in(browser, board)
    open_task(browser, task["id"])
    wait(browser, lambda d: text_of(d, "task-status") == "cancelled", what="the task page")
    browser.execute_script("""
        const real = window.fetch;
        window.fetch = (path, init) => {
          const answer = real(path, init);
          if (!(init && init.method === "POST" && String(path).endsWith("/retry"))) return answer;
          return answer.then((r) => new Promise((done) => setTimeout(() => done(r), 2000)));
        };""")
    click(browser, "retry")
    wait(browser, lambda d: text_of(d, "task-status") == "pending", what="the live update")
    wait(browser, lambda d: text_of(d, "action-msg") == "retry: done", what="the retry's message")
    no_script_ran(browser)


def test_the_page_stays_responsive_with_ten_thousand_tasks(board, browser, tmp_path):
    for start in range(0, 10_000, 20):
        task_store.submit_batch([{"title": f"task {start + i}", "instructions": "x", "working_dir": str(tmp_path)}
                                 for i in range(20)])
    started = time.monotonic()
    log_in(browser, board)
    wait(browser, lambda d: "1–50 of 10000" in text_of(d, "page-info"), what="the first page")
    first = time.monotonic() - started
    started = time.monotonic()
    click(browser, "next")
    wait(browser, lambda d: "51–100 of 10000" in text_of(d, "page-info"), what="the next page")
    paged = time.monotonic() - started
    by_id(browser, "f-search").send_keys("task 9999")
    wait(browser, lambda d: "1–1 of 1" in text_of(d, "page-info"), what="the search")
    rows = len(browser.find_elements("css selector", "#tasks tbody tr"))
    print(f"10,000 tasks: board open {first:.2f} s, next page {paged:.2f} s")
    assert rows == 1 and first < 10 and paged < 3
    assert text_of(browser, "tally-pending") == "10000"


def test_a_usage_limit_pause_shows_its_resume_time_and_continue_resumes_it(board, browser, tmp_path):
    from selenium.webdriver.common.by import By
    task = task_store.submit_task(title="limited", instructions="x", working_dir=str(tmp_path), model="fake/model")
    claimed = task_store.claim_next("w", task_id=task["id"])
    task_store.pause_for_limit(task["id"], claimed["run_marker"], "Usage limit: the provider fake said 'slow down'",
                               account="fake", said="slow down", resume_at=task_store.now() + 600, known_reset=True)
    resume_at = task_store.get_task(task["id"])["resume_at"]
    log_in(browser, board)
    wait(
        browser, lambda d: f"fake at its usage limit until {resume_at}" in text_of(d, "spend"), what="the held account"
    )
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-id='{task['id']}']")
    assert f"resumes {resume_at}" in row.text
    row.find_element(By.CSS_SELECTOR, "a").click()
    wait(browser, lambda d: text_of(d, "task-status") == "waiting", what="the task page")
    assert text_of(browser, "question-head") == f"Paused at fake's usage limit; resumes by itself at {resume_at}:"
    by_id(browser, "answer-text").send_keys("continue")
    click(browser, "answer-send")
    wait(browser, lambda d: text_of(d, "task-status") == "pending", what="the task resumed")
    assert task_store.get_task(task["id"])["limit_pauses"][0]["resumed"] == "by board"
    assert console_errors(browser) == []


def _step_line(kind: str) -> bytes:
    return (
        json.dumps({"type": kind, "timestamp": int(time.time() * 1000), "sessionID": "s", "part": {}}) + "\n"
    ).encode()


def test_a_failed_task_says_why_on_top_a_running_one_shows_its_model_call_and_models_are_named(
    board, browser, tmp_path
):
    failed = task_store.submit_task(title="breaks", instructions="x", working_dir=str(tmp_path), max_retries=0)
    marker = task_store.claim_next("test-worker", task_id=failed["id"])["run_marker"]
    task_store.fail_attempt(failed["id"], marker, "the model refused: " + HOSTILE, retryable=False)
    ran = task_store.submit_task(title="ran on the default", instructions="x", working_dir=str(tmp_path))
    marker = task_store.claim_next("test-worker", task_id=ran["id"])["run_marker"]
    task_store.complete_attempt(ran["id"], marker, result={"summary": "ok", "model": "fake/picked"})
    queued = task_store.submit_task(title="queued", instructions="x", working_dir=str(tmp_path))
    running = task_store.submit_task(title="thinking", instructions="x", working_dir=str(tmp_path))
    task_store.claim_next("test-worker", task_id=running["id"])
    task_store.append_task_log(running["id"], b"[worker] starting\n" + _step_line("step_start"))
    from selenium.webdriver.common.by import By
    log_in(browser, board)
    cell = lambda d, tid: d.find_element(By.CSS_SELECTOR, f"tr[data-id='{tid}'] td:nth-child(5)").text  # noqa: E731
    wait(browser, lambda d: by_id(d, "tasks") and queued["id"] in text_of(d, "tasks"), what="the list")
    assert cell(browser, ran["id"]) == "fake/picked (default)" and cell(browser, queued["id"]) == "default"
    assert not by_id(browser, "loading").is_displayed()

    browser.get(f"{board}/#/task/{failed['id']}")
    wait(browser, lambda d: "Why it failed" in text_of(d, "task-why"), what="the reason on top")
    assert text_of(browser, "task-why") == "Why it failed: the model refused: " + HOSTILE
    assert (
        browser.execute_script("return document.getElementById('task-why').previousElementSibling.id") == "task-title"
    )
    assert "no receipt: the attempt ended before writing one" in text_of(browser, "task-view")
    no_script_ran(browser)

    browser.get(f"{board}/#/task/{running['id']}")
    wait(browser, lambda d: "model call 1 in progress since" in text_of(d, "live"), what="the model call in progress")
    assert "running: started" in text_of(browser, "live")
    task_store.append_task_log(running["id"], _step_line("step_finish") + _step_line("step_start"))
    wait(browser, lambda d: "model call 2 in progress" in text_of(d, "live"), what="the next model call")
    wait(browser, lambda d: "call 2 started (in progress)" in text_of(d, "feed"), what="the model call in the feed")
    assert console_errors(browser) == []
