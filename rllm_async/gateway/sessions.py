"""Sessions: one per rollout. Each records its calls as Steps of its `RolloutContext`."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
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
    task: str | None = None  # the group key a client named when it opened the session
    # An API key that names this session, so one client with the plain `/v1` base URL serves
    # every rollout (`Authorization: Bearer <key>`).
    key: str = field(default_factory=lambda: f"sk-session-{secrets.token_urlsafe(24)}")
    created: float = field(default_factory=time.time)
    calls: int = 0
    closed: bool = False
    reward: float | None = None  # reported by the client (`POST /sessions/{id}/reward`)
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

    @property
    def busy(self) -> bool:
        """Whether a call is in flight."""
        return bool(self._inflight)

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
            "task": self.task,
            "created": self.created,
            "calls": self.calls,
            "reward": self.reward,
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


# How a session ended, as a later request for it is told: (HTTP status, error code, why).
_ENDED = {
    "closed": (404, "session_not_found", "is closed"),
    "rewarded": (
        409,
        "session_rewarded",
        "already has its reward and is closed: open a new session for the next episode",
    ),
    "expired": (
        404,
        "session_expired",
        "expired without a reward (past its ttl_s): open a new session and report its reward "
        "before it expires",
    ),
}


class SessionStore:
    """Open sessions by id. Closing one forgets it, so records never outlive their rollout;
    `export_path` (standalone `serve`) appends each closed session's records as one JSON line.
    How the latest `remember` closed sessions ended, and their API keys, are kept, so that a late
    request is told why its session is gone, and one with an ended session's key is refused even
    on a gateway without an API key; `on_expired` hears of every session that expires."""

    def __init__(
        self,
        *,
        max_sessions: int,
        max_calls: int,
        export_path: Path | None = None,
        on_expired: Callable[[Session], None] | None = None,
        remember: int = 100_000,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_calls = max_calls
        self.export_path = export_path
        self.on_expired = on_expired
        self.remember = remember
        self._open: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> how it ended (see _ENDED)
        self._ended_keys: OrderedDict[str, str] = OrderedDict()  # API key -> its ended session

    def __len__(self) -> int:
        return len(self._open)

    def open(self, ctx: RolloutContext, *, locked: bool, task: str | None = None) -> Session:
        """A new session recording into `ctx`; `task` is its group key, if the client named one."""
        self.expire()
        if len(self._open) >= self.max_sessions:
            raise APIError(
                429,
                f"{len(self._open)} sessions are open (max {self.max_sessions}): close finished ones",
                code="too_many_sessions",
            )
        session = Session(secrets.token_hex(12), ctx, locked, self.max_calls, task)
        self._open[session.id] = session
        self._by_key[session.key] = session
        return session

    def by_key(self, key: str) -> Session | None:
        """The open session whose API key is `key`."""
        return self._by_key.get(key)

    def ended_key(self, key: str) -> str | None:
        """The id of the ended session (among the latest `remember`) whose API key is `key`."""
        return self._ended_keys.get(key)

    def get(self, session_id: str) -> Session:
        """The open session `session_id`, or an APIError saying why there is none."""
        session = self._open.get(session_id)
        if session is not None:
            return session
        ended = self._ended.get(session_id)
        if ended is None:
            raise APIError(404, f"no open session {session_id!r}", code="session_not_found")
        status, code, why = _ENDED[ended]
        raise APIError(status, f"session {session_id!r} {why}", code=code)

    def close(self, session_id: str, how: str = "closed") -> Session | None:
        """Cancel the session's calls in flight, export its records if asked, and forget it;
        `how` it ended (closed, rewarded, expired) is what a later request for it is told."""
        session = self._open.pop(session_id, None)
        if session is None:
            return None
        del self._by_key[session.key]
        session.close()
        self._ended[session_id] = how
        self._ended_keys[session.key] = session_id
        if len(self._ended) > self.remember:
            self._ended.popitem(last=False)
            self._ended_keys.popitem(last=False)
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
            self.close(session.id, "expired")
            if self.on_expired is not None:
                self.on_expired(session)
