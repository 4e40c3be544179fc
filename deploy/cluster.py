#!/usr/bin/env python3
"""Several serve hosts behind HAProxy on this machine: one command, for trying it out and for tests.

    python3 deploy/cluster.py --hosts 3 build/demo.waste            # three hosts of one model
    python3 deploy/cluster.py build/demo.waste build/kl.waste       # one host each of two models

Each host is `python3 -m serve CONTAINER` on a loopback port of its own, with its
own --prefix-cache-dir and --usage under --dir, and every host shares one
--shared-cache, DIR/shared (--no-shared-cache: none); the router is HAProxy with
deploy/haproxy.cfg and the backends file written here (one backend per model).
It prints one line per host and one for the router, then `ready` once the router
has checked every host, and runs until interrupted; a host that dies is
reported and the rest go on (that is what the router is for).

Across machines, start serve on each and write the router's files from their
addresses instead: `python3 deploy/cluster.py --write-router DIR http://ws1:8000 ...`
(docs/serving-a-team.md). Standard library only, like serve.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "haproxy.cfg"
READY_SECONDS = 120.0


@dataclass
class Host:
    name: str        # the router's name for it: h1, h2, ...
    url: str         # http://address:port
    model: dict      # what its /v1/models lists
    pid: Optional[int] = None


RESPONSES = "responses"   # the backend of /v1/responses/{id}..., and the table of stored responses' hosts
POLICIES = {
    # each conversation on the host of its first turn, new ones on the least loaded: the default.
    # A stored response's host comes first: a request naming one (previous_response_id) goes
    # where it is kept, and the host's X-Serve-Response-Id on a reply says where that is.
    "affinity": ["    stick-table type string len 256 size 100k expire 7d",
                 f"    stick match var(txn.response) table {RESPONSES}",
                 "    stick on var(txn.conversation)",
                 f"    stick store-response res.hdr(x-serve-response-id) table {RESPONSES}"],
    # for comparison (bench/cluster.py): every request to the least loaded, or to the next host
    "leastconn": [],
    "roundrobin": ["    balance roundrobin"],
}


def backends_cfg(hosts: list[Host], policy: str = "affinity") -> str:
    """One backend per model, named model1, model2... in order of first appearance, and
    the `responses` backend.

    The conversations' stick table lives in each model's backend: the same conversation
    key asking for two models (an agent's main and small model) is then placed on each
    model's hosts apart. The stored responses' table is one, in `responses`, shared by
    every backend: a retrieval by id names no model. A shared table records hosts by
    server id, so each host has the same id everywhere.
    """
    ids = {host.name: n for n, host in enumerate(hosts, 1)}
    lines = []
    homes = {}
    for n, (model, members) in enumerate(by_model(hosts).items(), 1):
        lines += [f"backend model{n}  # {model}", *POLICIES[policy]]
        for host in members:
            lines.append(f"    server {host.name} {address(host)} id {ids[host.name]}")
            homes[host.name] = f"model{n}"
        lines.append("")
    # Every host, in the state its model's backend checks: an id the table does not know
    # (expired, or never seen) goes to the least loaded host, whose 404 is the answer.
    lines += [f"backend {RESPONSES}  # GET, DELETE /v1/responses/{{id}}...: the host that stored it",
              "    stick-table type string len 64 size 100k expire 7d",
              "    stick match var(txn.response)"]
    lines += [f"    server {host.name} {address(host)} id {ids[host.name]} no-check "
              f"track {homes[host.name]}/{host.name}" for host in hosts]
    return "\n".join(lines + [""])


def address(host: Host) -> str:
    return host.url.split("://", 1)[1].rstrip("/")


def by_model(hosts: Iterable[Host]) -> dict[str, list[Host]]:
    grouped: dict[str, list[Host]] = {}
    for host in hosts:
        grouped.setdefault(host.model["id"], []).append(host)
    return grouped


def write_router_files(directory: Path, hosts: list[Host], policy: str = "affinity") -> None:
    """backends.cfg, models.map (model id -> backend) and models.json (the union) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    grouped = by_model(hosts)
    (directory / "backends.cfg").write_text(backends_cfg(hosts, policy))
    (directory / "models.map").write_text(
        "".join(f"{model} model{n}\n" for n, model in enumerate(grouped, 1)))
    union = {"object": "list", "data": [members[0].model for members in grouped.values()]}
    (directory / "models.json").write_text(json.dumps(union))


def ask_model(url: str, timeout: float = 10.0) -> dict:
    """The one model a serve host lists (asked with $SERVE_HOST_API_KEY when the hosts have a key)."""
    key = os.environ.get("SERVE_HOST_API_KEY")
    asked = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(asked, timeout=timeout) as reply:
        return json.load(reply)["data"][0]


# ---- local hosts ------------------------------------------------------------------------

def start_host(container: Path, name: str, directory: Path, serve_args: list[str]) -> tuple[Host, subprocess.Popen]:
    """`python3 -m serve` on an ephemeral loopback port; returns once it listens."""
    directory.mkdir(parents=True, exist_ok=True)
    log = open(directory / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", str(container), "--host", "127.0.0.1", "--port", "0",
         "--prefix-cache-dir", str(directory / "prefix"), "--usage", str(directory / "usage.waste"),
         *serve_args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    log.close()
    try:
        url = None
        for line in proc.stdout:  # the banner; its last line says where it listens
            found = re.match(r"listen\s+(http://[^/\s]+)", line)  # http://127.0.0.1:PORT/v1
            if found:
                url = found.group(1)
                break
        if url is None:
            raise RuntimeError(f"{name} did not start:\n{(directory / 'serve.log').read_text()}")
        host = Host(name, url, ask_model(url), proc.pid)
    except BaseException:
        proc.kill()  # not yet the caller's to stop
        proc.wait()
        raise
    # The rest of its stdout (--warm progress) goes to the log's neighbour, never blocking it.
    threading.Thread(target=_drain, args=(proc.stdout, directory / "stdout.log"), daemon=True).start()
    return host, proc


def _drain(stream, path: Path) -> None:
    with open(path, "a") as out:
        for line in stream:
            out.write(line)
            out.flush()


# ---- the router -------------------------------------------------------------------------

def haproxy_binary() -> str:
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)
    if not found:
        raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy; `make router`)")
    return found


def start_router(directory: Path, bind: str, env: Optional[dict] = None) -> subprocess.Popen:
    """HAProxy in the foreground, its log (one line per request) in directory/haproxy.log."""
    environment = {**os.environ, **(env or {}), "SERVE_ROUTER_BIND": bind,
                   "SERVE_ROUTER_DIR": str(directory)}
    command = [haproxy_binary(), "-db", "-f", str(CONFIG), "-f", str(directory / "backends.cfg")]
    check = subprocess.run([*command, "-c"], env=environment, capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy refused the configuration:\n{check.stdout}{check.stderr}")
    log = open(directory / "haproxy.log", "w")
    proc = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    return proc


def admin(directory: Path, command: str) -> str:
    """A command on HAProxy's admin socket (`show stat`, `set server model1/h2 state drain`...)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(directory / "admin.sock"))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def server_states(directory: Path) -> dict[str, tuple[str, str]]:
    """Each host's (status, last check) as the router sees them: ('UP', 'L7OK'), ('NOLB', 'L7OKC')..."""
    rows = admin(directory, "show stat").splitlines()
    header = rows[0].lstrip("# ").split(",")
    states = {}
    for row in rows[1:]:
        fields = dict(zip(header, row.split(",")))
        # The responses backend's servers only repeat their model's (`track`).
        if fields.get("svname") not in (None, "", "FRONTEND", "BACKEND") and fields["pxname"] != RESPONSES:
            states[fields["svname"]] = (fields["status"], fields["check_status"])
    return states


def wait_checked(directory: Path, names: list[str], proc: subprocess.Popen) -> None:
    """Until the router has checked every host once: before that it counts them all as up."""
    deadline = time.monotonic() + READY_SECONDS
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited:\n{(directory / 'haproxy.log').read_text()}")
        try:
            states = server_states(directory)
            # "INI": not checked yet; "* INI": its first check is under way.
            if all(name in states and not states[name][1].lstrip("* ").startswith("INI")
                   for name in names):
                return
        except OSError:
            pass  # the socket is not there yet
        if time.monotonic() > deadline:
            raise RuntimeError("the router did not check every host in time")
        time.sleep(0.1)


# ---- the command ------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("containers", nargs="*", metavar="CONTAINER",
                   help="one serve host per container (repeat a container for more hosts of it)")
    p.add_argument("--hosts", type=int, default=1, help="hosts per container given (default 1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    p.add_argument("--bind", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--dir", type=Path, default=ROOT / "build" / "cluster",
                   help="per host: snapshots, usage, log; the router's files in DIR/router")
    p.add_argument("--serve-args", default="",
                   help="flags for every host, e.g. \"--ctx 8192 --quiet\"")
    p.add_argument("--host-args", action="append", default=[], metavar="N:FLAGS",
                   help="flags for host N only (1-based), e.g. \"3:--warm preamble.json\"")
    p.add_argument("--no-shared-cache", action="store_true",
                   help="no shared tier (default: every host publishes to and reads DIR/shared)")
    p.add_argument("--policy", choices=list(POLICIES), default="affinity",
                   help="affinity (default), or leastconn / roundrobin for comparison")
    p.add_argument("--write-router", type=Path, metavar="DIR",
                   help="write the router's files for running hosts given as URLs, and exit")
    args = p.parse_args(argv)
    if not args.containers:
        p.error("name at least one container (or, with --write-router, host URLs)")
    return args


def write_for_remote(directory: Path, urls: list[str], policy: str) -> int:
    hosts = [Host(f"h{n}", url.rstrip("/"), ask_model(url.rstrip("/"))) for n, url in enumerate(urls, 1)]
    write_router_files(directory, hosts, policy)
    print(f"wrote {directory}/backends.cfg, models.map, models.json for "
          f"{len(hosts)} hosts; run: SERVE_ROUTER_BIND=:443 SERVE_ROUTER_DIR={directory} "
          f"haproxy -f {CONFIG} -f {directory}/backends.cfg")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.write_router:
        return write_for_remote(args.write_router, args.containers, args.policy)
    per_host: dict[int, list[str]] = {}
    for spec in args.host_args:
        number, _, flags = spec.partition(":")
        per_host.setdefault(int(number), []).extend(flags.split())
    containers = [Path(c) for c in args.containers for _ in range(args.hosts)]
    procs: list[subprocess.Popen] = []
    stopping = threading.Event()

    def stop(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # One directory every host reads and writes: snapshots, replies, stored responses.
    shared = [] if args.no_shared_cache else ["--shared-cache", str(args.dir / "shared")]
    try:
        hosts = []
        for n, container in enumerate(containers, 1):
            host, proc = start_host(container, f"h{n}", args.dir / f"h{n}",
                                    shared + args.serve_args.split() + per_host.get(n, []))
            hosts.append(host)
            procs.append(proc)
            print(f"host h{n} {host.url} model={host.model['id']} pid={proc.pid} dir={args.dir / f'h{n}'}",
                  flush=True)
        router_dir = args.dir / "router"
        write_router_files(router_dir, hosts, args.policy)
        router = start_router(router_dir, f"{args.bind}:{args.port}")
        procs.insert(0, router)
        wait_checked(router_dir, [h.name for h in hosts], router)
        print(f"router http://{args.bind}:{args.port} pid={router.pid} dir={router_dir}", flush=True)
        print("ready", flush=True)
        watch(procs, hosts, stopping)
    finally:
        for proc in procs:  # the router first: it stops taking requests for hosts about to go
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


def watch(procs: list[subprocess.Popen], hosts: list[Host], stopping: threading.Event) -> None:
    """Until stopped: say when a host exits (the router moves its conversations); stop if the router does."""
    names = {h.pid: h.name for h in hosts}
    reported: set[int] = set()
    while not stopping.wait(0.2):
        if procs[0].poll() is not None:
            print(f"router exited ({procs[0].returncode}); stopping", flush=True)
            return
        for proc in procs[1:]:
            if proc.poll() is not None and proc.pid not in reported:
                reported.add(proc.pid)
                print(f"host {names[proc.pid]} exited ({proc.returncode})", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:  # a host or the router would not start: say why, without a traceback
        sys.exit(f"cluster: {e}")
