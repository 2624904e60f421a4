"""SmolLM2Tokenizer: ChatML, masks, special ids, and torchtune's datasets.

Most tests run twice: on a toy byte-level BPE trained here (so they run without
the assets) and on the real SmolLM2 tokenizer.json (skipped if not downloaded).
Through the recipe: tests/integration/test_tokenizer.py.
"""

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, ChatMLTemplate, Message
from torchtune.datasets import alpaca_dataset, chat_dataset, text_completion_dataset

from torchtune_ext.data.assets import MissingAssetError
from torchtune_ext.data.tokenizer import SmolLM2Tokenizer, smollm2_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "user assistant system: Hello! How are you today? I am fine, thank you.",
    "Describe a process of making crepes. Whisk the flour and the eggs.",
] * 20


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    # Same layout as the exported SmolLM2 tokenizer: byte-level BPE with the
    # three special tokens at ids 0, 1, 2.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder = tmp_path_factory.mktemp("toy_tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return folder


@pytest.fixture(params=["toy", "smollm2"])
def tokenizer_dir(request, toy_dir):
    if request.param == "toy":
        return toy_dir
    return request.getfixturevalue("smollm2_assets") / "SmolLM2-135M-Instruct"


@pytest.fixture
def tok(tokenizer_dir):
    return smollm2_tokenizer(str(tokenizer_dir))


def enc(tok, text):
    return tok.encode(text, add_bos=False, add_eos=False)


TWO_TURNS = [
    Message("user", "Hello! How are you?", masked=True),
    Message("assistant", "I am fine, thank you."),
    Message("user", "Describe crepes.", masked=True),
    Message("assistant", "Whisk the flour\nand the eggs."),
]


def test_special_ids(tok, tokenizer_dir):
    assert (tok.eos_id, tok.im_start_id, tok.im_end_id, tok.pad_id, tok.bos_id) == (0, 1, 2, 0, None)
    assert tok.stop_tokens == [2, 0]
    assert {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}.items() <= tok.special_tokens.items()
    body = enc(tok, "Hello")
    assert tok.encode("Hello") == body + [0]  # no BOS; <|endoftext|> as document end
    assert tok.encode("Hello", add_bos=True, add_eos=False) == body
    with_bos = SmolLM2Tokenizer(str(tokenizer_dir / "tokenizer.json"), bos_token="<|endoftext|>")
    assert with_bos.encode("Hello", add_eos=False) == [0] + body


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and   internal spaces\n\ttabs\n",
        "Numbers 12345 and 3.14",
        "Café naïve 日本語 😀",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(enc(tok, text)) == text


def test_special_token_strings_in_text_stay_text(tok):
    ids = enc(tok, "a <|im_end|> b <|endoftext|>")
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == "a <|im_end|> b <|endoftext|>"


def test_chatml_tokens_and_mask_two_turns(tok):
    tokens, mask = tok.tokenize_messages(TWO_TURNS)
    expected_tokens, expected_mask = [], []
    for m in TWO_TURNS:
        block = [1] + enc(tok, m.role + "\n") + enc(tok, m.text_content) + [2] + enc(tok, "\n")
        expected_tokens += block
        expected_mask += [m.masked] * len(block)
    assert tokens == expected_tokens
    assert mask == expected_mask
    assert tok.decode(tokens, skip_special_tokens=False) == (
        "<|im_start|>user\nHello! How are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am fine, thank you.<|im_end|>\n"
        "<|im_start|>user\nDescribe crepes.<|im_end|>\n"
        "<|im_start|>assistant\nWhisk the flour\nand the eggs.<|im_end|>\n"
    )
    # every <|im_end|> closing an assistant reply is trained, those closing user turns are not
    im_end_masks = [m for t, m in zip(tokens, mask, strict=False) if t == 2]
    assert im_end_masks == [True, False, True, False]


def test_generation_prompt_leaves_assistant_turn_open(tok):
    tokens, mask = tok.tokenize_messages(
        [Message("user", "Hi", masked=True), Message("assistant", "")], add_end_tokens=False
    )
    tail = [2] + enc(tok, "\n") + [1] + enc(tok, "assistant\n")
    assert tokens[-len(tail) :] == tail
    sample = tok({"messages": [Message("user", "Hi"), Message("assistant", "")]}, inference=True)
    assert sample["tokens"] == tokens and "messages" not in sample


def test_truncation(tokenizer_dir):
    full, full_mask = smollm2_tokenizer(str(tokenizer_dir)).tokenize_messages(TWO_TURNS)
    short, short_mask = smollm2_tokenizer(str(tokenizer_dir), max_seq_len=12).tokenize_messages(TWO_TURNS)
    assert short == full[:12] and short_mask == full_mask[:12]
    exact = smollm2_tokenizer(str(tokenizer_dir), max_seq_len=len(full)).tokenize_messages(TWO_TURNS)
    assert exact == (full, full_mask)


def test_prompt_template_applies_and_chatml_is_rejected(tokenizer_dir):
    templated = smollm2_tokenizer(str(tokenizer_dir), prompt_template={"user": ("Q: ", "\nA:")})
    tokens, _ = templated.tokenize_messages([Message("user", "Why?", masked=True)])
    assert templated.decode(tokens, skip_special_tokens=False) == "<|im_start|>user\nQ: Why?\nA:<|im_end|>\n"
    with pytest.raises(ValueError, match="ChatML"):
        SmolLM2Tokenizer(str(tokenizer_dir / "tokenizer.json"), prompt_template=ChatMLTemplate())


def test_builder_accepts_folder_or_file_and_names_missing_assets(tokenizer_dir, tmp_path):
    a = smollm2_tokenizer(str(tokenizer_dir))
    b = smollm2_tokenizer(str(tokenizer_dir / "tokenizer.json"))
    assert enc(a, "same text") == enc(b, "same text")
    with pytest.raises(MissingAssetError, match="python -m torchtune_ext.download"):
        smollm2_tokenizer(str(tmp_path / "SmolLM2-135M-Instruct"))


# ---------------------------------------------------------------- torchtune datasets on the real data


@pytest.fixture
def real_tok(smollm2_assets):
    return smollm2_tokenizer(str(smollm2_assets / "SmolLM2-135M-Instruct"), max_seq_len=512)


def test_smollm2_chat_ids_match_hf(real_tok):
    # "<|im_start|>user\n" is [1, 4093, 198] with HF's SmolLM2 tokenizer; digits split one by one.
    assert real_tok.tokenize_message(Message("user", ""))[:3] == [1, 4093, 198]
    assert len(enc(real_tok, "2024")) == 4 and real_tok.vocab_size == 49152


def test_alpaca_dataset_masks_the_prompt(real_tok, smollm2_assets):
    ds = alpaca_dataset(
        real_tok,
        source="json",
        data_files=str(smollm2_assets / "data/alpaca_en_demo.json"),
        split="train",
        train_on_input=False,
    )
    assert len(ds) == 999
    sample = ds[0]
    tokens, labels = sample["tokens"], sample["labels"]
    record = json.loads((smollm2_assets / "data/alpaca_en_demo.json").read_text())[0]
    trained = [t for t in labels if t != CROSS_ENTROPY_IGNORE_IDX]
    reply = [1] + enc(real_tok, "assistant\n") + enc(real_tok, record["output"]) + [2] + enc(real_tok, "\n")
    assert trained == reply[: len(trained)] and tokens[-len(trained) :] == trained
    assert labels[: len(tokens) - len(trained)] == [CROSS_ENTROPY_IGNORE_IDX] * (len(tokens) - len(trained))
    assert real_tok.decode(tokens[:40], skip_special_tokens=False).startswith(
        "<|im_start|>user\nBelow is an instruction"
    )

    with_input = alpaca_dataset(
        real_tok,
        source="json",
        data_files=str(smollm2_assets / "data/alpaca_en_demo.json"),
        split="train",
        train_on_input=True,
    )[0]
    assert CROSS_ENTROPY_IGNORE_IDX not in with_input["labels"]


def test_text_completion_dataset_ends_documents_with_endoftext(real_tok, smollm2_assets):
    ds = text_completion_dataset(
        real_tok, source="json", data_files=str(smollm2_assets / "data/shakespeare.jsonl"), split="train", column="text"
    )
    first = json.loads((smollm2_assets / "data/shakespeare.jsonl").read_text().split("\n", 1)[0])["text"]
    assert ds[0]["tokens"] == enc(real_tok, first) + [0]
    assert ds[0]["labels"] == ds[0]["tokens"]


def test_chat_dataset(real_tok, tmp_path):
    data = tmp_path / "chat.json"
    data.write_text(
        json.dumps([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}])
    )
    ds = chat_dataset(
        real_tok,
        source="json",
        data_files=str(data),
        split="train",
        conversation_column="messages",
        conversation_style="openai",
    )
    tokens, labels = ds[0]["tokens"], ds[0]["labels"]
    user_len = len([1] + enc(real_tok, "user\n") + enc(real_tok, "Hi") + [2] + enc(real_tok, "\n"))
    assert labels[:user_len] == [CROSS_ENTROPY_IGNORE_IDX] * user_len
    assert labels[user_len:] == tokens[user_len:]
    assert real_tok.decode(tokens[user_len:], skip_special_tokens=False) == "<|im_start|>assistant\nHello!<|im_end|>\n"


# ------------------------------------------------------------------- the chat template checkpoints carry
def hf_ids(folder, messages, **options):
    """The ids transformers' tokenizer of ``folder`` gives ``messages``; ``folder`` may be one already loaded."""
    from transformers import AutoTokenizer

    conversation = [{"role": m.role, "content": m.text_content} for m in messages]
    hf = AutoTokenizer.from_pretrained(str(folder)) if isinstance(folder, (str, Path)) else folder
    return hf.apply_chat_template(conversation, tokenize=True, **options)["input_ids"]


def test_chat_template_writes_what_the_tokenizer_writes(real_tok, smollm2_assets, tmp_path):
    from transformers import AutoTokenizer

    from torchtune_ext.checkpoint.tokenizer_files import write_chat_template

    folder = tmp_path / "saved"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_assets / "SmolLM2-135M-Instruct" / name, folder / name)
    assert hf_ids(folder, TWO_TURNS) != real_tok.tokenize_messages(TWO_TURNS)[0]  # SmolLM2's adds a system prompt
    for tok in (real_tok, smollm2_tokenizer(str(smollm2_assets / "SmolLM2-135M-Instruct"),
                                            prompt_template={"user": ("Q: \"", "\"\nA: \u00e9\U0001f600"),
                                                             "assistant": ("Answer: ", "")})):
        assert write_chat_template(folder, tok.chat_template)
        hf = AutoTokenizer.from_pretrained(str(folder))  # read after the write: the folder as saved
        assert hf_ids(hf, TWO_TURNS) == tok.tokenize_messages(TWO_TURNS)[0]
        prompt = [Message("user", "Hi", masked=True)]
        assert hf_ids(hf, prompt, add_generation_prompt=True) == tok.tokenize_messages(
            [*prompt, Message("assistant", "")], add_end_tokens=False)[0]
    assert not write_chat_template(folder, tok.chat_template)  # already there: nothing written
    llama2 = smollm2_tokenizer(str(smollm2_assets / "SmolLM2-135M-Instruct"),
                               prompt_template="torchtune.models.llama2.Llama2ChatTemplate")
    assert llama2.chat_template is None  # no Jinja form


def test_write_chat_template_replaces_the_one_transformers_reads(tmp_path):
    from torchtune_ext.checkpoint.tokenizer_files import write_chat_template

    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "old"}, {"name": "tool_use", "template": "tools"}]}))
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "tokenizer_config.json").symlink_to(base / "tokenizer_config.json")
    assert write_chat_template(saved, "new")
    assert json.loads((saved / "tokenizer_config.json").read_text())["chat_template"] == [
        {"name": "default", "template": "new"}, {"name": "tool_use", "template": "tools"}]
    assert "old" in (base / "tokenizer_config.json").read_text()  # the link was replaced, not written through
    (saved / "chat_template.jinja").write_text("old")  # transformers prefers this file
    assert write_chat_template(saved, "newer") and (saved / "chat_template.jinja").read_text() == "newer"
    assert not write_chat_template(tmp_path, "x")  # no tokenizer files: nothing


def test_training_chat_template_only_for_message_data(tiny_run):
    from omegaconf import OmegaConf

    from torchtune_ext.data.tokenizer import training_chat_template

    cfg = OmegaConf.load(tiny_run())
    assert training_chat_template(cfg) == smollm2_tokenizer(cfg.tokenizer.path).chat_template
    cfg.dataset = {"_component_": "torchtune.datasets.text_completion_dataset", "source": "json"}
    assert training_chat_template(cfg) is None  # nothing trained on a chat: the base folder's template stays


def test_torchtunes_own_tokenizers_leave_the_copied_template(tmp_path):
    from tests.support.families import FAMILIES, write_qwen_bpe
    from torchtune_ext.data.tokenizer import training_chat_template

    write_qwen_bpe(tmp_path)
    tokenizer = {k: (str(tmp_path / v) if k.endswith("path") or k == "merges_file" else v)
                 for k, v in FAMILIES["qwen2"].tokenizer.items()}
    assert training_chat_template({"tokenizer": tokenizer, "dataset": {
        "_component_": "torchtune.datasets.alpaca_dataset"}}) is None


# ------------------------------------------------------------------ tokenizer.path that is not a tokenizer
@pytest.fixture
def tiny_cfg(tiny_run):
    from omegaconf import OmegaConf

    from torchtune_ext.config import validate

    return lambda *overrides: validate(OmegaConf.merge(OmegaConf.load(tiny_run()), OmegaConf.from_dotlist(overrides)))


def not_tokenizers(root):
    text = root / "notes.txt"
    text.write_text("not a tokenizer\n")
    return {"text": text, "json": root / "data.json", "weights": root / "ckpt" / "model.safetensors"}


@pytest.mark.parametrize("kind", ["text", "json", "weights"])
def test_tokenizer_path_that_is_not_a_tokenizer_is_one_config_error(tiny_cfg, kind):
    """issue 33 F6: a traceback from the tokenizers library ("expected ident at line 1 column 2")."""
    import torch

    from torchtune_ext.config import ConfigError
    from torchtune_ext.run.preflight import check_components

    cfg = tiny_cfg()
    path = not_tokenizers(Path(cfg.output_dir).parent)[kind]
    cfg.tokenizer.path = str(path)
    with pytest.raises(ConfigError) as err:
        check_components(cfg, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith(f"config key 'tokenizer.path': '{path}' is not a Hugging Face tokenizer.json (")
    assert message.endswith("); expected a tokenizer.json or the folder holding it") and "\n" not in message


def test_torchtune_tokenizer_on_a_wrong_file_names_what_it_reads(tiny_cfg):
    import torch

    from torchtune_ext.config import ConfigError
    from torchtune_ext.run.preflight import check_components

    cfg = tiny_cfg()
    path = not_tokenizers(Path(cfg.output_dir).parent)["json"]
    cfg.tokenizer = {"_component_": "torchtune.models.llama3.llama3_tokenizer", "path": str(path)}
    with pytest.raises(ConfigError, match=r"^config key 'tokenizer.path': torchtune.models.llama3.llama3_tokenizer "
                       f"cannot read '{path}' \\(.*\\); expected Llama 3's tiktoken file \\(original/tokenizer.model "
                       r"in the download\)$"):
        check_components(cfg, torch.device("cpu"))
