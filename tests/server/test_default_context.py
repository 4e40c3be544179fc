"""The default context: the largest the model takes that fits the RAM budget, capped; --ctx overrides.

An agent's first request is tens of thousands of positions; the ABI's default
of 4096 refused it. A prompt that still does not fit is a 400 naming both
numbers and --ctx.
"""
from __future__ import annotations

import json
from pathlib import Path

from agents import claude_code_first_message, claude_code_request
from conftest import make_container
from scripted import assert_error, call
from served import cli_server
from serve.app.context import CAP, STATE_SHARE, beyond, choose_context


def test_a_model_that_takes_more_than_the_cap_gets_the_cap(lib, k3_container):
    assert json.loads((k3_container / "manifest.json").read_text())["context_length"] >= CAP
    choice = choose_context(lib, str(k3_container), 0, 0, vision=False)
    assert choice.tokens == CAP and "--ctx for more" in choice.reason


def test_the_model_s_own_length_bounds_it(lib, tmp_path):
    short = make_container(tmp_path / "short.waste", "--context-length", "10000")
    choice = choose_context(lib, str(short), 0, 0, vision=False)
    assert choice.tokens == 8192
    # What was chosen, and why; not what was refused on the way.
    assert choice.reason == ("the largest of serve's candidates the model takes (it takes up to "
                             "10,000; --ctx for more)")
    exact = make_container(tmp_path / "exact.waste", "--context-length", "8192")
    choice = choose_context(lib, str(exact), 0, 0, vision=False)
    assert (choice.tokens, choice.reason) == (8192, "the most the model takes")
    tiny = make_container(tmp_path / "tiny.waste", "--context-length", "300")
    choice = choose_context(lib, str(tiny), 0, 0, vision=False)
    assert choice.tokens == 0 and "engine's default" in choice.reason   # the engine opens it at 300


def test_the_budget_bounds_it_so_that_the_expert_cache_keeps_most_of_it(lib, k3_container):
    state = lib.plan_memory(k3_container, 16384)
    budget = (state.state_bytes + state.scratch_bytes) * STATE_SHARE + 1   # room for 16384, not more
    choice = choose_context(lib, str(k3_container), 0, budget, vision=False)
    assert choice.tokens == 16384 and "quarter" in choice.reason and "32,768 would not" in choice.reason


def test_ctx_overrides_it(lib, k3_container):
    assert choose_context(lib, str(k3_container), 2048, 0, vision=False).tokens == 2048


def test_the_default_context_fits_claude_codes_request(lib_path, k3_container, tmp_path):
    body = claude_code_request([claude_code_first_message("Tidy up the README.")])
    with cli_server(str(k3_container), "--lib", str(lib_path), "--usage", str(tmp_path / "u"),
                    "--prefix-cache-dir", str(tmp_path / "cache")) as (proc, port, banner):
        assert f"context  {CAP:,} positions: the largest serve picks by itself; --ctx for more" in banner
        ctx = call(port, "GET", "/v1/models").json()["data"][0]["waste"]["ctx"]
        counted = call(port, "POST", "/v1/messages/count_tokens",
                       {k: v for k, v in body.items() if k not in ("max_tokens", "stream")})
        assert counted.status == 200, counted.body
    assert ctx == CAP and 20_000 < counted.json()["input_tokens"] < ctx


def test_a_prompt_the_context_cannot_hold_names_both_numbers_and_ctx(lib_path, k3_container, tmp_path):
    words = " ".join(f"w{n}" for n in range(3000))
    with cli_server(str(k3_container), "--lib", str(lib_path), "--ctx", "1024", "--usage",
                    str(tmp_path / "u"), "--prefix-cache-dir", str(tmp_path / "cache")) as (_, port, _b):
        resp = call(port, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": words}], "max_tokens": 4})
    assert_error(resp, 400, param="messages", code="context_length_exceeded")
    message = resp.json()["error"]["message"]
    assert "the context holds 1024" in message and "--ctx" in message
    assert int(message.split("the prompt is ")[1].split()[0]) > 1024


def test_plan_prints_the_chosen_context(lib_path, tmp_path):
    from served import run_cli
    short = make_container(Path(tmp_path) / "short.waste", "--context-length", "8192")
    done = run_cli(str(short), "--plan", lib_path=lib_path)
    assert done.returncode == 0 and "(ctx 8192: the most the model takes)" in done.stdout


def test_a_larger_context_is_named_only_when_there_is_one(lib, tmp_path, k3_container):
    exact = make_container(tmp_path / "exact.waste", "--context-length", "8192")
    assert beyond(lib, str(exact), 8192, 0, vision=False) == "the most this model takes"
    assert "--ctx" in beyond(lib, str(exact), 4096, 0, vision=False)
    # The model takes more, but the budget holds no more than this context's floor.
    floor = lib.plan_memory(k3_container, 2048).floor_bytes
    assert beyond(lib, str(k3_container), 2048, floor, vision=False).startswith("the most the ")
    assert "--ctx" in beyond(lib, str(k3_container), 2048, 0, vision=False)


def test_a_prompt_too_long_for_the_model_s_own_limit_does_not_name_ctx(lib_path, tmp_path):
    short = make_container(tmp_path / "short.waste", "--context-length", "1024")
    words = " ".join(f"w{n}" for n in range(3000))
    with cli_server(str(short), "--lib", str(lib_path), "--ctx", "1024", "--usage",
                    str(tmp_path / "u"), "--prefix-cache-dir", str(tmp_path / "cache")) as (_, port, banner):
        resp = call(port, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": words}], "max_tokens": 4})
    message = assert_error(resp, 400, param="messages", code="context_length_exceeded")["message"]
    assert "the context holds 1024" in message and message.endswith("(the most this model takes)")
    assert "--ctx" not in message
