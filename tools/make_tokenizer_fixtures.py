"""Writes the tokenizer fixtures that are plain data (chapter 14): the two tokenizer_config.json files
and the agreement corpus. Deterministic; no randomness, no network.

  fixtures/tiny-k3/tokenizer_config.json       the tiny K3's 32 specials (ids 480..511)
  fixtures/tokenizer/k3_tokenizer_config.json  K3's 256 specials (ids 163584..163839), docs/kimi-k3.md section 4
  fixtures/little-k3/tokenizer_config.json     the same 256 specials after little-k3's 4096 BPE ranks:
                                               K3 id 163584 + k -> 4096 + k (ids 4096..4351)
  fixtures/tokenizer/corpus.json               [{"name", "text", "vocabs"}]: the strings whose ids
                                               tools/tiktoken_oracle.mjs computes with OpenAI's tiktoken

Usage: /usr/bin/python3 tools/make_tokenizer_fixtures.py
(reads tools/tiny_corpus.txt and chapters/14_unicode_tables.inc, so run it after make_unicode_tables.mjs)
"""
import json
import os
import re

# Spec section 4: the named specials of K3 (absolute ids). `special: false` for the three XTML markers.
K3_NAMED = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
    163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>", 163605: "<|media_pad|>",
    163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]",
}
NOT_SPECIAL = {"<|open|>", "<|close|>", "<|sep|>"}
K3_BASE = 163584


def entry(content):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": content not in NOT_SPECIAL}


def config(first_id, count, named):
    dec = {}
    for i in range(first_id, first_id + count):
        dec[str(i)] = entry(named.get(i, f"<|reserved_token_{i}|>"))
    return {"added_tokens_decoder": dec, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
            "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576}


def tiny_named():
    # id = 480 + (k3_id - 163584) where that offset is < 32; the three far ones get fixed tiny ids.
    out = {480 + (k - K3_BASE): v for k, v in K3_NAMED.items() if k - K3_BASE < 32}
    out.update({502: "<osagent_mode>", 510: "[UNK]", 511: "[PAD]"})
    return out


LITTLE_BPE = 4096   # fixtures/little-k3/tiktoken.model: 256 bytes + 3840 merges (tools/train_tiny_bpe.py)


def little_named():
    # little-k3 keeps all 256 of K3's specials, in K3's order, right after its BPE ranks
    return {LITTLE_BPE + (k - K3_BASE): v for k, v in K3_NAMED.items()}


def unicode_sweep():
    """Every boundary of the Unicode class table, both sides, each in four contexts that split
    differently for each class (Lu/Lt vs Ll vs Lm/Lo/M vs N vs White_Space vs Han vs other)."""
    text = open("chapters/14_unicode_tables.inc", encoding="ascii").read()
    starts = [int(h, 16) for h in re.findall(r"\{0x([0-9A-F]+),\d+\}", text)]
    cps = sorted({c for s in starts for c in (s - 1, s) if 0 <= c <= 0x10FFFF and not 0xD800 <= c <= 0xDFFF})
    parts = []
    for c in cps:
        ch = chr(c)
        parts.append("A" + ch + "b !!" + ch + "! \u4e2d" + ch + " 1" + ch + "2\n")
    return "".join(parts)


def corpus():
    tiny = open("tools/tiny_corpus.txt", encoding="utf-8").read()
    paragraphs = [p for p in tiny.split("\n\n") if p.strip()]
    c = []
    add = lambda name, text, vocabs=("tiny", "large"): c.append({"name": name, "text": text, "vocabs": list(vocabs)})
    add("prose", "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.")
    add("prose with names", "Kimi K3 was released by Moonshot AI; the tokenizer is a tiktoken byte-level BPE.")
    add("contractions lower", "I'm sure you're right: he's here, she'd know, we've seen it, they'll come, don't go.")
    add("contractions upper", "I'M SURE YOU'RE RIGHT: HE'S HERE, SHE'D KNOW, WE'VE SEEN IT, THEY'LL COME, DON'T GO.")
    add("contractions mixed case", "it'S it's It'S 'T 't 'Re 'rE 'RE 've 'VE 'Ve 'm 'M 'll 'LL 'lL 'd 'D")
    add("contractions bare", "'s 'S 't 'T 're 'RE 've 'VE 'm 'M 'll 'LL 'd 'D 'x 'tis 'twas")
    add("contraction edge cases", "cats's HELLO'S Hello's ÉCOLE'S naïve's ab'llc ab'sx x'd'd 123's a''s 's's")
    add("long s folds to s", "it'\u017f IT'\u017f")
    add("curly apostrophe is no contraction", "it\u2019s don\u2019t we\u2019re \u2018quoted\u2019 \u201cdouble\u201d")
    for n in range(1, 11):
        add(f"digits {n}", "1234567890"[:n])
    add("digit runs in text", "a1b22c333d4444e55555 666666 7777777x 88888888 999999999 1234567890.")
    add("numbers", "3.14159 1,234,567.89 -42 +7 1e-5 0x7FFF 2026-07-01 12:30 50% $100 \u20ac15")
    add("other digits", "\u0663\u0664\u0665 \u0968\u0969 \uff11\uff12\uff13 \u00bd \u00b2 \u216b \u3007\u4e00\u4e8c 1\u30072")
    add("spaces", "a b  c   d    e")
    add("tabs", "a\tb\t\tc \t d")
    add("newlines", "line one\nline two\n\nline four\n\n\n")
    add("crlf", "first\r\nsecond\r\n\r\nthird \r\n fourth")
    add("trailing spaces", "text   \n   more text   ")
    add("leading spaces", "   leading")
    add("only spaces", "    ")
    add("single space", " ")
    add("whitespace before punctuation", "wait   !  ?   ...")
    add("mixed whitespace", "a \t\n \r\n\t b\u00a0c\u3000d\u2028e\u2029f\u0085g\u000bh\u000ci")
    add("chinese", "\u4e2d\u6587\u7684\u53e5\u5b50\u6ca1\u6709\u7a7a\u683c\uff0c\u6240\u4ee5\u5206\u8bcd\u5668\u4f1a\u628a\u8fde\u7eed\u7684\u6c49\u5b57\u653e\u5728\u4e00\u8d77\u3002")
    add("chinese with latin", "\u6211\u7528GPT\u5199\u4ee3\u7801\uff0cK3\u6709163840\u4e2a\u8bcd\u3002 abc\u4e2d\u6587def")
    add("japanese", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u306b\u306f\u3001\u3072\u3089\u304c\u306a\u3068\u30ab\u30bf\u30ab\u30ca\u3068\u6f22\u5b57\u304c\u307e\u3056\u3063\u3066\u3044\u307e\u3059\u3002")
    add("korean", "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc740 \ub744\uc5b4\uc4f0\uae30\ub97c \ud569\ub2c8\ub2e4.")
    add("han specials", "\u2e80\u2e81 \u3005\u3006\u3007 \u303b \U00020000\U00020001 \U00031350 \U0002ebf0 x\u2e80y !\u2f00")
    add("mixed scripts", "Hello \u043f\u0440\u0438\u0432\u0435\u0442 \u03b3\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947 \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35")
    add("emoji", "\U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 \U0001F1EF\U0001F1F5 \u2764\ufe0f 1\ufe0f\u20e3 \U0001F680\U0001F680 text\U0001F600text")
    add("combining marks", "e\u0301 n\u0303o a\u0308 \u0301 x \u0301\u0301 Z\u0334\u0353a\u0337l\u0338g\u0336o\u0335 a\u20dd \u0915\u093f")
    add("titlecase and modifier letters", "\u01c5ungla \u01c8 \u01cb \u1f88 \u01c5A \u01c5a A\u01c5 \u02b0\u02b1\u02b2 \u02c6 \u1d43 \u02bc \u00aa\u00ba \u01c2 \U0001E030")
    add("case runs", "HELLOWorld camelCaseWords PascalCase ABCdef XMLHttpRequest iPhone McDONALD")
    add("special token text", "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|> [EOS] [BOS] <|reserved_token_163600|>")
    add("code python", "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n")
    add("code cpp", "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\nstd::vector<int> v{1, 2, 3};")
    add("json and markup", "{\"role\": \"user\", \"content\": \"Hello!\"} <tag attr=\"v\">x</tag> **bold** `code` [link](https://example.invalid/a?b=c)")
    add("punctuation", "... !!! ?!? -- --- a.b.c (a) [b] {c} 'single' \"double\" \\ / @#$%^&*_+=~|")
    add("control characters", "\x00\x01\x07\x1b[0m\x7f \x1c\x1d\x1e\x1f x\x1fy")
    add("format characters", "zero\u200bwidth \u2060joiner \ufeffbom soft\u00adhyphen \u200e\u200f")
    add("private use and noncharacters", "\ue000\uf8ff \U000F0000 \ufdd0 \ufffe\uffff \U0010FFFF")
    add("replacement character", "\ufffd \ufffd\ufffd")
    add("tiny corpus whole", tiny)
    add("long paragraphs", "\n\n".join(paragraphs * 2))
    add("long word", "abcdefghijklmnopqrstuvwxyz" * 120)
    add("long digit run", "0123456789" * 300)
    add("long whitespace run", " " * 1000 + "x" + "\n" * 500 + "\t" * 300 + "y   ")
    add("long punctuation run", "=-" * 800 + "\n")
    add("long han run", "\u4eba\u5de5\u667a\u80fd\u6b63\u5728\u6539\u53d8\u4e16\u754c" * 200)
    add("unicode table sweep", unicode_sweep(), vocabs=("large",))
    return c


def dump(path, obj):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(obj, f, ensure_ascii=True, indent=1)
        f.write("\n")


def main():
    dump("fixtures/tiny-k3/tokenizer_config.json", config(480, 32, tiny_named()))
    dump("fixtures/tokenizer/k3_tokenizer_config.json", config(K3_BASE, 256, K3_NAMED))
    os.makedirs("fixtures/little-k3", exist_ok=True)
    dump("fixtures/little-k3/tokenizer_config.json", config(LITTLE_BPE, 256, little_named()))
    cases = corpus()
    dump("fixtures/tokenizer/corpus.json", cases)
    print(f"corpus: {len(cases)} cases, {sum(len(x['text'].encode('utf-8')) for x in cases)} bytes of UTF-8")


if __name__ == "__main__":
    main()
