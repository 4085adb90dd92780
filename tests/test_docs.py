"""The documentation runs and names what exists.

Every fenced ``python`` block of README.md and docs/*.md runs here as written, one test per
block, in a fresh namespace and a temporary working directory. A comment on the line before
a block says what else it needs or why it cannot run:

- ``<!-- needs: ucx -->``: the native UCX module (skipped where it was not built, failed where
  LUMEN_UCX=ON says it must be);
- ``<!-- needs: vllm -->``: a real vLLM (marker ``vllm``: ``make test-vllm``, in .venv-vllm);
- ``<!-- not run: <why> -->``: reported as a skip with that reason (a live server, a GPU).

docs/structure.md has one line per package and source file of the listed roots and per
top folder of tests/; a path it names must exist, and one it lacks fails the check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {"ucx", "vllm"}

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(needs|not run):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced python block: where it starts (1-based line of its fence) and its marker."""

    page: Path
    line: int
    code: str
    marker: tuple[str, str] | None  # ("needs", "ucx") or ("not run", why)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The ``python`` blocks of a page, with the marker comment on the line before each.
    Raises ValueError for a fence left open."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page.name}:{i + 1}: a fence must be closed, got none before the end")
        if fence.group(1) == "python":
            before = _MARKER.match(lines[i - 1]) if i > 0 else None
            marker = (before.group(1), before.group(2)) if before else None
            blocks.append(Block(page, i + 1, "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return blocks


def _param(block: Block) -> object:
    marks: list[pytest.MarkDecorator] = []
    if block.marker == ("needs", "vllm"):
        marks.append(pytest.mark.vllm)
    elif block.marker is not None and block.marker[0] == "not run":
        marks.append(pytest.mark.skip(reason=f"{block.name}: {block.marker[1]}"))
    return pytest.param(block, id=block.name, marks=marks)


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def test_markers_are_known() -> None:
    bad = [
        f"{b.name}: {b.marker}"
        for b in BLOCKS
        if b.marker is not None
        and not (b.marker[0] == "needs" and b.marker[1] in NEEDS)
        and not (b.marker[0] == "not run" and b.marker[1])
    ]
    assert not bad, f"markers must be `needs: {'|'.join(sorted(NEEDS))}` or `not run: <why>`, got {bad}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if block.marker in (("needs", "ucx"), ("needs", "vllm")):
        request.getfixturevalue("ucx_module")  # the vLLM blocks stream over it too
    monkeypatch.chdir(tmp_path)  # blocks write files (weights, secrets) where they run
    # Run from the repository, the trace is found under ./data/traces; from here, say where.
    monkeypatch.setenv("LUMEN_TRACE_DIR", str(ROOT / "data" / "traces"))
    exec(compile(block.code, block.name, "exec"), {"__name__": "__docs__"})  # noqa: S102 (the test's job)


# ---- docs/structure.md ---------------------------------------------------------------------

STRUCTURE = ROOT / "docs" / "structure.md"
# What the page must list: every package and source file under these roots (build outputs,
# caches and compiled modules are not sources), and every top folder of tests/.
SOURCE_ROOTS = ("src/lumen_core", "csrc", "python", "bench")
SOURCE_SUFFIXES = {".py", ".pyi", ".proto", ".cpp", ".cu", ".h", ".md"}
_ENTRY = re.compile(r"^[-|]\s*`([^`]+)`")


def structure_entries() -> list[str]:
    """The paths docs/structure.md lists: the first backticked path of each list item or table
    row, folders with a trailing slash."""
    return [m.group(1) for line in STRUCTURE.read_text().splitlines() if (m := _ENTRY.match(line.strip()))]


def expected_entries() -> set[str]:
    expected: set[str] = set()
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*"):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts:
                continue
            if path.is_file() and path.suffix in SOURCE_SUFFIXES:
                expected.add(rel.as_posix())
            elif path.is_dir() and (path / "__init__.py").exists():
                expected.add(rel.as_posix() + "/")
    for path in (ROOT / "tests").iterdir():
        if path.is_dir() and path.name != "__pycache__":
            expected.add(f"tests/{path.name}/")
    return expected


def test_structure_lists_every_package_and_file() -> None:
    missing = sorted(expected_entries() - set(structure_entries()))
    assert not missing, f"docs/structure.md must have a line for each of {missing}"


def test_structure_names_only_what_exists() -> None:
    entries = structure_entries()
    gone = sorted(e for e in entries if not (ROOT / e).exists())
    assert not gone, f"docs/structure.md names paths that do not exist: {gone}"
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert not repeated, f"docs/structure.md must list each path once, got repeats of {repeated}"


def test_doc_links_resolve() -> None:
    """Relative links between the pages point at files that exist."""
    broken = []
    for page in [*PAGES, ROOT / "bench" / "RESULTS.md", ROOT / "bench" / "HISTORY.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links must name existing files, got {broken}"


def test_no_page_names_the_design_map_outside_the_repository() -> None:
    outside = [p.name for p in PAGES if "shared/DESIGN.md" in p.read_text()]
    assert not outside, f"pages must link docs/design.md, not a file outside the repository: {outside}"
