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
- docs/configuration.md lists every key of the config: each field of every section of the schema,
  Nanotron's and `mesh3d:`, has a row of its own.
- The `mesh3d plan` sample of docs/planning.md is what the command prints now.
- Relative links of the README, docs/*.md and benchmarks/**/*.md resolve (a file that exists;
  a `#section` of a Markdown file names one of its headings).
- Nothing was lost when the README and benchmarks/README.md were split into pages (issue 43):
  every section they had (`old_doc_sections.txt`) is a heading, or a bold lead, of a page now.
- "Two clicks": the README is short, links every page of docs/ and the benchmarks' index, which
  links every benchmark's page.
"""

import ast
import dataclasses
import re
import shlex
import typing
from pathlib import Path

import pytest

from mesh3d.config.llamoe import LlaMoEConfig
from mesh3d.config.mamba import MambaConfig, MambaInit
from mesh3d.config.other_families import Qwen2Config, Qwen3Config, Starcoder2Config
from mesh3d.config.schema import Config, Mesh3dArgs

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
BENCH_DOCS = _files("*.md", "benchmarks")  # the index, its pages, the results drawn as Markdown


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


@pytest.mark.parametrize("md", DOCS + BENCH_DOCS, ids=_id)
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


def _sections(cls, seen=None) -> set[type]:
    """`cls` and every dataclass its fields hold (a section, a model config, an init form...)."""
    seen = set() if seen is None else seen
    if dataclasses.is_dataclass(cls) and cls not in seen:
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for arg in _type_parts(hints[f.name]):
                _sections(arg, seen)
    return seen


def _type_parts(tp) -> list:
    args = typing.get_args(tp)
    return [tp] if not args else [a for arg in args for a in _type_parts(arg)]


_OTHER = (Qwen2Config, Qwen3Config, Starcoder2Config)  # MoEConfig: a Qwen2Config field


def test_configuration_page_lists_every_key():
    """Every key of every section (Nanotron's and `mesh3d:`) has a row `| `key` |` on
    docs/configuration.md, the page the README's index sends a reader to for any key."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    sections = _sections(Config)
    assert Mesh3dArgs in sections and len(sections) > 25  # the walk found the schema
    for cls in (
        MambaConfig,
        MambaInit,
        LlaMoEConfig,
        *_OTHER,
    ):  # loaded by the pickers for their family
        _sections(cls, sections)
    missing = sorted({f"{cls.__name__}.{f.name}" for cls in sections
                      for f in dataclasses.fields(cls) if f"| `{f.name}` |" not in text})  # fmt: skip
    assert not missing, f"keys missing from docs/configuration.md: {missing}"


def test_configuration_page_mesh3d_table_has_every_key_once():
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("### The `mesh3d:` section", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(rows) == sorted(f.name for f in dataclasses.fields(Mesh3dArgs))


def test_plan_sample_is_current(capsys):
    from mesh3d.plan.__main__ import main

    text = (ROOT / "docs" / "planning.md").read_text()
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


OLD_SECTIONS = Path(__file__).with_name("old_doc_sections.txt")


def _headings(md: Path) -> set[str]:
    return {h.strip() for h in re.findall(r"^#+ (.+)$", FENCE.sub("", md.read_text()), re.M)}


def _old_sections() -> list[tuple[str, str, str, str]]:
    """(old file, kind, old words, where to find them now) of every line of the data file."""
    rows = []
    for line in OLD_SECTIONS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            old_file, kind, words = line.split("\t")
            old, _, new = words.partition(" => ")
            rows.append((old_file, kind, old, new or old))
    return rows


def test_every_old_section_has_a_home():
    """Every heading of the README and of benchmarks/README.md before they were split (issue 43)
    is a heading of the README or a docs/ page (benchmarks: of benchmarks/README.md or a page
    under benchmarks/); every bold lead of the old README is a bold lead on one of them."""
    rows = _old_sections()
    assert len(rows) > 100 and {kind for _, kind, _, _ in rows} == {"heading", "bold"}
    pages = {"README.md": DOCS, "benchmarks/README.md": BENCH_DOCS}
    headings = {old: set().union(*map(_headings, mds)) for old, mds in pages.items()}
    texts = {old: "\n".join(md.read_text() for md in mds) for old, mds in pages.items()}
    lost = [f"{old_file} {kind} {old!r} (looked for {new!r})"
            for old_file, kind, old, new in rows
            if (kind == "heading" and new not in headings[old_file])
            or (kind == "bold" and f"**{new}**" not in texts[old_file])]  # fmt: skip
    assert not lost, "sections of the old READMEs with no home:\n" + "\n".join(lost)


def _links(md: Path) -> set[Path]:
    found = set()
    for target in LINK.findall(FENCE.sub("", md.read_text())):
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", target):
            found.add((md.parent / path).resolve())
    return found


def test_every_page_is_two_clicks_from_the_readme():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) <= 250
    one = _links(readme)
    two = set().union(*(_links(p) for p in one if p.suffix == ".md" and p.is_file()))
    pages = {*ROOT.joinpath("docs").glob("*.md"), *ROOT.joinpath("benchmarks", "docs").glob("*.md")}
    far = sorted(_id(p) for p in pages if p.resolve() not in one | two)
    assert not far, f"pages more than two clicks from the README: {far}"
    docs_pages = {p.resolve() for p in ROOT.joinpath("docs").glob("*.md")}
    assert docs_pages <= one, "the README's index misses " + str(sorted(docs_pages - one))
