"""Set-up without serving: client snippets and the Claude Desktop merge, the token file, the modes
of everything that holds task data, and a worker started with a bare environment."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import connectors
import serve
import task_store
import tasks_cli
import worker_talk
from helpers import ROOT, fake_binary, normal_user, run_script

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------------------------
# Client snippets.


def test_connect_prints_every_clients_setup_with_absolute_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENCODE_BIN", sys.executable)   # any executable: the entry names it
    result = CliRunner().invoke(tasks_cli.cli, ["connect", "--port", "9876", "--public-url",
                                                "https://abc.trycloudflare.com"])
    assert result.exit_code == 0, result.output
    out = result.output
    desktop = json.loads(out[out.index("{"):out.index("\n}\n") + 2])["mcpServers"]["taskbridge"]
    assert Path(desktop["command"]).is_absolute() and desktop["args"] == [str(ROOT / "opencode_bridge_mcp.py")]
    assert desktop["env"]["TASK_DB_PATH"] == os.environ["TASK_DB_PATH"]
    queue = os.environ["TASK_DB_PATH"]
    assert (
        f"claude mcp add -s user taskbridge -- {desktop['command']} {ROOT / 'opencode_bridge_mcp.py'} --db {queue}\n"
        in out
    )
    assert "claude mcp add -s user --transport http taskbridge http://127.0.0.1:9876/mcp --header" in out
    assert "codex mcp add taskbridge --url http://127.0.0.1:9876/mcp --bearer-token-env-var TASKBRIDGE_TOKEN" in out
    assert "gemini mcp add -s user --transport http taskbridge http://127.0.0.1:9876/mcp --header" in out
    assert "code --add-mcp" in out and "~/.cursor/mcp.json" in out
    assert str(ROOT / "claude_control_mcp.py") in out and '"claude-control"' in out
    assert "Settings → Apps → Advanced settings → Developer mode" in out
    assert "https://abc.trycloudflare.com/mcp" in out


def printed_json(out: str, after: str) -> dict:
    """The JSON block printed right after the line starting with ``after``."""
    start = out.index("{", out.index(after))
    return json.loads(out[start:out.index("\n}\n", start) + 2])


@pytest.mark.anyio
@pytest.mark.parametrize("client", ["claude code", "cursor", "vs code"])
async def test_each_stdio_snippet_opens_the_connect_time_queue_from_anywhere(client, tmp_path, monkeypatch):
    """The printed command, run as the client runs it (another folder, no TASK_DB_PATH in its
    environment), serves the queue `connect` was run against, not the default one."""
    import shlex

    from mcp import Client, StdioServerParameters
    queue = tmp_path / "elsewhere" / "queue.db"
    monkeypatch.setenv("TASK_DB_PATH", str(queue))
    (tmp_path / "project").mkdir()
    task_store.submit_task(title="in the other queue", instructions="x", working_dir=str(tmp_path / "project"))
    out = CliRunner().invoke(tasks_cli.cli, ["connect"]).output
    if client == "claude code":
        argv = shlex.split(out.split("claude mcp add -s user taskbridge -- ", 1)[1].splitlines()[0])
    elif client == "cursor":
        entry = printed_json(out, "Cursor:")["mcpServers"]["taskbridge"]
        argv = [entry["command"], *entry["args"]]
    else:
        entry = json.loads(shlex.split(out.split("code --add-mcp ", 1)[1].splitlines()[0])[0])
        argv = [entry["command"], *entry["args"]]
    env = {k: v for k, v in os.environ.items() if k not in ("TASK_DB_PATH", "TASK_DB_URL")}
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=str(tmp_path))
    async with Client(params, mode="legacy") as mcp_client:
        listed = await mcp_client.call_tool("list_tasks", {})
    assert [t["title"] for t in listed.structured_content["tasks"]] == ["in the other queue"]


@pytest.mark.real_opencode
def test_opencode_as_the_planner_connects_with_the_printed_entry(tmp_path, monkeypatch):
    """The `type: remote` entry `connect` prints (the token read from its file by OpenCode's
    {file:…} substitution) lets the pinned opencode connect to the served /mcp."""
    from helpers import free_port, serving
    from opencode_env import opencode_env, require_opencode_bin
    token = tmp_path / "tb" / "token"
    token.parent.mkdir()
    token.write_text("planner-seat-token-0123456789\n")
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token))
    monkeypatch.delenv("MCP_BEARER_TOKEN", raising=False)
    port = free_port()
    entry = printed_json(CliRunner().invoke(tasks_cli.cli, ["connect", "--port", str(port)]).output,
                         "OpenCode as the planner")
    env = opencode_env(tmp_path, "http://127.0.0.1:9/v1")
    env.pop("OPENCODE_CONFIG")
    config = Path(env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(entry))
    with serving(port):
        listed = subprocess.run([require_opencode_bin(), "mcp", "list"], env={**env, "PWD": str(tmp_path)},
                                cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    line = next((row for row in listed.stdout.splitlines() if "taskbridge" in row), "")
    assert "connected" in line and "not connected" not in line.lower(), listed.stdout + listed.stderr


def test_connect_refuses_a_public_url_that_is_not_a_base_url():
    result = CliRunner().invoke(tasks_cli.cli, ["connect", "--public-url", "abc.trycloudflare.com/mcp"])
    assert result.exit_code == 2 and "https://abc.trycloudflare.com" in result.output


def test_write_claude_desktop_keeps_other_servers_and_a_backup(tmp_path, monkeypatch):
    config = tmp_path / "Claude" / "claude_desktop_config.json"
    config.parent.mkdir()
    original = {"mcpServers": {"github": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-github"]},
                               "files": {"command": "/usr/bin/mcp-files", "env": {"ROOT": "/srv"}}},
                "globalShortcut": "Ctrl+Space"}
    config.write_text(json.dumps(original, indent=2))
    monkeypatch.setenv("CLAUDE_DESKTOP_CONFIG", str(config))
    result = CliRunner().invoke(tasks_cli.cli, ["connect", "--write-claude-desktop"])
    assert result.exit_code == 0, result.output
    merged = json.loads(config.read_text())
    assert merged["mcpServers"]["github"] == original["mcpServers"]["github"]
    assert merged["mcpServers"]["files"] == original["mcpServers"]["files"]
    assert merged["globalShortcut"] == "Ctrl+Space"
    assert merged["mcpServers"]["taskbridge"]["args"] == [str(ROOT / "opencode_bridge_mcp.py")]
    backups = list(config.parent.glob("claude_desktop_config.json.bak-*"))
    assert len(backups) == 1 and json.loads(backups[0].read_text()) == original


def test_write_claude_desktop_leaves_a_broken_config_alone(tmp_path, monkeypatch):
    config = tmp_path / "claude_desktop_config.json"
    config.write_text('{"mcpServers": {"github": ')
    monkeypatch.setenv("CLAUDE_DESKTOP_CONFIG", str(config))
    result = CliRunner().invoke(tasks_cli.cli, ["connect", "--write-claude-desktop"])
    assert result.exit_code == 1 and "is not valid JSON" in result.output
    assert config.read_text() == '{"mcpServers": {"github": ' and list(tmp_path.glob("*.bak-*")) == []


# --------------------------------------------------------------------------------------------
# The token.


def test_token_is_made_once_private_and_rotated_on_request(tmp_path, monkeypatch):
    token_file = tmp_path / "state" / "token"
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token_file))
    first, how = serve.ensure_token()
    assert how == "new" and len(first) >= 40 and mode(token_file) == 0o600 and mode(token_file.parent) == 0o700
    assert serve.ensure_token() == (first, "kept")
    second, how = serve.ensure_token(rotate=True)
    assert how == "rotated" and second != first and token_file.read_text().strip() == second


def test_a_token_file_readable_by_others_is_made_private_and_said(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("abc-token\n")
    token_file.chmod(0o644)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token_file))
    result = run_script("serve.py", "--setup-only", "--quiet", env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "was readable by others; made it 0600" in result.stderr and mode(token_file) == 0o600


def test_rotation_refused_while_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MCP_BEARER_TOKEN", "from-env")
    with pytest.raises(serve.SetupError, match="MCP_BEARER_TOKEN is set"):
        serve.ensure_token(rotate=True)


# --------------------------------------------------------------------------------------------
# File modes: folders 0700, files 0600; checked against another local user.


def test_queue_files_token_and_logs_are_private(monkeypatch):
    other = normal_user()   # a non-root user to read as (created when missing, as root in CI)
    if other is None:
        pytest.skip("needs root to read as another user")
    user = other.pw_name
    if not shutil.which("runuser"):
        pytest.skip("needs runuser to read as another user")
    # A folder every user can enter, so only the modes set by TaskBridge stand in the way.
    root = Path(tempfile.mkdtemp(prefix="tb-modes-"))
    try:
        root.chmod(0o755)
        monkeypatch.setenv("TASK_DB_PATH", str(root / "tasks.db"))
        monkeypatch.setenv("TASK_LOG_DIR", str(root / "task_logs"))
        monkeypatch.setenv("MCP_TOKEN_FILE", str(root / ".taskbridge" / "token"))
        serve.ensure_token()
        (root / "project").mkdir()   # the queue's own folder is no working_dir
        task = task_store.submit_task(title="secret plan", instructions="the secret", working_dir=str(root / "project"))
        with task_store.open_task_log(task["id"]) as log:
            log.write(b"secret output\n")
        task_store.write_worker_heartbeat({"state": "idle"})
        worker_talk.write_log_line("t_0001 claimed: secret plan")
        held = task_store.connect()   # the WAL files exist while a connection is open
        held.execute("SELECT count(*) FROM tasks").fetchone()
        assert mode(root / ".taskbridge") == 0o700 and mode(root / ".taskbridge" / "token") == 0o600
        assert mode(root / "tasks.db") == 0o600 and mode(root / "tasks.db-wal") == 0o600 \
            and mode(root / "tasks.db-shm") == 0o600
        assert mode(root / "task_logs") == 0o700 and mode(root / "task_logs" / "t_0001.log") == 0o600
        assert mode(root / "tasks.worker.json") == 0o600 and mode(root / "tasks.worker.log") == 0o600
        for path in (
            "tasks.db",
            "tasks.db-wal",
            "tasks.db-shm",
            ".taskbridge/token",
            "task_logs/t_0001.log",
            "tasks.worker.json",
            "tasks.worker.log",
        ):
            read = subprocess.run(
                ["runuser", "-u", user, "--", "cat", str(root / path)], capture_output=True, text=True
            )
            assert read.returncode != 0 and "Permission denied" in read.stderr, (path, read)
        held.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_setup_tightens_an_older_install_that_left_files_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "tb" / "token"))
    task = task_store.submit_task(title="t", instructions="i", working_dir=str(tmp_path))
    log = task_store.log_path(task["id"])
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("old log\n")
    for path, old in ((task_store.db_path(), 0o644), (log, 0o644), (log.parent, 0o755)):
        path.chmod(old)
    result = run_script("serve.py", "--setup-only", "--quiet", env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert mode(task_store.db_path()) == 0o600 and mode(log) == 0o600 and mode(log.parent) == 0o700
    assert f"made {task_store.db_path()} private" in result.stderr


# --------------------------------------------------------------------------------------------
# A worker started by a scheduler with a bare environment.


def test_worker_with_a_bare_environment_and_opencode_elsewhere_says_so_and_claims_nothing(tmp_path):
    # A copy of the code without node_modules/: opencode is installed elsewhere (as with
    # `npm install -g` into ~/.npm-global), which PATH=/usr/bin:/bin does not reach.
    code = tmp_path / "code"
    code.mkdir()
    for source in ROOT.glob("*.py"):
        shutil.copy2(source, code / source.name)
    db = tmp_path / "q" / "tasks.db"
    task = task_store.submit_task(title="t", instructions="do it", working_dir=str(tmp_path))
    assert Path(os.environ["TASK_DB_PATH"]) == db
    if shutil.which("opencode", path="/usr/bin:/bin"):
        pytest.skip("opencode is installed in /usr/bin or /bin here")
    result = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", f"TASK_DB_PATH={db}", "WORKER_NOTIFY=0",
                             f"HOME={tmp_path}", sys.executable, str(code / "worker.py")],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result
    assert "opencode" in result.stderr and "OPENCODE_BIN" in result.stderr and "PATH=/usr/bin:/bin" in result.stderr
    assert "Traceback" not in result.stderr
    after = task_store.get_task(task["id"])
    assert after["status"] == "pending" and after["attempts"] == 0


# --------------------------------------------------------------------------------------------
# install.sh's prerequisite check.


def sandbox_path(tmp_path: Path, python: str | None) -> str:
    """A PATH holding only what install.sh needs to run its checks (no git, no node, no npm)."""
    bins = tmp_path / "bins"
    bins.mkdir()
    for tool in ("bash", "dirname", "uname", "head", "sed", "cat", "ls"):
        os.symlink(shutil.which(tool), bins / tool)
    if python:
        os.symlink(python, bins / "python3")
    return str(bins)


def checkout_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    copy.mkdir()
    shutil.copy2(ROOT / "install.sh", copy / "install.sh")
    (copy / "worker.py").write_text("")
    return copy


def test_install_names_every_missing_prerequisite_with_the_way_to_get_it(tmp_path):
    copy = checkout_copy(tmp_path)
    env = {"PATH": sandbox_path(tmp_path, sys.executable), "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(copy / "install.sh"), "--setup-only"], env=env, capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result
    assert "install.sh: missing:" in result.stderr
    assert "git; " in result.stderr and "sudo apt install git" in result.stderr
    assert "Node.js >= 20 and npm" in result.stderr and "https://nodejs.org/en/download" in result.stderr
    assert "Python" not in result.stderr.split("missing:")[1], "a Python >= 3.11 was found"
    assert not (copy / ".venv").exists()


def test_install_says_how_to_get_a_new_enough_python(tmp_path):
    old = fake_binary(tmp_path, "python3.9", "[ \"$1\" = --version ] && { echo 'Python 3.9.18'; exit 0; }\nexit 1\n")
    copy = checkout_copy(tmp_path)
    env = {"PATH": sandbox_path(tmp_path, str(old)), "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(copy / "install.sh")], env=env, capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert "Python >= 3.11 (found: Python 3.9.18)" in result.stderr
    assert "python3.11" in result.stderr and "PYTHON=/path/to/python3.12 ./install.sh" in result.stderr


def test_the_claude_skill_is_a_valid_skill_folder_and_connect_names_it():
    skill = connectors.REPO / "skills" / "taskbridge" / "SKILL.md"
    text = skill.read_text()
    front = text.split("---\n")[1]
    assert "name: taskbridge\n" in front and "description: Use when" in front
    for tool in ("submit_task", "continue_from", "fork_from", "wait_for", "apply_task", "get_task_result",
                 "get_task_transcript", "add_task_note", "answer_task"):
        assert tool in text, tool
    result = CliRunner().invoke(tasks_cli.cli, ["connect"])
    assert result.exit_code == 0 and str(skill.parent) in result.output and "~/.claude/skills/" in result.output


@pytest.mark.real_claude
def test_the_real_claude_code_takes_both_printed_lines_for_every_project(tmp_path, monkeypatch):
    """The printed `claude mcp add -s user` lines, run by the real claude CLI, register TaskBridge in
    the user's config; from another folder `claude mcp list` starts the stdio server on the connect-time
    queue and reaches the HTTP one with the token, both connected."""
    from helpers import free_port, serving
    claude = ROOT / "node_modules" / ".bin" / "claude"
    if not claude.exists():
        pytest.skip("the claude CLI is not installed (npm install)")
    token = tmp_path / "tb" / "token"
    token.parent.mkdir()
    token.write_text("claude-code-seat-token-0123456789\n")
    monkeypatch.setenv("MCP_TOKEN_FILE", str(token))
    monkeypatch.delenv("MCP_BEARER_TOKEN", raising=False)
    port = free_port()
    out = CliRunner().invoke(tasks_cli.cli, ["connect", "--port", str(port)]).output
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("claude mcp add -s user")]
    assert len(lines) == 2
    env = dict(os.environ, HOME=str(tmp_path / "home"), PATH=f"{claude.parent}:{os.environ['PATH']}")
    (tmp_path / "home").mkdir()
    for folder, line in zip(("one", "two"), lines, strict=True):
        (tmp_path / folder).mkdir()
        http = line.replace("taskbridge", "taskbridge-http", 1) if "--transport http" in line else line
        added = subprocess.run(["bash", "-c", http], cwd=tmp_path / folder, env=env, capture_output=True, text=True,
                               timeout=60, stdin=subprocess.DEVNULL)
        assert added.returncode == 0 and "to user config" in added.stdout, added.stdout + added.stderr
    (tmp_path / "elsewhere").mkdir()
    with serving(port):
        listed = subprocess.run([str(claude), "mcp", "list"], cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                                text=True, timeout=120, stdin=subprocess.DEVNULL)
    rows = {line.split(":", 1)[0]: line for line in listed.stdout.splitlines() if line.startswith("taskbridge")}
    assert f"--db {os.environ['TASK_DB_PATH']}" in rows["taskbridge"], listed.stdout
    assert "Connected" in rows["taskbridge"] and "Connected" in rows["taskbridge-http"], listed.stdout + listed.stderr
