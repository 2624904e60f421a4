"""A layer-pruned student of a Hugging Face Llama-style checkpoint, for the distillation demo.

The bundled student ``assets/SmolLM2-135M-Instruct-10L`` is the first 10 of
the teacher's 30 decoder layers, with its embedding, final norm and tokenizer
(depth pruning, as NVIDIA's Minitron does before distilling: the student
shares the teacher's vocabulary and starts close to it; Sreenivas et al.
2024, "LLM Pruning and Distillation in Practice: The Minitron Approach",
arXiv 2408.11796). Written by ``python -m torchtune_ext.download``.
"""

import json
import shutil
from pathlib import Path

# Files of a model folder that go to the student unchanged.
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE")


def build_layer_pruned(source: Path, dest: Path, num_layers: int) -> None:
    """Write into ``dest`` (which must not exist) the first ``num_layers`` decoder layers of ``source``.

    Args:
        source: a Hugging Face folder with ``config.json`` and one ``model.safetensors``
            (keys ``model.layers.<i>.*``).
        dest: the new folder: ``config.json`` with ``num_hidden_layers`` set,
            ``model.safetensors`` with layers ``0 .. num_layers - 1``, the tokenizer files.
        num_layers: layers kept, 1 to the source's count minus one.

    Raises:
        ValueError: ``num_layers`` out of range.
    """
    from safetensors.torch import load_file, save_file  # heavy (torch): only the download command pays

    config = json.loads((source / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers'] - 1}], got {num_layers}")
    state = load_file(source / "model.safetensors")
    kept = {k: v for k, v in state.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    dest.mkdir()
    save_file(kept, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2) + "\n")
    for name in COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    (dest / "README.md").write_text(
        f"# {dest.name}: the first {num_layers} of the {config['num_hidden_layers']} decoder layers of "
        f"{source.name}\n\nA student for the knowledge-distillation demo (docs/distillation.md), written by "
        "`python -m torchtune_ext.download` (torchtune_ext/tools/student.py): the same embedding, final norm "
        "and tokenizer; the license is the source model's (LICENSE).\n")
