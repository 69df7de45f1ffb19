"""The two readings of a YAML cluster file give the same: libyaml's parser (the default)
and PyYAML's own (`llmgw apply --pure-yaml`), the same models, quota and scale, the same
lines for each field, and the same one-line error, word for word, for every file either
refuses (aliases, depth, keys given twice, broken YAML, wrong types)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services import clusterfile

pytestmark = pytest.mark.timeout(60)

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.y*ml"))

FILES = {
    "plain": "models:\n  - {name: a, min: 1, profiles: [{name: p, gpus: 1}]}\nscale: {a: 2}\n",
    "block style": (
        "models:\n  - name: chat\n    class: critical\n    min: 1\n    max: 3\n"
        "    profiles:\n      - name: tp4\n        gpus: 4\n"
        "quota:\n  - name: root\n    guarantee: {gpus: 8}\n"
    ),
    "comments and unicode": '# é\nmodels:\n  - {name: "ü-model", profiles: [{name: p, gpus: 1}]}\n',
    "alias": "models:\n  - &m {name: a, profiles: [{name: p, gpus: 1}]}\n  - *m\n",
    "too deep": "models: " + "[" * 40 + "]" * 40 + "\n",
    "a key twice": "models:\n  - name: a\n    min: 1\n    min: 0\n",
    "broken": "models:\n  - {name: a\n",
    "tab": "models:\n\t- name: a\n",
    "quoted number": "models:\n  - {name: a, max: '3', profiles: [{name: p, gpus: 1}]}\n",
    "yes as a name": "models:\n  - {name: no, profiles: [{name: p, gpus: 1}]}\n",
    "sexagesimal and hex": "models:\n  - {name: a, max: 0x10, min: 1:20, profiles: [{name: p, gpus: 1}]}\n",
    "empty": "",
    "a document of two": "models: []\n---\nmodels: []\n",
    "null scale": "models:\n  - {name: a, profiles: [{name: p, gpus: 1}]}\nscale: ~\n",
    "timestamp name": "models:\n  - {name: 2026-12-06, profiles: [{name: p, gpus: 1}]}\n",
    "an anchor alone": "models:\n  - &m {name: a, profiles: [{name: p, gpus: 1}]}\n",
    "a key in quotes twice": 'models:\n  - {name: a, min: 1, "min": 2}\n',
    "a merge key": "models:\n  - {<<: {name: a}, profiles: [{name: p, gpus: 1}]}\n",
    "a complex key": "models:\n  - {? [a, b] : 1, name: a}\n",
    "explicit tags": "models:\n  - {name: !!str 3, max: !!int '4', profiles: [{name: p, gpus: 1}]}\n",
    "a local tag": "models:\n  - !model {name: a, profiles: [{name: p, gpus: 1}]}\n",
    "floats and nulls": (
        "models:\n  - {name: a, profiles: [{name: p, gpus: 1, gpu_memory_gb: .5e2, "
        "memory_gb: 1_0, cpu_cores: ~}]}\n"
    ),
    "block scalars": "models:\n  - name: |\n      a\n    profiles: [{name: p, gpus: 1}]\n",
    "a null key": "models:\n  - {~: 1, name: a}\n",
    "an equals sign": "models:\n  - {name: =, profiles: [{name: p, gpus: 1}]}\n",
    "deep but allowed": "scale: " + "{a: " * 20 + "1" + "}" * 20 + "\n",
    "not a mapping": "- a\n- b\n",
}


def _read(path: Path, libyaml: bool) -> object:
    try:
        return clusterfile.load(path, libyaml=libyaml)
    except clusterfile.ClusterFileError as e:
        return str(e)


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="this PyYAML has no libyaml")
@pytest.mark.parametrize("name", [*FILES, *(p.name for p in EXAMPLES)])
def test_both_readings_give_the_same(tmp_path: Path, name: str) -> None:
    if name in FILES:
        path = tmp_path / "cluster.yaml"
        path.write_text(FILES[name])
    else:
        path = next(p for p in EXAMPLES if p.name == name)
    fast, plain = _read(path, True), _read(path, False)
    assert fast == plain
    if isinstance(fast, clusterfile.ClusterFile):
        assert fast.lines == plain.lines  # type: ignore[union-attr]


def test_a_big_file_reads_the_same_both_ways(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(
        "models:\n"
        + "".join(
            f"  - {{name: m{i}, class: standard, min: 0, max: {i % 5}, "
            f"profiles: [{{name: p, gpus: {1 + i % 8}}}]}}\n"
            for i in range(2000)
        )
    )
    fast, plain = _read(path, True), _read(path, False)
    assert isinstance(fast, clusterfile.ClusterFile) and fast == plain


def test_apply_on_a_terminal_says_what_it_is_doing(tmp_path: Path, nats_server) -> None:  # type: ignore[no-untyped-def]
    """On a terminal, `apply` says it is reading the file, then draws the publishing's
    progress (a bar, erased at the end); piped, its output is the lines alone."""
    import os
    import pty
    import subprocess
    import sys

    path = tmp_path / "big.yaml"
    path.write_text(
        "models:\n"
        + "".join(
            f"  - {{name: m{i}, min: 0, profiles: [{{name: p, gpus: 1}}]}}\n" for i in range(3000)
        )
    )
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_NATS"}
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "--nats", nats_server.url, "apply", "-f", str(path)],
        stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=120,
    )  # fmt: skip
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert r.returncode == 0
    assert r.stdout.count("published model") == 3000
    said = seen.decode(errors="replace")
    assert f"reading {path} ..." in said and "publishing [" in said and "3,000/3,000" in said, said
