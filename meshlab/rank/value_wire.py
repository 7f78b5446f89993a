"""A value as one pickle and the buffers it points into, so it travels without copies.

Pickle protocol 5 leaves numpy arrays' memory out of band (``PickleBuffer``); a CPU tensor is
sent as the bytes of its storage the same way (torch pickles a tensor through a copy of it
in ``torch.save``'s format). The receiving end allocates each buffer once, writes the parts
into it as they arrive and unpickles over them: the value's arrays and tensors live in those
buffers, so taking a value costs about its own size. Plain Python; torch if it is loaded.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any


def dumps(value: Any) -> list[memoryview]:
    """``[the pickle, *its out-of-band buffers]``, each a flat memoryview of bytes (the
    buffers are views into the value's own arrays and tensors)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(value)
    return [out.getbuffer(), *(b.raw() for b in buffers)]


def loads(parts: Sequence[Any]) -> Any:
    """The value ``dumps`` made, from its parts (bytes-like; the buffers become its memory)."""
    return pickle.loads(parts[0], buffers=parts[1:])


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if (torch is None or type(obj) is not torch.Tensor or obj.device.type != "cpu"
                or obj.layout != torch.strided or obj.is_quantized or obj.numel() == 0):
            return NotImplemented  # parameters, DTensors, GPU tensors: as pickle does
        flat = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return _tensor, (flat, str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                         obj.requires_grad)


def _tensor(flat: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    tensor = torch.from_numpy(flat).view(getattr(torch, dtype)).reshape(shape)
    return tensor.requires_grad_(requires_grad)
