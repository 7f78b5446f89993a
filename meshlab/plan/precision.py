"""What each planned precision stores and computes in: bytes per value of each kind of
training state, and the dtype of the matmuls (``Layout.precision`` names one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per value of each kind of training state, and the matmul dtype."""

    compute: str
    params: int
    grads: int
    optimizer: int
    """Adam states per parameter (and fp32 master weights where params are 16-bit)."""
    activations: int

    @property
    def unconverted_compute(self) -> str:
        """The dtype of the matmuls fp8 training leaves alone: attention's two products and
        the output projection. torchao's convert_to_float8_training swaps nn.Linear modules
        only, and torchtitan skips the output (module_filter_fn: fqn != "output"); SDPA
        runs in bf16. Transformer Engine's FP8 likewise leaves dot-product attention in
        bf16 unless asked."""
        return "bf16" if self.compute == "fp8" else self.compute

    @property
    def master_weights(self) -> bool:
        """The optimizer states hold an fp32 copy of the parameters (Adam's two moments
        are 8 bytes; more is that copy)."""
        return self.optimizer > 8


# fp32: Adam's two fp32 moments; bf16 and fp8: ZeRO's mixed-precision 2 + 2 + 12 bytes
# (FSDP2's MixedPrecisionPolicy keeps fp32 sharded parameters and gathers bf16 copies:
# the same 16 bytes per parameter). fp8 (as in torchao float8) changes the matmuls only.
PRECISIONS = {
    "fp32": Precision(compute="fp32", params=4, grads=4, optimizer=8, activations=4),
    "bf16": Precision(compute="bf16", params=2, grads=2, optimizer=12, activations=2),
    "fp8": Precision(compute="fp8", params=2, grads=2, optimizer=12, activations=2),
    # fp16 is counted as bf16: 2-byte parameters and gradients, fp32 master weights, and
    # matmuls at bf16's peak (the same tensor cores on A100/H100/B200); the dynamic loss
    # scaler is one fp32 scalar and a growth counter, left out
    "fp16": Precision(compute="bf16", params=2, grads=2, optimizer=12, activations=2),
}
