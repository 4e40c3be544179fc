"""Multi-turn chat with and without prefix reuse: time to first token and prompt
tokens actually prefilled, per turn, side by side.

    .venv/bin/python bench/multiturn.py [CONTAINER] [--lib PATH] [--turns N]

Two servers on the same container, one with the prefix cache and one with
--no-prefix-cache, replay the same conversation; each turn resends the whole
history, as chat clients do. Greedy decoding, so both see identical replies.
"""
from __future__ import annotations

import argparse

from common import DEMO, machine, server, stream_chat

# A long-ish user turn, so that prefill is a real share of each request.
PARAGRAPH = ("The harbour master kept a ledger of every ship that passed the breakwater: its name, "
             "its flag, the tonnage it declared and the tonnage the pilots guessed. ")


def user_turn(n: int) -> dict:
    return {"role": "user", "content": f"Turn {n}. " + PARAGRAPH * 6 + "What changed since last time?"}


def replay(port: int, turns: int, answer_tokens: int) -> list[tuple[float, int, int]]:
    """(seconds to first token, prompt tokens, tokens restored from a snapshot) per turn."""
    messages: list[dict] = []
    rows = []
    for n in range(turns):
        messages.append(user_turn(n))
        reply = stream_chat(port, {"messages": messages, "max_tokens": answer_tokens,
                                   "temperature": 0, "reasoning_effort": "none"})
        usage = reply.usage
        rows.append((reply.first_token_s, usage["prompt_tokens"],
                     usage["prompt_tokens_details"]["cached_tokens"]))
        messages.append({"role": "assistant", "content": reply.text})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--answer-tokens", type=int, default=32)
    args = ap.parse_args()
    flags = ("--ctx", "16384")
    with server(args.container, *flags, lib=args.lib) as port:
        warm = replay(port, args.turns, args.answer_tokens)
    with server(args.container, *flags, "--no-prefix-cache", lib=args.lib) as port:
        cold = replay(port, args.turns, args.answer_tokens)
    print(f"{args.turns}-turn chat, greedy, {args.answer_tokens}-token answers — {machine()}")
    print(f"{'turn':>4} {'prompt':>7} | {'prefilled':>9} {'TTFT ms':>8} (cache) | "
          f"{'prefilled':>9} {'TTFT ms':>8} (no cache)")
    for n, ((w_s, w_prompt, w_cached), (c_s, c_prompt, c_cached)) in enumerate(zip(warm, cold), 1):
        print(f"{n:>4} {w_prompt:>7} | {w_prompt - w_cached:>9} {w_s * 1e3:>8.1f}         | "
              f"{c_prompt - c_cached:>9} {c_s * 1e3:>8.1f}")
    total = lambda rows: (sum(p - c for _, p, c in rows), sum(s for s, _, _ in rows))  # noqa: E731
    (wp, ws), (cp, cs) = total(warm), total(cold)
    print(f"{'all':>4} {'':>7} | {wp:>9} {ws * 1e3:>8.1f}         | {cp:>9} {cs * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
