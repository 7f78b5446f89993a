"""The messages of the direct cell channel between the notebook and its ranks.

One owner for the wire, imported by both ends: a message is ``[signature, header, *blobs]``,
the header JSON, the signature HMAC-SHA256 of every other frame under the cluster's key
(ipyparallel's own). A frame that does not verify is dropped before it is parsed, so
nothing from an unauthenticated peer is ever decoded, let alone unpickled.

Kinds: the notebook sends ``cell`` (id, code, number, keep); a rank sends ``hello`` once it
listens, ``output`` (what the running cell printed since the last, from a second socket)
and ``reply`` (how the cell ended, with what the notebook keeps: the rest of the output,
how many output batches went before, the value's text, error, optimizer steps, the pickled
value when asked). Plain Python.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

CELL, HELLO, OUTPUT, REPLY = "cell", "hello", "output", "reply"


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


def pack(key: bytes, header: dict[str, Any], *blobs: bytes) -> list[bytes]:
    """The frames of one message, signed."""
    frames = [json.dumps(header).encode(), *blobs]
    return [_signature(key, frames), *frames]


def unpack(key: bytes, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]] | None:
    """``(header, blobs)`` of a signed message; None when its signature does not verify."""
    if len(frames) < 2 or not hmac.compare_digest(frames[0], _signature(key, frames[1:])):
        return None
    header = json.loads(frames[1])
    return (header, frames[2:]) if isinstance(header, dict) else None


def _signature(key: bytes, frames: list[bytes]) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        digest.update(len(frame).to_bytes(8, "little"))  # frame edges are signed too
        digest.update(frame)
    return digest.hexdigest().encode()
