"""A layer-pruned student of a Llama-style Hugging Face model (Minitron-style depth pruning).

    python -m bench.peers.student --layers 10 --out outputs/peers/SmolLM2-135M-Instruct-10L \
        [--teacher assets/SmolLM2-135M-Instruct]

The student keeps the teacher's token embedding, its first ``--layers`` decoder
layers, its final norm and its (tied) output head, unchanged: a depth-pruned
copy, as Minitron prunes depth before distilling (Sreenivas et al. 2024, "LLM
Pruning and Distillation in Practice: The Minitron Approach"). Which layers to
keep is the simplest choice, the first ones; Minitron ranks layers by how much
dropping each changes the output, which needs data and a forward per layer.

The output is an ordinary Hugging Face folder: ``model.safetensors`` (fp32, the
teacher's tensor names minus the dropped layers), ``config.json`` with
``num_hidden_layers`` set, and the teacher's tokenizer and generation files
copied, so ``LlamaForCausalLM.from_pretrained``, torchtune's
``FullModelHFCheckpointer`` (model type ``LLAMA3_2``) and our tokenizer builder
read it as they read the teacher.

Self-contained on purpose (torch and safetensors only): the distillation
recipe's asset step is to take it over as it is.
"""

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple

import torch
from safetensors.torch import load_file, save_file

# Files of a Hugging Face model folder that describe the tokenizer and generation, copied as they are.
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "LICENSE")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def prune_layers(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                 layers: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The state dict and config of the first ``layers`` decoder layers of a Llama-style model.

    Args:
        state_dict: the teacher's tensors by Hugging Face name (``model.embed_tokens.weight``,
            ``model.layers.<i>.…``, ``model.norm.weight``, and ``lm_head.weight`` unless tied).
        config: the teacher's ``config.json`` as a dict; needs ``num_hidden_layers``.
        layers: decoder layers to keep, ``1 <= layers <= num_hidden_layers``; layers
            ``0 .. layers - 1`` are kept.

    Returns:
        ``(tensors, config)``: every tensor outside ``model.layers.<i>`` with ``i >= layers``
        (the same tensor objects, not copies), and a copy of ``config`` with
        ``num_hidden_layers = layers``.

    Raises:
        ValueError: ``layers`` out of range, or the state dict's layer indices do not
            match ``num_hidden_layers`` (not the folder its config describes).
    """
    total = int(config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be between 1 and the teacher's {total} layers, got {layers}")
    found = {int(m.group(1)) for name in state_dict if (m := _LAYER.match(name))}
    if found != set(range(total)):
        raise ValueError(f"the state dict has layers {sorted(found)[:3]}...{sorted(found)[-3:]}, its config says "
                         f"num_hidden_layers={total}: not the same model")
    kept = {name: tensor for name, tensor in state_dict.items()
            if not ((m := _LAYER.match(name)) and int(m.group(1)) >= layers)}
    return kept, {**config, "num_hidden_layers": layers}


def write_student(teacher_dir: Path, out_dir: Path, layers: int) -> Path:
    """Write the pruned student of the HF folder ``teacher_dir`` into ``out_dir`` (created); returns ``out_dir``.

    Reads ``model.safetensors`` (one file; a sharded teacher is not supported) and
    ``config.json``; writes both pruned (see :func:`prune_layers`) and copies
    :data:`COPIED_FILES` that exist.

    Raises:
        FileNotFoundError: ``teacher_dir`` lacks ``model.safetensors`` or ``config.json``.
        ValueError: as :func:`prune_layers`.
    """
    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    for name in ("model.safetensors", "config.json"):
        if not (teacher_dir / name).is_file():
            raise FileNotFoundError(f"{teacher_dir / name} not found: the teacher must be a Hugging Face folder "
                                    "with a single model.safetensors")
    config = json.loads((teacher_dir / "config.json").read_text())
    tensors, student_config = prune_layers(load_file(str(teacher_dir / "model.safetensors")), config, layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    # contiguous copies: safetensors refuses tensors that share storage
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(student_config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (teacher_dir / name).is_file():
            shutil.copyfile(teacher_dir / name, out_dir / name)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.student", description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, default=Path("assets/SmolLM2-135M-Instruct"),
                        help="teacher HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers the student keeps (default 10)")
    parser.add_argument("--out", type=Path, required=True, help="student folder to write")
    args = parser.parse_args(argv)
    out = write_student(args.teacher, args.out, args.layers)
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    print(f"student: first {args.layers} layers of {args.teacher} -> {out} ({size:.0f} MiB)")


if __name__ == "__main__":
    main()
