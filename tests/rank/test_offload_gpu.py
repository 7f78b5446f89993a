"""Offloading where it saves something: on a GPU, against the same run without it.

CPU ranks run the same code (tests/rank/test_parallel.py's offload configurations), but
there host memory is the device's, so only these tests see bytes leave the device.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="offloading moves bytes off a GPU: none here")


def test_offloaded_activations_leave_the_gpu_and_train_alike() -> None:
    from meshlab.measure.memory import activation_placement
    from meshlab.models import ModelConfig, Transformer, global_batch
    from meshlab.parallel.offload import apply_activation_offload

    inputs, targets = (t.cuda() for t in global_batch(step=0, batch=4, seq=16, vocab=256))
    torch.manual_seed(0)
    plain = Transformer(ModelConfig()).cuda()
    offloaded = apply_activation_offload(copy.deepcopy(plain))
    (device, _), (off_device, off_host) = (activation_placement(m, inputs)
                                           for m in (plain, offloaded))
    assert off_host > 0 and off_device < device
    grads = []
    for model in (plain, offloaded):
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    # pinned copies out and back: the same values; the embedding's backward adds with
    # atomics on a GPU, so the order of its sums (its last bits) may differ
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads, strict=True))


def test_offloaded_fsdp_trains_like_fsdp_with_its_shards_on_the_host(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from meshlab.measure.memory import measure
    from meshlab.models import ModelConfig, Transformer, global_batch
    from meshlab.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard_cp",))
    torch.manual_seed(0)
    base = Transformer(ModelConfig())
    runs = []
    for offload in (False, True):
        model = apply_fsdp(copy.deepcopy(base).cuda(), mesh, offload=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(5):
            inputs, targets = (t.cuda() for t in global_batch(step=step, batch=4, seq=16,
                                                               vocab=256))
            loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        report = measure(model, opt)
        # AdamW keeps its step counters on the CPU (unless capturable): host memory either way
        counters = sum(state["step"].numel() * state["step"].element_size()
                       for state in opt.state.values()
                       if torch.is_tensor(state.get("step")) and not state["step"].is_cuda)
        assert report.host == (report.total if offload else counters)
        # one rank: its shard is the whole parameter (on the host when offloaded)
        runs.append((losses, [p.to_local().detach().cpu() for p in model.parameters()]))
    (losses, params), (off_losses, off_params) = runs
    # AdamW on the CPU rather than the GPU: fp32 either way, rounding may differ in the
    # last bits (1e-5 is far below a 1e-2 step's change)
    assert losses == pytest.approx(off_losses, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(params, off_params, strict=True))
