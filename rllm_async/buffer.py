"""TrajectoryGroupBuffer: completes groups, computes advantages, filters, and hands groups out."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from rllm_async.algorithms.advantages import AdvantageFn
from rllm_async.config import Config
from rllm_async.coordinator import GroupState, SyncCoordinator
from rllm_async.types import Episode, Trajectory, TrajectoryGroup


@dataclass(slots=True)
class Dispatch:
    """One dispatch of one task: `group_size` rollouts started at policy `version`."""

    id: int
    task: dict[str, Any]
    task_id: str
    version: int


@dataclass(slots=True)
class GroupOutcome:
    """How a group whose rollouts all ended came out: its new state and its finished rollouts'
    episodes, in rollout order; `infra_failed`: how many of its rollouts its infrastructure
    failed (not in `episodes`)."""

    state: GroupState
    episodes: list[Episode]
    infra_failed: int = 0

    @property
    def tokens(self) -> int:
        """Completion tokens of its finished rollouts."""
        return sum(ep.num_completion_tokens for ep in self.episodes)

    @property
    def judged(self) -> int:
        """Its rollouts with a judgement of correctness (`is_correct` not None)."""
        return sum(ep.is_correct is not None for ep in self.episodes)

    @property
    def correct(self) -> int:
        """Its rollouts judged correct."""
        return sum(bool(ep.is_correct) for ep in self.episodes)


@dataclass(slots=True)
class ReadyGroup:
    """A completed dispatch: one TrajectoryGroup per actor name, advantages computed."""

    dispatch: Dispatch
    groups: list[TrajectoryGroup]
    episodes: list[Episode]
    min_version: int  # oldest token version in any of its groups, computed once

    @property
    def tokens(self) -> int:
        """Completion tokens of its episodes."""
        return sum(ep.num_completion_tokens for ep in self.episodes)


@dataclass(slots=True)
class _Pending:
    dispatch: Dispatch
    expected: int
    episodes: dict[int, Episode] = field(default_factory=dict)  # by rollout index
    failures: int = 0
    infra_failures: int = 0  # of `failures`, those that failed for their infrastructure


class TrajectoryGroupBuffer:
    """Accumulates episodes per dispatch until its group is complete, then queues it.

    A group is complete when all `group_size` rollouts ended; it trains on the survivors of failed
    rollouts if at least `min_group_size` survived, else it fails. A rollout whose infrastructure
    failed is one of those failed rollouts: left out of the group, its advantages computed over
    the survivors alone, exactly as if the group had been dispatched without it. Zero-variance groups, and
    dispatches where every rollout is judged wrong, are filtered when asked. Every outcome moves
    the group's count in the coordinator, which frees its admission slot at once. Ready groups
    leave oldest policy version first, and the queue is bounded: a full queue makes producers
    wait (backpressure), it never evicts.
    """

    def __init__(
        self,
        coordinator: SyncCoordinator,
        *,
        group_size: int,
        min_group_size: int,
        advantage_fn: AdvantageFn,
        normalize_std: bool,
        filter_zero_variance: bool,
        filter_unsolved: bool,
        capacity: int,
    ) -> None:
        self.coordinator = coordinator
        self.group_size = group_size
        self.min_group_size = min_group_size
        self.advantage_fn = advantage_fn
        self.normalize_std = normalize_std
        self.filter_zero_variance = filter_zero_variance
        self.filter_unsolved = filter_unsolved
        self.capacity = capacity
        self._pending: dict[int, _Pending] = {}
        # Dispatches opened and not yet handed out, filtered or failed, by id: the tasks a
        # checkpoint must run again, and whose tokens are wasted if the run stops.
        self._outstanding: dict[int, Dispatch] = {}
        self._ready: list[tuple[int, int, ReadyGroup]] = []
        self._seq = itertools.count()
        self._closed = False

    @classmethod
    def from_config(
        cls, config: Config, coordinator: SyncCoordinator, advantage_fn: AdvantageFn
    ) -> TrajectoryGroupBuffer:
        """The buffer of a fit of `config`: room for the groups of `pipeline_depth + 1` steps."""
        ro, alg, tr = config.rollout, config.algorithm, config.train
        return cls(
            coordinator,
            group_size=ro.group_size,
            min_group_size=ro.min_group_size,
            advantage_fn=advantage_fn,
            normalize_std=alg.normalize_std,
            filter_zero_variance=alg.filter_zero_variance,
            filter_unsolved=alg.filter_unsolved,
            capacity=(config.coordinator.depth_ceiling(tr.updates_per_batch) + 1)
            * tr.groups_per_step,
        )

    def __len__(self) -> int:
        return len(self._ready)

    def open(self, dispatch: Dispatch) -> None:
        """Start collecting the rollouts of a just-dispatched group."""
        self._pending[dispatch.id] = _Pending(dispatch, self.group_size)
        self._outstanding[dispatch.id] = dispatch

    def add(
        self, dispatch_id: int, index: int, episode: Episode | None, infra_failed: bool = False
    ) -> bool:
        """Add rollout `index` of a group (None: it failed; `infra_failed`: for its
        infrastructure); True once every rollout of the group is in, when it is the caller's to
        `complete`."""
        pending = self._pending[dispatch_id]
        if episode is None:
            pending.failures += 1
            pending.infra_failures += infra_failed
        else:
            pending.episodes[index] = episode
        return len(pending.episodes) + pending.failures >= pending.expected

    async def complete(self, dispatch_id: int) -> GroupOutcome:
        """End a group whose rollouts are all in: failed, filtered, or queued once there is room."""
        pending = self._pending[dispatch_id]  # until it leaves, its tokens count at `cancel`
        # Rollout order, not completion order, so that batches do not depend on timing.
        episodes = [pending.episodes[i] for i in sorted(pending.episodes)]
        infra = pending.infra_failures
        if len(episodes) < self.min_group_size:
            return self._end(dispatch_id, GroupOutcome(GroupState.FAILED, episodes, infra))
        ready = self._complete(pending.dispatch, episodes)
        if ready is None:
            return self._end(dispatch_id, GroupOutcome(GroupState.FILTERED, episodes, infra))
        await self.coordinator.wait_for(lambda: len(self._ready) < self.capacity, "buffer space")
        del self._pending[dispatch_id]
        heapq.heappush(self._ready, (ready.min_version, next(self._seq), ready))
        self.coordinator.move(GroupState.IN_FLIGHT, GroupState.BUFFERED)
        return GroupOutcome(GroupState.BUFFERED, episodes, infra)

    def _end(self, dispatch_id: int, outcome: GroupOutcome) -> GroupOutcome:
        del self._pending[dispatch_id], self._outstanding[dispatch_id]
        self.coordinator.move(GroupState.IN_FLIGHT, outcome.state)
        return outcome

    def _complete(self, dispatch: Dispatch, episodes: list[Episode]) -> ReadyGroup | None:
        """Group the survivors by actor and compute advantages; None if every group is filtered."""
        # Episodes that are not judged (is_correct None) never count as unsolved.
        if self.filter_unsolved and all(ep.is_correct is False for ep in episodes):
            return None
        by_name: dict[str, list[Trajectory]] = {}
        for ep in episodes:
            for traj in ep.trajectories:
                by_name.setdefault(traj.name, []).append(traj)
        groups = []
        for name, trajs in by_name.items():
            rewards = [t.reward for t in trajs]
            if self.filter_zero_variance and max(rewards) == min(rewards):
                continue
            groups.append(
                TrajectoryGroup(
                    task_id=dispatch.task_id,
                    name=name,
                    trajectories=trajs,
                    advantages=self.advantage_fn(rewards, self.normalize_std),
                    dispatch_id=dispatch.id,
                    dispatch_version=dispatch.version,
                )
            )
        if not groups:
            return None
        return ReadyGroup(dispatch, groups, episodes, min(g.min_version for g in groups))

    async def get(self) -> ReadyGroup | None:
        """The ready group with the oldest policy version; None once closed and drained."""
        await self.coordinator.wait_for(lambda: bool(self._ready) or self._closed, "a ready group")
        if not self._ready:
            return None
        _, _, ready = heapq.heappop(self._ready)
        del self._outstanding[ready.dispatch.id]
        self.coordinator.notify()  # space freed
        return ready

    @property
    def finished(self) -> bool:
        """Closed and drained: no group will ever come out again."""
        return self._closed and not self._ready

    def close(self) -> None:
        """No more groups will come: `get` returns None once the queue is empty."""
        self._closed = True
        self.coordinator.notify()

    def outstanding(self) -> list[Dispatch]:
        """Dispatches not yet handed out, filtered or failed (cancelled ones included), oldest
        first: what a checkpoint records as pending."""
        return [self._outstanding[i] for i in sorted(self._outstanding)]

    def cancel(self) -> int:
        """Cancel the groups still in flight or queued (at shutdown); returns the completion
        tokens their finished rollouts generated, now wasted."""
        coord = self.coordinator
        tokens = sum(ready.tokens for _, _, ready in self._ready)
        tokens += sum(
            ep.num_completion_tokens for p in self._pending.values() for ep in p.episodes.values()
        )
        for _ in range(len(self._ready)):
            coord.move(GroupState.BUFFERED, GroupState.CANCELLED)
        self._ready.clear()
        for _ in range(coord.counts.in_flight):
            coord.move(GroupState.IN_FLIGHT, GroupState.CANCELLED)
        return tokens
