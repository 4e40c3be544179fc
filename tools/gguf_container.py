"""Convert a llama-architecture GGUF into a reference container (engine/FORMAT.md).

Every dense FFN becomes a MoE layer with one always-selected expert, stored in
that layer's bank, so the engine streams FFNs through its expert cache exactly
as it streams K3's experts.  Weights are never rounded: Q4_1 stays Q4_1, Q8_0
becomes q8g32 (the same int8 codes and scales), F16 and F32 become f32.
The tokenizer (GPT-2 byte-level BPE) becomes tokenizer.model with the GGUF's
ids, tokenizer.merges with its merge priorities, and specials.json; a ChatML
chat template becomes chat.json.
"""
from __future__ import annotations

import base64
import re
import struct
from array import array
from pathlib import Path

from container_io import QUANT_KIND, write_bank, write_json
from gguf import GGUF, Tensor

# ggml type -> the container's weight format for a matrix of that type
MATRIX_FORMAT = {"Q4_1": "q4_1", "Q8_0": "q8g32", "F16": "f32", "F32": "f32"}
CONTROL, USER_DEFINED = 3, 4   # GGUF token types that are specials, not BPE tokens
CHATML_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL)


class ConversionError(ValueError):
    """The GGUF is not something this converter can turn into a container."""


# ------------------------------------------------------------------ weights --

def _halves_to_f32(raw: bytes) -> bytes:
    return array("f", struct.unpack("<%de" % (len(raw) // 2), raw)).tobytes()


def _strided(data: bytes, block: int, start: int, size: int) -> bytes:
    """Bytes start..start+size of every block-sized block, concatenated."""
    n = len(data) // block
    out = bytearray(n * size)
    for k in range(size):
        out[k::size] = data[start + k::block]
    return bytes(out)


def matrix_bytes(t: Tensor) -> bytes:
    """A matrix in its container format (FORMAT.md, "Weight formats"); exact."""
    raw = bytes(t.data)
    if t.type_name == "Q4_1":   # block: f16 d, f16 m, 16 bytes of nibbles
        return (_strided(raw, 20, 4, 16) + _halves_to_f32(_strided(raw, 20, 0, 2))
                + _halves_to_f32(_strided(raw, 20, 2, 2)))
    if t.type_name == "Q8_0":   # block: f16 d, 32 int8 codes
        return _strided(raw, 34, 2, 32) + _halves_to_f32(_strided(raw, 34, 0, 2))
    return vector_bytes(t)


def vector_bytes(t: Tensor) -> bytes:
    if t.type_name == "F32":
        return bytes(t.data)
    if t.type_name == "F16":
        return _halves_to_f32(bytes(t.data))
    raise ConversionError(f"{t.name}: a {t.type_name} vector is not supported (want F32 or F16)")


def _format_of(tensors: list[Tensor], what: str) -> str:
    formats = {MATRIX_FORMAT.get(t.type_name) for t in tensors}
    if None in formats:
        bad = next(t for t in tensors if t.type_name not in MATRIX_FORMAT)
        raise ConversionError(f"{bad.name}: {bad.type_name} is not supported "
                              f"(want one of {', '.join(MATRIX_FORMAT)})")
    if len(formats) != 1:
        raise ConversionError(f"the {what} matrices mix {sorted(formats)}; "
                              "the container wants one format for them")
    return formats.pop()


# ---------------------------------------------------------------- tokenizer --

def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def tokenizer_files(meta: dict) -> tuple[str, str, list[dict]]:
    """(tokenizer.model, tokenizer.merges, specials.json) from the GGUF's vocabulary."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ConversionError(f"tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
                              "(want gpt2 byte-level BPE)")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    decode = byte_decoder()
    lines, specials, ids = [], [], {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            specials.append({"id": i, "text": text})
            continue
        try:
            raw = bytes(decode[c] for c in text)
        except KeyError:
            raise ConversionError(f"token {i} ({text!r}) is not byte-level text") from None
        ids[text] = i
        lines.append(f"{base64.b64encode(raw).decode()} {i}\n")
    merges = []
    for n, merge in enumerate(meta.get("tokenizer.ggml.merges", [])):
        left, _, right = merge.partition(" ")
        if left not in ids or right not in ids or left + right not in ids:
            raise ConversionError(f"merge {n} ({merge!r}) names a token the vocabulary lacks")
        merges.append(f"{ids[left]} {ids[right]}\n")
    return "".join(lines), "".join(merges), specials


def chat_json(meta: dict) -> dict | None:
    """A ChatML chat.json when the GGUF's template is ChatML, else None.

    The default system line is what the template inserts when a conversation
    does not start with a system message."""
    template = meta.get("tokenizer.chat_template")
    if not isinstance(template, str) or "<|im_start|>" not in template:
        return None
    chat = {role: [f"<|im_start|>{role}\n", "<|im_end|>\n"]
            for role in ("system", "user", "assistant")}
    chat["open"] = "<|im_start|>assistant\n"
    default = CHATML_SYSTEM.search(template)
    if default:
        chat["default_system"] = default.group(1)
    return chat


# ---------------------------------------------------------------- container --

def _meta(meta: dict, key: str):
    if key not in meta:
        raise ConversionError(f"metadata {key} is missing")
    return meta[key]


def _special_text(specials: list[dict], token_id) -> str:
    for s in specials:
        if s["id"] == token_id:
            return s["text"]
    raise ConversionError(f"token id {token_id} is not a control token")


def _bos_text(meta: dict, specials: list[dict]) -> str:
    """What the engine prepends to a raw completion: the GGUF's bos when it asks
    for one, else <|endoftext|> (the document separator of GPT-2-style BPEs)."""
    if meta.get("tokenizer.ggml.add_bos_token") or not any(
            s["text"] == "<|endoftext|>" for s in specials):
        return _special_text(specials, _meta(meta, "tokenizer.ggml.bos_token_id"))
    return "<|endoftext|>"


def convert(path: Path, out: Path) -> dict:
    """Write the container for GGUF `path` into the empty directory out; returns the manifest."""
    g = GGUF(path)
    meta, t = g.meta, g.tensors
    if meta.get("general.architecture") != "llama":
        raise ConversionError(f"architecture {meta.get('general.architecture')!r} "
                              "is not supported (want llama)")
    n_layers = int(_meta(meta, "llama.block_count"))
    hidden = int(_meta(meta, "llama.embedding_length"))
    n_heads = int(_meta(meta, "llama.attention.head_count"))
    vocab = len(_meta(meta, "tokenizer.ggml.tokens"))
    layers = [{k: t.get(f"blk.{i}.{k}.weight") for k in
               ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down")} for i in range(n_layers)]
    for i, layer in enumerate(layers):
        missing = [k for k, v in layer.items() if v is None]
        if missing:
            raise ConversionError(f"block {i} lacks {', '.join(missing)}")
    embed, head = t.get("token_embd.weight"), t.get("output.weight")
    if embed is None or "output_norm.weight" not in t:
        raise ConversionError("token_embd.weight or output_norm.weight is missing")
    attn_format = _format_of([layer[k] for layer in layers
                              for k in ("attn_q", "attn_k", "attn_v", "attn_output")],
                             "attention")
    ffn_format = _format_of([layer[k] for layer in layers
                             for k in ("ffn_gate", "ffn_up", "ffn_down")], "FFN")
    embed_format = _format_of([embed] + ([head] if head else []), "embedding")
    model, merges, specials = tokenizer_files(meta)
    manifest = {
        "format": "waste-ref", "version": 1, "arch": "llama",
        "flavour": str(meta.get("general.name", path.stem)),
        "vocab_size": vocab, "hidden": hidden, "n_layers": n_layers, "n_dense_layers": 0,
        "n_heads": n_heads,
        "n_kv_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": hidden // n_heads,
        "dense_ffn": int(_meta(meta, "llama.feed_forward_length")),
        "n_experts": 1, "top_k": 1,
        "expert_ffn": int(_meta(meta, "llama.feed_forward_length")),
        "shared_expert": False,
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_style": "adjacent",
        "norm_eps": float(_meta(meta, "llama.attention.layer_norm_rms_epsilon")),
        "expert_quant": ffn_format, "weight_quant": attn_format, "embed_quant": embed_format,
        "tied_embeddings": head is None,
        "pretokenizer": str(meta.get("tokenizer.ggml.pre", "default")),
        "bos_token": _bos_text(meta, specials),
        # Byte-level vocabularies may lack a few bytes (SmolLM2 lacks 21):
        # those encode as the unknown token.
        "unk_token": _special_text(specials, meta.get("tokenizer.ggml.unknown_token_id", 0)),
        "eos_token": _special_text(specials, _meta(meta, "tokenizer.ggml.eos_token_id")),
    }
    if "llama.context_length" in meta:   # the longest sequence the model was trained for
        manifest["context_length"] = int(meta["llama.context_length"])
    if manifest["pretokenizer"] != "smollm":
        raise ConversionError(f"pre-tokenizer {manifest['pretokenizer']!r} is not supported "
                              "(want smollm)")
    write_json(out / "manifest.json", manifest)
    (out / "tokenizer.model").write_text(model, encoding="ascii")
    (out / "tokenizer.merges").write_text(merges, encoding="ascii")
    write_json(out / "specials.json", specials)
    chat = chat_json(meta)
    if chat:
        write_json(out / "chat.json", chat)
    with open(out / "trunk.bin", "wb") as f:
        f.write(matrix_bytes(embed))
        for layer in layers:
            f.write(vector_bytes(layer["attn_norm"]))
            for k in ("attn_q", "attn_k", "attn_v", "attn_output"):
                f.write(matrix_bytes(layer[k]))
            f.write(vector_bytes(layer["ffn_norm"]))
        f.write(vector_bytes(t["output_norm.weight"]))
        if head is not None:
            f.write(matrix_bytes(head))
    (out / "experts").mkdir()
    group = 0 if ffn_format == "f32" else 32
    for i, layer in enumerate(layers):
        payload = b"".join(matrix_bytes(layer[k]) for k in ("ffn_gate", "ffn_up", "ffn_down"))
        write_bank(out / "experts" / f"layer-{i:03d}.bank", i, [payload], group,
                   QUANT_KIND[ffn_format])
    return manifest
