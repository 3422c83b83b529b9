// The agreement oracle for chapter 14: OpenAI's tiktoken (the npm package `tiktoken`, a WASM build of
// the Rust crate that Kimi's tokenization_kimi.py calls) encodes every string of
// fixtures/tokenizer/corpus.json with K3's pre-tokenizer regex and two vocabularies, and writes the ids:
//
//   fixtures/tokenizer/tiny_expected.json    vocab fixtures/tiny-k3/tiktoken.model (480 BPE tokens)
//   fixtures/tokenizer/large_expected.json   the synthetic K3-sized vocabulary (163,584 BPE tokens),
//                                            built by the rule below; never written to the repository
//
// Encoding is tokenization_kimi.py's `encode` for text without specials: the long-input pre-split
// (chunks of 400,000 code points, then runs of > 25,000 whitespace / non-whitespace code points, with
// Python's str.isspace) ported below, then tiktoken's encode_ordinary on each piece (specials are never
// recognised). Each case is also decoded back and must give its bytes.
//
// Usage (tiktoken installed outside the repository; no lock file is written):
//   npm install --prefix /tmp/kimik3-tiktoken --no-package-lock --no-save tiktoken@1.0.22
//   node tools/tiktoken_oracle.mjs /tmp/kimik3-tiktoken
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

const prefix = process.argv[2] || "/tmp/kimik3-tiktoken";
const require = createRequire(path.join(prefix, "node_modules", "/"));
const { Tiktoken } = require("tiktoken/lite");
const tiktokenVersion = JSON.parse(fs.readFileSync(path.join(prefix, "node_modules", "tiktoken", "package.json"), "utf8")).version;

// K3's pat_str, docs/kimi-k3.md section 4 (tokenization_kimi.py), alternatives joined with "|".
const PAT_STR = [
  String.raw`[\p{Han}]+`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`\p{N}{1,3}`,
  String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
  String.raw`\s*[\r\n]+`,
  String.raw`\s+(?!\S)`,
  String.raw`\s+`,
].join("|");

// ---- the synthetic K3-sized vocabulary (tests/large_vocab.hpp builds the same bytes in C++) ----------
// Built rank by rank; a candidate whose bytes are already a token is skipped.
//   1. fixtures/tokenizer/large_seed.tiktoken in rank order (the 256 bytes, then trained merges);
//   2. every 2-byte string b1 b2, in increasing order of mix64(0x4B33000000000000 | b1 << 8 | b2);
//   3. the UTF-8 of every code point of these ranges, in code point order:
//      U+3000..U+30FF, U+4E00..U+9FFF, U+AC00..U+D7A3, U+1F300..U+1F6FF, U+1F900..U+1F9FF;
//   4. until there are 163,584 tokens: r = the next output of splitmix64 seeded with 0x4B33; with n the
//      token count after step 3, the candidate is token[r mod n] + token[(r >> 32) mod n], skipped when
//      longer than 32 bytes.
// mix64 is splitmix64's finaliser; splitmix64 adds 0x9E3779B97F4A7C15 to its state and returns mix64.
const M64 = (1n << 64n) - 1n;
function mix64(z) {
  z = ((z ^ (z >> 30n)) * 0xBF58476D1CE4E5B9n) & M64;
  z = ((z ^ (z >> 27n)) * 0x94D049BB133111EBn) & M64;
  return z ^ (z >> 31n);
}
const LARGE_SIZE = 163584;
function buildLargeVocab(seedText) {
  const tokens = [];             // Buffer per rank
  const seen = new Set();        // latin1 view of the bytes
  const add = (buf) => {
    const key = buf.toString("latin1");
    if (seen.has(key) || tokens.length >= LARGE_SIZE) return;
    seen.add(key);
    tokens.push(buf);
  };
  for (const line of seedText.split("\n")) if (line) add(Buffer.from(line.split(" ")[0], "base64"));
  const pairs = [];
  for (let v = 0; v < 65536; v++) pairs.push([mix64(0x4B33000000000000n | BigInt(v)), v]);
  pairs.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  for (const [, v] of pairs) add(Buffer.from([v >> 8, v & 255]));
  for (const [lo, hi] of [[0x3000, 0x30FF], [0x4E00, 0x9FFF], [0xAC00, 0xD7A3], [0x1F300, 0x1F6FF], [0x1F900, 0x1F9FF]])
    for (let c = lo; c <= hi; c++) add(Buffer.from(String.fromCodePoint(c), "utf8"));
  const n = BigInt(tokens.length);
  let state = 0x4B33n;
  while (tokens.length < LARGE_SIZE) {
    state = (state + 0x9E3779B97F4A7C15n) & M64;
    const r = mix64(state);
    const cand = Buffer.concat([tokens[Number(r % n)], tokens[Number((r >> 32n) % n)]]);
    if (cand.length <= 32) add(cand);
  }
  return tokens.map((t, i) => t.toString("base64") + " " + i + "\n").join("");
}

// FNV-1a 64 of a byte string, as 16 hex digits: lets the C++ test check it rebuilt the same vocabulary.
function fnv1a64(buf) {
  let h = 0xCBF29CE484222325n;
  for (const b of buf) h = ((h ^ BigInt(b)) * 0x100000001B3n) & M64;
  return h.toString(16).padStart(16, "0");
}

// ---- tokenization_kimi.py's long-input pre-split, ported -------------------------------------------
// Python's str.isspace(): bidirectional class WS, B or S, or category Zs (checked with /usr/bin/python3).
const PY_SPACE = new Set([9, 10, 11, 12, 13, 28, 29, 30, 31, 32, 133, 160, 5760, 8192, 8193, 8194, 8195, 8196,
  8197, 8198, 8199, 8200, 8201, 8202, 8232, 8233, 8239, 8287, 12288]);
function splitLong(text, maxChunk = 400000, maxRun = 25000) {
  const cps = Array.from(text);
  const out = [];
  for (let i = 0; i < cps.length; i += maxChunk) {
    const s = cps.slice(i, i + maxChunk);
    let len = 0, isSpace = s.length > 0 && PY_SPACE.has(s[0].codePointAt(0)), start = 0;
    for (let j = 0; j < s.length; j++) {
      const now = PY_SPACE.has(s[j].codePointAt(0));
      if (isSpace !== now) { len = 1; isSpace = now; }
      else if (++len > maxRun) { out.push(s.slice(start, j).join("")); start = j; len = 1; }
    }
    out.push(s.slice(start).join(""));
  }
  return out;
}

function specialsOf(configPath) {
  const dec = JSON.parse(fs.readFileSync(configPath, "utf8")).added_tokens_decoder;
  return Object.fromEntries(Object.entries(dec).map(([id, v]) => [v.content, Number(id)]));
}

function run(name, ranksText, specials, cases, outPath, extra) {
  const enc = new Tiktoken(ranksText, specials, PAT_STR);
  const lines = [];
  let total = 0;
  for (const c of cases) {
    if (!c.vocabs.includes(name)) continue;
    const ids = [];
    for (const piece of splitLong(c.text)) ids.push(...enc.encode_ordinary(piece));
    const back = Buffer.from(enc.decode(Uint32Array.from(ids)));
    if (!back.equals(Buffer.from(c.text, "utf8"))) throw new Error(`${name}: '${c.name}' does not round-trip`);
    for (const id of ids) if (Object.values(specials).includes(id)) throw new Error(`${name}: '${c.name}' produced a special`);
    lines.push(`  {"name": ${JSON.stringify(c.name)}, "ids": [${ids.join(",")}]}`);
    total += ids.length;
  }
  enc.free();
  const head = {
    generator: "node tools/tiktoken_oracle.mjs /tmp/kimik3-tiktoken",
    tiktoken: `npm tiktoken ${tiktokenVersion} (Rust tiktoken in WASM: fancy-regex 0.11.0, regex-syntax 0.8.5 = Unicode 16.0)`,
    pat_str: PAT_STR,
    encoding: "tokenization_kimi.py encode without specials: long-input pre-split, then encode_ordinary per piece",
    ...extra,
  };
  const text = "{\n" + Object.entries(head).map(([k, v]) => ` ${JSON.stringify(k)}: ${JSON.stringify(v)},\n`).join("") +
               ' "cases": [\n' + lines.join(",\n") + "\n ]\n}\n";
  fs.writeFileSync(outPath, text);
  console.log(`${outPath}: ${lines.length} cases, ${total} ids`);
}

const cases = JSON.parse(fs.readFileSync("fixtures/tokenizer/corpus.json", "utf8"));
const tinyRanks = fs.readFileSync("fixtures/tiny-k3/tiktoken.model", "utf8");
run("tiny", tinyRanks, specialsOf("fixtures/tiny-k3/tokenizer_config.json"), cases,
    "fixtures/tokenizer/tiny_expected.json",
    { vocab: "fixtures/tiny-k3/tiktoken.model", specials: "fixtures/tiny-k3/tokenizer_config.json",
      vocab_fnv1a64: fnv1a64(Buffer.from(tinyRanks, "latin1")) });
const largeRanks = buildLargeVocab(fs.readFileSync("fixtures/tokenizer/large_seed.tiktoken", "utf8"));
run("large", largeRanks, specialsOf("fixtures/tokenizer/k3_tokenizer_config.json"), cases,
    "fixtures/tokenizer/large_expected.json",
    { vocab: "synthetic, 163,584 tokens: the rule in tools/tiktoken_oracle.mjs and tests/large_vocab.hpp",
      specials: "fixtures/tokenizer/k3_tokenizer_config.json",
      vocab_bytes: largeRanks.length, vocab_fnv1a64: fnv1a64(Buffer.from(largeRanks, "latin1")) });
