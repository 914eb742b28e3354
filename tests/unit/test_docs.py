"""The documentation stands on its own: README.md and docs/*.md name only what a clone has.

- Nothing points outside the repository: no Markdown file, and no source file under mesh3d/,
  tests/, benchmarks/ or recipes/ (code, comments or docstrings alike), names a document that
  only existed beside the repository or its sections (`OUTSIDE`). The one place that locates
  Nanotron's fixture configs, kept beside the repository (`tests/helpers/nanotron_fixtures.py`,
  `FIXTURES`), builds that path from its parts; everything else refers to `FIXTURES`. Each
  `docs/<page>.md#<section>` named anywhere is a heading of that page.
- No docstring pads its paragraphs with runs of blank lines.
- Every repository path they mention (in inline code, code blocks or links: `recipes/...`,
  `mesh3d/...`, `benchmarks/...`, `docs/...`, `tests/...`) exists; placeholders such as
  `mesh3d/models/<family>.py` are skipped. Relative links resolve, and a `#section` of a
  Markdown file names one of its headings.
- docs/nanotron-compatibility.md lists every key of the `mesh3d:` section.
- The README's `mesh3d plan` sample is what the command prints now.
"""

import ast
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from mesh3d.config.schema import Mesh3dArgs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("benchmarks/", "docs/", "mesh3d/", "recipes/", "tests/")
PLACEHOLDER = re.compile(r"[<>*{}\[\]%$]|\.\.\.")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Names of documents outside the repository; a section sign stood for a section of one of them.
OUTSIDE = ("../shared", "shared/fixtures", "§", "FACTS.md", "nanotron-format.md",
           "ARCHITECTURE.md", "STYLE.md")  # fmt: skip
NOT_SOURCE = {"runs", "wandb", "checkpoints", "__pycache__", "local", "tmp"}  # local, ignored
DOC_SECTION = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
BLANK_RUN = re.compile(r"\n[ \t]*\n[ \t]*\n")


def _files(pattern: str, *folders: str) -> list[Path]:
    """Files matching `pattern` under `folders` (all of the repository without), leaving out
    hidden folders and what runs and benchmarks write locally."""
    found = []
    for top in [ROOT / f for f in folders] or [ROOT]:
        for path in top.rglob(pattern):
            parts = path.relative_to(ROOT).parts[:-1]
            if not any(p.startswith(".") or p in NOT_SOURCE for p in parts):
                found.append(path)
    return sorted(found)


SOURCES = _files("*.py", "mesh3d", "tests", "benchmarks", "recipes")
MARKDOWN = _files("*.md")


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _repo_paths(text: str) -> set[str]:
    """Tokens of inline code and code blocks that start like a repository path."""
    blocks = FENCE.findall(text)
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    found = set()
    for token in " ".join(blocks + spans).split():
        token = token.strip("\"'(),;").split("::")[0].rstrip(".:")
        if token.startswith(PREFIXES) and not PLACEHOLDER.search(token):
            found.add(token)
    return found


def _anchors(md: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces -> hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", md.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("md", MARKDOWN, ids=_id)
def test_no_reference_outside_the_repository(md):
    text = md.read_text()
    for outside in OUTSIDE:
        assert outside not in text, f"{md.name} mentions {outside}"


def test_no_source_points_outside_the_repository():
    this = Path(__file__).resolve()  # names them, to refuse them
    found = [f"{_id(path)}:{n}: {outside}" for path in SOURCES if path.resolve() != this
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for outside in OUTSIDE if outside in line]  # fmt: skip
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_named_doc_sections_exist():
    bad = []
    for path in SOURCES + MARKDOWN:
        for page, anchor in DOC_SECTION.findall(path.read_text()):
            md = ROOT / "docs" / page
            if not md.is_file() or anchor not in _anchors(md):
                bad.append(f"{_id(path)}: docs/{page}#{anchor}")
    assert not bad, "sections that do not exist:\n" + "\n".join(bad)


def test_docstrings_have_no_runs_of_blank_lines():
    padded = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and BLANK_RUN.search(doc):
                    padded.append(f"{_id(path)}: {getattr(node, 'name', '(module)')}")
    assert not padded, "docstrings with two or more blank lines in a row:\n" + "\n".join(padded)


@pytest.mark.parametrize("md", DOCS, ids=_id)
def test_repository_paths_exist(md):
    missing = sorted(p for p in _repo_paths(md.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{md.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("md", DOCS, ids=_id)
def test_relative_links_resolve(md):
    bad = []
    for target in LINK.findall(FENCE.sub("", md.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        broken_anchor = anchor and dest.suffix == ".md" and anchor not in _anchors(dest)
        if not dest.exists() or broken_anchor:
            bad.append(target)
    assert not bad, f"{md.name} has broken links: {bad}"


def test_compatibility_page_lists_every_mesh3d_key():
    text = (ROOT / "docs" / "nanotron-compatibility.md").read_text()
    missing = [f.name for f in dataclasses.fields(Mesh3dArgs) if f"| `{f.name}` |" not in text]
    assert not missing, f"mesh3d: keys missing from the table: {missing}"


def test_readme_plan_sample_is_current(capsys):
    from mesh3d.plan.__main__ import main

    text = (ROOT / "README.md").read_text()
    block = next(b for b in FENCE.findall(text) if "\n$ mesh3d plan " in b)
    lines = block.split("\n")[1:-1]  # without the fences
    command = [lines[0][2:]]
    while command[-1].endswith("\\"):
        command[-1] = command[-1][:-1]
        command.append(lines[len(command)])
    args = shlex.split(" ".join(command))[2:]  # after `mesh3d plan`
    args[0] = str(ROOT / args[0])
    main(args)
    printed = capsys.readouterr().out
    assert printed == "\n".join(lines[len(command) :]) + "\n"
