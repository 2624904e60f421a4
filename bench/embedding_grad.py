"""The tied token embedding's gradient, three ways, on real-size micro-batches.

    python -m bench.embedding_grad [--seq-len 128] [--micro-batches 4] [--trainable 0.5] [--repeats 5]

SmolLM2-135M (random weights, embedding tied to the output projection, the
loss applying the projection as the recipes do) forwards and backpropagates
``--micro-batches`` micro-batches of ``--seq-len`` random tokens each (the
first ``1 - trainable`` of every row masked, as a prompt), gradients
accumulating as in one optimizer step, then zeroes them. Three copies of the
model, same weights, take turns (the order alternates every repeat):

* ``autograd (dense)``: torch's default; ``nn.Embedding``'s backward builds a
  zero-filled ``[vocab, hidden]`` gradient holding the micro-batch's rows;
* ``sparse rows``: ``nn.Embedding(sparse=True)``; autograd adds the sparse
  rows to the projection's dense gradient (an experiment, not used);
* ``rows into .grad``: :func:`torchtune_ext.model.runtime.embedding_rows_into_grad`,
  what the single-device full recipe does on CPU.

Prints, per way, the median time of such a step over ``--repeats`` after one
warm-up, what torch.profiler charges to the ``[vocab, hidden]``-sized
operations of one more step (zero fills, adds, copies), and the largest
difference of the embedding weight's gradient to the dense way's. Nothing is
written.
"""

import argparse
import statistics
import time
from typing import Dict

import torch

from torchtune_ext.model.build import smollm2_135m
from torchtune_ext.model.runtime import embedding_rows_into_grad
from torchtune_ext.train.loss import SummedCrossEntropyLoss

IGNORE = -100
WAYS = ("autograd (dense)", "sparse rows", "rows into .grad")


def _micro_batches(n: int, seq_len: int, trainable: float):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 49_152, (1, seq_len), generator=g)
        labels = torch.full_like(tokens, IGNORE)
        start = int(seq_len * (1 - trainable))
        labels[:, start:-1] = tokens[:, start + 1:]  # already shifted
        out.append((tokens, labels))
    return out


def _step(model, loss_fn, micro_batches) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for tokens, labels in micro_batches:
        sums = loss_fn(model(tokens), labels)
        (sums.loss / 100).backward()
    return time.perf_counter() - start


def _vocab_sized_ms(model, loss_fn, micro_batches, vocab: int) -> Dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _step(model, loss_fn, micro_batches)
    totals: Dict[str, float] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = e.input_shapes or []
        if e.key in ("aten::fill_", "aten::add", "aten::add_", "aten::copy_", "aten::index_add_") \
                and shapes and list(shapes[0])[:1] == [vocab]:
            totals[e.key] = totals.get(e.key, 0.0) + e.self_cpu_time_total / 1e3
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embedding_grad")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--trainable", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    models = {way: smollm2_135m(max_seq_len=args.seq_len) for way in WAYS}
    state = models[WAYS[0]].state_dict()
    for model in models.values():
        model.load_state_dict(state)
    models["sparse rows"].tok_embeddings.sparse = True
    if not embedding_rows_into_grad(models["rows into .grad"], torch.device("cpu")):
        raise SystemExit("embedding_rows_into_grad did not apply to SmolLM2-135M")
    losses = {}
    for way, model in models.items():
        losses[way] = SummedCrossEntropyLoss(ignore_index=IGNORE)
        losses[way].take_output_projection(model)
    micro_batches = _micro_batches(args.micro_batches, args.seq_len, args.trainable)

    times = {way: [] for way in WAYS}
    for i in range(args.repeats + 1):
        for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
            seconds = _step(models[way], losses[way], micro_batches)
            if i:  # the first round warms up
                times[way].append(seconds)
    reference = models[WAYS[0]].tok_embeddings.weight.grad

    vocab = reference.size(0)
    print(f"SmolLM2-135M, {args.micro_batches} micro-batches of 1 x {args.seq_len} tokens "
          f"({args.trainable:.0%} trainable), {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| embedding gradient | step (s) | vs autograd | vocab-sized fill / add / add_ / copy_ / index_add_ (ms) "
          "| max rel. diff of the gradient |")
    print("|---|---:|---:|---|---:|")
    base = statistics.median(times[WAYS[0]])
    for way in WAYS:
        grad = models[way].tok_embeddings.weight.grad
        diff = ((grad - reference).abs().max() / reference.abs().max()).item()
        ops = _vocab_sized_ms(models[way], losses[way], micro_batches, vocab)
        cost = " / ".join(f"{ops.get(k, 0.0):.0f}" for k in
                          ("aten::fill_", "aten::add", "aten::add_", "aten::copy_", "aten::index_add_"))
        median = statistics.median(times[way])
        print(f"| {way} | {median:.3f} | {median / base:.3f} | {cost} | {diff:.1e} |")


if __name__ == "__main__":
    main()
