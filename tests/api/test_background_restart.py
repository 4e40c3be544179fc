"""Background responses across a restart, through the official `openai` client and a real
server process: killed (SIGKILL), stopped, sharing its cache directory with another server,
and with a damaged record on disk. Each record is in responses/ under the prefix cache's
directory (serve/service/background_records.py)."""
from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from served import run_cli, serve
from serve.service.background_records import Records
from test_background import DELAY_MS, _client, _text, _until


def _records(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "prefix" / "responses").iterdir() if not p.name.startswith(".")]


def _raw_get(port: int, response_id: str, key: str) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/responses/{response_id}",
                                     headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _running(client: openai.OpenAI, max_output_tokens: int = 500):
    """A background response that has begun to answer (at 40 ms a token it runs on)."""
    created = client.responses.create(model="k3", input="A very long story.", background=True,
                                      max_output_tokens=max_output_tokens, temperature=0)
    _until(lambda: _text(client.responses.retrieve(created.id)), "no output")
    return created


@pytest.fixture
def slow_clock():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        yield


def test_a_killed_server_s_response_is_failed_after_the_restart(slow_clock, k3_container,
                                                                lib_path, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as first:
        client = _client(first.port)
        short = client.responses.create(model="k3", input="hi", background=True,
                                        max_output_tokens=4, temperature=0)
        done = _until(lambda: (r := client.responses.retrieve(short.id)).status
                      in ("completed", "incomplete") and r, "the short one never finished")
        created = _running(client)
        seen = []
        for event in client.responses.retrieve(created.id, stream=True):
            seen.append(event)
            if len(seen) > 8:
                break
        # Recorded again while it runs (every RECORD_EVERY s), with what it has said.
        _until(lambda: any(created.id.encode() in data and b'"in_progress"' in data
                           and b'"output_text"' in data
                           for data in (p.read_bytes() for p in _records(tmp_path))),
               "never recorded while it ran", timeout=120)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as second:
        client = _client(second.port)
        after = client.responses.retrieve(created.id)
        assert after.status == "failed" and after.background is True
        assert "restarted" in after.error.message and "killed" in after.error.message
        said = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert _text(after).startswith(said) and len(_text(after)) > len(said)
        assert "1 background response(s) left unfinished" in second.log()
        (line,) = [line for line in second.banner if line.startswith("records ")]
        assert str(tmp_path / "prefix" / "responses") in line and "failed" in line
        # Its stream, resumed where the client was, ends with the failure.
        resumed = list(client.responses.retrieve(created.id, stream=True,
                                                 starting_after=seen[-1].sequence_number))
        assert [e.type for e in resumed] == ["response.failed"]
        assert resumed[0].sequence_number > seen[-1].sequence_number
        assert resumed[0].response.error.message == after.error.message
        assert _text(resumed[0].response) == _text(after)
        beyond = list(client.responses.retrieve(created.id, stream=True, starting_after=100000))
        assert [(e.type, e.sequence_number) for e in beyond] == [("response.failed", 100001)]
        # The one that finished before the kill is as it was.
        kept = client.responses.retrieve(short.id)
        assert kept.status == done.status and _text(kept) == _text(done)
        assert kept.usage.output_tokens == done.usage.output_tokens
        # Another key's GET is the 404 of an id never made, byte for byte but the id.
        never = created.id[:-4] + ("0000" if not created.id.endswith("0000") else "1111")
        status, body = _raw_get(second.port, created.id, "other")
        never_status, never_body = _raw_get(second.port, never, "k")
        assert status == never_status == 404
        assert body.replace(created.id.encode(), b"ID") == never_body.replace(never.encode(), b"ID")
        assert _raw_get(second.port, created.id, "k")[0] == 200
        # DELETE forgets it here and on disk.
        client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(created.id)
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as third:
        with pytest.raises(openai.NotFoundError):
            _client(third.port).responses.retrieve(created.id)
        assert "left unfinished" not in third.log()   # failed once, not at every start


def test_a_stopped_server_s_response_is_failed_with_what_it_said(slow_clock, k3_container,
                                                                lib_path, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as first:
        client = _client(first.port)
        created = _running(client)
        assert first.stop(signal.SIGTERM) == 0
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as second:
        client = _client(second.port)
        after = client.responses.retrieve(created.id)
        ended = list(client.responses.retrieve(created.id, stream=True, starting_after=2))
    # Ended at the shutdown, in drain time, and recorded so: not "restarted" at the next start.
    assert after.status == "failed" and "shutting down" in after.error.message
    assert _text(after)   # what it said before the shutdown is kept
    assert "left unfinished" not in second.log()
    assert [e.type for e in ended] == ["response.failed"] and ended[0].sequence_number > 2


def test_another_server_s_start_leaves_a_running_response_alone(slow_clock, k3_container,
                                                              lib_path, tmp_path):
    beside = tmp_path / "beside"
    beside.mkdir()
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as first:
        client = _client(first.port)
        created = _running(client, max_output_tokens=150)
        # A second server on the same cache directory, while the response runs.
        with serve(k3_container, lib_path, beside, "--no-thinking",
                   "--prefix-cache-dir", str(tmp_path / "prefix")) as second:
            assert "left unfinished" not in second.log()
            assert client.responses.retrieve(created.id).status == "in_progress"
            done = _until(lambda: (r := client.responses.retrieve(created.id)).status
                          in ("completed", "incomplete") and r, "never finished", timeout=180)
            # Its record, written by the first, answers on the second too.
            there = _client(second.port).responses.retrieve(created.id)
            assert there.status == done.status and _text(there) == _text(done)
            # The first killed while another runs: the second, asked for it, finds it failed.
            cut = _running(client)
            assert first.stop(signal.SIGKILL) == -signal.SIGKILL
            after = _client(second.port).responses.retrieve(cut.id)
            assert after.status == "failed" and "restarted" in after.error.message


def test_a_damaged_record_is_ignored_and_logged(slow_clock, k3_container, lib_path, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as first:
        client = _client(first.port)
        made = [client.responses.create(model="k3", input="hi", background=True,
                                        max_output_tokens=2) for _ in range(2)]
        for response in made:
            _until(lambda: client.responses.retrieve(response.id).status
                   in ("completed", "incomplete"), "never finished")
    truncated, flipped = sorted(_records(tmp_path))[:2]
    truncated.write_bytes(truncated.read_bytes()[:-40])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (tmp_path / "prefix" / "responses" / "stray").write_bytes(b"not a record at all")
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as second:
        client = _client(second.port)
        for response in made:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(response.id)
        assert second.log().count("ignored the background response record") == 3
        # The server goes on: a new background response is recorded and answered.
        fresh = client.responses.create(model="k3", input="hi", background=True,
                                        max_output_tokens=2)
        _until(lambda: client.responses.retrieve(fresh.id).status in ("completed", "incomplete"),
               "the fresh one never finished")
    assert len(_records(tmp_path)) == 1   # the damaged ones were removed


def test_an_unusable_records_directory_stops_the_start_saying_why(k3_container, lib_path,
                                                                 tmp_path):
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "responses").write_text("a file where the records go")
    done = run_cli(str(k3_container), "--lib", str(lib_path), "--port", "0",
                   "--prefix-cache-dir", str(tmp_path / "prefix"))
    assert done.returncode == 1
    assert "prefix cache:" in done.stderr and "responses" in done.stderr


def test_a_record_that_cannot_be_written_is_logged_and_the_response_still_runs(
        k3_container, lib_path, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--no-thinking") as served:
        records = tmp_path / "prefix" / "responses"
        records.rename(tmp_path / "moved")
        records.write_text("a file where the records go: every write fails")
        client = _client(served.port)
        created = client.responses.create(model="k3", input="hi", background=True,
                                          max_output_tokens=2)
        done = _until(lambda: (r := client.responses.retrieve(created.id)).status
                      in ("completed", "incomplete") and r, "never finished")
        assert done.id == created.id
        assert served.log().count(f"the record of background response {created.id} was not "
                                  "written") == 2   # accepted, and ended


def test_records_are_bounded_by_count_and_bytes_oldest_out(tmp_path):
    warned: list[str] = []
    records = Records(str(tmp_path / "responses"), warned.append, max_records=3, max_bytes=1 << 20)

    def response(n: int, text: str = "") -> dict:
        return {"id": f"resp_{n}", "status": "completed", "output": [text]}

    for n in range(5):
        records.write(response(n), "owner", 1)
        time.sleep(0.05)   # apart in mtime, which orders eviction
    assert [n for n in range(5) if records.get(f"resp_{n}", "owner")] == [2, 3, 4]
    records.write(response(9, "x" * 600_000), "owner", 1)
    time.sleep(0.05)
    records.write(response(10, "y" * 600_000), "owner", 1)   # past the bytes: the rest go
    assert [n for n in (2, 3, 4, 9, 10) if records.get(f"resp_{n}", "owner")] == [10]
    assert warned == []
