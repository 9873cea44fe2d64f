"""The model of an inference server: processor sharing of decode slots, and a sync step's profile.

With n sequences decoding, the aggregate rate is R(n) = rmax * n / (n + n_half), split evenly, at
most `slots` at once (a FIFO queue beyond). Benchmarks use the pure functions for ideal times.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import count

import numpy as np

from rllm_async.algorithms.sim_workload import sample_lengths
from rllm_async.backends.sim.options import SimOptions


def ps_rate(n: int, rmax: float, n_half: float) -> float:
    """Aggregate decode rate (tokens/s) with n sequences active; n = slots gives the ideal rate."""
    return rmax * n / (n + n_half) if n > 0 else 0.0


def ps_makespan(lengths: Sequence[int], rmax: float, n_half: float, slots: int) -> float:
    """Seconds until sequences of `lengths`, submitted together in this order, have all finished."""
    heap = [float(x) for x in lengths[:slots]]
    heapify(heap)
    waiting = iter(lengths[slots:])
    t = level = 0.0
    while heap:
        finish = heappop(heap)
        t += (finish - level) * (len(heap) + 1 + n_half) / rmax
        level = finish
        nxt = next(waiting, None)
        if nxt is not None:
            heappush(heap, level + nxt)
    return t


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Mean completion tokens and mean sync-mode generation time (s) of one optimizer step."""

    tokens: float
    t_gen: float

    def train_rate_for(self, ratio: float) -> float:
        """The train_rate that makes T_train / T_gen(sync) equal `ratio`."""
        return self.tokens / (ratio * self.t_gen)


def step_profile(
    opts: SimOptions, rollouts: int, *, steps: int = 2000, seed: int = 0
) -> StepProfile:
    """Average over `steps` seeded samples of a sync step: `rollouts` sequences started together."""
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(
        rng, steps * rollouts, opts.len_median, opts.len_sigma, opts.len_cap
    ).reshape(steps, rollouts)
    if rollouts <= opts.slots:
        # Closed form: the service level S rises at rmax / (n + n_half) per second, so
        # rmax * t = sum of n dS + n_half * sum of dS = total tokens + n_half * longest length.
        t_gen = (lengths.sum(axis=1) + opts.n_half * lengths.max(axis=1)) / opts.rmax
    else:
        t_gen = np.array(
            [ps_makespan(row.tolist(), opts.rmax, opts.n_half, opts.slots) for row in lengths]
        )
    return StepProfile(tokens=float(lengths.sum(axis=1).mean()), t_gen=float(t_gen.mean()))


_QUEUED, _ACTIVE, _DONE, _CANCELLED = range(4)


class _Job:
    __slots__ = ("done", "length", "start", "state")

    def __init__(self, length: int, done: asyncio.Future[None]) -> None:
        self.length = length
        self.done = done
        self.start = 0.0  # service level when it got a slot
        self.state = _QUEUED


class ProcessorSharing:
    """Decode slots shared evenly: with n active, each sequence gets rmax / (n + n_half) tokens/s,
    times `speed` (below 1 while something else holds the engine's processors, 0 while paused).

    All active sequences get the same rate, so one counter, the service each has attained
    (`level`), tells when each finishes: at its start level plus its length. A heap of finish
    levels and a single timer for the next completion make every event O(log n).
    """

    def __init__(self, rmax: float, n_half: float, slots: int) -> None:
        self.rmax = rmax
        self.n_half = n_half
        self.slots = slots
        self.active = 0
        self.speed = 1.0
        self._level = 0.0
        self._t_last = 0.0
        self._heap: list[tuple[float, int, _Job]] = []
        self._queue: deque[_Job] = deque()
        self._seq = count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._rescheduling = False
        self._busy = False  # whether any sequence was decoding at the last change
        self._busy_waiters: list[asyncio.Future[None]] = []

    @property
    def queued(self) -> int:
        return sum(job.state == _QUEUED for job in self._queue)

    def level(self) -> float:
        """The attained-service counter now."""
        self._advance()
        return self._level

    def set_speed(self, speed: float) -> None:
        """From now on decode at `speed` times the rate (0: paused, 1: the full rate)."""
        self._use_running_loop()
        self._advance()
        self.speed = speed
        self._changed()

    def submit(self, length: int) -> _Job:
        """Queue a sequence of `length` tokens; `job.done` resolves when it has decoded them all."""
        loop = self._use_running_loop()
        job = _Job(length, loop.create_future())
        if self.active < self.slots:
            self._start(job)
        else:
            self._queue.append(job)
        return job

    def busy_changed(self) -> asyncio.Future[None]:
        """A future that resolves when the engine next starts or stops decoding (active turns
        from zero to more, or back)."""
        waiter = self._use_running_loop().create_future()
        self._busy_waiters = [w for w in self._busy_waiters if not w.done()] + [waiter]
        return waiter

    def _use_running_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop and self.active == 0:
            # A new event loop (a new run): nothing armed on the old one carries over.
            self._loop, self._timer, self._rescheduling = loop, None, False
        return loop

    def cancel(self, job: _Job) -> None:
        """Withdraw a sequence (its caller was cancelled); a finished one is left alone."""
        if job.state == _ACTIVE:
            self._advance()
            job.state = _CANCELLED  # its heap entry is skipped when reached
            self.active -= 1
            self._fill()
            self._changed()
        elif job.state == _QUEUED:
            job.state = _CANCELLED  # its queue entry is skipped when reached

    def close(self, reason: str) -> None:
        """Stop the clock and fail every waiting sequence with RuntimeError(reason)."""
        if self._timer is not None:
            self._timer.cancel()
        for job in [entry[2] for entry in self._heap] + list(self._queue):
            if job.state in (_QUEUED, _ACTIVE) and not job.done.done():
                job.done.set_exception(RuntimeError(reason))
            job.state = _CANCELLED
        self._heap.clear()
        self._queue.clear()
        self.active = 0
        self._wake_busy_waiters()

    def _wake_busy_waiters(self) -> None:
        """Resolve the `busy_changed` futures if the engine started or stopped decoding."""
        busy = self.active > 0
        if busy == self._busy:
            return
        self._busy = busy
        waiters, self._busy_waiters = self._busy_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _advance(self) -> None:
        if self._loop is None:
            return
        now = self._loop.time()
        if self.active:
            rate = self.speed * self.rmax / (self.active + self.n_half)
            self._level += (now - self._t_last) * rate
        self._t_last = now

    def _start(self, job: _Job) -> None:
        self._advance()
        job.state = _ACTIVE
        job.start = self._level
        self.active += 1
        heappush(self._heap, (job.start + job.length, next(self._seq), job))
        self._changed()

    def _fill(self) -> None:
        while self._queue and self.active < self.slots:
            job = self._queue.popleft()
            if job.state == _QUEUED:
                self._start(job)

    def _changed(self) -> None:
        # The rate changed, so the armed completion time is stale: disarm now, re-arm once per
        # loop iteration (a burst of joins costs one timer, not one each).
        self._wake_busy_waiters()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._rescheduling and self._loop is not None:
            self._rescheduling = True
            self._loop.call_soon(self._reschedule)

    def _reschedule(self) -> None:
        self._rescheduling = False
        heap = self._heap
        while heap and heap[0][2].state != _ACTIVE:
            heappop(heap)
        if heap and self._loop is not None and self.speed > 0:
            self._advance()
            dt = (heap[0][0] - self._level) * (self.active + self.n_half) / (self.speed * self.rmax)
            self._timer = self._loop.call_at(self._t_last + max(dt, 0.0), self._complete)

    def _complete(self) -> None:
        self._timer = None
        self._advance()
        heap = self._heap
        # The timer was armed for the head's finish level: float rounding must not leave it short.
        self._level = max(self._level, heap[0][0])
        limit = self._level + 1e-9 * max(1.0, self._level)
        while heap and heap[0][0] <= limit:
            job = heappop(heap)[2]
            if job.state == _ACTIVE:
                job.state = _DONE
                self.active -= 1
                if not job.done.done():
                    job.done.set_result(None)
        self._fill()
        self._changed()
