"""`llmgw agent`: what a person sees when the command line is wrong, in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services import cli

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(
            ["--simulate", "--node", "gpu-a1"],
            "--simulate needs --gpus, e.g. --gpus 8xH100-80GB",
            id="simulate without GPUs",
        ),
        pytest.param(
            ["--node", "gpu-a1", "--gpus", "1xL4-24GB", "--ports", "20010-20000"],
            "'20010-20000' is not LOW-HIGH",
            id="bad ports",
        ),
        pytest.param(
            ["--simulate", "--node", "gpu-a1", "--gpus", "8xH100"],
            "bad GPU spec '8xH100': expected COUNTxMODEL-MEMORYGB (for example 8xH100-80GB)",
            id="bad GPU spec",
        ),
        pytest.param(
            ["--simulate", "--node", "a", "--gpus", "1xL4-24GB", "--traffic", "llama"],
            "'llama' is not MODEL=RPM",
            id="bad traffic",
        ),
        pytest.param(
            ["--simulate", "--node", "a", "--gpus", "1xL4-24GB", "--load-delay", "-1"],
            "'-1' must be 0 or more",
            id="negative delay",
        ),
        pytest.param(
            ["--simulate", "--node", "a", "--gpus", "1xL4-24GB", "--labels", "zone"],
            "'zone' is not KEY=VALUE",
            id="bad labels",
        ),
    ],
)
def test_bad_command_line_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["agent", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert err.count("\n") == 1


def test_no_driver_and_no_gpus_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # No pynvml importable and no nvidia-smi on PATH: a host without NVIDIA's driver.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert cli.main(["agent", "--node", "cpu-1", "--data", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "no NVIDIA driver here (no NVML, no nvidia-smi): declare the GPUs with --gpus" in err
    assert err.count("\n") == 1
