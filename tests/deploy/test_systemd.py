"""The shipped systemd units (deploy/systemd/) put no credential where others read it:
`systemctl show` prints every `Environment=` to any local user, so a unit that needs the
broker's URL, which carries a password, reads it from a root-only file
(`EnvironmentFile=`, no `-`: a missing file is a failed start, not a URL-less one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

UNITS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "systemd").glob("*.service"))

# CREDENTIAL is what a credential in a unit looks like: a URL's user:password@, a
# password or token setting, or a known placeholder.
CREDENTIAL = re.compile(r"://[^\s/@]+@|PASSWORD|TOKEN|change-me", re.I)


def _settings(unit: Path) -> list[tuple[str, str]]:
    """(key, value) of every setting line, comments left out."""
    out = []
    for line in unit.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def test_the_units_are_there() -> None:
    assert {u.name for u in UNITS} >= {"llmgw-agent@.service", "llmgw-control.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_no_credential_is_set_in_a_unit(unit: Path) -> None:
    for key, value in _settings(unit):
        assert not CREDENTIAL.search(value), f"{unit.name}: {key}={value}"
        if key == "Environment":
            assert not value.startswith("LLMGW_NATS="), f"{unit.name}: {key}={value}"


@pytest.mark.parametrize("name", ["llmgw-agent@.service", "llmgw-control.service"], ids=lambda n: n)
def test_the_broker_url_comes_from_a_root_only_file(name: str) -> None:
    (unit,) = [u for u in UNITS if u.name == name]
    files = [v for k, v in _settings(unit) if k == "EnvironmentFile"]
    assert len(files) == 1, files
    assert files[0].startswith("/etc/llmgw/"), files  # not optional ("-"), not in the data
    text = unit.read_text()
    assert f"install -m 0600 -o root -g root /dev/null {files[0]}" in text
    assert "LLMGW_NATS=tls://" in text  # the comment says what goes in it
    assert "LLMGW_NATS_CA=/etc/llmgw/nats/ca.pem" in text
