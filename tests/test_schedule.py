"""The every-60-s schedule. launchctl (macOS) and a user systemd cannot run on this Linux test
machine, so fake `launchctl` / `systemctl` scripts on PATH record their calls; the generated
files themselves are real and checked."""
from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, fake_binary

sys.path.insert(0, str(ROOT / "launchd"))
import schedule  # noqa: E402


@pytest.fixture
def fake_bins(tmp_path, monkeypatch):
    bins, calls = tmp_path / "bin", tmp_path / "calls.txt"
    for name in ("launchctl", "systemctl"):
        fake_binary(bins, name, f'echo {name} "$@" >> {calls}\n')
    fake_binary(bins, "opencode", "exit 0\n")
    monkeypatch.setenv("PATH", f"{bins}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.delenv("OPENCODE_BIN", raising=False)
    return bins, calls


def test_launchd_agent_carries_absolute_paths(fake_bins, tmp_path, monkeypatch):
    bins, calls = fake_bins
    monkeypatch.setattr(schedule.platform, "system", lambda: "Darwin")
    monkeypatch.setenv("LAUNCH_AGENTS_DIR", str(tmp_path / "agents"))
    message = schedule.install()
    plist = plistlib.loads((tmp_path / "agents" / "com.taskbridge.worker.plist").read_bytes())
    assert plist["StartInterval"] == 60
    assert plist["ProgramArguments"] == [sys.executable, str(ROOT / "worker.py")]
    env = plist["EnvironmentVariables"]
    assert env["OPENCODE_BIN"] == str(bins / "opencode")
    assert env["PATH"].split(os.pathsep)[0] == str(bins), "launchd's bare PATH must not hide opencode"
    assert env["TASK_DB_PATH"] == os.environ["TASK_DB_PATH"]
    assert "bootstrap" in calls.read_text() and "loaded" in message


def test_systemd_timer_written_and_enabled(fake_bins, tmp_path, monkeypatch):
    bins, calls = fake_bins
    monkeypatch.setattr(schedule.platform, "system", lambda: "Linux")
    monkeypatch.setenv("SYSTEMD_USER_DIR", str(tmp_path / "units"))
    schedule.install()
    service = (tmp_path / "units" / "taskbridge-worker.service").read_text()
    assert f'ExecStart="{sys.executable}" "{ROOT / "worker.py"}"' in service
    assert f'Environment="OPENCODE_BIN={bins / "opencode"}"' in service
    assert "OnUnitActiveSec=60" in (tmp_path / "units" / "taskbridge-worker.timer").read_text()
    assert "enable --now taskbridge-worker.timer" in calls.read_text()
    schedule.uninstall()
    assert not (tmp_path / "units" / "taskbridge-worker.service").exists()


def test_missing_opencode_is_said_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("OPENCODE_BIN", "/nowhere/opencode")
    monkeypatch.setenv("SYSTEMD_USER_DIR", str(tmp_path / "units"))
    assert schedule.main(["install"]) == 1
    assert "OPENCODE_BIN" in capsys.readouterr().err
    assert not (tmp_path / "units").exists()


def test_paths_with_spaces_and_markup_survive_every_format(fake_bins, tmp_path, monkeypatch):
    odd = tmp_path / "my proj & <q>"
    odd.mkdir()
    monkeypatch.setenv("TASK_DB_PATH", str(odd / "tasks.db"))
    monkeypatch.delenv("TASK_LOG_DIR")
    monkeypatch.setenv("WORKER_MODEL", "anthropic/claude-sonnet-4-5")
    monkeypatch.setenv("TASKBRIDGE_WORKTREE_ROOT", str(odd / "wt"))
    env = plistlib.loads(schedule.plist())["EnvironmentVariables"]
    assert env["TASK_DB_PATH"] == str(odd / "tasks.db") and env["WORKER_MODEL"] == "anthropic/claude-sonnet-4-5"
    assert env["TASKBRIDGE_WORKTREE_ROOT"] == str(odd / "wt")
    assert f'Environment="TASK_DB_PATH={odd / "tasks.db"}"' in schedule.service_unit()
    words = shlex.split(schedule.cron_line().split(" ", 5)[5])
    assert f"TASK_DB_PATH={odd / 'tasks.db'}" in words and f"TASK_LOG_DIR={odd / 'tasks_logs'}" in words
    assert "WORKER_MODEL=anthropic/claude-sonnet-4-5" in words


def stand_in_loginctl(bins: Path, linger: str) -> None:
    """loginctl needs a running systemd-logind, which this machine lacks: a stand-in prints what
    `loginctl show-user USER -p Linger` prints."""
    fake_binary(bins, "loginctl", f"echo Linger={linger}\n")


def test_linger_off_is_said_with_the_command_that_fixes_it(fake_bins, tmp_path, monkeypatch):
    bins, _ = fake_bins
    stand_in_loginctl(bins, "no")
    monkeypatch.setattr(schedule.platform, "system", lambda: "Linux")
    monkeypatch.setenv("SYSTEMD_USER_DIR", str(tmp_path / "units"))
    message = schedule.install()
    user = schedule.user_name()
    assert "stops at logout" in message and f"loginctl enable-linger {user}" in message
    assert "stops at logout" in schedule.status()
    stand_in_loginctl(bins, "yes")
    assert "enable-linger" not in schedule.install()
    assert "keeps running after logout" in schedule.status()


def test_status_says_what_is_installed_and_the_last_pass(fake_bins, tmp_path, monkeypatch):
    bins, _ = fake_bins
    stand_in_loginctl(bins, "yes")
    fake_binary(
        bins,
        "systemctl",
        'case "$*" in\n'
        "  *show*timer*) printf 'ActiveState=active\\nLastTriggerUSec=Mon 2026-11-30 10:00:00 UTC\\n' ;;\n"
        "  *show*service*) printf "
        "'Result=success\\nExecMainStatus=0\\nExecMainExitTimestamp=Mon 2026-11-30 10:00:02 UTC\\n' ;;\n"
        "esac\n",
    )
    monkeypatch.setattr(schedule.platform, "system", lambda: "Linux")
    monkeypatch.setenv("SYSTEMD_USER_DIR", str(tmp_path / "units"))
    assert "not installed" in schedule.status()
    schedule.install()
    import task_store
    task_store.write_worker_heartbeat({"state": "pass"})
    text = schedule.status()
    assert "installed in" in text and "last fired Mon 2026-11-30 10:00:00 UTC" in text
    assert "result success, exit status 0" in text and "worker heartbeat: pass" in text


def test_systemd_units_pass_systemd_analyze_verify(fake_bins, tmp_path, monkeypatch):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed here")
    odd = tmp_path / "my proj 100%"
    odd.mkdir()
    monkeypatch.setenv("TASK_DB_PATH", str(odd / "tasks.db"))
    units = tmp_path / "units"
    units.mkdir()
    (units / "taskbridge-worker.service").write_text(schedule.service_unit())
    shutil.copy(ROOT / "launchd" / "taskbridge-worker.timer", units)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    result = subprocess.run(["systemd-analyze", "--user", "verify", str(units / "taskbridge-worker.service"),
                             str(units / "taskbridge-worker.timer")], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)), cwd=units)
    assert result.returncode == 0, result.stdout + result.stderr


def test_launchd_plist_parses_and_runs_the_worker_every_60_s_with_a_path(fake_bins, monkeypatch):
    data = plistlib.loads(schedule.plist())
    assert data["StartInterval"] == 60 and data["ProgramArguments"][1] == str(ROOT / "worker.py")
    assert all(Path(arg).is_absolute() for arg in data["ProgramArguments"])
    assert Path(data["WorkingDirectory"]).is_absolute() and "/usr/bin" in data["EnvironmentVariables"]["PATH"]


def test_schedule_status_from_the_command_line(fake_bins, tmp_path, monkeypatch, capsys):
    bins, _ = fake_bins
    stand_in_loginctl(bins, "no")
    monkeypatch.setattr(schedule.platform, "system", lambda: "Linux")
    monkeypatch.setenv("SYSTEMD_USER_DIR", str(tmp_path / "units"))
    assert schedule.main(["status"]) == 0
    assert "loginctl enable-linger" in capsys.readouterr().out


def test_status_on_macos_reads_launchctl_print(fake_bins, tmp_path, monkeypatch):
    bins, _ = fake_bins
    fake_binary(bins, "launchctl",
        "[ \"$1\" = print ] && printf 'gui/501/com.taskbridge.worker = {\\n\\tstate = not running\\n"
        "\\truns = 14\\n\\tlast exit code = 1\\n}\\n'\nexit 0\n")
    monkeypatch.setattr(schedule.platform, "system", lambda: "Darwin")
    monkeypatch.setenv("LAUNCH_AGENTS_DIR", str(tmp_path / "agents"))
    schedule.install()
    text = schedule.status()
    assert f"installed at {tmp_path / 'agents' / 'com.taskbridge.worker.plist'}" in text
    assert "last exit code = 1" in text and "runs = 14" in text and "linger" not in text


def test_a_postgresql_queue_is_carried_without_its_password(fake_bins, tmp_path, monkeypatch):
    """A job file is a file others may read: the URL goes in without its password, which the
    job's libpq reads from ~/.pgpass; the machine's host name goes with it."""
    monkeypatch.setenv("TASK_DB_URL", "postgresql://tb:hunter2-pw@db.example:5432/queue")
    monkeypatch.setenv("TASKBRIDGE_HOST", "build-1")
    monkeypatch.setattr(schedule.platform, "system", lambda: "Linux")
    env = schedule.job_env()
    assert env["TASK_DB_URL"] == "postgresql://tb@db.example:5432/queue" and env["TASKBRIDGE_HOST"] == "build-1"
    assert "hunter2-pw" not in schedule.service_unit() + schedule.cron_line() + schedule.plist().decode()
