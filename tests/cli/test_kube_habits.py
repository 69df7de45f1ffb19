"""kubectl habits: `get`, `describe`, `wait`, `completion`, `kind/name` taken back by
every command that takes a name, and one exit-code table. In-process against a real
nats-server (and a bundle, which `get` reads as `view` does)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from schemas import codec
from services import cli
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from services.cli import app
from tests import documents
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(90)


def _cluster() -> Scenario:
    s = Scenario()
    s.node("n1", "8xH100-80GB", labels={"zone": "eu-1", "tier": "gold"})
    s.node("n2", "8xH100-80GB", labels={"zone": "us-2"})
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), created="-2h", ready="-1h")
    s.replica("b1", "batch", on=("n2", [0]), ready="-1h")
    s.replica("b2", "batch", on=("n2", [1]), ready="-30m")
    s.state("b2", "stopped")
    s.hold("batch", "chat", "+10m")
    s.at("+1m")
    return s


async def _publish(url: str, s: Scenario, start: int = 0) -> None:
    nc = await connect(url, "test-publisher")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        items = [(subj, codec.encode(e), e.id) for _, subj, e in s.events()[start:]]
        await Publisher(js).publish_many(items)
    finally:
        await nc.close()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def live(nats_server: EmbeddedBroker) -> str:
    asyncio.run(_publish(nats_server.url, _cluster()))
    return nats_server.url


# ---------------------------------------------------------------------- get


def test_get_gateways_is_the_live_fleet_and_says_what_does_not_go_with_it(
    live: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No gateway runs: an empty list (a line on stderr for a table, `items: []` as
    JSON); a name none announces exits 3; the log's options are one clear line each."""
    code, out, err = _run(capsys, "--nats", live, "get", "gateways")
    assert (code, out) == (0, "") and "no gateways announce themselves" in err
    code, out, _ = _run(capsys, "--nats", live, "get", "gateways", "-o", "json")
    assert code == 0 and json.loads(out)["items"] == []
    code, _, err = _run(capsys, "--nats", live, "get", "gateway/01ABC")
    assert code == 3 and "no gateway 01ABC" in err
    for extra in (("--log", "x.jsonl"), ("--at", "10m"), ("-l", "zone=a"), ("--all",)):
        code, _, err = _run(capsys, "--nats", live, "get", "gateways", *extra)
        assert code == 2 and "does not go with gateways" in err, (extra, err)
        assert len(err.strip().splitlines()) == 1


def test_get_each_kind_as_a_table(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--nats", live, "get", "nodes")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "GPUS", "REPLICAS", "UPDATED"]
    assert lines[1].split()[:4] == ["n1", "ready", "4/8", "1"]
    code, out, _ = _run(capsys, "--nats", live, "get", "models")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["chat"][1:6] == ["critical", "default", "1", "1", "1..1"]
    code, out, _ = _run(capsys, "--nats", live, "get", "replicas")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["b1", "c1"]
    code, out, _ = _run(capsys, "--nats", live, "get", "replicas", "--all")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["b1", "b2", "c1"]
    code, out, _ = _run(capsys, "--nats", live, "get", "holds")
    assert code == 0 and out.splitlines()[1].split()[:2] == ["batch", "chat"]


def test_no_headers_wide_and_singular(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, table, _ = _run(capsys, "--nats", live, "get", "node")
    _, bare, _ = _run(capsys, "--nats", live, "get", "nodes", "--no-headers")
    assert bare.splitlines() == table.splitlines()[1:]
    _, wide, _ = _run(capsys, "--nats", live, "get", "nodes", "-o", "wide")
    assert "LABELS" in wide.splitlines()[0] and "tier=gold,zone=eu-1" in wide


def test_json_and_yaml_are_one_object(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, j, _ = _run(capsys, "--nats", live, "get", "models", "-o", "json")
    _, y, _ = _run(capsys, "--nats", live, "get", "models", "-o", "yaml")
    assert json.loads(j) == yaml.safe_load(y)
    d = json.loads(j)
    assert d["kind"] == "models" and [m["model"] for m in d["items"]] == ["batch", "chat"]


def test_label_selector(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    def names(*argv: str) -> list[str]:
        code, out, err = _run(capsys, "--nats", live, "get", *argv, "-o", "name")
        assert code == 0, err
        return out.split()

    assert names("nodes", "-l", "zone=eu-1") == ["node/n1"]
    assert names("nodes", "-l", "zone!=eu-1") == ["node/n2"]
    assert names("nodes", "-l", "tier") == ["node/n1"]
    assert names("nodes", "-l", "zone=eu-1,tier=gold") == ["node/n1"]
    assert names("nodes", "-l", "zone=eu-1", "-l", "tier=silver") == []
    assert names("replicas", "-l", "zone=us-2") == ["replica/b1"]
    code, _, err = _run(capsys, "--nats", live, "get", "models", "-l", "zone=eu-1")
    assert code == app.EXIT_USAGE and "node labels" in err
    code, _, err = _run(capsys, "--nats", live, "get", "nodes", "-l", "=x")
    assert code == app.EXIT_USAGE and "KEY=VALUE" in err


def test_get_names_and_not_found(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--nats", live, "get", "node/n2", "-o", "name")
    assert (code, out.split()) == (0, ["node/n2"])
    code, out, _ = _run(capsys, "--nats", live, "get", "models", "model/chat", "-o", "name")
    assert (code, out.split()) == (0, ["model/chat"])
    code, _, err = _run(capsys, "--nats", live, "get", "nodes", "n3")
    assert code == app.EXIT_NOT_FOUND and "no node 'n3'" in err
    code, _, err = _run(capsys, "--nats", live, "get", "models", "chatt")
    assert code == app.EXIT_NOT_FOUND and "did you mean chat?" in err
    code, _, err = _run(capsys, "--nats", live, "get", "gpus")
    assert code == app.EXIT_USAGE and "not a kind" in err


def test_get_replicas_by_state(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--state` selects replicas by their state, stopped and failed ones too without
    `--all`; a state that is none is a usage error naming the closest."""
    code, out, _ = _run(
        capsys, "--nats", live, "get", "replicas", "--state", "stopped", "-o", "name"
    )
    assert (code, out.split()) == (0, ["replica/b2"])
    code, out, _ = _run(
        capsys, "--nats", live, "get", "replicas", "--state", "ready,stopped", "-o", "name"
    )
    assert (code, sorted(out.split())) == (0, ["replica/b1", "replica/b2", "replica/c1"])
    code, _, err = _run(capsys, "--nats", live, "get", "replicas", "--state", "stoped")
    assert code == app.EXIT_USAGE and "did you mean `stopped`?" in err, err
    code, _, err = _run(capsys, "--nats", live, "get", "nodes", "--state", "ready")
    assert code == app.EXIT_USAGE and "--state goes with replicas" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["get", "replicas", "-o", "name", "b2", "--all"], id="get"),
        pytest.param(["get", "replica", "--all", "b2", "-o", "name"], id="get, option first"),
        pytest.param(["describe", "replica", "--seq", "12", "b1"], id="describe"),
        pytest.param(["explain", "replica", "--seq", "12", "b1"], id="explain"),
    ],
)
def test_options_may_come_between_kind_and_name(
    live: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """kubectl takes options anywhere among a command's names; so does llmgw."""
    code, out, err = _run(capsys, "--nats", live, *argv)
    assert code == 0 and "unrecognized" not in err, err
    assert "b" in out


def test_get_reads_a_bundle_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_cluster().write(tmp_path / "log.jsonl"))
    code, out, _ = _run(capsys, "get", "replicas", "-o", "name", "--log", log)
    assert (code, out.split()) == (0, ["replica/b1", "replica/c1"])


# ---------------------------------------------------------------------- -o name round trips


def test_every_name_printed_is_taken_back(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    printed = []
    for kind in ("nodes", "models", "replicas"):
        code, out, _ = _run(capsys, "--nats", live, "get", kind, "-o", "name")
        assert code == 0
        printed += out.split()
    assert len(printed) == 6
    for ref in printed:
        for command in ("explain", "describe", "history"):
            code, out, err = _run(capsys, "--nats", live, command, ref)
            assert code == 0, (command, ref, err)
        code, out, _ = _run(capsys, "--nats", live, "explain", ref, "-o", "name")
        assert out.strip() == ref
        # A kind typed before what -o name printed: `explain replica replica/r-7`.
        kind = ref.partition("/")[0]
        code, out, err = _run(capsys, "--nats", live, "explain", kind, ref, "-o", "name")
        assert code == 0 and out.strip() == ref, (ref, err)
    # The same listing from `view` and `status`, whose -o name prints the same kinds.
    _, out, _ = _run(capsys, "--nats", live, "view", "-o", "name")
    assert set(printed) <= set(out.split())
    # And the commands that take a node or a model.
    code, out, err = _run(capsys, "--nats", live, "cordon", "node/n2")
    assert code == 0 and "node.cordoned n2" in out, err
    code, out, err = _run(capsys, "--nats", live, "uncordon", "node/n2")
    assert code == 0 and "node.uncordoned n2" in out, err
    code, out, err = _run(capsys, "--nats", live, "scale", "model/batch", "2")
    assert code == 0 and "scale.desired batch" in out, err
    code, out, err = _run(capsys, "--nats", live, "preemption", "plan", "--model", "model/chat")
    assert code == 0, err
    code, _, err = _run(capsys, "--nats", live, "cordon", "model/chat")
    assert code == app.EXIT_USAGE and "names a model, not a node" in err


def test_describe_is_explain(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, a, _ = _run(capsys, "--nats", live, "explain", "model", "chat", "-o", "json")
    _, b, _ = _run(capsys, "--nats", live, "describe", "model/chat", "-o", "json")
    assert json.loads(a)["timeline"] == json.loads(b)["timeline"]
    assert json.loads(b)["kind"] == "model" and json.loads(b)["name"] == "chat"


# ---------------------------------------------------------------------- exit codes


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["explain", "replica", "ghost"], id="explain"),
        pytest.param(["describe", "node/ghost"], id="describe"),
        pytest.param(["history", "model", "ghost"], id="history"),
        pytest.param(["get", "models", "ghost"], id="get"),
        pytest.param(["scale", "ghost", "2"], id="scale"),
        pytest.param(["cordon", "ghost"], id="cordon"),
        pytest.param(["drain", "node", "ghost", "--yes"], id="drain"),
        pytest.param(["delete", "model", "ghost", "--yes"], id="delete"),
        pytest.param(["preemption", "plan", "--model", "ghost"], id="plan"),
        pytest.param(["wait", "model", "ghost", "--timeout", "20"], id="wait"),
    ],
)
def test_an_unknown_name_exits_3_everywhere(
    live: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = _run(capsys, "--nats", live, *argv)
    assert code == app.EXIT_NOT_FOUND == 3, err
    assert len(err.strip().splitlines()) == 1 and "ghost" in err


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["explain", "replicas"], id="explain no name"),
        pytest.param(["explain", "gpu", "x"], id="explain bad kind"),
        pytest.param(["history", "replica/a", "b"], id="history two names"),
        pytest.param(["get", "nodes", "-o", "xml"], id="get bad output"),
        pytest.param(["wait", "node", "n1"], id="wait a node"),
        pytest.param(["scale", "chat", "many"], id="scale not a number"),
        pytest.param(["gpu", "reset-health", "model/chat", "1"], id="gpu of a model"),
    ],
)
def test_a_usage_mistake_exits_2_everywhere(
    live: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = _run(capsys, "--nats", live, *argv)
    assert code == app.EXIT_USAGE == 2, err
    assert len(err.strip().splitlines()) == 1


def test_the_table_is_in_help_and_the_readme(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    readme = documents.text()
    for n, what in app.EXIT_CODES:
        assert f"  {n:<4} {what}" in out
        assert f"| {n} | {what} |" in readme, f"README lacks exit code {n}"


def test_logs_does_not_suggest_compaction(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "logs")
    assert code == 2
    assert "events tail" in err and "did you mean `log`" not in err


# ---------------------------------------------------------------------- wait


def test_wait_follows_the_log_until_ready(
    nats_server: EmbeddedBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.model("chat", min=1, profiles=["one:1"])
    s.replica("c1", "chat", on=("n1", [0]), state="loading")
    asyncio.run(_publish(nats_server.url, s))
    url = nats_server.url
    # Not ready yet: it waits the whole timeout and says how far it got.
    code, _, err = _run(capsys, "--nats", url, "wait", "model", "chat", "--timeout", "0.5")
    assert code == app.EXIT_TIMED_OUT == 4
    assert "timed out after 0.5s" in err and "0 ready, desired 1" in err
    got: list[int] = []
    t = threading.Thread(
        target=lambda: got.append(
            cli.main(["--nats", url, "wait", "model/chat", "--for", "desired", "--timeout", "60"])
        )
    )
    t.start()
    n = len(s.events())
    s.state("c1", "ready")
    asyncio.run(_publish(url, s, start=n))
    t.join(60)
    assert got == [0]
    assert "model/chat: 1 ready, desired 1" in capsys.readouterr().out


# ---------------------------------------------------------------------- completion


def _complete(script: str, *words: str) -> list[str]:
    line = " ".join(f"'{w}'" for w in words)
    out = subprocess.run(
        [
            "bash",
            "-c",
            f"{script}\nCOMP_WORDS=({line}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); _llmgw; "
            'printf "%s\\n" "${COMPREPLY[@]}"',
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.split()


def test_bash_completion(capsys: pytest.CaptureFixture[str]) -> None:
    code, script, _ = _run(capsys, "completion", "bash")
    assert code == 0
    subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)
    assert _complete(script, "llmgw", "ge") == ["get"]
    assert _complete(script, "llmgw", "get", "") == [
        "nodes",
        "models",
        "replicas",
        "holds",
        "gateways",
    ]
    assert _complete(script, "llmgw", "get", "nodes", "-o", "") == [
        "table",
        "wide",
        "json",
        "yaml",
        "name",
    ]
    assert "--no-headers" in _complete(script, "llmgw", "get", "nodes", "--no")
    assert _complete(script, "llmgw", "events", "ta") == ["tail"]
    assert _complete(script, "llmgw", "explain", "") == ["replica", "model", "node"]
    assert _complete(script, "llmgw", "--nats", "x", "descr") == ["describe"]


def test_zsh_completion_wraps_the_bash_one(capsys: pytest.CaptureFixture[str]) -> None:
    _, bash, _ = _run(capsys, "completion", "bash")
    code, zsh, _ = _run(capsys, "completion", "zsh")
    assert code == 0 and "bashcompinit" in zsh and bash in zsh
