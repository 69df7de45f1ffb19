"""The Kubernetes manifests parse, and what one names another agrees: Secrets and their
keys, the NATS servers and port of the Helm values, the replica counts, the node name
from the downward API, the GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.bus import broker
from services.bus.connection import servers_of
from services.bus.stream import CLUSTER_REPLICAS

pytestmark = pytest.mark.timeout(30)

DIR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DIR / name).read_text()) if d]


def _kind(kind: str) -> list[dict[str, Any]]:
    return [
        d
        for f in sorted(DIR.glob("*.yaml"))
        if f.name != "nats-values.yaml"
        for d in _docs(f.name)
        if d["kind"] == kind
    ]


def _secrets() -> dict[str, dict[str, str]]:
    return {s["metadata"]["name"]: s["stringData"] for s in _kind("Secret")}


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def _values() -> dict[str, Any]:
    (v,) = _docs("nats-values.yaml")
    return v


def _nats_hosts(values: dict[str, Any]) -> set[tuple[str, int]]:
    """The servers the chart makes, released as `nats` in the llmgw namespace."""
    n = values["config"]["cluster"]["replicas"]
    port = values["config"]["nats"]["port"]
    return {(f"nats-{i}.nats-headless.llmgw.svc", port) for i in range(n)}


def test_every_manifest_parses_and_lives_in_one_namespace() -> None:
    files = sorted(DIR.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "control-plane.yaml",
        "agent-daemonset.yaml",
        "nats-values.yaml",
        "secrets.example.yaml",
    }
    namespaces = {d["metadata"]["name"] for d in _kind("Namespace")}
    for kind in ("Deployment", "DaemonSet", "Secret"):
        for d in _kind(kind):
            assert d["metadata"]["namespace"] in namespaces, d["metadata"]["name"]


def test_nats_is_a_three_server_jetstream_cluster_as_llmgw_expects() -> None:
    v = _values()
    assert v["config"]["cluster"]["enabled"] is True
    assert v["config"]["cluster"]["replicas"] == CLUSTER_REPLICAS
    assert v["config"]["jetstream"]["enabled"] is True
    assert v["config"]["jetstream"]["fileStore"]["enabled"] is True
    assert v["config"]["merge"]["max_payload"] == broker.MAX_PAYLOAD


def test_the_control_plane_is_a_leader_and_a_standby_on_every_nats_server() -> None:
    (dep,) = _kind("Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (c,) = spec["template"]["spec"]["containers"]
    assert c["args"][0] == "up" and "--simulate" not in c["args"]
    env = _env(c)
    ref = env["LLMGW_NATS"]["valueFrom"]["secretKeyRef"]
    url = _secrets()[ref["name"]][ref["key"]]
    servers = servers_of(url)
    where = {(urlsplit(u).hostname, urlsplit(u).port) for u in servers}
    assert where == _nats_hosts(_values())
    users = {
        u["user"]: u["password"] for u in _values()["config"]["merge"]["authorization"]["users"]
    }
    for u in servers:
        parts = urlsplit(u)
        assert users.get(parts.username) == parts.password, "the Secret's user is not the server's"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["data"] == env["LLMGW_DATA"]["value"] == c["args"][c["args"].index("--data") + 1]
    assert "data" in {v["name"] for v in spec["template"]["spec"]["volumes"]}


def test_the_agent_runs_on_every_gpu_node_named_after_it() -> None:
    (ds,) = _kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (c,) = pod["containers"]
    env = _env(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    args = c["args"]
    assert args[0] == "agent" and args[args.index("--node") + 1] == "$(NODE_NAME)"
    gpus = env[args[args.index("--gpus") + 1].strip("$()")]["value"]
    count = int(gpus.split("x", 1)[0])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == count
    ref = env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in _secrets()[ref["name"]]
    # Variables a value refers to must be defined before it (Kubernetes expands in order).
    names = list(env)
    url = env["LLMGW_NATS"]["value"]
    for var in ("NODE_NAME", "NATS_PASSWORD"):
        assert f"$({var})" in url and names.index(var) < names.index("LLMGW_NATS")
    servers = servers_of(url)
    assert {(urlsplit(u).hostname, urlsplit(u).port) for u in servers} == _nats_hosts(_values())
