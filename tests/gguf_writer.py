"""Write small llama GGUF files for the conversion tests: random weights,
ggml's Q4_1 / Q8_0 / F16 / F32 encodings, and a byte-level BPE vocabulary
whose merge order differs from its id order."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISSING_BYTES = (0x04, 0xF1)  # bytes the vocabulary leaves out, as SmolLM2's does
CORPUS = ("the quick brown fox jumps over the lazy dog; the dog sleeps. "
          "numbers 12 and 345, café naïve, Привет мир, 日本語 ").encode() * 3


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def train_merges(n: int) -> list[tuple[bytes, bytes]]:
    """n greedy BPE merges over CORPUS split at spaces (spaces start words)."""
    words = [w if i == 0 else b" " + w for i, w in enumerate(CORPUS.split(b" ")) if w]
    seqs = [[bytes([c]) for c in w] for w in words]
    merges = []
    for _ in range(n):
        counts: dict[tuple[bytes, bytes], int] = {}
        for s in seqs:
            for a, b in zip(s, s[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        merges.append(best)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i:i + 2] = [s[i] + s[i + 1]]
                i += 1
    return merges


def vocabulary(n_merges: int = 60) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) in GGUF form; merged tokens get ids in
    reverse merge order, so a rank-by-id BPE would merge wrongly."""
    chars = byte_chars()
    text = lambda raw: "".join(chars[b] for b in raw)  # noqa: E731
    merges = train_merges(n_merges)
    merged = list(dict.fromkeys(a + b for a, b in merges))
    tokens = SPECIALS + [chars[b] for b in range(256) if b not in MISSING_BYTES]
    tokens += [text(m) for m in reversed(merged)]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{text(a)} {text(b)}" for a, b in merges]


# ------------------------------------------------------------------ encodings

def q4_1(w: np.ndarray) -> bytes:
    blocks = w.astype(np.float32).reshape(-1, 32)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], m.astype(np.float32)[:, None]
    q = np.clip(np.round((blocks - mf) / np.where(df == 0, 1, df)), 0, 15).astype(np.uint8)
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2),
                           nibbles], axis=1).tobytes()


def q8_0(w: np.ndarray) -> bytes:
    blocks = w.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    q = np.round(blocks / np.where(df == 0, 1, df)).astype(np.int8)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1).tobytes()


ENCODE = {"Q4_1": q4_1, "Q8_0": q8_0, "F16": lambda w: w.astype(np.float16).tobytes(),
          "F32": lambda w: w.astype(np.float32).tobytes(),
          "Q4_0": lambda w: bytes(w.size // 32 * 18)}


# ---------------------------------------------------------------- the file

def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(v) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if all(isinstance(x, str) for x in v):
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(x) for x in v)
    return struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)


def write_gguf(path: Path, meta: dict, tensors: list[tuple[str, np.ndarray, str]]) -> Path:
    """tensors: (name, float array [rows][cols] or [n], ggml type name)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    head += b"".join(_string(k) + _value(v) for k, v in meta.items())
    blobs, offset = [], 0
    for name, w, kind in tensors:
        data = ENCODE[kind](w)
        shape = w.shape[::-1]  # ggml order: columns first
        head += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        head += struct.pack("<IQ", TYPE_IDS[kind], offset)
        pad = -len(data) % 32
        blobs.append(data + bytes(pad))
        offset += len(data) + pad
    head += bytes(-len(head) % 32)
    path.write_bytes(head + b"".join(blobs))
    return path


def tiny_llama(path: Path, *, block_type: str = "Q4_1", embed_type: str = "Q8_0",
               arch: str = "llama", tied: bool = True, seed: int = 0,
               overrides: dict | None = None) -> Path:
    """A 2-layer llama (hidden 64, 4 heads over 2 KV heads, FFN 96)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary()
    hidden, ffn, heads, kv_heads, layers = 64, 96, 4, 2, 2
    kv = hidden // heads * kv_heads
    meta = {
        "general.architecture": arch, "general.name": "tiny", "general.alignment": 32,
        f"{arch}.block_count": layers, f"{arch}.context_length": 2048,
        f"{arch}.embedding_length": hidden, f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML,
        **(overrides or {}),
    }
    mat = lambda rows, cols: rng.normal(0, 0.5 / np.sqrt(cols), (rows, cols))  # noqa: E731
    norm = lambda: 1 + rng.normal(0, 0.1, hidden)  # noqa: E731
    tensors = [("token_embd.weight", rng.normal(0, 1, (len(tokens), hidden)), embed_type)]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", norm(), "F32"),
                    (p + "attn_q.weight", mat(hidden, hidden), block_type),
                    (p + "attn_k.weight", mat(kv, hidden), block_type),
                    (p + "attn_v.weight", mat(kv, hidden), block_type),
                    (p + "attn_output.weight", mat(hidden, hidden), block_type),
                    (p + "ffn_norm.weight", norm(), "F32"),
                    (p + "ffn_gate.weight", mat(ffn, hidden), block_type),
                    (p + "ffn_up.weight", mat(ffn, hidden), block_type),
                    (p + "ffn_down.weight", mat(hidden, ffn), block_type)]
    tensors.append(("output_norm.weight", norm(), "F32"))
    if not tied:
        tensors.append(("output.weight", mat(len(tokens), hidden), embed_type))
    return write_gguf(path, meta, tensors)
