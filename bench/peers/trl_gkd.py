"""TRL's ``GKDTrainer``, offline (``lmbda=0``), on the distillation benchmark's teacher, student and samples.

    python -m bench.peers.trl_gkd --out <dir/probe.json> --config bench/configs/upstream_kd_lora_single_device.yaml \
        [key=value ...]

Not a training entry point: ``python -m bench.distillation`` starts it, in the
peers' environment (TRL is no dependency of the project; ``bench/peers/README.md``).
It reads upstream's distillation config with the same overrides, so both peers
train the same setting:

* **Models.** Teacher: ``LlamaForCausalLM`` of ``teacher_checkpointer.checkpoint_dir``;
  student: of ``checkpointer.checkpoint_dir`` (the pruned folder) with PEFT LoRA of
  ``model``'s rank, alpha, dropout and target modules, its adapters set to the draw
  our recipes start from (:func:`bench.peers.trl_common.load_our_adapter`; upstream's
  run gets the same one). fp32, CPU, torch's default threads.
* **Samples.** ``tokenizer`` and ``dataset`` instantiated by torchtune (prompts
  masked), torchtune's ``padded_collate_sft`` with an attention mask of the real
  tokens, upstream's sample order (``DistributedSampler(seed=0)``), ``batch_size``
  consecutive samples per micro-batch, ``gradient_accumulation_steps`` per step.
* **Loss.** ``lmbda=0`` (no student generation: the dataset's responses, offline
  distillation), ``beta=0`` (the generalized JSD is then the forward KL,
  KL(teacher || student), per response token), ``seq_kd=False``. The loss uses
  temperature 1 whatever ``GKDConfig.temperature`` (which only samples). TRL divides the
  summed KL by the step's label count (``num_items_in_batch``).
* **Optimizer.** The config's ``optimizer`` and ``lr_scheduler`` over the adapters,
  clipping at ``clip_grad_norm``.

Measured with the same probes as upstream's run: micro-batch tokens from the
collate, step ends from a ``TrainerCallback``, peak RSS from the first
micro-batch, the teacher's forward timed by hooks on the teacher module.
"""

import argparse
import atexit
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from bench.launch import IGNORE_INDEX, Probe
from bench.peers.probes import TeacherTimer
from bench.peers.trl_common import (
    EpochOrder,
    check_cpu_fp32,
    load_config,
    load_our_adapter,
    lora_config,
    make_step_callback,
)


def recording_collate(probe: Probe, pad_id: int, ga: int):
    """torchtune's ``padded_collate_sft`` plus an attention mask; records each micro-batch in ``probe``.

    A micro-batch's step is its position // ``ga``: the Trainer's loader fetches
    one batch ahead, so its time of collation would put it in the step before.
    """
    from torchtune.data import padded_collate_sft

    def collate(samples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        batch = padded_collate_sft(samples, padding_idx=pad_id, ignore_idx=IGNORE_INDEX)
        probe.micro_batch(samples, batch, step_index=len(probe.data["micro_batches"]) // ga)
        lengths = torch.tensor([len(s["tokens"]) for s in samples])
        mask = (torch.arange(batch["tokens"].size(1))[None, :] < lengths[:, None]).long()
        return {"input_ids": batch["tokens"], "attention_mask": mask, "labels": batch["labels"]}

    return collate


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.peers.trl_gkd")
    parser.add_argument("--out", required=True, type=Path, help="probe JSON (as bench.launch writes)")
    parser.add_argument("--config", required=True, help="upstream's distillation config (YAML)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    check_cpu_fp32(cfg, parser.prog)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    probe = Probe(args.out, "trl", "trl.experimental.gkd.GKDTrainer", list(argv))
    atexit.register(probe.write)

    import peft
    import transformers
    import trl
    from peft import get_peft_model
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torchtune import config as tt_config
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    register_optimizer_step_post_hook(probe.optimizer_step)
    probe.data.update(trl=trl.__version__, transformers=transformers.__version__, peft=peft.__version__)

    from datasets import Dataset

    tokenizer = tt_config.instantiate(cfg.tokenizer)
    # SFTTrainer takes a datasets.Dataset: torchtune's samples (token ids, masked labels) as its rows
    dataset = Dataset.from_list([{"tokens": s["tokens"], "labels": s["labels"]}
                                 for s in tt_config.instantiate(cfg.dataset, tokenizer)])
    seed, steps = int(cfg.seed), int(cfg.max_steps_per_epoch)
    ga, batch_size = int(cfg.gradient_accumulation_steps), int(cfg.batch_size)
    if steps * ga * batch_size > len(dataset):
        raise SystemExit(f"{parser.prog}: {steps} steps x {ga} x {batch_size} samples is more than the dataset's "
                         f"{len(dataset)}; one epoch only")

    teacher = LlamaForCausalLM.from_pretrained(str(cfg.teacher_checkpointer.checkpoint_dir), dtype=torch.float32)
    TeacherTimer(probe).attach(teacher)
    student = get_peft_model(
        LlamaForCausalLM.from_pretrained(str(cfg.checkpointer.checkpoint_dir), dtype=torch.float32),
        lora_config(cfg.model))
    probe.data["initial_adapter"] = {"seed": seed, "applied": load_our_adapter(student, cfg.model, seed)}
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = tt_config.instantiate(cfg.optimizer, trainable)
    scheduler = tt_config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps)

    step_losses: List[float] = []

    class BenchGKDTrainer(GKDTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return EpochOrder(len(dataset))

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            step_losses.append(float(loss))
            return loss

    targs = GKDConfig(
        output_dir=str(cfg.output_dir), per_device_train_batch_size=batch_size, gradient_accumulation_steps=ga,
        max_steps=steps, learning_rate=float(cfg.optimizer.lr), max_grad_norm=float(cfg.get("clip_grad_norm") or 0),
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed, dataloader_num_workers=0,
        remove_unused_columns=False, average_tokens_across_devices=True, disable_tqdm=True, bf16=False,
        lmbda=0.0, beta=0.0, seq_kd=False, max_length=int(cfg.tokenizer.max_seq_len),
    )
    trainer = BenchGKDTrainer(
        model=student, teacher_model=teacher, args=targs, train_dataset=dataset,
        data_collator=recording_collate(probe, tokenizer.pad_id, ga),
        processing_class=AutoTokenizer.from_pretrained(str(cfg.checkpointer.checkpoint_dir)),
        optimizers=(optimizer, scheduler),
        callbacks=[make_step_callback(probe, ga, step_losses, Path(str(cfg.output_dir)) / "logs" / "metrics.jsonl")],
    )
    trainer.train()


if __name__ == "__main__":
    sys.path.append(os.getcwd())
    main()
