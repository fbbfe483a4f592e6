"""The queue itself: claims, fencing, dependencies, priority, validation, concurrency. Every test
runs on SQLite and on PostgreSQL (tests/pg_server.py's real server)."""
from __future__ import annotations

import pytest

import task_store as store
from helpers import claim_in_processes, submit


@pytest.fixture(autouse=True)
def backend(store_backend):
    """Each test of this file on both backends (sqlite, postgresql)."""
    return store_backend


def test_ids_accept_three_shapes(tmp_path):
    task = submit(tmp_path)
    for shape in ("t_0001", "0001", "1", 1, "T_1"):
        assert store.get_task(shape)["id"] == task["id"] == "t_0001"
    for bad in ("t_x", "", "0", -1, None, True, "1.5"):
        with pytest.raises(store.ValidationError, match="t_0001, 0001 or 1"):
            store.get_task(bad)
    with pytest.raises(store.TaskNotFound, match="t_0099 not found"):
        store.get_task("t_0099")


def test_priority_then_oldest(tmp_path):
    low = submit(tmp_path, "low", priority=-5)
    first = submit(tmp_path, "first")
    high = submit(tmp_path, "high", priority=10)
    second = submit(tmp_path, "second")
    order = [store.claim_next("w")["id"] for _ in range(4)]
    assert order == [high["id"], first["id"], second["id"], low["id"]]
    assert store.claim_next("w") is None


def test_dependency_runs_only_after_done(tmp_path):
    a = submit(tmp_path, "A")
    b = submit(tmp_path, "B", depends_on=[a["id"]], priority=100)
    claimed = store.claim_next("w")
    assert claimed["id"] == a["id"], "B must wait for A despite its priority"
    assert store.claim_next("w") is None
    with pytest.raises(store.InvalidTransition, match="waits for t_0001"):
        store.claim_next("w", task_id=b["id"])
    store.complete_attempt(a["id"], claimed["run_marker"], result={"summary": "ok"})
    assert store.claim_next("w")["id"] == b["id"]


def test_failed_dependency_fails_dependents_naming_it(tmp_path):
    a = submit(tmp_path, "A", max_retries=0)
    b = submit(tmp_path, "B", depends_on=[a["id"]])
    c = submit(tmp_path, "C", depends_on=[b["id"]])
    claimed = store.claim_next("w")
    store.fail_attempt(a["id"], claimed["run_marker"], "boom")
    assert store.get_task(b["id"])["status"] == "failed"
    assert store.get_task(b["id"])["error"] == "dependency t_0001 failed"
    assert store.get_task(c["id"])["error"] == "dependency t_0002 failed"
    with pytest.raises(store.ValidationError, match="t_0001, which is failed"):
        submit(tmp_path, "D", depends_on=[a["id"]])


def test_cycle_refused_and_nothing_written(tmp_path):
    batch = [
        {"title": "x", "instructions": "i", "working_dir": str(tmp_path), "ref": "x", "depends_on": ["z"]},
        {"title": "y", "instructions": "i", "working_dir": str(tmp_path), "ref": "y", "depends_on": ["x"]},
        {"title": "z", "instructions": "i", "working_dir": str(tmp_path), "ref": "z", "depends_on": ["y"]},
    ]
    with pytest.raises(store.ValidationError, match="cycle refused: x -> z -> y -> x"):
        store.submit_batch(batch)
    assert store.counts()["pending"] == 0
    with pytest.raises(store.ValidationError, match="depends on itself"):
        store.submit_batch([batch[0] | {"depends_on": ["x"]}])


def test_batch_is_all_or_nothing(tmp_path):
    good = {"title": "ok", "instructions": "i", "working_dir": str(tmp_path)}
    with pytest.raises(store.ValidationError, match="task 1 of the batch: timeout_sec"):
        store.submit_batch([good, good | {"timeout_sec": 0}])
    with pytest.raises(store.ValidationError, match="1 to 20 tasks; got 21"):
        store.submit_batch([good] * 21)
    assert store.counts()["pending"] == 0
    assert store.last_event_id() == 0


def test_a_refused_batch_names_its_own_tasks_by_place_not_by_ids_it_rolled_back(tmp_path):
    """Before, a batch item building on another item was refused naming the other's new id
    (t_0001), an id the refusal rolled back and that no tool could then find."""
    item = {"title": "x", "instructions": "i", "working_dir": str(tmp_path)}
    twice = [item | {"ref": "@a"}, item | {"continue_from": "@a"}, item | {"continue_from": "@a"}]
    with pytest.raises(store.ValidationError) as refused:
        store.submit_batch(twice)
    assert str(refused.value) == (
        "task 2 of the batch: continue_from task 0 of the batch (ref '@a'): task 1 of the batch already continues "
        "it on its branch; continue from task 1 of the batch instead, or use fork_from task 0 of the batch "
        "(ref '@a') to try another approach side by side")
    in_place = [item | {"ref": "@a", "worktree": False}, item | {"fork_from": "@a"}]
    with pytest.raises(store.ValidationError, match=r"^task 1 of the batch: fork_from task 0 of the batch \(ref "
                                                     r"'@a'\): that task ran with worktree=false"):
        store.submit_batch(in_place)
    assert store.counts()["pending"] == 0 and store.last_event_id() == 0
    # Outside a batch, a task that exists is named by its id, as before.
    first, follow = store.submit_batch(twice[:2])
    with pytest.raises(store.ValidationError, match=f"^continue_from {first['id']}: {follow['id']} already continues"):
        store.submit_task(**item, continue_from=first["id"])


def test_continue_from_and_fork_from_name_a_batch_ref_as_depends_on_does(tmp_path):
    """The docs say refs are named "in depends_on, continue_from and fork_from", but a plain ref
    ("a") worked only in depends_on: continue_from "a" said "task id 'a' is not valid"."""
    item = {"title": "x", "instructions": "i", "working_dir": str(tmp_path)}
    made = store.submit_batch([item | {"ref": "b", "continue_from": "a"}, item | {"ref": "a"},
                               item | {"fork_from": "a", "depends_on": ["b"]}, item | {"ref": "@c"},
                               item | {"fork_from": "@c"}])
    base, fork_of_c = made[1]["id"], made[4]
    assert made[0]["continue_from"] == base and made[0]["depends_on"] == [base]
    assert made[2]["fork_from"] == base and sorted(made[2]["depends_on"]) == sorted([base, made[0]["id"]])
    assert fork_of_c["fork_from"] == made[3]["id"], "an @ref works as before"
    written = store.last_event_id()
    for field in ("continue_from", "fork_from", "depends_on"):
        for unknown in ("z", "@z"):
            value = [unknown] if field == "depends_on" else unknown
            with pytest.raises(store.ValidationError) as refused:
                store.submit_batch([item | {"ref": "a"}, item | {"ref": "@b"}, item | {field: value}])
            assert str(refused.value) == (
                f"task 2 of the batch: {field} names {unknown!r}, which is neither a task id (t_0001, 0001 or 1) "
                "nor a ref of this batch; this batch's refs are 'a', '@b'"), refused.value
    with pytest.raises(store.ValidationError, match="^continue_from names 'a', which is neither a task id .* no item "
                                                    "of this batch has a ref"):
        store.submit_task(**item, continue_from="a")
    assert store.last_event_id() == written, "nothing written"


def test_a_batch_refuses_a_key_twice_and_a_ref_that_reads_as_a_task_id(tmp_path):
    """A key given twice in one batch was refused naming the first item's rolled-back id (which
    the next submit then took); a ref ``t_0001`` or ``1`` hid the existing task of that id from
    ``depends_on``; a ref given as a number was taken."""
    existing = submit(tmp_path, "existing")
    item = {"title": "x", "instructions": "i", "working_dir": str(tmp_path)}
    refusals = [
        ([item | {"idempotency_key": "dup"}, item | {"title": "y", "idempotency_key": "dup"}],
         "^task 1 of the batch: idempotency_key 'dup' is task 0's of the same batch; give each task its own key$"),
        ([item | {"ref": existing["id"]}, item | {"depends_on": [existing["id"]]}],
         f"^task 0 of the batch: ref '{existing['id']}' reads as a task id"),
        ([item | {"ref": " 1 "}], "reads as a task id"),
        ([item | {"ref": 5}], "ref must be a label"),
        ([item | {"ref": "r" * 201}], "ref must be a label of up to 200 characters"),
    ]
    for batch, message in refusals:
        with pytest.raises(store.ValidationError, match=message):
            store.submit_batch(batch)
    assert store.counts()["pending"] == 1 and [e["kind"] for e in store.events_since(0)] == ["submitted"]
    with pytest.raises(store.ValidationError, match="is not valid"):
        store.get_task("\uff11")   # a fullwidth digit 1 is not an id


def test_idempotency_key_returns_original(tmp_path):
    first = submit(tmp_path, "once", idempotency_key="k-1")
    again = submit(tmp_path, "once", idempotency_key="k-1")
    assert again["id"] == first["id"] and again["duplicate"] and not first["duplicate"]
    with pytest.raises(store.ValidationError, match=r"'k-1' was already used by t_0001 \('once'\), whose title"):
        submit(tmp_path, "twice", idempotency_key="k-1")
    assert store.counts()["pending"] == 1
    # A follow-up names no folder (the store takes its task's): its retry is the same request.
    follow = store.submit_task(title="next", instructions="more", continue_from=first["id"], idempotency_key="k-2")
    again = store.submit_task(title="next", instructions="more", continue_from=first["id"], idempotency_key="k-2")
    assert again["id"] == follow["id"] and again["duplicate"] and follow["working_dir"] == first["working_dir"]


@pytest.mark.parametrize("field,value,message", [
    ("timeout_sec", 0, "timeout_sec must be from 1 to 86400"),
    ("timeout_sec", -5, "timeout_sec must be from 1"),
    ("timeout_sec", "soon", "timeout_sec must be a whole number"),
    ("priority", "high", "priority must be a whole number"),
    ("max_retries", 11, "max_retries must be from 0 to 10"),
    ("permission", "root", "permission 'root' is not one of"),
    ("model", "gpt4", "not of the form provider/model"),
    ("working_dir", "relative/dir", "is relative"),
    ("working_dir", "/nonexistent/xyz", "does not exist"),
    ("title", "  ", "title must not be empty"),
    ("depends_on", ["t_0042"], "t_0042, which does not exist"),
])
def test_bad_submissions_name_the_problem(tmp_path, field, value, message):
    fields = {"title": "t", "instructions": "i", "working_dir": str(tmp_path), field: value}
    with pytest.raises(store.ValidationError, match=message):
        store.submit_task(**fields)
    assert store.counts()["pending"] == 0


def test_odd_shapes_accepted(tmp_path):
    task = submit(tmp_path, '{"steps":[1]}', timeout_sec="600", depends_on="[]", model="null")
    assert task["title"] == '{"steps":[1]}' and task["timeout_sec"] == 600 and task["model"] is None
    other = submit(tmp_path, "12345", depends_on='["t_0001"]')
    assert other["title"] == "12345" and other["depends_on"] == ["t_0001"]


def test_fencing_refuses_a_superseded_attempt(tmp_path):
    task = submit(tmp_path, max_retries=2)
    first = store.claim_next("w1")
    store.requeue_attempt(task["id"], first["run_marker"], "lease went stale")
    with pytest.raises(store.StaleAttempt):
        store.requeue_attempt(task["id"], first["run_marker"], "twice")
    second = store.claim_next("w2")
    assert second["run_marker"] == "br-1-a2"
    with pytest.raises(
        store.StaleAttempt, match=r"br-1-a1 of task t_0001 is not the current attempt \(current: br-1-a2, task is "
                                  r"running\); the worker's record of it was refused$"
    ):
        store.complete_attempt(task["id"], first["run_marker"], result={"summary": "late"})
    with pytest.raises(store.StaleAttempt):
        store.renew_lease(task["id"], first["run_marker"])
    store.complete_attempt(task["id"], second["run_marker"], result={"summary": "ok"})
    assert store.get_task(task["id"])["result"]["summary"] == "ok"


def test_retry_then_failed_when_spent(tmp_path):
    task = submit(tmp_path, max_retries=1)
    first = store.claim_next("w")
    after = store.fail_attempt(task["id"], first["run_marker"], "flaky")
    assert after["status"] == "pending" and after["not_before"] is not None
    assert store.claim_next("w") is None, "claimed during its back-off"
    # The back-off passes: it is judged on the queue's clock (on PostgreSQL the server's, read
    # inside the claim's statement), so the task's not_before is moved back past it instead.
    store._kept().execute("UPDATE tasks SET not_before = not_before - 60 WHERE id = 1")
    second = store.claim_next("w")
    final = store.fail_attempt(task["id"], second["run_marker"], "flaky again")
    assert final["status"] == "failed" and final["attempts"] == 2


def test_question_answer_roundtrip_and_answer_needs_waiting(tmp_path):
    task = submit(tmp_path)
    with pytest.raises(store.InvalidTransition, match="pending, not waiting"):
        store.answer_task(task["id"], "yes")
    claimed = store.claim_next("w")
    store.pause_for_question(task["id"], claimed["run_marker"], "Which port?", session_id="ses_1")
    waiting = store.get_task(task["id"])
    assert waiting["status"] == "waiting" and waiting["question"] == "Which port?"
    store.answer_task(task["id"], "8080")
    again = store.get_task(task["id"])
    assert again["status"] == "pending" and again["answer"] == "8080" and again["session_id"] == "ses_1"
    assert again["questions"] == [again["questions"][0] | {"question": "Which port?", "answer": "8080"}]


def test_cancel_running_fences_the_worker(tmp_path):
    task = submit(tmp_path)
    claimed = store.claim_next("w")
    store.cancel_task(task["id"])
    with pytest.raises(store.StaleAttempt):
        store.renew_lease(task["id"], claimed["run_marker"])
    with pytest.raises(store.InvalidTransition, match="already cancelled"):
        store.cancel_task(task["id"])


def test_notes_delivered_once(tmp_path):
    task = submit(tmp_path)
    store.add_note(task["id"], "use tabs")
    claimed = store.claim_next("w")
    assert [n["text"] for n in store.take_notes(task["id"], claimed["run_marker"])] == ["use tabs"]
    assert store.take_notes(task["id"], claimed["run_marker"]) == []
    store.complete_attempt(task["id"], claimed["run_marker"])
    with pytest.raises(store.InvalidTransition, match="is done"):
        store.add_note(task["id"], "too late")


def test_events_are_written_with_each_state_change(tmp_path):
    cursor = store.last_event_id()
    task = submit(tmp_path)
    claimed = store.claim_next("w")
    store.complete_attempt(task["id"], claimed["run_marker"], result={"summary": "fine"})
    kinds = [e["kind"] for e in store.events_since(cursor, [task["id"]])]
    assert kinds == ["submitted", "claimed", "done"]


def test_clear_finished_keeps_what_others_depend_on(tmp_path):
    a = submit(tmp_path, "A")
    submit(tmp_path, "B", depends_on=[a["id"]])
    claimed = store.claim_next("w")
    store.complete_attempt(a["id"], claimed["run_marker"])
    assert store.clear_finished() == []  # B still pending and depends on A
    store.cancel_task("t_0002")
    removed = store.clear_finished()
    assert sorted(r["id"] for r in removed) == ["t_0001", "t_0002"]
    assert store.counts() == dict.fromkeys(store.STATUSES, 0)


def test_eight_processes_claim_200_tasks_exactly_once(tmp_path):
    store.submit_batch([{"title": f"t{i}", "instructions": "i", "working_dir": str(tmp_path)}
                        for i in range(20)])  # migrate first, then bulk insert
    for _ in range(9):
        store.submit_batch([{"title": "t", "instructions": "i", "working_dir": str(tmp_path)}] * 20)
    claimed = claim_in_processes(8, timeout=120)   # each exits 0 without a "locked" error
    assert len(claimed) == 200 and len(set(claimed)) == 200
    assert store.counts()["done"] == 200


def test_cancel_waiting_task_says_where_its_work_stays(tmp_path):
    task = submit(tmp_path)
    claimed = store.claim_next("w")
    store.renew_lease(task["id"], claimed["run_marker"], branch="taskbridge/t_0001",
                      worktree_path="/wt/repo-t_0001")
    store.pause_for_question(task["id"], claimed["run_marker"], "Which port?")
    cancelled = store.cancel_task(task["id"])
    assert cancelled["kept"] == ("branch taskbridge/t_0001 kept; its uncommitted work stays in the "
                                 "worktree /wt/repo-t_0001")
    assert "branch taskbridge/t_0001 kept" in store.get_task(task["id"])["events"][-1]["message"]
    assert store.cancel_task(submit(tmp_path)["id"])["kept"] is None


def test_cancel_of_a_running_task_says_its_branch_stays_only_with_work_on_it(tmp_path):
    """A fresh user's finding: the cancel's event said "branch ... kept", and the next one that the
    worker deleted it (its attempt had committed nothing)."""
    task = submit(tmp_path)
    claimed = store.claim_next("w")
    store.renew_lease(task["id"], claimed["run_marker"], branch="taskbridge/t_0001")
    kept = store.cancel_task(task["id"])["kept"]
    assert kept == ("branch taskbridge/t_0001 kept if its attempt committed work (an empty one is deleted as its "
                    "run ends); what the agent had changed by then goes into its receipt and diff as its worker "
                    "ends the run")
    assert kept in store.get_task(task["id"])["events"][-1]["message"]
    # a worker killed meanwhile ends nothing: the words say where the work is then (a tester's finding)
    other = submit(tmp_path)
    claimed = store.claim_next("w")
    store.renew_lease(other["id"], claimed["run_marker"], branch="taskbridge/t_0002", worktree_path="/wt/repo-t_0002")
    assert store.cancel_task(other["id"])["kept"].endswith(
        "as its worker ends the run (a worker that is gone leaves it in the worktree /wt/repo-t_0002)")


def test_a_cancelled_attempts_receipt_is_recorded_only_for_that_attempt_while_cancelled(tmp_path):
    """The worker records what a cancelled run changed (record_cancelled_receipt): never over an
    attempt another marker holds, nor on a task that is not cancelled (a reaped one runs again)."""
    task = submit(tmp_path)
    marker = store.claim_next("w")["run_marker"]
    receipt = {"summary": "", "files_touched": ["lib.py"]}
    assert not store.record_cancelled_receipt(task["id"], marker, receipt, "diff")   # still running
    store.cancel_task(task["id"])
    assert not store.record_cancelled_receipt(task["id"], "another", receipt, "diff")
    assert store.get_task(task["id"])["result"] is None
    assert store.record_cancelled_receipt(task["id"], marker, receipt, "+x", session_id="ses_1")
    kept = store.get_task(task["id"])
    assert (kept["status"], kept["result"]["files_touched"], kept["diff"], kept["session_id"]) == \
        ("cancelled", ["lib.py"], "+x", "ses_1")
    assert kept["events"][-1]["kind"] == "receipt"


def test_a_retry_waits_until_the_cancelled_attempts_worker_has_wrapped_it_up(tmp_path):
    """A retry right after a cancel was claimed by another slot while the old worker still observed
    the cancelled run in the same worktree (for a readonly run in place, before it had reverted the
    agent's writes). The retry succeeds at once; the claim waits for that worker's end_wrap_up."""
    task = submit(tmp_path)
    first = store.claim_next("worker:a:1", pid=1, pid_start=1.0)
    store.cancel_task(task["id"])
    retried = store.retry_task(task["id"])
    assert retried["status"] == "pending"
    assert retried["waits"].startswith(f"the cancelled attempt {first['run_marker']} is still being wrapped "
                                       "up by worker:a:1")
    assert "it waits: the cancelled attempt" in store.get_task(task["id"])["events"][-1]["message"]
    assert store.claim_next("worker:b:2") is None, "claimed while the old worker still held the worktree"
    assert store.queue_summary()["claimable"] == 0
    with pytest.raises(store.InvalidTransition, match="still being wrapped up by worker:a:1"):
        store.claim_next("worker:b:2", task_id=task["id"])
    # the old worker's receipt still lands (the next attempt has not started), and its wrap-up ends
    assert store.record_cancelled_receipt(task["id"], first["run_marker"], {"files_touched": ["a.py"]}, "+a")
    assert store.claim_next("worker:b:2") is None, "its worktree is not dealt with yet"
    assert not store.end_wrap_up(task["id"], "br-1-a9")
    assert store.end_wrap_up(task["id"], first["run_marker"])
    second = store.claim_next("worker:b:2")
    assert (second["id"], second["run_marker"], second["lease_owner"]) == (task["id"], "br-1-a2", "worker:b:2")
    assert not store.end_wrap_up(task["id"], first["run_marker"]), "a late end changes nothing"


def test_a_retry_keeps_the_receipt_and_diff_of_the_attempt_it_starts_afresh_from(tmp_path):
    """A tester's A.txt was lost: a cancelled attempt's diff was the only copy of its work (its
    worktree went), and the retried attempt's receipt replaced it. The retry keeps it among the
    earlier receipts, whether the receipt landed before the retry or after it (during the wrap-up)."""
    task = submit(tmp_path)
    first = store.claim_next("worker:a:1", pid=1, pid_start=1.0)
    store.cancel_task(task["id"])
    store.record_cancelled_receipt(task["id"], first["run_marker"], {"files_touched": ["A.txt"], "summary": "A"},
                                   "+A\n")
    store.end_wrap_up(task["id"], first["run_marker"])
    assert store.retry_task(task["id"])["earlier_attempts"][0]["attempt"] == first["run_marker"]
    second = store.claim_next("worker:a:1", pid=1, pid_start=1.0)
    store.cancel_task(task["id"])
    store.retry_task(task["id"])   # before the second attempt's receipt: it lands during the wrap-up
    store.record_cancelled_receipt(task["id"], second["run_marker"], {"files_touched": ["B.txt"]}, "+B\n")
    store.end_wrap_up(task["id"], second["run_marker"])
    third = store.claim_next("worker:a:1")
    store.complete_attempt(task["id"], third["run_marker"], result={"files_touched": ["C.txt"]}, diff="+C\n")
    done = store.get_task(task["id"])
    assert done["diff"] == "+C\n"
    assert [(e["attempt"], e["status"], e["files_touched"], e["diff_bytes"]) for e in done["earlier_attempts"]] == \
        [(first["run_marker"], "cancelled", ["A.txt"], 3), (second["run_marker"], "cancelled", ["B.txt"], 3)]
    assert "earlier_receipts" not in done, "the task dict carries the summaries, not every earlier diff"
    assert store.earlier_receipt(task["id"], "a1")["diff"] == "+A\n"
    assert store.earlier_receipt(task["id"], second["run_marker"])["result"]["files_touched"] == ["B.txt"]
    with pytest.raises(store.ValidationError, match=f"keeps no earlier attempt 'a3'; it keeps: {first['run_marker']}"):
        store.earlier_receipt(task["id"], "a3")


def test_a_receipt_that_landed_before_the_retry_but_within_the_wrap_up_is_kept(tmp_path):
    """The worker's receipt names its attempt (receipt.Receipt.attempt): the retry keeps it though
    the cancelled attempt was still being wrapped up (its worktree not yet removed)."""
    task = submit(tmp_path)
    first = store.claim_next("worker:a:1", pid=1, pid_start=1.0)
    store.cancel_task(task["id"])
    store.record_cancelled_receipt(task["id"], first["run_marker"], {"attempt": 1, "files_touched": ["A.txt"]}, "+A\n")
    store.retry_task(task["id"])
    store.end_wrap_up(task["id"], first["run_marker"])
    second = store.claim_next("w")
    store.complete_attempt(task["id"], second["run_marker"], result={"attempt": 2, "files_touched": ["B.txt"]},
                           diff="+B\n")
    assert [(e["attempt"], e["files_touched"]) for e in store.get_task(task["id"])["earlier_attempts"]] == \
        [(first["run_marker"], ["A.txt"])]
    assert store.earlier_receipt(task["id"], "a1")["diff"] == "+A\n"


def test_a_task_keeps_the_last_few_earlier_receipts(tmp_path):
    task = submit(tmp_path)
    for n in range(store.EARLIER_KEPT + 2):
        attempt = store.claim_next("w")
        store.fail_attempt(task["id"], attempt["run_marker"], "no", retryable=False, diff=f"+{n}\n")
        store.retry_task(task["id"])
    kept = store.get_task(task["id"])["earlier_attempts"]
    assert [e["attempt"] for e in kept] == [f"br-1-a{n}" for n in range(3, store.EARLIER_KEPT + 3)]
    assert store.earlier_receipt(task["id"], "a3")["diff"] == "+2\n"


def test_a_wrap_up_whose_worker_is_gone_is_ended_by_the_reaper_and_a_hand_claim_holds_none(tmp_path):
    task = submit(tmp_path)
    first = store.claim_next("worker:a:1", pid=1, pid_start=1.0)
    store.cancel_task(task["id"])
    assert [(t["id"], t["wrapping_up"], t["stale"]) for t in store.wrap_ups(3600)] == \
        [(task["id"], first["run_marker"], False)]
    store.retry_task(task["id"])
    store.cancel_task(task["id"])   # cancelled again while still wrapped up: still held
    store.retry_task(task["id"])
    assert store.claim_next("worker:b:2") is None
    assert [t["stale"] for t in store.wrap_ups(-1)] == [True]   # its heartbeat is older than the limit
    assert store.end_wrap_up(task["id"], first["run_marker"], "its worker (pid 1) is gone from a")
    assert store.get_task(task["id"])["events"][-1]["message"] == (
        f"the cancelled attempt {first['run_marker']} was not wrapped up: its worker (pid 1) is gone from a; "
        "the retried task can start now")
    assert store.wrap_ups(-1) == []
    assert store.claim_next("worker:b:2")["id"] == task["id"]
    by_hand = submit(tmp_path)
    store.claim_next("cli:alice", task_id=by_hand["id"])
    store.cancel_task(by_hand["id"])
    store.retry_task(by_hand["id"])
    assert store.claim_next("worker:b:2")["id"] == by_hand["id"], "no worker wraps up a hand claim"


@pytest.mark.parametrize("field", ["priority", "timeout_sec", "depends_on"])
def test_numbers_with_thousands_of_digits_are_refused_clearly(tmp_path, field):
    value = ["9" * 5000] if field == "depends_on" else "9" * 5000
    with pytest.raises(store.ValidationError):
        submit(tmp_path, **{field: value})
    with pytest.raises(store.ValidationError):
        store.get_task("1" * 5000)


@pytest.mark.parametrize("field", ["title", "instructions"])
def test_nul_in_text_is_refused_by_the_store(tmp_path, field):
    fields = {"title": "t", "instructions": "i", "working_dir": str(tmp_path), field: "a\x00b"}
    with pytest.raises(store.ValidationError, match=f"{field} contains a NUL"):
        store.submit_task(**fields)
    task = submit(tmp_path)
    with pytest.raises(store.ValidationError, match="NUL"):
        store.add_note(task["id"], "x\x00")


def test_a_question_does_not_spend_a_retry_and_usage_adds_up(tmp_path):
    task = submit(tmp_path, max_retries=0)
    first = store.claim_next("w")
    usage = {"tokens": {"input": 900, "output": 50}, "cost_usd": 0.00101, "steps": 1}
    store.pause_for_question(task["id"], first["run_marker"], "Which port?", usage=usage)
    store.answer_task(task["id"], "8080")
    second = store.claim_next("w")
    after = store.fail_attempt(task["id"], second["run_marker"], "model error", usage=usage)
    assert after["status"] == "failed", "max_retries=0: the failure after the answer is the only one"
    third_task = submit(tmp_path, max_retries=1)
    claimed = store.claim_next("w")
    store.pause_for_question(third_task["id"], claimed["run_marker"], "Tabs?", usage=usage)
    store.answer_task(third_task["id"], "spaces")
    again = store.claim_next("w")
    retried = store.fail_attempt(third_task["id"], again["run_marker"], "flaky", usage=usage)
    assert retried["status"] == "pending", "the question did not use up the one retry"
    total = store.get_task(task["id"])["usage"]
    assert total["tokens"] == {"input": 1800, "output": 100} and total["cost_usd"] == pytest.approx(0.00202)
    assert [a["attempt"] for a in total["by_attempt"]] == [1, 2]


def test_a_cancelled_attempt_is_told_so_plainly(tmp_path):
    """What was refused is the worker's write to the queue, not the agent's: the task log said
    "its write was refused" (a fresh user's finding) after the agent's writes had all succeeded."""
    task = submit(tmp_path)
    claimed = store.claim_next("w")
    store.cancel_task(task["id"])
    with pytest.raises(store.StaleAttempt, match="was ended from outside: the task is now cancelled; "
                                                 "the worker's record of it was refused$"):
        store.complete_attempt(task["id"], claimed["run_marker"])


def test_a_nul_in_an_agents_output_is_stored_not_refused(tmp_path, backend):
    """Agent output reaches the store unvalidated (errors, diffs, receipts); PostgreSQL's text
    cannot hold NUL, so there it is kept as U+FFFD; the write never fails."""
    task = submit(tmp_path, max_retries=0)
    claimed = store.claim_next("w")
    failed = store.fail_attempt(task["id"], claimed["run_marker"], "bad\x00byte", diff="+a\x00b\n",
                                result={"summary": "x\x00y"})
    kept = "\x00" if backend == "sqlite" else "\ufffd"
    assert failed["status"] == "failed" and failed["error"] == f"bad{kept}byte" and failed["diff"] == f"+a{kept}b\n"
    assert store.get_task(task["id"])["result"]["summary"] == "x\x00y"   # JSON escapes it: exact on both
    assert any(f"bad{kept}byte" in e["message"] for e in store.events_since(0, [task["id"]]))


def test_event_messages_keep_quotes_percents_and_backslashes_exactly(tmp_path):
    title = "it's 100% \\done\\ {x} %s ? :name — 雪 'quoted' \"double\""
    task = submit(tmp_path, title)
    store.add_note(task["id"], title)
    messages = [e["message"] for e in store.events_since(0, [task["id"]])]
    assert messages == [title, f"planner: {title}"]


def _truth() -> tuple[dict[str, int], int]:
    """Counts per status and unread results as a plain scan of the tasks finds them."""
    with store._reading() as conn:
        counted = dict(conn.execute("SELECT status, count(*) FROM tasks GROUP BY status").fetchall())
        unseen = conn.execute("SELECT count(*) FROM tasks WHERE result_seen_at IS NULL"
                              " AND status IN ('done', 'failed', 'cancelled')").fetchone()[0]
    return {s: counted.get(s, 0) for s in store.STATUSES}, unseen


def test_counts_and_unread_results_stay_right_after_every_kind_of_transition(tmp_path):
    """The kept counts (SQLite: task_counts and its triggers, migration 9's unread count) agree
    with a scan after submit, claim, finish, fail, question, answer, requeue, cancel, retry, a
    read result and clear_finished."""
    def check(step):
        assert (store.counts(), store.unseen_results()["total"]) == _truth(), step
    a, b, c, d = (submit(tmp_path, n, max_retries=0) for n in "abcd")
    check("submit")
    run = store.claim_next("w", task_id=a["id"])
    check("claim")
    store.complete_attempt(a["id"], run["run_marker"])
    check("done")
    store.fail_attempt(b["id"], store.claim_next("w", task_id=b["id"])["run_marker"], "broke", retryable=False)
    check("failed")
    store.pause_for_question(c["id"], store.claim_next("w", task_id=c["id"])["run_marker"], "which?")
    check("question")
    store.answer_task(c["id"], "this one")
    check("answer")
    store.requeue_attempt(c["id"], store.claim_next("w", task_id=c["id"])["run_marker"], "reaped")
    check("requeue")
    store.cancel_task(d["id"])
    check("cancel")
    store.retry_task(b["id"])
    check("retry")
    assert store.mark_result_seen(a["id"])
    check("result read")
    store.clear_finished(statuses=["cancelled"])
    check("clear_finished")
    assert store.counts()["done"] == 1 and store.counts()["cancelled"] == 0


def test_the_latest_events_are_the_newest_ones_whatever_the_ids(tmp_path):
    """Ids are a cursor, not a count: on PostgreSQL they are made of transaction ids, so
    "newest id minus 50" found none of the last 50 (the board's feed and `events` stayed empty)."""
    for n in range(3):
        store.submit_task(title=f"t{n}", instructions="x", working_dir=str(tmp_path))
    every = store.events_since(0)
    latest = store.latest_events(2)
    assert [e["id"] for e in latest] == [e["id"] for e in every[-2:]]
    assert latest[0]["id"] < latest[1]["id"] and latest[-1]["id"] == store.last_event_id()


@pytest.mark.parametrize("how", ["_writing", "_single_write"])
@pytest.mark.parametrize("statement", [
    "INSERT INTO task_deps (task_id, depends_on) VALUES (1, 99)",     # a reference to no task
    "UPDATE tasks SET status = 'lost' WHERE id = 1",                   # a value a CHECK refuses
    "UPDATE tasks SET idempotency_key = 'k' WHERE id = 2",             # a duplicate of a unique key
    "UPDATE tasks SET title = NULL WHERE id = 1",                      # NOT NULL
])
def test_a_write_a_constraint_refuses_is_the_same_store_error_on_both(tmp_path, statement, how):
    # The seam's contract: sqlite3.IntegrityError and psycopg's IntegrityError (UniqueViolation,
    # ForeignKeyViolation, CheckViolation, NotNullViolation) leave the store as one error.
    first, second = submit(tmp_path, idempotency_key="k"), submit(tmp_path)
    with pytest.raises(store.ConstraintViolated) as raised, getattr(store, how)() as conn:
        conn.execute(statement)
    message = str(raised.value)
    assert isinstance(raised.value, store.DatabaseUnusable) and raised.value.detail in message
    assert f"{store.database_label()} refused a write (" in message and "nothing was written" in message
    assert "password" not in message.lower()
    assert [store.get_task(t["id"])["status"] for t in (first, second)] == ["pending", "pending"]
    assert store.get_task(second["id"])["idempotency_key"] is None and submit(tmp_path)["id"] == "t_0003"


def test_the_kept_connection_and_its_rows_are_the_stores_protocols(tmp_path):
    # task_store.Connection / Row are what the store's SQL is typed against on both databases.
    submit(tmp_path)
    conn = store._kept()
    assert isinstance(conn, store.Connection)
    row = conn.execute("SELECT id, title FROM tasks").fetchone()
    assert isinstance(row, store.Row) and row["id"] == row[0] == 1 and dict(row) == {"id": 1, "title": "t"}
    assert row.keys() == ["id", "title"] and list(row) == [1, "t"] and len(row) == 2


def test_an_answer_to_a_task_that_asked_nothing_points_at_a_note_and_when_it_arrives(tmp_path):
    # It said a note "reaches a task at its next attempt"; a running task gets it before its next
    # model call (the notes courier), a pending one when it starts (found by a new-user test).
    task = submit(tmp_path)
    store.claim_next("w", task_id=task["id"])
    with pytest.raises(store.InvalidTransition) as refused:
        store.answer_task(task["id"], "yes")
    assert "is running, not waiting" in str(refused.value)
    assert "add_task_note reaches a running task before its next model call" in str(refused.value)


def test_a_follow_up_or_fork_of_a_task_done_without_a_branch_is_refused_at_submit(tmp_path):
    """A task completed by hand has no branch: its follow-up was queued, then failed at every run
    ("t_0006's branch (none) is not in ..."). One whose empty branch was deleted is built on."""
    by_hand = submit(tmp_path, "by hand")
    store.complete_attempt(by_hand["id"], store.claim_next("me", task_id=by_hand["id"])["run_marker"],
                           result={"summary": "done by hand"})
    for kind in ("continue_from", "fork_from"):
        with pytest.raises(store.ValidationError, match=f"^{kind} {by_hand['id']}: that task has no branch"):
            store.submit_task(title="next", instructions="i", **{kind: by_hand["id"]})
    assert sum(store.counts().values()) == 1
    unchanged = submit(tmp_path, "changed nothing")
    store.complete_attempt(unchanged["id"], store.claim_next("w", task_id=unchanged["id"])["run_marker"],
                           result={"summary": "looked", "branch_deleted": f"taskbridge/{unchanged['id']}"})
    assert store.submit_task(title="next", instructions="i", continue_from=unchanged["id"])["status"] == "pending"
