"""Broker connections that let a worker outlive a broker restart.

When the broker goes away under a running worker (a Redis restart), Celery's
consumer first collects its connection (closing its channels and detaching
the transport) and then closes it again. kombu keeps the closed default
channel, so the second close closes it once more: on Redis that restores
the unacked messages through a transport already detached, and the
``AttributeError`` it raises ('NoneType' object has no attribute
'hostname') is not a connection error, so the worker's main process exits
with "Unrecoverable error". A connection made here forgets its default
channel once it has closed it; a later use opens a new one.
"""

from __future__ import annotations

from celery.app.amqp import AMQP as CeleryAMQP
from kombu.connection import Connection as KombuConnection


class Connection(KombuConnection):
    def _do_close_self(self) -> None:
        try:
            super()._do_close_self()  # type: ignore[no-untyped-call]
        finally:
            self._default_channel = None


class AMQP(CeleryAMQP):  # type: ignore[misc]
    """Celery's broker glue, making :class:`Connection` connections."""

    Connection = Connection
    BrokerConnection = Connection
