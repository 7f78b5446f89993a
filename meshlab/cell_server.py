"""A rank's end of the direct cell channel: a cell in, its output and one reply out.

ipyparallel launches, supervises and signals the engines; cells take this shorter path.
The notebook sends a cell to each rank once over a ZeroMQ socket (no hub between), the
rank runs it with IPython's own ``run_cell`` (magics, ``_``, tracebacks that name
``Cell In[n]``) on the engine's main thread, and sends back what it printed, batched every
FLUSH seconds while it runs, then one reply holding everything the notebook keeps of the
cell. One thread here owns the socket, so replies and output leave in the order made.

Plain Python and ZeroMQ: the shell is the engine's, handed in, never imported.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import sys
import threading
from typing import Any

import zmq
from tornado.ioloop import IOLoop

from meshlab import cell_wire, runtime

FLUSH = 0.05  # seconds between batches of a running cell's output
_server: CellServer | None = None


def serve(shell: Any, address: str, rank: int, key: bytes) -> None:
    """Listen for cells from the notebook at ``address`` (call on the engine's main thread:
    cells run on the loop that calls it)."""
    global _server
    if _server is not None:
        _server.close()
    _server = CellServer(shell, address, rank, key)


class RankStream:
    """sys.stdout or sys.stderr while a cell runs: text waits here for the next batch."""

    def __init__(self, name: str, original: Any, pending: dict[str, list[str]],
                 lock: threading.Lock) -> None:
        self.name, self._original, self._pending, self._lock = name, original, pending, lock
        self.encoding, self.errors = "utf-8", "replace"

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._pending[self.name].append(text)
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
    """The socket's thread relays; the engine's loop runs each cell on the main thread."""

    def __init__(self, shell: Any, address: str, rank: int, key: bytes) -> None:
        self.shell, self.key, self.loop = shell, key, IOLoop.current()
        self._lock = threading.Lock()  # guards _pending and _running together
        self._pending: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._running: str | None = None  # the cell the main thread runs: its output's tag
        self._queued = 0  # cells received, not yet replied to (the relay's thread only)
        context: zmq.Context[Any] = zmq.Context.instance()
        inbox = f"inproc://meshlab-cells-{id(self)}"
        self._done = context.socket(zmq.PAIR)  # main thread -> relay: a finished cell
        self._done.bind(inbox)
        self._thread = threading.Thread(target=self._relay, args=(address, rank, inbox),
                                        name="meshlab-cells", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._done.send_multipart([b"close"])
        self._thread.join(5)
        self._done.close(linger=0)

    # -- the relay thread: the only user of the notebook's socket --------------------------

    def _relay(self, address: str, rank: int, inbox: str) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        notebook = context.socket(zmq.DEALER)
        notebook.setsockopt(zmq.IDENTITY, str(rank).encode())
        notebook.setsockopt(zmq.LINGER, 1000)
        notebook.connect(address)
        done = context.socket(zmq.PAIR)
        done.connect(inbox)
        poller = zmq.Poller()
        poller.register(notebook, zmq.POLLIN)
        poller.register(done, zmq.POLLIN)
        notebook.send_multipart(cell_wire.pack(self.key, {"kind": cell_wire.HELLO}))
        try:
            while True:
                ready = dict(poller.poll(int(FLUSH * 1000) if self._queued else None))
                if notebook in ready:
                    self._receive(notebook.recv_multipart())
                self._send_output(notebook)
                if done in ready:
                    frames = done.recv_multipart()
                    if frames == [b"close"]:
                        break
                    self._queued -= 1
                    notebook.send_multipart(frames)  # the reply, signed on the main thread
        finally:
            notebook.close()
            done.close(linger=0)

    def _receive(self, frames: list[bytes]) -> None:
        message = cell_wire.unpack(self.key, frames)
        if message is None:
            return  # not signed with the cluster's key: never parsed further
        header, _ = message
        if header.get("kind") == cell_wire.CELL:
            self._queued += 1
            self.loop.add_callback(self._run, header)  # thread-safe: runs on the main thread

    def _send_output(self, notebook: Any) -> None:
        with self._lock:
            cell, taken = self._running, self._take()
        if taken and cell:
            notebook.send_multipart(cell_wire.pack(
                self.key, {"kind": cell_wire.OUTPUT, "id": cell, **taken}))

    def _take(self) -> dict[str, str]:
        """The output not sent yet (hold the lock)."""
        taken = {name: "".join(parts) for name, parts in self._pending.items() if parts}
        for parts in self._pending.values():
            parts.clear()
        return taken

    # -- the main thread -------------------------------------------------------------------

    def _run(self, cell: dict[str, Any]) -> None:
        with self._lock:
            self._running = cell["id"]
        try:
            header, blobs = run_cell(self.shell, cell["code"], cell["number"], cell["keep"],
                                     self._streams())
        except BaseException as e:  # a Ctrl-C between statements, outside the user's code
            header, blobs = {"status": "error", "ename": type(e).__name__, "evalue": str(e),
                             "traceback": []}, []
        with self._lock:  # the rest of its output rides on the reply: nothing is mislabelled
            header.update(self._take(), kind=cell_wire.REPLY, id=cell["id"])
            self._running = None
        self._done.send_multipart(cell_wire.pack(self.key, header, *blobs))

    def _streams(self) -> dict[str, RankStream]:
        return {name: RankStream(name, getattr(sys, name), self._pending, self._lock)
                for name in ("stdout", "stderr")}


def run_cell(shell: Any, code: str, number: int, keep: bool,
             streams: dict[str, RankStream]) -> tuple[dict[str, Any], list[bytes]]:
    """Run ``code`` as In [number] with IPython's semantics; its printing goes to
    ``streams``. Returns the reply's header and blobs (the pickled value, when kept)."""
    shown: dict[str, Any] = {}
    errors: list[tuple[str, str, list[str]]] = []

    def displayhook(value: Any) -> None:  # the value travels in the reply, not on iopub
        if value is None or shell.displayhook.quiet():
            return
        shown["value"] = value
        shown["text"] = shell.display_formatter.format(value, include={"text/plain"})[0].get(
            "text/plain")
        shell.displayhook.update_user_ns(value)  # _, __, Out[n] as in the notebook

    def showtraceback(etype: type, evalue: BaseException, stb: list[str]) -> None:
        errors.append((etype.__name__, str(evalue), stb))  # the formatted chunks, sent back

    shell.execution_count = number
    saved = sys.stdout, sys.stderr, shell.display_trap.hook
    sys.stdout, sys.stderr = streams["stdout"], streams["stderr"]
    shell.display_trap.hook, shell._showtraceback = displayhook, showtraceback
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C reaches it
    try:
        result = shell.run_cell(code, store_history=True)
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.stdout, sys.stderr, shell.display_trap.hook = saved
        with contextlib.suppress(KeyError):
            del vars(shell)["_showtraceback"]  # the kernel's own again
    header: dict[str, Any] = {"status": "ok", "optimizer_steps": runtime.optimizer_steps,
                              "result": shown.get("text")}
    failure = result.error_before_exec or result.error_in_exec
    if errors:
        header.update(status="error", ename=errors[-1][0], evalue=errors[-1][1],
                      traceback=errors[-1][2])
    elif failure is not None:  # a UsageError: IPython prints it without a traceback
        header.update(status="error", ename=type(failure).__name__, evalue=str(failure),
                      traceback=[])
    blobs: list[bytes] = []
    if keep and "value" in shown and header["status"] == "ok":
        try:  # pickled here, so a value that cannot travel costs only this rank's
            blobs.append(pickle.dumps(shown["value"]))
        except Exception as e:
            header["unsent"] = f"{type(e).__name__}: {e}"
    return header, blobs
