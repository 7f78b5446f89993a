"""Context parallelism in closed form: each implementation's collectives per rank and layer
(their bytes and alpha-beta seconds), its attention memory, and where an implementation
cannot split a model's heads. What the planner costs CP with and what the tests and the
tour check against traced collectives.

Plain Python, like ``meshlab.plan.formulas``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlab.plan.formulas import bus_factor, collective_seconds

CP_IMPLEMENTATIONS = ("meshlab", "torch", "ulysses", "chunked", "all_gather")
"""How attention crosses the cp ranks' sequence slices: meshlab.parallel's four
(``ParallelPlan.context_parallel``) and "all_gather", Llama 3's (Dubey et al. 2024, section
3.3.2: K/V all-gathered; their gradients reduce-scattered, the all-gather's transpose), which
the published 128K run is planned with."""
HEAD_SPLIT_CP = ("ulysses", "chunked")
"""The implementations that re-partition sequence into heads (all-to-all)."""
CONTIGUOUS_CP = ("meshlab", "torch")
"""The implementations whose ranks hold contiguous sequence slices unless ``cp_balanced``
(Llama 3's all_gather is balanced by its design; the head splits hold every position)."""


@dataclass(frozen=True, slots=True)
class CpCollective:
    """One collective of a context-parallel attention layer: per rank, per micro-batch."""

    name: str
    collective: str
    calls: int
    message: float
    """Bytes this rank hands to one call (its own slice; the whole buffer to a reduction)."""
    buffer: float
    """Bytes of one call in ``collective_seconds``' convention (all-gather, reduce-scatter:
    the gathered buffer; all-to-all: what one rank holds; send/recv: the message)."""
    wire: float
    """Bytes this rank sends in one call: ``bus_factor`` x buffer."""
    backward: bool
    overlappable: bool
    """Runs behind attention's own compute (ring hops, chunks after the first)."""


def cp_refusal(impl: str, *, heads: int, kv_heads: int, tp: int, cp: int) -> str | None:
    """Why ``impl`` cannot split this attention over ``cp`` ranks (None: it can): Ulysses
    and chunked give each rank heads/tp/cp query heads and kv_heads/tp/cp key/value heads."""
    if impl not in CP_IMPLEMENTATIONS:
        raise ValueError(f"context_parallel must be one of {', '.join(CP_IMPLEMENTATIONS)}, "
                         f"got {impl!r}")
    if impl not in HEAD_SPLIT_CP or cp == 1:
        return None
    for name, value in (("heads", heads), ("kv_heads", kv_heads)):
        if (value // tp) % cp:
            return (f"{impl}: {name}/tp = {value}/{tp} = {value // tp} is not divisible by "
                    f"cp={cp}; use a cp that divides it, less tp, or context_parallel=meshlab")
    return None


def context_parallel_collectives(impl: str, *, batch: int, seq_len: int, heads: int,
                                 kv_heads: int, head_dim: int, cp: int, dtype_bytes: int,
                                 chunks: int = 1) -> list[CpCollective]:
    """The collectives of one attention layer's forward and backward on one rank, for one
    micro-batch of ``batch`` sequences of ``seq_len`` tokens; ``heads`` and ``kv_heads`` are
    this tp rank's (heads / tp). With n = cp, L = seq_len / n, q = batch·L·heads·head_dim·e
    and kv = batch·L·kv_heads·head_dim·e (one of K or V, this rank's slice):

    - meshlab (meshlab.parallel.context): forward all-gathers K and V (hands 2kv, receives
      2n·kv); backward all-reduces their whole gradients (2n·kv, 2(n-1)/n of it on the wire).
    - all_gather (Llama 3): the same forward; backward reduce-scatters them ((n-1)/n·2n·kv).
    - torch (ring attention, Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
      n-1 hops of K and V (2kv each) forward, each behind one block of attention; backward
      n-1 hops of K and V and n of their gradients, kept in fp32 as torch 2.13 does
      (convert_to_f32). torch 2.13's default rotater all-gathers K/V instead: the same bytes.
    - ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509): forward four
      all-to-alls, q, k, v from sequence- to head-split and the output back (2q + 2kv
      handed in, (n-1)/n of it on the wire); backward the reverse, the same bytes. For
      heads = kv_heads = a·d/h that is 4·batch·L·h·e a layer each way: the paper's per-link
      volume 4Nh/P (N = seq_len, P = n), constant when N and P grow together (the paper's
      section 3 was not retrieved here: the count is re-derived, its 4Nh/P as quoted in
      issue 39).
    - chunked (Yao et al. 2024, FPDT, arXiv 2408.16978, as meshlab.parallel.context_chunked
      runs it): Ulysses' all-to-alls, whole; only attention then runs chunk by chunk (FPDT
      also pipelines the all-to-alls chunk by chunk: the same bytes in ``chunks`` times as
      many calls, which meshlab does not do).
    """
    refused = cp_refusal(impl, heads=heads, kv_heads=kv_heads, tp=1, cp=cp)
    if refused:
        raise ValueError(refused)
    for name, value in (("batch", batch), ("seq_len", seq_len), ("heads", heads),
                        ("kv_heads", kv_heads), ("head_dim", head_dim), ("cp", cp),
                        ("dtype_bytes", dtype_bytes), ("chunks", chunks)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    n = cp
    if n == 1:
        return []
    tokens = batch * seq_len / n
    q, kv = tokens * heads * head_dim * dtype_bytes, tokens * kv_heads * head_dim * dtype_bytes

    def one(name: str, kind: str, calls: int, message: float, buffer: float,
            backward: bool, overlappable: bool = False) -> CpCollective:
        return CpCollective(name, kind, calls, message, buffer, bus_factor(kind, n) * buffer,
                            backward, overlappable)

    if impl in ("meshlab", "all_gather"):
        reduce = "all_reduce" if impl == "meshlab" else "reduce_scatter"
        return [one("all-gather of keys and values", "all_gather", 1, 2 * kv, 2 * n * kv, False),
                one(f"{reduce.replace('_', '-')} of key and value gradients", reduce, 1,
                    2 * n * kv, 2 * n * kv, True)]
    if impl == "torch":
        return [one("ring hops of keys and values", "send_recv", n - 1, 2 * kv, 2 * kv, False,
                    True),
                one("ring hops of keys and values (backward)", "send_recv", n - 1, 2 * kv,
                    2 * kv, True, True),
                one("ring hops of key and value gradients (fp32)", "send_recv", n,
                    2 * kv * 4 / dtype_bytes, 2 * kv * 4 / dtype_bytes, True, True)]
    out = []
    for backward, what in ((False, "q, k, v to heads and the output back"),
                           (True, "output gradient to heads, q, k, v gradients back")):
        for name, size in ((f"all-to-all of {what}: queries and output", q),
                           (f"all-to-all of {what}: keys and values", kv)):
            out.append(one(name, "all_to_all", 2, size, size, backward))
    return out


def context_parallel_bytes(impl: str, *, batch: int, seq_len: int, heads: int, kv_heads: int,
                           head_dim: int, cp: int, dtype_bytes: int, chunks: int = 1
                           ) -> dict[str, float]:
    """Bytes per rank of one attention layer's forward and backward (one micro-batch):
    ``"<collective name> message"`` and ``"... wire"`` for each collective of
    ``context_parallel_collectives`` (all its calls), and their sums ``"message"`` and
    ``"wire"``."""
    out: dict[str, float] = {"message": 0.0, "wire": 0.0}
    for c in context_parallel_collectives(impl, batch=batch, seq_len=seq_len, heads=heads,
                                          kv_heads=kv_heads, head_dim=head_dim, cp=cp,
                                          dtype_bytes=dtype_bytes, chunks=chunks):
        out[f"{c.name} message"] = out.get(f"{c.name} message", 0.0) + c.calls * c.message
        out[f"{c.name} wire"] = out.get(f"{c.name} wire", 0.0) + c.calls * c.wire
        out["message"] += c.calls * c.message
        out["wire"] += c.calls * c.wire
    return out


def context_parallel_seconds(impl: str, *, attention_s: float, latency_s: float,
                             bandwidth_bytes_s: float, **shape: int) -> tuple[float, float]:
    """(total, exposed) alpha-beta seconds of one layer's CP collectives, forward and
    backward: all-gathers, all-reduces and Ulysses' all-to-alls wait for attention (exposed
    whole); ring hops run behind ``attention_s`` (the layer's attention compute, forward and
    backward; Liu et al. 2023: each hop behind one block)."""
    exposed = hidden = 0.0
    for c in context_parallel_collectives(impl, **shape):
        s = c.calls * collective_seconds(c.collective, shape["cp"], c.buffer,
                                         latency_s=latency_s,
                                         bandwidth_bytes_s=bandwidth_bytes_s)
        if c.overlappable:
            hidden += s
        else:
            exposed += s
    return exposed + hidden, exposed + max(0.0, hidden - attention_s)


def context_parallel_memory(impl: str, *, batch: int, seq_len: int, heads: int,
                            kv_heads: int, head_dim: int, cp: int, dtype_bytes: int,
                            chunks: int = 1, offload: bool = False) -> dict[str, float]:
    """Attention's memory per rank and layer under ``impl`` (one micro-batch), in bytes:

    - ``kv_kept``: keys and values the layer keeps for its backward on the device. meshlab's
      all-gather keeps the whole sequence's (2·batch·seq_len·kv_heads·head_dim·e: autograd
      saves the gathered tensors). Llama 3's (all_gather) is taken to keep its slice only,
      as the planner has always planned that run: the gathered copy, 7.5 GiB on its 128K
      layout, would not fit beside its activations without recompute, so the run must free
      it (not stated in the paper; a re-gather in the backward is not counted). Ulysses
      and chunked kv_heads/cp heads of the whole sequence (the size of the local slice);
      the ring its own slice only (the backward passes K/V round again); chunked with
      ``offload`` none: they wait in host memory (``host``).
    - ``transient``: extra while the layer's attention runs: the ring's two remote K/V
      chunks (the one in use, the one arriving; Liu et al. 2023); offloaded chunks, the
      keys and values the last query chunk reads (all of them).
    - ``to_device`` / ``to_host``: offload's copies a layer makes, forward and backward:
      query chunk i reads key/value chunks 0..i (u(u+1)/2 chunk copies), again when its
      checkpointed forward is recomputed in the backward; each chunk goes to the host once.
    - ``scores``: unfused attention's scores, one value per query-key pair: L x seq_len per
      query head (Ulysses: seq_len x seq_len for heads/cp heads, the same count); chunked
      one chunk's, batch·(heads/cp)·(seq_len/chunks)·seq_len (FPDT's "~chunk x T").
    """
    refused = cp_refusal(impl, heads=heads, kv_heads=kv_heads, tp=1, cp=cp)
    if refused:
        raise ValueError(refused)
    n, e, s = cp, dtype_bytes, seq_len
    local = 2.0 * batch * s / n * kv_heads * head_dim * e  # K and V of this rank's slice
    gathered = impl == "meshlab" and n > 1
    kept = 2.0 * batch * s * kv_heads * head_dim * e if gathered else local
    out = {"kv_kept": kept, "transient": 2 * local if impl == "torch" and n > 1 else 0.0,
           "host": 0.0, "to_device": 0.0, "to_host": 0.0}
    if impl == "chunked" and offload and n > 1:
        out.update(kv_kept=0.0, transient=local, host=local, to_host=local,
                   to_device=2 * local / chunks * chunks * (chunks + 1) / 2)
    scores = batch * heads * (s / n) * s * e
    if impl == "chunked" and n > 1:
        scores = batch * heads / n * (s / chunks) * s * e
    return {**out, "scores": scores}
