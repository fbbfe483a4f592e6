"""Recognising a provider's usage limit and its reset (issue 23) from what OpenCode reports: the
error event (status, headers), the --print-logs line (as 1.18.33 printed it against a 429), and
the providers' own header and message formats; the back-off when no reset is given."""
from __future__ import annotations

import email.utils
from datetime import UTC, datetime

import pytest

import opencode_runner as oc
import worker

NOW = 1_800_000_000.0
# A line the pinned opencode printed with --print-logs for a 429 (tests/test_usage_pause.py makes it).
LOG_LINE = ('timestamp=2026-12-01T20:43:22.445Z level=ERROR run=b8744a01 message="stream error" providerID=fake '
            'modelID=model session.id=ses_dcca704d4ffeIOwFLVyn1o9Vab small=false agent=build mode=primary '
            'error.error="AI_APICallError: Rate limit reached for requests. Please try again in 3s."')


@pytest.mark.parametrize("headers, seconds", [
    ({"retry-after-ms": "1500"}, 1.5),
    ({"Retry-After": "20"}, 20),
    ({"x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "6m0s"}, 360),   # OpenAI: the later
    ({"anthropic-ratelimit-tokens-reset": datetime.fromtimestamp(NOW + 90, UTC).isoformat()}, 90),
    ({"retry-after": email.utils.formatdate(NOW + 120, usegmt=True)}, 120),
    ({"x-ratelimit-reset": str(int(NOW + 45))}, 45),
])
def test_reset_from_the_providers_headers(headers, seconds):
    assert oc.reset_from_headers(headers, NOW) == pytest.approx(NOW + seconds, abs=1)


@pytest.mark.parametrize("text, seconds", [
    ("Rate limit reached for requests. Please try again in 17s.", 17),
    ("Please try again in 1m30s", 90),
    ("Please try again in 250ms", 0.25),
    ("usage limit reached, try again in 2 hours", 7200),
])
def test_reset_from_the_providers_words(text, seconds):
    assert oc.reset_from_text(text, NOW) == pytest.approx(NOW + seconds)


def test_a_clock_time_is_its_next_occurrence_and_a_bare_number_is_none():
    at = oc.reset_from_text("Your usage limit resets at 3pm", NOW)
    local = datetime.fromtimestamp(at).astimezone()
    assert (local.hour, local.minute) == (15, 0) and NOW < at <= NOW + 86400
    assert oc.reset_from_text("try again at 3", NOW) is None
    assert oc.reset_from_text("the server is down", NOW) is None


def test_limit_from_an_error_event_and_not_from_other_errors():
    event = {"type": "error", "error": {"name": "APIError", "data": {
        "message": "Too many requests", "statusCode": 429, "isRetryable": True,
        "responseHeaders": {"retry-after": "30"}}}}
    assert oc.limit_from_error(event, NOW) == {"said": "Too many requests", "status": 429, "reset_at": NOW + 30}
    quota = {"type": "error", "error": {"name": "APIError", "data": {"message": "You exceeded your current quota"}}}
    assert oc.limit_from_error(quota, NOW)["reset_at"] is None
    down = {
        "type": "error",
        "error": {"name": "APIError", "data": {"message": "quota service down", "statusCode": 500}},
    }
    assert oc.limit_from_error(down, NOW) is None


def test_limit_from_the_print_logs_line():
    seen = oc.limit_from_log(LOG_LINE, NOW)
    assert seen == {"said": "Rate limit reached for requests. Please try again in 3s.", "provider": "fake",
                    "reset_at": NOW + 3, "session_id": "ses_dcca704d4ffeIOwFLVyn1o9Vab"}
    assert oc.limit_from_log(LOG_LINE.replace("Rate limit reached", "Bad gateway").replace("try again in 3s", "x"),
                             NOW) is None


def test_no_reset_backs_off_doubling_then_asks_the_planner(monkeypatch):
    monkeypatch.setenv("WORKER_LIMIT_BACKOFF_SEC", "60")
    monkeypatch.setenv("WORKER_LIMIT_ROUNDS", "3")
    monkeypatch.setenv("WORKER_LIMIT_MARGIN_SEC", "5")
    knobs = worker.Knobs()
    waits = [worker.limit_resume_at({"limit_rounds": r}, {"reset_at": None}, knobs, NOW) for r in range(4)]
    assert waits == [NOW + 60, NOW + 120, NOW + 240, None]
    assert worker.limit_resume_at({"limit_rounds": 9}, {"reset_at": NOW + 100}, knobs, NOW) == NOW + 105
    monkeypatch.setenv("WORKER_LIMIT_BACKOFF_SEC", "3000")
    assert worker.limit_resume_at({"limit_rounds": 2}, {"reset_at": None}, worker.Knobs(), NOW) == NOW + 3600
