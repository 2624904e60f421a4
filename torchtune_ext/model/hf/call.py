"""transformers' causal LM called as torchtune calls a decoder: tokens, positions, a mask; the head handed to the loss.

The instance's class gets a thin subclass (as FSDP2's ``fully_shard`` does)
whose ``forward`` also accepts torchtune's call: ``tokens`` ``[b, s]``,
``input_pos`` ``[b, s]`` as transformers' ``position_ids``. Packed rows
(positions restarting at 0 for every document) keep attention inside each
document through transformers' own packed-sequence detection, which works
for every attention implementation and for sliding-window layers; the
collator's block-causal ``mask`` is only checked against the positions (see
:func:`_check_documents`). Called as transformers calls it (``input_ids=``,
``labels=``, ``generate``), it is transformers' forward.

:meth:`TorchtuneCall.hand_over_output_projection` lets
:class:`torchtune_ext.train.loss.SummedCrossEntropyLoss` apply the output
projection to trainable rows only, with whatever the family's head does
after its matmul (Gemma 2/3 ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``), read from the class's own
forward so that an unknown head transform is refused rather than dropped
(:func:`head_transforms`).
"""


import inspect
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import transformers
from torch import nn

from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.packing import packing_refusal
from torchtune_ext.train.loss import OutputProjection

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the head
@dataclass(frozen=True)
class HeadTransform:
    """What a family's causal-LM head does to ``lm_head``'s output, element-wise.

    Attributes:
        softcap: ``cap * tanh(logits / cap)`` (Gemma 2/3 ``final_logit_softcapping``); None: off.
        multiply: logits times this (Cohere ``logit_scale``, Falcon-H1 ``lm_head_multiplier``); 1.0: off.
        divide: logits divided by this (Granite ``logits_scaling``); 1.0: off.
    """

    softcap: Optional[float] = None
    multiply: float = 1.0
    divide: float = 1.0

    def describe(self) -> str:
        """What it does, in words for a message (``softcap 30.0``, ``nothing``)."""
        done = [f"multiply by {self.multiply}"] if self.multiply != 1.0 else []
        done += [f"divide by {self.divide}"] if self.divide != 1.0 else []
        done += [f"softcap {self.softcap}"] if self.softcap is not None else []
        return ", then ".join(done) or "nothing"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

# Lines a causal LM's forward may have between its lm_head call and its loss, as transformers
# writes them (comments stripped): each maps to what HeadTransform reproduces.
_LM_HEAD_CALLS = {
    "logits = self.lm_head(hidden_states[:, slice_indices, :])",
    "logits = self.lm_head(hidden_states[:, slice_indices, :]).float()",
    "logits = self.lm_head(hidden_states[:, slice_indices, :].to(self.lm_head.weight.dtype)).float()",
    "logits = self.lm_head(hidden_states[:, slice_indices, :]).contiguous()",
    "lm_logits = self.lm_head(hidden_states[:, slice_indices, :])",
}

_SOFTCAP_LINES = {
    "if self.config.final_logit_softcapping is not None:",
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
    # an image-text class reads it off its text config (Gemma 4)
    "if (final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) is not None:",
    "logits = logits / final_logit_softcapping",
    "logits = logits * final_logit_softcapping",
}

_MULTIPLY_LINE = "logits = logits * self.logit_scale"

_DIVIDE_LINE = "logits = logits / self.config.logits_scaling"

# a known lm_head call times a scalar attribute of the model (Falcon-H1's lm_head_multiplier)
_SCALED_CALL = re.compile(r"^(.+\)) \* self\.([A-Za-z_][\w.]*)$")


def _scalar(model: nn.Module, path: str, cls: type) -> float:
    """The number ``model.<path>`` holds (a float, an int or a one-element tensor).

    Raises:
        ConfigError: (key ``model``) anything else (a per-token or per-vocabulary scale).
    """
    value: Any = model
    for part in path.split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError("model", f"{cls.__name__} multiplies its logits by self.{path}, which is not one number "
                          f"({type(value).__name__}); its loss would differ from the model's")
    return float(value)


_HEAD_END = re.compile(r"^(loss\b|if labels\b|return\b|aux_loss\b)")

def head_transforms(model: nn.Module, cls: type) -> HeadTransform:
    """Read off ``cls.forward`` what it does to ``lm_head``'s output; refuse what we cannot reproduce.

    Raises:
        ConfigError: (key ``model``) the forward's source cannot be read, its
            lm_head call is not one we know, or a line after it is not a
            transform of :class:`HeadTransform`.
    """
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError) as err:
        raise ConfigError("model", f"the source of {cls.__name__}.forward cannot be read ({err}), so what it does "
                          "after its output projection is unknown") from None
    lines = [line.split("#", 1)[0].strip() for line in source.splitlines()]
    lines = [line for line in lines if line]
    calls = [i for i, line in enumerate(lines) if "self.lm_head(" in line]
    scaled = _SCALED_CALL.match(lines[calls[0]]) if len(calls) == 1 else None
    multiply = 1.0
    if scaled:  # Falcon-H1: logits = self.lm_head(...) * self.model.lm_head_multiplier
        multiply = _scalar(model, scaled.group(2), cls)
    if len(calls) != 1 or (scaled.group(1) if scaled else lines[calls[0]]) not in _LM_HEAD_CALLS:
        found = lines[calls[0]] if calls else "no lm_head call"
        raise ConfigError("model", f"{cls.__name__} computes its logits in a way torchtune_ext.model.hf does not know "
                          f"({found!r}); its output projection cannot be handed to the loss, so it cannot train "
                          "with these recipes: train it with transformers' own Trainer, or ask for its head to be "
                          "supported (torchtune_ext/model/hf/call.py, head_transforms)")
    config, divide, softcap = model.config, 1.0, None
    for line in lines[calls[0] + 1:]:
        if _HEAD_END.match(line):
            break
        if line in _SOFTCAP_LINES:
            softcap = getattr(config.get_text_config(), "final_logit_softcapping", None)
        elif line == _MULTIPLY_LINE:
            multiply *= float(model.logit_scale)
        elif line == _DIVIDE_LINE:
            divide = float(config.logits_scaling)
        else:
            raise ConfigError("model", f"{cls.__name__} does more after its output projection than "
                              f"torchtune_ext.model.hf reproduces ({line!r}); its loss would differ from the model's")
    return HeadTransform(softcap=float(softcap) if softcap is not None else None, multiply=multiply, divide=divide)

# --------------------------------------------------------------------------- packed rows
def _separates(mask: Any, batch: int, seq_len: int) -> torch.Tensor:
    """``[batch, seq_len - 1]`` bool: position ``t + 1`` may not attend to ``t`` (a document starts at ``t + 1``).

    ``mask``: torchtune's block-causal mask, a ``[b, s, s]`` bool tensor (True
    = may attend) or, on CUDA with flex attention, a ``BlockMask``.
    """
    query = torch.arange(1, seq_len)
    if isinstance(mask, torch.Tensor):
        return ~mask[:, query, query - 1].bool()
    device = getattr(mask, "kv_indices", query).device
    b = torch.arange(batch, device=device)[:, None]
    q = query.to(device)[None, :]
    heads = torch.zeros_like(b)
    return ~mask.mask_mod(b, heads, q, q - 1)

def _check_documents(mask: Any, input_pos: Optional[torch.Tensor], tokens: torch.Tensor) -> None:
    """Check that the collator's block-causal ``mask`` and the positions tell the same documents.

    transformers finds the documents of a packed row from its positions (a
    new document wherever the position does not go up by 1), so a document
    the mask separates must start with a position restart. One exception: a
    last segment the mask separates while its positions go on counting is
    torchtune's ``PackedDataset`` padding (its ``input_pos`` continue the
    last document); no label is trained there and no earlier token attends
    to it, so it changes nothing.

    Raises:
        ValueError: ``mask`` without ``input_pos``, or a document boundary of
            the mask where the positions go on counting (the documents would
            see each other).
    """
    if input_pos is None:
        raise ValueError("a packed micro-batch needs input_pos with its mask: transformers models find the "
                         "documents of a row from the positions (restarting at 0 for every document)")
    batch, seq_len = tokens.shape
    if seq_len < 2:
        return
    by_mask = _separates(mask, batch, seq_len).to(input_pos.device)
    by_pos = input_pos[:, 1:] - input_pos[:, :-1] != 1
    unseen = by_mask & ~by_pos  # the mask separates, the positions do not
    # allowed: the row's last mask boundary, when nothing after it restarts (torchtune's padding)
    last_boundary = torch.where(by_mask, torch.arange(seq_len - 1, device=by_mask.device), -1).amax(dim=1, keepdim=True)
    tail_ok = torch.arange(seq_len - 1, device=by_mask.device)[None, :] == last_boundary
    if bool((unseen & ~tail_ok).any()):
        row, col = [int(i) for i in (unseen & ~tail_ok).nonzero()[0]]
        raise ValueError(f"packed micro-batch row {row}: the mask starts a document at position {col + 1} but "
                         "input_pos does not restart there; transformers models find documents from input_pos, "
                         "so the documents would attend to each other")

# --------------------------------------------------------------------------- the call convention
class TorchtuneCall:
    """Mixed into a transformers causal LM's class by :func:`causal_lm` (see the module docstring).

    Attributes set by :func:`adapt`: ``_ext_hf_class`` (the transformers class),
    ``_ext_head`` (:class:`HeadTransform`), ``_ext_returns_hidden`` (after the
    hand-over), ``_ext_router`` (router load-balancing settings or None),
    ``_ext_router_aux`` (the last forward's router loss) and ``_ext_body``
    (the name of the decoder stack that gives the final hidden states), ``_ext_packing`` (why packed
    rows are refused: :func:`torchtune_ext.model.hf.packing.packing_refusal`).
    """

    def forward(self, tokens: Optional[torch.Tensor] = None, mask: Any = None,
                input_pos: Optional[torch.Tensor] = None, **kwargs):
        """torchtune's call, or transformers' own.

        ``model(tokens, mask=..., input_pos=...)`` (``tokens`` ``[b, s]`` ids,
        ``input_pos`` ``[b, s]`` positions restarting at 0 per document of a
        packed row, ``mask`` the collator's block-causal mask, checked
        against them) returns ``[b, s, vocab]`` logits as the model's own
        head computes them, or ``[b, s, hidden]`` final normed hidden states
        after :meth:`hand_over_output_projection`. With any other keyword
        (``input_ids``, ``labels``, ``attention_mask``...) it is
        transformers' forward, unchanged.
        """
        if tokens is None or kwargs:
            return super().forward(tokens, **kwargs) if tokens is not None else super().forward(**kwargs)
        if mask is not None:
            _check_documents(mask, input_pos, tokens)
            if self._ext_packing is None:  # once: it reads the modules and the stack's source
                self._ext_packing = packing_refusal(self, getattr(self, self._ext_body)) or ""
            if self._ext_packing:  # the recipes refuse it before training (torchtune_ext.run.preflight)
                raise ValueError(f"a packed micro-batch: {self._ext_packing}")
        extra = {"output_router_logits": True} if self._ext_router is not None else {}
        # No attention_mask: with one, transformers would build a plain causal mask and ignore the
        # documents of a packed row (transformers PR #46634); without, it finds them from the positions.
        out = getattr(self, self._ext_body)(input_ids=tokens, position_ids=input_pos, use_cache=False, **extra)
        if self._ext_router is not None:
            self._ext_router_aux = self._ext_router.loss(out.router_logits)
        hidden = out.last_hidden_state
        if self._ext_returns_hidden:
            return hidden
        return self._ext_head(self.get_output_embeddings()(hidden))

    def hand_over_output_projection(self) -> OutputProjection:
        """From now on return final hidden states; the loss applies the output projection.

        Returns:
            :class:`torchtune_ext.train.loss.OutputProjection`: ``project`` maps
            ``[rows, hidden]`` to fp32 ``[rows, vocab]`` logits through this
            model's ``lm_head`` module (so a LoRA adapter on it, tied weights
            and FSDP's gathering work as in the model) and its head
            transform; with router load balancing on, ``auxiliary`` holds
            the router loss of the last forward and its coefficient.
        """
        self._ext_returns_hidden = True
        head, transform = self.get_output_embeddings(), self._ext_head
        vocab = getattr(head, "out_features", None)
        vocab = vocab if isinstance(vocab, int) else self.config.get_text_config().vocab_size
        auxiliary = {}
        if self._ext_router is not None:
            auxiliary["router_aux_loss"] = (lambda: self._ext_router_aux, self._ext_router.coef)
        return OutputProjection(project=lambda rows: transform(head(rows).float()), vocab_size=vocab,
                                auxiliary=auxiliary)

@dataclass(frozen=True)
class RouterBalance:
    """The router load-balancing loss of a mixture-of-experts model, as its transformers module computes it.

    ``loss(router_logits)`` is the Switch Transformer auxiliary loss (Fedus
    et al., 2021, eqs. 4-6) over every position of the micro-batch (padding
    included: the model gets no padding mask), via the family's own
    ``load_balancing_loss_func``.
    """

    function: Callable
    num_experts: int
    top_k: int
    coef: float

    def loss(self, router_logits) -> torch.Tensor:
        return self.function(router_logits, self.num_experts, self.top_k, None)

def _router_balance(model: nn.Module, cls: type, coef: Optional[float]) -> RouterBalance:
    function = getattr(sys.modules[cls.__module__], "load_balancing_loss_func", None)
    num_experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    if function is None or not isinstance(num_experts, int) or not isinstance(top_k, int):
        raise ConfigError("model.output_router_logits", f"{cls.__name__} has no router load-balancing loss "
                          "torchtune_ext.model.hf knows; set model.output_router_logits=false")
    if coef is None:
        coef = getattr(model, "router_aux_loss_coef", model.config.router_aux_loss_coef)
    coef = float(coef)
    return RouterBalance(function, num_experts, top_k, coef)

_ADAPTED: Dict[type, type] = {}

def adapt(model: nn.Module, *, output_router_logits: bool = False,
          router_aux_loss_coef: Optional[float] = None) -> nn.Module:
    """Give a transformers causal LM torchtune's call convention, in place (see :class:`TorchtuneCall`).

    The instance's class becomes a subclass of its transformers class with
    the same name (``save_pretrained`` still writes that name into
    ``architectures``); weights, state dict and every other method are unchanged.

    Raises:
        ConfigError: (key ``model``) a head :func:`_head_transforms` refuses;
            (``model.output_router_logits``) router load balancing on a model without it.
    """
    cls = getattr(model, "_ext_hf_class", type(model))
    head = head_transforms(model, cls)
    router = _router_balance(model, cls, router_aux_loss_coef) if output_router_logits else None
    if cls not in _ADAPTED:
        _ADAPTED[cls] = type(cls.__name__, (TorchtuneCall, cls), {"__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})
    model.__class__ = _ADAPTED[cls]
    model._ext_hf_class = cls
    model._ext_head = head
    model._ext_returns_hidden = False
    model._ext_router = router
    model._ext_router_aux = None
    model._ext_body = _body(model)
    model._ext_packing = None  # why packed rows are refused ("" when they are not), found at the first pack
    return model

def _body(model: nn.Module) -> str:
    """The name of the causal LM's decoder stack: its ``base_model``, or where that is the model itself
    (Llama4ForCausalLM names ``language_model`` as its prefix, to load from Llama 4's image-text files,
    and keeps its stack in ``model``) its one child that is a transformers model.

    Raises:
        ConfigError: (key ``model``) none, or several.
    """
    if model.base_model is not model:
        return model.base_model_prefix
    found = [name for name, child in model.named_children() if isinstance(child, transformers.PreTrainedModel)]
    if len(found) != 1:
        raise ConfigError("model", f"{type(model).__name__}: no one decoder stack found among its modules "
                          f"({', '.join(name for name, _ in model.named_children())})")
    return found[0]
