"""docs/configuration.md is the schema: every key, its default and its meaning, generated from it."""

from pathlib import Path

import pytest

from torchtune_ext.config import COMMON_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, Key
from torchtune_ext.config import docs as config_docs
from torchtune_ext.config.checkers import boolean

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_configuration_page_is_what_the_schema_generates():
    assert PAGE.read_text() == config_docs.page(), (
        "docs/configuration.md differs from the schema: run `python -m torchtune_ext.config.docs > "
        "docs/configuration.md`")


def test_every_key_has_one_line_saying_what_it_does():
    for keys in (COMMON_KEYS, DISTRIBUTED_KEYS, LORA_KEYS):
        for name, key in keys.items():
            assert key.doc.strip() and "\n" not in key.doc, name


def test_the_page_lists_every_key_of_each_section_with_its_default():
    text = PAGE.read_text()
    assert text.startswith("# Configuration\n")
    sections = {title: text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
                for title, _, _ in config_docs.SECTIONS}
    for (title, _, keys) in config_docs.SECTIONS:
        rows = [line for line in sections[title].splitlines() if line.startswith("| `")]
        assert [row.split("`")[1] for row in rows] == list(keys)
        for row, key in zip(rows, keys.values()):
            assert row.split(" | ")[1] == config_docs.format_default(key)
    assert "| `gradient_accumulation_steps` | `1` |" in sections["Common keys"]
    assert "| `output_dir` | required |" in sections["Common keys"]
    assert "| `loss` | `{_component_: torchtune_ext.train.loss.SummedCrossEntropyLoss, num_output_chunks: auto}` |" \
        in sections["Common keys"]


def test_a_key_without_a_doc_line_stops_the_page(monkeypatch):
    monkeypatch.setattr(config_docs, "SECTIONS", (("Common keys", "", {"new_key": Key(False, boolean)}),))
    with pytest.raises(ValueError, match="new_key"):
        config_docs.page()
