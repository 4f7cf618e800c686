"""What the fleet's leader does: every worker process runs a sweeper, and the
one holding the leader lock sweeps for the fleet.

By job: :mod:`.leader` (the loop, the leader's election and takeover of a
frozen leader, the actions it records), :mod:`.recovery` (frozen workers
fenced, orphans dispatched again, requests revoked while their message
waited), :mod:`.result_repair` (results the result backend lacks stored from
the ledger) with :mod:`.result_watch` (the watch on a backend that loses
results it had), :mod:`.retention` (pruning, and forgetting workers long
gone), :mod:`.actions` (what it did, for the console). It reaches the ledger
only through its two gateways, :mod:`.ledger_recovery` and
:mod:`.ledger_results`; its SQL is in ``sql/sweeper.sql``. It uses no Celery:
the worker's Celery binding (``tasks``) gives it how to publish, count queues,
learn of revokes and reach the result backend."""
