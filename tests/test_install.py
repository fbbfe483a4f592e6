"""From nothing to a served, connected TaskBridge: the one-line installer piped into bash, public
mode behind a tunnel, the token's life, the README's first Quick start command in a fresh clone.

No tunnel can run offline here, so stand-in `cloudflared` and `ngrok` executables first on PATH
print the lines the real ones print (cloudflared's quick-tunnel banner on stderr, ngrok's logfmt
`started tunnel ... url=https://...`) and then wait; they record their arguments. Everything
else is real: bash runs install.sh from a pipe, git clones a local repository, pip fills a new
virtualenv, the real server, worker and opencode (against the scripted model) serve and run.
Each install creates a virtualenv (~20 s with pip's cache): marked `install`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import anyio
import httpx2
import psutil
import pytest
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Implementation

from fake_openai import text
from helpers import GIT_ID, ROOT, call_tool, fake_binary, free_port, make_repo

pytestmark = pytest.mark.install

CLOUDFLARE_HOST = "quiet-river-42.trycloudflare.com"
NGROK_DOMAIN = "taskbridge-test.ngrok-free.app"
# pip's cache of the real HOME (read before any fixture moves HOME): a new virtualenv without
# downloading every wheel again.
PIP_CACHE = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")


def source_repo(dest: Path) -> Path:
    """A local git repository holding this checkout's tracked files as they are on disk now (so
    uncommitted work is what gets installed), one commit on main."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dest, check=True)
    subprocess.run(["git", *GIT_ID, "add", "-A"], cwd=dest, check=True)
    subprocess.run(["git", *GIT_ID, "commit", "-q", "-m", "snapshot"], cwd=dest, check=True)
    return dest


def stand_in_tunnels(bin_dir: Path, calls: Path) -> None:
    fake_binary(
        bin_dir,
        "cloudflared",
        f'echo "cloudflared $*" >> {calls}\n'
        "echo '2026-11-30T10:00:00Z INF Requesting new quick Tunnel on trycloudflare.com...' >&2\n"
        "echo '2026-11-30T10:00:01Z INF +----------------------------------------------"
        "----------------------------------------------+' >&2\n"
        "echo '2026-11-30T10:00:01Z INF |  Your quick Tunnel has been created! "
        "Visit it at (it may take some time to be reachable):  |' >&2\n"
        f"echo '2026-11-30T10:00:01Z INF |  https://{CLOUDFLARE_HOST}                                          |' >&2\n"
        "exec sleep 600\n",
    )
    fake_binary(
        bin_dir,
        "ngrok",
        f'echo "ngrok $*" >> {calls}\n'
        "url=https://random-words-1234.ngrok-free.app\n"
        'for a in "$@"; do case "$a" in --domain=*) url="https://${a#--domain=}" ;; esac; done\n'
        "echo 't=2026-11-30T10:00:00+0000 lvl=info msg=\"starting web service\" obj=web addr=127.0.0.1:4040'\n"
        'echo "t=2026-11-30T10:00:01+0000 lvl=info msg=\\"started tunnel\\" obj=tunnels name=command_line '
        'addr=http://127.0.0.1:8765 url=$url"\n'
        "exec sleep 600\n",
    )


class Served:
    """A running `install.sh` (or start_public.sh): its stderr collected by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output)
            if found:
                return found
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in {timeout} s:\n{self.output}")

    def ctrl_c(self, timeout: float = 60) -> int:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout)


def leftovers(mark: str) -> list[psutil.Process]:
    """Live processes whose environment carries this test's mark (every child inherits it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TB_INSTALL_TEST") == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def no_leftovers(mark: str) -> None:
    deadline = time.monotonic() + 10
    while leftovers(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(mark) == [], [p.cmdline() for p in leftovers(mark)]


def install_env(home: Path, bins: Path, port: int, mark: str, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base or os.environ)
    env.update({
        "HOME": str(home), "PORT": str(port), "TB_INSTALL_TEST": mark,
        "PATH": f"{bins}:{env.get('PATH', '/usr/bin:/bin')}",
        "PIP_CACHE_DIR": PIP_CACHE,
    })
    # The pinned opencode this checkout's tests use: install.sh then skips npm (no 100 MB download).
    pinned = ROOT / "node_modules" / ".bin" / "opencode"
    if "OPENCODE_BIN" not in env and pinned.exists():
        env["OPENCODE_BIN"] = str(pinned)
    for key in ("MCP_BEARER_TOKEN", "MCP_TOKEN_FILE", "TUNNEL_BIN", "TUNNEL_HOST", "MCP_ALLOWED_HOSTS"):
        env.pop(key, None)
    return env


async def mcp_ping(port: int, host: str, token: str) -> dict:
    headers = {"Host": host, "Authorization": f"Bearer {token}"}
    transport = streamable_http_client(f"http://127.0.0.1:{port}/mcp",
                                       http_client=httpx2.AsyncClient(headers=headers, timeout=30))
    async with Client(transport, mode="legacy", client_info=Implementation(name="claude-ai", version="1")) as c:
        return await call_tool(c, "ping")


async def sse_ping(port: int, token: str) -> dict:
    streams = sse_client(f"http://127.0.0.1:{port}/sse", headers={"Authorization": f"Bearer {token}"})
    async with Client(streams, mode="legacy", client_info=Implementation(name="openai-mcp", version="1")) as c:
        return await call_tool(c, "ping")


def status_of(port: int, path: str, host: str, token: str | None) -> int:
    headers = {"Host": host} | ({"Authorization": f"Bearer {token}"} if token else {})
    return httpx2.get(f"http://127.0.0.1:{port}{path}", headers=headers, timeout=10).status_code


def test_piped_install_clones_serves_behind_a_tunnel_and_keeps_or_rotates_the_token(tmp_path):
    home, bins, calls, mark = tmp_path / "home", tmp_path / "bin", tmp_path / "tunnel-calls.txt", uuid.uuid4().hex
    home.mkdir()
    stand_in_tunnels(bins, calls)
    src = source_repo(tmp_path / "src")
    target = home / "TaskBridge"
    port = free_port()
    env = install_env(home, bins, port, mark) | {"TASKBRIDGE_REPO": f"file://{src}", "TASKBRIDGE_DIR": str(target)}

    # 1. curl … | bash, from a local file: clones, installs, serves behind the cloudflare stand-in.
    piped = Served(["bash", "-c", f"cat {ROOT / 'install.sh'} | bash -s -- --tunnel cloudflare"], env, tmp_path)
    try:
        piped.wait_for(r"MCP connector URL:.*\n")
        token = (target / ".taskbridge" / "token").read_text().strip()
        assert f"https://{CLOUDFLARE_HOST}/mcp" in piped.output
        assert f"Token:              {token[:3]}…({len(token)} characters)" in piped.output
        assert token not in piped.output, "the box masks the token (its file is named to copy it from)"
        assert (target / ".git").is_dir() and (target / ".venv" / "bin" / "python").exists()
        ping = anyio.run(mcp_ping, port, CLOUDFLARE_HOST, token)
        assert ping["ok"] and ping["caller"]["name"] == "claude-ai"
        assert anyio.run(sse_ping, port, token)["caller"]["name"] == "openai-mcp"
        assert status_of(port, "/health", "evil.example.com", None) == 421
        assert status_of(port, "/api/status", CLOUDFLARE_HOST, None) == 401
        # Remote connectors find the OAuth server at the public URL.
        metadata = httpx2.get(f"http://127.0.0.1:{port}/.well-known/oauth-authorization-server",
                              headers={"Host": CLOUDFLARE_HOST}, timeout=10).json()
        assert metadata["issuer"] == f"https://{CLOUDFLARE_HOST}"
        assert metadata["authorization_endpoint"] == f"https://{CLOUDFLARE_HOST}/authorize"
        connect = subprocess.run([str(target / ".venv" / "bin" / "python"), "tasks_cli.py", "connect"], cwd=target,
                                 env=env, capture_output=True, text=True, timeout=60)
        assert f"URL https://{CLOUDFLARE_HOST}/mcp" in connect.stdout, connect
        assert f'"command": "{target}/.venv/bin/python"' in connect.stdout
    finally:
        assert piped.ctrl_c() == 0, piped.output
    no_leftovers(mark)
    assert not (target / ".taskbridge" / "public_url").exists(), "the public URL note goes with the tunnel"
    assert oct((target / ".taskbridge" / "token").stat().st_mode & 0o777) == "0o600"
    assert oct((target / ".taskbridge").stat().st_mode & 0o777) == "0o700"

    # 2. Again from the clone, with ngrok and a reserved domain: the same token.
    (target / ".ngrok-domain").write_text(NGROK_DOMAIN + "\n")
    again = Served(["./install.sh", "--tunnel", "ngrok"], env, target)
    try:
        again.wait_for(r"MCP connector URL:.*\n")
        assert f"https://{NGROK_DOMAIN}/mcp" in again.output
        assert (target / ".taskbridge" / "token").read_text().strip() == token
        assert anyio.run(mcp_ping, port, NGROK_DOMAIN, token)["ok"]
        assert status_of(port, "/health", CLOUDFLARE_HOST, None) == 421, "the old quick-tunnel host is not paired"
    finally:
        assert again.ctrl_c() == 0, again.output
    no_leftovers(mark)
    ngrok_call = [line for line in calls.read_text().splitlines() if line.startswith("ngrok ")][-1]
    assert "--inspect=false" in ngrok_call and f"--domain={NGROK_DOMAIN}" in ngrok_call

    # 3. --rotate: a new token; the old one gets 401, and the output says who must be updated.
    rotated = Served(["./install.sh", "--rotate", "--tunnel", "none"], env, target)
    try:
        rotated.wait_for(r"Token:\s+\S+")
        new = (target / ".taskbridge" / "token").read_text().strip()
        assert new != token and "Claude Code over HTTP" in rotated.output
        assert status_of(port, "/api/status", "127.0.0.1", token) == 401
        assert status_of(port, "/api/status", "127.0.0.1", new) == 200
        assert "MCP connector URL" not in rotated.output, "never public unless asked"
    finally:
        assert rotated.ctrl_c() == 0, rotated.output
    no_leftovers(mark)

    # 4. --setup-only serves nothing; it prints the snippets and merges Claude Desktop's config.
    desktop = tmp_path / "Claude" / "claude_desktop_config.json"
    setup = subprocess.run(["./install.sh", "--setup-only", "--write-claude-desktop"], cwd=target,
                           env=env | {"CLAUDE_DESKTOP_CONFIG": str(desktop)}, capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL)
    assert setup.returncode == 0, setup.stderr
    assert (
        f"claude mcp add -s user taskbridge -- {target}/.venv/bin/python {target}/opencode_bridge_mcp.py --db "
        in setup.stderr
    )
    entry = json.loads(desktop.read_text())["mcpServers"]["taskbridge"]
    assert entry["args"] == [str(target / "opencode_bridge_mcp.py")]
    assert (target / ".taskbridge" / "token").read_text().strip() == new
    no_leftovers(mark)


def quick_start_first_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()[0]


@pytest.mark.real_opencode
def test_fresh_clone_quick_start_serves_runs_a_task_from_mcp_and_ctrl_c_leaves_nothing(opencode, tmp_path):
    command = quick_start_first_command()
    assert command.startswith("./install.sh"), command
    src = source_repo(tmp_path / "src")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", f"file://{src}", str(clone)], check=True)
    mark, port = uuid.uuid4().hex, free_port()
    env = install_env(Path(opencode.env["HOME"]), tmp_path / "bin", port, mark, base=dict(os.environ))
    repo = make_repo(tmp_path / "project")
    opencode.model.script("qs", [text('Done.\n```json\n{"summary": "quick start ran", "files_touched": [], '
                                      '"tests_run": [], "open_questions": []}\n```')])
    served = Served(["bash", "-c", command], env, clone)
    try:
        served.wait_for(r"Token:\s+\S+")
        token = (clone / ".taskbridge" / "token").read_text().strip()
        board = httpx2.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert board.status_code == 200 and "TaskBridge" in board.text

        async def submit_and_wait() -> dict:
            headers = {"Authorization": f"Bearer {token}"}
            transport = streamable_http_client(f"http://127.0.0.1:{port}/mcp",
                                               http_client=httpx2.AsyncClient(headers=headers, timeout=120))
            async with Client(transport, mode="legacy") as c:
                task = await call_tool(c, "submit_task", {"title": "Quick start", "working_dir": str(repo),
                                                          "instructions": "Say done. SCRIPT:qs"})
                return await call_tool(c, "wait_for", {"task_ids": [task["id"]], "timeout_sec": 120})

        waited = anyio.run(submit_and_wait)
        assert waited["tasks"][0]["status"] == "done", (waited, served.output)
        served.wait_for(r"t_0001 submitted: Quick start")   # serve.py's line for a task queued elsewhere
        served.wait_for(r"t_0001 done in")                   # the worker's own line
    finally:
        assert served.ctrl_c() == 0, served.output
    no_leftovers(mark)
    # What the run created holds task data: this user's only.
    logs = Path(os.environ["TASK_LOG_DIR"])
    assert oct(logs.stat().st_mode & 0o777) == "0o700" and oct((logs / "t_0001.log").stat().st_mode & 0o777) == "0o600"
    assert oct(Path(os.environ["TASK_DB_PATH"]).stat().st_mode & 0o777) == "0o600"
    assert oct((clone / ".taskbridge" / "token").stat().st_mode & 0o777) == "0o600"


def test_installing_the_binaries_leaves_the_tracked_lock_file_as_it_is(tmp_path):
    """install.sh's own npm step (--test: every locked package), run offline from npm's cache on a
    copy of the checkout's package files over this checkout's installed node_modules, must
    install from package-lock.json without rewriting it: a fresh clone stays clean."""
    for name in ("install.sh", "package.json", "package-lock.json"):
        shutil.copy2(ROOT / name, tmp_path / name)
    modules = tmp_path / "node_modules"
    subprocess.run(["cp", "-al", str((ROOT / "node_modules").resolve()), str(modules)], check=True)
    # npm rewrites its hidden lock in place: a copy of its own, so the checkout's is never touched.
    hidden = modules / ".package-lock.json"
    data = hidden.read_bytes()
    hidden.unlink()
    hidden.write_bytes(data)
    functions = (tmp_path / "install.sh").read_text().rsplit('\nmain "$@"', 1)[0]
    (tmp_path / "functions.sh").write_text(functions)
    env = os.environ | {"npm_config_offline": "true", "npm_config_update_notifier": "false"}
    proc = subprocess.run(["bash", "-c", "source ./functions.sh && want_test=1 && install_opencode"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "package-lock.json").read_bytes() == (ROOT / "package-lock.json").read_bytes()
    assert (tmp_path / "node_modules" / ".bin" / "opencode").exists()
