"""`Gateway`: an OpenAI-compatible HTTP server over a `PolicyClient`, run inside the caller's loop."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from starlette.requests import Request

from rllm_async.gateway.app import build_app
from rllm_async.gateway.errors import APIError
from rllm_async.gateway.sessions import Session, SessionStore
from rllm_async.protocols import PolicyClient, SamplingParams
from rllm_async.rollout import Pause, RolloutContext, SyncPause
from rllm_async.rollout.reply_parser import ReplyParser

log = logging.getLogger("rllm_async.gateway")


class _FollowedPause:
    """The pause of the trainer the gateway follows now (none until one does): standalone
    sessions' contexts hold this one, so that they follow a trainer that comes later."""

    def __init__(self) -> None:
        self.followed: Pause = SyncPause()

    @property
    def paused(self) -> bool:
        return self.followed.paused

    async def wait(self) -> None:
        while self.followed.paused:  # the trainer followed may change meanwhile
            await self.followed.wait()


class _Server(uvicorn.Server):
    """uvicorn that resolves `ready` once it accepts connections (no polling of `started`).

    `embedded` drops its signal handlers: inside a trainer, Ctrl-C belongs to the trainer.
    """

    def __init__(
        self, config: uvicorn.Config, *, ready: asyncio.Future[None], embedded: bool
    ) -> None:
        super().__init__(config)
        self._ready = ready
        self._embedded = embedded

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self._embedded:
            yield
        else:
            with super().capture_signals():
                yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self._ready.done():
            self._ready.set_result(None)


CONSTRAINTS = ("enforce", "check")


class Gateway:
    """Serves `policy` at `/v1/...` and per-session at `/sessions/{id}/v1/...`.

    A session records every call (exact prompt and completion tokens, logprobs, versions) as Steps
    of its `RolloutContext`; `sessions.close(id)` forgets it. With `open_sessions` (standalone
    `serve`) clients open and delete sessions over HTTP, and sessions expire after `session_ttl_s`;
    a client reports a session's reward with `POST /sessions/{id}/reward`, which closes it and
    hands it to `on_reward` (online training), while `on_expired` hears of each session that
    expired unrewarded; `locked_sessions` makes them sample with `sampling`'s temperature and
    top_p only (the trainer's loss assumes them). With `constraints="enforce"` a forced tool call
    and a JSON `response_format` are sampled under their grammar, and refused (400) where the
    policy's engine cannot constrain decoding; with `check` they are only checked. A call outside
    any session, and every call of a session opened over HTTP, waits on the pause of the contexts given to `session` or
    `follow_pause` (a trainer's weight sync, which every rollout's context shares), so no weights
    half-updated serve it.
    """

    def __init__(
        self,
        policy: PolicyClient,
        *,
        model: str = "policy",
        api_key: str | None = None,
        sampling: SamplingParams | None = None,
        open_sessions: bool = False,
        session_ttl_s: float = 3600.0,
        max_sessions: int = 10_000,
        max_calls_per_session: int = 1_000,
        max_body_bytes: int = 4 * 2**20,
        export_path: Path | None = None,
        parser: ReplyParser | None = None,
        on_reward: Callable[[Session], None] | None = None,
        on_expired: Callable[[Session], None] | None = None,
        locked_sessions: bool = False,
        constraints: str = "enforce",
    ) -> None:
        if constraints not in CONSTRAINTS:
            raise ValueError(
                f"constraints={constraints!r}: enforce (sample forced tool calls and JSON "
                "response formats under their grammar) or check (only check the replies)"
            )
        self.constraints = constraints
        self.policy = policy
        self.parser = parser  # reads the replies of calls outside a rollout's context
        self.model = model
        self.api_key = api_key
        self.sampling = sampling or SamplingParams()
        self.open_sessions = open_sessions
        self.session_ttl_s = session_ttl_s
        self.max_body_bytes = max_body_bytes
        self.on_reward = on_reward
        self.locked_sessions = locked_sessions
        self.sessions = SessionStore(
            max_sessions=max_sessions,
            max_calls=max_calls_per_session,
            export_path=export_path,
            on_expired=on_expired,
        )
        self.created = int(time.time())
        self.app = build_app(self)
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._pause = _FollowedPause()

    # -- sessions -------------------------------------------------------------------------------

    def session(self, ctx: RolloutContext) -> Session:
        """A session recording into a rollout's `ctx`, sampling with its temperature and top_p;
        calls outside a session wait on `ctx`'s pause from now on."""
        self.follow_pause(ctx.pause)
        return self.sessions.open(ctx, locked=True)

    def follow_pause(self, pause: Pause) -> None:
        """Calls outside a trainer's rollouts (no session, or one opened over HTTP) wait out
        `pause` (the trainer's weight-sync pause) from now on."""
        self._pause.followed = pause

    @property
    def paused(self) -> bool:
        """Whether calls outside a trainer's rollouts wait out a weight sync now (`/health`)."""
        return self._pause.paused

    def open_session(self, ttl_s: float | None = None, task: str | None = None) -> Session:
        """A standalone session with its own context, closed after `ttl_s` (default the TTL);
        `task` is the group key of its episode for online training."""
        loop = asyncio.get_running_loop()
        ctx = RolloutContext(
            self.policy,
            sampling=self.sampling,
            pin=False,
            pause=self._pause,
            deadline=loop.time() + (ttl_s or self.session_ttl_s),
            task_id="serve",
            parser=self.parser,
        )
        return self.sessions.open(ctx, locked=self.locked_sessions, task=task)

    def reward(
        self, session_id: str, reward: float, task: str | None, response_id: str | None = None
    ) -> Session:
        """Record the reward of an open session's episode and close it (`on_reward` takes it),
        or with `response_id` the reward of that reply alone (the session stays open); a child
        session's reward is its branch's own credit, and closes only the child. An APIError,
        changing nothing, when the session is gone or cannot take it."""
        self.sessions.expire()  # a reward past the session's TTL is late
        session = self.sessions.get(session_id)
        if task is not None and session.task is not None and task != session.task:
            raise APIError(
                400,
                f"task {task!r}: the session was opened with task {session.task!r}; "
                "leave task out or give the same",
                param="task",
                code="invalid_parameter",
            )
        if response_id is not None:
            _reward_reply(session, response_id, reward)
            session.task = task or session.task
            return session
        if session.busy:
            raise APIError(
                409,
                f"session {session_id!r} has a call in flight: report the reward once the "
                "episode's calls have returned",
                code="session_busy",
            )
        if not (session.ctx.trajectory().steps if session.parent else session.ctx.trajectories()):
            raise APIError(
                409,
                f"session {session_id!r} recorded no model call: there is no episode to reward",
                code="session_empty",
            )
        session.reward = reward
        session.task = task or session.task
        self.sessions.close(session_id, "rewarded")
        if session.parent is not None:
            session.ctx.set_reward(reward)  # a subagent's own reward: its branch's credit
        elif self.on_reward is not None:
            self.on_reward(session)
        return session

    def scratch_context(self) -> RolloutContext:
        """A context for one call outside any session; what it records is dropped."""
        return RolloutContext(
            self.policy,
            sampling=self.sampling,
            pin=False,
            pause=self._pause,
            deadline=float("inf"),
            task_id="",
            parser=self.parser,
        )

    def session_url(self, session_id: str, request: Request | None = None) -> str:
        """The OpenAI `base_url` of a session."""
        root = str(request.base_url).rstrip("/") if request is not None else self.url
        return f"{root}/sessions/{session_id}/v1"

    # -- serving --------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, embedded: bool = True) -> None:
        """Listen on `host:port` (0: a free port) in this event loop; returns once accepting.

        `embedded` leaves signal handling to the caller (a trainer); otherwise SIGINT/SIGTERM stop
        the server gracefully (`serve`).
        """
        if not _is_loopback(host) and self.api_key is None:
            log.warning(
                "gateway: listening on %s without an API key; anyone who reaches it can use it",
                host,
            )
        sock = _bind(host, port)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        ready = asyncio.get_running_loop().create_future()
        self._server = server = _Server(config, ready=ready, embedded=embedded)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="rllm-async:gateway")
        await asyncio.wait((ready, self._task), return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            self._task.result()  # raises why it stopped
            raise RuntimeError("the gateway stopped while starting")
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}"

    async def wait(self) -> None:
        """Until the server stops (a signal, in standalone mode)."""
        if self._task is not None:
            await self._task

    async def stop(self) -> None:
        """Close every session and stop listening; idempotent."""
        self.sessions.close_all()
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = self._task = None


def _reward_reply(session: Session, response_id: str, reward: float) -> None:
    """Reward the steps of one reply of `session`, each once."""
    steps = [
        step
        for traj in session.ctx.trajectories()
        for step in traj.steps
        if step.info.get("reply_id") == response_id
    ]
    if not steps:
        raise APIError(
            404,
            f"session {session.id!r} has no chat completion, response or message with id "
            f"{response_id!r}: give the `id` of one of its replies",
            param="response_id",
            code="response_not_found",
        )
    if any(step.reward is not None for step in steps):
        raise APIError(
            409, f"the reply {response_id!r} already has its reward", code="response_rewarded"
        )
    for step in steps:
        step.reward = reward


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket; binding here makes a port in use an OSError, not uvicorn's exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the listening
    # socket says so, and without it every response waits for a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
