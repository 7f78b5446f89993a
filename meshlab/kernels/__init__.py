"""Triton kernels for the model's hot spots (RMSNorm, softmax, SwiGLU, cross-entropy), each
with its plain-torch reference, and apply_kernels to switch a meshlab Transformer onto them.

On a machine without CUDA they run in Triton's interpreter: correct, and about a millisecond
per program instance, so keep CPU problems to a few rows.
"""

import os
import sys
from typing import TypeVar

import torch
from torch import nn

# Triton picks interpreter or GPU when @triton.jit decorates, and decorates its own library
# (tl.sigmoid, tl.maximum...) when triton is imported: choose before triton is imported.
if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError(
            "triton was imported before meshlab.kernels without TRITON_INTERPRET=1 (torch.compile "
            "and torch._dynamo import it), so its library is compiled for a GPU this machine does "
            "not have: import meshlab.kernels first, or set os.environ['TRITON_INTERPRET'] = '1' "
            "before anything imports triton (meshlab's CPU ranks do this when they start)")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshlab.kernels import cross_entropy as _cross_entropy
from meshlab.kernels import rmsnorm as _rmsnorm
from meshlab.kernels import softmax as _softmax
from meshlab.kernels import swiglu as _swiglu
from meshlab.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from meshlab.kernels.rmsnorm import RMSNorm, rmsnorm, rmsnorm_reference
from meshlab.kernels.softmax import softmax, softmax_reference
from meshlab.kernels.spec import KernelSpec
from meshlab.kernels.swiglu import FeedForward, swiglu, swiglu_reference
from meshlab.models import llama

KERNELS: dict[str, KernelSpec] = {
    spec.name: spec for spec in (_rmsnorm.SPEC, _softmax.SPEC, _swiglu.SPEC, _cross_entropy.SPEC)}
"""Every kernel by name, with its reference and problem builder (for tests and benchmarks)."""

M = TypeVar("M", bound=nn.Module)


def apply_kernels(model: M) -> M:
    """Switch model's RMSNorms and SwiGLU feed-forwards to the Triton kernels, in place.

    Only the modules' classes change, not their parameters, so state dicts stay compatible.
    Apply it before tensor parallelism: the kernels take plain tensors, not DTensors.
    """
    for module in model.modules():
        # Exact types: subclasses may compute something else
        if type(module) is llama.RMSNorm:
            module.__class__ = RMSNorm
        elif type(module) is llama.FeedForward:
            module.__class__ = FeedForward
    return model


__all__ = ["KERNELS", "FeedForward", "KernelSpec", "RMSNorm", "apply_kernels", "cross_entropy",
           "cross_entropy_reference", "rmsnorm", "rmsnorm_reference", "softmax",
           "softmax_reference", "swiglu", "swiglu_reference"]
