"""Options several ``%mesh`` subcommands share, declared once: argparse types for whole and
finite numbers above 0, ``--ranks``, ``-o NAME`` and a schedule's size."""

from __future__ import annotations

import math
from argparse import ArgumentTypeError
from collections.abc import Callable
from typing import Any

from IPython.core.magic_arguments import argument

Parser = Callable[[str], None]


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a whole (``int``) or finite (``float``) number above 0; argparse
    names the option in front of the message."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            what = "whole number" if kind is int else "finite number"
            raise ArgumentTypeError(f"{text!r} is not a {what} above 0")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


count, amount = positive(int), positive(float)  # argparse types: 3 ranks, 2.5 s

ranks_option = argument("--ranks", help="only these ranks, e.g. 0,2-3 (default: all)")


def output_option(what: str) -> Callable[[Parser], Parser]:
    """``-o NAME``: keep ``what`` in the notebook as NAME."""
    return argument("-o", dest="output", metavar="NAME", help=f"keep {what} as NAME")


def schedule_options(microbatches: int) -> Callable[[Parser], Parser]:
    """``--microbatches`` and ``--virtual``, for a schedule built by name."""
    def add(fn: Parser) -> Parser:
        fn = argument("--virtual", type=count, default=1,
                      help="stages per rank v (interleaved, looped; a builder name)")(fn)
        return argument("--microbatches", type=count, default=microbatches,
                        help=f"micro-batches m (default {microbatches}; a builder name)")(fn)
    return add
