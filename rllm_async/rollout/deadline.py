"""`Deadline`: a scope that raises TimeoutError at a time on the event loop's clock and can be moved.

It behaves as `asyncio.timeout_at`, but every scope of a loop shares one timer: entering a scope
pushes a tuple onto a heap and leaving marks it dead, with no timer handle of its own. With
thousands of rollouts in flight, each under its own deadline, asyncio's per-scope timer handles
(objects compared in Python on every heap operation) cost more than the rest of a short rollout.
Entering needs no await, so it is a plain `with` (as trio's cancel scopes are): no coroutine per
scope either; `async with` works too. Measured against `asyncio.timeout_at` in its place (valgrind,
`benchmarks/overhead_instructions.py`, 16,384 rollouts in flight): 223,567 instructions per
episode against 263,655 (15% fewer); whole runs of `benchmarks/overhead.py`: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import weakref
from types import TracebackType

_COMPACT_AT = 1024  # dead heap entries tolerated before they outnumber the live ones


class Deadline:
    """Raise TimeoutError in the entering task once the loop's clock reaches `when` (None: never),
    as `asyncio.timeout_at` does; `reschedule` moves it, `expired` tells whether it fired."""

    __slots__ = ("_cancelling", "_entry", "_expired", "_task", "_timer", "_when")

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._task: asyncio.Task[object] | None = None
        self._timer: _Timer | None = None
        self._entry: _Entry | None = None  # its live entry in the loop's timer
        self._expired = False
        self._cancelling = 0

    def expired(self) -> bool:
        return self._expired

    def reschedule(self, when: float | None) -> None:
        """Fire at `when` instead (None: not at all); a scope that already fired stays fired, and
        one not entered yet or already left only keeps `when`."""
        self._when = when
        if self._task is None or self._expired:
            return
        assert self._timer is not None  # set on entering
        self._timer.drop(self)
        if when is not None:
            self._timer.add(self, when)

    def __enter__(self) -> Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline must be entered inside a task")
        self._task, self._timer = task, _timer(loop)
        self._cancelling = task.cancelling()
        if self._when is not None:
            self._timer.add(self, self._when)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None and self._timer is not None
        task, self._task = self._task, None
        if not self._expired:
            self._timer.drop(self)
        elif task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    async def __aenter__(self) -> Deadline:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def _fire(self) -> None:
        assert self._task is not None
        self._expired = True
        self._task.cancel()


_Entry = tuple[float, int, Deadline]  # when, a tie-breaker, whose: live while it is whose._entry


class _Timer:
    """The one timer of a loop's deadlines: a heap of entries (a dropped one stays until it is
    popped or the dead outnumber the live) and a loop timer set for the earliest."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[_Entry] = []
        self._dead = 0
        self._seq = itertools.count()
        self._armed: asyncio.TimerHandle | None = None
        self._armed_at = float("inf")

    def add(self, deadline: Deadline, when: float) -> None:
        entry = deadline._entry = (when, next(self._seq), deadline)
        heapq.heappush(self._heap, entry)
        if when < self._armed_at:
            self._arm(when)

    def drop(self, deadline: Deadline) -> None:
        if deadline._entry is None:
            return
        deadline._entry = None
        self._dead += 1
        if self._dead > _COMPACT_AT and self._dead * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2]._entry is e]
            heapq.heapify(self._heap)
            self._dead = 0

    def _arm(self, when: float) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed, self._armed_at = self._loop.call_at(when, self._expire), when

    def _expire(self) -> None:
        # Due: everything up to the time this timer was set for (the loop may run it a clock
        # resolution early) or the clock, whichever is later.
        due = max(self._armed_at, self._loop.time())
        self._armed, self._armed_at = None, float("inf")
        heap = self._heap
        while heap and (heap[0][2]._entry is not heap[0] or heap[0][0] <= due):
            entry = heapq.heappop(heap)
            deadline = entry[2]
            if deadline._entry is not entry:
                self._dead -= 1
                continue
            deadline._entry = None
            deadline._fire()
        if heap:
            self._arm(heap[0][0])


_timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Timer] = weakref.WeakKeyDictionary()
_last: _Timer | None = (
    None  # the timer used last, nearly always the next one's (its loop stays alive)
)


def _timer(loop: asyncio.AbstractEventLoop) -> _Timer:
    global _last
    last = _last  # read once: another thread's loop may set it meanwhile
    if last is not None and last._loop is loop:
        return last
    timer = _timers.get(loop)
    if timer is None:
        timer = _timers[loop] = _Timer(loop)
    _last = timer
    return timer
