"""Preference pairs through torchtune's preference_dataset, checked, as one step-loader sample each."""

import json

import pytest
from omegaconf import OmegaConf
from torchtune.data import Message

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


def _tokenizer(tmp_path):
    write_tokenizer(tmp_path)
    return smollm2_tokenizer(str(tmp_path / "tokenizer.json"), max_seq_len=64)


def _messages(question, answer, system=None):
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


TORCHTUNE_RECORDS = [{"chosen": _messages(f"question {i}", f"good {i}", "be kind" if i == 1 else None),
                      "rejected": _messages(f"question {i}", f"bad answer {i}", "be kind" if i == 1 else None)}
                     for i in range(3)]


def _write(path, records):
    """JSON (a list), JSON Lines or Parquet, by the suffix."""
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(records).to_parquet(path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _dataset_cfg(path, component="torchtune_ext.data.preference.preference_dataset", **extra):
    source = "parquet" if path.suffix == ".parquet" else "json"
    return OmegaConf.create({"_component_": component, "source": source, "data_files": str(path), "split": "train",
                             **extra})


def _items(cfg, tokenizer):
    return [dict(p) for p in build_pair_dataset(cfg, tokenizer, ignore_index=IGNORE).dataset]


@pytest.mark.parametrize("options", [{}, {"train_on_input": True}, {"new_system_prompt": "be brief"}])
def test_our_preference_dataset_reads_torchtunes_records_as_torchtune_does(tmp_path, options):
    """chosen/rejected message lists (a system message in one): the same token ids and labels as torchtune's own
    preference_dataset, with and without train_on_input and new_system_prompt."""
    from torchtune import config as tt_config

    tokenizer = _tokenizer(tmp_path)
    path = _write(tmp_path / "pairs.jsonl", TORCHTUNE_RECORDS)
    theirs = tt_config.instantiate(_dataset_cfg(path, "torchtune.datasets.preference_dataset", **options), tokenizer)
    assert _items(_dataset_cfg(path, **options), tokenizer) == [dict(theirs[i]) for i in range(len(theirs))]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
@pytest.mark.parametrize("conversational", [False, True])
def test_trls_preference_format_loads_as_the_equivalent_message_lists(tmp_path, suffix, conversational):
    """TRL's rows, prompt apart: strings (the prompt a user turn, the responses assistant turns) or message lists
    (TRL's conversational format), from JSON, JSON Lines and Parquet, give the token ids and labels of the same
    pairs written as torchtune's message lists (the prompt trained on nowhere); through torchtune's
    preference_dataset component too, which the pair loader builds with ours."""
    tokenizer = _tokenizer(tmp_path)
    want = _items(_dataset_cfg(_write(tmp_path / "tt.jsonl", TORCHTUNE_RECORDS[:1] + TORCHTUNE_RECORDS[2:])),
                  tokenizer)
    if conversational:
        rows = [{"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:], "rejected": r["rejected"][-1:]}
                for r in TORCHTUNE_RECORDS]
    else:
        rows = [{"prompt": r["chosen"][-2]["content"], "chosen": r["chosen"][-1]["content"],
                 "rejected": r["rejected"][-1]["content"]} for r in TORCHTUNE_RECORDS]
    rows = rows[:1] + rows[2:]  # the record with a system message: in the conversational test below
    path = _write(tmp_path / f"trl{suffix}", rows)
    assert _items(_dataset_cfg(path), tokenizer) == want
    assert _items(_dataset_cfg(path, "torchtune.datasets.preference_dataset"), tokenizer) == want
    prompt_len = len(tokenizer.tokenize_messages([Message("user", rows[0]["prompt"] if not conversational
                                                          else rows[0]["prompt"][0]["content"])])[0])
    assert want[0]["chosen_labels"][:prompt_len] == [IGNORE] * prompt_len


def test_trls_conversational_prompt_keeps_its_system_message_and_column_map_renames(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    want = _items(_dataset_cfg(_write(tmp_path / "tt.jsonl", TORCHTUNE_RECORDS)), tokenizer)
    rows = [{"question": r["chosen"][:-1], "good": r["chosen"][-1]["content"], "bad": r["rejected"][-1]["content"]}
            for r in TORCHTUNE_RECORDS]
    cfg = _dataset_cfg(_write(tmp_path / "trl.jsonl", rows),
                       column_map={"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert _items(cfg, tokenizer) == want
    with pytest.raises(ConfigError, match="record 0 of .* has no column 'context'.*column_map"):
        _items(_dataset_cfg(tmp_path / "trl.jsonl", column_map={"prompt": "context", "chosen": "good",
                                                                "rejected": "bad"}), tokenizer)
    with pytest.raises(ConfigError, match="column_map keys must be among prompt, chosen, rejected, got answer"):
        _items(_dataset_cfg(tmp_path / "trl.jsonl", column_map={"answer": "good"}), tokenizer)


def test_strings_without_a_prompt_are_refused_in_one_line(tmp_path):
    """TRL's implicit-prompt strings (the prompt inside chosen and rejected): where the prompt ends is unknown."""
    tokenizer = _tokenizer(tmp_path)
    path = _write(tmp_path / "implicit.jsonl", [{"chosen": "Q? yes", "rejected": "Q? no"}])
    with pytest.raises(ConfigError) as err:
        _items(_dataset_cfg(path, "torchtune.datasets.preference_dataset"), tokenizer)
    message = str(err.value)
    assert err.value.key == "dataset" and "\n" not in message
    assert "record 0 of" in message and "'chosen' is a string and the record has no 'prompt'" in message
