"""Shared pieces of the benchmarks: the engine through the binding, a server subprocess, SSE."""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve import (Engine, EngineConfig, Event, GenParams, build_chat_segments,  # noqa: E402
                   load_library)

DEMO = ROOT / "build" / "demo.waste"


class Quiet:
    """A Listener that reads nothing until the end, as a blocking request does: the reply is
    what the service returns."""

    def take(self, event: Event) -> None: ...

    def client_left(self) -> bool:
        return False


def container_args(doc: str) -> argparse.Namespace:
    """`[CONTAINER] [--repeat N] [--lib PATH]`, the arguments of a benchmark on one container."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--lib", default=None)
    return ap.parse_args()


def machine() -> str:
    """One line saying what the figures were measured on."""
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores, Python {sys.version.split()[0]}"


def decode_rate(lib_path: Optional[str], container: Path, prompt: str | list[dict], *,
                threads: int = 0, max_tokens: int = 256, ctx: int = 2048) -> tuple[float, int]:
    """(tokens/s between the first and last token, tokens) of a bare waste_generate loop.

    `prompt` is raw text, or chat messages rendered exactly as the server
    renders them with thinking off (same positions, so the same attention cost).
    """
    stamps: list[float] = []
    with Engine(load_library(lib_path), container, EngineConfig(threads=threads, ctx=ctx)) as engine:
        if isinstance(prompt, str):
            ids = engine.tokenize(prompt, add_bos=True)
        else:
            ids = engine.tokenize_segments(build_chat_segments(prompt, thinking=False))
        engine.generate(ids, GenParams(max_tokens=max_tokens),
                        lambda info, piece: stamps.append(time.perf_counter()))
    return rate(stamps), len(stamps)


# The engine before batched prefill (issue 19): the "before" of bench/engine_prefill.py.
PREVIOUS_ENGINE = "8196aea"


def build_engine_at(commit: str, directory: str | Path) -> Path:
    """libwaste built from `commit`'s engine/ and Makefile in `directory` (the work tree is untouched)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "Makefile", "engine"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    name = "libwaste.dylib" if sys.platform == "darwin" else "libwaste.so"
    subprocess.run(["make", "-s", "-C", str(directory), name], check=True, stdout=subprocess.DEVNULL)
    return Path(directory) / name


def rate(stamps: list[float]) -> float:
    if len(stamps) < 2 or stamps[-1] == stamps[0]:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def split_cpus() -> tuple[Optional[set[int]], Optional[set[int]]]:
    """(server cpus, client cpus): on a machine with few cores the client would
    otherwise compete with the server for its core, which no real deployment
    does (the client is on another machine, or at least another core)."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


@contextmanager
def server(container: Path, *flags: str, lib: Optional[str] = None,
           cpus: Optional[set[int]] = None, env: Optional[dict] = None,
           root: Path = ROOT) -> Iterator[int]:
    """`python3 -m serve` in its own process on an ephemeral port; yields the port.

    Each server learns its own expert hotlist, and keeps its prefix snapshots
    apart unless --prefix-cache-dir says otherwise, so one run never warms the next.
    `env` adds to the environment (WASTE_DELAY_MS, say); `root` is the checkout whose
    serve runs (another revision, for a before-and-after)."""
    hotlist = tempfile.TemporaryDirectory(prefix="bench-usage-")
    args = [sys.executable, "-m", "serve", str(container), "--port", "0", "--quiet",
            "--usage", os.path.join(hotlist.name, "usage.waste"), *flags]
    if "--prefix-cache-dir" not in flags:
        args += ["--prefix-cache-dir", os.path.join(hotlist.name, "prefix")]
    if lib:
        args += ["--lib", lib]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(args, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=pin, env={**os.environ, **(env or {})})
    try:
        port = None
        for line in proc.stdout:
            if line.startswith("listen"):
                port = int(line.rsplit(":", 1)[1].split("/")[0])
                break
        if port is None:
            raise SystemExit("the server did not start")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
        hotlist.cleanup()


@dataclass
class Streamed:
    first_token_s: float          # request sent -> first reasoning/content delta
    token_stamps: list[float]     # arrival time of each delta
    usage: dict
    text: str                     # the answer (content), for the next turn's history
    reasoning: str = ""           # the think channel (reasoning_content), likewise


def stream_chat(port: int, body: dict, keep_text: bool = True) -> Streamed:
    """POST a streaming chat and read it as a client would, timing each delta.

    keep_text=False skips decoding the deltas, to keep the client's cost off the
    measurement when only timing matters."""
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=payload,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps: list[float] = []
    text: list[str] = []
    reasoning: list[str] = []
    usage: dict = {}
    pending = b""
    # Read as it arrives and keep the client light (it shares the machine with
    # the server): only the last events, which carry usage, are parsed whole.
    while chunk := resp.read1(1 << 16):
        now = time.perf_counter()
        events = (pending + chunk).split(b"\n\n")
        pending = events.pop()
        for event in events:
            if b'"content": "' in event or b'"reasoning_content": "' in event:
                if b'"content": ""' not in event:   # the role chunk carries no token
                    stamps.append(now)
                    if keep_text:
                        delta = json.loads(event[6:])["choices"][0]["delta"]
                        text.append(delta.get("content") or "")
                        reasoning.append(delta.get("reasoning_content") or "")
            elif event.startswith(b"data: {") and b'"usage": {' in event:
                usage = json.loads(event[6:])["usage"]
    conn.close()
    if not stamps:
        raise SystemExit("no tokens streamed")
    return Streamed(stamps[0] - started, stamps, usage, "".join(text), "".join(reasoning))
