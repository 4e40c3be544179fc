"""Several serve hosts behind the router, started by the recipe's own script (deploy/cluster.py).

Three hosts of the reference engine behind HAProxy on loopback: conversations
keep their host in every API, a killed host's conversations move and nothing
sent afterwards is lost, a warming host takes no new conversations, two models
share one router. Skipped only when HAProxy is not installed (`make router`
installs it, and `make check` runs that first).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest

from scripted import dechunk, post_open, read_all
from served import listening

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "cluster.py"
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
needs_router = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (`make router`, "
                                  "or apt-get install haproxy): the router the recipe uses")
GREEDY = {"temperature": 0, "seed": 1}


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports nothing listens on (router k's is +k-1)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65536:
            continue
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


class Cluster:
    """`deploy/cluster.py` as a user runs it, its hosts and routers read from what it prints."""

    def __init__(self, containers: list[Path], work: Path, lib: Path, *, serve_args: str = "",
                 host_args: tuple[str, ...] = (), env: Optional[dict] = None, routers: int = 1,
                 restart_hosts: bool = False):
        self.port = free_ports(routers)
        self.ports = [self.port + k for k in range(routers)]  # router k + 1's
        self.dir = work
        command = [sys.executable, str(SCRIPT), *map(str, containers), "--port", str(self.port),
                   "--dir", str(work), f"--serve-args=--quiet --lib {lib} --prefix-cache-min 16 {serve_args}",
                   *(f"--host-args={spec}" for spec in host_args), "--routers", str(routers),
                   *(["--restart-hosts"] if restart_hosts else [])]
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("WASTE_", "SERVE_ROUTER"))}
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**environment, **(env or {})})
        self.hosts: dict[str, tuple[int, int]] = {}    # name -> (port, pid)
        self.routers: dict[int, int] = {}              # port -> pid
        self.lines: list[str] = []
        self.changed = threading.Condition()
        for line in self.proc.stdout:
            self.read(line)
            if line.strip() == "ready":
                break
        else:
            raise AssertionError("the cluster did not start:\n" + "".join(self.lines))
        threading.Thread(target=lambda: [self.read(line) for line in self.proc.stdout], daemon=True).start()

    def read(self, line: str) -> None:
        """One line the script printed: a host or router (again) and its pid."""
        with self.changed:
            self.lines.append(line)
            found = re.match(r"host (h\d+) (?:restarted )?http://127\.0\.0\.1:(\d+) .*pid=(\d+)", line)
            if found:
                self.hosts[found.group(1)] = (int(found.group(2)), int(found.group(3)))
            found = re.match(r"router (?:r\d+ \w+ )?http://127\.0\.0\.1:(\d+) pid=(\d+)", line)
            if found:
                self.routers[int(found.group(1))] = int(found.group(2))
            self.changed.notify_all()

    def wait_line(self, pattern: str, since: int = 0, timeout: float = 120) -> None:
        """Until the script prints a line that matches, after its first `since` lines."""
        with self.changed:
            assert self.changed.wait_for(lambda: any(re.match(pattern, line) for line in self.lines[since:]),
                                         timeout), (pattern, "".join(self.lines))

    def host_of(self, reply_headers: dict) -> str:
        """The router's name for the host that wrote a reply, from its X-Serve-Host."""
        port = int(reply_headers["x-serve-host"].rsplit(":", 1)[1])
        return next(name for name, (p, _) in self.hosts.items() if p == port)

    def router_log(self) -> str:
        return (self.dir / "router" / "haproxy.log").read_text()

    def admin(self, command: str) -> str:
        """A command on the (first) router's admin socket."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.dir / "router" / "admin.sock"))
            s.sendall(command.encode() + b"\n")
            return b"".join(iter(lambda: s.recv(65536), b"")).decode()

    def state(self, host: str) -> str:
        rows = self.admin("show stat").splitlines()
        header = rows[0].lstrip("# ").split(",")
        return next(dict(zip(header, r.split(",")))["status"] for r in rows[1:]
                    if r.split(",")[1] == host)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def three_hosts(lib_path, k3_container, tmp_path_factory):
    """Three hosts of K3, shared by the tests that neither kill, drain, warm nor slow one."""
    cluster = Cluster([k3_container] * 3, tmp_path_factory.mktemp("three"), lib_path)
    yield cluster
    cluster.stop()


@pytest.fixture
def start(lib_path, tmp_path):
    started: list[Cluster] = []

    def run(*containers: Path, **options) -> Cluster:
        started.append(Cluster(list(containers), tmp_path / f"cluster{len(started)}", lib_path, **options))
        return started[-1]

    yield run
    for cluster in started:
        cluster.stop()


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes, error: Optional[str] = None):
        self.status, self.headers, self.body, self.error = status, headers, body, error

    def json(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.body.decode().split("\n")
                if line.startswith("data: {")]


def send(port: int, path: str, body: dict, headers: Optional[dict] = None, method: str = "POST") -> Reply:
    """One request; the body is read whole, a cut chunked body becoming the error it is."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, json.dumps(body) if method == "POST" else None,
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        head = {k.lower(): v for k, v in resp.getheaders()}
        try:
            return Reply(resp.status, head, resp.read())
        except http.client.IncompleteRead as e:
            return Reply(resp.status, head, e.partial, error="IncompleteRead")
    finally:
        conn.close()


# ---- what the router needs from serve ---------------------------------------------------

def test_every_reply_names_its_host_and_a_stream_ends_with_the_last_chunk(lib_path, k3_container, tmp_path):
    with serving(k3_container, lib_path, tmp_path) as port:
        plain = send(port, "/v1/models", {}, method="GET")
        assert plain.headers["x-serve-host"].endswith(f":{port}")
        raw = read_all(post_open(port, {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                        "max_tokens": 3}))
        head = raw.split(b"\r\n\r\n", 1)[0].lower()
        assert b"transfer-encoding: chunked" in head and b"x-serve-host: " in head
        assert raw.endswith(b"\r\n0\r\n\r\n") and dechunk(raw).endswith(b"data: [DONE]\n\n")
        # HTTP/1.0 has no chunks: the stream ends with the connection, as before.
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            body = json.dumps({"prompt": "hi", "stream": True, "max_tokens": 2}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            old = read_all(s)
        assert b"chunked" not in old.split(b"\r\n\r\n")[0].lower() and old.endswith(b"data: [DONE]\n\n")


class serving:
    """One plain serve host, for what it answers on its own."""

    def __init__(self, container: Path, lib: Path, tmp: Path):
        self.args = [sys.executable, "-m", "serve", str(container), "--lib", str(lib), "--port", "0",
                     "--quiet", "--prefix-cache-dir", str(tmp / "prefix"), "--usage", str(tmp / "usage.waste")]

    def __enter__(self) -> int:
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        for line in self.proc.stdout:
            if line.startswith("listen"):
                return int(line.rsplit(":", 1)[1].split("/")[0])
        raise AssertionError("serve did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


# ---- affinity ---------------------------------------------------------------------------

DIALECTS = {
    # API, the key its agent sends, where the reply's text and the cached count are
    "chat+openwebui": ("/v1/chat/completions", lambda c: ({"X-OpenWebUI-Chat-Id": c}, {})),
    "chat+user": ("/v1/chat/completions", lambda c: ({}, {"user": c})),
    "messages+claude-code": ("/v1/messages", lambda c: ({"x-claude-code-session-id": c}, {})),
    "messages+claude-code-2": ("/v1/messages", lambda c: ({"x-claude-code-session-id": c}, {})),
    "responses+codex": ("/v1/responses", lambda c: ({}, {"prompt_cache_key": c})),
    "responses+codex-2": ("/v1/responses", lambda c: ({}, {"prompt_cache_key": c})),
}


def converse(port: int, dialect: str, turns: int, stream_every: int = 2) -> list[tuple[dict, int, dict]]:
    """One conversation: (reply headers, cached tokens, key headers) per turn."""
    path, key = DIALECTS[dialect]
    headers, fields = key(f"{dialect}-{time.monotonic_ns()}")
    history: list = []
    seen = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"{dialect}: question {turn} about "
                        + " ".join(f"topic{turn}-{i}" for i in range(12))})
        stream = turn % stream_every == 1
        if path == "/v1/chat/completions":
            body = {"messages": history, "max_tokens": 6, "reasoning_effort": "none",
                    **({"stream_options": {"include_usage": True}} if stream else {})}
        elif path == "/v1/messages":
            body = {"messages": history, "max_tokens": 6}
        else:
            body = {"input": history, "max_output_tokens": 6, "store": False}
        reply = send(port, path, {"model": "k3", **body, **fields, **GREEDY, "stream": stream}, headers)
        assert reply.status == 200 and not reply.error, (dialect, turn, reply.status, reply.body[-300:])
        text, cached = read_reply(path, reply, stream)
        history.append({"role": "assistant", "content": text})
        seen.append((reply.headers, cached, headers))
    return seen


def read_reply(path: str, reply: Reply, stream: bool) -> tuple[str, int]:
    """The reply's text and its cached prompt tokens, in each API's own fields."""
    if not stream:
        got = reply.json()
        if path == "/v1/chat/completions":
            return got["choices"][0]["message"]["content"], got["usage"]["prompt_tokens_details"]["cached_tokens"]
        if path == "/v1/messages":
            text = "".join(b.get("text", "") for b in got["content"])
            return text, got["usage"]["cache_read_input_tokens"]
        text = "".join(p["text"] for o in got["output"] if o["type"] == "message" for p in o["content"])
        return text, got["usage"]["input_tokens_details"]["cached_tokens"]
    events = reply.events()
    if path == "/v1/chat/completions":
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        usage = next(e["usage"] for e in events if e.get("usage"))
        return text, usage["prompt_tokens_details"]["cached_tokens"]
    if path == "/v1/messages":
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        return text, next(e for e in events if e["type"] == "message_delta")["usage"]["cache_read_input_tokens"]
    done = events[-1]["response"]  # response.completed, or .incomplete at max_output_tokens
    assert done["status"] in ("completed", "incomplete")
    text = "".join(p["text"] for o in done["output"] if o["type"] == "message" for p in o["content"])
    return text, done["usage"]["input_tokens_details"]["cached_tokens"]


@needs_router
def test_six_conversations_in_three_apis_each_stay_on_their_host(three_hosts):
    cluster = three_hosts
    with ThreadPoolExecutor(len(DIALECTS)) as pool:
        runs = dict(zip(DIALECTS, pool.map(lambda d: converse(cluster.port, d, 4), DIALECTS)))
    used = set()
    for dialect, turns in runs.items():
        hosts = [cluster.host_of(headers) for headers, _, _ in turns]
        assert len(set(hosts)) == 1, (dialect, hosts)
        assert all(cached > 0 for _, cached, _ in turns[1:]), (dialect, [c for _, c, _ in turns])
        used.add(hosts[0])
    # Six conversations starting together on three hosts: the least loaded took each new one.
    assert len(used) >= 2, runs
    # The router's own log says the same: every request of a conversation's key on one host.
    placed: dict[str, set] = {}
    for line in cluster.router_log().splitlines():
        found = re.search(r"POST /v1/\S+ 200 conv=(\S+) model=k3 host=(h\d)", line)
        if found:
            placed.setdefault(found.group(1), set()).add(found.group(2))
    keys = [next(iter(h.values())) for turns in runs.values() for h in [turns[0][2]] if h]
    for key in keys:
        assert len(placed[key]) == 1, (key, placed[key])
    assert len([k for k in placed if k in keys]) == len(keys)


@needs_router
def test_a_draining_host_keeps_its_conversations_and_takes_no_new_ones(start, k3_container):
    cluster = start(k3_container, k3_container)
    key = {"x-claude-code-session-id": f"drain-{time.monotonic_ns()}"}
    first = send(cluster.port, "/v1/messages", {"model": "k3", "max_tokens": 4, **GREEDY,
                                                "messages": [{"role": "user", "content": "before"}]}, key)
    home = cluster.host_of(first.headers)
    cluster.admin(f"set server model1/{home} state drain")  # what an operator does before maintenance
    assert cluster.state(home) == "DRAIN"
    later = send(cluster.port, "/v1/messages", {"model": "k3", "max_tokens": 4, **GREEDY,
                                                "messages": [{"role": "user", "content": "before"},
                                                             {"role": "assistant", "content": "x"},
                                                             {"role": "user", "content": "after"}]}, key)
    assert later.status == 200 and cluster.host_of(later.headers) == home
    fresh = [send(cluster.port, "/v1/messages", {"model": "k3", "max_tokens": 4, **GREEDY,
                                                 "messages": [{"role": "user", "content": f"new {i}"}]},
                  {"x-claude-code-session-id": f"new-{i}-{time.monotonic_ns()}"}) for i in range(4)]
    assert [r.status for r in fresh] == [200] * 4
    assert home not in {cluster.host_of(r.headers) for r in fresh}


# ---- load and warming -------------------------------------------------------------------

@needs_router
def test_a_warming_host_gets_no_new_conversations(start, k3_container, tmp_path):
    warm = tmp_path / "preamble.json"  # long enough to warm through the whole test at this clock
    warm.write_text(json.dumps({"messages": [{"role": "system", "content": " ".join(["w"] * 1500)}]}))
    cluster = start(k3_container, k3_container, host_args=(f"2:--warm {warm}",),
                    env={"WASTE_DELAY_MS": "25"})
    assert cluster.state("h2") == "NOLB", cluster.admin("show stat")  # checked before `ready`
    replies = [send(cluster.port, "/v1/chat/completions",
                    {"model": "k3", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2},
                    {"x-claude-code-session-id": f"new-{i}"}) for i in range(5)]
    assert [r.status for r in replies] == [200] * 5
    assert {cluster.host_of(r.headers) for r in replies} == {"h1"}
    health = send(cluster.hosts["h2"][0], "/health", {}, method="GET")
    assert health.status == 200 and json.loads(health.body)["warming"] is not None  # warming all along


@needs_router
def test_a_new_conversation_goes_to_the_host_that_is_not_busy(start, k3_container):
    cluster = start(k3_container, k3_container, env={"WASTE_DELAY_MS": "10"})
    results: list[Reply] = []
    long = threading.Thread(target=lambda: results.append(send(
        cluster.port, "/v1/completions", {"model": "k3", "prompt": "a long one", "max_tokens": 600, **GREEDY},
        {"x-claude-code-session-id": "long"})))
    long.start()
    deadline = time.monotonic() + 60
    while not (busy := in_flight(cluster)):
        assert time.monotonic() < deadline, "the long request never reached a host"
        time.sleep(0.05)
    fresh = [send(cluster.port, "/v1/completions", {"model": "k3", "prompt": f"new {i}", "max_tokens": 2},
                  {"x-claude-code-session-id": f"fresh-{i}"}) for i in range(4)]
    long.join()
    assert results[0].status == 200 and cluster.host_of(results[0].headers) == busy[0]
    assert [r.status for r in fresh] == [200] * 4
    assert busy[0] not in {cluster.host_of(r.headers) for r in fresh}


def in_flight(cluster: Cluster) -> list[str]:
    """The hosts with a request in flight, as the router counts them (its admin socket)."""
    rows = cluster.admin("show stat").splitlines()
    header = rows[0].lstrip("# ").split(",")
    return [f["svname"] for f in (dict(zip(header, r.split(","))) for r in rows[1:])
            if f.get("svname", "").startswith("h") and int(f["scur"] or 0) > 0]


# ---- failover ---------------------------------------------------------------------------

@needs_router
def test_a_killed_host_moves_its_conversations_and_loses_nothing_sent_after(start, k3_container):
    # A slow clock, so that the killed host's two requests are still running when it dies.
    cluster = start(k3_container, k3_container, k3_container, env={"WASTE_DELAY_MS": "15"})
    keys = [{"x-claude-code-session-id": f"conv-{i}-{time.monotonic_ns()}"} for i in range(6)]
    histories = [[{"role": "user", "content": f"conversation {i} begins " + "words " * 20}] for i in range(6)]

    def turn(i: int, stream: bool = False, max_tokens: int = 4) -> Reply:
        return send(cluster.port, "/v1/messages", {"model": "k3", "messages": histories[i], **GREEDY,
                                                   "max_tokens": max_tokens, "stream": stream}, keys[i])

    first = [turn(i) for i in range(6)]
    homes = [cluster.host_of(r.headers) for r in first]
    victim = homes[0]
    mine = [i for i in range(6) if homes[i] == victim]
    for i in range(6):
        histories[i] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on " * 10}]
    # Two of the victim's requests in flight, one blocking and one streamed: the first waits
    # in line behind the second, which holds the engine.
    cut: dict[str, Reply] = {}
    streamed = threading.Thread(target=lambda: cut.update(stream=turn(0, True, 2000)))
    streamed.start()
    # The stream holds the victim's engine (its /health says so) before the blocking request
    # is sent: in flight at the router is not yet in the host's line.
    while not json.loads(send(cluster.hosts[victim][0], "/health", {}, method="GET").body)["busy"]:
        time.sleep(0.05)
    blocking = threading.Thread(target=lambda: cut.update(blocking=send(
        cluster.port, "/v1/messages", {"model": "k3", "messages": [{"role": "user", "content": "wait"}],
                                       "max_tokens": 4}, keys[0])))
    blocking.start()
    time.sleep(1.0)
    port, pid = cluster.hosts[victim]
    os.kill(pid, signal.SIGKILL)
    while listening(port):  # the kernel closes its sockets a moment after the signal
        time.sleep(0.01)
    # At once, before any health check has seen it: every conversation's next turn, concurrently.
    with ThreadPoolExecutor(6) as pool:
        after = list(pool.map(turn, range(6)))
    streamed.join()
    blocking.join()
    # The streamed reply was cut: the client sees a broken body, never a finished-looking one.
    assert cut["stream"].status == 200 and cut["stream"].error == "IncompleteRead"
    assert b"message_stop" not in cut["stream"].body
    # The blocking one had no answer yet, not a byte: the router sent it to another host.
    assert cut["blocking"].status == 200 and cluster.host_of(cut["blocking"].headers) != victim
    # Nothing sent after the failure was lost; the victim's conversations moved, and restored
    # there what the victim had published to the shared tier; the others stayed where they were.
    assert [r.status for r in after] == [200] * 6, [r.body[-200:] for r in after]
    for i, reply in enumerate(after):
        where = cluster.host_of(reply.headers)
        cached = reply.json()["usage"]["cache_read_input_tokens"]
        if i in mine:
            assert where != victim and cached > 0, (i, where, cached)
        else:
            assert where == homes[i] and cached > 0, (i, where, cached)
    # Their next turn stays on the new host, and reuses what it prefilled.
    for i in mine:
        histories[i] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        again = turn(i)
        assert cluster.host_of(again.headers) == cluster.host_of(after[i].headers)
        assert again.json()["usage"]["cache_read_input_tokens"] > 0
    assert any(f"host {victim} exited (-9)" in line for line in cluster.lines)


def messages_turn(port: int, key: str, text: str = "hello") -> Reply:
    return send(port, "/v1/messages", {"model": "k3", "max_tokens": 2, **GREEDY,
                                       "messages": [{"role": "user", "content": text}]},
                {"x-claude-code-session-id": key})


@needs_router
@pytest.mark.soak
def test_a_turn_sent_as_its_host_is_killed_is_served_by_another(start, k3_container, soak):
    cluster = start(k3_container, k3_container, k3_container, restart_hosts=True)
    # The host accepted the connection (its kernel did) and died without reading it or
    # answering a byte: what a request meets a few ms after a SIGKILL, here every time.
    key = f"stopped-{time.monotonic_ns()}"
    home = cluster.host_of(messages_turn(cluster.port, key).headers)
    pid = cluster.hosts[home][1]
    since = len(cluster.lines)
    os.kill(pid, signal.SIGSTOP)
    replies: list[Reply] = []
    sent = threading.Thread(target=lambda: replies.append(messages_turn(cluster.port, key)))
    sent.start()
    while home not in in_flight(cluster):
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    sent.join()
    assert replies[0].status == 200 and cluster.host_of(replies[0].headers) != home
    # Sent again by the router, to another host (`+`: redispatched); logged as the reply ends.
    deadline = time.monotonic() + 30
    while not re.search(rf"POST /v1/messages 200 conv={key} .* retries=\+1", cluster.router_log()):
        assert time.monotonic() < deadline, cluster.router_log()
        time.sleep(0.05)
    cluster.wait_line(rf"host {home} restarted", since)
    # A turn sent 0 to 10 ms after its host's SIGKILL: refused, or accepted and reset.
    trials = 20 if soak else 4
    for trial in range(trials):
        deadline = time.monotonic() + 60
        while any(cluster.state(name) != "UP" for name in cluster.hosts):  # the last one back
            assert time.monotonic() < deadline, cluster.admin("show stat")
            time.sleep(0.05)
        key = f"killed-{trial}-{time.monotonic_ns()}"
        home = cluster.host_of(messages_turn(cluster.port, key).headers)
        since = len(cluster.lines)
        os.kill(cluster.hosts[home][1], signal.SIGKILL)
        time.sleep(0.010 * trial / (trials - 1))
        reply = messages_turn(cluster.port, key)
        assert reply.status == 200, (trial, reply.status, reply.body[-300:])
        assert cluster.host_of(reply.headers) != home
        cluster.wait_line(rf"host {home} restarted", since)


# ---- several routers --------------------------------------------------------------------

@needs_router
def test_two_routers_keep_each_conversation_and_stored_response_on_its_host_through_restarts(start, k3_container):
    cluster = start(k3_container, k3_container, k3_container, routers=2)
    keys = [f"routers-{i}-{time.monotonic_ns()}" for i in range(4)]
    homes: dict[str, str] = {}     # conversation key or stored response id -> its host
    previous = None

    def turns(ports: list[int], number: int) -> None:
        """One turn of every conversation, each through the next router in `ports`, and the
        stored responses read back by id; all on their homes (the first turn sets them)."""
        nonlocal previous
        for n, key in enumerate(keys):
            reply = messages_turn(ports[(n + number) % len(ports)], key, f"{key} turn {number}")
            assert reply.status == 200, reply.body[-300:]
            assert homes.setdefault(key, cluster.host_of(reply.headers)) == cluster.host_of(reply.headers), (number, key)
        # A Responses chain without a key: only its stored response says where it lives.
        reply, response = chain_turn(ports[number % len(ports)], f"chain turn {number}", previous)
        if previous:
            assert cluster.host_of(reply.headers) == homes[previous]
        previous = response["id"]
        homes[previous] = cluster.host_of(reply.headers)
        for n, stored in enumerate(k for k in homes if k.startswith("resp_")):
            got = send(ports[n % len(ports)], f"/v1/responses/{stored}", {}, method="GET")
            assert got.status == 200 and cluster.host_of(got.headers) == homes[stored], (number, stored)

    turns(cluster.ports, 0)
    turns(cluster.ports, 1)   # each conversation through the other router now
    assert len(set(homes.values())) >= 2, homes   # spread: a router without the tables would move some
    # The first router dies and is started again: it learns the tables from the second.
    since = len(cluster.lines)
    os.kill(cluster.routers[cluster.ports[0]], signal.SIGKILL)
    cluster.wait_line(r"router r1 restarted", since)
    turns(cluster.ports[:1], 2)
    # Both reloaded in turn (SIGHUP): each new process gets the tables from its old one, and
    # takes over its listening socket: a client sending meanwhile sees nothing of it.
    since = len(cluster.lines)
    cluster.proc.send_signal(signal.SIGHUP)
    during = []
    while not any(line.startswith("router r2 reloaded") for line in cluster.lines[since:]):
        during.append(messages_turn(cluster.ports[0], keys[0], "during the reload"))
    assert during and all(r.status == 200 and cluster.host_of(r.headers) == homes[keys[0]] for r in during)
    turns(cluster.ports, 3)
    turns(cluster.ports[1:], 4)


# ---- models and access ------------------------------------------------------------------

@needs_router
def test_two_models_behind_one_router(start, k3_container, kimi_linear_container):
    cluster = start(k3_container, kimi_linear_container)
    for model, host in (("k3", "h1"), ("kl", "h2")):
        for i in range(3):
            reply = send(cluster.port, "/v1/chat/completions",
                         {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
                         {"x-claude-code-session-id": f"same-session-{i}"})
            assert reply.status == 200 and reply.json()["model"] == model
            assert cluster.host_of(reply.headers) == host
        one = send(cluster.port, f"/v1/models/{model}", {}, method="GET")
        assert one.status == 200 and one.json()["id"] == model and cluster.host_of(one.headers) == host
        # A stored response is found by its id alone, whichever model's host wrote it.
        made = send(cluster.port, "/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 2})
        assert made.status == 200 and cluster.host_of(made.headers) == host
        kept = send(cluster.port, f"/v1/responses/{made.json()['id']}", {}, method="GET")
        assert kept.status == 200 and cluster.host_of(kept.headers) == host
    listed = send(cluster.port, "/v1/models", {}, method="GET").json()
    assert listed["object"] == "list" and sorted(m["id"] for m in listed["data"]) == ["k3", "kl"]


@needs_router
def test_the_router_asks_for_its_api_key(start, k3_container):
    cluster = start(k3_container, env={"SERVE_ROUTER_API_KEY": "sesame"})
    body = {"model": "k3", "prompt": "hi", "max_tokens": 2}
    refused = send(cluster.port, "/v1/completions", body)
    assert refused.status == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert send(cluster.port, "/v1/completions", body, {"Authorization": "Bearer wrong"}).status == 401
    assert send(cluster.port, "/v1/completions", body, {"Authorization": "Bearer sesame"}).status == 200
    assert send(cluster.port, "/v1/completions", body, {"x-api-key": "sesame"}).status == 200
    assert send(cluster.port, "/health", {}, method="GET").status == 200  # for load balancers in front


@needs_router
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_the_router_serves_https_with_a_key_in_front_of_hosts_with_their_own(start, k3_container, tmp_path):
    pem = tmp_path / "router.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    pem.write_bytes((tmp_path / "cert.pem").read_bytes() + (tmp_path / "key.pem").read_bytes())
    cluster = start(k3_container, serve_args="--api-key host-secret",
                    env={"SERVE_ROUTER_CERT": str(pem), "SERVE_ROUTER_API_KEY": "team-secret",
                         "SERVE_HOST_API_KEY": "host-secret"})
    context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    context.check_hostname = False

    def ask(key: str) -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", cluster.port, context=context, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "k3", "prompt": "hi", "max_tokens": 2}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        status = conn.getresponse().status
        conn.close()
        return status

    # The team's key opens the router; the router sends the hosts' own key, which no client knows.
    assert ask("team-secret") == 200
    assert ask("host-secret") == 401
    with pytest.raises((ConnectionError, http.client.BadStatusLine)):
        send(cluster.port, "/v1/completions", {"prompt": "hi"})  # plain HTTP on the TLS port


@needs_router
def test_conversations_without_a_key_stay_with_their_first_message_in_all_four_apis(three_hosts):
    cluster = three_hosts
    system = {"role": "system", "content": "You are terse."}

    def conversation(n: int) -> set:
        path = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions")[n % 4]
        opening = f"conversation {n}: " + " ".join(f"w{n}-{i}" for i in range(20))
        history, hosts = [], set()
        for turn in range(3):
            history.append({"role": "user", "content": opening if turn == 0 else f"and then {turn}"})
            if path == "/v1/chat/completions":
                body = {"messages": [system, *history], "max_tokens": 3}
            elif path == "/v1/messages":
                body = {"system": "You are terse.", "messages": history, "max_tokens": 3}
            elif path == "/v1/responses":
                body = {"input": history, "max_output_tokens": 3, "store": False}
            else:
                body = {"prompt": " ".join(m["content"] for m in history), "max_tokens": 3}
            reply = send(cluster.port, path, {"model": "k3", **body, **GREEDY})
            assert reply.status == 200, reply.body[-300:]
            hosts.add(cluster.host_of(reply.headers))
            history.append({"role": "assistant", "content": "ok"})
        return hosts

    with ThreadPoolExecutor(4) as pool:
        placed = list(pool.map(conversation, range(8)))
    assert all(len(hosts) == 1 for hosts in placed), placed
    assert len(set().union(*placed)) >= 2, placed  # and they were spread, not all sent to one host


# ---- stored Responses -------------------------------------------------------------------

def chain_turn(port: int, text: str, previous: Optional[str], stream: bool = False,
               headers: Optional[dict] = None, **fields) -> tuple[Reply, dict]:
    """One stored Responses turn, chained by previous_response_id alone: (the reply, its Response)."""
    body = {"model": "k3", "input": text, "max_output_tokens": 4, "store": True,
            "reasoning": {"effort": "none"}, **GREEDY, "stream": stream, **fields}
    if previous:
        body["previous_response_id"] = previous
    reply = send(port, "/v1/responses", body, headers)
    assert reply.status == 200 and not reply.error, (text, reply.status, reply.body[-300:])
    response = reply.events()[-1]["response"] if stream else reply.json()
    # The id the router remembers the host by, in the headers (a stream's go out before its events).
    assert reply.headers["x-serve-response-id"] == response["id"]
    return reply, response


@needs_router
def test_a_responses_chain_without_a_key_stays_with_its_stored_responses(three_hosts):
    cluster = three_hosts
    previous, ids, hosts, cached = None, [], [], []
    for turn in range(4):  # no key at all: each turn's input is only its new message
        reply, response = chain_turn(cluster.port, f"chain turn {turn}: "
                                     + " ".join(f"c{turn}-{i}" for i in range(12)), previous, stream=turn == 2)
        previous = response["id"]
        ids.append(previous)
        hosts.append(cluster.host_of(reply.headers))
        cached.append(response["usage"]["input_tokens_details"]["cached_tokens"])
    home = hosts[0]
    assert hosts == [home] * 4 and all(c > 0 for c in cached[1:]), (hosts, cached)
    # Retrieval by id alone, one after the other: leastconn alone would spread them on the three.
    for response_id in ids:
        got = send(cluster.port, f"/v1/responses/{response_id}", {}, method="GET")
        assert got.status == 200 and got.json()["id"] == response_id, got.body[-300:]
        assert cluster.host_of(got.headers) == home
    deleted = send(cluster.port, f"/v1/responses/{ids[0]}", {}, method="DELETE")
    assert deleted.status == 200 and deleted.json() == {"id": ids[0], "object": "response.deleted",
                                                        "deleted": True}
    assert cluster.host_of(deleted.headers) == home
    # Gone from its host: the router still sends it there, and the host says it is not found.
    gone = send(cluster.port, f"/v1/responses/{ids[0]}", {}, method="GET")
    assert gone.status == 404 and cluster.host_of(gone.headers) == home
    assert gone.json()["error"]["code"] == "not_found" and gone.json()["error"]["param"] == "response_id"


@needs_router
def test_a_stored_response_outranks_the_conversation_key_and_the_key_follows_it(three_hosts):
    cluster = three_hosts
    first, response = chain_turn(cluster.port, "where the chain began", None)
    home = cluster.host_of(first.headers)
    # A key already placed on another host (new keys go round the idle hosts: a few tries at most).
    for attempt in range(6):
        key = {"prompt_cache_key": f"elsewhere-{attempt}-{time.monotonic_ns()}"}
        placed, _ = chain_turn(cluster.port, "a conversation of its own", None, **key)
        if cluster.host_of(placed.headers) != home:
            break
    else:
        raise AssertionError("every new key went to the chain's host")
    # Continuing the chain under that key: the stored response's host answers, not the key's.
    later, _ = chain_turn(cluster.port, "and on", response["id"], **key)
    assert cluster.host_of(later.headers) == home
    # The key now names that host too, so the two never disagree on a later turn.
    alone, _ = chain_turn(cluster.port, "the key alone", None, **key)
    assert cluster.host_of(alone.headers) == home


@needs_router
def test_a_response_the_router_never_saw_gets_the_hosts_own_error(three_hosts):
    cluster = three_hosts
    unknown = "resp_" + "0" * 32
    refused = send(cluster.port, "/v1/responses", {"model": "k3", "input": "hi", "max_output_tokens": 2,
                                                   "previous_response_id": unknown})
    # Placed as any request is, and answered by the host (X-Serve-Host) as OpenAI answers it.
    assert refused.status == 400 and "x-serve-host" in refused.headers
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and unknown in error["message"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "previous_response_id", "previous_response_not_found")
    for method in ("GET", "DELETE"):
        missing = send(cluster.port, f"/v1/responses/{unknown}", {}, method=method)
        assert missing.status == 404 and "x-serve-host" in missing.headers
        assert missing.json()["error"]["code"] == "not_found"
