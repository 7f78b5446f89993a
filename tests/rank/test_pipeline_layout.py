"""Where a pipeline split finds a model's parts (meshlab.parallel.pipeline_stage.layout_of):
read off one forward, or, for a model on the meta device whose forward cannot run there, off
transformers' pipeline plan or the order its parts were built in. Both must say the same: a
meta layout that put OLMoE's rotary embedding after the blocks fed later stages the hidden
states as their cos and sin (a shape error inside the model, the other stages left waiting)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.rank.families import FAMILIES_SOURCE, FAMILY_NAMES

pytest.importorskip("transformers", reason="transformers is a test dependency")


@pytest.fixture(scope="module")
def families() -> dict[str, object]:
    scope: dict[str, object] = {}
    exec(FAMILIES_SOURCE, scope)
    return scope["FAMILIES"]  # type: ignore[return-value]


def test_a_model_on_meta_is_laid_out_as_its_forward_runs(families: dict) -> None:
    from meshlab.parallel.pipeline_stage import layout_of

    differ = {}
    for name in FAMILY_NAMES:
        torch.manual_seed(0)
        traced = layout_of(families[name]())
        with torch.device("meta"):
            on_meta = layout_of(families[name]())
        # what meta cannot read it does not claim: a block's tuple width (proved on "tiny")
        if replace(on_meta, width=traced.width) != traced:
            differ[name] = (traced, on_meta)
    assert not differ, differ
