// BullMQ guarded at the claim: two real worker processes, a real BullMQ queue on Redis, a real stopgate.
import { test, after as afterAll } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import readline from 'node:readline';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { REFUSED_AT_CLAIM, RETRY_REFUSED, RETRY_REVOKED, STOPPED_AT_CHECKPOINT, activeWatches, guarded, jobData } from '../src/bullmq.js';
import { CONTROL, CONTROL_B, REDIS, eventually, operator, runId } from './support.js';

const QUEUED = 20;
const CANCEL_AFTER = 3;

const u = new URL(REDIS);
const connection = { host: u.hostname, port: Number(u.port), db: 4, maxRetriesPerRequest: null };
const records = new Redis({ host: u.hostname, port: Number(u.port), db: 5 });

/** @type {import('node:child_process').ChildProcess[]} */
const workers = [];
/** @type {Queue[]} */
const queues = [];
// Whatever the test's outcome, nothing it opened keeps the process alive.
afterAll(async () => {
  await Promise.all(workers.map((w) => new Promise((resolve) => {
    if (w.exitCode !== null) return resolve(undefined);
    const kill = setTimeout(() => w.kill('SIGKILL'), 10_000);
    w.once('exit', () => { clearTimeout(kill); resolve(undefined); });
    w.kill('SIGTERM');
  })));
  for (const q of queues) {
    await q.obliterate({ force: true }).catch(() => {});
    await q.close();
  }
  await records.quit();
});

/** @param {string} queue @param {string} name @param {string} control */
function startWorker(queue, name, control) {
  const w = spawn(process.execPath, ['test/bullmq-worker.js', queue, name], {
    env: { ...process.env, STOPGATE_CONTROL: control }, stdio: ['ignore', 'pipe', 'inherit'],
  });
  workers.push(w);
  return new Promise((resolve, reject) => {
    const lines = readline.createInterface({ input: /** @type {import('node:stream').Readable} */ (w.stdout) });
    const t = setTimeout(() => reject(new Error(`${name} was not ready within 30 s`)), 30_000);
    lines.on('line', (l) => { if (l === 'ready') { clearTimeout(t); resolve(w); } });
    w.once('exit', (code) => reject(new Error(`${name} exited (${code}) before it was ready`)));
  });
}

/** @param {string} key */
const list = async (key) => (await records.lrange(key, 0, -1)).map((s) => JSON.parse(s));

test('a cancel stops the queue at the claim', { timeout: 180_000 }, async () => {
  await records.flushdb();
  const queueName = runId('bullmq');
  const queue = new Queue(queueName, { connection });
  queues.push(queue);
  // One worker on each instance of the fleet: the cancel is taken by one.
  await Promise.all([startWorker(queueName, 'w1', CONTROL), startWorker(queueName, 'w2', CONTROL_B)]);
  const op = operator();
  const rid = (await op.admit(runId('bullmq'))).run_id;
  const token = await op.tokenFor(rid);
  const jobs = [];
  for (let i = 0; i < QUEUED; i++) {
    jobs.push(await queue.add('work', jobData({ i, steps: 30 }, rid, { cancelVersion: 1, token }), { attempts: 3, backoff: { type: 'fixed', delay: 3000 } }));
  }
  await eventually(`${CANCEL_AFTER} jobs start`, async () => (await records.llen('starts')) >= CANCEL_AFTER, 60_000, 10);
  const sent = Date.now() / 1000;
  await op.cancel(rid, { reason: 'operator stop' });
  await eventually('every job settles', async () => {
    const states = await Promise.all(jobs.map((j) => queue.getJobState(/** @type {string} */ (j.id))));
    return states.every((s) => s === 'completed' || s === 'failed');
  }, 90_000, 200);
  const final = await eventually('the run drains', async () => { const r = await op.status(rid); return r.status === 'CANCELLED' || r.status === 'COMPLETED' ? r : undefined; }, 30_000);
  assert.deepEqual([final.status, final.status_reason], ['CANCELLED', 'drained']);

  // The queue's own records: BullMQ's job states and reasons, and what the job bodies wrote.
  const settled = await Promise.all(jobs.map((j) => queue.getJob(/** @type {string} */ (j.id))));
  /** @type {Record<string, number>} */
  const states = {};
  /** @type {Record<string, number>} */
  const why = {};
  for (const j of settled) {
    const s = await /** @type {any} */ (j).getState();
    states[s] = (states[s] ?? 0) + 1;
    if (s === 'failed') {
      const head = String(j?.failedReason).split(':').slice(0, 2).join(':');
      why[head] = (why[head] ?? 0) + 1;
    }
  }
  const starts = await list('starts');
  const effects = await list('effects');
  const firstStarts = starts.filter((s) => s.attempt === 0);
  const retryStarts = starts.filter((s) => s.attempt > 0);

  // stopgate's audit: every transition in commit order.
  const audit = await op.audit(rid);
  const cancelAt = audit.events.findIndex((e) => e.kind === 'run.cancel');
  /** @type {Map<string, number>} */
  const admitted = new Map();
  audit.events.forEach((e, n) => { if (e.kind === 'intent.admitted' && e.intent) admitted.set(e.intent, n); });
  const intents = new Map(audit.intents.map((i) => [i.key, i]));
  const of = (/** @type {string} */ prefix) => [...intents.values()].filter((i) => i.key.startsWith(prefix));
  const claims = of('claim:');
  const retries = of('retry:');
  const guardedEffects = of('effect:');
  const claimedBefore = claims.filter((i) => (admitted.get(i.key) ?? Infinity) < cancelAt);
  const claimedAfter = claims.filter((i) => (admitted.get(i.key) ?? -1) > cancelAt);
  const refused = claims.filter((i) => i.state === 'CANCELLED_BEFORE_DISPATCH');
  const stopped = claims.filter((i) => (i.reason ?? '').startsWith('stopped at a checkpoint'));
  const revoked = retries.filter((i) => i.state === 'REVOKED');
  const retriesRefused = retries.filter((i) => i.state === 'CANCELLED_BEFORE_DISPATCH');
  const dispatchedAfter = audit.events.filter((e, n) => n > cancelAt && e.kind === 'intent.admitted' && e.intent?.startsWith('retry:'));
  // An effect a job asked for after the cancel is refused: recorded, never admitted.
  const effectsAfterAudit = guardedEffects.filter((i) => (admitted.get(i.key) ?? -1) > cancelAt);
  const effectsRefused = guardedEffects.filter((i) => i.state === 'CANCELLED_BEFORE_DISPATCH');
  const neither = guardedEffects.filter((i) => !admitted.has(i.key) && i.state !== 'CANCELLED_BEFORE_DISPATCH');
  /** @type {Map<string, number>} */
  const outcomeAt = new Map();
  audit.events.forEach((e, n) => { if (e.kind === 'intent.outcome' && e.intent) outcomeAt.set(e.intent, n); });
  const inFlightAudit = guardedEffects.filter((i) => (admitted.get(i.key) ?? Infinity) < cancelAt && cancelAt < (outcomeAt.get(i.key) ?? Infinity));
  const inFlightProvider = effects.filter((e) => e.at > sent);
  // An effect may be carried out after the cancel only if the guard admitted it before (in flight at the cancel).
  const notAdmittedBefore = effects.filter((e) => (admitted.get(e.key) ?? Infinity) > cancelAt);
  const unguarded = effects.filter((e) => intents.get(e.key)?.state !== 'RESPONDED');

  const rows = [
    ['jobs queued', `${jobs.length} added`, `${claims.length} claim intents`],
    ['started before the cancel', `${firstStarts.length} bodies started`, `${claimedBefore.length} claims admitted before run.cancel`],
    ['started after the cancel', `${firstStarts.length - claimedBefore.length}`, `${claimedAfter.length} claims admitted after run.cancel`],
    ['refused at the claim', `${why[REFUSED_AT_CLAIM] ?? 0} failed (${REFUSED_AT_CLAIM})`, `${refused.length} claims CANCELLED_BEFORE_DISPATCH`],
    ['stopped at a checkpoint', `${why[STOPPED_AT_CHECKPOINT] ?? 0} failed (${STOPPED_AT_CHECKPOINT})`, `${stopped.length} claims RESPONDED, stopped at a checkpoint`],
    ['retries revoked', `${why[RETRY_REVOKED] ?? 0} failed (${RETRY_REVOKED})`, `${revoked.length} retry intents REVOKED`],
    ['retries refused (scheduled after the cancel)', `${why[RETRY_REFUSED] ?? 0} failed (${RETRY_REFUSED})`, `${retriesRefused.length} retry intents CANCELLED_BEFORE_DISPATCH`],
    ['retries run after the cancel', `${retryStarts.length} retried bodies started`, `${dispatchedAfter.length} retries admitted after run.cancel`],
    ['effects in flight at the cancel', `${inFlightProvider.length} provider records after the cancel was sent`, `${inFlightAudit.length} admitted before run.cancel, finished after`],
    ['effects after the cancel', `${notAdmittedBefore.length} provider records not admitted before it`, `${effectsAfterAudit.length} effect intents admitted after run.cancel, ${effectsRefused.length} refused`],
    ['effects in all', `${effects.length} provider records (${unguarded.length} without a RESPONDED intent)`, `${guardedEffects.length} effect intents`],
  ];
  console.log(`\nBullMQ, ${QUEUED} jobs of run ${rid}, two workers, cancel after ${CANCEL_AFTER} started (BullMQ states: ${JSON.stringify(states)})`);
  console.log('| | BullMQ\'s records | stopgate\'s audit |\n|---|---|---|');
  for (const r of rows) console.log(`| ${r.join(' | ')} |`);

  assert.equal(claims.length, QUEUED, 'the audit accounts for every job');
  assert.deepEqual(claims.filter((i) => i.state !== 'RESPONDED' && i.state !== 'CANCELLED_BEFORE_DISPATCH'), []);
  assert.deepEqual(claimedAfter, [], 'no claim admitted after the cancel');
  assert.ok(claimedBefore.length >= CANCEL_AFTER);
  assert.equal(firstStarts.length, claimedBefore.length, 'a body started exactly for each claim admitted, and only those');
  assert.deepEqual(new Set(firstStarts.map((s) => `claim:${s.job}`)), new Set(claimedBefore.map((i) => i.key)));
  assert.equal(why[REFUSED_AT_CLAIM] ?? 0, refused.length);
  assert.equal(refused.length + claimedBefore.length, QUEUED);
  assert.ok(refused.length > 0);
  assert.equal(why[STOPPED_AT_CHECKPOINT] ?? 0, stopped.length);
  assert.ok(stopped.length > 0, 'a job running at the cancel stopped at its checkpoint');
  assert.equal(why[RETRY_REVOKED] ?? 0, revoked.length);
  assert.equal(why[RETRY_REFUSED] ?? 0, retriesRefused.length);
  assert.ok(revoked.length + retriesRefused.length > 0, 'a retry of a job that failed before the cancel was revoked');
  assert.deepEqual(retryStarts, []);
  assert.deepEqual(dispatchedAfter, []);
  assert.deepEqual(effectsAfterAudit, []);
  assert.deepEqual(neither, [], 'an effect intent is admitted or refused, and the audit says which');
  assert.deepEqual(notAdmittedBefore, []);
  assert.deepEqual(unguarded, []);
  assert.equal((states.completed ?? 0) + (states.failed ?? 0), QUEUED);
});

test('a worker process holds one watch per run for its jobs, and lets it go once they are done', { timeout: 60_000 }, async () => {
  const op = operator();
  const rid = (await op.admit(runId('follow'))).run_id;
  const token = await op.tokenFor(rid);
  /** @type {Map<string, () => void>} each running job's end, by its id */
  const release = new Map();
  const processor = guarded((job, step) => new Promise((resolve) => release.set(job.id, () => resolve(step.attempt))), { control: CONTROL, followIdle: 300 });
  const before = activeWatches();
  // Two jobs of one run at once, called as BullMQ's Worker calls a processor.
  const job = (/** @type {string} */ id) => ({ id, name: 'work', data: jobData({}, rid, { token }), attemptsMade: 0, opts: {} });
  const running = [processor(job('1')), processor(job('2'))];
  await eventually('both jobs run', () => release.size === 2);
  assert.equal(activeWatches(), before + 1, 'two jobs of one run share one watch');
  release.get('1')?.();
  await running[0];
  await new Promise((r) => setTimeout(r, 600));
  assert.equal(activeWatches(), before + 1, 'a job of the run still runs: the watch stays');
  release.get('2')?.();
  await running[1];
  await eventually('the idle watch is closed', () => activeWatches() === before, 5000);
  const states = Object.fromEntries((await op.audit(rid)).intents.map((i) => [i.key, i.state]));
  assert.deepEqual(states, { 'claim:1': 'RESPONDED', 'claim:2': 'RESPONDED' });
});
