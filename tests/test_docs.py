"""The README and docs/ hold together: links resolve, anchors exist, no page is orphaned, the README stays short.

A unit test (no services): it reads Markdown files only. Anchors follow GitHub's rules, since GitHub is where
the pages are read.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 25_000

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target ends at the first space (a title may follow) or ')'.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The file's lines outside fenced code blocks (whose '#' lines are not headings, nor their brackets links)."""
    out, fenced = [], False
    for line in HTML_COMMENT.sub("", text).splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without Markdown, lower-cased, every character but letters,
    marks, digits, '-', '_' and spaces dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*|_(?=\W|$)|(?<=\W)_)", "", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = []
    for ch in text:
        if ch in " -" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in the file; a repeated heading gets -1, -2, … as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    out = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        out.extend(m.group(1) for m in LINK.finditer(INLINE_CODE.sub("", line)))
    return out


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What in `path` points nowhere: a missing file, or an anchor no heading of the target gives."""
    problems = []
    for target in links(path):
        if not target or is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(root)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{path.relative_to(root)}: {target}: no heading gives #{anchor} in "
                            f"{dest.relative_to(root)}")
    return problems


def linked_pages(path: Path) -> set[Path]:
    out = set()
    for target in links(path):
        file_part = target.partition("#")[0]
        if file_part and not is_external(target) and file_part.endswith(".md"):
            out.add((path.parent / unquote(file_part)).resolve())
    return out


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_readme_stays_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or not page.exists():
            continue
        reached.add(page)
        todo.extend(linked_pages(page))
    orphans = [str(p.relative_to(ROOT)) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in reached]
    assert orphans == [], f"not linked from the README or a page it leads to: {orphans}"


@pytest.mark.parametrize("heading, slug", [
    ("What is guaranteed, and what is not", "what-is-guaranteed-and-what-is-not"),
    ("The safe high watermark (ids commit out of order)", "the-safe-high-watermark-ids-commit-out-of-order"),
    ("Backfill — initial load of a large table", "backfill--initial-load-of-a-large-table"),
    ("`where:`: a row filter", "where-a-row-filter"),
    ("The `rowrelay` command", "the-rowrelay-command"),
    ("Warm runs and freshness (issue 10)", "warm-runs-and-freshness-issue-10"),
    ("Why 0.8× the Spark ceiling", "why-08-the-spark-ceiling"),
    ("snake_case and **bold**", "snake_case-and-bold"),
])
def test_anchors_are_github_style(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Here\n\n```\n# not a heading\n[x](nowhere.md)\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#here) [gone](a.md#not-a-heading) [missing](c.md) `[code](c.md)` "
                    "[site](https://example.com/x.md)\n")
    problems = [p.split(": ", 1)[1] for p in broken_links(page, root=tmp_path)]
    assert problems == ["a.md#not-a-heading: no heading gives #not-a-heading in a.md", "c.md: no such file"]

