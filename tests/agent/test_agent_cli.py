"""`llmgw agent`: what a person sees when the command line is wrong, in one line."""

from __future__ import annotations

import pytest

from services import cli

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(
            ["--node", "gpu-a1", "--gpus", "8xH100-80GB"],
            "the real-GPU runtime is not built yet: run `llmgw agent --simulate ...` instead",
            id="no --simulate",
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
