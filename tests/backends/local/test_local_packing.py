"""Shared-prompt packing gives every trained token the logprob and gradient of its own sequence."""

from __future__ import annotations

import random

import pytest
import torch

from rllm_async.backends.local.model import build_model, preset_config
from rllm_async.backends.local.packing import pack

VOCAB = 40


def _groups(seed: int) -> tuple[list[list[int]], list[int]]:
    """Three prompts with four completions each (one of a single token), and a lone sequence."""
    rng = random.Random(seed)
    seqs, starts = [], []
    for _ in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        for length in (1, rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 6)):
            seqs.append(prompt + [rng.randrange(VOCAB) for _ in range(length)])
            starts.append(len(prompt))
    seqs.append([rng.randrange(VOCAB) for _ in range(7)])
    starts.append(2)
    return seqs, starts


def _packed_logprobs(
    model: torch.nn.Module, seqs: list[list[int]], starts: list[int], share_prompts: bool = True
):
    batch = pack(seqs, starts, share_prompts=share_prompts)
    hidden = model.hidden(batch.inputs, batch).flatten(0, 1)[batch.index]
    chosen = torch.log_softmax(model.lm_head(hidden), -1).gather(-1, batch.targets[:, None])[:, 0]
    flat = chosen.new_zeros(len(seqs) * batch.width).index_copy(0, batch.dest, chosen)
    return batch, flat.view(len(seqs), batch.width)


def _own_logprobs(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([seq[:-1]]))[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def test_packed_logprobs_equal_each_sequence_alone() -> None:
    model = build_model(preset_config("tiny", VOCAB), seed=0)
    seqs, starts = _groups(0)
    batch, packed = _packed_logprobs(model, seqs, starts)
    # The twelve grouped sequences fit three rows, the lone one a fourth.
    assert batch.inputs.shape[0] == 4
    for i, seq in enumerate(seqs):
        first, last = starts[i] - 1, len(seq) - 1
        torch.testing.assert_close(packed[i, first:last], _own_logprobs(model, seq)[first:])
        # Outside the trained span the layout holds zeros (masked out by the loss).
        assert not packed[i, :first].any() and not packed[i, last:].any()


def test_without_shared_prompts_each_sequence_has_a_row_from_position_zero() -> None:
    """The layout of the transformers fallback, which runs whole sequences (`rows`)."""
    model = build_model(preset_config("tiny", VOCAB), seed=0)
    seqs, starts = _groups(3)
    seqs, starts = [*seqs, seqs[5]], [*starts, starts[5]]  # a repeat reads the same row
    batch, packed = _packed_logprobs(model, seqs, starts, share_prompts=False)
    assert batch.inputs.shape[0] == len(seqs) - 1
    ids, columns = batch.rows(batch.inputs)
    assert ids is batch.inputs and columns is batch.positions
    for r, seq in enumerate(seqs[:-1]):  # row r holds the r-th distinct sequence, from column 0
        n = len(seq) - 1
        assert ids[r, :n].tolist() == seq[:-1] and columns[r, :n].tolist() == list(range(n))
    for i, seq in enumerate(seqs):
        first, last = starts[i] - 1, len(seq) - 1
        torch.testing.assert_close(packed[i, first:last], _own_logprobs(model, seq)[first:])
    shared = pack(seqs, starts)
    with pytest.raises(ValueError, match="share_prompts=False"):
        shared.rows(shared.inputs)


def test_packed_gradient_equals_unpacked_gradient() -> None:
    seqs, starts = _groups(1)
    weights = torch.randn(len(seqs), max(len(s) for s in seqs) - 1)

    def grads(packed: bool) -> list[torch.Tensor]:
        model = build_model(preset_config("tiny", VOCAB), seed=0)
        if packed:
            _, logprobs = _packed_logprobs(model, seqs, starts)
            total = (logprobs * weights).sum()
        else:
            total = sum(
                (
                    _own_logprobs(model, s)[starts[i] - 1 :]
                    * weights[i, starts[i] - 1 : len(s) - 1]
                ).sum()
                for i, s in enumerate(seqs)
            )
        total.backward()
        return [p.grad for p in model.parameters()]

    for a, b in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_rows_stay_within_twice_the_longest_sequence() -> None:
    prompt = list(range(4))
    seqs = [[*prompt, 10 + i, 6, 7, 8] for i in range(6)]  # 8 tokens: 7 inputs each
    batch = pack(seqs, [4] * 6)
    # A row holds the prompt and completions while it stays within 14 columns: 4 + 3 * 3 = 13.
    assert batch.inputs.shape == (2, 13)
    assert batch.targets.tolist() == [t for i in range(6) for t in (10 + i, 6, 7, 8)]


def test_repeated_sequences_share_columns_and_keep_their_own_logprobs_and_gradients() -> None:
    seqs, starts = _groups(2)
    # Repeat a grouped completion twice and the lone sequence once, interleaved with the rest.
    repeated = [*seqs[:2], seqs[1], *seqs[2:], seqs[1], seqs[-1]]
    repeated_starts = [*starts[:2], starts[1], *starts[2:], starts[1], starts[-1]]
    model = build_model(preset_config("tiny", VOCAB), seed=0)
    assert torch.equal(pack(repeated, repeated_starts).inputs, pack(seqs, starts).inputs)

    weights = torch.randn(len(repeated), max(len(s) for s in repeated) - 1)
    _, logprobs = _packed_logprobs(model, repeated, repeated_starts)
    (logprobs * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = 0.0
    for i, seq in enumerate(repeated):
        first, last = repeated_starts[i] - 1, len(seq) - 1
        own = _own_logprobs(model, seq)[first:]
        torch.testing.assert_close(logprobs[i, first:last], own.detach())
        total = total + (own * weights[i, first:last]).sum()
    total.backward()
    for a, b in zip(packed_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
