"""stopgate's client for workers: the control API, with the standard library only.

See docs/workers.md in the stopgate repository for how a worker hears a cancel
and the Celery recipe (:mod:`stopgate.celery`).
"""

from .client import (
    ACTIVE,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    UNKNOWN,
    Audit,
    Client,
    Event,
    Guarded,
    Intent,
    ProxySettings,
    Renewed,
    Run,
    RunCancelled,
    StopgateError,
    StopgateUnavailable,
    Watch,
)

__all__ = [
    "ACTIVE",
    "CANCELLED",
    "CANCELLING",
    "COMPLETED",
    "UNKNOWN",
    "Audit",
    "Client",
    "Event",
    "Guarded",
    "Intent",
    "ProxySettings",
    "Renewed",
    "Run",
    "RunCancelled",
    "StopgateError",
    "StopgateUnavailable",
    "Watch",
]
