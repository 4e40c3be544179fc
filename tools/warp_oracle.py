#!/usr/bin/env python3
"""Record WARP's own tokenizer on a corpus: the fixture serve's "warp" pre-tokenizer is
tested against (tests/tokenizer/test_warp_fixture.py).

    tools/warp_oracle.py WARP_SOURCE_DIR [--out tests/fixtures/warp_tokenizer.json.gz]

WARP_SOURCE_DIR is a checkout of WARP (github.com/sqliteai/warp): its
src/tokenizer.c is compiled, unchanged, with `-Dstatic=` (so the harness can
call next_piece, the pre-tokenizer) into a small C harness in a temporary
directory; a C compiler is all it needs. The corpus is tools/warp_corpus.py's.
The vocabulary is made here, so that ids test the merge and its 1024-byte
windows: every byte, then the corpus' most frequent byte strings of 2 to 8
bytes (many of them cut inside a UTF-8 character), most frequent first, ranked
in that order as a tiktoken rank file; the specials follow it.

The fixture (gzipped JSON) holds the WARP commit, the vocabulary, the specials
and, per text, WARP's pieces (byte lengths) and ids as waste_tok_encode gives
them with allow_special 0 (content); a text with special tokens' texts also has
`markup_ids`, with allow_special 1. CI never runs this tool: it cannot fetch WARP.
"""
from __future__ import annotations

import argparse
import base64
import collections
import gzip
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import warp_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "warp_tokenizer.json.gz"
VOCAB = 20000
SEED = 29

HARNESS = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "tokenizer.h"

int next_piece(const char *s, int len);   /* static in tokenizer.c; -Dstatic= exposes it */

/* stdin: records of a mode byte ('p' content, 'm' markup), a little-endian uint32 length
   and the text. stdout per record: "P len len ..." (content only), then "I id id ...". */
int main(int argc, char **argv)
{
    if (argc != 2) return 2;
    waste_tok *t = waste_tok_open(argv[1]);
    if (!t) { fprintf(stderr, "cannot open %s\n", argv[1]); return 1; }
    for (;;) {
        const int mode = getchar();
        if (mode == EOF) break;
        uint8_t b[4];
        if (fread(b, 1, 4, stdin) != 4) return 1;
        const uint32_t len = b[0] | b[1] << 8 | b[2] << 16 | (uint32_t)b[3] << 24;
        char *text = malloc(len + 1);
        int32_t *ids = malloc(sizeof(int32_t) * (len + 16));
        if (!text || !ids || fread(text, 1, len, stdin) != len) return 1;
        text[len] = 0;
        if (mode == 'p') {
            printf("P");
            for (int at = 0, n; at < (int)len && (n = next_piece(text + at, (int)len - at)) > 0; at += n)
                printf(" %d", n);
            printf("\n");
        }
        const int n = waste_tok_encode(t, text, ids, (int)len + 16, mode == 'm');
        if (n < 0) return 1;
        printf("I");
        for (int i = 0; i < n; i++) printf(" %d", ids[i]);
        printf("\n");
        free(text);
        free(ids);
    }
    waste_tok_free(t);
    return 0;
}
"""


def vocabulary(texts: list[str]) -> list[bytes]:
    """Every byte, then the most frequent byte strings of 2..8 bytes, in rank order."""
    counts: collections.Counter[bytes] = collections.Counter()
    for text in texts:
        data = text.encode("utf-8")
        for size in range(2, 9):
            counts.update(data[i:i + size] for i in range(len(data) - size + 1))
    frequent = sorted((c, token) for token, c in counts.items() if c >= 2)
    frequent.sort(key=lambda ct: (-ct[0], len(ct[1]), ct[1]))
    return [bytes([b]) for b in range(256)] + [t for _, t in frequent[:VOCAB - 256]]


def read_fixture(path: Path = FIXTURE) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def fixture_tokens(fixture: dict) -> list[bytes]:
    """The fixture's vocabulary, in rank order."""
    blob, sizes = base64.b64decode(fixture["vocab"]), base64.b64decode(fixture["vocab_sizes"])
    tokens, at = [], 0
    for size in sizes:
        tokens.append(blob[at:at + size])
        at += size
    return tokens


def fixture_ranks(fixture: dict) -> dict[bytes, int]:
    """The fixture's vocabulary: token bytes -> rank."""
    return {token: rank for rank, token in enumerate(fixture_tokens(fixture))}


def write_vocabulary(root: Path, tokens: list[bytes], specials: list[dict]) -> None:
    """A container's tokenizer files as WARP reads them: tokenizer.model (a token's rank is
    its place) and specials.json (raw UTF-8: WARP does not unescape JSON strings)."""
    (root / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    (root / "specials.json").write_text(json.dumps(specials, ensure_ascii=False), "utf-8")


def build_harness(warp: Path, work: Path) -> Path:
    src = warp / "src"
    if not (src / "tokenizer.c").is_file():
        raise SystemExit(f"{src / 'tokenizer.c'} not found: give a WARP checkout")
    (work / "harness.c").write_text(HARNESS)
    binary = work / "harness"
    subprocess.run(["cc", "-O2", "-std=gnu11", "-Dstatic=", f"-I{src}", "-o", str(binary),
                    str(work / "harness.c"), str(src / "tokenizer.c")], check=True)
    return binary


def run(binary: Path, container: Path, cases: list[tuple[str, bool]]) -> list[dict]:
    records = b"".join((b"m" if markup else b"p") + struct.pack("<I", len(data)) + data
                       for data, markup in ((t.encode("utf-8"), m) for t, m in cases))
    out = subprocess.run([str(binary), str(container)], input=records, capture_output=True,
                         check=True).stdout.decode().splitlines()
    found, lines = [], iter(out)
    for text, markup in cases:
        case: dict = {"text": text}
        if not markup:
            case["pieces"] = [int(x) for x in next(lines).split()[1:]]
        case["ids"] = [int(x) for x in next(lines).split()[1:]]
        found.append(case)
    return found


def commit_of(warp: Path) -> str:
    got = subprocess.run(["git", "-C", str(warp), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    return got.stdout.strip() if got.returncode == 0 else "unknown (not a git checkout)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("warp", type=Path, help="a checkout of WARP's source")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    parser.add_argument("--commit", help="the WARP commit, when the directory is not a git checkout")
    args = parser.parse_args()
    plain = warp_corpus.plain_texts(SEED, 2200)
    marked = warp_corpus.markup_texts(SEED, plain, 500)
    tokens = vocabulary(plain)
    specials = [{"id": len(tokens) + i, "text": text} for i, text in enumerate(warp_corpus.SPECIALS)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        container = work / "vocab"
        container.mkdir()
        write_vocabulary(container, tokens, specials)
        cases = [(t, False) for t in plain + marked] + [(t, True) for t in marked]
        found = run(build_harness(args.warp, work), container, cases)
    for case, as_markup in zip(found[len(plain):], found[len(plain) + len(marked):]):
        case["markup_ids"] = as_markup["ids"]   # the same text, tokenized as markup
    found = found[:len(plain) + len(marked)]
    fixture = {
        "about": "WARP's tokenizer (src/tokenizer.c: next_piece, waste_tok_encode) on "
                 "tools/warp_corpus.py's texts, recorded by tools/warp_oracle.py",
        "warp_commit": args.commit or commit_of(args.warp),
        "vocab": base64.b64encode(b"".join(tokens)).decode(),
        "vocab_sizes": base64.b64encode(bytes(len(t) for t in tokens)).decode(),
        "specials": specials,
        "cases": found,
    }
    with gzip.open(args.out, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(fixture, f, ensure_ascii=False, separators=(",", ":"))
    print(f"{args.out}: {len(found)} texts ({len(marked)} with specials, also as markup), "
          f"{len(tokens)} tokens, {args.out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
