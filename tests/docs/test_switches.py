"""Every `LLMGW_*` environment variable the code names is in docs/operating.md's table
("Environment variables"), and every row of the table is one the code names: a switch
added, renamed or removed without the page saying so fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from services.bus import snapshots
from services.bus.stream import DLQ_STREAM

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "operating.md"
NAME = re.compile(r"^LLMGW_[A-Z0-9_]*[A-Z0-9]$")
# NOT_VARIABLES are the code's LLMGW_ names that are JetStream streams and buckets, not
# the environment's.
NOT_VARIABLES = {DLQ_STREAM, snapshots.BUCKET}


def _in_code() -> set[str]:
    found: set[str] = set()
    for root in ("services", "schemas"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.update(w for w in re.findall(r"LLMGW_[A-Z0-9_]+", node.value))
    return {n for n in found if NAME.match(n)} - NOT_VARIABLES


def _in_table() -> set[str]:
    text = PAGE.read_text()
    section = text[text.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    return set(re.findall(r"^\| `(LLMGW_[A-Z0-9_]+)` \|", section, re.M))


def test_the_table_names_every_variable_the_code_reads_and_no_other() -> None:
    code, table = _in_code(), _in_table()
    assert len(code) >= 10  # the scan finds them (the ordinary settings alone are nine)
    assert code - table == set(), "in the code, not in docs/operating.md's table"
    assert table - code == set(), "in docs/operating.md's table, not in the code"


# FLAGS_NOW are switches that became `Config` fields with flags (or, the crash hook, a
# test's own entry point; the policy's five, its engine's one choice): no code names
# them any more.
FLAGS_NOW = {
    "LLMGW_GATEWAY_FASTPATH": "--no-fast-path",
    "LLMGW_GC_TUNE": "--no-gc-tune",
    "LLMGW_GC_THRESHOLDS": "--gc-thresholds",
    "LLMGW_GC_FREEZE": "--no-gc-freeze",
    "LLMGW_BUS_WIRE": "--no-wire-reader",
    "LLMGW_FAULT": "",
    "LLMGW_POLICY_INDEX": "--policy-engine",
    "LLMGW_POLICY_CHECK": "--policy-engine",
    "LLMGW_POLICY_LAZY": "--policy-engine",
    "LLMGW_POLICY_LAZY_GANGS": "--policy-engine",
    "LLMGW_POLICY_NARROW": "--policy-engine",
    "LLMGW_ORACLE_DOMAINS": "--oracle-every-set",
}


def test_the_switches_that_are_flags_now_are_read_nowhere_and_the_page_names_their_flags() -> None:
    assert set(FLAGS_NOW) & _in_code() == set()
    text = PAGE.read_text()
    section = text[text.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    for flag in filter(None, FLAGS_NOW.values()):
        assert f"`{flag}" in section, flag


# SHARING are the gateway's flags for sharing with the other gateways on its broker:
# flags of its `Config`, read from no variable, named in the switches' section and in
# docs/gateway.md.
SHARING = ("--no-share", "--share-interval", "--share-expiry")


def test_the_gateways_sharing_switches_are_flags_the_pages_name() -> None:
    from services.gateway.__main__ import parser

    helped = parser().format_help()
    text = PAGE.read_text()
    section = text[text.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    gateway = (REPO / "docs" / "gateway.md").read_text()
    for flag in SHARING:
        assert flag in helped, flag
        assert f"`{flag}`" in section, flag
        assert f"`{flag}`" in gateway or f"`{flag} " in gateway, flag


# SPEED_SWITCHES are the gateway's speed-ups that are another implementation of the same
# interface, each with the flag that turns back to the reference: the page names each.
SPEED_SWITCHES = (
    "--no-fast-path",
    "--upstream-client aiohttp",
    "--server aiohttp",
    "--event-loop asyncio",
)


def test_the_page_names_the_flag_back_to_each_reference_implementation() -> None:
    from services.gateway.config import Config
    from services.gateway.loop import EVENT_LOOPS

    text = PAGE.read_text()
    section = text[text.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    for flag in SPEED_SWITCHES:
        assert f"`{flag}`" in section, flag
    # The references are what the flags name, and the speed-ups are the defaults.
    assert Config().upstream_client == "lean" and Config().event_loop == "auto"
    assert Config().server == "lean"
    assert "asyncio" in EVENT_LOOPS
