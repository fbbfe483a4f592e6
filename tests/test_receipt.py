"""The typed receipt (receipt.py): the keys a worker's receipt has are the ones the type declares,
and its JSON keeps the shape readers know (absent fields stay absent)."""
from __future__ import annotations

import pytest

import receipt
import task_store
from fake_openai import text, tool_call
from helpers import make_repo, run_script
from receipt import UNSET, Receipt

BOTH_ENGINES = True   # each real-opencode test runs on the cold and the warm engine (conftest)

RECEIPT_BLOCK = '```json\n{"summary": "Wrote a.txt", "files_touched": ["a.txt"], ' \
                '"tests_run": [], "open_questions": []}\n```'


def test_a_field_not_set_is_absent_from_the_json():
    made = Receipt(summary="s", commit=None)
    assert made.to_json() == {"summary": "s", "commit": None}
    assert made.get("worktree_removed") is None and not made.worktree_removed
    made.unset("commit")
    assert made.to_json() == {"summary": "s"}


def test_a_name_the_type_does_not_declare_is_refused():
    made = Receipt()
    with pytest.raises(AttributeError):
        made.comitt = "abc"   # noqa: B018 - a typo must fail, not add a key
    with pytest.raises(AttributeError):
        made.update(comitt="abc")


def test_a_stored_receipt_round_trips_with_keys_of_its_own():
    stored = {"summary": "s", "commit": "abc", "an_older_key": [1]}
    assert Receipt.from_json(stored).to_json() == stored


def test_every_field_is_always_or_sometimes():
    assert len(receipt.ALWAYS) == 37
    assert not set(receipt.ALWAYS) & set(receipt.SOMETIMES)
    built_by_default = Receipt()
    assert all(getattr(built_by_default, name) is UNSET for name in receipt.ALWAYS + receipt.SOMETIMES)


@pytest.mark.real_opencode
def test_a_real_runs_receipt_has_exactly_the_declared_keys(opencode, tmp_path):
    repo = make_repo(tmp_path / "repo")
    opencode.model.script("keys", [
        tool_call("write", {"filePath": "{cwd}/a.txt", "content": "a\n"}),
        text("Done.\n" + RECEIPT_BLOCK),
    ])
    task = task_store.submit_task(title="keys", instructions="SCRIPT:keys", working_dir=str(repo))
    assert run_script("worker.py").returncode == 0
    done = task_store.get_task(task["id"])
    assert done["status"] == "done", done["error"]
    keys = set(done["result"])
    # A done worktree run on a local repository: every built key, and the ones its outcome sets.
    outcome = {"changed_outside_worktree", "repo_config", "commit", "no_change", "worktree_removed"}
    assert keys == set(receipt.ALWAYS) | outcome
    assert keys <= set(receipt.ALWAYS) | set(receipt.SOMETIMES)
