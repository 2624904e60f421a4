"""What the two TRL runs share: the upstream config they read, the sample order, LoRA from our draw, step probes.

The TRL runs (``bench.peers.trl_gkd``, ``bench.peers.trl_dpo``) take the
settings of the upstream recipe's config (``bench/configs/upstream_*.yaml``) with
the same ``key=value`` overrides, so one file states what both peers train:
model and adapter shape, tokenizer and data (instantiated with torchtune, so
both see the same token ids), optimizer and schedule, batch size, accumulation,
steps and seed.
"""

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from bench.launch import Probe

# torchtune's LoRA module names -> the Hugging Face Llama module names PEFT targets
PEFT_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
MLP = ("w1", "w2", "w3")


def load_config(path: str, overrides: Sequence[str]) -> DictConfig:
    """The YAML at ``path`` with ``key=value`` overrides merged, as ``tune run`` would read them."""
    return OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))


def check_cpu_fp32(cfg: DictConfig, prog: str) -> None:
    if str(cfg.get("device", "cpu")) != "cpu" or str(cfg.get("dtype", "fp32")) != "fp32":
        raise SystemExit(f"{prog}: only device=cpu, dtype=fp32 are supported")


def epoch_order(size: int) -> List[int]:
    """Upstream's sample order: its sampler is ``DistributedSampler(seed=0, shuffle=True)``, one replica, epoch 0."""
    generator = torch.Generator()
    generator.manual_seed(0)
    return torch.randperm(size, generator=generator).tolist()


class EpochOrder(torch.utils.data.Sampler):
    """:func:`epoch_order` as a sampler, for ``Trainer._get_train_sampler``."""

    def __init__(self, size: int):
        self.order = epoch_order(size)

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


def lora_config(cfg_model: DictConfig):
    """PEFT's ``LoraConfig`` for the adapters the torchtune model config asks for (same rank, alpha, dropout)."""
    from peft import LoraConfig

    modules = list(cfg_model.lora_attn_modules) + (list(MLP) if cfg_model.get("apply_lora_to_mlp") else [])
    if cfg_model.get("apply_lora_to_output"):
        raise SystemExit("apply_lora_to_output: SmolLM2's output is its tied embedding; not supported")
    return LoraConfig(r=int(cfg_model.lora_rank), lora_alpha=float(cfg_model.lora_alpha),
                      lora_dropout=float(cfg_model.get("lora_dropout", 0.0)), bias="none", task_type="CAUSAL_LM",
                      target_modules=[PEFT_TARGETS[m] for m in modules])


def peft_name(torchtune_name: str) -> str:
    """``layers.3.attn.output_proj.lora_a.weight`` -> ``model.layers.3.self_attn.o_proj.lora_A.default.weight``."""
    m = re.fullmatch(r"layers\.(\d+)\.(attn|mlp)\.(\w+)\.lora_([ab])\.weight", torchtune_name)
    if not m:
        raise ValueError(f"not a torchtune LoRA weight: {torchtune_name}")
    layer, block, module, part = m.groups()
    where = "self_attn" if block == "attn" else "mlp"
    return f"model.layers.{layer}.{where}.{PEFT_TARGETS[module]}.lora_{part.upper()}.default.weight"


def load_our_adapter(peft_model: torch.nn.Module, cfg_model: DictConfig, seed: int) -> int:
    """Set the PEFT adapters to the draw our recipes (and upstream's run here) start from; returns tensors set.

    The torchtune model of ``cfg_model`` is built on the meta device and its
    adapters drawn by ``torchtune_ext.models.initialize_adapters(model, seed)``
    (A Kaiming-uniform, B zero), then copied into the PEFT model by name.

    Raises:
        ValueError: an adapter tensor has no PEFT counterpart of the same shape.
    """
    from torchtune import config

    from torchtune_ext.models import initialize_adapters

    with torch.device("meta"):
        draft = config.instantiate(cfg_model)
    initialize_adapters(draft, seed)
    ours = {k: v for k, v in draft.state_dict().items() if ".lora_a." in k or ".lora_b." in k}
    target = dict(peft_model.base_model.model.named_parameters())
    with torch.no_grad():
        for name, value in ours.items():
            param = target.get(peft_name(name))
            if param is None or param.shape != value.shape:
                raise ValueError(f"{name}: no PEFT parameter {peft_name(name)} of shape {tuple(value.shape)}")
            param.copy_(value)
    return len(ours)


def make_step_callback(probe: Probe, ga: int, step_losses: List[float], metrics_path: Path):
    """A ``TrainerCallback`` that marks each optimizer step's end and writes ``metrics.jsonl`` (loss, grad norm).

    ``step_losses`` collects the micro-batch losses ``training_step`` returns
    (each already divided as the trainer divides it): their sum is the step's
    loss. A record per step: ``step``, ``loss``, ``num_tokens`` (label tokens
    after the shift, from the probe), ``grad_norm`` and the Trainer's own
    logged loss (``hf_logged_loss``, rounded).
    """
    from transformers import TrainerCallback

    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(metrics_path, "w")
    records: List[Dict[str, Any]] = []

    class StepProbe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            probe.step_end()
            k = state.global_step
            window = probe.data["micro_batches"][(k - 1) * ga:k * ga]
            records.append({"step": k, "loss": sum(step_losses),
                            "num_tokens": sum(mb["trainable_tokens"] for mb in window)})
            step_losses.clear()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if records and "loss" in logs:
                records[-1].update(hf_logged_loss=logs.get("loss"), grad_norm=logs.get("grad_norm"))
                out.write(json.dumps(records[-1]) + "\n")
                out.flush()

        def on_train_end(self, args, state, control, **kwargs):
            out.close()

    return StepProbe()
