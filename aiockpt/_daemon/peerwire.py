"""The peer network's wire: authenticated connections between the daemons of one root.

Every connection starts with a challenge and response over the root's peer key
(``_peer.key``, see ``_core/identity.py``), which only those who can read the root hold:

1. the server sends ``{"op": "challenge", "root": <root id>, "nonce": <32 random bytes>}``;
2. the client sends ``{"op": "auth", "rank": r, "nonce": <32 random bytes>, "proof": P}``,
   ``P = HMAC-SHA256(key, "aiockpt-peer/1 client" | root id | rank | server nonce | client
   nonce)``;
3. the server, having checked ``P`` (in constant time), answers ``{"ok": true, "proof": Q}``
   with ``Q`` the same over ``"aiockpt-peer/1 server"``, which the client checks in turn:
   each side has proved it holds the key, for this root, on this connection.

Both then derive a session key, ``HMAC-SHA256(key, "aiockpt-peer/1 session" | server nonce |
client nonce)``, and every later message carries a MAC under it: after its header, over the
direction, the message's number on the connection and the header; after its body, where it
has one, over the direction, the number and the body. So a message is accepted only whole,
in order, on the connection it was sent on, from a holder of the key; a replayed, reordered,
reflected or altered one is refused and the connection closed. Headers are checked before
anything is done for them; a body before it is used (a replica before it is linked into
place, a read before the load is told its bytes arrived).

The bytes are authenticated, not encrypted: a party that sees the network sees what is
copied (see docs/tiers.md, "Trust").

A frame is a 4-byte big-endian length, a JSON header of that length, then (once
authenticated) its 32-byte MAC; a body follows where the request says so (a ``put``'s
``size``, a ``read`` answer's ``length``), then its MAC. Before authentication a header is
at most :data:`HANDSHAKE_MAX` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["AuthError", "Channel", "accept", "connect"]

VERSION = b"aiockpt-peer/1"
MAC_BYTES = 32
NONCE_BYTES = 32
#: The largest header before authentication: a challenge or a response is far smaller.
HANDSHAKE_MAX = 4096
#: The largest authenticated header.
HEADER_MAX = 1 << 20
#: How many bytes of a body are received at a time (into the caller's memory, or a piece).
PIECE = 8 << 20

_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_TO_SERVER = b"c>s"
_TO_CLIENT = b"s>c"


class AuthError(ConnectionError):
    """The other end did not prove it holds this root's peer key, or a message's MAC was
    wrong: the connection is closed."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(_LEN.pack(len(p)))
        h.update(p)
    return h.digest()


def _body_hmac(key: bytes, direction: bytes, seq: bytes) -> Any:
    """The running MAC of one message's body, to be fed its bytes as they pass."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in (direction, seq, b"body"):
        h.update(_LEN.pack(len(p)))
        h.update(p)
    return h


def recv_exact(sock: socket.socket, out: memoryview) -> None:
    """Fill ``out`` from ``sock``; a connection that ends first is a ConnectionError."""
    got = 0
    while got < len(out):
        with out[got:] as rest:
            n = sock.recv_into(rest)
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-message")
        got += n


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _send_plain(sock: socket.socket, header: dict[str, Any]) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_plain(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_bytes(sock, _LEN.size))
    if n > HANDSHAKE_MAX:
        raise AuthError(f"a handshake message of {n} bytes (at most {HANDSHAKE_MAX})")
    return _object(_recv_bytes(sock, n))


def _object(data: bytes) -> dict[str, Any]:
    try:
        header = json.loads(data)
    except ValueError as e:
        raise ConnectionError(f"a peer's message is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ConnectionError("a peer's message is not a JSON object")
    return header


def _nonce(value: Any) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != NONCE_BYTES:
        raise AuthError("a handshake without a valid nonce")
    return raw


def _proof(key: bytes, who: bytes, root_id: str, rank: int, snonce: bytes, cnonce: bytes) -> bytes:
    return _mac(key, VERSION + b" " + who, root_id.encode(), b"%d" % rank, snonce, cnonce)


class Channel:
    """One authenticated connection (see the module's docstring): messages in order, each
    with its MAC under the connection's session key."""

    def __init__(self, sock: socket.socket, session: bytes, *, client: bool, rank: int) -> None:
        self.sock = sock
        #: The rank at the client's end, as it proved with the key.
        self.rank = rank
        self._key = session
        self._out, self._in = (_TO_SERVER, _TO_CLIENT) if client else (_TO_CLIENT, _TO_SERVER)
        self._sent = 0
        self._received = 0

    def close(self) -> None:
        self.sock.close()

    # ----------------------------------------------------------------------- sending

    def send(
        self, header: dict[str, Any], body: Iterable[memoryview | bytes] | None = None
    ) -> None:
        """One message: ``header`` and its MAC, then, where there is one, ``body``'s bytes
        (as many as the header says: the caller's promise, and the receiver's to expect)
        and theirs."""
        seq = _SEQ.pack(self._sent)
        self._sent += 1
        data = json.dumps(header).encode()
        self.sock.sendall(_LEN.pack(len(data)) + data + _mac(self._key, self._out, seq, data))
        if body is None:
            return
        h = _body_hmac(self._key, self._out, seq)
        for piece in body:
            h.update(piece)
            self.sock.sendall(piece)
        self.sock.sendall(h.digest())

    # --------------------------------------------------------------------- receiving

    def recv(self) -> dict[str, Any]:
        """The next message's header, its MAC checked; its body, where it has one, is the
        caller's to take next, with :meth:`recv_into` or :meth:`pieces`."""
        self._seq = _SEQ.pack(self._received)
        self._received += 1
        (n,) = _LEN.unpack(_recv_bytes(self.sock, _LEN.size))
        if n > HEADER_MAX:
            raise ConnectionError(f"a message header of {n} bytes (at most {HEADER_MAX})")
        data = _recv_bytes(self.sock, n)
        mac = _recv_bytes(self.sock, MAC_BYTES)
        if not hmac.compare_digest(mac, _mac(self._key, self._in, self._seq, data)):
            raise AuthError("a message whose MAC is wrong: not from the key's holder, or altered")
        return _object(data)

    def _body_mac(self) -> Any:
        return _body_hmac(self._key, self._in, self._seq)

    def _check(self, h: Any) -> None:
        if not hmac.compare_digest(_recv_bytes(self.sock, MAC_BYTES), h.digest()):
            raise AuthError(
                "a message body whose MAC is wrong: not from the key's holder, or altered"
            )

    def recv_into(self, out: memoryview) -> None:
        """The last header's body, ``len(out)`` bytes, into ``out``; its MAC checked once
        all of it is there (an AuthError then: the bytes in ``out`` are not to be used)."""
        h = self._body_mac()
        for at in range(0, len(out), PIECE):
            with out[at : at + PIECE] as part:
                recv_exact(self.sock, part)
                h.update(part)
        self._check(h)

    def pieces(self, size: int) -> Iterator[bytes]:
        """The last header's body of ``size`` bytes, :data:`PIECE` at most at a time; its MAC
        is checked after the last piece and before the iteration ends (an AuthError then),
        so a consumer that acts only once the iteration is over acts on checked bytes."""
        h = self._body_mac()
        left = size
        while left:
            piece = self.sock.recv(min(PIECE, left))
            if not piece:
                raise ConnectionError("the peer closed the connection mid-file")
            h.update(piece)
            yield piece
            left -= len(piece)
        self._check(h)


def connect(sock: socket.socket, key: bytes, root_id: str, rank: int) -> Channel:
    """The client's handshake on ``sock``: prove the key for ``root_id`` as ``rank``, and
    check the server's proof. An :class:`AuthError` when either fails; ``sock`` is the
    channel's, or closed."""
    try:
        return _connect(sock, key, root_id, rank)
    except BaseException:
        sock.close()
        raise


def _connect(sock: socket.socket, key: bytes, root_id: str, rank: int) -> Channel:
    challenge = _recv_plain(sock)
    if "error" in challenge:
        raise AuthError(f"the partner refused the connection: {challenge['error']}")
    theirs = challenge.get("root")
    if challenge.get("op") != "challenge" or not isinstance(theirs, str):
        raise AuthError("the partner did not open with a challenge")
    if theirs != root_id:
        raise AuthError(f"the partner serves root {theirs}, not this root ({root_id})")
    snonce, cnonce = _nonce(challenge.get("nonce")), secrets.token_bytes(NONCE_BYTES)
    proof = _proof(key, b"client", root_id, rank, snonce, cnonce)
    _send_plain(sock, {"op": "auth", "rank": rank, "nonce": cnonce.hex(), "proof": proof.hex()})
    answer = _recv_plain(sock)
    if "error" in answer:
        raise AuthError(f"the partner refused the connection: {answer['error']}")
    expect = _proof(key, b"server", root_id, rank, snonce, cnonce)
    if not isinstance(answer.get("proof"), str) or not hmac.compare_digest(
        answer["proof"].encode(), expect.hex().encode()
    ):
        raise AuthError("the partner did not prove it holds this root's peer key")
    session = _mac(key, VERSION + b" session", snonce, cnonce)
    return Channel(sock, session, client=True, rank=rank)


def accept(sock: socket.socket, key: bytes, root_id: str) -> Channel:
    """The server's handshake on ``sock``: challenge the client, check its proof, prove the
    key in turn. An :class:`AuthError` (after telling the client) when the proof fails."""
    snonce = secrets.token_bytes(NONCE_BYTES)
    _send_plain(sock, {"op": "challenge", "root": root_id, "nonce": snonce.hex()})
    msg = _recv_plain(sock)
    rank, proof = msg.get("rank"), msg.get("proof")
    try:
        if msg.get("op") != "auth" or type(rank) is not int or rank < 0:
            raise AuthError("not an authentication")
        cnonce = _nonce(msg.get("nonce"))
        expect = _proof(key, b"client", root_id, rank, snonce, cnonce)
        if not isinstance(proof, str) or not hmac.compare_digest(
            proof.encode(), expect.hex().encode()
        ):
            raise AuthError("the client did not prove it holds this root's peer key")
    except AuthError as e:
        _send_plain(sock, {"error": f"authentication failed: {e}"})
        raise
    _send_plain(
        sock, {"ok": True, "proof": _proof(key, b"server", root_id, rank, snonce, cnonce).hex()}
    )
    session = _mac(key, VERSION + b" session", snonce, cnonce)
    return Channel(sock, session, client=False, rank=rank)
