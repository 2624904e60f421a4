"""Whether a transformers model can train on packed rows: what keeps a pack's documents apart, and what does not.

A packed row holds several documents; the positions restart at 0 for each
(:mod:`~torchtune_ext.model.hf.call`). transformers keeps the documents apart
in *attention* only: its mask builders (``create_causal_mask`` and its
sliding-window and chunked siblings) read the document boundaries off the
``position_ids`` when no attention mask is passed. Two kinds of model then
let one document see another, and a packed step would differ from the
unpacked one with no error:

* layers that mix tokens across positions outside attention: short
  convolutions (LFM2), linear attention / Gated DeltaNet (Qwen3-Next,
  Qwen3.5, MiniMax), state-space layers (Mamba, Falcon-H1, Jamba,
  Bamba...). transformers runs them over the whole row: its kernels take no
  document boundaries (``seq_idx=None``, ``cu_seqlens`` unused) and its
  torch fallbacks have none;
* a decoder stack that builds its attention mask without the
  ``position_ids`` (or not through a mask builder at all).

:func:`packing_refusal` says which, from the built model (on meta is
enough): the modules it holds, its config's ``layer_types`` and the source of
its decoder stack's ``forward``. The recipes refuse ``dataset.packed`` and
``pack_micro_batches`` for such a model before anything trains
(:func:`torchtune_ext.run.preflight.check_components`), and its forward
refuses a packed micro-batch (:class:`~torchtune_ext.model.hf.call.TorchtuneCall`).
``bench/packing_sweep.py`` applies it to every causal LM transformers has
(docs/models.md lists the result).
"""

import ast
import inspect
import re
import textwrap
from typing import List, Optional, Tuple

from torch import nn
from transformers import PreTrainedModel

# layer_types values that are attention (transformers' names): every other value is a token mixer of its own
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
# transformers' mask builders that take position_ids and detect the documents of a packed row from them
MASK_BUILDERS = frozenset({"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
                           "create_masks_for_generate"})
# Class names of token mixers outside attention, for those without a convolution over the sequence (a
# convolution is found by its type); each with the words a message uses.
_MIXER_KINDS: Tuple[Tuple[str, str], ...] = (
    (r"ShortConv", "short convolution"),
    (r"DeltaNet|LinearAttention|LightningAttention|Lightning", "linear attention"),
    (r"Mamba|Mixer|Ssm|SSM|StateSpace", "state-space (Mamba)"),
    (r"Rwkv|RWKV|Recurrent|Retention|LSTM", "recurrent"),
)


def mixer_kind(cls: type) -> Optional[str]:
    """What kind of token mixer outside attention a module class is, by its name (None: not one)."""
    name = cls.__name__
    if re.search(r"Norm|Rotary|MLP|Mlp|FeedForward|Backend", name):
        return None  # parts of a mixer's layer that mix nothing across positions
    if "Attention" in name and not re.search(r"Linear|Lightning|DeltaNet", name):
        return None  # softmax attention: the mask keeps the documents apart
    for pattern, kind in _MIXER_KINDS:
        if re.search(pattern, name):
            return kind
    return None


def _kind(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
        return "convolution over the sequence"
    return mixer_kind(type(module))


def cross_document_mixers(model: nn.Module) -> List[Tuple[str, str]]:
    """The model's modules that mix tokens across positions outside attention: ``[(class name, kind)]``.

    The outermost such module counts (Qwen3-Next's ``Qwen3NextGatedDeltaNet``,
    not the ``Conv1d`` inside it), each class once, in model order; the
    config's ``layer_types`` values that are not attention are added as
    ``(value, "layer type")`` when no module was found for them.
    """
    found: List[Tuple[str, str]] = []
    inside: List[str] = []
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel) or any(name.startswith(prefix + ".") for prefix in inside):
            continue  # the model classes (MambaForCausalLM) hold the mixers: name the layers
        kind = _kind(module)
        if kind is not None:
            inside.append(name)
            if (type(module).__name__, kind) not in found:
                found.append((type(module).__name__, kind))
    if not found:
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None else None
        for layer_type in getattr(text, "layer_types", None) or ():
            if isinstance(layer_type, str) and layer_type not in ATTENTION_LAYER_TYPES \
                    and (layer_type, "layer type") not in found:
                found.append((layer_type, "layer type"))
    return found


_MASK_CALL = re.compile(r"^_?(create|prepare|update|get)\w*mask")
# an encoder's (cross-attention) mask: no causal documents to keep apart
_ENCODER_MASK = re.compile(r"bidirectional|encoder|cross")


def _callee(call: ast.Call) -> Optional[str]:
    return getattr(call.func, "id", getattr(call.func, "attr", None))


def _positions_dicts(tree: ast.AST) -> set:
    """Names of dicts that hold ``position_ids``: ``kw = {..., "position_ids": ...}``, ``kw["position_ids"] = ...``,
    and copies of them (``other = kw.copy()``, ``dict(kw)``)."""
    names: set = set()
    for _ in range(3):  # copies of copies
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name) and isinstance(value, ast.Dict) \
                    and any(isinstance(k, ast.Constant) and k.value == "position_ids" for k in value.keys):
                names.add(target.id)
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                    and isinstance(target.slice, ast.Constant) and target.slice.value == "position_ids":
                names.add(target.value.id)
            elif isinstance(target, ast.Name) and isinstance(value, ast.Call) and (
                    (_callee(value) == "copy" and getattr(value.func, "value", None) is not None
                     and getattr(value.func.value, "id", None) in names)
                    or (_callee(value) == "dict" and any(getattr(a, "id", None) in names for a in value.args))):
                names.add(target.id)
    return names


def _passes_positions(call: ast.Call, dicts: set) -> bool:
    if any(k.arg == "position_ids" for k in call.keywords):
        return True
    if any(isinstance(a, ast.Name) and a.id == "position_ids" for a in call.args):
        return True
    return any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id in dicts for k in call.keywords)


def mask_without_positions(stack: nn.Module) -> Optional[str]:
    """Why the decoder stack's attention mask would not see a packed row's documents, or None if it does.

    Read off the source of ``type(stack).forward``: its mask calls (a
    function named ``create_*mask*``, ``prepare_*mask*``, ``update_*mask*``
    or ``get_*mask*``, or a name bound to one, as Mistral's ``mask_function``)
    must all pass ``position_ids``: by keyword, as an argument, or in a dict
    spread into the call (Gemma 3's ``mask_kwargs`` and its copies). A stack
    with no mask call builds its mask some other way (an encoder's, a
    legacy ``_prepare_4d_causal_attention_mask``...).

    Returns:
        None, or a phrase for a message (``BloomModel builds its attention mask without the positions``).
    """
    name = type(stack).__name__
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(stack).forward)))
    except (OSError, TypeError, SyntaxError):
        return f"{name}'s forward has no source to read, so how it builds its attention mask is unknown"
    aliases = {node.targets[0].id for node in ast.walk(tree)
               if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
               and any(_MASK_CALL.match(getattr(n, "id", "") or "") for n in ast.walk(node.value)
                       if isinstance(n, ast.Name))
               and not isinstance(node.value, ast.Call)}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and (_MASK_CALL.match(_callee(node) or "") or _callee(node) in aliases)
             and not _ENCODER_MASK.search(_callee(node) or "")]
    if not calls:
        return f"{name} builds its attention mask without transformers' mask builders"
    dicts = _positions_dicts(tree)
    if not all(_passes_positions(call, dicts) for call in calls):
        return f"{name} builds its attention mask without the positions"
    return None


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module whose forward builds the attention mask: ``model.base_model``, or where that is the model
    itself (Llama4ForCausalLM) its one child that is a transformers model."""
    if model.base_model is not model:
        return model.base_model
    children = [child for child in model.children() if isinstance(child, PreTrainedModel)]
    return children[0] if len(children) == 1 else model


def packing_refusal(model: nn.Module, stack: Optional[nn.Module] = None) -> Optional[str]:
    """Why packed rows would train ``model`` differently from the same samples unpacked; None if they would not.

    Args:
        model: a transformers causal LM (built on meta is enough).
        stack: its decoder stack (the module whose forward builds the mask);
            default ``model.base_model``.

    Returns:
        None, or one sentence naming the layer type (``its Lfm2ShortConv layers
        (short convolution) mix tokens across positions outside attention``).
    """
    mixers = cross_document_mixers(model)
    if mixers:
        names = ", ".join(f"{name} layers ({kind})" if kind != "layer type" else f"'{name}' layers"
                          for name, kind in mixers)
        return (f"{type(model).__name__}'s {names} mix tokens across positions outside attention, where "
                "transformers does not see a pack's document boundaries, so packed documents would see each other")
    why = mask_without_positions(stack if stack is not None else decoder_stack(model))
    if why:
        return (f"{why}, so packed documents would attend to each other (transformers finds a pack's documents "
                "from the positions)")
    return None
