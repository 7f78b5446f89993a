"""Running a cell on a rank as the notebook's IPython would, at a fraction of the cost.

IPython's ``run_cell`` spends ~0.3 ms on a trivial cell: the same static transforms again,
traitlets, an async check, a result object and a compile per statement. That is a third of
a rank's whole share of a ``%%mesh`` round trip. Here a cell takes IPython's steps itself:
the cell transformed by IPython's own transformers (the static part cached per text, the
single-line part asked afresh, since it depends on the namespace), history, the cell's
``Cell In[n]`` filename, the builtin and display traps, the last expression shown, errors
formatted by the shell's own traceback. Whatever it does not copy goes through
``shell.run_cell`` unchanged: top-level ``await``, a syntax error, AST transformers,
listeners on ``pre_run_cell``/``post_run_cell`` (autoreload), other interactivity settings.

The shell is the engine's, handed in, never imported.
"""

from __future__ import annotations

import ast
import bdb
import contextlib
import pickle
import signal
import sys
import time
import warnings
from typing import Any

from meshlab import runtime
from meshlab.measure import profiling
from meshlab.rank import rng_state

_transformed: dict[str, str] = {}  # cell text -> IPython's static transform of it
_TRANSFORMED_KEPT = 1024

# meshlab's second, stronger stop (docs/guides/notebook-basics.md, "When a cell will not
# stop"), for a cell that caught Ctrl-C's KeyboardInterrupt and went on. Not SIGUSR1: Slurm's
# --signal, Lightning's requeue and faulthandler.register conventionally use that one.
STOP_SIGNAL = signal.SIGUSR2
running = False  # a cell is running on the main thread (read by the probe thread)
interrupts = 0  # SIGINTs the running cell has seen: one still running after one caught it
steps_before = 0  # runtime.optimizer_steps as the running cell began: its own are the rest


class CellStopped(BaseException):
    """Raised in a cell that caught KeyboardInterrupt and went on, when meshlab sends it
    STOP_SIGNAL: neither an Exception nor a KeyboardInterrupt, so that ``except Exception:``
    and ``except KeyboardInterrupt:`` let it through."""


def _on_interrupt(signum: int, frame: Any) -> None:
    global interrupts
    interrupts += 1  # counted: a cell that outlives this caught it
    raise KeyboardInterrupt


def _on_stop(signum: int, frame: Any) -> None:
    if running:  # a late signal after the cell ended is no one's business
        raise CellStopped(f"meshlab stopped the cell with {signal.Signals(signum).name}: it "
                          "caught Ctrl-C's KeyboardInterrupt and went on")


def run_cell(shell: Any, code: str, number: int, keep: bool,
             streams: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
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
    global running, interrupts, steps_before
    began, steps_before = time.monotonic(), runtime.optimizer_steps
    running, interrupts = True, 0  # after steps_before: a probe that sees it running reads both
    previous = signal.signal(signal.SIGINT, _on_interrupt)  # Ctrl-C reaches it
    signal.signal(STOP_SIGNAL, _on_stop)
    profiling.mark_cell()
    generators = rng_state.snapshot()  # export asks whether a cell it leaves out drew
    try:
        failure = execute(shell, code, number)
    finally:
        profiling.mark_cell()
        running = False
        signal.signal(signal.SIGINT, previous)
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # an idle engine never dies of it
        sys.stdout, sys.stderr, shell.display_trap.hook = saved
        with contextlib.suppress(KeyError):
            del vars(shell)["_showtraceback"]  # the kernel's own again
    header: dict[str, Any] = {"status": "ok", "optimizer_steps": runtime.optimizer_steps,
                              "cell_steps": runtime.optimizer_steps - steps_before,
                              "seconds": time.monotonic() - began,
                              "result": shown.get("text"), "drew": rng_state.drawn(generators)}
    if errors:
        header.update(status="error", ename=errors[-1][0], evalue=errors[-1][1],
                      traceback=errors[-1][2])
    elif failure is not None:  # a UsageError: IPython prints it without a traceback
        header.update(status="error", ename=type(failure).__name__, evalue=str(failure) or (
            "quit from the debugger: the cell ended there" if isinstance(failure, bdb.BdbQuit)
            else ""), traceback=[])
    blobs: list[bytes] = []
    if keep and "value" in shown and header["status"] == "ok":
        try:  # pickled here, so a value that cannot travel costs only this rank's
            blobs.append(pickle.dumps(shown["value"]))
        except Exception as e:
            header["unsent"] = f"{type(e).__name__}: {e}"
    return header, blobs


def execute(shell: Any, code: str, number: int) -> BaseException | None:
    """Run ``code`` as In [number], as ``shell.run_cell(code, store_history=True)`` would;
    returns what it raised, if anything."""
    compiled = _compile(shell, code, number)
    if compiled is None:
        result = shell.run_cell(code, store_history=True)
        return result.error_before_exec or result.error_in_exec
    cell, codes = compiled
    shell.events.trigger("pre_execute")
    shell.history_manager.store_inputs(number, cell, code)
    shell.logger.log(cell, code)
    failure: BaseException | None = None
    excepthook, sys.excepthook = sys.excepthook, shell.excepthook
    try:
        try:
            with shell.builtin_trap, shell.display_trap:
                for compiled_code in codes:
                    exec(compiled_code, shell.user_global_ns, shell.user_ns)
        finally:  # the code is over: a Ctrl-C sent again for it must not cut its traceback
            # (a stop signal already pending is raised here, and reported as the cell's)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    except SystemExit as e:
        failure = e
        shell.showtraceback(exception_only=True)
        warnings.warn("To exit: use 'exit', 'quit', or Ctrl-D.", stacklevel=1)
    except bdb.BdbQuit as e:  # a debugger quit: IPython stops here without a word
        failure = e
    except BaseException as e:  # shown as IPython shows it, then replied
        failure = e
        # from the cell's own frame down: IPython up to 9.10 dropped this function's frame
        # by tb_offset=1, later ones drop only frames of IPython's own modules
        user_frames = e.__traceback__.tb_next if e.__traceback__ is not None else None
        shell.showtraceback((type(e), e.with_traceback(user_frames), user_frames),
                            tb_offset=0, running_compiled_code=True)
    finally:
        sys.excepthook = excepthook
        shell.last_execution_succeeded = failure is None
        shell.history_manager.store_output(number)
        shell.execution_count = number + 1
        shell.events.trigger("post_execute")
    return failure


def _compile(shell: Any, code: str, number: int) -> tuple[str, list[Any]] | None:
    """The transformed cell and its code objects (all but a last expression as one
    module, that expression in "single" mode so it reaches the display hook), or None
    where only ``shell.run_cell`` does it right."""
    if (not code.strip() or shell.ast_transformers or shell.ast_node_interactivity != "last_expr"
            or shell.custom_exceptions or shell.trio_runner is not None
            or shell.events.callbacks["pre_run_cell"] or shell.events.callbacks["post_run_cell"]):
        return None
    try:
        cell = _transform(shell, code)
        name = shell.compile.cache(cell, number, raw_code=code)
        body = shell.compile.ast_parse(cell, filename=name).body
        codes = []
        if body and isinstance(body[-1], ast.Expr):
            body, last = body[:-1], body[-1]
            codes.append(shell.compile(ast.Interactive([last]), name, "single"))
        if body:
            codes.insert(0, shell.compile(ast.Module(body, []), name, "exec"))
    except Exception:  # a syntax error, top-level await: IPython's path says it its way
        return None
    return cell, codes


def _transform(shell: Any, code: str) -> str:
    """IPython's ``transform_cell``: its static transforms depend on the text alone, so
    they are kept per text; a one-line cell's prefilter (automagic, aliases, ``exit``)
    depends on the namespace, so it is asked each time."""
    cell = _transformed.get(code)
    if cell is None:
        if len(_transformed) >= _TRANSFORMED_KEPT:
            _transformed.clear()
        cell = _transformed[code] = shell.input_transformer_manager.transform_cell(code)
    if len(cell.splitlines()) == 1:
        with shell.builtin_trap:
            cell = shell.prefilter_manager.prefilter_lines(cell) + "\n"
    lines = cell.splitlines(keepends=True)
    for transform in shell.input_transformers_post:
        lines = transform(lines)
    return "".join(lines)
