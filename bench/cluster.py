#!/usr/bin/env python3
"""Agent sessions replayed on 1, 2 and 3 hosts behind the router, affinity against round robin.

    .venv/bin/python bench/cluster.py [--sessions 6] [--turns 4] [--delay-ms 2]

A multi-user trace: `--sessions` agent sessions start a little apart, each a
conversation of `--turns` turns (a new user message of ~300 tokens, a short
reply, a pause for the tool or the reader, drawn per session), in the three APIs with the key its
agent sends (Claude Code's header on Messages, Codex's prompt_cache_key on
Responses, Open-WebUI's chat id on chat). Every turn streams. The reference
engine runs at a slowed clock (WASTE_DELAY_MS per evaluated token), so that
prefill, as on K3, is what a turn costs. The hosts are started by
deploy/cluster.py's own functions, the router with each policy in turn.

Per run: wall time and throughput (turns and generated tokens per second), and
per turn index the prompt tokens prefilled (summed over sessions) and the mean
time to first token. Needs haproxy (`make router`).

Two more scenarios, of a team's shared snapshot tier (--shared-cache), each run
with it and without it:

    .venv/bin/python bench/cluster.py --scenario failover [--sessions 6] [--turns 6]
    .venv/bin/python bench/cluster.py --scenario warm [--preamble-words 600]

- failover: three hosts, the same trace, and the host with the most sessions
  SIGKILLed once half the trace's turns are done; a turn cut by the death is
  sent again (as a client retries). Prompt tokens prefilled in all, after the
  kill, and by the dead host's sessions after it.
- warm: a preamble (a system prompt) warmed with --warm on one host of three,
  then a new conversation on each host: the positions each host evaluated (its
  serve_engine_evaluated_tokens_total) and the team's sum.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from deploy import cluster  # noqa: E402

DIALECTS = ("messages", "responses", "chat")
REPLY_TOKENS = 16


@dataclass
class Turn:
    session: int
    index: int
    host: str
    ttft: float      # seconds from sending to the first generated text
    prefilled: int   # prompt tokens not restored from a snapshot
    generated: int
    sent: float = 0.0   # time.monotonic() when it was sent (first sent, when it was retried)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(dialect: str, history: list) -> tuple[str, dict, dict]:
    """Path, body and headers of one streamed turn in the session's API."""
    if dialect == "messages":
        return "/v1/messages", {"messages": history, "max_tokens": REPLY_TOKENS}, {}
    if dialect == "responses":
        return "/v1/responses", {"input": history, "max_output_tokens": REPLY_TOKENS, "store": False}, {}
    return "/v1/chat/completions", {"messages": history, "max_tokens": REPLY_TOKENS,
                                    "reasoning_effort": "none",
                                    "stream_options": {"include_usage": True}}, {}


def keyed(dialect: str, key: str, body: dict, headers: dict) -> tuple[dict, dict]:
    """The conversation's key where the session's agent puts it."""
    if dialect == "messages":
        return body, {**headers, "x-claude-code-session-id": key}
    if dialect == "responses":
        return {**body, "prompt_cache_key": key}, headers
    return body, {**headers, "X-OpenWebUI-Chat-Id": key}


def stream(port: int, path: str, body: dict, headers: dict) -> tuple[str, float, str, dict]:
    """Sends one streamed turn; returns the reply's text, time to first text, host, and usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    started = time.monotonic()
    conn.request("POST", path, json.dumps({"model": "k3", "temperature": 0, "stream": True, **body}),
                 {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    host = resp.getheader("X-Serve-Host", "?")
    text, first, usage = "", 0.0, {}
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        piece = generated_text(event)
        if piece and not first:
            first = time.monotonic() - started
        text += piece
        usage = usage_of(event) or usage
    conn.close()
    return text, first, host, usage


def generated_text(event: dict) -> str:
    """Any text the model wrote in this event (answer or reasoning), in the three APIs' shapes."""
    if "choices" in event and event["choices"]:
        delta = event["choices"][0].get("delta", {})
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    if event.get("type") == "content_block_delta":
        return event["delta"].get("text") or event["delta"].get("thinking") or ""
    if event.get("type", "").startswith("response.") and event["type"].endswith(".delta"):
        return event.get("delta") or ""
    return ""


def usage_of(event: dict) -> dict:
    """(prompt, cached, generated) from a final event, as each API reports them."""
    if event.get("usage") and "prompt_tokens" in event["usage"]:
        u = event["usage"]
        return {"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"],
                "generated": u["completion_tokens"]}
    if event.get("type") == "message_delta":
        u = event["usage"]
        return {"prompt": u["input_tokens"] + u["cache_read_input_tokens"],
                "cached": u["cache_read_input_tokens"], "generated": u["output_tokens"]}
    if event.get("type") in ("response.completed", "response.incomplete"):
        u = event["response"]["usage"]
        return {"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"],
                "generated": u["output_tokens"]}
    return {}


class Cut(Exception):
    """A turn that got no whole reply (its host died under it): the client sends it again."""


def retried(port: int, path: str, body: dict, headers: dict) -> tuple[str, float, str, dict]:
    """stream(), sent again (as a client retries) while its host's death cuts it."""
    for attempt in range(20):
        try:
            text, ttft, host, usage = stream(port, path, body, headers)
            if not usage:
                raise Cut("no final event")
            return text, ttft, host, usage
        except (AssertionError, OSError, http.client.HTTPException, ValueError, Cut):
            time.sleep(0.5)
    raise Cut(f"{path}: no reply after 20 tries")


def session(port: int, n: int, turns: int, pause: float, out: list[Turn], lock: threading.Lock) -> None:
    # Tool runs and reading take their own time: each session's pauses drawn apart, the same
    # in every run, so that the policies are compared on one trace.
    pauses = random.Random(n)
    dialect = DIALECTS[n % len(DIALECTS)]
    key = f"bench-session-{n}-{time.monotonic_ns()}"
    history: list = []
    for t in range(turns):
        words = " ".join(f"s{n}t{t}w{i}" for i in range(100))  # ~300 tokens of new context
        history.append({"role": "user", "content": f"Session {n}, step {t}: {words}"})
        path, body, headers = request(dialect, history)
        body, headers = keyed(dialect, key, body, headers)
        sent = time.monotonic()
        text, ttft, host, usage = retried(port, path, body, headers)
        history.append({"role": "assistant", "content": text})
        with lock:
            out.append(Turn(n, t, host, ttft, usage["prompt"] - usage["cached"], usage["generated"],
                            sent))
        time.sleep(pauses.uniform(0, 2 * pause))  # the tool runs, or the user reads


def run(containers: list[Path], policy: str, work: Path, args: argparse.Namespace) -> dict:
    hosts, procs = [], []
    try:
        for n, container in enumerate(containers, 1):
            host, proc = cluster.start_host(container, f"h{n}", work / f"{policy}-{len(containers)}-h{n}",
                                            ["--quiet", "--prefix-cache-min", "16"])
            hosts.append(host)
            procs.append(proc)
        router_dir = work / f"{policy}-{len(containers)}-router"
        cluster.write_router_files(router_dir, hosts, policy)
        port = free_port()
        router = cluster.start_router(router_dir, f"127.0.0.1:{port}")
        procs.append(router)
        cluster.wait_checked(router_dir, [h.name for h in hosts], router)
        turns: list[Turn] = []
        lock = threading.Lock()
        threads = [threading.Thread(target=session, args=(port, n, args.turns, args.pause, turns, lock))
                   for n in range(args.sessions)]
        started = time.monotonic()
        for t in threads:
            t.start()
            time.sleep(args.stagger)
        for t in threads:
            t.join()
        wall = time.monotonic() - started
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
    by_turn = [[t for t in turns if t.index == i] for i in range(args.turns)]
    moved = sum(len({t.host for t in turns if t.session == s}) > 1 for s in range(args.sessions))
    return {"hosts": len(containers), "policy": policy, "wall": wall,
            "turns_per_s": len(turns) / wall, "tokens_per_s": sum(t.generated for t in turns) / wall,
            "prefilled": [sum(t.prefilled for t in ts) for ts in by_turn],
            "ttft": [sum(t.ttft for t in ts) / len(ts) for ts in by_turn],
            "sessions_moved": moved}


def start_hosts(containers: list[Path], work: Path, flags: dict[int, list[str]], policy: str = "affinity"
                ) -> tuple[list, list, int, Path]:
    """Hosts (host n with flags[n] added) behind one router: (hosts, processes, port, router dir)."""
    hosts, procs = [], []
    for n, container in enumerate(containers, 1):
        host, proc = cluster.start_host(container, f"h{n}", work / f"h{n}",
                                        ["--quiet", "--prefix-cache-min", "16", *flags.get(n, [])])
        hosts.append(host)
        procs.append(proc)
    router_dir = work / "router"
    cluster.write_router_files(router_dir, hosts, policy)
    port = free_port()
    procs.append(cluster.start_router(router_dir, f"127.0.0.1:{port}"))
    cluster.wait_checked(router_dir, [h.name for h in hosts], procs[-1])
    return hosts, procs, port, router_dir


def stop_all(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait()


def team_flags(shared: bool, work: Path, n: int) -> dict[int, list[str]]:
    return {i: ["--shared-cache", str(work / "shared")] for i in range(1, n + 1)} if shared else {}


def failover(k3: Path, shared: bool, work: Path, args: argparse.Namespace) -> dict:
    """The trace on three hosts; the busiest SIGKILLed once half its turns are done."""
    hosts, procs, port, _ = start_hosts([k3] * 3, work, team_flags(shared, work, 3))
    try:
        turns: list[Turn] = []
        lock = threading.Lock()
        threads = [threading.Thread(target=session, args=(port, n, args.turns, args.pause, turns, lock))
                   for n in range(args.sessions)]
        for t in threads:
            t.start()
            time.sleep(args.stagger)
        while len(turns) < args.sessions * args.turns // 2:
            time.sleep(0.05)
        with lock:
            homes = {t.session: t.host for t in turns if t.index == 0}
        victim = max(set(homes.values()), key=list(homes.values()).count)
        killed_at = time.monotonic()
        os.kill(next(h.pid for h in hosts if h.url.rsplit(":", 1)[1] == victim.rsplit(":", 1)[1]),
                signal.SIGKILL)
        for t in threads:
            t.join()
    finally:
        stop_all(procs)
    moved = {s for s, h in homes.items() if h == victim}
    after = [t for t in turns if t.sent >= killed_at]
    return {"shared": shared, "prefilled": sum(t.prefilled for t in turns),
            "prefilled_after_kill": sum(t.prefilled for t in after),
            "moved_sessions": len(moved),
            "moved_prefilled_after_kill": sum(t.prefilled for t in after if t.session in moved),
            "moved_first_turn_after_kill": [min((t for t in after if t.session == s),
                                                key=lambda t: t.index).prefilled
                                            for s in sorted(moved) if any(t.session == s for t in after)]}


def evaluated(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("serve_engine_evaluated_tokens_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no serve_engine_evaluated_tokens_total")


def wait_idle(url: str) -> None:
    while True:
        with urllib.request.urlopen(url + "/health", timeout=60) as reply:
            if json.load(reply)["idle"]:
                return
        time.sleep(0.1)


def warm_once(k3: Path, shared: bool, work: Path, args: argparse.Namespace) -> dict:
    """A preamble warmed on h1 only, then a new conversation on each of three hosts."""
    system = "You are the team's agent. " + " ".join(f"rule{i}" for i in range(args.preamble_words))
    work.mkdir(parents=True)
    preamble = work / "preamble.json"
    preamble.write_text(json.dumps({"messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": "hi"}]}))
    flags = team_flags(shared, work, 3)
    flags.setdefault(1, []).extend(["--warm", str(preamble)])
    hosts, procs, _, _ = start_hosts([k3] * 3, work, flags)
    try:
        wait_idle(hosts[0].url)
        for host in hosts:
            conn = http.client.HTTPConnection(host.url.split("//")[1], timeout=3600)
            conn.request("POST", "/v1/chat/completions", json.dumps({
                "model": "k3", "max_tokens": 4, "temperature": 0, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"a new conversation on {host.name}"}]}),
                {"Content-Type": "application/json"})
            assert conn.getresponse().status == 200
            conn.close()
        for host in hosts:
            wait_idle(host.url)
        work_done = [evaluated(h.url) for h in hosts]
    finally:
        stop_all(procs)
    return {"shared": shared, "evaluated": work_done, "team": sum(work_done)}


def scenarios(kind: str, k3: Path, work: Path, args: argparse.Namespace) -> None:
    """The shared tier's scenarios, without it and then with it, as a table."""
    rows = []
    for shared in (False, True):
        run_dir = work / f"{kind}-{'shared' if shared else 'alone'}"
        rows.append((failover if kind == "failover" else warm_once)(k3, shared, run_dir, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if kind == "failover":
        print("| shared tier | prompt tokens prefilled | after the kill | by the dead host's "
              "sessions after it | their first turn after it |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {'on' if r['shared'] else 'off'} | {r['prefilled']} | {r['prefilled_after_kill']} | "
                  f"{r['moved_prefilled_after_kill']} ({r['moved_sessions']} sessions) | "
                  f"{r['moved_first_turn_after_kill']} |")
    else:
        print("| shared tier | positions evaluated: h1 (warmed) | h2 | h3 | the team |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {'on' if r['shared'] else 'off'} | " + " | ".join(map(str, r["evaluated"]))
                  + f" | {r['team']} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--delay-ms", default="2", help="WASTE_DELAY_MS: the engine's clock per token")
    p.add_argument("--pause", type=float, default=1.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--stagger", type=float, default=0.2, help="seconds between session starts")
    p.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--policies", nargs="+", default=["affinity", "roundrobin"],
                   choices=list(cluster.POLICIES))
    p.add_argument("--scenario", choices=["policies", "failover", "warm"], default="policies",
                   help="policies (default): the table above; failover, warm: the shared tier's")
    p.add_argument("--preamble-words", type=int, default=600, help="warm: the preamble's length")
    args = p.parse_args()
    os.environ["WASTE_DELAY_MS"] = args.delay_ms
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: the hosts and routers stop too
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        k3 = work / "k3.waste"
        subprocess.run([sys.executable, str(ROOT / "tools/make_container.py"), str(k3)], check=True,
                       capture_output=True)
        if args.scenario != "policies":
            scenarios(args.scenario, k3, work, args)
            return 0
        rows = []
        for n in args.hosts:
            for policy in args.policies if n > 1 else args.policies[:1]:
                rows.append(run([k3] * n, policy, work, args))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    turns = " | ".join(f"turn {i + 1}" for i in range(args.turns))
    print(f"| hosts | policy | wall s | turns/s | gen tok/s | prefilled tokens: {turns} | "
          f"TTFT s: {turns} | sessions moved |")
    print("|---|---|---|---|---|" + "---|" * (2 * args.turns) + "---|")
    for r in rows:
        print(f"| {r['hosts']} | {r['policy'] if r['hosts'] > 1 else '-'} | {r['wall']:.1f} | "
              f"{r['turns_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
              + " | ".join(str(x) for x in r["prefilled"]) + " | "
              + " | ".join(f"{x:.2f}" for x in r["ttft"]) + f" | {r['sessions_moved']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
