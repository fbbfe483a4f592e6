"""The git guard (issue 19, point 3): TaskBridge's own git never runs what a run planted in the
files that configure it. The real `opencode` makes the scripted model's write-tool calls (approved
by --auto, the OS box turned off with TASKBRIDGE_SANDBOX=off: this is the layer behind it); the
planted command would write a canary file each time it ran."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import task_store
import worktrees
from fake_openai import text, tool_call
from helpers import git, make_repo, run_script, submit

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT = '```json\n{"summary": "Wrote hello.txt", "files_touched": ["hello.txt"], ' \
          '"tests_run": [], "open_questions": []}\n```'


@pytest.fixture
def unboxed(monkeypatch):
    monkeypatch.setenv("TASKBRIDGE_SANDBOX", "off")


def _filter(canary: Path) -> str:
    """A filter section whose programs append to ``canary`` (and pass the content through)."""
    run = f"sh -c 'echo ran >> {canary}; cat'"
    return f'[filter "x"]\n\tclean = "{run}"\n\tsmudge = "{run}"\n'


def _pass(opencode, repo: Path, name: str, steps: list) -> tuple[dict, str]:
    """Queue a task on ``repo`` scripted with ``steps`` (then the receipt), run one worker pass;
    return the task as stored and the worker's output."""
    opencode.model.script(name, [*steps, text("Done.\n" + RECEIPT)])
    task = submit(repo, script=name)
    passed = run_script("worker.py")
    assert passed.returncode == 0, passed.stderr
    return task_store.get_task(task["id"]), passed.stdout + passed.stderr


def _hello() -> dict:
    return tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello from the agent\n"})


def _assert_work_committed(repo: Path, task: dict) -> None:
    assert task["status"] == "done", task["error"]
    assert "hello from the agent" in task["diff"]
    branch = f"taskbridge/{task['id']}"
    assert git(repo, "show", f"{branch}:hello.txt") == "hello from the agent"
    assert task["result"]["commit"] == git(repo, "rev-parse", branch)


@pytest.mark.real_opencode
def test_filter_planted_in_main_config_never_runs(opencode, tmp_path, unboxed):
    repo = make_repo(tmp_path / "repo")
    config = repo / ".git" / "config"
    before = config.read_bytes()
    canary = tmp_path / "canary"
    task, said = _pass(opencode, repo, "plant-filter", [
        tool_call("write", {"filePath": str(config), "content": before.decode() + _filter(canary)}),
        tool_call("write", {"filePath": "{cwd}/.gitattributes", "content": "* filter=x\n"}),
        _hello(),
    ])
    assert not canary.exists(), canary.read_text()
    assert config.read_bytes() == before
    _assert_work_committed(repo, task)
    planted = task["result"]["git_planted"]
    assert [(p["file"], p["change"]) for p in planted] == [(str(config), "changed")]
    assert '[filter "x"]' in planted[0]["planted"] and str(canary) in planted[0]["planted"]
    assert "1 change(s) the run made were undone" in task["result"]["sandbox"]["git config"]
    assert f"undid git configuration the run planted: {config} changed" in said


@pytest.mark.real_opencode
@pytest.mark.parametrize("where", ["in-place", "remote"])
def test_filter_planted_in_place_or_in_a_remote_tasks_mirror_never_runs(opencode, tmp_path, unboxed, where):
    """In place, the run's own repository's config; for a task on a remote, the worker's mirror."""
    repo = make_repo(tmp_path / "repo")
    if where == "remote":
        bare = tmp_path / "remote.git"
        git(tmp_path, "clone", "-q", "--bare", str(repo), str(bare))
        config = worktrees.sync_mirror(str(bare))[0] / "config"
        fields = {"repo": str(bare)}
    else:
        config, fields = repo / ".git" / "config", {"working_dir": str(repo), "worktree": False}
    before = config.read_bytes()
    canary = tmp_path / "canary"
    name = f"plant-{where}"
    opencode.model.script(name, [
        tool_call("write", {"filePath": str(config), "content": before.decode() + _filter(canary)}),
        tool_call("write", {"filePath": "{cwd}/.gitattributes", "content": "* filter=x\n"}),
        _hello(), text("Done.\n" + RECEIPT)])
    task = task_store.submit_task(title=name, instructions=f"SCRIPT:{name}", **fields)
    assert run_script("worker.py").returncode == 0
    task = task_store.get_task(task["id"])
    assert not canary.exists(), canary.read_text()
    assert config.read_bytes() == before
    assert task["status"] == "done", task["error"]
    assert "hello from the agent" in task["diff"]
    assert [(p["file"], p["change"]) for p in task["result"]["git_planted"]] == [(str(config), "changed")]
    if where == "remote":
        assert git(bare, "show", f"{task['pushed_branch']}:hello.txt") == "hello from the agent"


@pytest.mark.real_opencode
def test_include_planted_in_an_included_file_never_runs(opencode, tmp_path, unboxed):
    """The user's config includes a file of theirs; the run adds to it an include of a file in
    its worktree that defines the filter. .git/config itself is untouched."""
    repo = make_repo(tmp_path / "repo")
    team = tmp_path / "team.gitconfig"
    team.write_text("[core]\n\tautocrlf = false\n")
    git(repo, "config", "include.path", str(team))
    config_before, team_before = (repo / ".git" / "config").read_bytes(), team.read_bytes()
    canary = tmp_path / "canary"
    task, _ = _pass(
        opencode,
        repo,
        "plant-include",
        [
            tool_call("write", {"filePath": "{cwd}/evil.cfg", "content": _filter(canary)}),
            tool_call(
                "write",
                {"filePath": str(team), "content": team_before.decode() + "[include]\n\tpath = {cwd}/evil.cfg\n"},
            ),
            tool_call("write", {"filePath": "{cwd}/.gitattributes", "content": "* filter=x\n"}),
            _hello(),
        ],
    )
    assert not canary.exists(), canary.read_text()
    assert team.read_bytes() == team_before and (repo / ".git" / "config").read_bytes() == config_before
    _assert_work_committed(repo, task)
    planted = task["result"]["git_planted"]
    assert [(p["file"], p["change"]) for p in planted] == [(str(team), "changed")]
    assert "evil.cfg" in planted[0]["planted"]


@pytest.mark.real_opencode
def test_rewritten_git_pointer_never_runs(opencode, tmp_path, unboxed):
    """The run points its worktree's .git file at a repository it wrote itself (a config with
    the filter, the real objects through alternates, the branch at the base commit)."""
    repo = make_repo(tmp_path / "repo")
    canary, evil = tmp_path / "canary", tmp_path / "evil-gitdir"
    head = git(repo, "rev-parse", "HEAD")
    task, _ = _pass(opencode, repo, "plant-pointer", [
        tool_call("write", {"filePath": str(evil / "HEAD"), "content": "ref: refs/heads/main\n"}),
        tool_call("write", {"filePath": str(evil / "config"),
                            "content": "[core]\n\trepositoryformatversion = 0\n\tbare = false\n" + _filter(canary)}),
        tool_call("write", {"filePath": str(evil / "objects" / "info" / "alternates"),
                            "content": f"{repo / '.git' / 'objects'}\n"}),
        tool_call("write", {"filePath": str(evil / "refs" / "heads" / "main"), "content": head + "\n"}),
        tool_call("write", {"filePath": "{cwd}/.git", "content": f"gitdir: {evil}\n"}),
        tool_call("write", {"filePath": "{cwd}/.gitattributes", "content": "* filter=x\n"}),
        _hello(),
    ])
    assert not canary.exists(), canary.read_text()
    _assert_work_committed(repo, task)
    planted = task["result"]["git_planted"]
    assert [(Path(p["file"]).name, p["change"]) for p in planted] == [(".git", "changed")]
    assert planted[0]["planted"] == f"gitdir: {evil}"


@pytest.mark.real_opencode
def test_users_own_filter_still_applies(opencode, tmp_path, unboxed):
    """A filter the user defined before the run (git-crypt style: clean on add) is theirs: it
    still shapes TaskBridge's commit, and nothing is reported as planted."""
    repo = make_repo(tmp_path / "repo", {"README.md": "# demo\n", ".gitattributes": "*.txt filter=redact\n"})
    git(repo, "config", "filter.redact.clean", "sed s/secret/REDACTED/")
    git(repo, "config", "filter.redact.smudge", "cat")
    task, _ = _pass(opencode, repo, "own-filter", [
        tool_call("write", {"filePath": "{cwd}/hello.txt", "content": "hello from the agent, secret\n"}),
    ])
    assert task["status"] == "done", task["error"]
    assert git(repo, "show", f"taskbridge/{task['id']}:hello.txt") == "hello from the agent, REDACTED"
    assert task["result"]["git_planted"] == []
    assert "none had changed" in task["result"]["sandbox"]["git config"]


# The snapshot and compare functions on a real repository, without an agent.

def _workspace(tmp_path: Path) -> tuple[Path, worktrees.Workspace]:
    repo = make_repo(tmp_path / "repo")
    ws = worktrees.Workspace("in-place", str(repo), top=str(repo), repo=str(repo))
    worktrees.pin_git_config(ws)
    return repo, ws


def test_pin_lists_the_files_git_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    repo = make_repo(tmp_path / "repo")
    (tmp_path / "a.cfg").write_text("[include]\n\tpath = b.cfg\n")
    git(repo, "config", "includeIf.gitdir:/nowhere/.path", str(tmp_path / "a.cfg"))
    git(repo, "config", "core.attributesFile", "~/attrs")
    ws = worktrees.Workspace("in-place", str(repo), top=str(repo), repo=str(repo))
    worktrees.pin_git_config(ws)
    pinned = set(ws.git_pin)
    for expected in (repo / ".git" / "config", repo / ".git" / "info" / "attributes", repo / ".git" / "commondir",
                     tmp_path / "a.cfg", tmp_path / "b.cfg", tmp_path / "home" / "attrs",
                     tmp_path / "home" / ".gitconfig", tmp_path / "xdg" / "git" / "config"):
        assert str(expected) in pinned, expected
    assert ws.git_pin[str(tmp_path / "b.cfg")] == ("absent",)


def test_undo_puts_back_files_links_and_removes_new_ones(tmp_path):
    repo, ws = _workspace(tmp_path)
    config = repo / ".git" / "config"
    before = config.read_bytes()
    config.write_bytes(before + b"[core]\n\tsshCommand = touch /tmp/x\n")
    attributes = repo / ".git" / "info" / "attributes"
    attributes.mkdir(parents=True)          # a folder where a file may go: removed
    (repo / ".git" / "commondir").symlink_to("/elsewhere")
    planted = worktrees.undo_planted_git(ws)
    assert config.read_bytes() == before
    assert not attributes.exists() and not os.path.lexists(repo / ".git" / "commondir")
    assert {p["change"] for p in planted} == {"changed", "created (a folder)", "created (a link)"}
    assert worktrees.undo_planted_git(ws) == []


def test_undo_that_cannot_be_done_stops_naming_the_file(tmp_path):
    repo, ws = _workspace(tmp_path)
    dot_git = repo / ".git"
    os.rename(dot_git, tmp_path / "moved")
    dot_git.write_text("gitdir: /tmp/evil\n")
    with pytest.raises(worktrees.GitPlanted) as caught:
        worktrees.undo_planted_git(ws)
    assert f"{dot_git} replaced (a folder before, a file now)" in str(caught.value)
    assert "no further git command was run" in str(caught.value)


@pytest.mark.parametrize("put_there", ["link to the checkout", "a folder of its own", "nothing"])
def test_a_task_folder_put_out_of_place_stops_all_git_there(tmp_path, put_there):
    """A hostile tester's finding: a kept server's box may write the folder around the worktree,
    and the agent renamed its worktree away and put a link to the user's checkout (or a repository
    of its own, with a filter) in its place; TaskBridge's git then committed the user's uncommitted
    work on their own branch (or ran the filter as the worker). The folder is checked by identity
    before any git runs there, and a link is never followed when a worktree is removed."""
    repo = make_repo(tmp_path / "repo")
    (repo / "README.md").write_text("the user's own edit\n")
    top = tmp_path / "slot" / "repo"
    top.parent.mkdir()
    git(repo, "worktree", "add", "-q", "--detach", str(top))
    ws = worktrees.Workspace("worktree", str(top), top=str(top), repo=str(repo))
    worktrees.pin_git_config(ws)
    os.rename(top, tmp_path / "slot" / "repo.orig")
    if put_there == "link to the checkout":
        top.symlink_to(repo)
    elif put_there == "a folder of its own":
        make_repo(top)
    with pytest.raises(worktrees.FolderReplaced) as caught:
        worktrees.undo_planted_git(ws)
    said = str(caught.value)
    assert "replaced the task's folder" in said and "committed nothing" in said
    assert ("a link to" in said) == (put_there == "link to the checkout")
    assert git(repo, "status", "--porcelain") == "M README.md"
    if put_there == "link to the checkout":
        mode = os.stat(repo).st_mode
        assert worktrees._force_rmtree(str(top)) == [] and not os.path.lexists(top)
        assert (repo / "README.md").read_text() == "the user's own edit\n" and os.stat(repo).st_mode == mode


def test_what_a_run_left_around_its_worktree_in_a_kept_servers_folder_goes_with_it(tmp_path):
    """A hostile tester's finding: files, folders and links a warm run wrote beside its worktree
    (the slot's folder is writable to it) stayed forever, reported nowhere. They go when the
    task's worktree is removed, links removed and never followed; a link left where the worktree
    was goes the same way."""
    repo = make_repo(tmp_path / "repo")
    for swapped in (False, True):
        slot = worktrees.worktree_root() / "engine" / f"slot_0-{int(swapped)}"
        slot.mkdir(parents=True)
        top = worktrees.parked_path(slot, str(repo))
        git(repo, "worktree", "add", "-q", "--detach", str(top))
        (slot / "litter.txt").write_text("x\n")
        (slot / "evil" / "deep").mkdir(parents=True)
        (slot / "evil" / "deep").chmod(0o555)
        (slot / "link").symlink_to(repo)
        if swapped:
            os.rename(top, slot / "repo.orig")
            top.symlink_to(repo)
        assert worktrees.remove_worktree_at(str(top)) is None
        assert not slot.exists()
        assert (repo / "README.md").read_text() == "# demo\n" and (repo / ".git").is_dir()
    assert not (worktrees.worktree_root() / "engine").exists()
