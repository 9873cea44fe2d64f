"""Our trajectory groups as verl's padding-free TensorDict, and verl's outputs back as our rows.

One row per training sequence (`Trajectory.sequences()`): `prompts` are its tokens before the first
sampled token, `responses` the rest (sampled, tool and environment tokens, told apart by the mask).
Token-level tensors are jagged (`input_ids`, `position_ids`, `prompts`, `responses`); the
response-level ones (`response_mask`, `old_log_probs`, `advantages`) are right-padded to the
longest response, as verl's own `left_right_2_no_padding` leaves them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from rllm_async.algorithms.losses import LossStats, policy_loss
from rllm_async.config import LossConfig
from rllm_async.types import TokenSequence, TrajectoryGroup


@dataclass
class Row:
    """One training sequence split where sampling starts, with its trajectory's advantage."""

    prompt: list[int]
    response: list[int]
    mask: list[int]  # 1 where the response token was sampled
    logprobs: list[float]  # the sampler's, one per response token (0.0 where the mask is 0)
    advantage: float

    @classmethod
    def from_sequence(cls, seq: TokenSequence, advantage: float) -> Row:
        start = seq.loss_mask.index(1)
        if start == 0:
            raise ValueError("a training sequence cannot start with a sampled token")
        return cls(
            seq.tokens[:start],
            seq.tokens[start:],
            seq.loss_mask[start:],
            seq.logprobs[start:],
            advantage,
        )

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)


def rows(groups: Sequence[TrajectoryGroup]) -> list[Row]:
    """Every sequence with a sampled token in `groups`, in order."""
    return [Row.from_sequence(seq, adv) for g in groups for seq, adv in g.training_sequences()]


def filler_row(token: int) -> Row:
    """A two-token row with nothing to learn: pads a batch to a multiple of the data-parallel size."""
    return Row([token], [token], [0], [0.0], 0.0)


def to_tensordict(batch: Sequence[Row], *, temperature: float, extra: dict[str, Any]) -> TensorDict:
    """The padding-free TensorDict verl's engine trains on; `extra` goes in as non-tensor data."""
    if not batch:
        raise ValueError("an empty batch has nothing to train on")
    width = max(len(r.response) for r in batch)

    def padded(values: Iterator[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(len(batch), width, dtype=dtype)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.tensor(v, dtype=dtype)
        return out

    mask = padded((r.mask for r in batch), torch.int64)
    tensors = {
        "input_ids": _jagged([r.prompt + r.response for r in batch]),
        "position_ids": _jagged([list(range(len(r.prompt) + len(r.response))) for r in batch]),
        "prompts": _jagged([r.prompt for r in batch]),
        "responses": _jagged([r.response for r in batch]),
        "response_mask": mask,
        "loss_mask": mask,
        "old_log_probs": padded((r.logprobs for r in batch), torch.float32),
        "advantages": padded(([r.advantage] * len(r.response) for r in batch), torch.float32)
        * mask,
    }
    lengths = [len(r.prompt) + len(r.response) for r in batch]
    info = {"temperature": temperature, "max_response_len": width, "global_token_num": lengths}
    return tu.get_tensordict(tensors, {**info, **extra})


def from_tensordict(td: TensorDict) -> list[Row]:
    """The rows a TensorDict of `to_tensordict` holds (the inverse, for checks and metrics)."""
    out = []
    for i, (prompt, response) in enumerate(
        zip(td["prompts"].unbind(), td["responses"].unbind(), strict=True)
    ):
        n = len(response)
        mask = td["response_mask"][i, :n]
        advantage = float(td["advantages"][i, :n][mask > 0][0]) if bool(mask.any()) else 0.0
        out.append(
            Row(
                prompt.tolist(),
                response.tolist(),
                mask.tolist(),
                td["old_log_probs"][i, :n].tolist(),
                advantage,
            )
        )
    return out


def response_logprobs(log_probs: torch.Tensor, batch: Sequence[Row]) -> list[torch.Tensor]:
    """Per row, the trainer's logprobs of its response tokens, from verl's jagged `log_probs`.

    verl's `log_probs[t]` is the logprob of token t + 1 (next-token layout, one per input token).
    """
    out = []
    for values, row in zip(log_probs.unbind(), batch, strict=True):
        start = len(row.prompt) - 1
        out.append(values[start : start + len(row.response)].float())
    return out


def _jagged(seqs: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(
        [torch.tensor(s, dtype=torch.int64) for s in seqs], layout=torch.jagged
    )


def loss_stats(
    batch: Sequence[Row], logprobs: Sequence[torch.Tensor], cfg: LossConfig
) -> LossStats:
    """The shared loss code's statistics of `batch`, given the trainer's response logprobs."""
    width = max(len(r.response) for r in batch)
    shape = (len(batch), width)
    learner, sampler, adv, mask = (torch.zeros(shape) for _ in range(4))
    for i, (row, lp) in enumerate(zip(batch, logprobs, strict=True)):
        n = len(row.response)
        learner[i, :n] = lp
        sampler[i, :n] = torch.tensor(row.logprobs)
        mask[i, :n] = torch.tensor(row.mask, dtype=torch.float32)
        adv[i, :n] = row.advantage * mask[i, :n]
    with torch.no_grad():
        return policy_loss(learner, sampler, adv, mask, cfg).stats
