"""stopgate's client for workers: the control API, with the standard library only.

See docs/workers.md in the stopgate repository for how a worker hears a cancel
and the Celery recipe (:mod:`stopgate.celery`).
"""

# The package's names are the ones client.py lists in its __all__, kept there only.
from .client import *  # noqa: F403
from .client import __all__ as __all__
