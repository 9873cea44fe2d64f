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

    A child session (`child`, `spawn`) records a subagent's calls into a branch of its parent's
    rollout (`RolloutContext.spawn`): its trajectory is named by its `role` and linked to the
    parent's latest step when the child opened. Its calls count against its ancestors' limits
    too, and closing a session closes its children.
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
    parent: Session | None = None
    _inflight: set[asyncio.Task[Any]] = field(default_factory=set)
    _children: list[Session] = field(default_factory=list)
    _by_role: dict[str, Session] = field(default_factory=dict)  # the `X-Agent-Role` children

    @property
    def role(self) -> str | None:
        """A child session's role (its branch's trajectory name); None for a rollout's session."""
        return self.ctx.role

    def spawn(self, role: str) -> Session:
        """A new child session of `role`, its branch linked to this session's latest step."""
        if self.closed:
            raise APIError(404, f"session {self.id} is closed", code="session_not_found")
        child = Session(
            f"{self.id}-{len(self._children)}",
            self.ctx.spawn(role),
            self.locked,
            self.max_calls,
            self.task,
            parent=self,
        )
        self._children.append(child)
        return child

    def child(self, role: str) -> Session:
        """The child session of `role` that calls naming it (`X-Agent-Role`) record into,
        opened by the first of them."""
        if role == self.role:
            return self
        child = self._by_role.get(role)
        if child is None or child.closed:
            child = self._by_role[role] = self.spawn(role)
        return child

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one request's model calls; they are cancelled if the session closes meanwhile."""
        if self.closed:
            raise APIError(404, f"session {self.id} is closed", code="session_not_found")
        chain = [self]
        while chain[-1].parent is not None:
            chain.append(chain[-1].parent)
        for s in chain:
            if s.calls >= s.max_calls:
                raise APIError(
                    429, f"session {s.id} made its {s.max_calls} calls", code="too_many_calls"
                )
        for s in chain:
            s.calls += 1
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
        """Whether a call is in flight, in this session or a child."""
        return bool(self._inflight) or any(c.busy for c in self._children)

    def close(self) -> None:
        self.closed = True
        for task in list(self._inflight):
            task.cancel()
        for child in self._children:
            child.close()

    def descendants(self) -> list[Session]:
        """Its children, theirs, and so on."""
        out = []
        for child in self._children:
            out += [child, *child.descendants()]
        return out

    def records(self) -> dict[str, Any]:
        """Every call's exact tokens, logprobs and versions, by node of the rollout's tree (an
        actor's name, or a branch's id), and the tree: each branch's role and parent step
        (JSON-ready)."""
        trajectories = self.ctx.trajectories()
        return {
            "id": self.id,
            "task_id": self.ctx.task_id,
            "task": self.task,
            "created": self.created,
            "calls": self.calls,
            "reward": self.reward,
            "trajectories": {t.node_id: [step_record(s) for s in t.steps] for t in trajectories},
            "tree": {
                t.node_id: {
                    "role": t.name,
                    "parent": None
                    if t.parent is None
                    else {"node": t.parent.node, "step": t.parent.step, "kind": t.parent.kind},
                }
                for t in trajectories
            },
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

    def open_child(self, parent: Session, role: str) -> Session:
        """A child session of `parent` with an id and API key of its own, for a subagent whose
        calls the client sends apart (`POST /sessions/{id}/children`)."""
        if len(self._open) >= self.max_sessions:
            raise APIError(
                429,
                f"{len(self._open)} sessions are open (max {self.max_sessions}): close finished ones",
                code="too_many_sessions",
            )
        child = parent.spawn(role)
        self._open[child.id] = child
        self._by_key[child.key] = child
        return child

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
        for child in session.descendants():  # children opened with keys of their own
            if self._open.pop(child.id, None) is not None:
                del self._by_key[child.key]
                self._forget(child, how)
        self._forget(session, how)
        if self.export_path is not None and session.parent is None:
            with self.export_path.open("a") as f:
                f.write(json.dumps(session.records()) + "\n")
        return session

    def _forget(self, session: Session, how: str) -> None:
        session_id = session.id
        self._ended[session_id] = how
        self._ended_keys[session.key] = session_id
        if len(self._ended) > self.remember:
            self._ended.popitem(last=False)
            self._ended_keys.popitem(last=False)

    def close_all(self) -> None:
        for session_id in list(self._open):
            self.close(session_id)

    def expire(self) -> None:
        """Close sessions past their context's deadline (standalone sessions have a TTL)."""
        loop = asyncio.get_running_loop()
        expired = [
            s for s in self._open.values() if s.parent is None and s.ctx.deadline <= loop.time()
        ]
        for session in expired:
            self.close(session.id, "expired")
            if self.on_expired is not None:
                self.on_expired(session)
