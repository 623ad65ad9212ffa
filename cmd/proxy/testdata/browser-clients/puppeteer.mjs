// A Puppeteer agent: node puppeteer.mjs WS_URL SITE_URL (see steps.mjs).
import puppeteer from 'puppeteer-core';
import { attempt, stages } from './steps.mjs';

const [ws, site] = process.argv.slice(2);
const browser = await puppeteer.connect({ browserWSEndpoint: ws, defaultViewport: null, protocolTimeout: 10000 });
let disconnected = false;
browser.on('disconnected', () => { disconnected = true; });
const page = (await browser.pages())[0] ?? (await browser.newPage());

await page.goto(`${site}/form`);
await page.type('#name', 'Ada');
await Promise.all([page.waitForNavigation(), page.click('#submit')]);
const result = await page.$eval('#result', (e) => e.textContent);

// What an agent tries next, and what it can still look at.
async function tries() {
  return {
    goto: await attempt(() => page.goto(`${site}/after`).then(() => null)),
    click: await attempt(() => page.click('#submit')),
    evaluate: await attempt(() => page.evaluate(() => document.title)),
    screenshot: await attempt(() => page.screenshot({ encoding: 'base64' }).then((b) => b.length)),
    accessibility: await attempt(() => page.accessibility.snapshot().then((t) => t && t.role)),
    cdp_dom: await attempt(async () => {
      const s = await page.createCDPSession();
      const { root } = await s.send('DOM.getDocument', { depth: 1 });
      return root.nodeName;
    }),
  };
}

await stages(result, tries, () => disconnected);
