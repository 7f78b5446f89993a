"""A module whose fused projection tensor parallel splits, proved on a probe batch before it
trains.

What a module does with a fused projection's output (split it by a size, view it as heads,
reshape it back) is the user's own code, which meshlab cannot read: it runs it. Before the
model is sharded, it runs a probe batch in this process and keeps each such module's inputs
and output (the first module of each kind: the blocks are alike); once sharded, every tp rank
runs that module on the same inputs, and its output must be what it was, up to the order of
the row-parallel sum. One that raises or differs is refused on every rank (the tp ranks agree
through one all-gather), naming the module, what happened and the fix.

The modules proved: those holding a ``FusedColwise`` projection, and those where the user's
plan splits an nn.Linear column-wise although its outputs are not what the row-parallel
projection beside it takes (a packed projection under a plain split: rank 0 would hold all of
q and half of k, and a forward that ``chunk``s it would train on that without a word). A
packing by head (GPT-NeoX's q, k, v per head), which a plain split keeps whole, passes.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from meshlab.parallel.blocks import owner_of
from meshlab.parallel.fused import FusedColwise, LocalSizes
from meshlab.parallel.pipeline_stage import output_of, probe
from meshlab.parallel.tensor_styles import name_matches

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch.distributed.device_mesh import DeviceMesh

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # otherwise half types: 5e-2
"""Of the output's largest magnitude: TP only reorders the row-parallel projection's sum
(1e-16 of it in float64, 1e-7 in float32); a part or a head split wrong moves it by 1e-1."""

PROBE_TOKENS = 4


@dataclass(slots=True)
class Suspect:
    """A module to prove: ``name`` holds ``linear``, split by the plan entry ``pattern``."""

    name: str
    pattern: str
    linear: str
    parts: int | None
    """FusedColwise's parts; None: a plain column split of a projection that looks packed."""
    beside: str | None = None
    """The row-parallel projection beside a plain-split one, whose inputs differ from it."""
    divided: tuple[str, ...] = ()
    """The attributes a LocalSizes entry divides on the module."""
    held: str = ""
    """The LocalSizes entry to suggest for the module, from its attributes as they are whole."""


@dataclass(slots=True)
class _Probe:
    suspect: Suspect
    args: Any
    kwargs: Any
    expected: torch.Tensor


_CAPTURED: weakref.WeakKeyDictionary[nn.Module, _Probe | None] = weakref.WeakKeyDictionary()
"""Module -> its probe until it is proved; None once proved, or where another module of its
kind (the first block's) is proved for it."""


def kind(style: Any) -> str | None:
    """'fused', 'colwise' or 'rowwise' for a plan entry's style (a column split that hands on
    its output split, or a row split taking its input split), else None."""
    if isinstance(style, FusedColwise):
        return "fused"
    from torch.distributed.tensor import Shard

    name = style if isinstance(style, str) else type(style).__name__
    if name in ("colwise", "ColwiseParallel"):
        layouts = getattr(style, "output_layouts", (Shard(-1),))
        return "colwise" if all(isinstance(p, Shard) for p in layouts) else None
    return "rowwise" if name in ("rowwise", "RowwiseParallel") else None


def suspects(model: nn.Module, plan: Mapping[str, Any], *, user: bool) -> list[Suspect]:
    """The modules to prove, the first of each kind (a pipeline stage's first block may be
    any); a plain column split is suspected only in a user's own plan (a model's shipped plan
    is its authors')."""
    modules = dict(model.named_modules())
    rows = [n for p, s in plan.items() if kind(s) == "rowwise"
            for n in modules if name_matches(p, n) and isinstance(modules[n], nn.Linear)]
    found: dict[str, Suspect] = {}
    for pattern, style in plan.items():
        what = kind(style)
        if what not in ("fused", "colwise") or (what == "colwise" and not user):
            continue
        for name in (n for n in modules if n and name_matches(pattern, n)):
            owner, linear = name.rpartition(".")[0], modules[name]
            divided = next((st.names for p, st in plan.items()
                            if isinstance(st, LocalSizes) and name_matches(p, owner)), ())
            beside = [r for r in rows if r.rpartition(".")[0] == owner]
            if what == "fused" and isinstance(linear, nn.Linear):
                width = linear.out_features // style.parts
                found.setdefault(owner, Suspect(owner, pattern, name, style.parts, None,
                                                divided, _held(modules[owner], width)))
            elif type(linear) is nn.Linear and beside and _wider(linear, [
                    modules[r] for r in beside]):
                width = modules[beside[0]].in_features
                found.setdefault(owner, Suspect(owner, pattern, name, None, beside[0],
                                                divided, _held(modules[owner], width)))
            break
    return list(found.values())


def _wider(linear: nn.Linear, beside: list[nn.Module]) -> bool:
    """Whether ``linear`` gives more outputs than a row-parallel Linear beside it takes, and
    none takes them all: it packs parts (a narrower one is a key's or value's fewer heads)."""
    widths = {cast(nn.Linear, m).in_features for m in beside}
    return linear.out_features not in widths and linear.out_features > min(widths)


def _held(module: nn.Module, width: int) -> str:
    names = sizes_to_divide(module, width)
    if not names:
        return ""
    values = ", ".join(f"{k}={getattr(module, k)}" for k in names)
    return (f"LocalSizes({', '.join(map(repr, names))}) (of its integer attributes, {values} "
            "count heads or a part's width: name those its forward splits the output by)")


def packed_parts(linear: nn.Linear, beside: nn.Linear) -> int | None:
    """How many parts of ``beside``'s input width ``linear``'s output packs, if whole."""
    ratio, rest = divmod(linear.out_features, beside.in_features)
    return ratio if ratio > 1 and not rest else None


def sizes_to_divide(module: nn.Module, width: int | None) -> list[str]:
    """The integer attributes of ``module`` that a forward likely splits a fused output by:
    those equal to one part's ``width``, and counts of heads (not one head's size)."""
    held = {k: v for k, v in vars(module).items()
            if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_")}
    return [k for k, v in held.items() if v == width or (
        re.search(r"head", k) and not re.search(r"dim|size|width", k))]


def capture(model: nn.Module, plan: Mapping[str, Any], *, user: bool,
            vouched: bool = False) -> None:
    """Before sharding: the probe of every module ``suspects`` names, from one forward of
    the whole model on a probe batch. ``vouched``: a tiny copy already trained the plan
    beside one process (parallelize's check=), so a model on meta needs no probe."""
    todo = [s for s in suspects(model, plan, user=user)
            if model.get_submodule(s.name) not in _CAPTURED]
    if not todo:
        return
    for s in todo:  # the other blocks' modules of this kind are proved by the first's
        kin = s.pattern.rpartition(".")[0]
        for n, m in model.named_modules():
            if name_matches(kin, n) and n != s.name:
                _CAPTURED.setdefault(m, None)
    from meshlab.parallel.materialize import _fake

    weights = list(model.parameters())
    dry = _fake is not None or any(_is_fake(p) for p in weights)
    if dry or any(p.is_meta for p in weights) or "causal_lm" in model.__dict__ or not any(
            isinstance(m, nn.Embedding) for m in model.modules()):
        if dry or vouched:  # a dry run's numbers are no one's (the user's forward still runs)
            for s in todo:
                _CAPTURED[model.get_submodule(s.name)] = None
            return
        s = todo[0]
        why = ("is on the meta device" if any(p.is_meta for p in weights) else
               "is a pipeline stage" if "causal_lm" in model.__dict__ else
               "has no nn.Embedding to take a probe batch of token ids")
        raise ValueError(f"{s.name} holds a fused projection ({s.pattern!r}), which meshlab "
                         "proves by running the module on a probe batch before training, "
                         f"but {type(owner_of(model)).__name__} {why}: pass parallelize(..., "
                         "check='tiny') (or check=factory, for a model written by hand), "
                         "which trains the plan on a tiny copy beside one process first, or "
                         "parallelize a model built on a device")
    kept: dict[str, tuple[Any, Any, torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(_: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            clone = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                             (args, kwargs))
            kept.setdefault(name, (*clone, output_of(out).detach().clone()))
        return hook

    hooks = [model.get_submodule(s.name).register_forward_hook(keep(s.name), with_kwargs=True)
             for s in todo]
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # no dropout: the same numbers both times
        with torch.no_grad():
            model(probe(model, PROBE_TOKENS))
    except Exception as e:  # the user's forward, whole: say why the proof cannot run
        if not vouched:
            raise ValueError(
                f"{todo[0].name} holds a fused projection ({todo[0].pattern!r}), which meshlab "
                f"proves by running the model on a probe batch of {PROBE_TOKENS} token ids "
                f"before training, but its forward raised {type(e).__name__}: {e}: pass "
                "parallelize(..., check=factory) (a function of a meshlab.verify.tiny."
                "TinySize), which trains the plan on a tiny copy beside one process "
                "instead") from e
        kept.clear()
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes.items():
            m.training = training
    for s in todo:
        module = model.get_submodule(s.name)
        _CAPTURED[module] = _Probe(s, *kept[s.name]) if s.name in kept else None


def check(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """After sharding: every captured module's output on its probe against what it was;
    ValueError on every tp rank when one raised or differs on any."""
    group, size = tp_mesh.get_group(), tp_mesh.size()
    for name, module in model.named_modules():
        found = _CAPTURED.get(module)
        if found is None:
            continue
        _CAPTURED[module] = None
        what = _run(module, found)
        # and the whole output each rank had: ranks that built different weights (no common
        # seed) shard a mix of them, and the proof would blame the split
        whole = found.expected.double()
        mine = torch.tensor([0.0 if what is None else 1.0, float(whole.sum()),
                             float(whole.abs().sum())], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=group)
        sums = [float(e[1]) for e in every]
        if max(sums) - min(sums) > TOLERANCE.get(found.expected.dtype, 5e-2) * float(mine[2]):
            raise ValueError(f"the {size} tp ranks' {name} gave different outputs on one "
                             "probe batch before sharding: they built the model with different "
                             "weights, and each keeps its part of its own: build it after "
                             "torch.manual_seed(the same seed) on every rank")
        if what is None and any(float(e[0]) for e in every):
            what = "differs on another tp rank"
        if what is not None:
            raise ValueError(_refusal(model, name, module, found.suspect, what, size))


def _run(module: nn.Module, found: _Probe) -> str | None:
    """Why ``module`` on its probe is not what it was whole, or None."""
    modes = {m: m.training for m in module.modules()}
    try:
        module.eval()
        with torch.no_grad():
            got = output_of(module(*found.args, **found.kwargs))
    except Exception as e:  # the user's forward on a shard: the refusal says what it raised
        return f"its forward raised {type(e).__name__}: {e}"
    finally:
        for m, training in modes.items():
            m.training = training
    if isinstance(got, DTensor):
        got = got.full_tensor()
    expected = found.expected
    if got.shape != expected.shape:
        return f"its output is {tuple(got.shape)}, where whole it was {tuple(expected.shape)}"
    error = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
    tolerance = TOLERANCE.get(expected.dtype, 5e-2)
    if not error <= tolerance:
        return (f"its output differs from its whole forward's by {error:.1e} of its size "
                f"(tolerance {tolerance:.0e})")
    return None


def _refusal(model: nn.Module, name: str, module: nn.Module, s: Suspect, what: str,
             tp: int) -> str:
    owner = s.pattern.rpartition(".")[0]
    linear = cast(nn.Linear, model.get_submodule(s.linear))
    shape = f"nn.Linear({linear.in_features}, {linear.out_features})"
    gather = ("or split it 'colwise_gather_output', with 'rowwise_split_input' on the "
              "projection after it (every rank then computes the whole module)")
    if s.parts is None:
        beside = cast(nn.Linear, model.get_submodule(s.beside or ""))
        parts = packed_parts(linear, beside)
        by_head = ("; parts packed by head (each head's q, k and v side by side) keep "
                   "'colwise' with that LocalSizes" if s.held else "")
        fix = (f" (meshlab.parallel.fused): give {s.pattern!r}: FusedColwise(parts={parts})"
               f"{_sizes(owner, s.held)}{by_head}; {gather}" if parts else
               f": its parts are not of one width (FusedColwise splits equal ones): {gather}")
        return (f"TP plan entry {s.pattern!r}: 'colwise' cuts {s.linear} ({shape}) into "
                f"{tp} contiguous blocks of outputs, but its {linear.out_features} outputs "
                f"are not the {beside.in_features} that {s.beside} (row-parallel) takes: it "
                "packs parts (q, k, v; gate, up), and packed one after another, each rank "
                "would hold whole parts instead of its slice of each. On a probe batch, "
                f"{name} under that split: {what}. Fix{fix}")
    hint = (f"LocalSizes divides {', '.join(s.divided)}; a size it reads elsewhere stays whole: "
            "one read off its input (nanoGPT's `B, T, C = x.size()`, then `C // self.n_head` "
            "and `.view(B, T, C)`) must come from the divided attributes instead "
            "(`self.n_embd // self.n_head`, `.view(B, T, self.n_embd)`) or be -1, and "
            "LocalSizes must name every attribute that counts heads or a part's width (not "
            "one head's size)" if s.divided else
            f"give {owner!r}: {s.held or 'LocalSizes(...)'} from meshlab.parallel.fused")
    return (f"TP with {s.pattern!r}: FusedColwise(parts={s.parts}) does not give "
            f"{name} ({type(module).__name__}) what its forward gave whole on a probe batch: "
            f"{what}. Each of the {tp} tp ranks holds 1/{tp} of every part (its share of the "
            f"heads), so every size its forward splits or reshapes by must be that share: "
            f"{hint}; {gather}")


def _sizes(owner: str, held: str) -> str:
    if held:
        return f" and {owner!r}: {held}"
    return (f", with LocalSizes(...) on {owner!r} if its forward splits the output by a size "
            "it holds")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))
