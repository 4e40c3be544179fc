"""`python3 -m serve MODEL`: parse flags, open the model, print a banner, serve until stopped."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn, Optional

from serve.engine import decode

from serve.formats import grammar
from serve.formats.base import ChatFormat
from serve.formats.format_choice import resolve_chat_format
from serve.engine.binding import Engine, Library, LibraryNotFound, load_library
from serve.engine.types import EngineConfig, MemPlan, WasteError
from serve.http.connections import DEFAULT_MAX_CONNECTIONS, stderr_log
from serve.app import chores
from serve.app.budget import BudgetError, Split, gib
from serve.app.context import CAP, ContextChoice, beyond, choose_context
from serve.http.server import DEFAULT_REQUEST_TIMEOUT, Server
from serve.snapshots.identity import state_identity
from serve.snapshots.cache import (DEFAULT_MAX_ENTRIES, default_directory, PrefixCache,
                                   PrefixCacheError)
from serve.snapshots.reply_memory import ReplyMemory
from serve.dialects.sse import DEFAULT_HEARTBEAT
from serve.service.facade import Service, ServiceOptions
from serve.service.image_positions import read_grid
from serve.service.models import Models
from serve.snapshots.policy import SnapshotPolicy
from serve.app.warm import WarmError, Warmer, warm_requests
from serve.app import team as shared_tier
from serve.service.response_store import ResponseStore
from serve.app import job_flags, records, team_flags, work_flags
from serve.http.auth import Keys
from serve.http.keyring import KeyFileError
from serve.tokenizer.tokenizer_choice import Choice, choose as choose_tokenizer
from serve.version import version

LOOPBACK = ("127.0.0.1", "::1", "localhost")
DRAIN_SECONDS = 10.0  # at shutdown, for cut replies to reach their clients
SIZE = re.compile(r"(\d+)([KMGT]?)(I?B)?", re.IGNORECASE)
UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_size(text: str) -> int:
    """'48G', '512M', '1048576' → bytes (binary units)."""
    match = SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 48G, 512M or bytes)")
    return int(match.group(1)) << UNITS[match.group(2).upper()]


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"not a non-negative integer: {text!r}")
    return value


def port(text: str) -> int:
    value = non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (0 to 65535)")
    return value


def positive(text: str) -> int:
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return value


def directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not a directory: {text!r}")
    return os.path.realpath(text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: the mistake is what the user needs to see.
        self.exit(2, f"serve: {message} (see --help)\n")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    # `serve` when run as the installed command, else as the module.
    p = _Parser(prog="serve" if Path(sys.argv[0]).name == "serve" else "python3 -m serve",
                description="OpenAI-compatible server for a libwaste model.")
    p.add_argument("model", help="container directory (e.g. ~/models/k3.waste)")
    p.add_argument("--version", action="version", version=f"serve {version()}")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument("--model-id", help="id reported to clients (default: the directory name)")
    p.add_argument("--api-key", default=os.environ.get("WASTE_API_KEY"),
                   help="require Authorization: Bearer KEY (default $WASTE_API_KEY)")
    p.add_argument("--budget", type=parse_size, default=0, help="RAM ceiling, e.g. 48G (0 = engine picks)")
    p.add_argument("--ctx", type=non_negative, default=0,
                   help="context tokens (default: the largest the model takes whose state fits "
                        f"a quarter of the budget, at most {CAP})")
    p.add_argument("--threads", type=non_negative, default=0, help="compute threads (0 = one per core)")
    p.add_argument("--cpus", help="cpu list for the threads, e.g. 0-5 or 0-2,6-8")
    p.add_argument("--cache", choices=("lfru", "lru"), default="lfru", help="expert-cache eviction")
    p.add_argument("--no-direct-io", action="store_true", help="read experts through the page cache")
    p.add_argument("--vision", action="store_true", help="load the vision tower")
    p.add_argument("--verify", action="store_true", help="crc32-check every expert record read")
    p.add_argument("--usage", help="learned hotlist file (default <model>/usage.waste)")
    p.add_argument("--max-tokens", type=positive, default=4096,
                   help="reply cap when a request sets none (default 4096)")
    p.add_argument("--no-thinking", action="store_true", help="answer without the think channel by default")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N", help="think-channel "
                   "tokens when a request sets no budget (-1, the default: no limit; 0: off)")
    p.add_argument("--allow-local-images", type=directory, metavar="DIR",
                   help="let clients name image files under DIR (symlinks resolved)")
    p.add_argument("--plan", action="store_true", help="print the memory plan and exit")
    # No default here: load_library tries $WASTE_LIB itself, after --lib.
    p.add_argument("--lib", help="libwaste path (default $WASTE_LIB, then the libwaste.so "
                                 "that `make` builds in the checkout serve runs from)")
    p.add_argument("--exclusive-open", action="store_true", help="refuse a container another process owns")
    p.add_argument("--prefix-cache", type=parse_size, default=None, metavar="SIZE",
                   help="disk for prefix snapshots, e.g. 8G (default: a quarter of the free "
                        "space where they go, at most 16G)")
    p.add_argument("--prefix-cache-dir", metavar="DIR",
                   help="where prefix snapshots persist (default $XDG_CACHE_HOME/serve, "
                        "else ~/.cache/serve)")
    p.add_argument("--prefix-cache-entries", type=positive, default=DEFAULT_MAX_ENTRIES,
                   metavar="N", help=f"most snapshots kept (default {DEFAULT_MAX_ENTRIES})")
    p.add_argument("--prefix-cache-min", type=non_negative, default=None, metavar="N",
                   help="a prompt shorter than N tokens that restored nothing is not snapshotted "
                        "(default: snapshots are placed by their measured cost)")
    p.add_argument("--prefix-cache-spacing", type=positive, default=None, metavar="N",
                   help="inside a long prefill, a snapshot at every multiple of N positions "
                        "(default: when the prefill since the last cost ten saves)")
    p.add_argument("--shared-cache", metavar="DIR",
                   help="a directory every host of a team shares (e.g. over NFS): snapshots, "
                        "replies and stored responses are published there and found by all "
                        "(default: off)")
    p.add_argument("--shared-cache-size", type=parse_size, default=None, metavar="SIZE",
                   help="disk for the shared snapshots, e.g. 200G (default: a quarter of the "
                        "free space there, at most 64G)")
    p.add_argument("--warm", action="append", metavar="REQUEST.json",
                   help="prefill and checkpoint this saved request in idle time, from "
                        "start-up; requests are served meanwhile (repeatable)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every request from scratch")
    p.add_argument("--engine-tokenizer", action="store_true",
                   help="tokenize on the engine (between its calls) even where serve's own "
                        "tokenizer is equal to it")
    p.add_argument("--keep-reasoning", action="store_true",
                   help="give a returned reply whose reasoning the client dropped the reasoning "
                        "this server remembers for it")
    p.add_argument("--quiet", action="store_true", help="no per-request log lines")
    p.add_argument("--max-connections", type=positive, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"open connections at most; more get a 503 (default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--max-queue", type=non_negative, default=ServiceOptions.max_queue,
                   help="requests that may wait for the engine; more get a 503 "
                        f"(default {ServiceOptions.max_queue})")
    p.add_argument("--request-timeout", type=seconds, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds a client has to send a whole request, headers and body "
                        f"(default {DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--heartbeat", type=seconds, default=DEFAULT_HEARTBEAT, metavar="SECONDS",
                   help="seconds a stream may stay silent (waiting, prefilling) before it sends "
                        f"a sign of life its client counts (default {DEFAULT_HEARTBEAT:g})")
    work_flags.add_flags(p, positive, seconds)
    job_flags.add_flags(p, seconds)
    team_flags.add_flags(p, positive)
    chores.add_arguments(p, parse_size, non_negative)
    return p.parse_args(argv)


def default_model_id(model: str) -> str:
    name = Path(model).resolve().name
    return name[:-len(".waste")] if name.endswith(".waste") else name


def describe_plan(plan: MemPlan) -> str:
    rows = [("trunk", plan.trunk_bytes), ("state", plan.state_bytes), ("scratch", plan.scratch_bytes),
            ("min expert cache", plan.min_expert_cache), ("floor", plan.floor_bytes),
            ("recommended", plan.recommended_bytes), ("vision", plan.vision_bytes),
            ("working set/token", plan.working_set_bytes)]
    return "\n".join(f"  {name:<18} {gib(value):>12}  ({value} bytes)" for name, value in rows)


def describe_cache(cache: Optional[PrefixCache]) -> str:
    if cache is None:
        return "off"
    text = (f"{gib(cache.capacity_bytes)}, {cache.max_entries} snapshots at most, in {cache.root} "
            f"({len(cache)} kept, {gib(cache.used_bytes)})")
    if cache.reclaimed:
        text += f"; reclaimed {cache.reclaimed} left by dead processes"
    return text


def banner(lib: Library, engine: Engine, fmt: ChatFormat, args: argparse.Namespace, url: str,
           models: Models, context: ContextChoice, tokens: Choice,
           split: Optional[Split] = None, keys: Keys = Keys()) -> str:
    service = models.main
    info, mem = engine.info, service.worker.call(engine.memory_used)
    chat = fmt.description
    lines = [
        f"engine   libwaste {lib.version()} — {lib.build_info()}",
        f"model    {info.arch}: {info.n_layers} layers, {info.n_experts} experts (top-{info.top_k}), "
        f"hidden {info.hidden}, {info.params_total:,} params ({info.params_active:,} active)",
        f"context  {info.ctx_max:,} positions: {context.reason}",
        f"quant    {info.quant_summary}",
        f"memory   {gib(mem.recommended_bytes)} resolved (trunk {gib(mem.trunk_bytes)}, "
        f"state {gib(mem.state_bytes)}, floor {gib(mem.floor_bytes)})"
        + (f", vision tower {gib(mem.vision_bytes)}" if args.vision else ""),
        f"experts  {describe_hotlist(hotlist_path(args))}",
        f"chat     {chat}",
        f"tokens   {tokens.note}",
        *([f"images   {service.positions.describe()}"] if args.vision else []),
        ("thinking unavailable (this chat format has no reasoning channel)"
         if not fmt.supports_reasoning else
         f"thinking {'off' if args.no_thinking else 'on'} by default (reasoning_effort overrides)"
         + (f", at most {args.reasoning_budget} tokens" if args.reasoning_budget >= 0 else "")),
        f"prefix   {describe_cache(service.options.prefix_cache)}",
        *([f"snapshot {service.policy.describe()}"]
          if service.options.prefix_cache is not None else []),
        *([f"shared   {shared_tier.describe(cache.shared)}"]
          if (cache := service.options.prefix_cache) is not None and cache.shared is not None else []),
        *job_flags.banner_lines(args), records.banner_line(args),
        structure_line(),
        *work_flags.banner_lines(args, lib.build_info(), service.options.prefix_cache is not None),
        *team_flags.banner_lines(args, keys),
        *(chores.banner_lines(models.chores, split)
          if models.chores is not None and split is not None else []),
        f"listen   {url}",
    ]
    if args.host not in LOOPBACK and not keys.required:
        lines.append(f"WARNING  listening on {args.host} without --api-key: anyone who can reach "
                     "this port can use the model")
    return "\n".join(lines)


def describe_hotlist(path: str) -> str:
    """Whether the expert cache starts warm: without a learned hotlist a first request reads
    every expert it uses from disk, which is most of its time on a fresh model."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return (f"no hotlist yet ({path}): the first requests read their experts from disk; "
                "what they use is learned and saved there at shutdown")
    return f"hotlist {path} ({size:,} bytes) warmed the expert cache at start"


def structure_line() -> str:
    """Whether replies can be held to a format and carry logprobs (optional packages)."""
    if grammar.missing() is None:
        return "struct   structured output and logprobs on (llguidance)"
    what = ("structured output off (logprobs on)" if decode.missing() is None
            else "structured output and logprobs off")
    return f"struct   {what}: {grammar.missing()}; to enable: {grammar.ENABLE_HINT}"


def default_prefix_cache_bytes(directory: str) -> int:
    """A quarter of the free space where snapshots go, capped: they are a cache, not the point."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return min(shutil.disk_usage(existing).free // 4, 16 << 30)


def open_prefix_cache(args: argparse.Namespace, lib: Library, engine: Engine,
                      model: Optional[str] = None) -> Optional[PrefixCache]:
    """The persistent snapshot store, namespaced by what this engine's states mean: the
    main model's, or the chores `model`'s (whose hotlist is in its own directory)."""
    if args.no_prefix_cache:
        return None
    directory = args.prefix_cache_dir or str(default_directory())
    size = default_prefix_cache_bytes(directory) if args.prefix_cache is None else args.prefix_cache
    if size <= 0:
        return None
    return PrefixCache(size, directory, max_entries=args.prefix_cache_entries,
                       identity=state_identity(lib, engine, model or args.model,
                                               skip=[hotlist_path(args, model)]))


def hotlist_path(args: argparse.Namespace, model: Optional[str] = None) -> str:
    """The main model's learned hotlist (--usage, else in its directory), or the chores
    `model`'s, always in its own directory."""
    return (args.usage if model is None else None) or os.path.join(model or args.model,
                                                                   "usage.waste")


def fail(message: str) -> int:
    print(f"serve: {message}", file=sys.stderr)
    return 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        lib = load_library(args.lib)
    except LibraryNotFound as e:
        return fail(str(e).replace("\n", "; "))
    for skipped in lib.rejected:  # e.g. a mistyped --lib: say so rather than run another library
        print(f"serve: warning: skipped {skipped}", file=sys.stderr)
    if not Path(args.model).is_dir():
        return fail(f"{args.model}: not a model container directory")
    try:
        warm = warm_requests(args.warm)
    except WarmError as e:
        return fail(str(e))
    unwarmed = team_flags.warm_owner(args, warm)
    if unwarmed is not None:
        return fail(unwarmed)
    try:
        split = chores.plan(lib, args)   # None without --chores-model
        context = (split.main.context if split is not None else
                   choose_context(lib, args.model, args.ctx, args.budget, args.vision))
    except (ValueError, BudgetError, chores.ChoresError) as e:
        return fail(str(e))
    if args.plan and split is not None:
        for share in (split.main, split.chores):
            print(f"memory plan for {share.model} (ctx {share.context.tokens or 'default'}: "
                  f"{share.context.reason}; budget {gib(share.budget)}: {share.reason}):\n"
                  f"{describe_plan(share.plan)}")
        print(f"split    {chores.describe(split)}")
        return 0
    if args.plan:
        try:
            plan = lib.plan_memory(args.model, context.tokens)
        except (WasteError, ValueError) as e:
            return fail(str(e))
        print(f"memory plan for {args.model} (ctx {context.tokens or 'default'}: {context.reason}):"
              f"\n{describe_plan(plan)}")
        return 0
    budget = args.budget if split is None else split.main.budget
    cfg = EngineConfig(budget=budget, ctx=context.tokens, threads=args.threads, cpus=args.cpus,
                       cache_policy=args.cache, direct_io=not args.no_direct_io, vision=args.vision,
                       verify=args.verify, usage_path=args.usage, exclusive_open=args.exclusive_open)
    try:
        engine = Engine(lib, args.model, cfg)
    except (WasteError, ValueError) as e:
        return fail(f"cannot open {args.model}: {e}")
    try:
        return serve(lib, engine, args, warm, context, cfg, split)
    finally:
        engine.close()


def serve(lib: Library, engine: Engine, args: argparse.Namespace, warm: list,
          context: ContextChoice, cfg: EngineConfig, split: Optional[Split]) -> int:
    fmt = resolve_chat_format(engine, args.model)
    log = None if args.quiet else stderr_log
    if warm and args.no_prefix_cache:
        return fail("--warm needs the prefix cache (drop --no-prefix-cache)")
    if args.shared_cache and args.no_prefix_cache:
        return fail("--shared-cache needs the prefix cache (drop --no-prefix-cache)")
    try:
        kept, cache = records.opened(args), open_prefix_cache(args, lib, engine)
    except (PrefixCacheError, OSError) as e:
        return fail(f"prefix cache: {e}")
    team = None
    if args.shared_cache and cache is not None:
        size = args.shared_cache_size
        try:
            team = shared_tier.open_team(args.shared_cache, size if size is not None
                                         else shared_tier.default_size(args.shared_cache), cache)
        except (OSError, ValueError) as e:
            cache.close()
            return fail(f"--shared-cache {args.shared_cache}: {getattr(e, 'strerror', None) or e}")
    try:
        main_id = args.model_id or default_model_id(args.model)
        tokens = choose_tokenizer(engine, args.model, enabled=not args.engine_tokenizer)
        options = ServiceOptions(model_id=main_id,
                                 max_tokens=args.max_tokens, thinking=not args.no_thinking,
                                 reasoning_budget=args.reasoning_budget,
                                 vision=args.vision, allow_local_images=args.allow_local_images,
                                 prefix_cache=cache,
                                 snapshot_policy=SnapshotPolicy(args.prefix_cache_min,
                                                                args.prefix_cache_spacing, log),
                                 **job_flags.options(args),
                                 log=log,
                                 reply_memory=ReplyMemory(shared=team.replies if team else None),
                                 responses=ResponseStore(shared=team.responses if team else None),
                                 keep_reasoning=args.keep_reasoning, max_queue=args.max_queue,
                                 context_beyond=beyond(lib, args.model, engine.info.ctx_max,
                                                       cfg.budget, args.vision),
                                 tokenizer=tokens.tokenizer, bos=tokens.bos,
                                 image_grid=read_grid(args.model) if args.vision else None,
                                 **work_flags.options(args, lib.build_info()),
                                 **team_flags.options(args))
        with chores.opened(lib, args, split, default_model_id, cfg, options,
                           lambda chores_engine, path: open_prefix_cache(
                               args, lib, chores_engine, path)) as extra:
            models = Models([Service(engine, lib, fmt, options), *extra],
                            chores=extra[0] if extra else None)
            return run_server(lib, engine, fmt, models, args, log, warm, context, tokens, split, kept)
    except chores.ChoresError as e:
        return fail(str(e))
    finally:
        if cache is not None:
            cache.close()


def run_server(lib: Library, engine: Engine, fmt: ChatFormat, models: Models,
               args: argparse.Namespace, log, warm: list, context: ContextChoice, tokens: Choice,
               split: Optional[Split], kept: Optional[records.Records]) -> int:
    service = models.main
    try:
        keys = team_flags.keys(args)
    except KeyFileError as e:
        return fail(f"--api-keys: {e}")
    try:
        server = Server((args.host, args.port), models, keys=keys, log=log, records=kept,
                        max_connections=args.max_connections, request_timeout=args.request_timeout,
                        heartbeat=args.heartbeat, metrics_open=args.metrics_open)
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    stopping, hurry = threading.Event(), threading.Event()
    # Idle-time work: requests are served meanwhile, and /health says how far it got.
    warmer = Warmer(service, warm, lambda line: print(line, flush=True)) if warm else None

    def stop(signum, frame) -> None:
        if hurry.is_set() or stopping.is_set():
            hurry.set()  # a second signal: stop waiting
            return
        stopping.set()
        if warmer is not None:
            warmer.stop()   # at its next prefill chunk

        def begin() -> None:
            models.stop()     # queued requests get a 503, running ones stop at their next token
            server.shutdown()  # waits for serve_forever to return: not on this (the serving) thread
        threading.Thread(target=begin, daemon=True).start()

    # Before the banner: a supervisor may signal as soon as it reads the listen line.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    team_flags.reread_on_hangup(keys, stderr_log)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(banner(lib, engine, fmt, args, f"http://{host}:{server.port}/v1", models, context,
                 tokens, split, keys), flush=True)
    if fmt.refusal is not None:
        print("note     /v1/chat/completions is unavailable; /v1/completions works", flush=True)
    if warmer is not None:
        warmer.start()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    # An engine may be closed only once no call runs on it: wait for the requests holding them.
    while not models.wait_idle(0.1):
        if hurry.is_set():
            abandon(models)
    # Then give cut replies a moment to send their last events.
    drained_by = time.monotonic() + DRAIN_SECONDS
    while not server.wait_requests(0.1) and not hurry.is_set() and time.monotonic() < drained_by:
        pass
    # Background responses cut by the shutdown: each stores how it ended, never in_progress.
    server.background.wait(0.0 if hurry.is_set() else max(0.0, drained_by - time.monotonic()))
    # Snapshots queued for the team: published within the drain time, or none half-written.
    for service in models.services:
        if (cache := service.options.prefix_cache) is not None and cache.shared is not None:
            cache.shared.publisher.drain(0.0 if hurry.is_set()
                                         else max(0.0, drained_by - time.monotonic()),
                                         hurry.is_set)
    while warmer is not None and warmer.is_alive():  # it stops at its next chunk
        warmer.join(0.1)
        if hurry.is_set():
            abandon(models)
    models.close()    # deferred snapshots stop before the engines close
    try:
        engine.save_usage()  # what this run learned warms the expert cache of the next
    except WasteError as e:
        print(f"serve: warning: the expert hotlist was not saved: {e}", file=sys.stderr)
    print("serve: stopped", file=sys.stderr)
    return 0


def abandon(models: Models) -> NoReturn:
    """A second signal while a request still runs on an engine: leave without closing it (the
    prefix caches are closed: their work directories go)."""
    for service in models.services:
        if service.options.prefix_cache is not None:
            service.options.prefix_cache.close()
    print("serve: stopped without waiting for the running request", file=sys.stderr, flush=True)
    os._exit(1)  # returning would close the engine under the running call

