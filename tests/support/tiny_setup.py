"""A tiny, self-contained training setup the real recipes can run in seconds.

Writes into a folder: a byte-level BPE ``tokenizer.json`` with SmolLM2's three
special tokens (259 ids), a random 2-layer Llama as an HF checkpoint, an
Alpaca-format JSON dataset whose records have very different lengths (so the
per-micro-batch normalization visibly differs from the exact one), and a
recipe config pointing at them. Nothing from ``assets/`` is needed.
"""

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torchtune.models import convert_weights
from torchtune.models.llama3_2 import llama3_2

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DIM, HEADS, KV_HEADS, LAYERS, HIDDEN, MAX_SEQ_LEN = 32, 4, 2, 2, 64, 512
WORDS = "the a model learns every token step batch data rank sum mean loss count grad norm".split()


def write_tokenizer(folder: Path) -> int:
    """Byte-level BPE without merges: one id per byte after the special tokens. Returns the vocab size."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIAL[1], "eos_token": SPECIAL[0]}))
    return len(vocab)


def write_checkpoint(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """Random tiny llama3_2 weights in HF layout, with the config.json torchtune's HF checkpointer reads."""
    torch.manual_seed(seed)
    model = llama3_2(vocab_size=vocab_size, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                     embed_dim=DIM, max_seq_len=MAX_SEQ_LEN, intermediate_dim=HIDDEN)
    # torchtune initializes embeddings with std 1, which with the tied output gives
    # logits so large the loss starts near 30 nats; std 0.02 starts near ln(vocab)
    torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
    hf = convert_weights.tune_to_hf(model.state_dict(), num_heads=HEADS, num_kv_heads=KV_HEADS, dim=DIM)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM,
        "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": DIM // HEADS, "vocab_size": vocab_size,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }))


def write_dataset(path: Path, num_samples: int, seed: int = 0) -> None:
    """Alpaca records; answers from 1 to 40 words, so trainable tokens per sample vary ~30x."""
    rng = random.Random(seed)
    records = []
    for i in range(num_samples):
        answer_words = 1 if i % 3 == 0 else rng.randint(5, 40)
        records.append({
            "instruction": " ".join(rng.choices(WORDS, k=rng.randint(2, 12))),
            "input": "",
            "output": " ".join(rng.choices(WORDS, k=answer_words)),
        })
    path.write_text(json.dumps(records))


def write_tiny_setup(root: Path, num_samples: int = 16, metric_logger: bool = True) -> Path:
    """Write tokenizer, checkpoint, data and config under ``root``; returns the config path."""
    ckpt = root / "tiny_model"
    ckpt.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(ckpt)
    write_checkpoint(ckpt, vocab_size)
    write_dataset(root / "data.json", num_samples)
    logger = (
        "metric_logger:\n  _component_: torchtune.training.metric_logging.WandBLogger\n"
        "  project: parity-test\n  mode: offline\n  log_dir: ${output_dir}/logs\n"
        if metric_logger else "metric_logger: null\n"
    )
    config = root / "tiny.yaml"
    config.write_text(f"""\
output_dir: {root / 'out'}
model:
  _component_: torchtune.models.llama3_2.llama3_2
  vocab_size: {vocab_size}
  num_layers: {LAYERS}
  num_heads: {HEADS}
  num_kv_heads: {KV_HEADS}
  embed_dim: {DIM}
  max_seq_len: {MAX_SEQ_LEN}
  intermediate_dim: {HIDDEN}
tokenizer:
  _component_: torchtune_ext.data.tokenizer.smollm2_tokenizer
  path: {ckpt}
  max_seq_len: {MAX_SEQ_LEN}
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  source: json
  data_files: {root / 'data.json'}
  split: train
  train_on_input: false
  packed: false
seed: 7
shuffle: true
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {ckpt}
  checkpoint_files: [model.safetensors]
  model_type: LLAMA3_2
  output_dir: ${{output_dir}}
batch_size: 2
gradient_accumulation_steps: 1
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-3
loss:
  _component_: torchtune_ext.train.loss.SummedCrossEntropyLoss
  num_output_chunks: 2
clip_grad_norm: 1.0
device: cpu
dtype: fp32
{logger}""")
    return config
