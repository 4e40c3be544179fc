#!/usr/bin/env python3
"""How far batched prefill moved the logits: the old engine and the new, on every test container.

    .venv/bin/python bench/engine_agreement.py [--positions 1,512,4096,16384] [--smollm2-positions 1,512]

The engine "before" is built from the last commit before batched prefill in a
temporary directory.  Containers: the k3, k3 with vision, kimi-linear and plain
flavours of tools/make_container.py, a llama converted from a tiny generated
GGUF (tests/gguf_writer.py), and SmolLM2 (build/smollm2.waste, when present;
fewer positions by default, as the old engine takes minutes per thousand there).
Both engines evaluate the same random tokens, the new one in chunks of 512 that
end at each position; printed is the largest logit difference at each position
as a fraction of the old logits' spread (max - min), and whether 24 greedy
tokens after each container's prompt are the same.  Slow (minutes): not part
of `make check`.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PREVIOUS_ENGINE, ROOT, build_engine_at, machine

from serve import Engine, EngineConfig, GenParams, load_library  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from gguf_writer import tiny_llama  # noqa: E402

CHUNK = 512


def make(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"), str(out), *args],
                   check=True, capture_output=True)
    return out


def containers(tmp: Path) -> dict[str, Path]:
    found = {"k3": make(tmp / "k3.waste"), "k3 vision": make(tmp / "k3v.waste", "--vision"),
             "kimi-linear": make(tmp / "kl.waste", "--flavour", "kimi-linear"),
             "plain": make(tmp / "plain.waste", "--flavour", "plain"),
             "gguf (tiny)": make(tmp / "tiny.waste", "--from-gguf", str(tiny_llama(tmp / "tiny.gguf")))}
    smollm2 = ROOT / "build" / "smollm2.waste"
    if smollm2.exists():
        found["smollm2"] = smollm2
    return found


def logits_at(lib, container: Path, tokens: list[int], positions: list[int]) -> dict[int, list[float]]:
    """The logits after the first p tokens, for each p, in chunks of CHUNK that end at each p."""
    out: dict[int, list[float]] = {}
    with Engine(lib, container, EngineConfig(ctx=max(positions) + 8)) as engine:
        done = 0
        for p in positions:
            while done < p:
                step = min(CHUNK, p - done)
                logits = engine.eval(tokens[done:done + step])
                done += step
            out[p] = list(logits)
    return out


def greedy(lib, container: Path, prompt: list[int]) -> list[int]:
    seen: list[int] = []
    with Engine(lib, container, EngineConfig(ctx=256)) as engine:
        engine.generate(prompt, GenParams(max_tokens=24), lambda info, piece: seen.append(info.token))
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", default="1,512,4096,16384")
    ap.add_argument("--smollm2-positions", default="1,512")
    ap.add_argument("--before", default=PREVIOUS_ENGINE)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as name:
        tmp = Path(name)
        (tmp / "old").mkdir()
        old = load_library(str(build_engine_at(args.before, tmp / "old")))
        new = load_library(None)
        print(f"logits of {old.version()} ({args.before}) and {new.version()}: max |new - old| / "
              f"spread of old, at each position — {machine()}")
        for label, container in containers(tmp).items():
            positions = [int(p) for p in (args.smollm2_positions if label == "smollm2"
                                          else args.positions).split(",")]
            with Engine(new, container, EngineConfig(ctx=64)) as engine:
                prompt = engine.tokenize("The lighthouse keeper climbed the stairs", add_bos=True)
            vocab = json.loads((container / "manifest.json").read_text())["vocab_size"]
            tokens = [random.Random(label).randrange(vocab) for _ in range(max(positions))]
            before, after = logits_at(old, container, tokens, positions), logits_at(new, container, tokens,
                                                                                   positions)
            cells = []
            for p in positions:
                spread = max(before[p]) - min(before[p])
                cells.append(f"{p}: {max(abs(a - b) for a, b in zip(after[p], before[p])) / spread:.1e}")
            same = greedy(old, container, prompt) == greedy(new, container, prompt)
            print(f"{label:<12} {'  '.join(cells)}  greedy {'same' if same else 'DIFFERENT'}",
                  flush=True)


if __name__ == "__main__":
    main()
