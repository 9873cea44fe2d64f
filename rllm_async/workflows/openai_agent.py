"""OpenAIAgentWorkflow: train any agent that speaks the OpenAI API, through the gateway.

`start(policy)` starts a `Gateway` on 127.0.0.1 in the trainer's event loop, ready before
the first rollout; `run` opens one session per rollout and calls `agent(base_url, api_key, task)` with the
gateway's `/v1` base URL and the session's own API key, which names the session: every rollout
has the same base URL, so agents share one HTTP client (`openai_client`, or `anthropic_client` for
the Anthropic Messages API) instead of paying for a new one (its SSL set-up) per rollout. The gateway records every call server-side as a Step of the
rollout, so the trajectory is rebuilt from its records: the agent never reports tokens. The
session is closed (its in-flight calls cancelled, its records freed) before the episode goes to
the buffer.
"""

from __future__ import annotations

import contextvars
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rllm_async.protocols import PolicyClient
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow
from rllm_async.workflows.callables import load, score

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic
    from anthropic import DefaultAsyncHttpxClient as AnthropicHttpxClient
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    from rllm_async.gateway import Gateway

AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[Any]]
_HTTP: contextvars.ContextVar[DefaultAsyncHttpxClient | None] = contextvars.ContextVar(
    "rllm_async_http", default=None
)
# The `anthropic` package has an HTTP client of its own kind (`httpx2`): a second shared one.
_ANTHROPIC_HTTP: contextvars.ContextVar[AnthropicHttpxClient | None] = contextvars.ContextVar(
    "rllm_async_anthropic_http", default=None
)


def openai_client(base_url: str, api_key: str, **options: Any) -> AsyncOpenAI:
    """An `openai.AsyncOpenAI` for one rollout on the workflow's shared HTTP client (a few ms,
    where a client of its own costs ~50 ms of SSL set-up). Do not close it: the HTTP client is
    the workflow's, closed when training ends. Outside a rollout it gets an HTTP client of its own.
    """
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=_HTTP.get(), **options)


def anthropic_client(base_url: str, api_key: str, **options: Any) -> AsyncAnthropic:
    """An `anthropic.AsyncAnthropic` for one rollout on the workflow's shared HTTP client, as
    `openai_client`; `base_url` is the agent's (`.../v1`): the client adds `/v1/messages` to the
    gateway's root itself. Do not close it. Outside a rollout it gets an HTTP client of its own."""
    from anthropic import AsyncAnthropic

    root = base_url.rstrip("/").removesuffix("/v1")
    http = _ANTHROPIC_HTTP.get()
    return AsyncAnthropic(base_url=root, api_key=api_key, http_client=http, **options)


class OpenAIAgentWorkflow(Workflow):
    """Run `agent(base_url, api_key, task)` (an async function using e.g. `openai.AsyncOpenAI`)
    against a recording session of the gateway.

    The agent returns its reward (a float, or `(reward, is_correct)`), or anything that
    `reward_fn(task, result)` scores. The model is named `model` (default "policy"); leave
    temperature and top_p unset in the agent, the session samples with the rollout's.
    """

    def __init__(
        self,
        agent: str | AgentFn,
        reward_fn: str | Callable[[dict[str, Any], Any], Any] | None = None,
        model: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_calls_per_session: int = 1_000,
        constraints: str = "enforce",
    ) -> None:
        self.agent: AgentFn = load(agent, "workflow.args.agent")
        self.reward_fn = load(reward_fn, "workflow.args.reward_fn") if reward_fn else None
        self.model = model
        self.host = host
        self.port = port
        # A key per run by default, so that nothing else on the machine can use the trainer's policy.
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.max_calls_per_session = max_calls_per_session
        # The gateway's forced tool calls and JSON formats: enforce or check (rollout.constraints).
        self.constraints = constraints
        self.gateway: Gateway | None = None
        self.http: DefaultAsyncHttpxClient | None = None  # every rollout's agent shares it
        self.anthropic_http: AnthropicHttpxClient | None = None  # the same, for `anthropic`

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        gateway = self.gateway
        if gateway is None:
            raise RuntimeError(
                "OpenAIAgentWorkflow.run() before start(policy): the trainer starts the workflow's "
                "gateway; outside it, `await workflow.start(policy)` first and `close()` after"
            )
        session = gateway.session(ctx)
        token = _HTTP.set(self.http)
        anthropic_token = _ANTHROPIC_HTTP.set(self.anthropic_http)
        try:
            result = await self.agent(f"{gateway.url}/v1", session.key, task)
        finally:
            _ANTHROPIC_HTTP.reset(anthropic_token)
            _HTTP.reset(token)
            gateway.sessions.close(session.id)
        if self.reward_fn is not None:
            reward, correct = score(self.reward_fn, task, result)
        elif isinstance(result, (int, float, tuple)):
            reward, correct = score(lambda: result)
        else:
            raise TypeError(
                f"the agent returned {type(result).__name__}: return a reward (or (reward, "
                "is_correct)), or give workflow.args.reward_fn to score what it returns"
            )
        ctx.set_reward(reward)
        episode = ctx.build_episode(None)
        episode.is_correct = correct
        episode.metrics["calls"] = float(session.calls)
        return episode

    async def start(self, policy: PolicyClient) -> None:
        """Start the gateway over `policy` and the agents' shared HTTP client; once ready."""
        from rllm_async.gateway import Gateway

        gateway = Gateway(
            policy,
            model=self.model,
            api_key=self.api_key,
            max_calls_per_session=self.max_calls_per_session,
            constraints=self.constraints,
        )
        await gateway.start(self.host, self.port)
        self.gateway, self.http = gateway, _http_client()
        self.anthropic_http = _anthropic_http_client()

    async def close(self) -> None:
        """Stop the gateway and close the shared HTTP client (the trainer calls this at the end)."""
        try:
            if self.http is not None:
                await self.http.aclose()
            if self.anthropic_http is not None:
                await self.anthropic_http.aclose()
        finally:
            if self.gateway is not None:
                await self.gateway.stop()
            self.gateway, self.http, self.anthropic_http = None, None, None


def _http_client() -> DefaultAsyncHttpxClient | None:
    """The `openai` package's HTTP client (its httpx flavour, limits and timeouts), when installed."""
    try:
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        return None
    return DefaultAsyncHttpxClient()


def _anthropic_http_client() -> AnthropicHttpxClient | None:
    """The `anthropic` package's HTTP client, when installed."""
    try:
        from anthropic import DefaultAsyncHttpxClient
    except ImportError:
        return None
    return DefaultAsyncHttpxClient()
