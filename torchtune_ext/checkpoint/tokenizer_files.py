"""The tokenizer files of a checkpoint folder: they carry the chat template training wrote.

torchtune's checkpointers copy the base folder's tokenizer files into every
checkpoint, whose chat template may not be the format training used
(SmolLM2's adds a default system prompt). The caller that knows the run's
tokenizer hands its template in (:func:`torchtune_ext.data.tokenizer.training_chat_template`);
this module only writes it.
"""

import json
import os
from pathlib import Path
from typing import Any


def write_chat_template(folder: Path, template: str) -> bool:
    """Make the Hugging Face tokenizer files in ``folder`` carry ``template``.

    transformers takes a folder's chat template from ``chat_template.jinja`` if
    there is one, else from ``tokenizer_config.json``'s ``chat_template`` (a
    string, or a list of named templates whose ``default`` it uses). That one
    is replaced; other named templates stay. A folder without either file
    (no Hugging Face tokenizer) is left alone. Files are replaced, never
    written through, so a link to the base folder's file cannot change it.

    Args:
        folder: a checkpoint folder (the staging one, before its manifest).
        template: Jinja text.

    Returns:
        Whether a file changed.
    """
    jinja, config_file = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    if jinja.is_file():
        if jinja.read_text(encoding="utf-8") == template:
            return False
        _replace(jinja, template)
        return True
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text(encoding="utf-8"))
    current = config.get("chat_template")
    if isinstance(current, list):
        new: Any = [dict(t, template=template) if t.get("name") == "default" else t for t in current]
        if not any(t.get("name") == "default" for t in current):
            new.append({"name": "default", "template": template})
    else:
        new = template
    if new == current:
        return False
    config["chat_template"] = new
    _replace(config_file, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return True


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
