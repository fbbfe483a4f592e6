"""The listing of a folder run in place outside git (what files_touched is observed from) and the
readonly snapshot beside it: real folders, real files, FIFOs and links, and the run's own tricks
(a mtime set back, a folder 1,000 deep, the folder itself swapped for a link)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import task_store
import worktrees
from helpers import make_repo, submit


def prepared(folder: Path) -> worktrees.Workspace:
    """The workspace of a task queued and claimed in ``folder`` (in place: it is outside git)."""
    submit(folder)
    return worktrees.prepare_workspace(task_store.claim_next("test"), resume=False)


def deep_folder(base: Path, levels: int) -> Path:
    """``levels`` nested folders under ``base``, made one by one (os.makedirs itself recurses)."""
    path = str(base)
    for _ in range(levels):
        path = os.path.join(path, "d")
        os.mkdir(path)
    return Path(path)


def remove_deep(base: Path) -> None:
    """Remove what deep_folder made, deepest first (shutil.rmtree recurses on Python 3.11)."""
    paths, path = [], str(base)
    while os.path.isdir(os.path.join(path, "d")):
        path = os.path.join(path, "d")
        paths.append(path)
    for each in reversed(paths):
        for name in os.listdir(each):
            os.unlink(os.path.join(each, name))
        os.rmdir(each)


def test_same_size_write_with_its_mtime_set_back_is_a_change(tmp_path, monkeypatch):
    """A run that writes a file's size again and sets its mtime back (touch -r, os.utime with
    ns) cannot set back its ctime or inode: the file is read again (hashed, or unhashed compared
    by ctime and inode) and listed; untouched files stay out."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("hashed.txt", "swapped.txt", "kept.txt"):
        (plain / name).write_text("aaaa\n")
    ws = prepared(plain)
    for name in ("hashed.txt", "swapped.txt"):
        was = os.stat(plain / name)
        if name == "hashed.txt":
            (plain / name).write_text("bbbb\n")
        else:   # a new file (a new inode) moved over it
            (tmp_path / "new").write_text("cccc\n")
            os.replace(tmp_path / "new", plain / name)
        os.utime(plain / name, ns=(was.st_atime_ns, was.st_mtime_ns))
        assert os.stat(plain / name).st_mtime_ns == was.st_mtime_ns
    assert worktrees.observed_changes(ws) == (["hashed.txt", "swapped.txt"], "")

    monkeypatch.setattr(worktrees, "LISTING_READ_BYTES", 0)   # nothing hashed: stat alone must tell
    (plain / "hashed.txt").write_text("aaaa\n")
    ws = prepared(plain)
    was = os.stat(plain / "hashed.txt")
    (plain / "hashed.txt").write_text("dddd\n")
    os.utime(plain / "hashed.txt", ns=(was.st_atime_ns, was.st_mtime_ns))
    assert worktrees.observed_changes(ws)[0] == ["hashed.txt"]


def test_a_folder_1000_deep_is_not_compared_and_says_so_rather_than_crashing(tmp_path):
    """os.walk recursed: a folder ~1,000 deep raised RecursionError in the listing before the run
    (every retry there failed) and after it (the receipt was lost), and in the readonly snapshot.
    Walked with a stack now, past WALK_DEPTH_MAX levels it falls back to the tools' word, said."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("a\n")
    try:
        deep_folder(plain, 1000)
        ws = prepared(plain)
        assert ws.start_listing is None and ws.mode == "in-place"
        assert f"goes over {worktrees.WALK_DEPTH_MAX} folders deep" in ws.note and "write and edit tools" in ws.note
        assert worktrees.take_snapshot(str(plain)) is None
        assert worktrees.observed_changes(ws) == ([], "")
    finally:
        remove_deep(plain)

    ws = prepared(plain)   # shallow before the run; the run makes the deep tree
    assert ws.start_listing is not None
    try:
        deep_folder(plain, 1000)
        assert worktrees.observed_changes(ws) == ([], "")
        assert ws.start_listing is None
        assert f"after the run the folder goes over {worktrees.WALK_DEPTH_MAX} folders deep" in ws.note
    finally:
        remove_deep(plain)


def test_a_run_that_swaps_its_folder_for_a_link_or_floods_it_is_not_listed_whole(tmp_path, monkeypatch):
    """mv folder x; ln -s / folder: the listing after the run followed the link and listed the
    whole disk (it had no limit). Now the folder is opened without following a link and must be
    the one listed before; the listing after the run stops at LISTING_AFTER_MAX entries; each
    falls back to the tools' word and the receipt's isolation says why."""
    plain, elsewhere = tmp_path / "plain", tmp_path / "elsewhere"
    plain.mkdir()
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("s\n")
    (plain / "a.txt").write_text("a\n")
    ws = prepared(plain)
    plain.rename(tmp_path / "moved")
    plain.symlink_to(elsewhere)
    assert worktrees.observed_changes(ws) == ([], "") and ws.start_listing is None
    assert "no longer a folder but a link" in ws.note

    plain.unlink()
    plain.mkdir()   # another folder at its path
    ws = prepared(plain)
    plain.rename(tmp_path / "moved2")
    plain.mkdir()
    assert worktrees.observed_changes(ws) == ([], "") and "was replaced during the run" in ws.note

    monkeypatch.setattr(worktrees, "LISTING_AFTER_MAX", 20)
    ws = prepared(plain)
    for n in range(30):
        (plain / f"f{n}").write_text("x")
    assert worktrees.observed_changes(ws) == ([], "") and "holds over 20 entries" in ws.note


def test_a_readonly_revert_never_follows_the_folder_swapped_for_a_link(tmp_path):
    """The readonly revert removed what was not in the snapshot under the folder's path: with the
    folder swapped for a link, under what the link leads to. It reverts nothing there, and says so."""
    plain, elsewhere = tmp_path / "plain", tmp_path / "elsewhere"
    plain.mkdir()
    elsewhere.mkdir()
    (plain / "a.txt").write_text("a\n")
    (elsewhere / "yours.txt").write_text("keep me\n")
    snapshot = worktrees.take_snapshot(str(plain))
    plain.rename(tmp_path / "moved")
    plain.symlink_to(elsewhere)
    reverted, failed = worktrees.restore_snapshot(str(plain), snapshot)
    assert (elsewhere / "yours.txt").read_text() == "keep me\n" and not (elsewhere / "a.txt").exists()
    assert reverted == [] and failed == [".: nothing reverted: the folder is no longer a folder but a link or a "
                                         "file (the run replaced the folder itself)"]


def test_a_readonly_revert_is_whole_however_many_entries_the_run_made(tmp_path, monkeypatch):
    """A reviewer's finding: past LISTING_AFTER_MAX entries the revert reverted nothing at all,
    not even edits to files of the snapshot (an `npm install` makes that many): a readonly run
    could get out of its revert by making files."""
    monkeypatch.setattr(worktrees, "LISTING_MAX", 20)
    monkeypatch.setattr(worktrees, "LISTING_AFTER_MAX", 20)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("as it was\n")
    snapshot = worktrees.take_snapshot(str(plain))
    (plain / "a.txt").write_text("EDITED BY AGENT\n")
    (plain / "flood").mkdir()
    for n in range(30):
        (plain / "flood" / f"{n}.txt").write_text("x")
    reverted, failed = worktrees.restore_snapshot(str(plain), snapshot)
    assert failed == [] and "a.txt" in reverted and "flood/" in reverted
    assert (plain / "a.txt").read_text() == "as it was\n" and not (plain / "flood").exists()


def test_a_fifo_or_link_swapped_in_after_the_stat_is_neither_waited_on_nor_followed(tmp_path, monkeypatch):
    """The listing stat'ed a file, then opened it by name: a FIFO put there meanwhile hung the
    worker, a link was followed (a file swapped for a link to the same bytes read as no change).
    The stat is made to go stale here by the one who swaps; the open refuses both."""
    plain, outside = tmp_path / "plain", tmp_path / "outside.txt"
    plain.mkdir()
    (plain / "fifo.txt").write_text("same\n")
    (plain / "link.txt").write_text("same\n")
    outside.write_text("same\n")
    ws = prepared(plain)
    (tmp_path / "decoy").write_text("same\n")   # a regular file of the same size, newer
    stale = os.lstat(tmp_path / "decoy")
    os.unlink(plain / "fifo.txt")
    os.mkfifo(plain / "fifo.txt")
    os.unlink(plain / "link.txt")
    os.symlink(outside, plain / "link.txt")
    real_lstat = os.lstat

    def swapped(path, *args, **kw):   # the stat as it was an instant before the swap
        return stale if os.path.basename(path) in ("fifo.txt", "link.txt") else real_lstat(path, *args, **kw)

    monkeypatch.setattr(os, "lstat", swapped)
    seen: list = []
    listing = threading.Thread(target=lambda: seen.append(worktrees.observed_changes(ws)), daemon=True)
    listing.start()
    listing.join(10)
    hung = listing.is_alive()
    if hung:   # let the hung reader go (the stale stat still in place) before failing
        os.close(os.open(plain / "fifo.txt", os.O_WRONLY | os.O_NONBLOCK))
        listing.join(5)
    monkeypatch.undo()
    assert not hung and seen == [(["fifo.txt", "link.txt"], "")]


def test_writes_under_a_nested_git_folder_are_seen_and_reverted_the_folders_own_git_is_not(tmp_path):
    """Every .git at any depth was skipped, so a run's writes under sub/.git/ never showed. Only
    the folder's own top-level .git is skipped now (git's database, see worktrees._SKIPPED): a
    checkout run in place keeps it out of its readonly snapshot."""
    plain = tmp_path / "plain"
    (plain / "sub" / ".git").mkdir(parents=True)
    (plain / "sub" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    ws = prepared(plain)
    assert ws.mode == "in-place" and not ws.top
    snapshot = worktrees.take_snapshot(str(plain))
    (plain / "sub" / ".git" / "HEAD").write_text("ref: refs/heads/evil\n")
    (plain / "sub" / ".git" / "hooks").mkdir()
    assert worktrees.observed_changes(ws) == (["sub/.git/HEAD", "sub/.git/hooks"], "")
    reverted, failed = worktrees.restore_snapshot(str(plain), snapshot)
    assert reverted == ["sub/.git/HEAD", "sub/.git/hooks/"] and failed == []
    assert (plain / "sub" / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"

    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    (repo / "vendored" / ".git").mkdir(parents=True)
    (repo / "vendored" / ".git" / "HEAD").write_text("x\n")
    taken = worktrees.take_snapshot(str(repo))
    assert taken is not None and "vendored/.git/HEAD" in taken and "a.txt" in taken
    assert not [rel for rel in taken if rel == ".git" or rel.startswith(".git" + os.sep)]


def test_a_file_that_grows_after_it_was_listed_is_read_one_byte_past_its_size_and_is_a_change(tmp_path):
    """A reviewer's finding: a file was read to its end however large it had grown since its lstat
    (a run could make the worker hold gigabytes); and a folder was read whole before the entry cap."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "grows.txt").write_bytes(b"0123456789")
    walk = worktrees.walk_folder(str(plain), max_entries=10)
    found = next(f for f in walk if f.rel == "grows.txt")
    with open(plain / "grows.txt", "ab") as more:
        more.write(b"x" * (4 << 20))
    assert worktrees._read_file(found) == b"0123456789x"
    walk.close()
    for n in range(30):
        (plain / f"{n}.txt").write_text("x")
    with pytest.raises(worktrees.NotListed, match="holds over 10 entries"):
        list(worktrees.walk_folder(str(plain), max_entries=10))
