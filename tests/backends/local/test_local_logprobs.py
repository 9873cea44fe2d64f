"""The learner's chunked logprobs (`logprobs.py`) equal the full-logits form, values and gradients,
on packed batches with shared prompts, repeated sequences, masked environment tokens and grammar
masks on constrained tokens; their forward pass keeps no batch-wide logits for backward."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.logprobs import Constraints, chunk_positions, packed_logprobs
from rllm_async.backends.local.model import build_model, preset_config
from rllm_async.backends.local.packing import PackedBatch, pack
from rllm_async.backends.local.transformers_model import Decoder, TransformersModel
from rllm_async.config import LossConfig, OptimConfig
from rllm_async.grammar import apply_bitmask
from rllm_async.types import Step, TokenSequence, Trajectory, TrajectoryGroup

VOCAB = 40
MULTI = 3  # positions per chunk, far fewer than a batch's trained positions


def full_logits_logprobs(
    model: Decoder,
    packed: PackedBatch,
    mask: torch.Tensor,
    temperature: float,
    chunk: int = 0,
    constraints: Constraints | None = None,
) -> torch.Tensor:
    """The learner's former form: log_softmax over the [positions, vocab] logits of every packed
    position from each sequence's first trained token, masked afterwards."""
    hidden = model.hidden(packed.inputs, packed).flatten(0, 1)[packed.index]
    logits = model.lm_head(hidden).float() / temperature
    if constraints is not None:
        for dest, bitmask in zip(constraints.dest.tolist(), constraints.bitmask, strict=True):
            rows = (packed.dest == dest).nonzero()[:, 0]
            logits = logits.index_copy(
                0, rows, apply_bitmask(logits[rows], bitmask.expand(len(rows), -1))
            )
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, packed.targets.unsqueeze(-1))[:, 0]
    flat = chosen.new_zeros(mask.numel()).index_copy(0, packed.dest, chosen)
    return flat.view(mask.shape) * mask


def trajectories(seed: int) -> list[Trajectory]:
    """Three groups of four sharing a prompt, half of them two turns (the tool's tokens between
    them masked), then a repeat of one of them and a lone sequence."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    trajs = []
    for _ in range(3):
        prompt = tokens(rng.randint(3, 9))
        for k in range(4):
            first = tokens(rng.randint(1, 6))
            steps = [Step(prompt, first, [-1.0] * len(first), [0] * len(first))]
            if k % 2:  # a second turn after a tool's reply
                second = tokens(rng.randint(1, 5))
                tool = tokens(3)
                steps.append(Step(prompt + first + tool, second, [-1.0] * len(second), [0] * 5))
            trajs.append(Trajectory(steps=steps))
    trajs.append(copy.deepcopy(trajs[1]))  # a repeat: it shares its twin's columns
    trajs.append(Trajectory(steps=[Step(tokens(2), tokens(4), [-1.0] * 4, [0] * 4)]))
    return trajs


def sequences(seed: int) -> list[TokenSequence]:
    seqs = [seq for t in trajectories(seed) for seq in t.sequences()]
    masked = [m for s in seqs for m in s.loss_mask[s.loss_mask.index(1) :]]
    assert 0 in masked  # tokens inside a trained span that are not trained
    return seqs


def batch(seqs: list[TokenSequence], share_prompts: bool) -> tuple[PackedBatch, torch.Tensor]:
    packed = pack(
        [s.tokens for s in seqs], [s.loss_mask.index(1) for s in seqs], share_prompts=share_prompts
    )
    return packed, Learner._loss_mask(seqs, packed.width)


def tiny() -> Decoder:
    return build_model(preset_config("tiny", VOCAB), seed=0)


def gemma2() -> Decoder:
    """The transformers fallback on a tiny random Gemma 2 (soft-capped logits)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=8,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return TransformersModel(transformers.AutoModelForCausalLM.from_config(config).float())


def values_and_grads(
    fn: Any,
    model: Decoder,
    packed: PackedBatch,
    mask: torch.Tensor,
    temperature: float,
    chunk: int,
    constraints: Constraints | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logprobs and the gradient of a fixed weighted sum of them w.r.t. every parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    logprobs = fn(model, packed, mask, temperature, chunk, constraints)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((logprobs * weights).sum(), params, allow_unused=True)
    return logprobs.detach(), [
        torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
    ]


def assert_grads_close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Equal to 1e-5 of each parameter's largest gradient entry."""
    for a, b in zip(ours, theirs, strict=True):
        scale = max(float(b.abs().max()), 1e-12)
        assert float((a - b).abs().max()) / scale < 1e-5


@pytest.mark.parametrize("make_model", [tiny, gemma2], ids=["tiny", "transformers"])
@pytest.mark.parametrize("chunk", [chunk_positions(VOCAB), MULTI], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_full_logits_form(
    make_model: Any, chunk: int, temperature: float
) -> None:
    model = make_model()
    seqs = sequences(0)
    packed, mask = batch(seqs, share_prompts=model.shares_prompts)
    assert int(mask.sum()) > 10 * MULTI
    ours, our_grads = values_and_grads(packed_logprobs, model, packed, mask, temperature, chunk)
    theirs, their_grads = values_and_grads(
        full_logits_logprobs, model, packed, mask, temperature, chunk
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert not ours[mask == 0].any()
    assert_grads_close(our_grads, their_grads)
    with torch.no_grad():  # the ref model's and record_old_logprobs' way: no recomputation
        torch.testing.assert_close(
            packed_logprobs(model, packed, mask, temperature, chunk), theirs, atol=1e-5, rtol=0
        )


def random_constraints(
    packed: PackedBatch, mask: torch.Tensor, seqs: list[TokenSequence]
) -> Constraints:
    """Random masks (each allowing its position's target and about half the rest) on every other
    trained position of every other sequence, the repeated one's twin among them, so that twin
    columns are scored once under a mask and once without."""
    rng = torch.Generator().manual_seed(3)
    width = packed.width
    dest = [
        i * width + t
        for i in range(0, len(seqs), 2)
        for t in range(width)
        if mask[i, t] > 0 and t % 2 == 0
    ]
    targets = torch.zeros(mask.numel(), dtype=torch.long).index_copy(0, packed.dest, packed.targets)
    allowed = torch.rand(len(dest), VOCAB, generator=rng) < 0.5
    allowed[torch.arange(len(dest)), targets[dest]] = True
    padded = torch.zeros(len(dest), 64, dtype=torch.bool)
    padded[:, :VOCAB] = allowed
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (padded.view(len(dest), 2, 32).long() * weights).sum(-1)
    bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return Constraints(torch.tensor(dest), bitmask)


@pytest.mark.parametrize("chunk", [chunk_positions(VOCAB), MULTI], ids=["one_chunk", "chunks"])
def test_constrained_logprobs_renormalize_over_the_allowed_tokens(chunk: int) -> None:
    model = tiny()
    seqs = sequences(0)
    packed, mask = batch(seqs, share_prompts=True)
    constraints = random_constraints(packed, mask, seqs)
    ours, our_grads = values_and_grads(
        packed_logprobs, model, packed, mask, 0.7, chunk, constraints
    )
    theirs, their_grads = values_and_grads(
        full_logits_logprobs, model, packed, mask, 0.7, chunk, constraints
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert_grads_close(our_grads, their_grads)
    free = packed_logprobs(model, packed, mask, 0.7, chunk).detach()
    where = torch.zeros(mask.numel(), dtype=torch.bool)
    where[constraints.dest] = True
    where = where.view(mask.shape)
    # Masking removes mass: a constrained token's logprob rises; the others are untouched.
    assert bool((ours[where] > free[where]).all())
    torch.testing.assert_close(ours[~where], free[~where], atol=1e-6, rtol=0)


def test_a_chunks_logits_are_recomputed_in_backward_not_kept() -> None:
    """What the forward pass keeps for backward holds no [positions, vocab] logits beyond one
    chunk's (here none: a chunk's are made again in backward)."""
    model = tiny()
    packed, mask = batch(sequences(1), share_prompts=True)

    def kept_logits(fn: Any) -> int:
        kept = 0

        def pack_hook(t: torch.Tensor) -> torch.Tensor:
            nonlocal kept
            if t.dim() == 2 and t.shape[-1] == VOCAB:
                kept += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            fn(model, packed, mask, 1.0, MULTI).sum().backward()
        return kept

    assert kept_logits(full_logits_logprobs) >= int(mask.sum()) * VOCAB  # the probe sees them
    assert kept_logits(packed_logprobs) <= MULTI * VOCAB


def test_the_learners_steps_are_the_full_logits_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Learner passes with a KL to the reference model and recomputed old logprobs (the first
    half trained, the second recorded, then trained after the step) give the metrics, gradients
    and old logprobs they gave with the full logits, chunked or not."""
    rng = random.Random(2)
    trajs = trajectories(2)
    groups = [
        TrajectoryGroup("t", "default", part, [rng.uniform(-1, 1) for _ in part])
        for part in (trajs[:4], trajs[4:8], trajs[8:12], trajs[12:])
    ]
    loss = LossConfig(kl_coef=0.1, behaviour_logprobs="recomputed")

    def passes(chunk: int | None, full: bool) -> tuple[list[float], list[list[torch.Tensor]], Any]:
        model = tiny()
        learner = Learner(
            model,
            OptimConfig(lr=1e-5),  # AdamW's first update is lr x sign(grad), float error's too
            total_steps=4,
            temperature=0.7,
            train_batch=5,
            compute_dtype=torch.float32,
            ref_model=build_model(preset_config("tiny", VOCAB), seed=1),
            updates_per_batch=2,
        )
        if chunk is not None:
            learner._chunk = chunk
        with monkeypatch.context() as m:
            if full:
                m.setattr("rllm_async.backends.local.learner.packed_logprobs", full_logits_logprobs)
            first = learner.forward_backward(groups[:2], loss)
            grads = [[p.grad.clone() for p in model.parameters() if p.grad is not None]]
            learner.record_old_logprobs(groups[2:])
            learner.optim_step()
            second = learner.forward_backward(groups[2:], loss)
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert first.keys() == second.keys()
        return [*first.values(), *second.values()], grads, learner._old

    full_metrics, full_grads, full_old = passes(None, full=True)
    for chunk in (None, MULTI):
        metrics, grads, old = passes(chunk, full=False)
        assert metrics == pytest.approx(full_metrics, rel=1e-5, abs=1e-6)
        assert_grads_close(grads[0], full_grads[0])
        assert_grads_close(grads[1], full_grads[1])
        assert old.keys() == full_old.keys() and len(old) > 8
        for key, row in old.items():
            torch.testing.assert_close(row, full_old[key], atol=1e-5, rtol=0)
