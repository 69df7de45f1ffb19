"""deploy/install-agent.sh, run for real in a scratch root (--root), twice: the first run
makes the llmgw user (in the GPU groups the root has), the directories with their modes,
the venv with the gpu extra, the shipped unit and the 0600 credentials file the unit
reads; the second changes nothing and says so. The Containerfile's install step is the
same script: its RUN line, run against the same root, finds nothing to change, and the
image's entrypoint is the venv's llmgw."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from tests.deploy.natsconf import ROOT, make_ca

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = ROOT / "deploy" / "install-agent.sh"
CONTAINERFILE = ROOT / "Containerfile"
NODE = "gpu-a1"
PASSWORD = "s3cret-test-pw-of-gpu-a1"


def install(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "VIRTUAL_ENV"))}
    r = subprocess.run(
        ["sh", str(SCRIPT), *args], capture_output=True, text=True, timeout=540, env=env
    )
    assert PASSWORD not in r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def tree(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under `root` (bytecode caches left out): mode, owner, size, mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in [*dirs, *files]:
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    return out


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def containerfile_install() -> tuple[list[str], str]:
    """The install-agent.sh command of the Containerfile's RUN line, and where its COPY
    put the source."""
    lines = CONTAINERFILE.read_text().replace("\\\n", " ").splitlines()
    (copy,) = [x.split() for x in lines if x.startswith("COPY ")]
    assert copy[1] == ".", copy  # the whole checkout
    runs = [shlex.split(x[4:]) for x in lines if x.startswith("RUN ")]
    (run,) = [r for r in runs if any(w.endswith("deploy/install-agent.sh") for w in r)]
    # The RUN line's commands, split at each `&&`: the one that is the script's.
    cmds: list[list[str]] = [[]]
    for w in run:
        if w == "&&":
            cmds.append([])
        else:
            cmds[-1].append(w)
    (cmd,) = [c for c in cmds if c and c[0].endswith("deploy/install-agent.sh")]
    assert cmd[0] == f"{copy[2]}/deploy/install-agent.sh", cmd
    return cmd[1:], copy[2]


def test_install_twice_changes_nothing_the_second_time(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\nrender:x:109:alice\n")
    ca = make_ca(tmp_path / "pki", "ca")[0]
    pw = tmp_path / "passwords"
    pw.write_text(f"control=not-this-one\n{NODE}={PASSWORD}\n")
    args = ["--root", str(root), "--node", NODE, "--nats-ca", str(ca), "--password-file", str(pw)]

    first = install(*args)
    assert "change(s)" in first.stdout, first.stdout

    passwd = (root / "etc/passwd").read_text().splitlines()
    (user,) = [x.split(":") for x in passwd if x.startswith("llmgw:")]
    assert user[5:] == ["/var/lib/llmgw", "/usr/sbin/nologin"]
    groups = {x.split(":")[0]: x.split(":") for x in (root / "etc/group").read_text().splitlines()}
    assert groups["llmgw"][2] == user[3]
    assert groups["video"][3] == "llmgw" and groups["render"][3] == "alice,llmgw"

    for path, want in {
        "opt/llmgw": 0o755,
        "etc/llmgw": 0o755,
        "etc/llmgw/nats": 0o750,
        "var/lib/llmgw": 0o750,
        "var/lib/llmgw/hf": 0o750,
        "etc/llmgw/nats/ca.pem": 0o644,
        "etc/systemd/system/llmgw-agent@.service": 0o644,
        "etc/llmgw/agent.env": 0o600,
    }.items():
        assert mode(root / path) == want, (path, oct(mode(root / path)))
    if os.geteuid() == 0:
        data = (root / "var/lib/llmgw").stat()
        assert (data.st_uid, data.st_gid) == (int(user[2]), int(user[3]))
        assert (root / "etc/llmgw/agent.env").stat().st_uid == 0
    assert (root / "etc/llmgw/nats/ca.pem").read_bytes() == ca.read_bytes()

    # The unit as shipped, reading the credentials file that was written for it.
    unit = (root / "etc/systemd/system/llmgw-agent@.service").read_text()
    assert unit == (ROOT / "deploy/systemd/llmgw-agent@.service").read_text()
    assert "EnvironmentFile=/etc/llmgw/agent.env" in unit
    assert (root / "etc/llmgw/agent.env").read_text().splitlines()[1:] == [
        f"LLMGW_NATS=tls://{NODE}:{PASSWORD}@nats.internal:4222",
        "LLMGW_NATS_CA=/etc/llmgw/nats/ca.pem",
    ]

    # The venv: llmgw, not editable (a copy), with the gpu extra's NVML binding.
    py = root / "opt/llmgw/.venv/bin/python"
    where = subprocess.run(
        [str(py), "-c", "import pynvml, services; print(services.__file__)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert str(root) in where.stdout, where.stdout
    helped = subprocess.run(
        [str(root / "opt/llmgw/.venv/bin/llmgw"), "agent", "--help"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert helped.returncode == 0 and "--node" in helped.stdout, helped.stderr

    before = tree(root)
    second = install(*args)
    assert second.stdout.splitlines()[-2] == "install-agent.sh: nothing to change", second.stdout
    assert "changed:" not in second.stdout, second.stdout
    assert tree(root) == before

    # The Containerfile's install step, the source where its COPY put it: nothing new.
    cargs, src = containerfile_install()
    cargs = [str(ROOT) if a == src else a for a in cargs]
    image = install(*cargs, "--root", str(root))
    assert image.stdout.splitlines()[-1] == "install-agent.sh: nothing to change", image.stdout
    assert tree(root) == before
    entry = [x for x in CONTAINERFILE.read_text().splitlines() if x.startswith("ENTRYPOINT")]
    assert entry == ['ENTRYPOINT ["/opt/llmgw/.venv/bin/llmgw"]']
    assert (root / "opt/llmgw/.venv/bin/llmgw").exists()

    # A credentials file others may read is put back to 0600, kept otherwise.
    (root / "etc/llmgw/agent.env").chmod(0o644)
    fixed = install(*args)
    assert "changed: /etc/llmgw/agent.env (mode 600" in fixed.stdout, fixed.stdout
    assert "install-agent.sh: 1 change(s)" in fixed.stdout, fixed.stdout
    assert mode(root / "etc/llmgw/agent.env") == 0o600


def test_the_manifests_name_the_image_the_containerfile_builds() -> None:
    text = CONTAINERFILE.read_text()
    name = text.split('org.opencontainers.image.ref.name="', 1)[1].split('"', 1)[0]
    for manifest in ("agent-daemonset.yaml", "control-plane.yaml"):
        images = [
            x.split("image:", 1)[1].strip()
            for x in (ROOT / "deploy/kubernetes" / manifest).read_text().splitlines()
            if x.strip().startswith("image:")
        ]
        assert images and set(images) == {name}, (manifest, images)


def test_refusals_are_one_line(tmp_path: Path) -> None:
    r = subprocess.run(
        ["sh", str(SCRIPT), "--root", str(tmp_path), "--password", PASSWORD],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1 and PASSWORD not in r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "--password-file" in r.stderr, r.stderr
    r = subprocess.run(
        ["sh", str(SCRIPT), "--root", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1 and "no such directory" in r.stderr, r.stderr


def test_credentials_without_a_ca_are_refused_before_anything_is_made(tmp_path: Path) -> None:
    """agent.env names /etc/llmgw/nats/ca.pem; written when no CA was given, the agent
    could never verify the broker and would not start. Refused in one line, and the
    root is left as it was."""
    pw = tmp_path / "gpu-a1.pw"
    pw.write_text(f"{NODE}={PASSWORD}\n")
    root = tmp_path / "root"
    root.mkdir()
    r = subprocess.run(
        ["sh", str(SCRIPT), "--root", str(root), "--node", NODE, "--password-file", str(pw)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1 and PASSWORD not in r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "--nats-ca" in r.stderr, r.stderr
    assert list(root.iterdir()) == []
