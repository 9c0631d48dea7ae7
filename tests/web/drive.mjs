// Drives one page in the system Chromium for tests/browser.py's run_page().
//
// Usage: node tests/web/drive.mjs ARGS.json, where ARGS.json holds
//   {"url": str, "script": str | null, "waitFor": str | null,
//    "timeoutMs": number, "screenshot": str | null,
//    "download": {"click": CSS selector, "path": str} | null}
// Arguments come in a file (never through a shell string) so scripts need no quoting.
//
// Prints exactly one JSON line on stdout:
//   {"ok": true, "value": ..., "console": [...], "pageErrors": [...], "requests": [...]}
//   {"ok": false, "error": "...", "console": [...], "pageErrors": [...], "requests": [...]}
// Everything else (Playwright's own diagnostics) goes to stderr. The whole run, Chromium's
// start included, is bounded by timeoutMs; Python kills this process a little later still.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';

// playwright-core lives in web/node_modules (web/package.json), not beside this file.
const require = createRequire(new URL('../../web/package.json', import.meta.url));
const { chromium } = require('playwright-core');

// The machine's network is closed: without the background-networking flags Chromium keeps
// trying to reach Google's hosts. Playwright gives every launch a fresh temporary profile
// (its own --user-data-dir) and adds --headless itself.
const FLAGS = [
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
];

const args = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const consoleMessages = [];
const pageErrors = [];
const requests = [];
let browser = null;

function fail(message) {
  return { ok: false, error: message };
}

async function drive() {
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: FLAGS,
  });
  const page = await browser.newPage({ acceptDownloads: true });
  page.on('console', (m) => consoleMessages.push({ type: m.type(), text: m.text() }));
  page.on('request', (r) => requests.push(r.url()));
  // An uncaught exception (or unhandled rejection) ends a wait for completion at once:
  // a page that failed will never set its "done" flag.
  let rejectOnPageError;
  const pageFailed = new Promise((_, reject) => { rejectOnPageError = reject; });
  pageFailed.catch(() => {});
  page.on('pageerror', (e) => {
    const text = e.stack || String(e);
    pageErrors.push(text);
    rejectOnPageError(new Error(`page error: ${e.message || text}`));
  });
  page.on('crash', () => rejectOnPageError(new Error('page crashed')));

  const response = await page.goto(args.url, { waitUntil: 'load', timeout: 0 });
  if (response && !response.ok()) return fail(`HTTP ${response.status()} for ${args.url}`);
  if (args.waitFor) {
    await Promise.race([
      page.waitForFunction(args.waitFor, null, { timeout: 0, polling: 50 }),
      pageFailed,
    ]);
  }
  let value = null;
  if (args.script) {
    // JSON round trip inside the page: the caller gets exactly JSON semantics.
    const json = await Promise.race([
      page.evaluate(`(async () => { ${args.script}\n})().then((v) => JSON.stringify(v))`),
      pageFailed,
    ]);
    value = json === undefined ? null : JSON.parse(json);
  }
  if (args.screenshot) await page.screenshot({ path: args.screenshot, fullPage: true });
  if (args.download) {
    // what a user gets: click the element, save the file the page offers
    const [download] = await Promise.all([
      page.waitForEvent('download', { timeout: 0 }),
      page.click(args.download.click),
    ]);
    await download.saveAs(args.download.path);
  }
  return { ok: true, value };
}

let timer;
const deadline = new Promise((resolve) => {
  timer = setTimeout(() => resolve(fail(
    `timed out after ${args.timeoutMs / 1000} s` + (args.waitFor ? ` waiting for ${args.waitFor}` : ''),
  )), args.timeoutMs);
});
let result;
try {
  result = await Promise.race([drive(), deadline]);
} catch (e) {
  result = fail(e && e.message ? e.message : String(e));
}
clearTimeout(timer);
const out = { ...result, console: consoleMessages, pageErrors, requests };
process.stdout.write(JSON.stringify(out) + '\n');
// Closing can stall on a renderer stuck in a loop; Chromium dies with this process anyway.
if (browser) await Promise.race([browser.close(), new Promise((r) => setTimeout(r, 3000))]);
process.exit(0);
