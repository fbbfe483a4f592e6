"""Run TaskBridge in the foreground: the MCP server (streamable-http at /mcp, sse at /sse), the
board and /api on 127.0.0.1, and a worker in --watch beside it; with a tunnel, a public URL in
front. One line per task event; one Ctrl-C stops all of it (a task in hand is handed back to the
queue without spending a retry). A worker that stops by itself is started again (after 5 s,
doubling to 60 s while it keeps stopping at once) while the server and the board serve on; the
server or the tunnel stopping stops everything.

    .venv/bin/python serve.py [--port 8765] [--tunnel none|cloudflare|ngrok|auto] [--rotate] [--db URL]
    .venv/bin/python serve.py --setup-only [--rotate] [--write-claude-desktop]

``./install.sh`` runs it after set-up; ``./start_public.sh`` runs it with a tunnel. Never public
unless asked: without ``--tunnel`` it asks when run in a terminal and serves on loopback otherwise.

The token is made once (``secrets.token_urlsafe(32)``, a 0600 file in a 0700 folder) and reused
on every run; ``--rotate`` replaces it, which also revokes every OAuth token issued to remote
connectors (they are signed with it).

Env: PORT (default 8765); TASK_DB_URL (the queue; ``--db`` sets it, and the children get it from
the environment, never on a command line, which ``ps`` shows); TUNNEL_BIN (the cloudflared or ngrok
executable; default: on PATH); TUNNEL_HOST (the public host of a tunnel or proxy you run yourself:
none is started, and the clients it names are not believed: they all count as one local client);
MCP_TOKEN_FILE / MCP_BEARER_TOKEN (the token); MCP_ALLOWED_HOSTS (kept, the tunnel's host added);
``.ngrok-domain`` in the repository (a reserved ngrok domain). The server's and the worker's own
knobs pass through to them.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import connectors
import knobs
import process_tree
import task_store as store

REPO = Path(__file__).resolve().parent
TUNNEL_WAIT_SEC = 30
HEALTH_WAIT_SEC = 30
STOP_GRACE_SEC = 20
WORKER_RETRY_SEC = 30    # a worker that found the queue's lock taken tries again after this
# A worker that stopped by itself (status not 0) is started again after the first wait, doubled
# after each exit that came within WORKER_SETTLED_SEC of its start, up to the second (seconds).
WORKER_RESTART_SEC = (5, 60)
WORKER_SETTLED_SEC = 60
# The worker prints its own line when it claims and ends a task; these come from elsewhere.
SHOWN_KINDS = ("submitted", "answered", "cancelled", "note")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Quick tunnels print their URL among other https URLs (api.trycloudflare.com in errors).
CLOUDFLARE_URL_RE = re.compile(r"https://(?!api\.)([a-z0-9-]+\.trycloudflare\.com)\b", re.I)
NGROK_URL_RE = re.compile(r"\burl=https://([A-Za-z0-9.-]+)")


class SetupError(Exception):
    """Serving cannot start; the message says what is wrong and the way out."""


def say(message: str) -> None:
    # After SIGHUP the terminal may be gone; a line that cannot be shown must not stop the stopping.
    with contextlib.suppress(OSError, ValueError):
        print(f"==> {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The token and private files.


def token_file() -> Path:
    return connectors.token_file()


def private_folder(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700; an existing folder of ours is made 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, 0o700)


def _tighten(path: Path, mode: int) -> bool:
    """chmod ``path`` to ``mode`` when this user owns it and others could read it; True if changed."""
    try:
        info = path.stat()
    except OSError:
        return False
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077 == 0:
        return False
    path.chmod(mode)
    return True


write_private = store.write_private   # atomic 0600 files: one helper for every private write


def ensure_token(rotate: bool = False) -> tuple[str, str]:
    """The bearer token and what happened: ``"env"`` (MCP_BEARER_TOKEN is used), ``"kept"``,
    ``"new"`` or ``"rotated"``. Raises SetupError for a blank MCP_BEARER_TOKEN, a rotation asked
    while MCP_BEARER_TOKEN is set, or a token file that cannot be read or written."""
    if "MCP_BEARER_TOKEN" in os.environ:
        token = os.environ["MCP_BEARER_TOKEN"].strip()
        if not token:
            raise SetupError("MCP_BEARER_TOKEN is set but blank; unset it (the token file is used) or give a token")
        if rotate:
            raise SetupError("--rotate changes the token file, but MCP_BEARER_TOKEN is set: change that "
                             "variable yourself, or unset it to use the file")
        return token, "env"
    path = token_file()
    try:
        private_folder(path.parent)
        if not rotate and path.is_file() and path.read_text().strip():
            if _tighten(path, 0o600):
                say(f"the token file {path} was readable by others; made it 0600")
            return path.read_text().strip(), "kept"
        existed = path.exists()
        token = secrets.token_urlsafe(32)
        write_private(path, token + "\n")
    except OSError as exc:
        raise SetupError(f"cannot use the token file {path} ({exc.strerror or exc}); fix its folder's "
                         "permissions or point MCP_TOKEN_FILE elsewhere") from None
    return token, "rotated" if rotate and existed else "new"


def rotation_notice(port: int) -> str:
    """Who must be told about a new token."""
    return ("the bearer token was rotated; the old one no longer works, also on a server already running. Update:\n"
            "  - Claude Code over HTTP: claude mcp remove -s user taskbridge, "
            "then the `claude mcp add -s user --transport http` "
            f"line from `tasks_cli.py connect` (port {port})\n"
            "  - any client sending the old Authorization header or ?token=\n"
            "  - claude.ai / ChatGPT connectors: their OAuth tokens are revoked; they ask you to connect again "
            "(the consent page wants the new token)\n"
            "  Claude Desktop and Claude Code over stdio need nothing.")


def tighten_modes() -> list[str]:
    """Folders 0700 and files 0600 for what holds task data: the token's folder, the database
    (and its WAL files, lock and heartbeat), the log folder and its logs. Only paths this user
    owns; returns those changed."""
    changed = []
    db = store.db_path()
    candidates = [(token_file().parent, 0o700), (token_file(), 0o600), (store.log_dir(), 0o700)]
    candidates += [(db.with_name(db.name + suffix), 0o600) for suffix in ("", "-wal", "-shm")]
    state_files = ("worker.json", "worker.lock", "worker.log", "models.json")
    candidates += [(store.state_path(name), 0o600) for name in state_files]
    if store.log_dir().is_dir():
        candidates += [(p, 0o600) for p in store.log_dir().iterdir() if p.is_file()]
    for path, mode in candidates:
        if _tighten(path, mode):
            changed.append(str(path))
    return changed


# --------------------------------------------------------------------------------------------
# Tunnels.


class Tunnel:
    """A tunnel process (own session) whose output is read by a thread: the public host once it
    is printed, and the last lines for error messages."""

    def __init__(self, kind: str, binary: str, port: int) -> None:
        self.kind, self.binary = kind, binary
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self.host: str | None = None
        self.found = threading.Event()
        self.proc = subprocess.Popen(tunnel_argv(kind, binary, port), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", start_new_session=True,
                                     preexec_fn=die_with_parent())
        threading.Thread(target=self._read, daemon=True).start()

    def identity(self) -> str:
        """``pid:start time`` of the tunnel process, for the server's TASKBRIDGE_TUNNEL_PID: only
        connections this process holds may name the client they carry (http_app.client_address)."""
        return f"{self.proc.pid}:{process_tree.start_time(self.proc.pid) or 0}"

    def _read(self) -> None:
        pattern = NGROK_URL_RE if self.kind == "ngrok" else CLOUDFLARE_URL_RE
        if self.proc.stdout is None:   # started with stdout=PIPE in __init__: never, unless that changes
            raise RuntimeError("the tunnel's output is not piped to serve")
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            match = pattern.search(line)
            if match and not self.found.is_set():
                self.host = match.group(1).lower()
                self.found.set()

    def wait_for_host(self, seconds: float, stop: threading.Event) -> str:
        """The public host name; raises SetupError when the tunnel exits, prints none in time, or
        ``stop`` is set (Ctrl-C)."""
        deadline = time.monotonic() + seconds
        while not self.found.wait(0.2):
            if stop.is_set():
                raise SetupError("stopped before the tunnel printed its URL")
            if self.proc.poll() is not None:
                time.sleep(0.2)   # let the reader take the last lines
                raise SetupError(f"the {self.kind} tunnel exited (status {self.proc.returncode}):\n"
                                 + "\n".join(self.lines))
            if time.monotonic() > deadline:
                raise SetupError(f"the {self.kind} tunnel printed no public URL in {seconds:.0f} s; its output:\n"
                                 + "\n".join(self.lines))
        return self.host or ""


def tunnel_argv(kind: str, binary: str, port: int) -> list[str]:
    """argv of a tunnel to ``127.0.0.1:port``. ngrok runs with its request inspector off (it would
    keep every request's headers, the token among them, for any local process to read) and with
    the reserved domain from ``.ngrok-domain`` when that file exists."""
    if kind == "ngrok":
        argv = [binary, "http", f"127.0.0.1:{port}", "--inspect=false", "--log", "stdout", "--log-format", "logfmt"]
        domain = ngrok_domain()
        return argv + ([f"--domain={domain}"] if domain else [])
    return [binary, "tunnel", "--no-autoupdate", "--url", f"http://127.0.0.1:{port}"]


def ngrok_domain() -> str | None:
    path = REPO / ".ngrok-domain"
    if not path.is_file():
        return None
    domain = path.read_text().strip().removeprefix("https://").strip("/")
    return domain or None


INSTALL_HINTS = {
    "cloudflare": "install cloudflared (macOS: brew install cloudflared; Linux: the package from "
                  "https://developers.cloudflare.com/cloudflare-one/connections/connect-networks/downloads/); "
                  "no account is needed for a quick tunnel",
    "ngrok": "install ngrok (https://ngrok.com/download), then `ngrok config add-authtoken <token>` once",
}


def tunnel_binary(kind: str) -> tuple[str, str]:
    """(kind, executable) for ``cloudflare``, ``ngrok`` or ``auto`` (TUNNEL_BIN, else cloudflared,
    else ngrok on PATH). Raises SetupError naming how to install one."""
    given = os.environ.get("TUNNEL_BIN")
    if kind == "auto":
        binary = given or shutil.which("cloudflared") or shutil.which("ngrok")
        if not binary:
            raise SetupError("no tunnel binary: install cloudflared or ngrok, or set TUNNEL_BIN; or run your "
                             f"own tunnel and set TUNNEL_HOST.\n  cloudflared: {INSTALL_HINTS['cloudflare']}\n"
                             f"  ngrok: {INSTALL_HINTS['ngrok']}")
        return ("ngrok" if Path(binary).name.startswith("ngrok") else "cloudflare"), binary
    name = "ngrok" if kind == "ngrok" else "cloudflared"
    binary = given if given and Path(given).name.startswith(name) else shutil.which(name)
    if not binary:
        raise SetupError(f"--tunnel {kind}: {name} is not on PATH; {INSTALL_HINTS[kind]}")
    return kind, binary


def ask_tunnel() -> str:
    """In a terminal: which public mode, if any (default none)."""
    print("Serve on a public URL too (for claude.ai / ChatGPT connectors)?\n"
          "  [n] no, this machine only (default)\n  [c] Cloudflare quick tunnel (no account)\n"
          "  [g] ngrok (your account; a reserved domain from .ngrok-domain)", file=sys.stderr)
    try:
        answer = input("choice [n/c/g]: ").strip().lower()
    except EOFError:
        return "none"
    return {"c": "cloudflare", "g": "ngrok"}.get(answer[:1], "none")


# --------------------------------------------------------------------------------------------
# Serving.


def connector_box(port: int, token: str, host: str | None) -> str:
    """The box printed once everything answers: URLs, the token and how to copy it."""
    local = f"http://127.0.0.1:{port}"
    quoted = store.shell_command(token_file())
    copy = (f"pbcopy < {quoted}" if sys.platform == "darwin"
            else f"xclip -selection clipboard < {quoted}   (or {store.shell_command('cat', token_file())})")
    rows = []
    if host:
        rows += [f"MCP connector URL:  https://{host}/mcp", f"SSE (older clients): https://{host}/sse",
                 f"Board:              https://{host}/",
                 "claude.ai / ChatGPT: add a custom connector with that URL; its sign-in page asks",
                 "                    for the token below once."]
    rows += [f"Local MCP:          {local}/mcp   (sse: {local}/sse)", f"Local board:        {local}/",
             f"Token:              {masked(token)}", "Header clients:     Authorization: Bearer <token>",
             f"Copy the token:     {copy}" if "MCP_BEARER_TOKEN" not in os.environ else
             "Copy the token:     it is $MCP_BEARER_TOKEN",
             f"Client set-up:      {store.script_command('tasks_cli.py', 'connect')}",
             "Stop:               Ctrl-C (server, worker" + (" and tunnel)" if host else ")")]
    rule = "+" + "-" * 86 + "+"
    return "\n".join([rule, *("  " + r for r in rows), rule])


def masked(token: str) -> str:
    """The token as the box shows it: its first three characters and its length (a terminal's
    scrollback and a screen share are not where a secret belongs; the box says how to copy it)."""
    return f"{token[:3]}…({len(token)} characters)"


def port_taken(port: int) -> str | None:
    """Why 127.0.0.1:``port`` cannot be served, in one line with the way out, or None when it is
    free: another TaskBridge (its serve.py's pid) or another program. Asked before anything is
    set up or printed, so a second ./install.sh never prints a box for a server it cannot start."""
    try:
        process_tree.bind_port("127.0.0.1", port).close()
        return None
    except process_tree.AddressInUse as exc:
        holder = exc.holder
    except OSError:
        holder = None
    other = f"./install.sh --port {port + 1} (or PORT={port + 1})"
    if holder is None:
        return f"port {port} on 127.0.0.1 is taken by another program; stop it, or serve on another port: {other}"
    line = " ".join(holder.info["cmdline"] or [])
    if "opencode_bridge_mcp.py" in line:
        pid = _serving_pid(holder)
        # Serving this very queue, another port would be refused too (hold_queue): one serve.py a queue.
        mine = (store.served_by() or ("", 0))[1] == port
        return (f"{'a TaskBridge already serves this queue' if mine else 'another TaskBridge already serves'} on "
                f"127.0.0.1:{port} (serve.py pid {pid}); use that one (board: http://127.0.0.1:{port}/), stop it "
                f"with Ctrl-C in its terminal (or kill {pid}), or "
                + ("serve another queue with --db" if mine else f"serve this one on another port: {other}"))
    return (f"port {port} on 127.0.0.1 is taken by {holder.info['name']} (pid {holder.pid}); "
            f"stop it, or serve on another port: {other}")


def hold_queue(port: int) -> tuple[int | None, str | None]:
    """This queue's serve lock (``<db>.serve.lock`` beside the database, as the worker's): its
    descriptor, held while serving, with ``pid port`` written in it; or (None, why) when another
    serve.py holds it: one line naming that serve.py's pid and port and the way out; (None, None)
    when the lock file cannot be made (a read-only folder). Two serve.py on one queue on two ports
    would run two --watch workers, one of them only retrying the lock."""
    try:
        fd = store.take_lock(store.state_path("serve.lock"))
    except OSError:   # a read-only queue folder: nothing can write the queue twice there; serve unlocked
        return None, None
    if fd is None:
        pid, held_port = store.served_by() or ("?", "?")
        return None, (f"another TaskBridge (serve.py pid {pid}) already serves the queue {store.database_label()} "
                      f"on 127.0.0.1:{held_port}; use that one (board: http://127.0.0.1:{held_port}/), stop it "
                      f"(Ctrl-C in its terminal, or kill {pid}), or give this one another queue with --db")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {port}\n".encode(), 0)
    return fd, None


def _serving_pid(server: Any) -> int:
    """The pid of the serve.py that started ``server`` (a psutil.Process), else the server's own:
    either may end while it is asked (then the server's pid is the one to name)."""
    import psutil
    try:
        parent = server.parent()
        return parent.pid if parent and "serve.py" in " ".join(parent.cmdline()) else server.pid
    except psutil.Error:
        return server.pid


def wait_healthy(port: int, server: subprocess.Popen, seconds: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        if server.poll() is not None:
            raise SetupError(f"the MCP server exited (status {server.returncode}); its error is above "
                             f"(port {port} in use? set PORT or --port)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    if stop.is_set():
        raise SetupError("stopped before the server answered")
    raise SetupError(f"the MCP server did not answer /health on port {port} in {seconds:.0f} s")


def die_with_parent():
    """A preexec function that asks Linux to send the child SIGTERM when this process dies, however
    it dies (SIGKILL, a crash): our children lead sessions of their own, so nothing else would
    reach them, and a second serve.py would find the port and the queue's lock still taken. The
    worker's SIGTERM hands a task in hand back. None elsewhere (macOS has no such call: there only
    the stops this process performs itself apply)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:                # the parent died before the call took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


class Services:
    """The server, the worker and the tunnel, each in a session of its own so the terminal's
    Ctrl-C reaches only this process, which then stops them in order."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen] = {}
        self.stop_asked = threading.Event()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
                                preexec_fn=die_with_parent())
        self.children[name] = proc
        return proc

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        self.children[name] = proc

    def on_signal(self, _signum: int, _frame: object) -> None:
        """A ``signal.signal`` handler (its (signum, frame) arguments are the signal module's): ask to stop."""
        self.stop_asked.set()

    def first_exit(self) -> tuple[str, int] | None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self) -> None:
        """The worker first (it runs with --stop-at-once: one SIGTERM ends a task in hand and hands
        it back without spending a retry, and it says so in one line), then the server and the
        tunnel; whatever outlives the grace period is killed with its process group."""
        worker = self.children.get("worker")
        if worker and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
        for name in ("server", "tunnel"):
            proc = self.children.get(name)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SEC
        for name, proc in self.children.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"the {name} did not stop in {STOP_GRACE_SEC} s; killing it")
            with_group_killed(proc)
        self.children.clear()   # a second stop (serve's finally) has nothing left to do


def with_group_killed(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the child's process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def event_line(event: dict) -> str:
    message = CONTROL_RE.sub(" ", event.get("message") or "")
    if len(message) > 110:
        message = message[:107] + "..."
    return f"[{time.strftime('%H:%M:%S')}] {event['task_id']} {event['kind']}: {message}"


def queue_problem() -> str | None:
    """Why the queue cannot be opened (and migrated), in one line naming it without a password;
    None when it opens. Asked before anything is started: an unreachable PostgreSQL server or a
    broken SQLite file stops serve.py with that line, not with the children's exits."""
    try:
        store.last_event_id()
    except store.TaskStoreError as exc:   # its message names the queue and the way out
        return str(exc)
    except OSError as exc:
        return f"cannot use the queue {store.database_label()}: {exc}; check TASK_DB_URL / TASK_DB_PATH"
    return None


def print_events(cursor: int) -> int:
    """Print one line per task event after ``cursor``; returns the new cursor. A database that
    cannot be read is skipped quietly (the server and worker say why)."""
    try:
        events = store.events_since(cursor, limit=200)
    except Exception:  # noqa: BLE001 - a status line must never stop the serving
        return cursor
    for event in events:
        if event["task_id"] and event["kind"] in SHOWN_KINDS:
            print(event_line(event), file=sys.stderr, flush=True)
    return events[-1]["id"] if events else cursor


def serve(port: int, tunnel_kind: str, token: str) -> int:
    """Start everything, print the box, show task events until Ctrl-C or a child's exit, stop
    everything. Returns the exit status: 0 after Ctrl-C, 1 when a part stopped by itself."""
    sup = Services()
    # Closing the terminal sends SIGHUP: it stops everything the way Ctrl-C does.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, sup.on_signal)
    try:
        return _serve(sup, port, tunnel_kind, token)
    finally:
        sup.stop()   # whatever ended serving (a signal, an error of ours): no child outlives it


def _public_host(sup: Services, port: int, tunnel_kind: str, env: dict[str, str]) -> str | None:
    """The public host clients reach the server on: TUNNEL_HOST's, or that of a tunnel started here
    (adopted by ``sup``; its identity goes into ``env``), or None when serving on loopback only.
    Raises SetupError when the tunnel cannot be started or names no host in time."""
    host = os.environ.get("TUNNEL_HOST", "").strip().lower() or None
    if tunnel_kind != "none" and not host:
        kind, binary = tunnel_binary(tunnel_kind)
        say(f"starting the {kind} tunnel ({binary})")
        tunnel = Tunnel(kind, binary, port)
        sup.adopt("tunnel", tunnel.proc)
        host = tunnel.wait_for_host(TUNNEL_WAIT_SEC, sup.stop_asked)
        env["TASKBRIDGE_TUNNEL_PID"] = tunnel.identity()
    return host


def how_it_ended(code: int) -> str:
    """How a child serve.py started ended, from its exit status (``Popen.returncode``, negative
    for a signal): 'was killed by SIGKILL (…)' or 'stopped by itself (status 1); its message is
    above'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (a kill, or the kernel out of memory: it printed nothing)"
    return f"stopped by itself (status {code}); its message is above"


def _serve(sup: Services, port: int, tunnel_kind: str, token: str) -> int:
    env = dict(os.environ)
    host = None
    try:
        host = _public_host(sup, port, tunnel_kind, env)
        if host:
            env["MCP_ALLOWED_HOSTS"] = ",".join(filter(None, [env.get("MCP_ALLOWED_HOSTS", ""), host]))
            env["MCP_PUBLIC_URL"] = f"https://{host}"
        server = sup.start("server", [sys.executable, str(REPO / "opencode_bridge_mcp.py"), "--transport",
                                      "streamable-http", "--host", "127.0.0.1", "--port", str(port),
                                      "--log-level", "WARNING"], env)
        wait_healthy(port, server, HEALTH_WAIT_SEC, sup.stop_asked)
        cursor = store.last_event_id()
        worker_argv = [sys.executable, str(REPO / "worker.py"), "--watch", "--stop-at-once"]
        sup.start("worker", worker_argv, env)
    except SetupError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    if host:
        with contextlib.suppress(OSError):   # for `tasks_cli.py connect` while this runs
            write_private(connectors.public_url_file(), f"https://{host}\n")
    print(connector_box(port, token, host), file=sys.stderr, flush=True)
    status, worker_again, started_at, pause = 0, None, time.monotonic(), WORKER_RESTART_SEC[0]
    while not sup.stop_asked.wait(1.0):
        cursor = print_events(cursor)
        if worker_again is not None and time.monotonic() >= worker_again:
            worker_again, started_at = None, time.monotonic()
            sup.start("worker", worker_argv, env)
        ended = sup.first_exit()
        if ended and ended == ("worker", 0):
            # Exit 0 without being asked: another pass (the schedule's) holds this queue's lock.
            # It runs the tasks meanwhile; ours takes over once the lock is free.
            say(f"the worker exited (another pass holds this queue's lock); trying again in {WORKER_RETRY_SEC} s")
            del sup.children["worker"]
            worker_again = time.monotonic() + WORKER_RETRY_SEC
        elif ended and ended[0] == "worker":
            # The worker rides out a database outage itself; should it stop anyway (a bug, a
            # database that refuses it at start, a kill), the server and the board keep serving
            # (tasks wait in the queue) and the worker is started again, with back-off.
            pause = WORKER_RESTART_SEC[0] if time.monotonic() - started_at > WORKER_SETTLED_SEC else pause
            say(f"the worker {how_it_ended(ended[1])}. The server and the "
                f"board go on; starting the worker again in {pause} s")
            del sup.children["worker"]
            worker_again = time.monotonic() + pause
            pause = min(pause * 2, WORKER_RESTART_SEC[1])
        elif ended:
            name, code = ended
            say(f"the {name} {how_it_ended(code)}. Stopping everything.")
            status = 1
            break
    print_events(cursor)
    say("stopping the worker (a task in hand goes back to the queue), the server" + (" and the tunnel" if host else ""))
    sup.stop()
    if host:
        connectors.public_url_file().unlink(missing_ok=True)
    say("stopped")
    return status


# --------------------------------------------------------------------------------------------
# Entry point.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=None,
                        help="loopback port of the server, 1-65535 (default $PORT or 8765)")
    parser.add_argument("--tunnel", choices=("none", "cloudflare", "ngrok", "auto"), default=None,
                        help="public mode: none (default), cloudflare, ngrok, auto (whichever is installed)")
    parser.add_argument("--rotate", action="store_true", help="make a new token (old clients must be updated)")
    parser.add_argument("--setup-only", action="store_true", help="token, file modes and client set-up; serve nothing")
    parser.add_argument("--check-port", action="store_true",
                        help="only check the port: exit 0 when free, else say who holds it and exit 1 "
                             "(install.sh asks first)")

    parser.add_argument("--quiet", action="store_true", help="with --setup-only: print no client snippets")
    parser.add_argument("--write-claude-desktop", action="store_true",
                        help="merge the taskbridge entry into Claude Desktop's config (a backup is kept)")
    parser.add_argument("--db", metavar="URL", default=None,
                        help="the queue: a postgresql:// URL or a SQLite file (default $TASK_DB_URL, else "
                             "$TASK_DB_PATH or <repo>/tasks.db); the server and the worker get it as TASK_DB_URL "
                             "in their environment, never on their command line")
    args = parser.parse_args(argv)
    try:   # before anything touches the store; the children inherit it with the environment
        knobs.select_database(args.db)
    except knobs.KnobError as exc:
        parser.exit(2, f"serve: {exc}\n")
    # Every knob of the server and the worker is checked before anything starts: a typo must not
    # run with a default, nor surface as a child's exit after the box was printed.
    refused = knobs.problems(() if args.port is None else tuple(n for n in knobs.REGISTRY if n != "PORT"))
    if refused:
        parser.exit(2, "".join(f"serve: {line}\n" for line in refused))
    if args.port is None:
        args.port = knobs.knob("PORT")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be 1-65535; got {args.port}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    new_queue = store.backend() == "sqlite" and not store.db_path().exists()   # before the checks open it
    refused = _refusal(args)
    if refused is not None:
        return refused
    lock, other = (None, None) if args.setup_only else hold_queue(args.port)
    if other and not args.rotate:
        print(f"serve: {other}", file=sys.stderr)
        return 1
    try:
        token, how = ensure_token(args.rotate)
    except SetupError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    if how in ("new", "rotated"):
        say(f"wrote a new bearer token to {token_file()} (mode 0600)")
    if how == "rotated":   # the port the clients use: the serving one's when one serves this queue
        say(rotation_notice((store.served_by() or ("", args.port))[1] if other else args.port))
        if other:   # rotated for the TaskBridge already serving this queue: nothing more to start
            say(f"{other.split(';')[0]}: it uses the new token from now on")
            return 0
    failed = _set_up(args, first_run=how == "new")
    if failed is not None or args.setup_only:
        return failed or 0
    if new_queue:
        say(f"made a new queue at {store.db_path()}: clients of this server and its worker use it; a queue at "
            "another path is not seen (a typo in --db / TASK_DB_PATH? Ctrl-C stops, and the empty queue can go)")
    tunnel = args.tunnel
    if tunnel is None:
        tunnel = ask_tunnel() if sys.stdin.isatty() and not os.environ.get("TUNNEL_HOST") else "none"
    try:
        return serve(args.port, tunnel, token)
    finally:
        if lock is not None:
            os.close(lock)


def _refusal(args: argparse.Namespace) -> int | None:
    """The exit status when serving stops before anything is written: the port taken or the
    queue unusable (1, said in one line), or --check-port answered (0); None to go on."""
    taken = None if args.setup_only else port_taken(args.port)
    if taken:
        print(f"serve: {taken}", file=sys.stderr)
        return 1
    if args.check_port:
        return 0
    problem = None if args.setup_only else queue_problem()
    if problem:   # before anything is written or its mode changed: a file that is no queue stays as it was
        print(f"serve: {problem}", file=sys.stderr)
        return 1
    return None


def _set_up(args: argparse.Namespace, first_run: bool) -> int | None:
    """Private modes, the Claude Desktop entry (--write-claude-desktop), the client snippets on
    the first run; 1 when the Claude Desktop config cannot be written, else None."""
    for path in tighten_modes():
        say(f"made {path} private to this user")
    if args.write_claude_desktop:
        try:
            config, backup = connectors.write_claude_desktop()
        except (ValueError, OSError) as exc:
            print(f"serve: {exc}", file=sys.stderr)
            return 1
        say(f"Claude Desktop: added taskbridge to {config}" + (f" (backup: {backup})" if backup else "")
            + "; restart Claude Desktop")
    if (args.setup_only or first_run) and not args.quiet:   # the snippets; `tasks_cli.py connect` later
        print(connectors.snippets(args.port), file=sys.stderr)
    return None

if __name__ == "__main__":
    sys.exit(main())
