"""A database URL that leads to PgBouncer in transaction or statement mode is
found out: ``doctor`` fails saying what to change, and a worker refuses to
start (it would take its session locks on borrowed server sessions and
stall). In session mode both go on. PgBouncer is a private one per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.integration.celery_harness import Fleet
from tests.integration.helpers import cli
from tests.integration.services import PrivatePgBouncer

pytestmark = pytest.mark.slow

FIX = "pool_mode = session"


@pytest.fixture(params=["transaction", "statement", "session"])
def pooled_dsn(request: pytest.FixtureRequest, dsn: str, tmp_path: Path) -> Iterator[str]:
    workdir = tmp_path / "pgbouncer"
    workdir.mkdir()
    bouncer = PrivatePgBouncer(workdir, request.param)
    bouncer.start()
    try:
        yield bouncer.dsn(str(conninfo_to_dict(dsn)["dbname"]))
    finally:
        bouncer.stop()


def test_doctor_and_worker_refuse_a_transaction_pooler(
    fleet: Fleet, pooled_dsn: str, request: pytest.FixtureRequest
) -> None:
    mode = request.node.callspec.params["pooled_dsn"]
    doctor = cli(fleet, "doctor", LOOMFLOW_WORKER_DATABASE_URL=pooled_dsn)
    if mode == "session":
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        fleet.start("w1", 1, cli=True, LOOMFLOW_WORKER_DATABASE_URL=pooled_dsn)
        return
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "FAIL database" in doctor.stdout and "transaction or statement mode" in doctor.stdout
    assert FIX in doctor.stdout
    with pytest.raises(RuntimeError, match="exited at start") as exited:
        fleet.start("w1", 1, cli=True, LOOMFLOW_WORKER_DATABASE_URL=pooled_dsn)
    assert "transaction or statement mode" in str(exited.value), exited.value
    assert FIX in str(exited.value)
