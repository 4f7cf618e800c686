"""The run console: a read-only web view of a fleet's requests, runs and workers.

``loomflow-worker console`` serves it (see :mod:`.server`); :func:`create_app`
is the ASGI application, for a server of one's own.
"""

from .app import create_app
from .server import BackgroundConsole, check_bind, serve

__all__ = ["BackgroundConsole", "check_bind", "create_app", "serve"]
