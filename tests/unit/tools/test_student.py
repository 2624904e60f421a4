"""The layer-pruned student of the distillation demo (torchtune_ext.tools.student)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchtune_ext.tools.student import build_layer_pruned


def test_keeps_the_first_layers_the_embedding_and_the_tokenizer(tmp_path):
    source = tmp_path / "teacher"
    source.mkdir()
    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    for i in range(3):
        state[f"model.layers.{i}.mlp.up_proj.weight"] = torch.full((4, 4), float(i))
    save_file(state, source / "model.safetensors")
    (source / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "vocab_size": 8}))
    (source / "tokenizer.json").write_text('{"model": {}}')
    build_layer_pruned(source, tmp_path / "student", 2)
    student = load_file(tmp_path / "student" / "model.safetensors")
    assert set(student) == set(state) - {"model.layers.2.mlp.up_proj.weight"}
    assert all(torch.equal(student[k], state[k]) for k in student)
    assert json.loads((tmp_path / "student" / "config.json").read_text()) == {"num_hidden_layers": 2, "vocab_size": 8}
    assert (tmp_path / "student" / "tokenizer.json").read_text() == '{"model": {}}'
    with pytest.raises(ValueError, match="num_layers"):
        build_layer_pruned(source, tmp_path / "none", 3)
    assert not (tmp_path / "none").exists()
