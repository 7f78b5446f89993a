"""The direct cell channel: CurveZMQ with the cluster's key, frames of bounded size, signed
messages only, loopback by default, output in order."""

from __future__ import annotations

import ipaddress
import time

import pytest
import zmq

from meshlab.notebook.cell_channel import CellChannel
from meshlab.notebook.cluster import Cluster
from meshlab.rank import cell_wire

KEY = b"the cluster's key"


def test_unpack_takes_only_frames_signed_with_the_key() -> None:
    frames = cell_wire.pack(KEY, {"kind": "reply", "id": "cell:1"}, b"\x80blob")
    assert cell_wire.unpack(KEY, frames) == ({"kind": "reply", "id": "cell:1"}, [b"\x80blob"])
    assert cell_wire.unpack(b"another key", frames) is None
    assert cell_wire.unpack(KEY, [b"", *frames[1:]]) is None  # unsigned
    assert cell_wire.unpack(KEY, [*frames[:3], b"\x80other blob"]) is None
    # moving bytes across a frame edge changes the signature too
    assert cell_wire.unpack(KEY, [*frames[:2], frames[2] + b"\x80", b"blob"]) is None


def test_a_header_or_blob_longer_than_a_frame_travels_in_parts() -> None:
    text, blob = "z" * (cell_wire.FRAME_MAX + 5), bytes(2 * cell_wire.FRAME_MAX + 1)
    frames = cell_wire.pack(KEY, {"stdout": text}, blob, b"")
    assert max(map(len, frames)) <= cell_wire.FRAME_MAX
    assert cell_wire.unpack(KEY, frames) == ({"stdout": text}, [blob, b""])


@pytest.fixture
def channel():  # type: ignore[no-untyped-def]
    ch = CellChannel("127.0.0.1", KEY)
    yield ch
    ch.close()


def _peer(channel: CellChannel, identity: bytes, key: bytes = KEY) -> zmq.Socket[bytes]:
    """A rank's socket, made as a rank makes it, holding ``key``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    cell_wire.secure_client(sock, key)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(channel.address)
    return sock


def test_a_peer_without_the_key_is_never_heard(channel: CellChannel) -> None:
    assert ipaddress.ip_address(channel.address.split("//")[1].rsplit(":", 1)[0]).is_loopback
    # a guessed key fails the handshake: the channel never hears it, nor sends it a cell
    guesser, plain = _peer(channel, b"0", key=b"a guess"), zmq.Context.instance().socket(
        zmq.DEALER)
    # one that signs with the key but knows no handshake (the channel before CurveZMQ)
    plain.setsockopt(zmq.IDENTITY, b"1")
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(channel.address)
    try:
        guesser.send_multipart(cell_wire.pack(b"a guess", {"kind": "hello"}))
        plain.send_multipart(cell_wire.pack(KEY, {"kind": "hello"}))
        assert channel.wait_connected([0, 1], timeout=1.0) == [0, 1]
        cell = channel.send([0, 1], "1", number=1, keep=True)
        assert not guesser.poll(500) and not plain.poll(500)
        assert cell.replies[0].reply is not None and cell.replies[0].reply["ename"] == "RankDied"
    finally:
        guesser.close()
        plain.close()


def test_a_frame_past_the_cap_drops_its_sender_not_the_channel(channel: CellChannel) -> None:
    """Even a peer with the key cannot make the notebook hold a frame past FRAME_MAX: zmq
    reads its length first and drops the connection; the other ranks go on."""
    big, rank = _peer(channel, b"3"), _peer(channel, b"2")
    try:
        big.send_multipart(cell_wire.pack(KEY, {"kind": "hello"}))
        rank.send_multipart(cell_wire.pack(KEY, {"kind": "hello"}))
        assert channel.wait_connected([2, 3], timeout=5.0) == []
        big.send(bytes(cell_wire.FRAME_MAX + 2048))
        time.sleep(0.5)
        cell = channel.send([2, 3], "1", number=1, keep=False)
        assert cell.replies[3].reply is not None and cell.replies[3].reply["ename"] == "RankDied"
        assert rank.poll(5000)  # rank 2 still gets its cell
    finally:
        big.close()
        rank.close()


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
