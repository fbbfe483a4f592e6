"""The reverse bridge for a boxed agent: claude_control_mcp.py runs outside the agent's box, and
the run's OpenCode reaches it over loopback HTTP.

Used by ``worker.py`` only: ``reverse_bridge_env(env)`` when it builds a run's environment.
When the OpenCode config registers the reverse bridge (the local entry
``claude_control_mcp.py --register-opencode`` writes under ``claude-control``, found by reading
the global config and the ``OPENCODE_CONFIG`` file, not by asking OpenCode), the worker starts
one ``claude_control_mcp.py --transport streamable-http`` of its own on 127.0.0.1, lazily, once
per worker process, with a fresh random bearer token (never the queue's MCP token). It holds the
worker's whole environment (the API key, the queue); the run gets only the entry that points
OpenCode at it, through ``OPENCODE_CONFIG_CONTENT``, and no ``ANTHROPIC_API_KEY`` /
``ANTHROPIC_AUTH_TOKEN`` (unless the run's own model is an ``anthropic/`` one, which needs it).

The token is in the run's environment, so the agent can read it: it grants the reverse bridge's
six tools, which the agent has through MCP anyway, and nothing of the queue's.

The server is the worker's child in a process group of its own; its stdin is a pipe only the
worker holds: it stops when the worker exits (atexit closes the pipe, then ends its tree) or dies
(the pipe's end is its cue, whatever killed the worker). Its stderr goes to
``store.state_path("reverse-bridge.log")``, beside the queue (outside the box).

Env read at call time: the run env's ``XDG_CONFIG_HOME`` / ``HOME``, ``OPENCODE_CONFIG`` and
``OPENCODE_CONFIG_CONTENT``; the worker's own environment is what the server inherits.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import opencode_runner as oc
import process_tree
import task_store as store

SERVER_NAME = "claude-control"      # claude_control_mcp.SERVER_NAME (importing it costs ~1 s)
SCRIPT = Path(__file__).resolve().parent / "claude_control_mcp.py"
WITHHELD = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")   # the bridge's credentials, not the agent's
RUN_TAGS = (oc.MARKER_ENV, oc.QUEUE_ENV)   # a server carrying a run's tag would be swept with that run
START_SEC = 30.0          # for the server to answer /health (its imports take seconds on a loaded machine)
RETRY_AFTER_SEC = 300.0   # a server that failed to start is tried again after this long, not every run
STOP_GRACE_SEC = 5.0      # after its stdin closes, before its tree is killed

_lock = threading.Lock()
_state: dict[str, Any] = {"server": None, "failed_at": None, "problem": None}


class BridgeUnavailable(Exception):
    """The reverse bridge's server could not be started; ``str()`` is one line that says why."""


class BridgeServer:
    """One running reverse-bridge server: its process, its port on 127.0.0.1 and its token."""

    def __init__(self, proc: subprocess.Popen, port: int, token: str) -> None:
        self.proc, self.port, self.token = proc, port, token

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Close its stdin (it shuts down, ending its jobs as interrupted); its whole tree is
        killed if it is still there after STOP_GRACE_SEC."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(STOP_GRACE_SEC)
        except subprocess.TimeoutExpired:
            pass
        process_tree.kill_tree(self.proc.pid, 2.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(2.0)


def reverse_bridge_env(env: dict[str, str], model: str | None = None,
                       say: Callable[[str], None] | None = None) -> dict[str, str]:
    """The run's environment ``env`` pointed at this worker's reverse-bridge server, when the
    OpenCode config ``env`` selects registers the reverse bridge (see `registered`); otherwise
    ``env`` itself, unchanged.

    ``model``: the run's ``provider/model``; an ``anthropic/`` model keeps ``ANTHROPIC_API_KEY``
    (its provider needs it). ``say``: called with one line when the server cannot be started
    (the run then goes on without the reverse bridge). Returns a new dict; never raises for a
    server that fails (a broken ``OPENCODE_CONFIG_CONTENT`` raises oc.ConfigProblem).
    """
    if not registered(env):
        return env
    out = {k: v for k, v in env.items() if k not in WITHHELD or _provider_needs(k, model)}
    try:
        server = running_server()
    except BridgeUnavailable as exc:
        if say is not None:
            say(f"the reverse bridge (claude_ask) is off for this run: {exc}")
        return _disabled(out)
    content = oc._config_content(out)
    listed = content.get("mcp")
    servers = listed if isinstance(listed, dict) else {}
    content["mcp"] = {**servers, SERVER_NAME: {"type": "remote", "url": server.url, "enabled": True,
                                               "headers": {"Authorization": f"Bearer {server.token}"}}}
    out["OPENCODE_CONFIG_CONTENT"] = json.dumps(content)
    return out


def _provider_needs(name: str, model: str | None) -> bool:
    return name == "ANTHROPIC_API_KEY" and (model or "").startswith("anthropic/")


def _disabled(env: dict[str, str]) -> dict[str, str]:
    # Without this OpenCode would start the local entry inside the box, where it has neither the
    # key nor the queue: every claude_* call would fail, later and less clearly.
    content = oc._config_content(env)
    listed = content.get("mcp")
    servers = listed if isinstance(listed, dict) else {}
    content["mcp"] = {**servers, SERVER_NAME: {"enabled": False}}
    return {**env, "OPENCODE_CONFIG_CONTENT": json.dumps(content)}


def registered(env: dict[str, str]) -> bool:
    """Whether the OpenCode config of ``env`` registers the reverse bridge as a local server:
    ``mcp.claude-control`` in ``$XDG_CONFIG_HOME/opencode/opencode.json[c]`` (``~/.config``
    without XDG_CONFIG_HOME) or the ``OPENCODE_CONFIG`` file, the later file winning key by key,
    not disabled by ``OPENCODE_CONFIG_CONTENT``. A file that cannot be read counts as absent."""
    folder = oc.config_dir(env)
    files = [folder / "opencode.json", folder / "opencode.jsonc"]
    if env.get("OPENCODE_CONFIG"):
        files.append(Path(env["OPENCODE_CONFIG"]))
    entry: dict[str, Any] = {}
    for path in files:
        entry.update(_entry(_read(path)))
    if entry.get("type") != "local" or entry.get("enabled") is False:
        return False
    return _entry(oc._config_content(env)).get("enabled") is not False


def _read(path: Path) -> Any:
    try:
        return oc.loads_jsonc(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _entry(config: Any) -> dict[str, Any]:
    servers = config.get("mcp") if isinstance(config, dict) else None
    entry = servers.get(SERVER_NAME) if isinstance(servers, dict) else None
    return entry if isinstance(entry, dict) else {}


def running_server() -> BridgeServer:
    """This worker process's server, started on first use (and again if it died). Raises
    BridgeUnavailable with the reason when it cannot start; a failed start is not tried again for
    RETRY_AFTER_SEC (the same reason is raised meanwhile)."""
    with _lock:
        server = _state["server"]
        if server is not None and server.alive():
            return server
        failed_at = _state["failed_at"]
        if failed_at is not None and time.monotonic() - failed_at < RETRY_AFTER_SEC:
            raise BridgeUnavailable(_state["problem"])
        try:
            server = start_server()
        except BridgeUnavailable as exc:
            _state.update(server=None, failed_at=time.monotonic(), problem=str(exc))
            raise
        if not _state.get("atexit"):
            atexit.register(stop_server)
            _state["atexit"] = True
        _state.update(server=server, failed_at=None, problem=None)
        return server


def stop_server() -> None:
    """Stop this process's server, if one runs (atexit calls it; safe to call twice)."""
    with _lock:
        server, _state["server"] = _state["server"], None
    if server is not None:
        server.stop()


def start_server(start_sec: float = START_SEC) -> BridgeServer:
    """Start ``claude_control_mcp.py --transport streamable-http`` on a listening socket bound
    here to a free 127.0.0.1 port (handed over, so no other process can take the port between
    the choice and the bind), with the worker's environment minus any run tag, and wait up to
    ``start_sec`` seconds for its ``/health``. Raises BridgeUnavailable naming the server's own
    last stderr line (or the wait) when it does not answer."""
    import secrets  # here and in _wait_healthy: a worker that never starts the bridge loads no ssl

    token = secrets.token_urlsafe(32)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    errors = store.state_path("reverse-bridge.log")
    try:
        errors.parent.mkdir(parents=True, exist_ok=True)
        seen = errors.stat().st_size if errors.exists() else 0
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in RUN_TAGS}
        with open(errors, "ab") as log:
            proc = subprocess.Popen([sys.executable, str(SCRIPT), "--transport", "streamable-http",
                                     "--listen-fd", str(listener.fileno())],
                                    pass_fds=(listener.fileno(),), stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    except OSError as exc:
        raise BridgeUnavailable(f"cannot start {SCRIPT.name}: {exc}") from None
    finally:
        listener.close()
    server = BridgeServer(proc, port, token)
    assert proc.stdin is not None   # stdin=PIPE above
    try:
        proc.stdin.write(f"{token}\n".encode())
        proc.stdin.flush()
    except OSError:
        pass   # it died already: _wait_healthy names why
    _wait_healthy(server, start_sec, errors, seen)
    return server


def _wait_healthy(server: BridgeServer, start_sec: float, errors: Path, seen: int) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + start_sec
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never through an http_proxy
    while time.monotonic() < deadline:
        if not server.alive():
            raise BridgeUnavailable(f"{SCRIPT.name} exited {server.proc.returncode}: {_last_line(errors, seen)}")
        try:
            with direct.open(f"http://127.0.0.1:{server.port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    server.stop()
    raise BridgeUnavailable(f"{SCRIPT.name} did not answer within {start_sec:.0f} s (its log: {errors})")


def _last_line(path: Path, seen: int) -> str:
    """The last line the server wrote to its log past byte ``seen`` (what this start said)."""
    try:
        with open(path, "rb") as log:
            log.seek(seen)
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1][-300:] if lines else f"no message (its log: {path})"
