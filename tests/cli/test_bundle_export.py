"""`llmgw events export` never writes over a file by accident; export and import show
progress on a terminal and always end with one summary line."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker
from services.cli import main
from tests.cli.test_bundle_import import lines, write

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LLMGW_NATS", "LLMGW_ROOT", "LLMGW_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path / "no-llmgw-up-here"))


@pytest.fixture
def loaded(nats_server: EmbeddedBroker, tmp_path: Path) -> Iterator[str]:
    """A broker holding 50 events, seq 1..50."""
    path = write(tmp_path / "seed.jsonl", lines(50))
    assert main(["--nats", nats_server.url, "events", "import", str(path)]) == 0
    yield nats_server.url


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_an_existing_out_is_refused_without_force(
    loaded: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "incident.jsonl"
    out_file.write_text("precious\n")
    code, out, err = run(capsys, "--nats", loaded, "events", "export", "--out", str(out_file))
    assert code == 1 and out == ""
    assert err == f"llmgw: --out: {out_file} exists; pass --force to replace it\n"
    assert out_file.read_text() == "precious\n"

    code, out, err = run(
        capsys, "--nats", loaded, "events", "export", "--out", str(out_file), "--force"
    )
    assert code == 0, err
    assert out.startswith(f"exported 50 events (seq 1..50) to {out_file} in ")
    assert out_file.read_bytes() == (tmp_path / "seed.jsonl").read_bytes()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_and_a_summary_ends_each(
    loaded: str,
    second_server_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out_file = tmp_path / "incident.jsonl"
    for argv, verb, summary in (
        (["--nats", loaded, "events", "export", "-o", str(out_file)], "exporting", "exported 50"),
        (
            ["--nats", second_server_url, "events", "import", str(out_file)],
            "importing",
            "imported 50",
        ),
    ):
        term, stdout = _Terminal(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", term)
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(argv) == 0, term.getvalue()
        monkeypatch.undo()
        assert f"\r{verb} [" in term.getvalue() and "50/50" in term.getvalue()
        assert term.getvalue().endswith("\r\x1b[K"), "the bar is erased before the summary"
        assert stdout.getvalue().startswith(summary) and stdout.getvalue().count("\n") == 1


def test_export_to_stdout_says_its_summary_on_stderr(
    loaded: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "--nats", loaded, "events", "export", "--out", "-")
    assert code == 0
    assert out.count("\n") == 50
    assert err.startswith("exported 50 events (seq 1..50) to stdout in ")


@pytest.fixture
def second_server_url(tmp_path: Path) -> Iterator[str]:
    broker = EmbeddedBroker(tmp_path / "broker-2")
    broker.start()
    try:
        yield broker.url
    finally:
        broker.stop()


def test_the_bar_shows_the_final_count_before_it_is_erased() -> None:
    """Draws are a tenth of a second apart at least; the last advances may come sooner,
    and the bar must not end short of what was done."""
    from services.cli.app import Progress

    term = _Terminal()
    p = Progress("exporting", 50, term)
    p.advance(10)
    p.advance(40)  # within a tenth of a second of the first draw: not drawn then
    p.close()
    text = term.getvalue()
    assert "10/50" in text and "50/50" in text
    assert text.endswith("\r\x1b[K")
