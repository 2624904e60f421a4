"""SmolLM2's tokenizer as a torchtune ``ModelTokenizer``: ChatML for messages, plain BPE for text.

Special ids, and why:

* No BOS. SmolLM2 was trained without one: the GGUF and HF tokenizer configs
  say ``add_bos_token: false`` and the Instruct chat template starts straight
  with ``<|im_start|>``. ``bos_id`` is therefore ``None`` by default and
  ``encode(add_bos=True)`` (which torchtune's text-completion dataset always
  passes) adds nothing. Pass ``bos_token`` to the constructor to change that.
* ``eos_id = <|endoftext|>`` (0): the document separator of SmolLM2's
  pretraining corpus and the base model's ``eos_token``. ``encode(add_eos=True)``
  appends it, so text-completion samples end the way pretraining documents did.
* ``im_start_id = <|im_start|>`` (1), ``im_end_id = <|im_end|>`` (2): ChatML turn
  markers. ``<|im_end|>`` is what the Instruct model emits at the end of a
  reply (the Instruct HF config calls it ``eos_token``), so
  ``stop_tokens = [<|im_end|>, <|endoftext|>]``.
* ``pad_id = <|endoftext|>`` (0). The Instruct HF config pads with
  ``<|im_end|>``, but ``torchtune.generation.generate`` treats every token equal
  to ``pad_id`` in a prompt as padding, and every chat prompt contains
  ``<|im_end|>``. ``<|endoftext|>`` never appears in a prompt. Padded label
  positions are ignored by the collators regardless of the id.

Text given to :meth:`SmolLM2Tokenizer.encode` is always encoded as text: a
literal ``"<|im_end|>"`` inside a dataset sample becomes ordinary BPE pieces,
never the control token, so data cannot forge turn boundaries. Control tokens
enter only through the ChatML formatting in :meth:`tokenize_messages`.

For any tokenizer component: :func:`check_tokenizer` builds it (and formats a
chat where the datasets give messages) before the model loads, and
:func:`training_chat_template` / :func:`write_chat_template` give checkpoints
the chat template training wrote (``docs/models.md``, Tokenizer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config as tt_config
from torchtune.data import ChatMLTemplate, Message, PromptTemplate, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer, ModelTokenizer
from torchtune.utils import get_logger

from torchtune_ext.config import enabled, validation_enabled
from torchtune_ext.data.assets import check_asset
from torchtune_ext.errors import ConfigError, UserError
from torchtune_ext.moved import canonical

log = get_logger()  # torchtune's logger, which the recipes' lines go through too

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class SmolLM2Tokenizer(ModelTokenizer, Transform):
    """ChatML tokenizer for SmolLM2 over an exported ``tokenizer.json``.

    A conversation is formatted as HF's SmolLM2 chat template does, one block
    per message::

        <|im_start|>{role}\\n{content}<|im_end|>\\n

    except that no default system prompt is inserted (HF's template adds
    "You are a helpful AI assistant named SmolLM..." when the first message is
    not a system message; add a system ``Message`` if you want it).

    Masking follows torchtune's model tokenizers: every token of a message's
    block (header, content, ``<|im_end|>`` and the newline) takes that
    message's ``masked`` flag. So with ``train_on_input=False`` the prompt
    blocks are masked and the assistant block is trained, including the
    ``<|im_end|>`` the model must learn to emit to stop.

    Args:
        path: ``tokenizer.json``; a ``tokenizer_config.json`` or
            ``generation_config.json`` must sit next to it (torchtune's
            ``HuggingFaceBaseTokenizer`` requires one).
        max_seq_len: truncate ``tokenize_messages`` output to this many tokens;
            also read by torchtune's datasets (text completion, packing).
            ``None`` keeps everything.
        prompt_template: optional torchtune prompt template applied to the
            messages before ChatML formatting: an instance, a dotted path
            string or a ``{role: (prepend, append)}`` dict.
        bos_token: token to prepend on ``encode(add_bos=True)``; ``None``
            (default) prepends nothing, as SmolLM2 was trained.

    Raises:
        ValueError: if ``prompt_template`` is ChatML (it would wrap every
            message twice), a required special token is missing from the
            vocabulary, or neither sidecar config file exists.
    """

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        prompt_template: PromptTemplateInterface | str | dict[str, Any] | None = None,
        bos_token: str | None = None,
    ):
        json_path = Path(path)
        sidecars = [json_path.with_name(n) for n in ("tokenizer_config.json", "generation_config.json")]
        self._base = HuggingFaceBaseTokenizer(
            str(json_path),
            tokenizer_config_json_path=str(sidecars[0]) if sidecars[0].exists() else None,
            generation_config_path=str(sidecars[1]) if sidecars[1].exists() else None,
        )
        # Encode data text as text; see the module docstring.
        self._base.tokenizer.encode_special_tokens = True

        if isinstance(prompt_template, (str, dict)):
            prompt_template = _get_prompt_template(prompt_template)
        if isinstance(prompt_template, ChatMLTemplate):
            raise ValueError(
                "prompt_template=ChatMLTemplate would wrap each message in <|im_start|>/<|im_end|> "
                "twice; SmolLM2Tokenizer already formats ChatML. Use prompt_template=None."
            )
        self.prompt_template = prompt_template
        self.max_seq_len = max_seq_len

        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in self._base.tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self.eos_id = self._special_id(ENDOFTEXT)
        self.im_start_id = self._special_id(IM_START)
        self.im_end_id = self._special_id(IM_END)
        self.bos_id = None if bos_token is None else self._special_id(bos_token)
        self.pad_id = self.eos_id
        self.stop_tokens = [self.im_end_id, self.eos_id]
        self._newline = self.encode("\n", add_bos=False, add_eos=False)

    def _special_id(self, token: str) -> int:
        if token not in self.special_tokens:
            raise ValueError(f"{token!r} is not a special token of this tokenizer.json")
        return self.special_tokens[token]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (49152 for SmolLM2)."""
        return self._base.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """A Hugging Face chat template (Jinja) that writes what :meth:`tokenize_messages` writes.

        Checkpoints carry it in place of the base folder's (:func:`write_chat_template`): SmolLM2's
        own template adds a default system prompt this tokenizer never writes, so a model deployed
        with it would see a format it was not trained on. ChatML, no default system prompt,
        ``add_generation_prompt`` opens an assistant turn; a :class:`~torchtune.data.PromptTemplate`'s
        tags go around each message's content as here (the generation prompt ends with the
        assistant's opening tag; torchtune would also close an empty assistant message with its
        closing tag). ``None`` for other prompt templates (no Jinja form). One difference remains
        by design: a template renders a special-token string inside a message as the control
        token, where this tokenizer keeps it text.
        """
        content, reply = "message['content']", "'<|im_start|>assistant\\n'"
        head = ""
        if self.prompt_template is not None:
            if not isinstance(self.prompt_template, PromptTemplate):
                return None
            tags = {role: [pre if isinstance(pre, str) else "", post if isinstance(post, str) else ""]
                    for role, (pre, post) in self.prompt_template.template.items()}
            # a JSON object is a Jinja dict literal (ensure_ascii=False: Jinja decodes no surrogate pairs)
            head = "{%- set tags = " + json.dumps(tags, ensure_ascii=False) + " -%}"
            content = "tags.get(message['role'], ['', ''])[0] + message['content'] + " \
                      "tags.get(message['role'], ['', ''])[1]"
            reply += " + tags.get('assistant', ['', ''])[0]"  # the reply starts after its tag
        return (head + "{%- for message in messages -%}"
                "{{- '<|im_start|>' + message['role'] + '\\n' + " + content + " + '<|im_end|>\\n' -}}"
                "{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- " + reply + " -}}{%- endif -%}")

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Encode ``text`` as text (special-token strings are not recognised).

        Args:
            text: any string.
            add_bos: prepend ``bos_id`` if the tokenizer has one (by default it
                has none; see the module docstring).
            add_eos: append ``eos_id`` (``<|endoftext|>``).

        Returns:
            Token ids.
        """
        ids = self._base.encode(text, add_bos=False, add_eos=False)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text.

        Args:
            token_ids: ids to decode.
            skip_special_tokens: drop special tokens such as ``<|im_end|>``.

        Returns:
            The text; byte-level BPE makes ``decode(encode(s, False, False)) == s``.
        """
        return self._base.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def tokenize_message(self, message: Message, *, add_end_tokens: bool = True) -> list[int]:
        """Token ids of one ChatML block ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.

        Args:
            message: a text-only message.
            add_end_tokens: append ``<|im_end|>\\n``. ChatML has no
                end-of-message token, so ``message.eot`` is not consulted.

        Returns:
            Token ids.

        Raises:
            ValueError: if the message has non-text content.
        """
        ids = [self.im_start_id] + self.encode(f"{message.role}\n", add_bos=False, add_eos=False)
        for item in message.content:
            if item["type"] != "text":
                raise ValueError(f"SmolLM2Tokenizer handles text only, got content of type {item['type']!r}")
        # The parts as one text (a prompt template's tags are parts): tokenized as a chat template renders it
        ids += self.encode(message.text_content, add_bos=False, add_eos=False)
        if add_end_tokens:
            ids += [self.im_end_id] + self._newline
        return ids

    def tokenize_messages(
        self, messages: list[Message], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Format messages as ChatML and tokenize them.

        Args:
            messages: the conversation.
            add_end_tokens: close the last message with ``<|im_end|>\\n``. Set
                False for generation, with a last empty assistant message, so the
                prompt ends in ``<|im_start|>assistant\\n``.

        Returns:
            ``(tokens, mask)``, equal lengths; ``mask[i]`` is True where token
            ``i`` must not be a training target. At most ``max_seq_len`` long:
            longer conversations are cut, with no end token forced in, so a
            cut-off reply never teaches the model to stop mid-sentence.

        Raises:
            ValueError: if a message has non-text content.
        """
        if self.prompt_template is not None:
            messages = self.prompt_template(messages)
        tokens: list[int] = []
        mask: list[bool] = []
        for i, message in enumerate(messages):
            last = i == len(messages) - 1
            ids = self.tokenize_message(message, add_end_tokens=add_end_tokens or not last)
            tokens += ids
            mask += [message.masked] * len(ids)
            if self.max_seq_len is not None and len(tokens) >= self.max_seq_len:
                break
        if self.max_seq_len is not None:
            tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replace ``sample["messages"]`` by ``"tokens"`` and ``"mask"`` (torchtune model transform).

        Args:
            sample: dict with a ``"messages"`` list of ``Message``.
            inference: leave the last message open (``add_end_tokens=False``).

        Returns:
            The same dict, without ``"messages"``, with ``"tokens"`` and ``"mask"``.
        """
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample


def smollm2_tokenizer(
    path: str,
    max_seq_len: int | None = None,
    prompt_template: PromptTemplateInterface | str | dict[str, Any] | None = None,
) -> SmolLM2Tokenizer:
    """Build :class:`SmolLM2Tokenizer` from the asset folder or its ``tokenizer.json``.

    Args:
        path: ``assets/SmolLM2-135M-Instruct`` or ``.../tokenizer.json``.
        max_seq_len: see :class:`SmolLM2Tokenizer`.
        prompt_template: see :class:`SmolLM2Tokenizer`.

    Returns:
        The tokenizer.

    Raises:
        MissingAssetError: if the folder or file does not exist; the message
            names the download command.
        ValueError: if the file is not a tokenizer.json (the message names it
            and what was expected).
    """
    p = check_asset(path)
    if p.is_dir():
        p = check_asset(p / "tokenizer.json")
    try:
        return SmolLM2Tokenizer(str(p), max_seq_len=max_seq_len, prompt_template=prompt_template)
    except json.JSONDecodeError as err:  # a ValueError, from a sidecar torchtune reads
        raise ValueError(f"'{p.parent}': its tokenizer_config.json or generation_config.json is not JSON "
                         f"({err})") from None
    except ValueError:
        raise
    except Exception as err:  # the tokenizers library reports a file it cannot parse as a bare Exception
        raise ValueError(f"'{path}' is not a Hugging Face tokenizer.json ({' '.join(str(err).split())}); "
                         "expected a tokenizer.json or the folder holding it") from None


# ---------------------------------------------------------------- checks and checkpoints

# torchtune's dataset builders that give the tokenizer plain text; the others in torchtune.datasets give it messages.
_TEXT_DATASETS = ("text_completion_dataset", "cnn_dailymail_articles_dataset", "wikitext_dataset")

# What torchtune's tokenizer builders read from ``path``, for the message when they cannot read it (by
# component prefix). Ours say it in their own errors.
_EXPECTED_FILES = {
    "torchtune_ext.data.tokenizer.": "a Hugging Face tokenizer.json, or the folder holding it",  # spelled as now
    "torchtune.models.llama3": "Llama 3's tiktoken file (original/tokenizer.model in the download)",
    "torchtune.models.qwen": "Qwen's vocab.json (and merges_file: merges.txt)",
    "torchtune.models.phi4": "Phi-4's vocab.json (and merges_path: merges.txt)",
    **{f"torchtune.models.{family}": "a SentencePiece model (tokenizer.model)"
       for family in ("llama2", "code_llama2", "mistral", "gemma", "phi3")},
}


def message_datasets(cfg: Mapping[str, Any]) -> list[str]:
    """The datasets of a run that give its tokenizer messages, as ``"key (component)"``.

    ``dataset``, and ``dataset_val`` when validation is on; a component of
    ``torchtune.datasets`` gives messages unless it reads plain text
    (``text_completion_dataset`` and the like). Other components (a user's own)
    are not judged.

    Args:
        cfg: the run's config, as a ``DictConfig`` or its resolved dict.
    """
    keys = ("dataset", "dataset_val") if validation_enabled(cfg) else ("dataset",)
    found = []
    for key in keys:
        node = cfg.get(key)
        nodes = list(node) if isinstance(node, (list, ListConfig)) else [node]
        for i, one in enumerate(nodes):
            component = str((enabled(one) or {}).get("_component_") or "")
            name = component.rsplit(".", 1)[-1]
            if component.startswith("torchtune.datasets.") and name not in _TEXT_DATASETS:
                found.append(f"{key if len(nodes) == 1 else f'{key}[{i}]'} ({component})")
    return found


def check_tokenizer(cfg: DictConfig) -> None:
    """Build the config's tokenizer, and with message datasets format a chat with it, before the model loads.

    A ``tokenizer.path`` that is not the file its builder reads otherwise fails
    in the builder with the parser's words ("expected ident at line 1 column
    2") and a traceback on every rank; a tokenizer that cannot format messages
    (a Hugging Face folder without a chat template) fails at the first sample.
    Costs one build of the tokenizer (a fraction of a second for SmolLM2's).

    Raises:
        ConfigError: (``tokenizer.path``, or ``tokenizer`` if it has no ``path``)
            the builder fails: the message names the file and what was
            expected; or :func:`message_datasets` is not empty and a
            user/assistant chat cannot be formatted: the message names the
            dataset and the fix. (``tokenizer.chat_template``) a value that is
            neither Jinja text nor a file.
    """
    node = enabled(cfg.get("tokenizer"))
    if node is None:
        return
    key = "tokenizer.path" if node.get("path") is not None else "tokenizer"
    component = canonical(str(node._component_))
    template = node.get("chat_template")
    if isinstance(template, str) and "{" not in template and not os.path.isfile(template):
        raise ConfigError("tokenizer.chat_template", f"'{template}' is neither Jinja text nor a file: give the "
                          "template's text, or the path of a .jinja file")
    try:
        tokenizer = tt_config.instantiate(node)
    except Exception as err:
        reason = " ".join(str(err).split())
        if not (component.startswith("torchtune_ext.") and isinstance(err, ValueError)):  # ours say it all
            expected = next((text for prefix, text in _EXPECTED_FILES.items() if component.startswith(prefix)),
                            f"a tokenizer file {component} reads")
            reason = f"{component} cannot read '{node.get('path')}' ({type(err).__name__}: {reason}); " \
                     f"expected {expected}"
        raise ConfigError(key, reason) from None
    datasets = message_datasets(cfg)
    if not datasets:
        return
    try:
        tokenizer.tokenize_messages([Message("user", "Hi", masked=True), Message("assistant", "Hello")])
    except Exception as err:
        raise ConfigError(key, f"cannot format messages, which {datasets[0]} gives it: "
                               f"{' '.join(str(err).split())}") from None


def training_chat_template(cfg: Mapping[str, Any], tokenizer: Any = None) -> str | None:
    """The chat template that writes what a run's tokenizer trained on, for its checkpoints.

    Args:
        cfg: the run's config, as a ``DictConfig`` or its resolved dict.
        tokenizer: the run's tokenizer, when built already; None: built from ``cfg["tokenizer"]``.

    Returns:
        The tokenizer's ``chat_template`` (:class:`SmolLM2Tokenizer`,
        :class:`torchtune_ext.data.hf_tokenizer.HFTokenizer`). None when the run's
        datasets give no messages (plain text: the base folder's template
        stays, as nothing trained another), or the tokenizer has none
        (torchtune's own tokenizers; a SmolLM2 prompt template without a
        Jinja form, which is warned about).
    """
    if not message_datasets(cfg):
        return None
    if tokenizer is None:
        node = cfg["tokenizer"]
        tokenizer = tt_config.instantiate(node if isinstance(node, DictConfig) else OmegaConf.create(node))
    template = getattr(tokenizer, "chat_template", None)
    if template is None and getattr(tokenizer, "prompt_template", None) is not None:
        log.warning(f"tokenizer.prompt_template {type(tokenizer.prompt_template).__name__} has no Jinja form: "
                    "checkpoints keep the base folder's chat template, which is not the format training wrote")
    return template


# The keys of torchtune's tokenizer builders that name files: llama3/gemma/mistral/phi `path`, qwen
# `path` (vocab) and `merges_file`, phi4 `vocab_path`/`merges_path`, HF `tokenizer_json_path`.
_TOKENIZER_FILE_KEYS = ("path", "tokenizer_json_path", "vocab_path", "merges_file", "merges_path",
                        "special_tokens_path")

def build_tokenizer(cfg_tokenizer: Any) -> Any:
    """Build the config's ``tokenizer``; files it cannot read are a config error, not a traceback.

    The one tokenizer load the recipes and ``python -m torchtune_ext.evaluate``
    share: a file that exists but is not a tokenizer (a truncated or garbage
    ``tokenizer.json``, another format) fails inside the tokenizers library
    with a bare ``Exception`` that names neither the key nor the file.

    Args:
        cfg_tokenizer: the ``tokenizer`` config (``_component_`` plus its arguments).

    Returns:
        the tokenizer (a torchtune ``ModelTokenizer``).

    Raises:
        UserError: the builder's own (a missing asset names the download command);
        ConfigError: (key ``tokenizer.path`` or the file key the config
            gives) naming the file and the reader's error.
    """
    try:
        return tt_config.instantiate(cfg_tokenizer)
    except UserError:
        raise
    except Exception as err:
        given = [k for k in _TOKENIZER_FILE_KEYS if cfg_tokenizer.get(k) is not None]
        key = f"tokenizer.{given[0]}" if given else "tokenizer"
        files = ", ".join(f"{k}='{cfg_tokenizer[k]}'" for k in given) or "its arguments"
        reason = " ".join(str(err).split()) or "no message"
        why = ("a file it needs is missing" if isinstance(err, FileNotFoundError)
               else "the file is damaged or not a tokenizer of this kind")
        raise ConfigError(key, f"{cfg_tokenizer.get('_component_')} cannot build a tokenizer from {files} "
                          f"({type(err).__name__}: {reason}): {why}; point it at the model's own tokenizer "
                          "files") from None
