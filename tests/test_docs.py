"""The documentation's own code, its shown outputs and its links: README.md and docs/*.md.

Every ```python block runs, each in a fresh namespace and a temporary working directory,
in this process (8 simulated CPU devices, tests/conftest.py). A block preceded by
``<!-- not-run: reason -->`` is skipped (a fragment, or too slow for the tests: keep these
few), and one preceded by ``<!-- run-by: tests/FILE.py -->`` is run by that test instead.
Bash and other blocks are not run.

Shown outputs. A page shows what a python block prints in a plain fenced block (no
language) right after it, introduced by one paragraph that begins with "prints"::

    ```python
    print(2 + 2, time.time() - start)
    ```

    prints (the time varies)

    <!-- output varies: the seconds it took -->
    ```
    4 ...
    ```

The test captures the block's standard output (standard error is not compared) and
compares it with the shown block, each line's trailing spaces and the last newlines
ignored. Outputs go in such a block, never in a comment beside ``print(...)``: comments are
not compared. Where part of an output legitimately varies (a time, a figure of this machine
or of the Python/jax stack: the pages' outputs must hold on both stacks CI tests), the page
writes ``...`` in its place, matched like doctest's ELLIPSIS (any text, several lines
included), says what varies in ``<!-- output varies: what and why -->`` on the line right
above the output block, and says it in the "prints" paragraph too, for readers of the
rendered page. A ``...`` without that marker, a marker without ``...`` or anywhere else, and
an output shown after a not-run block fail; the output of a run-by block is its test's to
compare. A block whose page shows no output is only run.

Every relative link (``](docs/cli.md)``, ``](rules.md#anchor)``, an image) must name a file
that exists, and an anchor a heading of that file (GitHub's rule for heading ids).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path

import pytest

import nnxscale

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(not-run|run-by):\s*(.*?)\s*-->$")
VARIES = re.compile(r"^<!--\s*output varies:\s*(.*?)\s*-->$")
MAX_NOT_RUN = 3  # exceptions stay few: fix a block rather than skip it


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: tuple[str, str] | None  # ("not-run", reason) or ("run-by", path)
    end: int  # the line of the closing fence, 1-based

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
        blocks.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", marker, j + 1))
        i = j + 1
    return blocks


@dataclasses.dataclass(frozen=True)
class Shown:
    """The output a page shows for a python block (the module docstring's convention)."""

    block: Block  # the python block
    output: Block  # the plain block after it
    varies: str | None  # the reason of <!-- output varies: ... -->, where the page gives one


def shown_outputs(page: Path) -> list[Shown]:
    """Every plain block right after a python block, introduced by a paragraph beginning with
    "prints" (what a bash block prints is not compared)."""
    lines = page.read_text().splitlines()
    blocks = fenced_blocks(page)
    shown = []
    for before, block in zip([None, *blocks], blocks):
        if block.lang or before is None or before.lang != "python":
            continue
        between = [line.strip() for line in lines[before.end : block.line - 1] if line.strip()]
        varies = VARIES.match(between[-1]) if between else None
        if varies:
            between = between[:-1]
        if not between or not re.match(r"prints\b", between[0]) or any(line.startswith("#") for line in between):
            continue
        shown.append(Shown(before, block, varies and varies.group(1)))
    return shown


BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
RUN = [b for b in PYTHON if b.marker is None]
SHOWN = [s for page in PAGES for s in shown_outputs(page)]
EXPECTED = {s.block: s for s in SHOWN}  # a python block -> the output its page shows


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


def test_shown_outputs_follow_the_convention():
    """Each shown output belongs to a block that a test runs, and its ``...`` and its
    output-varies marker come together (the module docstring)."""
    assert len(SHOWN) >= 5, [s.output.name for s in SHOWN]
    bad = []
    for s in SHOWN:
        where = s.output.name
        if s.block.marker is not None and s.block.marker[0] != "run-by":
            bad.append(f"{where}: the output of {s.block.name}, a block no test runs")
        elif s.block.marker is None and ("..." in s.output.code) != bool(s.varies):
            bad.append(f"{where}: '...' in a shown output and <!-- output varies: what --> right above it go together")
    for page in PAGES:  # output-varies markers sit right above a shown output, nowhere else
        lines = page.read_text().splitlines()
        outputs = {s.output.line for s in SHOWN if s.output.page == page}
        for n, line in enumerate(lines, 1):
            if VARIES.match(line.strip()):
                nxt = next((k for k in range(n + 1, len(lines) + 1) if lines[k - 1].strip()), None)
                if nxt not in outputs:
                    bad.append(f"{page.relative_to(ROOT)}:{n}: an output-varies marker not right above a shown output")
    assert not bad, "\n".join(bad)


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


def normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def matches(shown: str, printed: str) -> bool:
    """doctest's ELLIPSIS: ``...`` in the shown output stands for any text."""
    shown, printed = normalized(shown), normalized(printed)
    if "..." not in shown:
        return shown == printed
    return re.fullmatch(".*?".join(map(re.escape, shown.split("..."))), printed, flags=re.S) is not None


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_python_block_runs(block, fresh_process_state, capsys):
    scope = {"__name__": "__docs__"}
    capsys.readouterr()
    exec(compile(block.code, block.name, "exec"), scope)
    printed = capsys.readouterr().out
    shown = EXPECTED[block].output if block in EXPECTED else None
    if shown is not None and not matches(shown.code, printed):
        diff = difflib.unified_diff(normalized(shown.code).splitlines(), normalized(printed).splitlines(),
                                    f"{shown.name} (shown)", "printed", lineterm="")
        pytest.fail(f"{block.name} prints other than the page shows:\n" + "\n".join(diff), pytrace=False)


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
