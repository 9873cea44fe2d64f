"""Sessions: one per rollout. Each records its calls as Steps of its `RolloutContext`."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rllm_async.gateway.errors import APIError
from rllm_async.rollout import RolloutContext
from rllm_async.types import Step

T = TypeVar("T")


@dataclass(eq=False)
class Session:
    """A rollout as the gateway sees it: its context (which records every call), its limits, and
    the calls in flight (cancelled when the session closes).

    A `locked` session samples with its context's temperature and top_p (the trainer's loss assumes
    them); a request asking for others is refused.
    """

    id: str
    ctx: RolloutContext
    locked: bool
    max_calls: int
    # An API key that names this session, so one client with the plain `/v1` base URL serves
    # every rollout (`Authorization: Bearer <key>`).
    key: str = field(default_factory=lambda: f"sk-session-{secrets.token_urlsafe(24)}")
    created: float = field(default_factory=time.time)
    calls: int = 0
    closed: bool = False
    _inflight: set[asyncio.Task[Any]] = field(default_factory=set)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one request's model calls; they are cancelled if the session closes meanwhile."""
        if self.closed:
            raise APIError(404, f"session {self.id} is closed", code="session_not_found")
        if self.calls >= self.max_calls:
            raise APIError(
                429, f"session {self.id} made its {self.max_calls} calls", code="too_many_calls"
            )
        self.calls += 1
        task = asyncio.ensure_future(fn())
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.closed and current is not None and not current.cancelling():
                raise APIError(
                    409, f"session {self.id} closed during the call", code="session_closed"
                ) from None
            raise

    def close(self) -> None:
        self.closed = True
        for task in list(self._inflight):
            task.cancel()

    def records(self) -> dict[str, Any]:
        """Every call's exact tokens, logprobs and versions, by actor (JSON-ready)."""
        trajectories = self.ctx.trajectories()
        return {
            "id": self.id,
            "task_id": self.ctx.task_id,
            "created": self.created,
            "calls": self.calls,
            "trajectories": {t.name: [step_record(s) for s in t.steps] for t in trajectories},
        }


def step_record(step: Step) -> dict[str, Any]:
    return {
        "prompt_ids": step.prompt_ids,
        "completion_ids": step.completion_ids,
        "logprobs": step.logprobs,
        "versions": step.versions,
        "messages": step.messages,
        "reward": step.reward,
        "info": step.info,
    }


class SessionStore:
    """Open sessions by id. Closing one forgets it, so records never outlive their rollout;
    `export_path` (standalone `serve`) appends each closed session's records as one JSON line."""

    def __init__(
        self, *, max_sessions: int, max_calls: int, export_path: Path | None = None
    ) -> None:
        self.max_sessions = max_sessions
        self.max_calls = max_calls
        self.export_path = export_path
        self._open: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, ctx: RolloutContext, *, locked: bool) -> Session:
        """A new session recording into `ctx`."""
        self.expire()
        if len(self._open) >= self.max_sessions:
            raise APIError(
                429,
                f"{len(self._open)} sessions are open (max {self.max_sessions}): close finished ones",
                code="too_many_sessions",
            )
        session = Session(secrets.token_hex(12), ctx, locked, self.max_calls)
        self._open[session.id] = session
        self._by_key[session.key] = session
        return session

    def by_key(self, key: str) -> Session | None:
        """The open session whose API key is `key`."""
        return self._by_key.get(key)

    def get(self, session_id: str) -> Session:
        session = self._open.get(session_id)
        if session is None:
            raise APIError(404, f"no open session {session_id!r}", code="session_not_found")
        return session

    def close(self, session_id: str) -> Session | None:
        """Cancel the session's calls in flight, export its records if asked, and forget it."""
        session = self._open.pop(session_id, None)
        if session is None:
            return None
        del self._by_key[session.key]
        session.close()
        if self.export_path is not None:
            with self.export_path.open("a") as f:
                f.write(json.dumps(session.records()) + "\n")
        return session

    def close_all(self) -> None:
        for session_id in list(self._open):
            self.close(session_id)

    def expire(self) -> None:
        """Close sessions past their context's deadline (standalone sessions have a TTL)."""
        loop = asyncio.get_running_loop()
        for session in [s for s in self._open.values() if s.ctx.deadline <= loop.time()]:
            self.close(session.id)
