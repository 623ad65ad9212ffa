// The package's types are its JSDoc, written out by tsc into types/: they must be what tsc writes now, and a
// user's TypeScript must type-check against them.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const tsc = path.join(root, 'node_modules', 'typescript', 'bin', 'tsc');

/** @param {string[]} args */
function run(args) {
  try {
    return execFileSync(process.execPath, [tsc, ...args], { cwd: root, encoding: 'utf8' });
  } catch (e) {
    const err = /** @type {{stdout?: string, stderr?: string}} */ (e);
    assert.fail(`tsc ${args.join(' ')}:\n${err.stdout ?? ''}${err.stderr ?? ''}`);
  }
}

test('types/ is what tsc writes from the JSDoc (npm run types)', () => {
  const out = fs.mkdtempSync(path.join(os.tmpdir(), 'sg-types-'));
  try {
    run(['-p', 'tsconfig.json', '--outDir', out]);
    for (const f of fs.readdirSync(out)) {
      assert.equal(fs.readFileSync(path.join(root, 'types', f), 'utf8'), fs.readFileSync(path.join(out, f), 'utf8'), `types/${f} is stale: run npm run types`);
    }
    assert.deepEqual(fs.readdirSync(path.join(root, 'types')).sort(), fs.readdirSync(out).sort());
  } finally {
    fs.rmSync(out, { recursive: true });
  }
});

test('a user\'s TypeScript type-checks against the package', () => {
  run(['--noEmit', '--strict', '--module', 'nodenext', '--moduleResolution', 'nodenext', '--target', 'es2022', '--types', 'node', 'test/consumer.ts']);
});
