"""Per-rank outputs -> grouped, deduplicated text; error summaries by rank.

Ranks send plain data (text and tracebacks); everything here draws it. Identical
output from several ranks is shown once under its rank set, ``[ranks 0-3]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from meshlab.notebook.ranks import label

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Frames from the machinery between the user's cell and the rank: never the user's fault.
BACKEND_ERRORS = ("DistBackendError", "DistError", "DistNetworkError", "DistStoreError")
# what gloo and NCCL say when a peer failed, timed out or went away
_BACKEND_TEXT = re.compile(r"\bgloo\b|\bNCCL\b|ProcessGroup|Connection closed by peer|"
                           r"pair closure|Connection reset by peer")
_INTERNAL_FRAME = re.compile(r"(/ipyparallel/|/ipykernel/|/meshlab/(?!models/)|/IPython/core/|"
                             r"/torch/distributed/_tools/)")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes."""
    return _ANSI.sub("", text)


@dataclass(slots=True)
class RankError:
    """An exception raised on one rank, as plain data."""

    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)

    def headline(self) -> str:
        return f"{self.ename}: {self.evalue}" if self.evalue else self.ename

    def from_backend(self) -> bool:
        """Raised by torch.distributed or its backend, whatever the class (gloo raises a
        plain RuntimeError): a consequence, usually, of another rank's failure."""
        if self.ename in BACKEND_ERRORS or _BACKEND_TEXT.search(self.evalue):
            return True
        # torch's memory trackers (%%mesh --memory) sit in every op's frames: not the backend
        return any("torch/distributed/" in text and "torch/distributed/_tools/" not in text
                   for text in map(strip_ansi, self.traceback))


@dataclass(slots=True)
class RankOutput:
    """What one rank produced for one cell."""

    rank: int
    status: str = "running"  # running | ok | error | timeout | interrupted | died
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of the cell's last expression
    error: RankError | None = None
    stack: str | None = None  # main-thread stack when it timed out or stayed stuck
    dropped: dict[str, int] = field(default_factory=dict)  # stream -> lines past the cap
    dropped_bytes: dict[str, int] = field(default_factory=dict)  # stream -> characters
    optimizer_steps: int | None = None  # optimizer.step() calls so far, sent as the cell ended
    drew: list[str] | None = None  # random generators the cell drew from (meshlab.rank.rng_state)
    reason: str | None = None  # its summary line, where not the usual (it ignored Ctrl-C)


@dataclass(slots=True)
class CellResult:
    """Everything the ranks of one cell produced, in rank order."""

    ranks: list[int]
    outputs: dict[int, RankOutput]
    timeout: float | None = None
    notes: list[str] = field(default_factory=list)
    values: dict[int, Any] = field(default_factory=dict)  # last-expression values, if pulled
    comms: dict[int, list[Any]] = field(default_factory=dict)  # traced collectives, if asked
    profile: Any = None  # a CellProfile (meshlab.notebook.cell_profile), if asked
    memory: dict[int, Any] = field(default_factory=dict)  # rank -> its MemoryTimeline, if asked
    collectives: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # on a hang
    full_output: str | None = None  # folder with each rank's whole output, if some was cut
    # what threads other than the cell's printed meanwhile (or since the last cell): thread
    # name -> rank -> its text; and characters a rank dropped, holding them between cells
    threads: dict[str, dict[int, RankOutput]] = field(default_factory=dict)
    threads_dropped: dict[int, int] = field(default_factory=dict)
    progress: Any = None  # its time and each rank's steps: a CellProgress (cell_progress.py)

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outputs.values())

    @property
    def optimizer_steps(self) -> int | None:
        """The most optimizer.step() calls on any rank of the cell; None if a rank did not
        say (it did not finish)."""
        steps = [o.optimizer_steps for o in self.outputs.values()]
        return None if None in steps else max((s for s in steps if s is not None), default=0)

    @property
    def drew(self) -> tuple[str, ...] | None:
        """The random generators the cell drew from on any rank; None if a rank did not say
        and none that did drew (it did not finish)."""
        said = [o.drew for o in self.outputs.values()]
        drew = sorted({g for names in said if names for g in names})
        return None if None in said and not drew else tuple(drew)

    @property
    def failed(self) -> list[int]:
        return [r for r, o in self.outputs.items() if o.status not in ("ok", "running")]

    def stdout(self) -> str:
        return render_groups({r: o.stdout for r, o in self.outputs.items()})

    def stderr(self) -> str:
        return render_groups({r: o.stderr for r, o in self.outputs.items()})

    def thread_output(self, name: str) -> str:
        """``[ranks 0-3] thread 'ticker': tick 4``: what other threads printed on ``name``."""
        return "\n".join(render_groups({r: getattr(o, name) for r, o in by_rank.items()},
                                        suffix=f" thread {thread!r}:")
                         for thread, by_rank in sorted(self.threads.items()))

    def truncated(self) -> str:
        """``[ranks 0-3] … 195,000 more stdout lines not shown`` and where they went."""
        lines = []
        sources = [("", self.outputs), *((f" thread {t!r}", by_rank)
                                         for t, by_rank in sorted(self.threads.items()))]
        for source, outputs in sources:
            for name in ("stdout", "stderr"):
                counts = {r: _not_shown(name, o.dropped.get(name, 0), o.dropped_bytes[name])
                          for r, o in outputs.items() if o.dropped_bytes.get(name)}
                lines += [f"{label(ranks)}{source} {text}" for ranks, text in group(counts)]
        if lines and self.full_output:
            lines.append(f"full output of each rank: {self.full_output}/rank<N>.stdout "
                         "(and .stderr; rank<N>.thread-<name>.stdout for other threads)")
        lost = {r: f"… {n:,} characters printed by other threads while no cell ran were not "
                   "kept (a rank holds 8 MB of them between cells)"
                for r, n in self.threads_dropped.items() if n}
        lines += [f"{label(ranks)} {text}" for ranks, text in group(lost)]
        return "\n".join(lines)

    def results(self) -> str:
        values = {r: o.result for r, o in self.outputs.items() if o.result is not None}
        return render_groups(values, prefix="Out", colon=True)

    def summary(self) -> str:
        """One line per group of failing ranks, then the stacks of stuck ranks."""
        if self.ok:
            return ""
        n, total = len(self.failed), len(self.ranks)
        lines = [f"{n} of {total} rank{'s' if total > 1 else ''} failed:"]
        lines += [f"  {label(ranks)} {reason}" for ranks, reason in self._reasons()]
        stacks = {r: o.stack for r, o in self.outputs.items() if o.stack}
        for ranks, stack in group(stacks):
            lines += [f"{label(ranks)} stack when stopped:", stack]
        lines += collective_lines(self.collectives)
        lines += self.notes
        return "\n".join(lines)

    def _reasons(self) -> list[tuple[list[int], str]]:
        reasons: dict[int, str] = {}
        for r, o in self.outputs.items():
            if o.status == "error" and o.error is not None:
                reasons[r] = o.error.headline()
            elif o.reason:
                reasons[r] = o.reason
            elif o.status == "timeout":
                reasons[r] = f"still running after the {self.timeout:g} s time limit"
            elif o.status == "interrupted":
                reasons[r] = "interrupted (KeyboardInterrupt)"
            elif o.status == "died":
                reasons[r] = o.error.evalue if o.error else "died"
        # the root cause first: a dead rank, or one whose own code raised; then the ranks
        # that failed because of it (backend errors, timeouts, interrupts)
        return sorted(group(reasons), key=lambda g: self._consequence(g[0][0]))

    def _consequence(self, rank: int) -> int:
        """0: a root cause (died, or raised from its own code); 1: a backend error; 2: the
        rest (timed out, interrupted)."""
        o = self.outputs[rank]
        if o.status == "died" or (o.status == "error" and o.error is not None
                                  and not o.error.from_backend()):
            return 0
        return 1 if o.status == "error" else 2

    def first_traceback(self) -> list[str]:
        """The traceback of the root-cause rank (the lowest that raised from its own code,
        else the lowest that raised), internal frames removed."""
        for o in sorted(self.outputs.values(), key=lambda o: (self._consequence(o.rank), o.rank)):
            if o.status == "error" and o.error is not None and o.error.traceback:
                return [f"Traceback from rank {o.rank}:", *clean_traceback(o.error.traceback)]
        return []

    def __str__(self) -> str:
        parts = [self.thread_output("stdout"), self.thread_output("stderr"), self.stdout(),
                 self.stderr(), self.truncated(), self.results(), self.summary()]
        return "\n".join(p for p in parts if p)


class MeshError(RuntimeError):
    """A %%mesh cell failed on some ranks; ``.result`` holds every rank's output."""

    def __init__(self, result: CellResult):
        self.result = result
        tb = "\n".join(strip_ansi(line) for line in result.first_traceback())
        super().__init__(result.summary() + ("\n\n" + tb if tb else ""))


def size_text(n: int) -> str:
    """Bytes as people read them: ``512 MB``, ``3.6 GB``."""
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def group(values: dict[int, str]) -> list[tuple[list[int], str]]:
    """Ranks with identical text, in order of their lowest rank; empty texts dropped."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(values):
        if values[rank]:
            by_text.setdefault(values[rank], []).append(rank)
    return sorted(((ranks, text) for text, ranks in by_text.items()), key=lambda g: g[0][0])


def render_groups(values: dict[int, str], prefix: str = "", colon: bool = False,
                  suffix: str = "") -> str:
    """``[ranks 0-3] text``, or the label on its own line before multi-line text."""
    blocks = []
    for ranks, text in group(values):
        head = f"{prefix}{label(ranks)}{':' if colon else ''}{suffix}"
        body = text.rstrip("\n")
        blocks.append(f"{head} {body}" if "\n" not in body else f"{head}\n{body}")
    return "\n".join(blocks)


def collective_lines(collectives: dict[int, list[dict[str, Any]]], last: int = 3) -> list[str]:
    """Each rank's last collectives (identical histories once), then where the ranks part."""
    if not any(collectives.values()):
        return []
    texts = {r: " · ".join(_collective(c) for c in rows[-last:]) or "(none)"
             for r, rows in collectives.items()}
    lines = ["last collectives per rank (flight recorder, oldest first):"]
    lines += [f"  {label(ranks)} {text}" for ranks, text in group(texts)]
    parted = first_mismatch(collectives)
    return lines + ([f"  {parted}"] if parted else [])


def first_mismatch(collectives: dict[int, list[dict[str, Any]]]) -> str | None:
    """The first collective (by group and sequence number) the ranks did not all issue alike:
    the usual cause of a hang is one rank skipping a collective or calling it with other
    sizes."""
    issued = {r: {(c["group"], c["seq"]): c for c in rows} for r, rows in collectives.items()}
    order = sorted({k for d in issued.values() for k in d}, key=lambda k: (k[1], k[0]))
    for group_name, seq in order:
        calls: dict[int, str] = {}
        finished: set[str | None] = set()  # the op, if every rank finished it; else None
        for r, d in issued.items():
            seqs = [s for g, s in d if g == group_name]
            if not seqs or seq < min(seqs):
                continue  # not in this group, or its history no longer reaches back this far
            call = d.get((group_name, seq))
            calls[r] = f"{call['op']}{_sizes(call)}" if call else "never issued it"
            finished.add(call["op"] if call and call.get("state") == "done" else None)
        if len(finished) == 1 and None not in finished:
            continue  # finished alike on every rank (a scatter's root alone lists sizes)
        if len(set(calls.values())) > 1:
            parts = " · ".join(f"{label(ranks)} {text}" for ranks, text in group(calls))
            return f"ranks part at collective #{seq} on {group_name}: {parts}"
    return None


def _collective(c: dict[str, Any]) -> str:
    return f"#{c['seq']} {c['op']}{_sizes(c)} on {c['group']} ({c['state']})"


def _sizes(c: dict[str, Any]) -> str:
    return ",".join("[" + "x".join(map(str, s)) + "]" for s in c.get("sizes", []))


def clean_traceback(lines: Iterable[str]) -> list[str]:
    """Drop traceback chunks that point into ipyparallel, ipykernel or meshlab itself."""
    kept = []
    for chunk in lines:
        plain = strip_ansi(chunk).lstrip()
        if plain.startswith("File ") and _INTERNAL_FRAME.search(plain.split("\n", 1)[0]):
            continue
        kept.append(chunk)
    return kept


class LiveOutput:
    """Shows a running cell's output in the notebook as it arrives, then its grouped result.

    While the cell runs, only what is new is sent: each poll's complete new lines, grouped
    (ranks that sent the same lines show them once). When it ends, that live output is
    cleared and replaced, once, by the grouped output of the whole cell (each rank's kept
    lines, then a marker for what the cap dropped). ``sent`` counts the characters shown.
    A cell that runs long shows its progress too (``progress``), ended on its final state.
    """

    def __init__(self) -> None:
        from meshlab.notebook.progress_line import ProgressLine  # (which imports this module)

        # (thread, or "" for the cell's own, rank, stream) -> characters shown
        self._shown: dict[tuple[str, int, str], int] = {}
        self._live = False
        self.sent = 0
        self.line = ProgressLine()
        self.progress = self.line.on_progress  # Session.run's on_progress: None if not shown

    def update(self, result: CellResult) -> None:
        sources = [("", result.outputs), *((t, by_rank) for t, by_rank in
                                           sorted(result.threads.items()))]
        for thread, outputs in sources:
            for name in ("stdout", "stderr"):
                new: dict[int, str] = {}
                for r, o in outputs.items():
                    text, shown = getattr(o, name), self._shown.get((thread, r, name), 0)
                    end = text.rfind("\n") + 1  # whole lines only, so equal ranks group
                    if end > shown:
                        new[r], self._shown[thread, r, name] = text[shown:end], end
                if new:
                    self._live = True
                    self._show(name, render_groups(
                        new, suffix=f" thread {thread!r}:" if thread else ""))

    def finish(self, result: CellResult, debugged: list[str] | None = None) -> None:
        """Replace the live output by the cell's grouped output; ``debugged``: the lines of
        a debugger session at its prompt (cleared with the rest), shown again first."""
        if self._live or debugged:
            from IPython.display import clear_output

            clear_output()
        if debugged:
            self._show("stdout", "\n".join(["pdb session:", *debugged]))
        for name, text in (("stdout", result.thread_output("stdout")),
                           ("stderr", result.thread_output("stderr")),
                           ("stdout", result.stdout()), ("stderr", result.stderr()),
                           ("stderr", result.truncated()), ("stdout", result.results())):
            self._show(name, text)
        if result.ok and result.notes:  # a failed cell's notes close its error summary
            self._show("stderr", "\n".join(result.notes))
        self.line.finish(result.progress, cleared=self._live or bool(debugged))

    def _show(self, stream: str, text: str) -> None:
        from IPython.display import display

        if not text:
            return
        self.sent += len(text)
        bundle = {"text/plain": text}
        if stream == "stderr":  # JupyterLab draws this MIME type like a stderr stream
            bundle["application/vnd.jupyter.stderr"] = text
        with self.line.aside():  # a terminal's progress line: never under the output
            display(bundle, raw=True)


def stacks_text(stacks: dict[int, str], collectives: dict[int, list[dict[str, Any]]],
                ranks: list[int]) -> str:
    """``%mesh stacks``: identical stacks once under their rank set, then the collectives."""
    lines = [f"{label(group_ranks)}\n{stack}" for group_ranks, stack in group(stacks)]
    silent = [r for r in ranks if r not in stacks]
    if silent:
        lines.append(f"{label(silent)} did not answer (dead, or its process is frozen)")
    return "\n".join(lines + collective_lines(collectives))


def postmortem_text(rank: int, report: dict[str, Any] | None) -> str:
    """``%mesh debug RANK``: the traceback, then the failing frame's variables."""
    if report is None:
        return f"rank {rank} has no failed cell to examine"
    width = max((len(n) for n in report["locals"]), default=0)
    variables = [f"  {name:<{width}} = {value}" for name, value in report["locals"].items()]
    return "\n".join([f"rank {rank}: {report['error']}", "", report["traceback"].rstrip(), "",
                      f"variables in {report['frame']}:", *(variables or ["  (none)"])])


def summary_lines(result: CellResult) -> list[str]:
    """The error summary, then the lowest failing rank's traceback (for IPython's display)."""
    head, _, rest = result.summary().partition("\n")
    return [f"\x1b[31m{head}\x1b[0m\n{rest}", *result.first_traceback()]


__all__ = [
    "CellResult", "LiveOutput", "MeshError", "RankError", "RankOutput",
    "clean_traceback", "collective_lines", "first_mismatch", "group", "postmortem_text",
    "render_groups", "size_text", "stacks_text", "strip_ansi", "summary_lines",
]


def _not_shown(name: str, lines: int, size: int) -> str:
    """What a cap kept back: whole lines, or the rest of one line too long to show."""
    if lines:
        return f"… {lines:,} more {name} lines not shown ({size:,} characters)"
    return f"… {size:,} more {name} characters not shown (one line longer than the cap)"
