"""Constrained decoding in the sim: replies that satisfy their constraint, drawn byte by byte under
llguidance's masks (`rllm_async.grammar`, as the local sampler and vLLM draw tokens), from a fixed
model-free distribution that favours closing what is open, so that replies end soon.

The sim's "model" gives each byte a weight: printable ASCII 1, other bytes 1/20, the bytes that
close JSON and lists (`"`, `}`, `]`, `,`) 20 and the end of sequence 50. A token is drawn among
those the mask allows in proportion to its weight, and its logprob is that of the masked,
renormalized distribution, log(w / sum of the allowed weights): a forced token (one allowed) has
logprob 0, as on the real engines. Deterministic per seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from rllm_async import grammar
from rllm_async.backends.toy_tokenizers import ByteTokenizer

CLOSING = b'"}],'
CLOSING_WEIGHT = 20.0
EOS_WEIGHT = 50.0
OTHER_WEIGHT = 0.05


def byte_weights(tokenizer: ByteTokenizer) -> list[float]:
    """The sim's unnormalized distribution over `tokenizer`'s 256 bytes and its end of sequence."""
    weights = [1.0 if 32 <= b < 127 else OTHER_WEIGHT for b in range(256)]
    for b in CLOSING:
        weights[b] = CLOSING_WEIGHT
    return [*weights, EOS_WEIGHT] if tokenizer.eos_token_id == 256 else weights


def pick(rng: random.Random, allowed: Sequence[int], weights: Sequence[float]) -> tuple[int, float]:
    """A token of `allowed` drawn in proportion to `weights`, and its masked logprob."""
    if len(allowed) == 1:
        return allowed[0], 0.0
    w = [weights[t] for t in allowed]
    total = sum(w)
    token = rng.choices(allowed, weights=w)[0]
    return token, math.log(weights[token] / total)


class ConstrainedSampler:
    """Draws the sim's constrained replies on `ByteTokenizer`'s vocabulary."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.vocab = len(tokenizer.token_bytes())
        self.eos = tokenizer.eos_token_id
        self.grammars = grammar.Grammars(tokenizer, self.vocab, [self.eos])
        self.weights = byte_weights(tokenizer)

    def reply(
        self, structured: str, max_tokens: int, rng: random.Random
    ) -> tuple[list[int], list[float], str]:
        """Token ids (the end of sequence last, when drawn), their logprobs and the finish reason
        (`stop`, or `length` when `max_tokens` ran out first) of one reply under `structured`.
        Raises `grammar.ConstraintError` for a constraint that does not compile."""
        matcher = self.grammars.matcher(structured)
        bitmask = self.grammars.new_bitmask(1)
        ids: list[int] = []
        logprobs: list[float] = []
        while len(ids) < max_tokens:
            self.grammars.fill(matcher, bitmask, 0)
            allowed = grammar.allowed(bitmask[0], self.vocab).nonzero().flatten().tolist()
            token, logprob = pick(rng, allowed, self.weights)
            ids.append(token)
            logprobs.append(logprob)
            if token == self.eos:
                return ids, logprobs, "stop"
            matcher.consume_token(token)
        return ids, logprobs, "length"
