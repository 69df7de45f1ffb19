"""The policy's one seam for its speed-ups: an engine chosen once (`Config.engine`), the
speed-ups behind it in `services/core/policy/fast/`, and no file of the policy's folder
a reader has to page through (at most 600 lines). What the engines decide is held equal
elsewhere (tests/core/test_policy_index.py, tests/core/test_gang_levels.py,
tests/sim/test_sim.py); this holds the shape that keeps it one decision."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from services.core import policy, reaction
from services.core.policy import engine as engine_module

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "services" / "core" / "policy"
MOST_LINES = 600


def test_no_file_of_the_policy_is_over_600_lines() -> None:
    sizes = {
        str(p.relative_to(POLICY)): len(p.read_text().splitlines()) for p in POLICY.rglob("*.py")
    }
    assert "fast/index.py" in sizes and "fast/narrow.py" in sizes  # the walk sees the folder
    over = {name: n for name, n in sizes.items() if n > MOST_LINES}
    assert over == {}, f"over {MOST_LINES} lines: {over}"


def test_the_speed_ups_live_in_fast_and_the_spec_imports_none_of_them() -> None:
    """The index, the lazy walks and the narrowed trials are the fast engine's
    (`policy.fast`); the spec's modules (the rules, the searches, the trials, the plain
    engine, the checked one) name none of them. Only `choice`, which makes the engine a
    config names, and the package's re-exports do."""
    for name in ("index", "narrow", "node_levels", "gang_levels"):
        assert not (POLICY / f"{name}.py").exists(), name
        assert (POLICY / "fast" / f"{name}.py").exists(), name
    allowed = {"__init__.py", "choice.py"}
    for path in POLICY.glob("*.py"):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert "policy.fast" not in node.module, (path.name, node.module)


def test_plan_and_react_take_an_engine_and_no_switch() -> None:
    for fn in (policy.plan, reaction.react):
        params = inspect.signature(fn).parameters
        assert "engine" in params and "narrow" not in params, fn.__name__
    found = {n for n in dir(engine_module.Found) if not n.startswith("_")}
    assert found == {
        "by_tier",
        "considered",
        "every",
        "excluded_by",
        "excluded_count",
        "excluded_first",
        "first",
        "has_gangs",
    }


def test_no_search_asks_what_kind_of_trials_or_found_it_was_given() -> None:
    """Node-aware's choice (`aware.choose`) and `plan` ask the engine, not the type of
    what it gave them: no `isinstance` on trials or a `Found`, no engine named."""
    for name in ("__init__.py", "aware.py", "search.py", "node_aware.py", "gangs.py"):
        tree = ast.parse((POLICY / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                shown = ast.unparse(node)
                for word in ("Narrow", "Trials", "Found", "Listing", "Fast", "Index", "Checked"):
                    assert word not in shown, (name, shown)
            if isinstance(node, ast.Compare):
                shown = ast.unparse(node)
                assert ".name ==" not in shown and "engine ==" not in shown, (name, shown)


def test_the_policy_reads_no_environment() -> None:
    for path in (ROOT / "services" / "core").rglob("*.py"):
        text = path.read_text()
        assert "os.environ" not in text and "getenv" not in text, path
    for path in (ROOT / "services" / "sim").rglob("*.py"):
        assert "os.environ" not in path.read_text(), path


def test_the_engine_is_a_flag_of_the_services_and_of_the_readers() -> None:
    import argparse

    from services import flags
    from services.preemption.config import Config as PreemptionConfig

    p = argparse.ArgumentParser()
    flags.add(p, PreemptionConfig)
    assert p.parse_args([]).engine == "fast"
    assert p.parse_args(["--policy-engine", "checked"]).engine == "checked"
    with pytest.raises(SystemExit):
        p.parse_args(["--policy-engine", "index"])
    cfg = flags.build(PreemptionConfig, p.parse_args(["--policy-engine", "plain"]))
    assert cfg.policy.engine == "plain"


def test_the_engine_is_recorded_and_an_older_record_still_reads() -> None:
    from schemas import codec
    from schemas import events as ev
    from services.preemption import settings
    from services.preemption.config import Config as PreemptionConfig

    for name in policy.ENGINES:
        recorded = settings.settings_of(PreemptionConfig(policy=policy.Config(engine=name)))  # type: ignore[arg-type]
        assert recorded.engine == name
        assert settings.policy_of(recorded).engine == name
    older = b'{"hold_s":300,"eviction_grace_s":600,"min_lifetime_s":120,"max_victims":3,"drain_grace_s":30}'
    e = codec.decode(
        b'{"type":"policy.configured","id":"p1","time":"2026-01-01T00:00:00Z",'
        b'"source":"preemption","data":' + older + b"}"
    )
    assert isinstance(e, ev.PolicyConfiguredEvent) and e.data.engine == ""
    assert settings.policy_of(e.data).engine == "fast"
    decided = codec.decode(
        b'{"type":"preemption.decided","id":"d1","time":"2026-01-01T00:00:00Z",'
        b'"source":"preemption","data":{"for_model":"m","outcome":"no_fit"}}'
    )
    assert isinstance(decided, ev.PreemptionDecidedEvent) and decided.data.engine == ""
