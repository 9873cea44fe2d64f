"""The built-in character tokenizer and its chat format."""

from __future__ import annotations

import pytest

from rllm_async.backends.toy_tokenizers import CharTokenizer


def test_round_trip_and_unknown_characters() -> None:
    tok = CharTokenizer()
    assert tok.decode(tok.encode("3*(5+7) = 36\n")) == "3*(5+7) = 36\n"
    assert tok.encode("é") == [tok.unk_token_id]


def test_next_turn_extends_the_exact_tokens_of_the_previous_turn() -> None:
    tok = CharTokenizer()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    prompt = tok.apply_chat_template(chat)
    reply = [*tok.encode("4"), tok.eos_token_id]  # a completion ends with the EOS
    history = [*chat, {"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"}]
    nxt = tok.apply_chat_template(history)
    assert nxt[: len(prompt) + len(reply)] == prompt + reply
    assert tok.decode(nxt) == "be brief2+2?4ok"  # role markers and EOS are special ids


def test_tools_and_unknown_roles() -> None:
    tok = CharTokenizer()
    tools = [{"name": "calc"}]
    with_tools = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools)
    assert '"name": "calc"' in tok.decode(with_tools)
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
