"""``meshlab plan MODEL --gpus N [--hardware H] [--layout ...] [--where ...] [--json]``: the
planner in a terminal (``%mesh plan`` in a notebook): a summary, the layouts and the
collectives. The model is a preset, a TOML file (``--model my.toml``) or shape flags
(``--layers 32 --hidden 4096 ...``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshlab.plan.hardware import HARDWARE
from meshlab.plan.layout import IMPLEMENTATIONS
from meshlab.plan.precision import PRECISIONS
from meshlab.plan.report import plan
from meshlab.plan.shapes import MODELS, ModelShape, load_model, model_shape

# shape flags (argparse dest) -> ModelShape fields: all of the first or none
SHAPE_FLAGS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "ffn": "ffn",
               "vocab": "vocab", "seq": "seq_len"}
OPTIONAL_SHAPE_FLAGS = {"kv_heads": "kv_heads", "experts": "experts", "top_k": "top_k"}
# structure flags (store_true): each sets a ModelShape field away from its default
STRUCTURE_FLAGS = {"plain_ffn": ("gated_ffn", False), "tied_embeddings": ("tied_embeddings", True),
                   "learned_positions": ("learned_positions", True)}


def add_command(commands: Any) -> None:
    cmd = commands.add_parser(
        "plan", help="memory, communication and step time of a model on many GPUs",
        description="Predict memory per GPU, communication per axis and step time; without "
        "--layout, search the best layouts. The model: a preset, --model FILE.toml, or "
        "--layers --hidden --heads --ffn --vocab --seq (one of the three).")
    cmd.add_argument("preset", nargs="?", metavar="MODEL",
                     help="a preset: " + ", ".join(MODELS) + " (or a .toml file)")
    cmd.add_argument("--gpus", type=int, required=True)
    cmd.add_argument("--hardware", default="h100-sxm",
                     help=", ".join(HARDWARE) + ", or a .toml profile (default h100-sxm)")
    cmd.add_argument("--layout", help='e.g. "tp=8 pp=16 dp=16 zero=1 mbs=1 m=16"')
    cmd.add_argument("--where", help='search constraints, e.g. "tp<=8 pp=16"')
    cmd.add_argument("--batch", type=int,
                     help="global batch in sequences (default ~4M tokens, >= 1 per GPU; with "
                     "--layout: sets m, or must equal mbs x m x dp where the layout gives m)")
    cmd.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    cmd.add_argument("--implementation", default="meshlab", choices=list(IMPLEMENTATIONS),
                     help="whose code the memory is counted for (default meshlab: what its "
                     "dry run measures; megatron: Megatron-LM's)")
    cmd.add_argument("--tokens", type=float, help="training tokens, for days and GPU-hours")
    cmd.add_argument("--top", type=int, default=10)
    cmd.add_argument("--json", action="store_true",
                     help="print one JSON object (summary, layouts, collectives) instead")
    own = cmd.add_argument_group(
        "a model of your own", "a transformers config.json (or its folder), a TOML file whose "
        "keys are ModelShape's fields (name, layers, hidden, heads, kv_heads, ffn, vocab, "
        "seq_len, experts, top_k, gated_ffn, tied_embeddings, learned_positions), or its shape "
        "as flags")
    own.add_argument("--model", metavar="FILE",
                     help="the model's shape from a TOML file, or from a transformers "
                     "config.json or the folder holding one (read with transformers, its "
                     "structure from the model built on the meta device)")
    for flag, what in (("layers", "transformer layers"), ("hidden", "hidden size"),
                       ("heads", "attention heads"), ("ffn", "feed-forward hidden size"),
                       ("vocab", "vocabulary size"),
                       ("seq", "training sequence length (alone: a preset's or a file's "
                        "model at this length, e.g. --seq 131072)"),
                       ("kv-heads", "key/value heads (default: --heads)"),
                       ("experts", "experts per MoE layer (default: dense)"),
                       ("top-k", "experts each token goes to (default 1)")):
        own.add_argument(f"--{flag}", type=int, metavar="N", help=what)
    for flag, what in (("plain-ffn", "a two-matrix feed-forward (GPT's GELU MLP) rather than "
                        "a gated one (Llama's SwiGLU, three matrices: the default)"),
                       ("tied-embeddings", "the output projection reuses the token embedding"),
                       ("learned-positions", "a position-embedding table (GPT) rather than "
                        "RoPE")):
        own.add_argument(f"--{flag}", action="store_true", help=what)
    cmd.set_defaults(run=run_command)


def chosen_model(args: Any) -> str | ModelShape:
    """The one model the arguments name: a preset, a TOML file or shape flags."""
    flags = {dest: getattr(args, dest) for dest in (*SHAPE_FLAGS, *OPTIONAL_SHAPE_FLAGS)
             if getattr(args, dest) is not None}
    structure = [d for d in STRUCTURE_FLAGS if getattr(args, d, False)]
    if structure and not flags.keys() - {"seq"}:
        raise ValueError(f"{_flags(structure)} describe a model given as shape flags "
                         f"({_flags(SHAPE_FLAGS)}); a preset or a file says its own structure")
    if set(flags) == {"seq"} and (args.preset or args.model):  # a preset at another length
        return dataclasses.replace(_from_file(args.model) if args.model
                                   else model_shape(str(args.preset)), seq_len=flags["seq"])
    sources = [s for s, given in ((f"the preset {args.preset!r}", args.preset),
                                  (f"--model {args.model}", args.model),
                                  (" ".join(_flag(d) for d in flags) + " flags", flags))
               if given]
    if not sources:
        raise ValueError(f"which model? name a preset ({', '.join(MODELS)}), pass --model "
                         f"FILE.toml, or give its shape: {_flags(SHAPE_FLAGS)}")
    if len(sources) > 1:
        raise ValueError(f"the model is given {len(sources)} ways ({' and '.join(sources)}): "
                         "keep one")
    if args.model:
        return _from_file(args.model)
    if not flags:
        preset = str(args.preset)
        return preset if preset.strip().lower() in MODELS else _from_file(preset)
    missing = [d for d in SHAPE_FLAGS if d not in flags]
    if missing:
        raise ValueError(f"a model from flags needs {_flags(missing)} too (given: "
                         f"{_flags(flags)}): add them, or use --model FILE.toml")
    if "top_k" in flags and "experts" not in flags:
        raise ValueError(f"--top-k {flags['top_k']} needs --experts N (experts per MoE "
                         "layer): add it, or drop --top-k for a dense model")
    names = {**SHAPE_FLAGS, **OPTIONAL_SHAPE_FLAGS}
    shape: dict[str, Any] = {names[d]: value for d, value in flags.items()}
    shape.update(STRUCTURE_FLAGS[d] for d in structure)
    return ModelShape(**shape)


def _from_file(path: str) -> ModelShape:
    """A TOML file of ModelShape's fields, or a transformers config.json (or its folder)."""
    if path.strip().endswith(".toml"):
        return load_model(path)
    if not path.strip().endswith(".json") and not Path(path).expanduser().is_dir():
        return model_shape(path)  # names the presets
    # transformers and torch, only for a config: the planner itself stays pure Python
    from meshlab.dry_run.shape_from_config import shape_from_config_file

    return shape_from_config_file(path)


def run_command(args: Any, parser: Any) -> int:
    try:
        result = plan(chosen_model(args), gpus=args.gpus, hardware_profile=args.hardware,
                      layout=args.layout, constraints=args.where, global_batch=args.batch,
                      precision=args.precision, top=args.top, tokens=args.tokens,
                      implementation=args.implementation)
    except ValueError as e:
        parser.exit(2, f"meshlab plan: {e}\n")
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    print(result.text(), end="\n\n")
    print(result.table().to_string(index=False), end="\n\n")
    comm = result.comm_frame()
    print(f"collectives of {result.best.layout.describe()}:")
    print(comm.to_string(index=False) if len(comm) else "(none: a single GPU)")
    return 0


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _flags(dests: Any) -> str:
    return " ".join(_flag(d) for d in dests)
