"""Operator commands and cluster files: `llmgw apply`, `scale`, `cordon`, deploy configs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas import codec
from schemas import events as ev
from services import cli, clusterfile

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_cluster_files_are_valid(path: Path) -> None:
    spec = clusterfile.load(path)
    assert spec.models
    for model in spec.scale:
        assert model in {m.name for m in spec.models} | {a for m in spec.models for a in m.aliases}


BAD = [
    pytest.param(
        "models:\n  - name: a\n    profiles: [{name: p, gpus: one}]\n",
        3,
        "models[0].profiles[0].gpus: model 'a': expected a whole number, not the text 'one'",
        id="wrong type names the line",
    ),
    pytest.param(
        "models:\n  - name: a\n    class: vip\n    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].class: Invalid enum value 'vip'",
        id="unknown class",
    ),
    pytest.param(
        "models:\n  - name: a\n    profiles: []\n",
        3,
        "models[0].profiles: a model needs at least one profile",
        id="no profiles",
    ),
    pytest.param(
        "models:\n  - profiles: [{name: p, gpus: 1}]\n",
        2,
        "models[0]: missing required field `name`",
        id="missing name",
    ),
    pytest.param(
        "models:\n  - {name: a, profiles: [{name: p, gpus: 1}]}\n  - {name: a, profiles: [{name: p, gpus: 1}]}\n",
        3,
        "declared twice",
        id="duplicate model",
    ),
    pytest.param("modles: []\n", 1, "modles: unknown section", id="typo in a section"),
    pytest.param("models: [\n", 2, "not valid YAML", id="broken YAML"),
    pytest.param(
        "quota:\n  - {name: a, parent: b}\n  - {name: b, parent: a}\n",
        1,
        "parent cycle",
        id="quota cycle",
    ),
    pytest.param("scale:\n  a: -1\n", 2, "scale.a: must be a whole number", id="negative scale"),
    # A value is the type the file wrote: a quoted number is text (any other reader of
    # the file takes it so), a boolean is not a name, 3.0 is not a whole number.
    pytest.param(
        "models:\n  - name: chat\n    max: '3'\n    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].max: model 'chat': expected a whole number, not the text '3': write 3, "
        "without quotes",
        id="quoted max",
    ),
    pytest.param(
        'models:\n  - name: chat\n    idle_after_s: "600"\n    profiles: [{name: p, gpus: 1}]\n',
        3,
        "models[0].idle_after_s: model 'chat': expected a number, not the text '600': write 600",
        id="quoted seconds",
    ),
    pytest.param(
        "models:\n  - name: chat\n    profiles:\n      - {name: p, gpus: 1.0}\n",
        4,
        "models[0].profiles[0].gpus: model 'chat': expected a whole number, not 1.0",
        id="float gpus",
    ),
    pytest.param(
        "models:\n  - name: chat\n    owner: no\n    profiles: [{name: p, gpus: 1}]\n",
        3,
        "models[0].owner: model 'chat': expected text, not false (YAML reads an unquoted yes",
        id="yaml boolean as a name",
    ),
    pytest.param(
        "quota:\n  - name: team-a\n    limit: {gpus: '16'}\n",
        3,
        "quota[0].limit.gpus: owner 'team-a': expected a whole number, not the text '16'",
        id="quoted quota",
    ),
    pytest.param(
        "scale:\n  a: '2'\n",
        2,
        "scale.a: expected a whole number, not the text '2': write 2, without quotes",
        id="quoted scale",
    ),
    pytest.param(
        "scale:\n  a: 1000000000000\n",
        2,
        "scale.a: must be a whole number of replicas from 0 to 100,000, not 1000000000000",
        id="huge scale",
    ),
]


@pytest.mark.parametrize(("text", "line", "why"), BAD)
def test_cluster_file_errors_name_the_line(tmp_path: Path, text: str, line: int, why: str) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    with pytest.raises(clusterfile.ClusterFileError) as info:
        clusterfile.load(f)
    assert why in str(info.value)
    assert info.value.line == line, str(info.value)
    assert str(info.value).startswith(f"{f}:{line}:")


def test_toml_cluster_files_name_the_line(tmp_path: Path) -> None:
    f = tmp_path / "cluster.toml"
    f.write_text(
        '[[models]]\nname = "a"\nprofiles = [{name = "p", gpus = 1}]\n\n'
        '[[models]]\nname = "b"\nmin = "x"\nprofiles = [{name = "p", gpus = 1}]\n\n[scale]\na = 2\n'
    )
    with pytest.raises(clusterfile.ClusterFileError) as info:
        clusterfile.load(f)
    assert info.value.line == 7 and "models[1].min" in str(info.value)
    f.write_text('[[models]]\nname = "a"\nmax = "3"\nprofiles = [{name = "p", gpus = 1}]\n')
    with pytest.raises(clusterfile.ClusterFileError) as info:
        clusterfile.load(f)
    assert str(info.value) == (
        f"{f}:3: models[0].max: model 'a': expected a whole number, not the text '3': "
        "write 3, without quotes"
    )
    f.write_text('[[models]]\nname = "a"\nprofiles = [{name = "p", gpus = 1}]\n[scale]\na = 2\n')
    spec = clusterfile.load(f)
    assert spec.scale == {"a": 2} and spec.models[0].name == "a"


def _stored(url: str) -> list[ev.Event]:
    """Every event on the stream, read with the bus's own range reader."""
    from services.bus import connect, consume, ensure_streams

    async def read() -> list[ev.Event]:
        nc = await connect(url, "test")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            out: list[ev.Event] = []
            async for batch in consume.read_range(js, 1, None):
                out.extend(codec.decode(d.data) for d in batch)
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


def test_apply_publishes_only_what_changed(nats_server, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    small = ROOT / "deploy" / "examples" / "small.yaml"
    assert cli.main(["--nats", nats_server.url, "apply", "-f", str(small)]) == 0
    first = _stored(nats_server.url)
    kinds = [ev.type_of(type(e)) for e in first]
    assert kinds.count("model.declared") == 3 and kinds.count("scale.desired") == 2
    assert cli.main(["--nats", nats_server.url, "apply", "-f", str(small)]) == 0
    assert "nothing changed" in capsys.readouterr().out
    assert len(_stored(nats_server.url)) == len(first)
    changed = tmp_path / "c.yaml"
    changed.write_text(small.read_text().replace("embed: 4", "embed: 2"))
    assert cli.main(["--nats", nats_server.url, "apply", "-f", str(changed)]) == 0
    after = _stored(nats_server.url)
    assert len(after) == len(first) + 1
    assert after[-1].data == ev.ScaleDesired(model="embed", replicas=2)


def test_scale_and_cordon_publish_events(nats_server) -> None:  # type: ignore[no-untyped-def]
    url = nats_server.url
    assert cli.main(["--nats", url, "scale", "meta/llama-3.1-8b", "3", "--force"]) == 0
    assert cli.main(["--nats", url, "cordon", "gpu-a1", "--force"]) == 0
    assert cli.main(["--nats", url, "uncordon", "gpu-a1", "--force"]) == 0
    got = [e.data for e in _stored(nats_server.url)]
    assert got == [
        ev.ScaleDesired(model="meta/llama-3.1-8b", replicas=3),
        ev.NodeCordoned(node="gpu-a1"),
        ev.NodeUncordoned(node="gpu-a1"),
    ]


def test_a_bad_file_is_one_line_and_publishes_nothing(nats_server, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "bad.yaml"
    f.write_text("models:\n  - name: a\n    min: -2\n    profiles: [{name: p, gpus: 1}]\n")
    assert cli.main(["--nats", nats_server.url, "apply", "-f", str(f)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{f}:3: models[0].min" in err, err
    assert _stored(nats_server.url) == []
