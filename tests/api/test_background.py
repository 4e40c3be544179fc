"""Background responses through the official `openai` client, at a scaled K3 clock.

`responses.create(background=True)` answers at once; the client polls with
`responses.retrieve`, resumes the event stream after a sequence number
(`retrieve(..., stream=True, starting_after=N)` and `responses.stream(response_id=...)`),
and cancels with `responses.cancel`. A restart ends one still running as failed, saying
why, and never leaves it in_progress.
"""
from __future__ import annotations

import signal
import time

import openai
import pytest

from scripted import call
from served import serve
from slow_clock import prompt_text

DELAY_MS = 40


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def slow(k3_container, lib_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        # Prefill steps of 64 positions: a prompt of a few hundred is several chunks
        with serve(k3_container, lib_path, tmp_path_factory.mktemp("bg"), "--no-thinking",
                   "--no-prefix-cache", "--prefill-step", "64") as served:
            yield served


def _until(check, what: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _text(response) -> str:
    return "".join(part.text for item in response.output if item.type == "message"
                   for part in item.content)


def test_create_poll_resume_and_finish(slow):
    client = _client(slow.port)
    created = client.responses.create(model="k3", input="Say a long thing.", background=True,
                                      max_output_tokens=60, temperature=0)
    assert created.background is True and created.status in ("queued", "in_progress")
    # Polled: in progress, with its output so far.
    running = _until(lambda: (r := client.responses.retrieve(created.id)).status == "in_progress"
                     and _text(r) and r, "never in progress with output")
    assert running.id == created.id
    # The stream from the start, then resumed after one of its events.
    whole = list(client.responses.retrieve(created.id, stream=True))
    numbers = [event.sequence_number for event in whole]
    assert numbers == list(range(len(numbers))) and whole[0].type == "response.created"
    assert whole[-1].type in ("response.completed", "response.incomplete")
    cut = len(whole) // 2
    resumed = list(client.responses.retrieve(created.id, stream=True, starting_after=cut))
    assert [e.sequence_number for e in resumed] == numbers[cut + 1:]
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in whole[cut + 1:]]
    done = client.responses.retrieve(created.id)
    assert done.status == whole[-1].response.status and _text(done) == _text(whole[-1].response)
    # Stored like any other response: the next turn can name it.
    follow = client.responses.create(model="k3", input="And then?", previous_response_id=done.id,
                                     max_output_tokens=3)
    assert follow.status in ("completed", "incomplete")


def test_a_client_that_leaves_its_stream_loses_nothing(slow):
    client = _client(slow.port)
    with client.responses.stream(model="k3", input="Tell a long tale.", background=True,
                                 max_output_tokens=60, temperature=0) as stream:
        seen = []
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) > 6:
                break
    response_id = seen[0].response.id
    done = _until(lambda: (r := client.responses.retrieve(response_id)).status
                  in ("completed", "incomplete") and r, "never finished")
    said = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert _text(done).startswith(said) and len(_text(done)) > len(said)
    # Resumed through the client's own helper, after the last event it had.
    with client.responses.stream(response_id=response_id,
                                 starting_after=seen[-1].sequence_number) as again:
        rest = list(again)
    assert rest[0].sequence_number == seen[-1].sequence_number + 1
    assert said + "".join(e.delta for e in rest if e.type == "response.output_text.delta") \
        == _text(done)


def test_cancel_stops_it_and_says_cancelled(slow):
    client = _client(slow.port)
    created = client.responses.create(model="k3", input="Go on and on.", background=True,
                                      max_output_tokens=400, temperature=0)
    # Another's key cannot cancel it while it runs.
    other = openai.OpenAI(base_url=f"http://127.0.0.1:{slow.port}/v1", api_key="other",
                          max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(created.id)
    _until(lambda: _text(client.responses.retrieve(created.id)), "no output before the cancel")
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    final = _until(lambda: (r := client.responses.retrieve(created.id)).status == "cancelled"
                   and list(client.responses.retrieve(created.id, stream=True))[-1].type
                   == "response.cancelled" and r, "the cancel never ended it")
    assert final.usage.output_tokens < 400
    # The engine is free again: a request after it is answered.
    after = client.responses.create(model="k3", input="hi", max_output_tokens=2)
    assert after.status in ("completed", "incomplete")


def test_background_is_refused_where_it_cannot_be_kept(slow):
    client = _client(slow.port)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="k3", input="hi", background=True, store=False)
    assert caught.value.body["param"] == "store"
    plain = client.responses.create(model="k3", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        list(client.responses.retrieve(plain.id, stream=True))
    assert caught.value.body["param"] == "stream"


def test_without_a_disk_the_banner_says_a_restart_forgets_them(slow):
    # --no-prefix-cache: nowhere to record them, yet background: true is taken.
    (line,) = [line for line in slow.banner if line.startswith("records ")]
    assert "memory only" in line and "forgets" in line
    created = _client(slow.port).responses.create(model="k3", input="hi", background=True,
                                                  max_output_tokens=2)
    assert created.status in ("queued", "in_progress")
    assert not (slow.prefix / "responses").exists()


def test_a_restart_ends_a_running_background_response_as_failed(k3_container, lib_path, tmp_path):
    shared = tmp_path / "team"
    for part in ("a", "b"):
        (tmp_path / part).mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        with serve(k3_container, lib_path, tmp_path / "a", "--no-thinking",
                   "--shared-cache", str(shared)) as first:
            client = _client(first.port)
            created = client.responses.create(model="k3", input="A very long story.",
                                              background=True, max_output_tokens=500)
            _until(lambda: _text(client.responses.retrieve(created.id)), "no output")
            assert first.stop(signal.SIGTERM) == 0
        with serve(k3_container, lib_path, tmp_path / "b", "--no-thinking",
                   "--shared-cache", str(shared)) as second:
            after = _client(second.port).responses.retrieve(created.id)
    assert after.status == "failed" and "shutting down" in after.error.message
    assert _text(after)   # what it said before the restart is kept


def _created(port: int, **body) -> tuple[str, str]:
    """A background response made through the client: its id, and its job's (X-Serve-Job)."""
    raw = _client(port).responses.with_raw_response.create(model="k3", background=True,
                                                           temperature=0, **body)
    return raw.parse().id, raw.headers["x-serve-job"]


def _get(port: int, path: str) -> dict:
    """GET with the client's credentials (a job answers only those that started it)."""
    return call(port, "GET", path, headers={"Authorization": "Bearer k"}).json()


def _post(port: int, path: str) -> dict:
    return call(port, "POST", path, headers={"Authorization": "Bearer k"}).json()


def test_a_background_response_shows_its_prefill_and_estimate(slow):
    """GET /v1/responses/{id} says in `waste.prefill` what GET /v1/jobs/{id} and a stream's
    progress comments do: positions, restored, evaluated, the rate, the first token's time."""
    response_id, job = _created(slow.port, input=prompt_text(20, "bg eta"), max_output_tokens=2)
    running = _until(lambda: (r := _get(slow.port, f"/v1/responses/{response_id}"))
                     ["waste"]["prefill"]["first_token_seconds"] and r, "no estimate in prefill")
    shown = running["waste"]["prefill"]
    assert running["status"] == "in_progress" and shown["positions"] > 64
    # (an estimate from the start: the rate earlier prefills measured)
    assert 0 <= shown["evaluated"] < shown["positions"] and shown["positions_per_second"] > 0
    assert shown["first_token_at"] > time.time() - 1
    assert _get(slow.port, f"/v1/jobs/{job}")["prefill"]["positions"] \
        == shown["positions"]
    done = _until(lambda: (r := _client(slow.port).responses.retrieve(response_id)).status
                  in ("completed", "incomplete") and r, "never finished")
    assert "prefill" not in done.model_extra["waste"]   # the final Response: its usage says it


def test_answer_now_reaches_a_background_response(slow):
    client = _client(slow.port)
    response_id, job = _created(slow.port, input="Think about a long story.",
                                reasoning={"effort": "high"}, max_output_tokens=80)
    state = _until(lambda: (s := _get(slow.port, f"/v1/jobs/{job}"))["output"]
                   ["deltas"] >= 5 and s, "no reasoning before the call")
    assert state["output"]["reasoning"] and not state["output"]["content"], \
        "the model closed its reasoning itself: nothing to test"
    assert _post(slow.port, f"/v1/jobs/{job}/answer")["answering"] is True
    done = _until(lambda: (r := client.responses.retrieve(response_id)).status
                  in ("completed", "incomplete") and r, "never finished")
    assert [item.type for item in done.output] == ["reasoning", "message"] and _text(done)
    assert done.model_extra["waste"]["reasoning_ended"] == "answer_now"
    assert done.usage.output_tokens_details.reasoning_tokens == \
        done.model_extra["waste"]["reasoning_tokens"] < 40
    kinds = [e.type for e in client.responses.retrieve(response_id, stream=True)
             if e.type in ("response.reasoning_text.delta", "response.output_text.delta")]
    assert "response.reasoning_text.delta" not in kinds[kinds.index("response.output_text.delta"):]


def test_stop_through_the_job_api_ends_a_background_response(slow):
    client = _client(slow.port)
    response_id, job = _created(slow.port, input="Go on and on.", max_output_tokens=400)
    _until(lambda: _text(client.responses.retrieve(response_id)), "no output before the stop")
    assert _post(slow.port, f"/v1/jobs/{job}/stop")["stop_requested"] is True
    done = _until(lambda: (r := client.responses.retrieve(response_id)).status
                  not in ("queued", "in_progress") and r, "the stop never ended it")
    assert done.status == "completed" and 0 < done.usage.output_tokens < 400   # a normal finish
    assert _get(slow.port, f"/v1/jobs/{job}")["status"] == "stopped"
