"""TaskBridge's own git commands on a developer's machine set up the way real ones are: a global
git configuration that signs commits with a key the worker cannot use, hooks that reopen the
terminal, colour and diff settings that reshape `git diff`, an identity with only an email and
`user.useConfigOnly`. Each test drives a real worker pass with the real opencode and the scripted
model, in a real repository, and checks the task is done, committed and its diff applies."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

import task_store
from fake_openai import text, tool_call
from helpers import checkout_state, fake_binary, make_repo, normal_user, run_script, run_task, tagged

pytestmark = pytest.mark.real_opencode
BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)
DONE = '```json\n{"summary": "added notes", "files_touched": ["notes.txt"], "tests_run": [], "open_questions": []}\n```'


def clean_git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """git with no user configuration at all: how the test itself looks at results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-c", "user.name=Test", "-c", "user.email=test@example.com", *args],
                          cwd=cwd, env=env, check=check, capture_output=True, text=True)


def hostile_config(tmp_path: Path) -> tuple[Path, Path]:
    """A global git config as found on real machines (and a log file its programs write to
    when they run, with the run marker of the agent whose git ran them, or "none": TaskBridge's
    own). Returns (config file, log file)."""
    tools, hooks = tmp_path / "user-tools", tmp_path / "user-hooks"
    ran = tmp_path / "user-programs-ran.log"
    external = fake_binary(tools, "external-diff",
                           f"echo external-diff run=${{TASKBRIDGE_RUN:-none}} >> {ran}\necho 'EXTERNAL DIFF OUTPUT'\n")
    fsmonitor = fake_binary(tools, "fsmonitor", f"echo fsmonitor run=${{TASKBRIDGE_RUN:-none}} >> {ran}\nsleep 30\n")
    for hook in ("pre-commit", "prepare-commit-msg", "commit-msg", "post-commit", "post-checkout",
                 "reference-transaction"):
        # What commit-message helpers install: reopen the terminal (fails without one).
        fake_binary(hooks, hook, f"echo {hook} run=${{TASKBRIDGE_RUN:-none}} >> {ran}\nexec < /dev/tty\nexit 1\n")
    config = tmp_path / "hostile.gitconfig"
    config.write_text(f"""\
[user]
\temail = dev@example.com
\tuseConfigOnly = true
\tsigningkey = DEADBEEFDEADBEEF
[commit]
\tgpgsign = true
[tag]
\tgpgsign = true
[gpg]
\tprogram = {tools}/no-such-gpg
[core]
\thooksPath = {hooks}
\tpager = less -R
\teditor = vim
\tfsmonitor = {fsmonitor}
[color]
\tui = always
\tdiff = always
[diff]
\tnoprefix = true
\tmnemonicPrefix = true
\texternal = {external}
\trelative = true
[status]
\tshowUntrackedFiles = no
[gc]
\tauto = 1
""")
    return config, ran


def applies_to_fresh_clone(repo: Path, base: str, diff: str, tmp_path: Path) -> Path:
    """Clone `repo`, check out `base`, apply `diff` with plain `git apply`; returns the clone."""
    clone = tmp_path / "fresh-clone"
    clean_git(tmp_path, "clone", "-q", str(repo), str(clone))
    clean_git(clone, "checkout", "-q", base)
    patch = tmp_path / "receipt.diff"
    patch.write_text(diff)
    check = clean_git(clone, "apply", "--check", str(patch), check=False)
    assert check.returncode == 0, check.stderr
    clean_git(clone, "apply", str(patch))
    return clone


def test_hostile_global_git_config_does_not_reach_taskbridges_git(opencode, tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", {"README.md": "# demo\n", "src/app.py": "print('hi')\n"})
    before = checkout_state(repo)
    config, ran = hostile_config(tmp_path)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("TASKBRIDGE_GIT_TIMEOUT_SEC", "60")
    opencode.model.script("notes", [
        tool_call("write", {"filePath": "{cwd}/notes.txt", "content": "first line\nsecond line\n"}),
        tool_call("edit", {"filePath": "{cwd}/app.py", "oldString": "print('hi')",
                           "newString": "print('hello')"}),
        text("Done.\n" + DONE),
    ])
    task = task_store.submit_task(title="notes", instructions="Write notes. SCRIPT:notes",
                                  working_dir=str(repo / "src"), max_retries=2)
    result = run_script("worker.py")
    assert result.returncode == 0, result.stderr

    final = task_store.get_task(task["id"])
    assert final["status"] == "done", final["error"]
    assert final["attempts"] == 1
    receipt = final["result"]
    branch = f"taskbridge/{task['id']}"
    assert receipt["commit"] == clean_git(repo, "rev-parse", branch).stdout.strip()
    raw = clean_git(repo, "cat-file", "commit", receipt["commit"]).stdout
    assert "gpgsig" not in raw, "TaskBridge's commit was not signed"
    author = clean_git(repo, "log", "-1", "--format=%an <%ae>", branch).stdout.strip()
    assert author == "TaskBridge <dev@example.com>", "the user's email is kept, the missing name filled in"
    ours = [line for line in (ran.read_text() if ran.exists() else "").splitlines() if "run=none" in line]
    assert ours == [], "TaskBridge's own git ran the user's programs"

    diff = final["diff"]
    assert "\x1b[" not in diff and "EXTERNAL DIFF OUTPUT" not in diff
    assert "--- a/src/app.py\n+++ b/src/app.py" in diff and "+++ b/src/notes.txt" in diff
    assert sorted(receipt["files_touched"]) == ["src/app.py", "src/notes.txt"]
    clone = applies_to_fresh_clone(repo, receipt["base_commit"], diff, tmp_path)
    assert (clone / "src/notes.txt").read_text() == "first line\nsecond line\n"
    assert (clone / "src/app.py").read_text() == "print('hello')\n"

    assert receipt["worktree_removed"] is True and not Path(receipt["worktree_path"]).exists()
    monkeypatch.delenv("GIT_CONFIG_GLOBAL")
    assert checkout_state(repo) == before
    assert tagged() == []


def _lock_the_index(cwd: str | None) -> None:
    """Another git process's index.lock in the worktree ``cwd``, made by the test itself (on a
    kept server the agent's own git has an index of its own, and the worktree's is not its to lock)."""
    assert cwd is not None
    lock = subprocess.run(["git", "-C", cwd, "rev-parse", "--git-path", "index.lock"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (Path(cwd) / lock).touch()


def test_a_failed_commit_after_a_successful_run_never_reruns_the_agent(opencode, tmp_path):
    """Git refuses the commit (another git process's index.lock in the worktree): the receipt
    is stored, the failing step named, the worktree kept, and the paid run is not repeated."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("locked", [
        tool_call("write", {"filePath": "{cwd}/notes.txt", "content": "the agent's work\n"}),
        text("Done.\n" + DONE, before=_lock_the_index),   # the agent's tools have run: git is busy now
    ])
    task = task_store.submit_task(title="locked", instructions="SCRIPT:locked", working_dir=str(repo),
                                  max_retries=3)
    assert run_script("worker.py").returncode == 0
    assert run_script("worker.py").returncode == 0   # a later pass finds nothing to rerun
    final = task_store.get_task(task["id"])
    assert final["status"] == "failed" and final["attempts"] == 1
    assert final["error"].startswith("the agent finished, but the commit failed")
    assert "index.lock" in final["error"] and "not run again" in final["error"]
    receipt = final["result"]
    assert receipt["summary"] == "added notes" and receipt["worktree_kept"] is True
    assert "the agent's work" in final["diff"]
    worktree = Path(receipt["worktree_path"])
    assert (worktree / "notes.txt").read_text() == "the agent's work\n"
    assert len(opencode.model.step_requests("locked")) == 2, "one run of two model steps, no rerun"


def test_a_hanging_git_step_is_ended_with_its_tree_and_named(opencode, tmp_path, monkeypatch):
    """A clean filter (the repository's own setting) that hangs while the receipt is built:
    the git command and the filter it started are ended at TASKBRIDGE_GIT_TIMEOUT_SEC, the step
    is named, and the finished run is not repeated."""
    nonce = f"{random.randint(100000, 999999)}"
    repo = make_repo(tmp_path / "repo", {".gitattributes": "*.slow filter=slow\n", "README.md": "x\n"})
    clean_git(repo, "config", "filter.slow.clean", f"sleep 300.{nonce}")
    monkeypatch.setenv("TASKBRIDGE_GIT_TIMEOUT_SEC", "3")
    opencode.model.script("slowfilter", [
        tool_call("write", {"filePath": "{cwd}/data.slow", "content": "payload\n"}),
        text("Done.\n" + DONE),
    ])
    final = run_task("slowfilter", str(repo), title="slow", max_retries=2)
    assert final["status"] == "failed" and final["attempts"] == 1
    assert "the agent finished, but building the receipt" in final["error"]
    assert "git add -A . was ended with its process tree: did not finish in 3 s" in final["error"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", f"300.{nonce}"]]
    assert len(opencode.model.step_requests("slowfilter")) == 2


# Never in place by accident: only a folder git says is outside every repository runs in place.


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_repository_of_another_user_fails_at_once_with_the_safe_directory_fix(opencode, tmp_path, monkeypatch):
    """git refuses a repository owned by another user ("dubious ownership"): the task must not
    run in place in that checkout, must not be retried, and names git's reason and the fix. Once
    the user marks it safe (their own decision, never TaskBridge's) it runs in a worktree."""
    user = normal_user()
    if user is None:
        pytest.skip("needs root to make a repository owned by another user")
    monkeypatch.delenv("SUDO_UID", raising=False)   # git trusts the sudo caller's repositories
    repo = make_repo(tmp_path / "theirs")
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(repo)], check=True)
    global_config = tmp_path / "global.gitconfig"
    global_config.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(global_config))
    before = files_of(repo)
    opencode.model.script("theirs", [tool_call("write", {"filePath": "{cwd}/x.txt", "content": "x\n"}),
                                     text("Done.\n" + DONE)])
    final = run_task("theirs", str(repo), max_retries=2)
    assert final["status"] == "failed" and final["attempts"] == 1
    assert "belongs to another user" in final["error"] and "dubious ownership" in final["error"]
    assert "git config --global --add safe.directory" in final["error"]
    assert opencode.model.step_requests("theirs") == [], "the agent never ran"
    assert files_of(repo) == before

    global_config.write_text(f"[safe]\n\tdirectory = {repo}\n")
    done = run_task("theirs", str(repo))
    assert done["status"] == "done", done["error"]
    assert done["result"]["isolation"] == "worktree" and done["result"]["files_touched"] == ["x.txt"]
    assert not (repo / "x.txt").exists(), "the work went to a worktree, not into their checkout"


@pytest.mark.parametrize("where", ["bare", "git-folder", "broken-head"])
def test_a_folder_git_will_not_work_in_never_runs_in_place(opencode, tmp_path, where):
    if where == "bare":
        folder = tmp_path / "project.git"
        clean_git(tmp_path, "init", "-q", "--bare", str(folder))
        expected = "bare repository"
    elif where == "git-folder":
        folder = make_repo(tmp_path / "repo") / ".git"
        expected = "bare repository or inside a .git folder"
    else:
        repo = make_repo(tmp_path / "repo")
        (repo / ".git" / "HEAD").write_text("garbage\n")
        folder = repo
        expected = "git does not read"
    before = files_of(folder)
    opencode.model.script("nowhere", [tool_call("write", {"filePath": "{cwd}/x.txt", "content": "x\n"}),
                                      text("Done.\n" + DONE)])
    final = run_task("nowhere", str(folder), max_retries=2)
    assert final["status"] == "failed" and final["attempts"] == 1, final["error"]
    assert expected in final["error"] and "not run in place" in final["error"] or \
        "use one of its worktrees" in final["error"], final["error"]
    assert opencode.model.step_requests("nowhere") == []
    assert files_of(folder) == before


def test_submodules_are_checked_out_from_local_clones_or_the_receipt_says_why(opencode, tmp_path):
    libs = {}
    for name in ("core", "extra"):
        libs[name] = make_repo(tmp_path / f"lib-{name}", {"VERSION": f"{name} 1.0\n"})
    repo = make_repo(tmp_path / "repo")
    for name, lib in libs.items():
        clean_git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), f"libs/{name}")
    clean_git(repo, "commit", "-q", "-m", "submodules")
    # "extra" was never fetched into this checkout: no local clone to take it from.
    clean_git(repo, "submodule", "deinit", "-q", "-f", "libs/extra")
    shutil.rmtree(repo / ".git" / "modules" / "libs" / "extra")
    for lib in libs.values():
        shutil.rmtree(lib)    # the "remote" is gone: a network fetch would fail
    config_before = clean_git(repo, "config", "--list", "--local").stdout
    opencode.model.script("subs", [
        tool_call("bash", {"command": "cat libs/core/VERSION > SEEN.txt; ls -A libs/extra | wc -l >> SEEN.txt",
                           "description": "look"}),
        text("Done.\n" + DONE),
    ])
    final = run_task("subs", str(repo))
    assert final["status"] == "done", final["error"]
    receipt = final["result"]
    assert receipt["submodules"]["initialised"] == ["libs/core"]
    [missing] = receipt["submodules"]["not_initialised"]
    assert missing["path"] == "libs/extra" and "no local copy" in missing["why"]
    assert receipt["files_touched"] == ["SEEN.txt"]
    assert "+core 1.0\n+0\n" in final["diff"], "core checked out for the agent; extra left empty"
    assert receipt["worktree_removed"] is True and not Path(receipt["worktree_path"]).exists()
    assert clean_git(repo, "config", "--list", "--local").stdout == config_before, "the user's config untouched"


def test_a_title_with_control_characters_makes_one_plain_commit_subject(opencode, tmp_path):
    """A fresh user's finding: a title's ESC and BEL reached the task branch's commit message raw,
    and `git log` in a terminal played them; a line break ended the subject early. The subject is
    one line with the characters shown as escapes; the receipt still comes from that commit."""
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("ctl", [tool_call("write", {"filePath": "{cwd}/notes.txt", "content": "x\n"}),
                                  text("Wrote \x1b]0;pwned\x07 it.\n" + DONE)])
    task = run_task("ctl", str(repo), title="ctl \x1b[31mred\x07\nsecond line")
    assert task["status"] == "done", task["error"]
    message = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%B", task["branch"]],
                             capture_output=True, text=True, check=True).stdout
    assert message.splitlines()[0] == f"taskbridge {task['id']}: ctl \\x1b[31mred\\x07 second line", message
    assert "\x1b" not in message and "\x07" not in message, message
