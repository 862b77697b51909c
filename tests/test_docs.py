"""The README and the pages under docs/: links that resolve, no placeholders, a short README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 330
PLACEHOLDERS = ("LINK_TABLE", "TODO", "TBD", "XXX")

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def prose(path: Path) -> str:
    """The file's text without fenced code blocks and inline code spans."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return INLINE_CODE.sub("", text)


def link_targets(path: Path) -> list[str]:
    return LINK.findall(prose(path))


def relative_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", markdown_files(), ids=relative_name)
def test_relative_links_resolve(path: Path) -> None:
    missing: list[str] = []
    for target in link_targets(path):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        local = target.split("#", 1)[0].split("?", 1)[0]
        if not local:
            continue
        if not (path.parent / local).exists():
            missing.append(target)
    assert not missing, f"{relative_name(path)} links to missing files: {missing}"


@pytest.mark.parametrize("path", markdown_files(), ids=relative_name)
def test_no_placeholder_words(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [word for word in PLACEHOLDERS if re.search(rf"\b{word}\b", text)]
    assert not found, f"{relative_name(path)} contains placeholder words: {found}"


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def test_link_pattern_finds_links_and_images() -> None:
    sample = "See [a](docs/a.md#part) and ![b](img/b.png) but not `[c](d.md)`."
    assert LINK.findall(INLINE_CODE.sub("", sample)) == ["docs/a.md#part", "img/b.png"]
