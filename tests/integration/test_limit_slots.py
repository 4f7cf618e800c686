"""Concurrency limit slots: advisory locks a run holds on its lock connection."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from loomflow_worker.runtime import PostgresRuntime
from loomflow_worker.runtime.keys import slot_lock_keys

pytestmark = pytest.mark.anyio


def _held(dsn: str, keys: list[int]) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks l, unnest(%s::bigint[]) k"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            # Advisory locks are per database: not another test's, in its own.
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND l.classid = ((k >> 32) & 4294967295)::oid"
            " AND l.objid = (k & 4294967295)::oid", (keys,)).fetchone()
    assert row is not None
    return int(row[0])


async def test_runs_of_one_process_take_one_slot_each_until_none_is_left(dsn: str) -> None:
    keys = slot_lock_keys("per_key:alice", 3)
    assert len(set(keys)) == 3 and keys == slot_lock_keys("per_key:alice", 3)
    # Every run of the process on one lock connection: a session lock taken
    # twice there would succeed, so the process must not try one it holds.
    runtime = await PostgresRuntime.connect(dsn, lock_wait_timeout=0, lock_connections=1)
    other = await PostgresRuntime.connect(dsn, lock_wait_timeout=0, lock_connections=1)
    try:
        leases = [await runtime.journal.acquire(f"s{i}", wait=0) for i in range(4)]
        taken = [await runtime.journal.take_slot(lease, keys) for lease in leases[:3]]
        assert taken == [True, True, True]
        assert sorted(k for lease in leases[:3] for k in lease.slots) == sorted(keys)
        assert _held(dsn, keys) == 3
        assert not await runtime.journal.take_slot(leases[3], keys)
        # Another process finds them all held too.
        stranger = await other.journal.acquire("t", wait=0)
        assert not await other.journal.take_slot(stranger, keys)
        await runtime.journal.release(leases[0])
        assert _held(dsn, keys) == 2
        assert await other.journal.take_slot(stranger, keys)
        assert stranger.slots == leases[0].slots
        assert not await runtime.journal.take_slot(leases[3], keys)
        await other.journal.release(stranger)
        assert await runtime.journal.take_slot(leases[3], keys)
        for lease in leases[1:]:
            await runtime.journal.release(lease)
        assert _held(dsn, keys) == 0
    finally:
        await runtime.aclose()
        await other.aclose()


async def test_runs_taking_slots_at_once_each_get_one_while_any_is_free(dsn: str) -> None:
    # Three starts at once on two lock connections, three slots: none is told
    # the limit is full (which would park it while a slot stays idle).
    keys = slot_lock_keys("per_key:bob", 3)
    runtime = await PostgresRuntime.connect(dsn, lock_wait_timeout=0, lock_connections=2)
    try:
        leases = [await runtime.journal.acquire(f"s{i}", wait=0) for i in range(4)]
        taken = await asyncio.gather(*(runtime.journal.take_slot(lease, keys)
                                       for lease in leases[:3]))
        assert list(taken) == [True, True, True]
        assert sorted(k for lease in leases[:3] for k in lease.slots) == sorted(keys)
        assert _held(dsn, keys) == 3
        assert not await runtime.journal.take_slot(leases[3], keys)
        for lease in leases:
            await runtime.journal.release(lease)
        assert _held(dsn, keys) == 0
    finally:
        await runtime.aclose()
