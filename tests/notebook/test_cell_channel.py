"""The direct cell channel: signed frames only, loopback by default, output in order."""

from __future__ import annotations

import ipaddress

import pytest
import zmq

from meshlab import cell_wire
from meshlab.notebook.cell_channel import CellChannel
from meshlab.notebook.cluster import Cluster

KEY = b"the cluster's key"


def test_unpack_takes_only_frames_signed_with_the_key() -> None:
    frames = cell_wire.pack(KEY, {"kind": "reply", "id": "cell:1"}, b"\x80blob")
    assert cell_wire.unpack(KEY, frames) == ({"kind": "reply", "id": "cell:1"}, [b"\x80blob"])
    assert cell_wire.unpack(b"another key", frames) is None
    assert cell_wire.unpack(KEY, [b"", *frames[1:]]) is None  # unsigned
    assert cell_wire.unpack(KEY, [frames[0], frames[1], b"\x80other blob"]) is None
    # moving bytes across a frame edge changes the signature too
    assert cell_wire.unpack(KEY, [frames[0], frames[1] + b"\x80", b"blob"]) is None


@pytest.fixture
def channel():  # type: ignore[no-untyped-def]
    ch = CellChannel("127.0.0.1", KEY)
    yield ch
    ch.close()


def _peer(channel: CellChannel, identity: bytes) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(channel.address)
    return sock


def test_a_peer_without_the_key_is_never_heard(channel: CellChannel) -> None:
    assert ipaddress.ip_address(channel.address.split("//")[1].rsplit(":", 1)[0]).is_loopback
    intruder = _peer(channel, b"0")
    try:
        intruder.send_multipart(cell_wire.pack(b"a guess", {"kind": "hello"}))
        assert channel.wait_connected([0], timeout=1.0) == [0]
        cell = channel.send([0], "1", number=1, keep=True)
        assert intruder.poll(5000)  # the cell reached the socket named rank 0 ...
        intruder.recv_multipart()
        forged = {"kind": "reply", "id": cell.id, "status": "ok", "result": "'forged'"}
        intruder.send_multipart(cell_wire.pack(b"a guess", forged, b"cos\nsystem\n"))
        intruder.send_multipart([b"", *cell_wire.pack(b"", forged)[1:]])
        channel.wait(cell, timeout=1.0)
        assert not cell.ready() and cell.replies[0].value is None  # ... and nothing it said
    finally:
        intruder.close()


def test_output_and_the_reply_are_filed_under_their_cell(channel: CellChannel) -> None:
    rank = _peer(channel, b"2")
    try:
        rank.send_multipart(cell_wire.pack(KEY, {"kind": "hello"}))
        assert channel.wait_connected([2], timeout=5.0) == []
        cell = channel.send([2], "print('hi')", number=3, keep=False)
        assert rank.poll(5000)
        header, _ = cell_wire.unpack(KEY, rank.recv_multipart()) or ({}, [])
        assert header == {"kind": "cell", "id": cell.id, "code": "print('hi')", "number": 3,
                          "keep": False}
        rank.send_multipart(cell_wire.pack(KEY, {"kind": "output", "id": cell.id,
                                                 "stdout": "h"}))
        rank.send_multipart(cell_wire.pack(KEY, {"kind": "reply", "id": cell.id,
                                                 "status": "ok", "stdout": "i\n"}))
        assert channel.wait(cell, timeout=5.0)
        assert cell.replies[2].stdout == "hi\n" and cell.replies[2].reply is not None
        assert channel.running() == set()
    finally:
        rank.close()


def test_a_cell_for_a_rank_that_is_not_connected_says_it_died(channel: CellChannel) -> None:
    cell = channel.send([5], "1", number=1, keep=False)
    assert cell.ready() and cell.replies[5].reply is not None
    assert cell.replies[5].reply["ename"] == "RankDied"


@pytest.mark.cluster
def test_a_rank_streams_while_it_runs_and_its_tail_rides_on_the_reply(cluster: Cluster) -> None:
    seen: list[str] = []
    code = "import time\nprint('first', flush=True)\ntime.sleep(1.0)\nprint('last')\n7"
    result = cluster.run(code, ranks="1",
                         on_output=lambda r: seen.append(r.outputs[1].stdout))
    assert "first\n" in seen  # shown while the rank slept, before 'last' existed
    assert result.outputs[1].stdout == "first\nlast\n" and result.outputs[1].result == "7"


def test_a_reply_that_overtakes_its_output_waits_for_it(channel: CellChannel) -> None:
    """A running cell's output leaves from a second socket, so its reply can arrive first:
    the cell is not done until every batch the reply counts is in, and text keeps order."""
    rank, output = _peer(channel, cell_wire.cell_identity(1)), _peer(
        channel, cell_wire.output_identity(1))
    try:
        rank.send_multipart(cell_wire.pack(KEY, {"kind": "hello"}))
        assert channel.wait_connected([1], timeout=5.0) == []
        cell = channel.send([1], "print(1); print(2)", number=1, keep=False)
        rank.send_multipart(cell_wire.pack(KEY, {"kind": "reply", "id": cell.id, "batches": 1,
                                                 "status": "ok", "stdout": "2\n"}))
        assert not channel.wait(cell, timeout=0.5) and channel.running() == {1}
        output.send_multipart(cell_wire.pack(KEY, {"kind": "output", "id": cell.id,
                                                   "stdout": "1\n"}))
        assert channel.wait(cell, timeout=5.0)
        assert cell.replies[1].stdout == "1\n2\n" and channel.running() == set()
    finally:
        rank.close()
        output.close()


def test_only_the_two_sockets_of_a_rank_are_heard() -> None:
    assert cell_wire.rank_of(cell_wire.cell_identity(12)) == 12
    assert cell_wire.rank_of(cell_wire.output_identity(3)) == 3
    for other in (b"", b"x", b"-1", b"3/", b"3/other", b"/output", b"\x00k\x8bEg"):
        assert cell_wire.rank_of(other) is None, other
