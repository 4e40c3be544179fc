"""Ollama's model endpoints, in its shapes: `/api/tags`, `/api/ps`, `/api/show`, `/api/version`.

Each model is listed as `<id>:latest`, and a request may name it with or
without the tag. Its context is where Ollama's clients look for it:
`model_info["<arch>.context_length"]` in /api/show and `context_length` in
/api/ps. serve keeps its models loaded for as long as it runs, so /api/ps lists
every one, never expiring; `size` is 0, as serve does not publish a container's
bytes on disk or in memory.
"""
from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Sequence

from serve.dialects.ollama import ollama_name
from serve.formats import grammar
from serve.service.facade import Service
from serve.version import version

# The Ollama release whose API this follows: clients that turn features on by the version
# (think levels, tools) see one that has them.
OLLAMA_API = "0.33.0"
NEVER = "9999-12-31T23:59:59Z"   # /api/ps's expires_at for a model that stays loaded


def version_body() -> dict:
    return {"version": OLLAMA_API, "serve": version()}


def tags(services: Sequence[Service]) -> dict:
    return {"models": [_listed(s) for s in services]}


def running(services: Sequence[Service]) -> dict:
    return {"models": [{**_listed(s), "expires_at": NEVER, "size_vram": 0,
                        "context_length": s.engine.info.ctx_max} for s in services]}


def show(service: Service) -> dict:
    info, arch = service.engine.info, service.engine.info.arch
    name = ollama_name(service.options.model_id)
    return {"modelfile": f"# served by serve {version()}\nFROM {name}\n", "parameters": "",
            "template": "", "details": _details(service), "capabilities": capabilities(service),
            "modified_at": _modified(service),
            "model_info": {"general.architecture": arch,
                           "general.parameter_count": info.params_total,
                           f"{arch}.context_length": info.ctx_max,
                           f"{arch}.block_count": info.n_layers,
                           f"{arch}.embedding_length": info.hidden,
                           f"{arch}.expert_count": info.n_experts,
                           f"{arch}.expert_used_count": info.top_k}}


def capabilities(service: Service) -> list[str]:
    """What Ollama's clients check before they send a feature: `completion` (a raw
    /api/generate needs no chat format), and what the model's chat format carries (tools only
    where a request with them is not refused)."""
    fmt = service.chat_format
    # A format whose prompt alone cannot get calls (serve's generic one) needs the grammar.
    calls = fmt.prompts_tools or service.generation.decoding_off(grammar.missing()) is None
    return ["completion"] + [name for name, has in (
        ("tools", fmt.supports_tools and fmt.refusal is None and calls),
        ("thinking", fmt.supports_reasoning and fmt.refusal is None),
        ("vision", fmt.supports_images and service.options.vision)) if has]


def _listed(service: Service) -> dict:
    name = ollama_name(service.options.model_id)
    return {"name": name, "model": name, "modified_at": _modified(service), "size": 0,
            "digest": _digest(service), "details": _details(service),
            "capabilities": capabilities(service)}


def _details(service: Service) -> dict:
    info = service.engine.info
    return {"parent_model": "", "format": "waste", "family": info.arch, "families": [info.arch],
            "parameter_size": _parameters(info.params_total),
            "quantization_level": info.quant_summary}


def _parameters(count: int) -> str:
    """Ollama's way of saying a model's size: 7.6B, 135M."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _modified(service: Service) -> str:
    return datetime.fromtimestamp(service.created, timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(service: Service) -> str:
    """A stable name for what is served (Ollama's is its manifest's hash, which serve has not)."""
    info = service.engine.info
    what = f"{service.options.model_id}\0{info.arch}\0{info.params_total}\0{info.quant_summary}"
    return hashlib.sha256(what.encode()).hexdigest()
