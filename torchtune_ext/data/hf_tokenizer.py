"""A Hugging Face model folder's tokenizer as a torchtune ``ModelTokenizer``, with the folder's own chat template.

A folder as ``huggingface-cli download`` leaves it (``tokenizer.json``,
``tokenizer_config.json`` with its ``chat_template`` or a
``chat_template.jinja``, ``generation_config.json``, ``config.json``) is read
by transformers' ``AutoTokenizer``. torchtune's datasets (``alpaca_dataset``,
``chat_dataset``, ``instruct_dataset``, ``text_completion_dataset``, packing)
use the result unchanged.

Messages. A conversation is rendered by the folder's chat template, exactly
as ``tokenizer.apply_chat_template(messages, tokenize=True)`` renders it: the
same text, tokenized the same way, so BOS, turn markers, a default system
prompt the template adds, or Qwen3's empty ``<think>`` block are what the
model will see when deployed with that template. For prompt masking, each
token belongs to the message whose part of the rendered text it starts in
(torchtune's convention: a message's header and end-of-turn marker are part
of it), and takes that message's ``masked`` flag; text the template writes
before the first message (BOS, a default system prompt) belongs to the first
message. How the text is split into messages is described in
:meth:`HFTokenizer.tokenize_messages`.

Text completion. ``encode(text, add_bos=True, add_eos=True)`` adds BOS only
when the tokenizer itself adds one to plain text (``add_bos_token`` /
the ``tokenizer.json`` post-processor: Llama 3 and Gemma do, Qwen and SmolLM2
do not), and appends the tokenizer's ``eos_token``. Text is encoded as text:
a literal ``"<|im_end|>"`` in a document is not the control token.

Truncation follows torchtune's model tokenizers: at most ``max_seq_len``
tokens are kept and, when the conversation was cut and end tokens are asked
for, the last kept token becomes ``eos_id``, masked (so it is not trained).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtune.data import Message
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import ModelTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Files that make a folder a Hugging Face tokenizer folder; at least one must be there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EXPECTED = ("a Hugging Face model folder with tokenizer.json and tokenizer_config.json "
            "(as huggingface-cli download leaves it)")


class HFTokenizer(ModelTokenizer, Transform):
    """torchtune ``ModelTokenizer`` over a transformers tokenizer and a Jinja chat template.

    Build it with :func:`hf_tokenizer`.

    Args:
        hf: a fast (``tokenizer.json``-backed) transformers tokenizer; fast,
            because prompt masking needs each token's character offsets.
        chat_template: the Jinja template that formats messages; ``None``
            leaves the tokenizer usable for text only.
        max_seq_len: truncate ``tokenize_messages`` to this many tokens; also
            read by torchtune's datasets (text completion, packing). ``None``
            keeps everything.
        chat_template_kwargs: extra variables for the template, e.g.
            ``{"enable_thinking": False}`` for Qwen3.
        stop_tokens: ids generation stops at; ``eos_id`` is added if missing.
        source: the folder, named in error messages.

    Attributes:
        bos_id, eos_id, pad_id: special ids (``bos_id`` may be None: Qwen has
            none). ``pad_id`` is the first of the ``pad_token``, the
            ``unk_token`` and ``eos_id`` that is not a stop token, else the
            first of them there is; padded positions are never trained
            (their labels are ignore_index).
        stop_tokens: the ids generation stops at.
        special_tokens: ``{text: id}`` of the tokenizer's special tokens.
        prompt_template: always None: the chat template formats messages
            (torchtune's datasets read this attribute).

    Raises:
        ValueError: if ``hf`` is not a fast tokenizer.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, chat_template: str | None = None, *,
                 max_seq_len: int | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                 stop_tokens: list[int] | None = None, source: str = ""):
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{source or 'this tokenizer'}: a tokenizer.json (a fast tokenizer) is needed; "
                             f"transformers gave {type(hf).__name__}")
        self._hf = hf
        self.chat_template = chat_template
        self.max_seq_len = max_seq_len
        self.prompt_template = None
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._source = source
        self.bos_id: int | None = hf.bos_token_id
        self.eos_id: int | None = hf.eos_token_id
        self.stop_tokens = list(dict.fromkeys([i for i in (self.eos_id, *(stop_tokens or [])) if i is not None]))
        # torchtune.generation.generate takes every pad_id in a prompt for padding, and a stop token such as
        # <|im_end|> (SmolLM2's pad_token) closes every turn of a chat prompt: prefer a pad that is none
        candidates = [i for i in (hf.pad_token_id, hf.unk_token_id, hf.eos_token_id) if i is not None]
        self.pad_id: int = next((i for i in candidates if i not in self.stop_tokens), candidates[0] if candidates
                                else 0)
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
        # Does the tokenizer put BOS before plain text (Llama 3, Gemma) or not (Qwen, SmolLM2)?
        first = hf("a", add_special_tokens=True)["input_ids"][:1]
        self._bos_on_text = self.bos_id is not None and first == [self.bos_id]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._hf)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Encode ``text`` as text: special-token strings in it are not recognised.

        Args:
            text: any string.
            add_bos: prepend ``bos_id`` if the tokenizer adds BOS to plain
                text (see the module docstring); otherwise nothing is added.
            add_eos: append ``eos_id``.

        Returns:
            Token ids.
        """
        ids = self._hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if add_bos and self._bos_on_text:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text (``skip_special_tokens``: drop BOS, turn markers and the like)."""
        return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # -------------------------------------------------------------- messages
    def tokenize_messages(self, messages: list[Message], *, add_end_tokens: bool = True
                          ) -> tuple[list[int], list[bool]]:
        """Render messages with the chat template, tokenize, and mask by message.

        The ids are those of ``apply_chat_template(conversation, tokenize=True)``.
        Each message's part of the rendered text ends where the template's
        rendering of the conversation up to that message ends. Templates that
        render an earlier message differently once later messages follow
        (Qwen3 writes the last assistant turn with a ``<think>`` block and
        drops reasoning from earlier turns) are split where the end of that
        shorter rendering lines up best with the full text: the position after
        which the longest stretch of its end (content, end-of-turn marker)
        matches.

        Args:
            messages: the conversation (text content only).
            add_end_tokens: False leaves the last message open, for
                generation: a last assistant message with no text becomes the
                template's generation prompt (``add_generation_prompt``), one
                with text is continued (``continue_final_message``), and after
                any other last message the generation prompt is added.

        Returns:
            ``(tokens, mask)``, equal lengths, at most ``max_seq_len``;
            ``mask[i]`` is True where token ``i`` must not be a training target.

        Raises:
            ValueError: the folder has no chat template, a message has
                non-text content, or the template's text cannot be split into
                messages.
        """
        if not messages:
            return [], []
        if self.chat_template is None:
            raise ValueError(f"'{self._source}' has no chat template (no chat_template in tokenizer_config.json, no "
                             "chat_template.jinja), so messages cannot be formatted: give one as chat_template "
                             "(tokenizer.chat_template in a config: Jinja text or a .jinja file), or train on "
                             "plain text with text_completion_dataset")
        conversation = [_as_dict(m) for m in messages]
        options: dict[str, bool] = {}
        if not add_end_tokens:
            if conversation[-1]["role"] != "assistant":
                options["add_generation_prompt"] = True
            elif conversation[-1]["content"]:
                options["continue_final_message"] = True
            else:
                conversation = conversation[:-1]  # its text is the generation prompt
                options["add_generation_prompt"] = True
        text = self._render(conversation, **options)
        ends: list[int] = []
        for k in range(1, len(messages)):
            ends.append(self._end_of(conversation[:k], text, ends[-1] if ends else 0))
        encoding = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        tokens = list(encoding["input_ids"])
        mask = [messages[bisect.bisect_right(ends, start)].masked for start, _ in encoding["offset_mapping"]]
        if self.max_seq_len is not None and len(tokens) > self.max_seq_len:
            tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
            if add_end_tokens and self.eos_id is not None:
                tokens[-1], mask[-1] = self.eos_id, True  # as torchtune's truncate(..., eos_id)
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
        sample["tokens"], sample["mask"] = self.tokenize_messages(messages, add_end_tokens=not inference)
        return sample

    def _render(self, conversation: list[dict[str, str]], **options: bool) -> str:
        return self._hf.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                            **options, **self._template_kwargs)

    def _end_of(self, head: list[dict[str, str]], text: str, start: int) -> int:
        """Where, in ``text`` (the whole conversation rendered), the messages ``head`` end; at or after ``start``."""
        rendered = self._render(head)
        if text.startswith(rendered):
            return max(len(rendered), start)
        # The template renders the last message of `head` differently when it is last (see
        # tokenize_messages): past the common beginning, find where `rendered`'s end fits best.
        common = 0
        while common < min(len(rendered), len(text)) and rendered[common] == text[common]:
            common += 1
        tail = rendered[common:]
        best, best_end = -1, None
        for end in range(max(start, common) + 1, len(text) + 1):
            if text[end - 1] != tail[-1]:
                continue
            n = 1
            while n < len(tail) and end - n > common and text[end - n - 1] == tail[-n - 1]:
                n += 1
            if n > best:
                best, best_end = n, end
                if n == len(tail):
                    break
        if best_end is None:
            raise ValueError(f"the chat template of '{self._source}' renders the conversation so that message "
                             f"{len(head) - 1} ({head[-1]['role']}) cannot be found in it: prompt masking by message "
                             "is not possible with this template")
        return best_end


def _as_dict(message: Message) -> dict[str, str]:
    """A torchtune ``Message`` as the ``{"role", "content"}`` dict chat templates read."""
    if any(part["type"] != "text" for part in message.content):
        raise ValueError(f"only text messages can be formatted; a {message.role} message has "
                         f"{', '.join(sorted({p['type'] for p in message.content} - {'text'}))} content")
    return {"role": message.role, "content": message.text_content}


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []


def hf_tokenizer(path: str, max_seq_len: int | None = None, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> HFTokenizer:
    """Build an :class:`HFTokenizer` from a Hugging Face model folder.

    Args:
        path: the folder (``tokenizer.json``, ``tokenizer_config.json``, ...),
            or its ``tokenizer.json`` / ``tokenizer_config.json``.
        max_seq_len: see :class:`HFTokenizer`.
        chat_template: use this template instead of the folder's: Jinja text,
            or the path of a ``.jinja`` file.
        chat_template_kwargs: extra template variables (e.g.
            ``{enable_thinking: false}`` for Qwen3).

    Returns:
        The tokenizer. ``stop_tokens``: its ``eos_token`` and the
        ``eos_token_id`` of ``generation_config.json`` and ``config.json``.

    Raises:
        ValueError: ``path`` is not a folder transformers reads as a fast
            tokenizer (the message says what was expected), or
            ``chat_template`` names a file that cannot be read.
    """
    folder = Path(path)
    if folder.is_file() and folder.name in TOKENIZER_FILES:
        folder = folder.parent
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is a file"
        raise ValueError(f"'{path}' {what}; expected {EXPECTED}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"'{path}' holds neither {' nor '.join(TOKENIZER_FILES)}; expected {EXPECTED}")
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # transformers reports a broken file as OSError, ValueError, JSON or tokenizers errors
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise ValueError(f"'{path}' is not a tokenizer transformers can read ({reason}); expected {EXPECTED}") from None
    if chat_template is not None and "{" not in chat_template:  # Jinja text always has a {{ or {%
        try:
            chat_template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"chat_template '{chat_template}' is neither Jinja text nor a readable .jinja file "
                             f"({type(err).__name__}: {err})") from None
    elif chat_template is None:
        try:
            chat_template = hf.get_chat_template()  # the "default" one where a folder names several
        except ValueError:  # none in the folder
            chat_template = None
    stop_tokens: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            stop_tokens += _ids(json.loads((folder / name).read_text()).get("eos_token_id"))
    return HFTokenizer(hf, chat_template, max_seq_len=max_seq_len, chat_template_kwargs=chat_template_kwargs,
                       stop_tokens=stop_tokens, source=str(path))
