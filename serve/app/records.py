"""Where background responses are recorded (serve/service/background_records.py): in
responses/ under the prefix cache's directory, unless --no-prefix-cache leaves no disk; then
they are kept in memory only, and a restart forgets them (the banner says which)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from serve.service.background_records import Records
from serve.snapshots.cache import default_directory


def directory(args: argparse.Namespace) -> Optional[str]:
    if args.no_prefix_cache:
        return None
    return os.path.join(args.prefix_cache_dir or str(default_directory()), "responses")


def opened(args: argparse.Namespace) -> Optional[Records]:
    """The records, with those a stopped or killed server left unfinished failed now."""
    path = directory(args)
    return Records(path, lambda line: print(line, file=sys.stderr, flush=True)) if path else None


def banner_line(args: argparse.Namespace) -> str:
    path = directory(args)
    if path is None:
        return ("records  background responses in memory only (--no-prefix-cache): a restart "
                "forgets them")
    return f"records  background responses in {path}: a restart ends an unfinished one failed"
