"""An isolated environment for the real `opencode` binary, talking to a ScriptedModel.

Used as a pytest plugin (`pytest_plugins = ["opencode_env"]`), it provides two fixtures:
- `scripted_model`: a started `fake_openai.ScriptedModel`, stopped after the test;
- `opencode`: an `OpenCode` (bin, env, model, root) whose env is also applied to `os.environ`
  with monkeypatch, so code under test that spawns `opencode` inherits it. It skips the test
  when the binary is missing, and fails it instead when `CI=true`.

Everything OpenCode writes (config, sessions, caches) lands under `tmp_path/opencode-home`; the
model is the config FILE named by `OPENCODE_CONFIG`, so `OPENCODE_CONFIG_CONTENT` stays free for
the code under test. Reads `OPENCODE_BIN` (fallback binary) and `CI` at call time.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import agent_box
from fake_openai import ScriptedModel
from helpers import require_pinned

OPENCODE_VERSION = "1.18.33"
MODEL = "fake/model"
REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "MODEL",
    "OPENCODE_VERSION",
    "OpenCode",
    "opencode",
    "opencode_bin",
    "opencode_config",
    "opencode_env",
    "parse_events",
    "require_opencode_bin",
    "scripted_model",
]


def opencode_bin() -> str | None:
    """The pinned binary (<repo>/node_modules/.bin/opencode), else `$OPENCODE_BIN` if it resolves
    to an executable, else None."""
    pinned = REPO_ROOT / "node_modules" / ".bin" / "opencode"
    if pinned.exists() and os.access(pinned, os.X_OK):
        return str(pinned)
    fallback = os.environ.get("OPENCODE_BIN")
    return shutil.which(fallback) if fallback else None


def opencode_config(model_url: str, cost: bool = True,
                    extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenCode config for provider "fake" (model `fake/model`) served at `model_url`.

    cost: declare prices (USD per million tokens: input 1.0, output 2.0, cache read 0.1, cache
    write 1.25); without them OpenCode reports cost 0. extra_config: deep-merged over the result
    (dicts merge, anything else replaces), e.g. {"provider": {"fake": {"options":
    {"chunkTimeout": 3000}}}}.
    """
    model: dict[str, Any] = {"name": "Fake", "limit": {"context": 128000, "output": 8192}}
    if cost:
        model["cost"] = {"input": 1.0, "output": 2.0, "cache_read": 0.1, "cache_write": 1.25}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"fake": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "Fake",
            # headerTimeout/chunkTimeout (ms) replace the 300 s defaults so a silent model fails
            # a test in a minute, not in half an hour of retries.
            "options": {"baseURL": model_url, "apiKey": "x",
                        "headerTimeout": 60000, "chunkTimeout": 60000},
            "models": {"model": model},
        }},
        "model": MODEL,
        "small_model": MODEL,
        "enabled_providers": ["fake"],
        "autoupdate": False,
        "share": "disabled",
        "snapshot": False,
    }
    return _deep_merge(config, extra_config or {})


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `over` merged in (nested dicts merge; other values replace)."""
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _closed_loopback_url() -> str:
    """A 127.0.0.1 URL nothing listens on (the port was just free), for npm to fail against."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def _precreate_plugin_dir(config_dir: Path) -> None:
    """Make OpenCode believe @opencode-ai/plugin is installed, so no background npm install starts."""
    deps = {"@opencode-ai/plugin": OPENCODE_VERSION}
    (config_dir / "node_modules").mkdir(parents=True, exist_ok=True)
    (config_dir / "package.json").write_text(json.dumps({"dependencies": deps}, indent=2))
    lock = {"name": "opencode", "lockfileVersion": 3, "requires": True,
            "packages": {"": {"dependencies": deps}}}
    (config_dir / "package-lock.json").write_text(json.dumps(lock, indent=2))


_prepared: list[Path] = []   # the session's one prepared OpenCode data folder (prepared_data)


def prepared_data(binary: str) -> Path | None:
    """A data folder whose ``opencode/`` holds OpenCode's database made and migrated by ``binary``
    with TaskBridge's mark beside it (opencode_runner.prepare_opencode_db), made once per test
    session: each test's data folder starts as a copy of it, as a user's does after the first run
    (its workers then start OpenCode at once; a test that wants a fresh folder deletes the copy).
    None when it cannot be made (the test then starts fresh)."""
    if not _prepared:
        import atexit
        import tempfile
        from unittest import mock

        import opencode_runner
        folder = Path(tempfile.mkdtemp(prefix="tb-opencode-data-"))
        atexit.register(shutil.rmtree, folder, True)
        with mock.patch.dict(os.environ, {"XDG_DATA_HOME": str(folder), "OPENCODE_BIN": binary}):
            if opencode_runner.prepare_opencode_db() is not None:
                return None
        import sqlite3
        conn = sqlite3.connect(folder / "opencode" / "opencode.db")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # the main file holds it all: it alone is copied
        conn.close()
        _prepared.append(folder)
    return _prepared[0]


def opencode_env(tmp_path: Path, model_url: str, cost: bool = True,
                 extra_config: dict[str, Any] | None = None) -> dict[str, str]:
    """A full environment (os.environ copy plus overrides) isolating OpenCode under tmp_path.

    Creates tmp_path/opencode-home/{home,config,data,cache,state} and the config file
    tmp_path/opencode-home/opencode-test.json (see `opencode_config`). Inherited `OPENCODE_*`
    variables are dropped so the user's settings cannot leak in. The caller still sets `PWD` (or
    passes `--dir`) per run: OpenCode trusts `PWD` over the real cwd.
    """
    root = Path(tmp_path) / "opencode-home"
    dirs = {name: root / name for name in ("home", "config", "data", "cache", "state")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    _precreate_plugin_dir(dirs["config"] / "opencode")
    config_file = root / "opencode-test.json"
    config_file.write_text(json.dumps(opencode_config(model_url, cost, extra_config), indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCODE_")}
    env.update({
        "HOME": str(dirs["home"]),
        "XDG_CONFIG_HOME": str(dirs["config"]),
        "XDG_DATA_HOME": str(dirs["data"]),
        "XDG_CACHE_HOME": str(dirs["cache"]),
        "XDG_STATE_HOME": str(dirs["state"]),
        "npm_config_registry": _closed_loopback_url(),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_CONFIG": str(config_file),
        "WORKER_MODEL": MODEL,
    })
    binary = opencode_bin()
    if binary:
        env["OPENCODE_BIN"] = binary
        template = prepared_data(binary)
        # yours, the template of the boxed runs' own (agent_box.seed_home) and TaskBridge's calls' own
        homes = [agent_box.template_home(env), *(agent_box.calls_home(kind, env) for kind in agent_box.CALLS)]
        boxed = [Path(home) / "data" for home in homes]
        for data in (dirs["data"], *boxed) if template is not None else ():
            (data / "opencode").mkdir(parents=True, exist_ok=True)
            for name in ("opencode.db", ".taskbridge-prepared"):
                shutil.copyfile(template / "opencode" / name, data / "opencode" / name)
    return env


def parse_events(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects of an `opencode run --format json` stdout; non-JSON lines are skipped."""
    events = []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


@dataclass
class OpenCode:
    """The `opencode` fixture's value: the binary, its isolated env, the model behind it."""

    bin: str
    env: dict[str, str]
    model: ScriptedModel
    root: Path  # tmp_path/opencode-home: config, data (sessions db), cache, state

    def configure(self, extra_config: dict[str, Any]) -> None:
        """Rewrite the config file as the base config with `extra_config` deep-merged over it,
        e.g. {"provider": {"fake": {"options": {"headerTimeout": 2000}}}}; later runs see it."""
        config = opencode_config(self.model.url, extra_config=extra_config)
        Path(self.env["OPENCODE_CONFIG"]).write_text(json.dumps(config, indent=2))

    def run(self, prompt: str, cwd: Path | str, *, title: str = "br-test",
            extra_args: tuple[str, ...] = (), timeout: float = 180) -> subprocess.CompletedProcess:
        """`opencode run --auto --format json -m fake/model --title TITLE` in `cwd`, the prompt
        on stdin (then closed). Returns the CompletedProcess (text mode); raises
        subprocess.TimeoutExpired after `timeout` seconds."""
        args = [self.bin, "run", "--auto", "--format", "json", "-m", MODEL, "--title", title, *extra_args]
        env = {**self.env, "PWD": str(cwd)}
        return subprocess.run(args, input=prompt, cwd=str(cwd), env=env, capture_output=True,
                              text=True, timeout=timeout)


def require_opencode_bin() -> str:
    """The binary `opencode_bin()` finds; else skip the test, or fail it when CI=true."""
    return require_pinned(opencode_bin(), f"opencode (opencode-ai {OPENCODE_VERSION}, or set OPENCODE_BIN)")


@pytest.fixture
def scripted_model() -> Iterator[ScriptedModel]:
    """A started ScriptedModel; stopped (hangs released) after the test."""
    with ScriptedModel() as model:
        yield model


@pytest.fixture
def opencode(tmp_path: Path, scripted_model: ScriptedModel,
             monkeypatch: pytest.MonkeyPatch) -> OpenCode:
    """The real opencode wired to `scripted_model`, its env applied to os.environ.

    Skips when the binary is missing; with CI=true that is a failure instead.
    """
    binary = require_opencode_bin()
    env = opencode_env(tmp_path, scripted_model.url)
    for key in [k for k in os.environ if k not in env]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    return OpenCode(bin=binary, env=env, model=scripted_model, root=Path(tmp_path) / "opencode-home")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the real opencode (the ``opencode`` fixture, directly or through
    another fixture) is marked ``real_opencode``, so ``-m "not real_opencode"`` leaves it out
    without each test having to say so."""
    for item in items:
        if "opencode" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_opencode)
