"""The README's links into itself (its contents list, and `see [Router](#router)` in the text)
land on a heading: a renamed section breaks a test, not a reader's click."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def outside_code(text: str) -> str:
    """The README without its fenced code blocks (a `# comment` there is not a heading)."""
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def test_every_link_into_the_readme_names_one_of_its_headings() -> None:
    prose = outside_code(README.read_text())
    headings = {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose, re.MULTILINE)}
    links = set(re.findall(r"\]\(#([^)]+)\)", prose))
    assert len(links) >= 20  # the contents list alone has more
    assert sorted(links - headings) == []


def test_the_contents_list_names_every_section_and_subsection() -> None:
    text = README.read_text()
    contents = text[text.index("Contents:") : text.index("## Quick start")]
    for heading in re.findall(r"^#{2,3} (.+)$", outside_code(text), re.MULTILINE):  # not the ####s
        assert f"(#{github_anchor(heading)})" in contents, heading
