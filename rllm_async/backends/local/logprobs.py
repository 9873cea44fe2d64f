"""The learner's logprobs of the trained tokens, without a batch's [positions, vocab] logits.

Only loss-mask positions are scored, each (column, target) pair once, and their logits are made a
chunk of positions at a time and made again in backward (activation checkpointing), so the logits
held at once are one chunk's, `LOGIT_ELEMENTS` floats, not the batch's (49,152 per position on
SmolLM2). The price is a second pass of the output layer over the trained positions in backward.

Tokens sampled under a decoding constraint are scored under the grammar's mask at their position
(`Constraints`): the logprob of the masked, renormalized distribution the sampler drew them from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rllm_async.backends.local.packing import PackedBatch
from rllm_async.backends.local.transformers_model import Decoder
from rllm_async.grammar import apply_bitmask

# Logits per chunk: 64 MiB in float32, 341 positions of a 49,152 vocab. Above glibc's largest
# dynamic mmap threshold (32 MiB), so a chunk's buffers are unmapped when freed; smaller ones stay
# in the heap and raised the peak RSS by ~0.5 GB on SmolLM2 (benchmarks/learner_memory.py).
LOGIT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Constraints:
    """The grammar masks of a batch's constrained tokens: `bitmask[k]` ([words] int32) is the mask
    of the prediction at flat position `dest[k]` of the next-token layout [rows, width]."""

    dest: torch.Tensor  # [M]
    bitmask: torch.Tensor  # [M, words]


def chunk_positions(vocab_size: int, logit_elements: int = LOGIT_ELEMENTS) -> int:
    """Positions per chunk whose logits hold about `logit_elements` floats."""
    return max(1, logit_elements // vocab_size)


def chosen_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`log_softmax(head(hidden).float() / temperature)` at `targets`, float32 [N], from hidden
    states [N, dim], `chunk` positions at a time; with grad, each chunk's logits are recomputed
    in backward instead of kept. With `bitmask` ([N, words]), the softmax is over the tokens
    each row's mask allows."""
    recompute = torch.is_grad_enabled()
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        m = None if bitmask is None else bitmask[start : start + chunk]
        if recompute:
            part = checkpoint(_chunk_logprobs, head, h, t, temperature, m, use_reentrant=False)
        else:
            part = _chunk_logprobs(head, h, t, temperature, m)
        parts.append(part)
    if not parts:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def packed_logprobs(
    model: Decoder,
    packed: PackedBatch,
    mask: torch.Tensor,
    temperature: float,
    chunk: int,
    constraints: Constraints | None = None,
) -> torch.Tensor:
    """The logprobs of the tokens `mask` ([rows, width], next-token layout) trains, in that layout
    (zero where the mask is): what `policy_loss` reads."""
    keep = mask.flatten()[packed.dest] > 0
    index, targets, dest = packed.index[keep], packed.targets[keep], packed.dest[keep]
    # A row's prompt end predicts each member's first token, and repeated sequences share all
    # their columns: each (column, target) pair is scored once, and once per mask it is under.
    vocab = model.vocab_size
    pair = index * vocab + targets
    masks = 1 if constraints is None else len(constraints.dest) + 1
    if constraints is not None:
        mask_of = torch.zeros(mask.numel(), dtype=torch.long, device=dest.device)
        mask_of[constraints.dest] = torch.arange(1, masks, device=dest.device)
        pair = pair * masks + mask_of[dest]
    pairs, inverse = torch.unique(pair, return_inverse=True)
    columns, which = pairs // masks, pairs % masks  # which: 0 for none, else 1 + its mask's row
    bitmask = None
    if constraints is not None and bool((which > 0).any()):
        padded = torch.cat(
            [
                constraints.bitmask.new_full((1, constraints.bitmask.shape[1]), -1),
                constraints.bitmask,
            ]
        )
        bitmask = padded[which]
    hidden = model.hidden(packed.inputs, packed).flatten(0, 1)[columns // vocab]
    chosen = chosen_logprobs(model.lm_head, hidden, columns % vocab, temperature, chunk, bitmask)
    flat = chosen.new_zeros(mask.numel()).index_copy(0, dest, chosen[inverse])
    return flat.view(mask.shape)


def _chunk_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    bitmask: torch.Tensor | None,
) -> torch.Tensor:
    logits = head(hidden).float() / temperature
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask.to(logits.device))
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
