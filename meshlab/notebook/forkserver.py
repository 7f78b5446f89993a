"""Engines forked from one process per host that imported their stack once.

A rank's start is mostly imports: torch (~2-3 s of CPU), then IPython, ipyparallel, zmq and
meshlab's rank side. Started one by one, every rank pays them, and on a host with fewer
cores than ranks they take turns. Here one process per host pays them once and forks its
ranks (the zygote, or forkserver, pattern)::

    python -m meshlab.notebook.forkserver -n RANKS [--exits FILE] [--wait S]
        [--environment-on-stdin] -- IPENGINE_ARGS...

Why forking here is safe: the fork happens before anything that does not survive one
exists. No CUDA context (nothing here touches ``torch.cuda``: each child initialises its
own GPU), no process group, no zmq context or socket (each child's engine makes its own),
no Python thread. The one native thread an import starts, OpenBLAS's pool (numpy's), is
shut down by OpenBLAS's own ``pthread_atfork`` handler and restarted in the child on use.

The parent stays. It forwards the signals a launcher sends (SIGTERM to stop, SIGINT); if
it is killed outright, the kernel sends each rank SIGTERM (``PR_SET_PDEATHSIG``). It forks
each rank's ipyparallel nanny when the rank asks, where ipyparallel would start a fresh
interpreter. It reaps its ranks and appends ``PID STATUS`` to ``--exits`` as each ends
(STATUS is the exit code, or minus the signal that killed it), so the notebook can say how
a rank died as it can for an engine it started itself; it exits when the last rank has.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import pickle
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

# Imported before forking: what an engine and meshlab's rank side import on start (the
# ranks' user code imports the rest, as it would under torchrun).
STACK = ("torch", "torch.distributed", "torch.distributed.device_mesh",
         "ipyparallel.engine.app", "ipyparallel.engine.kernel", "ipykernel.zmqshell",
         "meshlab.runtime", "meshlab.rank.cell_server", "meshlab.rank.probe_server",
         "meshlab.rank.cell_exec", "meshlab.mesh", "meshlab.notebook.on_ranks")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # prctl options (linux/prctl.h)
GRACE_S = 5  # SIGTERM to SIGKILL when the lifeline ends: a rank in a collective may not stop


def command(python: str, n: int, wait: float, *options: str,
            engine_args: Sequence[str] = ()) -> list[str]:
    """The command line that starts a forkserver of ``n`` engines (the launchers' one)."""
    return [python, "-m", "meshlab.notebook.forkserver", "-n", str(n), "--wait", f"{wait:g}",
            *options, "--", *engine_args]


def exit_codes(path: str) -> dict[int, int]:
    """pid -> how it ended (exit code, or minus the signal), as a forkserver wrote them."""
    codes = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            pid, _, status = line.partition(" ")
            if status.strip():
                codes[int(pid)] = int(status)
    return codes


def _prctl(option: int, value: int | bytes) -> None:
    """Linux's prctl, where there is one (elsewhere nothing happens)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def _child(engine_argv: list[str], nannies: socket.socket) -> None:
    """Become one engine; never returns. Its nanny is asked of the forkserver over
    ``nannies``, not started as a fresh interpreter."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # go when the forkserver goes
    _prctl(PR_SET_NAME, b"ipengine")  # its command line is the forkserver's: ps and top say
    code = 0
    try:
        import ipyparallel.engine.app as engine_app

        engine_app.start_nanny = functools.partial(_ask_for_nanny, nannies)
        sys.argv = ["ipengine", *engine_argv]
        engine_app.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


def _ask_for_nanny(nannies: socket.socket, **kwargs: Any) -> tuple[str, Any]:
    """ipyparallel's ``start_nanny`` for a forked engine: the same nanny with the same
    arguments, forked by the forkserver. It writes its url on a pipe whose write end
    travels with the request; the engine keeps the read end, as it keeps the nanny's
    stdout, and the nanny leaves when the engine's end closes."""
    kwargs["pid"] = os.getpid()
    read, write = os.pipe()
    socket.send_fds(nannies, [pickle.dumps(kwargs)], [write])
    os.close(write)
    pipe = os.fdopen(read, "rb")
    url = pipe.readline().decode().strip()
    if not url:
        raise RuntimeError("the forkserver could not start this engine's nanny")
    return url, pipe


def _fork_nanny(request: socket.socket) -> None:
    """Serve one engine's request for its nanny (see ``_ask_for_nanny``)."""
    message, fds, _, _ = socket.recv_fds(request, 1 << 20, 1)
    if not message or not fds:
        return
    if os.fork() == 0:
        # A group of its own, as ipyparallel's own session: signals to the engines' group
        # do not reach it. Not a session: in the forkserver's, the watchdog finds it after
        # the forkserver has gone, however recently it was forked.
        os.setpgid(0, 0)
        _prctl(PR_SET_NAME, b"ipengine-nanny")
        for sig in (*FORWARDED, signal.SIGCHLD, signal.SIGALRM):  # the forkserver's own
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        from ipyparallel.engine.nanny import KernelNanny

        code = 0
        try:
            KernelNanny.main(pipe=os.fdopen(fds[0], "w", buffering=1),
                             **pickle.loads(message))
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(fds[0])


def serve(n: int, exits: str, engine_argv: list[str], lifeline: bool = False) -> int:
    """Import the stack, fork ``n`` engines, fork their nannies as they ask, forward
    signals, record how each engine ends; return when the last has. With ``lifeline``, the
    engines' environment comes on stdin first (once the controller is up: the imports
    overlap its start), and the end of stdin (the ssh that started this one has gone) stops
    the engines."""
    import importlib

    for module in STACK:
        importlib.import_module(module)
    if lifeline:  # the connection's key: on stdin, never on a command line
        line = sys.stdin.buffer.readline()
        if not line.strip():
            print("forkserver: stdin ended before the engines' environment came: the "
                  "notebook found no controller to connect them to", file=sys.stderr)
            return 1
        os.environ.update(json.loads(line))
        os.makedirs(os.environ.get("IPP_PROFILE_DIR", "."), 0o700, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    engines: dict[int, socket.socket] = {}  # pid -> the socket it asks for its nanny on
    for _ in range(n):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            ours.close()
            for other in engines.values():
                other.close()
            if lifeline:  # the lifeline is the forkserver's alone
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            _child(engine_argv, theirs)
        theirs.close()
        engines[pid] = ours

    def forward(sig: int, _frame: Any) -> None:
        for pid in list(engines):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    wake_read, wake_write = os.pipe()  # a child's end wakes the select at once
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    watched = [wake_read, 0] if lifeline else [wake_read]
    with open(exits, "a", buffering=1) as record:
        while engines:
            asking = {sock.fileno(): sock for sock in engines.values()}
            ready, _, _ = select.select([*watched, *asking], [], [], 1.0)
            for fd in ready:
                if fd == wake_read:
                    os.read(wake_read, 512)
                elif fd == 0:
                    if not os.read(0, 512):  # whoever started us has gone: so do the ranks
                        watched.remove(0)
                        forward(signal.SIGTERM, None)
                        signal.signal(signal.SIGALRM, lambda *_: forward(signal.SIGKILL, None))
                        signal.alarm(GRACE_S)
                else:
                    _fork_nanny(asking[fd])
            while True:  # reap every child that ended: engines are recorded, nannies not
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid in engines:
                    engines.pop(pid).close()
                    record.write(f"{pid} {os.waitstatus_to_exitcode(status)}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshlab.notebook.forkserver",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, required=True, help="engines to fork")
    parser.add_argument("--exits", help="file for PID STATUS lines (none: not recorded)")
    parser.add_argument("--wait", type=float, default=10.0,
                        help="seconds an engine waits for the controller's connection file")
    parser.add_argument("--environment-on-stdin", action="store_true",
                        help="read the engines' environment (JSON, one line) from stdin, "
                        "then keep stdin as a lifeline: its end stops the engines")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="-- then ipengine's arguments")
    args = parser.parse_args(argv)
    engine_argv = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    return serve(args.n, args.exits or os.devnull,
                 [f"--IPEngine.wait_for_url_file={args.wait:g}", *engine_argv],
                 lifeline=args.environment_on_stdin)


if __name__ == "__main__":
    sys.exit(main())
