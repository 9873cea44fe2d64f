"""The data model: Step, Trajectory, Episode, TrajectoryGroup."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class Termination(enum.StrEnum):
    """Why an episode ended."""

    DONE = "done"
    MAX_TURNS = "max_turns"
    TRUNCATED = "truncated"
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(slots=True)
class Step:
    """One model call: exact tokens in and out, the sampler's logprobs and per-token versions.

    `messages` is a copy of the chat as it was at this call; later turns never mutate it.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    messages: list[dict[str, Any]] | None = None
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def min_version(self) -> int | None:
        return min(self.versions) if self.versions else None


@dataclass(slots=True)
class TokenSequence:
    """One training sequence: the tokens, which of them the model produced, and their metadata.

    `loss_mask[i]` is 1 for a model-sampled token and 0 for prompt, tool and environment tokens;
    `logprobs` and `versions` are meaningful only where the mask is 1 (0.0 and -1 elsewhere).
    `constraints` are the spans `(start, end, structured)` of `tokens` sampled under a decoding
    constraint (a step's completion): a learner scores them under the same grammar's masks.
    """

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    constraints: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(slots=True, frozen=True)
class StepRef:
    """Where a branch of a rollout's tree starts: after step `step` of the trajectory `node`
    (None: before its first step). `kind` is `spawn` (a subagent with its own conversation) or
    `fork` (a branch that continues the parent's exact tokens)."""

    node: str
    step: int | None
    kind: str = "spawn"


@dataclass(slots=True)
class Trajectory:
    """The steps of one actor in one rollout; `name` tells actors apart in multi-agent workflows.

    In a rollout's tree (`RolloutContext.spawn` and `fork`), `name` is the role that groups
    trajectories for the advantage, `node` is the trajectory's own id in its rollout, and
    `parent` the step it branched from; a top-level actor has `node` None (its `name` is its id)
    and no parent.
    """

    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0
    name: str = "default"
    node: str | None = None
    parent: StepRef | None = None

    @property
    def node_id(self) -> str:
        """The trajectory's id in its rollout: `node`, or `name` for a top-level actor."""
        return self.node if self.node is not None else self.name

    @property
    def num_completion_tokens(self) -> int:
        n = 0
        for s in self.steps:
            n += len(s.completion_ids)
        return n

    @property
    def min_version(self) -> int | None:
        oldest = None
        for s in self.steps:
            if s.versions:
                v = min(s.versions)
                if oldest is None or v < oldest:
                    oldest = v
        return oldest

    def sequences(self) -> list[TokenSequence]:
        """Token-in/token-out training sequences.

        A step whose prompt extends the previous step's prompt + completion continues the same
        sequence (the tokens in between are environment/tool tokens, masked out); any other step
        starts a new sequence.
        """
        out: list[TokenSequence] = []
        for step in self.steps:
            cur = out[-1] if out else None
            if cur is not None and _extends(step.prompt_ids, cur.tokens):
                gap = step.prompt_ids[len(cur.tokens) :]
                cur.tokens.extend(gap)
                cur.loss_mask.extend([0] * len(gap))
                cur.logprobs.extend([0.0] * len(gap))
                cur.versions.extend([-1] * len(gap))
            else:
                n = len(step.prompt_ids)
                cur = TokenSequence(list(step.prompt_ids), [0] * n, [0.0] * n, [-1] * n)
                out.append(cur)
            structured = step.info.get("structured")
            if structured is not None and step.completion_ids:
                start = len(cur.tokens)
                cur.constraints.append((start, start + len(step.completion_ids), structured))
            cur.tokens.extend(step.completion_ids)
            cur.loss_mask.extend([1] * len(step.completion_ids))
            cur.logprobs.extend(step.logprobs)
            cur.versions.extend(step.versions)
        return out


def _extends(prompt: list[int], prefix: list[int]) -> bool:
    return len(prompt) >= len(prefix) and prompt[: len(prefix)] == prefix


@dataclass(slots=True)
class Episode:
    """One rollout of one task."""

    task_id: str
    trajectories: list[Trajectory] = field(default_factory=list)
    reward: float = 0.0
    is_correct: bool | None = None
    termination: Termination = Termination.DONE
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def num_completion_tokens(self) -> int:
        n = 0
        for t in self.trajectories:
            n += t.num_completion_tokens
        return n


@dataclass(slots=True)
class TrajectoryGroup:
    """All trajectories with one (task_id, name) across the rollouts of one dispatch of a task.

    The unit of advantage computation, staleness accounting and training. `advantages[i]`
    belongs to `trajectories[i]`.
    """

    task_id: str
    name: str
    trajectories: list[Trajectory]
    advantages: list[float]
    dispatch_id: int = 0
    dispatch_version: int = 0

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token in the group (the dispatch version if no tokens)."""
        oldest = None
        for t in self.trajectories:
            v = t.min_version
            if v is not None and (oldest is None or v < oldest):
                oldest = v
        return self.dispatch_version if oldest is None else oldest

    @property
    def num_completion_tokens(self) -> int:
        n = 0
        for t in self.trajectories:
            n += t.num_completion_tokens
        return n

    def training_sequences(self) -> Iterator[tuple[TokenSequence, float]]:
        """Every token sequence with a sampled token, in order, with its trajectory's advantage."""
        if len(self.advantages) != len(self.trajectories):
            raise ValueError(
                f"group {self.task_id}/{self.name} has {len(self.trajectories)} trajectories "
                f"but {len(self.advantages)} advantages"
            )
        for traj, advantage in zip(self.trajectories, self.advantages, strict=True):
            for seq in traj.sequences():
                if seq.num_loss_tokens > 0:
                    yield seq, float(advantage)
