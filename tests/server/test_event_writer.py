"""The stream writer over a real TCP connection: a lone event goes out at once, from the
caller's thread; what a full socket cannot take waits for the writer's thread and arrives
whole and in order; a client that left is noticed once."""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Iterator

from serve.dialects.sse import EventWriter


@contextmanager
def connected(timeout: float = 30.0) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the server's end, with a timeout as the server's connections have; the client's)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=10)
    server, _ = listener.accept()
    listener.close()
    server.settimeout(timeout)
    try:
        yield server, client
    finally:
        server.close()
        client.close()


class SendAll:
    """A handler's wfile, as socketserver's StreamRequestHandler makes it: each write a sendall."""

    def __init__(self, sock: socket.socket):
        self.write = sock.sendall


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = sock.recv(n - len(data))
        assert piece, "the connection closed early"
        data += piece
    return data


def test_each_lone_event_is_sent_at_once_by_the_callers_thread():
    with connected() as (server, client):
        # The writer's thread is never started: only the caller's send can deliver these.
        writer = EventWriter(SendAll(server), sock=server)
        for i in range(3):
            event = b"data: {\"n\": %d}\n\n" % i
            writer.put(event)
            assert read_exactly(client, len(event)) == event


def test_a_socket_without_a_timeout_leaves_every_send_to_the_writers_thread():
    with connected() as (server, client):
        server.settimeout(None)   # a blocking descriptor: a send from the caller could stall it
        writer = EventWriter(SendAll(server), chunked=True, sock=server)
        writer.put(b"data: one\n\n")
        client.settimeout(0.5)
        try:
            early = client.recv(100)
        except socket.timeout:
            early = b""
        assert early == b""
        client.settimeout(10)
        writer.start()
        writer.close()
        expected = b"b\r\ndata: one\n\n\r\n0\r\n\r\n"
        assert read_exactly(client, len(expected)) == expected


def test_what_a_full_socket_cannot_take_arrives_whole_and_in_order():
    with connected() as (server, client):
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer = EventWriter(SendAll(server), chunked=True, sock=server)
        writer.start()
        events = [b"data: %d %s\n\n" % (i, b"x" * 1000) for i in range(300)]   # 300 kB: many times the buffers
        done = threading.Event()

        def put_all() -> None:
            for event in events:
                writer.put(event)
            done.set()
            writer.close()   # returns once the client has read it all

        # The client reads nothing yet: the socket fills, puts must not block on it.
        putter = threading.Thread(target=put_all)
        putter.start()
        assert done.wait(30), "put() blocked on a client that does not read"
        expected = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        assert read_exactly(client, len(expected)) == expected
        putter.join()
        assert not writer.failed


def test_a_client_that_left_is_noticed_once_on_the_callers_send():
    failed: list[int] = []
    with connected() as (server, client):
        writer = EventWriter(SendAll(server), sock=server,
                             on_failed=lambda: failed.append(1))
        writer.start()
        client.close()
        for _ in range(100):   # the first sends may still go out before the reset comes back
            writer.put(b"data: x\n\n")
            if writer.failed:
                break
            threading.Event().wait(0.02)
        writer.put(b"data: after\n\n")
        writer.close()
    assert writer.failed and failed == [1]
