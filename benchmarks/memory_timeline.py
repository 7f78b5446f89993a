"""What ``%%mesh --memory`` costs a step: a training step of meshlab's Transformer in one
process, plain beside the same step under meshlab.measure.memory_timeline (torch's
MemTracker keeping every change as a point and a memory_viz event). The median of the
rounds, and their ratio.

$ python benchmarks/memory_timeline.py                    # dim 128, 2 layers, 5 rounds
$ python benchmarks/memory_timeline.py --dim 512 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshlab.measure import memory_timeline
from meshlab.models import ModelConfig, Transformer


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    del logits
    loss.backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                         vocab_size=256, ffn_hidden=4 * args.dim, max_seq_len=args.seq)
    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    step(model, opt, tokens)  # the optimizer's states exist: every round alike
    plain, tracked, points = [], [], 0
    for _ in range(args.rounds):
        started = time.perf_counter()
        step(model, opt, tokens)
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        memory_timeline.start({"model": model, "opt": opt})
        step(model, opt, tokens)
        timeline = memory_timeline.stop(rank=0)
        tracked.append(time.perf_counter() - started)
        points = len(timeline.points) if timeline else 0
    a, b = statistics.median(plain), statistics.median(tracked)
    print(f"dim {args.dim}, {args.layers} layers, batch {args.batch}x{args.seq}: step "
          f"{a * 1e3:.1f} ms plain, {b * 1e3:.1f} ms under --memory ({points} points): "
          f"{b / a:.2f}x")


if __name__ == "__main__":
    main()
