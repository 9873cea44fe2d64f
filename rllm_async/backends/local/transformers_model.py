"""The transformers fallback: a checkpoint whose architecture our decoder does not implement (Gemma,
Phi, mixtures of experts, ...) runs through `transformers.AutoModelForCausalLM` instead.

`TransformersModel` offers the sampler and the learner what they use of our `Transformer`:
`hidden` (final hidden states), `lm_head` (logits from them) and `forward`. It has no KV cache of
ours: the sampler keeps each slot's token ids (`TokenCache`) and every decode step reruns each
row's whole sequence, a plain causal forward pass that transformers computes as it always does
(sliding windows, soft-capping, expert routing), at the cost of re-reading the history each step.
The learner gives it one sequence per row (`shares_prompts` is false), right-padded: causal
attention never lets a real token see the padding after it, so no mask is needed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from rllm_async.backends.local.model import Transformer, frozen_copy

PROBE_TOKENS = 8  # tokens of the start-up check that our logits are transformers' own
PROBE_ATOL = 1e-4


class SequenceView(Protocol):
    """Where a `TransformersModel` forward pass's tokens sit: whole sequences, one per row."""

    def rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's sequence from position 0, right-padded, [B, L], and the column of each of
        `tokens` ([B, T]) in it, [B, T]."""
        ...


class TransformersModel(nn.Module):
    """A Hugging Face causal LM behind the interface our sampler and learner use.

    Its modules stay in eval mode (no dropout, no router jitter), so that the trainer's logprobs
    are the sampler's, as with our decoder."""

    shares_prompts: ClassVar[bool] = False  # the learner lays out one sequence per row

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.hf: Any = hf.eval()  # a transformers PreTrainedModel
        self.model_type = str(getattr(hf.config, "model_type", type(hf).__name__))
        self._softcap: float | None = getattr(hf.config, "final_logit_softcapping", None)
        self.vocab_size = int(hf.get_output_embeddings().weight.shape[0])  # the logits' width

    def train(self, mode: bool = True) -> TransformersModel:
        """Kept in eval mode: dropout or router noise would make the trainer's logprobs differ
        from the sampler's."""
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of right-padded sequences [B, T]."""
        return self.lm_head(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor, view: SequenceView | None = None) -> torch.Tensor:
        """Final hidden states [B, T, dim] of `tokens`: the sequences themselves, or with `view`,
        the new tokens of the sequences it holds."""
        if view is None:
            ids, columns = tokens, None
        else:
            ids, columns = view.rows(tokens)
        out: torch.Tensor = self.hf.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        if columns is None:
            return out
        return out.gather(1, columns.unsqueeze(-1).expand(-1, -1, out.shape[-1]))

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from final hidden states, soft-capped where the model does (Gemma 2 and 3)."""
        logits: torch.Tensor = self.hf.get_output_embeddings()(hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits


class TokenCache:
    """The sampler's slots for a `TransformersModel`: the token ids of each slot's sequence."""

    def __init__(self, max_batch: int, max_seq_len: int, device: torch.device) -> None:
        self.tokens = torch.zeros(max_batch, max_seq_len, dtype=torch.long, device=device)

    def copy(self, source: int, target: int, length: int) -> None:
        """Give slot `target` the first `length` tokens of slot `source` (a shared prompt)."""
        self.tokens[target, :length] = self.tokens[source, :length]

    def view(self, slots: torch.Tensor, positions: torch.Tensor) -> TokenView:
        """One forward pass: token j of row b goes to `positions[b, j]` of slot `slots[b]`."""
        return TokenView(self, slots, positions)


class TokenView:
    """A `SequenceView` over `TokenCache` slots."""

    def __init__(self, cache: TokenCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache, self.slots, self.positions = cache, slots, positions

    def rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `tokens` into their slots, then read each slot's sequence up to the furthest
        position of this pass (what lies past a row's own position is never attended to)."""
        self.cache.tokens[self.slots.unsqueeze(1), self.positions] = tokens
        width = int(self.positions.max()) + 1
        return self.cache.tokens[self.slots, :width], self.positions


Decoder = Transformer | TransformersModel  # what the sampler decodes with and the learner trains


def inference_copy(model: Decoder, device: torch.device, dtype: torch.dtype) -> Decoder:
    """An inference-only copy of `model`'s weights (a sampler snapshot, a reference model)."""
    if isinstance(model, Transformer):
        return frozen_copy(model, device, dtype)
    return copy.deepcopy(model).to(device=device, dtype=dtype).requires_grad_(False)


def max_positions(raw: dict[str, Any]) -> int:
    """The longest sequence the fallback runs as transformers runs it alone: transformers rotates
    length-dependent RoPE (`longrope`, `dynamic`) by a batch's longest row, so past the original
    context a short row batched with a long one would be rotated otherwise than alone."""
    limit = int(raw.get("max_position_embeddings") or 2048)
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "dynamic"):
        original = raw.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings"
        )
        limit = min(limit, int(original or limit))
    return limit


def load_transformers_model(path: Path, device: torch.device) -> TransformersModel:
    """A local checkpoint directory loaded with `AutoModelForCausalLM` (float32, no download).

    Refuses a model whose logits `TransformersModel` would not reproduce: a probe sequence's
    logits through `hidden` and `lm_head` must equal the model's own forward pass."""
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    model = TransformersModel(hf.to(device=device, dtype=torch.float32))
    probe = torch.arange(PROBE_TOKENS, device=device).remainder(model.vocab_size).unsqueeze(0)
    with torch.no_grad():
        ours = model(probe)
        theirs = hf(input_ids=probe, use_cache=False).logits
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=PROBE_ATOL):
        raise ValueError(
            f"{path}: the transformers fallback cannot reproduce the logits of model_type "
            f"'{model.model_type}' from its final hidden states (the model transforms them in a "
            "way the fallback does not know): use another backend (verl) for it"
        )
    return model
