/**
 * A run's row, as the store keeps it (times are RFC 3339 strings).
 * @typedef {object} Run
 * @property {string} run_id
 * @property {'ACTIVE'|'CANCELLING'|'CANCELLED'|'COMPLETED'|'UNKNOWN'} status
 * @property {number} cancel_version
 * @property {string} [reason] the operator's reason for the cancel
 * @property {string} [status_reason] why the run left CANCELLING: drained, unresolved_intents, drain_timeout, reconciled
 * @property {string} created_at
 * @property {string} updated_at
 * @property {string} [cancelled_at]
 * @property {string} [drain_deadline]
 * @property {Record<string, number>} intents the run's intents counted by state
 * @property {Budget} [budget] the budget fixed at admission, as the API writes it
 * @property {Record<string, any>} [usage] what the run has used of it (effects, bytes, tokens, spend); only a read of the run fills it
 */
/**
 * What a run may do before it is cancelled, given at admission (on top of the policy's budget).
 * Counts are whole numbers of 1 or more, durations Go durations ('2h', '30s'), the spend in USD.
 * Past a limit the effect that would cross it is refused and the run cancelled in the same step.
 * @typedef {object} Budget
 * @property {number} [max_effects]
 * @property {number} [max_effects_per_destination]
 * @property {number} [max_request_bytes]
 * @property {number} [max_response_bytes]
 * @property {string} [max_wall_time]
 * @property {number} [max_input_tokens]
 * @property {number} [max_output_tokens]
 * @property {number} [max_tokens]
 * @property {number|string} [max_spend_usd]
 * @property {boolean} [cancel_on_unknown_usage]
 * @property {string} [drain_timeout]
 */
/**
 * The record of one effect.
 * @typedef {object} Intent
 * @property {string} run_id
 * @property {string} key
 * @property {string} boundary
 * @property {string} state IN_FLIGHT, SCHEDULED, RESPONDED, NOT_SENT, UNKNOWN, CANCELLED_BEFORE_DISPATCH, REVOKED, APPLIED, NOT_APPLIED
 * @property {number} attempts
 * @property {string} [method]
 * @property {string} [target]
 * @property {number} [status_code]
 * @property {number} [refusals]
 * @property {number} [observed_version]
 * @property {string} [reason]
 * @property {string} [source]
 * @property {string} [note]
 * @property {string} [lease_owner]
 * @property {string} [lease_expires]
 * @property {string} [not_before]
 * @property {string} created_at
 * @property {string} updated_at
 */
/**
 * One line of a run's audit log.
 * @typedef {object} Event
 * @property {string} at
 * @property {string} run_id
 * @property {string} actor
 * @property {string} kind
 * @property {string} [reason]
 * @property {string} [from]
 * @property {string} [to]
 * @property {string} [intent]
 * @property {number} [cancel_version]
 */
/**
 * An effect the guard admitted: its intent as recorded and the run's row.
 * @typedef {object} Guarded
 * @property {Intent} intent
 * @property {Run} run
 */
/**
 * The row, its intents and its events.
 * @typedef {object} Audit
 * @property {Run} run
 * @property {Intent[]} intents
 * @property {Event[]} events
 */
/**
 * Whether row is further on than other (undefined: any row is).
 * @param {Run} row
 * @param {Run | undefined} other
 * @returns {boolean}
 */
export function after(row: Run, other: Run | undefined): boolean;
/**
 * Whether the row can never change again.
 * @param {Run} row
 */
export function isFinal(row: Run): boolean;
export const ACTIVE: "ACTIVE";
export const CANCELLING: "CANCELLING";
export const CANCELLED: "CANCELLED";
export const COMPLETED: "COMPLETED";
export const UNKNOWN: "UNKNOWN";
/** How long a watch stream may be silent before it is taken for dead and opened again, in ms: three of the server's heartbeats. */
export const WATCH_IDLE: 45000;
/** An answer of the control API that is not a success. */
export class StopgateError extends Error {
    /**
     * @param {string} message
     * @param {{status?: number, code?: string, body?: Record<string, any>, cause?: unknown}} [opts]
     */
    constructor(message: string, opts?: {
        status?: number;
        code?: string;
        body?: Record<string, any>;
        cause?: unknown;
    });
    /** The HTTP status; undefined when no answer came. */
    status: number | undefined;
    /** The server's reason: run_not_active, forbidden, … */
    code: string;
    /** The JSON the server sent (a refusal of the guard carries intent and recorded). */
    body: Record<string, any>;
    /** What the ledger now says of the refused effect (CANCELLED_BEFORE_DISPATCH), if anything. */
    get recorded(): string;
    /** The key the refused effect is recorded under, if any. */
    get intent(): string;
}
/**
 * The run is no longer ACTIVE: start nothing new, stop at this checkpoint. `code` says what stopped
 * it (run_not_active, budget_exceeded with the `limit` in `body`, tripwire, …).
 */
export class RunCancelled extends StopgateError {
    /**
     * @param {Run} run the row that said so
     * @param {string} [message]
     * @param {{status?: number, code?: string, body?: Record<string, any>}} [opts]
     */
    constructor(run: Run, message?: string, opts?: {
        status?: number;
        code?: string;
        body?: Record<string, any>;
    });
    run: Run;
}
/** The control API or its store did not answer: nothing may be taken as allowed. */
export class StopgateUnavailable extends StopgateError {
}
/**
 * @typedef {object} ClientOptions
 * @property {string} [control] the control API's URL (default $STOPGATE_CONTROL, else http://127.0.0.1:8081)
 * @property {string} [token] the bearer token (default $STOPGATE_CONTROL_TOKEN): a worker holds its run token (sg1.…), which acts for that one run
 * @property {string} [actor] X-Stopgate-Actor: the name an operator gives itself in the audit log
 * @property {number} [timeout] bounds one call, in ms (default 30 000)
 * @property {string} [proxyAddr] the egress proxy's host:port for proxySettings (default $STOPGATE_PROXY, else asked of the server, which needs an operator or read-only token)
 */
/**
 * How Client#intent and Client#effect guard an effect.
 * @typedef {object} IntentOptions
 * @property {'custom'|'delivery'|'browser'} [boundary]
 * @property {string} [method]
 * @property {string} [target]
 * @property {string} [bodyDigest]
 * @property {number} [cancelVersion]
 * @property {number} [leaseTtl] in seconds
 * @property {string} [carrier]
 * @property {boolean} [allowCancelling] only with boundary delivery
 */
/**
 * Calls one stopgate control API. It never goes through the proxy settings of
 * its environment: the control API is not an upstream.
 */
export class Client {
    /** @param {ClientOptions} [opts] */
    constructor(opts?: ClientOptions);
    /** @internal */
    base: URL;
    /** @private */
    private prefix;
    token: string;
    actor: string | undefined;
    timeout: number;
    proxyAddr: string | undefined;
    /** @private */
    private agent;
    /** @private @type {Map<string, Set<Watch>>} */
    private watches;
    /**
     * One request; resolves with the response, its body unread.
     * @internal
     * @param {string} method
     * @param {string} p
     * @param {{body?: any, accept?: string, timeout?: number}} [o]
     * @returns {Promise<http.IncomingMessage>}
     */
    open(method: string, p: string, o?: {
        body?: any;
        accept?: string;
        timeout?: number;
    }): Promise<http.IncomingMessage>;
    /**
     * @private
     * @param {string} method
     * @param {string} p
     * @param {{body?: any, timeout?: number}} [o]
     * @returns {Promise<any>}
     */
    private call;
    /**
     * Creates the run ACTIVE at version 1 (or returns it if it already is ACTIVE). Operator.
     * `budget` goes on top of the policy's; `labels` choose the policy's budget rule (not stored).
     * A run that exists keeps what it was admitted with, its budget included.
     * @param {string} runId
     * @param {{reason?: string, budget?: Budget, labels?: Record<string, string>}} [o]
     * @returns {Promise<Run>}
     */
    admit(runId: string, o?: {
        reason?: string;
        budget?: Budget;
        labels?: Record<string, string>;
    }): Promise<Run>;
    /**
     * Reads the run's row.
     * @param {string} runId
     * @returns {Promise<Run>}
     */
    status(runId: string): Promise<Run>;
    /**
     * Cancels the run (ACTIVE → CANCELLING); an unseen id gets a CANCELLED tombstone. Operator.
     * @param {string} runId
     * @param {{reason?: string, drainTimeout?: number}} [o] drainTimeout in seconds (undefined: the server's default)
     * @returns {Promise<Run>}
     */
    cancel(runId: string, o?: {
        reason?: string;
        drainTimeout?: number;
    }): Promise<Run>;
    /**
     * Moves the run ACTIVE → COMPLETED if it is still at cancelVersion. Operator.
     * @param {string} runId
     * @param {number} cancelVersion
     * @param {{reason?: string}} [o]
     * @returns {Promise<Run>}
     */
    complete(runId: string, cancelVersion: number, o?: {
        reason?: string;
    }): Promise<Run>;
    /**
     * Mints the run's worker token (sg1.…), for an ACTIVE run. Operator.
     * @param {string} runId
     * @param {{ttl?: number}} [o] ttl in seconds
     * @returns {Promise<string>}
     */
    tokenFor(runId: string, o?: {
        ttl?: number;
    }): Promise<string>;
    /**
     * The row, every intent and every event of the run.
     * @param {string} runId
     * @returns {Promise<Audit>}
     */
    audit(runId: string): Promise<Audit>;
    /**
     * Takes a queued step through the guard: IN_FLIGHT under claim:<stepId>.
     * Throws {@link RunCancelled} when the run is no longer ACTIVE (the refusal
     * is recorded CANCELLED_BEFORE_DISPATCH): do not run the step.
     * @param {string} runId
     * @param {string} stepId
     * @param {{cancelVersion?: number, worker?: string, leaseTtl?: number}} [o] leaseTtl in seconds
     * @returns {Promise<Guarded>}
     */
    claim(runId: string, stepId: string, o?: {
        cancelVersion?: number;
        worker?: string;
        leaseTtl?: number;
    }): Promise<Guarded>;
    /**
     * Schedules attempt `attempt` of a step (SCHEDULED under retry:<stepId>:<attempt>).
     * A cancel revokes every scheduled retry of the run in its own atomic step;
     * after it, this throws {@link RunCancelled}.
     * @param {string} runId
     * @param {string} stepId
     * @param {number} attempt
     * @param {Date | number} notBefore a Date, or a number of seconds from now
     * @param {{cancelVersion?: number}} [o]
     * @returns {Promise<Guarded>}
     */
    retry(runId: string, stepId: string, attempt: number, notBefore: Date | number, o?: {
        cancelVersion?: number;
    }): Promise<Guarded>;
    /**
     * Runs a scheduled retry: the same guard on its key, now IN_FLIGHT and
     * leased. Throws {@link RunCancelled} once the cancel revoked it.
     * @param {string} runId
     * @param {string} stepId
     * @param {number} attempt
     * @param {{cancelVersion?: number, worker?: string, leaseTtl?: number}} [o]
     * @returns {Promise<Guarded>}
     */
    dispatchRetry(runId: string, stepId: string, attempt: number, o?: {
        cancelVersion?: number;
        worker?: string;
        leaseTtl?: number;
    }): Promise<Guarded>;
    /**
     * The guard for an effect that does not travel through the egress proxy
     * (an e-mail, a publish). key is the effect's idempotency key. Report what
     * happened with {@link Client#outcome}. Throws {@link RunCancelled} when the
     * run is no longer ACTIVE: do not carry the effect out.
     * @param {string} runId
     * @param {string} key
     * @param {IntentOptions} [o]
     * @returns {Promise<Guarded>}
     */
    intent(runId: string, key: string, o?: IntentOptions): Promise<Guarded>;
    /**
     * Records what happened to an IN_FLIGHT effect.
     * @param {string} runId
     * @param {string} key
     * @param {'responded'|'not_sent'|'unknown'} outcome
     * @param {{statusCode?: number, attempt?: number, reason?: string}} [o]
     * @returns {Promise<Intent>}
     */
    outcome(runId: string, key: string, outcome: "responded" | "not_sent" | "unknown", o?: {
        statusCode?: number;
        attempt?: number;
        reason?: string;
    }): Promise<Intent>;
    /**
     * A heartbeat on an effect the worker carries: the lease extended, and the
     * run's row. A 409 intent_not_in_flight says the lease is no longer the
     * worker's: stop, and do not report success.
     * @param {string} runId
     * @param {string} key
     * @param {{worker?: string, leaseTtl?: number}} [o]
     * @returns {Promise<{intent: Intent, run: Run}>}
     */
    renew(runId: string, key: string, o?: {
        worker?: string;
        leaseTtl?: number;
    }): Promise<{
        intent: Intent;
        run: Run;
    }>;
    /**
     * Guards one effect, carries it out with fn, and records its outcome:
     * responded when fn resolves; unknown when it throws (the effect may or may
     * not have happened: an operator reconciles it), and the error is thrown
     * on. Throws {@link RunCancelled} without calling fn when the guard refuses.
     * @template T
     * @param {string} runId
     * @param {string} key
     * @param {(g: Guarded) => Promise<T> | T} fn
     * @param {IntentOptions} [o]
     * @returns {Promise<T>}
     */
    effect<T>(runId: string, key: string, fn: (g: Guarded) => Promise<T> | T, o?: IntentOptions): Promise<T>;
    /**
     * Follows the run's row: iterate it (for await), or start it to run in the
     * background. With onCancel it starts at once and calls it the first time
     * the row is no longer ACTIVE.
     * @param {string} runId
     * @param {{onCancel?: (row: Run) => void}} [o]
     * @returns {Watch}
     */
    watch(runId: string, o?: {
        onCancel?: (row: Run) => void;
    }): Watch;
    /**
     * Long-polls the run: resolves once the row is not `held` any more (at once
     * if it already is not), or after `wait` seconds (at most 60).
     * @param {string} runId
     * @param {Run} held
     * @param {{wait?: number}} [o]
     * @returns {Promise<Run>}
     */
    poll(runId: string, held: Run, o?: {
        wait?: number;
    }): Promise<Run>;
    /**
     * Throws {@link RunCancelled} if the run is no longer ACTIVE; resolves with
     * its row otherwise. With a started {@link Watch} of the run on this client
     * that is connected and has heard from the server within WATCH_IDLE, it
     * asks nothing of the server; otherwise it reads the row, and throws
     * {@link StopgateUnavailable} when it cannot: a checkpoint that cannot tell
     * does not say "go on".
     * @param {string} runId
     * @returns {Promise<Run>}
     */
    checkpoint(runId: string): Promise<Run>;
    /** @internal @param {Watch} w */
    register(w: Watch): void;
    /** @internal @param {Watch} w */
    unregister(w: Watch): void;
    /**
     * The egress proxy's MITM CA certificate (PEM) a worker's clients must trust.
     * @returns {Promise<string>}
     */
    caPem(): Promise<string>;
    /**
     * The egress proxy's URL carrying the run's identity, and the CA to trust.
     * The password is the run token: token, else this client's token when it
     * is one (sg1.…); otherwise the cancel_version observed (cancelVersion,
     * else read now), so that the proxy refuses the run's requests once it is
     * cancelled.
     * @param {string} runId
     * @param {{token?: string, cancelVersion?: number}} [o]
     * @returns {Promise<ProxySettings>}
     */
    proxySettings(runId: string, o?: {
        token?: string;
        cancelVersion?: number;
    }): Promise<ProxySettings>;
    /** Closes the client's idle connections and its watches. */
    close(): void;
}
/**
 * Follows one run's row through the control API's watch stream.
 *
 * Iterating (for await) yields the row as it stands, then the row at every
 * transition, each once and in order, until the row is final (CANCELLED or
 * COMPLETED) or {@link Watch#close}. The stream is opened again when the
 * connection breaks, goes silent for WATCH_IDLE, or the server ends it
 * (shutdown, max age). A refusal that trying again cannot change (401, 403,
 * 404) is thrown.
 *
 * {@link Watch#start} runs it in the background instead: {@link Watch#row}
 * is then the latest row, {@link Watch#checkpoint} throws
 * {@link RunCancelled} once it is not ACTIVE, {@link Watch#signal} aborts,
 * and onCancel is called once, when it first is not.
 */
export class Watch {
    /**
     * @param {Client} client
     * @param {string} runId
     * @param {(row: Run) => void} [onCancel]
     */
    constructor(client: Client, runId: string, onCancel?: (row: Run) => void);
    client: Client;
    runId: string;
    onCancel: ((row: Run) => void) | undefined;
    /** @type {Run | undefined} the latest row heard */
    row: Run | undefined;
    /** @type {unknown} the error that ended a started watch, if one did */
    error: unknown;
    /** @private */
    private closed;
    /** @private */
    private connected;
    /** @private */
    private heard;
    /** @private @type {http.IncomingMessage | undefined} */
    private resp;
    /** @private @type {Promise<void> | undefined} */
    private running;
    /** Whether a started watch has ended (the run is final, close, or a refusal: see error). */
    ended: boolean;
    /** @private */
    private aborter;
    /** @private @type {(() => void) | undefined} */
    private wake;
    /**
     * Aborts once a started watch hears that the run is no longer ACTIVE (its
     * reason is the {@link RunCancelled}): hand it to fetch, timers, anything
     * that takes an AbortSignal.
     * @returns {AbortSignal}
     */
    get signal(): AbortSignal;
    /**
     * One stream: yields the rows further on than the last one.
     * @private
     * @returns {AsyncGenerator<Run, void, undefined>}
     */
    private stream;
    /**
     * Runs the watch in the background (once); returns this.
     * @returns {this}
     */
    start(): this;
    /**
     * The latest row if the stream is connected and heard from within
     * WATCH_IDLE, else undefined. A final row is always fresh: it never changes.
     * @returns {Run | undefined}
     */
    freshRow(): Run | undefined;
    /**
     * Throws {@link RunCancelled} if the run is no longer ACTIVE (see {@link Client#checkpoint}).
     * @returns {Promise<Run>}
     */
    checkpoint(): Promise<Run>;
    /**
     * Resolves with the row once a started watch hears that the run is no
     * longer ACTIVE, or with undefined after timeout ms.
     * @param {number} [timeout]
     * @returns {Promise<Run | undefined>}
     */
    waitCancelled(timeout?: number): Promise<Run | undefined>;
    /**
     * Ends the watch: the stream is closed, and a started watch's loop ends.
     * @returns {Promise<void>}
     */
    close(): Promise<void>;
    /** @returns {AsyncGenerator<Run, void, undefined>} */
    [Symbol.asyncIterator](): AsyncGenerator<Run, void, undefined>;
}
/** Where a run's HTTP goes: the egress proxy with the run's identity, and its CA. */
export class ProxySettings {
    /**
     * @param {string} url http://RUN:PASSWORD@host:port, for HTTPS_PROXY and HTTP_PROXY
     * @param {string} caPem the MITM CA certificate (PEM) the run's clients must trust
     */
    constructor(url: string, caPem: string);
    url: string;
    caPem: string;
    /**
     * A dispatcher for undici's fetch (and Node's, when it is the same undici)
     * through the proxy, trusting the system's roots and the CA. Node's
     * standard library cannot build one: pass the ProxyAgent class of the
     * undici package your code already uses (`import { ProxyAgent } from
     * 'undici'`). This package depends on nothing.
     * @template T
     * @param {new (opts: {uri: string, requestTls: {ca: string[]}}) => T} ProxyAgent
     * @returns {T}
     */
    dispatcher<T>(ProxyAgent: new (opts: {
        uri: string;
        requestTls: {
            ca: string[];
        };
    }) => T): T;
    /**
     * The environment a child process needs: the proxy variables (both
     * cases), NO_PROXY cleared, and the CA. Writes stopgate-ca.pem (the CA,
     * for NODE_EXTRA_CA_CERTS) and stopgate-bundle.pem (the system's roots and
     * the CA, for the variables that replace the roots) into dir.
     * @param {string} dir
     * @returns {Record<string, string>}
     */
    env(dir: string): Record<string, string>;
}
/**
 * A run's row, as the store keeps it (times are RFC 3339 strings).
 */
export type Run = {
    run_id: string;
    status: "ACTIVE" | "CANCELLING" | "CANCELLED" | "COMPLETED" | "UNKNOWN";
    cancel_version: number;
    /**
     * the operator's reason for the cancel
     */
    reason?: string | undefined;
    /**
     * why the run left CANCELLING: drained, unresolved_intents, drain_timeout, reconciled
     */
    status_reason?: string | undefined;
    created_at: string;
    updated_at: string;
    cancelled_at?: string | undefined;
    drain_deadline?: string | undefined;
    /**
     * the run's intents counted by state
     */
    intents: Record<string, number>;
    /**
     * the budget fixed at admission, as the API writes it
     */
    budget?: Budget | undefined;
    /**
     * what the run has used of it (effects, bytes, tokens, spend); only a read of the run fills it
     */
    usage?: Record<string, any> | undefined;
};
/**
 * What a run may do before it is cancelled, given at admission (on top of the policy's budget).
 * Counts are whole numbers of 1 or more, durations Go durations ('2h', '30s'), the spend in USD.
 * Past a limit the effect that would cross it is refused and the run cancelled in the same step.
 */
export type Budget = {
    max_effects?: number | undefined;
    max_effects_per_destination?: number | undefined;
    max_request_bytes?: number | undefined;
    max_response_bytes?: number | undefined;
    max_wall_time?: string | undefined;
    max_input_tokens?: number | undefined;
    max_output_tokens?: number | undefined;
    max_tokens?: number | undefined;
    max_spend_usd?: string | number | undefined;
    cancel_on_unknown_usage?: boolean | undefined;
    drain_timeout?: string | undefined;
};
/**
 * The record of one effect.
 */
export type Intent = {
    run_id: string;
    key: string;
    boundary: string;
    /**
     * IN_FLIGHT, SCHEDULED, RESPONDED, NOT_SENT, UNKNOWN, CANCELLED_BEFORE_DISPATCH, REVOKED, APPLIED, NOT_APPLIED
     */
    state: string;
    attempts: number;
    method?: string | undefined;
    target?: string | undefined;
    status_code?: number | undefined;
    refusals?: number | undefined;
    observed_version?: number | undefined;
    reason?: string | undefined;
    source?: string | undefined;
    note?: string | undefined;
    lease_owner?: string | undefined;
    lease_expires?: string | undefined;
    not_before?: string | undefined;
    created_at: string;
    updated_at: string;
};
/**
 * One line of a run's audit log.
 */
export type Event = {
    at: string;
    run_id: string;
    actor: string;
    kind: string;
    reason?: string | undefined;
    from?: string | undefined;
    to?: string | undefined;
    intent?: string | undefined;
    cancel_version?: number | undefined;
};
/**
 * An effect the guard admitted: its intent as recorded and the run's row.
 */
export type Guarded = {
    intent: Intent;
    run: Run;
};
/**
 * The row, its intents and its events.
 */
export type Audit = {
    run: Run;
    intents: Intent[];
    events: Event[];
};
export type ClientOptions = {
    /**
     * the control API's URL (default $STOPGATE_CONTROL, else http://127.0.0.1:8081)
     */
    control?: string | undefined;
    /**
     * the bearer token (default $STOPGATE_CONTROL_TOKEN): a worker holds its run token (sg1.…), which acts for that one run
     */
    token?: string | undefined;
    /**
     * X-Stopgate-Actor: the name an operator gives itself in the audit log
     */
    actor?: string | undefined;
    /**
     * bounds one call, in ms (default 30 000)
     */
    timeout?: number | undefined;
    /**
     * the egress proxy's host:port for proxySettings (default $STOPGATE_PROXY, else asked of the server, which needs an operator or read-only token)
     */
    proxyAddr?: string | undefined;
};
/**
 * How Client#intent and Client#effect guard an effect.
 */
export type IntentOptions = {
    boundary?: "custom" | "delivery" | "browser" | undefined;
    method?: string | undefined;
    target?: string | undefined;
    bodyDigest?: string | undefined;
    cancelVersion?: number | undefined;
    /**
     * in seconds
     */
    leaseTtl?: number | undefined;
    carrier?: string | undefined;
    /**
     * only with boundary delivery
     */
    allowCancelling?: boolean | undefined;
};
import http from 'node:http';
