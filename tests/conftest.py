"""Shared fixtures: every test gets its own database, log folder and worktree root."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

pytest_plugins = ["opencode_env", "pg_server"]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SLOW_MARKERS = ("real_opencode", "real_claude", "browser", "postgres", "install")


# The [warm] variants that do not pass yet. Until the worker_engine fix below, every [warm] test
# of a BOTH_ENGINES module ran on the cold engine; run warm at last, these fail (two parallel runs
# on the 2-core machine, 2026-12-06; some pass alone) and are issue 21's open work: each is run
# and reported as an expected failure (False: not run: it hangs until its time limit, or breaks
# what the tests after it share).
WARM_NOT_YET = {
    # once in CI (stop 39, [warm-allow once]) the cold resume after a warm ask asked again, as if
    # the session had lost the held call; not seen in nine runs here, loaded or not: the test now
    # prints the second pass's verbose lines and the task log when it fails
    "test_lines_of_work.py::test_an_ask_rule_pauses_the_task_and_the_answer_resumes_the_same_session": True,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test with one of the slow parts' markers (or the ``opencode`` fixture, which
    opencode_env's hook marks ``real_opencode``, maybe after this one) is also marked ``slow``, so
    the fast set is ``-m "not slow"`` (pytest's own ``-m`` filter runs after both hooks). The
    [warm] variants of WARM_NOT_YET are expected failures."""
    for item in items:
        if "opencode" in getattr(item, "fixturenames", ()) or any(
            item.get_closest_marker(name) for name in SLOW_MARKERS
        ):
            item.add_marker(pytest.mark.slow)
        name, _, params = item.nodeid.partition("[")
        run = WARM_NOT_YET.get(name.removeprefix("tests/"))
        if run is not None and params.startswith("warm"):
            item.add_marker(pytest.mark.xfail(reason="the warm engine does not pass it yet (issue 21)", run=run,
                                              strict=False))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module that sets ``BOTH_ENGINES = True`` runs each of its tests that use the real
    opencode twice, on the cold engine and on the warm one (ids ``[cold]``, ``[warm]``): the
    guarantees a worker run gives are the same on both (issue 21). A test of another module asks
    for the same by naming the ``worker_engine`` fixture."""
    if "worker_engine" in metafunc.fixturenames or (
            getattr(metafunc.module, "BOTH_ENGINES", False) and "opencode" in metafunc.fixturenames):
        if "worker_engine" not in metafunc.fixturenames:
            # Named here so that parametrize takes it; pytest 9 does not make it a fixture of the
            # test then (its [warm] ran cold), so engine_of_the_parameter (autouse) applies it.
            metafunc.fixturenames.append("worker_engine")
        metafunc.parametrize("worker_engine", ["cold", "warm"], indirect=True)


@pytest.fixture
def worker_engine(request: pytest.FixtureRequest, opencode: object, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine the worker runs this test's tasks on (``WORKER_ENGINE``: cold 0, warm 1), set
    after the ``opencode`` fixture has made the environment the worker inherits."""
    monkeypatch.setenv("WORKER_ENGINE", "1" if request.param == "warm" else "0")
    return str(request.param)


@pytest.fixture(autouse=True)
def isolated_queue(tmp_path, monkeypatch, request):
    """Point the queue, logs and worktrees at tmp_path; silence banners. With
    ``TASKBRIDGE_TEST_DB=postgresql`` every test's queue is a fresh PostgreSQL database instead
    (``pg_url``): the whole suite on the other backend."""
    monkeypatch.setenv("TASK_DB_PATH", str(tmp_path / "q" / "tasks.db"))
    monkeypatch.delenv(
        "TASK_DB_URL", raising=False
    )  # PostgreSQL only where a test asks (pg_url); also undoes --db in-process
    import knobs  # after sys.path names the checkout (above)
    import opencode_runner
    monkeypatch.setattr(knobs, "GIVEN_DB_FILE", [None])   # and the --db that hints repeat
    # OpenCode's answers (models, the default model) are kept in memory per process: an earlier
    # test's must not answer for this one's set-up (queue_status's default_model, a submit's warning).
    monkeypatch.setattr(opencode_runner, "_memory_cache", {})
    # The worker's process-wide state (its signal flags, its voice): a test that signalled a stop
    # must not leave the next in-process run_task handing its task back.
    if "worker" in sys.modules:
        monkeypatch.setattr(sys.modules["worker"], "_state", None)
    if os.environ.get("TASKBRIDGE_TEST_DB", "").strip().lower() == "postgresql":
        monkeypatch.setenv("TASK_DB_URL", request.getfixturevalue("pg_url"))
    monkeypatch.setenv("TASK_LOG_DIR", str(tmp_path / "q" / "task_logs"))
    monkeypatch.setenv("TASKBRIDGE_WORKTREE_ROOT", str(tmp_path / "worktrees"))
    monkeypatch.setenv("WORKER_NOTIFY", "0")
    monkeypatch.setenv("TASKBRIDGE_MIRROR_DIR", str(tmp_path / "mirrors"))
    monkeypatch.delenv("TASKBRIDGE_HOST", raising=False)
    monkeypatch.delenv("MCP_BEARER_TOKEN", raising=False)
    monkeypatch.setenv("MCP_TOKEN_FILE", str(tmp_path / "no-token-file"))
    monkeypatch.delenv("MCP_ALLOWED_HOSTS", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("WORKER_MODEL", raising=False)
    monkeypatch.delenv("WORKER_ENGINE", raising=False)   # cold unless a test (or BOTH_ENGINES) says warm
    # A TaskBridge the person serves beside the suite (8765, the default) must not be seen:
    # doctor, connect and the like look at $PORT, so it names a port nothing listens on.
    monkeypatch.setenv("PORT", str(_closed_port()))
    yield tmp_path


@pytest.fixture(autouse=True)
def engine_of_the_parameter(request: pytest.FixtureRequest, isolated_queue: Path) -> None:
    """A BOTH_ENGINES module's test parametrized by engine (ids ``[cold]``, ``[warm]``) that does
    not name ``worker_engine``: that fixture is applied all the same, after the queue's isolation
    (whose environment the ``opencode`` fixture keeps)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if "worker_engine" in params and "worker_engine" not in request.fixturenames:
        request.getfixturevalue("worker_engine")


def _closed_port() -> int:
    """A loopback port free a moment ago (bound, read, closed): nothing answers there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def anyio_backend():
    return "asyncio"
