"""The advisory lock keys: a journal scope's, and a concurrency limit's slots'.

A leaf module (no driver, no agent framework), so the commands that only
read the ledger import it without loading what a run needs."""

from __future__ import annotations

import hashlib

_LOCK_SALT = b"loomflow-worker/scope/"
_SLOT_SALT = b"loomflow-worker/slot/"


def scope_lock_key(scope: str) -> int:
    """The advisory lock key (a signed bigint) of a journal scope."""
    digest = hashlib.blake2b(_LOCK_SALT + scope.encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big", signed=True)


def slot_lock_keys(limit: str, count: int) -> list[int]:
    """The advisory lock keys of the ``count`` slots of a concurrency limit
    (one instance of it: ``per_key:alice``): a run of the limit holds one of
    them, on its lock connection, for as long as it runs."""
    salt = _SLOT_SALT + limit.encode("utf-8", "surrogatepass") + b"\0"
    return [int.from_bytes(hashlib.blake2b(salt + str(i).encode(), digest_size=8).digest(),
                           "big", signed=True) for i in range(count)]
