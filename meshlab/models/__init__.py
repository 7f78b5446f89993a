"""Small Llama-style transformers (dense and MoE) for demos and tests, plus synthetic data."""

from meshlab.models.data import global_batch, local_batch
from meshlab.models.llama import ModelConfig, Transformer

__all__ = ["ModelConfig", "Transformer", "global_batch", "local_batch"]
