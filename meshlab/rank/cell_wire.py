"""The messages of the direct cell channel between the notebook and its ranks.

One owner for the wire, imported by both ends: a message is ``[signature, layout, *parts]``:
the header (JSON) and the blobs, each cut into parts of at most FRAME_MAX bytes (``layout``
lists how many parts each has), the signature HMAC-SHA256 of every other frame under the
channel's key (a 32-byte secret the notebook makes and hands each rank over the controller's
CurveZMQ channel). A frame that does not verify is dropped before it is
parsed, so nothing from an unauthenticated peer is ever decoded, let alone unpickled.

Before any of that, the connection itself is CurveZMQ: the notebook's socket is a CURVE
server whose key pair is derived from the channel's key, so a peer without that key fails the
handshake and nothing it sends is read into a message, let alone buffered; and no frame may
be larger than FRAME_MAX (``secure_server``), so even a peer with the key cannot make the
notebook hold a frame larger than that.

Kinds: the notebook sends ``cell`` (id, code, number, keep); a rank sends ``hello`` once it
listens, ``output`` (what the running cell printed since the last, from a second socket),
``threads`` (what other threads printed, by thread name, and how many characters the rank
could not keep for the notebook) and ``reply`` (how the cell ended, with what the notebook
keeps: the rest of the output, how many output batches went before, the value's text, error,
optimizer steps, the random generators the cell drew from, what other threads printed that
was not sent, the pickled value when asked). A value pulled on its own (``%mesh pull``) goes
before the reply as ``value`` (the sizes of its parts: meshlab.rank.value_wire) and ``chunk``
messages (part, offset, at most PIECE bytes), so neither end ever holds it twice.
Plain Python and ZeroMQ.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import zmq
import zmq.utils.z85

CELL, HELLO, OUTPUT, REPLY, THREADS = "cell", "hello", "output", "reply", "threads"
VALUE, CHUNK = "value", "chunk"  # a pulled value: its parts' sizes, then each part in pieces
NOTICE = "notice"  # news of a running cell: a rank stopped in the debugger
PIECE = 4 * 2**20
"""A pulled value's piece: each end holds a few (queued, encrypted) beside the value."""

FRAME_MAX = 32 * 2**20
"""The largest frame either end sends or accepts; longer headers and blobs travel in parts."""
QUEUED = 4  # messages either end queues: a pulled value's pieces wait in the value
_CURVE_SLACK = 1024  # a CURVE frame is its plaintext and a box: the cap counts the box too


def _server_secret(key: bytes) -> bytes:
    # its "public" half stays a secret too: only holders of the channel's key can derive it,
    # and a CURVE client must know it to say hello
    return zmq.utils.z85.encode(hmac.new(key, b"meshlab cell channel", hashlib.sha256).digest())


def secure_server(socket: zmq.Socket[bytes], key: bytes) -> None:
    """Make ``socket`` (before it binds) a CURVE server only holders of ``key`` can reach."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, _server_secret(key))
    socket.setsockopt(zmq.MAXMSGSIZE, FRAME_MAX + _CURVE_SLACK)  # a larger frame: disconnect
    socket.setsockopt(zmq.RCVHWM, QUEUED)


def secure_client(socket: zmq.Socket[bytes], key: bytes) -> None:
    """Make ``socket`` (before it connects) a CURVE client of the server ``key`` makes."""
    public, secret = zmq.curve_keypair()
    socket.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_public(_server_secret(key)))
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
    socket.setsockopt(zmq.MAXMSGSIZE, FRAME_MAX + _CURVE_SLACK)
    socket.setsockopt(zmq.SNDHWM, QUEUED)


def cell_identity(rank: int) -> bytes:
    """The identity of a rank's socket for cells and replies."""
    return str(rank).encode()


def output_identity(rank: int) -> bytes:
    """The identity of a rank's socket for a running cell's output."""
    return f"{rank}/output".encode()


def rank_of(identity: bytes) -> int | None:
    """The rank a socket of the channel belongs to; None for any other identity."""
    rank, slash, stream = identity.partition(b"/")
    return int(rank) if rank.isdigit() and (not slash or stream == b"output") else None


def pack(key: bytes, header: dict[str, Any], *blobs: bytes | memoryview) -> list[Any]:
    """The frames of one message, signed: the header and each blob in parts of FRAME_MAX."""
    parts: list[bytes | memoryview] = []
    counts = []
    for whole in (json.dumps(header).encode(), *blobs):
        view = memoryview(whole)
        cut = [bytes(view[i:i + FRAME_MAX]) for i in range(0, len(whole), FRAME_MAX)]
        parts += cut if len(cut) > 1 else [whole]  # the common case: no copy
        counts.append(max(1, len(cut)))
    frames = [json.dumps(counts).encode(), *parts]
    return [_signature(key, frames), *frames]


def unpack(key: bytes, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]] | None:
    """``(header, blobs)`` of a signed message; None when its signature does not verify."""
    if len(frames) < 3 or not hmac.compare_digest(frames[0], _signature(key, frames[1:])):
        return None
    counts, parts, whole = json.loads(frames[1]), frames[2:], []
    for n in counts:
        whole.append(parts[0] if n == 1 else b"".join(parts[:n]))
        parts = parts[n:]
    header = json.loads(whole[0])
    return (header, whole[1:]) if isinstance(header, dict) else None


def _signature(key: bytes, frames: list[Any]) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        digest.update(len(frame).to_bytes(8, "little"))  # frame edges are signed too
        digest.update(frame)
    return digest.hexdigest().encode()
