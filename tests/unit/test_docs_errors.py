"""The docs stay true to the code: docs/api.md's error table is the one
rendered from shared/errors.py, and every relative link in the docs
resolves to a file."""

from __future__ import annotations

import re
from pathlib import Path

from shared.errors import WHEN, Code, markdown_table

REPO = Path(__file__).resolve().parents[1]
while not (REPO / "pyproject.toml").exists():  # (the tests may sit a folder deeper)
    REPO = REPO.parent
API_DOC = REPO / "docs" / "api.md"
BEGIN, END = "<!-- errors:begin -->\n", "<!-- errors:end -->"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_api_docs_error_table_is_the_generated_one() -> None:
    text = API_DOC.read_text()
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table == markdown_table(), "regenerate it: python -m shared.errors"


def test_every_code_says_when_it_is_given() -> None:
    assert set(WHEN) == set(Code)


def _docs() -> list[Path]:
    return [
        REPO / "README.md",
        REPO / "bench" / "README.md",
        REPO / "envoy" / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "bench" / "results").glob("*.md")),
    ]


def test_relative_links_in_the_docs_resolve() -> None:
    broken = []
    for doc in _docs():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, broken
