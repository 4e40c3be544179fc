#!/usr/bin/env python3
"""One person's three parallel requests and a colleague's one: the colleague's wait, before and after people took turns.

    .venv/bin/python bench/fair_turns.py [CONTAINER] [--delay-ms MS] [--lib PATH]

Issue 38's measurement, at a scaled clock (the reference engine sleeps --delay-ms
per evaluated position; default 10): person A sends three requests at once, as
an agent running three subagents does, and person B sends one 0.3 s later, each
streamed, the same prompt size. Two runs on the same engine and container:
- one key: everyone holds the same --api-key, as a team does today: one person
  to the server, so its line is arrival order (today's main);
- a key each: --api-keys, A and B named: within the class the engine goes to the
  person served least recently (serve/engine/queue.py).
For each request: when its first token came and when it was done, in seconds
from A's first request. Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import DEMO, ROOT, machine, server

sys.path.insert(0, str(ROOT))
from serve.app.keygen import new_key  # noqa: E402
from serve.http.keyring import line_for  # noqa: E402


def body(label: str) -> dict:
    words = " ".join(f"{label}{i}" for i in range(300))
    return {"messages": [{"role": "user", "content": f"Summarize: {words}"}], "max_tokens": 32,
            "reasoning_effort": "none", "stream": True}


def streamed(port: int, key: str, label: str, start: float, out: dict) -> None:
    """(first token, done), in seconds since `start`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body(label)),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    first = None
    while chunk := resp.read1(1 << 16):
        if first is None and (b'"content": "' in chunk or b'"reasoning_content": "' in chunk) \
                and b'"content": ""' not in chunk:
            first = time.monotonic() - start
    out[label] = (resp.status, first, time.monotonic() - start)
    conn.close()


def run(container: Path, flags: tuple[str, ...], keys: dict[str, str], delay_ms: int,
        lib: str | None) -> dict:
    out: dict = {}
    with server(container, *flags, lib=lib, env={"WASTE_DELAY_MS": str(delay_ms)},
                ) as port:
        start = time.monotonic()
        threads = [threading.Thread(target=streamed, args=(port, keys["a"], f"a{n}", start, out))
                   for n in (1, 2, 3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        threads.append(threading.Thread(target=streamed, args=(port, keys["b"], "b1", start, out)))
        threads[-1].start()
        for t in threads:
            t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--delay-ms", type=int, default=10)
    ap.add_argument("--lib", default=None)
    args = ap.parse_args()
    print(f"# {machine()}; WASTE_DELAY_MS={args.delay_ms}; --no-prefix-cache")
    shared = new_key()
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
        each = {"a": new_key(), "b": new_key()}
        keys_path = Path(tmp) / "keys"
        keys_path.write_text("".join(f"{line_for(n, k)}\n" for n, k in each.items()))
        runs = {"one key": (("--no-prefix-cache", "--api-key", shared), {"a": shared, "b": shared}),
                "a key each": (("--no-prefix-cache", "--api-keys", str(keys_path)), each)}
        for name, (flags, keys) in runs.items():
            out = run(Path(args.container), flags, keys, args.delay_ms, args.lib)
            print(f"\n{name}: request  first token (s)  done (s)")
            for label in ("a1", "a2", "a3", "b1"):
                status, first, done = out[label]
                print(f"  {label}  {status}  {first:8.1f}  {done:8.1f}")
            ahead = sum(1 for a in ("a1", "a2", "a3") if out[a][2] < out["b1"][1])
            print(f"  B's first token came after {ahead} of A's requests")


if __name__ == "__main__":
    main()
