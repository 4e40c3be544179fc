#!/usr/bin/env python3
"""Tool use on SmolLM2-135M-Instruct, a model never taught serve's call format: free against constrained.

    .venv/bin/python bench/tool_use.py [CONTAINER] [--lib PATH]

CONTAINER defaults to build/smollm2.waste (`make demo` or tools/fetch_model.py
writes it).  20 prompts, each with one right answer: a call of a given tool
with given arguments, among five declared tools.  Every prompt is asked
greedily three ways, on the same prompt (the tools declared in serve's generic
form, docs/api.md):

- free: decoded without a grammar; a call counts when the model wrote the call
  marker (the template's `open` token) and then a well-formed call, as serve's
  parser reads it; "any JSON" also counts a call written as text anywhere;
- auto: `tool_choice: auto` under the grammar (the model may still answer in text);
- required: `tool_choice: required` under the grammar.

"valid" is a call whose arguments parse and meet its tool's schema; "right
tool" and "right call" (the tool with the expected arguments: strings contain
the expected text, case aside; numbers equal) are counted over all prompts.
The quality is the model's; validity under the grammar must be 100%.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jsonschema

from common import ROOT, Quiet, machine

from serve import (Engine, EngineConfig, GenParams, Service, ServiceOptions,  # noqa: E402
                   load_library, parse_chat_request, resolve_chat_format)

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"]}
CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Get the current weather in a city",
                                      "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time",
                                      "description": "Get the current local time in a city",
                                      "parameters": CITY}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money between currencies",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from_currency": CURRENCY, "to_currency": CURRENCY},
            "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string", "maxLength": 60}, "subject": {"type": "string", "maxLength": 60}},
            "required": ["to", "subject"]}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 80}},
                       "required": ["query"]}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
PROMPTS = [
    ("What is the weather like in Paris right now?", "get_weather", {"city": "Paris"}),
    ("Is it raining in London?", "get_weather", {"city": "London"}),
    ("How hot is it in Cairo today?", "get_weather", {"city": "Cairo"}),
    ("Tell me the weather forecast for Tokyo.", "get_weather", {"city": "Tokyo"}),
    ("What's the temperature in Berlin?", "get_weather", {"city": "Berlin"}),
    ("What time is it in New York?", "get_time", {"city": "New York"}),
    ("What is the local time in Sydney?", "get_time", {"city": "Sydney"}),
    ("Tell me the current time in Madrid.", "get_time", {"city": "Madrid"}),
    ("What time is it now in Rome?", "get_time", {"city": "Rome"}),
    ("Convert 100 US dollars to euros.", "convert_currency",
     {"amount": 100, "from_currency": "USD", "to_currency": "EUR"}),
    ("How many Japanese yen is 50 euros?", "convert_currency",
     {"amount": 50, "from_currency": "EUR", "to_currency": "JPY"}),
    ("Change 20 British pounds into US dollars.", "convert_currency",
     {"amount": 20, "from_currency": "GBP", "to_currency": "USD"}),
    ("Convert 75 Swiss francs to euros.", "convert_currency",
     {"amount": 75, "from_currency": "CHF", "to_currency": "EUR"}),
    ("Send an email to alice@example.com with the subject Lunch.", "send_email",
     {"to": "alice@example.com", "subject": "Lunch"}),
    ("Email bob@example.com, subject: Meeting moved.", "send_email",
     {"to": "bob@example.com", "subject": "Meeting"}),
    ("Write to carol@example.com with the subject Invoice.", "send_email",
     {"to": "carol@example.com", "subject": "Invoice"}),
    ("Send dave@example.com an email titled Hello.", "send_email",
     {"to": "dave@example.com", "subject": "Hello"}),
    ("Search the web for the tallest mountain in Africa.", "search_web",
     {"query": "tallest mountain"}),
    ("Look up the population of Canada online.", "search_web", {"query": "population of Canada"}),
    ("Find recipes for banana bread on the web.", "search_web", {"query": "banana bread"}),
]
MAX_TOKENS = 64
CALL_TEXT = re.compile(r'\{"name"\s*:')


def right(arguments: dict, expected: dict) -> bool:
    for key, want in expected.items():
        got = arguments.get(key)
        if isinstance(want, str):
            if not isinstance(got, str) or want.lower() not in got.lower():
                return False
        elif got != want:
            return False
    return True


def score(calls: list[tuple[str, str]], tool: str, expected: dict) -> tuple[bool, bool, bool]:
    """(valid, right tool, right call) of a reply's first call."""
    if not calls:
        return False, False, False
    name, text = calls[0]
    try:
        arguments = json.loads(text)
        jsonschema.validate(arguments, SCHEMAS[name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False, name == tool, False
    return True, name == tool, name == tool and right(arguments, expected)


def text_calls(text: str) -> list[tuple[str, str]]:
    """Calls written as text anywhere in a reply: {"name": ..., "arguments": {...}}."""
    found = []
    decoder = json.JSONDecoder()
    for match in CALL_TEXT.finditer(text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("name"), str) \
                and isinstance(value.get("arguments"), dict):
            found.append((value["name"], json.dumps(value["arguments"])))
    return found


def free(service: Service, engine: Engine, question: str) -> tuple[list, list]:
    """The reply decoded without a grammar: (calls serve's parser reads, calls in the text)."""
    fmt = service.chat_format
    segments = fmt.render([{"role": "user", "content": question}], tools=TOOLS, thinking=False).segments
    parser = fmt.new_parser(thinking=False)
    pieces: list[bytes] = []

    def on_token(info, piece: bytes) -> bool:
        parser.feed_token(info.token, piece)
        pieces.append(piece)
        return False

    engine.reset()
    engine.generate(engine.tokenize_segments(segments),
                    GenParams(temperature=0.0, max_tokens=MAX_TOKENS,
                              stop_tokens=tuple(fmt.stop_tokens)), on_token)
    engine.reset()
    parser.finish()
    marked = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.reply.tool_calls]
    return marked, text_calls(b"".join(pieces).decode("utf-8", "replace"))


def constrained(service: Service, question: str, choice: str) -> list:
    body = {"messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "tool_choice": choice, "temperature": 0, "max_tokens": MAX_TOKENS}
    reply = service.chat(parse_chat_request(body), Quiet())
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in reply.message.get("tool_calls") or []]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(ROOT / "build" / "smollm2.waste"))
    ap.add_argument("--lib", default=str(ROOT / "libwaste.so"))
    args = ap.parse_args()
    if not (Path(args.container) / "manifest.json").is_file():
        print(f"{args.container}: no container (tools/fetch_model.py writes it)", file=sys.stderr)
        return 2
    lib = load_library(args.lib)
    modes = ("free (marker)", "free (any JSON)", "auto", "required")
    tally = {mode: [0, 0, 0] for mode in modes}
    with Engine(lib, args.container, EngineConfig(ctx=2048)) as engine:
        service = Service(engine, lib, resolve_chat_format(engine, args.container),
                          ServiceOptions(model_id="smollm2", thinking=False))
        for question, tool, expected in PROMPTS:
            marked, anywhere = free(service, engine, question)
            replies = {"free (marker)": marked, "free (any JSON)": anywhere,
                       "auto": constrained(service, question, "auto"),
                       "required": constrained(service, question, "required")}
            for mode, calls in replies.items():
                for i, hit in enumerate(score(calls, tool, expected)):
                    tally[mode][i] += hit
            print(f"{question:60.60} required: {replies['required'][:1]}", flush=True)
    n = len(PROMPTS)
    print(f"\nSmolLM2-135M-Instruct, {n} prompts, greedy, {machine()}")
    print(f"{'':18} {'valid call':>11} {'right tool':>11} {'right call':>11}")
    for mode in modes:
        print(f"{mode:18} " + " ".join(f"{count}/{n}".rjust(11) for count in tally[mode]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
