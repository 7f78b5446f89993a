"""Which of the journal goes into the script, and what the export says about what it leaves
out: the failed cells, a later cell that needs a name one of them defines (refused), and one
that drew random numbers the script would then draw differently (said, with the fix).
Notebook side, plain Python."""

from __future__ import annotations

import re

from meshlab.notebook.export.journal import Entry, ExportError, Journal
from meshlab.notebook.export.names import binds, free_reads, seeds_first


def parse_cells(spec: str) -> list[tuple[int, int | None]]:
    """``"3-7,9,12-"`` -> [(3, 7), (9, 9), (12, None)]: In [n] numbers, ranges inclusive."""
    ranges: list[tuple[int, int | None]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(\d+)(?:(-)(\d*))?", part)
        if not match:
            raise ExportError(f"--cells {spec!r}: {part!r} is not N, N-M or N- (In [n] numbers)")
        first = int(match[1])
        last = first if not match[2] else int(match[3]) if match[3] else None
        if last is not None and last < first:
            raise ExportError(f"--cells {spec!r}: {part!r} runs backwards; write {last}-{first}")
        ranges.append((first, last))
    if not ranges:
        raise ExportError(f"--cells {spec!r} selects nothing: give In [n] numbers like 3-7,9")
    return ranges


def _chosen(number: int, cells: str | None) -> bool:
    ranges = parse_cells(cells) if cells else [(0, None)]
    return any(a <= number and (b is None or number <= b) for a, b in ranges)


def select(journal: Journal, cells: str | None = None) -> list[Entry]:
    """The entries the script repeats: the chosen cells, and the mesh in force before them."""
    entries = [e for e in journal.entries if _chosen(e.number, cells) and e.mark != "skip"
               and e.code]
    if any(e.mark == "export" for e in entries):
        entries = [e for e in entries if e.kind != "cell" or e.mark == "export"]
    if not any(e.kind == "cell" for e in entries):
        raise ExportError("no %%mesh cell to export: run some (only those that succeed on every "
                          "rank are recorded), or widen --cells")
    if entries[0].kind != "mesh":  # the script needs the mesh the first cell saw
        first = journal.entries.index(entries[0])
        in_force = [e for e in journal.entries[:first] if e.kind == "mesh"]
        entries = in_force[-1:] + entries
    for e in entries:
        if e.problem:
            raise ExportError(e.problem)
    _check_failures(journal, entries)
    return entries


def _check_failures(journal: Journal, entries: list[Entry]) -> None:
    """ExportError if a failed cell would have defined a name that an exported cell after it
    reads before binding it, and that nothing exported before that cell defines: the script
    would stop there with a NameError."""
    for failed in journal.failed:
        lost = binds(failed.code)
        if not lost:
            continue
        users: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            if e.kind != "cell" or e.number <= failed.number:
                continue
            before: set[str] = set()
            for earlier in entries[:i]:
                before |= {"mesh"} if earlier.kind == "mesh" else binds(earlier.code)
            for name in sorted((lost & free_reads(e.code)) - before):
                users.setdefault(name, []).append(e.number)
        if users:
            names = ", ".join(f"`{n}`" for n in users)
            cells = sorted({n for numbers in users.values() for n in numbers})
            used_by = ", ".join(f"In [{n}]" for n in cells)
            them = "it" if len(users) == 1 else "them"
            raise ExportError(
                f"In [{failed.number}] failed and defines {names}, used by {used_by}: re-run "
                f"it successfully and {used_by} after it, then export "
                f"{_without(entries, failed.number)} (N: In [{failed.number}]'s new number) to "
                f"leave the old ones out; or leave {used_by} out with --cells ({used_by} "
                f"read{'s' * (len(cells) == 1)} {names} before any exported cell defines {them}: "
                "the script would stop there with a NameError)")


def left_out(journal: Journal, entries: list[Entry], cells: str | None = None) -> list[str]:
    """What the export says about the cells it leaves out: one line listing the failed cells
    among those chosen, and one for each that drew random numbers before an exported cell
    that draws too (the script's numbers differ from there on), with the fix."""
    failed = [f for f in journal.failed if _chosen(f.number, cells)]
    if not failed:
        return []
    notes = ["Left out, having failed: " + ", ".join(f"In [{f.number}]" for f in failed) + "."]
    for f in failed:
        later = _next_draw(f, entries)
        if f.drew == () or later is None:
            continue
        if f.drew is None:
            what = (f"In [{f.number}] failed and is left out; meshlab cannot tell whether it drew "
                    "random numbers (a saved notebook does not record it, nor does a rank that "
                    "did not answer). If it did, ")
        else:
            what = (f"In [{f.number}] failed after drawing random numbers "
                    f"({', '.join(f.drew)}) and is left out: ")
        notes.append(
            what + f"the script draws different ones from In [{later}] on (initial weights, "
            "dropout, batches) and its losses differ from the notebook's. To export what the "
            "notebook computed, run your seed cell (torch.manual_seed) and the cells after it "
            f"again, then export {_without(entries, f.number)} (N: the seed cell's new "
            f"number), leaving out In [{f.number}] and the old cells after it.")
    return notes


def _next_draw(failed: Entry, entries: list[Entry]) -> int | None:
    """The first exported cell after ``failed`` that may draw from a generator ``failed`` drew
    from (not seeded again since); None if none does."""
    moved = set(failed.drew) if failed.drew is not None else {"torch", "cuda", "random"}
    for e in entries:
        if e.number <= failed.number:
            continue
        if e.kind == "cell":
            moved -= seeds_first(e.code)  # set afresh: its draws are the notebook's again
            if not moved:
                return None
            if e.drew is None or moved & set(e.drew):
                return e.number
        elif e.note.startswith(("%mesh step", "%mesh pipeline")):  # a step may drop out
            return e.number
    return None


def _without(entries: list[Entry], number: int) -> str:
    """``--cells 1-14,N-``: the exported cells before In [number], and those from N on."""
    before = [e.number for e in entries if e.kind == "cell" and e.number < number]
    return f"--cells {min(before)}-{number - 1},N-" if before else "--cells N-"
