"""What every endpoint shares: the API key, reading the body, naming the session, sampling
overrides, and running a request's model calls with its errors mapped to the client's."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from rllm_async.gateway.conversation import keep_first_call
from rllm_async.gateway.errors import APIError, ErrorShape, error_response, invalid
from rllm_async.gateway.protocol import ResponseFormat, SamplingFields
from rllm_async.gateway.sessions import Session, SessionStore
from rllm_async.gateway.structured import constraint
from rllm_async.grammar import ConstraintError
from rllm_async.protocols import PolicyClient
from rllm_async.rollout import ChatTemplateError, ChatTurn, ContextLengthError, RolloutContext
from rllm_async.types import Step

log = logging.getLogger("rllm_async.gateway")
SESSION_HEADER = "x-session-id"
# Names the subagent a call is for: it records into the session's child of that role.
ROLE_HEADER = "x-agent-role"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


class TemperatureTopP(Protocol):
    """A request that may set temperature and top_p (every API's does)."""

    @property
    def temperature(self) -> float | None: ...

    @property
    def top_p(self) -> float | None: ...


class GatewayState(Protocol):
    """What the handlers read of the gateway they serve (`rllm_async.gateway.server.Gateway`)."""

    policy: PolicyClient
    model: str
    api_key: str | None
    open_sessions: bool
    max_body_bytes: int
    created: int
    sessions: SessionStore
    constraints: str  # enforce | check: whether constraints are enforced while sampling

    def open_session(self, ttl_s: float | None = None, task: str | None = None) -> Session: ...

    @property
    def paused(self) -> bool: ...

    def reward(
        self, session_id: str, reward: float, task: str | None, response_id: str | None = None
    ) -> Session: ...

    def scratch_context(self) -> RolloutContext: ...

    def session_url(self, session_id: str, request: Request | None = None) -> str: ...


class API:
    """The handlers; each one either answers or raises `APIError`."""

    def __init__(self, gateway: GatewayState) -> None:
        self.gw = gateway

    def endpoint(
        self,
        fn: Callable[[API, Request], Awaitable[Response]],
        *,
        auth: bool = True,
        errors: ErrorShape = error_response,
    ) -> Handler:
        """`fn` as a route's handler: authorized, its `APIError`s answered in the `errors` shape."""

        async def run(request: Request) -> Response:
            try:
                request.state.keyed = self._authorize(request) if auth else None
                return await fn(self, request)
            except APIError as e:
                return errors(e.status, e.message, param=e.param, code=e.code)
            except Exception:
                # A request never takes the server (or a trainer in the same process) down.
                log.exception("gateway: unexpected error on %s %s", request.method, request.url)
                return errors(500, "internal error: see the gateway's log")

        return run

    def _authorize(self, request: Request) -> Session | None:
        """Check the API key (`Authorization: Bearer` or `x-api-key`): the gateway's, or an open
        session's (which names that session); an ended session's key is refused."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # `x-api-key` is the Anthropic clients' header.
        bearer = (
            token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        )
        keyed = self.gw.sessions.by_key(bearer) if bearer else None
        if keyed is None and (ended := self.gw.sessions.ended_key(bearer)) is not None:
            # Answered, such a call would be recorded nowhere: the agent must learn its session
            # is over, with or without a gateway key.
            raise APIError(
                401,
                f"the API key of session {ended!r}, which has ended: open a new session",
                code="invalid_api_key",
            )
        key = self.gw.api_key
        if (
            keyed is None
            and key is not None
            and not hmac.compare_digest(bearer.encode(), key.encode())
        ):
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                code="invalid_api_key",
            )
        return keyed

    # -- reading requests -----------------------------------------------------------------------

    async def body(self, request: Request, model: type[M]) -> M:
        limit = self.gw.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body over {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks) or b"{}")
        except (ValueError, RecursionError):
            raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise invalid(e) from None
        except RecursionError:
            raise APIError(400, "the body is nested too deeply", code="invalid_json") from None

    def session(self, request: Request, *, role: bool = True) -> Session | None:
        """The session a call records into: named by the path, the `X-Session-Id` header or the
        API key (one of them, or several that agree), else none; with an `X-Agent-Role` header
        (unless `role` is False), that session's child of the role (`Session.child`)."""
        keyed: Session | None = request.state.keyed
        sid = request.path_params.get("sid") or request.headers.get(SESSION_HEADER)
        session = keyed if sid is None else self.gw.sessions.get(sid)
        if sid is not None and keyed is not None and keyed is not session:
            raise APIError(
                403, "the API key belongs to another session", code="session_key_mismatch"
            )
        name = request.headers.get(ROLE_HEADER) if role else None
        if session is not None and name:
            if len(name) > 128:
                raise APIError(400, "X-Agent-Role: at most 128 characters", code="invalid_header")
            session = session.child(name)
        return session

    def check_model(self, name: str) -> None:
        if name != self.gw.model:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this gateway serves {self.gw.model!r}",
                param="model",
                code="model_not_found",
            )

    def sampling(self, req: SamplingFields, session: Session | None, index: int) -> dict[str, Any]:
        """Sampling overrides for one choice; a locked session keeps its temperature and top_p."""
        out = self.temperature_top_p(req, session)
        if (limit := getattr(req, "token_limit", None)) is not None:
            out["max_tokens"] = limit
        if req.stop is not None:
            out["stop"] = req.stops
        if req.seed is not None:
            out["seed"] = (req.seed + index) % (2**63)
        return out

    def constraint(
        self,
        ctx: RolloutContext,
        forced: str | bool,
        tools: list[dict[str, Any]] | None,
        fmt: ResponseFormat | None,
        format_param: str = "response_format",
    ) -> dict[str, Any]:
        """The decoding constraint of a request (`structured`), enforced unless the gateway only
        checks (`constraints: check`): a forced call's grammar, else `fmt`'s JSON. Where the
        policy's engine cannot constrain decoding, a request that needs one is refused."""
        rule = constraint(fmt)
        if (forced is False and rule is None) or self.gw.constraints == "check":
            return {}
        if not getattr(self.gw.policy, "constrains_decoding", False):
            what, param = (
                ("forces a tool call (tool_choice)", "tool_choice")
                if forced is not False
                else (f"asks for JSON ({format_param})", format_param)
            )
            raise APIError(
                400,
                f"the request {what}, which this gateway enforces while sampling "
                "(rollout.constraints: enforce), but the policy's engine cannot constrain "
                "decoding: serve with an engine that can (the local sampler, backend.name: "
                "local; or vLLM, backend.rollout: vllm), or set rollout.constraints: check to "
                "only check the reply",
                param=param,
                code="constraint_not_enforceable",
            )
        if forced is not False:
            rule = ctx.tool_call_constraint(None if forced is True else forced, tools)
        return {"structured": rule}

    def temperature_top_p(self, req: TemperatureTopP, session: Session | None) -> dict[str, Any]:
        """The request's temperature and top_p; a locked session refuses values other than its own."""
        out: dict[str, Any] = {}
        if session is not None and session.locked:
            base = session.ctx.sampling
            for name in ("temperature", "top_p"):
                value = getattr(req, name)
                if value is not None and value != getattr(base, name):
                    raise APIError(
                        400,
                        f"{name}={value}: this session samples with {name}={getattr(base, name)}, "
                        "which the trainer's loss assumes; leave it unset",
                        param=name,
                        code="invalid_parameter",
                    )
        else:
            out.update(
                {k: v for k in ("temperature", "top_p") if (v := getattr(req, k)) is not None}
            )
        return out

    async def run(
        self,
        request: Request,
        session: Session | None,
        make: Callable[[], list[Awaitable[T]]],
        prompt_param: str = "messages",
    ) -> list[T]:
        """Run one request's model calls, cancelled if the client hangs up meanwhile; map what can
        go wrong to the client's errors."""

        async def run_all() -> list[T]:
            tasks = [asyncio.ensure_future(c) for c in make()]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:  # the others, when one failed
                    task.cancel()

        try:
            return await unless_disconnected(
                request, run_all() if session is None else session.call(run_all)
            )
        except ContextLengthError as e:
            raise APIError(
                400, str(e), param=prompt_param, code="context_length_exceeded"
            ) from None
        except ChatTemplateError as e:
            raise APIError(400, str(e), param=prompt_param, code="invalid_messages") from None
        except ConstraintError as e:
            raise APIError(400, str(e), code="invalid_constraint") from None
        except RuntimeError as e:
            raise APIError(
                503, f"the policy is unavailable: {e}", code="policy_unavailable"
            ) from None

    def context(self, session: Session | None) -> RolloutContext:
        """The session's context, or a scratch one (recording nothing) outside any session."""
        return session.ctx if session is not None else self.gw.scratch_context()

    async def chat_turn(
        self,
        request: Request,
        session: Session | None,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        forced: str | bool,
        template_kwargs: dict[str, Any],
        sampling: dict[str, Any],
        prompt_param: str,
        parallel: bool = True,
        response_format: ResponseFormat | None = None,
        format_param: str = "response_format",
    ) -> ChatTurn:
        """One chat turn (Responses and Messages requests), a forced tool call opened in the prompt
        and sampled under its grammar (`constraint`); without `parallel` tool calls, cut after its
        first call (`keep_first_call`)."""
        ctx = self.context(session)
        prefix = forced_prefix(ctx, forced)
        sampling = {
            **sampling,
            **self.constraint(ctx, forced, tools, response_format, format_param),
        }
        [turn] = await self.run(
            request,
            session,
            lambda: [
                ctx.chat_turn(
                    messages,
                    tools=tools,
                    prefix=prefix,
                    template_kwargs=template_kwargs or None,
                    **sampling,
                )
            ],
            prompt_param=prompt_param,
        )
        if not parallel:
            stop = sampling.get("stop", ctx.sampling.stop)
            keep_first_call(
                ctx,
                turn,
                messages,
                tools=tools,
                prefix=prefix,
                template_kwargs=template_kwargs or None,
                stop=stop,
            )
        return turn


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled when the client disconnects first (a client that timed out while a weight
    sync held its call, and retries), so that no reply it never saw is recorded."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, hangup), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled() and hangup.done() and not hangup.cancelled():
        raise APIError(499, "the client disconnected before the reply", code="client_disconnected")
    return task.result()


async def _disconnect(request: Request) -> None:
    """Until the client disconnects (the body has been read: the next message is the hang-up)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def name_reply(reply_id: str, steps: list[Step]) -> None:
    """Mark the recorded steps of a reply with the `id` the client got, so that a per-call reward
    (`POST /sessions/{id}/reward` with `response_id`) finds them."""
    for step in steps:
        step.info["reply_id"] = reply_id


def note_forced(forced: str | bool, turns: list[ChatTurn]) -> dict[str, str]:
    """For a forced call, say in each recorded step's info and the `X-Tool-Choice-Enforcement`
    header whether the call was sampled under its grammar (`enforced`) or only opened in the
    prompt and its reply parsed (`checked`)."""
    if forced is False:
        return {}
    verdicts = []
    for turn in turns:
        enforced = "structured" in turn.step.info
        turn.step.info["tool_choice"] = {"forced": forced, "enforced": enforced}
        verdicts.append("enforced" if enforced else "checked")
    return {"X-Tool-Choice-Enforcement": ",".join(verdicts)}


def forced_prefix(ctx: RolloutContext, forced: str | bool) -> str:
    """The prompt's opening of a forced call: `forced` names the function, True any, False none."""
    return "" if forced is False else ctx.tool_call_prefix(None if forced is True else forced)
