"""Each service's knobs are declared once, in its `Config`: the flags of
`python -m services.scheduler`, `python -m services.preemption` and `llmgw up` are made
from those fields, with their defaults."""

from __future__ import annotations

import pytest

from services import flags
from services.cli import app
from services.core import scheduling
from services.core.policy import Config as PolicyConfig
from services.preemption import Config as PreemptionConfig
from services.preemption.__main__ import parser as preemption_parser
from services.scheduler.__main__ import parser as scheduler_parser

pytestmark = pytest.mark.timeout(10)


def test_scheduler_flags_default_to_its_config() -> None:
    args = scheduler_parser().parse_args([])
    assert flags.build(scheduling.Config, args) == scheduling.Config()


def test_scheduler_flags_set_their_fields() -> None:
    args = scheduler_parser().parse_args(
        ["--node-timeout", "5", "--drain-grace", "2.5", "--avoid-for", "9", "--lease-ttl", "3"]
    )
    assert flags.build(scheduling.Config, args) == scheduling.Config(
        node_timeout_s=5.0, drain_grace_s=2.5, avoid_for_s=9.0, lease_ttl_s=3.0
    )


def test_preemption_flags_set_the_policy_and_the_service() -> None:
    assert flags.build(PreemptionConfig, preemption_parser().parse_args([])) == PreemptionConfig()
    args = preemption_parser().parse_args(
        [
            "--hold",
            "20",
            "--grace",
            "5",
            "--max-victims",
            "2",
            "--drain-grace",
            "3",
            "--tick",
            "0.5",
        ]
    )
    assert flags.build(PreemptionConfig, args) == PreemptionConfig(
        policy=PolicyConfig(hold_s=20.0, eviction_grace_s=5.0, max_victims=2),
        drain_grace_s=3.0,
        tick_s=0.5,
    )


@pytest.mark.parametrize(
    "argv",
    [["--max-victims", "0"], ["--hold", "-1"], ["--tick", "0"], ["--lease-ttl", "x"]],
    ids=["no victims", "negative", "zero tick", "not a number"],
)
def test_bad_values_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        preemption_parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_the_drain_grace_is_one_value() -> None:
    assert scheduling.Config().drain_grace_s == PreemptionConfig().drain_grace_s
    assert scheduling.DRAIN_GRACE_S == 30.0


def test_llmgw_up_flags_come_from_the_same_configs() -> None:
    args = app.build_parser().parse_args(
        ["up", "--hold", "20", "--tick", "0.5", "--drain-grace", "4"]
    )
    policy = flags.build(PolicyConfig, args)
    sched = flags.build(scheduling.Config, args)
    assert policy == PolicyConfig(hold_s=20.0)
    assert sched == scheduling.Config(tick_s=0.5, drain_grace_s=4.0)
    defaults = app.build_parser().parse_args(["up"])
    assert flags.build(PolicyConfig, defaults) == PolicyConfig()
    assert flags.build(scheduling.Config, defaults) == scheduling.Config()


def test_scheduler_backoff_flags_set_their_fields() -> None:
    args = scheduler_parser().parse_args(
        [
            "--start-backoff",
            "2",
            "--start-backoff-max",
            "30",
            "--failed-quiet",
            "1",
            "--failed-backoff-max",
            "600",
        ]
    )
    assert flags.build(scheduling.Config, args) == scheduling.Config(
        start_backoff_s=2.0,
        start_backoff_max_s=30.0,
        failed_quiet_s=1.0,
        failed_backoff_max_s=600.0,
    )


@pytest.mark.parametrize("flag", ["--avoid-for", "--start-backoff-max", "--node-timeout"])
def test_a_time_flag_refuses_inf(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        scheduler_parser().parse_args([flag, "inf"])
    assert "'inf' must be a finite number of seconds" in capsys.readouterr().err


def test_a_pass_takes_times_past_any_date() -> None:
    """A Config made in code may still say "for ever": the pass reads back to the
    earliest date there is instead of failing."""
    from datetime import UTC, datetime

    from services.core.view import View

    now = datetime(2026, 1, 5, tzinfo=UTC)
    huge = scheduling.Config(avoid_for_s=float("inf"), start_backoff_max_s=float("inf"))
    assert scheduling.plan(View(), now, huge).outputs == []
    assert scheduling.plan(View(), now, scheduling.Config(avoid_for_s=1e12)).outputs == []
