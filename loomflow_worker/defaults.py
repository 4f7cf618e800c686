"""Defaults and bounds the ``loomflow-worker`` command's help shows, in a module
that imports nothing: printing the help loads no driver and no settings."""

#: Where `loomflow-worker console` listens unless told otherwise.
CONSOLE_PORT = 8040
#: The most requests one listing (`loomflow-worker requests`) returns.
MAX_LIST = 1_000_000
