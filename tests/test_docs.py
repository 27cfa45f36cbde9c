"""The documentation's own code and links: README.md and docs/*.md.

Every ```python block runs, each in a fresh namespace and a temporary working directory,
in this process (8 simulated CPU devices, tests/conftest.py). A block preceded by
``<!-- not-run: reason -->`` is skipped (a fragment, or too slow for the tests: keep these
few), and one preceded by ``<!-- run-by: tests/FILE.py -->`` is run by that test instead.
Bash and other blocks are not run.

Every relative link (``](docs/cli.md)``, ``](rules.md#anchor)``, an image) must name a file
that exists, and an anchor a heading of that file (GitHub's rule for heading ids).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

import nnxscale

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(not-run|run-by):\s*(.*?)\s*-->$")
MAX_NOT_RUN = 3  # exceptions stay few: fix a block rather than skip it


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: tuple[str, str] | None  # ("not-run", reason) or ("run-by", path)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced code block of a page, with the HTML comment marker on the line before it."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        assert j < len(lines), f"{page.name}:{start + 1}: unclosed code block"
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mm = MARKER.match(prev)
        marker = (mm.group(1), mm.group(2)) if mm else None
        blocks.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", marker))
        i = j + 1
    return blocks


BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
RUN = [b for b in PYTHON if b.marker is None]


def test_the_pages_have_python_blocks_and_few_exceptions():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1
    assert len(RUN) >= 10, [b.name for b in RUN]
    not_run = [b for b in PYTHON if b.marker and b.marker[0] == "not-run"]
    assert len(not_run) <= MAX_NOT_RUN, [b.name for b in not_run]
    for b in PYTHON:
        if b.marker is None:
            continue
        kind, value = b.marker
        assert value, f"{b.name}: {kind} needs a reason or a test file"
        if kind == "run-by":
            test = ROOT / value
            assert test.is_file() and test.parent == ROOT / "tests", f"{b.name}: run-by {value} is not a test file"
            assert b.page.relative_to(ROOT).as_posix() in test.read_text(), f"{value} does not read {b.page.name}"
    # markers sit right above a python block, nowhere else
    for page in PAGES:
        lines = page.read_text().splitlines()
        starts = {b.line for b in PYTHON if b.page == page}
        for n, line in enumerate(lines, 1):
            if MARKER.match(line.strip()):
                nxt = next(k for k in range(n + 1, len(lines) + 1) if lines[k - 1].strip())
                assert nxt in starts, f"{page.name}:{n}: a marker not followed by a python block"


@pytest.fixture
def fresh_process_state(tmp_path, monkeypatch):
    """A block may set XLA_FLAGS and write files: keep both inside the test.

    Only the variables a block changed are put back, in place. Emptying the environment and
    filling it again, as this fixture did until 2026-11-27, makes glibc 2.36 (Debian 12's;
    glibc's commit ce4122ff of late 2024 stopped it) build a new ``environ`` array name by
    name and free the old ones, while XLA's and tensorstore's threads may be reading it with
    ``getenv``: a use after free, which no Python code can catch. Setting a name that exists
    replaces one pointer in place. On Python 3.13.0 an xdist worker died of a segmentation
    fault three times in about 15 cold runs; the two whose test is known (2026-11-26 here,
    and CI on 2026-11-27) died in this file, the only test that emptied the environment."""
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    yield tmp_path
    for name in [name for name in os.environ if name not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_python_block_runs(block, fresh_process_state):
    scope = {"__name__": "__docs__"}
    exec(compile(block.code, block.name, "exec"), scope)


# ---- links ----------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its code blocks and inline code, where brackets are not links."""
    lines = page.read_text().splitlines()
    for b in fenced_blocks(page):
        for k in range(b.line - 1, b.line + b.code.count("\n") + 1):
            lines[k] = ""
    return re.sub(r"(`+).*?\1", "", "\n".join(lines), flags=re.S)


def github_anchors(page: Path) -> set[str]:
    """The ids GitHub gives a page's headings: lowercased, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    text = "\n".join(line for line in prose_with_code_headings(page))
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def prose_with_code_headings(page: Path) -> list[str]:
    """The page's lines outside code blocks (inline code kept: it is part of a heading's id)."""
    lines = page.read_text().splitlines()
    for b in fenced_blocks(page):
        for k in range(b.line - 1, b.line + b.code.count("\n") + 1):
            lines[k] = ""
    return lines


def links() -> list[tuple[Path, str]]:
    return [(page, m.group(1)) for page in PAGES for m in LINK.finditer(prose(page))]


def test_links_resolve():
    found = links()
    assert any(t.startswith("docs/") for p, t in found if p.name == "README.md")
    bad = []
    for page, target in found:
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_listed_in_the_readme_and_links_back():
    readme = prose(ROOT / "README.md")
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
        assert "](../README.md)" in "\n".join(page.read_text().splitlines()[:6]), f"{page.name} does not link back"


def test_no_private_source_paths():
    for page in PAGES:
        assert "src/nnxscale/_" not in page.read_text(), f"{page.name} names a private module's file"


def test_the_api_table_names_public_names():
    """The table of names in docs/design.md lists only what nnxscale exports."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| area | names in `nnxscale` |") :].split("\n\n", 1)[0]
    names = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[2])}
    assert len(names) > 50 and not names - set(nnxscale.__all__), sorted(names - set(nnxscale.__all__))
