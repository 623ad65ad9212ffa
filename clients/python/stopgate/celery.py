"""Celery, guarded at the claim.

Every task of a run is a step of it: when a worker is about to run the task,
it claims the step through stopgate's guard (``POST /v1/runs/{run}/claims``,
key ``claim:<task id>``) in the same atomic step that checks the run is still
ACTIVE. Refused, the task is not run: the refusal is recorded by stopgate
(CANCELLED_BEFORE_DISPATCH) and by Celery (the task REVOKED, its reason naming
the run's row). Celery's retries are stopgate's retries: ``self.retry()``
first schedules the next attempt through the guard (``POST …/retries``, key
``retry:<task id>:<n>``; refused after the cancel, the task is REVOKED,
RETRY_REFUSED), which the cancel revokes in its own step, and the retried
task is dispatched through the guard again when it comes due (refused once
revoked: REVOKED, RETRY_REVOKED). A task that runs checks :func:`checkpoint`
between its steps and stops there once the run is no longer ACTIVE; the worker
hears the cancel on the run's watch stream the moment it commits, so a
checkpoint asks nothing of the server.

Use it as the base of the tasks (or of the app's tasks)::

    from celery import Celery
    import stopgate.celery as sgc

    app = Celery("agents", broker="redis://…", task_cls=sgc.GuardedTask)

    @app.task(bind=True, max_retries=3)
    def research(self, query):
        for page in plan(query):
            sgc.checkpoint()          # raises RunCancelled once the run is cancelled
            fetch(page)
        try:
            publish(query)
        except Timeout as e:
            raise self.retry(exc=e, countdown=30)   # a stopgate retry: a cancel revokes it

    research.apply_async(("q",), headers=sgc.headers(run.run_id, run.cancel_version, token=run_token))

The task's run travels in the message's headers (:func:`headers`): its id, the
cancel_version the enqueuer observed, and, best, the run's worker token, so that
the worker acts for that run only and holds no operator token. A task without a
run is refused (no task runs unguarded). The control API is
``$STOPGATE_CONTROL`` unless the task class names another
(``stopgate_control``).
"""

from __future__ import annotations

import contextvars
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from celery import Task
from celery.exceptions import Ignore, Retry

from .client import Client, Run, RunCancelled, StopgateError, Watch

__all__ = ["HEADER_RUN", "HEADER_TOKEN", "HEADER_VERSION", "GuardedTask", "Step", "active_watches", "checkpoint", "current", "headers"]

HEADER_RUN = "stopgate_run"
HEADER_VERSION = "stopgate_version"
HEADER_TOKEN = "stopgate_token"

#: Why a guarded task did not run or did not finish, at the head of the
#: reason Celery records with its REVOKED state.
REFUSED_AT_CLAIM = "stopgate: refused at the claim"
RETRY_REVOKED = "stopgate: retry revoked"
RETRY_REFUSED = "stopgate: retry refused"
STOPPED_AT_CHECKPOINT = "stopgate: stopped at a checkpoint"


def headers(run_id: str, cancel_version: int = 0, *, token: Optional[str] = None) -> dict[str, Any]:
    """The message headers that make a task a step of run_id (for ``apply_async(headers=…)``)."""
    h: dict[str, Any] = {HEADER_RUN: run_id, HEADER_VERSION: int(cancel_version)}
    if token:
        h[HEADER_TOKEN] = token
    return h


@dataclass
class Step:
    """The guarded task running now: its run, its step and the intent its claim is recorded under."""

    client: Client
    run_id: str
    cancel_version: int
    step_id: str
    #: ``claim:<task id>`` for the first attempt, ``retry:<task id>:<n>`` after.
    key: str
    attempt: int
    worker: str
    #: Whether the step's outcome is already recorded (a retry records it).
    reported: bool = False

    def checkpoint(self) -> Run:
        """Raises :class:`RunCancelled` if the run is no longer ACTIVE."""
        return self.client.checkpoint(self.run_id)

    def report(self, reason: str = "") -> None:
        """Records that the step ran to an end (its own effects are recorded one by one)."""
        if self.reported:
            return
        self.reported = True
        self.client.outcome(self.run_id, self.key, "responded", attempt=self.attempt, reason=reason or None)


_current: contextvars.ContextVar[Optional[Step]] = contextvars.ContextVar("stopgate_step", default=None)


def current() -> Optional[Step]:
    """The guarded task running in this context, if any."""
    return _current.get()


def checkpoint() -> Run:
    """A safe point of the running task: raises :class:`RunCancelled` once its run is no longer ACTIVE.

    Call it between the steps of a task, where stopping leaves nothing half
    done. Outside a guarded task it raises RuntimeError.
    """
    step = _current.get()
    if step is None:
        raise RuntimeError("stopgate.celery.checkpoint() called outside a task of GuardedTask")
    return step.checkpoint()


# One watch per run in a worker process, shared by the tasks of the run that
# run in it (the server bounds the watches of one run, and a process needs
# but one), with the client that opened it: a checkpoint finds the watch on
# the task's client. It is closed a minute after the last of them ended, so a
# worker that goes through many runs does not keep a stream open for each.
FOLLOW_IDLE = 60.0


@dataclass
class _Follow:
    client: Client
    watch: Watch
    users: int = 0
    idle: Optional[threading.Timer] = None


_follows: dict[tuple[Optional[str], Optional[str], str], _Follow] = {}
_follows_lock = threading.Lock()


def _follow(control: Optional[str], token: Optional[str], run_id: str) -> tuple[tuple[Optional[str], Optional[str], str], Client]:
    key = (control, token, run_id)
    with _follows_lock:
        f = _follows.get(key)
        if f is None:
            client = Client(control, token)
            f = _follows[key] = _Follow(client, client.watch(run_id).start())
        elif f.watch._thread is None or not f.watch._thread.is_alive():
            f.watch = f.client.watch(run_id).start()  # it ended (a refusal, or the run final): open it again
        f.users += 1
        if f.idle is not None:
            f.idle.cancel()
            f.idle = None
        return key, f.client


def _unfollow(key: tuple[Optional[str], Optional[str], str]) -> None:
    with _follows_lock:
        f = _follows.get(key)
        if f is None:
            return
        f.users -= 1
        if f.users == 0:
            f.idle = threading.Timer(FOLLOW_IDLE, _close_idle, (key, f))
            f.idle.daemon = True
            f.idle.start()


def active_watches() -> int:
    """How many runs this worker process holds a watch stream open for."""
    with _follows_lock:
        return len(_follows)


def _close_idle(key: tuple[Optional[str], Optional[str], str], f: _Follow) -> None:
    with _follows_lock:
        if _follows.get(key) is not f or f.users > 0:
            return
        del _follows[key]
    f.watch.close()


class GuardedTask(Task):  # type: ignore[misc]  # Celery ships no types
    """A Celery task guarded at the claim, retried through stopgate, stopped at its checkpoints."""

    abstract = True
    #: The control API (None: ``$STOPGATE_CONTROL``).
    stopgate_control: Optional[str] = None
    #: The bearer token when the message carries none (None: ``$STOPGATE_CONTROL_TOKEN``).
    stopgate_token: Optional[str] = None
    #: The claim's lease, in seconds; a running task renews it every third of it.
    stopgate_lease_ttl: float = 600.0

    # -- the claim ----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly:
            return super().__call__(*args, **kwargs)
        run_id = req.get(HEADER_RUN)
        if not run_id:
            raise StopgateError(f"task {self.name}[{req.id}] names no stopgate run: enqueue it with headers=stopgate.celery.headers(run_id, …)")
        following, client = _follow(self.stopgate_control, req.get(HEADER_TOKEN) or self.stopgate_token, run_id)
        try:
            return self._guarded(client, run_id, args, kwargs)
        finally:
            _unfollow(following)

    def _guarded(self, client: Client, run_id: str, args: Any, kwargs: Any) -> Any:
        req = self.request
        version = int(req.get(HEADER_VERSION) or 0)
        attempt = int(req.retries or 0)
        worker = f"{req.hostname or socket.gethostname()}/{os.getpid()}"
        try:
            if attempt == 0:
                g = client.claim(run_id, req.id, cancel_version=version, worker=worker, lease_ttl=self.stopgate_lease_ttl)
            else:
                g = client.dispatch_retry(run_id, req.id, attempt, cancel_version=version, worker=worker, lease_ttl=self.stopgate_lease_ttl)
        except RunCancelled as e:
            what = REFUSED_AT_CLAIM if attempt == 0 else RETRY_REVOKED
            self._revoked(f"{what}: {e}")
        step = Step(client, run_id, version, req.id, g.intent.key, g.intent.attempts, worker)
        token = _current.set(step)
        beat = _Heartbeat(step, self.stopgate_lease_ttl)
        try:
            result = super().__call__(*args, **kwargs)
        except Retry:
            raise  # retry() recorded the outcome and scheduled the next attempt
        except RunCancelled as e:
            step.report(f"stopped at a checkpoint: {e}")
            self._revoked(f"{STOPPED_AT_CHECKPOINT}: {e}")
        except BaseException as e:
            step.report(f"failed: {type(e).__name__}: {e}"[:1000])
            raise
        finally:
            beat.stop()
            _current.reset(token)
        step.report()
        return result

    def _revoked(self, reason: str) -> None:
        """Records in Celery's backend that the task did not run (or stopped), then ends it without another state."""
        req = self.request
        self.backend.mark_as_revoked(req.id, reason, request=req)
        raise Ignore(reason)

    # -- retries ------------------------------------------------------------

    def retry(self, args: Any = None, kwargs: Any = None, exc: Optional[BaseException] = None, throw: bool = True,
              eta: Optional[datetime] = None, countdown: Optional[float] = None, max_retries: Optional[int] = None, **options: Any) -> Any:
        """Celery's retry, scheduled through stopgate first: a cancel revokes it while it waits."""
        step = _current.get()
        req = self.request
        if step is None or req.called_directly:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        attempt = int(req.retries or 0) + 1
        limit = self.max_retries if max_retries is None else max_retries
        if limit is not None and attempt > limit:
            # Celery raises MaxRetriesExceededError (or exc): nothing to schedule.
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        if eta is None:
            delay = self.default_retry_delay if countdown is None else countdown
            eta = datetime.now(timezone.utc) + timedelta(seconds=float(delay or 0))
        elif eta.tzinfo is None:
            eta = eta.replace(tzinfo=timezone.utc)
        try:
            step.client.retry(step.run_id, step.step_id, attempt, eta, cancel_version=step.cancel_version)
        except RunCancelled as e:
            step.report(f"failed; its retry was refused: {e}"[:1000])
            self._revoked(f"{RETRY_REFUSED}: {e}")
        step.report(f"failed; retried as attempt {attempt}" + (f": {type(exc).__name__}: {exc}" if exc else "")[:900])
        # Celery 5.2 does not carry a message's own headers to its retry.
        hdrs = dict(options.pop("headers", None) or {})
        hdrs.update(headers(step.run_id, step.cancel_version, token=req.get(HEADER_TOKEN)))
        return super().retry(args, kwargs, exc, throw, eta, None, max_retries, headers=hdrs, **options)

    def checkpoint(self) -> Run:
        """:func:`checkpoint`, for a bound task."""
        return checkpoint()


class _Heartbeat:
    """Renews a running step's lease every third of it, so that only a dead worker's claim expires into UNKNOWN."""

    def __init__(self, step: Step, ttl: float):
        self._step, self._ttl = step, ttl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stopgate-lease-{step.key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                self._step.client.renew(self._step.run_id, self._step.key, worker=self._step.worker, lease_ttl=self._ttl)
            except StopgateError:
                pass  # the next beat tries again; a lease lost is the step's own report's 409

    def stop(self) -> None:
        self._stop.set()
