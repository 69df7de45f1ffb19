"""Every file of this repository the docs name by its path is there: a page that sends a
reader to `services/core/policy/engine.py` or `deploy/examples/tour.yaml` is checked
against the tree, so a file moved or never added fails here, not in a reader's shell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

# TOP are the repository's own top-level folders: a path in backquotes starting with one
# of them is a file or folder of this repository, and so is any relative path of a source
# file (SOURCE: `policy/engine.py`, `reconciler/preempt.go`), which a reader looks for in
# the tree. A path with a placeholder (`<name>`, `NAME`, `*`) names a kind of file, not
# one; an absolute one (`/etc/...`, `~/.llmgw/...`) is a host's.
TOP = ("services/", "schemas/", "deploy/", "tests/", "docs/")
SOURCE = (".py", ".go", ".sh", ".js", ".css", ".html", ".yaml", ".toml", ".conf", ".conf.in")
_QUOTED = re.compile(r"`([^`\s]+)`")
_PLACEHOLDER = re.compile(r"[<>*{}]|\.\.\.|[A-Z]{3,}")


def repository_paths(text: str) -> list[str]:
    """The paths of this repository a page names in backquotes (a command's argument
    too: `llmgw apply -f deploy/examples/tour.yaml` is split into its words)."""
    found = []
    for code in re.findall(r"`([^`\n]+)`", text):
        for word in code.split():
            word = word.strip("\"'(),;:")
            word = word.split(":")[0].split("#")[0]
            relative = "/" in word and not word.startswith(("/", "~", "$", ".", "http"))
            ours = word.startswith(TOP) or (relative and word.endswith(SOURCE))
            if ours and not _PLACEHOLDER.search(word):
                found.append(word)
    return found


def test_the_paths_the_docs_name_are_in_the_repository() -> None:
    missing = []
    for page in PAGES:
        for path in repository_paths(page.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "the docs name files the repository does not have:\n" + "\n".join(missing)


def test_the_check_finds_paths() -> None:
    # The check itself: it sees paths inside commands, and leaves placeholders alone.
    assert repository_paths("run `llmgw apply -f deploy/examples/tour.yaml` and `x`") == [
        "deploy/examples/tour.yaml"
    ]
    assert repository_paths("`deploy/examples/sim/<name>.yaml` `/etc/x/y.yaml`") == []
    assert repository_paths("the Go plane's `reconciler/preempt.go`") == ["reconciler/preempt.go"]
    tour = (ROOT / "docs" / "tour.md").read_text()
    assert "deploy/examples/tour.yaml" in repository_paths(tour)
