"""The generation side of one fit: a task dispatched whenever the coordinator admits one, its
group's rollouts run fire-and-forget (as many at once as `RolloutSlots` allows), every episode
handed to the buffer, and what each rollout and group came to reported to `Accounting`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

from rllm_async.accounting import Accounting
from rllm_async.buffer import Dispatch, TrajectoryGroupBuffer
from rllm_async.concurrency_controller import ConcurrencyChange, ConcurrencyController, ModelClock
from rllm_async.config import Config
from rllm_async.coordinator import SyncCoordinator
from rllm_async.data import TaskSource
from rllm_async.plan.record import KeptGroup
from rllm_async.protocols import PolicyClient, SamplingParams
from rllm_async.rollout_slots import RolloutSlots
from rllm_async.runner import configured_parser, run_rollout
from rllm_async.workflows.base import Workflow


class Generation:
    """The generation loop of one `fit()`, built in its event loop; `run()` ends when the data
    does (the buffer closed)."""

    def __init__(
        self,
        config: Config,
        workflow: Workflow,
        policy: PolicyClient,
        coordinator: SyncCoordinator,
        buffer: TrajectoryGroupBuffer,
        source: TaskSource,
        accounting: Accounting,
        max_concurrency: int,
    ) -> None:
        """`max_concurrency`: the rollout limit to start with (`starting_concurrency`), which
        `rollout.max_concurrency: auto` moves from there (`observe_step`)."""
        self.config, self.workflow, self.policy = config, workflow, policy
        self.coordinator, self.buffer, self.source = coordinator, buffer, source
        self.accounting = accounting
        self.sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_tokens=config.rollout.max_tokens,
        )
        self.parser = configured_parser(config, policy)
        self.slots = RolloutSlots(max_concurrency, config.rollout.late_concurrency, coordinator)
        self.concurrency = (
            ConcurrencyController(max_concurrency)
            if config.rollout.max_concurrency == "auto"
            else None
        )
        self.pin = config.coordinator.weight_update == "pin"
        self.dispatch_ids = itertools.count()

    async def run(self) -> None:
        """Dispatch tasks as admission allows, fire and forget; close the buffer at the data's end."""
        coord, source = self.coordinator, self.source
        async with asyncio.TaskGroup() as rollouts:
            while True:
                await coord.wait_admissible()
                task = source.pop()
                if task is None:
                    # A stale group may still hand its task back; wait until none can.
                    await coord.wait_for(
                        lambda: bool(source.requeued) or coord.outstanding == 0, "end of data"
                    )
                    if source.requeued:
                        continue
                    break
                coord.dispatch()
                dispatch = Dispatch(next(self.dispatch_ids), task, task["id"], coord.version)
                self.buffer.open(dispatch)
                kept = self.accounting.on_dispatch()
                for index in range(self.config.rollout.group_size):
                    rollouts.create_task(self._rollout(dispatch, index, kept))
                # Admission may allow hundreds of groups at once: let the loop breathe between them.
                await asyncio.sleep(0)
        self.buffer.close()

    def observe_step(self, record: Mapping[str, float]) -> ConcurrencyChange | None:
        """Show a step's record to the concurrency controller (`rollout.max_concurrency: auto`);
        its change, if it made one (the rollout limit follows it at once)."""
        if self.concurrency is None:
            return None
        change = self.concurrency.observe(record)
        if change is not None:
            self.slots.set_max_concurrency(change.new)
        return change

    async def _rollout(self, dispatch: Dispatch, index: int, kept: KeptGroup | None) -> None:
        """One rollout of a dispatched group, into the buffer; the group's end when it completes
        (`kept`: the group as the workload record keeps it, if it does)."""
        ro, accounting = self.config.rollout, self.accounting
        start = await self.slots.acquire()
        meter = accounting.rollout_meter(kept)
        timed = None if self.concurrency is None else ModelClock(meter, asyncio.get_running_loop())
        try:
            rollout = await run_rollout(
                self.workflow,
                dispatch.task,
                self.policy,
                sampling=self.sampling,
                pin=self.pin,
                timeout_s=ro.timeout_s,
                retries=ro.retries,
                pause=self.coordinator.pause,
                report=accounting.on_attempt,
                rollout_index=index,
                parser=self.parser,
                meter=meter if timed is None else timed,
            )
        finally:
            self.slots.release(start)
        accounting.on_rollout(meter, rollout, None if timed is None else timed.metrics())
        if self.buffer.add(dispatch.id, index, rollout.episode, rollout.infra_failed):
            accounting.on_group(dispatch, kept, await self.buffer.complete(dispatch.id))
