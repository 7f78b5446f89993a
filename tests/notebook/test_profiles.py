"""Cluster profiles: the built-in ones, a user's file, and bad files named."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlab.notebook import profiles


def test_builtin_local_profile_loads() -> None:
    p = profiles.load("local")
    assert (p.launcher, p.backend, p.ranks, p.cell_timeout) == ("local", "auto", None, None)


def test_unknown_profile_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster profile 'nope'.*available profiles "
                                         r"are local"):
        profiles.load("nope")


def test_profile_from_a_user_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[cluster]\nranks = 2\npg_timeout = 5\n[env]\nOMP_NUM_THREADS = 1\n')
    p = profiles.load(path)
    assert (p.name, p.ranks, p.pg_timeout, p.env) == ("mine", 2, 5, {"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("text, message", [
    ("[cluster]\nrnaks = 2\n", r"unknown \[cluster\] key\(s\) \['rnaks'\]"),
    ('[cluster]\nbackend = "mpi"\n', "backend 'mpi' is not one of"),
    ("[clusters]\n", r"unknown table\(s\)"),
])
def test_bad_profiles_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        profiles.load(path)
