// A real browser against kimik3 serve's page: headless chromium (Debian's), driven over the DevTools
// protocol on a pipe (--remote-debugging-pipe: no port, no WebSocket library). Loads the page, sends a
// message, waits for the streamed reply and the heat map, clicks a token, saves a screenshot.
// Prints one line; exit 0 = passed.  usage: node tests/serve_browser.mjs URL CHROMIUM OUT.png
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const [url, chromium, out] = process.argv.slice(2);
const profile = fs.mkdtempSync(path.join(os.tmpdir(), "kimik3-chromium-"));
const args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--disable-extensions",
              `--user-data-dir=${profile}`, "--remote-debugging-pipe", "about:blank"];
const proc = spawn(chromium, args, { stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"] });
let stderr = "";
proc.stderr.on("data", (d) => { stderr = (stderr + d).slice(-4000); });
let ending = false;
const done = (code, line) => {  // prints the result, stops chromium, removes its profile once it has exited
  if (ending) return;
  ending = true;
  console.log(line);
  const finish = () => {
    try { fs.rmSync(profile, { recursive: true, force: true, maxRetries: 5 }); } catch {}
    process.exit(code);
  };
  if (proc.exitCode !== null) return finish();
  proc.once("exit", finish);
  setTimeout(finish, 3000).unref();
  try { proc.kill("SIGKILL"); } catch {}
};
const fail = (m) => done(1, "FAILED: " + m + (stderr ? "\nchromium said: " + stderr.split("\n").slice(-5).join("\n") : ""));
setTimeout(() => fail("timed out after 80 s"), 80000).unref();
proc.on("exit", (code) => fail("chromium exited with " + code));

// the protocol: JSON messages separated by NUL bytes, fd 3 to chromium, fd 4 from it
let next = 0, buf = Buffer.alloc(0);
const pending = new Map();
proc.stdio[4].on("data", (d) => {
  buf = Buffer.concat([buf, d]);
  for (let i; (i = buf.indexOf(0)) >= 0; buf = buf.subarray(i + 1)) {
    const m = JSON.parse(buf.subarray(0, i).toString());
    const p = m.id && pending.get(m.id);
    if (!p) continue;
    pending.delete(m.id);
    m.error ? p.reject(new Error(JSON.stringify(m.error))) : p.resolve(m.result);
  }
});
function send(method, params = {}, sessionId) {
  const m = { id: ++next, method, params };
  if (sessionId) m.sessionId = sessionId;
  proc.stdio[3].write(JSON.stringify(m) + "\0");
  return new Promise((resolve, reject) => pending.set(m.id, { resolve, reject }));
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

try {
  const info = await (await fetch(url + "/kimik3/info")).json();
  const moeLayers = info.layers.filter((l) => l.ffn === "MoE").length;
  const { targetId } = await send("Target.createTarget", { url: "about:blank" });
  const { sessionId } = await send("Target.attachToTarget", { targetId, flatten: true });
  await send("Emulation.setDeviceMetricsOverride", { width: 1400, height: 900, deviceScaleFactor: 1, mobile: false }, sessionId);
  await send("Page.navigate", { url: url + "/" }, sessionId);
  const evaluate = async (expression) => {
    const r = await send("Runtime.evaluate", { expression, returnByValue: true, awaitPromise: true }, sessionId);
    if (r.exceptionDetails) throw new Error("in the page: " + JSON.stringify(r.exceptionDetails).slice(0, 400));
    return r.result.value;
  };
  const waitFor = async (what, expression, ms) => {
    for (const t0 = Date.now(); Date.now() - t0 < ms; await sleep(50)) {
      try { if (await evaluate(expression)) return; } catch {}
    }
    throw new Error("waited " + ms / 1000 + " s for " + what);
  };
  await waitFor("the page and the model's shape", "document.getElementById('model').textContent.includes('layers')", 15000);
  await evaluate(`(() => { const i = document.getElementById('input'); i.value = 'Hello from a browser'; document.getElementById('max_tokens').value = 24; document.getElementById('form').requestSubmit(); return true; })()`);
  await waitFor("the reply", "!!document.querySelector('.msg.assistant.done, .msg.error.done')", 30000);
  const error = await evaluate("document.querySelector('.msg.error') ? document.querySelector('.msg.error').textContent : ''");
  if (error) fail("the page shows an error: " + error);
  const shown = await evaluate("document.querySelectorAll('.msg.assistant.current .tok').length");
  if (shown < 1) fail("the reply has no tokens");
  // select the second token (or the first) and check that the inspector follows
  const pick = Math.min(1, shown - 1);
  await evaluate(`document.querySelectorAll('.msg.assistant.current .tok')[${pick}].click(), true`);
  const cells = await evaluate("Number(document.getElementById('heatmap').dataset.cells || 0)");
  const rows = await evaluate("Number(document.getElementById('depth').dataset.rows || 0)");
  const selectedStep = await evaluate("document.getElementById('tokinfo').textContent");
  if (cells !== moeLayers * info.experts_per_token) fail(`the heat map has ${cells} cells, not ${moeLayers} MoE layers x ${info.experts_per_token}`);
  if (rows !== 2 * info.layers.length + 1) fail(`the depth map has ${rows} rows, not ${2 * info.layers.length + 1}`);
  if (!selectedStep.includes(`step${pick} `)) fail("the inspector does not show the clicked token: " + selectedStep);
  const shot = await send("Page.captureScreenshot", { format: "png" }, sessionId);
  fs.writeFileSync(out, Buffer.from(shot.data, "base64"));
  await send("Browser.close").catch(() => {});
  done(0, `chromium: the page streamed a reply of ${shown} tokens; token ${pick} selected: a heat map of ${cells} expert choices, ` +
          `${rows} rows of depth weights; screenshot ${out}`);
} catch (e) {
  fail(String(e.message || e));
}
