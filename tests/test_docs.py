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


# --- the API reference (mkdocs + mkdocstrings, scripts/docs_roles.py) ----------------------------------------


def _roles():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_roles", ROOT / "scripts" / "docs_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docstrings_roles_become_autorefs_and_a_missing_name_a_required_one() -> None:
    pytest.importorskip("griffe")
    known = {"flatbma.predict.evaluate": True, "flatbma.old_name": False}

    def resolve(name: str):
        path = name if name.startswith("flatbma") else f"flatbma.{name}"
        return None if name.startswith("torch") else (path, known.get(path, True))

    text = _roles().convert(
        "See :func:`~flatbma.predict.evaluate`, :class:`torch.nn.Module`, :meth:`the mean <flatbma.predict.evaluate>` "
        "and :func:`flatbma.old_name`.",
        resolve,
    )
    assert text == (
        'See <autoref identifier="flatbma.predict.evaluate" optional><code>evaluate</code></autoref>, '
        "<code>torch.nn.Module</code>, "
        '<autoref identifier="flatbma.predict.evaluate" optional><code>the mean</code></autoref> and '
        '<autoref identifier="flatbma.old_name"><code>flatbma.old_name</code></autoref>.'  # required: fails the build
    )


def test_names_resolve_in_their_docstrings_scope() -> None:
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "src")])
    package = loader.load("flatbma")
    loader.resolve_aliases(implicit=False, external=False)
    roles = _roles()
    bma = package["predictor.BMA"]
    resolve = roles.resolver(bma["load"], loader.modules_collection)
    assert resolve("save") == ("flatbma.predictor.BMA.save", True)  # a method of the enclosing class
    assert resolve("flatbma.fit_posterior") == ("flatbma.fit_posterior", True)
    assert resolve("Tensor") is None and resolve("int") is None  # torch's, a builtin: code, no link
    assert resolve("no_such_helper") == ("no_such_helper", False)  # required: autorefs reports it as written
    assert resolve("flatbma.predict.no_such") == ("flatbma.predict.no_such", False)


def test_the_api_reference_lists_the_public_api_with_links_and_no_private_names(tmp_path) -> None:
    """The site builds in strict mode (an unresolved reference fails) and its reference page is complete."""
    pytest.importorskip("mkdocstrings_handlers.python")
    import subprocess
    import sys

    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    ids = set(re.findall(r'id="(flatbma[^"]*)"', page))
    import flatbma

    public = {f"flatbma.{name}" for name in flatbma.__all__ if name != "__version__"}
    assert {"flatbma.fit_posterior", "flatbma.load_posterior", "flatbma.BMA.calibrate"} <= ids
    assert public <= ids, sorted(public - ids)
    private = sorted(i for i in ids if re.search(r"\._", i))
    assert not private, private[:10]
    assert not re.findall(r":(?:func|class|meth|mod|attr|data|exc):`", page)  # no role shown as text
    assert 'href="#flatbma.fit_posterior"' in page and page.count('class="autorefs autorefs-internal"') > 500
