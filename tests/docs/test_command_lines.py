"""Every `llmgw` command line the docs' shell blocks and the commands' own `--help`
examples show is one the parser takes: a flag renamed, a positional made an option
(`preemption plan MODEL` is `--model MODEL`) or a choice dropped fails here, in the
page or help that still shows it. Only the parse is checked (no broker is needed);
what the tour's commands print is held to the page by
tests/e2e/test_documented_commands.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from services.cli import app

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SHELL = re.compile(r"\s(?:\||&&|>|2>|<)\s.*$|;\s.*$")


def _command(line: str) -> list[str] | None:
    """The words of one `llmgw` command on a line, past its comment and any shell
    operator after it; None for a line that is not one."""
    line = re.sub(r"\s+#.*$", "", line.strip())
    line = _SHELL.sub("", line)
    if not line.startswith("llmgw ") or "$(" in line:
        return None
    return shlex.split(line)[1:]


def page_lines() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in re.findall(r"^```sh\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            block = re.sub(r"\\\n\s*", " ", block)  # a line continued with `\`
            found += [(page.name, line) for line in block.splitlines()]
    return found


def help_lines(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """The `$ llmgw ...` examples of every command's and subcommand's --help."""
    found: list[tuple[str, str]] = []

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        text = re.sub(r"\\\n\s*", " ", p.format_help())
        found.extend((name, x) for x in re.findall(r"^\s*\$ (llmgw .*)$", text, re.M))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")

    walk(parser, "llmgw --help")
    return found


def refused(words: list[str]) -> str | None:
    """What the parser says of `llmgw WORDS`, or None when it takes them."""
    parser = app.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _, extra = parser.parse_known_args(words)
    except SystemExit as e:
        return None if e.code in (0, None) else err.getvalue().strip()
    return f"unrecognized {extra}" if extra else None


def test_every_command_line_shown_parses() -> None:
    lines = page_lines() + help_lines(app.build_parser())
    checked, wrong = 0, []
    for where, line in lines:
        words = _command(line)
        if words is None:
            continue
        checked += 1
        why = refused(words)
        if why:
            wrong.append(f"{where}: `{line.strip()}`: {why}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 100, checked


def test_the_check_refuses_what_the_parser_refuses() -> None:
    assert refused(["preemption", "plan", "chat"]) is not None
    assert refused(["preemption", "plan", "--model", "chat"]) is None
    assert _command("llmgw get replicas -o name | xargs -n1 llmgw explain") == [
        "get",
        "replicas",
        "-o",
        "name",
    ]
