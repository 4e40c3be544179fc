#!/usr/bin/env python3
"""Write a small, deterministic reference container (engine/FORMAT.md).

    make_container.py OUT [--flavour k3|kimi-linear|plain] [--vision]
                          [--seed N] [--quant f32|q8g32] [--vocab N] [--force]
    make_container.py OUT --from-gguf FILE.gguf [--force]

The model is random but shaped like a real one: a byte-level BPE trained on a
built-in corpus, a 4-layer MoE trunk and one expert bank per MoE layer.  The
same arguments always give byte-identical files.  The pre-tokenizer and the
reference encoder here are also what the tokenizer tests compare the engine
against.
"""
from __future__ import annotations

import argparse
import base64
import heapq
import itertools
import math
import os
import random
import shutil
import sys
import tempfile
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_container  # noqa: E402
from container_io import publish, write_bank, write_json  # noqa: E402
from gguf import GGUFError  # noqa: E402

BPE_VOCAB = 1280  # 256 single bytes + up to 1024 merges

SHAPES = {
    "hidden": 64, "n_layers": 4, "n_dense_layers": 1,
    "n_heads": 4, "head_dim": 16, "dense_ffn": 128,
    "n_experts": 16, "top_k": 2, "expert_ffn": 96, "shared_expert": True,
    "rope_theta": 10000.0, "norm_eps": 1e-5,
}
# The context the synthetic containers declare: Kimi K2's 128K, which K3's stand-in takes over
# (random weights attend any distance; the bound is the model's word, as a real container's is).
CONTEXT_LENGTH = 131072
VISION = {"patch_size": 8, "merge": 2, "vision_hidden": 32, "max_tokens": 256}

K3_SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
               "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
               "<|kimi_image_placeholder|>"]
KIMI_LINEAR_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                        "<|im_system|>", "<|im_middle|>"]
KIMI_LINEAR_CHAT = {
    "system": ["<|im_system|>system<|im_middle|>", "<|im_end|>"],
    "user": ["<|im_user|>user<|im_middle|>", "<|im_end|>"],
    "assistant": ["<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"],
    "open": "<|im_assistant|>assistant<|im_middle|>",
}
FLAVOURS = {
    # flavour: (specials, bos, eos, media pad or None, chat.json or None)
    "k3": (K3_SPECIALS, "[BOS]", "[EOS]", "<|media_pad|>", None),
    "kimi-linear": (KIMI_LINEAR_SPECIALS, "[BOS]", "[EOS]", None, KIMI_LINEAR_CHAT),
    "plain": (["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", None, None),
}

# Chat-markup words must stay several ordinary tokens, so that text which only
# spells them out can never look like a merged piece of the real markup.
FORBIDDEN_TOKENS = frozenset(s.encode() for s in ("message", " role", "=\"", "user", "<|open|>"))

CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. First he
wiped the salt from the glass, then he trimmed the wick and checked the oil.
Second, he wrote the weather into a leather notebook: wind from the west, a low
swell, gulls resting on the rocks. Nobody had asked him to keep the notebook, but
he liked the quiet certainty of numbers lined up in neat columns.

In the market square the baker sold bread, pastries and small honey cakes. The
children counted their coins twice before choosing, and the baker pretended not
to notice when they were one short. Second chances, she said, were the cheapest
thing she ever gave away. The clock on the town hall struck seven, then eight,
and the smell of warm bread drifted down every street.

Rivers shape the land slowly. Water finds the softest stone and patiently wears
it down, carving valleys over thousands of years. Scientists measure the flow in
cubic metres per second and draw maps that change with every flood. Second
only to the sea, rivers carried trade, stories and travellers from one city to
the next, and many towns were built where a river could be crossed.

She opened the old piano and played a few uncertain notes. The instrument was
out of tune, but the melody was still recognisable: a simple waltz her
grandmother had taught her. First the left hand, then the right, then both
together, slowly, until the rhythm settled and the room seemed to breathe.
Second attempts are always easier, she thought, because the fear is gone.

Good software is written twice. The first version teaches you what the problem
really is; the second version solves it. Keep functions small, give variables
honest names, and write tests that would fail if the code were wrong. When a
program crashes, read the error carefully before changing anything. Second
guessing a stack trace wastes more time than reading it.

The expedition reached the glacier on the third day. The guide pointed at the
blue ice, cracked and folded like paper, and explained how the weight of snow
turns into ice over centuries. They camped beside a frozen lake, cooked soup on
a tiny stove and watched the stars appear one by one. Second by second the cold
deepened, and everyone went to sleep wearing every jumper they owned.

Questions and answers: What is the capital of France? Paris. How many legs does
a spider have? Eight. Why is the sky blue? Because air scatters short blue
wavelengths of sunlight more strongly than long red ones. Which planet is the
largest? Jupiter. What is the boiling point of water at sea level? One hundred
degrees Celsius, or two hundred and twelve degrees Fahrenheit.

Travel notes: a café in Paris, a naïve question about the menu, a résumé left on
the table. In Zürich the trams were punctual; in München the beer gardens were
crowded. Straße, façade, jalapeño, déjà vu, coöperate. In Tokyo the sign said
日本語 and 東京駅, and the menu offered ラーメン and 寿司. Привет, мир! Γειά σου
κόσμε. مرحبا بالعالم. 你好，世界。 The postcard ended with 🙂 🚀 🌍 ❤️ and ✨.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for (int i = 0; i < count; i++) {
    total += values[i] * weights[i];
}

{"name": "demo", "version": 3, "tags": ["small", "fast"], "ok": true, "ratio": 0.75}
{"city": "Lisbon", "population": 545000, "coords": [38.72, -9.14], "coastal": true}

if (x > 0 && y < 10) { return x * y; } else { return -1; }
const items = list.filter(item => item.active).map(item => item.id);
SELECT id, title FROM books WHERE year >= 1990 ORDER BY title;
git commit -m "fix the parser"; make test; ./run --verbose --port 8080

Numbers appear everywhere: 1, 2, 3, 42, 100, 256, 1024, 2025, 3.14159, 2.71828,
and phone numbers like 555 0100 or dates like 2024-03-15 and 12:30:45.

Autumn came early that year. The maple trees turned red and gold, and the wind
carried their leaves across the fields in long spirals. Farmers hurried to
bring in the last of the harvest: apples, pumpkins, potatoes and corn. At night
the temperature dropped below freezing, and in the morning every window was
decorated with delicate patterns of frost. Second helpings of soup became the
rule at dinner, and nobody complained.

The museum opened a new exhibition about ancient navigation. Visitors could see
astrolabes, compasses and hand-drawn charts covered in tiny notes. One chart
showed the coast of Africa with remarkable accuracy, another imagined islands
that never existed. A guide explained how sailors used the position of the sun
and stars to estimate latitude, and how longitude remained a mystery for
centuries until reliable clocks were invented.

Learning a language takes patience. At first every sentence feels like a puzzle,
and even ordering coffee requires careful planning. Then, slowly, the words stop
being separate pieces and start flowing together. Reading helps, listening
helps more, and speaking with people helps most of all. Mistakes are part of the
process; each one is a small lesson that makes the next conversation easier.

The train left the station exactly on time. Outside the window the city gave way
to suburbs, then to farmland, then to forests and hills. A child in the next seat
pressed her face against the glass and named every animal she saw: cows, horses,
sheep, a fox, a heron standing in a pond. Her father smiled and opened a book,
and the train rolled on through the afternoon towards the mountains.
"""


# ---------------------------------------------------------------- tokenizer --

SPACE_BYTES = frozenset(b" \t\n\r\v\f")
DIGIT_BYTES = frozenset(b"0123456789")


def _is_letter(b: int) -> bool:
    return (65 <= b <= 90) or (97 <= b <= 122) or b >= 0x80


def _is_other(b: int) -> bool:
    return b not in SPACE_BYTES and b not in DIGIT_BYTES and not _is_letter(b)


def pretokenize(data: bytes) -> list[bytes]:
    """Split bytes into pre-tokens by FORMAT.md's four rules, greedily."""
    out = []
    i, n = 0, len(data)
    while i < n:
        start = i
        j = i + 1 if data[i] == 0x20 and i + 1 < n else i
        c = data[j] if j < n else -1
        if c >= 0 and _is_letter(c):
            while j < n and _is_letter(data[j]):
                j += 1
        elif c in DIGIT_BYTES:
            end = min(n, j + 3)
            while j < end and data[j] in DIGIT_BYTES:
                j += 1
        elif c >= 0 and _is_other(c):
            while j < n and _is_other(data[j]):
                j += 1
        else:  # a run of spaces
            j = start
            while j < n and data[j] in SPACE_BYTES:
                j += 1
            if j < n and j - start > 1 and data[j - 1] == 0x20:
                j -= 1  # leave the last ' ' to start the next pre-token
        out.append(data[start:j])
        i = j
    return out


def bpe_encode_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Merge the adjacent pair of lowest rank until none is in the vocabulary.

    A pre-token that is itself a token is taken whole, as tiktoken does.
    """
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


def encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """The reference encoder for ordinary text (no specials)."""
    ids: list[int] = []
    for piece in pretokenize(text.encode("utf-8")):
        ids.extend(bpe_encode_piece(piece, ranks))
    return ids


def encode_markup(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """Split at specials' exact texts (longest match wins), encode the rest."""
    ids: list[int] = []
    data = text.encode("utf-8")
    by_bytes = sorted(((s.encode(), i) for s, i in specials.items()), key=lambda p: -len(p[0]))
    plain_start = i = 0
    while i < len(data):
        match = next(((s, sid) for s, sid in by_bytes if data.startswith(s, i)), None)
        if match is None:
            i += 1
            continue
        for piece in pretokenize(data[plain_start:i]):
            ids.extend(bpe_encode_piece(piece, ranks))
        ids.append(match[1])
        i += len(match[0])
        plain_start = i
    for piece in pretokenize(data[plain_start:]):
        ids.extend(bpe_encode_piece(piece, ranks))
    return ids


def train_bpe(corpus: str, vocab_size: int) -> list[bytes]:
    """Byte-level BPE: the token bytes in rank order (ranks 0..255 = bytes).

    Pair counts are kept incrementally with a lazy max-heap, so training the
    whole vocabulary takes well under a second.  Ties go to the lexically
    smallest pair, which keeps the result independent of dict order.
    """
    word_counts: dict[bytes, int] = {}
    for piece in pretokenize(corpus.encode("utf-8")):
        word_counts[piece] = word_counts.get(piece, 0) + 1
    words = [[w[i:i + 1] for i in range(len(w))] for w in sorted(word_counts)]
    freqs = [word_counts[w] for w in sorted(word_counts)]

    pair_counts: dict[tuple[bytes, bytes], int] = {}
    pair_words: dict[tuple[bytes, bytes], set[int]] = {}

    def count_word(idx: int, sign: int) -> None:
        parts = words[idx]
        for pair in zip(parts, parts[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + sign * freqs[idx]
            if sign > 0:
                pair_words.setdefault(pair, set()).add(idx)
            heapq.heappush(heap, (-pair_counts[pair], pair))

    heap: list[tuple[int, tuple[bytes, bytes]]] = []
    for idx in range(len(words)):
        count_word(idx, +1)

    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    while len(tokens) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if -neg != pair_counts.get(pair) or -neg <= 0:
            continue  # stale heap entry
        merged = pair[0] + pair[1]
        if merged in FORBIDDEN_TOKENS:
            continue  # never merged; re-pushed only if its count changes
        for idx in sorted(pair_words.pop(pair, ())):
            count_word(idx, -1)
            words[idx] = _merge_pair(words[idx], pair, merged)
            count_word(idx, +1)
        pair_counts[pair] = 0
        if merged not in known:  # another pair may already have built these bytes
            known.add(merged)
            tokens.append(merged)
    return tokens


def _merge_pair(parts: list[bytes], pair: tuple[bytes, bytes], merged: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(parts):
        if i + 1 < len(parts) and parts[i] == pair[0] and parts[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


def tokenizer_model_text(tokens: list[bytes]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))


def load_ranks(path: Path) -> dict[bytes, int]:
    """Read a tokenizer.model back (used by tests and tools)."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            b64, rank = line.split()
            ranks[base64.b64decode(b64)] = int(rank)
    return ranks


# ------------------------------------------------------------------ weights --

def random_matrix(rng: random.Random, rows: int, cols: int) -> array:
    """Uniform with std 1/sqrt(cols): keeps activations O(1) layer to layer."""
    bound = math.sqrt(3.0 / cols)
    r = rng.random
    return array("f", [(2.0 * r() - 1.0) * bound for _ in range(rows * cols)])


def ones(n: int) -> array:
    return array("f", [1.0]) * n


def lm_head(rng: random.Random, vocab: int, hidden: int, special_ids: list[int]) -> array:
    """Random rows, but special tokens' rows are zero so their logit is 0.

    The best ordinary logit of a random head is positive, so greedy decoding
    never picks EOS (or any special) and generations run long.
    """
    head = random_matrix(rng, vocab, hidden)
    zero_row = array("f", [0.0]) * hidden
    for sid in special_ids:
        head[sid * hidden:(sid + 1) * hidden] = zero_row
    return head


def trunk_tensors(rng: random.Random, vocab: int, special_ids: list[int]):
    """Yield the trunk's tensors in FORMAT.md's order."""
    h, s = SHAPES["hidden"], SHAPES
    yield random_matrix(rng, vocab, h)  # tok_embed (std 1/8 keeps rmsnorm sane)
    for layer in range(s["n_layers"]):
        yield ones(h)  # attn_norm
        for _ in range(4):  # wq, wk, wv, wo
            yield random_matrix(rng, h, h)
        yield ones(h)  # ffn_norm
        if layer < s["n_dense_layers"]:
            yield random_matrix(rng, s["dense_ffn"], h)  # w1
            yield random_matrix(rng, s["dense_ffn"], h)  # w3
            yield random_matrix(rng, h, s["dense_ffn"])  # w2
        else:
            yield random_matrix(rng, s["n_experts"], h)  # router
            if s["shared_expert"]:
                yield random_matrix(rng, s["expert_ffn"], h)
                yield random_matrix(rng, s["expert_ffn"], h)
                yield random_matrix(rng, h, s["expert_ffn"])
    yield ones(h)  # final_norm
    yield lm_head(rng, vocab, h, special_ids)


def quantize_q8(values: array, group: int) -> bytes:
    """int8 codes then one f32 scale per group (scale = max|x| / 127)."""
    codes = bytearray(len(values))
    scales = array("f", [0.0]) * (len(values) // group)
    for g in range(len(scales)):
        chunk = values[g * group:(g + 1) * group]
        peak = max(max(chunk), -min(chunk))
        if peak == 0.0:
            continue
        scale = peak / 127.0
        scales[g] = scale
        base = g * group
        for k, v in enumerate(chunk):
            codes[base + k] = round(v / scale) & 0xFF
    return bytes(codes) + scales.tobytes()


def expert_payload(rng: random.Random, quant_group: int) -> bytes:
    h, f = SHAPES["hidden"], SHAPES["expert_ffn"]
    mats = (random_matrix(rng, f, h), random_matrix(rng, f, h), random_matrix(rng, h, f))
    if quant_group == 0:
        return b"".join(m.tobytes() for m in mats)
    return b"".join(quantize_q8(m, quant_group) for m in mats)


def vision_tensors(rng: random.Random):
    """Yield vision.bin's tensors in FORMAT.md's order."""
    v, p, m, h = VISION["vision_hidden"], VISION["patch_size"], VISION["merge"], SHAPES["hidden"]
    yield random_matrix(rng, v, 3 * p * p)  # patch_proj
    yield random_matrix(rng, 1, v)  # patch_bias (small: bound sqrt(3/v))
    yield ones(v)  # norm
    yield random_matrix(rng, h, v * m * m)  # proj
    yield random_matrix(rng, 1, h)  # proj_bias


# ---------------------------------------------------------------- container --

def quant_group_of(quant: str) -> int:
    return 0 if quant == "f32" else int(quant[len("q8g"):])


def filler_tokens(known: list[bytes], count: int) -> list[bytes]:
    """`count` word-like tokens (" abc", "abcd", ...) not already in `known`, in a fixed order:
    a production-sized vocabulary (K3 has 163,840 ids) for benchmarks over the whole vocabulary."""
    seen, out = set(known) | FORBIDDEN_TOKENS, []
    letters = [bytes([c]) for c in range(ord("a"), ord("z") + 1)]
    length = 2
    while len(out) < count:
        for prefix in (b" ", b""):
            for combo in itertools.product(letters, repeat=length):
                token = prefix + b"".join(combo)
                if token not in seen:
                    seen.add(token)
                    out.append(token)
                    if len(out) == count:
                        return out
        length += 1
    return out


def write_container(out: Path, flavour: str, vision: bool, seed: int, quant: str,
                    vocab_size: int = 0, context_length: int = CONTEXT_LENGTH) -> int:
    """Write every file of the container into directory out; returns vocab_size."""
    specials, bos, eos, media_pad, chat = FLAVOURS[flavour]
    tokens = train_bpe(CORPUS, BPE_VOCAB)
    tokens += filler_tokens(tokens, max(0, vocab_size - len(tokens) - len(specials)))
    special_ids = list(range(len(tokens), len(tokens) + len(specials)))
    vocab = len(tokens) + len(specials)
    rng = random.Random(seed)

    manifest = {"format": "waste-ref", "version": 1, "arch": "ref-moe", "flavour": flavour,
                "vocab_size": vocab, **SHAPES, "expert_quant": quant,
                "bos_token": bos, "eos_token": eos, "context_length": context_length}
    if media_pad:
        manifest["media_pad_token"] = media_pad
    write_json(out / "manifest.json", manifest)
    (out / "tokenizer.model").write_text(tokenizer_model_text(tokens), encoding="ascii")
    write_json(out / "specials.json", [{"id": i, "text": t} for i, t in zip(special_ids, specials)])
    if chat:
        write_json(out / "chat.json", chat)

    with open(out / "trunk.bin", "wb") as f:
        for tensor in trunk_tensors(rng, vocab, special_ids):
            f.write(tensor.tobytes())
    (out / "experts").mkdir()
    for layer in range(SHAPES["n_dense_layers"], SHAPES["n_layers"]):
        group = quant_group_of(quant)
        payloads = [expert_payload(rng, group) for _ in range(SHAPES["n_experts"])]
        write_bank(out / "experts" / f"layer-{layer:03d}.bank", layer, payloads, group)

    if vision:
        write_json(out / "vision.json", VISION)
        with open(out / "vision.bin", "wb") as f:
            for tensor in vision_tensors(rng):
                f.write(tensor.tobytes())
    return vocab


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Write a small random reference container.")
    ap.add_argument("out", type=Path, help="container directory to create")
    ap.add_argument("--flavour", choices=sorted(FLAVOURS), default="k3")
    ap.add_argument("--vision", action="store_true", help="add a random vision tower")
    ap.add_argument("--seed", type=int, default=0, help="PRNG seed for the weights")
    ap.add_argument("--quant", choices=["f32", "q8g32"], default="q8g32",
                    help="expert weight format")
    ap.add_argument("--vocab", type=int, default=0, metavar="N",
                    help="pad the vocabulary with word-like tokens to N ids (e.g. 163840, K3's)")
    ap.add_argument("--context-length", type=int, default=CONTEXT_LENGTH, metavar="N",
                    help=f"the longest sequence the model declares (default {CONTEXT_LENGTH})")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    ap.add_argument("--from-gguf", type=Path, metavar="FILE",
                    help="convert this llama GGUF instead of writing a random model")
    args = ap.parse_args(argv)
    out = args.out
    if out.exists() and not out.is_dir():
        ap.error(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        ap.error(f"{out} is not empty (use --force to replace it)")
    if not out.resolve().parent.is_dir():
        ap.error(f"parent directory of {out} does not exist")
    if not 1 <= args.context_length < 1 << 32:
        ap.error(f"--context-length {args.context_length} is not a length (1 to 2^32-1)")
    if args.from_gguf and not args.from_gguf.is_file():
        ap.error(f"{args.from_gguf} is not a file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out.resolve()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        if args.from_gguf:
            manifest = gguf_container.convert(args.from_gguf, tmp)
            summary = (f"{manifest['flavour']} from {args.from_gguf.name}, vocab "
                       f"{manifest['vocab_size']}, FFNs {manifest['expert_quant']}")
        else:
            vocab = write_container(tmp, args.flavour, args.vision, args.seed, args.quant, args.vocab,
                                    args.context_length)
            summary = (f"{args.flavour}, vocab {vocab}, experts {args.quant}"
                       + (", vision" if args.vision else ""))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a container is ordinary data
        publish(tmp, out)
    except (gguf_container.ConversionError, GGUFError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"make_container.py: {args.from_gguf}: {exc}", file=sys.stderr)
        return 1
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{args.out}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
