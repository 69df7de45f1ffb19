"""The Kubernetes manifests parse, and what one names another agrees: Secrets and their
keys, the NATS servers and port of the Helm values, the replica counts, the node name
from the downward API, the real agent runtime on the node's GPUs; and every user an agent
logs in as is declared to a real nats-server configured as the manifests and README say."""

from __future__ import annotations

import json
import socket
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.bus import broker
from services.bus.connection import servers_of
from services.bus.stream import CLUSTER_REPLICAS
from tests import documents

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


def _deployment(name: str) -> dict[str, Any]:
    (dep,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == name]
    return dep


def test_every_manifest_parses_and_lives_in_one_namespace() -> None:
    files = sorted(DIR.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "control-plane.yaml",
        "gateway.yaml",
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
    # The deployed servers' bound (single.conf, fleet.conf, cluster-N.conf), not the
    # embedded broker's: what one GPU host may send in one message.
    single = (DIR.parent / "nats" / "single.conf").read_text()
    assert f"max_payload: {v['config']['merge']['max_payload']}\n" in single


def test_the_control_plane_is_a_leader_and_a_standby_on_every_nats_server() -> None:
    dep = _deployment("llmgw-control")
    spec = dep["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (c,) = spec["template"]["spec"]["containers"]
    assert c["args"][0] == "up" and "--simulate" not in c["args"]
    # The gateway is a Deployment of its own, never in the plane's pods.
    assert "--no-gateway" in c["args"] and "--gateway-listen" not in c["args"]
    env = _env(c)
    ref = env["LLMGW_NATS"]["valueFrom"]["secretKeyRef"]
    url = _secrets()[ref["name"]][ref["key"]]
    servers = servers_of(url)
    where = {(urlsplit(u).hostname, urlsplit(u).port) for u in servers}
    assert where == _nats_hosts(_values())
    # That the servers know this user and password: the login test below.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["data"] == env["LLMGW_DATA"]["value"] == c["args"][c["args"].index("--data") + 1]
    assert "data" in {v["name"] for v in spec["template"]["spec"]["volumes"]}


def _agent_container() -> tuple[dict[str, Any], dict[str, Any]]:
    (ds,) = _kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


def _expand(text: str, values: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an arg or env value."""
    for k, v in values.items():
        text = text.replace(f"$({k})", v)
    assert "$(" not in text, text
    return text


def test_the_agent_runs_on_every_gpu_node_named_after_it() -> None:
    (ds,) = _kind("DaemonSet")
    pod, c = _agent_container()
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    env = _env(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    args = c["args"]
    assert args[0] == "agent" and args[args.index("--node") + 1] == "$(NODE_NAME)"
    ref = env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in _secrets()[ref["name"]]
    # Variables a value refers to must be defined before it (Kubernetes expands in order).
    names = list(env)
    url = env["LLMGW_NATS"]["value"]
    for var in ("NODE_NAME", "NATS_PASSWORD"):
        assert f"$({var})" in url and names.index(var) < names.index("LLMGW_NATS")
    servers = servers_of(url)
    assert {(urlsplit(u).hostname, urlsplit(u).port) for u in servers} == _nats_hosts(_values())


def test_the_agent_is_the_real_process_runtime_on_the_nodes_gpus() -> None:
    from services.cli.app import build_parser

    pod, c = _agent_container()
    env = _env(c)
    # The real runtime: no --simulate, no GPUs declared by hand (NVML finds them).
    assert "--simulate" not in c["args"] and "--gpus" not in c["args"]
    got = {"NODE_NAME": "gpu-a1", "POD_IP": "10.1.2.3"}
    argv = [_expand(a, got) for a in c["args"]]
    a = build_parser().parse_args(argv)
    assert a.simulate is False and a.node == "gpu-a1" and a.gpus is None
    # Servers on the pod's IP, on a port range of their own.
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert a.host == "10.1.2.3" and len(a.ports) >= 100
    # Every GPU of the node and NVML through the NVIDIA runtime; none taken from the
    # device plugin (the agent hands them out), so a toleration keeps others off.
    assert pod["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(",")
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(",")
    for kind in ("limits", "requests"):
        assert "nvidia.com/gpu" not in c.get("resources", {}).get(kind, {})
    # NVML names a GPU's processes by host pid: the agent sees the host's.
    assert pod["hostPID"] is True
    # Its state and the servers' logs outlive the pod: the data directory is the host's.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert str(a.data_dir) in mounts
    assert volumes[mounts[str(a.data_dir)]]["hostPath"]["path"] == str(a.data_dir)
    # Dedicated nodes: the taint the README puts on them is tolerated here.
    assert pod["nodeSelector"].get("llmgw.io/agent") == "true"
    assert {
        "key": "llmgw.io/gpu",
        "operator": "Equal",
        "value": "agent",
        "effect": "NoSchedule",
    } in pod["tolerations"]


# The nodes of the test's Kubernetes cluster, as `kubectl get nodes` would name them.
NODES = ["gpu-a1", "gpu-b7", "h100_rack2-n3"]


def _users_secret() -> tuple[str, str, str]:
    """The Secret nats-values.yaml mounts, where, and the file it includes from it."""
    v = _values()
    include = v["config"]["merge"]["$include"]
    (mount,) = [p["value"] for p in v["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    (volume,) = [p["value"] for p in v["podTemplate"]["patch"] if p["path"] == "/spec/volumes/-"]
    assert mount["name"] == volume["name"]
    # The chart's config is /etc/nats-config/nats.conf; an include is relative to it.
    path = PurePosixPath("/etc/nats-config") / include
    assert path.parent == PurePosixPath(mount["mountPath"]), (include, mount)
    return volume["secret"]["secretName"], mount["mountPath"], path.name


def test_the_readme_writes_the_users_secret_the_values_mount() -> None:
    name, _, included = _users_secret()
    assert included == "users.conf"
    readme = documents.text()
    assert f"create secret generic {name}" in readme
    assert "--from-file=users.conf --from-file=deploy/nats/permissions.conf" in readme
    assert "python deploy/nats/users.py" in readme
    # The agents' password the README reads is the Secret the DaemonSet uses.
    ref = _env(_agent_container()[1])["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert f"get secret {ref['name']} -o jsonpath='{{.data.{ref['key']}}}'" in readme
    # The servers declare no users of their own beside the included ones.
    assert "authorization" not in _values()["config"]["merge"]


def test_every_user_an_agent_logs_in_as_is_declared_to_the_servers(tmp_path: Path) -> None:
    """The README's steps on a real nats-server: users.conf from users.py for the nodes,
    with the Secrets' passwords, mounted where the values say and included as the chart's
    config does; then each agent logs in with the URL its pod builds, the control plane
    with its Secret's URL, and a node nobody declared is refused."""
    from tests.deploy import natsconf

    secret, mount, included = _users_secret()
    users = natsconf.users_module()
    # Step 2: the Secrets with passwords of one's own. The example's placeholders as they
    # are would be refused by users.py in step 3.
    example = _secrets()
    with pytest.raises(users.UsersError, match="placeholder"):
        users.render({}, urlsplit(example["llmgw-control-nats"]["url"]).password, "x")
    secrets = {
        name: {k: v.replace("change-me-", "test-k8s-") for k, v in data.items()}
        for name, data in example.items()
    }
    control = urlsplit(servers_of(secrets["llmgw-control-nats"]["url"])[0])
    _, c = _agent_container()
    env = _env(c)
    ref = env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    agent_pw = secrets[ref["name"]][ref["key"]]
    with pytest.raises(users.UsersError, match="placeholder"):
        users.render({NODES[0]: example[ref["name"]][ref["key"]]}, "x", "y")

    # Step 3: users.py for every node, the agents' password, the control password.
    etc = tmp_path / "etc" / "nats-config"
    files = etc / PurePosixPath(mount).relative_to("/etc/nats-config")
    files.mkdir(parents=True)
    (files / included).write_text(
        users.render(dict.fromkeys(NODES, agent_pw), str(control.password), "test-k8s-viewer")
    )
    (files / "permissions.conf").write_text((natsconf.DEPLOY / "permissions.conf").read_text())
    # Step 4: the chart's nats.conf, with the values' include.
    port, http = natsconf.free_port(), natsconf.free_port()
    conf = etc / "nats.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{http}\n"
        f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
        f"max_payload: {_values()['config']['merge']['max_payload']}\n"
        f"include {json.dumps(_values()['config']['merge']['$include'])}\n"
    )

    def login(url: str) -> str:
        """'' when `url`'s user logs in (CONNECT, then PONG to a PING), else the
        server's answer."""
        parts = urlsplit(url)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            f = sock.makefile("rb")
            assert f.readline().startswith(b"INFO ")
            hello = {"user": parts.username, "pass": parts.password, "verbose": False}
            sock.sendall(b"CONNECT " + json.dumps(hello).encode() + b"\r\nPING\r\n")
            answer = f.readline().decode().strip()
            f.close()
        return "" if answer == "PONG" else answer or "closed"

    rendered = natsconf.Rendered(conf, port, http)
    with natsconf.server(rendered, tmp_path / "nats.log"):
        for node in NODES:
            pod_env = {"NODE_NAME": node, "NATS_PASSWORD": agent_pw}
            for url in servers_of(_expand(env["LLMGW_NATS"]["value"], pod_env)):
                assert urlsplit(url).username == node
                assert login(url) == "", (node, url)
        assert login(secrets["llmgw-control-nats"]["url"].split(",")[0]) == ""
        # Authentication is real: a node no one declared, a wrong password.
        stranger = {"NODE_NAME": "gpu-z9", "NATS_PASSWORD": agent_pw}
        assert login(servers_of(_expand(env["LLMGW_NATS"]["value"], stranger))[0]) != ""
        wrong = {"NODE_NAME": NODES[0], "NATS_PASSWORD": "not-the-password"}
        assert login(servers_of(_expand(env["LLMGW_NATS"]["value"], wrong))[0]) != ""
    assert secret == "llmgw-nats-users"


# ---------------------------------------------------------------------- works as written


def test_every_manifest_is_valid_kubernetes() -> None:
    """Each object of every manifest against the Kubernetes API's own schemas (strict:
    a field the API does not have is an error, as `kubectl apply --validate=strict`)."""
    import kubernetes_validate

    checked = 0
    for f in sorted(DIR.glob("*.yaml")):
        if f.name == "nats-values.yaml":  # the Helm chart's values, not an object
            continue
        for d in _docs(f.name):
            kubernetes_validate.validate(d, "1.30.0", strict=True)
            checked += 1
    assert checked >= 7


def _control(name: str = "llmgw-control") -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _deployment(name)["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    return pod, c


def _gateway() -> tuple[dict[str, Any], dict[str, Any]]:
    return _control("llmgw-gateway")


def _arg(c: dict[str, Any], flag: str) -> str:
    args: list[str] = c["args"]
    assert flag in args, (flag, args)
    return args[args.index(flag) + 1]


def test_the_services_probes_and_scrape_reach_what_up_serves() -> None:
    """The Services and probes name ports the containers declare, and those ports are
    where `up` and `llmgw gateway` listen, on every interface (the default, loopback, no
    Service reaches); each Service selects its own Deployment's pods."""
    pod, c = _control()
    gpod, g = _gateway()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    gports = {p["name"]: p["containerPort"] for p in g["ports"]}
    assert _arg(c, "--ui-listen") == f"0.0.0.0:{ports['dashboard']}"
    assert _arg(g, "--listen") == f"0.0.0.0:{gports['gateway']}"
    services = {s["metadata"]["name"]: s for s in _kind("Service")}
    assert set(services) >= {"llmgw-gateway", "llmgw-dashboard"}
    for name, port, of, other in (
        ("llmgw-gateway", "gateway", gpod, pod),
        ("llmgw-dashboard", "dashboard", pod, gpod),
    ):
        spec = services[name]["spec"]
        assert spec["selector"].items() <= of["metadata"]["labels"].items(), name
        assert not spec["selector"].items() <= other["metadata"]["labels"].items(), name
        assert [p["targetPort"] for p in spec["ports"]] == [port], name
    for probe in ("readinessProbe", "livenessProbe"):
        get = g[probe]["httpGet"]
        assert (get["port"], get["path"]) == ("gateway", "/health"), probe
        assert c[probe]["tcpSocket"]["port"] == "dashboard", probe
    notes = gpod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == gports["gateway"]
    assert notes["prometheus.io/path"] == "/metrics"
    # The dashboard answers the names its Service is reached by.
    hosts = _arg(c, "--allow-host").split(",")
    assert "llmgw-dashboard.llmgw.svc" in hosts and "llmgw-dashboard" in hosts


def test_the_gateway_scales_apart_from_the_plane_on_the_control_users_broker() -> None:
    """Its own Deployment, several replicas, spread over nodes, ready before an old one
    goes, on the same broker URL as the plane (the control user's Secret)."""
    dep = _deployment("llmgw-gateway")
    spec = dep["spec"]
    assert spec["replicas"] >= 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod, g = _gateway()
    assert g["args"][0] == "gateway"
    ref = _env(g)["LLMGW_NATS"]["valueFrom"]["secretKeyRef"]
    _, c = _control()
    assert ref == _env(c)["LLMGW_NATS"]["valueFrom"]["secretKeyRef"]
    spread = pod["spec"]["affinity"]["podAntiAffinity"]
    (term,) = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    )


def test_the_keys_and_the_token_are_secrets_mounted_where_up_reads_them() -> None:
    from services.dashboard.server import TOKEN_FILE

    gpod, g = _gateway()
    volumes = {v["name"]: v for v in gpod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in g["volumeMounts"]}
    secrets = _secrets()
    keys = PurePosixPath(_arg(g, "--api-keys"))
    assert PurePosixPath(mounts["api-keys"]["mountPath"]) == keys.parent
    ref = volumes["api-keys"]["secret"]
    assert keys.name in secrets[ref["secretName"]] and ref["defaultMode"] == 0o400
    pod, c = _control()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert "api-keys" not in mounts
    token = mounts["dashboard-token"]
    assert PurePosixPath(token["mountPath"]) == PurePosixPath(_arg(c, "--data")) / TOKEN_FILE
    ref = volumes["dashboard-token"]["secret"]
    assert token["subPath"] in secrets[ref["secretName"]] and ref["defaultMode"] == 0o400


def test_the_control_plane_starts_as_the_manifest_runs_it(
    tmp_path: Path, nats_server: broker.EmbeddedBroker
) -> None:
    """`llmgw up` and `llmgw gateway` with their containers' own arguments (paths under a
    scratch root, ports free ones), the Secrets' files as the pods mount them
    (placeholders replaced: the example's as they are are refused, in one line), and
    LLMGW_NATS from the control Secret pointed at a real single server (so one copy of
    the log): the gateway answers /health and a key of the Secret, off loopback, and
    lists itself among the gateways; the dashboard answers its token."""
    import http.client
    import json
    import os
    import time

    from tests.deploy.natsconf import free_port
    from tests.up_process import UpProcess

    _, c = _control()
    _, g = _gateway()
    secrets = _secrets()
    root = tmp_path / "root"

    def at(path: str) -> str:
        return str(root / path.lstrip("/"))

    data, keys = at(_arg(c, "--data")), at(_arg(g, "--api-keys"))
    os.makedirs(os.path.dirname(keys))
    os.makedirs(data)
    gw, ui = free_port(), free_port()
    args = [a for a in c["args"][1:]]
    for flag, value in (
        ("--data", data),
        ("--ui-listen", f"0.0.0.0:{ui}"),
        ("--replicas", "1"),  # one server here, not the chart's three
    ):
        args[args.index(flag) + 1] = value
    gargs = [a for a in g["args"][1:]]
    for flag, value in (("--api-keys", keys), ("--listen", f"0.0.0.0:{gw}")):
        gargs[gargs.index(flag) + 1] = value

    def mount(path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    env = {"LLMGW_NATS": nats_server.url}

    def gateway(name: str) -> UpProcess:
        return UpProcess(
            Path(data), tmp_path / f"{name}.log", *gargs, command=("gateway",), env=env
        )

    # The example's Secrets as they are: each placeholder refused in one line.
    mount(keys, secrets["llmgw-api-keys"]["api-keys"])
    refused = gateway("placeholder")
    assert refused.proc.wait(60) != 0
    assert "placeholder" in refused.text() and "Traceback" not in refused.text(), refused.text()
    refused.stop()

    key = "test-k8s-" + "k" * 24
    mount_keys = secrets["llmgw-api-keys"]["api-keys"].replace("change-me-a-key-of-team-a", key)
    os.chmod(keys, 0o600)
    mount(keys, mount_keys)
    token = "test-k8s-dashboard-token"
    mount(os.path.join(data, "dashboard.token"), token)
    plane = UpProcess(Path(data), tmp_path / "up.log", *args, command=("up",), env=env)
    proc: UpProcess | None = None
    try:

        def get(port: int, path: str, headers: dict[str, str]) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", path, headers=headers)
                return conn.getresponse().status
            finally:
                conn.close()

        # The plane makes the log; a gateway pod started before it restarts until then.
        deadline = time.monotonic() + 60
        while not (Path(data) / "dashboard.url").exists():
            assert plane.alive(), plane.text()[-3000:]
            assert time.monotonic() < deadline, plane.text()[-3000:]
            time.sleep(0.2)
        proc = gateway("gateway")
        while True:
            assert proc.alive(), proc.text()[-3000:]
            assert plane.alive(), plane.text()[-3000:]
            try:
                if get(gw, "/health", {}) == 200 and get(ui, "/", {}) in (200, 401):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, proc.text()[-3000:] + plane.text()[-3000:]
            time.sleep(0.2)
        assert get(gw, "/v1/models", {}) == 401
        assert get(gw, "/v1/models", {"Authorization": f"Bearer {key}"}) == 200
        assert get(ui, "/api/health", {}) == 401
        assert get(ui, "/api/health", {"Authorization": f"Bearer {token}"}) == 200
        named = {"Authorization": f"Bearer {token}", "Host": f"llmgw-dashboard.llmgw.svc:{ui}"}
        assert get(ui, "/api/health", named) == 200
        # The plane runs no gateway of its own: the one listed is the gateway pod's.
        listed = plane.llmgw("get", "gateways", "-o", "json")
        assert listed.returncode == 0, listed.stderr
        (one,) = json.loads(listed.stdout)["items"]
        assert one["pid"] == proc.proc.pid and one["address"].endswith(f":{gw}")
    finally:
        if proc is not None:
            proc.stop()
        plane.stop()
