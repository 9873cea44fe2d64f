"""Grammar-constrained decoding with llguidance: a request's constraint compiled once, one matcher
per sequence, and the token masks that the local sampler applies before each draw and the learner
applies again when it recomputes the logprobs of the same tokens.

A constraint is JSON text in vLLM's structured-outputs vocabulary (`SamplingParams.structured`):
`{"json": schema}`, `{"json_object": true}`, `{"regex": pattern}` or `{"grammar": lark}` (in
llguidance's Lark dialect, where `%json{...}` embeds a JSON schema; vLLM runs the same text with its
`guidance` backend). llguidance is MIT-licensed, has no Python dependencies, computes a mask in tens
of microseconds on a CPU and releases the GIL while it does (docs/constrained_decoding.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON as `json.dumps` writes it, one space after `:` and `,` and none elsewhere: a model new to a
# format does not wander into whitespace. Keywords the engine does not implement (`format`, say)
# are ignored rather than refused: the gateway still checks each reply against the whole schema.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


MAX_COMPILED = 256  # constraints kept compiled per tokenizer, the oldest dropped first


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: the message names what is wrong with it."""


def embedded_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` for a Lark grammar's `%json{...}`, compiled with the same `JSON_OPTIONS`."""
    return {**schema, "x-guidance": dict(JSON_OPTIONS)}


def grammar_text(structured: str) -> str:
    """llguidance's grammar for the constraint `structured` (not yet checked against a tokenizer)."""
    try:
        spec = json.loads(structured)
    except ValueError as e:
        raise ConstraintError(f"the constraint is not JSON text ({e}): {structured[:200]!r}") from e
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConstraintError(
            'a constraint is one of {"json": schema}, {"json_object": true}, {"regex": pattern} '
            f'or {{"grammar": lark}}, not {structured[:200]!r}'
        )
    [(kind, value)] = spec.items()
    if kind == "json":
        if not isinstance(value, dict):
            raise ConstraintError(f"a json constraint needs a JSON schema object, not {value!r}")
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object" and value is True:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind == "regex" and isinstance(value, str):
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "grammar" and isinstance(value, str):
        return llguidance.LLMatcher.grammar_from_lark(value)
    raise ConstraintError(f"unknown constraint {kind!r} (json, json_object, regex, grammar)")


class Grammars:
    """The grammar engine of one tokenizer: compiles constraints (each distinct one checked once)
    and makes matchers, masks and the masks of a sampled sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        # The tokens a complete grammar allows: the sampler's stop ids, else the tokenizer's eos.
        eos = list(stop_ids) or [tokenizer.eos_token_id]
        self._tokenizer = llguidance.LLTokenizer(
            _wrap(tokenizer), n_vocab=vocab_size, eos_token=eos
        )
        self._words = (vocab_size + 31) // 32
        # Each constraint's matcher at the start of a reply, by the constraint's text.
        self._starts: dict[str, llguidance.LLMatcher] = {}

    def matcher(self, structured: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of a reply under `structured`; raises `ConstraintError`.
        The first of a constraint compiles it (up to milliseconds; off the decode thread in the
        sampler), later ones copy that one's start (under a microsecond)."""
        return self._start(structured).deep_copy()

    def compiled(self, structured: str) -> bool:
        """Whether `matcher(structured)` is a copy already (no compilation)."""
        return structured in self._starts

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """An all-allowed int32 bitmask [rows, words] for `fill`."""
        return torch.full((rows, self._words), -1, dtype=torch.int32)

    @staticmethod
    def fill(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens `matcher` allows next into `bitmask[row]`."""
        target = bitmask[row]
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def sequence_masks(self, structured: str, ids: Sequence[int]) -> torch.Tensor:
        """The bitmask before each of `ids` under `structured` [len(ids), words]: what the sampler
        applied to draw them. Tokens past one the grammar refuses get no constraint (all allowed)."""
        matcher = self.matcher(structured)
        masks = self.new_bitmask(len(ids))
        for row, token in enumerate(ids):
            self.fill(matcher, masks, row)
            if not matcher.consume_token(token):
                break
        return masks

    def _start(self, structured: str) -> llguidance.LLMatcher:
        start = self._starts.get(structured)
        if start is None:
            grammar = grammar_text(structured)
            error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
            if error and not error.startswith("WARNING"):
                raise ConstraintError(f"the constraint does not compile: {error}")
            start = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if start.is_error():
                raise ConstraintError(f"the constraint does not compile: {start.get_error()}")
            if len(self._starts) >= MAX_COMPILED:
                self._starts.pop(next(iter(self._starts)))  # the oldest
            self._starts[structured] = start
        return start


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask [..., words] as booleans [..., vocab_size]."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with every token `bitmask` [rows, words] forbids at -inf."""
    return logits.masked_fill(~allowed(bitmask, logits.shape[-1]), float("-inf"))


def _wrap(tokenizer: Any) -> Any:
    """What `llguidance.LLTokenizer` reads: a Hugging Face tokenizer's JSON, else the byte strings
    of a tokenizer that lists them (`token_bytes()`, `special_ids`)."""
    hf_json = getattr(tokenizer, "tokenizer_json", None)
    if callable(hf_json):
        return hf_json()
    if not hasattr(tokenizer, "token_bytes"):
        raise ConstraintError(
            f"{type(tokenizer).__name__} exposes neither tokenizer_json() nor token_bytes(): "
            "constrained decoding needs one of them to know each token's bytes"
        )
    return llguidance.TokenizerWrapper(_ByteVocab(tokenizer))


class _ByteVocab:
    """A tokenizer's vocabulary as llguidance's `TokenizerWrapper` asks for it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self.tokens = tokenizer.token_bytes()
        self.special_token_ids = list(getattr(tokenizer, "special_ids", ()))

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text))
