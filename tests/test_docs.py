"""The documentation links only inside the repository: every relative link of README.md and docs/*.md
resolves to a file of the repository (and a ``#fragment`` to a heading of its target)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text: str) -> list[str]:
    """Link targets of Markdown text (inline links, images, reference definitions, HTML), not in code."""
    prose = _FENCE.sub("", text)
    targets = [*_DEFINITION.findall(prose), *_HTML.findall(prose)]
    # inline code never holds a link, but a link's text may hold inline code: blank the code, keep the brackets
    return targets + _LINK.findall(_INLINE_CODE.sub("``", prose))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, inline-code marks and punctuation dropped, spaces → ``-``."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_the_link_parser_on_known_cases() -> None:
    text = (
        'See [`docs/methods.md`](docs/methods.md#5-fp-bma) and ![fig](docs/figures/a.png "title").\n'
        "[ref]: ../outside.md\n"
        '<img src="img.png"> [paper](https://arxiv.org/abs/2406.15664) `[not](a link)`\n'
        "```python\nx = [1](2)\n```\n"
    )
    assert sorted(links(text)) == sorted(
        [
            "docs/methods.md#5-fp-bma",
            "docs/figures/a.png",
            "../outside.md",
            "img.png",
            "https://arxiv.org/abs/2406.15664",
        ]
    )
    assert slug("5. FP-BMA: an ascent step in a KL ball") == "5-fp-bma-an-ascent-step-in-a-kl-ball"
    assert slug("FP-BMA's options") == "fp-bmas-options"
    assert slug("Python API") == "python-api"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    problems = []
    for target in links(text):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # a web address (a paper, a download): not a file of the repository
        path, _, fragment = target.partition("#")
        if path.startswith("/"):
            problems.append(f"{target}: an absolute path, not a link inside the repository")
            continue
        resolved = (document.parent / unquote(path)).resolve() if path else document
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: points outside the repository ({resolved})")
        elif not resolved.exists():
            problems.append(f"{target}: no such file in the repository")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{target}: {resolved.name} has no heading with anchor #{fragment}")
    assert not problems, f"{document.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_maths_lives_in_the_repository() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/methods.md" in links(readme)
    assert not [t for t in links(readme) if "shared/" in t]
