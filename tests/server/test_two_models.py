"""Two containers in one process (--chores-model): both answer, one memory plan holds them,
and a signal stops both cleanly.

The main model is the K3-flavoured container, the chores model a Kimi-Linear-flavoured
one (chat.json): both written by tools/make_container.py, so nothing needs the network.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import pytest

from scripted import (ScriptedEngine, call, held_engine, post_open, read_all, read_until, scrape,
                      scripted_service, serving, sse_data, wait_idle, xtml_answer)
from openwebui_tasks import task
from served import run_cli, serve
from serve.app.budget import split_budget
from serve.app.chores import threads
from serve.engine.binding import Engine
from serve.engine.types import EngineConfig, MemPlan
from serve.service.models import Models

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "seed": 1}
CHORES = "chores"   # the chores model's id in these tests


def evaluated(port: int) -> dict[str, float]:
    """Positions each model's engine evaluated so far, by model id, once idle-time work (the
    snapshot a reply leaves) is done."""
    wait_idle(port)
    return {dict(labels)["model"]: value for (name, labels), value in scrape(port).items()
            if name == "serve_engine_evaluated_tokens_total"}


@pytest.fixture(scope="module")
def two(lib_path, k3_container, kimi_linear_container, tmp_path_factory):
    """One server with both models (served once for the module: starting one costs seconds)."""
    tmp = tmp_path_factory.mktemp("two")
    with serve(k3_container, lib_path, tmp, "--quiet", "--chores-model",
               str(kimi_linear_container), "--chores-model-id", CHORES, "--budget", "4G") as srv:
        yield srv


# ---- both answer -----------------------------------------------------------------------

@pytest.mark.parametrize("path, body, model_of", [
    (CHAT, {"messages": USER, "max_tokens": 4}, lambda r: r["model"]),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, lambda r: r["model"]),
    ("/v1/messages", {"messages": USER, "max_tokens": 4}, lambda r: r["model"]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, lambda r: r["model"]),
])
def test_each_model_answers_when_named_in_every_dialect(two, path, body, model_of):
    for name, answers in ((CHORES, CHORES), ("k3", "k3"), ("claude-haiku-4-5", "k3")):
        before = evaluated(two.port)
        resp = call(two.port, "POST", path, {**body, "model": name, **GREEDY})
        assert resp.status == 200, resp.body
        assert model_of(resp.json()) == answers
        moved = {m: n - before[m] for m, n in evaluated(two.port).items()}
        # The model that answers is the one whose engine ran, and only it.
        assert moved[answers] > 0 and sum(moved.values()) == moved[answers], (name, moved)


def test_a_stream_names_the_model_that_answers(two):
    resp = call(two.port, "POST", CHAT, {"model": CHORES, "messages": USER, "max_tokens": 3,
                                         "stream": True, **GREEDY})
    chunks = [e for e in resp.events() if e != "[DONE]"]
    assert chunks and {c["model"] for c in chunks} == {CHORES}
    resp = call(two.port, "POST", "/v1/messages", {"model": CHORES, "messages": USER,
                                                   "max_tokens": 3, "stream": True, **GREEDY})
    start = resp.named_events()[0]
    assert start[0] == "message_start" and start[1]["message"]["model"] == CHORES


def test_models_lists_both_and_each_is_found(two):
    listed = call(two.port, "GET", "/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["k3", CHORES]
    assert [m["waste"]["chat_format"] for m in listed["data"]] == ["xtml", "chat.json"]
    assert call(two.port, "GET", f"/v1/models/{CHORES}").json()["id"] == CHORES
    assert call(two.port, "GET", "/v1/models/k3").json()["id"] == "k3"
    assert call(two.port, "GET", "/v1/models/gpt-4").status == 404


def test_health_and_metrics_report_each_model(two):
    health = call(two.port, "GET", "/health").json()
    assert set(health["models"]) == {"k3", CHORES}
    assert all({"idle", "busy", "queue", "deferred"} <= set(each) for each in health["models"].values())
    assert health["status"] == "ok" and "idle" in health and "queue" in health
    got = scrape(two.port)
    for family in ("serve_queue_length", "serve_busy", "serve_idle", "serve_prompt_tokens_total",
                   "serve_engine_evaluated_tokens_total", "serve_prefix_cache_entries"):
        assert {dict(labels).get("model") for name, labels in got if name == family} \
            == {"k3", CHORES}, family
    # HTTP requests are the server's, counted once and labelled by endpoint only.
    requests = [labels for name, labels in got if name == "serve_requests_total"]
    assert requests and all("model" not in dict(labels) for labels in requests)


# ---- one memory plan ------------------------------------------------------------------

def test_the_plan_splits_the_budget_and_each_engine_keeps_to_its_share(lib, k3_container,
                                                                        kimi_linear_container):
    budget = 1 << 30
    split = split_budget(lib, str(k3_container), str(kimi_linear_container), budget=budget, ctx=0,
                         chores_ctx=0, chores_budget=None, vision=False)
    assert split.main.budget + split.chores.budget == budget
    assert split.chores.plan.floor_bytes <= split.chores.budget <= budget // 4
    assert split.main.plan.floor_bytes <= split.main.budget
    for share in (split.main, split.chores):
        cfg = EngineConfig(budget=share.budget, ctx=share.context.tokens)
        with Engine(lib, share.model, cfg) as engine:
            assert engine.memory_used().recommended_bytes <= share.budget
            assert engine.info.ctx_max == share.context.tokens


class Planned:
    """A planner whose every model has the same floor and recommended size at any context."""

    def __init__(self, floor: int, recommended: int):
        self.floor, self.recommended = floor, recommended

    def plan_memory(self, model_path: str, ctx: int = 0) -> MemPlan:
        return MemPlan(0, 0, 0, 0, self.floor, self.recommended, 0, 0)

    def usable_ram(self) -> int:
        return 64 << 30


@pytest.mark.parametrize("floor, recommended, chores, why", [
    (10, 100, 100, "its recommended size"),            # it fits a quarter: all it recommends
    (10, 600, 250, "1/4 of the budget"),               # a quarter at most
    (300, 600, 300, "its floor"),                       # never below its floor
])
def test_the_chores_model_takes_its_recommended_size_at_most_a_quarter_never_below_its_floor(
        floor, recommended, chores, why):
    split = split_budget(Planned(floor, recommended), "main", "small", budget=1000, ctx=4096,
                         chores_ctx=4096, chores_budget=None, vision=False)
    assert (split.chores.budget, split.main.budget) == (chores, 1000 - chores)
    assert split.chores.reason.startswith(why) and split.main.reason == "the rest"


def test_without_a_budget_the_two_share_half_the_usable_ram():
    split = split_budget(Planned(10, 100), "main", "small", budget=0, ctx=4096, chores_ctx=4096,
                         chores_budget=None, vision=False)
    assert split.total == 32 << 30 and split.origin == "half the usable RAM"
    assert split.main.budget + split.chores.budget == split.total


def test_plan_prints_both_models_and_the_split(lib_path, k3_container, kimi_linear_container):
    out = run_cli(str(k3_container), "--chores-model", str(kimi_linear_container), "--budget", "2G",
                  "--plan", lib_path=lib_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("memory plan for") == 2
    assert "split    2.00 GiB (--budget): the chores model" in out.stdout
    chores = run_cli(str(k3_container), "--chores-model", str(kimi_linear_container),
                     "--chores-ctx", "8192", "--chores-budget", "100M", "--plan", lib_path=lib_path)
    assert f"memory plan for {kimi_linear_container} (ctx 8192: --chores-ctx; budget 100.0 MiB: " \
           "--chores-budget)" in chores.stdout, chores.stdout


def test_a_chores_model_that_cannot_be_planned_is_refused_in_one_line(lib_path, k3_container,
                                                                      tmp_path):
    out = run_cli(str(k3_container), "--chores-model", str(tmp_path), "--port", "0",
                  lib_path=lib_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"serve: cannot plan {tmp_path}: "), out.stderr


@pytest.mark.parametrize("flags, says", [
    (["--budget", "10M"], "serve: a budget of 10.0 MiB (--budget) cannot hold both models: "
                          "the chores model"),
    (["--budget", "1G", "--chores-budget", "1G"], "serve: --chores-budget 1.00 GiB leaves nothing"),
    (["--budget", "1G", "--chores-budget", "1M"], "its floor), more than --chores-budget 1.0 MiB"),
    (["--chores-model-id", "k3"], "serve: the chores model's id 'k3' is the main model's"),
])
def test_an_impossible_plan_is_refused_at_start_in_one_line(flags, says, lib_path, k3_container,
                                                            kimi_linear_container):
    out = run_cli(str(k3_container), "--chores-model", str(kimi_linear_container), "--port", "0",
                  *flags, lib_path=lib_path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr


@pytest.mark.parametrize("flags, says", [
    (["--chores-model", "/nonexistent"], "serve: /nonexistent: not a model container directory"),
    (["--chores-ctx", "4096"], "serve: --chores-ctx needs --chores-model"),
    (["--chores-model-id", "x"], "serve: --chores-model-id needs --chores-model"),
    (["--chores-threads", "2"], "serve: --chores-threads needs --chores-model"),
])
def test_chores_flags_without_a_chores_model_are_refused(flags, says, lib_path, k3_container):
    out = run_cli(str(k3_container), "--port", "0", *flags, lib_path=lib_path)
    assert out.returncode == 1 and out.stderr.strip() == says


# ---- a signal stops both ----------------------------------------------------------------

LONG_PROMPT = [{"role": "user", "content": " ".join(f"w{i}" for i in range(600))}]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_mid_request_on_both_engines_stops_both_cleanly(lib_path, k3_container,
                                                                 kimi_linear_container, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", "3")   # both still prefill when the signal comes
    with serve(k3_container, lib_path, tmp_path, "--quiet", "--chores-model",
               str(kimi_linear_container), "--chores-model-id", CHORES) as srv:
        assert any(line.startswith("chores   chores (") for line in srv.banner)
        works = sorted(srv.prefix.glob(f"work-{srv.proc.pid}-*"))
        assert len(works) == 2   # each model's snapshots, in one directory
        running = {name: post_open(srv.port, {"model": name, "messages": LONG_PROMPT,
                                              "stream": True, "max_tokens": 5})
                   for name in ("k3", CHORES)}
        got = {name: read_until(s, b": prefill ") for name, s in running.items()}
        health = call(srv.port, "GET", "/health").json()
        assert all(each["busy"] for each in health["models"].values()), health
        srv.proc.send_signal(signal.SIGTERM)
        cut = {name: sse_data(read_all(s, got[name])) for name, s in running.items()}
        assert srv.proc.wait(timeout=60) == 0, srv.log()
    for events in cut.values():
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in srv.log() and srv.log().rstrip().endswith("serve: stopped")
    assert not any(os.path.exists(work) for work in works)


# ---- which model answers: the routing rule, on the classification's word (docs/chores.md) ----

# Open-WebUI's title chore, from its own template: a background request by its text.
TASK = [{"role": "user", "content": task("TITLE_GENERATION", USER)}]


@pytest.fixture
def pair():
    """A main and a chores model (scripted engines) behind one server; the main one's engine
    is held by its first request until `release` is set."""
    main_engine, held, release = held_engine(xtml_answer("big"))
    small = ScriptedEngine([xtml_answer("small")] * 8)
    main = scripted_service(main_engine, model_id="big", thinking=False)
    chores = scripted_service(small, model_id="small", thinking=False)
    with serving(Models([main, chores], chores=chores)) as srv:
        yield srv, main_engine, small, held, release
    release.set()


@pytest.mark.parametrize("name", ["big", "small", "gpt-4o-mini", None])
def test_a_chore_goes_to_the_chores_model_whatever_main_or_unknown_name_it_gives(pair, name):
    srv, main_engine, small, held, release = pair
    body = {"messages": TASK, **({"model": name} if name else {})}
    reply = call(srv.port, "POST", CHAT, body).json()
    assert reply["model"] == "small" and reply["choices"][0]["message"]["content"] == "small"
    assert main_engine.prompts == [] and len(small.prompts) == 1


def test_with_two_models_the_log_line_names_the_one_that_answered():
    lines: list[str] = []
    main = scripted_service(ScriptedEngine([xtml_answer("big")]), model_id="big", thinking=False)
    small = scripted_service(ScriptedEngine([xtml_answer("small")]), model_id="small",
                             thinking=False)
    with serving(Models([main, small], chores=small), log=lines.append) as srv:
        call(srv.port, "POST", CHAT, {"model": "small", "messages": USER})
        call(srv.port, "POST", CHAT, {"model": "gpt-4", "messages": USER})
    answered = [line for line in lines if " POST " in line]
    assert [line.rsplit(" ", 1)[1] for line in answered] == ["model=small", "model=big"]


def test_a_chore_is_answered_while_the_main_engine_is_held(pair):
    srv, main_engine, small, held, release = pair
    person = threading.Thread(target=call, args=(srv.port, "POST", CHAT, {"messages": USER}))
    person.start()
    try:
        assert held.wait(10)
        chore = call(srv.port, "POST", CHAT, {"model": "big", "messages": TASK}).json()
        assert chore["choices"][0]["message"]["content"] == "small"
        assert call(srv.port, "GET", "/health").json()["models"]["big"]["busy"] is True
    finally:
        release.set()
        person.join(30)


def test_a_person_naming_no_known_model_gets_the_main_one_and_the_chores_one_by_name(pair):
    srv, main_engine, small, held, release = pair
    release.set()
    assert call(srv.port, "POST", CHAT, {"model": "gpt-4", "messages": USER}).json()["model"] == "big"
    assert call(srv.port, "POST", CHAT, {"model": "small", "messages": USER}).json()["model"] == "small"
    assert len(main_engine.prompts) == 1 and len(small.prompts) == 1


def test_one_model_answers_every_request_chores_included():
    engine = ScriptedEngine([xtml_answer("only")] * 2)
    with serving(scripted_service(engine, model_id="only", thinking=False)) as srv:
        for body in ({"model": "small", "messages": TASK}, {"model": "gpt-4", "messages": USER}):
            assert call(srv.port, "POST", CHAT, body).json()["model"] == "only"
        health = call(srv.port, "GET", "/health").json()
        assert "models" not in health
        assert all("model" not in dict(labels) for _, labels in scrape(srv.port))


@pytest.mark.parametrize("how", ["header", "priority"])
def test_a_chore_by_any_of_the_classification_s_rules_goes_to_the_chores_model(pair, how):
    srv, main_engine, small, held, release = pair
    body = {"model": "big", "messages": USER, **({"priority": 5} if how == "priority" else {})}
    headers = {"X-Serve-Class": "background"} if how == "header" else {}
    assert call(srv.port, "POST", CHAT, body, headers=headers).json()["model"] == "small"
    assert main_engine.prompts == []


def test_an_open_webui_title_chore_naming_the_main_model_never_touches_its_engine(two):
    before = evaluated(two.port)
    reply = call(two.port, "POST", CHAT, {"model": "k3", "max_tokens": 4, "messages": TASK}).json()
    assert reply["model"] == CHORES
    moved = {m: n - before[m] for m, n in evaluated(two.port).items()}
    assert moved["k3"] == 0 and moved[CHORES] > 0


def test_the_chores_model_takes_a_quarter_of_the_cores_unless_told():
    quarter = max(1, (os.cpu_count() or 1) // 4)
    assert threads(argparse.Namespace(chores_threads=0)) == quarter
    assert threads(argparse.Namespace(chores_threads=3)) == 3
