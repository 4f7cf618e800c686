"""Quarantine: suspected requests run apart from the shared process, among a
few suspects or alone (:class:`~loomflow_worker.execution.host.QuarantineLevel`).

:mod:`.attempts` is the worker's side (a request's attempt sent to a process of
quarantine and its outcome read back), :mod:`.processes` the processes a
worker process runs, and :mod:`.child` what runs in each of them."""
