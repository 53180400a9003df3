"""The README's code blocks, for the tests that run what it shows as written."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(lang: str, needle: str) -> str:
    """The body of the README's one ```lang code block containing `needle` (AssertionError when
    none or several do, so an edit that drops or duplicates a shown command fails its test)."""
    text = README.read_text()
    blocks = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith(lang + "\n")]
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"README.md: {len(found)} {lang} blocks contain {needle!r}"
    return found[0]


def readme_line(lang: str, prefix: str) -> str:
    """The one line starting with `prefix` in the README's ```lang blocks."""
    block = readme_block(lang, prefix)
    lines = [ln for ln in block.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"README.md: {len(lines)} lines start with {prefix!r}"
    return lines[0]
