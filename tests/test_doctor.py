"""`tasks_cli.py doctor` on a healthy set-up and on broken ones: the real opencode with a scripted
model, real SQLite files, the CLI run as a separate process."""
from __future__ import annotations

import json
import os
import re

import pytest

import task_store
from fake_openai import http_error, text
from helpers import run_script

pytestmark = pytest.mark.real_opencode


def doctor(*args: str):
    result = run_script("tasks_cli.py", "doctor", *args)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def line_of(output: str, name: str) -> str:
    """The report line of check ``name``."""
    found = [line for line in output.splitlines() if re.match(rf"^(ok|warn|FAIL)\s+{name}\s", line)]
    assert len(found) == 1, output
    return found[0]


def test_doctor_on_a_healthy_set_up(opencode, tmp_path):
    opencode.model.script("default", [text("ok")])
    task_store.submit_task(title="x", instructions="y", working_dir=str(tmp_path))
    result = doctor("--live")
    assert result.returncode == 0, result.stdout
    assert line_of(result.stdout, "python").startswith("ok") and "packages installed" in result.stdout
    assert line_of(result.stdout, "opencode").startswith("ok") and "opencode 1.18.33" in result.stdout
    assert line_of(result.stdout, "agent box").startswith("ok") and "bubblewrap" in line_of(result.stdout, "agent box")
    model = line_of(result.stdout, "default model")
    assert model.startswith("ok") and "fake/model (from WORKER_MODEL) answered a one-line prompt" in model
    database = line_of(result.stdout, "database")
    assert database.startswith("ok") and "1 task(s), integrity ok, journal wal" in database
    assert line_of(result.stdout, "worker").startswith("warn")        # no worker has run here yet
    assert "FAIL" not in result.stdout
    report = json.loads(doctor("--json").stdout)
    assert report["ok"] is True and [c["name"] for c in report["checks"]] == [
        "python",
        "settings",
        "agent box",
        "opencode",
        "engine",
        "default model",
        "database",
        "folders",
        "worker",
        "leftover worktrees",
        "token",
        "mcp server",
        "reverse bridge",
    ]


def test_doctor_warns_when_the_worker_that_reported_is_gone_and_nothing_starts_another(opencode):
    """A worker pass that ended a moment ago left a young heartbeat, and doctor said ``ok`` while
    nothing served the queue (its process gone, no schedule installed): a fresh user's finding."""
    assert run_script("worker.py").returncode == 0   # one pass, then its process ends
    worker = line_of(doctor().stdout, "worker")
    if "not installed" not in worker:
        pytest.skip(f"this machine's schedule cannot be told not installed: {worker}")
    assert worker.startswith("warn") and "its process is gone" in worker, worker
    assert "no worker serves this queue now" in worker, worker


def test_doctor_names_the_engine_and_why_a_kept_server_cannot_start(opencode, monkeypatch):
    assert line_of(doctor().stdout, "engine").startswith("ok") and "cold" in line_of(doctor().stdout, "engine")
    monkeypatch.setenv("WORKER_ENGINE", "1")
    warm = line_of(doctor().stdout, "engine")
    assert warm.startswith("ok") and "a kept `opencode serve` 1.18.33 starts in" in warm, warm
    # A config only a server's start reads (the model name must be a string): named in one line.
    monkeypatch.setenv("OPENCODE_CONFIG_CONTENT", json.dumps({"model": 5}))
    result = doctor()
    broken = line_of(result.stdout, "engine")
    assert result.returncode == 1 and broken.startswith("FAIL"), result.stdout
    assert "refused its configuration" in broken and "model" in broken, broken


def test_doctor_with_opencode_missing(opencode, monkeypatch, tmp_path):
    monkeypatch.setenv("OPENCODE_BIN", str(tmp_path / "no-such-opencode"))
    result = doctor()
    assert result.returncode == 1
    missing = line_of(result.stdout, "opencode")
    assert missing.startswith("FAIL") and "not found" in missing and "./install.sh" in missing
    model = line_of(result.stdout, "default model")
    assert model.startswith("FAIL") and "cannot be chosen or checked: opencode is missing" in model
    assert line_of(result.stdout, "database").startswith("ok")          # the rest is still checked


def test_doctor_with_a_broken_database(opencode):
    path = task_store.db_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not a SQLite database at all\n" * 200)
    result = doctor()
    assert result.returncode == 1
    broken = line_of(result.stdout, "database")
    assert broken.startswith("FAIL") and "file is not a database" in broken and f"mv {path} {path}.broken" in broken
    assert path.read_bytes().startswith(b"this is not")       # the doctor changes nothing


def test_doctor_with_an_unusable_default_model(opencode, monkeypatch):
    monkeypatch.setenv("WORKER_MODEL", "fake/modle")
    result = doctor()
    assert result.returncode == 1
    model = line_of(result.stdout, "default model")
    assert model.startswith("FAIL") and "fake/modle (from WORKER_MODEL) is not offered by OpenCode here" in model
    assert "similar: fake/model" in model and "WORKER_MODEL" in model.split("→")[1]

    # Listed, but the provider refuses it: only --live finds out, quoting the provider's error.
    monkeypatch.setenv("WORKER_MODEL", "fake/model")
    opencode.model.script("default", [http_error(401, "invalid api key for the scripted model")])
    assert doctor().returncode == 0
    live = doctor("--live")
    assert live.returncode == 1
    refused = line_of(live.stdout, "default model")
    assert refused.startswith("FAIL") and "a one-line prompt failed" in refused
    assert "invalid api key for the scripted model" in refused


def test_doctor_with_a_broken_opencode_config_quotes_opencode(opencode, monkeypatch):
    monkeypatch.delenv("WORKER_MODEL")          # the default must come from OpenCode's own config
    config = opencode.env["OPENCODE_CONFIG"]
    with open(config, "w") as handle:
        handle.write('{"model": "fake/model",, }')
    result = doctor()
    assert result.returncode == 1
    model = line_of(result.stdout, "default model")
    assert model.startswith("FAIL") and f"Config file at {config} is not valid JSON" in model


def test_with_no_model_chosen_anywhere_submit_doctor_and_connect_name_the_hosted_free_model(
    opencode, monkeypatch, tmp_path
):
    """The real opencode with no model in its config and only its built-in hosted provider: a task
    that names no model would go to OpenCode's free hosted model. The worker's start line said so;
    now a submit, `doctor` and `connect` do too."""
    import json as _json
    from pathlib import Path
    monkeypatch.delenv("WORKER_MODEL", raising=False)
    Path(opencode.env["OPENCODE_CONFIG"]).write_text(_json.dumps(
        # "$schema" as OpenCode writes it into a config that lacks it (a rewrite that would
        # change the file's mtime, part of the key of OpenCode's cached answers).
        {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
         "snapshot": False, "enabled_providers": ["opencode"]}))
    task_store.connect().close()   # a served worker made the queue: OpenCode's answers are cached beside it
    checked = doctor()
    model = line_of(checked.stdout, "default model")
    assert model.startswith("warn") and "OpenCode's hosted free model" in model and "opencode/" in model, model
    repo = tmp_path / "repo"
    from helpers import make_repo
    make_repo(repo)
    submitted = run_script("tasks_cli.py", "submit", "t", "--dir", str(repo))     # from the answers doctor cached
    assert submitted.returncode == 0, submitted.stderr
    assert "Warning:" in submitted.stderr and "hosted free model" in submitted.stderr, submitted.stderr
    named = run_script("tasks_cli.py", "submit", "t", "--dir", str(repo), "--model", "opencode/big-pickle")
    assert "hosted free model" not in named.stderr, "a task that names its model is not warned"
    connected = run_script("tasks_cli.py", "connect")
    assert connected.returncode == 0 and "hosted free model" in connected.stderr, connected.stderr


def test_the_agent_box_line_warns_when_ripgrep_is_not_on_path(monkeypatch):
    """The box's cache bin/ is read-only to runs, so OpenCode cannot download ripgrep inside it:
    without rg on PATH its grep and glob tools fail there, and doctor says so with the fix."""
    import doctor as doctor_module
    if not doctor_module.agent_box.choose("auto").mechanism:
        pytest.skip("no agent box on this machine")
    real_which = doctor_module.shutil.which
    assert doctor_module.check_box().status == ("ok" if real_which("rg") else "warn")
    monkeypatch.setattr(doctor_module.shutil, "which", lambda name: None if name == "rg" else real_which(name))
    found = doctor_module.check_box()
    assert found.status == "warn" and "ripgrep (rg) is not on PATH" in found.detail
    assert "install ripgrep" in found.fix


def test_a_bad_knob_a_check_reads_is_said_in_its_words_not_as_a_crash(monkeypatch):
    """A fresh user's finding: WORKER_ENGINE=2 made the engine line print a raw KnobError("…")
    as "the check itself failed"; every check that meets a bad setting now names it plainly."""
    import doctor as doctor_module
    monkeypatch.setenv("WORKER_ENGINE", "2")
    found = doctor_module.run_check(doctor_module.check_engine)
    assert found.name == "engine" and found.status == "fail"
    assert found.detail.startswith("WORKER_ENGINE='2' is not 0 or 1")
    assert "KnobError" not in found.detail and "the check itself failed" not in found.detail


def test_doctor_names_a_log_or_worktree_folder_the_worker_cannot_write(tmp_path, monkeypatch):
    """A fresh tester's finding: doctor said all was well while the worker refused to claim. (Root
    writes anywhere: a file stands where the folder should be.)"""
    import doctor as doctor_mod
    assert doctor_mod.check_folders().status == "ok"
    for knob in ("TASK_LOG_DIR", "TASKBRIDGE_WORKTREE_ROOT"):
        was = os.environ[knob]   # the test's own folders (conftest)
        blocked = tmp_path / f"{knob}-file"
        blocked.write_text("not a folder\n")
        monkeypatch.setenv(knob, str(blocked))
        check = doctor_mod.check_folders()
        assert check.status == "fail" and str(blocked) in check.detail and knob in check.fix, check
        monkeypatch.setenv(knob, was)
