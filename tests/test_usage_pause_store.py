"""Usage-limit pauses in the store, on SQLite and PostgreSQL: a pause holds its provider account
(pending tasks on it are not claimed, others are), resumes by itself once its reset has passed,
spends no retry, and the planner can resume it now or stop it."""
from __future__ import annotations

import pytest

import task_store as store
from helpers import submit


def _paused(store_backend, tmp_path, model="fake/model", resume_in=60.0, known=True):
    task = submit(tmp_path, "limited", model=model, max_retries=0)
    claimed = store.claim_next("w", task_id=task["id"])
    return store.pause_for_limit(claimed["id"], claimed["run_marker"], "Usage limit: wait", account="fake",
                                 said="Rate limit reached", resume_at=store.now() + resume_in if resume_in else None,
                                 known_reset=known, session_id="ses_x")


def test_a_pause_holds_its_account_not_the_queue(store_backend, tmp_path):
    paused = _paused(store_backend, tmp_path)
    same = store.submit_task(title="same", instructions="x", working_dir=str(tmp_path), model="fake/model")
    lookalike = store.submit_task(title="lookalike", instructions="x", working_dir=str(tmp_path), model="fakeish/m")
    default = store.submit_task(title="default", instructions="x", working_dir=str(tmp_path))
    assert paused["status"] == "waiting" and paused["paused_for"] == "usage_limit" and paused["resume_at"]
    held = store.held_accounts()
    assert [h["account"] for h in held] == ["fake"] and held[0]["tasks"] == [paused["id"]]

    got = [store.claim_next("w", default_account="fake") for _ in range(3)]
    assert [t["id"] for t in got if t] == [lookalike["id"]]
    with pytest.raises(store.InvalidTransition, match="usage limit to reset"):
        store.claim_next("w", task_id=same["id"], default_account="fake")
    # A task without a model of its own runs on the default's provider: held only when that is "fake".
    assert store.claim_next("w", default_account="other")["id"] == default["id"]
    assert store.get_task(same["id"])["status"] == "pending"


def test_resume_due_requeues_for_the_same_session_without_spending_a_retry(store_backend, tmp_path):
    paused = _paused(store_backend, tmp_path, resume_in=30)
    assert store.resume_due() == []
    resumed = store.resume_due(at=store.now() + 31)
    assert [t["id"] for t in resumed] == [paused["id"]]
    task = store.get_task(paused["id"])
    assert task["status"] == "pending" and task["session_id"] == "ses_x" and "usage limit" in task["answer"]
    assert task["resume_at"] is None and task["limit_pauses"][-1]["resumed"] == "at its reset"
    assert task["limit_pauses"][-1]["said"] == "Rate limit reached"
    # max_retries=0 and the pause did not spend it: the task is claimable, and the account is free.
    again = store.claim_next("w", task_id=paused["id"])
    assert again["attempts"] == 2 and store.held_accounts() == []
    kinds = [e["kind"] for e in store.events_since(0, [paused["id"]])]
    assert kinds[-3:] == ["paused", "resumed", "claimed"]


def test_answer_resumes_now_or_stops(store_backend, tmp_path):
    first = _paused(store_backend, tmp_path)
    now = store.answer_task(first["id"], "go on now", author="planner")
    assert now["status"] == "pending" and "go on now" in now["answer"] and now["resume_at"] is None
    assert store.held_accounts() == []
    second = _paused(store_backend, tmp_path)
    stopped = store.answer_task(second["id"], "stop", author="planner")
    assert stopped["status"] == "failed" and "usage limit" in stopped["error"]


def test_rounds_without_a_reset_count_up_and_a_known_reset_clears_them(store_backend, tmp_path):
    task = store.submit_task(title="t", instructions="x", working_dir=str(tmp_path), model="fake/m")
    for known, rounds in ((False, 1), (False, 2), (True, 0)):
        claimed = store.claim_next("w", task_id=task["id"])
        paused = store.pause_for_limit(claimed["id"], claimed["run_marker"], "q", account="fake", said="quota",
                                       resume_at=store.now() - 1, known_reset=known)
        assert paused["limit_rounds"] == rounds
        store.resume_due()
    assert len(store.get_task(task["id"])["limit_pauses"]) == 3
