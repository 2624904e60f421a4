"""README.md and docs/*.md: a short front door whose commands, links and tables stay true (issue 32, item 4).

Text only: nothing here imports torch or starts a recipe.
"""

import re
import shlex
from pathlib import Path

import pytest

from torchtune_ext.moved import canonical

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
CI_SCRIPT = REPO_ROOT / ".ci" / "run"

# The README's first two commands, as a new user copies them: keep them exactly as they are.
INSTALL_AND_RUN = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m torchtune_ext.download'
    " && tune run recipes/full_finetune_single_device.py --config configs/smollm2/135M_full_single_device.yaml"
)
ACTIVATE = ". .venv/bin/activate"
TEST_COMMAND = "python -m pytest -q"
MAX_README_LINES = 230

# Pages other helpers are writing on their own branches (issue 32): linked from here before
# they land. Once a page exists it is checked like any other; remove it from this set then.

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages():
    return [README] + sorted(DOCS.glob("*.md"))


def prose_lines(text):
    """The lines outside fenced code blocks (``` or ~~~), as (line number, line)."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def strip_code_spans(line):
    return re.sub(r"`[^`]*`", "", line)


def github_anchor(heading, seen):
    """The id GitHub gives a heading: rendered text, lower case, punctuation dropped, spaces to hyphens.

    A repeated heading gets ``-1``, ``-2``, ... in order (``seen`` counts them per page).
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)", "", text)  # code and emphasis markers
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def anchors(path):
    seen = {}
    return {github_anchor(m.group(2), seen)
            for _, line in prose_lines(path.read_text())
            if (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line))}


def links(path):
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(strip_code_spans(line)):
            yield number, match.group(1)


def commands(text):
    """Shell commands in code blocks, in order: 4-space indented blocks and fenced blocks."""
    found, inside, previous_blank = [], False, True
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if inside:
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(line.strip())
        elif line.startswith("    ") and line.strip() and (previous_blank or found):
            found.append(line.strip())
        previous_blank = not line.strip()
    return found


# --- the README ----------------------------------------------------------------------------------


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details to docs/"


def test_readme_starts_with_the_install_and_the_test_command():
    first, second = commands(README.read_text())[:2]
    assert first == INSTALL_AND_RUN
    assert second == f"{ACTIVATE} && {TEST_COMMAND}"


def test_ci_runs_the_readmes_install_and_test_command():
    ci = [line.strip() for line in CI_SCRIPT.read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert [line for line in ci if "pytest" in line] == [TEST_COMMAND]
    # The install command's steps, one line each in the script (pip there runs quietly).
    assert any("pip install" in line and '-e ".[test]"' in line for line in ci)
    assert "python -m torchtune_ext.download" in ci
    recipe, config = shlex.split(INSTALL_AND_RUN.split(" && ")[-1])[2::2]
    assert (REPO_ROOT / recipe).is_file() and (REPO_ROOT / config).is_file()


def test_readme_config_table_lists_every_config_folder():
    table = "\n".join(line for line in README.read_text().splitlines() if line.startswith("|"))
    folders = sorted(p.name for p in (REPO_ROOT / "configs").iterdir() if p.is_dir())
    assert folders, "no configs/ folders found"
    missing = [f"configs/{name}/" for name in folders if f"`configs/{name}/`" not in table]
    assert not missing, f"README.md's config table lacks {missing}"


def expand(pattern):
    """`qwen3/8B_{full,lora}[_single_device].yaml` -> the four names it stands for."""
    names = [""]
    for part in re.split(r"(\{[^}]*\}|\[[^\]]*\])", pattern):
        if part.startswith("{"):
            choices = part[1:-1].split(",")
        elif part.startswith("["):
            choices = ["", part[1:-1]]
        else:
            choices = [part]
        names = [name + choice for name in names for choice in choices]
    return names


def test_config_files_named_in_the_readme_exist():
    named = set(re.findall(r"configs/[\w./{},\[\]-]+?\.yaml", README.read_text()))
    files = {name for pattern in named for name in expand(pattern)}
    missing = sorted(name for name in files if not (REPO_ROOT / name).is_file())
    assert len(files) > len(named) > 1, "the README names no config files, or no {a,b} pattern"
    assert not missing, f"README.md names config files that do not exist: {missing}"


def test_readme_code_map_names_modules_that_exist():
    """Every `torchtune_ext...` module and file the README names is there, and so is a name in it."""
    text = README.read_text()
    wrong = []
    for path in set(re.findall(r"torchtune_ext/[\w/]+\.py", text)):
        if not (REPO_ROOT / path).is_file():
            wrong.append(path)
    for dotted in set(re.findall(r"torchtune_ext(?:\.\w+)+", text)):
        parts = canonical(dotted).split(".")  # a command's module path of earlier versions still runs
        module, rest = REPO_ROOT / parts[0], parts[1:]
        while rest and ((module / rest[0]).is_dir() or (module / f"{rest[0]}.py").is_file()):
            module = module / rest[0] if (module / rest[0]).is_dir() else module / f"{rest[0]}.py"
            rest = rest[1:]
        source = module / "__init__.py" if module.is_dir() else module
        if rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()):
            wrong.append(dotted)  # neither a module nor a name its module defines or imports
    # `CheckpointManager` (`torchtune_ext.checkpoint`): a class named beside its module
    for name, dotted in re.findall(r"`(\w+)` \(`(torchtune_ext(?:\.\w+)+)`\)", text):
        path = REPO_ROOT / Path(*dotted.split("."))
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not source.is_file() or not re.search(rf"\b{name}\b", source.read_text()):
            wrong.append(f"{name} in {dotted}")
    # `torchtune_ext/loop.py` (`TrainingRun`, `FinetuneRecipe`): names beside their file
    for path, names in re.findall(r"`(torchtune_ext/[\w/]+\.py)` \(((?:`\w+`(?:, )?)+)\)", text):
        source = (REPO_ROOT / path).read_text() if (REPO_ROOT / path).is_file() else ""
        wrong += [f"{name} in {path}" for name in re.findall(r"`(\w+)`", names)
                  if not re.search(rf"^(?:class|def) {name}\b", source, re.M)]
    assert not wrong, f"README.md names code that does not exist: {sorted(wrong)}"


# --- every page ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_starts_with_a_title(page):
    first = page.read_text().splitlines()[0] if page.read_text() else ""
    assert first.startswith("# "), f"{page.name} starts with {first!r}, not a '# ' title"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path_part, _, fragment = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"line {number}: {target} (no such file)")
            continue
        if fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"line {number}: {target} (no heading with anchor #{fragment})")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: " + "; ".join(broken)


# --- the checker itself --------------------------------------------------------------------------


def test_github_anchors():
    seen = {}
    assert github_anchor("Why `tune run recipes/...` finds these recipes", seen) == \
        "why-tune-run-recipes-finds-these-recipes"
    assert github_anchor("Weights & Biases", seen) == "weights--biases"
    assert github_anchor("Realistic settings (issue 13)", seen) == "realistic-settings-issue-13"
    assert github_anchor("Packing a step's samples: `pack_micro_batches`", seen) == \
        "packing-a-steps-samples-pack_micro_batches"
    assert github_anchor("Tests", seen) == "tests"
    assert github_anchor("Tests", seen) == "tests-1"


def test_link_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Sub part\n\n[ok](#sub-part) [bad](#nope) [file](b.md)\n"
                                   "```\n[in code](c.md)\n```\n")
    found = [target for _, target in links(tmp_path / "a.md")]
    assert found == ["#sub-part", "#nope", "b.md"]
    assert anchors(tmp_path / "a.md") == {"a", "sub-part"}


def test_commands_are_read_in_order():
    text = "intro\n\n    first command\n\ntext\n\n```bash\n# a comment\nsecond\n```\n\n    third\n"
    assert commands(text) == ["first command", "second", "third"]
