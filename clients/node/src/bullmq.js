// @ts-check
/**
 * BullMQ, guarded at the claim.
 *
 * Every job of a run is a step of it: when a worker is about to process the
 * job, {@link guarded}'s processor claims the step through stopgate's guard
 * (POST /v1/runs/{run}/claims, key claim:<job id>) in the same atomic step
 * that checks the run is still ACTIVE. Refused, the job is not processed:
 * the refusal is recorded by stopgate (CANCELLED_BEFORE_DISPATCH) and by
 * BullMQ (the job failed, not to be retried, its failedReason naming the
 * run's row). BullMQ's attempts are stopgate's retries: before a failed job
 * goes back to BullMQ for its next attempt, that attempt is scheduled through
 * the guard (POST …/retries, key retry:<job id>:<n>; refused after the
 * cancel: the job fails, RETRY_REFUSED), which the cancel revokes in its own
 * step, and the next attempt is dispatched through the guard when it starts
 * (refused once revoked: the job fails, RETRY_REVOKED). A job that runs is
 * handed an AbortSignal that aborts the moment the worker hears the cancel on
 * the run's watch stream, and a checkpoint() that throws {@link RunCancelled}
 * from then on.
 *
 * It takes nothing of BullMQ: the processor it returns is what BullMQ's
 * Worker calls, and a job that must not be retried fails with an error named
 * UnrecoverableError, which BullMQ honours by name.
 *
 * @example
 * import { Queue, Worker } from 'bullmq';
 * import { guarded, jobData } from '@stopgate/client/bullmq';
 *
 * new Worker('agents', guarded(async (job, step) => {
 *   for (const page of plan(job.data.query)) {
 *     await step.checkpoint();                           // throws RunCancelled once the run is cancelled
 *     await fetch(page, { signal: step.signal });        // aborted at the cancel
 *   }
 * }), { connection });
 * await queue.add('research', jobData({ query }, run.run_id, { cancelVersion: run.cancel_version, token }),
 *                 { attempts: 3, backoff: { type: 'exponential', delay: 1000 } });
 *
 * @module @stopgate/client/bullmq
 */

import os from 'node:os';
import { Client, RunCancelled, StopgateError } from './index.js';

/** @typedef {import('./index.js').Run} Run */
/** @typedef {import('./index.js').Watch} Watch */

/** The field of a job's data that names its run (see {@link jobData}). */
export const DATA_KEY = 'stopgate';

/** Why a guarded job did not run or did not finish, at the head of the failedReason BullMQ records. */
export const REFUSED_AT_CLAIM = 'stopgate: refused at the claim';
export const RETRY_REVOKED = 'stopgate: retry revoked';
export const RETRY_REFUSED = 'stopgate: retry refused';
export const STOPPED_AT_CHECKPOINT = 'stopgate: stopped at a checkpoint';

/**
 * What a job carries of its run.
 * @typedef {object} JobRun
 * @property {string} run_id
 * @property {number} [cancel_version] the version the enqueuer observed
 * @property {string} [token] the run's worker token: the worker then acts for that run only
 */

/**
 * The job's data with its run: data, and {@link DATA_KEY}.
 * @template {object} T
 * @param {T} data
 * @param {string} runId
 * @param {{cancelVersion?: number, token?: string}} [o]
 * @returns {T & {stopgate: JobRun}}
 */
export function jobData(data, runId, o = {}) {
  /** @type {JobRun} */
  const run = { run_id: runId };
  if (o.cancelVersion) run.cancel_version = o.cancelVersion;
  if (o.token) run.token = o.token;
  return { ...data, [DATA_KEY]: run };
}

/**
 * The job as the processor reads it: what BullMQ's Job has of it.
 * @typedef {object} JobLike
 * @property {string | undefined} id
 * @property {string} name
 * @property {any} data
 * @property {number} attemptsMade retries so far: 0 on the first attempt
 * @property {{attempts?: number, backoff?: number | {type?: string, delay?: number}}} opts
 */

/**
 * The guarded job running now.
 * @typedef {object} Step
 * @property {Client} client
 * @property {string} runId
 * @property {number} cancelVersion
 * @property {string} stepId the job's id
 * @property {string} key claim:<job id> on the first attempt, retry:<job id>:<n> after
 * @property {number} attempt the intent's attempt the worker carries
 * @property {string} worker
 * @property {AbortSignal} signal aborts at the cancel (its reason a RunCancelled) or when BullMQ cancels the job
 * @property {() => Promise<Run>} checkpoint throws RunCancelled once the run is no longer ACTIVE
 */

/**
 * @typedef {object} GuardOptions
 * @property {string} [control] the control API (default $STOPGATE_CONTROL)
 * @property {string} [token] the bearer token when the job carries none (default $STOPGATE_CONTROL_TOKEN)
 * @property {number} [leaseTtl] the claim's lease in seconds (default 600); a running job renews it every third of it
 * @property {string} [worker] the name the claim is leased to (default host/pid)
 * @property {number} [followIdle] how long, in ms, a run's watch stays open after the last of its jobs here ended (default FOLLOW_IDLE)
 */

/**
 * An error BullMQ does not retry (it reads the name).
 * @param {string} message
 * @param {unknown} [cause]
 */
function unrecoverable(message, cause) {
  const e = new Error(message, cause === undefined ? undefined : { cause });
  e.name = 'UnrecoverableError';
  return e;
}

/**
 * One watch per run in a worker process, shared by the jobs of the run that
 * run in it (the server bounds the watches of one run, and a process needs
 * but one), with the client that opened it: a checkpoint finds the watch on
 * the job's client. It is closed a minute after the last of them ended, so a
 * worker that goes through many runs does not keep a stream open for each.
 */
export const FOLLOW_IDLE = 60_000;

/** @typedef {{client: Client, watch: Watch, users: number, idle?: NodeJS.Timeout}} Follow */
/** @type {Map<string, Follow>} */
const follows = new Map();

/**
 * @param {GuardOptions} opts
 * @param {string | undefined} token
 * @param {string} runId
 * @returns {[string, Follow]}
 */
function follow(opts, token, runId) {
  const tok = token ?? opts.token;
  const key = JSON.stringify([opts.control ?? '', tok ?? '', runId]);
  let f = follows.get(key);
  if (!f) {
    const client = new Client({ control: opts.control, token: tok });
    f = { client, watch: client.watch(runId).start(), users: 0 };
    follows.set(key, f);
  } else if (f.watch.ended) {
    f.watch = f.client.watch(runId).start(); // it ended (a refusal, or the run final): open it again
  }
  f.users++;
  if (f.idle) clearTimeout(f.idle);
  f.idle = undefined;
  return [key, f];
}

/** @param {string} key @param {Follow} f @param {number} idle */
function unfollow(key, f, idle) {
  if (--f.users > 0) return;
  f.idle = setTimeout(() => {
    if (follows.get(key) !== f || f.users > 0) return;
    follows.delete(key);
    void f.watch.close();
  }, idle);
  f.idle.unref();
}

/**
 * How many runs this worker process holds a watch stream open for.
 * @returns {number}
 */
export function activeWatches() {
  return follows.size;
}

/**
 * The delay BullMQ's built-in backoffs give attempt n (fixed, exponential;
 * 0 for a custom strategy): the retry's not_before in the record. The guard
 * does not hold the retry to it; BullMQ times it.
 * @param {JobLike} job
 * @param {number} n
 */
function backoffMs(job, n) {
  const b = job.opts.backoff;
  if (typeof b === 'number') return b;
  if (!b || !b.delay) return 0;
  if (b.type === 'exponential') return Math.round(2 ** (n - 1) * b.delay);
  if (b.type === 'fixed') return b.delay;
  return 0;
}

/**
 * @param {unknown} err
 * @param {AbortSignal} signal
 */
function isCancel(err, signal) {
  if (err instanceof RunCancelled) return true;
  return signal.aborted && signal.reason instanceof RunCancelled && (err === signal.reason || (err instanceof Error && err.name === 'AbortError'));
}

/**
 * Wraps a BullMQ processor so that each job is claimed through stopgate
 * before it runs, its retries are stopgate retries, and it is aborted at the
 * cancel. The processor is called as processor(job, step).
 * @template R
 * @param {(job: any, step: Step) => Promise<R>} processor
 * @param {GuardOptions} [opts]
 * @returns {(job: any, token?: string, signal?: AbortSignal) => Promise<R>}
 */
export function guarded(processor, opts = {}) {
  const leaseTtl = opts.leaseTtl ?? 600;
  const worker = opts.worker ?? `${os.hostname()}/${process.pid}`;
  // Three parameters: BullMQ hands a processor that takes them its own AbortSignal.
  return async function stopgateGuarded(job, token, signal) {
    /** @type {JobLike} */
    const j = job;
    const meta = /** @type {JobRun | undefined} */ (j.data?.[DATA_KEY]);
    if (!meta?.run_id) {
      throw unrecoverable(`job ${j.name}[${j.id}] names no stopgate run: add it with jobData(data, runId, …)`);
    }
    const [key, f] = follow(opts, meta.token, meta.run_id);
    try {
      return await run(job, signal, f.client, f.watch, meta);
    } finally {
      unfollow(key, f, opts.followIdle ?? FOLLOW_IDLE);
    }
  };

  /**
   * @param {any} job
   * @param {AbortSignal | undefined} signal
   * @param {Client} client
   * @param {Watch} watch
   * @param {JobRun} meta
   * @returns {Promise<R>}
   */
  async function run(job, signal, client, watch, meta) {
    /** @type {JobLike} */
    const j = job;
    const runId = meta.run_id;
    const cancelVersion = meta.cancel_version ?? 0;
    const stepId = String(j.id);
    const attempt = j.attemptsMade;
    let g;
    try {
      g = attempt === 0
        ? await client.claim(runId, stepId, { cancelVersion, worker, leaseTtl })
        : await client.dispatchRetry(runId, stepId, attempt, { cancelVersion, worker, leaseTtl });
    } catch (err) {
      if (err instanceof RunCancelled) throw unrecoverable(`${attempt === 0 ? REFUSED_AT_CLAIM : RETRY_REVOKED}: ${err.message}`, err);
      // Fail closed and do not let BullMQ retry: the retry was never scheduled.
      throw unrecoverable(`stopgate: the claim could not be made, the job did not run: ${/** @type {Error} */ (err).message}`, err);
    }
    const ac = new AbortController();
    /** @param {AbortSignal} s */
    const abortWith = (s) => {
      if (s.aborted) ac.abort(s.reason);
      else s.addEventListener('abort', () => ac.abort(s.reason), { once: true });
    };
    abortWith(watch.signal);
    if (signal) abortWith(signal);
    /** @type {Step} */
    const step = {
      client, runId, cancelVersion, stepId, key: g.intent.key, attempt: g.intent.attempts, worker, signal: ac.signal,
      checkpoint: async () => {
        if (ac.signal.reason instanceof RunCancelled) throw ac.signal.reason;
        return client.checkpoint(runId);
      },
    };
    let reported = false;
    /** @param {string} [reason] */
    const report = async (reason) => {
      if (reported) return;
      reported = true;
      await client.outcome(runId, step.key, 'responded', { attempt: step.attempt, reason: reason ? reason.slice(0, 1000) : undefined });
    };
    const beat = setInterval(() => {
      client.renew(runId, step.key, { worker, leaseTtl }).catch(() => {}); // the next beat tries again
    }, (leaseTtl * 1000) / 3);
    beat.unref();
    try {
      const result = await processor(job, step);
      await report();
      return result;
    } catch (err) {
      const e = /** @type {Error} */ (err);
      if (isCancel(err, ac.signal)) {
        const why = ac.signal.reason instanceof RunCancelled ? ac.signal.reason.message : e.message;
        await report(`stopped at a checkpoint: ${why}`);
        throw unrecoverable(`${STOPPED_AT_CHECKPOINT}: ${why}`, err);
      }
      const next = j.attemptsMade + 1;
      if (next < (j.opts.attempts ?? 1) && e?.name !== 'UnrecoverableError') {
        try {
          await client.retry(runId, stepId, next, new Date(Date.now() + backoffMs(j, next)), { cancelVersion });
        } catch (rerr) {
          const why = /** @type {Error} */ (rerr).message;
          await report(`failed; its retry was refused: ${why}`).catch(() => {});
          if (rerr instanceof RunCancelled) throw unrecoverable(`${RETRY_REFUSED}: ${why}`, err);
          throw unrecoverable(`stopgate: the retry could not be scheduled, so it does not run: ${why}`, err);
        }
        await report(`failed; retried as attempt ${next}: ${e?.name}: ${e?.message}`);
        throw err; // BullMQ schedules its attempt
      }
      await report(`failed: ${e?.name}: ${e?.message}`);
      throw err;
    } finally {
      clearInterval(beat);
    }
  }
}

export { RunCancelled, StopgateError };
