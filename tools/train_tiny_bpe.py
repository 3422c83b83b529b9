"""Deterministic byte-level BPE trainer for the project's tokenizer fixtures (chapter 14).

Writes a `tiktoken.model` file: one line per token, `base64(token bytes) rank`, ranks 0..N-1, where ranks
0..255 are the 256 single bytes (rank = byte value) and every later rank is a merge learned from the
corpus, in the order it was learned.

Training, exactly:
  1. The corpus (UTF-8) is cut into words by APPROX_PAT below, a Python-`re` approximation of K3's
     pre-tokenizer (Python's `re` has no \\p{Han} or class intersection). The vocabulary is only data:
     the fixtures' expected ids come from OpenAI's tiktoken running the exact K3 regex on this file,
     so the approximation can make the vocabulary less apt, never a test wrong.
  2. Each distinct word is a list of token ids (initially its bytes) with a count.
  3. Repeat until the vocabulary has --size tokens: count every adjacent pair of ids over all words
     (weighted by word count); take the pair with the highest count, ties broken by the smaller
     (left id, right id); stop early if the best count is below 2. Its merged bytes become the next
     rank, unless those bytes are already a token (reached by another split), in which case the pair
     is rewritten to that existing id and no rank is spent. Rewrite every word left to right,
     non-overlapping.
Running it twice gives the same bytes; a smaller --size gives a prefix of a larger one's output.

Usage (the commands that made the fixtures):
  /usr/bin/python3 tools/train_tiny_bpe.py --corpus tools/tiny_corpus.txt --size 480 --out fixtures/tiny-k3/tiktoken.model
  /usr/bin/python3 tools/train_tiny_bpe.py --corpus tools/tiny_corpus.txt --size 4096 --out fixtures/tokenizer/large_seed.tiktoken
"""
import argparse
import base64
import collections
import re

APPROX_PAT = re.compile(
    r"""[\u3400-\u4dbf\u4e00-\u9fff]+"""
    r"""| ?[^\W\d_]+(?:'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL]))?"""
    r"""|\d{1,3}"""
    r"""| ?[^\s\w]+[\r\n]*"""
    r"""|\s*[\r\n]+"""
    r"""|\s+(?!\S)"""
    r"""|\s+""")


def train(text, size):
    words = collections.Counter(m.group(0).encode("utf-8") for m in APPROX_PAT.finditer(text))
    seqs = [(list(w), c) for w, c in sorted(words.items())]   # sorted: order independent of dict order
    vocab = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(vocab)}
    while len(vocab) < size:
        pairs = collections.Counter()
        for seq, c in seqs:
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merged = vocab[a] + vocab[b]
        new_id = index.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            index[merged] = new_id
        for seq, _ in seqs:
            i = 0
            while i < len(seq) - 1:
                if seq[i] == a and seq[i + 1] == b:
                    seq[i:i + 2] = [new_id]
                i += 1
    return vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--size", type=int, required=True, help="total tokens including the 256 bytes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    vocab = train(text, args.size)
    with open(args.out, "w", encoding="ascii", newline="\n") as f:
        for rank, tok in enumerate(vocab):
            f.write(base64.b64encode(tok).decode("ascii") + " " + str(rank) + "\n")
    print(f"{args.out}: {len(vocab)} tokens ({len(vocab) - 256} merges)")


if __name__ == "__main__":
    main()
