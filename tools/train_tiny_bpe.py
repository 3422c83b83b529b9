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

train_reference() is step 3 written plainly (it recounts every pair at every step: minutes per MB);
train() gives exactly the same merges with pair counts kept up to date and a heap, fast enough for
little-k3's 14 MB corpus (about 30 s). `--check` runs both and fails unless they agree.

Usage (the commands that made the fixtures):
  /usr/bin/python3 tools/train_tiny_bpe.py --corpus tools/tiny_corpus.txt --size 480 --out fixtures/tiny-k3/tiktoken.model
  /usr/bin/python3 tools/train_tiny_bpe.py --corpus tools/tiny_corpus.txt --size 4096 --out fixtures/tokenizer/large_seed.tiktoken
  /usr/bin/python3 tools/train_tiny_bpe.py --corpus build/little-corpus/train.txt --size 4096 --out fixtures/little-k3/tiktoken.model
    (train.txt comes from tools/little_corpus.py)
"""
import argparse
import base64
import collections
import heapq
import os
import re
import sys
import time

APPROX_PAT = re.compile(
    r"""[\u3400-\u4dbf\u4e00-\u9fff]+"""
    r"""| ?[^\W\d_]+(?:'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL]))?"""
    r"""|\d{1,3}"""
    r"""| ?[^\s\w]+[\r\n]*"""
    r"""|\s*[\r\n]+"""
    r"""|\s+(?!\S)"""
    r"""|\s+""")


def words_of(text):
    """The distinct pre-tokens of `text` as (list of byte ids, count), sorted by their bytes."""
    words = collections.Counter(m.group(0).encode("utf-8") for m in APPROX_PAT.finditer(text))
    return [(list(w), c) for w, c in sorted(words.items())]   # sorted: order independent of dict order


def merge_word(seq, a, b, new_id):
    """Rewrites every (a, b) in `seq` to new_id, left to right, non-overlapping (in place)."""
    i = 0
    while i < len(seq) - 1:
        if seq[i] == a and seq[i + 1] == b:
            seq[i:i + 2] = [new_id]
        i += 1


def train_reference(text, size):
    """The rule of step 3 written plainly: every step recounts every pair of every word. O(steps x corpus);
    kept as the definition that train() must reproduce (--check compares them)."""
    seqs = words_of(text)
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
            merge_word(seq, a, b, new_id)
    return vocab


def train(text, size, progress=None):
    """The same merges as train_reference, fast: the pair counts are kept up to date instead of recounted.
    `counts[p]` is p's count over all words (weighted), `where[p]` the words that contain p; a merge
    rewrites only the words in where[(a, b)] and adjusts the counts of the pairs those words lose and
    gain. The best pair comes from a heap of (-count, a, b): the same order as the reference's
    min(-count, (a, b)). An entry whose count is no longer the pair's count is stale and skipped when
    popped; every change of a count pushes a fresh entry, so the valid top is the reference's choice."""
    seqs = words_of(text)
    vocab = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(vocab)}
    counts = collections.Counter()
    where = collections.defaultdict(set)
    for w, (seq, c) in enumerate(seqs):
        for p in zip(seq, seq[1:]):
            counts[p] += c
            where[p].add(w)
    heap = [(-n, a, b) for (a, b), n in counts.items()]
    heapq.heapify(heap)
    while len(vocab) < size:
        while heap and counts.get((heap[0][1], heap[0][2]), 0) != -heap[0][0]:
            heapq.heappop(heap)   # stale
        if not heap:
            break
        count, a, b = heap[0]
        count = -count
        if count < 2:
            break
        merged = vocab[a] + vocab[b]
        new_id = index.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            index[merged] = new_id
            if progress and (len(vocab) - 256) % progress == 0:
                print(f"  {len(vocab)} tokens, last merge count {count}", flush=True)
        changed = set()
        for w in where.pop((a, b)):
            seq, c = seqs[w]
            before = collections.Counter(zip(seq, seq[1:]))
            merge_word(seq, a, b, new_id)
            after = collections.Counter(zip(seq, seq[1:]))
            for p, n in before.items():
                m = after.get(p, 0)
                if m != n:
                    counts[p] += (m - n) * c
                    changed.add(p)
                if m == 0 and p != (a, b):
                    where[p].discard(w)
            for p, m in after.items():
                if p not in before:
                    counts[p] += m * c
                    changed.add(p)
                    where[p].add(w)
        for p in changed:
            n = counts[p]
            if n > 0:
                heapq.heappush(heap, (-n, p[0], p[1]))
            else:
                del counts[p]
                where.pop(p, None)
    return vocab


def write_model(path, vocab):
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for rank, tok in enumerate(vocab):
            f.write(base64.b64encode(tok).decode("ascii") + " " + str(rank) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--size", type=int, required=True, help="total tokens including the 256 bytes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", action="store_true",
                    help="also run the plain reference trainer (slow: minutes on 1 MB) and fail unless it gives the same vocabulary")
    ap.add_argument("--progress", type=int, default=0, metavar="N", help="print a line every N new tokens")
    args = ap.parse_args()
    if args.size < 256:
        sys.exit(f"train_tiny_bpe.py: --size {args.size} is below the 256 single bytes")
    try:
        with open(args.corpus, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"train_tiny_bpe.py: cannot read the corpus {args.corpus}: {e}")
    t0 = time.monotonic()
    vocab = train(text, args.size, args.progress)
    seconds = time.monotonic() - t0
    if args.check:
        t1 = time.monotonic()
        ref = train_reference(text, args.size)
        if ref != vocab:
            first = next((r for r, (x, y) in enumerate(zip(ref, vocab)) if x != y), min(len(ref), len(vocab)))
            sys.exit(f"train_tiny_bpe.py: --check FAILED: the fast trainer differs from the reference at rank {first} "
                     f"({len(vocab)} vs {len(ref)} tokens)")
        print(f"--check: the reference trainer gives the same {len(ref)} tokens ({time.monotonic() - t1:.1f} s vs {seconds:.1f} s)")
    tmp = args.out + ".tmp"
    write_model(tmp, vocab)
    os.replace(tmp, args.out)
    print(f"{args.out}: {len(vocab)} tokens ({len(vocab) - 256} merges) from {len(text.encode('utf-8'))} bytes in {seconds:.1f} s")


if __name__ == "__main__":
    main()
