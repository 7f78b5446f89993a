"""A rank's end of the direct cell channel: a cell in, its output and one reply out.

ipyparallel launches, supervises and signals the engines; cells take this shorter path.
The notebook sends a cell to each rank once over a ZeroMQ socket (no hub between). The
socket lives on the engine's own event loop, so a cell is read, run with IPython's semantics
(``cell_exec``: magics, ``_``, tracebacks that name ``Cell In[n]``) and replied to on the
main thread with no hand-off between threads. What a running cell prints leaves from a second
socket, owned by a thread that sleeps until a cell first prints and then sends every FLUSH
seconds while the main thread is in the user's code. The reply carries the rest of the
output and how many batches went before it, so the notebook knows when it has them all.

sys.stdout and sys.stderr stay meshlab's between cells too, so nothing printed is lost: what
the running cell's own threads print (its main thread, threads it started) is the cell's;
what any other thread prints (one an earlier cell started, a library's) is sent apart, named
by its thread, whether a cell runs or not, and never mixed into a cell's output.

Plain Python and ZeroMQ: the shell is the engine's, handed in, never imported.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from meshlab.rank import cell_exec, cell_wire, value_wire

FLUSH = 0.05  # seconds between batches of a running cell's output
THREADS_KEPT = 8 * 2**20  # characters of other threads' printing a rank holds between cells
_server: CellServer | None = None


def serve(shell: Any, address: str, rank: int, key: bytes) -> None:
    """Listen for cells from the notebook at ``address`` (call on the engine's main thread:
    cells run on the loop that calls it)."""
    global _server
    if _server is not None:
        _server.close()
    _server = CellServer(shell, address, rank, key)


def stream_value(value: Any) -> None:
    """Send ``value`` to the notebook as the running cell's pulled value, in pieces of at
    most PIECE bytes read straight from its arrays and tensors (no copy of them here)."""
    if _server is None or _server.cell is None:
        raise RuntimeError("stream_value runs inside a cell the notebook sent")
    _server.stream(value_wire.dumps(value))


def notify(header: dict[str, Any]) -> None:
    """Tell the notebook something about the running cell as it runs (a debugger's stop);
    from the main thread, which owns the socket. Nothing when no cell runs."""
    if _server is not None and _server.cell is not None:
        _server._socket.send_multipart(cell_wire.pack(
            _server.key, {**header, "kind": cell_wire.NOTICE, "id": _server.cell}))


class RankStream:
    """sys.stdout or sys.stderr of a rank: text waits here for the next batch."""

    def __init__(self, name: str, original: Any, relay: OutputRelay) -> None:
        self.name, self._original, self._relay = name, original, relay
        self.encoding, self.errors = "utf-8", "replace"

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._relay.write(self.name, text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass  # the relay sends every FLUSH seconds; the rest rides on the reply

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # fileno() and the like: the engine's stream
        return getattr(self._original, name)


class CellServer:
    """Cells arrive, run and are replied to on the engine's loop; output has its own relay."""

    def __init__(self, shell: Any, address: str, rank: int, key: bytes) -> None:
        self.shell, self.key = shell, key
        self.cell: str | None = None  # the id of the cell running now
        self._socket = _connect(address, cell_wire.cell_identity(rank), key)
        self._stream = ZMQStream(self._socket)  # on the engine's loop: the main thread
        self._stream.on_recv(self._receive)
        self._socket.send_multipart(cell_wire.pack(key, {"kind": cell_wire.HELLO}))
        self.output = OutputRelay(address, cell_wire.output_identity(rank), key)
        # the engine's own streams, kept for fileno() and restored on close
        self._original = {name: _unwrapped(getattr(sys, name)) for name in ("stdout", "stderr")}
        self._streams = {name: RankStream(name, stream, self.output)
                         for name, stream in self._original.items()}
        sys.stdout, sys.stderr = self._streams["stdout"], self._streams["stderr"]

    def close(self) -> None:
        sys.stdout, sys.stderr = self._original["stdout"], self._original["stderr"]
        self.output.close()
        self._stream.close(linger=1000)

    def _receive(self, frames: list[bytes]) -> None:
        message = cell_wire.unpack(self.key, frames)
        if message is None:
            return  # not signed with the channel's key: never parsed further
        cell, _ = message
        if cell.get("kind") != cell_wire.CELL:
            return
        self.output.start(cell["id"])
        self.cell = cell["id"]
        try:
            header, blobs = cell_exec.run_cell(self.shell, cell["code"], cell["number"],
                                               cell["keep"], self._streams)
        except BaseException as e:  # a Ctrl-C between statements, outside the user's code
            header, blobs = {"status": "error", "ename": type(e).__name__, "evalue": str(e),
                             "traceback": []}, []
        self.cell = None
        # the rest rides on the reply, and what other threads printed that was not sent
        tail, batches, threads = self.output.finish()
        header.update(tail, kind=cell_wire.REPLY, id=cell["id"], batches=batches)
        if threads is not None:
            header.update(threads)
        self._socket.send_multipart(cell_wire.pack(self.key, header, *blobs))

    def stream(self, parts: list[memoryview]) -> None:
        """The running cell's value in parts, on the socket its reply will follow."""
        sizes = [part.nbytes for part in parts]
        self._socket.send_multipart(cell_wire.pack(
            self.key, {"kind": cell_wire.VALUE, "id": self.cell, "sizes": sizes}))
        for index, part in enumerate(parts):
            for offset in range(0, part.nbytes, cell_wire.PIECE):
                piece = part[offset:offset + cell_wire.PIECE]
                header = {"kind": cell_wire.CHUNK, "id": self.cell, "part": index,
                          "offset": offset}
                self._socket.send_multipart(cell_wire.pack(self.key, header, piece),
                                            copy=False)  # zmq reads the tensor itself


class OutputRelay:
    """Sends what a rank prints in batches from its own thread and socket: the running cell's
    under its id, other threads' under their names. It sleeps until something is printed, so a
    cell that prints nothing costs it nothing."""

    def __init__(self, address: str, identity: bytes, key: bytes) -> None:
        self.key = key
        self._lock = threading.Lock()  # guards everything below but the thread
        self._pending: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._cell: str | None = None  # the running cell: its output's tag
        self._before: set[int] = set()  # threads alive when it started, but the main one
        self._sent = 0  # batches of it sent (or being sent) from the thread
        # other threads' printing: thread name -> stream -> text, sent while a cell runs (the
        # notebook reads only then) and held between cells; past THREADS_KEPT counted only
        self._threads: dict[str, dict[str, list[str]]] = {}
        self._threads_size, self._threads_dropped = 0, 0
        self._wake, self._closed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._relay, args=(address, identity),
                                        name="meshlab-output", daemon=True)
        self._thread.start()

    def start(self, cell: str) -> None:
        main = threading.main_thread()
        before = {t.ident for t in threading.enumerate() if t is not main and t.ident}
        with self._lock:
            self._cell, self._sent, self._before = cell, 0, before
            held = bool(self._threads or self._threads_dropped)
        if held:  # other threads printed since the last cell: the notebook reads now
            self._wake.set()

    def write(self, name: str, text: str) -> None:
        with self._lock:
            if self._cell is not None and threading.get_ident() not in self._before:
                self._pending[name].append(text)  # the cell's own thread, or one it started
            elif self._threads_size + len(text) <= THREADS_KEPT:
                thread = threading.current_thread().name
                self._threads.setdefault(thread, {}).setdefault(name, []).append(text)
                self._threads_size += len(text)
            else:
                self._threads_dropped += len(text)
        if not self._wake.is_set():
            self._wake.set()

    def finish(self) -> tuple[dict[str, str], int, dict[str, Any] | None]:
        """What the cell printed that was not sent, how many batches were, and what other
        threads printed that was not sent (None: nothing)."""
        with self._lock:
            self._cell = None
            return self._take(), self._sent, self._take_threads()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(5)

    def _take(self) -> dict[str, str]:
        """The output not sent yet (hold the lock)."""
        taken = {name: "".join(parts) for name, parts in self._pending.items() if parts}
        for parts in self._pending.values():
            parts.clear()
        return taken

    def _take_threads(self) -> dict[str, Any] | None:
        """Other threads' printing not sent yet, for a message (hold the lock)."""
        if not self._threads and not self._threads_dropped:
            return None
        threads = {thread: {name: "".join(parts) for name, parts in streams.items()}
                   for thread, streams in self._threads.items()}
        taken = {"threads": threads, "threads_dropped": self._threads_dropped}
        self._threads, self._threads_size, self._threads_dropped = {}, 0, 0
        return taken

    def _relay(self, address: str, identity: bytes) -> None:
        notebook = _connect(address, identity, self.key)
        try:
            while not self._closed.is_set():
                self._wake.wait()
                self._wake.clear()
                while not self._closed.wait(FLUSH):  # let a batch gather
                    with self._lock:
                        cell = self._cell
                        if cell is None:
                            # the cell ended (the reply took the rest); other threads' text
                            # waits for the next, when the notebook reads: held here, bounded
                            break
                        taken, threads = self._take(), self._take_threads()
                        if taken:
                            self._sent += 1
                    if taken:
                        notebook.send_multipart(cell_wire.pack(
                            self.key, {"kind": cell_wire.OUTPUT, "id": cell, **taken}))
                    if threads is not None:
                        notebook.send_multipart(cell_wire.pack(
                            self.key, {"kind": cell_wire.THREADS, **threads}))
        finally:
            notebook.close()


def _unwrapped(stream: Any) -> Any:
    """The engine's stream under a RankStream a previous server left."""
    return stream._original if isinstance(stream, RankStream) else stream


def _connect(address: str, identity: bytes, key: bytes) -> zmq.Socket[bytes]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    cell_wire.secure_client(socket, key)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(address)
    return socket
