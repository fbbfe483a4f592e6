"""What each MCP client needs to reach TaskBridge: the set-up snippets, and the merge of our entry
into Claude Desktop's config file.

    .venv/bin/python tasks_cli.py connect [--port 8765] [--public-url URL] [--write-claude-desktop]

(``./install.sh`` prints the same snippets.) Every path in a snippet is absolute: Claude Desktop
and OpenCode start servers with a bare environment and an unknown working directory.

Env read at call time: CLAUDE_DESKTOP_CONFIG (the config file to merge into; default: macOS
``~/Library/Application Support/Claude/claude_desktop_config.json``, elsewhere
``$XDG_CONFIG_HOME/Claude/claude_desktop_config.json``), MCP_TOKEN_FILE, TASK_DB_PATH,
TASK_DB_URL (a PostgreSQL queue is written into snippets without its password), OPENCODE_BIN
(through task_store / opencode_runner).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import knobs
import opencode_runner
import task_store

REPO = Path(__file__).resolve().parent
SERVER_KEY = "taskbridge"


def python_path() -> str:
    """The virtualenv's interpreter (not resolved: a venv's python is a symlink whose target
    lacks the venv's packages), else the running interpreter."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else os.path.abspath(sys.executable)


def token_file() -> Path:
    """``$MCP_TOKEN_FILE`` or ``<repo>/.taskbridge/token`` (where install.sh keeps the token)."""
    return Path(os.environ.get("MCP_TOKEN_FILE") or REPO / ".taskbridge" / "token").expanduser().absolute()


def public_url_file() -> Path:
    """Where a serving ``serve.py`` notes its public URL (removed when it stops)."""
    return token_file().parent / "public_url"


def current_public_url() -> str | None:
    """The public ``https://host`` of the public mode running now, if any."""
    try:
        return public_url_file().read_text().strip() or None
    except OSError:
        return None


def claude_desktop_entry() -> dict[str, Any]:
    """Our ``mcpServers`` entry for Claude Desktop: stdio, absolute paths, the queue's database and
    the opencode binary (list_models needs it; Claude Desktop's PATH is bare). A PostgreSQL URL
    goes in without its password (libpq reads it from ~/.pgpass): a config file never holds one."""
    env = {"TASK_DB_PATH": str(task_store.db_path())}
    if task_store.backend() == "postgresql":
        env["TASK_DB_URL"] = task_store.database_label()
    try:
        env["OPENCODE_BIN"] = opencode_runner.opencode_bin()
    except opencode_runner.OpencodeNotFound:
        pass
    return {"command": python_path(), "args": [str(REPO / "opencode_bridge_mcp.py")], "env": env}


def opencode_entry() -> dict[str, Any]:
    """The reverse bridge as an OpenCode local MCP server (what ``claude_control_mcp.py
    --register-opencode`` merges into OpenCode's config)."""
    return {"type": "local", "command": [python_path(), str(REPO / "claude_control_mcp.py")], "enabled": True}


def queue_arg() -> str:
    """What ``--db`` names for a stdio server: the SQLite file (absolute), or the PostgreSQL URL
    without its password (libpq reads it from ~/.pgpass)."""
    return task_store.database_label() if task_store.backend() == "postgresql" else str(task_store.db_path())


def _stdio_argv() -> list[str]:
    # --db rather than an env flag: `claude mcp add -e K=V name` swallows the name (-e is
    # variadic), and a server started from another folder must still open this queue.
    return [python_path(), str(REPO / "opencode_bridge_mcp.py"), "--db", queue_arg()]


def _local_clients(port: int) -> list[str]:
    """Claude Desktop, Claude Code, Cursor and VS Code: stdio, every path absolute."""
    argv = _stdio_argv()
    stdio = {"command": argv[0], "args": argv[1:]}
    url, header = f"http://127.0.0.1:{port}/mcp", f'"Authorization: Bearer $(cat {shlex.quote(str(token_file()))})"'
    desktop = json.dumps({"mcpServers": {SERVER_KEY: claude_desktop_entry()}}, indent=2)
    return [
        f"Claude Desktop (stdio): merge into {claude_desktop_config()} "
        f"(or run: {task_store.script_command('tasks_cli.py', 'connect', '--write-claude-desktop')})",
        desktop, "",
        "Claude Code, stdio, for every project (user scope):",
        f"  claude mcp add -s user {SERVER_KEY} -- {shlex.join(argv)}",
        f"Claude Code, HTTP (while ./install.sh serves on port {port}):",
        f"  claude mcp add -s user --transport http {SERVER_KEY} {url} --header {header}",
        "Claude Code, the skill that teaches when and how to delegate (briefs, follow-ups, forks, receipts):",
        f"  mkdir -p ~/.claude/skills && cp -r {shlex.quote(str(REPO / 'skills' / 'taskbridge'))} ~/.claude/skills/",
        "",
        "Cursor: merge into ~/.cursor/mcp.json:",
        json.dumps({"mcpServers": {SERVER_KEY: stdio}}, indent=2), "",
        "VS Code (user profile):",
        f"  code --add-mcp {shlex.quote(json.dumps({'name': SERVER_KEY, 'type': 'stdio'} | stdio))}", "",
    ]


def _http_clients(port: int) -> list[str]:
    """Codex CLI, Gemini CLI and OpenCode as the planner: HTTP with the bearer token."""
    url, token = f"http://127.0.0.1:{port}/mcp", token_file()
    header = f'"Authorization: Bearer $(cat {shlex.quote(str(token))})"'
    planner = {"type": "remote", "url": url, "enabled": True,
               "headers": {"Authorization": f"Bearer {{file:{token}}}"}}
    return [
        f"Codex CLI (HTTP, while ./install.sh serves on port {port}; the token from the environment):",
        f"  export TASKBRIDGE_TOKEN=\"$(cat {shlex.quote(str(token))})\"   # in your shell profile",
        f"  codex mcp add {SERVER_KEY} --url {url} --bearer-token-env-var TASKBRIDGE_TOKEN",
        "Gemini CLI (HTTP):",
        f"  gemini mcp add -s user --transport http {SERVER_KEY} {url} --header {header}", "",
        "OpenCode as the planner (it queues tasks here): merge into ~/.config/opencode/opencode.json:",
        json.dumps({"mcp": {SERVER_KEY: planner}}, indent=2),
        "OpenCode, the reverse bridge (agents ask Claude); merge into ~/.config/opencode/opencode.json "
        f"(or run: {task_store.script_command('claude_control_mcp.py', '--register-opencode')}):",
        json.dumps({"mcp": {"claude-control": opencode_entry()}}, indent=2), "",
    ]


def _remote_clients(public_url: str | None) -> list[str]:
    """claude.ai and ChatGPT: a public https URL and OAuth (the consent page asks for the token)."""
    if not public_url:
        return ["claude.ai / ChatGPT: need a public URL: ./install.sh --tunnel cloudflare (or ngrok), "
                "then use https://<host>/mcp"]
    url = f"{public_url.rstrip('/')}/mcp"
    return [f"claude.ai: Settings → Connectors → Add custom connector; URL {url}",
            f"ChatGPT: Settings → Apps → Advanced settings → Developer mode (on) → Create app; URL {url}, "
            "authentication OAuth",
            "  (the consent page asks for the bearer token once)"]


def snippets(port: int = 8765, public_url: str | None = None) -> str:
    """Every client's set-up as text to print (``port`` the local HTTP port; ``public_url`` the
    tunnel's ``https://host``, default that of the public mode running now, if any): Claude
    Desktop, Claude Code (user scope, stdio and HTTP), Cursor, VS Code, Codex CLI, Gemini CLI,
    OpenCode as the planner and its reverse bridge, claude.ai and ChatGPT. The stdio commands name
    the queue with --db, so a client started anywhere opens the same queue as the CLI."""
    return "\n".join([*_local_clients(port), *_http_clients(port),
                      *_remote_clients(public_url or current_public_url())])


def claude_desktop_config() -> Path:
    """Claude Desktop's config file: ``$CLAUDE_DESKTOP_CONFIG``, else its per-platform place."""
    if os.environ.get("CLAUDE_DESKTOP_CONFIG"):
        return Path(os.environ["CLAUDE_DESKTOP_CONFIG"]).expanduser()
    if platform.system() == "Darwin":
        return Path.home() / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"
    return knobs.xdg_home("XDG_CONFIG_HOME") / "Claude" / "claude_desktop_config.json"


def write_claude_desktop(path: Path | None = None) -> tuple[Path, Path | None]:
    """Merge our entry into Claude Desktop's config (``mcpServers.taskbridge``), keeping every
    other server and key; the previous file is copied to ``<name>.bak-<UTC time>`` first. Returns
    (the config, the backup or None when there was no file). Raises ValueError, naming the file,
    when it is not a JSON object, and ValueError naming the path and the way out when it cannot
    be read or written (a folder, no permission; nothing is written then)."""
    path = path or claude_desktop_config()
    try:
        return _merge_claude_desktop(path)
    except OSError as exc:
        where = "" if exc.filename in (None, str(path)) else f" ({exc.filename})"
        raise ValueError(f"cannot write Claude Desktop's config {path}{where}: {exc.strerror or exc}; point "
                         "CLAUDE_DESKTOP_CONFIG at the config file itself (claude_desktop_config.json), or "
                         "add the entry printed by `tasks_cli.py connect` by hand") from None


def _merge_claude_desktop(path: Path) -> tuple[Path, Path | None]:
    config: dict[str, Any] = {}
    backup = None
    if path.is_dir():
        raise IsADirectoryError(21, "it is a folder, not a file", str(path))
    if path.exists():
        try:
            config = json.loads(path.read_text() or "{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); fix it, or add the entry printed by "
                             "`tasks_cli.py connect` by hand") from None
        if not isinstance(config, dict) or not isinstance(config.get("mcpServers", {}), dict):
            raise ValueError(f"{path}: expected a JSON object whose \"mcpServers\" is an object; fix it by hand")
        backup = path.with_name(f"{path.name}.bak-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        shutil.copy2(path, backup)
    config.setdefault("mcpServers", {})[SERVER_KEY] = claude_desktop_entry()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
    return path, backup
