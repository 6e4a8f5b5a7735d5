"""The repository's docs (docs/) are its own: code cites them, not developer notes kept outside the repository, and
what they link to or name exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
THIS = Path(__file__).resolve()

# citations of notes that are not part of the repository (the team's design and environment notes)
OUTSIDE_NOTES = re.compile(r"DESIGN §|DESIGN\.md|ENV-NOTES|\.\./shared/|/work/shared")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATH_LIKE = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?")
FILE_SUFFIXES = (".py", ".proto", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cpp", ".cu", ".sh", ".tpl")
# a path in running text: at least one folder, a known suffix, not the tail of a longer path or URL
BARE_PATH = re.compile(r"(?<![\w./~:-])((?:[A-Za-z0-9_-]+/)+[A-Za-z0-9_.-]+\.(?:py|proto|md|yaml|toml|json))\b")
DOC_CITATION = re.compile(r"\bdocs/([A-Za-z0-9_-]+\.md)(?:#([A-Za-z0-9_-]+))?")
SKIPPED_DIRS = {".git", ".venv", ".venv-checkov", "node_modules", "__pycache__", ".pytest_cache", ".mypy_cache",
                ".ruff_cache", "tandem.egg-info"}


def repository_files() -> list[Path]:
    """The repository's files: tracked ones and new ones git does not ignore (or, without git, the tree)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             check=True, capture_output=True).stdout.decode()
        paths = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)]
    return [p for p in paths if p.is_file()]


def text_of(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to hyphens)."""
    anchors = set()
    in_fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            title = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_docs_exist() -> None:
    names = {p.name for p in doc_pages()}
    assert {"README.md", "architecture.md", "operations.md", "environment.md"} <= names


def test_no_file_outside_docs_cites_notes_kept_outside_the_repository() -> None:
    offenders = []
    for path in repository_files():
        if path.resolve() == THIS or DOCS in path.resolve().parents:
            continue
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_NOTES.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "cite docs/ instead:\n" + "\n".join(offenders)


def test_docs_relative_links_resolve() -> None:
    broken = []
    for page in doc_pages():
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_paths_the_docs_name_exist() -> None:
    missing = []
    for page in doc_pages():
        text = page.read_text()
        named = set(BARE_PATH.findall(text))
        for span in CODE_SPAN.findall(text):
            span = span.strip()
            if "/" in span and PATH_LIKE.fullmatch(span) and (span.endswith("/") or span.endswith(FILE_SUFFIXES)):
                named.add(span)
        missing += [f"{page.name}: {p}" for p in sorted(named) if not (ROOT / p).exists()]
    assert missing == []


def test_citations_of_docs_point_at_a_page_and_heading_that_exist() -> None:
    broken = []
    for path in repository_files():
        text = text_of(path)
        if text is None or path.resolve() == THIS:
            continue
        for page, anchor in DOC_CITATION.findall(text):
            target = DOCS / page
            if not target.exists():
                broken.append(f"{path.relative_to(ROOT)}: docs/{page}")
            elif anchor and anchor not in heading_anchors(target.read_text()):
                broken.append(f"{path.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert broken == []
