"""The server as its command, `python3 -m serve`, in a subprocess of the tests."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

from conftest import ROOT


def run_cli(*args: str, lib_path=None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WASTE_LIB", "WASTE_API_KEY")}
    if lib_path is not None:
        env["WASTE_LIB"] = str(lib_path)
    return subprocess.run([sys.executable, "-m", "serve", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@contextmanager
def cli_server(*args: str, host: str = "127.0.0.1", env: Optional[dict] = None,
               ) -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    """`python3 -m serve ...` on an ephemeral port: (process, port, banner lines); always stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "serve", *args, "--port", "0", "--host", host,
                             "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        banner = []
        while not banner or not banner[-1].startswith("listen"):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            banner.append(line.strip())
        yield proc, int(banner[-1].rsplit(":", 1)[1].split("/")[0]), banner
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
