"""GPU, cluster and label specs: what parses to what, and the one line a bad spec gets."""

from __future__ import annotations

import pytest

from services.agent import spec
from services.agent.errors import SpecError

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("text", "count", "model", "memory_gb"),
    [
        pytest.param("8xH100-80GB", 8, "H100", 80.0, id="8 H100 80GB"),
        pytest.param("8xA100-40GB", 8, "A100", 40.0, id="8 A100 40GB"),
        pytest.param("2xL4-24GB", 2, "L4", 24.0, id="2 L4 24GB"),
        pytest.param(" 1xH200-141GB ", 1, "H200", 141.0, id="spaces around"),
        pytest.param("4xRTX-6000-48GB", 4, "RTX-6000", 48.0, id="model with a dash"),
        pytest.param("2XMI300X-192G", 2, "MI300X", 192.0, id="upper X and bare G"),
        pytest.param("1xT4-15.5GB", 1, "T4", 15.5, id="fractional memory"),
    ],
)
def test_gpu_spec_parses(text: str, count: int, model: str, memory_gb: float) -> None:
    g = spec.parse_gpus(text)
    assert (g.count, g.model, g.memory_gb) == (count, model, memory_gb)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param("8xH100", "expected COUNTxMODEL-MEMORYGB", id="no memory"),
        pytest.param("H100-80GB", "expected COUNTxMODEL-MEMORYGB", id="no count"),
        pytest.param("8x-80GB", "expected COUNTxMODEL-MEMORYGB", id="no model"),
        pytest.param("", "expected COUNTxMODEL-MEMORYGB", id="empty"),
        pytest.param("0xH100-80GB", "a node has 1 to 64 GPUs, not 0", id="zero GPUs"),
        pytest.param("80xH100-8GB", "a node has 1 to 64 GPUs, not 80", id="too many GPUs"),
        pytest.param("8xH100-0GB", "GPU memory must be more than 0 GB", id="zero memory"),
    ],
)
def test_bad_gpu_spec_says_what_was_expected(text: str, why: str) -> None:
    with pytest.raises(SpecError) as info:
        spec.parse_gpus(text)
    msg = str(info.value)
    assert why in msg
    assert "for example 8xH100-80GB" in msg
    assert "\n" not in msg


def test_cluster_of_one_kind() -> None:
    nodes = spec.parse_cluster("4x8xH100-80GB")
    assert [n.name for n in nodes] == ["sim-0", "sim-1", "sim-2", "sim-3"]
    assert {n.gpus for n in nodes} == {spec.GpuSpec(8, "H100", 80.0)}
    # An 8-GPU host is sized like the usual box unless told otherwise.
    assert {(n.cpu_cores, n.memory_gb) for n in nodes} == {(96.0, 1024.0)}


def test_cluster_mix_is_named_in_spec_order() -> None:
    nodes = spec.parse_cluster("2x8xH100-80GB+3x2xL4-24GB", prefix="gpu", cpu_cores=32)
    assert [(n.name, str(n.gpus), n.cpu_cores) for n in nodes] == [
        ("gpu-0", "8xH100-80GB", 32),
        ("gpu-1", "8xH100-80GB", 32),
        ("gpu-2", "2xL4-24GB", 32),
        ("gpu-3", "2xL4-24GB", 32),
        ("gpu-4", "2xL4-24GB", 32),
    ]
    assert nodes[2].memory_gb == 256.0


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param(
            "8xH100-80GB", "'8xH100-80GB' is not NODESxCOUNTxMODEL-MEMORYGB", id="one node's spec"
        ),
        pytest.param("4x8xH100", "in '4x8xH100': expected COUNTxMODEL-MEMORYGB", id="bad GPU part"),
        pytest.param("0x8xH100-80GB", "asks for 0 nodes", id="zero nodes"),
        pytest.param("2x8xH100-80GB+", "expected NODESxCOUNTxMODEL-MEMORYGB", id="dangling plus"),
        pytest.param(
            "2x8xH100-80GB+1x0xL4-24GB", "a node has 1 to 64 GPUs, not 0", id="bad second part"
        ),
        pytest.param("1001x1xL4-24GB", "more than 1000 simulated nodes", id="too many nodes"),
    ],
)
def test_bad_cluster_spec_says_what_was_expected(text: str, why: str) -> None:
    with pytest.raises(SpecError) as info:
        spec.parse_cluster(text)
    msg = str(info.value)
    assert why in msg
    assert "for example 4x8xH100-80GB" in msg
    assert "\n" not in msg


def test_simulated_gpus_are_stable_per_node() -> None:
    g = spec.parse_gpus("2xL4-24GB")
    a, b = spec.gpu_inventory("sim-0", g), spec.gpu_inventory("sim-0", g)
    assert a == b
    assert [x.index for x in a] == [0, 1]
    assert a[0].uuid != spec.gpu_inventory("sim-1", g)[0].uuid
    assert a[0].uuid.startswith("GPU-")


@pytest.mark.parametrize(
    ("text", "labels"),
    [
        pytest.param("", {}, id="none"),
        pytest.param("zone=a", {"zone": "a"}, id="one"),
        pytest.param("zone=a, rack=r7,", {"zone": "a", "rack": "r7"}, id="several, loose commas"),
        pytest.param("pool=", {"pool": ""}, id="empty value"),
    ],
)
def test_labels(text: str, labels: dict[str, str]) -> None:
    assert spec.parse_labels(text) == labels


def test_bad_label_says_key_value() -> None:
    with pytest.raises(SpecError, match=r"'rack' is not KEY=VALUE \(for example zone=a,rack=r7\)"):
        spec.parse_labels("zone=a,rack")
