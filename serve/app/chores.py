"""--chores-model: a second container in the same process, which answers the chores.

Chat front ends send chores of their own (titles, tags, follow-up suggestions);
on an expert-streaming model each costs minutes to hours of the engine a person
waits for. A small model beside it (Kimi-Linear beside K3) answers them
instead: its own engine, engine queue and service, within one memory plan
(serve/app/budget.py), and requests reach it as serve/service/models.py says.
Both engines are opened, drained at a signal and closed by serve/app/main.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from serve.app.budget import Split, gib, split_budget
from serve.app.context import beyond
from serve.engine.binding import Engine, Library
from serve.engine.types import EngineConfig, WasteError
from serve.formats.format_choice import resolve_chat_format
from serve.service.facade import Service, ServiceOptions
from serve.tokenizer.tokenizer_choice import choose as choose_tokenizer
from serve.snapshots.cache import PrefixCache, PrefixCacheError
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.reply_memory import ReplyMemory


class ChoresError(Exception):
    """The chores model cannot be served as asked (one line for the user)."""


def add_arguments(p: argparse.ArgumentParser, size: Callable[[str], int],
                  count: Callable[[str], int]) -> None:
    p.add_argument("--chores-model", metavar="DIR",
                   help="a second container, loaded beside MODEL, that answers background "
                        "requests (chores: titles, tags, follow-ups) and requests naming it")
    p.add_argument("--chores-model-id", metavar="ID",
                   help="the chores model's id (default: its directory name)")
    p.add_argument("--chores-ctx", type=count, default=0, metavar="N",
                   help="the chores model's context (default: chosen as MODEL's is, "
                        "against a quarter of the budget)")
    p.add_argument("--chores-budget", type=size, default=None, metavar="SIZE",
                   help="RAM for the chores model, out of --budget (default: what it "
                        "recommends, at most a quarter of the budget)")
    p.add_argument("--chores-threads", type=count, default=0, metavar="N",
                   help="compute threads of the chores model (default: a quarter of the "
                        "cores, at least 1); the main model keeps --threads")


def plan(lib: Library, args: argparse.Namespace) -> Optional[Split]:
    """The memory plan of both models, or None without --chores-model."""
    if args.chores_model is None:
        for flag in ("chores_model_id", "chores_budget"):
            if getattr(args, flag) is not None:
                raise ChoresError(f"--{flag.replace('_', '-')} needs --chores-model")
        for flag in ("chores_ctx", "chores_threads"):
            if getattr(args, flag):
                raise ChoresError(f"--{flag.replace('_', '-')} needs --chores-model")
        return None
    if not Path(args.chores_model).is_dir():
        raise ChoresError(f"{args.chores_model}: not a model container directory")
    return split_budget(lib, args.model, args.chores_model, budget=args.budget, ctx=args.ctx,
                        chores_ctx=args.chores_ctx, chores_budget=args.chores_budget,
                        vision=args.vision)


def describe(split: Split) -> str:
    """The split, for --plan and the banner."""
    return (f"{gib(split.total)} ({split.origin}): the chores model {gib(split.chores.budget)} "
            f"({split.chores.reason}), the main model the rest, {gib(split.main.budget)}")


@contextmanager
def opened(lib: Library, args: argparse.Namespace, split: Optional[Split],
           default_id: Callable[[str], str], cfg: EngineConfig, options: ServiceOptions,
           prefix_cache: Callable[[Engine, str], Optional[PrefixCache]]) -> Iterator[list[Service]]:
    """The chores model's service, its engine open: [] without one. Its engine is opened as
    the main one is (`cfg`: threads, cache policy, direct I/O...) with its own budget,
    context and hotlist, and no vision tower; its service as the main one's (`options`)
    with its own id (--chores-model-id, else `default_id(path)`), prefix cache
    (`prefix_cache(engine, path)`), snapshot policy and reply memory."""
    if split is None:
        yield []
        return
    path = args.chores_model
    model_id, main_id = args.chores_model_id or default_id(path), options.model_id
    if model_id == main_id:
        raise ChoresError(f"the chores model's id {model_id!r} is the main model's: "
                          "give it another with --chores-model-id")
    try:
        engine = Engine(lib, path, dataclasses.replace(
            cfg, budget=split.chores.budget, ctx=split.chores.context.tokens, vision=False,
            usage_path=None, threads=threads(args)))
    except (WasteError, ValueError) as e:
        raise ChoresError(f"cannot open the chores model {path}: {e}") from None
    cache = None
    try:
        try:
            cache = prefix_cache(engine, path)
        except (PrefixCacheError, OSError) as e:
            raise ChoresError(f"prefix cache of the chores model: {e}") from None
        tokens = choose_tokenizer(engine, path, enabled=not args.engine_tokenizer)
        service = Service(engine, lib, resolve_chat_format(engine, path), dataclasses.replace(
            options, model_id=model_id, vision=False, prefix_cache=cache,
            tokenizer=tokens.tokenizer, bos=tokens.bos,   # its own vocabulary, not the main one's
            snapshot_policy=SnapshotPolicy(args.prefix_cache_min, args.prefix_cache_spacing,
                                           options.log),
            reply_memory=ReplyMemory(),
            context_beyond=beyond(lib, path, engine.info.ctx_max, split.chores.budget,
                                  False).replace("--ctx", "--chores-ctx")))
        yield [service]
        try:
            engine.save_usage()
        except WasteError as e:
            print(f"serve: warning: the chores model's expert hotlist was not saved: {e}", file=sys.stderr)
    finally:
        if cache is not None:
            cache.close()
        engine.close()


def threads(args: argparse.Namespace) -> int:
    """The chores model's threads. Each context has a pool of its own (docs/engine.md,
    "Threads"), and chores run while a person's reply does: a quarter of the cores keeps
    the person's engine nearly whole when both run, the way the memory plan does."""
    return args.chores_threads or max(1, (os.cpu_count() or 1) // 4)


def banner_lines(service: Service, split: Split) -> list[str]:
    info = service.engine.info
    return [f"chores   {service.options.model_id} ({info.arch}, {info.params_total:,} params, "
            f"context {info.ctx_max:,}: {split.chores.context.reason}) answers background "
            "requests and requests naming it",
            f"budget   {describe(split)}"]
