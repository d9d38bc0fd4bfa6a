"""Every relative link in README.md and docs/*.md resolves: the file (or folder) exists, and a ``#anchor``
names a heading of the target page under GitHub's slug rules (lower case, punctuation dropped, spaces to
hyphens, ``-1``, ``-2`` for repeated headings). The checker is shown to catch a broken link and a bad anchor
first."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger): the rendered text (code spans' content, link
    text, no emphasis markers) lower-cased, every character that is not a letter, digit, ``_``, ``-`` or space
    dropped, spaces turned into hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"(\*\*|__|\*)(?=\S)(.+?)(?<=\S)\1", r"\2", text)  # emphasis markers
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown page, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", text):
        out.add(m.group(1))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    out = []
    for i, line in _prose_lines(text):
        bare = _CODE_SPAN.sub("", line)
        out += [(i, m.group(2)) for m in _LINK.finditer(bare)]
        m = _REF_DEF.match(bare)
        if m:
            out.append((i, m.group(1)))
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What in ``page`` does not resolve: ``"LINE: TARGET: why"``; links outside the repository (a scheme or
    ``//``) are not checked."""
    text = page.read_text(encoding="utf-8")
    bad = []
    for line, target in links(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not this test's business
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if path and not dest.exists():
            bad.append(f"{line}: {target}: no such file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
            continue
        if path and not dest.is_relative_to(root):
            bad.append(f"{line}: {target}: outside the repository")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                bad.append(f"{line}: {target}: an anchor into a file that is not a markdown page")
            elif unquote(anchor) not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{line}: {target}: no heading with the anchor #{anchor} in {dest.name}")
    return bad


# ----------------------------------------------------------------------------------------- the checker


def test_github_slugs_of_this_projects_heading_shapes():
    assert github_slug("The precision ladder: INT8 where BF16 is too dear (`gnmr_hf.planning.ladder`)") == \
        "the-precision-ladder-int8-where-bf16-is-too-dear-gnmr_hfplanningladder"
    assert github_slug("Measured: the demo on this project's development machine") == \
        "measured-the-demo-on-this-projects-development-machine"
    assert github_slug("8. Package layout") == "8-package-layout"
    assert github_slug("A budget in memory over the 4-bit model: `+N%nf4`") == \
        "a-budget-in-memory-over-the-4-bit-model-nnf4"
    assert github_slug("At 240 steps: does the gain survive?") == "at-240-steps-does-the-gain-survive"
    assert github_slug("**What** it buys, [measured](x.md)") == "what-it-buys-measured"
    text = "# Title\n\n## Results\n\n```bash\n# not a heading\n```\n\n### Results\n"
    assert anchors(text) == {"title", "results", "results-1"}


def test_the_checker_catches_a_broken_link_and_a_bad_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## The precision ladder (`ladder`)\n\ntext\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("")
    page = tmp_path / "README.md"
    page.write_text(
        "# Front\n\n## Install\n\n"
        "[ok](docs/page.md) [ok anchor](docs/page.md#the-precision-ladder-ladder) [here](#install)\n"
        "[script](bench/x.py) ![plot](docs/missing.png) [web](https://example.org/x#y)\n"
        "[gone](docs/nope.md) [bad anchor](docs/page.md#the-precision-ladder)\n"
        "`[in code](nowhere.md)` and [local bad](#tests)\n"
        "```bash\n[in a block](nowhere.md)\n```\n"
        "[ref]: docs/also-missing.md\n")
    assert broken_links(page, tmp_path) == [
        "6: docs/missing.png: no such file docs/missing.png",
        "7: docs/nope.md: no such file docs/nope.md",
        "7: docs/page.md#the-precision-ladder: no heading with the anchor #the-precision-ladder in page.md",
        "8: #tests: no heading with the anchor #tests in README.md",
        "12: docs/also-missing.md: no such file docs/also-missing.md",
    ]


# ----------------------------------------------------------------------------------------- the pages


def test_the_pages_are_there():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/results.md", "docs/recipes.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_docs_index_lists_every_docs_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = {t.partition("#")[0] for _, t in links(index)}
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md" and p.name not in listed]
    assert missing == []
