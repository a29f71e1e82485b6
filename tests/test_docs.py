"""docs/ holds pages and what they link to, nothing else: every relative link in README.md and the
pages under docs/ resolves to a file, and every file under docs/ is a page or is linked from one (so
a result nobody cites cannot come back unnoticed; git history keeps the superseded ones).  The
benchmark records the pages cite live in exp/records/ under the same rule (every record is linked
from README.md or a page), and both folders keep to a size budget: docs/ under 2 MB, exp/records/
under 5 MB, no file over 1 MB and no archive (the code is in git).

A link is a markdown link or image, ``[text](target)`` / ``![alt](target)``, a reference definition
``[name]: target`` or an HTML ``src``/``href``, outside code (fenced blocks and inline spans;
``[`a.json`](a.json)`` is a link); it is relative when it has no
scheme (``https:``, ``mailto:``) and is not an in-page anchor.  The files checked are those git would
commit (tracked, or untracked and not ignored), so a run's output left in docs/ is flagged before it
is committed; outside a git checkout, every file on disk."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RECORDS = ROOT / "exp" / "records"
MB = 1_000_000

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
HTML = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""")
FENCE = re.compile(r"^ {0,3}(```+|~~~+).*?^ {0,3}\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def links(text: str) -> list[str]:
    """The relative link targets of a markdown text, anchors and queries removed."""
    text = CODE_SPAN.sub("code", FENCE.sub("", text))
    out = []
    for pattern in (LINK, REFERENCE, HTML):
        for m in pattern.finditer(text):
            target = m.group(1)
            if SCHEME.match(target) or target.startswith("#"):
                continue
            out.append(target.split("#", 1)[0].split("?", 1)[0])
    return [t for t in out if t]


def _git() -> bool:
    return bool(shutil.which("git")) and (ROOT / ".git").exists()


def committed_files(folder: Path) -> list[Path]:
    """The files under ``folder`` that a commit would hold."""
    if _git():
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", str(folder.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sorted(ROOT / p for p in listed.split("\0") if p and (ROOT / p).is_file())
    return sorted(p for p in folder.rglob("*") if p.is_file())


def docs_files() -> list[Path]:
    """The files under docs/ that a commit would hold."""
    return committed_files(DOCS)


def record_files() -> list[Path]:
    """The benchmark records (exp/records/) that a commit would hold."""
    return committed_files(RECORDS)


def pages() -> list[Path]:
    return [ROOT / "README.md"] + [p for p in docs_files() if p.suffix == ".md"]


def test_link_parser():
    text = """see [a](a.md), ![fig](img/b.png "title"), [`c.json`](c.json), [web](https://x.org/y),
[anchor](#top), [e](e.md#part) and <img src="f.png">, but not `[code](span.md)`.

```bash
[g](inside-a-fence.md)
```

[ref]: refs/h.json
"""
    assert sorted(links(text)) == sorted(["a.md", "img/b.png", "c.json", "e.md", "f.png", "refs/h.json"])


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [t for t in links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def _linked() -> set[Path]:
    return {(page.parent / t).resolve() for page in pages() for t in links(page.read_text())}


def test_every_file_under_docs_is_a_page_or_linked():
    linked = _linked()
    orphans = [str(f.relative_to(ROOT)) for f in docs_files() if f.suffix != ".md" and f.resolve() not in linked]
    assert not orphans, (
        "files under docs/ that no page links to (link them from the page that reports "
        f"them, or delete them; git history keeps them): {orphans}"
    )


def test_every_record_is_linked_from_a_page():
    """A record (a .md one too: it is a run's report, not a page) is linked from README.md or a page
    under docs/, so a record nobody cites cannot come back."""
    linked = _linked()
    orphans = [str(f.relative_to(ROOT)) for f in record_files() if f.resolve() not in linked]
    assert not orphans, (
        "records under exp/records/ that no page links to (link them from the page that reports them "
        f"(from docs/*.md: ../exp/records/...), or delete them; git history keeps them): {orphans}"
    )


ARCHIVES = (".tgz", ".tar", ".gz", ".zip", ".whl", ".bz2", ".xz", ".7z")
BUDGET = {DOCS: 2 * MB, RECORDS: 5 * MB}
LARGEST = 1 * MB


@pytest.mark.parametrize("folder", list(BUDGET), ids=lambda f: str(f.relative_to(ROOT)))
def test_size_budget(folder):
    """docs/ stays under 2 MB and exp/records/ under 5 MB (the plan files the runs read), counting what
    a commit would hold; no file in either is over 1 MB."""
    files = committed_files(folder)
    where = folder.relative_to(ROOT)
    total = sum(f.stat().st_size for f in files)
    big = {str(f.relative_to(ROOT)): f.stat().st_size for f in files if f.stat().st_size > LARGEST}
    advice = (
        "delete what no current page needs (git keeps it: cite it as `git show REV:path`), or cut a "
        "record to what its page reports (drop per-kernel lists, traces and logs; keep the figures)"
    )
    assert not big, f"files over {LARGEST // MB} MB under {where}/: {big}; {advice}"
    assert total <= BUDGET[folder], (
        f"{where}/ holds {total / MB:.2f} MB, over its budget of {BUDGET[folder] // MB} MB; {advice}"
    )


@pytest.mark.parametrize("folder", list(BUDGET), ids=lambda f: str(f.relative_to(ROOT)))
def test_no_archives(folder):
    """No code or data archives under docs/ or exp/records/: the code is in git, and a record is a
    file a page links to, read as it is."""
    found = [str(f.relative_to(ROOT)) for f in committed_files(folder) if f.name.lower().endswith(ARCHIVES)]
    assert not found, (
        f"archives under {folder.relative_to(ROOT)}/: {found}; delete them (git keeps them; the code "
        "they hold is in git): a page reports the figures it took from them, not the archive"
    )


# A repository path in prose: one of the top-level folders, then a file name with an extension.  A
# path right after ``REV:`` (``git show 6b9b137:docs/bench/sockets-profile.json``) is one of the git history, which
# GIT_PATH checks instead.
NAMED_PATH = re.compile(
    r"(?<![\w./:-])((?:hidup|search|codegen|profiler|exp|tests|docs|\.ci)/[\w./-]*\w\.(?:py|md|json|jsonl|sh|toml|png|txt|gz)(?!\w))"
)
GIT_PATH = re.compile(r"(?<![\w./-])([0-9a-f]{7,40}):((?:hidup|search|codegen|profiler|exp|tests|docs|\.ci)/[\w./-]*)")


def _named_in() -> list[Path]:
    """The files whose prose names repository paths: README, the pages, the tests, and the code
    (docstrings and comments) of every package and of exp/."""
    code = [p for top in ("hidup", "search", "codegen", "profiler", "exp") for p in sorted((ROOT / top).rglob("*.py"))]
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "tests").glob("*.py")), *code]


def test_every_path_named_in_docs_tests_and_code_exists():
    """A path like ``codegen/grads.py`` named anywhere a reader looks exists (from the repository
    root, or from the naming file's folder), so the map from folders to import names never points
    nowhere (``hidup.codegen`` lives in codegen/, not hidup/codegen/)."""
    missing = sorted(
        {
            f"{m.group(1)} (named in {f.relative_to(ROOT)})"
            for f in _named_in()
            for m in NAMED_PATH.finditer(f.read_text(encoding="utf-8"))
            if "*" not in m.group(1) and not ((ROOT / m.group(1)).exists() or (f.parent / m.group(1)).exists())
        }
    )
    assert not missing, f"paths named but absent (fix the name: hidup/codegen/FILE is codegen/FILE): {missing}"


def test_named_path_patterns():
    text = "exp/records/sockets-profile.json, exp/records/baselines-rank/bert-sgmoe-w4-bf16.jsonl and "
    text += "`git show 6b9b137:docs/bench/sockets-profile.json` or 6b9b137:docs/archive/"
    assert [m.group(1) for m in NAMED_PATH.finditer(text)] == [
        "exp/records/sockets-profile.json",
        "exp/records/baselines-rank/bert-sgmoe-w4-bf16.jsonl",
    ]
    assert [":".join(m.groups()) for m in GIT_PATH.finditer(text)] == [
        "6b9b137:docs/bench/sockets-profile.json",
        "6b9b137:docs/archive/",
    ]


def test_every_path_named_in_git_history_exists():
    """A page or a comment may cite what the tree no longer holds as ``REV:path`` (``git show
    6b9b137:docs/archive/benchmarks-2026-11-21.md``); that revision holds that path."""
    if not _git():
        pytest.skip("not a git checkout")
    named = {(m.group(1), m.group(2).rstrip("/")) for f in _named_in() for m in GIT_PATH.finditer(f.read_text("utf-8"))}
    missing = []
    for rev, path in sorted(named):
        if subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True).returncode:
            pytest.skip(f"revision {rev} is not in this clone (a shallow one?)")
        if subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT, capture_output=True).returncode:
            missing.append(f"{rev}:{path}")
    assert not missing, f"paths named in the git history that it does not hold: {missing}"
