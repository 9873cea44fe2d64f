"""Chat plumbing: tool-call parsing, token-in/token-out prompts, and per-step rewards."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.rollout.chat import ChatHistory, continuation_ids
from rllm_async.rollout.tool_parsers import HermesParser
from rllm_async.vclock import run
from tests.scripted import ScriptedPolicy, context

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def test_tool_calls_are_parsed_from_the_documented_syntax() -> None:
    text = 'Let me compute. <tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>'
    parsed = HermesParser().parse(text, {"calc": {}})
    assert parsed.content == "Let me compute."
    assert parsed.errors == []
    [call] = parsed.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "calc"
    assert json.loads(call["function"]["arguments"]) == {"expr": "3*4"}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "calc", "arguments": {"expr": "1"', "not valid JSON"),
        ('{"name": "rm", "arguments": {}}', "unknown tool 'rm'"),
        ('{"name": "calc", "arguments": [1, 2]}', "must be a JSON object"),
        ('["calc"]', "must be a JSON object"),
        ("__import__('os').system('true')", "not valid JSON"),  # parsed as JSON, never evaluated
    ],
)
def test_malformed_tool_calls_are_reported_not_raised(body: str, error: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    parsed = HermesParser().parse(text, {"calc": {}})
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.content == text  # the malformed block stays visible


def test_an_unterminated_tool_call_is_an_error() -> None:
    parsed = HermesParser().parse('ok <tool_call>{"name": "calc"', {"calc": {}})
    assert parsed.tool_calls == [] and "unterminated" in parsed.errors[0]


def test_char_template_renders_tool_calls_as_the_model_writes_them() -> None:
    tok = CharTokenizer()
    call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    ids = tok.apply_chat_template(
        [{"role": "assistant", "content": "hm", "tool_calls": [call]}], add_generation_prompt=False
    )
    assert tok.decode(ids) == 'hm<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'


class ChatMLTokenizer:
    """ChatML with a token after each turn's EOS (like the newline after `<|im_end|>`) and a default
    system turn: the shape of most HF chat templates, in words as tokens."""

    eos_token_id = 1

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<pad>": 0, "<eos>": 1, "<nl>": 2, "<start>": 3}

    def _id(self, word: str) -> int:
        return self.vocab.setdefault(word, len(self.vocab))

    def encode(self, text: str) -> list[int]:
        return [self._id(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        names = {i: w for w, i in self.vocab.items()}
        return " ".join(names[i] for i in ids if i > 3)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "default"}, *messages]
        ids: list[int] = []
        for m in messages:
            ids += [3, self._id(m["role"]), *self.encode(m["content"]), 1, 2]
        if add_generation_prompt:
            ids += [3, self._id("assistant")]
        return ids


def test_continuation_keeps_the_template_trailer_and_closes_truncated_turns() -> None:
    tok = ChatMLTokenizer()
    chat = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(chat)
    reply = [*tok.encode("hello there"), tok.eos_token_id]
    new = [{"role": "user", "content": "again"}]
    full = tok.apply_chat_template([*chat, {"role": "assistant", "content": "hello there"}, *new])
    # The exact tokens so far, then what the template puts after the EOS, then the new turn.
    assert prompt + reply + continuation_ids(tok, {}, reply, new, None) == full
    truncated = tok.encode("hello")  # stopped by length: no EOS was sampled
    tail = continuation_ids(tok, {}, truncated, new, None)
    assert tail[:2] == [tok.eos_token_id, 2]


def test_next_prompt_extends_the_previous_tokens_even_when_rendering_would_differ() -> None:
    tok = CharTokenizer()
    history = ChatHistory()
    chat = [{"role": "user", "content": "q"}]
    prompt, extended = history.prompt(tok, chat, None)
    assert not extended
    # The model wrote text that re-renders differently (a truncated reply has no EOS).
    completion = tok.encode("abc")
    reply = {"role": "assistant", "content": "abc"}
    history.add(chat, reply, None, prompt, completion)
    nxt = [*chat, reply, {"role": "tool", "content": "42"}]
    tokens, extended = history.prompt(tok, nxt, None)
    assert extended
    assert tokens[: len(prompt) + 3] == prompt + completion
    assert tok.decode(tokens[len(prompt) + 3 :]) == "42"
    # An edited history is rendered afresh.
    edited = [{"role": "user", "content": "other"}, reply, {"role": "tool", "content": "42"}]
    assert history.prompt(tok, edited, None)[1] is False


def test_chat_turn_parses_tool_calls_and_extends_prompts_turn_by_turn() -> None:
    replies = iter(['<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>', "4"])
    policy = ScriptedPolicy(lambda prompt: next(replies))
    ctx = context(policy)

    async def go() -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
        turn = await ctx.chat_turn(messages, tools=[CALC])
        assert turn.finish_reason == "tool_calls" and not turn.extended
        messages.append(turn.message)
        call = turn.message["tool_calls"][0]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "4"})
        second = await ctx.chat_turn(messages, tools=[CALC])
        assert second.extended and second.message == {"role": "assistant", "content": "4"}
        return messages

    run(go(), virtual=True)
    (p1, c1), (p2, c2) = policy.calls
    assert p2[: len(p1) + len(c1)] == p1 + c1
    [seq] = ctx.trajectory().sequences()
    assert seq.tokens == p2 + c2
    model_positions = set(range(len(p1), len(p1) + len(c1))) | set(range(len(p2), len(seq.tokens)))
    assert {i for i, m in enumerate(seq.loss_mask) if m} == model_positions


def test_stop_sequences_are_cut_from_the_reply_but_kept_in_the_tokens() -> None:
    policy = ScriptedPolicy(lambda prompt: "yes. STOP more")
    ctx = context(policy)
    reply = run(ctx.chat([{"role": "user", "content": "q"}], stop=["STOP"]), virtual=True)
    assert reply["content"] == "yes. "
    assert policy.tok.decode(ctx.trajectory().steps[0].completion_ids) == "yes. STOP more"


def test_step_rewards_add_to_the_outcome_reward() -> None:
    ctx = context(ScriptedPolicy(lambda prompt: "a"))

    async def go() -> None:
        for r in (0.5, -0.25):
            await ctx.chat([{"role": "user", "content": "q"}])
            ctx.set_step_reward(r)

    run(go(), virtual=True)
    episode = ctx.build_episode(1.0)
    assert episode.trajectories[0].reward == pytest.approx(1.25)
    assert episode.reward == pytest.approx(1.25)


def test_continuation_with_a_real_hugging_face_chat_template(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from rllm_async.backends.hf_tokenizer import load_tokenizer

    chars = ["<unk>", "<|im_start|>", "<|im_end|>", *[chr(c) for c in range(33, 127)]]
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    # ChatML with a trailer after each turn's end ('#' standing in for the newline) and a default
    # system turn, like Qwen's template.
    fast.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system:default<|im_end|>#{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>#{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
    )
    fast.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path, setting="backend.model_path", require_chat_template=True)
    history = ChatHistory()
    chat = [{"role": "user", "content": "hi"}]
    prompt, _ = history.prompt(tok, chat, None)
    completion = [*tok.encode("hello"), tok.eos_token_id]
    reply = {"role": "assistant", "content": "hello"}
    history.add(chat, reply, None, prompt, completion)
    nxt = [*chat, reply, {"role": "user", "content": "more"}]
    tokens, extended = history.prompt(tok, nxt, None)
    assert extended and tokens == tok.apply_chat_template(nxt)
