"""The model list read by the `openai` client: the served context under the names agents read
(vLLM's max_model_len, LM Studio's max_context_length, OpenRouter's context_length), beside
serve's own `waste` object; a chores model reports its own."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from scripted import real_service, serving
from serve.service.model_card import CONTEXT_FIELDS
from serve.service.models import Models

MAIN_CTX, CHORES_CTX = 512, 256


@pytest.fixture(scope="module")
def client(lib_path, k3_container, kimi_linear_container):
    with real_service(lib_path, k3_container, ctx=MAIN_CTX, model_id="k3") as main, \
            real_service(lib_path, kimi_linear_container, ctx=CHORES_CTX,
                         model_id="chores") as chores, \
            serving(Models([main, chores], chores=chores)) as srv:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused",
                           max_retries=0, timeout=30) as c:
            yield c


def fields(model) -> dict:
    return {name: getattr(model, name) for name in (*CONTEXT_FIELDS, "waste")}


def test_each_model_reports_the_context_it_is_served_with(client):
    listed = {model.id: fields(model) for model in client.models.list().data}
    assert set(listed) == {"k3", "chores"}
    for model_id, ctx in (("k3", MAIN_CTX), ("chores", CHORES_CTX)):
        entry = listed[model_id]
        assert entry["max_model_len"] == entry["max_context_length"] == entry["context_length"] \
            == entry["waste"]["ctx"] == ctx
        assert fields(client.models.retrieve(model_id)) == entry


def test_names_are_documented():
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name in CONTEXT_FIELDS:
        assert f"`{name}`" in api
