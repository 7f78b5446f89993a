"""The planner's shape of a transformers config (``config.json``, or its folder), held to
the model that config builds: ``meshlab plan --model config.json``.

The config names widths, not structure: whether the feed-forward is gated (Llama's three
matrices) or plain (GPT-2's two), whether positions are learned or the embedding is tied,
it does not say under one name across families. So the model is built on the meta device
(no memory, nothing downloaded) with the family's own transformers code; its modules settle
what the config leaves open (``shape_from_modules``), and the shape is kept only where its
parameter count is the built model's within ``AGREE`` (biases, which the planner leaves
out): otherwise the reader is told both counts, never given a plan for another model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshlab.dry_run.shape_from_modules import AGREE, shape_from_modules
from meshlab.plan.report import count_text
from meshlab.plan.shapes import ModelShape


def config_file(path: str | Path) -> Path:
    """``path`` itself, or the ``config.json`` in that folder."""
    found = Path(path).expanduser()
    if found.is_dir():
        found = found / "config.json"
    if not found.is_file():
        raise ValueError(f"no model config at {found}: give a transformers config.json (what "
                         "config.save_pretrained(folder) writes) or its folder")
    return found


def shape_from_config_file(path: str | Path, *, seq_len: int | None = None) -> ModelShape:
    """The shape of the model the transformers ``config.json`` at ``path`` describes."""
    found = config_file(path)
    try:
        data = json.loads(found.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {found} as JSON ({e}): give the config.json a "
                         "transformers config's save_pretrained wrote") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{found} has no model_type: it is not a transformers config (write "
                         "one with config.save_pretrained(folder)), or describe the model in a "
                         "TOML file of ModelShape's fields")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"reading {found} needs transformers: pip install transformers, or "
                         "describe the model in a TOML file of ModelShape's fields") from None
    try:
        config = transformers.AutoConfig.for_model(**data)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{found}: transformers does not know model_type "
                         f"{data['model_type']!r} ({e}): upgrade transformers, or describe "
                         "the model in a TOML file") from None
    return checked_shape(config, name=found.parent.name or found.stem, seq_len=seq_len)


def checked_shape(config: Any, *, name: str, seq_len: int | None = None) -> ModelShape:
    """``ModelShape.from_transformers(config)`` with the structure its modules show, held to
    the parameter count of the model built from it."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())
    shape = ModelShape.from_transformers(config, seq_len=seq_len, name=name)
    seen = shape_from_modules(model, shape.seq_len)
    if seen is not None:  # what the config does not say, from the modules
        shape = dataclasses.replace(
            shape, gated_ffn=seen.gated_ffn, tied_embeddings=seen.tied_embeddings,
            learned_positions=seen.learned_positions, layer_norm=seen.layer_norm)
    if abs(shape.params / counted - 1) > AGREE:
        raise ValueError(
            f"{name}: the planner reads {count_text(shape.params)} parameters from this "
            f"{config.model_type} config where the model it builds has {count_text(counted)}: "
            "its structure is one the planner does not read from a config; describe it in a "
            "TOML file of ModelShape's fields (gated_ffn, tied_embeddings, ...)")
    return shape
