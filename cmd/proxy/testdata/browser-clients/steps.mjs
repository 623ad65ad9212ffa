// The steps every client script takes, as a browser agent would: it
// drives the browser while the run is ACTIVE, then tries again at each
// stage the Go test moves the run to, and reports what it saw on stdout,
// one JSON object a line. The test answers on stdin when a stage is set.
import readline from 'node:readline';

const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();

export function say(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n');
}

// next reports a stage and waits until the test has set up the next one.
export async function next(stage, report) {
  say({ stage, ...report });
  const { done } = await lines.next();
  if (done) {
    throw new Error(`stdin closed after stage ${stage}`);
  }
}

// attempt runs one client call, bounded, and reports how it ended.
export async function attempt(fn, ms = 10000) {
  let timer;
  const bound = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no answer within ${ms}ms`)), ms);
  });
  try {
    const value = await Promise.race([fn(), bound]);
    return { ok: true, value: value === undefined ? null : value };
  } catch (e) {
    return { ok: false, error: String(e && e.message ? e.message : e) };
  } finally {
    clearTimeout(timer);
  }
}

// waitFor resolves when done() is true, or after ms.
export async function waitFor(done, ms) {
  const end = Date.now() + ms;
  while (!done() && Date.now() < end) {
    await new Promise((r) => setTimeout(r, 50));
  }
  return done();
}

// stages reports what the agent did while ACTIVE (result), then what tries()
// gives at each stage the test moves the run to: CANCELLING; CANCELLED,
// with whether the client saw the browser disconnect within 20s of it; and
// once the browser is closed. Then the script ends.
export async function stages(result, tries, disconnected) {
  await next('active', { result });
  await next('cancelling', await tries());
  const tried = await tries();
  await waitFor(disconnected, 20000);
  say({ stage: 'cancelled', ...tried, disconnected: disconnected() });
  say({ stage: 'closed', ...(await tries()) });
  process.exit(0);
}
