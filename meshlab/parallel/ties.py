"""Tied weights (an embedding and a head that are one parameter) through sharding.

Sharding replaces each module's parameter with its own DTensor, so a tied pair would become
two weights training apart. ``untie`` gives each name its own parameter over the same data
before a plan shards them, ``retie`` makes them one again after, or refuses when the plan
split the two differently.
"""

from __future__ import annotations

from torch import nn


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each weight the model holds under several (a tied embedding and head)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def untie(model: nn.Module) -> list[list[str]]:
    """``tied_groups``, each name given its own parameter over the same data, so that each
    module's style shards its own (``retie`` makes them one again)."""
    tied = tied_groups(model)
    for group in tied:
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            shared = module._parameters[leaf]
            assert shared is not None
            module._parameters[leaf] = nn.Parameter(shared.data, shared.requires_grad)
    return tied


def retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Make each tied group one parameter again after sharding made it several (a plan
    shards each module's weight on its own); ValueError when the plan shards them apart."""
    from torch.distributed.tensor import DTensor

    for group in tied:
        params = [model.get_parameter(name) for name in group]
        if all(p is params[0] for p in params):
            continue
        layouts = {name: tuple(p.placements) if isinstance(p, DTensor) else "whole on every rank"
                   for name, p in zip(group, params, strict=True)}
        if len(set(layouts.values())) > 1:
            said = ", ".join(f"{name}: {layout}" for name, layout in layouts.items())
            raise ValueError(f"{' and '.join(group)} are one tied weight, but the TP plan "
                             f"splits them differently ({said}): shard both on the vocabulary "
                             "(transformers' 'embedding_rowwise' on the embedding, "
                             "'colwise_gather_output' on the head), or untie them "
                             "(config.tie_word_embeddings=False)")
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = params[0]
