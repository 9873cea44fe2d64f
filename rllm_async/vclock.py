"""An asyncio event loop with a virtual clock, so simulated hours run in wall-clock milliseconds.

When the loop would sleep until its next timer, it polls real I/O once and, if nothing is ready,
jumps the clock to that timer instead of waiting. While work submitted through
`loop.run_in_executor` (and so `asyncio.to_thread`) is running, the loop waits in real time and
advances the clock by the real time that passed: a thread's work is never skipped over.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")

_Ready = list[tuple[selectors.SelectorKey, int]]


class _VirtualSelector(selectors.BaseSelector):
    """A real selector that owns the virtual clock and advances it instead of blocking."""

    def __init__(self) -> None:
        self._inner = selectors.DefaultSelector()
        self.now = 0.0
        self.threads_busy = 0

    def select(self, timeout: float | None = None) -> _Ready:
        # No timer pending (None) or work ready (0): behave like the real selector, so that
        # call_soon_threadsafe still wakes a loop that has nothing else to do.
        if timeout is None or timeout <= 0:
            return self._inner.select(timeout)
        if self.threads_busy:
            start = time.monotonic()
            ready = self._inner.select(timeout)
            self.now += min(timeout, time.monotonic() - start) if ready else timeout
            return ready
        ready = self._inner.select(0)
        if not ready:
            self.now += timeout
        return ready

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose `time()` is virtual: it starts at 0.0 and jumps to due timers."""

    def __init__(self) -> None:
        self._clock = _VirtualSelector()
        super().__init__(selector=self._clock)

    def time(self) -> float:
        return self._clock.now

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Run `func` in a thread; the clock follows real time until it finishes."""
        fut = super().run_in_executor(executor, func, *args)
        self._clock.threads_busy += 1
        fut.add_done_callback(self._thread_done)
        return fut

    def _thread_done(self, _fut: asyncio.Future[Any]) -> None:
        self._clock.threads_busy -= 1


def run(coro: Coroutine[Any, Any, T], *, virtual: bool) -> T:
    """Run `coro` to completion on a new loop (virtual clock or the default), like `asyncio.run`.

    Leftover tasks are cancelled, async generators and the default executor shut down, and the
    loop is closed.
    """
    with asyncio.Runner(loop_factory=VirtualClockLoop if virtual else None) as runner:
        return runner.run(coro)
