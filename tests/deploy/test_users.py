"""deploy/nats/users.py keeps passwords secret: none on the command line, none printed,
no placeholder (`change-me-*`) ever written; the missing ones made strong and kept in
the 0600 passwords file it reads, users.conf written 0600, stdin read for a pipe."""

from __future__ import annotations

import io
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.deploy.natsconf import DEPLOY, NATS_SERVER, users_module

pytestmark = pytest.mark.timeout(30)

SECRET = "Sup3r-s3cret-on-argv"


def _run(capsys: pytest.CaptureFixture[str], *argv: str, stdin: str = "") -> tuple[int, str, str]:
    rc = users_module().main(list(argv), stdin=io.StringIO(stdin))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _read(p: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in p.read_text().splitlines())


@pytest.mark.parametrize(
    "argv",
    [
        ["gpu-a1=" + SECRET],
        ["gpu-a1", "--control-password", SECRET],
        ["--viewer-password", SECRET],
    ],
    ids=["node", "control", "viewer"],
)
def test_a_password_on_the_command_line_is_refused_and_not_repeated(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    rc, out, err = _run(capsys, *argv, "--passwords", str(tmp_path / "pw"))
    assert rc == 1 and out == ""
    assert err.startswith("users.py: ") and err.count("\n") == 1, err
    assert "command line" in err and SECRET not in err
    assert not (tmp_path / "pw").exists()


def test_a_placeholder_is_never_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    fd = os.open(pw, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"control=change-me-control\n")
    os.close(fd)
    rc, out, err = _run(capsys, "gpu-a1", "--passwords", str(pw))
    assert rc == 1 and out == ""
    assert "the password of control is a placeholder" in err and "change-me-control" not in err
    users = users_module()
    for call in (
        lambda: users.render({}, "change-me-control", "v-strong"),
        lambda: users.render({"gpu-a1": "change-me-gpu-a1"}, "c-strong", "v-strong"),
        lambda: users.agent_user("gpu-a1", "CHANGE-ME"),
    ):
        with pytest.raises(users.UsersError, match="placeholder"):
            call()


def test_missing_passwords_are_made_strong_and_kept_in_the_0600_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pw, conf = tmp_path / "passwords", tmp_path / "users.conf"
    rc, out, err = _run(capsys, "gpu-a1", "--passwords", str(pw), "--out", str(conf))
    assert rc == 0 and out == "", err
    made = _read(pw)
    assert list(made) == ["control", "viewer", "gpu-a1"]
    assert len(set(made.values())) == 3 and all(len(v) >= 32 for v in made.values())
    assert _mode(pw) == 0o600 and _mode(conf) == 0o600
    assert err == f"users.py: new passwords for control, viewer, gpu-a1 in {pw}\n"
    text = conf.read_text()
    assert all(v in text for v in made.values()) and "change-me" not in text

    # A node added later: the others keep theirs, the new one gets one.
    rc, out, err = _run(capsys, "gpu-a1", "gpu-a2", "--passwords", str(pw), "--out", str(conf))
    assert rc == 0, err
    again = _read(pw)
    assert {k: again[k] for k in made} == made and len(again["gpu-a2"]) >= 32
    assert err == f"users.py: new passwords for gpu-a2 in {pw}\n"
    # nats-server takes it, beside the shipped config.
    (tmp_path / "single.conf").write_text((DEPLOY / "single.conf").read_text())
    (tmp_path / "permissions.conf").write_text((DEPLOY / "permissions.conf").read_text())
    r = subprocess.run(
        [NATS_SERVER, "-t", "-c", str(tmp_path / "single.conf")],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 0, r.stderr


def test_a_passwords_file_others_may_read_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pw = tmp_path / "pw"
    pw.write_text("control=" + SECRET + "\n")
    pw.chmod(0o644)
    rc, out, err = _run(capsys, "--passwords", str(pw))
    assert rc == 1 and out == "" and "chmod 600" in err and SECRET not in err


def test_passwords_from_stdin_for_a_pipe(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    given = "control=c-" + SECRET + "\nviewer=v-" + SECRET + "\n# the hosts\ngpu-a1=a-" + SECRET
    rc, out, err = _run(capsys, "gpu-a1", "--passwords", "-", stdin=given)
    assert rc == 0 and err == "", err
    assert all(f'"{p}-{SECRET}"' in out for p in "cva")
    # Nothing can be added to stdin: a user without a password is refused.
    rc, out, err = _run(capsys, "gpu-a1", "gpu-a2", "--passwords", "-", stdin=given)
    assert rc == 1 and out == "" and err == "users.py: no password on stdin for gpu-a2\n"
