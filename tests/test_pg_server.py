"""The PostgreSQL test server itself (tests/pg_server.py): a real server as a non-root user, a
fresh database per test, the password required on loopback."""
from __future__ import annotations

import os
import pwd

import pytest

pytestmark = pytest.mark.postgres


def test_pg_url_is_a_fresh_database_of_its_own(pg_server, pg_url):
    import psycopg
    with psycopg.connect(pg_url, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]
        assert pg_url.endswith("/" + name)
        conn.execute("CREATE TABLE mine (x int)")
        conn.execute("INSERT INTO mine VALUES (1)")
        assert conn.execute("SELECT count(*) FROM mine").fetchone()[0] == 1
    # A sibling database made the same way does not see it.
    other = pg_server.create_database("sibling_check", "taskbridge_template")
    try:
        with psycopg.connect(other) as conn:
            assert conn.execute("SELECT to_regclass('mine')").fetchone()[0] is None
    finally:
        pg_server.drop_database("sibling_check")


def test_server_runs_as_a_normal_user_on_loopback_with_a_password(pg_server, pg_url):
    import psutil
    import psycopg
    owner = psutil.Process(pg_server.proc.pid).uids().real
    assert owner != 0 and pwd.getpwuid(owner).pw_name == (
        "taskbridge-test" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    )
    assert "127.0.0.1" in pg_url
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(pg_url.replace(":tb-secret-pw@", ":wrong@"), connect_timeout=5).close()
