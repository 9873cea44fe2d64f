"""Shared-prompt packing: the sequences of a group start with the same prompt, so the trainer runs
that prompt once and lays the completions after it in one row.

A packed row is `prompt | completion 1 | completion 2 | ...`; each completion attends to the
prompt and to itself, and its rotary positions continue from the prompt's end, so every token
sees exactly the context (and positions) it has in its own unpacked sequence. On countdown (a
40-token prompt, 5-token answers, 8 per group) a group costs 80 tokens instead of 360.

Identical sequences (same tokens, same first trained token) are laid out once and read by each of
them: their logprobs are the same, and the gradient through the shared columns is the sum of
theirs, exactly as if each had its own. A group whose samples agree, common once a policy has
learned a task, costs little more than its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rllm_async.backends.local.model import attention

PAD = -1  # segment id of padding columns


@dataclass(frozen=True)
class PackedBatch:
    """Packed rows plus where each trained token's prediction is and where its logprob goes.

    `index[k]` is the flat position in `inputs` ([P, T] viewed as [P*T]) whose output predicts
    `targets[k]`; `dest[k]` is that logprob's flat position in the unpacked next-token layout
    ([R, width], row r = sequence r, column t = the prediction of token t + 1).
    """

    inputs: torch.Tensor  # [P, T] token ids
    positions: torch.Tensor  # [P, T] rotary positions
    mask: torch.Tensor  # [P, 1, T, T] True where a query column may attend to a key column
    index: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    dest: torch.Tensor  # [N]
    width: int
    one_per_row: bool = False  # each row one sequence from its position 0 (no shared prompts)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention view protocol (see model.py): each row's columns under `mask`."""
        return attention(q, k, v, self.mask)

    def rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence view protocol (see transformers_model.py): rows of one sequence each,
        right-padded, whose columns are their positions."""
        if not self.one_per_row:
            raise ValueError(
                "a row of shared prompts is no single sequence: pack(share_prompts=False)"
            )
        return tokens, self.positions

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(
            self.inputs.to(device),
            self.positions.to(device),
            self.mask.to(device),
            self.index.to(device),
            self.targets.to(device),
            self.dest.to(device),
            self.width,
            self.one_per_row,
        )


def pack(
    sequences: Sequence[Sequence[int]], starts: Sequence[int], *, share_prompts: bool = True
) -> PackedBatch:
    """Pack `sequences` whose first trained token is at `starts[i]` (so tokens before it are the
    prompt). Sequences with the same prompt share a row while it stays within twice the longest
    sequence, which bounds the cost of attending across a long row; repeats share columns.
    Without `share_prompts`, each distinct sequence has a row of its own."""
    width = max(len(s) for s in sequences) - 1
    cap = 2 * width
    rows: list[tuple[list[int], list[int]]] = []  # (prompt tokens, member sequence indices)
    by_prompt: dict[tuple[int, ...], int] = {}  # prompt -> its open row
    first_of: dict[tuple[tuple[int, ...], int], int] = {}  # (tokens, start) -> first such index
    source: list[int] = []  # sequence -> the sequence whose columns it reads (itself if laid out)
    for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        start = max(start, 1)  # the first token is never predicted
        source.append(first_of.setdefault((tuple(seq), start), i))
        if source[i] != i:
            continue
        key = tuple(seq[:start])
        r = by_prompt.get(key) if share_prompts else None
        if r is None or _row_len(rows[r], sequences) + len(seq) - 1 - start > cap:
            by_prompt[key] = r = len(rows)
            rows.append((list(key), []))
        rows[r][1].append(i)

    length = max(_row_len(row, sequences) for row in rows)
    inputs = torch.zeros(len(rows), length, dtype=torch.long)
    positions = torch.zeros(len(rows), length, dtype=torch.long)
    segments = torch.full((len(rows), length), PAD, dtype=torch.long)
    index: list[int] = []
    targets: list[int] = []
    dest: list[int] = []
    laid_out: dict[int, tuple[int, list[int]]] = {}  # sequence -> (prompt length, its columns)
    for r, (prompt, members) in enumerate(rows):
        p = len(prompt)
        inputs[r, :p] = torch.tensor(prompt)
        positions[r, :p] = torch.arange(p)
        segments[r, :p] = 0
        col = p
        for segment, i in enumerate(members, start=1):
            seq = sequences[i]
            suffix = seq[p:-1]  # the last token is only ever a target
            end = col + len(suffix)
            inputs[r, col:end] = torch.tensor(suffix, dtype=torch.long)
            positions[r, col:end] = torch.arange(p, p + len(suffix))
            segments[r, col:end] = segment
            # Token p is predicted by the prompt's last column, token p + 1 + j by column col + j.
            laid_out[i] = p, [r * length + p - 1, *range(r * length + col, r * length + end)]
            col = end
    for i, seq in enumerate(sequences):
        p, columns = laid_out[source[i]]
        index += columns
        targets += seq[p:]
        dest += range(i * width + p - 1, i * width + len(seq) - 1)
    query, keys = segments.unsqueeze(2), segments.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal & ((keys == 0) | (keys == query))  # the prompt, or the query's own completion
    return PackedBatch(
        inputs,
        positions,
        mask.unsqueeze(1),
        torch.tensor(index),
        torch.tensor(targets),
        torch.tensor(dest),
        width,
        not share_prompts,
    )


def _row_len(row: tuple[list[int], list[int]], sequences: Sequence[Sequence[int]]) -> int:
    prompt, members = row
    return len(prompt) + sum(len(sequences[i]) - 1 - len(prompt) for i in members)
