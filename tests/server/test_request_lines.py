"""Odd request lines over raw sockets: each gets an answer (JSON, with a request id), a log line
and a count, and none leaves shutdown waiting for a request that is not there."""
from __future__ import annotations

import json
import re
import signal
import socket
import struct
import time

import pytest

from scripted import raw_exchange, scripted_service, serving, status_of
from served import serve

ODD_LINES = {
    # line: (status, what the log line says it was)
    "OPTIONS * HTTP/1.1": (200, "OPTIONS *"),
    "GET http://127.0.0.1/health HTTP/1.1": (200, "GET /health"),
    "TRACE / HTTP/1.1": (501, "TRACE /"),
    "BREW /v1/messages HTTP/1.1": (501, "BREW /v1/messages"),
    "GET /health HTTP/2.0": (505, "'GET /health HTTP/2.0'"),
}


def odd(line: str) -> bytes:
    return f"{line}\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status_of(raw), headers, body


def error_of(raw: bytes, status: int) -> dict:
    got, headers, body = split(raw)
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    assert re.fullmatch(r"req-[0-9a-f]+", headers["x-request-id"])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def counted(port: int, status: int) -> int:
    text = raw_exchange(port, odd("GET /metrics HTTP/1.1")).decode()
    found = re.search(rf'serve_requests_total{{endpoint="[^"]+",status="{status}"}} (\d+)', text)
    return int(found.group(1)) if found else 0


@pytest.fixture
def logged():
    lines: list[str] = []
    with serving(scripted_service(), log=lines.append) as srv:
        yield srv, lines


def wait_logged(lines: list[str], what: str) -> str:
    """The first log line holding `what`. A status is looked for as its field, " 505 tokens=":
    alone, it would sometimes be found inside another line's request id (random hex) or time."""
    deadline = time.monotonic() + 10   # the line is written just after the reply
    while time.monotonic() < deadline:
        found = [line for line in lines if what in line]
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no log line with {what!r} in {lines}")


def test_options_asterisk_is_about_the_server(logged):
    srv, lines = logged
    status, headers, body = split(raw_exchange(srv.port, odd("OPTIONS * HTTP/1.1")))
    assert status == 200 and body == b"" and headers["content-length"] == "0"
    assert set(headers["allow"].split(", ")) == {"GET", "HEAD", "POST", "DELETE", "OPTIONS"}
    assert headers["x-request-id"].startswith("req-")
    assert re.search(r" OPTIONS \* 200 tokens=0 \d+ms id=req-", wait_logged(lines, "OPTIONS *"))


def test_the_asterisk_is_for_options_only(logged):
    srv, _ = logged
    assert error_of(raw_exchange(srv.port, odd("GET * HTTP/1.1")), 400)["code"] == "invalid_request_line"


@pytest.mark.parametrize("target", ["http://127.0.0.1/health", "HTTP://elsewhere:9/health?x=1",
                                    "https://127.0.0.1:1/health"])
def test_the_absolute_form_is_routed_by_its_path(logged, target):
    srv, lines = logged
    status, _, body = split(raw_exchange(srv.port, odd(f"GET {target} HTTP/1.1")))
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert " GET /health 200 " in wait_logged(lines, "GET /health")


def test_the_absolute_form_keeps_its_query_and_its_api(logged):
    srv, _ = logged
    error = error_of(raw_exchange(srv.port, odd("GET http://x/v1/responses/resp_1/input_items?limit=2 "
                                                "HTTP/1.1")), 404)
    assert error["param"] == "response_id"
    # Under /v1/messages, errors are Anthropic's shape.
    got = json.loads(split(raw_exchange(srv.port, odd("GET http://x/v1/messages HTTP/1.1")))[2])
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("target", ["health", "ftp://x/health", "http:/health", "example.com:443"])
def test_a_target_of_no_form_is_a_400(logged, target):
    srv, lines = logged
    error = error_of(raw_exchange(srv.port, odd(f"GET {target} HTTP/1.1")), 400)
    assert error["code"] == "invalid_request_line" and "not a path" in error["message"]
    wait_logged(lines, f"GET {target.split('?')[0]} 400")


@pytest.mark.parametrize("method", ["TRACE", "CONNECT", "BREW", "PROPFIND"])
def test_an_unsupported_method_is_a_json_501(logged, method):
    srv, lines = logged
    before = counted(srv.port, 501)
    error = error_of(raw_exchange(srv.port, odd(f"{method} /health HTTP/1.1")), 501)
    assert error["code"] == "method_not_supported" and method in error["message"]
    assert error["type"] == "server_error" and "request id req-" in error["message"]
    assert f" {method} /health 501 " in wait_logged(lines, f"{method} /health")
    assert counted(srv.port, 501) == before + 1


def test_connect_to_a_host_is_a_501_too(logged):
    srv, lines = logged
    error = error_of(raw_exchange(srv.port, odd("CONNECT example.com:443 HTTP/1.1")), 501)
    assert error["code"] == "method_not_supported"
    assert " CONNECT example.com:443 501 " in wait_logged(lines, "CONNECT")


def test_an_unsupported_method_under_an_api_answers_in_its_shape(logged):
    srv, _ = logged
    status, _, body = split(raw_exchange(srv.port, odd("BREW /v1/messages HTTP/1.1")))
    assert status == 501 and json.loads(body)["error"]["type"] == "api_error"


@pytest.mark.parametrize("version", ["HTTP/2.0", "HTTP/3.0"])
def test_an_unsupported_version_is_a_json_505(logged, version):
    srv, lines = logged
    before = counted(srv.port, 505)
    raw = raw_exchange(srv.port, odd(f"GET /health {version}"))
    assert raw.startswith(b"HTTP/1.1 505 ")   # a status line, in the version this server speaks
    error = error_of(raw, 505)
    assert error["code"] == "http_version_not_supported" and "HTTP/1.1" in error["message"]
    assert split(raw)[1]["connection"] == "close"
    assert f"'GET /health {version}' 505 " in wait_logged(lines, " 505 tokens=")
    assert counted(srv.port, 505) == before + 1


@pytest.mark.parametrize("line, status, code", [
    ("GET /health HTTP/1.x", 400, "invalid_request_line"),
    ("GET /health HTTP/1.1 extra", 400, "invalid_request_line"),
    ("GET /" + "a" * 70000 + " HTTP/1.1", 414, "request_line_too_long"),
])
def test_a_malformed_line_is_a_json_error(logged, line, status, code):
    srv, lines = logged
    error = error_of(raw_exchange(srv.port, odd(line)), status)
    assert error["code"] == code
    assert f" {status} tokens=0" in wait_logged(lines, f" {status} tokens=")


def test_headers_past_the_limit_are_a_json_431(logged):
    srv, _ = logged
    many = "".join(f"X-{i}: y\r\n" for i in range(120))
    error = error_of(raw_exchange(srv.port, f"GET /health HTTP/1.1\r\n{many}\r\n".encode()), 431)
    assert error["code"] == "request_header_fields_too_large"


def test_empty_lines_before_a_request_are_ignored(logged):
    srv, _ = logged   # RFC 9112 2.2
    assert status_of(raw_exchange(srv.port, b"\r\n\r\n" + odd("GET /health HTTP/1.1"))) == 200


def test_headers_not_sent_within_the_deadline_are_a_408():
    lines: list[str] = []
    with serving(scripted_service(), log=lines.append, request_timeout=0.5) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # and no end to the headers
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        assert error_of(raw, 408)["code"] == "request_timeout"
        assert " GET /health 408 " in wait_logged(lines, " 408 tokens=")
        assert srv.wait_requests(10)


def test_a_client_that_resets_mid_headers_is_a_499_and_not_in_flight():
    lines: list[str] = []
    with serving(scripted_service(), log=lines.append) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.2)   # the server is reading the headers when the reset comes
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        assert " GET /health 499 " in wait_logged(lines, " 499 tokens=")
        assert srv.wait_requests(10)


def test_after_odd_lines_nothing_is_left_in_flight(logged):
    srv, _ = logged
    for line in [*ODD_LINES, "GET * HTTP/1.1", "GET health HTTP/1.1", "   "]:
        raw_exchange(srv.port, odd(line))
    assert srv.wait_requests(10)


# ---- a server process: its shutdown after each --------------------------------------

@pytest.mark.parametrize("line", ODD_LINES)
def test_sigterm_after_an_odd_line_stops_at_once(line, lib_path, k3_container, tmp_path):
    status, what = ODD_LINES[line]
    with serve(k3_container, lib_path, tmp_path) as srv:
        raw = raw_exchange(srv.port, odd(line))
        assert status_of(raw) == status
        if status >= 400:
            assert split(raw)[1]["x-request-id"].startswith("req-")
            assert "error" in json.loads(split(raw)[2])
        started = time.monotonic()
        assert srv.stop(signal.SIGTERM) == 0
        took = time.monotonic() - started
        log = srv.log()
    # The drain waits DRAIN_SECONDS (10) for a request it counts as in flight: none is.
    assert took < 2, f"stopped {took:.1f} s after the signal"
    assert re.search(rf"{re.escape(what)} {status} tokens=0 \d+ms id=req-", log), log
    assert "Traceback" not in log


def test_a_connection_that_sends_nothing_is_no_request(lib_path, k3_container, tmp_path):
    with serve(k3_container, lib_path, tmp_path) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /hea")   # half a request line, and the server is stopped under it
            started = time.monotonic()
            assert srv.stop(signal.SIGTERM) == 0
        assert time.monotonic() - started < 2
