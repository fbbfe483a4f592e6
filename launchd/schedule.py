"""Install, show or remove the schedule that fires one TaskBridge worker pass every 60 s.

    python launchd/schedule.py show        print what would be installed here
    python launchd/schedule.py install     macOS: a launchd agent; Linux: a systemd user timer;
                                           elsewhere: print a cron line to add by hand
    python launchd/schedule.py uninstall

launchd and systemd start jobs with a bare PATH (/usr/bin:/bin:/usr/sbin:/sbin), so the
generated job carries absolute paths of python, worker.py and opencode, and the PATH of the
shell that installed it.

Env: TASK_DB_PATH, TASK_LOG_DIR (baked into the job), OPENCODE_BIN, LAUNCH_AGENTS_DIR and
SYSTEMD_USER_DIR (where the files go; defaults ~/Library/LaunchAgents, ~/.config/systemd/user).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

import opencode_runner  # noqa: E402
import task_store  # noqa: E402

LABEL = "com.taskbridge.worker"
UNIT = "taskbridge-worker"


def values() -> dict[str, str]:
    """The absolute paths baked into a generated job. Raises OpencodeNotFound."""
    opencode = opencode_runner.opencode_bin()
    path_dirs = [str(Path(opencode).parent), str(Path(sys.executable).parent)]
    path_dirs += [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in path_dirs]
    return {
        "label": LABEL, "python": sys.executable, "worker": str(REPO / "worker.py"), "repo": str(REPO),
        "path": os.pathsep.join(path_dirs), "opencode": opencode,
        "db": str(task_store.db_path()), "logs": str(task_store.log_dir()),
    }


def render(template: str) -> str:
    """A template from this folder with the paths filled in."""
    return (HERE / template).read_text().format(**values())


def launch_agent_path() -> Path:
    root = os.environ.get("LAUNCH_AGENTS_DIR") or str(Path.home() / "Library" / "LaunchAgents")
    return Path(root) / f"{LABEL}.plist"


def systemd_dir() -> Path:
    return Path(os.environ.get("SYSTEMD_USER_DIR") or Path.home() / ".config" / "systemd" / "user")


def cron_line() -> str:
    v = values()
    return (f"* * * * * cd {v['repo']} && PATH={v['path']} OPENCODE_BIN={v['opencode']} "
            f"TASK_DB_PATH={v['db']} {v['python']} {v['worker']} >> {v['logs']}/worker.cron.log 2>&1")


def install() -> str:
    """Write and load the job for this platform; returns what was done."""
    Path(values()["logs"]).mkdir(parents=True, exist_ok=True)
    if platform.system() == "Darwin":
        plist = launch_agent_path()
        plist.parent.mkdir(parents=True, exist_ok=True)
        plist.write_text(render("com.taskbridge.worker.plist.template"))
        domain = f"gui/{os.getuid()}"
        subprocess.run(["launchctl", "bootout", f"{domain}/{LABEL}"], capture_output=True)
        subprocess.run(["launchctl", "bootstrap", domain, str(plist)], check=True)
        return f"launchd agent {LABEL} loaded from {plist}"
    if shutil.which("systemctl"):
        unit_dir = systemd_dir()
        unit_dir.mkdir(parents=True, exist_ok=True)
        (unit_dir / f"{UNIT}.service").write_text(render("taskbridge-worker.service.template"))
        shutil.copy(HERE / "taskbridge-worker.timer", unit_dir / f"{UNIT}.timer")
        subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "--user", "enable", "--now", f"{UNIT}.timer"], check=True)
        return f"systemd user timer {UNIT}.timer enabled from {unit_dir}"
    return "no launchd or systemd here; add this line with `crontab -e`:\n" + cron_line()


def uninstall() -> str:
    """Unload and remove the job; returns what was done."""
    if platform.system() == "Darwin":
        subprocess.run(["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"], capture_output=True)
        launch_agent_path().unlink(missing_ok=True)
        return f"launchd agent {LABEL} removed"
    if shutil.which("systemctl"):
        subprocess.run(["systemctl", "--user", "disable", "--now", f"{UNIT}.timer"], capture_output=True)
        for suffix in ("service", "timer"):
            (systemd_dir() / f"{UNIT}.{suffix}").unlink(missing_ok=True)
        return f"systemd user timer {UNIT}.timer removed"
    return "nothing installed here (remove the cron line by hand)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["show", "install", "uninstall"])
    args = parser.parse_args(argv)
    try:
        if args.action == "show":
            print(render("com.taskbridge.worker.plist.template") if platform.system() == "Darwin"
                  else render("taskbridge-worker.service.template") + "\n# cron instead:\n# " + cron_line())
        else:
            print(install() if args.action == "install" else uninstall())
    except opencode_runner.OpencodeNotFound as exc:
        print(f"schedule: {exc}", file=sys.stderr)
        return 1
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"schedule: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
