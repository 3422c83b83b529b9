// A real client against kimik3 serve: the official openai npm package (installed by tests/serve.sh into
// build/serve-npm, never committed). Completes a chat, streams the same chat, lists the models and
// checks that an unknown model is the API error the package expects. Prints one line; exit 0 = passed.
// usage: node tests/serve_client.mjs URL MODEL NPM_DIR
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";

const [url, model, npmDir] = process.argv.slice(2);
const require = createRequire(path.resolve(npmDir) + "/");
const mod = require("openai");
const OpenAI = mod.OpenAI || mod.default;
const version = JSON.parse(fs.readFileSync(path.join(path.resolve(npmDir), "node_modules/openai/package.json"), "utf8")).version;
const client = new OpenAI({ baseURL: url + "/v1", apiKey: "unused", maxRetries: 0, timeout: 30000 });
const fail = (m) => { console.log("FAILED: " + m); process.exit(1); };

const messages = [{ role: "user", content: "Hello from the openai package" }];
const r = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0 });
const c = r.choices[0];
if (c.message.role !== "assistant" || typeof c.message.content !== "string") fail("no assistant message: " + JSON.stringify(r));
if (!["stop", "length"].includes(c.finish_reason)) fail("finish_reason " + c.finish_reason);
if (!(r.usage.completion_tokens >= 1 && r.usage.prompt_tokens > 0)) fail("usage " + JSON.stringify(r.usage));

const s = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } });
let text = "", chunks = 0, finish = null, usage = null;
for await (const chunk of s) {
  chunks++;
  if (chunk.usage) usage = chunk.usage;
  const ch = chunk.choices[0];
  if (!ch) continue;
  text += ch.delta?.content ?? "";
  if (ch.finish_reason) finish = ch.finish_reason;
}
if (text !== c.message.content) fail(`streamed text ${JSON.stringify(text)} differs from ${JSON.stringify(c.message.content)}`);
if (finish !== c.finish_reason) fail(`streamed finish_reason ${finish}, not ${c.finish_reason}`);
if (!usage || usage.completion_tokens !== r.usage.completion_tokens) fail("streamed usage " + JSON.stringify(usage));

const models = await client.models.list();
if (models.data[0]?.id !== model) fail("models.list: " + JSON.stringify(models.data));

try {
  await client.chat.completions.create({ model: "no-such-model", messages, max_tokens: 2 });
  fail("an unknown model was accepted");
} catch (e) {
  if (!(e instanceof OpenAI.APIError) || e.status !== 404) fail("an unknown model gave " + e);
}
console.log(`openai ${version}: a chat (${r.usage.completion_tokens} tokens, ${c.finish_reason}), the same chat streamed in ${chunks} chunks ` +
            `with the same text, models.list, and a 404 APIError for an unknown model`);
