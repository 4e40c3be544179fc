#!/usr/bin/env python3
"""Decoding in serve (grammar, logprobs) against the engine's own waste_generate, per token,
on a container with K3's vocabulary size (163,840 ids).

    .venv/bin/python bench/constrained.py [CONTAINER] [--lib PATH] [--tokens N] [--runs N]

Without CONTAINER a K3-sized one is written to a temporary directory
(tools/make_container.py --vocab 163840) and removed afterwards. Every case
runs the same prompt ids (a chat with tools, thinking off) for the same
number of tokens; time per token counts from the first token to the last, so
prefill is excluded. Cases:

- plain: waste_generate, the engine sampling (what a request without structure runs).
- tools auto: serve's loop with a tools grammar whose free answer text allows the
  model's own pick: the fast path, where no mask is computed.
- logprobs: serve's loop computing logprobs (a log-softmax over the vocabulary).
- json schema: a grammar that refuses the random model's pick now and then (the mask
  is computed only then).
- json schema + logprobs: the mask at every token (logprobs need the whole masked
  distribution), which gives the mask times' p50/p99.

"serve ms/token" is the loop's own time per token: everything but waste_eval.

Needs the optional packages (requirements-optional.txt).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine  # noqa: I001 (puts the repository on sys.path)

from serve import (Decoder, Engine, EngineConfig, GenParams, Markup, Vocabulary,
                   compile_grammar, load_library, parse_chat_request,
                   resolve_chat_format, xtml_grammar)  # noqa: E402

K3_VOCAB = 163_840
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string"}}}}}]
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
ASK = [{"role": "user", "content": "Tell me a long story about the sea."}]


def per_token_ms(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[0]) * 1000.0 / (len(stamps) - 1)


class Bench:
    """One open engine, its chat format and llguidance's vocabulary (built once)."""

    def __init__(self, engine: Engine, tokens: int):
        self.engine, self.tokens = engine, tokens
        self.fmt = resolve_chat_format(engine, engine.model_path)
        self.ids = engine.tokenize_segments(self.fmt.render(ASK, tools=TOOLS, thinking=False).segments)
        n_vocab = len(engine.eval(engine.tokenize("x")))
        started = time.perf_counter()
        self.vocabulary = Vocabulary(engine, n_vocab, self.fmt.stop_tokens)
        self.vocabulary_s = time.perf_counter() - started
        self.eval_s = 0.0
        evaluate = engine.eval

        def timed_eval(ids):   # to tell serve's own time from the engine's
            started = time.perf_counter()
            try:
                return evaluate(ids)
            finally:
                self.eval_s += time.perf_counter() - started
        engine.eval = timed_eval

    def run(self, temperature: float, body: dict | None = None,
            logprobs: bool = False) -> tuple[float, float, list[float]]:
        """(ms per token, serve's ms per token, mask times in ms) of one generation;
        no body and no logprobs: waste_generate."""
        stamps: list[float] = []
        self.engine.reset()
        params = GenParams(temperature=temperature, seed=1, max_tokens=self.tokens)

        def record(info, piece) -> None:
            stamps.append(time.perf_counter())
        if body is None and not logprobs:
            self.engine.generate(self.ids, params, record)
            return per_token_ms(stamps), 0.0, []
        matcher = None
        if body is not None:
            req = parse_chat_request({"messages": ASK, **body})
            m = self.fmt.markers
            lark = xtml_grammar(req, Markup(m.open, m.sep, m.close), False)
            compiled = compile_grammar(lark)
            matcher = lambda n_vocab: self.vocabulary.matcher(compiled)  # noqa: E731
        decoder = Decoder(self.engine, temperature=temperature, top_k=0, top_p=1.0, grammar=matcher,
                          top_logprobs=5 if logprobs else None)
        self.eval_s = 0.0
        started = time.perf_counter()
        decoder.generate(self.ids, params, record)
        own_ms = (time.perf_counter() - started - self.eval_s) * 1000.0 / len(stamps)
        assert len(stamps) == self.tokens, "the reply ended early; use fewer --tokens"
        return per_token_ms(stamps), own_ms, decoder.report.mask_times


JSON = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
CASES = [("plain (waste_generate)", None, False),
         ("tools auto (fast path)", {"tools": TOOLS}, False),
         ("logprobs (top 5)", None, True),
         ("json schema", JSON, False),
         ("json schema + logprobs", JSON, True)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(container: str, lib: str | None, tokens: int, runs: int) -> None:
    with Engine(load_library(lib), container, EngineConfig(threads=1, ctx=4096)) as engine:
        bench = Bench(engine, tokens)
        print(f"# {machine()}; vocabulary {len(bench.vocabulary.pieces)} ids "
              f"(llguidance tokenizer built in {bench.vocabulary_s:.1f} s); {tokens} tokens, "
              f"median of {runs} runs")
        for temperature in (0.0, 0.7):
            print(f"\ntemperature {temperature}\n")
            print("| case | ms/token | vs plain | serve ms/token | masks/reply | mask p50 ms | mask p99 ms |")
            print("|---|---|---|---|---|---|---|")
            base = None
            for name, body, logprobs in CASES:
                times, own, masks = [], [], []
                for _ in range(runs):
                    ms, own_ms, mask_times = bench.run(temperature, body, logprobs)
                    times.append(ms)
                    own.append(own_ms)
                    masks += mask_times
                ms = statistics.median(times)
                base = ms if base is None else base
                p50, p99 = (f"{percentile(masks, 0.5):.3f}", f"{percentile(masks, 0.99):.3f}") if masks \
                    else ("-", "-")
                serve_ms = f"{statistics.median(own):.3f}" if body is not None or logprobs else "-"
                print(f"| {name} | {ms:.2f} | {ms - base:+.2f} | {serve_ms} | {len(masks) // runs} "
                      f"| {p50} | {p99} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=None)
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.container:
        measure(args.container, args.lib, args.tokens, args.runs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        container = str(Path(tmp) / "k3-vocab.waste")
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"), container,
                        "--vocab", str(K3_VOCAB)], check=True, stdout=subprocess.DEVNULL)
        measure(container, args.lib, args.tokens, args.runs)


if __name__ == "__main__":
    main()
