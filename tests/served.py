"""`python3 -m serve` as a subprocess on an ephemeral port, and what /proc says about it.

For the soak, fault and fuzz tests: the server's threads, descriptors and
memory are its own there, apart from the test's.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent


class Served:
    """`python3 -m serve` on an ephemeral port, its stderr in a file."""

    def __init__(self, proc: subprocess.Popen, port: int, banner: list[str], log: Path,
                 prefix: Path):
        self.proc, self.port, self.banner, self._log, self.prefix = proc, port, banner, log, prefix

    @property
    def snapshots(self) -> Optional[str]:
        """This server's own work in the snapshot directory (the snapshots outlive it)."""
        found = list(self.prefix.glob(f"work-{self.proc.pid}-*"))
        return str(found[0]) if found else None

    def log(self) -> str:
        return self._log.read_text()

    def status(self, field: str) -> int:
        """A number from /proc/PID/status (VmRSS and VmHWM in kB, Threads)."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@contextmanager
def serve(container: Path, lib_path: Path, tmp_path: Path, *args: str,
          nofile: Optional[int] = None, fsize: Optional[int] = None) -> Iterator[Served]:
    def limits() -> None:  # in the child, before exec
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("WASTE_LIB", "WASTE_API_KEY")}
    env["TMPDIR"] = str(tmp_path)  # snapshots and staged images: nothing outside the test's directory
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve", str(container), "--lib", str(lib_path), "--port", "0",
             "--usage", str(tmp_path / "usage.waste"), "--prefix-cache-dir", str(tmp_path / "prefix"),
             *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            preexec_fn=limits if nofile or fsize else None)
    try:
        banner = read_banner(proc, log.read_text)
        yield Served(proc, listening_port(banner), banner, log, tmp_path / "prefix")
    finally:
        if proc.poll() is None:
            proc.terminate()  # an orderly stop removes its snapshot work directory
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


def read_banner(proc: subprocess.Popen, why_not: Callable[[], str]) -> list[str]:
    """The banner's lines, up to the `listen` line; `why_not()` explains a server that died first."""
    banner: list[str] = []
    while not banner or not banner[-1].startswith("listen"):
        line = proc.stdout.readline()
        assert line, why_not()
        banner.append(line.strip())
    return banner


def listening_port(banner: list[str]) -> int:
    return int(banner[-1].rsplit(":", 1)[1].split("/")[0])


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
        banner = read_banner(proc, proc.stderr.read)
        yield proc, listening_port(banner), banner
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def listening(port: int) -> bool:
    """Does anything accept connections on this loopback port?"""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=60).close()
        return True
    except (ConnectionRefusedError, ConnectionResetError):   # reset: closed with us in its backlog
        return False


def settle(read, target: int, slack: int, what: str) -> None:
    """Wait until a count (threads, descriptors) comes back within `slack` of `target`."""
    deadline = time.monotonic() + 30
    while read() > target + slack:
        assert time.monotonic() < deadline, f"{what}: {read()} against {target} before"
        time.sleep(0.05)
