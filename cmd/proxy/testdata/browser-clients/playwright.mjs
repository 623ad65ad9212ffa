// A Playwright agent: node playwright.mjs WS_URL SITE_URL (see steps.mjs).
import { chromium } from 'playwright-core';
import { attempt, stages } from './steps.mjs';

const [ws, site] = process.argv.slice(2);
const browser = await chromium.connectOverCDP(ws, { timeout: 15000 });
let disconnected = false;
browser.on('disconnected', () => { disconnected = true; });
const context = browser.contexts()[0];
const page = context.pages()[0] ?? (await context.newPage());

await page.goto(`${site}/form`);
await page.fill('#name', 'Ada');
await Promise.all([page.waitForURL('**/submit'), page.click('#submit')]);
const result = await page.textContent('#result');

// What an agent tries next, and what it can still look at.
async function tries() {
  return {
    goto: await attempt(() => page.goto(`${site}/after`, { timeout: 5000 }).then(() => null)),
    click: await attempt(() => page.click('#submit', { timeout: 5000 })),
    evaluate: await attempt(() => page.evaluate(() => document.title)),
    screenshot: await attempt(() => page.screenshot({ timeout: 5000 }).then((b) => b.length)),
    cdp_screenshot: await attempt(async () => {
      const s = await context.newCDPSession(page);
      const { data } = await s.send('Page.captureScreenshot');
      return data.length;
    }),
    cdp_accessibility: await attempt(async () => {
      const s = await context.newCDPSession(page);
      const { nodes } = await s.send('Accessibility.getFullAXTree');
      return nodes.length;
    }),
    cdp_dom: await attempt(async () => {
      const s = await context.newCDPSession(page);
      const { root } = await s.send('DOM.getDocument', { depth: 1 });
      return root.nodeName;
    }),
  };
}

await stages(result, tries, () => disconnected);
