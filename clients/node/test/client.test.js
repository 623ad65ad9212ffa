// The Node client against a real stopgate serve (two instances sharing a Redis store).
import { test, describe } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { ProxyAgent, fetch as undiciFetch } from 'undici';
import * as sg from '../src/index.js';
import { CONTROL, CONTROL_B, HTTP_UPSTREAM, HTTPS_UPSTREAM, PROXY, TOKEN, eventually, operator, refusedWith, runId } from './support.js';

const { Client, RunCancelled, StopgateError, StopgateUnavailable } = sg;

describe('runs', () => {
  const op = operator();

  test('admit, status, cancel, complete', async () => {
    const id = runId();
    const row = await op.admit(id);
    assert.deepEqual([row.run_id, row.status, row.cancel_version], [id, 'ACTIVE', 1]);
    assert.deepEqual(await op.admit(id), await op.status(id), 'admit of an ACTIVE run returns its row');
    const c = await op.cancel(id, { reason: 'operator stop', drainTimeout: 5 });
    assert.deepEqual([c.status, c.cancel_version, c.reason], ['CANCELLING', 2, 'operator stop']);
    assert.ok(c.drain_deadline);
    const done = await op.admit(runId());
    assert.equal((await op.complete(done.run_id, 1)).status, 'COMPLETED');
  });

  test('refusals carry the server\'s code and words', async () => {
    await assert.rejects(op.status(runId('never')), (e) => refusedWith(e, 404, 'not_found') && /never admitted/.test(e.message));
    const id = (await op.admit(runId())).run_id;
    await op.cancel(id);
    // Nothing was in flight: the sweeper may have drained the run already.
    await assert.rejects(op.admit(id), (e) => e instanceof RunCancelled && ['CANCELLING', 'CANCELLED'].includes(e.run.status));
    await assert.rejects(op.claim(id, 'has space'), (e) => refusedWith(e, 400, 'invalid_request'));
  });

  test('a bad control URL is refused at once', () => {
    for (const control of ['ftp://x', 'not a url', 'http://h/?q=1']) {
      assert.throws(() => new Client({ control, token: 't' }), TypeError, control);
    }
  });

  test('an unreachable server is unavailable, and a checkpoint fails closed', async () => {
    const port = await new Promise((resolve) => {
      const s = net.createServer().listen(0, '127.0.0.1', () => {
        const p = /** @type {net.AddressInfo} */ (s.address()).port;
        s.close(() => resolve(p));
      });
    });
    const c = new Client({ control: `http://127.0.0.1:${port}`, token: 't', timeout: 2000 });
    await assert.rejects(c.status('r1'), StopgateUnavailable);
    await assert.rejects(c.checkpoint('r1'), StopgateUnavailable);
  });
});

describe('the guard, as a worker with its run token', () => {
  const op = operator();
  /** @param {string} id */
  const workerOf = async (id) => new Client({ control: CONTROL, token: await op.tokenFor(id) });

  test('a claim, then refused after the cancel', async () => {
    const id = (await op.admit(runId())).run_id;
    const w = await workerOf(id);
    const g = await w.claim(id, 's1', { cancelVersion: 1, worker: 'w-1' });
    assert.deepEqual([g.intent.key, g.intent.state, g.intent.lease_owner], ['claim:s1', 'IN_FLIGHT', `worker:${id}/w-1`]);
    assert.equal((await w.renew(id, 'claim:s1', { worker: 'w-1' })).run.status, 'ACTIVE');
    await w.outcome(id, 'claim:s1', 'responded');
    await op.cancel(id);
    await assert.rejects(w.claim(id, 's2', { cancelVersion: 1 }), (e) =>
      e instanceof RunCancelled && e.status === 409 && e.recorded === 'CANCELLED_BEFORE_DISPATCH' && e.intent === 'claim:s2' && e.run.cancel_version === 2 && e.run.status !== 'ACTIVE');
    const states = Object.fromEntries((await op.audit(id)).intents.map((i) => [i.key, i.state]));
    assert.deepEqual(states, { 'claim:s1': 'RESPONDED', 'claim:s2': 'CANCELLED_BEFORE_DISPATCH' });
  });

  test('a retry is revoked by the cancel', async () => {
    const id = (await op.admit(runId())).run_id;
    const w = await workerOf(id);
    await w.claim(id, 's1');
    await w.outcome(id, 'claim:s1', 'responded', { reason: 'failed; retrying' });
    const r = await w.retry(id, 's1', 1, 60);
    assert.deepEqual([r.intent.key, r.intent.state], ['retry:s1:1', 'SCHEDULED']);
    await op.cancel(id);
    await assert.rejects(w.dispatchRetry(id, 's1', 1), (e) => e instanceof RunCancelled && e.intent === 'retry:s1:1');
    await assert.rejects(w.retry(id, 's1', 2, new Date()), RunCancelled);
    const audit = await op.audit(id);
    assert.equal(audit.intents.find((i) => i.key === 'retry:s1:1')?.state, 'REVOKED');
    assert.ok(audit.events.some((e) => e.kind === 'intent.revoked'));
  });

  test('a due retry is dispatched', async () => {
    const id = (await op.admit(runId())).run_id;
    const w = await workerOf(id);
    await w.claim(id, 's1');
    await w.outcome(id, 'claim:s1', 'responded');
    await w.retry(id, 's1', 1, 0);
    const d = await w.dispatchRetry(id, 's1', 1, { worker: 'w-2' });
    // The schedule was its first attempt, the dispatch is its second.
    assert.deepEqual([d.intent.state, d.intent.attempts], ['IN_FLIGHT', 2]);
  });

  test('effects are recorded with their outcome', async () => {
    const id = (await op.admit(runId())).run_id;
    const w = await workerOf(id);
    assert.equal(await w.effect(id, 'mail-1', async (g) => g.intent.state, { target: 'smtp://mail', method: 'SEND' }), 'IN_FLIGHT');
    await assert.rejects(w.effect(id, 'mail-2', () => { throw new RangeError('boom'); }), RangeError);
    const g = await w.intent(id, 'mail-3', { boundary: 'delivery' });
    await w.outcome(id, 'mail-3', 'responded', { statusCode: 250, attempt: g.intent.attempts });
    const states = Object.fromEntries((await op.audit(id)).intents.map((i) => [i.key, [i.state, i.status_code ?? 0]]));
    assert.deepEqual(states, { 'mail-1': ['RESPONDED', 0], 'mail-2': ['UNKNOWN', 0], 'mail-3': ['RESPONDED', 250] });
    await op.cancel(id);
    await assert.rejects(w.effect(id, 'mail-4', () => assert.fail('an effect of a cancelled run ran')), RunCancelled);
  });

  test('a budget given at admission stops the run, and its refusal is a RunCancelled', async () => {
    const id = (await op.admit(runId(), { budget: { max_effects: 2, max_wall_time: '1h' }, labels: { team: 'research' } })).run_id;
    const row = await op.status(id);
    assert.deepEqual([row.budget?.max_effects, row.budget?.max_wall_time], [2, '1h0m0s']);
    const w = await workerOf(id);
    for (const step of ['s1', 's2']) {
      await w.claim(id, step);
      await w.outcome(id, `claim:${step}`, 'responded');
    }
    await assert.rejects(w.claim(id, 's3'), (e) =>
      e instanceof RunCancelled && e.status === 409 && e.code === 'budget_exceeded' && e.body?.limit === 'max_effects' &&
      e.recorded === 'CANCELLED_BEFORE_DISPATCH' && e.run.status === 'CANCELLING' && e.run.cancel_version === 2 && e.run.reason === 'budget:max_effects');
    // A step's answer carries the row without its usage; reading the run gives it.
    assert.equal((await op.status(id)).usage?.effects, 2);
  });

  test('a worker token acts for its run only', async () => {
    const id = (await op.admit(runId())).run_id;
    const other = (await op.admit(runId())).run_id;
    const w = await workerOf(id);
    const calls = [() => w.claim(other, 's1'), () => w.status(other), () => w.cancel(id), async () => { for await (const _ of w.watch(other)); }];
    for (const call of calls) await assert.rejects(call(), (e) => e instanceof StopgateError && refusedWith(e, 403, 'forbidden'));
  });
});

describe('watch', () => {
  const op = operator();
  // A step in flight holds a cancelled run CANCELLING until it reports, so each transition is its own (a run with
  // nothing in flight may drain before a watch reads the cancel's row: it then gets the later row).
  const admitHeld = async () => {
    const id = (await op.admit(runId())).run_id;
    await op.claim(id, 'held');
    return id;
  };

  test('iterates each transition to the final row', async () => {
    const id = await admitHeld();
    const seen = [];
    for await (const row of op.watch(id)) {
      seen.push(row.status);
      if (row.status === 'ACTIVE') await op.cancel(id);
      else if (row.status === 'CANCELLING') await op.outcome(id, 'claim:held', 'responded');
    }
    // CANCELLING → CANCELLED is not broadcast (the outcome drains the run): the watch carries it too.
    assert.deepEqual(seen, ['ACTIVE', 'CANCELLING', 'CANCELLED']);
  });

  test('onCancel and the signal hear a cancel taken by another instance', async () => {
    const id = await admitHeld();
    /** @type {sg.Run[]} */
    const heard = [];
    const w = new Client({ control: CONTROL_B, token: TOKEN }).watch(id, { onCancel: (row) => heard.push(row) });
    try {
      await eventually('the watch has the row', () => w.row);
      const aborted = new Promise((resolve) => w.signal.addEventListener('abort', resolve, { once: true }));
      await op.cancel(id, { reason: 'stop' });
      const row = await w.waitCancelled(10_000);
      assert.equal(row?.status, 'CANCELLING');
      await aborted;
      assert.ok(w.signal.reason instanceof RunCancelled);
      assert.deepEqual(heard.map((r) => [r.status, r.reason]), [['CANCELLING', 'stop']]);
    } finally {
      await w.close();
    }
  });

  test('checkpoint', async () => {
    const id = await admitHeld();
    const worker = new Client({ control: CONTROL, token: await op.tokenFor(id) });
    assert.equal((await worker.checkpoint(id)).status, 'ACTIVE', 'without a watch: the row is read');
    const w = worker.watch(id).start();
    await eventually('the watch has the row', () => w.freshRow());
    assert.equal((await worker.checkpoint(id)).status, 'ACTIVE');
    await op.cancel(id);
    await eventually('the watch hears the cancel', () => w.row && w.row.status !== 'ACTIVE');
    await assert.rejects(worker.checkpoint(id), (e) => e instanceof RunCancelled && e.run.status === 'CANCELLING');
    await assert.rejects(w.checkpoint(), RunCancelled);
    await w.close();
    await assert.rejects(worker.checkpoint(id), RunCancelled, 'closed, the watch is not asked: the row is read');
  });

  test('close ends a blocked watch', async () => {
    const id = await admitHeld();
    const w = op.watch(id).start();
    await eventually('the watch has the row', () => w.row);
    const start = Date.now();
    await w.close();
    assert.ok(Date.now() - start < 5000);
    assert.ok(w.ended);
  });

  test('poll', async () => {
    const id = await admitHeld();
    const held = await op.status(id);
    const start = Date.now();
    assert.equal((await op.poll(id, held, { wait: 0.3 })).status, 'ACTIVE');
    assert.ok(Date.now() - start >= 300);
    setTimeout(() => op.cancel(id), 200);
    const moved = await op.poll(id, held, { wait: 20 });
    assert.equal(moved.status, 'CANCELLING');
    assert.ok(sg.after(moved, held));
  });
});

describe('the egress proxy', () => {
  const op = operator();

  test('requests go through the guard until the cancel (undici ProxyAgent)', async () => {
    const id = (await op.admit(runId())).run_id;
    const worker = new Client({ control: CONTROL, token: await op.tokenFor(id), proxyAddr: PROXY });
    const settings = await worker.proxySettings(id);
    assert.ok(settings.url.startsWith(`http://${id}:sg1.`), settings.url);
    assert.match(settings.caPem, /BEGIN CERTIFICATE/);
    const dispatcher = settings.dispatcher(ProxyAgent);
    for (const url of [HTTP_UPSTREAM, HTTPS_UPSTREAM]) {
      const resp = await undiciFetch(`${url}/hello`, { dispatcher });
      assert.equal(resp.status, 200, url);
      assert.equal(await resp.text(), 'hello GET /hello');
      assert.ok(resp.headers.get('x-stopgate-intent'));
    }
    await op.cancel(id);
    for (const url of [HTTP_UPSTREAM, HTTPS_UPSTREAM]) {
      const resp = await undiciFetch(`${url}/after`, { dispatcher });
      assert.equal(resp.status, 409, url);
      assert.equal(resp.headers.get('x-stopgate-refusal'), 'run_not_active');
    }
    await dispatcher.close();
  });

  test('the version as the password, and the environment', async () => {
    const id = (await op.admit(runId())).run_id;
    const settings = await op.proxySettings(id); // an operator token is not the run's: the version is
    assert.equal(settings.url.split('@')[0], `http://${id}:1`);
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'sg-env-'));
    try {
      const env = settings.env(dir);
      assert.equal(env.HTTPS_PROXY, settings.url);
      assert.equal(env.http_proxy, settings.url);
      assert.equal(env.NO_PROXY, '');
      assert.equal(fs.readFileSync(env.NODE_EXTRA_CA_CERTS, 'utf8'), settings.caPem);
      assert.ok(fs.readFileSync(env.SSL_CERT_FILE, 'utf8').endsWith(settings.caPem));
    } finally {
      fs.rmSync(dir, { recursive: true });
    }
  });
});
