"""Every docs/ page a file of the project cites is a file the repository holds: a user who
clones it can read the contract its code points to (docs/layout.md, once only outside it). And
every file of the repository that README.md and docs/ cite exists: a moved module moves its
citations too. Nothing cites a file outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A path under the repository's docs/, not part of a longer path or a URL (hydra.cc/docs/...).
CITED = re.compile(r"(?<![\w./-])docs/[\w./-]*\w")
SKIP = {".venv", ".git", "outputs", "multirun", "node_modules"}


def citing_files() -> list[Path]:
    return [p for pattern in ("*.py", "*.md", "*.yaml") for p in ROOT.rglob(pattern)
            if not SKIP & set(p.relative_to(ROOT).parts)]


def test_every_cited_docs_path_exists():
    cited = {(path.relative_to(ROOT), match) for path in citing_files()
             for match in CITED.findall(path.read_text(errors="replace"))}
    assert any(match == "docs/layout.md" for _, match in cited)  # the scan finds citations
    missing = sorted((str(path), match) for path, match in cited if not (ROOT / match).exists())
    assert not missing, missing


def test_the_pattern_skips_urls_and_longer_paths():
    text = "see docs/layout.md, https://hydra.cc/docs/advanced/x and /work/docs/y.md"
    assert CITED.findall(text) == ["docs/layout.md"]


# A repository path in a page: a top-level folder of the project, then a path (not a URL's).
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:trainer|parallel|tests|bench|conf|hydra_plugins|docs|\.ci)/[\w./-]*[\w/]")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_repository_path_the_pages_cite_exists():
    cited = {(page.name, match) for page in PAGES
             for match in REPO_PATH.findall(page.read_text())}
    assert len(cited) > 50  # the scan finds citations
    missing = sorted((page, match) for page, match in cited if not (ROOT / match).exists())
    assert not missing, missing


def test_nothing_cites_a_file_outside_the_repository():
    outside = re.compile(r"\.\./shared/|(?<![\w/])shared/notes/")
    found = sorted(str(path.relative_to(ROOT)) for path in citing_files()
                   if path.name != "test_doc_paths.py"
                   and outside.search(path.read_text(errors="replace")))
    assert not found, found

