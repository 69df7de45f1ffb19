"""The simulated server's errors (`--sim-errors`): which requests fail is a hash of the
seed, the model and the request's number at its replica, so the same in every run; each
kind fails as it says, and the gateway in front answers each with its status: 503 tried
on another replica, 500 passed on, garbage a 502 or a stream broken off, a stall a 504
or a stream cut."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from services.agent.responder import ERRORS, Errors, Responder, Timing, fault, parse_errors
from tests.gateway.conftest import Plane
from tests.up_process import llmgw

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]


def _always(kind: str) -> Timing:
    return Timing(0.0, 0.0, errors={"": Errors(1.0, (kind,))})


@pytest.mark.parametrize(
    ("text", "want"),
    [
        pytest.param("0.05", ("", Errors(0.05, tuple(ERRORS))), id="every model, every kind"),
        pytest.param("chat=0.2:503,stall", ("chat", Errors(0.2, ("503", "stall"))), id="a model"),
        pytest.param("org/m-7b=1:garbage", ("org/m-7b", Errors(1.0, ("garbage",))), id="slash"),
        pytest.param("0", ("", Errors(0.0, tuple(ERRORS))), id="none"),
    ],
)
def test_the_flag_reads(text: str, want: tuple[str, Errors]) -> None:
    assert parse_errors(text) == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param("1.5", "a share of requests from 0 to 1", id="over 1"),
        pytest.param("lots", "a share of requests from 0 to 1", id="not a number"),
        pytest.param("=0.1", "no model before =", id="no model"),
        pytest.param("0.1:stal", "'stal' is not a kind of error: did you mean stall?", id="kind"),
    ],
)
def test_a_wrong_flag_is_one_line(text: str, why: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_errors(text)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_which_requests_fail_is_the_same_every_time_and_about_the_rate() -> None:
    e = Errors(0.1, tuple(ERRORS))
    runs = [[fault(7, "chat", n, e) for n in range(1, 5001)] for _ in range(2)]
    assert runs[0] == runs[1]
    failed = [k for k in runs[0] if k is not None]
    assert 400 < len(failed) < 600 and set(failed) == set(ERRORS)
    assert [fault(8, "chat", n, e) for n in range(1, 5001)] != runs[0]
    assert [fault(7, "other", n, e) for n in range(1, 5001)] != runs[0]
    assert all(fault(7, "chat", n, Errors(0.0)) is None for n in range(1, 1000))
    assert all(fault(7, "chat", n, Errors(1.0, ("503",))) == "503" for n in range(1, 1000))
    # A model named has its own; the others the one for every model.
    t = Timing(errors={"": Errors(0.5), "chat": Errors(1.0, ("500",))})
    assert t.errors_of("chat") == Errors(1.0, ("500",)) and t.errors_of("x") == Errors(0.5)
    assert Timing().errors_of("x") == Errors()


async def test_each_kind_gets_its_status_through_the_gateway(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    # 503: tried once on another replica, which answers.
    await plane.model("busy")
    s503 = await servers("busy-1", "busy", _always("503"))
    ok = await servers("busy-2", "busy")
    await plane.ready("busy-1", "busy", s503.endpoint)
    await plane.ready("busy-2", "busy", ok.endpoint)
    for _ in range(2):
        status, h, _ = await plane.chat("busy", max_tokens=1)
        assert status == 200 and h["x-llmgw-replica"] == "busy-2"
    # Least recently picked first: the busy one was asked at least once.
    assert s503.failed["503"] >= 1 and ok.served == 2
    # 500 passed on as it came; garbage is the gateway's 502; a stall its 504 (its
    # upstream timeout is 1 s in these tests).
    for kind, want in (("500", 500), ("garbage", 502), ("stall", 504)):
        model = f"fails-{kind}"
        await plane.model(model)
        s = await servers(f"{model}-1", model, _always(kind))
        await plane.ready(f"{model}-1", model, s.endpoint)
        status, h, body = await plane.chat(model, max_tokens=1)
        assert status == want, body
        assert "error" in json.loads(body)
        assert s.failed == {kind: 1}


@pytest.mark.parametrize("kind", ["garbage", "stall"])
async def test_a_stream_breaks_off_after_its_first_token(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], kind: str
) -> None:
    model = f"cut-{kind}"
    await plane.model(model)
    s = await servers(f"{model}-1", model, _always(kind))
    await plane.ready(f"{model}-1", model, s.endpoint)
    got = b""
    body = {"model": model, "prompt": "p", "stream": True, "max_tokens": 8}
    async with plane.http.post(f"{plane.url}/v1/completions", json=body) as r:
        assert r.status == 200
        with pytest.raises(Exception):  # noqa: B017  (aiohttp's payload error, whatever its class)
            async for chunk in r.content.iter_any():
                got += chunk
    assert got.startswith(b"data: {") and b"[DONE]" not in got
    assert (b"garbage" in got) == (kind == "garbage")
    assert plane.gateway.router.inflight == {}


def test_the_command_line_refuses_a_wrong_one_in_one_line(tmp_path: Path) -> None:
    env = {"LLMGW_DATA": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = llmgw("up", "--simulate", "1x1xH100-80GB", "--sim-errors", "0.1:stal", env=env)
    assert out.returncode == 2 and "did you mean stall?" in out.stderr
    assert out.stderr.strip().count("\n") == 0
