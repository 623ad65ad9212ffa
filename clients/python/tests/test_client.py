"""The Python client against a real stopgate serve (two instances sharing a Redis store)."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import stopgate
from stopgate import RunCancelled, StopgateError, StopgateUnavailable

from . import support
from .support import eventually, operator, run_id


class RunsTest(unittest.TestCase):
    def setUp(self) -> None:
        self.op = operator()

    def test_admit_status_cancel_complete(self) -> None:
        rid = run_id()
        row = self.op.admit(rid)
        self.assertEqual((row.run_id, row.status, row.cancel_version), (rid, stopgate.ACTIVE, 1))
        self.assertTrue(row.active)
        self.assertIsNotNone(row.created_at)
        self.assertEqual(self.op.admit(rid), self.op.status(rid), "admit of an ACTIVE run returns its row")
        cancelled = self.op.cancel(rid, reason="operator stop", drain_timeout=5)
        self.assertEqual((cancelled.status, cancelled.cancel_version, cancelled.reason), (stopgate.CANCELLING, 2, "operator stop"))
        self.assertIsNotNone(cancelled.drain_deadline)
        done = self.op.admit(run_id())
        self.assertEqual(self.op.complete(done.run_id, 1).status, stopgate.COMPLETED)

    def test_refusals_carry_the_servers_code_and_words(self) -> None:
        with self.assertRaises(StopgateError) as cm:
            self.op.status(run_id("never"))
        self.assertEqual((cm.exception.status, cm.exception.code), (404, "not_found"))
        self.assertIn("never admitted", cm.exception.message)
        rid = self.op.admit(run_id()).run_id
        self.op.cancel(rid)
        with self.assertRaises(RunCancelled) as rc:
            self.op.admit(rid)
        # Nothing was in flight: the sweeper may have drained the run already.
        self.assertIn(rc.exception.run.status, (stopgate.CANCELLING, stopgate.CANCELLED))
        with self.assertRaises(StopgateError) as bad:
            self.op.claim(rid, "has space")
        self.assertEqual((bad.exception.status, bad.exception.code), (400, "invalid_request"))

    def test_bad_control_url(self) -> None:
        for url in ("ftp://x", "http://", "http://h/?q=1"):
            with self.subTest(url=url), self.assertRaises(ValueError):
                stopgate.Client(url, "t")

    def test_unreachable_server_is_unavailable(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        c = stopgate.Client(f"http://127.0.0.1:{port}", "t", timeout=2)
        with self.assertRaises(StopgateUnavailable):
            c.status("r1")
        # A checkpoint that cannot tell does not say "go on".
        with self.assertRaises(StopgateUnavailable):
            c.checkpoint("r1")


class GuardTest(unittest.TestCase):
    """claim, retry, intent/outcome: the guard through the client, as a worker with its run token."""

    def setUp(self) -> None:
        self.op = operator()
        self.rid = self.op.admit(run_id()).run_id
        self.worker = stopgate.Client(support.CONTROL, self.op.token_for(self.rid))

    def test_claim_then_refused_after_the_cancel(self) -> None:
        g = self.worker.claim(self.rid, "s1", cancel_version=1, worker="w-1")
        self.assertEqual((g.intent.key, g.intent.state, g.intent.lease_owner), ("claim:s1", "IN_FLIGHT", f"worker:{self.rid}/w-1"))
        beat = self.worker.renew(self.rid, "claim:s1", worker="w-1")
        self.assertEqual(beat.run.status, stopgate.ACTIVE)
        self.worker.outcome(self.rid, "claim:s1", "responded")
        self.op.cancel(self.rid)
        # The heartbeat's row is how a worker without a watch would learn it.
        with self.assertRaises(RunCancelled) as cm:
            self.worker.claim(self.rid, "s2", cancel_version=1)
        e = cm.exception
        self.assertEqual((e.status, e.code, e.recorded, e.intent), (409, "run_not_active", "CANCELLED_BEFORE_DISPATCH", "claim:s2"))
        self.assertEqual(e.run.cancel_version, 2)
        self.assertFalse(e.run.active)
        states = {i.key: i.state for i in self.op.audit(self.rid).intents}
        self.assertEqual(states, {"claim:s1": "RESPONDED", "claim:s2": "CANCELLED_BEFORE_DISPATCH"})

    def test_retry_is_revoked_by_the_cancel(self) -> None:
        self.worker.claim(self.rid, "s1")
        self.worker.outcome(self.rid, "claim:s1", "responded", reason="failed; retrying")
        r = self.worker.retry(self.rid, "s1", 1, 60)
        self.assertEqual((r.intent.key, r.intent.state), ("retry:s1:1", "SCHEDULED"))
        self.assertIsNotNone(r.intent.not_before)
        self.op.cancel(self.rid)
        with self.assertRaises(RunCancelled) as cm:
            self.worker.dispatch_retry(self.rid, "s1", 1)
        self.assertEqual(cm.exception.body.get("intent"), "retry:s1:1")
        with self.assertRaises(RunCancelled):
            self.worker.retry(self.rid, "s1", 2, 1)
        audit = self.op.audit(self.rid)
        self.assertEqual({i.key: i.state for i in audit.intents}["retry:s1:1"], "REVOKED")
        self.assertIn("intent.revoked", [e.kind for e in audit.events])

    def test_a_due_retry_is_dispatched(self) -> None:
        self.worker.claim(self.rid, "s1")
        self.worker.outcome(self.rid, "claim:s1", "responded")
        self.worker.retry(self.rid, "s1", 1, 0)
        d = self.worker.dispatch_retry(self.rid, "s1", 1, worker="w-2")
        # The schedule was its first attempt, the dispatch is its second.
        self.assertEqual((d.intent.state, d.intent.attempts), ("IN_FLIGHT", 2))

    def test_effects_recorded_with_their_outcome(self) -> None:
        with self.worker.effect(self.rid, "mail-1", target="smtp://mail", method="SEND") as g:
            self.assertEqual(g.intent.state, "IN_FLIGHT")
        with self.assertRaises(ZeroDivisionError):
            with self.worker.effect(self.rid, "mail-2"):
                1 / 0
        g = self.worker.intent(self.rid, "mail-3", boundary="delivery")
        self.worker.outcome(self.rid, "mail-3", "responded", status_code=250, attempt=g.intent.attempts)
        states = {i.key: (i.state, i.status_code) for i in self.op.audit(self.rid).intents}
        self.assertEqual(states, {"mail-1": ("RESPONDED", 0), "mail-2": ("UNKNOWN", 0), "mail-3": ("RESPONDED", 250)})
        self.op.cancel(self.rid)
        with self.assertRaises(RunCancelled):
            with self.worker.effect(self.rid, "mail-4"):
                self.fail("an effect of a cancelled run ran")

    def test_a_budget_given_at_admission_stops_the_run(self) -> None:
        rid = self.op.admit(run_id("budget"), budget={"max_effects": 2, "max_wall_time": "1h"}, labels={"team": "research"}).run_id
        row = self.op.status(rid)
        self.assertEqual((row.budget.get("max_effects"), row.budget.get("max_wall_time")), (2, "1h0m0s"))
        worker = stopgate.Client(support.CONTROL, self.op.token_for(rid))
        for step in ("s1", "s2"):
            worker.claim(rid, step)
            worker.outcome(rid, f"claim:{step}", "responded")
        # The refusal that cancels the run is a RunCancelled like any other: the worker stops.
        with self.assertRaises(RunCancelled) as cm:
            worker.claim(rid, "s3")
        e = cm.exception
        self.assertEqual((e.status, e.code, e.body.get("limit"), e.recorded), (409, "budget_exceeded", "max_effects", "CANCELLED_BEFORE_DISPATCH"))
        self.assertEqual((e.run.status, e.run.cancel_version, e.run.reason), (stopgate.CANCELLING, 2, "budget:max_effects"))
        # A step's answer carries the row without its usage; reading the run gives it.
        self.assertEqual(self.op.status(rid).usage.get("effects"), 2)
        self.assertFalse(e.run.active)

    def test_worker_token_acts_for_its_run_only(self) -> None:
        other = self.op.admit(run_id()).run_id
        for call in (lambda: self.worker.claim(other, "s1"), lambda: self.worker.status(other),
                     lambda: list(self.worker.watch(other)), lambda: self.worker.cancel(self.rid)):
            with self.subTest(call=call), self.assertRaises(StopgateError) as cm:
                call()
            self.assertEqual((cm.exception.status, cm.exception.code), (403, "forbidden"))


class WatchTest(unittest.TestCase):
    def setUp(self) -> None:
        self.op = operator()
        self.rid = self.op.admit(run_id()).run_id
        # A step in flight holds a cancelled run CANCELLING until it reports,
        # so each transition is its own (a run with nothing in flight may
        # drain before a watch reads the cancel's row: it then gets the later row).
        self.op.claim(self.rid, "held")

    def test_iterates_each_transition_to_the_final_row(self) -> None:
        seen: list[str] = []
        for row in self.op.watch(self.rid):
            seen.append(row.status)
            if row.status == stopgate.ACTIVE:
                self.op.cancel(self.rid)
            elif row.status == stopgate.CANCELLING:
                self.op.outcome(self.rid, "claim:held", "responded")
        # CANCELLING → CANCELLED is not broadcast (the outcome drains the run): the watch carries it too.
        self.assertEqual(seen, [stopgate.ACTIVE, stopgate.CANCELLING, stopgate.CANCELLED])

    def test_on_cancel_hears_a_cancel_taken_by_another_instance(self) -> None:
        heard: list[stopgate.Run] = []
        done = threading.Event()

        def on_cancel(row: stopgate.Run) -> None:
            heard.append(row)
            done.set()

        w = stopgate.Client(support.CONTROL_B, support.TOKEN).watch(self.rid, on_cancel=on_cancel)
        try:
            eventually("the watch has the row", lambda: w.row)
            start = time.monotonic()
            self.op.cancel(self.rid, reason="stop")
            self.assertTrue(done.wait(10), "on_cancel was not called")
            self.assertLess(time.monotonic() - start, 10)
            self.assertEqual((heard[0].status, heard[0].reason), (stopgate.CANCELLING, "stop"))
            self.assertEqual(len(heard), 1)
            row = w.wait_cancelled(0)
            assert row is not None
            self.assertEqual(row.status, stopgate.CANCELLING)
        finally:
            w.close()

    def test_checkpoint(self) -> None:
        worker = stopgate.Client(support.CONTROL, self.op.token_for(self.rid))
        self.assertEqual(worker.checkpoint(self.rid).status, stopgate.ACTIVE, "without a watch: the row is read")
        with worker.watch(self.rid) as w:
            eventually("the watch has the row", lambda: w.fresh_row())
            self.assertEqual(worker.checkpoint(self.rid).status, stopgate.ACTIVE)
            self.op.cancel(self.rid)
            eventually("the watch hears the cancel", lambda: w.row and not w.row.active)
            with self.assertRaises(RunCancelled) as cm:
                worker.checkpoint(self.rid)
            self.assertEqual(cm.exception.run.status, stopgate.CANCELLING)
            with self.assertRaises(RunCancelled):
                w.checkpoint()
        # Closed, the watch is no longer asked: the row is read again.
        with self.assertRaises(RunCancelled):
            worker.checkpoint(self.rid)

    def test_close_ends_a_blocked_watch(self) -> None:
        w = self.op.watch(self.rid).start()
        eventually("the watch has the row", lambda: w.row)
        start = time.monotonic()
        w.close()
        self.assertLess(time.monotonic() - start, 5)
        thread = w._thread
        assert thread is not None
        self.assertFalse(thread.is_alive())

    def test_poll(self) -> None:
        held = self.op.status(self.rid)
        start = time.monotonic()
        same = self.op.poll(self.rid, held, wait=0.3)
        self.assertEqual(same.status, stopgate.ACTIVE)
        self.assertGreaterEqual(time.monotonic() - start, 0.3)
        threading.Timer(0.2, lambda: self.op.cancel(self.rid)).start()
        moved = self.op.poll(self.rid, held, wait=20)
        self.assertEqual(moved.status, stopgate.CANCELLING)
        self.assertTrue(moved.after(held))


class ProxyTest(unittest.TestCase):
    def setUp(self) -> None:
        self.op = operator()
        self.rid = self.op.admit(run_id()).run_id
        self.worker = stopgate.Client(support.CONTROL, self.op.token_for(self.rid), proxy_addr=support.PROXY)

    def test_requests_go_through_the_guard_until_the_cancel(self) -> None:
        settings = self.worker.proxy_settings(self.rid)
        self.assertTrue(settings.url.startswith(f"http://{self.rid}:sg1."), settings.url)
        self.assertIn(b"BEGIN CERTIFICATE", settings.ca_pem)
        opener = settings.opener()
        for url in (support.HTTP_UPSTREAM, support.HTTPS_UPSTREAM):
            with self.subTest(url=url), opener.open(url + "/hello", timeout=10) as resp:
                self.assertEqual(resp.status, 200)
                self.assertEqual(resp.read(), b"hello GET /hello")
                self.assertTrue(resp.headers.get("X-Stopgate-Intent"))
        self.op.cancel(self.rid)
        for url in (support.HTTP_UPSTREAM, support.HTTPS_UPSTREAM):
            with self.subTest(url=url), self.assertRaises(urllib.error.HTTPError) as cm:
                opener.open(url + "/after", timeout=10)
            self.assertEqual(cm.exception.code, 409)
            self.assertEqual(cm.exception.headers.get("X-Stopgate-Refusal"), "run_not_active")

    def test_version_as_password_and_the_environment(self) -> None:
        settings = self.op.proxy_settings(self.rid)  # an operator token is not the run's: the version is
        self.assertEqual(settings.url.split("@")[0], f"http://{self.rid}:1")
        with tempfile.TemporaryDirectory() as d:
            env = settings.env(d)
            self.assertEqual({env[k] for k in ("HTTPS_PROXY", "http_proxy")}, {settings.url})
            self.assertEqual(env["NO_PROXY"], "")
            with open(env["NODE_EXTRA_CA_CERTS"], "rb") as f:
                self.assertEqual(f.read(), settings.ca_pem)
            with open(env["SSL_CERT_FILE"], "rb") as f:
                self.assertTrue(f.read().endswith(settings.ca_pem))


if __name__ == "__main__":
    unittest.main()
