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
export function jobData<T extends object>(data: T, runId: string, o?: {
    cancelVersion?: number;
    token?: string;
}): T & {
    stopgate: JobRun;
};
/**
 * How many runs this worker process holds a watch stream open for.
 * @returns {number}
 */
export function activeWatches(): number;
/**
 * Wraps a BullMQ processor so that each job is claimed through stopgate
 * before it runs, its retries are stopgate retries, and it is aborted at the
 * cancel. The processor is called as processor(job, step).
 * @template R
 * @param {(job: any, step: Step) => Promise<R>} processor
 * @param {GuardOptions} [opts]
 * @returns {(job: any, token?: string, signal?: AbortSignal) => Promise<R>}
 */
export function guarded<R>(processor: (job: any, step: Step) => Promise<R>, opts?: GuardOptions): (job: any, token?: string, signal?: AbortSignal) => Promise<R>;
/** @typedef {import('./index.js').Run} Run */
/** @typedef {import('./index.js').Watch} Watch */
/** The field of a job's data that names its run (see {@link jobData}). */
export const DATA_KEY: "stopgate";
/** Why a guarded job did not run or did not finish, at the head of the failedReason BullMQ records. */
export const REFUSED_AT_CLAIM: "stopgate: refused at the claim";
export const RETRY_REVOKED: "stopgate: retry revoked";
export const RETRY_REFUSED: "stopgate: retry refused";
export const STOPPED_AT_CHECKPOINT: "stopgate: stopped at a checkpoint";
/**
 * One watch per run in a worker process, shared by the jobs of the run that
 * run in it (the server bounds the watches of one run, and a process needs
 * but one), with the client that opened it: a checkpoint finds the watch on
 * the job's client. It is closed a minute after the last of them ended, so a
 * worker that goes through many runs does not keep a stream open for each.
 */
export const FOLLOW_IDLE: 60000;
/**
 * What a job carries of its run.
 */
export type JobRun = {
    run_id: string;
    /**
     * the version the enqueuer observed
     */
    cancel_version?: number | undefined;
    /**
     * the run's worker token: the worker then acts for that run only
     */
    token?: string | undefined;
};
/**
 * The job as the processor reads it: what BullMQ's Job has of it.
 */
export type JobLike = {
    id: string | undefined;
    name: string;
    data: any;
    /**
     * retries so far: 0 on the first attempt
     */
    attemptsMade: number;
    opts: {
        attempts?: number;
        backoff?: number | {
            type?: string;
            delay?: number;
        };
    };
};
/**
 * The guarded job running now.
 */
export type Step = {
    client: Client;
    runId: string;
    cancelVersion: number;
    /**
     * the job's id
     */
    stepId: string;
    /**
     * claim:<job id> on the first attempt, retry:<job id>:<n> after
     */
    key: string;
    /**
     * the intent's attempt the worker carries
     */
    attempt: number;
    worker: string;
    /**
     * aborts at the cancel (its reason a RunCancelled) or when BullMQ cancels the job
     */
    signal: AbortSignal;
    /**
     * throws RunCancelled once the run is no longer ACTIVE
     */
    checkpoint: () => Promise<Run>;
};
export type GuardOptions = {
    /**
     * the control API (default $STOPGATE_CONTROL)
     */
    control?: string | undefined;
    /**
     * the bearer token when the job carries none (default $STOPGATE_CONTROL_TOKEN)
     */
    token?: string | undefined;
    /**
     * the claim's lease in seconds (default 600); a running job renews it every third of it
     */
    leaseTtl?: number | undefined;
    /**
     * the name the claim is leased to (default host/pid)
     */
    worker?: string | undefined;
    /**
     * how long, in ms, a run's watch stays open after the last of its jobs here ended (default FOLLOW_IDLE)
     */
    followIdle?: number | undefined;
};
export type Run = import("./index.js").Run;
export type Watch = import("./index.js").Watch;
export type Follow = {
    client: Client;
    watch: Watch;
    users: number;
    idle?: NodeJS.Timeout;
};
import { RunCancelled } from './index.js';
import { StopgateError } from './index.js';
import { Client } from './index.js';
export { RunCancelled, StopgateError };
