"""Which of transformers' causal LMs can train on packed rows: :func:`torchtune_ext.model.hf.packing.packing_refusal`
applied to every model type transformers maps to a causal LM.

    python bench/packing_sweep.py [bench/results/packing_sweep.md]

Each model is built from its config's defaults on the meta device (no memory,
no weights, nothing downloaded); a model type that cannot be built so (remote
code, a missing optional dependency, a config that needs values) is listed
as not built. Writes a markdown table (docs/models.md quotes its summary).
"""

import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from torchtune_ext.model.hf.packing import cross_document_mixers, decoder_stack, mask_without_positions, mixer_kind


def classify(model_type: str):
    """``(verdict, detail)``: ``packs``, ``mixes tokens outside attention`` or ``mask without positions``."""
    config = AutoConfig.for_model(model_type)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    mixers = cross_document_mixers(model)
    # the default config may leave out the layers a checkpoint has (LFM2's defaults are all attention): the
    # modeling module's classes count too
    module = sys.modules[type(model).__module__]
    for name, cls in vars(module).items():
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and not issubclass(cls, PreTrainedModel) \
                and cls.__module__ == module.__name__ and mixer_kind(cls) and name not in dict(mixers):
            mixers.append((name, mixer_kind(cls)))
    if mixers:
        return "mixes tokens outside attention", ", ".join(f"{name} ({kind})" for name, kind in mixers)
    why = mask_without_positions(decoder_stack(model))
    if why:
        return "mask without positions", why
    return "packs", ""


def main(out: Path) -> None:
    rows, counts = [], defaultdict(int)
    start = time.perf_counter()
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            verdict, detail = classify(model_type)
        except Exception as err:  # noqa: BLE001 -- listed, the sweep goes on
            verdict, detail = "not built", f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
        counts[verdict] += 1
        rows.append(f"| {model_type} | {verdict} | {detail} |")
        print(rows[-1], flush=True)
    summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Packing: transformers {transformers.__version__}'s causal LMs\n\n"
                   f"{len(rows)} model types in {time.perf_counter() - start:.0f} s: {summary}.\n\n"
                   "| model_type | verdict | why |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    print(summary)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/packing_sweep.md"))
