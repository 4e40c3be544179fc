#!/usr/bin/env python3
"""An Open-WebUI chat and an opencode turn replayed at a scaled K3 clock: the person's first tokens, before and after chores went to the back.

    .venv/bin/python bench/chores.py [CONTAINER] [--delay-ms MS] [--lib PATH] [--runs NAME,...]
                                     [--main-root CHECKOUT]

The requests and their order are issue 28's table (Open-WebUI 0.12.4 in a
browser, one chat of three messages): a title chore beside message 1 (36 tools
attached), follow-ups and tags chores after each reply, the next message while
they run. The chores' text is Open-WebUI's own templates
(tests/fixtures/openwebui/), their bodies as it sends them (blocking; the title
with max_tokens 1000, the others with none), greedy so that the runs compare
(the same answers, but where a chore is cut). The person's think times are the
table's, scaled by the clock: the reference engine sleeps --delay-ms per
evaluated position (default 4) where K3 takes about 2 s, so a second of
thinking is --delay-ms/2000 s here.

Beside it, with message 1, an opencode turn: its title request and then its
turn, both streamed, as opencode 1.18.33 sent them (tests/fixtures/agents/
opencode-turn.json: the title agent's prompt with max_tokens 32000, then the
turn's 10 tools and system prompt; the turn's reply held to 200 tokens, as the
messages' are). The turn's first token is what changed: before, serve did not
know opencode's title and ran it first, as a person's request, to its 32,000
tokens.

Runs, on the same engine and container:
- before: one line in arrival order, chores run to the server's max_tokens
  (--no-work-classes --background-max-tokens 4096): today's main.
- main: --main-root's checkout (today's main, before opencode's title was
  known) with the defaults of `after`.
- after: the defaults (people first, chores preempted between engine calls,
  chores bounded), prefill in steps of 64 (WARP's batch, as K3 runs).
- chores model: the same, with a chores model beside it (--chores-model: by
  default build/smollm2.waste when `make demo` has made it, else a
  Kimi-Linear-flavoured container written here): the chores go to it.
RUNS below is the list to extend.

For each message: its first-token delay and how much of it was spent behind
chores (the reply's waste.behind_chores_ms); for each chore, its time and
tokens; the engine's time by class (serve_engine_seconds_total) and the
preemptions. Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from common import DEMO, ROOT, machine, server

sys.path.insert(0, str(ROOT / "tests"))
from agent_prompts import OPENCODE_TURN  # noqa: E402
from openwebui_tasks import task  # noqa: E402

K3_SECONDS_PER_TOKEN = 2.0
RUNS = {
    "before": ("--no-work-classes", "--background-max-tokens", "4096", "--prefill-step", "512"),
    "main": ("--prefill-step", "64"),
    "after": ("--prefill-step", "64"),
    "chores model": ("--prefill-step", "64", "--chores-model", "{chores}"),
}
SMOLLM2 = ROOT / "build" / "smollm2.waste"
SYSTEM = "You are a helpful assistant. Answer clearly and cite what you rely on."
QUESTIONS = ["How do tides work, and why are there two a day?",
             "Write a detailed explanation of spring and neap tides with a worked example.",
             "Thanks. Which coasts have the largest tidal range?"]
MESSAGE_TOKENS = (84, 1924, 200)   # what the table's replies were (the third: unknown, failed)
OPENCODE_TURN_TOKENS = 200   # the turn's reply (it asks 32,000, which greedy demo text would fill)


def tools(n: int = 36) -> list[dict]:
    """Open-WebUI's built-in tools stand-ins: n functions with a few typed parameters."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Built-in tool number {i}: searches, reads or "
                                            "writes one kind of thing the user keeps.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "at most this many results"}},
            "required": ["query"]}}} for i in range(n)]


@dataclass
class Result:
    name: str
    sent: float
    first_token: Optional[float] = None   # seconds after sent
    done: float = 0.0                     # seconds after sent
    tokens: int = 0
    waste: dict = field(default_factory=dict)


class Chat:
    """The replay's state: the conversation so far, and every request's result."""

    def __init__(self, port: int, think: float):
        self.port, self.think = port, think
        self.history: list[dict] = [{"role": "system", "content": SYSTEM}]
        self.results: list[Result] = []
        self.threads: list[threading.Thread] = []
        self.start = time.monotonic()

    def chore(self, name: str, template: str, max_tokens: Optional[int], after: float) -> None:
        """Send an Open-WebUI task `after` human seconds, on its own thread."""
        visible = [m for m in self.history if m["role"] != "system"]
        body = {"model": "demo", "stream": False, "temperature": 0,
                "messages": [{"role": "user", "content": task(template, visible)}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        self._later(after, lambda: self._blocking(name, body))

    def message(self, index: int, after: float) -> None:
        """The person's message `index`, sent `after` human seconds; returns when answered."""
        time.sleep(after * self.think)
        self.history.append({"role": "user", "content": QUESTIONS[index]})
        body = {"model": "demo", "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0,
                "messages": list(self.history), "max_tokens": MESSAGE_TOKENS[index]}
        if index == 0:
            body["tools"] = tools()
        result = self._streamed(f"message {index + 1}", body)
        self.history.append({"role": "assistant", "content": result.waste.pop("text", "")})

    def opencode(self, after: float) -> None:
        """opencode's title and then its turn, `after` human seconds, each on its own thread."""
        def send(name: str) -> None:
            body = {**OPENCODE_TURN[name], "model": "demo", "temperature": 0}
            if name == "turn":
                body["max_tokens"] = OPENCODE_TURN_TOKENS
            self._streamed(f"opencode {name}", body)
        self._later(after, lambda: send("title"))
        self._later(after + 0.1, lambda: send("turn"))

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _later(self, after: float, send) -> None:
        def run() -> None:
            time.sleep(after * self.think)
            send()
        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def _blocking(self, name: str, body: dict) -> None:
        result = Result(name, time.monotonic() - self.start)
        started = time.monotonic()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=7200) as resp:
            reply = json.loads(resp.read())
        result.done = time.monotonic() - started
        result.tokens, result.waste = reply["usage"]["completion_tokens"], reply["waste"]
        self.results.append(result)

    def _streamed(self, name: str, body: dict) -> Result:
        result = Result(name, time.monotonic() - self.start)
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=7200)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp, pending, text = conn.getresponse(), b"", []
        while chunk := resp.read1(1 << 16):
            events = (pending + chunk).split(b"\n\n")
            pending = events.pop()
            for event in events:
                data = json.loads(event[6:]) if event.startswith(b"data: {") else {}
                delta = data["choices"][0]["delta"] if data.get("choices") else {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                    result.first_token = result.first_token or time.monotonic() - started
                    text.append(delta.get("content") or "")
                if data.get("usage"):
                    result.tokens, result.waste = data["usage"]["completion_tokens"], data["waste"]
        conn.close()
        result.done = time.monotonic() - started
        result.waste["text"] = "".join(text)
        self.results.append(result)
        return result


def replay(port: int, think: float) -> Chat:
    """Issue 28's table, each request sent when Open-WebUI sent it."""
    chat = Chat(port, think)
    chat.chore("title", "TITLE_GENERATION", 1000, 0.0)
    chat.opencode(0.2)
    chat.message(0, 0.4)
    chat.chore("follow-ups 1", "FOLLOW_UP_GENERATION", None, 0.0)
    chat.chore("tags", "TAGS_GENERATION", None, 12.3)
    chat.message(1, 1.6)
    chat.chore("follow-ups 2", "FOLLOW_UP_GENERATION", None, 0.0)
    chat.message(2, 119.3)
    chat.join()
    return chat


SAMPLE = re.compile(r'^(serve_engine_seconds_total|serve_preemptions_total)(?:\{(.*)\})? (\S+)$')


def engine_seconds(port: int) -> dict[str, float]:
    """serve_engine_seconds_total by class, and serve_preemptions_total, summed over the
    models (with a chores model each engine's samples carry a `model` label); and each
    model's engine time, as `model NAME`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    out = {"interactive": 0.0, "background": 0.0, "preemptions": 0.0}
    for line in lines:
        found = SAMPLE.match(line)
        if not found:
            continue
        name, labels, value = found.groups()
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        key = label.get("class", "") if name == "serve_engine_seconds_total" else "preemptions"
        out[key] += float(value)
        if "model" in label and name == "serve_engine_seconds_total":
            out[f"model {label['model']}"] = out.get(f"model {label['model']}", 0.0) + float(value)
    return out


def report(name: str, chat: Chat, engine: dict[str, float]) -> None:
    by_model = ", ".join(f"{key[6:]} {value:.1f} s" for key, value in engine.items()
                         if key.startswith("model "))
    print(f"\n{name}: engine {engine['interactive']:.1f} s on messages, "
          f"{engine['background']:.1f} s on chores; {engine['preemptions']:.0f} preemptions"
          + (f" (by model: {by_model})" if by_model else ""))
    print(f"  {'request':<15} {'sent s':>7} {'first token s':>14} {'behind chores s':>16} "
          f"{'done s':>8} {'tokens':>7}")
    for r in sorted(chat.results, key=lambda r: r.sent):
        first = f"{r.first_token:.2f}" if r.first_token is not None else "-"
        behind = r.waste.get("behind_chores_ms", 0) / 1000.0
        print(f"  {r.name:<15} {r.sent:>7.2f} {first:>14} {behind:>16.2f} {r.done:>8.2f} "
              f"{r.tokens:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--delay-ms", type=float, default=4.0,
                    help="the reference engine's sleep per evaluated position (WASTE_DELAY_MS)")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--runs", default="main,after,chores model", help="which of " + ", ".join(RUNS))
    ap.add_argument("--main-root", default=None, type=Path,
                    help="the checkout the `main` run serves from (e.g. `git archive main`)")
    ap.add_argument("--chores-model", default=None,
                    help="the chores model of the `chores model` run (default: "
                         "build/smollm2.waste if made, else a Kimi-Linear-flavoured container)")
    args = ap.parse_args()
    made = tempfile.TemporaryDirectory(prefix="bench-chores-")
    chores = args.chores_model or (str(SMOLLM2) if SMOLLM2.is_dir() else
                                   str(Path(made.name) / "kimi-linear.waste"))
    if not Path(chores).is_dir():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"), chores,
                        "--flavour", "kimi-linear"], check=True, capture_output=True)
    think = args.delay_ms / 1000.0 / K3_SECONDS_PER_TOKEN
    print(f"machine  {machine()}")
    print(f"clock    WASTE_DELAY_MS={args.delay_ms:g}: one position {args.delay_ms:g} ms "
          f"(K3: {K3_SECONDS_PER_TOKEN:g} s), a human second {think * 1000:.1f} ms")
    for name in args.runs.split(","):
        flags = [flag.format(chores=chores) for flag in RUNS[name]]
        if name == "main" and args.main_root is None:
            raise SystemExit("the main run needs --main-root CHECKOUT")
        root = args.main_root if name == "main" else ROOT
        with server(args.container, *flags, lib=args.lib, root=root,
                    env={"WASTE_DELAY_MS": f"{args.delay_ms:g}"}) as port:
            chat = replay(port, think)
            report(f"{name} ({' '.join(flags)})", chat, engine_seconds(port))
    made.cleanup()


if __name__ == "__main__":
    main()
