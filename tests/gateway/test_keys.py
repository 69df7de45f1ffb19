"""API keys: the key file is private, each mistake one line naming FILE:LINE and never
the key; with keys, a request without a valid one is 401 (the openai package raises its
AuthenticationError), with one it is served."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
import pytest

from services.agent.responder import Responder
from services.core import ratelimit
from services.gateway.errors import GatewayError
from services.gateway.keys import Keys
from tests.gateway.conftest import Plane
from tests.up_process import llmgw

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]

KEY = "sk-test-0123456789abcdef"


def _file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "keys"
    p.write_text(text)
    p.chmod(mode)
    return p


@pytest.mark.parametrize(
    ("text", "mode", "why"),
    [
        (f"{KEY} team-a\n", 0o644, "others may read it (mode 644); chmod 600"),
        ("short team-a\n", 0o600, ":1: the key is shorter than 16 characters"),
        (f"# keys\n{KEY} team-a\n{KEY} team-b\n", 0o600, ":3: the key is given twice"),
        (f"{KEY}\n", 0o600, ":1: expected KEY OWNER"),
        ("# nothing\n", 0o600, "no keys in it"),
        (f"{KEY} team-a rpn=5\n", 0o600, ":1: `rpn=5` is not a limit: did you mean rpm?"),
        (f"{KEY} team-a tpm=lots\n", 0o600, ":1: tpm=lots is not a whole number of tokens"),
        (f"{KEY} team-a rpm=-1\n", 0o600, ":1: rpm=-1 is not a whole number of requests"),
        (f"{KEY} team-a rpm=5 rpm=6\n", 0o600, ":1: rpm is given twice"),
        (f"{KEY} rpm=5\n", 0o600, ":1: expected KEY OWNER [rpm=N] [tpm=N]; the owner is"),
        ("change-me-a-key-of-team-a team-a\n", 0o600, ":1: the key is a placeholder"),
    ],
)
def test_a_bad_key_file_is_one_line_without_the_key(
    tmp_path: Path, text: str, mode: int, why: str
) -> None:
    with pytest.raises(GatewayError) as e:
        Keys.load(_file(tmp_path, text, mode))
    assert why in str(e.value) and KEY not in str(e.value) and "\n" not in str(e.value)


def test_the_command_refuses_it_in_one_line(tmp_path: Path) -> None:
    p = _file(tmp_path, f"{KEY} team-a\n", 0o640)
    env = {"LLMGW_DATA": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = llmgw("gateway", "--listen", "0.0.0.0:8322", "--api-keys", str(p), env=env)
    assert out.returncode == 2 and "chmod 600" in out.stderr
    assert out.stderr.count("\n") == 1 and KEY not in out.stderr + out.stdout


def test_a_key_line_may_give_limits_and_the_two_word_line_still_has_none(
    tmp_path: Path,
) -> None:
    keys = Keys.load(_file(tmp_path, f"{KEY} team-a rpm=600 tpm=100000\n{KEY}-2 team-b\n"))
    a, b = keys.find(f"Bearer {KEY}"), keys.find(f"Bearer {KEY}-2")
    assert a is not None and b is not None
    assert (a.owner, a.limits, a.line) == ("team-a", ratelimit.Limits(600, 100000), 1)
    assert (b.owner, b.limits, b.line) == ("team-b", ratelimit.Limits(), 2)
    assert keys.owners == {"team-a", "team-b"}
    # No tree to be outside of: no check.
    assert keys.outside(set()) is None and keys.outside({"team-a", "team-b"}) is None
    said = keys.outside({"team-a", "team-c"})
    assert said is not None and said.startswith(f"{keys.path}:2: `team-b` is not an owner")


def test_a_key_maps_to_its_owner(tmp_path: Path) -> None:
    keys = Keys.load(_file(tmp_path, f"{KEY} team-a\n{KEY}-2 team-b\n"))
    assert keys.owner(f"Bearer {KEY}") == "team-a" and keys.owner(f"bearer {KEY}-2") == "team-b"
    assert keys.owner(None) is None and keys.owner(KEY) is None and keys.owner("Bearer x") is None


async def test_with_keys_a_request_without_a_valid_one_is_401(
    plane: Plane,
    servers: Callable[..., Awaitable[Responder]],
    tmp_path: Path,
) -> None:
    await plane.model("keyed")
    s = await servers("ky-1", "keyed")
    await plane.ready("ky-1", "keyed", s.endpoint)
    plane.gateway.keys = Keys.load(_file(tmp_path, f"{KEY} team-a\n"))
    base = f"{plane.url}/v1"
    wrong = openai.AsyncOpenAI(base_url=base, api_key="sk-wrong-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await wrong.chat.completions.create(
            model="keyed", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.response.headers["x-llmgw-reason"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()
    status, h, _ = await plane.chat("keyed")  # no Authorization at all
    assert status == 401 and h["x-llmgw-reason"] == "invalid_api_key"
    good = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
    answer = await good.chat.completions.create(
        model="keyed", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert answer.choices[0].message.content
    assert [m.id async for m in good.models.list()] != []
    # Only the request with a key reached the replica.
    assert s.served == 1
    await wrong.close()
    await good.close()
