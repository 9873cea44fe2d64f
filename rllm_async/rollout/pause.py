"""The weight-sync pause that model calls wait out: `Pause`, and `SyncPause`, the one a trainer holds."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Pause(Protocol):
    """What a model call checks before it samples, and waits on while `paused`."""

    @property
    def paused(self) -> bool: ...

    async def wait(self) -> None:
        """Return once not paused."""
        ...


class SyncPause:
    """A pause that the coordinator turns on for the length of a weight sync; off when made.

    Each pause waits on an event of its own, so that one trainer's fits may run on one event
    loop after another (an event is bound to the loop of its first waiter).
    """

    def __init__(self) -> None:
        self._off = asyncio.Event()
        self._off.set()

    @property
    def paused(self) -> bool:
        return not self._off.is_set()

    async def wait(self) -> None:
        await self._off.wait()

    def pause(self) -> None:
        if not self.paused:
            self._off = asyncio.Event()

    def resume(self) -> None:
        self._off.set()
