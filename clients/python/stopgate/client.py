"""The control API of stopgate, for a worker's code: the standard library only.

A worker admits or is handed a run, claims its queued steps through the guard,
schedules retries that a cancel revokes, records the effects it carries itself,
and stops at its next checkpoint once the run is no longer ACTIVE. It hears the
cancel the moment it commits by watching the run (a Server-Sent Events stream
the server sends from whichever instance the worker reaches).

Every call is one HTTP request to the control API; the API decides, this module
only shapes the request and the answer. A refusal is an exception carrying the
server's code and message: :class:`RunCancelled` when the run is no longer
ACTIVE, :class:`StopgateUnavailable` when the server or its store did not
answer (fail closed: do not go on as if the effect were allowed).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Mapping, Optional, TypedDict, Union

__all__ = [
    "ACTIVE",
    "CANCELLING",
    "CANCELLED",
    "COMPLETED",
    "UNKNOWN",
    "Audit",
    "Budget",
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

ACTIVE = "ACTIVE"
CANCELLING = "CANCELLING"
CANCELLED = "CANCELLED"
COMPLETED = "COMPLETED"
UNKNOWN = "UNKNOWN"

DEFAULT_CONTROL = "http://127.0.0.1:8081"
#: How long a watch stream may be silent before it is taken for dead and
#: opened again: three of the server's heartbeats (15 s).
WATCH_IDLE = 45.0

# A row's status only moves forward within one cancel_version, and the version
# only grows: (version, stage) orders every transition of a run.
_STAGE = {ACTIVE: 0, CANCELLING: 1, UNKNOWN: 2, CANCELLED: 3, COMPLETED: 3}


class Budget(TypedDict, total=False):
    """What a run may do before it is cancelled, given at admission (on top of the policy's budget).

    Counts are whole numbers of 1 or more; durations are Go durations ("2h", "30s"); the
    spend is in USD. Past a limit the effect that would cross it is refused and the run
    cancelled in the same step (``budget:<limit>``).
    """

    max_effects: int
    max_effects_per_destination: int
    max_request_bytes: int
    max_response_bytes: int
    max_wall_time: str
    max_input_tokens: int
    max_output_tokens: int
    max_tokens: int
    max_spend_usd: Union[float, str]
    cancel_on_unknown_usage: bool
    drain_timeout: str


def _time(v: Any) -> Optional[datetime]:
    if not v:
        return None
    return datetime.fromisoformat(str(v).replace("Z", "+00:00"))


@dataclass(frozen=True)
class Run:
    """A run's row, as the store keeps it."""

    run_id: str
    status: str
    cancel_version: int
    reason: str = ""
    status_reason: str = ""
    created_at: Optional[datetime] = None
    updated_at: Optional[datetime] = None
    cancelled_at: Optional[datetime] = None
    drain_deadline: Optional[datetime] = None
    #: The run's intents counted by state.
    intents: Mapping[str, int] = field(default_factory=dict)
    #: The budget fixed at admission (empty: none), as the API writes it.
    budget: Mapping[str, Any] = field(default_factory=dict)
    #: What the run has used of it (effects, bytes, tokens, spend); only a read of the run fills it.
    usage: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Run":
        return cls(
            run_id=str(d.get("run_id", "")),
            status=str(d.get("status", "")),
            cancel_version=int(d.get("cancel_version", 0)),
            reason=str(d.get("reason", "")),
            status_reason=str(d.get("status_reason", "")),
            created_at=_time(d.get("created_at")),
            updated_at=_time(d.get("updated_at")),
            cancelled_at=_time(d.get("cancelled_at")),
            drain_deadline=_time(d.get("drain_deadline")),
            intents=dict(d.get("intents") or {}),
            budget=dict(d.get("budget") or {}),
            usage=dict(d.get("usage") or {}),
        )

    @property
    def active(self) -> bool:
        """Whether new work of the run may still start."""
        return self.status == ACTIVE

    @property
    def final(self) -> bool:
        """Whether the row can never change again."""
        return self.status in (CANCELLED, COMPLETED)

    def after(self, other: Optional["Run"]) -> bool:
        """Whether this row is further on than other (None: any row is)."""
        if other is None:
            return True
        if self.cancel_version != other.cancel_version:
            return self.cancel_version > other.cancel_version
        return _STAGE.get(self.status, -1) > _STAGE.get(other.status, -1)


@dataclass(frozen=True)
class Intent:
    """The record of one effect."""

    run_id: str
    key: str
    boundary: str
    state: str
    attempts: int = 0
    method: str = ""
    target: str = ""
    status_code: int = 0
    refusals: int = 0
    observed_version: int = 0
    reason: str = ""
    source: str = ""
    note: str = ""
    lease_owner: str = ""
    lease_expires: Optional[datetime] = None
    not_before: Optional[datetime] = None
    created_at: Optional[datetime] = None
    updated_at: Optional[datetime] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Intent":
        return cls(
            run_id=str(d.get("run_id", "")),
            key=str(d.get("key", "")),
            boundary=str(d.get("boundary", "")),
            state=str(d.get("state", "")),
            attempts=int(d.get("attempts", 0)),
            method=str(d.get("method", "")),
            target=str(d.get("target", "")),
            status_code=int(d.get("status_code", 0)),
            refusals=int(d.get("refusals", 0)),
            observed_version=int(d.get("observed_version", 0)),
            reason=str(d.get("reason", "")),
            source=str(d.get("source", "")),
            note=str(d.get("note", "")),
            lease_owner=str(d.get("lease_owner", "")),
            lease_expires=_time(d.get("lease_expires")),
            not_before=_time(d.get("not_before")),
            created_at=_time(d.get("created_at")),
            updated_at=_time(d.get("updated_at")),
        )


@dataclass(frozen=True)
class Event:
    """One line of a run's audit log."""

    at: Optional[datetime]
    run_id: str
    actor: str
    kind: str
    reason: str = ""
    from_: str = ""
    to: str = ""
    intent: str = ""
    cancel_version: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Event":
        return cls(
            at=_time(d.get("at")),
            run_id=str(d.get("run_id", "")),
            actor=str(d.get("actor", "")),
            kind=str(d.get("kind", "")),
            reason=str(d.get("reason", "")),
            from_=str(d.get("from", "")),
            to=str(d.get("to", "")),
            intent=str(d.get("intent", "")),
            cancel_version=int(d.get("cancel_version", 0)),
        )


@dataclass(frozen=True)
class Guarded:
    """An effect the guard admitted: its intent as recorded and the run's row."""

    intent: Intent
    run: Run


@dataclass(frozen=True)
class Renewed:
    """A heartbeat's answer: the lease extended, and the run's row."""

    intent: Intent
    run: Run


@dataclass(frozen=True)
class Audit:
    """The row, its intents and its events."""

    run: Run
    intents: list[Intent]
    events: list[Event]


class StopgateError(Exception):
    """An answer of the control API that is not a success.

    ``code`` is the server's reason (``run_not_active``, ``forbidden``, ...),
    ``status`` the HTTP status (None when no answer came), ``body`` the JSON the
    server sent (a refusal of the guard carries ``intent`` and ``recorded``).
    """

    def __init__(self, message: str, *, status: Optional[int] = None, code: str = "", body: Optional[Mapping[str, Any]] = None):
        super().__init__(f"{code}: {message}" if code else message)
        self.message = message
        self.status = status
        self.code = code
        self.body: Mapping[str, Any] = body or {}

    @property
    def recorded(self) -> str:
        """What the ledger now says of the refused effect (CANCELLED_BEFORE_DISPATCH), if any."""
        return str(self.body.get("recorded", ""))

    @property
    def intent(self) -> str:
        """The key the refused effect is recorded under, if any."""
        return str(self.body.get("intent", ""))


class RunCancelled(StopgateError):
    """The run is no longer ACTIVE: start nothing new, stop at this checkpoint.

    ``run`` is the row that said so; ``code`` says what stopped it (``run_not_active``,
    ``budget_exceeded`` with the ``limit`` in ``body``, ``tripwire``, ...).
    """

    def __init__(self, run: Run, message: str = "", *, status: Optional[int] = None, code: str = "run_not_active", body: Optional[Mapping[str, Any]] = None):
        super().__init__(message or f"run {run.run_id} is {run.status} at cancel_version {run.cancel_version}", status=status, code=code, body=body)
        self.run = run


class StopgateUnavailable(StopgateError):
    """The control API or its store did not answer: nothing may be taken as allowed."""


def _cancelled(run: Run) -> RunCancelled:
    return RunCancelled(run)


class Client:
    """Calls one stopgate control API.

    ``control`` is its URL (default ``$STOPGATE_CONTROL``, else
    ``http://127.0.0.1:8081``); ``token`` the bearer token (default
    ``$STOPGATE_CONTROL_TOKEN``): a worker holds its run token (``sg1.…``), which
    acts for that one run. ``proxy_addr`` is the egress proxy's host:port for
    :meth:`proxy_settings` (default ``$STOPGATE_PROXY``, else asked of the
    server, which needs an operator or read-only token). The client never goes
    through the proxy variables of its environment: the control API is not an
    upstream.
    """

    def __init__(
        self,
        control: Optional[str] = None,
        token: Optional[str] = None,
        *,
        actor: Optional[str] = None,
        timeout: float = 30.0,
        proxy_addr: Optional[str] = None,
        ssl_context: Optional[ssl.SSLContext] = None,
    ):
        control = control or os.environ.get("STOPGATE_CONTROL") or DEFAULT_CONTROL
        u = urllib.parse.urlsplit(control)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"control URL {control!r}: want http:// or https:// with a host")
        if u.query or u.fragment:
            raise ValueError(f"control URL {control!r}: want no query or fragment")
        self._scheme = u.scheme
        self._host = u.hostname
        self._port = u.port or (443 if u.scheme == "https" else 80)
        self._prefix = u.path.rstrip("/")
        self._where = f"{u.scheme}://{u.netloc}{self._prefix}"
        self.token = token if token is not None else os.environ.get("STOPGATE_CONTROL_TOKEN", "")
        self.actor = actor
        self.timeout = timeout
        self.proxy_addr = proxy_addr or os.environ.get("STOPGATE_PROXY") or None
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self._watches: dict[str, list["Watch"]] = {}

    # -- transport ---------------------------------------------------------

    def _connect(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        if self._scheme == "https":
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl or ssl.create_default_context())
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, accept: str = "application/json") -> dict[str, str]:
        h = {"Accept": accept}
        if self.token:
            h["Authorization"] = "Bearer " + self.token
        if self.actor:
            h["X-Stopgate-Actor"] = self.actor
        return h

    def _path(self, path: str, query: Optional[Mapping[str, str]] = None) -> str:
        p = self._prefix + path
        if query:
            p += "?" + urllib.parse.urlencode(query)
        return p

    def _call(self, method: str, path: str, body: Optional[Mapping[str, Any]] = None, *, query: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None) -> tuple[int, Any, http.client.HTTPResponse]:
        data = None
        headers = self._headers()
        if body is not None:
            data = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
            headers["Content-Type"] = "application/json"
        conn = self._connect(timeout if timeout is not None else self.timeout)
        try:
            try:
                conn.request(method, self._path(path, query), body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                raise StopgateUnavailable(f"cannot reach the control API at {self._where}: {e}") from e
        finally:
            conn.close()
        try:
            value = json.loads(raw) if raw else None
        except ValueError:
            value = None
        if 200 <= resp.status < 300:
            if raw and value is None and resp.headers.get_content_type() == "application/json":
                raise StopgateError(f"{method} {path}: answer {resp.status} is not JSON", status=resp.status)
            return resp.status, value, resp
        raise _error(resp.status, value, raw)

    # -- runs --------------------------------------------------------------

    def admit(self, run_id: str, *, reason: Optional[str] = None, budget: Optional[Budget] = None,
              labels: Optional[Mapping[str, str]] = None) -> Run:
        """Creates the run ACTIVE at version 1 (or returns it if it already is ACTIVE). Operator.

        ``budget`` goes on top of the policy's; ``labels`` choose the policy's budget rule (not
        stored). A run that exists keeps what it was admitted with, its budget included.
        """
        body: dict[str, Any] = {"run_id": run_id, "reason": reason}
        if budget:
            body["budget"] = dict(budget)
        if labels:
            body["labels"] = dict(labels)
        _, v, _ = self._call("POST", "/v1/runs", body)
        return Run.from_json(v)

    def status(self, run_id: str) -> Run:
        """Reads the run's row."""
        _, v, _ = self._call("GET", _run_path(run_id))
        return Run.from_json(v)

    def cancel(self, run_id: str, *, reason: Optional[str] = None, drain_timeout: Optional[float] = None) -> Run:
        """Cancels the run (ACTIVE → CANCELLING); an unseen id gets a CANCELLED tombstone. Operator.

        ``drain_timeout`` is in seconds (None: the server's default).
        """
        _, v, _ = self._call("POST", _run_path(run_id, "cancel"), {"reason": reason, "drain_timeout": drain_timeout})
        return Run.from_json(v["run"])

    def complete(self, run_id: str, cancel_version: int, *, reason: Optional[str] = None) -> Run:
        """Moves the run ACTIVE → COMPLETED if it is still at cancel_version. Operator."""
        _, v, _ = self._call("POST", _run_path(run_id, "complete"), {"cancel_version": cancel_version, "reason": reason})
        return Run.from_json(v)

    def token_for(self, run_id: str, *, ttl: Optional[float] = None) -> str:
        """Mints the run's worker token (``sg1.…``), for an ACTIVE run. Operator."""
        _, v, _ = self._call("POST", _run_path(run_id, "tokens"), {"ttl": ttl})
        return str(v["token"])

    def audit(self, run_id: str) -> Audit:
        """The row, every intent and every event of the run."""
        _, v, _ = self._call("GET", _run_path(run_id, "audit"))
        return Audit(
            run=Run.from_json(v["run"]),
            intents=[Intent.from_json(i) for i in v.get("intents") or []],
            events=[Event.from_json(e) for e in v.get("events") or []],
        )

    # -- the guard ---------------------------------------------------------

    def claim(self, run_id: str, step_id: str, *, cancel_version: int = 0, worker: Optional[str] = None, lease_ttl: Optional[float] = None) -> Guarded:
        """Takes a queued step through the guard: IN_FLIGHT under ``claim:<step_id>``.

        Raises :class:`RunCancelled` when the run is no longer ACTIVE (the
        refusal is recorded CANCELLED_BEFORE_DISPATCH): do not run the step.
        """
        body = {"step_id": step_id, "cancel_version": cancel_version or None, "worker": worker, "lease_ttl": lease_ttl}
        _, v, _ = self._call("POST", _run_path(run_id, "claims"), body)
        return _guarded(v)

    def retry(self, run_id: str, step_id: str, attempt: int, not_before: "datetime | float", *, cancel_version: int = 0) -> Guarded:
        """Schedules attempt ``attempt`` of a step (SCHEDULED under ``retry:<step_id>:<attempt>``).

        ``not_before`` is a datetime or a number of seconds from now. A cancel
        revokes every scheduled retry of the run in its own atomic step; after
        it, this raises :class:`RunCancelled`.
        """
        if not isinstance(not_before, datetime):
            not_before = datetime.fromtimestamp(time.time() + float(not_before), timezone.utc)
        elif not_before.tzinfo is None:
            raise ValueError("not_before: want an aware datetime (with a timezone)")
        at = not_before.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        body = {"step_id": step_id, "attempt": attempt, "not_before": at, "cancel_version": cancel_version or None}
        _, v, _ = self._call("POST", _run_path(run_id, "retries"), body)
        return _guarded(v)

    def dispatch_retry(self, run_id: str, step_id: str, attempt: int, *, cancel_version: int = 0, worker: Optional[str] = None, lease_ttl: Optional[float] = None) -> Guarded:
        """Runs a scheduled retry: the same guard on its key, now IN_FLIGHT and leased.

        Raises :class:`RunCancelled` once the cancel revoked it.
        """
        body = {"cancel_version": cancel_version or None, "worker": worker, "lease_ttl": lease_ttl}
        path = _run_path(run_id, f"retries/{_seg(step_id)}/{int(attempt)}/dispatch")
        _, v, _ = self._call("POST", path, body)
        return _guarded(v)

    def intent(
        self,
        run_id: str,
        key: str,
        *,
        boundary: Optional[str] = None,
        method: Optional[str] = None,
        target: Optional[str] = None,
        body_digest: Optional[str] = None,
        cancel_version: int = 0,
        lease_ttl: Optional[float] = None,
        carrier: Optional[str] = None,
        allow_cancelling: bool = False,
    ) -> Guarded:
        """The guard for an effect that does not travel through the egress proxy (an e-mail, a publish).

        ``key`` is the effect's idempotency key. Report what happened with
        :meth:`outcome`. Raises :class:`RunCancelled` when the run is no longer
        ACTIVE: do not carry the effect out.
        """
        body = {
            "key": key, "boundary": boundary, "method": method, "target": target, "body_digest": body_digest,
            "cancel_version": cancel_version or None, "lease_ttl": lease_ttl, "carrier": carrier,
            "allow_cancelling": allow_cancelling or None,
        }
        _, v, _ = self._call("POST", _run_path(run_id, "intents"), body)
        return _guarded(v)

    def outcome(self, run_id: str, key: str, outcome: str, *, status_code: Optional[int] = None, attempt: Optional[int] = None, reason: Optional[str] = None) -> Intent:
        """Records what happened to an IN_FLIGHT effect: ``responded``, ``not_sent`` or ``unknown``."""
        body = {"outcome": outcome, "status_code": status_code, "attempt": attempt, "reason": reason}
        _, v, _ = self._call("PATCH", _intent_path(run_id, key), body)
        return Intent.from_json(v)

    def renew(self, run_id: str, key: str, *, worker: Optional[str] = None, lease_ttl: Optional[float] = None) -> Renewed:
        """A heartbeat on an effect the worker carries: the lease extended, and the run's row.

        A 409 ``intent_not_in_flight`` (a :class:`StopgateError`) says the lease is
        no longer the worker's: stop, and do not report success.
        """
        _, v, _ = self._call("POST", _intent_path(run_id, key, "renew"), {"worker": worker, "lease_ttl": lease_ttl})
        return Renewed(intent=Intent.from_json(v["intent"]), run=Run.from_json(v["run"]))

    @contextlib.contextmanager
    def effect(self, run_id: str, key: str, **guard: Any) -> Iterator[Guarded]:
        """Guards one effect, carries it inside the ``with`` block, and records its outcome.

        The block finishing records ``responded``; an exception records
        ``unknown`` (the effect may or may not have happened: an operator
        reconciles it) and propagates. Raises :class:`RunCancelled` before the
        block when the guard refuses.
        """
        g = self.intent(run_id, key, **guard)
        try:
            yield g
        except BaseException as e:
            with contextlib.suppress(StopgateError):
                self.outcome(run_id, key, "unknown", attempt=g.intent.attempts, reason=f"{type(e).__name__}: {e}"[:1000])
            raise
        self.outcome(run_id, key, "responded", attempt=g.intent.attempts)

    # -- hearing the cancel ------------------------------------------------

    def watch(self, run_id: str, *, on_cancel: Optional[Callable[[Run], None]] = None) -> "Watch":
        """Follows the run's row: iterate it, or start it (``with`` does) to run in the background.

        With ``on_cancel`` it starts at once and calls it, from its thread, the
        first time the row is no longer ACTIVE.
        """
        w = Watch(self, run_id, on_cancel=on_cancel)
        if on_cancel is not None:
            w.start()
        return w

    def poll(self, run_id: str, held: Run, *, wait: float = 30.0) -> Run:
        """Long-polls the run: answers once the row is not ``held`` any more (at once if it already is not), or after ``wait`` seconds (at most 60)."""
        q = {"after_version": str(held.cancel_version), "after_status": held.status, "wait": f"{wait}s"}
        _, v, _ = self._call("GET", _run_path(run_id, "watch"), query=q, timeout=wait + self.timeout)
        return Run.from_json(v)

    def checkpoint(self, run_id: str) -> Run:
        """Raises :class:`RunCancelled` if the run is no longer ACTIVE; returns its row otherwise.

        With a started :class:`Watch` of the run on this client that is
        connected and has heard from the server within WATCH_IDLE, it asks
        nothing of the server; otherwise it reads the row, and raises
        :class:`StopgateUnavailable` when it cannot: a checkpoint that cannot
        tell does not say "go on".
        """
        with self._lock:
            watches = list(self._watches.get(run_id, ()))
        for w in watches:
            row = w.fresh_row()
            if row is not None:
                if not row.active:
                    raise _cancelled(row)
                return row
        row = self.status(run_id)
        if not row.active:
            raise _cancelled(row)
        return row

    def _register(self, w: "Watch") -> None:
        with self._lock:
            self._watches.setdefault(w.run_id, []).append(w)

    def _unregister(self, w: "Watch") -> None:
        with self._lock:
            ws = self._watches.get(w.run_id, [])
            if w in ws:
                ws.remove(w)
            if not ws:
                self._watches.pop(w.run_id, None)

    # -- the egress proxy --------------------------------------------------

    def ca_pem(self) -> bytes:
        """The egress proxy's MITM CA certificate (PEM) a worker's clients must trust."""
        conn = self._connect(self.timeout)
        try:
            try:
                conn.request("GET", self._path("/v1/ca"), headers={"Accept": "application/x-pem-file"})
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                raise StopgateUnavailable(f"cannot reach the control API at {self._where}: {e}") from e
        finally:
            conn.close()
        if resp.status != 200:
            raise _error(resp.status, _json_or_none(raw), raw)
        return raw

    def proxy_settings(self, run_id: str, *, token: Optional[str] = None, cancel_version: Optional[int] = None) -> "ProxySettings":
        """The egress proxy's URL carrying the run's identity, and the CA to trust.

        The password is the run token: ``token``, else this client's token
        when it is one (``sg1.…``); otherwise the cancel_version observed
        (``cancel_version``, else read now), so that the proxy refuses the
        run's requests once it is cancelled.
        """
        addr = self.proxy_addr
        if not addr:
            _, v, _ = self._call("GET", "/v1/endpoints")
            addr = str(v["proxy"])
        password = token or (self.token if self.token.startswith("sg1.") else "")
        if not password:
            password = str(cancel_version if cancel_version is not None else self.status(run_id).cancel_version)
        url = f"http://{urllib.parse.quote(run_id, safe='')}:{urllib.parse.quote(password, safe='')}@{addr}"
        return ProxySettings(url=url, ca_pem=self.ca_pem())


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _error(status: int, value: Any, raw: bytes) -> StopgateError:
    if isinstance(value, dict) and value.get("error"):
        code, msg = str(value["error"]), str(value.get("message", ""))
        # The run is over for the worker when the refusal's row says it is no longer ACTIVE,
        # whatever stopped it (a cancel, its budget, a tripwire): the row decides, not a list of codes.
        row = value.get("run")
        if code == "run_not_active" or (isinstance(row, dict) and row.get("status", ACTIVE) != ACTIVE):
            row = row or {"run_id": value.get("run_id", ""), "status": value.get("status", ""), "cancel_version": value.get("cancel_version", 0)}
            return RunCancelled(Run.from_json(row), msg, status=status, code=code, body=value)
        if status == 503:
            return StopgateUnavailable(msg, status=status, code=code, body=value)
        return StopgateError(msg, status=status, code=code, body=value)
    snippet = raw[:200].decode("utf-8", "replace").strip()
    cls = StopgateUnavailable if status >= 500 else StopgateError
    return cls(f"control API answered {status}" + (f": {snippet}" if snippet else ""), status=status)


def _guarded(v: Mapping[str, Any]) -> Guarded:
    return Guarded(intent=Intent.from_json(v["intent"]), run=Run.from_json(v["run"]))


def _seg(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _run_path(run_id: str, tail: str = "") -> str:
    p = "/v1/runs/" + _seg(run_id)
    return p + "/" + tail if tail else p


def _intent_path(run_id: str, key: str, tail: str = "") -> str:
    p = _run_path(run_id, "intents/" + _seg(key))
    return p + "/" + tail if tail else p


class Watch:
    """Follows one run's row through the control API's watch stream.

    Iterating yields the row as it stands, then the row at every transition,
    each once and in order, until the row is final (CANCELLED or COMPLETED) or
    :meth:`close`. The stream is opened again when the connection breaks, goes
    silent for WATCH_IDLE, or the server ends it (shutdown, max age). A refusal
    that trying again cannot change (401, 403, 404) is raised.

    :meth:`start` (or ``with``) runs it in a daemon thread instead: :attr:`row`
    is then the latest row, :meth:`checkpoint` raises :class:`RunCancelled` once
    it is not ACTIVE, and ``on_cancel`` is called once, from that thread, when
    it first is not.
    """

    def __init__(self, client: Client, run_id: str, *, on_cancel: Optional[Callable[[Run], None]] = None):
        self.client = client
        self.run_id = run_id
        self.on_cancel = on_cancel
        self._row: Optional[Run] = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._cancelled = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._conn: Optional[http.client.HTTPConnection] = None
        self._connected = False
        self._heard = 0.0
        #: The error that ended a started watch, if one did.
        self.error: Optional[BaseException] = None

    # iteration

    def __iter__(self) -> Iterator[Run]:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                for row in self._stream():
                    backoff = 0.1
                    yield row
                    if row.final:
                        return
            except StopgateError as e:
                if e.status is not None and e.status < 500 and e.status != 429:
                    raise
            except (OSError, http.client.HTTPException, ValueError):
                pass
            finally:
                self._connected = False
            if self._row is not None and self._row.final:
                return
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, 5.0)

    def _stream(self) -> Iterator[Run]:
        c = self.client
        conn = c._connect(WATCH_IDLE)
        self._conn = conn
        try:
            if self._closed.is_set():
                return  # closed before close() could reach this connection
            conn.request("GET", c._path(_run_path(self.run_id, "watch")), headers=c._headers("text/event-stream"))
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read()
                raise _error(resp.status, _json_or_none(raw), raw)
            self._connected = True
            event, data = "", ""
            while not self._closed.is_set():
                line = resp.readline(1 << 20)
                if not line:
                    return  # the server closed the stream
                self._heard = time.monotonic()
                text = line.decode("utf-8").rstrip("\r\n")
                if text == "":
                    if event == "run":
                        row = Run.from_json(json.loads(data))
                        if self._offer(row):
                            yield row
                    elif event == "end":
                        return
                    event, data = "", ""
                elif text.startswith(":"):
                    continue  # heartbeat
                else:
                    name, _, value = text.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "event":
                        event = value
                    elif name == "data":
                        data += value
        finally:
            self._conn = None
            conn.close()

    def _offer(self, row: Run) -> bool:
        with self._lock:
            if not row.after(self._row):
                return False
            self._row = row
        return True

    # background

    def start(self) -> "Watch":
        """Runs the watch in a daemon thread (once); returns self."""
        if self._thread is None:
            self.client._register(self)
            self._thread = threading.Thread(target=self._run, name=f"stopgate-watch-{self.run_id}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for row in self:
                if not row.active and not self._cancelled.is_set():
                    self._cancelled.set()
                    if self.on_cancel is not None:
                        self.on_cancel(row)
        except BaseException as e:  # kept for the owner; the thread has no one to raise to
            self.error = e
        finally:
            self.client._unregister(self)

    @property
    def row(self) -> Optional[Run]:
        """The latest row heard (None before the first)."""
        with self._lock:
            return self._row

    def fresh_row(self) -> Optional[Run]:
        """The latest row if the stream is connected and heard from within WATCH_IDLE, else None.

        A final row is always fresh: it never changes.
        """
        row = self.row
        if row is not None and (row.final or (self._connected and time.monotonic() - self._heard < WATCH_IDLE)):
            return row
        return None

    def checkpoint(self) -> Run:
        """Raises :class:`RunCancelled` if the run is no longer ACTIVE (see :meth:`Client.checkpoint`)."""
        row = self.fresh_row()
        if row is None:
            row = self.client.status(self.run_id)
        if not row.active:
            raise _cancelled(row)
        return row

    def wait_cancelled(self, timeout: Optional[float] = None) -> Optional[Run]:
        """Blocks until a started watch hears that the run is no longer ACTIVE; its row, or None after timeout."""
        if self._cancelled.wait(timeout):
            return self.row
        return None

    def close(self) -> None:
        """Ends the watch: the stream is closed and a started thread ends."""
        self._closed.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.client._unregister(self)

    def __enter__(self) -> "Watch":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class ProxySettings:
    """Where a run's HTTP goes: the egress proxy with the run's identity, and its CA."""

    #: ``http://RUN:PASSWORD@host:port``, for HTTPS_PROXY and HTTP_PROXY.
    url: str
    #: The MITM CA certificate (PEM) the run's clients must trust.
    ca_pem: bytes

    def ssl_context(self) -> ssl.SSLContext:
        """A client context trusting the system's roots and the CA."""
        ctx = ssl.create_default_context()
        ctx.load_verify_locations(cadata=self.ca_pem.decode())
        return ctx

    def opener(self) -> urllib.request.OpenerDirector:
        """A urllib opener that sends HTTP and HTTPS through the proxy, trusting the CA."""
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": self.url, "https": self.url}),
            urllib.request.HTTPSHandler(context=self.ssl_context()),
        )

    def env(self, directory: str) -> dict[str, str]:
        """The environment a child process needs: the proxy variables (both cases), NO_PROXY cleared, and the CA.

        Writes ``stopgate-ca.pem`` (the CA, for NODE_EXTRA_CA_CERTS) and
        ``stopgate-bundle.pem`` (the system's roots and the CA, for the
        variables that replace the roots) into ``directory``.
        """
        ca = os.path.join(directory, "stopgate-ca.pem")
        bundle = os.path.join(directory, "stopgate-bundle.pem")
        with open(ca, "wb") as f:
            f.write(self.ca_pem)
        roots = b""
        default = ssl.get_default_verify_paths().cafile
        if default and os.path.exists(default):
            with open(default, "rb") as f:
                roots = f.read()
        with open(bundle, "wb") as f:
            f.write(roots + (b"\n" if roots and not roots.endswith(b"\n") else b"") + self.ca_pem)
        env = {k: self.url for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")}
        env.update({"NO_PROXY": "", "no_proxy": ""})
        env.update({k: bundle for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")})
        env["NODE_EXTRA_CA_CERTS"] = ca
        return env
