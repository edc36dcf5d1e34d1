"""aiockpt.storage.testing.Relay, the fault-injecting TCP relay of the plugins' server tests,
in front of a real echo server on 127.0.0.1."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from aiockpt.storage.testing import Relay


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def relay(echo: int) -> Iterator[Relay]:
    r = Relay(echo)
    yield r
    r.close()


def connect(relay: Relay) -> socket.socket:
    return socket.create_connection(("127.0.0.1", relay.port), timeout=30)


def round_trip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def is_dropped(sock: socket.socket) -> bool:
    """Whether the relay dropped ``sock``: a reset, or the end of the stream with no echo."""
    try:
        return round_trip(sock, b"ping") == b""
    except ConnectionError:
        return True


def test_bytes_go_both_ways(relay: Relay) -> None:
    assert relay.endpoint == f"http://127.0.0.1:{relay.port}"
    data = bytes(range(256)) * 8192  # 2 MiB: more than one recv of the relay
    with connect(relay) as s:
        assert round_trip(s, data) == data


def test_the_next_connections_are_reset_then_relayed(relay: Relay) -> None:
    relay.reset_next(2)
    for _ in range(2):
        try:
            s = connect(relay)
        except ConnectionResetError:  # reset before the handshake was through
            continue
        with s:
            assert is_dropped(s)
    with connect(relay) as s:
        assert round_trip(s, b"through") == b"through"


def test_a_trip_acts_once_the_bytes_went_up_and_resets_every_connection(relay: Relay) -> None:
    tripped = threading.Event()
    with connect(relay) as bystander, connect(relay) as s:
        assert round_trip(bystander, b"up") == b"up"
        assert round_trip(s, b"x" * 10) == b"x" * 10
        assert not tripped.is_set()  # 10 bytes of 16
        relay.trip(16, tripped.set)
        s.sendall(b"y" * 10)
        assert tripped.wait(30)
        deadline = time.monotonic() + 30  # the resets follow the action, on the relay's thread
        while not is_dropped(bystander):
            assert time.monotonic() < deadline, "the bystander was never reset"
    with connect(relay) as s:  # tripped once: the relay goes on relaying
        assert round_trip(s, b"after") == b"after"


def test_down_refuses_and_resets_and_up_serves_on_the_same_port(relay: Relay) -> None:
    port = relay.port
    with connect(relay) as s:
        assert round_trip(s, b"a") == b"a"
        relay.down()
        assert is_dropped(s)
    with pytest.raises(ConnectionRefusedError):
        connect(relay)
    relay.up()
    assert relay.port == port
    with connect(relay) as s:
        assert round_trip(s, b"back") == b"back"
