"""Claude Code and Codex, the real CLIs from npm, through a prefill longer than they wait in silence.

Slow (`make agents`): the K3-flavoured reference container prefills each
agent's whole preamble (about 42K tokens for Claude Code 2.1.197, 20K for
Codex 0.171) at a scaled clock. Claude Code gives up on a stream after 300 s
without a content event and then sends the request again, not streamed;
Codex after `stream_idle_timeout_ms` without a data event. Each must get its
first token from the one stream it opened.

The model's weights are random, so what it says (a tool call with a garbage
path, say) may end the agent's run in an error of its own; the tests hold the
stream to account, not the model: one streamed request per turn, never sent
twice, kept open through the whole prefill, and no stream error in the
agent's report.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from scripted import real_service, serving
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "build" / "agents"
PACKAGES = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0"}
CTX = 65536                  # room for Claude Code's preamble and a long random reply
CLAUDE_WATCHDOG_S = 300      # Claude Code's stream idle timeout (it can only be raised)


def agent(name: str) -> Path:
    """The agent's CLI, installed under build/agents on first use; skips when npm cannot."""
    binary = AGENTS / "node_modules" / ".bin" / name
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip(f"npm is not installed: cannot fetch {PACKAGES[name]}")
        try:
            done = subprocess.run([npm, "install", "--prefix", str(AGENTS), "--no-audit", "--no-fund",
                                   PACKAGES[name]], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm did not install {PACKAGES[name]} within 15 minutes")
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            pytest.skip(f"npm could not install {PACKAGES[name]} (registry unreachable?): {lines[-1]}")
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120)
    if version.returncode != 0:
        pytest.skip(f"{binary} does not run here: {version.stderr.strip()[-300:]}")
    return binary


# ---- a server that notes what each request went through ---------------------------------


@dataclass
class Seen:
    stream: bool
    conversation: str                    # to tell a request sent again from the next turn's
    arrived: float
    first_token: Optional[float] = None
    answered: bool = False               # the reply reached its end with the client there


class _Noting:
    """A request's sink, noting when its first piece of output goes out."""

    def __init__(self, sink: Any, seen: Seen):
        self._sink, self._seen = sink, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)

    def emit(self, delta: dict) -> None:
        if self._seen.first_token is None:
            self._seen.first_token = time.monotonic()
        self._sink.emit(delta)


@contextmanager
def slow_server(lib_path, container, tmp_path: Path, delay_ms: int, heartbeat: float
                ) -> Iterator[tuple[int, list[Seen]]]:
    """The reference engine at WASTE_DELAY_MS=delay_ms behind serve, snapshots and reply memory
    on, as `python3 -m serve` runs; yields the port and what each chat request went through."""
    seen: list[Seen] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(delay_ms))
        cache = PrefixCache(8 << 30, parent_dir=str(tmp_path))
        try:
            with real_service(lib_path, container, ctx=CTX, prefix_cache=cache,
                              reply_memory=ReplyMemory()) as service:
                chat = service.chat

                def noted(req, sink):
                    entry = Seen(bool(req.stream), json.dumps(req.messages, sort_keys=True),
                                 time.monotonic())
                    seen.append(entry)
                    reply = chat(req, _Noting(sink, entry))
                    entry.answered = not reply.client_left
                    return reply

                service.chat = noted
                with serving(service, heartbeat=heartbeat) as srv:
                    yield srv.port, seen
        finally:
            cache.close()


def assert_one_stream_per_turn(seen: list[Seen]) -> None:
    assert seen, "the agent sent no request"
    assert all(s.stream for s in seen), "a request was not streamed (a non-streamed fallback)"
    conversations = [s.conversation for s in seen]
    assert len(set(conversations)) == len(conversations), "a request was sent again (a retry)"
    first = seen[0]
    assert first.first_token is not None, "the first request was given up before its first token"


def quiet_env(home: Path, **extra: str) -> dict:
    """The agent's environment: its own home, nothing sent anywhere but serve."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    return {**keep, "HOME": str(home), "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1", **extra}


# ---- Claude Code ------------------------------------------------------------------------


def test_claude_code_waits_out_a_prefill_longer_than_its_watchdog(lib_path, k3_container, tmp_path):
    claude = agent("claude")
    work = tmp_path / "work"
    work.mkdir()
    # 10 ms a token: its ~42K-token preamble takes over 400 s; the default heartbeat (10 s).
    with slow_server(lib_path, k3_container, tmp_path / "prefix", 10, 10.0) as (port, seen):
        started = time.monotonic()
        done = subprocess.run(
            [str(claude), "-p", "Say hi.", "--output-format", "json"], cwd=work,
            env=quiet_env(tmp_path, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}",
                          ANTHROPIC_API_KEY="sk-local"),
            capture_output=True, text=True, timeout=7200)
        took = time.monotonic() - started
    report = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert report.startswith("{"), f"no JSON report (exit {done.returncode}): {done.stderr[-2000:]}"
    result = json.loads(report)
    assert_one_stream_per_turn(seen)
    first = seen[0]
    assert first.first_token - first.arrived > CLAUDE_WATCHDOG_S, \
        f"the prefill took {first.first_token - first.arrived:.0f} s: not past the watchdog"
    # Claude Code's own count: its first token came from that one stream, after the watchdog's
    # time; an API error (a timeout, a retry given up) would be its result instead.
    assert result["ttft_ms"] > CLAUDE_WATCHDOG_S * 1000
    assert result["api_error_status"] is None and not result["result"].startswith("API Error"), result
    assert first.answered or result.get("terminal_reason") == "model_error", result
    print(f"claude: {took:.0f} s in all, first token after {first.first_token - first.arrived:.0f} s, "
          f"{len(seen)} request(s), exit {done.returncode}, {result.get('subtype')}")


# ---- Codex ------------------------------------------------------------------------------


CODEX_IDLE_MS = 3000   # Codex gives up after this long without a data event
CODEX_CONFIG = """model = "k3"
model_provider = "serve"

[model_providers.serve]
name = "serve"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
stream_idle_timeout_ms = {idle}
stream_max_retries = 0
request_max_retries = 0
"""
STREAM_ERRORS = ("idle timeout", "stream disconnected", "retrying", "Reconnecting")


def test_codex_streams_through_chunks_longer_than_its_idle_timeout(lib_path, k3_container,
                                                                   tmp_path):
    codex = agent("codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    # 9 ms a token: a 512-token chunk lasts about 4.6 s, past Codex's 3 s; a 1 s heartbeat.
    with slow_server(lib_path, k3_container, tmp_path / "prefix", 9, 1.0) as (port, seen):
        (home / "config.toml").write_text(CODEX_CONFIG.format(port=port, idle=CODEX_IDLE_MS))
        started = time.monotonic()
        done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "Say hi."], cwd=work,
                              env=quiet_env(home, CODEX_HOME=str(home)), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=7200)
        took = time.monotonic() - started
    said = done.stdout + done.stderr
    assert_one_stream_per_turn(seen)
    first = seen[0]
    assert first.first_token - first.arrived > 2 * 512 * 9 / 1000   # two chunks at least
    assert not [line for line in said.splitlines() if any(e in line for e in STREAM_ERRORS)], said[-3000:]
    # The turn ended (Codex reports its tokens then), with every reply heard to its end.
    assert "tokens used" in said, said[-3000:]
    assert all(s.answered for s in seen), said[-3000:]
    print(f"codex: {took:.0f} s in all, first token after {first.first_token - first.arrived:.0f} s, "
          f"{len(seen)} request(s), exit {done.returncode}")
