"""Bundles with gaps in their seqs, and seqs out of the contract's bounds, on every reader
that takes `--log`: refused with FILE:LINE, or (`--allow-gaps`) replayed past and said
once on stderr."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas import bundle
from schemas.errors import BundleError
from services import cli
from services.core.view import digest, encode_state
from services.replay import rebuild
from services.replay.source import BundleSource
from tests.replay.conftest import cluster

pytestmark = pytest.mark.timeout(30)

# Every command that reads a bundle with --log, and what it needs besides.
READERS = [
    pytest.param(["view"], id="view"),
    pytest.param(["replay", "--db", "{tmp}/out.sqlite"], id="replay"),
    pytest.param(["history", "node", "n1"], id="history"),
    pytest.param(["explain", "node", "n1"], id="explain"),
    pytest.param(["diff", "--seq", "2"], id="diff"),
    pytest.param(["status"], id="status"),
    pytest.param(["preemption", "plan", "--model", "chat"], id="preemption plan"),
]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def gapped(tmp_path: Path, drop: range) -> Path:
    """The cluster scenario's bundle without the lines of the seqs in `drop`."""
    path = cluster().write(tmp_path / "full.jsonl")
    lines = path.read_text().splitlines()
    kept = [x for i, x in enumerate(lines, start=1) if i not in drop]
    out = tmp_path / "incident.jsonl"
    out.write_text("\n".join(kept) + "\n")
    return out


@pytest.mark.parametrize("argv", READERS)
def test_a_gap_is_refused_naming_its_line_and_allow_gaps_goes_on(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = gapped(tmp_path, range(6, 9))
    args = [a.format(tmp=tmp_path) for a in argv]
    code, out, err = run(capsys, *args, "--log", str(path))
    assert code == 1 and out == ""
    assert err == (
        f"llmgw: {path}:6: seqs 6-8 are missing (the log has a gap); --allow-gaps replays past it\n"
    )

    code, out, err = run(capsys, *args, "--log", str(path), "--allow-gaps")
    assert code == 0, err
    notes = [x for x in err.splitlines() if "gap" in x and "rejected" not in x]
    assert notes == [
        f"llmgw: note: {path}: the log has 1 gap: seqs 6-8 missing (3 events); replayed past them"
    ]


def test_one_missing_seq_and_several_gaps_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = gapped(tmp_path, range(4, 5))
    code, _, err = run(capsys, "view", "--log", str(path))
    assert code == 1
    assert f"{path}:4: seq 4 is missing (the log has a gap)" in err

    path.write_text(
        "\n".join(
            x
            for i, x in enumerate(
                cluster().write(tmp_path / "f.jsonl").read_text().splitlines(), start=1
            )
            if i not in (3, 7, 8)
        )
        + "\n"
    )
    code, _, err = run(capsys, "view", "--log", str(path), "--allow-gaps")
    assert code == 0
    assert "the log has 2 gaps: seqs 3, 7-8 missing (3 events)" in err


def test_a_gap_past_the_moment_asked_for_is_not_looked_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = gapped(tmp_path, range(10, 12))
    code, _, err = run(capsys, "view", "--log", str(path), "--seq", "9")
    assert code == 0 and err == ""
    code, _, err = run(capsys, "view", "--log", str(path), "--seq", "12")
    assert code == 1 and f"{path}:10: seqs 10-11 are missing" in err


@pytest.mark.parametrize("argv", READERS)
def test_a_bundle_that_starts_late_without_a_snapshot_is_refused(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A compacted log exported without its archive: its beginning is a hole like any
    # other, and replaying past it would show a cluster that never was.
    path = gapped(tmp_path, range(1, 4))
    args = [a.format(tmp=tmp_path) for a in argv]
    code, out, err = run(capsys, *args, "--log", str(path))
    assert code == 1 and out == ""
    assert err == (
        f"llmgw: {path}:1: the bundle starts at seq 4: seqs 1-3 are missing and no snapshot "
        "in it covers them (a compacted log exported or cut without its archive, or a "
        "hand-cut file); --allow-gaps replays past it\n"
    )
    # Past the hole it goes on, saying so; what it then shows lacks what the hole held
    # (`chat` was declared at seq 3: a plan for it is refused, in one line).
    code, out, err = run(capsys, *args, "--log", str(path), "--allow-gaps")
    note = f"llmgw: note: {path}: the log has 1 gap: seqs 1-3 missing (3 events); replayed"
    assert err.startswith(note), err
    if "plan" in args:
        assert code == 3 and "unknown model 'chat'" in err and err.count("\n") == 2
    else:
        assert code == 0, err


def test_a_bundle_that_starts_from_a_snapshot_replays_as_the_whole_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = cluster().write(tmp_path / "full.jsonl")
    whole = asyncio.run(rebuild.from_bundle(str(full)))
    at_10 = asyncio.run(rebuild.from_bundle(str(full), until_seq=10))
    lines = full.read_bytes().splitlines()[10:]
    path = tmp_path / "from-11.jsonl"
    path.write_bytes(b"\n".join([bundle.snapshot_line(10, encode_state(at_10.view.state)), *lines]))
    got = asyncio.run(rebuild.from_bundle(str(path)))
    assert got.started_at == 10 and got.source.stats.gaps == []
    assert digest(got.view.state) == digest(whole.view.state)
    code, _, err = run(capsys, "view", "--log", str(path), "--seq", "5")
    assert code == 1 and "the moment asked for is before it" in err and err.count("\n") == 1
    # A snapshot line that does not say its view's seq is not trusted.
    path.write_bytes(b"\n".join([bundle.snapshot_line(9, encode_state(at_10.view.state)), *lines]))
    code, _, err = run(capsys, "view", "--log", str(path))
    assert code == 1 and "says seq 9 and its view seq 10: not trusted" in err
    # A snapshot whose next line does not follow it is a gap like any other.
    at_9 = asyncio.run(rebuild.from_bundle(str(full), until_seq=9))
    path.write_bytes(b"\n".join([bundle.snapshot_line(9, encode_state(at_9.view.state)), *lines]))
    code, _, err = run(capsys, "view", "--log", str(path))
    assert code == 1
    assert (
        f"{path}:2: the bundle starts at seq 11: seq 10 is missing and its snapshot is of " in err
    )


def test_the_source_keeps_the_gaps_it_was_allowed_past(tmp_path: Path) -> None:
    path = gapped(tmp_path, range(6, 9))

    async def read(allow: bool) -> BundleSource:
        src = BundleSource(str(path), allow_gaps=allow)
        async for _ in src.batches():
            pass
        return src

    with pytest.raises(BundleError) as e:
        asyncio.run(read(False))
    assert (e.value.path, e.value.line) == (str(path), 6)
    src = asyncio.run(read(True))
    assert src.stats.gaps == [(6, 8)] and src.stats.decoded == 13


@pytest.mark.parametrize(
    ("seq", "why"),
    [
        pytest.param("9223372036854775808", "is past the largest sequence", id="2^63"),
        pytest.param("9007199254740993", "is past the largest sequence", id="2^53+1"),
        pytest.param("99999999999999999999999", "is past the largest sequence", id="2^76"),
        pytest.param("0", "seq 0: sequences start at 1", id="zero"),
        pytest.param("-4", "seq -4: sequences start at 1", id="negative"),
        pytest.param("2.5", "seq 2.5 is not a positive integer", id="float"),
        pytest.param('"2"', 'seq "2" is not a positive integer', id="string"),
        pytest.param("null", "seq null is not a positive integer", id="null"),
    ],
)
@pytest.mark.parametrize("argv", READERS)
def test_a_seq_out_of_bounds_is_a_file_line_error(
    seq: str, why: str, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster().write(tmp_path / "incident.jsonl")
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('{"seq":3,', f'{{"seq":{seq},', 1)
    path.write_text("\n".join(lines) + "\n")
    args = [a.format(tmp=tmp_path) for a in argv]
    code, out, err = run(capsys, *args, "--log", str(path), "--allow-gaps")
    assert code == 1 and out == ""
    assert err.startswith(f"llmgw: {path}:3: ") and why in err, err
    assert err.count("\n") == 1 and "internal error" not in err


def test_help_names_allow_gaps(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["view"], ["replay"], ["preemption", "plan"], ["status"]):
        assert cli.main([*argv, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--allow-gaps" in out and "examples:" in out
