"""The `llmgw` command itself: every help page, argument types, errors.

No broker needed: these run in-process through `services.cli.main([...])`.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services import cli

pytestmark = pytest.mark.timeout(60)


def _leaves(parser: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
    """The command paths under `parser`, groups included."""
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(_leaves(sub, [*path, name]))
    return out


COMMANDS = _leaves(cli.build_parser(), [])


@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) or "llmgw" for p in COMMANDS])
def test_every_help_page_is_complete(path: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*path, "--help"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: llmgw")
    assert "--nats URL" in out, "the global options show on every page"


@pytest.mark.parametrize(
    "path",
    [
        [],
        ["events"],
        ["events", "tail"],
        ["events", "export"],
        ["events", "import"],
        ["events", "publish"],
    ],
)
def test_events_help_teaches_with_examples(
    path: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*path, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:\n  $ llmgw" in out


def test_no_command_shows_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().err
    assert cli.main(["events"]) == 2
    assert "tail" in capsys.readouterr().err


def test_a_bad_flag_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["events", "export", "--out", "x", "--from-seq", "zero"]) == 2
    _, err = capsys.readouterr()
    assert err == (
        "llmgw events export: argument --from-seq: 'zero' is not a sequence number "
        "(see `llmgw events export --help`)\n"
    )
    assert cli.main(["--root", "a.b", "events", "tail"]) == 2
    assert capsys.readouterr().err.startswith("llmgw: --root: 'a.b' is not a subject token")


def test_global_options_work_before_and_after_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("LLMGW_NATS", "LLMGW_DATA", "LLMGW_ROOT"):
        monkeypatch.delenv(name, raising=False)
    p = cli.build_parser()
    before = p.parse_args(["--nats", "nats://a:1", "--data", "/d", "events", "tail"])
    after = p.parse_args(["events", "tail", "--nats", "nats://a:1", "--data", "/d"])
    for args in (before, after):
        assert cli.resolve_broker(args) == "nats://a:1"
        assert cli.data_dir(args) == Path("/d")
        assert cli.root(args) == "llmgw"
    # `events publish` has a --data of its own: the global one goes before the command.
    args = p.parse_args(["--data", "/d", "events", "publish", "quota.set", "--data", "{}"])
    assert cli.data_dir(args) == Path("/d") and args.data == "{}"


def test_the_broker_is_found_flag_then_env_then_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.bus import write_url

    monkeypatch.delenv("LLMGW_NATS", raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path))
    args = cli.build_parser().parse_args(["events", "tail"])
    with pytest.raises(cli.CliError, match="start one with `llmgw up`"):
        cli.resolve_broker(args)
    write_url(tmp_path, "nats://127.0.0.1:4999")
    assert cli.resolve_broker(args) == "nats://127.0.0.1:4999"
    monkeypatch.setenv("LLMGW_NATS", "nats://env:1")
    assert cli.resolve_broker(args) == "nats://env:1"
    args = cli.build_parser().parse_args(["events", "tail", "--nats", "nats://flag:1"])
    assert cli.resolve_broker(args) == "nats://flag:1"


NOW = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        pytest.param("2026-11-29T13:00:00Z", datetime(2026, 11, 29, 13, tzinfo=UTC), id="rfc3339"),
        pytest.param(
            "2026-11-29T15:00:00+02:00", datetime(2026, 11, 29, 13, tzinfo=UTC), id="offset"
        ),
        pytest.param("10m", datetime(2026, 11, 29, 13, 50, tzinfo=UTC), id="minutes"),
        pytest.param("1h30m", datetime(2026, 11, 29, 12, 30, tzinfo=UTC), id="mixed"),
        pytest.param("1d", datetime(2026, 11, 28, 14, tzinfo=UTC), id="days"),
        pytest.param("90s", datetime(2026, 11, 29, 13, 58, 30, tzinfo=UTC), id="seconds"),
    ],
)
def test_times_parse(text: str, want: datetime) -> None:
    assert cli.parse_time(text, now=NOW) == want


@pytest.mark.parametrize("text", ["yesterday", "2026-11-29T13:00:00", "", "m"])
def test_bad_times_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"RFC3339|time zone"):
        cli.parse_time(text, now=NOW)
