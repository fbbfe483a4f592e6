"""The one database switch on every entry point: ``--db URL`` on worker.py, tasks_cli.py, both MCP
servers and serve.py sets TASK_DB_URL for that process (serve.py hands it to its children by
environment, never on a command line); a value that cannot name a database is refused in one line
with exit 2 and no traceback, and a password in it is never shown."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import ROOT, free_port, run_script, wait_healthy

SECRET = "s3cr3t-pw"
ENTRY_POINTS = {
    "worker.py": [],
    "tasks_cli.py": ["status"],
    "opencode_bridge_mcp.py": [],
    "claude_control_mcp.py": [],
    "serve.py": ["--tunnel", "none"],
}


def run_with_db(script: str, value: str, *, cwd=None, env=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / script)]
    # tasks_cli's --db is a group option: it comes before the command.
    argv += ["--db", value, *ENTRY_POINTS[script]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, stdin=subprocess.DEVNULL,
                          env=env or dict(os.environ, MCP_BEARER_TOKEN="t"))


@pytest.mark.parametrize("script", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("value,said", [
    (f"mysql://me:{SECRET}@db.example/q", "--db is a mysql:// URL; only postgresql:// and postgres:// URLs"),
    (f"postgresql://me:{SECRET}@db.example:99999/q", "port is not a number from 0 to 65535"),
    ("", "--db is empty"),
], ids=["other-scheme", "bad-port", "empty"])
def test_a_bad_db_is_refused_in_one_line_without_its_password(tmp_path, script, value, said):
    result = run_with_db(script, value)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
    assert SECRET not in result.stderr + result.stdout and "Traceback" not in result.stderr
    assert result.stdout == "", "nothing on stdout (a stdio server's is JSON-RPC only)"
    assert not (tmp_path / "q").exists(), "nothing touched the store"


@pytest.mark.parametrize("script", ["worker.py", "tasks_cli.py", "serve.py"])
def test_a_folder_is_refused_naming_the_file_to_give(tmp_path, script):
    result = run_with_db(script, str(tmp_path))
    assert result.returncode == 2 and f"{tmp_path} is a folder; give the SQLite file in it" in result.stderr


@pytest.mark.parametrize("script", ["worker.py", "tasks_cli.py", "serve.py"])
def test_a_device_or_pipe_is_refused_as_no_queue_file(tmp_path, script):
    """--db /dev/null answered SQLite's "cannot rollback - no transaction is active"."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for value in ("/dev/null", str(fifo)):
        result = run_with_db(script, value)
        assert result.returncode == 2 and f"{value} is not a regular file" in result.stderr, result.stderr
        assert "path of a queue file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("script", ["worker.py", "tasks_cli.py"])
def test_a_db_file_where_no_queue_is_is_refused_and_nothing_is_made(tmp_path, script):
    """`worker.py --db /nonexistent/dir/x.db` exited 0 in silence, having made the folder and a new
    queue there, where tasks_cli.py refused the same path (a tester's finding): both refuse it."""
    typo = tmp_path / "nonexistent" / "dir" / "x.db"
    result = run_with_db(script, str(typo))
    assert result.returncode != 0 and f"no queue at {typo}: check --db / TASK_DB_PATH (a typo?)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "nonexistent").exists() and not (tmp_path / "q").exists()


def test_hints_name_the_queue_given_by_db_again(tmp_path):
    """After `tasks_cli.py --db Q …`, the commands a hint names (status, cancel, worker.py) said
    nothing of Q: pasted from the checkout, they acted on the default queue and ran its tasks
    (found by a new-user test). A URL is not repeated (its password)."""
    queue = tmp_path / "my queue" / "tasks.db"
    folder = tmp_path / "work"
    folder.mkdir()
    submitted = run_with_db_command(str(queue), "submit", "T", "--dir", str(folder), "-y")
    shown = run_with_db_command(str(queue), "show", "1").stdout
    status = run_with_db_command(str(queue), "status").stderr
    named = f"--db '{queue}'"
    assert f"tasks_cli.py {named} status" in submitted.stderr, submitted.stderr
    assert f"tasks_cli.py {named} cancel t_0001" in shown and f"worker.py {named} --watch" in status, status
    url = f"postgresql://me:{SECRET}@127.0.0.1:1/q"
    said = run_with_db_command(url, "status")
    assert SECRET not in said.stdout + said.stderr


def run_with_db_command(value: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "--db", value, *argv], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("script", ["worker.py", "tasks_cli.py", "serve.py"])
def test_another_programs_sqlite_database_is_refused_and_left_as_it_was(tmp_path, script):
    """`--db` naming another program's SQLite file (a browser's places.sqlite, say) made it a queue:
    twelve tables added, its journal switched to WAL and its user_version overwritten, even by
    `status` (found by a new-user test)."""
    import sqlite3
    other = tmp_path / "places.sqlite"
    conn = sqlite3.connect(other)
    conn.executescript("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT); PRAGMA user_version = 74;")
    conn.close()
    before = other.read_bytes()
    result = run_with_db(script, str(other))
    assert result.returncode != 0 and "a SQLite database of another program: its tables are moz_places" in \
        result.stderr and "Traceback" not in result.stderr, result.stderr
    assert other.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["places.sqlite"]


def test_a_file_that_is_no_sqlite_at_all_is_not_to_be_moved_aside(tmp_path):
    """A --db naming some other file (/etc/passwd, say) was told to `mv` it aside for a new queue,
    a command that would break the system it belongs to; only a file that may be a damaged queue
    (SQLite's header, or named .db) gets that way out, from the CLI and from doctor alike."""
    other = tmp_path / "passwd"
    other.write_text("root:x:0:0:root:/root:/bin/bash\n" * 20)
    damaged = tmp_path / "queue.db"
    damaged.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    for path, aside in ((other, False), (damaged, True)):
        said = run_with_db("tasks_cli.py", str(path))
        doctor = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "--db", str(path), "doctor"],
                                capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        database = next(line for line in doctor.stdout.splitlines() if line.split()[1:2] == ["database"])
        for text in (said.stderr, database):
            assert (f"mv {path} {path}.broken" in text) is aside, text
            assert aside or "not a SQLite database at all" in text
    assert other.read_text().startswith("root:x")


@pytest.mark.parametrize("script", ["worker.py", "opencode_bridge_mcp.py"])
def test_a_bad_task_db_url_in_the_environment_is_refused_the_same_way(tmp_path, script):
    result = run_script(script, env=dict(os.environ, TASK_DB_URL=f"mongodb://me:{SECRET}@h/q"), timeout=60)
    assert result.returncode == 2 and "TASK_DB_URL is a mongodb:// URL" in result.stderr
    assert SECRET not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("script", sorted(ENTRY_POINTS))
def test_help_names_db_and_never_shows_the_password(script):
    argv = ["--help"]
    result = run_script(script, *argv, env=dict(os.environ, TASK_DB_URL=f"postgresql://me:{SECRET}@db.example/q"),
                        timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--db" in result.stdout and "postgresql://" in result.stdout
    assert SECRET not in result.stdout + result.stderr


def test_a_relative_db_file_is_the_same_queue_for_the_cli_and_the_worker(tmp_path):
    """--db with a relative path means that file from the current folder, for the CLI and the worker
    alike; the default queue (TASK_DB_PATH of the test) is never touched."""
    (tmp_path / "work").mkdir()
    env = dict(os.environ)
    submitted = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "--db", "mine.db", "submit", "a task",
                                "--dir", str(tmp_path / "work"), "--yes"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    assert (tmp_path / "mine.db").exists() and not (tmp_path / "q" / "tasks.db").exists()
    listed = subprocess.run([sys.executable, str(ROOT / "tasks_cli.py"), "--db", str(tmp_path / "mine.db"), "list",
                             "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert [t["title"] for t in json.loads(listed.stdout)["tasks"]] == ["a task"]
    # The worker, pointed at it from another folder, works on that queue: its lock and heartbeat
    # sit beside that file (without opencode it claims nothing and says so).
    worker = subprocess.run([sys.executable, str(ROOT / "worker.py"), "--db", "../mine.db", "--max-tasks", "1"],
                            cwd=tmp_path / "work", env=dict(env, OPENCODE_BIN=str(tmp_path / "no-opencode")),
                            capture_output=True, text=True, timeout=120)
    assert (tmp_path / "mine.worker.json").exists(), worker.stderr
    assert not (tmp_path / "q" / "tasks.db").exists(), "the test's default queue was never opened"


@pytest.mark.anyio
async def test_both_mcp_servers_use_the_db_they_are_given(tmp_path):
    from mcp import Client, StdioServerParameters

    import task_store
    mine = tmp_path / "elsewhere" / "mine.db"
    mine.parent.mkdir()
    os.environ["TASK_DB_PATH"] = str(mine)   # (monkeypatched by conftest: restored after the test)
    task_store.submit_task(title="in mine", instructions="i", working_dir=str(tmp_path))
    os.environ["TASK_DB_PATH"] = str(tmp_path / "q" / "tasks.db")
    env = dict(os.environ)
    params = StdioServerParameters(
        command=sys.executable, args=[str(ROOT / "opencode_bridge_mcp.py"), "--db", str(mine)], env=env
    )
    async with Client(params) as client:
        result = await client.call_tool("list_tasks", {})
        assert [t["title"] for t in result.structured_content["tasks"]] == ["in mine"]
    params = StdioServerParameters(
        command=sys.executable, args=[str(ROOT / "claude_control_mcp.py"), "--db", str(mine)], env=env
    )
    async with Client(params) as client:
        result = await client.call_tool("claude_poll", {"job_id": "j_0001"})
        assert result.is_error
    assert not (tmp_path / "q" / "tasks.db").exists()


def serve_with_db(tmp_path, db: str) -> str:
    """serve.py --db DB until its server and worker run: checks that DB reached both by
    environment, never in their argv; returns everything serve.py said."""
    port = free_port()
    env = dict(os.environ, MCP_BEARER_TOKEN="t", MCP_TOKEN_FILE=str(tmp_path / "token"))
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--tunnel", "none", "--port", str(port),
                             "--db", db], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            children = {" ".join(c.cmdline()): c for c in psutil.Process(proc.pid).children()}
            if len(children) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert any("worker.py" in argv for argv in children) and any("opencode_bridge_mcp.py" in argv
                                                                    for argv in children), children
        for argv, child in children.items():
            assert db not in argv and "--db" not in argv
            assert child.environ()["TASK_DB_URL"] == db
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        said = proc.communicate(timeout=60)[0].decode(errors="replace")
    return said


def test_serve_hands_the_db_to_its_children_by_environment_not_argv(tmp_path):
    """`ps` shows every user's command lines: the URL (which may hold a password) travels in the
    environment of serve.py's server and worker, never in their argv."""
    mine = tmp_path / "served.db"
    serve_with_db(tmp_path, str(mine))
    assert mine.exists()


# --------------------------------------------------------------------------------------------
# On a real PostgreSQL (tests/pg_server.py): the URL carries a password, which nothing shows.


@pytest.mark.postgres
def test_the_cli_works_on_postgresql_and_never_shows_the_password(tmp_path, pg_url):
    import pg_server
    (tmp_path / "work").mkdir()
    cli = [sys.executable, str(ROOT / "tasks_cli.py"), "--db", pg_url]
    submitted = subprocess.run([*cli, "submit", "on postgres", "--dir", str(tmp_path / "work"), "--yes", "--json"],
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    listed = subprocess.run([*cli, "list", "--json"], capture_output=True, text=True, timeout=60)
    assert [t["title"] for t in json.loads(listed.stdout)["tasks"]] == ["on postgres"], listed.stderr
    status = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=60)
    as_json = subprocess.run([*cli, "status", "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(as_json.stdout)["db"] == pg_url.replace(f":{pg_server.PASSWORD}@", "@")
    for result in (submitted, listed, status, as_json):
        assert pg_server.PASSWORD not in result.stdout + result.stderr
    assert "postgresql://taskbridge@127.0.0.1" in status.stdout
    assert not (tmp_path / "q" / "tasks.db").exists(), "no SQLite queue was made beside it"


@pytest.mark.postgres
def test_the_worker_and_the_bridge_name_the_database_without_its_password(tmp_path, pg_url):
    import pg_server
    env = dict(os.environ, TASK_DB_PATH=str(tmp_path / "state" / "tasks.db"))
    worker = subprocess.Popen([sys.executable, str(ROOT / "worker.py"), "--db", pg_url, "--watch"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = worker.stdout.readline()
    finally:
        worker.send_signal(signal.SIGTERM)
        rest = worker.communicate(timeout=60)[0]
    assert "worker started" in first and "queue postgresql://taskbridge@127.0.0.1" in first, first + rest
    worker_log = "".join(p.read_text() for p in (tmp_path / "state").glob("*.worker.log"))
    assert "queue postgresql://taskbridge@" in worker_log
    assert pg_server.PASSWORD not in first + rest + worker_log

    bridge = subprocess.run(
        [sys.executable, str(ROOT / "opencode_bridge_mcp.py"), "--db", pg_url, "--log-level", "INFO"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "database postgresql://taskbridge@127.0.0.1" in bridge.stderr, bridge.stderr
    assert pg_server.PASSWORD not in bridge.stderr + bridge.stdout


@pytest.mark.postgres
@pytest.mark.anyio
async def test_ping_names_the_database_without_its_password(tmp_path, pg_url):
    from mcp import Client, StdioServerParameters

    import pg_server
    params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "opencode_bridge_mcp.py"), "--db", pg_url],
                                   env=dict(os.environ))
    async with Client(params) as client:
        ping = (await client.call_tool("ping", {})).structured_content
        status = (await client.call_tool("queue_status", {})).structured_content
    assert ping["database"] == status["database"] == pg_url.replace(f":{pg_server.PASSWORD}@", "@")


@pytest.mark.postgres
def test_serve_on_postgresql_shows_no_password(tmp_path, pg_url):
    import pg_server
    said = serve_with_db(tmp_path, pg_url)
    assert "Local MCP" in said and pg_server.PASSWORD not in said


def test_the_claude_desktop_entry_names_a_postgresql_queue_without_its_password(monkeypatch):
    import connectors
    monkeypatch.setenv("TASK_DB_URL", f"postgresql://tb:{SECRET}@db.example/queue")
    entry = connectors.claude_desktop_entry()
    assert entry["env"]["TASK_DB_URL"] == "postgresql://tb@db.example/queue"
    snippets = connectors.snippets(8765)
    assert "opencode_bridge_mcp.py --db postgresql://tb@db.example/queue\n" in snippets
    assert SECRET not in json.dumps(entry) + snippets


@pytest.mark.parametrize("script,args", [("serve.py", ["--tunnel", "none"]), ("worker.py", []),
                                         ("tasks_cli.py", ["list"])])
def test_an_unreachable_postgresql_server_is_one_line_without_the_password(script, args):
    port = free_port()   # nothing listens there
    env = dict(os.environ, MCP_BEARER_TOKEN="t")
    argv = [sys.executable, str(ROOT / script), "--db", f"postgresql://tb:{SECRET}@127.0.0.1:{port}/queue", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    assert f"postgresql://tb@127.0.0.1:{port}/queue" in result.stderr and "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr
    if script == "serve.py":
        assert "Local MCP" not in result.stderr, "nothing was started"


def test_install_refuses_another_scheme_before_installing():
    began = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / "install.sh"), "--db", f"mysql://me:{SECRET}@h/q"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and "--db is a mysql:// URL; only postgresql:// and postgres://" in result.stderr
    assert SECRET not in result.stderr and "installing" not in result.stderr and time.monotonic() - began < 10


def test_serve_on_a_file_that_is_no_queue_leaves_it_as_it_was_and_says_how_to_move_it_aside(tmp_path):
    # serve.py made the junk file 0600 first ("made … private to this user") and then refused it
    # without doctor's way out (found by a new-user test).
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"these bytes are not SQLite " * 40)
    junk.chmod(0o644)
    result = run_with_db("serve.py", str(junk), env=dict(os.environ, MCP_BEARER_TOKEN="t", PORT=str(free_port())))
    assert result.returncode == 1, result.stderr
    assert f"the task database {junk} cannot be used" in result.stderr
    assert f"move it aside (mv {junk} {junk}.broken" in result.stderr
    assert "private to this user" not in result.stderr and "Traceback" not in result.stderr
    assert junk.stat().st_mode & 0o777 == 0o644 and sorted(p.name for p in tmp_path.iterdir()) == ["junk.db"]
