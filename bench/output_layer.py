"""The output layer and loss alone: time and memory kept for backward, per way of computing them.

    python -m bench.output_layer [--batch 2] [--seq-len 256] [--trainable 0.5] [--repeats 3] [--dtype fp32]

SmolLM2-135M's output layer (hidden 576, vocabulary 49,152, tied to the
embedding; random weights: the cost does not depend on the values) on one
micro-batch of random final hidden states, of which the first
``1 - trainable`` of every row is masked (a prompt). For each way, the
forward and backward of the output projection plus the summed cross-entropy
are timed (best of ``--repeats`` after one warm-up), and the bytes autograd
keeps for backward between them are counted (``saved_tensors_hooks``,
distinct storages, weights excluded; what a micro-batch holds until the
step's one backward with ``backward=once_per_step``):

* ``upstream``: torchtune's ``CEWithChunkedOutputLoss`` way: logits for every
  position in 8 sequence chunks, upcast, cross-entropy;
* ``logits, 8 chunks`` / ``logits, 1 chunk``: the model returns logits in
  sequence chunks, our loss keeps only trainable rows;
* ``loss projects, auto``: our loss applies the projection to trainable rows
  only, in chunks of :func:`torchtune_ext.train.loss.rows_per_output_chunk`;
* ``... recomputed``: the same under ``torch.utils.checkpoint`` (what a
  micro-batch uses when its graph waits for the step's one backward).

Prints a markdown table; nothing is written.
"""

import argparse
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from torchtune_ext.train.loss import SummedCrossEntropyLoss

VOCAB, HIDDEN = 49_152, 576


class _Head(torch.nn.Module):
    """What ``take_output_projection`` needs of a decoder: norm, output, unembed."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight
        self.norm = torch.nn.Identity()
        self.output = lambda h: F.linear(h, self.weight)

    def unembed(self, h):
        return self.output(h)


def _saved_bytes(fn: Callable[[], torch.Tensor], skip: set) -> (torch.Tensor, int):
    seen: Dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.output_layer")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--trainable", type=float, default=0.5, help="share of each row with a trainable label")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16

    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).to(dtype))
    hidden = torch.randn(args.batch, args.seq_len, HIDDEN, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=generator)
    labels[:, : int(args.seq_len * (1 - args.trainable))] = -100
    skip = {weight.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr()}

    def upstream():
        chunks = [F.linear(h, weight) for h in hidden.chunk(8, dim=1)]
        return sum(F.cross_entropy(c.float().reshape(-1, VOCAB), l.reshape(-1), ignore_index=-100, reduction="sum")
                   for c, l in zip(chunks, labels.chunk(8, dim=1)))

    def logits(n):
        loss_fn = SummedCrossEntropyLoss(n, -100, token_metrics=False)
        return lambda: loss_fn([F.linear(h, weight) for h in hidden.chunk(n, dim=1)], labels).loss

    def projected(recompute):
        loss_fn = SummedCrossEntropyLoss("auto", -100, token_metrics=False)
        loss_fn.take_output_projection(_Head(weight))
        return lambda: loss_fn(hidden, labels, recompute_output=recompute).loss

    ways = {"upstream (8 sequence chunks, every position)": upstream, "logits, 8 chunks": logits(8),
            "logits, 1 chunk": logits(1), "loss projects, auto": projected(False),
            "loss projects, auto, recomputed": projected(True)}
    rows = []
    for name, fn in ways.items():
        best, kept = float("inf"), 0
        for i in range(args.repeats + 1):
            weight.grad = hidden.grad = None
            start = time.perf_counter()
            loss, kept = _saved_bytes(fn, skip)
            loss.backward()
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - start)
        rows.append((name, best, kept))
    trainable = int((labels != -100).sum())
    print(f"batch {args.batch} x {args.seq_len}, {trainable} trainable positions, {args.dtype}, "
          f"{torch.get_num_threads()} threads; best of {args.repeats}")
    print("| way | forward + backward (s) | kept for backward (MiB) |")
    print("|---|---:|---:|")
    for name, seconds, kept in rows:
        print(f"| {name} | {seconds:.3f} | {kept / 2**20:.1f} |")


if __name__ == "__main__":
    main()
