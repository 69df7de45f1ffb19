"""`--version`, and "did you mean" for a mistyped command, flag or cluster-file key."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import cli, clusterfile, names

pytestmark = pytest.mark.timeout(30)


def test_version_comes_from_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"llmgw {metadata.version('llmgw')}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(["stauts"], "unknown command `stauts`: did you mean `status`?", id="command"),
        pytest.param(
            ["events", "tial"], "unknown command `tial`: did you mean `tail`?", id="sub-command"
        ),
        pytest.param(
            ["status", "--jsn"], "unknown option `--jsn`: did you mean `--json`?", id="flag"
        ),
        pytest.param(["scale", "a", "1", "--forse"], "did you mean `--force`?", id="flag after"),
        pytest.param(["scale", "a", "1", "2"], "unrecognized arguments: 2", id="no suggestion"),
    ],
)
def test_a_mistyped_command_or_flag_gets_the_closest(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err, err


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        pytest.param(
            "models:\n  - name: a\n    mni: 1\n    profiles: [{name: p, gpus: 1}]\n",
            3,
            "models[0].mni: `mni` is not a key: did you mean `min`?",
            id="typo in a model",
        ),
        pytest.param(
            "models:\n  - name: a\n    profile: [{name: p, gpus: 1}]\n",
            3,
            "models[0].profile: `profile` is not a key: did you mean `profiles`?",
            id="profile singular",
        ),
        pytest.param(
            "models:\n  - name: a\n    replicas: 3\n    profiles: [{name: p, gpus: 1}]\n",
            3,
            "`replicas` is not a key: the replica count goes under `scale:`",
            id="replicas in a model",
        ),
        pytest.param(
            "models:\n  - name: a\n    profiles:\n      - {name: p, gpus: 1}\n      - name: q\n"
            "        gpu: 2\n",
            6,
            "models[0].profiles[1].gpu: `gpu` is not a key: did you mean `gpus`?",
            id="in a profile",
        ),
        pytest.param(
            "quota:\n  - name: a\n    guarantee: {gpus: 1}\n    limit:\n      gpu: 2\n",
            5,
            "quota[0].limit.gpu: `gpu` is not a key: did you mean `gpus`?",
            id="in a quota limit",
        ),
        pytest.param(
            "quota:\n  - name: a\n    paernt: b\n",
            3,
            "did you mean `parent`?",
            id="in an owner",
        ),
        pytest.param("scael: {}\n", 1, "scael: unknown section: did you mean `scale`?", id="top"),
    ],
)
def test_unknown_keys_are_errors_at_their_line(
    tmp_path: Path, text: str, line: int, why: str
) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    with pytest.raises(clusterfile.ClusterFileError) as info:
        clusterfile.load(f)
    assert why in str(info.value)
    assert str(info.value).startswith(f"{f}:{line}:"), str(info.value)


def test_unknown_keys_in_toml(tmp_path: Path) -> None:
    f = tmp_path / "cluster.toml"
    f.write_text('[[models]]\nname = "a"\nmni = 1\nprofiles = [{name = "p", gpus = 1}]\n')
    with pytest.raises(clusterfile.ClusterFileError) as info:
        clusterfile.load(f)
    assert info.value.line == 3 and "did you mean `min`?" in str(info.value)


def test_dry_run_refuses_an_unknown_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text("models:\n  - name: a\n    mni: 1\n    profiles: [{name: p, gpus: 1}]\n")
    assert cli.main(["--nats", "nats://127.0.0.1:1", "apply", "-f", str(f), "--dry-run"]) == 1
    assert capsys.readouterr().err.startswith(f"llmgw: {f}:3: models[0].mni")


@pytest.mark.parametrize(
    ("typed", "known", "want"),
    [
        pytest.param("lama-70b", ["llama-70b", "qwen-7b"], "llama-70b", id="typo"),
        pytest.param("ghost", ["llama-70b", "qwen-7b"], None, id="nothing close"),
        pytest.param("--jsn", ["--json", "--log"], "--json", id="flag"),
    ],
)
def test_suggest(typed: str, known: list[str], want: str | None) -> None:
    assert names.suggest(typed, known) == want


def test_plural() -> None:
    assert [names.plural(n, "GPU") for n in (0, 1, 2)] == ["0 GPUs", "1 GPU", "2 GPUs"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        pytest.param(
            "class: critcal",
            "models[0].class: 'critcal' is not one of critical, opportunistic, standard: "
            "did you mean `critical`?",
            id="class typo",
        ),
        pytest.param(
            "class: on_demand",
            "models[0].class: 'on_demand' is not one of critical, opportunistic, standard",
            id="class unlike any",
        ),
        pytest.param(
            "runtime: {engine: vlm}",
            "models[0].runtime.engine: 'vlm' is not one of command, sglang, vllm: "
            "did you mean `vllm`?",
            id="nested engine",
        ),
    ],
)
def test_a_bad_enum_value_is_one_line_exit_1_with_the_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, says: str
) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text(f"models:\n  - name: a\n    {line}\n    profiles: [{{name: p, gpus: 1}}]\n")
    assert cli.main(["--nats", "nats://127.0.0.1:1", "apply", "-f", str(f), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err == f"llmgw: {f}:3: {says}\n", err
