"""HFTokenizer: a model folder's own chat template, masks by message, torchtune's datasets, bad folders.

Tokenizer folders are made here from SmolLM2's bundled tokenizer.json (skipped if not downloaded): the folder
itself, and copies with the special tokens and a chat template written in the style of another family: Qwen3
(``<think>`` blocks: the last assistant turn gets one, earlier turns lose their reasoning, so a conversation's
rendering is not its first turns' rendering plus more), Gemma (BOS, ``<start_of_turn>``, role ``model``, the
system prompt inside the first user turn) and Llama 3 (BOS, header tokens, a default system block). Their
assistant blocks sit in ``{% generation %}`` tags, which change no text: transformers'
``return_assistant_tokens_mask`` then says independently which tokens are the assistant's.
"""

import json
import shutil

import pytest
from omegaconf import OmegaConf
from tokenizers import AddedToken, Tokenizer, processors
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message
from torchtune.datasets import alpaca_dataset, chat_dataset, instruct_dataset, text_completion_dataset
from transformers import AutoTokenizer

from tests.support.tokenizer_cache import each_tokenizer_loaded_once
from torchtune_ext.config import ConfigError
from torchtune_ext.data.hf_tokenizer import HFTokenizer, hf_tokenizer
from torchtune_ext.data.tokenizer import SmolLM2Tokenizer, check_tokenizer

QWEN3 = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {%- set content = m.content -%}{%- set reasoning = '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- generation -%}
    {%- if loop.index0 > ns.last_user -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
    {%- endgeneration -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

GEMMA = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
  {%- set prefix = messages[0].content | trim + '\n\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set prefix = '' -%}{%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
  {%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
  {%- endif -%}
  {%- if m.role == 'assistant' -%}
    {%- generation -%}{{- '<start_of_turn>model\n' + m.content | trim + '<end_of_turn>\n' -}}{%- endgeneration -%}
  {%- else -%}
    {{- '<start_of_turn>user\n' + (prefix if loop.first else '') + m.content | trim + '<end_of_turn>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

LLAMA3 = r"""
{{- bos_token -}}
{%- if messages[0].role != 'system' -%}
  {{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023<|eot_id|>' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {%- generation -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}
    {%- endgeneration -%}
  {%- else -%}
    {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# name: (chat template, special tokens to add, other tokens to add, tokenizer_config entries, BOS on text,
#        generation_config eos_token_id as token names)
FAMILIES = {
    "qwen3": (QWEN3, [], ["<think>", "</think>"],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, False,
              ["<|im_end|>", "<|endoftext|>"]),
    "gemma": (GEMMA, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], [],
              {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, True, ["<eos>", "<end_of_turn>"]),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], [],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, True,
               ["<|end_of_text|>", "<|eot_id|>"]),
}

TWO_TURNS = [
    Message("user", "Hello! How are you?", masked=True),
    Message("assistant", "I am fine, thank you."),
    Message("user", "Describe crepes.", masked=True),
    Message("assistant", "Whisk the flour\nand the eggs."),
]
WITH_SYSTEM_AND_REASONING = [
    Message("system", "Answer briefly.", masked=True),
    Message("user", "2 + 2?", masked=True),
    Message("assistant", "<think>\nadd them\n</think>\n\n4"),
    Message("user", "And 3 + 3?", masked=True),
    Message("assistant", "<think>\nthe same way\n</think>\n\n6"),
]


def dicts(messages):
    return [{"role": m.role, "content": m.text_content} for m in messages]


def write_family(folder, smollm2_dir, name, template=None):
    """A tokenizer folder of family ``name``: SmolLM2's vocabulary, that family's tokens and template."""
    chat_template, specials, others, config, bos_on_text, stops = FAMILIES[name]
    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in others])
    if bos_on_text:  # as the families' tokenizer.json do: BOS before every text
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    # PreTrainedTokenizerFast: transformers then takes tokenizer.json as it is, as for these families' folders
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template is not False:
        tokenizer_config["chat_template"] = template or chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(t) for t in stops]}))
    return folder


@pytest.fixture(scope="module", autouse=True)
def _load_each_folder_once():
    """hf_tokenizer is built about 20 times here on the same 4 folders: each is read once
    (tests/support/tokenizer_cache.py); the references below are loaded apart, by transformers itself."""
    with each_tokenizer_loaded_once():
        yield


@pytest.fixture(scope="module")
def folders(smollm2_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tokenizers")
    smollm2 = smollm2_assets / "SmolLM2-135M-Instruct"
    made = {"smollm2": root / "smollm2"}
    made["smollm2"].mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copy(smollm2 / name, made["smollm2"] / name)
    for name in FAMILIES:
        made[name] = write_family(root / name, smollm2, name)
    return made


@pytest.fixture(scope="module")
def toks(folders):
    return {name: (hf_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder)))
            for name, folder in folders.items()}


ALL = ["smollm2", *FAMILIES]


# ------------------------------------------------------------------------------ the template's ids
@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("messages", [TWO_TURNS, WITH_SYSTEM_AND_REASONING], ids=["two-turns", "system-reasoning"])
def test_ids_are_apply_chat_templates(toks, family, messages):
    tok, hf = toks[family]
    tokens, mask = tok.tokenize_messages(messages)
    assert tokens == hf.apply_chat_template(dicts(messages), tokenize=True)["input_ids"]
    assert len(mask) == len(tokens)


def test_what_the_templates_write(toks):
    """The families differ where the test means them to: default system prompts, BOS, <think> blocks."""
    rendered = {name: toks[name][0].decode(toks[name][0].tokenize_messages(TWO_TURNS)[0], skip_special_tokens=False)
                for name in ALL}
    assert rendered["smollm2"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered["gemma"].startswith("<bos><start_of_turn>user\nHello!")
    assert rendered["llama3"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting")
    # Qwen3: the last reply gets an empty <think> block, the first does not
    assert rendered["qwen3"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nWhisk the flour\nand the eggs."
                                      "<|im_end|>\n")
    assert "assistant\nI am fine, thank you.<|im_end|>" in rendered["qwen3"]
    qwen, _ = toks["qwen3"]
    text = qwen.decode(qwen.tokenize_messages(WITH_SYSTEM_AND_REASONING)[0], skip_special_tokens=False)
    assert "add them" not in text and "<think>\nthe same way\n</think>\n\n6<|im_end|>" in text


# ----------------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("messages", [TWO_TURNS, WITH_SYSTEM_AND_REASONING], ids=["two-turns", "system-reasoning"])
def test_masks_cover_exactly_the_non_assistant_tokens(toks, family, messages):
    tok, hf = toks[family]
    tokens, mask = tok.tokenize_messages(messages)
    assistant = hf.apply_chat_template(dicts(messages), tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)["assistant_masks"]
    assert sum(assistant) > 0
    assert mask == [not a for a in assistant]
    # train_on_input=true: every message unmasked, every token trained
    unmasked = [Message(m.role, m.text_content, masked=False) for m in messages]
    assert tok.tokenize_messages(unmasked) == (tokens, [False] * len(tokens))


def test_smollm2_masks_are_those_of_chatml_with_its_system_prompt(toks, folders):
    """The folder's template adds SmolLM2's default system prompt: masked, as a system message would be."""
    tok, hf = toks["smollm2"]
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    chatml = SmolLM2Tokenizer(str(folders["smollm2"] / "tokenizer.json"))
    assert tok.tokenize_messages(TWO_TURNS) == chatml.tokenize_messages([Message("system", default, masked=True),
                                                                         *TWO_TURNS])


# ---------------------------------------------------------------------------- generation, kwargs
@pytest.mark.parametrize("family", ALL)
def test_generation_prompt(toks, family):
    tok, hf = toks[family]
    prompt = [Message("user", "Hi", masked=True)]
    expected = hf.apply_chat_template(dicts(prompt), add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.tokenize_messages([*prompt, Message("assistant", "")], add_end_tokens=False)[0] == expected
    assert tok.tokenize_messages(prompt, add_end_tokens=False)[0] == expected
    sample = tok({"messages": [*prompt, Message("assistant", "")]}, inference=True)
    assert sample["tokens"] == expected and "messages" not in sample
    # a started reply is continued: no end-of-turn after it
    started = [*prompt, Message("assistant", "Well")]
    expected = hf.apply_chat_template(dicts(started), continue_final_message=True, tokenize=True)["input_ids"]
    assert tok.tokenize_messages(started, add_end_tokens=False)[0] == expected


def test_chat_template_kwargs_reach_the_template(folders):
    plain = hf_tokenizer(str(folders["qwen3"]))
    no_thinking = hf_tokenizer(str(folders["qwen3"]), chat_template_kwargs={"enable_thinking": False})
    prompt = [Message("user", "Hi", masked=True), Message("assistant", "")]
    thinking_off = no_thinking.tokenize_messages(prompt, add_end_tokens=False)[0]
    assert no_thinking.decode(thinking_off, skip_special_tokens=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert plain.decode(plain.tokenize_messages(prompt, add_end_tokens=False)[0],
                        skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_template_argument_replaces_the_folders(folders, tmp_path):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    for given in (template, str(tmp_path / "t.jinja")):
        tok = hf_tokenizer(str(folders["smollm2"]), chat_template=given)
        assert tok.chat_template == template
        assert tok.decode(tok.tokenize_messages(TWO_TURNS[:2])[0]) == ("[user] Hello! How are you?\n"
                                                                       "[assistant] I am fine, thank you.\n")
    with pytest.raises(ValueError, match="neither Jinja text nor a readable .jinja file"):
        hf_tokenizer(str(folders["smollm2"]), chat_template=str(tmp_path / "missing.jinja"))


# ---------------------------------------------------------------------------------- text, ids
@pytest.mark.parametrize("family", ALL)
def test_encode_adds_bos_and_eos_as_the_tokenizer_does(toks, family):
    tok, hf = toks[family]
    body = hf("Hello world", add_special_tokens=False)["input_ids"]
    assert tok.encode("Hello world", add_bos=False, add_eos=False) == body
    assert tok.encode("Hello world", add_bos=True, add_eos=False) == hf("Hello world")["input_ids"]
    bos = [tok.bos_id] if FAMILIES.get(family, (None,) * 4 + (False,))[4] else []
    assert tok.encode("Hello world") == bos + body + [hf.eos_token_id]
    assert tok.decode(body) == "Hello world"
    literal = tok.encode("a <|im_end|> b", add_bos=False, add_eos=False)  # data text stays text
    assert not set(literal) & set(tok.special_tokens.values())
    assert tok.decode(literal) == "a <|im_end|> b"


def test_special_ids(toks):
    gemma, hf = toks["gemma"]
    ids = {t: hf.convert_tokens_to_ids(t) for t in ("<bos>", "<eos>", "<pad>", "<end_of_turn>")}
    assert (gemma.bos_id, gemma.eos_id, gemma.pad_id) == (ids["<bos>"], ids["<eos>"], ids["<pad>"])
    assert gemma.stop_tokens == [ids["<eos>"], ids["<end_of_turn>"]]  # the eos, then generation_config's
    assert {"<bos>", "<start_of_turn>", "<end_of_turn>"} <= set(gemma.special_tokens)
    llama3, hf = toks["llama3"]
    assert llama3.pad_id == llama3.eos_id == hf.convert_tokens_to_ids("<|eot_id|>")  # no pad token: eos
    qwen3, _ = toks["qwen3"]
    assert qwen3.bos_id is None and qwen3.vocab_size == 49152 + 2
    smollm2, _ = toks["smollm2"]
    assert (smollm2.eos_id, smollm2.stop_tokens) == (2, [2])  # <|im_end|>, also in config.json and generation's
    assert smollm2.pad_id == 0  # its pad_token <|im_end|> closes every turn: <|endoftext|>, its unk_token


def test_truncation_as_torchtune(folders, toks):
    full, full_mask = toks["gemma"][0].tokenize_messages(TWO_TURNS)
    short = hf_tokenizer(str(folders["gemma"]), max_seq_len=12)
    tokens, mask = short.tokenize_messages(TWO_TURNS)
    assert tokens == full[:11] + [short.eos_id] and mask == full_mask[:11] + [True]
    assert short.tokenize_messages(TWO_TURNS, add_end_tokens=False) == (full[:12], full_mask[:12])
    exact = hf_tokenizer(str(folders["gemma"]), max_seq_len=len(full))
    assert exact.tokenize_messages(TWO_TURNS) == (full, full_mask)


# ----------------------------------------------------------------------------- torchtune datasets
def labels_of(tokens, mask):
    return [CROSS_ENTROPY_IGNORE_IDX if m else t for t, m in zip(tokens, mask, strict=True)]


def test_torchtune_datasets(folders, toks, tmp_path):
    tok = hf_tokenizer(str(folders["gemma"]), max_seq_len=64)
    hf = toks["gemma"][1]  # transformers' own, loaded apart

    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Name a colour.", "input": "", "output": "Blue."}]))
    sample = alpaca_dataset(tok, source="json", data_files=str(alpaca), split="train", train_on_input=False)[0]
    prompt = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n### Instruction:\nName a colour.\n\n### Response:\n")
    expected = tok.tokenize_messages([Message("user", prompt, masked=True), Message("assistant", "Blue.")])
    assert (sample["tokens"], sample["labels"]) == (expected[0], labels_of(*expected))
    assert tok.decode([t for t in sample["labels"] if t != CROSS_ENTROPY_IGNORE_IDX],
                      skip_special_tokens=False) == "<start_of_turn>model\nBlue.<end_of_turn>\n"

    packed = alpaca_dataset(tok, source="json", data_files=str(alpaca), split="train", train_on_input=False,
                            packed=True)[0]
    n = len(sample["tokens"])
    assert (packed["tokens"][:n].tolist(), packed["labels"][:n].tolist()) == (sample["tokens"], sample["labels"])

    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello!"}]}]))
    sample = chat_dataset(tok, source="json", data_files=str(chat), split="train", conversation_column="messages",
                          conversation_style="openai")[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]
    assert sample["tokens"] == hf.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert tok.decode([t for t in sample["labels"] if t != CROSS_ENTROPY_IGNORE_IDX],
                      skip_special_tokens=False) == "<start_of_turn>model\nHello!<end_of_turn>\n"

    instruct = tmp_path / "instruct.json"
    instruct.write_text(json.dumps([{"question": "Capital of France?", "answer": "Paris."}]))
    sample = instruct_dataset(tok, source="json", data_files=str(instruct), split="train",
                              column_map={"input": "question", "output": "answer"}, train_on_input=True)[0]
    expected = hf.apply_chat_template([{"role": "user", "content": "Capital of France?"},
                                       {"role": "assistant", "content": "Paris."}], tokenize=True)["input_ids"]
    assert sample["tokens"] == expected and sample["labels"] == expected  # train_on_input: nothing masked

    text = tmp_path / "text.json"
    text.write_text(json.dumps([{"text": "Once upon a time"}, {"text": "word " * 100}]))
    ds = text_completion_dataset(tok, source="json", data_files=str(text), split="train", column="text")
    body = hf("Once upon a time", add_special_tokens=False)["input_ids"]
    assert ds[0]["tokens"] == [tok.bos_id] + body + [tok.eos_id] == ds[0]["labels"]
    assert len(ds[1]["tokens"]) == 63  # torchtune cuts documents to max_seq_len - 1


# --------------------------------------------------------------------- no template, bad folders
def test_chat_data_without_a_chat_template_is_one_config_error(folders, tmp_path):
    folder = write_family(tmp_path / "plain", folders["smollm2"], "qwen3", template=False)
    tok = hf_tokenizer(str(folder))
    assert tok.chat_template is None
    assert tok.encode("text", add_eos=False) == tok.encode("text", add_bos=False, add_eos=False)  # text still works
    with pytest.raises(ValueError, match="has no chat template"):
        tok.tokenize_messages(TWO_TURNS)
    cfg = OmegaConf.create({
        "tokenizer": {"_component_": "torchtune_ext.data.hf_tokenizer.hf_tokenizer", "path": str(folder)},
        "dataset": {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json", "data_files": "x.json"},
    })
    with pytest.raises(ConfigError) as err:
        check_tokenizer(cfg)
    message = str(err.value)
    assert message.startswith("config key 'tokenizer.path': cannot format messages, which dataset "
                              "(torchtune.datasets.alpaca_dataset) gives it: ")
    assert "has no chat template" in message and "tokenizer.chat_template" in message and "\n" not in message
    cfg.dataset = {"_component_": "torchtune.datasets.text_completion_dataset", "source": "json"}
    check_tokenizer(cfg)  # plain text needs no template
    cfg.tokenizer.chat_template = QWEN3
    cfg.tokenizer.chat_template_kwargs = {"enable_thinking": False}
    cfg.dataset._component_ = "torchtune.datasets.chat_dataset"
    check_tokenizer(cfg)  # a template given in the config
    cfg.tokenizer.chat_template = str(tmp_path / "missing.jinja")
    with pytest.raises(ConfigError, match=r"^config key 'tokenizer.chat_template': '.*missing.jinja' is neither "
                                          "Jinja text nor a file"):
        check_tokenizer(cfg)


@pytest.mark.parametrize("case,words", [
    ("file", ["is a file; expected a Hugging Face model folder"]),
    ("empty", ["holds neither tokenizer.json nor tokenizer_config.json"]),
    ("broken", ["is not a tokenizer transformers can read", "expected a Hugging Face model folder"]),
])
def test_a_folder_that_is_not_a_tokenizer(folders, tmp_path, case, words):
    path = tmp_path / case
    if case == "file":
        path.write_text("[not a folder")
    else:
        path.mkdir()
        if case == "broken":
            (path / "tokenizer.json").write_text("{not json")
            shutil.copy(folders["smollm2"] / "tokenizer_config.json", path)
    with pytest.raises(ValueError) as err:
        hf_tokenizer(str(path))
    for word in words:
        assert word in str(err.value)
    assert "\n" not in str(err.value)
    # before the model loads, the same words as one config error
    tokenizer = {"_component_": "torchtune_ext.data.hf_tokenizer.hf_tokenizer", "path": str(path)}
    cfg = OmegaConf.create({"tokenizer": tokenizer,
                            "dataset": {"_component_": "torchtune.datasets.text_completion_dataset"}})
    with pytest.raises(ConfigError) as config_err:
        check_tokenizer(cfg)
    assert str(config_err.value) == f"config key 'tokenizer.path': {err.value}"


def test_file_paths_inside_the_folder_are_accepted(folders, toks):
    tok = hf_tokenizer(str(folders["llama3"] / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert tok.tokenize_messages(TWO_TURNS) == toks["llama3"][0].tokenize_messages(TWO_TURNS)
