"""On-policy distillation's samples: which samples of a step the student completes itself, and the completions.

Generalized knowledge distillation (Agarwal et al. 2024, "On-policy
distillation of language models: learning from self-generated mistakes",
arXiv 2306.13649) trains a share ``lambda`` of the samples on completions the
student samples from its own policy for the sample's prompt, scored by the
teacher; the rest on the dataset's completions (offline). Here:

* **Which samples.** Each sample of a step draws ``u ~ U(0, 1)`` from a
  generator seeded by ``(seed, step, the sample's content)``; it is
  completed by the student when ``u < on_policy_ratio``. The content (its
  prompt and its trainable labels, padding excluded) names the sample, so the
  choice does not depend on how the step was split into micro-batches or
  ranks, nor on its position in the micro-batch, and a resumed run makes it
  again. Two identical samples in one step are chosen (and completed) alike.
* **The completion.** Sampled one token at a time from ``softmax(logits /
  temperature)`` (the ``top_k`` most likely tokens only, if set) with a
  second generator seeded by the same triple, up to ``max_new_tokens``
  tokens, the first stop token included and ending it. Each sample is
  generated alone (batch 1), so its tokens do not depend on what it was
  batched with; the draws are made on the CPU, so not on the device either.
  A torchtune decoder generates with a KV cache
  (``torchtune.modules.common_utils.local_kv_cache``), a transformers model
  with its own cache (``past_key_values``); the model is in eval mode and
  under ``torch.no_grad`` while it generates, and back in its mode after.
* **What trains.** The prompt's labels stay masked; the generated tokens
  become the sample's labels. So the step's token count (taken from the
  shifted labels, as for any sample) counts the generated tokens, and they
  enter the same global tally and single division as the offline tokens.
  :func:`complete_micro_batch` returns the mask of those positions, for the
  loss (:class:`torchtune_ext.train.distill.DistillationObjective`).
"""

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from torchtune_ext.train.loss import shift_labels


@dataclass(frozen=True)
class OnPolicySettings:
    """How the student completes its share of the samples (see the module docstring).

    Attributes:
        ratio (float): the share ``lambda`` in [0, 1]; 0 is offline distillation.
        max_new_tokens (int): >= 1, the longest completion.
        temperature (float): > 0, the sampling temperature.
        top_k (int, optional): sample among the ``top_k`` most likely tokens; None: all.
        seed (int): the run's seed.
        stop_ids (tuple): token ids that end a completion (kept as its last token).
    """

    ratio: float = 0.0
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: Optional[int] = None
    seed: int = 0
    stop_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise ValueError(f"on_policy_ratio must be in [0, 1], got {self.ratio!r}")
        if int(self.max_new_tokens) < 1 or float(self.temperature) <= 0:
            raise ValueError(f"max_new_tokens must be >= 1 and temperature > 0, got {self.max_new_tokens!r} "
                             f"and {self.temperature!r}")
        if self.top_k is not None and int(self.top_k) < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k!r}")


def sample_generator(seed: int, step: int, content: Sequence[int], purpose: str) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, content, purpose)`` through BLAKE2b (stable across processes
    and Python versions, unlike ``hash``). ``purpose``: ``"choose"`` or ``"generate"``, two independent streams."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{int(seed)}:{int(step)}:{purpose}:".encode())
    digest.update(torch.tensor(list(content), dtype=torch.int64).numpy().tobytes())
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") & (2 ** 63 - 1))


def split_sample(tokens: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> Optional[Tuple[torch.Tensor,
                                                                                                     List[int]]]:
    """(prompt, content) of one unshifted row: the prompt is every token before the first trainable label;
    the content, the prompt's ids followed by the trainable labels (padding is never trainable). None for a
    row with no trainable label (nothing to complete: a stand-in, or a prompt alone)."""
    trainable = (labels != ignore_index).nonzero()
    if trainable.numel() == 0:
        return None
    start = int(trainable[0, 0])
    prompt = tokens[:start]
    return prompt, prompt.tolist() + labels[labels != ignore_index].tolist()


def chosen(settings: OnPolicySettings, step: int, content: Sequence[int]) -> bool:
    """Whether the sample with this content is completed by the student at ``step`` (see the module docstring)."""
    if settings.ratio <= 0.0:
        return False
    draw = torch.rand((), generator=sample_generator(settings.seed, step, content, "choose")).item()
    return draw < settings.ratio


def _next_token(logits: torch.Tensor, settings: OnPolicySettings, generator: torch.Generator) -> int:
    """One id drawn from ``[vocab]`` logits at the settings' temperature and top-k, on the CPU."""
    scores = logits.detach().float().cpu() / settings.temperature
    if settings.top_k is not None and settings.top_k < scores.numel():
        kth = torch.topk(scores, settings.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def _decode_torchtune(model: nn.Module, project: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
                      settings: OnPolicySettings, generator: torch.Generator) -> List[int]:
    """Generate with a torchtune ``TransformerDecoder`` and a KV cache (model returns hidden states)."""
    from torchtune.modules.common_utils import local_kv_cache  # torchtune's cache helper, needed here only

    length = prompt.numel() + settings.max_new_tokens
    device = prompt.device
    dtype = next(model.parameters()).dtype
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
    out: List[int] = []
    with local_kv_cache(model, batch_size=1, device=device, dtype=dtype, decoder_max_seq_len=length):
        positions = torch.arange(prompt.numel(), device=device)
        hidden = model(prompt[None], mask=causal[None, positions], input_pos=positions[None])
        while True:
            out.append(_next_token(project(hidden[0, -1:])[0], settings, generator))
            if out[-1] in settings.stop_ids or len(out) == settings.max_new_tokens:
                return out
            position = torch.tensor([prompt.numel() + len(out) - 1], device=device)
            hidden = model(torch.tensor([[out[-1]]], device=device), mask=causal[None, position],
                           input_pos=position[None])


def _decode_transformers(model: nn.Module, prompt: torch.Tensor, settings: OnPolicySettings,
                         generator: torch.Generator) -> List[int]:
    """Generate with a transformers model through its own forward and cache (``past_key_values``)."""
    out: List[int] = []
    result = model(input_ids=prompt[None], use_cache=True)
    while True:
        out.append(_next_token(result.logits[0, -1], settings, generator))
        if out[-1] in settings.stop_ids or len(out) == settings.max_new_tokens:
            return out
        result = model(input_ids=torch.tensor([[out[-1]]], device=prompt.device),
                       past_key_values=result.past_key_values, use_cache=True)


def length_limit(model: nn.Module) -> Optional[int]:
    """The longest sequence ``model`` takes: a torchtune decoder's ``max_seq_len``, a transformers model's
    ``max_position_embeddings``; None if it says neither."""
    limit = getattr(model, "max_seq_len", None)
    if not isinstance(limit, int):
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def generate(model: nn.Module, project: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
             settings: OnPolicySettings, generator: torch.Generator) -> List[int]:
    """The student's completion of ``prompt``, sampled with ``generator``.

    Args:
        model: the student; a torchtune decoder returning hidden states (its
            output projection handed to the loss), or a transformers model
            built by :func:`torchtune_ext.model.hf.causal_lm` (which still
            answers transformers' own call with logits).
        project: ``[rows, hidden]`` -> ``[rows, vocab]`` logits (the loss's
            :meth:`~torchtune_ext.train.loss.SummedCrossEntropyLoss.project`).
        prompt: ``[prompt_len]`` ids on the model's device, ``prompt_len >= 1``.
        settings: temperature, top-k, length and stop ids.
        generator: a CPU generator (:func:`sample_generator`).

    Returns:
        the generated ids, 1 to ``max_new_tokens`` of them (fewer where the prompt and ``max_new_tokens``
        would pass the model's maximum length, :func:`length_limit`), ending at the first stop id if one
        is drawn.

    Raises:
        ValueError: the prompt alone fills the model's maximum length.
    """
    limit = length_limit(model)
    if limit is not None and prompt.numel() + settings.max_new_tokens > limit:
        if prompt.numel() >= limit:
            raise ValueError(f"a prompt of {prompt.numel()} tokens leaves no room to generate within the "
                             f"model's {limit}")
        settings = dataclasses.replace(settings, max_new_tokens=limit - prompt.numel())
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if hasattr(model, "hand_over_output_projection"):
                return _decode_transformers(model, prompt, settings, generator)
            return _decode_torchtune(model, project, prompt, settings, generator)
    finally:
        model.train(was_training)


def complete_micro_batch(model: nn.Module, project: Callable[[torch.Tensor], torch.Tensor], micro_batch: dict,
                         settings: OnPolicySettings, step: int, ignore_index: int,
                         ) -> Tuple[dict, Optional[torch.Tensor], int]:
    """Replace the chosen samples of a padded micro-batch by their prompt and the student's completion.

    Args:
        micro_batch: a collated, right-padded micro-batch (``tokens``,
            ``labels`` ``[batch, seq_len]``, unshifted); packed rows are not
            supported (the config refuses them with on-policy distillation).
        step: the 1-based optimizer step (seeds the choice and the sampling).

    Returns:
        ``(micro_batch, generated, num_generated)``: the micro-batch (the same
        object when no sample is chosen), ``[batch, new_seq_len]`` bool mask of
        the *shifted* positions whose label is a generated token (None when no
        sample is chosen), and how many tokens were generated.
    """
    tokens, labels = micro_batch["tokens"], micro_batch["labels"]
    rows_tokens, rows_labels, chosen_rows = [], [], []
    for row in range(tokens.size(0)):
        split = split_sample(tokens[row], labels[row], ignore_index)
        if split is not None and chosen(settings, step, split[1]):
            prompt, content = split
            device = next(model.parameters()).device
            completion = generate(model, project, prompt.to(device), settings,
                                  sample_generator(settings.seed, step, content, "generate"))
            new = torch.tensor(completion, dtype=tokens.dtype)
            rows_tokens.append(torch.cat([prompt.cpu(), new]))
            rows_labels.append(torch.cat([torch.full_like(prompt.cpu(), ignore_index), new]))
            chosen_rows.append(True)
        else:
            rows_tokens.append(tokens[row])
            rows_labels.append(labels[row])
            chosen_rows.append(False)
    if not any(chosen_rows):
        return micro_batch, None, 0
    width = max(r.numel() for r in rows_tokens)
    # Right padding: id 0 (never attended by a real position of a causal model), labels masked.
    new_tokens = torch.stack([nn.functional.pad(r, (0, width - r.numel()), value=0) for r in rows_tokens])
    new_labels = torch.stack([nn.functional.pad(r, (0, width - r.numel()), value=ignore_index)
                              for r in rows_labels])
    generated = (shift_labels(new_labels, ignore_index) != ignore_index) & torch.tensor(chosen_rows)[:, None]
    out = {k: v for k, v in micro_batch.items() if k not in ("tokens", "labels")}
    out.update(tokens=new_tokens, labels=new_labels)
    return out, generated, int(generated.sum())
