// One BullMQ worker process of the tests: a guarded processor on the tests' Redis. Argument: the queue's name.
// Each job records, in Redis, when its body starts (the queue side's record) and carries one effect through
// the guard (a record in a "provider" list), the way an agent's tool call would.
import { setTimeout as sleep } from 'node:timers/promises';
import { Worker } from 'bullmq';
import { Redis } from 'ioredis';
import { guarded } from '../src/bullmq.js';

const [queueName, name] = process.argv.slice(2);
const u = new URL(/** @type {string} */ (process.env.STOPGATE_TEST_REDIS));
const connection = { host: u.hostname, port: Number(u.port), db: 4, maxRetriesPerRequest: null };
const records = new Redis({ host: u.hostname, port: Number(u.port), db: 5 });

/** @param {import('../src/bullmq.js').Step} step @param {string} what */
async function effect(step, what) {
  const key = `effect:${step.stepId}:${what}`;
  await step.client.effect(step.runId, key, () => records.rpush('effects', JSON.stringify({ key, at: Date.now() / 1000 })),
    { target: 'redis://provider', method: 'RPUSH' });
}

// Even jobs carry an effect, then fail their first attempt (BullMQ retries them in 3 s); odd ones work
// `steps` tenths of a second, checking in between, then carry their effect.
const worker = new Worker(queueName, guarded(async (job, step) => {
  await records.rpush('starts', JSON.stringify({ job: job.id, i: job.data.i, attempt: job.attemptsMade, at: Date.now() / 1000, worker: name }));
  if (job.data.i % 2 === 0 && job.attemptsMade === 0) {
    await effect(step, 'before-retry');
    throw new Error('flaky: fails its first attempt');
  }
  for (let n = 0; n < job.data.steps; n++) {
    await step.checkpoint();
    await sleep(100, undefined, { signal: step.signal });
  }
  await effect(step, 'done');
  return job.data.i;
}), { connection, concurrency: 1, name });

worker.on('error', (err) => console.error(`${name}: ${err.message}`));
await worker.waitUntilReady();
console.log('ready');
process.on('SIGTERM', async () => {
  await worker.close();
  await records.quit();
  process.exit(0);
});
