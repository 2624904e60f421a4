"""TRL's ``DPOTrainer`` on the preference benchmark's model, pairs and settings.

    python -m bench.peers.trl_dpo --out <dir/probe.json> --config bench/configs/upstream_lora_dpo_single_device.yaml \
        [key=value ...]

Not a training entry point: ``python -m bench.preference`` starts it, in the
peers' environment (``bench/peers/README.md``). It reads upstream's DPO config
with the same overrides, so both peers train the same setting:

* **Model.** ``LlamaForCausalLM`` of ``checkpointer.checkpoint_dir`` with PEFT LoRA of
  ``model``'s rank, alpha, dropout and targets, from the adapter our recipes draw
  (upstream's run gets the same one); no ``ref_model``: TRL's reference is the
  same model with the adapter disabled, as upstream's. fp32, CPU.
* **Pairs, as token ids.** torchtune's ``preference_dataset`` of the config (the
  torchtune file of ``python -m bench.peers.pairs``), tokenized by our tokenizer as
  upstream tokenizes it; each pair becomes TRL's ``prompt_ids`` (the tokens before
  the first learned label), ``chosen_ids`` and ``rejected_ids`` (the rest). TRL's own
  tokenization of the same pairs (``pairs_trl.jsonl``) would apply the HF chat
  template, which adds SmolLM2's default system prompt: other token ids, longer
  sequences. ``max_length`` is ``tokenizer.max_seq_len`` (truncation keeps the start).
* **Order and batches.** Upstream's pair order (``DistributedSampler(seed=0)``),
  ``batch_size`` pairs per micro-batch (chosen and rejected in one forward of
  2 x ``batch_size`` rows, as both do), ``gradient_accumulation_steps`` per step.
* **Loss.** Sigmoid DPO with the config's ``loss.beta``, reference log-probabilities
  computed per micro-batch (not precomputed), the mean over a micro-batch's pairs
  divided by the accumulation steps: upstream's loss. No gradient clipping
  (upstream's DPO recipe has none). The config's ``optimizer`` and ``lr_scheduler``.

Probes as in ``bench.peers.trl_gkd``; each micro-batch counts its chosen and
rejected sequences (policy forward tokens, no padding).
"""

import argparse
import atexit
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from bench.launch import IGNORE_INDEX, Probe
from bench.peers.probes import masked, sequences_of_pairs
from bench.peers.trl_common import (
    EpochOrder,
    check_cpu_fp32,
    load_config,
    load_our_adapter,
    lora_config,
    make_step_callback,
)


def trl_pair(sample: Dict[str, Any]) -> Dict[str, List[int]]:
    """A torchtune preference sample as TRL's ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``.

    The prompt is the chosen sequence before its first learned label; the
    rejected sequence must start with the same tokens (the same user turn).

    Raises:
        ValueError: no learned label, or the two sequences' prompts differ.
    """
    chosen, rejected = list(sample["chosen_input_ids"]), list(sample["rejected_input_ids"])
    starts = [next((i for i, l in enumerate(labels) if l != IGNORE_INDEX), None)
              for labels in (sample["chosen_labels"], sample["rejected_labels"])]
    if None in starts or starts[0] != starts[1] or chosen[:starts[0]] != rejected[:starts[0]]:
        raise ValueError("a pair whose chosen and rejected sequences do not share one prompt")
    n = starts[0]
    return {"prompt_ids": chosen[:n], "chosen_ids": chosen[n:], "rejected_ids": rejected[n:]}


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.peers.trl_dpo")
    parser.add_argument("--out", required=True, type=Path, help="probe JSON (as bench.launch writes)")
    parser.add_argument("--config", required=True, help="upstream's DPO config (YAML)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    check_cpu_fp32(cfg, parser.prog)

    probe = Probe(args.out, "trl", "trl.DPOTrainer", list(argv))
    atexit.register(probe.write)

    import peft
    import transformers
    import trl
    from datasets import Dataset
    from peft import get_peft_model
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torchtune import config as tt_config
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    register_optimizer_step_post_hook(probe.optimizer_step)
    probe.data.update(trl=trl.__version__, transformers=transformers.__version__, peft=peft.__version__)

    tokenizer = tt_config.instantiate(cfg.tokenizer)
    pairs = Dataset.from_list([trl_pair(s) for s in tt_config.instantiate(cfg.dataset, tokenizer)])
    seed, steps = int(cfg.seed), int(cfg.max_steps_per_epoch)
    ga, batch_size = int(cfg.gradient_accumulation_steps), int(cfg.batch_size)
    max_length = int(cfg.tokenizer.max_seq_len)

    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(str(cfg.checkpointer.checkpoint_dir), dtype=torch.float32),
        lora_config(cfg.model))
    probe.data["initial_adapter"] = {"seed": seed, "applied": load_our_adapter(model, cfg.model, seed)}
    optimizer = tt_config.instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    scheduler = tt_config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps)

    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_id, max_length=max_length)

    def collate(examples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        batch = collator(examples)
        # what the collator keeps of each sequence (it truncates to max_length, keeping the start)
        seqs = [(e["prompt_ids"] + e[key])[:max_length] for key in ("chosen_ids", "rejected_ids") for e in examples]
        n = len(examples)
        prompt = [len(e["prompt_ids"]) for e in examples]
        probe.micro_batch(sequences_of_pairs(seqs[:n], [masked(s, p) for s, p in zip(seqs[:n], prompt)],
                                             seqs[n:], [masked(s, p) for s, p in zip(seqs[n:], prompt)]),
                          {"tokens": batch["input_ids"]}, step_index=len(probe.data["micro_batches"]) // ga)
        return batch

    step_losses: List[float] = []

    class BenchDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # already token ids (trl_pair)

        def _get_train_sampler(self, *args, **kwargs):
            return EpochOrder(len(pairs))

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            step_losses.append(float(loss))
            return loss

    targs = DPOConfig(
        output_dir=str(cfg.output_dir), per_device_train_batch_size=batch_size, gradient_accumulation_steps=ga,
        max_steps=steps, learning_rate=float(cfg.optimizer.lr), max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed, dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True, bf16=False,
        beta=float(cfg.loss.get("beta", 0.1)), loss_type=["sigmoid"], max_length=max_length,
        precompute_ref_log_probs=False,
    )
    trainer = BenchDPOTrainer(
        model=model, ref_model=None, args=targs, train_dataset=pairs, data_collator=collate,
        processing_class=AutoTokenizer.from_pretrained(str(cfg.checkpointer.checkpoint_dir)),
        optimizers=(optimizer, scheduler),
        callbacks=[make_step_callback(probe, ga, step_losses, Path(str(cfg.output_dir)) / "logs" / "metrics.jsonl")],
    )
    trainer.train()


if __name__ == "__main__":
    sys.path.append(os.getcwd())
    main()
