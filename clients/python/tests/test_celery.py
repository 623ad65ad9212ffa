"""Celery guarded at the claim: real workers, a real Redis broker, a real stopgate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from collections import Counter

import redis
from celery.result import AsyncResult

import stopgate
import stopgate.celery as sgc

from . import support
from .support import eventually, operator, run_id

QUEUED = 20
CANCEL_AFTER = 3


class CeleryTest(unittest.TestCase):
    def setUp(self) -> None:
        from . import celery_app

        self.app = celery_app.app
        self.records = celery_app.records
        for url in (celery_app.BROKER, celery_app.BACKEND, celery_app.RECORDS):
            redis.Redis.from_url(url).flushdb()
        self.logs = tempfile.mkdtemp(prefix="celery-workers-")
        # One worker on each instance of the fleet: the cancel is taken by one.
        self.workers = [self._worker("w1", support.CONTROL), self._worker("w2", support.CONTROL_B)]
        self.addCleanup(self._stop_workers)
        eventually("both workers answer a ping", lambda: len(self.app.control.ping(timeout=0.5)) == 2, within=60, every=0.2)

    def _worker(self, name: str, control: str) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.logs, name + ".log"), "wb")
        self.addCleanup(log.close)
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "-P", "solo", "-n", f"{name}@%h",
             "--loglevel=INFO", "--without-gossip", "--without-mingle"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, STOPGATE_CONTROL=control),
        )

    def _stop_workers(self) -> None:
        for p in self.workers:
            p.send_signal(signal.SIGTERM)
        for p in self.workers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def _worker_logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.logs)):
            with open(os.path.join(self.logs, name), "rb") as f:
                out.append(f"== {name}\n" + f.read().decode("utf-8", "replace")[-4000:])
        return "\n".join(out)

    def test_a_cancel_stops_the_queue_at_the_claim(self) -> None:
        from .celery_app import work

        op = operator()
        rid = op.admit(run_id("celery")).run_id
        token = op.token_for(rid)
        ids = [work.apply_async((i, 30), headers=sgc.headers(rid, 1, token=token)).id for i in range(QUEUED)]
        try:
            eventually(f"{CANCEL_AFTER} tasks start", lambda: self.records.llen("starts") >= CANCEL_AFTER, within=60, every=0.01)
            sent = time.time()
            op.cancel(rid, reason="operator stop")
            eventually("every task settles", lambda: all(AsyncResult(i, app=self.app).state in ("SUCCESS", "FAILURE", "REVOKED") for i in ids), within=90, every=0.2)
            final = eventually("the run drains", lambda: (lambda r: r if r.final else None)(op.status(rid)), within=30)
        except AssertionError:
            print(self._worker_logs())
            raise
        assert final is not None
        self.assertEqual((final.status, final.status_reason), (stopgate.CANCELLED, "drained"))

        # The queue's own records: the result backend, and what the task bodies wrote.
        results = {i: AsyncResult(i, app=self.app) for i in ids}
        states = Counter(r.state for r in results.values())
        why = Counter(str(r.result).split(":")[0] + ":" + str(r.result).split(":")[1] for r in results.values() if r.state == "REVOKED")
        starts = [json.loads(s) for s in self.records.lrange("starts", 0, -1)]
        effects = [json.loads(e) for e in self.records.lrange("effects", 0, -1)]
        first_starts = [s for s in starts if s["attempt"] == 0]
        retry_starts = [s for s in starts if s["attempt"] > 0]

        # stopgate's audit: every transition in commit order.
        audit = op.audit(rid)
        cancel_at = next(n for n, e in enumerate(audit.events) if e.kind == "run.cancel")
        admitted = {e.intent: n for n, e in enumerate(audit.events) if e.kind == "intent.admitted"}
        intents = {i.key: i for i in audit.intents}
        claims = {k: i for k, i in intents.items() if k.startswith("claim:")}
        retries = {k: i for k, i in intents.items() if k.startswith("retry:")}
        guarded_effects = {k: i for k, i in intents.items() if k.startswith("effect:")}
        claimed_before = [k for k in claims if admitted.get(k, len(audit.events)) < cancel_at]
        claimed_after = [k for k in claims if k in admitted and admitted[k] > cancel_at]
        refused = [k for k, i in claims.items() if i.state == "CANCELLED_BEFORE_DISPATCH"]
        stopped = [k for k, i in claims.items() if i.reason.startswith("stopped at a checkpoint")]
        revoked = [k for k, i in retries.items() if i.state == "REVOKED"]
        retries_refused = [k for k, i in retries.items() if i.state == "CANCELLED_BEFORE_DISPATCH"]
        dispatched_after = [e.intent for n, e in enumerate(audit.events) if n > cancel_at and e.kind == "intent.admitted" and e.intent.startswith("retry:")]
        # An effect a task asked for after the cancel is refused: recorded, never admitted.
        effects_after_audit = [k for k in guarded_effects if k in admitted and admitted[k] > cancel_at]
        effects_refused = [k for k, i in guarded_effects.items() if i.state == "CANCELLED_BEFORE_DISPATCH"]
        neither = [k for k in guarded_effects if k not in admitted and k not in effects_refused]
        outcome_at = {e.intent: n for n, e in enumerate(audit.events) if e.kind == "intent.outcome"}
        in_flight_audit = [k for k in guarded_effects if admitted.get(k, len(audit.events)) < cancel_at < outcome_at.get(k, len(audit.events))]
        in_flight_provider = [e for e in effects if e["at"] > sent]
        # An effect may be carried out after the cancel only if the guard admitted it before (in flight at the cancel).
        not_admitted_before = [e for e in effects if admitted.get(e["key"], len(audit.events)) > cancel_at]
        unguarded = [e for e in effects if e["key"] not in guarded_effects or guarded_effects[e["key"]].state != "RESPONDED"]

        rows = [
            ("tasks queued", f"{len(ids)} sent", f"{len(claims)} claim intents"),
            ("started before the cancel", f"{len(first_starts)} bodies started", f"{len(claimed_before)} claims admitted before run.cancel"),
            ("started after the cancel", f"{len(first_starts) - len(claimed_before)}", f"{len(claimed_after)} claims admitted after run.cancel"),
            ("refused at the claim", f"{why[sgc.REFUSED_AT_CLAIM]} REVOKED ({sgc.REFUSED_AT_CLAIM})", f"{len(refused)} claims CANCELLED_BEFORE_DISPATCH"),
            ("stopped at a checkpoint", f"{why[sgc.STOPPED_AT_CHECKPOINT]} REVOKED ({sgc.STOPPED_AT_CHECKPOINT})", f"{len(stopped)} claims RESPONDED, stopped at a checkpoint"),
            ("retries revoked", f"{why[sgc.RETRY_REVOKED]} REVOKED ({sgc.RETRY_REVOKED})", f"{len(revoked)} retry intents REVOKED"),
            ("retries refused (scheduled after the cancel)", f"{why[sgc.RETRY_REFUSED]} REVOKED ({sgc.RETRY_REFUSED})", f"{len(retries_refused)} retry intents CANCELLED_BEFORE_DISPATCH"),
            ("retries run after the cancel", f"{len(retry_starts)} retried bodies started", f"{len(dispatched_after)} retries admitted after run.cancel"),
            ("effects in flight at the cancel", f"{len(in_flight_provider)} provider records after the cancel was sent", f"{len(in_flight_audit)} admitted before run.cancel, finished after"),
            ("effects after the cancel", f"{len(not_admitted_before)} provider records not admitted before it", f"{len(effects_after_audit)} effect intents admitted after run.cancel, {len(effects_refused)} refused"),
            ("effects in all", f"{len(effects)} provider records ({len(unguarded)} without a RESPONDED intent)", f"{len(guarded_effects)} effect intents"),
        ]
        print(f"\nCelery, {QUEUED} tasks of run {rid}, two workers, cancel after {CANCEL_AFTER} started "
              f"(Celery states: {dict(states)})")
        print("| | Celery's records | stopgate's audit |\n|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")

        self.assertEqual(len(claims), QUEUED, "the audit accounts for every task")
        self.assertEqual({i.state for i in claims.values()} - {"RESPONDED", "CANCELLED_BEFORE_DISPATCH"}, set())
        self.assertEqual(claimed_after, [], "no claim admitted after the cancel")
        self.assertGreaterEqual(len(claimed_before), CANCEL_AFTER)
        self.assertEqual(len(first_starts), len(claimed_before), "a body started exactly for each claim admitted, and only those")
        self.assertEqual({s["task"] for s in first_starts}, {k.removeprefix("claim:") for k in claimed_before})
        self.assertEqual(why[sgc.REFUSED_AT_CLAIM], len(refused))
        self.assertEqual(len(refused) + len(claimed_before), QUEUED)
        self.assertGreater(len(refused), 0)
        self.assertEqual(why[sgc.STOPPED_AT_CHECKPOINT], len(stopped))
        self.assertGreater(len(stopped), 0, "a task running at the cancel stopped at its checkpoint")
        self.assertEqual(why[sgc.RETRY_REVOKED], len(revoked))
        self.assertEqual(why[sgc.RETRY_REFUSED], len(retries_refused))
        self.assertGreater(len(revoked) + len(retries_refused), 0, "a retry of a task that failed before the cancel was revoked")
        self.assertEqual(retry_starts, [])
        self.assertEqual(dispatched_after, [])
        self.assertEqual(effects_after_audit, [])
        self.assertEqual(neither, [], "an effect intent is admitted or refused, and the audit says which")
        self.assertEqual(not_admitted_before, [])
        self.assertEqual(unguarded, [])
        self.assertEqual(states["SUCCESS"] + states["REVOKED"], QUEUED, f"every task SUCCESS or REVOKED: {dict(states)}")


class SharedWatchTest(unittest.TestCase):
    """A worker process holds one watch per run for the tasks of the run it runs, and lets it go once they are done."""

    def test_shared_then_closed_when_idle(self) -> None:
        op = operator()
        rid = op.admit(run_id("follow")).run_id
        token = op.token_for(rid)
        self.addCleanup(setattr, sgc, "FOLLOW_IDLE", sgc.FOLLOW_IDLE)
        sgc.FOLLOW_IDLE = 0.3
        before = sgc.active_watches()
        first, c1 = sgc._follow(support.CONTROL, token, rid)
        second, c2 = sgc._follow(support.CONTROL, token, rid)
        self.assertIs(c1, c2, "two tasks of one run share the client, and so the watch")
        self.assertEqual(sgc.active_watches(), before + 1)
        watch = sgc._follows[first].watch
        eventually("the watch has the row", lambda: watch.fresh_row())
        self.assertEqual(c1.checkpoint(rid).status, stopgate.ACTIVE)
        sgc._unfollow(first)
        time.sleep(0.6)
        self.assertEqual(sgc.active_watches(), before + 1, "a task of the run still runs: the watch stays")
        sgc._unfollow(second)
        eventually("the idle watch is closed", lambda: sgc.active_watches() == before, within=5)
        thread = watch._thread
        assert thread is not None

        def closed() -> bool:
            assert thread is not None
            return not thread.is_alive()

        eventually("its stream is closed", closed, within=5)


if __name__ == "__main__":
    unittest.main()
