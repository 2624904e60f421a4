"""A Hugging Face ``Trainer`` baseline on the data and weights our recipes use.

    python -m bench.hf_trainer --out <dir/probe.json> --config configs/smollm2/135M_full_single_device.yaml \
        [key=value ...]

Not a training entry point: the benchmark (``python -m bench``) starts it for
the ``hf_trainer`` variant, with the same ``key=value`` overrides as our
recipes; the keys it uses are listed in :func:`main`, the others are ignored.

What is kept equal to our full fine-tune recipe, so that step times compare:

* **Weights**: ``LlamaForCausalLM`` from the checkpoint folder our config's
  checkpointer reads (an HF safetensors folder), fp32 on CPU.
* **Token ids**: the config's ``tokenizer`` and ``dataset`` instantiated with
  torchtune's ``config.instantiate`` (prompts masked with -100 labels), and
  torchtune's ``padded_collate_sft`` (right padding, -100 labels) as the collate.
* **Sample order**: optimizer step ``k`` trains on samples ``32k .. 32k+31`` of
  ``DistributedSampler(seed=0, shuffle=True)``'s permutation (one replica),
  ``batch_size`` consecutive ones per micro-batch: ours with
  ``group_by_length=false`` arranges a step the same way on one device.
* **Optimizer**: the config's ``optimizer`` and ``lr_scheduler`` instantiated
  over all parameters (HF's default would exempt biases and norms from weight
  decay), gradient clipping at ``clip_grad_norm``.
* **Loss**: HF's token-normalized loss: every micro-batch's summed loss is
  divided by the step's label count (``num_items_in_batch``), and
  ``average_tokens_across_devices`` is on.
* **Threads**: torch's default, as in our runs.

Measured with the same :class:`bench.launch.Probe` as the recipes: the
collate records each micro-batch's tokens, a ``TrainerCallback`` marks every
optimizer step's end (wall time, peak RSS since the first micro-batch), and
``<output_dir>/logs/metrics.jsonl`` gets one record per step (loss, grad norm,
label tokens after the shift), the shape our recipes write, so
:func:`bench.runner.read_run` reads it like theirs.
"""

import argparse
import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from bench.launch import IGNORE_INDEX, Probe


def _epoch_order(size: int, seed: int) -> List[int]:
    from torchtune_ext.data.step_loader import epoch_order

    return epoch_order(size, 0, seed, True)


def recording_collate(probe: Probe, pad_id: int, ga: int):
    """torchtune's ``padded_collate_sft`` for the Trainer, recording each micro-batch in ``probe``.

    A micro-batch's optimizer step is its position // ``ga``, not the steps
    finished when it is collated (what the probe records for the recipes):
    the Trainer's data loader (accelerate's) fetches one batch ahead, so the
    first micro-batch of step k + 1 is collated before step k ends.
    Attributing it by time moved one sample per step into the step before.
    """
    from torchtune.data import padded_collate_sft

    def collate(samples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        batch = padded_collate_sft(samples, padding_idx=pad_id, ignore_idx=IGNORE_INDEX)
        probe.micro_batch(samples, batch, step_index=len(probe.data["micro_batches"]) // ga)
        # right padding under a causal mask: real tokens never see the padding, so no attention mask
        return {"input_ids": batch["tokens"], "labels": batch["labels"]}

    return collate


def _load_config(path: str, overrides: Sequence[str]):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    # the recipes' own keys only; e.g. metric_logger._component_ would not apply here
    known = [o for o in overrides if o.split("=", 1)[0].split(".")[0] in cfg or o.startswith("output_dir=")]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(known))


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.hf_trainer")
    parser.add_argument("--out", required=True, type=Path, help="probe JSON (as bench.launch writes)")
    parser.add_argument("--config", required=True, help="our full single-device config (YAML)")
    args, overrides = parser.parse_known_args(argv)
    cfg = _load_config(args.config, overrides)
    if str(cfg.get("device", "cpu")) not in ("cpu", "auto") or str(cfg.get("dtype", "fp32")) != "fp32":
        raise SystemExit("bench.hf_trainer: only device=cpu, dtype=fp32 are supported")

    probe = Probe(args.out, "hf", "transformers.Trainer", list(argv))
    atexit.register(probe.write)

    import transformers
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torchtune import config as tt_config
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    register_optimizer_step_post_hook(probe.optimizer_step)
    probe.data["transformers"] = transformers.__version__

    tokenizer = tt_config.instantiate(cfg.tokenizer)
    dataset = tt_config.instantiate(cfg.dataset, tokenizer)
    seed = int(cfg.seed)
    steps = int(cfg.max_steps_per_epoch)
    ga = int(cfg.gradient_accumulation_steps)
    batch_size = int(cfg.batch_size)
    if steps * ga * batch_size > len(dataset):
        # a second epoch would start with a short step: position // GA would no longer
        # give a micro-batch's step, and our recipes would train other samples by then
        raise SystemExit(f"bench.hf_trainer: {steps} steps x {ga} x {batch_size} samples is more than the "
                         f"dataset's {len(dataset)}; one epoch only")

    collate = recording_collate(probe, tokenizer.pad_id, ga)

    class StepOrder(torch.utils.data.Sampler):
        """Our recipes' epoch order (``DistributedSampler``'s permutation of one replica)."""

        def __init__(self, size: int):
            self.order = _epoch_order(size, seed)

        def __iter__(self):
            return iter(self.order)

        def __len__(self):
            return len(self.order)

    class BenchTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return StepOrder(len(dataset))

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            # with num_items_in_batch, each micro-batch's loss is already divided by the
            # step's label count: their sum is the step's loss
            step_losses.append(float(loss))
            return loss

    step_losses: List[float] = []
    records: List[Dict[str, Any]] = []
    log_dir = Path(str(cfg.output_dir)) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = open(log_dir / "metrics.jsonl", "w")

    class StepProbe(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            probe.step_end()
            k = state.global_step
            window = probe.data["micro_batches"][(k - 1) * ga:k * ga]
            ends = probe.data["step_ends"]
            records.append({
                "step": k, "loss": sum(step_losses), "num_tokens": sum(mb["trainable_tokens"] for mb in window),
                "step_seconds": ends[-1]["time"] - ends[-2]["time"] if len(ends) > 1 else None,
            })
            step_losses.clear()

        def on_log(self, targs, state, control, logs=None, **kwargs):
            logs = logs or {}
            if records and "loss" in logs:
                records[-1]["hf_logged_loss"] = logs.get("loss")
                records[-1]["grad_norm"] = logs.get("grad_norm")
                metrics_file.write(json.dumps(records[-1]) + "\n")
                metrics_file.flush()

    model = LlamaForCausalLM.from_pretrained(str(cfg.checkpointer.checkpoint_dir), dtype=torch.float32)
    optimizer = tt_config.instantiate(cfg.optimizer, model.parameters())
    scheduler = tt_config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps)
    targs = TrainingArguments(
        output_dir=str(cfg.output_dir), per_device_train_batch_size=batch_size, gradient_accumulation_steps=ga,
        max_steps=steps, learning_rate=float(cfg.optimizer.lr), max_grad_norm=float(cfg.get("clip_grad_norm") or 0),
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed, dataloader_num_workers=0,
        remove_unused_columns=False, average_tokens_across_devices=True, disable_tqdm=True,
    )
    trainer = BenchTrainer(model=model, args=targs, train_dataset=dataset, data_collator=collate,
                           optimizers=(optimizer, scheduler), callbacks=[StepProbe()])
    trainer.train()
    metrics_file.close()


if __name__ == "__main__":
    sys.path.append(os.getcwd())
    main()
