"""The notebook's end of the direct cell channel (rank end: meshlab.rank.cell_server).

One ROUTER socket, bound where the controller listens (loopback unless the profile says
otherwise); each rank connects twice, for cells and replies with its rank as identity and
for a running cell's output as "rank/output". A cell goes to each of its ranks
once; what comes back is filed under the cell's id as it arrives, while someone polls (the
cell in flight, or a wait for a stuck one). No thread: the notebook spends nothing between
cells. A peer without the channel's key fails the CurveZMQ handshake, so nothing it sends is
buffered; no frame is longer than cell_wire.FRAME_MAX; frames not signed with the key are
dropped unread.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from meshlab.rank import cell_wire


@dataclass(slots=True)
class RankReply:
    """What one rank sent for one cell so far."""

    stdout: str = ""
    stderr: str = ""
    reply: dict[str, Any] | None = None  # the end-of-cell header; None while it runs
    value: bytes | None = None  # the pickled last value, when asked for
    pulled: list[bytearray] | None = None  # a pulled value's parts (meshlab.rank.value_wire)
    stop: dict[str, Any] | None = None  # where its debugger last stopped (a notice)
    stops: int = 0  # notices of a stop so far: a new one is news
    batches: int = 0  # output messages received: the reply says how many were sent
    tail: tuple[str, str] | None = None  # the reply's (stdout, stderr), held until
    # the batches sent before it are in, so the text stays in order

    def done(self) -> bool:
        """Replied, and every batch of output sent before the reply is in (the two come
        over separate sockets, so the reply can overtake a batch)."""
        return self.reply is not None and self.batches >= self.reply.get("batches", 0)


@dataclass(slots=True)
class SentCell:
    """One cell on its ranks."""

    id: str
    ranks: list[int]
    replies: dict[int, RankReply] = field(default_factory=dict)

    def done(self, rank: int) -> bool:
        return self.replies[rank].done()

    def ready(self) -> bool:
        return all(r.done() for r in self.replies.values())


class CellChannel:
    """Sends cells to ranks and files their output and replies."""

    def __init__(self, ip: str, key: bytes | None = None) -> None:
        # its own secret (ipyparallel's HMAC key is empty under CurveZMQ): the ranks get it
        # over the controller's encrypted channel, with the rest of their set-up
        self.key = key if key is not None else secrets.token_bytes(32)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        cell_wire.secure_server(self._socket, self.key)  # no handshake, no frame, without the key
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a rank not connected: an error
        if ":" in ip:
            self._socket.setsockopt(zmq.IPV6, 1)
        host = f"[{ip}]" if ":" in ip else ip
        port: int = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._ids = itertools.count(1)
        self._cells: dict[str, SentCell] = {}
        self._connected: set[int] = set()
        # what threads other than a running cell's printed, as it came: (rank, thread name,
        # {stream: text}), and characters a rank could not keep; taken by the next cell
        self._threads: list[tuple[int, str, dict[str, str]]] = []
        self._threads_dropped: dict[int, int] = {}

    def close(self) -> None:
        self._socket.close(linger=0)

    def wait_connected(self, ranks: list[int], timeout: float) -> list[int]:
        """Wait until every rank said hello; the ranks that did not, in time."""
        deadline = time.monotonic() + timeout
        while not self._connected.issuperset(ranks) and time.monotonic() < deadline:
            self.poll(deadline - time.monotonic())
        return [r for r in ranks if r not in self._connected]

    def send(self, ranks: list[int], code: str, number: int, keep: bool) -> SentCell:
        cell = SentCell(f"cell:{os.getpid()}:{next(self._ids)}", ranks,
                        {r: RankReply() for r in ranks})
        self._cells[cell.id] = cell
        frames = cell_wire.pack(self.key, {"kind": cell_wire.CELL, "id": cell.id, "code": code,
                                           "number": number, "keep": keep})
        for r in ranks:
            try:
                self._socket.send_multipart([cell_wire.cell_identity(r), *frames])
            except zmq.ZMQError:  # not connected (ROUTER_MANDATORY): its engine went away
                cell.replies[r].reply = {
                    "status": "error", "ename": "RankDied", "traceback": [],
                    "evalue": "its engine is no longer connected to the notebook"}
        return cell

    def poll(self, timeout: float) -> bool:
        """File what arrives within ``timeout`` seconds (returns at the first batch);
        whether anything came."""
        if not self._socket.poll(max(0, int(timeout * 1000))):
            return False
        while self._socket.poll(0):
            self._file(self._socket.recv_multipart())
        return True

    def wait(self, cell: SentCell, timeout: float | None) -> bool:
        """Poll until ``cell`` has every reply or ``timeout`` passed; whether it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not cell.ready():
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(left, 1.0))
        return True

    def take_threads(self) -> tuple[list[tuple[int, str, dict[str, str]]], dict[int, int]]:
        """What other threads printed since the last call (filed while anyone polled), and
        by rank the characters the ranks dropped for want of a reader."""
        taken, self._threads = self._threads, []
        dropped, self._threads_dropped = self._threads_dropped, {}
        return taken, dropped

    def cell(self, cell_id: str) -> SentCell | None:
        return self._cells.get(cell_id)

    def forget(self, cell: SentCell) -> None:
        """The notebook has taken what it keeps of a finished cell."""
        self._cells.pop(cell.id, None)

    def running(self) -> set[int]:
        """Ranks with a cell not yet replied to (safe from another thread: a copy is read)."""
        return {r for c in list(self._cells.values()) for r, got in c.replies.items()
                if not got.done()}

    @staticmethod
    def owns(call_id: str) -> bool:
        """Is this the id of a cell sent here (not of an ipyparallel call)?"""
        return call_id.startswith("cell:")

    def _file(self, frames: list[bytes]) -> None:
        rank, message = cell_wire.rank_of(frames[0]), cell_wire.unpack(self.key, frames[1:])
        if message is None or rank is None:
            return  # not from a rank of this cluster
        header, blobs = message
        kind = header.get("kind")
        if kind == cell_wire.HELLO:
            self._connected.add(rank)
            return
        if kind in (cell_wire.THREADS, cell_wire.REPLY):  # a reply brings what was held
            self._threads += [(rank, str(thread), streams)
                              for thread, streams in header.pop("threads", {}).items()]
            dropped = int(header.pop("threads_dropped", 0))
            if dropped:
                self._threads_dropped[rank] = self._threads_dropped.get(rank, 0) + dropped
            if kind == cell_wire.THREADS:
                return
        cell = self._cells.get(header.get("id", ""))
        if cell is None or rank not in cell.replies:
            return  # a cell the notebook already let go of
        got = cell.replies[rank]
        if kind == cell_wire.OUTPUT:
            got.stdout += header.get("stdout", "")
            got.stderr += header.get("stderr", "")
            got.batches += 1
        elif kind == cell_wire.NOTICE and "debugger" in header:
            got.stop, got.stops = header["debugger"], got.stops + 1
        elif kind == cell_wire.VALUE:  # each part allocated once, filled as pieces come
            got.pulled = [bytearray(int(n)) for n in header["sizes"]]
        elif kind == cell_wire.CHUNK and got.pulled is not None and blobs:
            start = int(header["offset"])
            got.pulled[int(header["part"])][start:start + len(blobs[0])] = blobs[0]
        elif kind == cell_wire.REPLY:  # with the output not sent before it
            got.tail = header.pop("stdout", ""), header.pop("stderr", "")
            got.reply = header
            got.value = blobs[0] if blobs else None
        if got.tail is not None and got.done():
            got.stdout, got.stderr = got.stdout + got.tail[0], got.stderr + got.tail[1]
            got.tail = None
