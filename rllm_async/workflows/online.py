"""OnlineWorkflow: train on episodes that agents outside the trainer run in gateway sessions.

`start(policy)` serves the policy through a `Gateway` whose clients open sessions
(`POST /sessions`, optionally with a `task` key), make their calls in them and report each
episode's reward (`POST /sessions/{id}/reward`). A rewarded session becomes an episode of the
exact tokens it recorded (with the policy version of every token); `EpisodeGroups` gathers them
by group key into groups of `group_size`. The trainer's rollouts of one dispatched task wait for
the next complete group and return its episodes, one per rollout, so online groups take the
trainer's one path: admission, staleness bound, advantages, the step record.

Expiry: a session without a reward closes `session_ttl_s` after it opened, and an incomplete
group's episodes are dropped `group_ttl_s` after its first reward; neither is ever trained, and
both are counted in every step's record (`workflow/sessions_expired`, `workflow/episodes_expired`,
since the previous record).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rllm_async.protocols import PolicyClient, SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.rollout.reply_parser import reply_parser
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow

if TYPE_CHECKING:
    from rllm_async.gateway import Gateway
    from rllm_async.gateway.sessions import Session

GroupBy = Literal["task", "prompt"]


@dataclass(slots=True)
class _Pending:
    """Episodes of one group key waiting for the rest of their group."""

    first: float  # when its first episode was rewarded, on the event loop's clock
    episodes: list[Episode] = field(default_factory=list)


class EpisodeGroups:
    """Rewarded episodes gathered by key: every `group_size` episodes of a key make a group, ready
    in the order they completed; an incomplete group expires `ttl_s` after its first episode."""

    def __init__(self, group_size: int, ttl_s: float) -> None:
        self.group_size = group_size
        self.ttl_s = ttl_s
        self._pending: dict[str, _Pending] = {}
        self._ready: deque[list[Episode]] = deque()
        self._changed = asyncio.Event()

    @property
    def pending(self) -> int:
        """Episodes waiting for their group to fill."""
        return sum(len(p.episodes) for p in self._pending.values())

    def add(self, key: str, episode: Episode, now: float) -> None:
        pending = self._pending.setdefault(key, _Pending(now))
        pending.episodes.append(episode)
        if len(pending.episodes) == self.group_size:
            del self._pending[key]
            self._ready.append(pending.episodes)
            self._changed.set()

    def expire(self, now: float) -> int:
        """Drop the incomplete groups past their TTL; the number of episodes dropped."""
        old = [key for key, p in self._pending.items() if now - p.first >= self.ttl_s]
        return sum(len(self._pending.pop(key).episodes) for key in old)

    async def next(self) -> list[Episode]:
        """The oldest complete group, once there is one."""
        while not self._ready:
            self._changed.clear()
            await self._changed.wait()
        return self._ready.popleft()


@dataclass(slots=True)
class _Claim:
    """The group that the rollouts of one dispatched task share, and the indices handed out."""

    group: asyncio.Task[list[Episode]]
    waiting: int = 0
    delivered: set[int] = field(default_factory=set)


class OnlineWorkflow(Workflow):
    """Rollouts that return externally run, externally rewarded episodes (see the module's doc).

    `group_by="task"` groups by the `task` key a client gives when it opens the session or with
    the reward, and sessions with no key by their first prompt; `"prompt"` always by the first
    prompt's exact tokens. The gateway listens on `host:port` with `api_key` (none: any client
    that reaches it), serving the policy as `model`; every session samples with `sampling`'s
    temperature and top_p (the loss assumes them), its replies read by the named parsers.
    """

    def __init__(
        self,
        *,
        group_size: int,
        sampling: SamplingParams,
        group_by: GroupBy = "task",
        session_ttl_s: float = 600.0,
        group_ttl_s: float = 1800.0,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model: str = "policy",
        max_sessions: int = 10_000,
        max_calls_per_session: int = 1_000,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        constraints: str = "enforce",
    ) -> None:
        self.groups = EpisodeGroups(group_size, group_ttl_s)
        self.sampling = sampling
        self.group_by = group_by
        self.session_ttl_s = session_ttl_s
        self.host, self.port, self.api_key, self.model = host, port, api_key, model
        self.max_sessions = max_sessions
        self.max_calls_per_session = max_calls_per_session
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.constraints = constraints  # rollout.constraints: the gateway's
        self.gateway: Gateway | None = None
        self._claims: dict[str, _Claim] = {}
        self._expired_sessions = 0
        self._expired_episodes = 0
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, policy: PolicyClient) -> None:
        """Serve `policy` to the clients; once the gateway accepts connections."""
        from rllm_async.gateway import Gateway

        gateway = Gateway(
            policy,
            model=self.model,
            api_key=self.api_key,
            sampling=self.sampling,
            open_sessions=True,
            session_ttl_s=self.session_ttl_s,
            max_sessions=self.max_sessions,
            max_calls_per_session=self.max_calls_per_session,
            on_reward=self._rewarded,
            on_expired=self._expired,
            parser=reply_parser(policy.tokenizer, self.tool_parser, self.reasoning_parser),
            locked_sessions=True,
            constraints=self.constraints,
        )
        await gateway.start(self.host, self.port)
        self.gateway = gateway
        self._sweeper = asyncio.create_task(self._sweep(), name="rllm-async:online-expiry")

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        """Episode `ctx.rollout_index` of the next complete group, shared by the task's rollouts."""
        if self.gateway is None:
            raise RuntimeError("OnlineWorkflow.run() before start(policy)")
        if ctx.rollout_index >= self.groups.group_size:
            raise RuntimeError(
                f"rollout {ctx.rollout_index} of a group of {self.groups.group_size}: build the "
                "workflow with group_size=rollout.group_size"
            )
        # The clients' calls wait out the trainer's weight syncs, as rollouts do.
        self.gateway.follow_pause(ctx.pause)
        key = task["id"]
        claim = self._claims.get(key)
        if claim is None or ctx.rollout_index in claim.delivered:  # a new dispatch of the task
            claim = self._claims[key] = _Claim(asyncio.ensure_future(self.groups.next()))
        claim.waiting += 1
        try:
            group = await asyncio.shield(claim.group)
        finally:
            claim.waiting -= 1
            if not claim.group.done() and claim.waiting == 0:  # every rollout gave up waiting
                claim.group.cancel()
                self._claims.pop(key, None)
        claim.delivered.add(ctx.rollout_index)
        if len(claim.delivered) == len(group) and self._claims.get(key) is claim:
            del self._claims[key]
        return group[ctx.rollout_index]

    def step_metrics(self) -> dict[str, float]:
        """Sessions and episodes expired since the last record, and episodes waiting for their
        group to fill now."""
        out = {
            "sessions_expired": float(self._expired_sessions),
            "episodes_expired": float(self._expired_episodes),
            "episodes_pending": float(self.groups.pending),
        }
        self._expired_sessions = self._expired_episodes = 0
        return out

    def _rewarded(self, session: Session) -> None:
        """A client reported `session`'s reward: its episode joins its group."""
        assert session.reward is not None
        ctx = session.ctx
        ctx.set_reward(session.reward)
        episode = ctx.build_episode(None)
        episode.metrics["calls"] = float(session.calls)
        key = session.task if self.group_by == "task" and session.task else _prompt_key(ctx)
        self.groups.add(key, episode, asyncio.get_running_loop().time())

    def _expired(self, session: Session) -> None:
        self._expired_sessions += 1

    async def _sweep(self) -> None:
        """Expire unrewarded sessions and incomplete groups as their TTLs pass."""
        assert self.gateway is not None
        period = min(1.0, self.session_ttl_s / 10, self.groups.ttl_s / 10)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            self.gateway.sessions.expire()
            self._expired_episodes += self.groups.expire(loop.time())

    async def close(self) -> None:
        """Stop expiring and serving; open sessions are closed unrewarded."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for claim in self._claims.values():
            claim.group.cancel()
        if self.gateway is not None:
            await self.gateway.stop()
        self.gateway, self._sweeper = None, None


def _prompt_key(ctx: RolloutContext) -> str:
    """A group key from the exact tokens of a session's first prompt."""
    first = ctx.trajectories()[0].steps[0].prompt_ids
    return "prompt:" + hashlib.sha256(json.dumps(first).encode()).hexdigest()[:32]


def slots(count: int = 4096) -> list[dict[str, Any]]:
    """The tasks an online run dispatches: placeholders, each dispatch waiting for a group."""
    return [{"id": f"online-{i}"} for i in range(count)]
