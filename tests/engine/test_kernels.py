"""The engine's three kernel paths (engine/simd.h): plain C, AVX2 and AVX-512, each chosen
in a process of its own by WASTE_NO_AVX2 / WASTE_NO_AVX512, give the same greedy answers and
logits within rounding of each other, and each gives the same bits however a prompt is split,
one position at a time (the decode kernels) included."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_abi import ROOT, gguf_container, manifest  # noqa: F401 (a fixture)

PATHS = {"plain": {"WASTE_NO_AVX2": "1"}, "avx2": {"WASTE_NO_AVX2": "0", "WASTE_NO_AVX512": "1"},
         "avx512": {"WASTE_NO_AVX2": "0", "WASTE_NO_AVX512": "0"}}
KERNELS = {"plain": "plain C kernels", "avx2": "AVX2 kernels", "avx512": "AVX-512 kernels"}

CHILD = """
import ctypes as C, json, os, sys
sys.path[0:0] = sys.argv[1].split(os.pathsep)
from test_abi import evaluate, generate, load_library, opened
lib, job = load_library(sys.argv[2]), json.loads(sys.argv[4])
tokens, threads = job["tokens"], job["threads"]
out = {"build": lib.waste_build_info().decode()}
with opened(lib, sys.argv[3], ctx_tokens=1024, n_threads=threads) as ctx:
    out["whole"] = evaluate(lib, ctx, tokens)
    lib.waste_state_reset(ctx)
    for at in range(0, len(tokens), 97):
        out["split"] = evaluate(lib, ctx, tokens[at:at + 97])
    lib.waste_state_reset(ctx)
    head = tokens[:40]
    out["head_whole"] = evaluate(lib, ctx, head)
    lib.waste_state_reset(ctx)
    for token in head:
        out["head_single"] = evaluate(lib, ctx, [token])
    lib.waste_state_reset(ctx)
    status, seen = generate(lib, ctx, job["prompt"], max_tokens=24, temperature=0.0)
    out["greedy"] = [s["token"] for s in seen]
print(json.dumps(out))
"""


def cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    match = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(match.group(1).split()) if match else set()


def available(path: str) -> bool:
    """Whether this CPU runs the path (otherwise the engine falls back to the next one down)."""
    flags = cpu_flags()
    avx2 = {"avx2", "fma"} <= flags
    if path == "avx2":
        return avx2
    if path == "avx512":
        return avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    return True


def run_path(lib_path: Path, container: Path, path: str, tokens: list[int], prompt: list[int],
             threads: int) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in ("WASTE_NO_AVX2", "WASTE_NO_AVX512")}
    env.update(PATHS[path])
    proc = subprocess.run([sys.executable, "-c", CHILD,
                           os.pathsep.join([str(Path(__file__).parent), str(ROOT / "tests")]),
                           str(lib_path), str(container),
                           json.dumps({"tokens": tokens, "prompt": prompt, "threads": threads})],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", ["k3", "kimi-linear", "plain", "gguf", "smollm2"])
def test_every_kernel_path_gives_the_same_greedy_answer(lib_path, name, request):
    """On every test container (and SmolLM2, a real model, whose q4_1 and q8 products are
    where the kernels differ): each path gives the same bits whole, in chunks of 97 and one
    position at a time; AVX2 and AVX-512 give the same bits as each other (the same exact
    integer sums, the same float steps); plain C is within 1e-4 of the logits' spread (5e-4 on
    SmolLM2's 30 layers, where the engine before these kernels differed by 1.4e-4); and all
    three give the same 24 greedy tokens, at 1 and 2 threads."""
    container = request.getfixturevalue({"k3": "k3_container", "kimi-linear": "kimi_linear_container",
                                         "plain": "plain_container", "gguf": "gguf_container",
                                         "smollm2": "smollm2"}[name])
    vocab = manifest(container)["vocab_size"]
    rng = random.Random(name)
    tokens = [rng.randrange(vocab) for _ in range(300)]
    prompt = [rng.randrange(vocab) for _ in range(20)]
    for threads in (1, 2):
        runs = {path: run_path(lib_path, container, path, tokens, prompt, threads) for path in PATHS}
        for path, run in runs.items():
            assert run["whole"] == run["split"], path
            assert run["head_whole"] == run["head_single"], path
            if available(path):
                assert KERNELS[path] in run["build"], (path, run["build"])
        assert runs["avx2"]["whole"] == runs["avx512"]["whole"]
        assert runs["avx2"]["greedy"] == runs["avx512"]["greedy"] == runs["plain"]["greedy"]
        spread = max(runs["avx2"]["whole"]) - min(runs["avx2"]["whole"])
        gap = max(abs(a - b) for a, b in zip(runs["plain"]["whole"], runs["avx2"]["whole"]))
        assert gap < (5e-4 if name == "smollm2" else 1e-4) * spread
        if available("avx2"):
            assert runs["plain"]["whole"] != runs["avx2"]["whole"]   # two paths were taken
