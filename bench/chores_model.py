#!/usr/bin/env python3
"""A person's first token while a chore runs: one model, against a chores model beside it.

    .venv/bin/python bench/chores_model.py [CONTAINER] [--chores CONTAINER] [--delay-ms 9]
                                           [--chore-tokens 300] [--repeat 3]

Serves CONTAINER (default the K3 demo container) with the reference engine slowed
to DELAY_MS per evaluated token (WASTE_DELAY_MS: the engine's clock scaled towards
K3's), twice: alone, and with --chores-model (default a Kimi-Linear-flavoured
container written by tools/make_container.py; SmolLM2's build/smollm2.waste works
too). Each run sends what a chat front end sends at the start of a chat: a title
chore (blocking, Open-WebUI's own title template, up to CHORE_TOKENS tokens,
naming the main model as Open-WebUI does by default), then a person's message
(streamed) while the chore runs, and times the message's first token against the
same message sent alone. The chore is known as one by its text (docs/chores.md):
alone, it steps aside for the person at its next engine call; with a chores model,
it runs on the chores model's engine. (Stepping aside saves the chore's state: the
prefix cache is on, in a directory of each run's own.) Also printed: the positions each engine
evaluated (/metrics), which show where the chore ran.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from common import DEMO, ROOT, machine

sys.path.insert(0, str(ROOT / "tests"))
from openwebui_tasks import task  # noqa: E402
from scripted import call, samples, timed_blocks, wait_idle  # noqa: E402
from slow_clock import DIALECTS, prompt_text  # noqa: E402

CHAT = DIALECTS["chat"]


def serve(container: str, lib: str, tmp: str, delay_ms: float, chores: Optional[str]):
    flags = ["--chores-model", chores, "--chores-model-id", "chores"] if chores else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", container, "--lib", lib, "--port", "0", "--quiet",
         "--prefix-cache-dir", os.path.join(tmp, f"prefix-{bool(chores)}"), "--no-thinking",
         "--usage", os.path.join(tmp, "usage"), *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "WASTE_DELAY_MS": str(delay_ms)})
    port = next((int(line.rsplit(":", 1)[1].split("/")[0]) for line in proc.stdout
                 if line.startswith("listen")), None)
    if port is None:
        proc.kill()
        raise SystemExit("the server did not start")
    return proc, port


def first_token(port: int, text: str) -> float:
    """Seconds from sending a streamed message to its first token."""
    sent, blocks = timed_blocks(port, CHAT.path, CHAT.body(text), timeout=3600)
    return next(at for at, block in blocks if CHAT.token(block)) - sent


def evaluated(port: int) -> dict[str, float]:
    got = samples(call(port, "GET", "/metrics").body.decode())
    return {dict(labels).get("model", "the model"): value for (name, labels), value in got.items()
            if name == "serve_engine_evaluated_tokens_total"}


def run(port: int, model: str, args: argparse.Namespace, trial: int) -> tuple[float, float]:
    """(first token alone, first token with a chore running) for one message."""
    text = prompt_text(3, f"m{trial}")
    alone = first_token(port, text)
    wait_idle(port)
    history = [{"role": "user", "content": prompt_text(8, f"c{trial}")}]
    chore = {"model": model, "max_tokens": args.chore_tokens, "temperature": 0,
             "messages": [{"role": "user", "content": task("TITLE_GENERATION", history)}]}
    running = threading.Thread(target=call, args=(port, "POST", CHAT.path, chore),
                               kwargs={"timeout": 3600})
    running.start()
    time.sleep(args.after)   # the message comes while the chore runs, as in the chat
    with_chore = first_token(port, prompt_text(3, f"n{trial}"))
    running.join()
    wait_idle(port)
    return alone, with_chore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--chores", default=None, help="the chores model's container (default: a "
                                                   "Kimi-Linear-flavoured one, written here)")
    ap.add_argument("--delay-ms", type=float, default=9.0)
    ap.add_argument("--chore-tokens", type=int, default=300)
    ap.add_argument("--after", type=float, default=0.3, help="seconds between chore and message")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lib", default=None)
    args = ap.parse_args()
    lib = os.path.abspath(args.lib) if args.lib else str(ROOT / "libwaste.so")
    with tempfile.TemporaryDirectory(prefix="bench-chores-model-") as tmp:
        chores = args.chores
        if chores is None:
            chores = os.path.join(tmp, "kimi-linear.waste")
            subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"), chores,
                            "--flavour", "kimi-linear"], check=True, capture_output=True)
        print(f"# {machine()}; WASTE_DELAY_MS={args.delay_ms:g}, chore up to "
              f"{args.chore_tokens} tokens, message {args.after:g} s after it")
        print(f"{'serving':<22} {'first token alone':>17} {'behind a chore':>14} "
              f"{'delayed by':>10}  positions evaluated")
        main = Path(args.container).name.removesuffix(".waste")
        for label, extra in (("one model", None), ("with a chores model", os.path.abspath(chores))):
            proc, port = serve(os.path.abspath(args.container), lib, tmp, args.delay_ms, extra)
            try:
                results = [run(port, main, args, trial) for trial in range(args.repeat)]
                spent = json.dumps(evaluated(port))
            finally:
                proc.terminate()
                proc.wait(60)
            alone = sorted(r[0] for r in results)[len(results) // 2]
            behind = sorted(r[1] for r in results)[len(results) // 2]
            print(f"{label:<22} {alone:>16.2f}s {behind:>13.2f}s {behind - alone:>9.2f}s  {spent}")


if __name__ == "__main__":
    main()
