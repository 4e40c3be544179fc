"""Requests shaped like the ones Claude Code 2.1 and Codex 0.171 send, at their real sizes.

The texts are made up here; what is kept is the structure and the size:
Claude Code's three system blocks (~5.7 KB, the first its billing header), 24 tools with ~64 KB of JSON
schemas, a <system-reminder> opening the first user message; Codex's
developer message, nine tools in ~19 KB with a namespace and web_search.
"""
from __future__ import annotations

import json
from typing import Any

CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                      "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
                      "mid-conversation-system-2026-02-01,effort-2025-11-24",
    "x-app": "cli", "user-agent": "claude-cli/2.1.0 (external, cli)",
}
CODEX_HEADERS = {"session-id": "0199a213-81c0-7800-8aa1-bbab2a035a53", "originator": "codex_cli_rs",
                 "x-codex-turn-metadata": '{"turn":1}', "x-codex-beta-features": "namespaces",
                 "accept-encoding": "zstd,gzip"}


def _schema(tool: int, size: int) -> dict:
    """A JSON schema of about `size` bytes, with the nesting real tool schemas have."""
    properties: dict[str, Any] = {}
    n = 0
    while len(json.dumps(properties)) < size:
        properties[f"option_{n}"] = {
            "type": "object" if n % 3 == 0 else "string",
            "description": f"Setting {n} of tool {tool}: what it changes, when to use it and "
                           f"which values are accepted, written out as tool docs are.",
            **({"properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "additionalProperties": False} if n % 3 == 0 else {})}
        n += 1
    return {"type": "object", "properties": properties, "required": ["option_0"],
            "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}


def claude_code_tools() -> list[dict]:
    tools = [{"name": f"Tool{j}", "description": f"Tool number {j}. " + "Usage notes. " * 40,
              "input_schema": _schema(j, 2000)} for j in range(24)]
    tools.append({"type": "web_search_20250305", "name": "web_search", "max_uses": 8})
    return tools


def claude_code_billing(cch: str) -> dict:
    """Claude Code's billing header: its version suffix and `cch` change on every request."""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{cch[:3]}; "
                                    f"cc_entrypoint=cli; cch={cch};"}


def claude_code_system(cch: str = "5e1a7") -> list[dict]:
    return [claude_code_billing(cch),
            {"type": "text", "text": "You are an interactive CLI tool that helps with software "
                                     "engineering tasks.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Working directory: /home/user/project\n" + "Guideline. " * 500,
             "cache_control": {"type": "ephemeral"}}]


def claude_code_request(messages: list[dict], cch: str = "5e1a7", **overrides: Any) -> dict:
    body = {"model": "claude-opus-4-5", "max_tokens": 32000, "stream": True,
            "system": claude_code_system(cch), "tools": claude_code_tools(), "messages": messages,
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user_abc_account_def_session_0199a213"}}
    return {**body, **overrides}


def claude_code_first_message(text: str) -> dict:
    return {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-01.\n</system-reminder>"},
        {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}


def codex_tools() -> list[dict]:
    def function(name: str, size: int) -> dict:
        return {"type": "function", "name": name, "description": f"The {name} tool. " + "Detail. " * 30,
                "strict": False, "parameters": _schema(len(name), size)}

    tools = [function(name, 1800) for name in ("shell", "apply_patch", "update_plan", "view_image",
                                               "read_file", "list_dir", "grep_files")]
    tools.append({"type": "namespace", "name": "agents", "description": "Sub-agents.",
                  "tools": [function("spawn", 1500), function("wait", 500)]})
    tools.append({"type": "web_search", "external_web_access": False})
    return tools


def codex_request(input_items: list[dict], **overrides: Any) -> dict:
    body = {"model": "k3", "instructions": None, "input": input_items, "tools": codex_tools(),
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199a213-81c0-7800-8aa1-bbab2a035a53",
            "client_metadata": {"terminal": "xterm"}}
    body = {**body, **overrides}
    return {k: v for k, v in body.items() if v is not None}


def codex_first_input(text: str) -> list[dict]:
    return [{"type": "message", "role": "developer", "id": "item_0",
             "content": [{"type": "input_text", "text": "You are Codex. " + "Rule. " * 400}]},
            {"type": "message", "role": "user", "id": "item_1",
             "content": [{"type": "input_text", "text": "<environment_context>cwd=/src"
                                                        "</environment_context>"},
                         {"type": "input_text", "text": text}]}]
