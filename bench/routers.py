#!/usr/bin/env python3
"""Which router: nginx, HAProxy, vllm-router and sglang-router measured against the same serve hosts.

    .venv/bin/python bench/routers.py [--only NAME ...] [--rv VENV]

Needs `haproxy` and `nginx` (Debian packages) and, for the Rust routers, a venv
with `pip install vllm-router sglang-router` (--rv, default /tmp/rv). Hosts are
the reference engine on random-weight containers, slowed with WASTE_DELAY_MS so
that a reply is in flight long enough to be killed and its stream has gaps to
measure. Each candidate is started in front of fresh hosts; every check is a real
request through it, and the host that answered is read from X-Serve-Host.
Prints one row per candidate (the table in docs/serving-a-team.md).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from deploy import cluster  # noqa: E402

DELAY_MS = "15"   # per evaluated token: a 60-token reply streams for about a second
APIS = {  # path -> a one-turn body, and where its text is
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}]},
    "/v1/completions": lambda text: {"prompt": text},
    "/v1/messages": lambda text: {"messages": [{"role": "user", "content": text}]},
    "/v1/responses": lambda text: {"input": text},
}
KEYS = {  # how a client names its conversation -> (headers, body fields) for conversation `c`
    "x-claude-code-session-id": lambda c: ({"x-claude-code-session-id": c}, {}),
    "X-OpenWebUI-Chat-Id": lambda c: ({"X-OpenWebUI-Chat-Id": c}, {}),
    "prompt_cache_key": lambda c: ({}, {"prompt_cache_key": c}),
    "user": lambda c: ({}, {"user": c}),
    "no key": lambda c: ({}, {}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes, error: Optional[str] = None,
                 first_byte: float = 0.0, gaps: tuple = ()):
        self.status, self.headers, self.body, self.error = status, headers, body, error
        self.first_byte, self.gaps = first_byte, gaps

    @property
    def host(self) -> str:
        return self.headers.get("x-serve-host", "?")

    def json(self) -> dict:
        return json.loads(self.body)


def post(port: int, path: str, body: dict, headers: Optional[dict] = None, timeout: float = 60) -> Reply:
    """One request; a stream is read event by event, timing the first byte and the gaps after it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                      **(headers or {})})
        resp = conn.getresponse()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        if not body.get("stream") or resp.status != 200:
            return Reply(resp.status, hdrs, resp.read())
        # read1, not readline: http.client's readline takes a cut chunked body for its end.
        data, stamps = b"", []
        while piece := resp.read1(65536):
            if b"data:" in piece:
                stamps.append(time.monotonic())
            data += piece
        gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
        return Reply(resp.status, hdrs, data, first_byte=stamps[0] - started if stamps else 0.0, gaps=gaps)
    except (OSError, http.client.HTTPException) as e:
        return Reply(0, {}, b"", error=f"{type(e).__name__}")
    finally:
        conn.close()


def get(port: int, path: str) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    except (OSError, http.client.HTTPException) as e:
        return Reply(0, {}, b"", error=type(e).__name__)
    finally:
        conn.close()


# ---- hosts ------------------------------------------------------------------------------

class Hosts:
    """serve hosts started with deploy/cluster.py's own start_host."""

    def __init__(self, work: Path, containers: list[Path], extra: Optional[dict[int, list[str]]] = None):
        self.hosts, self.procs = [], []
        for n, container in enumerate(containers):
            args = ["--quiet", "--prefix-cache-min", "16", *(extra or {}).get(n, [])]
            host, proc = cluster.start_host(container, f"h{n + 1}", work / f"h{n + 1}-{time.monotonic_ns()}", args)
            self.hosts.append(host)
            self.procs.append(proc)

    def urls(self) -> list[str]:
        return [h.url for h in self.hosts]

    def kill(self, host_header: str) -> None:
        port = host_header.rsplit(":", 1)[1]
        for host, proc in zip(self.hosts, self.procs):
            if host.url.endswith(":" + port):
                proc.send_signal(signal.SIGKILL)
                proc.wait()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait()


# ---- candidates: each starts in front of `urls` on `port` and returns its process ------------

def start_haproxy(urls: list[str], port: int, work: Path, rv: Path) -> subprocess.Popen:
    hosts = [cluster.Host(f"h{n}", url, cluster.ask_model(url)) for n, url in enumerate(urls, 1)]
    cluster.write_router_files(work, hosts)
    proc = cluster.start_router(work, f"127.0.0.1:{port}")
    cluster.wait_checked(work, [h.name for h in hosts], proc)
    return proc


def start_nginx(urls: list[str], port: int, work: Path, rv: Path) -> subprocess.Popen:
    # The best stock nginx can do: a consistent hash on the first header key present
    # (it cannot read JSON bodies), streaming unbuffered, passive failover.
    servers = "".join(f"server {u.split('://')[1]} max_fails=1 fail_timeout=10s;" for u in urls)
    conf = f"""daemon off; pid {work}/nginx.pid; error_log {work}/error.log;
events {{}}
http {{
  access_log off;
  client_body_temp_path {work}; proxy_temp_path {work};
  map $http_x_claude_code_session_id $conv {{ "" $http_x_openwebui_chat_id; default $http_x_claude_code_session_id; }}
  upstream serve {{ hash $conv consistent; {servers} }}
  server {{ listen 127.0.0.1:{port};
    location / {{ proxy_pass http://serve; proxy_http_version 1.1; proxy_buffering off;
                 proxy_read_timeout 1h; proxy_next_upstream error timeout; }} }}
}}"""
    (work / "nginx.conf").write_text(conf)
    return subprocess.Popen(["nginx", "-c", str(work / "nginx.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def rust_router(binary: str, policy: str, *extra: str):
    def start(urls: list[str], port: int, work: Path, rv: Path) -> subprocess.Popen:
        log = open(work / "router.log", "w")
        return subprocess.Popen([str(rv / "bin" / binary), *([] if binary == "vllm-router" else ["launch"]),
                                 "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                 "--policy", policy, "--health-check-interval-secs", "1",
                                 "--worker-startup-timeout-secs", "30", *extra],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return start


CANDIDATES: dict[str, Callable] = {
    "haproxy": start_haproxy,
    "nginx": start_nginx,
    "vllm-router consistent_hash": rust_router("vllm-router", "consistent_hash"),
    "vllm-router sticky_least_loaded": rust_router("vllm-router", "sticky_least_loaded"),
    "sglang-router cache_aware": rust_router("sglang-router", "cache_aware"),
}


def wait_serving(port: int, proc: subprocess.Popen, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        r = post(port, "/v1/completions", {"model": "k3", "prompt": "ping", "max_tokens": 1}, timeout=10)
        if r.status == 200:
            return True
        time.sleep(0.5)
    return False


def last_lines(directory: Path) -> str:
    log = directory / "router.log"
    return " / ".join(log.read_text().splitlines()[-3:]) if log.exists() else "(no log)"


class Router:
    def __init__(self, name: str, urls: list[str], work: Path, rv: Path):
        self.port = free_port()
        self.dir = work / f"{name.replace(' ', '-')}-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        self.proc = CANDIDATES[name](urls, self.port, self.dir, rv)
        self.up = wait_serving(self.port, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- checks -----------------------------------------------------------------------------

def body_for(path: str, text: str, **more) -> dict:
    body = {"model": "k3", **APIS[path](text), "max_tokens": 8, "temperature": 0, **more}
    if path == "/v1/responses":  # the Responses API names its cap apart
        body["max_output_tokens"] = body.pop("max_tokens")
    return body


def check_apis(port: int) -> str:
    """Each API blocking and streamed, and /v1/models: what answered 200 with its own shape."""
    ok = []
    for path in APIS:
        plain = post(port, path, body_for(path, "hello"))
        streamed = post(port, path, body_for(path, "hello", stream=True))
        if plain.status == 200 and streamed.status == 200 and streamed.gaps:
            ok.append(path.rsplit("/", 1)[1])
    models = get(port, "/v1/models")
    return f"{len(ok)}/4" + ("" if models.status == 200 else ", no /v1/models")


def check_streaming(port: int, direct: int) -> tuple[str, str]:
    """First data byte and the mean gap between events, direct and through the router (ms)."""
    def measure(p: int) -> tuple[float, float]:
        firsts, gaps = [], []
        for i in range(3):
            r = post(p, "/v1/chat/completions", body_for("/v1/chat/completions", f"stream {i}",
                                                          stream=True, max_tokens=40))
            firsts.append(r.first_byte)
            gaps += list(r.gaps)
        return 1000 * sorted(firsts)[1], 1000 * sum(gaps) / max(1, len(gaps))
    d_first, d_gap = measure(direct)
    r_first, r_gap = measure(port)
    return f"{r_first:.0f} ({d_first:.0f})", f"{r_gap:.1f} ({d_gap:.1f})"


def check_affinity(port: int) -> dict[str, str]:
    """Three four-turn chat conversations per kind of key: were all turns of each on one host?"""
    found, used = {}, set()
    for kind, key in KEYS.items():
        kept = 0
        for c in range(3):
            headers, fields = key(f"{kind}-conv-{c}-{time.monotonic_ns()}")
            messages, hosts = [], set()
            for turn in range(4):
                messages.append({"role": "user", "content": f"conversation {c} of {kind}, turn {turn}"})
                r = post(port, "/v1/chat/completions", {"model": "k3", "messages": messages, "max_tokens": 4,
                                                        "temperature": 0, **fields}, headers)
                hosts.add(r.host if r.status == 200 else f"error {r.status}")
                if r.status == 200:
                    messages.append(r.json()["choices"][0]["message"])
            kept += len(hosts) == 1 and not any(h.startswith("error") for h in hosts)
            used |= hosts
        found[kind] = f"{kept}/3"
    found["hosts used"] = len(used)  # affinity means little if everything went to one host
    return found


def check_least_loaded(port: int) -> str:
    """While one host runs a long reply, where do four new conversations go? (0/4 on it is right)"""
    long = threading.Thread(target=lambda: holder.append(
        post(port, "/v1/chat/completions", body_for("/v1/chat/completions", "a long one", max_tokens=400))))
    holder: list[Reply] = []
    long.start()
    time.sleep(1.0)
    probes = [post(port, "/v1/chat/completions", body_for("/v1/chat/completions", f"new {i}"),
                   {"x-claude-code-session-id": f"new-{i}-{time.monotonic_ns()}"}) for i in range(4)]
    long.join()
    busy = holder[0].host
    return f"{sum(p.host == busy for p in probes)}/4 on the busy host"


def check_warming(name: str, work: Path, rv: Path, k3: Path) -> str:
    """A host that is warming (--warm) next to one that is not: where do new conversations go?"""
    warm = work / "warm.json"
    warm.write_text(json.dumps({"messages": [{"role": "system", "content": " ".join(["w"] * 3000)}]}))
    hosts = Hosts(work, [k3, k3], {1: ["--warm", str(warm)]})
    router = Router(name, hosts.urls(), work, rv)
    try:
        if not router.up:
            return "router never served"
        warming = hosts.hosts[1].url.rsplit(":", 1)[1]
        replies = [post(router.port, "/v1/chat/completions", body_for("/v1/chat/completions", f"w {i}"),
                        {"x-claude-code-session-id": f"warm-{i}"}) for i in range(6)]
        errors = sum(r.status != 200 for r in replies)
        landed = sum(r.host.endswith(":" + warming) for r in replies)
        return f"{landed}/6 to it" + (f", {errors} errors" if errors else "")
    finally:
        router.stop()
        hosts.stop()


def check_failover(name: str, work: Path, rv: Path, k3: Path) -> dict[str, str]:
    """SIGKILL the host of a conversation while its turn runs, blocking and streamed."""
    out = {}
    for stream in (False, True):
        hosts = Hosts(work, [k3, k3])
        router = Router(name, hosts.urls(), work, rv)
        try:
            key = {"x-claude-code-session-id": f"fail-{stream}-{time.monotonic_ns()}"}
            first = post(router.port, "/v1/chat/completions", body_for("/v1/chat/completions", "turn one"), key)
            holder: list[Reply] = []
            running = threading.Thread(target=lambda: holder.append(post(
                router.port, "/v1/chat/completions",
                body_for("/v1/chat/completions", "turn two", max_tokens=400, stream=stream), key)))
            running.start()
            time.sleep(1.5)
            hosts.kill(first.host)
            running.join()
            cut = holder[0]
            if cut.error:
                seen = f"connection error ({cut.error})"
            elif cut.status != 200:
                seen = f"{cut.status}" + (" + Retry-After" if "retry-after" in cut.headers else "")
            else:
                finished = b"[DONE]" in cut.body or b'"finish_reason": "length"' in cut.body
                seen = "200, finished (retried)" if finished else "200, cut short without an error"
            after = [post(router.port, "/v1/chat/completions",
                          body_for("/v1/chat/completions", f"turn {3 + i}"), key) for i in range(3)]
            lost = sum(r.status != 200 for r in after)
            out["stream" if stream else "blocking"] = seen
            out.setdefault("after", f"{3 - lost}/3 later turns served")
            out["after"] = min(out["after"], f"{3 - lost}/3 later turns served")
        finally:
            router.stop()
            hosts.stop()
    return out


def check_models(name: str, work: Path, rv: Path, k3: Path, kl: Path) -> str:
    """Hosts of two models behind one router: routed by `model`? /v1/models the union?"""
    hosts = Hosts(work, [k3, kl])
    router = Router(name, hosts.urls(), work, rv)
    try:
        if not router.up:
            return "router never served"
        right = 0
        for model, host in (("k3", hosts.hosts[0]), ("kl", hosts.hosts[1])):
            for i in range(3):
                r = post(router.port, "/v1/chat/completions",
                         {**body_for("/v1/chat/completions", f"m {i}"), "model": model})
                right += r.status == 200 and r.host.endswith(":" + host.url.rsplit(":", 1)[1])
        listed = get(router.port, "/v1/models")
        ids = sorted(m["id"] for m in json.loads(listed.body).get("data", [])) if listed.status == 200 else []
        return f"{right}/6 routed right, /v1/models lists {ids or listed.status}"
    finally:
        router.stop()
        hosts.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", choices=list(CANDIDATES))
    p.add_argument("--rv", type=Path, default=Path("/tmp/rv"), help="venv with vllm-router, sglang-router")
    args = p.parse_args()
    os.environ["WASTE_DELAY_MS"] = DELAY_MS
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: the hosts and routers stop too
    work = Path(tempfile.mkdtemp(prefix="routers-"))
    k3 = work / "k3.waste"
    kl = work / "kl.waste"
    subprocess.run([sys.executable, str(ROOT / "tools/make_container.py"), str(k3)], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, str(ROOT / "tools/make_container.py"), str(kl), "--flavour",
                    "kimi-linear"], check=True, capture_output=True)
    try:
        for name in args.only or CANDIDATES:
            row: dict[str, object] = {}
            hosts = Hosts(work, [k3, k3])
            router = Router(name, hosts.urls(), work, args.rv)
            try:
                if not router.up:
                    print(json.dumps({name: "never served a request: " + last_lines(router.dir)}), flush=True)
                    continue
                direct = int(hosts.hosts[0].url.rsplit(":", 1)[1])
                row["apis"] = check_apis(router.port)
                row["first byte ms (direct)"], row["event gap ms (direct)"] = check_streaming(router.port, direct)
                row["affinity"] = check_affinity(router.port)
                row["new conversation"] = check_least_loaded(router.port)
            finally:
                router.stop()
                hosts.stop()
            row["warming host"] = check_warming(name, work, args.rv, k3)
            row["failover"] = check_failover(name, work, args.rv, k3)
            row["models"] = check_models(name, work, args.rv, k3, kl)
            print(json.dumps({name: row}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
