"""Every Markdown link in README.md, CHANGELOG.md and docs/*.md leads somewhere: the file exists
and, for a `#anchor` into a Markdown page, a heading of that page has the slug GitHub gives it.
Every docs page is linked from the README, so a newcomer can reach it from the front page."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, every character that is not a
    letter, digit, `_`, `-` or space removed, each space a hyphen."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers, not snake_case
    kept = "".join(ch for ch in text.lower() if ch.isalnum() or ch in "_- ")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub makes on `page`: heading slugs (repeats get -1, -2, ...) and HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline and reference link outside code."""
    found = []
    for number, line in prose_lines(page.read_text()):
        line = CODE_SPAN.sub("", line)
        found += [(number, match.group(2)) for match in INLINE_LINK.finditer(line)]
        found += [(number, match.group(1)) for match in REFERENCE.finditer(line)]
    return found


def broken(page: Path) -> list[str]:
    """What is wrong with each local link of `page`, as `file:line: target: reason`."""
    problems = []
    for number, target in links(page):
        if not target or EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        where = (page.parent / unquote(path_part)).resolve() if path_part else page
        name = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{number}: {target}"
        if not where.exists():
            problems.append(f"{name}: no such file")
        elif anchor and where.suffix == ".md" and unquote(anchor) not in anchors(where):
            problems.append(f"{name}: no heading with the anchor #{anchor} in {where.name}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_leads_somewhere(page):
    assert page.exists(), page
    assert broken(page) == []


def test_every_docs_page_and_the_changelog_are_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {(readme.parent / target.partition("#")[0]).resolve() for _, target in links(readme)
              if not EXTERNAL.match(target) and target.partition("#")[0]}
    wanted = {ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")}
    assert sorted(str(p.relative_to(ROOT)) for p in wanted - linked) == []


def test_the_readme_stays_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("heading, anchor", [
    ("What `--keep` does, and when it does nothing", "what---keep-does-and-when-it-does-nothing"),
    ("3. Model names and pre-downloads", "3-model-names-and-pre-downloads"),
    ("Options: one object per group, from the client to the kernel",
     "options-one-object-per-group-from-the-client-to-the-kernel"),
    ("8. Coverage (bench/families.py against the serving path)", "8-coverage-benchfamiliespy-against-the-serving-path"),
    ("`specprefill cache verify`", "specprefill-cache-verify"),
    ("The **draft** and [its cache](x.md)", "the-draft-and-its-cache"),
    ("follow_chunks and __init__", "follow_chunks-and-init"),  # __init__ renders as bold "init"
])
def test_slugs_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [bad](other.md#not-a-heading)\n"
                    "`[in code](missing.md)` [web](https://example.com/x.md) [self](#top)\n\n# Top\n")
    assert [problem.split(": ", 1)[1] for problem in broken(page)] == [
        "missing.md: no such file", "other.md#not-a-heading: no heading with the anchor #not-a-heading in other.md"]
