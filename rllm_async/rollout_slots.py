"""RolloutSlots: how many rollouts run at once. Under a hard staleness bound the limit shrinks while
a running rollout has used more than half of its staleness budget, so that the engine decodes
fewer sequences and the late ones finish before the bound drops their group."""

from __future__ import annotations

import asyncio
from collections import deque

from rllm_async.coordinator import SyncCoordinator


class RolloutSlots:
    """At most `limit()` rollouts at once, admitted first come, first served.

    The limit is `max_concurrency`, or `late_share * max_concurrency` while the oldest running
    rollout's staleness exceeds `max_staleness // 2` (no new rollout starts until enough have
    finished). A decoding engine shares its rate over the sequences it runs, so fewer of them
    decode faster; without a bound, or with `late_share` None, the limit is `max_concurrency`,
    which `rollout.max_concurrency: auto` moves (`set_max_concurrency`).
    """

    def __init__(
        self, max_concurrency: int, late_share: float | None, coordinator: SyncCoordinator
    ) -> None:
        self.late_share = late_share
        self.coordinator = coordinator
        self.running = 0  # the coordinator is told when this leaves or reaches 0
        self._starts: dict[int, int] = {}  # running rollouts by the policy version they began at
        self._waiters: deque[asyncio.Future[int]] = deque()
        self.set_max_concurrency(max_concurrency)

    def set_max_concurrency(self, max_concurrency: int) -> None:
        """Run up to `max_concurrency` rollouts from now on (`rollout.max_concurrency: auto`);
        those waiting start at once where the limit rose."""
        share = self.late_share
        self.max_concurrency = max_concurrency
        self.late_limit = max(1, int(max_concurrency * share)) if share else None
        self._start_waiting()

    def limit(self) -> int:
        """How many rollouts may run now."""
        k = self.coordinator.config.max_staleness
        if self.late_limit is None or k is None or not self._starts:
            return self.max_concurrency
        late = self.coordinator.staleness(min(self._starts)) > k // 2
        return self.late_limit if late else self.max_concurrency

    async def acquire(self) -> int:
        """Wait for a slot; the policy version the rollout starts at (hand it to `release`)."""
        if not self._waiters and self.running < self.limit():
            return self._grant()
        slot: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            return await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.release(slot.result())  # granted, then cancelled before it ran
            raise

    def release(self, start: int) -> None:
        """Free the slot of a rollout that began at version `start`; start the next ones."""
        self.running -= 1
        if not self.running:
            self.coordinator.set_rollouts_running(False)
        left = self._starts[start] - 1
        if left:
            self._starts[start] = left
        else:
            del self._starts[start]
        self._start_waiting()

    def _start_waiting(self) -> None:
        while self._waiters and self.running < self.limit():
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(self._grant())

    def _grant(self) -> int:
        start = self.coordinator.synced_version
        self.running += 1
        if self.running == 1:
            self.coordinator.set_rollouts_running(True)
        self._starts[start] = self._starts.get(start, 0) + 1
        return start
