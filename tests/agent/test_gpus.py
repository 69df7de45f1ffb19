"""GPU discovery and health, without a GPU: `nvidia-smi` output recorded on real hosts,
the fake `pynvml` (tests/agent/fakenvml), and the pure parts of the process runtime
(metrics, counter resets, a model's runtime in a cluster file)."""

from __future__ import annotations

import importlib
import json
import sys
import threading
from pathlib import Path

import pytest

from schemas import events as ev
from services import clusterfile
from services.agent import gpus, process
from services.bus import EmbeddedBroker

pytestmark = pytest.mark.timeout(20)

FAKE_NVML_DIR = Path(__file__).parent / "fakenvml"

# Recorded: `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`
# on an 8-GPU H100 host (two rows kept) and, with a header, on an L4 host.
SMI_H100 = """\
0, GPU-5b1f3a2e-8c0e-2f8e-4b7d-0a6b0c1d2e3f, NVIDIA H100 80GB HBM3, 81559
1, GPU-9d2c4b1a-7e6f-5a4b-3c2d-1e0f9a8b7c6d, NVIDIA H100 80GB HBM3, 81559
"""
SMI_L4 = """\
index, uuid, name, memory.total [MiB]
0, GPU-0f1e2d3c-4b5a-6978-8695-a4b3c2d1e0f9, NVIDIA L4, 23034 MiB
"""


def test_nvidia_smi_output_parses() -> None:
    got = gpus.parse_smi(SMI_H100)
    assert [(g.index, g.uuid[:12], g.model, g.memory_gb) for g in got] == [
        (0, "GPU-5b1f3a2e", "H100", 79.6),
        (1, "GPU-9d2c4b1a", "H100", 79.6),
    ]
    (l4,) = gpus.parse_smi(SMI_L4)
    assert (l4.model, l4.memory_gb, l4.healthy) == ("L4", 22.5, True)
    assert gpus.parse_smi("") == ()


def test_discovery_falls_back_to_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI_H100}EOF\n")
    smi.chmod(0o755)
    found = gpus.discover(str(smi))
    assert found is not None and found.by == "nvidia-smi" and len(found.gpus) == 2
    assert gpus.discover(str(tmp_path / "absent")) is None


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    conf = tmp_path / "nvml.json"
    conf.write_text(
        json.dumps(
            {
                "gpus": [
                    {"uuid": "GPU-a", "name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920},
                    {
                        "uuid": "GPU-b",
                        "name": "NVIDIA A100-SXM4-80GB",
                        "memory_mb": 81920,
                        "ecc": 2,
                    },
                ],
                "pids": {"0": [4242]},
            }
        )
    )
    monkeypatch.setenv("FAKE_NVML", str(conf))
    monkeypatch.syspath_prepend(str(FAKE_NVML_DIR))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    importlib.invalidate_caches()
    return conf


def test_nvml_discovery_and_ecc(fake_nvml: Path) -> None:
    found = gpus.discover("/nonexistent/nvidia-smi")
    assert found is not None and found.by == "nvml" and found.nvml is not None
    assert [(g.uuid, g.model, g.memory_gb, g.healthy) for g in found.gpus] == [
        ("GPU-a", "A100", 80.0, True),
        ("GPU-b", "A100", 80.0, False),  # uncorrected ECC errors already counted
    ]
    assert found.nvml.pids(0) == {4242}


def test_nvml_events_application_xids_are_ignored(fake_nvml: Path) -> None:
    found = gpus.discover("/nonexistent/nvidia-smi")
    assert found is not None and found.nvml is not None
    got: list[tuple[int, str]] = []
    stop = threading.Event()
    t = threading.Thread(target=found.nvml.watch, args=(stop, lambda i, w: got.append((i, w))))
    t.start()
    try:
        with Path(str(fake_nvml) + ".events").open("a") as f:
            f.write("0 xid 13\n0 xid 43\n1 xid 79\n0 ecc\n")
        deadline = threading.Event()
        for _ in range(200):
            if len(got) >= 2:
                break
            deadline.wait(0.02)
    finally:
        stop.set()
        t.join(5)
    assert got == [(1, "XID 79"), (0, "uncorrected ECC error")]


@pytest.mark.parametrize(
    ("last", "served", "running", "fresh"),
    [
        pytest.param(None, 5.0, 0.0, False, id="first scrape is the baseline"),
        pytest.param(5.0, 5.0, 0.0, False, id="idle"),
        pytest.param(5.0, 7.0, 0.0, True, id="served"),
        pytest.param(5.0, 5.0, 1.0, True, id="serving now"),
        pytest.param(9.0, 2.0, 0.0, True, id="counter reset, served since"),
        pytest.param(9.0, 0.0, 0.0, False, id="counter reset, idle"),
        pytest.param(5.0, None, None, False, id="no metrics"),
    ],
)
def test_use_from_counters(
    last: float | None, served: float | None, running: float | None, fresh: bool
) -> None:
    assert process.served_since(last, served, running) is fresh


def test_metrics_of_both_engines_parse() -> None:
    text = (
        "# HELP vllm:request_success_total x\n"
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
        'vllm:request_success_total{finished_reason="length",model_name="m"} 2.0\n'
        'vllm:num_requests_running{model_name="m"} 1.0\n'
        "sglang:num_requests_total 7\n"
        "sglang:num_running_reqs 0\n"
    )
    assert process.parse_metrics(text, process.METRICS["vllm"].all()) == {
        "vllm:request_success_total": 5.0,
        "vllm:num_requests_running": 1.0,
    }
    assert process.parse_metrics(text, process.METRICS["sglang"].all()) == {
        "sglang:num_requests_total": 7.0,
        "sglang:num_running_reqs": 0.0,
    }


def test_runtime_defaults_and_old_events() -> None:
    old = ev.ModelDeclared(name="m")
    assert old.runtime is None
    assert ev.ModelRuntime(engine="vllm").metrics_path == "/metrics"
    assert ev.ModelRuntime(engine="command", command=("x",)).metrics_path is None
    assert ev.ModelRuntime(engine="sglang", metrics="").metrics_path is None
    rt = ev.ModelRuntime(engine="vllm")
    assert (rt.health, rt.ready_timeout, rt.args, rt.env) == ("/health", 900.0, (), {})


@pytest.mark.parametrize(
    ("runtime", "says"),
    [
        pytest.param({"engine": "command"}, "runtime.command: engine `command` needs", id="no cmd"),
        pytest.param(
            {"engine": "vllm", "args": ["--max-model-len", "{ctx}"]},
            "runtime.args: {ctx} is not a placeholder",
            id="bad placeholder",
        ),
        pytest.param({"engine": "tgi"}, "runtime.engine", id="unknown engine"),
        pytest.param({"engine": "vllm", "helth": "/h"}, "did you mean `health`", id="typo"),
    ],
)
def test_cluster_file_runtime_mistakes(runtime: dict, says: str) -> None:
    doc = {"models": [{"name": "m", "profiles": [{"name": "p", "gpus": 1}], "runtime": runtime}]}
    with pytest.raises(clusterfile.ClusterFileError) as e:
        clusterfile.parse(doc, {}, "c.yaml")
    assert says in str(e.value)


def test_cluster_file_runtime() -> None:
    doc = {
        "models": [
            {
                "name": "llama-8b",
                "profiles": [{"name": "tp1", "gpus": 1}],
                "runtime": {
                    "engine": "vllm",
                    "args": ["--max-model-len", "8192"],
                    "env": {"HF_HOME": "/models"},
                    "ready_timeout": 1200,
                },
            }
        ]
    }
    (m,) = clusterfile.parse(doc, {}, "c.yaml").models
    assert m.runtime == ev.ModelRuntime(
        engine="vllm",
        args=("--max-model-len", "8192"),
        env={"HF_HOME": "/models"},
        ready_timeout=1200.0,
    )


def test_reset_health_with_no_agent_is_one_line(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    from services import cli

    assert cli.main(["gpu", "reset-health", "gpu-z9", "0", "--nats", nats_server.url]) == 1
    err = capsys.readouterr().err
    assert "the agent of node gpu-z9 did not answer: is `llmgw agent --node gpu-z9` running?" in err
    assert err.count("\n") == 1
