"""Pretrained weights (a transformers ``save_pretrained`` folder) straight into a parallelized
model's shards, and the shards back out as one such folder.

``load_pretrained(model, folder)`` runs on every rank without any communication: each rank
reads, of each tensor, only the rows and columns its shards hold, from
``safe_open(file).get_slice(key)[...]``. Where a tensor lives on this rank:

- a DTensor (FSDP2, TP, both): for each tensor dim, the global indices this rank holds are the
  local part of ``torch.arange(size)`` under the parameter's placements, cut by
  ``distribute_tensor(..., src_data_rank=None)`` (a local split, no communication). That
  follows ``_StridedShard`` exactly; ``compute_local_shape_and_global_offset`` does not: it
  gives one offset per dim, and a strided shard's rows are not contiguous (GPT-2's packed
  c_attn under TP holds 3 runs of columns). The contiguous runs of those indices are read.
- an expert-parallel slice (``meshlab.parallel.expert`` marks it with the ep group, clip.PARTS):
  rows ``[r * local, (r + 1) * local)`` of dim 0, r this rank's place in that group.
- a plain tensor (DDP, no parallelism, a buffer): the whole tensor.
- a pipeline stage: only the stage's tensors; keys of parts another stage holds are skipped.

Names go through transformers' own checkpoint conversions (renamings, and the per-expert MoE
keys merged into stacked experts: those are read in slices too, each expert from its key);
any other conversion reads that one target's sources whole and runs transformers' converter.

Why not DCP's ``HuggingFaceStorageReader`` (torch 2.13): it does read slices with
``get_slice``, but plans a DTensor's read as the one box ``compute_local_shape_and_global_offset``
gives, so a ``_StridedShard`` that is not contiguous silently loads other rows (measured:
GPT-2's c_attn under dp=2 tp=2 came back wrong); it also needs the file's keys to be the
model's (no MoE expert merging, no renaming), every tied name in the file, and cannot express
an expert-parallel slice. So: safetensors slices, with the indices computed as above.

``save_pretrained(model, folder)`` is a collective: every rank calls it, rank 0 writes. Tensors
are gathered one at a time (``DTensor.full_tensor()``, an all-gather of expert slices over their
ep group, a pipeline stage's tensors sent to rank 0), and rank 0 streams each into its
safetensors shard as it arrives (the shards' headers are known before any tensor is), so no
rank ever holds more than one full tensor beyond its own shards.
"""

from meshlab.pretrained.load import load_pretrained
from meshlab.pretrained.save import save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
