"""SyncCoordinator: owns every group count, admission, the staleness bound and the weight sync."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from rllm_async.config import CoordinatorConfig
from rllm_async.rollout.pause import SyncPause
from rllm_async.staleness_controller import DepthChange, DepthController


class GroupState(enum.StrEnum):
    """Where a dispatched group is. Every group is in exactly one state; each state's value names
    its field of `Counts`."""

    IN_FLIGHT = "in_flight"
    BUFFERED = "buffered"
    CONSUMED = "consumed"
    FILTERED = "filtered"
    FAILED = "failed"
    DROPPED_STALE = "dropped_stale"
    CANCELLED = "cancelled"


_MOVES = {
    GroupState.IN_FLIGHT: {
        GroupState.BUFFERED,
        GroupState.FILTERED,
        GroupState.FAILED,
        GroupState.CANCELLED,
    },
    GroupState.BUFFERED: {GroupState.CONSUMED, GroupState.DROPPED_STALE, GroupState.CANCELLED},
}


class SyncTimeoutError(TimeoutError):
    """The backend's `on_policy_updated` did not finish within `coordinator.sync_timeout_s`."""


class StallError(RuntimeError):
    """Nothing moved for `coordinator.stall_timeout_s`; the message holds the counts."""


@dataclass(slots=True)
class Counts:
    """Group counts. Conservation: dispatched == the sum of all the states."""

    dispatched: int = 0
    in_flight: int = 0
    buffered: int = 0
    consumed: int = 0
    filtered: int = 0
    failed: int = 0
    dropped_stale: int = 0
    cancelled: int = 0

    def conserved(self) -> bool:
        return self.dispatched == (
            self.in_flight
            + self.buffered
            + self.consumed
            + self.filtered
            + self.failed
            + self.dropped_stale
            + self.cancelled
        )


class _IdleMeter:
    """Integrates how long generation was idle (no rollout running, or model calls paused), on
    `clock` (the event loop's); told only when either changes."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.running = False
        self.paused = False
        self._since = clock()
        self._idle = 0.0

    def change(self, *, running: bool | None = None, paused: bool | None = None) -> None:
        now = self.clock()
        if not self.running or self.paused:
            self._idle += now - self._since
        self._since = now
        if running is not None:
            self.running = running
        if paused is not None:
            self.paused = paused

    def take_idle(self) -> float:
        self.change()
        idle, self._idle = self._idle, 0.0
        return idle


class SyncCoordinator:
    """Admission by `pipeline_depth`, the hard bound `max_staleness`, and weight sync as a transaction.

    A group may be dispatched while `consumed + in_flight + buffered < (batch + d + 1) *
    groups_per_step`, where `batch = version // updates_per_batch` counts trained batches (versions
    count optimizer steps); filtered, failed and dropped groups free their slot at once. All waits
    are event-driven: every state change wakes the waiters, and every wait has a deadline.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        groups_per_step: int,
        on_policy_updated: Callable[[int], Awaitable[None]],
        version: int = 0,
        updates_per_batch: int = 1,
    ) -> None:
        self.config = config
        self.groups_per_step = groups_per_step
        self.updates_per_batch = updates_per_batch
        self.version = version
        self.synced_version = version  # the version the engine samples with
        self.counts = Counts()
        self.requeued = 0
        self.on_event: Callable[[str, Counts], None] | None = None  # observer, e.g. for tests
        self._hook = on_policy_updated
        self._changed: asyncio.Event | None = None  # made when someone waits, set by `notify`
        self.pause = SyncPause()  # on while a weight sync runs: model calls wait it out
        self._idle: _IdleMeter | None = None  # from the first rollout on
        # `pipeline_depth: auto`: the depth moves with what each step measured (`observe_step`).
        self.controller: DepthController | None = None
        if config.pipeline_depth == "auto":
            ceiling = config.depth_ceiling(updates_per_batch)
            self.controller = DepthController(config.auto, ceiling)

    # -- admission ---------------------------------------------------------------------------

    @property
    def pipeline_depth(self) -> int:
        """d, except during `sync_warmup_steps`, which run on-policy."""
        if self.version < self.config.sync_warmup_steps:
            return 0
        if self.controller is not None:
            return self.controller.depth
        depth = self.config.pipeline_depth
        assert depth != "auto"  # auto has a controller
        return depth

    def observe_step(self, record: dict[str, float]) -> DepthChange | None:
        """Show a step's record to the depth controller (`pipeline_depth: auto`); its change, if
        it made one (admission follows it at once)."""
        if self.controller is None:
            return None
        change = self.controller.observe(record)
        if change is not None:
            self.notify()  # a deeper pipeline admits more now
        return change

    @property
    def outstanding(self) -> int:
        return self.counts.in_flight + self.counts.buffered

    def can_admit(self) -> bool:
        c = self.counts
        batch = self.version // self.updates_per_batch
        limit = (batch + self.pipeline_depth + 1) * self.groups_per_step
        return c.consumed + c.in_flight + c.buffered < limit

    async def wait_admissible(self) -> None:
        """Wait until a group may be dispatched (the caller dispatches with no await in between)."""
        await self.wait_for(self.can_admit, "admission")

    def dispatch(self) -> None:
        if not self.can_admit():
            raise RuntimeError("dispatch() without admission: call wait_admissible() first")
        self.counts.dispatched += 1
        self.counts.in_flight += 1
        self._event("dispatched")

    # -- group life cycle ---------------------------------------------------------------------

    def move(self, src: GroupState, dst: GroupState, *, requeued: bool = False) -> None:
        """Move one group from `src` to `dst`; checks the conservation invariant."""
        if dst not in _MOVES.get(src, ()):
            raise RuntimeError(f"illegal group transition {src} -> {dst}")
        c = self.counts
        held = getattr(c, src)
        if held <= 0:
            raise RuntimeError(f"no group is {src}; cannot move one to {dst}")
        setattr(c, src, held - 1)
        setattr(c, dst, getattr(c, dst) + 1)
        self.requeued += requeued
        self._event(dst)

    def restore(self, version: int) -> None:
        """Resume at `version`: the groups consumed before it count toward admission as in the
        original run, and nothing is in flight."""
        self.version = self.synced_version = version
        batches = version // self.updates_per_batch
        self.counts.dispatched = self.counts.consumed = batches * self.groups_per_step
        self.notify()

    def staleness(self, min_version: int) -> int:
        """Optimizer steps from `min_version` to the start of the batch being trained (its later
        optimizer steps reuse the batch on purpose)."""
        return self.version - self.version % self.updates_per_batch - min_version

    def too_stale(self, min_version: int) -> bool:
        k = self.config.max_staleness
        return k is not None and self.staleness(min_version) > k

    # -- weight sync ----------------------------------------------------------------------------

    def sync_due(self, version: int) -> bool:
        """Whether the engine gets the weights of `version`: every `sync_every` optimizer steps,
        and every step during `sync_warmup_steps` (which run on-policy)."""
        return version % self.config.sync_every == 0 or version <= self.config.sync_warmup_steps

    def advance(self, version: int) -> None:
        """Count an optimizer step whose weights the engine does not get (see `sync_due`)."""
        self.version = version
        self._event("version_advanced")

    async def update_policy(self, version: int) -> tuple[float, float]:
        """Pause new model calls, run the backend's hook (with timeout and retries), resume.

        Returns (hook seconds, total seconds). Generation resumes even when the hook fails.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.pause.pause()
        if self._idle is not None:
            self._idle.change(paused=True)
        self.notify()  # waiters stop their stall clocks (see `wait_for`)
        hook_s = 0.0
        try:
            for attempt in range(self.config.sync_retries + 1):
                t0 = loop.time()
                try:
                    async with asyncio.timeout(self.config.sync_timeout_s):
                        await self._hook(version)
                    hook_s += loop.time() - t0
                    break
                except TimeoutError:
                    raise SyncTimeoutError(
                        f"backend.on_policy_updated({version}) did not finish within "
                        f"coordinator.sync_timeout_s={self.config.sync_timeout_s}s"
                    ) from None
                except Exception:
                    hook_s += loop.time() - t0
                    if attempt == self.config.sync_retries:
                        raise
            self.version = self.synced_version = version
        finally:
            end = loop.time()
            if self._idle is not None:
                self._idle.change(paused=False)
            self.pause.resume()
            self._event("policy_updated")
        return hook_s, end - start

    # -- rollout activity (for the generation idle ratio) ------------------------------------------

    def set_rollouts_running(self, running: bool) -> None:
        """Whether any rollout runs changed: the first started, or the last ended
        (`RolloutSlots`, which counts them, says)."""
        if self._idle is None:
            self._idle = _IdleMeter(asyncio.get_running_loop().time)
        self._idle.change(running=running)

    @property
    def rollouts_running(self) -> bool:
        """Whether any rollout runs now."""
        return self._idle is not None and self._idle.running

    def take_generation_idle(self) -> float:
        """Seconds with no rollout running (or generation paused) since the last call."""
        if self._idle is None:
            return 0.0
        return self._idle.take_idle()

    # -- waiting ----------------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait, event-driven, until `predicate()` holds; raise StallError after the stall timeout.

        Time while a weight sync runs is not counted: a sync is progress, bounded by its own
        `sync_timeout_s`, and it ends with an event that wakes every waiter.
        """
        waited = 0.0
        while not predicate():
            if self._changed is None:
                self._changed = asyncio.Event()
            changed = self._changed
            if self.pause.paused:
                await changed.wait()
                continue
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            try:
                async with asyncio.timeout(self.config.stall_timeout_s - waited):
                    await changed.wait()
            except TimeoutError:
                raise StallError(
                    f"no progress for coordinator.stall_timeout_s={self.config.stall_timeout_s}s "
                    f"while waiting for {what}; counts: {self.snapshot()}"
                ) from None
            finally:
                waited += loop.time() - t0

    def notify(self) -> None:
        """Wake every waiter to re-check its condition."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def snapshot(self) -> dict[str, int]:
        return {**asdict(self.counts), "requeued": self.requeued, "version": self.version}

    def _event(self, name: str) -> None:
        if not self.counts.conserved():
            raise AssertionError(f"group conservation violated after {name}: {self.snapshot()}")
        if self.on_event is not None:
            self.on_event(name, self.counts)
        self.notify()
