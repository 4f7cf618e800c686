"""What happens to a request, with no Celery: the ``runs`` ledger, one attempt
of a request on a worker (take the scope, consult the ledger, run, finish),
and the agents workers run, by name. The Celery binding (``tasks``) and the
CLI are built on it; it is built on the runtime."""
