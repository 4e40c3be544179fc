"""A team's hosts sharing one snapshot tier (deploy/cluster.py turns it on): a host that dies
leaves what it published, and its conversations resume on another host instead of starting
over; a preamble warmed on one host is restored on all. Skipped only without HAProxy."""
from __future__ import annotations

import json
import os
import signal
import struct
import threading
import time
from pathlib import Path

import pytest

from scripted import wait_idle
from served import listening
from test_cluster import GREEDY, needs_router, send, start  # noqa: F401 - start is a fixture

MAGIC = b"serve-shared 1\n"
CLOCK = {"WASTE_DELAY_MS": "2"}   # prefill costs far more than a snapshot: every checkpoint pays


def published(cluster) -> list[int]:
    """The positions each snapshot in the cluster's shared tier holds, read from its header."""
    found = []
    for path in (cluster.dir / "shared" / "snapshots").glob("*/*.snap"):
        with open(path, "rb") as f:
            assert f.read(len(MAGIC)) == MAGIC
            (length,) = struct.unpack("<I", f.read(4))
            found.append(json.loads(f.read(length))["n_tokens"])
    return sorted(found)


def kill(cluster, name: str) -> None:
    port, pid = cluster.hosts[name]
    os.kill(pid, signal.SIGKILL)
    while listening(port):
        time.sleep(0.01)


class Conversation:
    """One conversation in one of the three APIs, turn by turn, as its client sends it."""

    def __init__(self, cluster, api: str):
        self.cluster, self.api = cluster, api
        self.history: list[dict] = []
        self.previous = None
        self.opening = f"{api} conversation: " + " ".join(f"w{i}" for i in range(120))

    def turn(self, text: str):
        """(host, prompt tokens, cached tokens, completion tokens) of the next turn."""
        self.history.append({"role": "user", "content": text})
        key = {"x-claude-code-session-id": f"{self.api}-{id(self)}"}
        if self.api == "chat":
            path, body = "/v1/chat/completions", {"messages": self.history, "max_tokens": 6,
                                                  "reasoning_effort": "none"}
        elif self.api == "messages":
            path, body = "/v1/messages", {"messages": self.history, "max_tokens": 6}
        else:
            path, body = "/v1/responses", {"input": text, "max_output_tokens": 6, "store": True,
                                           "reasoning": {"effort": "none"},
                                           **({"previous_response_id": self.previous}
                                              if self.previous else {})}
        reply = send(self.cluster.port, path, {"model": "k3", **body, **GREEDY}, key)
        assert reply.status == 200, reply.body[-300:]
        out, usage = reply.json(), reply.json()["usage"]
        if self.api == "chat":
            self.history.append(out["choices"][0]["message"])
            numbers = (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                       usage["completion_tokens"])
        elif self.api == "messages":
            self.history.append({"role": "assistant", "content": out["content"]})
            cached = usage["cache_read_input_tokens"]
            numbers = (usage["input_tokens"] + cached, cached, usage["output_tokens"])
        else:
            self.previous = out["id"]
            numbers = (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                       usage["output_tokens"])
        return (self.cluster.host_of(reply.headers), *numbers)


@needs_router
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_killed_hosts_conversation_resumes_on_another_from_what_it_published(api, start,
                                                                               k3_container):
    cluster = start(k3_container, k3_container, env=CLOCK)
    talk = Conversation(cluster, api)
    home, *_ = talk.turn(talk.opening)
    again, prompt, cached, completion = talk.turn("tell me more " * 5)
    assert again == home and cached > 0
    wait_idle(cluster.hosts[home][0])   # the reply settled, and what it left is published
    before = published(cluster)
    kill(cluster, home)
    where, prompt3, cached3, _ = talk.turn("and then?")
    assert where != home
    # It restored the longest snapshot the dead host published that this prompt extends: at
    # least the whole previous turn's prompt, nothing prefilled from zero.
    assert cached3 in before and cached3 >= prompt, (cached3, prompt, before)
    assert prompt3 > prompt + completion   # the whole conversation, chained or resent
    # And the conversation goes on there, from its own snapshots now.
    after, _, cached4, _ = talk.turn("one more")
    assert after == where and cached4 > cached3


@needs_router
def test_a_preamble_warmed_on_one_host_is_restored_by_every_other(start, k3_container, tmp_path):
    system = "You are a careful agent. " + " ".join(f"rule{i}" for i in range(200))
    warm = tmp_path / "preamble.json"
    warm.write_text(json.dumps({"messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": "hi"}]}))
    cluster = start(k3_container, k3_container, k3_container, env=CLOCK,
                    host_args=(f"1:--warm {warm}",))
    warmer = "h1"
    wait_idle(cluster.hosts[warmer][0])
    assert published(cluster), "the warm published nothing"
    for name in ("h2", "h3"):   # straight to each host: no prefill of the preamble on any
        port = cluster.hosts[name][0]
        reply = send(port, "/v1/chat/completions", {
            "model": "k3", "max_tokens": 2, **GREEDY,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"a new conversation on {name}"}]})
        assert reply.status == 200, reply.body[-300:]
        usage = reply.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 200, (name, usage)


@needs_router
def test_a_host_killed_mid_prefill_leaves_its_progress_to_the_retry(start, k3_container):
    cluster = start(k3_container, k3_container, env={"WASTE_DELAY_MS": "5"})
    talk = Conversation(cluster, "chat")
    home, prompt, _, _ = talk.turn("a short start")
    wait_idle(cluster.hosts[home][0])
    long_turn = "read this: " + " ".join(f"p{i}" for i in range(700))   # chunks of 512 positions
    result = {}
    sender = threading.Thread(target=lambda: result.update(turn=talk.turn(long_turn)))
    sender.start()
    deadline = time.monotonic() + 120
    while not [n for n in published(cluster) if n > prompt + 512]:   # a progress snapshot
        assert time.monotonic() < deadline and sender.is_alive(), "no progress snapshot published"
        time.sleep(0.05)
    progress = max(published(cluster))
    kill(cluster, home)
    sender.join()
    # The router sent the request, unanswered, to the other host (retry-on empty-response),
    # which resumed it from the dead host's last progress snapshot.
    where, prompt2, cached2, _ = result["turn"]
    assert where != home and prompt2 > progress and cached2 >= progress, (cached2, progress)
