"""Every command's `--help` teaches by example: the whole command tree, walked."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from services import cli


def _commands(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for action in p._actions:  # argparse keeps its sub-commands here, and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


ALL = sorted(set(_commands(cli.build_parser())))


def test_the_tree_is_walked() -> None:
    assert ("status",) in ALL and ("events", "publish") in ALL and len(ALL) > 20


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "llmgw")
def test_help_has_examples(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args([*path, "--help"])
    assert e.value.code == 0
    assert "examples:\n  $ llmgw" in capsys.readouterr().out
