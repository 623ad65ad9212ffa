// How a user's TypeScript reads the package: test/types.test.js type-checks this file against types/.
import { Client, RunCancelled, StopgateUnavailable, type Run } from '@stopgate/client';
import { guarded, jobData, type Step } from '@stopgate/client/bullmq';

export async function work(): Promise<number> {
  const c = new Client({ control: 'http://127.0.0.1:8081', token: 'sg1.x' });
  const run: Run = await c.admit('r1', { budget: { max_effects: 5, max_spend_usd: '0.25' }, labels: { team: 'a' } });
  const limit: number | undefined = run.budget?.max_effects;
  const v: number = run.cancel_version;
  const w = c.watch(run.run_id, { onCancel: (row: Run) => console.log(row.status) });
  const signal: AbortSignal = w.signal;
  try {
    await c.checkpoint(run.run_id);
    const g = await c.claim(run.run_id, 'step-1', { cancelVersion: v, leaseTtl: 60 });
    await c.outcome(run.run_id, g.intent.key, 'responded', { attempt: g.intent.attempts });
    const n: number = await c.effect(run.run_id, 'mail-1', async () => 1, { boundary: 'delivery' });
    return n + (signal.aborted ? 1 : 0) + (limit ?? 0);
  } catch (e) {
    if (e instanceof RunCancelled) return e.run.cancel_version;
    if (e instanceof StopgateUnavailable) return e.status ?? 0;
    throw e;
  } finally {
    await w.close();
  }
}

export const processor = guarded(async (job: { data: { i: number } }, step: Step) => {
  await step.checkpoint();
  return job.data.i + step.attempt;
}, { leaseTtl: 60 });

export const data = jobData({ i: 1 }, 'r1', { cancelVersion: 1 });
const i: number = data.i;
const r: string = data.stopgate.run_id;
export { i, r };
