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
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtune.data import ChatMLTemplate, Message, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer, ModelTokenizer

from torchtune_ext.assets import check_asset

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
            ids += self.encode(item["content"], add_bos=False, add_eos=False)
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
    """
    p = check_asset(path)
    if p.is_dir():
        p = check_asset(p / "tokenizer.json")
    return SmolLM2Tokenizer(str(p), max_seq_len=max_seq_len, prompt_template=prompt_template)
