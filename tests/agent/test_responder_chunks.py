"""The simulated server's stream chunks: the one-choice middle chunk made from its parts
(`_Answer.middle`, what a stream is made of but its first and last chunk) is byte for
byte the chunk encoded whole, for chats and completions, token ids asked or not, any
text; more choices than one are encoded whole."""

from __future__ import annotations

import pytest

from services.agent.responder import WORDS, _Answer

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
@pytest.mark.parametrize("asked", [[1016, 1017], None], ids=["ids", "no-ids"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_middle_chunk_is_the_chunk_encoded_whole(
    chat: bool, asked: list[int] | None, n: int
) -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    a = _Answer('cmpl-"m"-1', 1733400000, 'm"\u00e9', "r-\\1", chat, n, list(WORDS), usage, asked)
    for text in (" the", "", ' "quoted" \u00e9\n\t\\', " \x00llmgw-text\x00"):
        for ids in ([3], [0, 9]):
            assert a.middle(text, ids) == a.chunk(text, None, ids=ids)
