"""Our groups as verl's padding-free TensorDict and back, checked against verl's own converters."""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from rllm_async.backends.verl import batch
from rllm_async.types import Step, Trajectory, TrajectoryGroup


def groups() -> list[TrajectoryGroup]:
    """Two groups: single-turn trajectories, and a two-turn one whose tool tokens are masked.

    Logprobs are exact in float32, so a round trip through tensors compares equal.
    """
    single = [
        Trajectory([Step([5, 6, 7], [10, 11], [-1.0, -2.0], [0, 0])], reward=1.0),
        Trajectory([Step([5, 6], [12, 13, 14], [-0.5, -0.625, -0.75], [0, 0, 0])], reward=0.0),
    ]
    turn1 = Step([8, 9], [20, 21], [-0.125, -0.25], [1, 1])
    turn2 = Step([8, 9, 20, 21, 30, 31], [22], [-0.375], [1])  # 30, 31: a tool's reply
    multi = [Trajectory([turn1, turn2], reward=2.0), Trajectory([], reward=0.0)]
    return [
        TrajectoryGroup("a", "default", single, [0.5, -0.5]),
        TrajectoryGroup("b", "default", multi, [1.0, -1.0]),
    ]


def test_rows_split_each_sequence_where_sampling_starts() -> None:
    rows = batch.rows(groups())
    assert [(r.prompt, r.response, r.mask) for r in rows] == [
        ([5, 6, 7], [10, 11], [1, 1]),
        ([5, 6], [12, 13, 14], [1, 1, 1]),
        ([8, 9], [20, 21, 30, 31, 22], [1, 1, 0, 0, 1]),
    ]
    assert rows[2].logprobs == [-0.125, -0.25, 0.0, 0.0, -0.375]
    assert [r.advantage for r in rows] == [0.5, -0.5, 1.0]


def test_round_trip() -> None:
    rows = batch.rows(groups())
    td = batch.to_tensordict(rows, temperature=0.7, extra={"k": 3})
    assert batch.from_tensordict(td) == rows
    assert tu.get_non_tensor_data(td, "temperature", None) == 0.7
    assert tu.get_non_tensor_data(td, "k", None) == 3
    assert td["loss_mask"].sum() == sum(r.num_loss_tokens for r in rows)


def test_matches_verls_conversion_of_left_right_padding() -> None:
    """verl's trainer pads prompts left and responses right, then strips the padding; we build the
    padding-free form directly. The two must agree on every field the engine and losses read."""
    rows = batch.rows(groups())
    ours = batch.to_tensordict(rows, temperature=1.0, extra={})
    p_len = max(len(r.prompt) for r in rows)
    r_len = max(len(r.response) for r in rows)
    n = len(rows)
    prompts, responses = (
        torch.zeros(n, p_len, dtype=torch.long),
        torch.zeros(n, r_len, dtype=torch.long),
    )
    attention = torch.zeros(n, p_len + r_len, dtype=torch.long)
    for i, r in enumerate(rows):
        prompts[i, p_len - len(r.prompt) :] = torch.tensor(r.prompt)
        responses[i, : len(r.response)] = torch.tensor(r.response)
        attention[i, p_len - len(r.prompt) : p_len + len(r.response)] = 1
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    padded = tu.get_tensordict(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": position,
            "response_mask": ours["response_mask"],
        }
    )
    theirs = left_right_2_no_padding(padded)
    for key in ("input_ids", "position_ids"):
        for a, b in zip(ours[key].unbind(), theirs[key].unbind(), strict=True):
            assert torch.equal(a, b), key
    assert torch.equal(ours["loss_mask"], theirs["loss_mask"])


def test_response_logprobs_are_verls_response_slice() -> None:
    rows = batch.rows(groups())
    td = batch.to_tensordict(rows, temperature=1.0, extra={})
    lengths = [len(r.prompt) + len(r.response) for r in rows]
    flat = torch.randn(sum(lengths))
    log_probs = torch.nested.nested_tensor_from_jagged(flat, torch.tensor([0, *lengths]).cumsum(0))
    ours = batch.response_logprobs(log_probs, rows)
    theirs = no_padding_2_padding(log_probs, td)
    for i, lp in enumerate(ours):
        assert torch.equal(lp, theirs[i, : len(lp)])


def test_filler_rows_carry_no_loss() -> None:
    row = batch.filler_row(2)
    assert row.num_loss_tokens == 0 and len(row.prompt) == len(row.response) == 1
