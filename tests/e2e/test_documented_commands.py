"""The tour's commands, run as docs/tour.md writes them, against a real plane, each checked
against what the page says it prints.

The page is parsed, not copied: every `sh` block's commands in order (a line, with its
continuations), each with the output the page shows for it, the `# ...` lines under it or
the plain block that follows its block. A command runs in a shell in a scratch HOME and
working directory beside `llmgw up` started with the page's own first command. A command
whose page shows output must exit as the page says (`# (exits N)` under an error, else 0)
and print every line the page shows, in order, once both are normalized (times, ages,
durations, ids, digests, numbers and the host's name replaced by placeholders; `...`
stands for anything); a plain output block with no `...` line of its own level must also
hold every unindented line of the real output, so a section the command gained (the
PLANE line) and the page lacks fails here. A command with no output shown must exit 0.
A later change to the page that drifts from the output, or to the output that leaves the
page behind, fails this test.

The README's tour (its own blocks, no output shown) is run by test_readme_tour.py. The
few commands of the page that cannot run here are in SKIP, each with its reason.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.up_process import reader_env, shell_up

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tour.md"

# SKIP: the page's commands (as written, the comment after them left out) this test does
# not run, and why.
SKIP = {
    "llmgw events tail --since 1": "follows the log until Ctrl-C",
    ".venv/bin/nats-server -js -sd /tmp/incident -p 4333 &": "a second broker on a fixed port",
    "llmgw --nats nats://127.0.0.1:4333 events import incident.jsonl": "needs that broker",
    "llmgw apply -f broken.yaml": "a reader's own mistaken file, not in the repository",
    "llmgw apply -f typo.yaml": "a reader's own mistaken file, not in the repository",
    "llmgw apply -f sweep.yaml": "a reader's own mistaken file, not in the repository",
    "llmgw apply -f quoted.yaml": "a reader's own mistaken file, not in the repository",
    "llmgw drain node sim-1": "asks on a terminal first; the tour's cluster is left as it is",
    "llmgw delete model batch": "asks on a terminal first; the tour's cluster is left as it is",
    "llmgw delete node sim-3": "a node the tour's plane does not have",
    "llmgw status --watch": "redraws until Ctrl-C",
    "llmgw view --watch --count 5": "waits for events the tour no longer makes",
}

# COMMAND_TIMEOUT_S bounds one command of the page: each ends within seconds.
COMMAND_TIMEOUT_S = 30

# SETTLE: what the page's reader waits for, in time, before a command whose output shows
# the cluster settled (the page's story is told seconds apart; the test runs at once).
SETTLE = {
    "llmgw status": (
        "llmgw wait model chat --for ready --timeout 60",
        "llmgw wait model batch --for desired --timeout 60",
    ),
    "llmgw explain replica batch-2d2": ("llmgw wait model chat --for desired --timeout 60",),
}


@dataclass
class Command:
    text: str
    line: int
    sample: list[str] = field(default_factory=list)
    block_sample: bool = False
    """True when the sample is a plain block after the `sh` block (the whole output)."""

    @property
    def key(self) -> str:
        """The command as written, without its trailing comment."""
        return re.sub(r"\s+#\s.*$", "", self.text.splitlines()[0]).strip()


def page_commands(text: str) -> list[list[Command]]:
    """The page's `sh` blocks, each a list of its commands with the output shown for each."""
    lines = text.splitlines()
    blocks: list[list[Command]] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```sh":
            i += 1
            continue
        i += 1
        block: list[Command] = []
        while lines[i].strip() != "```":
            line = lines[i]
            if line.startswith("#") and block:
                block[-1].sample.append(line[2:] if line.startswith("# ") else line[1:])
            elif line.strip() and line.strip() != ". .venv/bin/activate":
                cmd = Command(line, i + 1)
                # A command goes on past a line ending in `\` and inside an open '...'.
                while cmd.text.endswith("\\") or cmd.text.count("'") % 2:
                    i += 1
                    cmd.text += "\n" + lines[i]
                block.append(cmd)
            i += 1
        i += 1
        # A plain block right after (blank lines between at most) is the last one's output.
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if block and j < len(lines) and lines[j].strip() == "```":
            k = lines.index("```", j + 1)
            block[-1].sample = lines[j + 1 : k]
            block[-1].block_sample = True
            i = k + 1
        blocks.append(block)
    return blocks


_HOST = re.compile(re.escape(socket.gethostname()) + r"-(?=\d)")
_RULES: tuple[tuple[str, str], ...] = (
    (r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\b", "<T>"),
    (r"\b\d\d:\d\d:\d\d\b", "<T>"),
    (r"\b01[0-9A-HJKMNP-TV-Z]{24}\b|\b01[0-9A-Z]*\.\.\.", "<ULID>"),
    (r"\b[0-9a-f]{12,}\b", "<ID>"),
    (r"\b(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+\b", "<D>"),
    (r"\bin <D>|<D> ago\b|\bnow\b", "<AGE>"),
    (r"\d+", "N"),
    (r"[ \t]+", " "),
)


def normal(line: str) -> str:
    """A line with what differs from run to run replaced by placeholders."""
    line = _HOST.sub("host-", line)
    for pattern, to in _RULES:
        line = re.sub(pattern, to, line)
    return line.strip()


def shown(line: str) -> re.Pattern[str]:
    """A line the page shows, as a pattern for a real line (`...` is anything)."""
    return re.compile(".*".join(re.escape(part) for part in normal(line).split("...")))


def mismatch(cmd: Command, out: str) -> str | None:
    """What the real output lacks of the page's sample, or None."""
    real = [normal(x) for x in out.splitlines()]
    at = 0
    for want in cmd.sample:
        if not want.strip() or want.strip() == "..." or re.fullmatch(r"\(exits \d+\)", want):
            continue
        pattern = shown(want)
        found = next((k for k in range(at, len(real)) if pattern.search(real[k])), None)
        if found is None:
            return f"the page shows {want!r}, which is not in the output (after line {at})"
        at = found + 1
    if cmd.block_sample and "..." not in [x.strip() for x in cmd.sample if not x[:1].isspace()]:
        page = [shown(x) for x in cmd.sample if x.strip() and not x[:1].isspace()]
        for line in out.splitlines():
            top = line.strip() and not line[:1].isspace()
            if top and not any(p.fullmatch(normal(line)) for p in page):
                return f"the output says {line!r}, which the page's sample lacks"
    return None


def expected_exit(cmd: Command) -> int:
    for line in cmd.sample:
        m = re.fullmatch(r"\(exits (\d+)\)", line.strip())
        if m:
            return int(m.group(1))
    assert not (cmd.sample and cmd.sample[0].startswith("llmgw: ")), (
        f"{PAGE.name}:{cmd.line}: an error shown without its exit status: add `# (exits N)`"
    )
    return 0


def test_the_page_is_parsed() -> None:
    blocks = page_commands(PAGE.read_text())
    cmds = {c.key: c for b in blocks for c in b}
    assert cmds["llmgw status"].block_sample and "LAST DECISIONS" in cmds["llmgw status"].sample
    assert cmds["llmgw scale chat 2"].sample[0].startswith("scale.desired chat -> 2")
    assert expected_exit(cmds["llmgw scale caht 2"]) == 3
    assert (
        "x-llmgw-replica: chat-5b92d6648cc6"
        in cmds[
            "curl -s -D - \"$GW/chat/completions\" -H 'Content-Type: application/json' \\"
        ].sample
    )
    # Every command is run or skipped by name: a skip the page no longer has is stale.
    assert set(SKIP) <= set(cmds), set(SKIP) - set(cmds)
    assert set(SETTLE) <= set(cmds)
    # The normal form: what differs between runs is a placeholder, the rest is kept.
    assert normal("  6    9s ago  placement.decided  chat   placed   chat-d722b2cdefda (tp4)") == (
        "N <AGE> placement.decided chat placed chat-<ID> (tpN)"
    )
    assert shown("decision   seq 43 preemption.decided ... outcome preempted").search(
        normal(
            "decision   seq 44 preemption.decided 01M94M70GFHBB422SF34SSSZF0 at x, outcome preempted"
        )
    )


def test_the_tour_prints_what_its_page_shows(tmp_path: Path) -> None:
    blocks = page_commands(PAGE.read_text())
    up_cmd = blocks[0][0]
    assert up_cmd.key.startswith("llmgw up --simulate"), up_cmd
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "deploy").symlink_to(ROOT / "deploy")
    env = reader_env(home, COLUMNS="200")
    outputs: list[str] = []

    def sh(script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", script],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def served() -> str:
        found = re.findall(r"x-llmgw-replica: (\S+)", "\n".join(outputs))
        assert found, "no answer named its replica"
        return str(found[0])

    def victim() -> str:
        done = sh("llmgw get replicas --state stopped -o name")
        return next(x for x in done.stdout.split() if x.startswith("replica/batch-"))

    # IDS: the page's own ids in commands, and the ones this run has in their place.
    ids: dict[str, Callable[[], str]] = {"batch-2d2": victim, "chat-5b9": served}
    ran, skipped, failures = 0, 0, []
    with shell_up(up_cmd.key, work, env, tmp_path / "up.log"):
        for block in blocks:
            prelude = ""
            for cmd in block:
                if cmd is up_cmd:
                    continue
                if cmd.key in SKIP:
                    skipped += 1
                    continue
                if re.match(r"[A-Z_]+=", cmd.text):
                    prelude += cmd.text + "\n"
                    continue
                for wait in SETTLE.get(cmd.key, ()):
                    settled = sh(wait, timeout=90)
                    assert settled.returncode == 0, (wait, settled.stdout, settled.stderr)
                text = cmd.text
                for page_id, real in ids.items():
                    if re.search(rf"\b{page_id}\b", text):
                        text = re.sub(rf"\b{page_id}\b", real(), text)
                where = f"{PAGE.name}:{cmd.line}: `{cmd.key}`"
                try:
                    done = sh(prelude + text, timeout=COMMAND_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    failures.append(f"{where} did not end within {COMMAND_TIMEOUT_S} s")
                    continue
                ran += 1
                out = done.stdout + done.stderr
                outputs.append(out)
                want = expected_exit(cmd)
                if done.returncode != want:
                    failures.append(
                        f"{where} exited {done.returncode}, the page says {want}:\n{out}"
                    )
                    continue
                why = mismatch(cmd, out)
                if why:
                    failures.append(f"{where}: {why}; it printed:\n{out}")
        assert not failures, "\n\n".join(failures)
        assert ran >= 15 and skipped == len(SKIP), (ran, skipped)
