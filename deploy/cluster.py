#!/usr/bin/env python3
"""Several serve hosts behind HAProxy on this machine: one command, for trying it out and for tests.

    python3 deploy/cluster.py --hosts 3 build/demo.waste            # three hosts of one model
    python3 deploy/cluster.py build/demo.waste build/kl.waste       # one host each of two models
    python3 deploy/cluster.py --hosts 3 --routers 2 build/demo.waste  # two routers sharing their tables

Each host is `python3 -m serve CONTAINER` on a loopback port of its own, with its
own --prefix-cache-dir and --usage under --dir, and every host shares one
--shared-cache, DIR/shared (--no-shared-cache: none); the router is HAProxy with
deploy/haproxy.cfg and the backends file written here (one backend per model).
It prints one line per host and one per router, then `ready` once the routers
have checked every host, and runs until interrupted; a host that dies is
reported and the rest go on (that is what the router is for), and is started
again on its port with --restart-hosts. With --routers N, router k listens on
--port + k - 1 and they share their stick tables (HAProxy's `peers`): a router
that exits is started again and learns the tables from the others, and SIGHUP
reloads the routers one after the other (HAProxy's seamless reload: no
connection refused, the tables handed over by the old process).

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
STOPPING = threading.Event()  # set by SIGTERM or SIGINT: a wait for a router gives up


class Stopped(Exception):
    """SIGTERM or SIGINT came while waiting for a router."""


@dataclass
class Host:
    name: str        # the router's name for it: h1, h2, ...
    url: str         # http://address:port
    model: dict      # what its /v1/models lists
    pid: Optional[int] = None


@dataclass
class Router:
    name: str        # its name among the routers' peers: r1, r2, ...
    port: int
    directory: Path  # its files, admin socket and log
    proc: Optional[subprocess.Popen] = None


RESPONSES = "responses"   # the backend of /v1/responses/{id}..., and the table of stored responses' hosts
PEERS = "routers"         # the peers section: several routers' stick tables, replicated among them
POLICIES = {
    # each conversation on the host of its first turn, new ones on the least loaded: the default.
    # A stored response's host comes first: a request naming one (previous_response_id) goes
    # where it is kept, and the host's X-Serve-Response-Id on a reply says where that is.
    "affinity": ["    stick-table type string len 256 size 100k expire 7d{peers}",
                 f"    stick match var(txn.response) table {RESPONSES}",
                 "    stick on var(txn.conversation)",
                 f"    stick store-response res.hdr(x-serve-response-id) table {RESPONSES}"],
    # for comparison (bench/cluster.py): every request to the least loaded, or to the next host
    "leastconn": [],
    "roundrobin": ["    balance roundrobin"],
}


def backends_cfg(hosts: list[Host], policy: str = "affinity", peers: Optional[dict[str, str]] = None) -> str:
    """One backend per model, named model1, model2... in order of first appearance, and
    the `responses` backend; with `peers` (router name -> address:port), the section that
    replicates their stick tables among the routers.

    The conversations' stick table lives in each model's backend: the same conversation
    key asking for two models (an agent's main and small model) is then placed on each
    model's hosts apart. The stored responses' table is one, in `responses`, shared by
    every backend: a retrieval by id names no model. A shared table records hosts by
    server id, so each host has the same id everywhere (and in every router: peers
    send the id).
    """
    ids = {host.name: n for n, host in enumerate(hosts, 1)}
    replicated = f" peers {PEERS}" if peers else ""
    lines = []
    if peers:
        # The same section in every router; each finds its own line by its name (haproxy -L).
        lines += [f"peers {PEERS}", *(f"    peer {name} {where}" for name, where in peers.items()), ""]
    homes = {}
    for n, (model, members) in enumerate(by_model(hosts).items(), 1):
        lines += [f"backend model{n}  # {model}", *(rule.format(peers=replicated) for rule in POLICIES[policy])]
        for host in members:
            lines.append(f"    server {host.name} {address(host)} id {ids[host.name]}")
            homes[host.name] = f"model{n}"
        lines.append("")
    # Every host, in the state its model's backend checks: an id the table does not know
    # (expired, or never seen) goes to the least loaded host, whose 404 is the answer.
    lines += [f"backend {RESPONSES}  # GET, DELETE /v1/responses/{{id}}...: the host that stored it",
              f"    stick-table type string len 64 size 100k expire 7d{replicated}",
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


def write_router_files(directory: Path, hosts: list[Host], policy: str = "affinity",
                       peers: Optional[dict[str, str]] = None) -> None:
    """backends.cfg, models.map (model id -> backend) and models.json (the union) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    grouped = by_model(hosts)
    (directory / "backends.cfg").write_text(backends_cfg(hosts, policy, peers))
    (directory / "models.map").write_text(
        "".join(f"{model} model{n}\n" for n, model in enumerate(grouped, 1)))
    union = {"object": "list", "data": [members[0].model for members in grouped.values()]}
    (directory / "models.json").write_text(json.dumps(union))


def ask_model(url: str, timeout: float = 10.0) -> dict:
    """The one model a serve host lists, asked with $SERVE_ASK_KEY (a person's key, for hosts
    on --api-keys: the router then passes each client's own) or else $SERVE_HOST_API_KEY."""
    key = os.environ.get("SERVE_ASK_KEY") or os.environ.get("SERVE_HOST_API_KEY")
    asked = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(asked, timeout=timeout) as reply:
        return json.load(reply)["data"][0]


# ---- local hosts ------------------------------------------------------------------------

def start_host(container: Path, name: str, directory: Path, serve_args: list[str],
               port: int = 0) -> tuple[Host, subprocess.Popen]:
    """`python3 -m serve` on a loopback port (0: an ephemeral one); returns once it listens.
    Started again on its port, a host appends to its log."""
    directory.mkdir(parents=True, exist_ok=True)
    log = open(directory / "serve.log", "a" if port else "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", str(container), "--host", "127.0.0.1", "--port", str(port),
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


def start_router(directory: Path, bind: str, env: Optional[dict] = None, peer: Optional[str] = None,
                 replacing: Optional[int] = None) -> subprocess.Popen:
    """HAProxy in the foreground, its log (one line per request) appended to directory/haproxy.log.

    `peer`: its name in the peers section (several routers). `replacing`: the pid of the
    router it reloads, which hands over its listening sockets and its tables, finishes its
    requests and exits (HAProxy's seamless reload)."""
    environment = {**os.environ, **(env or {}), "SERVE_ROUTER_BIND": bind,
                   "SERVE_ROUTER_DIR": str(directory)}
    command = [haproxy_binary(), "-db", "-f", str(CONFIG), "-f", str(directory / "backends.cfg")]
    if peer:
        command += ["-L", peer]
    check = subprocess.run([*command, "-c"], env=environment, capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy refused the configuration:\n{check.stdout}{check.stderr}")
    if replacing:
        command += ["-x", str(directory / "admin.sock"), "-sf", str(replacing)]
    log = open(directory / "haproxy.log", "a")
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
    def checked() -> bool:
        states = server_states(directory)
        # "INI": not checked yet; "* INI": its first check is under way.
        return all(name in states and not states[name][1].lstrip("* ").startswith("INI") for name in names)
    wait_router(directory, proc, checked, "check every host")


# The peers section's flags in `show peers` (HAProxy 2.6, src/peers.c): 0x2 once its resync
# is over: taught the tables by its old process (a reload) or by another router, or none of
# them vouched for a complete table within 5 s (as when all start together). Until then its
# sessions with the others may drop and reconnect (measured, two routers started together:
# about a second after both were up), and an entry written meanwhile reached the other
# router seconds late.
RESYNCED = 0x2


def wait_synced(directory: Path, proc: subprocess.Popen) -> None:
    """Until a router has the tables the others (or its old process) hold, and shares its own."""
    def synced() -> bool:
        found = re.search(r" id=%s .*?flags=0x([0-9a-f]+)" % PEERS, admin(directory, "show peers"))
        return found is not None and int(found.group(1), 16) & RESYNCED != 0
    wait_router(directory, proc, synced, "learn its tables")


def wait_router(directory: Path, proc: subprocess.Popen, done, what: str) -> None:
    """Until `done()` says so, asked of this process (not yet ready: its socket missing)."""
    deadline = time.monotonic() + READY_SECONDS
    while not STOPPING.is_set():
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited:\n{(directory / 'haproxy.log').read_text()}")
        try:
            # In a reload the old process keeps the socket for a moment: ask the new one.
            if f"\nPid: {proc.pid}\n" in admin(directory, "show info") and done():
                return
        except OSError:
            pass  # the socket is not there yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not {what} in time")
        time.sleep(0.1)
    raise Stopped


def free_port() -> int:
    """A loopback port nothing listens on now (for the routers' peers, which only they use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the command ------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("containers", nargs="*", metavar="CONTAINER",
                   help="one serve host per container (repeat a container for more hosts of it)")
    p.add_argument("--hosts", type=int, default=1, help="hosts per container given (default 1)")
    p.add_argument("--port", type=int, default=8000,
                   help="the router's port (default 8000); router k's is PORT + k - 1")
    p.add_argument("--bind", default="127.0.0.1", help="the routers' address (default 127.0.0.1)")
    p.add_argument("--routers", type=int, default=1,
                   help="routers sharing their stick tables (default 1); with 2 or more, one that "
                        "exits is started again")
    p.add_argument("--restart-hosts", action="store_true",
                   help="start a host that exits again, on its port (as a service manager would)")
    p.add_argument("--dir", type=Path, default=ROOT / "build" / "cluster",
                   help="per host: snapshots, usage, log; router k's files in DIR/router (DIR/routerK)")
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
    p.add_argument("--peer", action="append", default=[], metavar="NAME=ADDRESS:PORT",
                   help="with --write-router, one per router: their stick tables are shared "
                        "(run each with haproxy -L NAME)")
    args = p.parse_args(argv)
    if not args.containers:
        p.error("name at least one container (or, with --write-router, host URLs)")
    if args.routers < 1:
        p.error("--routers: at least 1")
    if any("=" not in peer for peer in args.peer):
        p.error("--peer: NAME=ADDRESS:PORT")
    return args


def write_for_remote(directory: Path, urls: list[str], policy: str, peers: list[str]) -> int:
    hosts = [Host(f"h{n}", url.rstrip("/"), ask_model(url.rstrip("/"))) for n, url in enumerate(urls, 1)]
    named = dict(peer.split("=", 1) for peer in peers)
    write_router_files(directory, hosts, policy, named or None)
    print(f"wrote {directory}/backends.cfg, models.map, models.json for "
          f"{len(hosts)} hosts; run: SERVE_ROUTER_BIND=:443 SERVE_ROUTER_DIR={directory} "
          f"haproxy {'-L NAME ' if named else ''}-f {CONFIG} -f {directory}/backends.cfg")
    return 0


def router_dir(directory: Path, k: int) -> Path:
    return directory / ("router" if k == 1 else f"router{k}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.write_router:
        return write_for_remote(args.write_router, args.containers, args.policy, args.peer)
    per_host: dict[int, list[str]] = {}
    for spec in args.host_args:
        number, _, flags = spec.partition(":")
        per_host.setdefault(int(number), []).extend(flags.split())
    containers = [Path(c) for c in args.containers for _ in range(args.hosts)]
    routers = [Router(f"r{k}", args.port + k - 1, router_dir(args.dir, k)) for k in range(1, args.routers + 1)]
    hosts: list[Host] = []
    host_procs: list[subprocess.Popen] = []
    retired: list[subprocess.Popen] = []   # reloaded routers finishing their requests
    reloading = threading.Event()

    def stop(signum, frame) -> None:
        STOPPING.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, lambda signum, frame: reloading.set())
    try:
        for n, container in enumerate(containers, 1):
            host, proc = start_host(container, f"h{n}", args.dir / f"h{n}",
                                    serve_flags(args, per_host.get(n, [])))
            hosts.append(host)
            host_procs.append(proc)
            print(f"host h{n} {host.url} model={host.model['id']} pid={proc.pid} dir={args.dir / f'h{n}'}",
                  flush=True)
        # A peers section even for one router: a reloaded router is then handed the tables by
        # its old process.
        peers = {r.name: f"127.0.0.1:{free_port()}" for r in routers}
        for router in routers:
            write_router_files(router.directory, hosts, args.policy, peers)
            (router.directory / "haproxy.log").unlink(missing_ok=True)  # this run's requests only
            router.proc = start_router(router.directory, f"{args.bind}:{router.port}", peer=router.name)
        for router in routers:
            wait_checked(router.directory, [h.name for h in hosts], router.proc)
            if len(routers) > 1:  # (alone, it has nothing to learn: its tables start empty)
                wait_synced(router.directory, router.proc)
            print(f"router http://{args.bind}:{router.port} pid={router.proc.pid} dir={router.directory}",
                  flush=True)
        print("ready", flush=True)
        while not STOPPING.wait(0.2):
            if reloading.is_set():
                reloading.clear()
                retired += reload_routers(routers, args.bind, [h.name for h in hosts])
            retired = [proc for proc in retired if proc.poll() is None]  # reaped once they finished
            if not watch_routers(routers, args.bind, [h.name for h in hosts]):
                break
            for n, host in enumerate(hosts):
                host_procs[n] = watch_host(host, host_procs[n], containers[n], args, per_host.get(n + 1, []))
    except Stopped:
        pass
    finally:
        # The routers first: they stop taking requests for hosts about to go.
        procs = [*(r.proc for r in routers if r.proc), *retired, *host_procs]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


def watch_routers(routers: list[Router], bind: str, names: list[str]) -> bool:
    """Start again a router that exited, once it has the others' tables; False when the only
    router exited (nothing to learn the tables from: stop)."""
    for router in routers:
        if router.proc.poll() is None:
            continue
        if len(routers) == 1:
            print(f"router exited ({router.proc.returncode}); stopping", flush=True)
            return False
        print(f"router {router.name} exited ({router.proc.returncode})", flush=True)
        router.proc = start_router(router.directory, f"{bind}:{router.port}", peer=router.name)
        wait_checked(router.directory, names, router.proc)
        wait_synced(router.directory, router.proc)
        print(f"router {router.name} restarted http://{bind}:{router.port} pid={router.proc.pid}", flush=True)
    return True


def reload_routers(routers: list[Router], bind: str, names: list[str]) -> list[subprocess.Popen]:
    """Each router reloaded in turn (SIGHUP); returns the old processes, which finish their requests."""
    old = []
    for router in routers:
        # An old process hands its tables over only once it has them all itself (5 s after a
        # start among none or new peers); before, the new one would start empty.
        wait_synced(router.directory, router.proc)
        old.append(router.proc)
        router.proc = start_router(router.directory, f"{bind}:{router.port}", peer=router.name,
                                   replacing=old[-1].pid)
        wait_checked(router.directory, names, router.proc)
        wait_synced(router.directory, router.proc)
        print(f"router {router.name} reloaded http://{bind}:{router.port} pid={router.proc.pid}", flush=True)
    return old


def serve_flags(args: argparse.Namespace, own_args: list[str]) -> list[str]:
    """A host's flags: the shared tier every host reads and writes (snapshots, replies, stored
    responses), every host's flags, then its own."""
    shared = [] if args.no_shared_cache else ["--shared-cache", str(args.dir / "shared")]
    return shared + args.serve_args.split() + own_args


def watch_host(host: Host, proc: subprocess.Popen, container: Path, args: argparse.Namespace,
               own_args: list[str]) -> subprocess.Popen:
    """Say when a host exits (the routers move its conversations); with --restart-hosts,
    start it again on its port. Returns its process (the new one, if started again)."""
    if host.pid is None or proc.poll() is None:  # reported already, or running
        return proc
    host.pid = None
    print(f"host {host.name} exited ({proc.returncode})", flush=True)
    if not args.restart_hosts:
        return proc
    port = int(host.url.rsplit(":", 1)[1])
    try:
        proc = start_host(container, host.name, args.dir / host.name, serve_flags(args, own_args), port)[1]
    except RuntimeError as e:  # its port taken meanwhile, say: the others go on
        print(f"host {host.name} was not started again: {e}", flush=True)
        return proc
    host.pid = proc.pid
    print(f"host {host.name} restarted {host.url} pid={proc.pid}", flush=True)
    return proc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:  # a host or the router would not start: say why, without a traceback
        sys.exit(f"cluster: {e}")
