"""``docs/configuration.md``, generated from the schema: every key, its default and what it means.

    python -m torchtune_ext.config.docs > docs/configuration.md

``tests/config/test_docs.py`` fails when the page and the schema disagree.
"""

import json
from typing import Any, Dict, List

from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.schema import COMMON_KEYS, DISTILLATION_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, NO_DEFAULT, Key

# (section title, what it covers, keys)
SECTIONS = (
    ("Common keys", "Read by every recipe.", COMMON_KEYS),
    ("Distributed keys", "Read by the distributed recipes (`*_distributed.py`, FSDP2), besides the common keys.",
     DISTRIBUTED_KEYS),
    ("LoRA keys", "Read by the LoRA recipes (`lora_*.py`), besides the common keys; they replace a common key of "
     "the same name.", LORA_KEYS),
    ("Distillation keys", "Read by the knowledge-distillation recipes (`knowledge_distillation_*.py`), besides the "
     "common keys (and the LoRA keys for a LoRA student; docs/distillation.md).", DISTILLATION_KEYS),
    ("Preference keys", "Read by the preference recipes (`*_dpo_*.py`, [preference](preference.md)), besides the "
     "common keys (and the LoRA or distributed ones); they replace a common key of the same name.", PREFERENCE_KEYS),
)

INTRO = """# Configuration

Every top-level key the recipes read, with its default and what it does.
A config is a torchtune YAML file plus `key=value` overrides on the command
line; `torchtune_ext.config.validate` fills in the defaults below and checks
every value before anything is built, and a mistake is one line naming the
key and the fix (exit status 2). A key in the YAML file that no recipe reads
is a warning (it is named again at the end of the run); one typed on the
command line is an error, with a did-you-mean.

Components (`_component_` entries: `model`, `tokenizer`, `dataset`,
`checkpointer`, `optimizer`, `lr_scheduler`, `loss`, `metric_logger`) take
their builder's own arguments; those are checked against the builder's
signature before any weight loads (`torchtune_ext.run.preflight`).

This page is generated from the schema (`torchtune_ext/config/schema.py`):
`python -m torchtune_ext.config.docs > docs/configuration.md`. A test fails
when the two disagree.
"""


def format_default(key: Key) -> str:
    """The default as the YAML a config would write (``required`` for a key without one)."""
    if key.required or key.default is NO_DEFAULT:
        return "required"
    return f"`{_yaml(key.default)}`"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(keys: Dict[str, Key]) -> List[str]:
    """A Markdown table of ``keys``: name, default, meaning; in the schema's order."""
    lines = ["| Key | Default | Meaning |", "|---|---|---|"]
    for name, key in keys.items():
        lines.append(f"| `{name}` | {_cell(format_default(key))} | {_cell(key.doc)} |")
    return lines


def page() -> str:
    """The whole of ``docs/configuration.md``.

    Raises:
        ValueError: a key of the schema without a ``doc`` line.
    """
    lines = [INTRO.rstrip("\n")]
    for title, covers, keys in SECTIONS:
        undocumented = [name for name, key in keys.items() if not key.doc.strip()]
        if undocumented:
            raise ValueError(f"{title}: key(s) without a doc line in the schema: {', '.join(undocumented)}")
        lines += ["", f"## {title}", "", covers, "", *table(keys)]
    return "\n".join(lines) + "\n"


def main() -> None:
    print(page(), end="")


if __name__ == "__main__":
    main()
