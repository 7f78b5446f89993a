"""A rank's native stack (meshlab.rank.native_stacks) when there is none to give: py-spy
missing, or a kernel that forbids ptrace, each said with its fix. A real stack of a rank
stuck in a collective is read in tests/notebook/test_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlab.rank import native_stacks


def test_a_missing_or_refused_py_spy_is_said_with_the_fix(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(native_stacks, "py_spy", lambda: None)
    said = native_stacks.native_stack()
    assert said.startswith("py-spy is not installed where this rank runs (")
    assert "pip install 'meshlab[debug]'" in said
    # a py-spy the kernel does not let attach: its own words, and what to do instead
    refused = tmp_path / "py-spy"
    refused.write_text("#!/bin/sh\necho 'Error: Operation not permitted (os error 1)' >&2\n"
                       "exit 1\n")
    refused.chmod(0o755)
    monkeypatch.setattr(native_stacks, "py_spy", lambda: str(refused))
    said = native_stacks.native_stack()
    assert said.startswith("py-spy may not attach to this rank (pid ")
    assert said.endswith("py-spy said: Error: Operation not permitted (os error 1)")
    hung = tmp_path / "hung"
    hung.write_text("#!/bin/sh\nsleep 5\n")
    hung.chmod(0o755)
    monkeypatch.setattr(native_stacks, "py_spy", lambda: str(hung))
    assert native_stacks.native_stack(timeout=0.5).startswith(
        "py-spy did not finish within 0.5 s")
