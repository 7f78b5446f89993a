"""A TP plan read off a model's own Linear layers, for the refusal of a model that ships none.

In the first of the model's repeated blocks, each module's Linears are paired as Megatron
pairs them: the one that writes back to the block's width (the residual stream) is
row-parallel when it reads another width, is the last Linear of its module, or is named
like an output projection; the others are column-parallel, and one whose outputs pack
several of what the row-parallel one beside it takes (nanoGPT's ``c_attn``, a fused
``gate_up``) is a ``FusedColwise``, with ``LocalSizes`` on its module. A suggestion to check,
not a proof: the plan the user passes is proved as any other (meshlab.parallel.fused_proof).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from meshlab.parallel.blocks import find_blocks, items
from meshlab.parallel.fused_proof import packed_parts, sizes_to_divide

OUTPUT_NAMES = {"o", "o_proj", "out", "out_proj", "c_proj", "wo", "w2", "down", "down_proj",
                "proj", "dense", "fc2", "dense_4h_to_h"}
"""Names of the projection back to the residual stream in common models."""


def suggested_plan(model: nn.Module) -> tuple[str, dict[str, str]] | None:
    """(the first block's name, {pattern: the style as source text}) from the model's own
    Linears; None where it has no repeated blocks holding Linears."""
    try:
        path, blocks = find_blocks(model)
    except ValueError:
        return None
    listed = items(blocks)
    if not listed:
        return None
    index, first = listed[0]
    linears = {n: m for n, m in first.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        return None
    width = Counter(m.in_features for m in linears.values()).most_common(1)[0][0]
    by_owner: dict[str, list[str]] = {}
    for name in linears:
        by_owner.setdefault(name.rpartition(".")[0], []).append(name)
    plan: dict[str, str] = {}
    for owner, names in by_owner.items():
        mine: dict[str, str] = {}
        rows = [n for n in names if _row_parallel(n, linears[n], width, n == names[-1],
                                                  len(names))]
        sizes: list[str] = []
        for name in names:
            linear = linears[name]
            # q, k, v or gate, up: more parts is a projection wider than the one beside it
            parts = next((p for r in rows if (p := packed_parts(linear, linears[r]))
                          and p <= 3), None)
            if name in rows:
                mine[f"{path}.*.{name}"] = "'rowwise'"
            elif parts:
                mine[f"{path}.*.{name}"] = f"FusedColwise(parts={parts})"
                sizes += sizes_to_divide(first.get_submodule(owner),
                                         linear.out_features // parts)
            else:
                mine[f"{path}.*.{name}"] = "'colwise'"
        if sizes:
            key = f"{path}.*.{owner}" if owner else f"{path}.*"
            plan[key] = f"LocalSizes({', '.join(map(repr, dict.fromkeys(sizes)))})"
        plan |= mine
    return f"{path}.{index}", plan


def _row_parallel(name: str, linear: nn.Linear, width: int, last: bool, siblings: int
                  ) -> bool:
    if linear.out_features != width:
        return False
    named = name.rpartition(".")[2] in OUTPUT_NAMES
    return linear.in_features != width or named or (last and siblings > 1)


def render(plan: dict[str, str]) -> str:
    """The plan as the source text a user pastes: {pattern: style, ...}."""
    return "{" + ", ".join(f"{p!r}: {s}" for p, s in plan.items()) + "}"
