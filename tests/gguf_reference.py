"""A plain numpy forward pass of a llama GGUF, straight from the file: the
reference the engine's logits are compared against.

Nothing here shares code with the engine or the converter's weight layout:
blocks are dequantised as ggml defines them, all arithmetic is float32 and
activations are never quantised.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from gguf import GGUF, Tensor  # noqa: E402


def dequantize(t: Tensor) -> np.ndarray:
    """A tensor as float32 [rows][cols]."""
    raw = np.frombuffer(t.data, dtype=np.uint8)
    if t.type_name == "F32":
        flat = raw.view(np.float32)
    elif t.type_name == "F16":
        flat = raw.view(np.float16).astype(np.float32)
    elif t.type_name == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        flat = (d * q).reshape(-1)
    elif t.type_name == "Q4_1":
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
        flat = (d * q + m).reshape(-1)
    else:
        raise ValueError(f"{t.name}: {t.type_name}")
    return flat.reshape(t.rows, t.cols)


class Reference:
    def __init__(self, path: Path) -> None:
        g = GGUF(path)
        meta = g.meta
        self.n_layers = meta["llama.block_count"]
        self.n_heads = meta["llama.attention.head_count"]
        self.n_kv = meta["llama.attention.head_count_kv"]
        self.eps = meta["llama.attention.layer_norm_rms_epsilon"]
        self.theta = meta["llama.rope.freq_base"]
        self.w = {name: dequantize(t) for name, t in g.tensors.items()}
        self.hidden = self.w["token_embd.weight"].shape[1]
        self.head_dim = self.hidden // self.n_heads

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight.reshape(-1)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate adjacent pairs (2i, 2i+1) of each head; x is [T][heads][head_dim]."""
        i = np.arange(self.head_dim // 2, dtype=np.float64)
        angle = positions[:, None].astype(np.float64) * self.theta ** (-2 * i / self.head_dim)
        c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out.astype(np.float32)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits [T][vocab] for every position of ids (causal)."""
        w, hd, T = self.w, self.head_dim, len(ids)
        x = w["token_embd.weight"][ids]
        pos = np.arange(T)
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        for layer in range(self.n_layers):
            p = f"blk.{layer}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = self._rope((h @ w[p + "attn_q.weight"].T).reshape(T, self.n_heads, hd), pos)
            k = self._rope((h @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, hd), pos)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, hd)
            group = self.n_heads // self.n_kv
            out = np.empty((T, self.n_heads, hd), dtype=np.float32)
            for head in range(self.n_heads):
                scores = q[:, head] @ k[:, head // group].T / np.sqrt(hd) + mask
                scores = np.exp(scores - scores.max(axis=1, keepdims=True))
                out[:, head] = (scores / scores.sum(axis=1, keepdims=True)) @ v[:, head // group]
            x = x + out.reshape(T, -1) @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            gate = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        head = w.get("output.weight", w["token_embd.weight"])
        return self._norm(x, w["output_norm.weight"]) @ head.T
