// make bench-serve: what kimik3 serve costs over kimik3 run, and what state reuse saves. A measurement,
// never part of make test. Needs node (18+) and a built kimik3.
//
//   node bench/serve_bench.mjs KIMIK3 MODEL_DIR [--gen 64] [--reps 5] [--turn-words 600] [--budget SIZE] [--threads N]
//
// 1. per token: `kimik3 run --prompt P --gen G` (its per-step table: the engine's own time) against the
//    same greedy request streamed through the server and timed at the client (first token chunk, then
//    each further chunk), alternating run and server request: time to first token and tokens/s, medians of --reps. The server's own decode
//    time (its timings) splits the difference into the engine inside the server and what the HTTP side
//    and the client add. The client (node) runs on the same machine: on 2 cores it competes with the
//    engine's threads, which --threads 1 avoids.
// 2. state reuse: a second turn after a long first one (--turn-words words of user text), timed when
//    the server reuses the first turn (cached_tokens > 0) and when it must recompute the whole
//    conversation (an unrelated request in between drops the state).
import { spawn, execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const argv = process.argv.slice(2);
const [bin, model] = argv;
const opt = (name, dflt) => { const i = argv.indexOf(name); return i >= 0 ? argv[i + 1] : dflt; };
const gen = Number(opt("--gen", 64)), reps = Number(opt("--reps", 5)), turnWords = Number(opt("--turn-words", 600));
const budget = opt("--budget", null), threads = opt("--threads", null);
const median = (v) => { const s = [...v].sort((a, b) => a - b); return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2; };
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "kimik3-bench-serve-"));
const prompt = "Tell me about the experts of Kimi K3.";
const extra = [...(budget ? ["--budget", budget] : []), ...(threads ? ["--threads", threads] : [])];

// ---- kimik3 run: the engine's own per-step times ------------------------------------------------------
const runTtft = [], runTps = [];
function runOnce() {
  const out = path.join(tmp, "run.json");
  execFileSync(bin, ["run", model, "--prompt", prompt, "--gen", String(gen), "--quiet", "--out", out, ...extra], { stdio: ["ignore", "ignore", "ignore"] });
  const j = JSON.parse(fs.readFileSync(out, "utf8"));
  const steps = j.steps.map((s) => s.seconds);
  runTtft.push(steps[0]);
  if (steps.length > 1) runTps.push((steps.length - 1) / steps.slice(1).reduce((a, b) => a + b, 0));
}

// ---- the server ---------------------------------------------------------------------------------------
const server = spawn(bin, ["serve", model, "--port", "0", "--quiet", "--context", "8192", ...extra], { stdio: ["ignore", "ignore", "pipe"] });
let log = "";
const url = await new Promise((resolve, reject) => {
  server.stderr.on("data", (d) => {
    log += d;
    const m = log.match(/listening on (http:\/\/127\.0\.0\.1:\d+)/);
    if (m) resolve(m[1]);
  });
  server.on("exit", (c) => reject(new Error("kimik3 serve exited with " + c + ":\n" + log)));
});
process.on("exit", () => server.kill());

async function streamed(messages, maxTokens) {
  const t0 = performance.now();
  const r = await fetch(url + "/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ messages, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true }, kimik3: {} }),
  });
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "", first = 0, last = 0, n = 0, usage = null, timings = null, content = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    for (let at; (at = buf.indexOf("\n\n")) >= 0; buf = buf.slice(at + 2)) {
      const ev = buf.slice(0, at);
      if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
      const j = JSON.parse(ev.slice(6));
      if (j.error) throw new Error(j.error.message);
      if (j.usage) usage = j.usage;
      if (j.kimik3 && j.kimik3.prefill_seconds !== undefined) timings = j.kimik3;
      if (j.kimik3 && j.kimik3.token !== undefined) {
        const now = performance.now();
        if (!n) first = now;
        last = now;
        n++;
        content += (j.choices[0].delta.content || "");
      }
    }
  }
  return { ttft: (first - t0) / 1000, tps: n > 1 ? (n - 1) / ((last - first) / 1000) : NaN, n, usage, timings, content };
}

const one = [{ role: "user", content: prompt }];
await streamed(one, 4);  // warm: the first request pays for first touches
const srvTtft = [], srvTps = [], srvEngineTps = [];
// run and serve alternate, so that a shared machine's drift falls on both alike
for (let r = 0; r < reps; r++) {
  runOnce();
  await streamed([{ role: "user", content: "something else " + r }], 2);  // drop the state: no reuse
  const s = await streamed(one, gen);
  srvTtft.push(s.ttft);
  srvTps.push(s.tps);
  if (s.timings && s.usage.completion_tokens > 1) srvEngineTps.push((s.usage.completion_tokens - 1) / s.timings.decode_seconds);
}

// ---- state reuse ----------------------------------------------------------------------------------------
const words = Array.from({ length: turnWords }, (_, i) => ["expert", "layer", "token", "cache", "budget", "state"][i % 6]).join(" ");
const first = [{ role: "user", content: "Here are my notes: " + words }];
const reuse = [], recompute = [];
let cachedSeen = 0, promptLen = 0;
for (let r = 0; r < reps; r++) {
  const a = await streamed(first, 8);
  const second = [...first, { role: "assistant", content: a.content }, { role: "user", content: "Summarise them." }];
  const b = await streamed(second, 1);            // reuses the first turn
  cachedSeen = b.usage.prompt_tokens_details.cached_tokens;
  promptLen = b.usage.prompt_tokens;
  reuse.push(b.ttft);
  await streamed([{ role: "user", content: "unrelated " + r }], 1);  // drops the state
  const c = await streamed(second, 1);            // the same second turn, recomputed from scratch
  recompute.push(c.ttft);
}
server.kill();
fs.rmSync(tmp, { recursive: true, force: true });

const f = (x, d = 2) => x.toFixed(d);
const load = fs.readFileSync("/proc/loadavg", "utf8").split(" ").slice(0, 3).join(" ");
console.log(`model ${model}, ${gen} tokens greedy, medians of ${reps}${threads ? ", " + threads + " thread(s)" : ""}; load average ${load}`);
console.log(`                      first token (ms)   tokens/s`);
console.log(`  kimik3 run           ${f(median(runTtft) * 1000).padStart(10)}   ${f(median(runTps), 0).padStart(10)}`);
console.log(`  kimik3 serve         ${f(median(srvTtft) * 1000).padStart(10)}   ${f(median(srvTps), 0).padStart(10)}   (at the client)`);
console.log(`    its engine         ${"".padStart(10)}   ${f(median(srvEngineTps), 0).padStart(10)}   (the server's decode_seconds)`);
const perTokenRun = 1 / median(runTps), perTokenSrv = 1 / median(srvTps), perTokenEng = 1 / median(srvEngineTps);
console.log(`  server cost per token: ${f((perTokenSrv - perTokenRun) * 1e6, 1)} us (${f(100 * (perTokenSrv / perTokenRun - 1), 1)}%): ` +
            `${f((perTokenEng - perTokenRun) * 1e6, 1)} us in its engine loop, ${f((perTokenSrv - perTokenEng) * 1e6, 1)} us between engine and client`);
console.log(`state reuse: second turn of ${promptLen} prompt tokens, ${cachedSeen} of them reused`);
console.log(`  time to its first token: ${f(median(reuse) * 1000)} ms reused vs ${f(median(recompute) * 1000)} ms recomputed (${f(median(recompute) / median(reuse), 1)}x)`);
