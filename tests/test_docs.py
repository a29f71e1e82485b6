"""docs/ holds pages and what they link to, nothing else: every relative link in README.md and the
pages under docs/ resolves to a file, and every file under docs/ is a page or is linked from one (so
a result nobody cites cannot come back unnoticed; git history keeps the superseded ones).

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


def docs_files() -> list[Path]:
    """The files under docs/ that a commit would hold."""
    if shutil.which("git") and (ROOT / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "docs"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sorted(ROOT / p for p in listed.split("\0") if p and (ROOT / p).is_file())
    return sorted(p for p in DOCS.rglob("*") if p.is_file())


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


def test_every_file_under_docs_is_a_page_or_linked():
    linked = {(page.parent / t).resolve() for page in pages() for t in links(page.read_text())}
    orphans = [str(f.relative_to(ROOT)) for f in docs_files() if f.suffix != ".md" and f.resolve() not in linked]
    assert not orphans, (
        "files under docs/ that no page links to (link them from the page that reports "
        f"them, or delete them; git history keeps them): {orphans}"
    )


# A repository path in prose: one of the top-level folders, then a file name with an extension.
NAMED_PATH = re.compile(
    r"(?<![\w./-])((?:hidup|search|codegen|profiler|exp|tests|docs|\.ci)/[\w./-]*\w\.(?:py|md|json|jsonl|sh|toml|png|txt|gz))"
)


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
