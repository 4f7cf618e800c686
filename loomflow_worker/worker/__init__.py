"""What a worker process is: its context for running requests, made of
parts each with a start and a stop (the runtime, the heartbeat and
presence, the loop watch, the live events, the agents), its loop, its
admission control, its pool and connections, and quarantine's processes.
The execution core takes what it needs of it through
:class:`loomflow_worker.execution.host.Host`."""
