"""Conformance of every model family's tool calls with token-in/token-out.

Each row is a chat template written for the test that behaves like its family's (a character-level
Hugging Face tokenizer with the family's special tokens): render -> a scripted completion in the
family's syntax -> parse -> tool message -> render the next turn. The parsed reply renders back
to the tokens the model sampled, the next prompt extends the exact tokens of the last one (also
when the template re-renders earlier turns differently), and the training sequence is what the
sampler saw, with the loss on exactly the sampled tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from rllm_async.backends.hf_tokenizer import HFTokenizer
from rllm_async.backends.toy_tokenizers import CHARS
from rllm_async.protocols import Completion, SamplingParams, Tokenizer
from rllm_async.rollout import RolloutContext
from rllm_async.rollout.chat import render, template_messages
from rllm_async.rollout.reply_parser import detect_family
from rllm_async.vclock import run

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
CALL = '{"name": "calc", "arguments": {"expr": "6*7"}}'

# Jinja pieces (no newlines in the source: transformers renders with trim_blocks/lstrip_blocks).
NL = "{{ '\\n' }}"
FN = "{%- set f = c.function or c %}"
LAST_QUERY = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
)


def chatml(calls: str, think: bool = False) -> str:
    """ChatML (Qwen): tools in a system turn, tool results as user turns; `calls` renders one call
    `c`; `think` renders reasoning like Qwen3: only after the last user turn, an empty block on
    the final reply, and none on earlier turns (so a new user turn re-renders history)."""
    reasoning = (
        "{%- if loop.index0 > ns.last and (loop.last or m.reasoning_content) %}"
        "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{%- endif %}"
        if think
        else ""
    )
    return (
        LAST_QUERY + "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
        "{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '</tools><|im_end|>\\n' }}"
        "{%- endif %}{%- for m in messages %}"
        "{%- if m.role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}" + reasoning + ""
        "{{- m.content or '' }}{%- for c in m.tool_calls or [] %}" + FN + ""
        "{%- if not loop.first or m.content %}" + NL + "{%- endif %}" + calls + "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        + ("{{- '</think>' if false }}" if think else "")  # names </think>, as Qwen3's does
    )


HERMES_CALL = (
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' + (f.arguments | tojson)'
    " + '}\\n</tool_call>' }}"
)
XML_CALL = (
    "{{- '<tool_call>\\n<function=' + f.name + '>\\n' }}{%- for k, v in f.arguments.items() %}"
    "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}"
)
LLAMA = (
    "{{- '<|begin_of_text|>' }}{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\nCall a function"
    ' as {"name": name, "parameters": arguments}; with <|python_tag|> for built-ins.\\n\' }}'
    "{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}" + FN + "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (f.arguments | tojson) + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role in ['tool', 'ipython'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content"
    " + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
MISTRAL = (
    "{{- '<s>' }}{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]{\"content\": ' + (m.content | tojson)"
    " + '}[/TOOL_RESULTS]' }}"
    "{%- elif m.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for c in m.tool_calls %}" + FN + ""
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{{- '{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}' }}"
    "{%- endfor %}{{- ']</s>' }}"
    "{%- else %}{{- m.content + '</s>' }}{%- endif %}{%- endfor %}"
)
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_TOKENS += ["<|python_tag|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]"]
MISTRAL_TOKENS += ["[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
DEEPSEEK = (
    "{{- '<｜begin▁of▁sentence｜>' }}{%- if tools %}{{- 'Tools: ' + (tools | tojson) }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'tool' %}{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + m.content"
    " + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{%- elif m.tool_calls %}{{- '<｜Assistant｜><｜tool▁calls▁begin｜>' }}"
    "{%- for c in m.tool_calls %}"
    + FN
    + "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + f.name"
    " + '\\n```json\\n' + (f.arguments | tojson) + '\\n```<｜tool▁call▁end｜>' }}{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- else %}{{- '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)
DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
]
DEEPSEEK_PLAIN = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>"]
DEEPSEEK_PLAIN += ["<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>"]
DEEPSEEK_PLAIN += ["<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
# gpt-oss (harmony): the model writes a call's recipient after its channel and ends it with
# <|call|>, ends a final answer with <|return|>; the template renders a call in history with the
# recipient first, a final answer ending with <|end|> unless it closes the chat, and names the
# function a tool turn answers (it refuses a tool turn that follows no call).
HARMONY = (
    "{%- set ns = namespace(call=none) %}"
    "{{- '<|start|>system<|message|># Valid channels: analysis, commentary, final.' }}"
    "{%- if tools %}{{- ' Calls to these tools must go to the commentary channel.' }}{%- endif %}"
    "{{- '<|end|>' }}{%- if tools %}{{- '<|start|>developer<|message|>namespace functions {' }}"
    "{%- for t in tools %}{{- 'type ' + t.function.name + ' = (_: '"
    " + (t.function.parameters | tojson) + ') => any;' }}{%- endfor %}"
    "{{- '} // namespace functions<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif %}"
    "{%- for c in m.tool_calls %}" + FN + ""
    "{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>'"
    " + (f.arguments | tojson) + '<|call|>' }}{%- set ns.call = f.name %}{%- endfor %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content }}"
    "{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
    "{%- elif m.role == 'tool' %}{%- if ns.call is none %}"
    "{{- raise_exception('Message has tool role, but there was no previous assistant message"
    " with a tool call!') }}{%- endif %}"
    "{{- '<|start|>functions.' + ns.call + ' to=assistant<|channel|>commentary<|message|>'"
    " + (m.content | tojson) + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
HARMONY_TOKENS = ["<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>"]
HARMONY_TOKENS += ["<|constrain|>", "<|call|>"]
CHATML_TOKENS = (
    ["<|im_start|>", "<|im_end|>"],
    ["<tool_call>", "</tool_call>", "<think>", "</think>"],
)


@dataclass(frozen=True)
class Family:
    """A family's template and tokens, and what its model writes: a call, then an answer."""

    name: str  # the tool parser `auto` must detect
    template: str
    eos: str
    special: list[str]  # skipped when decoding (the reply parser keeps the ones it reads)
    plain: list[str]  # single tokens, kept when decoding
    completions: tuple[str, ...]
    reasoning: str = "none"
    stops: tuple[str, ...] = ()  # what else than the EOS ends a reply (gpt-oss's <|call|>)
    as_sampled: bool = True  # the template renders a parsed reply as the model wrote it

    @property
    def reasons(self) -> bool:
        """Its replies carry reasoning: a `<think>` block, or harmony's `analysis` channel."""
        return self.reasoning == "think" or self.name == "harmony"


FAMILIES = [
    Family(
        "hermes",
        chatml(HERMES_CALL),
        "<|im_end|>",
        *CHATML_TOKENS,
        (f"<tool_call>\n{CALL}\n</tool_call>", "It is 42."),
    ),
    Family(
        "llama3_json",
        LLAMA,
        "<|eot_id|>",
        LLAMA_TOKENS,
        [],
        ('{"name": "calc", "parameters": {"expr": "6*7"}}', "It is 42."),
    ),
    Family(
        "mistral",
        MISTRAL,
        "</s>",
        MISTRAL_TOKENS,
        [],
        (f"[TOOL_CALLS][{CALL}]", "It is 42."),
    ),
    Family(
        "qwen3_coder",
        chatml(XML_CALL),
        "<|im_end|>",
        *CHATML_TOKENS,
        (
            "<tool_call>\n<function=calc>\n<parameter=expr>\n6*7\n</parameter>\n</function>\n"
            "</tool_call>",
            "It is 42.",
        ),
    ),
    Family(
        "deepseek_v3",
        DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        DEEPSEEK_TOKENS,
        DEEPSEEK_PLAIN,
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n"
            '{"expr": "6*7"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "It is 42.",
        ),
    ),
    Family(
        "hermes",  # a reasoning model (Qwen3): <think> in the reply, dropped from history
        chatml(HERMES_CALL, think=True),
        "<|im_end|>",
        *CHATML_TOKENS,
        (
            f"<think>\nI need the tool.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>",
            "<think>\nThe tool said 42.\n</think>\n\nIt is 42.",
            "<think>\nPolite.\n</think>\n\nYou are welcome.",
        ),
        reasoning="think",
    ),
    Family(
        "harmony",
        HARMONY,
        "<|return|>",
        HARMONY_TOKENS,
        [],
        (
            "<|channel|>analysis<|message|>I need the tool.<|end|><|start|>assistant<|channel|>"
            f"commentary to=functions.calc <|constrain|>json<|message|>{json.dumps({'expr': '6*7'})}"
            "<|call|>",
            "<|channel|>analysis<|message|>The tool said 42.<|end|><|start|>assistant<|channel|>"
            "final<|message|>It is 42.",
        ),
        stops=("<|call|>",),
        as_sampled=False,
    ),
]
IDS = ["hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "qwen3_think", "harmony"]


def family_tokenizer(family: Family) -> HFTokenizer:
    """A character-level Hugging Face tokenizer with the family's special tokens and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", *family.special, *family.plain, *CHARS]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token=family.eos, chat_template=family.template
    )
    return HFTokenizer(hf)


class FamilyPolicy:
    """Replies with the family's scripted completions in turn, each closed by its EOS unless it
    ends with one of `stops`."""

    def __init__(self, tok: HFTokenizer, completions: Sequence[str], stops: Sequence[str]) -> None:
        self.tok = tok
        self.completions = iter(completions)
        self.stops = tuple(stops)
        self.calls: list[tuple[list[int], list[int]]] = []

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tok

    def acquire(self) -> int:
        return 0

    def release(self, version: int) -> None:
        return None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        text = next(self.completions)
        closing = [] if text.endswith(self.stops) and self.stops else [self.tok.eos_token_id]
        ids = [*self.tok.encode(text), *closing]
        self.calls.append((list(prompt_ids), ids))
        return Completion(ids, [-0.5] * len(ids), [0] * len(ids))


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_a_tool_call_round_trips_token_in_token_out(family: Family) -> None:
    tok = family_tokenizer(family)
    assert detect_family(tok) == (family.name, family.reasoning)
    policy = FamilyPolicy(tok, family.completions, family.stops)
    ctx = RolloutContext(
        policy,
        sampling=SamplingParams(max_tokens=256),
        pin=True,
        deadline=1e9,
        task_id="t",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]

    async def go() -> None:
        turn = await ctx.chat_turn(messages, tools=[CALC])
        assert turn.tool_call_errors == [] and turn.finish_reason == "tool_calls"
        [call] = turn.message["tool_calls"]
        assert call["function"]["name"] == "calc"
        assert json.loads(call["function"]["arguments"]) == {"expr": "6*7"}
        assert not turn.message["content"]
        if family.reasons:
            assert turn.message["reasoning_content"] == "I need the tool."
        messages.extend(
            [turn.message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
        )
        # The parsed reply renders back to what the model sampled: the next prompt, extended from
        # the exact tokens, equals the template's rendering of the whole chat (gpt-oss's renders
        # a call in history otherwise than the model writes it: only the tool turn is the same).
        answer = await ctx.chat_turn(messages, tools=[CALC])
        assert answer.extended and answer.message["content"] == "It is 42."
        fresh = render(tok, template_messages(messages), [CALC])
        assert (answer.step.prompt_ids == fresh) is family.as_sampled
        (p1, c1), (p2, _) = policy.calls
        tail = p2[len(p1) + len(c1) :]
        assert fresh[len(fresh) - len(tail) :] == tail
        if family.reasons:
            assert answer.message["reasoning_content"] == "The tool said 42."
        if family.reasoning == "think":
            # A new user turn: the template drops earlier reasoning from a fresh rendering, and
            # the prompt still extends the tokens the model sampled.
            messages.extend([answer.message, {"role": "user", "content": "Thanks!"}])
            last = await ctx.chat_turn(messages, tools=[CALC])
            assert last.extended
            assert last.step.prompt_ids != render(tok, template_messages(messages), [CALC])

    run(go(), virtual=True)
    steps = ctx.trajectory().steps
    assert [(s.prompt_ids, s.completion_ids) for s in steps] == policy.calls
    for (p1, c1), (p2, _) in zip(policy.calls, policy.calls[1:], strict=False):
        assert p2[: len(p1) + len(c1)] == p1 + c1  # token-in/token-out
    [seq] = ctx.trajectory().sequences()
    p_last, c_last = policy.calls[-1]
    assert seq.tokens == p_last + c_last  # one training sequence: what the sampler saw
    sampled = [t for _, c in policy.calls for t in c]
    assert [t for t, m in zip(seq.tokens, seq.loss_mask, strict=True) if m] == sampled
    assert sum(seq.loss_mask) == len(sampled)
