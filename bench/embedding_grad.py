"""The token embedding's gradient, dense vs sparse rows, on a real-size micro-batch (an experiment).

    python -m bench.embedding_grad [--seq-len 128] [--trainable 0.5] [--repeats 5]

SmolLM2-135M (random weights, tied embedding, the loss applying the output
projection as the recipes do) forwards and backpropagates one micro-batch of
``--seq-len`` random tokens, the first ``1 - trainable`` of them masked (a
prompt), alternately with the embedding's dense backward (torch's default,
what the recipes use) and with ``nn.Embedding(sparse=True)``, whose backward
returns only the used rows, which autograd adds to the tied output
projection's dense gradient. Prints, per way, the median forward + backward
time over ``--repeats`` after one warm-up, the time of the embedding's
backward node alone (torch.profiler, one more micro-batch), and the largest
difference of the weight's gradients. Nothing is written.

On the 2-core CPU of docs/benchmarks.md the node shrank (88-103 ms to 35-67
ms at 128 tokens) but the whole forward + backward did not, consistently (911
vs 989 ms and 950 vs 871 ms in two runs): autograd adds the sparse rows to the
dense gradient out of place, a copy of the whole gradient. So the recipes keep
the dense backward.
"""

import argparse
import statistics
import time

import torch

from torchtune_ext.loss import SummedCrossEntropyLoss
from torchtune_ext.models import smollm2_135m

IGNORE = -100


def _micro_batch(seq_len: int, trainable: float):
    tokens = torch.randint(0, 49_152, (1, seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(tokens, IGNORE)
    start = int(seq_len * (1 - trainable))
    labels[:, start:-1] = tokens[:, start + 1:]  # already shifted
    return tokens, labels


def _fwd_bwd(model, loss_fn, tokens, labels) -> float:
    start = time.perf_counter()
    sums = loss_fn(model(tokens), labels)
    (sums.loss / max(1, int((labels != IGNORE).sum()))).backward()
    return time.perf_counter() - start


def _embedding_backward_ms(model, loss_fn, tokens, labels) -> float:
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _fwd_bwd(model, loss_fn, tokens, labels)
    return sum(e.cpu_time_total for e in prof.key_averages()
               if e.key.startswith("autograd::engine::evaluate_function: EmbeddingBackward")) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embedding_grad")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--trainable", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    models = {"dense": smollm2_135m(max_seq_len=args.seq_len), "sparse rows": smollm2_135m(max_seq_len=args.seq_len)}
    models["sparse rows"].load_state_dict(models["dense"].state_dict())
    models["sparse rows"].tok_embeddings.sparse = True  # the output projection is tied to this weight
    losses = {}
    for name, model in models.items():
        losses[name] = SummedCrossEntropyLoss(ignore_index=IGNORE)
        losses[name].take_output_projection(model)
    tokens, labels = _micro_batch(args.seq_len, args.trainable)

    times = {name: [] for name in models}
    for i in range(args.repeats + 1):
        for name in (list(models) if i % 2 == 0 else list(models)[::-1]):
            models[name].zero_grad(set_to_none=True)
            seconds = _fwd_bwd(models[name], losses[name], tokens, labels)
            if i:  # the first round warms up
                times[name].append(seconds)
    grads = {name: model.tok_embeddings.weight.grad for name, model in models.items()}
    diff = ((grads["sparse rows"] - grads["dense"]).abs().max() / grads["dense"].abs().max()).item()

    print(f"SmolLM2-135M, 1 x {args.seq_len} tokens ({args.trainable:.0%} trainable), "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print("| embedding gradient | forward + backward (ms) | embedding backward node (ms) |")
    print("|---|---:|---:|")
    for name, model in models.items():
        node = _embedding_backward_ms(model, losses[name], tokens, labels)
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.0f} | {node:.1f} |")
    print(f"max relative difference of the embedding weight's gradient: {diff:.1e}")


if __name__ == "__main__":
    main()
