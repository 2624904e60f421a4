"""Preference pairs through torchtune's preference_dataset, checked, as one step-loader sample each."""

import json

import pytest
from omegaconf import OmegaConf

from tests.support.helpers import IGNORE
from tests.support.tiny_setup import write_tokenizer
from torchtune_ext.data.check import ModelVocabulary
from torchtune_ext.data.preference import PairDataset, build_pair_dataset, check_pairs, collate_pairs, pair_sample
from torchtune_ext.data.step_loader import StepLoader
from torchtune_ext.data.tokenizer import smollm2_tokenizer
from torchtune_ext.errors import ConfigError


def pair(i: int, chosen: int, rejected: int, prompt: int = 3):
    tokens = list(range(10 * i, 10 * i + prompt))
    return {"chosen_input_ids": tokens + [1] * chosen, "chosen_labels": [IGNORE] * prompt + [1] * chosen,
            "rejected_input_ids": tokens + [2] * rejected, "rejected_labels": [IGNORE] * prompt + [2] * rejected}


def test_collate_puts_the_chosen_rows_first_and_counts_real_tokens():
    samples = [pair_sample(pair(0, 2, 4)), pair_sample(pair(1, 1, 1))]
    batch = collate_pairs(samples, padding_idx=0, ignore_idx=IGNORE)
    assert batch["tokens"].shape == (4, 7)
    assert batch["lengths"].tolist() == [5, 4, 7, 4]  # chosen 0, chosen 1, rejected 0, rejected 1
    assert batch["tokens"][0].tolist() == [0, 1, 2, 1, 1, 0, 0]
    assert batch["labels"][2].tolist() == [IGNORE] * 3 + [2] * 4
    assert batch["labels"][3].tolist() == [IGNORE] * 3 + [2] + [IGNORE] * 3


@pytest.mark.parametrize("world", [1, 2])
def test_every_pair_is_in_one_micro_batch_of_one_step(world):
    """7 pairs, batch 2 x accumulation 2 per rank: no pair dropped or split, the short last step kept."""
    dataset = PairDataset([pair(i, 1 + i % 3, 2) for i in range(7)])
    loaders = [StepLoader(dataset, lambda s: collate_pairs(s, 0, IGNORE), batch_size=2,
                          gradient_accumulation_steps=2 if world == 1 else 1, dp_rank=r, dp_world_size=world,
                          shuffle=True, seed=3) for r in range(world)]
    seen, per_step = [], []
    for steps in zip(*(loader.epoch(0) for loader in loaders)):
        in_step = 0
        for step in steps:
            for batch in step.micro_batches:
                rows = batch["tokens"].size(0) // 2
                for k in range(rows):  # a pair's two rows share their prompt
                    assert batch["tokens"][k, :3].tolist() == batch["tokens"][rows + k, :3].tolist()
                    if (batch["labels"][k] != IGNORE).any():
                        seen.append(batch["tokens"][k, 0].item() // 10)
                        in_step += 1
        per_step.append(in_step)
    assert sorted(seen) == list(range(7))
    assert per_step == [4, 3]


def test_check_pairs_refuses_what_cannot_train():
    with pytest.raises(ConfigError, match="not a preference dataset"):
        check_pairs([{"tokens": [1], "labels": [1]}], "dataset", ignore_index=IGNORE)
    with pytest.raises(ConfigError, match="pair 1: the rejected response has no trainable token"):
        check_pairs([pair(0, 2, 2), pair(1, 2, 0)], "dataset", ignore_index=IGNORE)
    with pytest.raises(ConfigError, match="pair 0: the chosen sequence has 9 tokens, more than the model's 8"):
        check_pairs([pair(0, 6, 2)], "dataset", ignore_index=IGNORE, model_max_seq_len=8)


def test_token_ids_are_checked_against_the_embedding_on_both_responses(tmp_path):
    """The SFT data's check (check_token_ids) on pairs: the largest id of either response against the rows.
    A rejected response's id is found as well as a chosen one's; an id equal to the rows is refused, one below
    is not (ids 0..rows-1)."""
    write_tokenizer(tmp_path)
    tokenizer = smollm2_tokenizer(str(tmp_path / "tokenizer.json"), max_seq_len=64)
    records = [{side: [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"{side} {i}"}]
                for side in ("chosen", "rejected")} for i in range(2)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.preference_dataset", "source": "json",
                            "data_files": str(path), "split": "train"})
    pairs = build_pair_dataset(cfg, tokenizer).dataset
    report = check_pairs(pairs, "dataset", ignore_index=IGNORE)
    top = report.max_token_id
    assert top == max(max(p["chosen_input_ids"] + p["rejected_input_ids"]) for p in pairs)
    build_pair_dataset(cfg, tokenizer, vocabulary=ModelVocabulary(top + 1, "m", "t"))  # fits: no error
    with pytest.raises(ConfigError) as err:
        build_pair_dataset(cfg, tokenizer, vocabulary=ModelVocabulary(top, "tiny_llama", "the tokenizer 'tok'"))
    assert err.value.key == "tokenizer" and "\n" not in str(err.value)
    assert (f"gives token id {top} (dataset '{path}', sample {report.max_token_at}), but the model 'tiny_llama' has "
            f"{top} token embeddings") in str(err.value)

    rejected_only = [pair(0, 2, 2), dict(pair(1, 2, 2), rejected_input_ids=[0, 1, 2, 2, 999])]
    assert check_pairs(rejected_only, "dataset", ignore_index=IGNORE).max_token_id == 999
    assert check_pairs(rejected_only, "dataset", ignore_index=IGNORE).max_token_at == 1


def test_torchtunes_preference_dataset_from_a_local_file(tmp_path):
    """chosen/rejected message lists in JSONL, as torchtune's preference_dataset reads them (prompt masked)."""
    write_tokenizer(tmp_path)
    tokenizer = smollm2_tokenizer(str(tmp_path / "tokenizer.json"), max_seq_len=64)
    records = [{side: [{"role": "user", "content": f"question {i}"},
                       {"role": "assistant", "content": f"{side} answer {i}"}] for side in ("chosen", "rejected")}
               for i in range(3)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.preference_dataset", "source": "json",
                            "data_files": str(path), "split": "train"})
    dataset = build_pair_dataset(cfg, tokenizer, ignore_index=IGNORE)
    assert len(dataset) == 3
    sample = dataset[1]
    chosen, rejected = sample["tokens"][:sample["chosen_len"]], sample["tokens"][sample["chosen_len"]:]
    assert tokenizer.decode(chosen).endswith("chosen answer 1\n")
    assert "rejected answer 1" in tokenizer.decode(rejected)
    labels = sample["labels"][:sample["chosen_len"]]
    trained = tokenizer.decode([t for t in labels if t != IGNORE])
    assert labels[0] == IGNORE and trained.endswith("chosen answer 1\n") and "question" not in trained

    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    with pytest.raises(ConfigError, match="record 0 of .* has no column 'chosen'.*column_map"):
        build_pair_dataset(OmegaConf.create({"_component_": "torchtune.datasets.preference_dataset", "source": "json",
                                             "data_files": str(plain), "split": "train"}), tokenizer)
