"""Data: tokenizers, datasets checked sample by sample, and every optimizer step's samples.

* :mod:`~torchtune_ext.data.assets`: where the downloaded model and data live;
* :mod:`~torchtune_ext.data.tokenizer`: SmolLM2's tokenizer, the tokenizer check, the chat template a run trains on;
* :mod:`~torchtune_ext.data.hf_tokenizer`: any Hugging Face folder's tokenizer, in torchtune's interface;
* :mod:`~torchtune_ext.data.check`: one pass over a dataset: samples that would train on garbage or nothing;
* :mod:`~torchtune_ext.data.datasets`: datasets as a config names them, and their collators;
* :mod:`~torchtune_ext.data.step_loader`: the samples of every optimizer step, at any world size.

The names of the former ``torchtune_ext.data`` module are re-exported here.
"""

from torchtune_ext.data.datasets import (
    Sample,
    build_dataset,
    collate_as_pack,
    collate_packed,
    make_collate,
    masked_copy,
)
from torchtune_ext.data.step_loader import StepData, StepLoader, build_step_loader, epoch_order, plan_step

__all__ = ["Sample", "StepData", "StepLoader", "build_dataset", "build_step_loader", "collate_as_pack",
           "collate_packed", "epoch_order", "make_collate", "masked_copy", "plan_step"]
