"""Rank sets written the way people type them: parse and format."""

from __future__ import annotations

import pytest

from meshlab.notebook.ranks import format_ranks, label, parse_ranks


def test_parse_ranks_accepts_lists_and_ranges() -> None:
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    assert parse_ranks(None, 3) == [0, 1, 2]
    assert parse_ranks([3, 1, 1], 4) == [1, 3]


@pytest.mark.parametrize("spec, message", [
    ("5", "out of range: the cluster has ranks 0-3"),
    ("a", "bad rank set 'a'"),
    ("3-1", "bad rank set '3-1'"),
    ("", "empty"),
    # checked before anything is built: the kernel was OOM-killed building this range
    ("0-99999999999", r"rank\(s\) 0-99999999999 out of range: the cluster has ranks 0-3"),
    ("0-", r"'0-' is not a rank or a range"),
    ("1,", r"'' is not a rank or a range"),
    ("-1", r"'-1' is not a rank or a range"),
])
def test_parse_ranks_rejects_bad_sets_with_the_fix(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_ranks(spec, 4)


def test_format_ranks_compresses_runs() -> None:
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert label([2]) == "[rank 2]" and label([0, 1, 2, 3]) == "[ranks 0-3]"
