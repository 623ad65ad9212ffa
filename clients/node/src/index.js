// @ts-check
/**
 * stopgate's client for workers: the control API, with Node's standard
 * library only (Node 20 or later).
 *
 * A worker admits or is handed a run, claims its queued steps through the
 * guard, schedules retries that a cancel revokes, records the effects it
 * carries itself, and stops at its next checkpoint once the run is no longer
 * ACTIVE. It hears the cancel the moment it commits by watching the run (a
 * Server-Sent Events stream the server sends from whichever instance the
 * worker reaches).
 *
 * Every call is one HTTP request to the control API; the API decides, this
 * module only shapes the request and the answer. A refusal is thrown, with
 * the server's code and message: {@link RunCancelled} when the run is no
 * longer ACTIVE, {@link StopgateUnavailable} when the server or its store did
 * not answer (fail closed: do not go on as if the effect were allowed).
 *
 * @module @stopgate/client
 */

import http from 'node:http';
import https from 'node:https';
import fs from 'node:fs';
import path from 'node:path';
import tls from 'node:tls';

export const ACTIVE = 'ACTIVE';
export const CANCELLING = 'CANCELLING';
export const CANCELLED = 'CANCELLED';
export const COMPLETED = 'COMPLETED';
export const UNKNOWN = 'UNKNOWN';

const DEFAULT_CONTROL = 'http://127.0.0.1:8081';
/** How long a watch stream may be silent before it is taken for dead and opened again, in ms: three of the server's heartbeats. */
export const WATCH_IDLE = 45_000;

/**
 * A run's status only moves forward within one cancel_version, and the
 * version only grows: (version, stage) orders every transition of a run.
 * @type {Record<string, number>}
 */
const STAGE = { ACTIVE: 0, CANCELLING: 1, UNKNOWN: 2, CANCELLED: 3, COMPLETED: 3 };

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
export function after(row, other) {
  if (!other) return true;
  if (row.cancel_version !== other.cancel_version) return row.cancel_version > other.cancel_version;
  return (STAGE[row.status] ?? -1) > (STAGE[other.status] ?? -1);
}

/**
 * Whether the row can never change again.
 * @param {Run} row
 */
export function isFinal(row) {
  return row.status === CANCELLED || row.status === COMPLETED;
}

/** An answer of the control API that is not a success. */
export class StopgateError extends Error {
  /**
   * @param {string} message
   * @param {{status?: number, code?: string, body?: Record<string, any>, cause?: unknown}} [opts]
   */
  constructor(message, opts = {}) {
    super(opts.code ? `${opts.code}: ${message}` : message, opts.cause === undefined ? undefined : { cause: opts.cause });
    this.name = 'StopgateError';
    /** The HTTP status; undefined when no answer came. */
    this.status = opts.status;
    /** The server's reason: run_not_active, forbidden, … */
    this.code = opts.code ?? '';
    /** The JSON the server sent (a refusal of the guard carries intent and recorded). */
    this.body = opts.body ?? {};
  }

  /** What the ledger now says of the refused effect (CANCELLED_BEFORE_DISPATCH), if anything. */
  get recorded() {
    return String(this.body.recorded ?? '');
  }

  /** The key the refused effect is recorded under, if any. */
  get intent() {
    return String(this.body.intent ?? '');
  }
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
  constructor(run, message, opts = {}) {
    super(message || `run ${run.run_id} is ${run.status} at cancel_version ${run.cancel_version}`, { code: 'run_not_active', ...opts });
    this.name = 'RunCancelled';
    this.run = run;
  }
}

/** The control API or its store did not answer: nothing may be taken as allowed. */
export class StopgateUnavailable extends StopgateError {
  /**
   * @param {string} message
   * @param {{status?: number, code?: string, body?: Record<string, any>, cause?: unknown}} [opts]
   */
  constructor(message, opts = {}) {
    super(message, opts);
    this.name = 'StopgateUnavailable';
  }
}

/**
 * @param {number} status
 * @param {any} value
 * @param {string} raw
 * @returns {StopgateError}
 */
function apiError(status, value, raw) {
  if (value && typeof value === 'object' && value.error) {
    const code = String(value.error);
    const msg = String(value.message ?? '');
    // The run is over for the worker when the refusal's row says it is no longer ACTIVE, whatever
    // stopped it (a cancel, its budget, a tripwire): the row decides, not a list of codes.
    if (code === 'run_not_active' || (value.run && typeof value.run === 'object' && (value.run.status ?? 'ACTIVE') !== 'ACTIVE')) {
      const row = value.run ?? { run_id: value.run_id, status: value.status, cancel_version: value.cancel_version, intents: {} };
      return new RunCancelled(row, msg, { status, code, body: value });
    }
    if (status === 503) return new StopgateUnavailable(msg, { status, code, body: value });
    return new StopgateError(msg, { status, code, body: value });
  }
  const snippet = raw.slice(0, 200).trim();
  const Cls = status >= 500 ? StopgateUnavailable : StopgateError;
  return new Cls(`control API answered ${status}${snippet ? ': ' + snippet : ''}`, { status });
}

/**
 * An answer's body as JSON, or undefined when it is empty or not JSON.
 * @param {string} raw
 * @returns {any}
 */
function parseJSON(raw) {
  try {
    return raw ? JSON.parse(raw) : undefined;
  } catch {
    return undefined;
  }
}

/** @param {string} s */
const seg = (s) => encodeURIComponent(s);
/** @param {string} runId @param {string} [tail] */
const runPath = (runId, tail) => `/v1/runs/${seg(runId)}${tail ? '/' + tail : ''}`;
/** @param {string} runId @param {string} key @param {string} [tail] */
const intentPath = (runId, key, tail) => runPath(runId, `intents/${seg(key)}${tail ? '/' + tail : ''}`);

/**
 * @param {Record<string, any>} o
 * @returns {Record<string, any>}
 */
function compact(o) {
  /** @type {Record<string, any>} */
  const out = {};
  for (const [k, v] of Object.entries(o)) if (v !== undefined && v !== null && v !== false && v !== 0) out[k] = v;
  return out;
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
  constructor(opts = {}) {
    const control = opts.control || process.env.STOPGATE_CONTROL || DEFAULT_CONTROL;
    let u;
    try {
      u = new URL(control);
    } catch {
      throw new TypeError(`control URL ${JSON.stringify(control)} is not a URL`);
    }
    if ((u.protocol !== 'http:' && u.protocol !== 'https:') || !u.hostname) {
      throw new TypeError(`control URL ${JSON.stringify(control)}: want http:// or https:// with a host`);
    }
    if (u.search || u.hash) throw new TypeError(`control URL ${JSON.stringify(control)}: want no query or fragment`);
    /** @internal */
    this.base = u;
    /** @private */
    this.prefix = u.pathname.replace(/\/+$/, '');
    this.token = opts.token ?? process.env.STOPGATE_CONTROL_TOKEN ?? '';
    this.actor = opts.actor;
    this.timeout = opts.timeout ?? 30_000;
    this.proxyAddr = opts.proxyAddr || process.env.STOPGATE_PROXY || undefined;
    // An agent of our own: never a global one that proxy settings reach.
    /** @private */
    this.agent = u.protocol === 'https:' ? new https.Agent({ keepAlive: true }) : new http.Agent({ keepAlive: true });
    /** @private @type {Map<string, Set<Watch>>} */
    this.watches = new Map();
  }

  /**
   * One request; resolves with the response, its body unread.
   * @internal
   * @param {string} method
   * @param {string} p
   * @param {{body?: any, accept?: string, timeout?: number}} [o]
   * @returns {Promise<http.IncomingMessage>}
   */
  open(method, p, o = {}) {
    const mod = this.base.protocol === 'https:' ? https : http;
    /** @type {Record<string, string>} */
    const headers = { Accept: o.accept ?? 'application/json' };
    if (this.token) headers.Authorization = 'Bearer ' + this.token;
    if (this.actor) headers['X-Stopgate-Actor'] = this.actor;
    /** @type {Buffer | undefined} */
    let data;
    if (o.body !== undefined) {
      data = Buffer.from(JSON.stringify(compact(o.body)));
      headers['Content-Type'] = 'application/json';
      headers['Content-Length'] = String(data.length);
    }
    return new Promise((resolve, reject) => {
      const req = mod.request(
        { protocol: this.base.protocol, hostname: this.base.hostname, port: this.base.port, path: this.prefix + p, method, headers, agent: this.agent },
        resolve,
      );
      req.setTimeout(o.timeout ?? this.timeout, () => req.destroy(new Error(`no answer within ${o.timeout ?? this.timeout} ms`)));
      req.on('error', (err) => reject(new StopgateUnavailable(`cannot reach the control API at ${this.base.origin}${this.prefix}: ${err.message}`, { cause: err })));
      req.end(data);
    });
  }

  /**
   * @private
   * @param {string} method
   * @param {string} p
   * @param {{body?: any, timeout?: number}} [o]
   * @returns {Promise<any>}
   */
  async call(method, p, o = {}) {
    const resp = await this.open(method, p, o);
    const raw = await readAll(resp, this.base.origin);
    const value = parseJSON(raw);
    const status = resp.statusCode ?? 0;
    if (status >= 200 && status < 300) {
      if (raw && value === undefined) throw new StopgateError(`${method} ${p}: answer ${status} is not JSON`, { status });
      return value;
    }
    throw apiError(status, value, raw);
  }

  // -- runs ---------------------------------------------------------------

  /**
   * Creates the run ACTIVE at version 1 (or returns it if it already is ACTIVE). Operator.
   * `budget` goes on top of the policy's; `labels` choose the policy's budget rule (not stored).
   * A run that exists keeps what it was admitted with, its budget included.
   * @param {string} runId
   * @param {{reason?: string, budget?: Budget, labels?: Record<string, string>}} [o]
   * @returns {Promise<Run>}
   */
  admit(runId, o = {}) {
    /** @type {Record<string, any>} */
    const body = { run_id: runId, reason: o.reason };
    if (o.budget && Object.keys(o.budget).length > 0) body.budget = o.budget;
    if (o.labels && Object.keys(o.labels).length > 0) body.labels = o.labels;
    return this.call('POST', '/v1/runs', { body });
  }

  /**
   * Reads the run's row.
   * @param {string} runId
   * @returns {Promise<Run>}
   */
  status(runId) {
    return this.call('GET', runPath(runId));
  }

  /**
   * Cancels the run (ACTIVE → CANCELLING); an unseen id gets a CANCELLED tombstone. Operator.
   * @param {string} runId
   * @param {{reason?: string, drainTimeout?: number}} [o] drainTimeout in seconds (undefined: the server's default)
   * @returns {Promise<Run>}
   */
  async cancel(runId, o = {}) {
    /** @type {Record<string, any>} */
    const body = { reason: o.reason };
    const v = await this.call('POST', runPath(runId, 'cancel'), { body: o.drainTimeout === undefined ? body : { ...body, drain_timeout: `${o.drainTimeout}s` } });
    return v.run;
  }

  /**
   * Moves the run ACTIVE → COMPLETED if it is still at cancelVersion. Operator.
   * @param {string} runId
   * @param {number} cancelVersion
   * @param {{reason?: string}} [o]
   * @returns {Promise<Run>}
   */
  complete(runId, cancelVersion, o = {}) {
    return this.call('POST', runPath(runId, 'complete'), { body: { cancel_version: cancelVersion, reason: o.reason } });
  }

  /**
   * Mints the run's worker token (sg1.…), for an ACTIVE run. Operator.
   * @param {string} runId
   * @param {{ttl?: number}} [o] ttl in seconds
   * @returns {Promise<string>}
   */
  async tokenFor(runId, o = {}) {
    const v = await this.call('POST', runPath(runId, 'tokens'), { body: { ttl: o.ttl } });
    return v.token;
  }

  /**
   * The row, every intent and every event of the run.
   * @param {string} runId
   * @returns {Promise<Audit>}
   */
  audit(runId) {
    return this.call('GET', runPath(runId, 'audit'));
  }

  // -- the guard ----------------------------------------------------------

  /**
   * Takes a queued step through the guard: IN_FLIGHT under claim:<stepId>.
   * Throws {@link RunCancelled} when the run is no longer ACTIVE (the refusal
   * is recorded CANCELLED_BEFORE_DISPATCH): do not run the step.
   * @param {string} runId
   * @param {string} stepId
   * @param {{cancelVersion?: number, worker?: string, leaseTtl?: number}} [o] leaseTtl in seconds
   * @returns {Promise<Guarded>}
   */
  async claim(runId, stepId, o = {}) {
    const v = await this.call('POST', runPath(runId, 'claims'), {
      body: { step_id: stepId, cancel_version: o.cancelVersion, worker: o.worker, lease_ttl: o.leaseTtl },
    });
    return { intent: v.intent, run: v.run };
  }

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
  async retry(runId, stepId, attempt, notBefore, o = {}) {
    const at = notBefore instanceof Date ? notBefore : new Date(Date.now() + notBefore * 1000);
    if (Number.isNaN(at.getTime())) throw new TypeError('notBefore: want a Date or a number of seconds');
    const v = await this.call('POST', runPath(runId, 'retries'), {
      body: { step_id: stepId, attempt, not_before: at.toISOString(), cancel_version: o.cancelVersion },
    });
    return { intent: v.intent, run: v.run };
  }

  /**
   * Runs a scheduled retry: the same guard on its key, now IN_FLIGHT and
   * leased. Throws {@link RunCancelled} once the cancel revoked it.
   * @param {string} runId
   * @param {string} stepId
   * @param {number} attempt
   * @param {{cancelVersion?: number, worker?: string, leaseTtl?: number}} [o]
   * @returns {Promise<Guarded>}
   */
  async dispatchRetry(runId, stepId, attempt, o = {}) {
    const v = await this.call('POST', runPath(runId, `retries/${seg(stepId)}/${Math.trunc(attempt)}/dispatch`), {
      body: { cancel_version: o.cancelVersion, worker: o.worker, lease_ttl: o.leaseTtl },
    });
    return { intent: v.intent, run: v.run };
  }

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
  async intent(runId, key, o = {}) {
    const v = await this.call('POST', runPath(runId, 'intents'), {
      body: {
        key, boundary: o.boundary, method: o.method, target: o.target, body_digest: o.bodyDigest, cancel_version: o.cancelVersion,
        lease_ttl: o.leaseTtl, carrier: o.carrier, allow_cancelling: o.allowCancelling,
      },
    });
    return { intent: v.intent, run: v.run };
  }

  /**
   * Records what happened to an IN_FLIGHT effect.
   * @param {string} runId
   * @param {string} key
   * @param {'responded'|'not_sent'|'unknown'} outcome
   * @param {{statusCode?: number, attempt?: number, reason?: string}} [o]
   * @returns {Promise<Intent>}
   */
  outcome(runId, key, outcome, o = {}) {
    return this.call('PATCH', intentPath(runId, key), { body: { outcome, status_code: o.statusCode, attempt: o.attempt, reason: o.reason } });
  }

  /**
   * A heartbeat on an effect the worker carries: the lease extended, and the
   * run's row. A 409 intent_not_in_flight says the lease is no longer the
   * worker's: stop, and do not report success.
   * @param {string} runId
   * @param {string} key
   * @param {{worker?: string, leaseTtl?: number}} [o]
   * @returns {Promise<{intent: Intent, run: Run}>}
   */
  renew(runId, key, o = {}) {
    return this.call('POST', intentPath(runId, key, 'renew'), { body: { worker: o.worker, lease_ttl: o.leaseTtl } });
  }

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
  async effect(runId, key, fn, o = {}) {
    const g = await this.intent(runId, key, o);
    let result;
    try {
      result = await fn(g);
    } catch (err) {
      const e = /** @type {Error} */ (err);
      await this.outcome(runId, key, 'unknown', { attempt: g.intent.attempts, reason: `${e?.name}: ${e?.message}`.slice(0, 1000) }).catch(() => {});
      throw err;
    }
    await this.outcome(runId, key, 'responded', { attempt: g.intent.attempts });
    return result;
  }

  // -- hearing the cancel -------------------------------------------------

  /**
   * Follows the run's row: iterate it (for await), or start it to run in the
   * background. With onCancel it starts at once and calls it the first time
   * the row is no longer ACTIVE.
   * @param {string} runId
   * @param {{onCancel?: (row: Run) => void}} [o]
   * @returns {Watch}
   */
  watch(runId, o = {}) {
    const w = new Watch(this, runId, o.onCancel);
    if (o.onCancel) w.start();
    return w;
  }

  /**
   * Long-polls the run: resolves once the row is not `held` any more (at once
   * if it already is not), or after `wait` seconds (at most 60).
   * @param {string} runId
   * @param {Run} held
   * @param {{wait?: number}} [o]
   * @returns {Promise<Run>}
   */
  poll(runId, held, o = {}) {
    const wait = o.wait ?? 30;
    const q = new URLSearchParams({ after_version: String(held.cancel_version), after_status: held.status, wait: `${wait}s` });
    return this.call('GET', `${runPath(runId, 'watch')}?${q}`, { timeout: wait * 1000 + this.timeout });
  }

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
  async checkpoint(runId) {
    for (const w of this.watches.get(runId) ?? []) {
      const row = w.freshRow();
      if (row) {
        if (row.status !== ACTIVE) throw new RunCancelled(row);
        return row;
      }
    }
    const row = await this.status(runId);
    if (row.status !== ACTIVE) throw new RunCancelled(row);
    return row;
  }

  /** @internal @param {Watch} w */
  register(w) {
    let ws = this.watches.get(w.runId);
    if (!ws) this.watches.set(w.runId, (ws = new Set()));
    ws.add(w);
  }

  /** @internal @param {Watch} w */
  unregister(w) {
    const ws = this.watches.get(w.runId);
    if (!ws) return;
    ws.delete(w);
    if (ws.size === 0) this.watches.delete(w.runId);
  }

  // -- the egress proxy ---------------------------------------------------

  /**
   * The egress proxy's MITM CA certificate (PEM) a worker's clients must trust.
   * @returns {Promise<string>}
   */
  async caPem() {
    const resp = await this.open('GET', '/v1/ca', { accept: 'application/x-pem-file' });
    const raw = await readAll(resp, this.base.origin);
    if (resp.statusCode !== 200) throw apiError(resp.statusCode ?? 0, parseJSON(raw), raw);
    return raw;
  }

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
  async proxySettings(runId, o = {}) {
    let addr = this.proxyAddr;
    if (!addr) addr = String((await this.call('GET', '/v1/endpoints')).proxy);
    let password = o.token || (this.token.startsWith('sg1.') ? this.token : '');
    if (!password) password = String(o.cancelVersion ?? (await this.status(runId)).cancel_version);
    const url = `http://${seg(runId)}:${seg(password)}@${addr}`;
    return new ProxySettings(url, await this.caPem());
  }

  /** Closes the client's idle connections and its watches. */
  close() {
    for (const ws of this.watches.values()) for (const w of ws) w.close();
    this.agent.destroy();
  }
}

/**
 * @param {http.IncomingMessage} resp
 * @param {string} where
 * @returns {Promise<string>}
 */
function readAll(resp, where) {
  return new Promise((resolve, reject) => {
    /** @type {Buffer[]} */
    const chunks = [];
    resp.on('data', (c) => chunks.push(c));
    resp.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    resp.on('error', (err) => reject(new StopgateUnavailable(`reading the answer of the control API at ${where}: ${err.message}`, { cause: err })));
  });
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
  constructor(client, runId, onCancel) {
    this.client = client;
    this.runId = runId;
    this.onCancel = onCancel;
    /** @type {Run | undefined} the latest row heard */
    this.row = undefined;
    /** @type {unknown} the error that ended a started watch, if one did */
    this.error = undefined;
    /** @private */
    this.closed = false;
    /** @private */
    this.connected = false;
    /** @private */
    this.heard = 0;
    /** @private @type {http.IncomingMessage | undefined} */
    this.resp = undefined;
    /** @private @type {Promise<void> | undefined} */
    this.running = undefined;
    /** Whether a started watch has ended (the run is final, close, or a refusal: see error). */
    this.ended = false;
    /** @private */
    this.aborter = new AbortController();
    /** @private @type {(() => void) | undefined} */
    this.wake = undefined;
  }

  /**
   * Aborts once a started watch hears that the run is no longer ACTIVE (its
   * reason is the {@link RunCancelled}): hand it to fetch, timers, anything
   * that takes an AbortSignal.
   * @returns {AbortSignal}
   */
  get signal() {
    return this.aborter.signal;
  }

  /** @returns {AsyncGenerator<Run, void, undefined>} */
  async *[Symbol.asyncIterator]() {
    let backoff = 100;
    while (!this.closed) {
      try {
        for await (const row of this.stream()) {
          backoff = 100;
          yield row;
          if (isFinal(row)) return;
        }
      } catch (err) {
        if (err instanceof StopgateError && err.status !== undefined && err.status < 500 && err.status !== 429) throw err;
      } finally {
        this.connected = false;
      }
      if (this.row && isFinal(this.row)) return;
      if (this.closed) return;
      await new Promise((resolve) => {
        const t = setTimeout(resolve, backoff);
        this.wake = () => {
          clearTimeout(t);
          resolve(undefined);
        };
      });
      backoff = Math.min(backoff * 2, 5000);
    }
  }

  /**
   * One stream: yields the rows further on than the last one.
   * @private
   * @returns {AsyncGenerator<Run, void, undefined>}
   */
  async *stream() {
    const c = this.client;
    const resp = await c.open('GET', runPath(this.runId, 'watch'), { accept: 'text/event-stream', timeout: WATCH_IDLE });
    this.resp = resp;
    try {
      if (this.closed) return; // closed while the stream was being opened
      if (resp.statusCode !== 200) {
        const raw = await readAll(resp, c.base.origin);
        throw apiError(resp.statusCode ?? 0, parseJSON(raw), raw);
      }
      this.connected = true;
      resp.setEncoding('utf8');
      let buf = '';
      let event = '';
      let data = '';
      for await (const chunk of resp) {
        if (this.closed) return;
        this.heard = Date.now();
        buf += chunk;
        let nl;
        while ((nl = buf.indexOf('\n')) >= 0) {
          const line = buf.slice(0, nl).replace(/\r$/, '');
          buf = buf.slice(nl + 1);
          if (line === '') {
            if (event === 'run') {
              const row = /** @type {Run} */ (JSON.parse(data));
              if (after(row, this.row)) {
                this.row = row;
                yield row;
              }
            } else if (event === 'end') {
              return;
            }
            event = '';
            data = '';
          } else if (line.startsWith(':')) {
            // a heartbeat
          } else {
            const i = line.indexOf(':');
            const name = i < 0 ? line : line.slice(0, i);
            let value = i < 0 ? '' : line.slice(i + 1);
            if (value.startsWith(' ')) value = value.slice(1);
            if (name === 'event') event = value;
            else if (name === 'data') data += value;
          }
        }
        if (buf.length > 1 << 20) throw new StopgateError('a line of the watch stream is longer than 1 MiB');
      }
    } finally {
      this.resp = undefined;
      resp.destroy();
    }
  }

  /**
   * Runs the watch in the background (once); returns this.
   * @returns {this}
   */
  start() {
    if (this.running) return this;
    this.client.register(this);
    this.running = (async () => {
      try {
        for await (const row of this) {
          if (row.status !== ACTIVE && !this.aborter.signal.aborted) {
            this.aborter.abort(new RunCancelled(row));
            this.onCancel?.(row);
          }
        }
      } catch (err) {
        this.error = err;
      } finally {
        this.ended = true;
        this.client.unregister(this);
      }
    })();
    return this;
  }

  /**
   * The latest row if the stream is connected and heard from within
   * WATCH_IDLE, else undefined. A final row is always fresh: it never changes.
   * @returns {Run | undefined}
   */
  freshRow() {
    const row = this.row;
    if (row && (isFinal(row) || (this.connected && Date.now() - this.heard < WATCH_IDLE))) return row;
    return undefined;
  }

  /**
   * Throws {@link RunCancelled} if the run is no longer ACTIVE (see {@link Client#checkpoint}).
   * @returns {Promise<Run>}
   */
  async checkpoint() {
    const row = this.freshRow() ?? (await this.client.status(this.runId));
    if (row.status !== ACTIVE) throw new RunCancelled(row);
    return row;
  }

  /**
   * Resolves with the row once a started watch hears that the run is no
   * longer ACTIVE, or with undefined after timeout ms.
   * @param {number} [timeout]
   * @returns {Promise<Run | undefined>}
   */
  waitCancelled(timeout) {
    const signal = this.aborter.signal;
    if (signal.aborted) return Promise.resolve(this.row);
    return new Promise((resolve) => {
      /** @type {NodeJS.Timeout | undefined} */
      let t;
      const done = () => {
        if (t) clearTimeout(t);
        resolve(this.row);
      };
      signal.addEventListener('abort', done, { once: true });
      if (timeout !== undefined) {
        t = setTimeout(() => {
          signal.removeEventListener('abort', done);
          resolve(undefined);
        }, timeout);
      }
    });
  }

  /**
   * Ends the watch: the stream is closed, and a started watch's loop ends.
   * @returns {Promise<void>}
   */
  async close() {
    this.closed = true;
    this.resp?.destroy();
    this.wake?.();
    this.client.unregister(this);
    await this.running;
  }
}

/** Where a run's HTTP goes: the egress proxy with the run's identity, and its CA. */
export class ProxySettings {
  /**
   * @param {string} url http://RUN:PASSWORD@host:port, for HTTPS_PROXY and HTTP_PROXY
   * @param {string} caPem the MITM CA certificate (PEM) the run's clients must trust
   */
  constructor(url, caPem) {
    this.url = url;
    this.caPem = caPem;
  }

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
  dispatcher(ProxyAgent) {
    return new ProxyAgent({ uri: this.url, requestTls: { ca: [...tls.rootCertificates, this.caPem] } });
  }

  /**
   * The environment a child process needs: the proxy variables (both
   * cases), NO_PROXY cleared, and the CA. Writes stopgate-ca.pem (the CA,
   * for NODE_EXTRA_CA_CERTS) and stopgate-bundle.pem (the system's roots and
   * the CA, for the variables that replace the roots) into dir.
   * @param {string} dir
   * @returns {Record<string, string>}
   */
  env(dir) {
    const ca = path.join(dir, 'stopgate-ca.pem');
    const bundle = path.join(dir, 'stopgate-bundle.pem');
    fs.writeFileSync(ca, this.caPem);
    fs.writeFileSync(bundle, [...tls.rootCertificates, this.caPem].join('\n'));
    /** @type {Record<string, string>} */
    const env = { NO_PROXY: '', no_proxy: '', NODE_EXTRA_CA_CERTS: ca, NODE_USE_ENV_PROXY: '1' };
    for (const k of ['HTTPS_PROXY', 'HTTP_PROXY', 'https_proxy', 'http_proxy']) env[k] = this.url;
    for (const k of ['SSL_CERT_FILE', 'REQUESTS_CA_BUNDLE', 'CURL_CA_BUNDLE']) env[k] = bundle;
    return env;
  }
}
