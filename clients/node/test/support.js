// Where the tests' stopgate is: the Go harness (go test ./clients/) starts it and says so in the environment.
import { randomUUID } from 'node:crypto';
import { Client } from '../src/index.js';

/** @param {string} name */
function env(name) {
  const v = process.env[name];
  if (!v) throw new Error(`$${name} is not set: these tests run against a real stopgate serve; run them with \`go test ./clients/\``);
  return v;
}

export const CONTROL = env('STOPGATE_TEST_CONTROL');
export const CONTROL_B = env('STOPGATE_TEST_CONTROL_B');
export const TOKEN = env('STOPGATE_TEST_TOKEN');
export const PROXY = env('STOPGATE_TEST_PROXY');
export const REDIS = env('STOPGATE_TEST_REDIS');
export const HTTP_UPSTREAM = env('STOPGATE_TEST_HTTP_UPSTREAM');
export const HTTPS_UPSTREAM = env('STOPGATE_TEST_HTTPS_UPSTREAM');

export const operator = (control = CONTROL) => new Client({ control, token: TOKEN, actor: 'test:node' });
export const runId = (prefix = 'node') => `${prefix}-${randomUUID().slice(0, 12)}`;

/**
 * Polls cond until it returns something truthy, for at most `within` ms.
 * @template T
 * @param {string} what
 * @param {() => T | Promise<T>} cond
 * @param {number} [within]
 * @param {number} [every]
 * @returns {Promise<T>}
 */
export async function eventually(what, cond, within = 10_000, every = 50) {
  const deadline = Date.now() + within;
  for (;;) {
    const v = await cond();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`not within ${within} ms: ${what}`);
    await new Promise((r) => setTimeout(r, every));
  }
}

/** @param {Error} err @param {number} status @param {string} code */
export function refusedWith(err, status, code) {
  return /** @type {any} */ (err).status === status && /** @type {any} */ (err).code === code;
}
