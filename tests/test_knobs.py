"""Numeric env knobs: a value that is set but not a number in range is refused at once, with one
line naming the variable, its value and the range, by every entry point (never run with the
default in silence, never a traceback)."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from helpers import ROOT, run_script


@pytest.mark.parametrize("name,value,range_", [("WORKER_SLOTS", "abc", "from 1 to 16"),
                                                ("TASKBRIDGE_GIT_TIMEOUT_SEC", "abc", "from 0.1 to 86400"),
                                                ("WORKER_STALE_SEC", "-1", "from 0 to"),
                                                ("WORKER_POLL_SEC", "nan", "from 0.01 to 60")])
def test_the_worker_refuses_a_bad_knob_before_it_starts(tmp_path, name, value, range_):
    result = run_script("worker.py", env=dict(os.environ, **{name: value}), timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{name}={value!r} is not" in result.stderr and range_ in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists(), "nothing was started nor written"


@pytest.mark.parametrize("stale,lease", [("0", None), ("5", None), ("9.9", "0.5"), ("50", "10")])
def test_a_stale_limit_too_short_for_the_lease_is_refused_naming_both(tmp_path, stale, lease):
    """WORKER_STALE_SEC=0 was accepted, and such a worker requeued other hosts' live tasks a second
    after their last heartbeat: it must exceed 10 renewals (WORKER_LEASE_SEC) and 10 s."""
    env = dict(os.environ, WORKER_STALE_SEC=stale, TASK_DB_PATH=str(tmp_path / "q" / "tasks.db"))
    if lease:
        env["WORKER_LEASE_SEC"] = lease
    for script in ("worker.py", "serve.py"):
        result = run_script(script, *(["--tunnel", "none"] if script == "serve.py" else []),
                            env=dict(env, MCP_BEARER_TOKEN="t"), timeout=60)
        assert result.returncode == 2, result.stderr
        line = [x for x in result.stderr.splitlines() if "WORKER_STALE_SEC" in x]
        assert len(line) == 1 and "WORKER_LEASE_SEC" in line[0] and f"WORKER_STALE_SEC={stale} is below" in line[0]
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists(), "nothing was started nor written"


def test_a_stale_limit_of_ten_renewals_is_accepted(monkeypatch):
    import knobs
    monkeypatch.setenv("WORKER_STALE_SEC", "20")
    assert knobs.problems() == []
    monkeypatch.setenv("WORKER_LEASE_SEC", "3")
    assert "below 30 s" in knobs.problems()[0]
    assert knobs.problems(("WORKER_SLOTS",)) == [], "only checked with the stale limit"


def test_the_worker_refuses_a_negative_max_tasks():
    result = run_script("worker.py", "--max-tasks", "-1", timeout=60)
    assert result.returncode == 2 and "--max-tasks must be 1 or more; got -1" in result.stderr


@pytest.mark.parametrize("name,value", [("PORT", "abc"), ("WORKER_SLOTS", "0")])
def test_serve_refuses_a_bad_knob_before_it_starts_anything(name, value):
    result = run_script("serve.py", "--tunnel", "none", env=dict(os.environ, MCP_BEARER_TOKEN="t", **{name: value}),
                        timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"serve: {name}={value!r} is not a whole number from" in result.stderr
    assert "Traceback" not in result.stderr and "Local MCP" not in result.stderr


def test_the_mcp_server_refuses_a_bad_git_timeout():
    result = run_script("opencode_bridge_mcp.py", "--transport", "streamable-http", "--port", "0",
                        env=dict(os.environ, TASKBRIDGE_GIT_TIMEOUT_SEC="abc"), timeout=60)
    assert result.returncode == 2 and "TASKBRIDGE_GIT_TIMEOUT_SEC='abc' is not a number" in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "soon", "0", "1e9"])
def test_the_mcp_server_refuses_a_wait_poll_that_would_spin_or_never_poll(value):
    """0 or nan would turn wait_for's fallback into a busy loop and 1e9 into none; before, such
    values were clamped in silence."""
    result = run_script("opencode_bridge_mcp.py", env=dict(os.environ, MCP_WAIT_POLL_SEC=value), timeout=60)
    assert result.returncode == 2 and result.stdout == "", "stdio stays clean"
    assert f"MCP_WAIT_POLL_SEC={value!r} is not a number from 0.01 to 5" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name,value,range_", [("CLAUDE_MAX_TOKENS", "lots", "from 1 to 128000"),
                                                ("CLAUDE_MAX_PARALLEL", "0", "from 1 to 64"),
                                                ("CLAUDE_STALL_SEC", "-5", "from 1 to 3600"),
                                                ("CLAUDE_CODE_MAX_RETRIES", "99", "from 0 to 20")])
def test_the_reverse_bridge_refuses_a_bad_knob_before_it_serves(name, value, range_):
    """Before, the reverse bridge clamped these (CLAUDE_MAX_PARALLEL=0 ran one job at a time) or
    fell back to the default with a warning only its log showed."""
    result = run_script("claude_control_mcp.py", env=dict(os.environ, **{name: value}), timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert f"{name}={value!r} is not a whole number {range_}" in result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_names_a_bad_port_and_the_fix():
    result = run_script("tasks_cli.py", "doctor", "--json", env=dict(os.environ, PORT="abc"), timeout=120)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["settings"]["status"] == "fail"
    assert "PORT='abc' is not a whole number from 1 to 65535" in checks["settings"]["detail"]
    assert checks["settings"]["fix"] == "fix or unset PORT"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args,env", [(["--port", "abc"], {}), (["--port=70000"], {}), ([], {"PORT": "abc"})])
def test_install_refuses_a_bad_port_before_installing(args, env):
    began = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / "install.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, **env), timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and "is not a port number from 1 to 65535" in result.stderr
    assert "installing" not in result.stderr and time.monotonic() - began < 10


@pytest.mark.parametrize("name", ["WORKER_ENGINE", "MCP_CHANNEL_PUSH"])
def test_a_switch_knob_says_what_0_and_1_mean(monkeypatch, name):
    """A bad on/off knob named only "a whole number from 0 to 1": its two values are now said."""
    import knobs
    monkeypatch.setenv(name, "yes")
    with pytest.raises(knobs.KnobError) as caught:
        knobs.knob(name)
    off, on = knobs.SWITCHES[name]
    off_word, on_word = (f", {w}" for w in knobs.SWITCH_WORDS[name]) if name in knobs.SWITCH_WORDS else ("", "")
    assert f"{name}='yes' is not 0 or 1 (0{off_word}: {off}; 1{on_word}: {on}); fix it or unset it" \
        in str(caught.value)


@pytest.mark.parametrize(("value", "engine"), [("warm", 1), ("Cold", 0), ("1", 1)])
def test_worker_engine_takes_the_words_of_its_flag_too(monkeypatch, value, engine):
    """--engine takes cold and warm: WORKER_ENGINE does too (it took only 0 and 1)."""
    import knobs
    monkeypatch.setenv("WORKER_ENGINE", value)
    assert knobs.knob("WORKER_ENGINE") == engine


def test_the_worker_says_what_worker_engine_means():
    result = run_script("worker.py", env=dict(os.environ, WORKER_ENGINE="2"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "WORKER_ENGINE='2' is not 0 or 1 (0, cold: a new `opencode run` per attempt; 1, warm: the warm engine" \
        in result.stderr
    assert "Traceback" not in result.stderr
