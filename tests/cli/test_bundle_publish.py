"""`llmgw events publish` checks the names typed against the cluster the log tells: an
alias goes out as the model it names, an unknown model or node is refused with the
closest known name unless `--force`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker
from services.cli import main

pytestmark = pytest.mark.timeout(120)

INVENTORY = {
    "node": "gpu-a1",
    "gpus": [{"index": 0, "uuid": "GPU-0", "model": "H100", "memory_gb": 80}],
    "cpu_cores": 64,
    "memory_gb": 512,
}


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LLMGW_NATS", "LLMGW_ROOT", "LLMGW_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path / "no-llmgw-up-here"))


def publish(
    capsys: pytest.CaptureFixture[str], url: str, kind: str, data: object, *more: str
) -> tuple[int, str, str]:
    code = main(["--nats", url, "events", "publish", kind, "--data", json.dumps(data), *more])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def declared(nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]) -> str:
    """A broker whose log declares llama-70b (alias `llama`) and node gpu-a1."""
    url = nats_server.url
    model = {"name": "llama-70b", "aliases": ["llama"], "profiles": [{"name": "tp1", "gpus": 1}]}
    for kind, data in (("model.declared", model), ("node.inventory", INVENTORY)):
        code, _, err = publish(capsys, url, kind, data)
        assert code == 0, err
    return url


def test_an_alias_is_published_as_the_model_it_names(
    declared: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = publish(capsys, declared, "scale.desired", {"model": "llama", "replicas": 2})
    assert code == 0, err
    assert "subject=llmgw.catalog.scale.llama-70b" in out
    assert "model: llama is an alias of llama-70b; published as llama-70b" in out

    code, out, err = publish(
        capsys,
        declared,
        "hold.created",
        {"model": "llama", "for_model": "llama", "until": "2026-11-29T14:00:00Z"},
    )
    assert code == 0, err
    assert "subject=llmgw.hold.created.llama-70b" in out and "for_model: llama is" in out


@pytest.mark.parametrize(
    ("kind", "data", "more", "message"),
    [
        pytest.param(
            "scale.desired",
            {"model": "lama-70b", "replicas": 1},
            [],
            "llmgw: --data: model 'lama-70b': unknown model: did you mean llama-70b?",
            id="model",
        ),
        pytest.param(
            "model.removed",
            {"name": "llama-7b"},
            [],
            "llmgw: --data: name 'llama-7b': unknown model: did you mean llama-70b?",
            id="removed",
        ),
        pytest.param(
            "node.cordoned",
            {"node": "gpu-a2"},
            [],
            "llmgw: --data: node 'gpu-a2': unknown node: did you mean gpu-a1?",
            id="node",
        ),
        pytest.param(
            "replica.drain",
            {"replica": "r-1", "model": "llama-70b", "reason": "node_drain"},
            ["--node", "gpu-b1"],
            "llmgw: --node 'gpu-b1': unknown node: did you mean gpu-a1?",
            id="--node",
        ),
    ],
)
def test_an_unknown_name_is_refused_unless_force(
    kind: str,
    data: dict[str, object],
    more: list[str],
    message: str,
    declared: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = publish(capsys, declared, kind, data, *more)
    assert code == 3 and out == ""  # not found (see services.cli.app.EXIT_CODES)
    assert err.startswith(message), err
    assert "--force publishes it as typed" in err and err.count("\n") == 1

    code, out, err = publish(capsys, declared, kind, data, *more, "--force")
    assert code == 0, err
    assert out.startswith("seq=3 ")


def test_new_names_need_no_check(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    # model.declared and node.inventory bring names in: an empty log is no reason to refuse.
    code, out, err = publish(capsys, nats_server.url, "node.inventory", INVENTORY)
    assert code == 0, err
    code, out, err = publish(capsys, nats_server.url, "model.declared", {"name": "fresh"})
    assert code == 0, err and out.startswith("seq=2 ")


def test_help_says_names_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["events", "publish", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--force" in out and "alias" in out and "examples:" in out
