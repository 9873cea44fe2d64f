"""`RolloutContext`: the policy as one rollout sees it, recording every model call as a Step."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol

from rllm_async.protocols import Completion, PolicyClient, SamplingParams
from rllm_async.rollout.chat import ChatHistory
from rllm_async.rollout.deadline import Deadline
from rllm_async.rollout.pause import Pause, SyncPause
from rllm_async.rollout.reply_parser import ReplyParser, reply_parser
from rllm_async.rollout.tool_calls import tool_schemas
from rllm_async.types import Episode, Step, StepRef, Termination, Trajectory

COMPACT_PROMPT = (
    "Summarize the conversation so far: the task, what was done and what was learned, "
    "everything needed to go on. Reply with the summary only."
)
SUMMARY_TEMPLATE = "A summary of the conversation so far:\n{summary}"


class ContextLengthError(ValueError):
    """A prompt leaves no room for a completion in the policy's context (`max_context_tokens`)."""


class ChatTemplateError(ValueError):
    """The policy's chat template refused the messages (an unknown role, an order it forbids)."""


@dataclass(slots=True)
class ChatTurn:
    """One `RolloutContext.chat_turn`: the reply message, the recorded Step, and what was parsed.

    `message` is an OpenAI-style assistant message (`content`; `reasoning_content` when the model
    reasoned, as its family writes it; `tool_calls` when tools were given and the model called
    them), read by the context's `parser`; `tool_call_errors` names the malformed calls, which stay in
    `content`; `extended` tells whether the prompt extended an earlier turn's exact tokens.
    """

    message: dict[str, Any]
    step: Step
    tool_call_errors: list[str] = field(default_factory=list)
    extended: bool = False

    @property
    def finish_reason(self) -> str:
        """`tool_calls`, `stop` or `length`, as in the OpenAI API."""
        if self.message.get("tool_calls"):
            return "tool_calls"
        return str(self.step.info.get("finish_reason", "stop"))


class CallMeter(Protocol):
    """Told when each model call of a rollout begins and ends (its wait for a weight sync
    included), which it times on its own clock: the workload record's view of the engine's load."""

    def call_began(self) -> None: ...

    def call_ended(self) -> None: ...


class RolloutContext:
    """The policy as one rollout sees it: every call is recorded as a Step of the calling actor.

    With `pin=True` the first call fixes the policy version for the whole episode; a `version`
    acquired by the caller (evaluation) pins every call to it. Every call waits while `pause` is
    on (the coordinator's, for a weight sync); that wait is not charged to the episode: it moves
    the deadline, and every `timeout()` scope with it.

    `parser` reads the replies of chat calls (tool calls, reasoning) in the policy's model family;
    by default it is detected from the policy's tokenizer (`reply_parser`).

    Per-step rewards (`set_step_reward`) are added to the actor's outcome reward (`set_reward`, or
    the float `run` returns) when the episode is built: the trajectory's reward, which the group
    advantage uses, is the outcome plus the sum of its steps' rewards.

    `spawn(role)` and `fork()` return a context of a branch of the rollout's tree: a trajectory
    of its own (named `role`, which groups it for the advantage), linked to the step it branched
    from, sampled on the same pinned version and deadline. A branch's reward is the episode's
    reward unless the workflow gives its own (`set_reward` on the branch), plus its steps'
    rewards (`build_episode`).
    """

    def __init__(
        self,
        policy: PolicyClient,
        *,
        sampling: SamplingParams,
        pin: bool,
        deadline: float,
        pause: Pause | None = None,
        task_id: str,
        rollout_index: int = 0,
        attempt: int = 0,
        version: int | None = None,
        parser: ReplyParser | None = None,
        meter: CallMeter | None = None,
    ) -> None:
        self.policy = policy
        # Prompt + completion tokens the policy fits, when its client says (`max_context_tokens`).
        limit = getattr(policy, "max_context_tokens", None)
        self.max_context_tokens = int(limit) if isinstance(limit, int) else None
        self.parser = parser or reply_parser(policy.tokenizer)
        self.sampling = sampling
        self._deadline = deadline
        # The `timeout()` scopes made, by their margins (one left only keeps its time when moved).
        self._scopes: dict[Deadline, float] = {}
        self.task_id = task_id
        self.rollout_index = rollout_index
        self.attempt = attempt
        self._pin = pin or version is not None
        self.pause: Pause = pause if pause is not None else SyncPause()
        self._version = version
        self._owns_version = False
        self._trajectories: dict[str, Trajectory] = {}
        self._chats: dict[str, ChatHistory] = {}
        self._meter = meter
        # Why the rollout's infrastructure failed, once a workflow says so (`mark_infra_failed`).
        self._infra_failure: str | None = None
        # The tree: the root context owns the version, deadline and pause; a branch's context
        # (`spawn`, `fork`) shares its records and names its own node.
        self._root: RolloutContext = self
        self._node: str | None = None
        self._own_rewards: set[str] = set()  # branches whose reward the workflow gave
        self._branches = 0

    @property
    def deadline(self) -> float:
        """When this episode must end, on the event loop's clock; later by every sync it waited for."""
        return self._root._deadline

    def timeout(self, margin_s: float = 0.0) -> Deadline:
        """A scope that raises TimeoutError `margin_s` before the deadline, and moves with it:
        `with ctx.timeout(margin_s):` (or `async with`, as with `asyncio.timeout`)."""
        root = self._root
        scope = Deadline(root._deadline - margin_s)
        root._scopes[scope] = margin_s
        return scope

    @property
    def time_left(self) -> float:
        """Seconds until this episode's deadline, on the event loop's clock."""
        return self.deadline - asyncio.get_running_loop().time()

    @property
    def pinned_version(self) -> int | None:
        return self._root._version

    @property
    def node(self) -> str | None:
        """This branch's node id in the rollout's tree; None for the rollout's own context."""
        return self._node

    @property
    def role(self) -> str | None:
        """This branch's role (its trajectory's `name`); None for the rollout's own context."""
        return None if self._node is None else self._trajectories[self._node].name

    def _key(self, actor: str) -> str:
        """The trajectory that `actor` names: in a branch's context, only its own."""
        if self._node is None:
            return actor
        if actor not in ("default", self._trajectories[self._node].name):
            raise ValueError(
                f"actor {actor!r}: a branch's context records its own trajectory only; "
                "spawn a branch for another actor"
            )
        return self._node

    def spawn(self, role: str, *, actor: str = "default") -> RolloutContext:
        """A subagent: a branch with a conversation of its own, its trajectory named `role`,
        linked to the latest step of this context's trajectory (of `actor`)."""
        return self._branch(role, actor, "spawn")

    def fork(self, role: str | None = None, *, actor: str = "default") -> RolloutContext:
        """A branch that continues from this context's exact tokens: its chat history is a copy
        of this one's, so its next `chat_turn` that continues the conversation extends the latest
        step's prompt and completion; its trajectory is its own (named `role`, by default this
        trajectory's name), linked to that step."""
        return self._branch(role, actor, "fork")

    def _branch(self, role: str | None, actor: str, kind: str) -> RolloutContext:
        root = self._root
        parent = self._key(actor)
        steps = root._trajectories[parent].steps if parent in root._trajectories else []
        name = role or (root._trajectories[parent].name if parent in root._trajectories else actor)
        if not name:
            raise ValueError("a branch needs a role (a non-empty name)")
        node = f"{parent}/{name}.{root._branches}"
        root._branches += 1
        ref = StepRef(parent, len(steps) - 1 if steps else None, kind)
        root._trajectories[node] = Trajectory(name=name, node=node, parent=ref)
        if kind == "fork" and parent in root._chats:
            root._chats[node] = root._chats[parent].copy()
        child = copy.copy(self)
        child._node = node
        return child

    @property
    def num_completion_tokens(self) -> int:
        """Tokens sampled so far in this rollout, by every actor."""
        return sum(t.num_completion_tokens for t in self._trajectories.values())

    def trajectories(self) -> list[Trajectory]:
        """Every trajectory of the rollout recorded so far, every branch's included (rewards not
        yet combined; see build_episode)."""
        return list(self._trajectories.values())

    def chat_history(self, actor: str = "default") -> ChatHistory:
        """The chat turns of `actor` so far, which later turns' prompts extend (`chat_turn`)."""
        key = self._key(actor)
        history = self._chats.get(key)
        if history is None:
            history = self._chats[key] = ChatHistory()
        return history

    def trajectory(self, actor: str = "default") -> Trajectory:
        """The trajectory of `actor` (in a branch's context, the branch's own)."""
        key = self._key(actor)
        traj = self._trajectories.get(key)
        if traj is None:
            traj = self._trajectories[key] = Trajectory(name=key)
        return traj

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        actor: str = "default",
        messages: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Sample a completion for exact prompt tokens and record it as the latest Step of `actor`."""
        limit = self.max_context_tokens
        if limit is not None and len(prompt_ids) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens and the policy's context is {limit}: "
                "shorten the conversation or raise the backend's context (backend.max_seq_len)"
            )
        params = self.sampling.updated(**sampling)
        if params.structured is not None and not getattr(self.policy, "constrains_decoding", False):
            raise ValueError(
                "a decoding constraint (structured) was given but this policy's engine cannot "
                "constrain decoding (the local sampler, the sim and the vLLM engine, "
                "backend.rollout: vllm, can): check the reply after sampling instead"
            )
        root = self._root
        meter = root._meter
        if meter is not None:
            meter.call_began()
        try:
            if root.pause.paused:
                await root._wait_out_sync()
            if root._pin and root._version is None:
                root._version = self.policy.acquire()
                root._owns_version = True
            out = await self.policy.generate(prompt_ids, params, version=root._version)
        finally:
            if meter is not None:
                meter.call_ended()
        step = Step(
            prompt_ids=list(prompt_ids),
            completion_ids=out.ids,
            logprobs=out.logprobs,
            versions=out.versions,
            messages=copy.deepcopy(messages) if messages is not None else None,
            info={"finish_reason": out.finish_reason},
        )
        if params.structured is not None:
            step.info["structured"] = params.structured  # the tokens were sampled under it
        self.trajectory(actor).steps.append(step)
        return out

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        actor: str = "default",
        **sampling: Any,
    ) -> dict[str, Any]:
        """Render `messages` with the policy's chat template, sample, and return the reply message.

        See `chat_turn`; this returns its `message`.
        """
        return (await self.chat_turn(messages, tools=tools, actor=actor, **sampling)).message

    async def chat_turn(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        actor: str = "default",
        prefix: str = "",
        template_kwargs: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> ChatTurn:
        """One chat call, token-in/token-out: when `messages` continue an earlier reply of `actor`
        (its call's messages, then the reply), the prompt is that call's exact prompt + completion
        tokens followed by the rendering of only the new messages; otherwise the whole chat is
        rendered. With `tools`, tool calls in the reply are parsed into OpenAI-style `tool_calls`,
        in the syntax of the policy's model family (`parser`).
        `prefix` opens the reply in the prompt (a forced tool call): its tokens are prompt tokens,
        never trained as the model's choice. `template_kwargs` go to the chat template.

        The step keeps a deep copy of `messages` as they were at this call. Raises
        `ContextLengthError` when the prompt does not fit the policy's context and
        `ChatTemplateError` when the template cannot render the messages.
        """
        tok = self.policy.tokenizer
        history = self.chat_history(actor)
        try:
            prompt_ids, extended = history.prompt(tok, messages, tools, template_kwargs)
        except Exception as e:  # templates raise anything, jinja2 errors included
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        prompt_ids += tok.encode(prefix)
        out = await self.generate(prompt_ids, actor=actor, messages=messages, **sampling)
        step = self.trajectory(actor).steps[-1]
        parsed = self.parser.read(
            tok,
            prompt_ids,
            out.ids,
            prefix=prefix,
            stop=sampling.get("stop", self.sampling.stop),
            tools=tools,
            id_prefix=f"call_{actor}_{len(self.trajectory(actor).steps) - 1}",
        )
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        step.info["extended"] = extended
        if prefix:
            step.info["forced_prefix"] = prefix
        history.add(messages, message, tools, step.prompt_ids, step.completion_ids, template_kwargs)
        return ChatTurn(copy.deepcopy(message), step, parsed.errors, extended)

    async def compact(
        self,
        messages: list[dict[str, Any]],
        *,
        budget_tokens: int,
        tools: list[dict[str, Any]] | None = None,
        prompt: str = COMPACT_PROMPT,
        summary_template: str = SUMMARY_TEMPLATE,
        actor: str = "default",
        template_kwargs: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """`messages` as they are while the next turn's prompt for them has at most
        `budget_tokens` tokens; past that, compacted by the policy itself.

        Compacting asks the policy to summarize (`messages`, then a user turn `prompt`: a turn
        that extends the conversation's exact tokens, recorded as a step of `actor` with
        `info["compaction"]`, and trained as any step: with the trajectory's, so the episode's,
        credit), and returns the conversation to go on from: the leading system messages and the
        first user message of `messages`, then a user turn `summary_template` with the summary.
        The next turn renders that afresh, so the conversation before and after are separate
        token sequences, each exact. `tools` and `template_kwargs` are the conversation's (the
        summary request renders as its next turn would); `sampling` overrides the summary's
        sampling (`max_tokens`).
        """
        history = self.chat_history(actor)
        try:
            prompt_ids, _ = history.prompt(self.policy.tokenizer, messages, tools, template_kwargs)
        except Exception as e:  # templates raise anything, jinja2 errors included
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        if len(prompt_ids) <= budget_tokens:
            return messages
        request = [*messages, {"role": "user", "content": prompt}]
        turn = await self.chat_turn(
            request, tools=tools, actor=actor, template_kwargs=template_kwargs, **sampling
        )
        turn.step.info["compaction"] = {"prompt_tokens": len(prompt_ids), "budget": budget_tokens}
        summary = turn.message.get("content") or ""
        head = 0
        while head < len(messages) and messages[head].get("role") == "system":
            head += 1
        if head < len(messages) and messages[head].get("role") == "user":
            head += 1
        return [
            *copy.deepcopy(messages[:head]),
            {"role": "user", "content": summary_template.format(summary=summary)},
        ]

    def tool_call_prefix(self, name: str | None) -> str:
        """The opening of a forced tool call in the policy's syntax: `name`'s call, or any call."""
        return self.parser.tool.forced_prefix(name)

    def tool_call_constraint(self, name: str | None, tools: list[dict[str, Any]] | None) -> str:
        """The decoding constraint (`SamplingParams.structured`) of the rest of a forced call after
        `tool_call_prefix(name)`: the name, arguments following the tool's schema, one call."""
        tool = self.parser.tool
        tokens = tool.grammar_tokens(self.policy.tokenizer.encode)
        return json.dumps({"grammar": tool.forced_grammar(name, tool_schemas(tools), tokens)})

    async def _wait_out_sync(self) -> None:
        """Wait while a weight sync pauses model calls, with the deadline stopped meanwhile."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._reschedule(stopped=True)
        try:
            await self.pause.wait()
        finally:
            self._deadline += loop.time() - start
            self._reschedule(stopped=False)

    def _reschedule(self, *, stopped: bool) -> None:
        for scope, margin_s in self._scopes.items():
            scope.reschedule(None if stopped else self._deadline - margin_s)

    def set_reward(self, reward: float, actor: str = "default") -> None:
        """The outcome reward of `actor`; in a branch's context, the branch's own reward, which
        replaces the episode's as its credit."""
        self.trajectory(actor).reward = float(reward)
        if self._node is not None:
            self._own_rewards.add(self._node)

    def set_step_reward(self, reward: float, actor: str = "default") -> None:
        """Reward the latest step of `actor` (per-step rewards for multi-turn workflows)."""
        self.trajectory(actor).steps[-1].reward = float(reward)

    def mark_infra_failed(self, reason: str) -> None:
        """Say that this rollout failed through no fault of the model (a tool's server, a sandbox
        or an environment died): whatever `run` then returns is neither scored nor trained, the
        rollout is left out of its group's advantages and counted as `rollout/infra_failed`
        (`rllm_async.infra`). `reason` names what failed; the first one given is kept. Raising
        `rllm_async.infra.InfraError` out of `run` does the same."""
        root = self._root
        if root._infra_failure is None:
            root._infra_failure = reason or "infrastructure failure"

    @property
    def infra_failure(self) -> str | None:
        """Why the rollout's infrastructure failed (`mark_infra_failed` in any of its branches)."""
        return self._root._infra_failure

    def close(self) -> None:
        """Release the pinned snapshot; called once by the trainer when the rollout ends (a
        branch's context has nothing of its own to release)."""
        if self._node is None and self._owns_version and self._version is not None:
            self.policy.release(self._version)
            self._owns_version = False

    def build_episode(self, result: Episode | float | None) -> Episode:
        """Turn what `Workflow.run` returned into an Episode holding this context's trajectories.

        A returned float is the outcome reward of the single top-level trajectory; each of this
        context's top-level trajectories then gets its steps' rewards added, and the episode's
        reward is their sum. Each branch (`spawn`, `fork`) with a step gets its credit: its own
        reward when the workflow gave one, else the episode's, plus its steps' rewards; a branch
        that made no model call is left out.

        In a branch's context, the episode of that branch alone, its reward what the branch's
        credit would be without the episode's (nothing is changed: the rollout's own context
        builds the rollout's episode).
        """
        if self._node is not None:
            return self._branch_episode(result)
        trajs = list(self._trajectories.values())
        top = [t for t in trajs if t.parent is None]
        if isinstance(result, Episode):
            if not result.trajectories:
                result.trajectories = self._credited(_finished(top), result.reward)
            return _checked(result)
        if result is not None:
            if not isinstance(result, (int, float)):
                raise TypeError(
                    f"Workflow.run must return an Episode, a float or None, got {type(result).__name__}"
                )
            if len(top) > 1:
                raise TypeError(
                    "Workflow.run returned a float but recorded several actors; return an Episode "
                    "or use ctx.set_reward(reward, actor=...) and return None"
                )
            for t in top:
                t.reward = float(result)
        _finished(top)
        reward: float = 0
        for t in top:
            reward += t.reward
        if not top:
            reward = float(result or 0.0)
        return _checked(
            Episode(
                task_id=self.task_id,
                trajectories=self._credited(top, reward),
                reward=reward,
                termination=Termination.DONE,
            )
        )

    def _credited(self, top: list[Trajectory], reward: float) -> list[Trajectory]:
        """`top`, then every branch with a step in recording order, each given its credit: its
        own reward, or the episode's `reward`, plus its steps' rewards."""
        out = list(top)
        for key, t in self._trajectories.items():
            if t.parent is None or not t.steps:
                continue
            if key not in self._own_rewards:
                t.reward = float(reward)
            out.append(t)
        _finished(out[len(top) :])
        return out

    def _branch_episode(self, result: Episode | float | None) -> Episode:
        if isinstance(result, Episode):
            return _checked(result)
        traj = self.trajectory()
        if result is not None:
            self.set_reward(float(result))
        reward = traj.reward + sum(s.reward for s in traj.steps if s.reward is not None)
        return _checked(Episode(task_id=self.task_id, trajectories=[traj], reward=reward))


def _finished(trajs: list[Trajectory]) -> list[Trajectory]:
    """`trajs`, each with its steps' rewards added to its reward."""
    for t in trajs:
        step_rewards: float = 0
        rewarded = False
        for s in t.steps:
            if s.reward is not None:
                step_rewards += s.reward
                rewarded = True
        if rewarded:
            t.reward += step_rewards
    return trajs


def _checked(episode: Episode) -> Episode:
    """`episode`, or ValueError when its reward or a metric is not a finite number."""
    if not math.isfinite(episode.reward):
        raise ValueError(f"the workflow returned a non-finite reward {episode.reward}")
    for key, value in episode.metrics.items():
        if not (isinstance(key, str) and isinstance(value, numbers.Real) and math.isfinite(value)):
            raise ValueError(
                f"Episode.metrics[{key!r}] is {value!r}: report finite numbers under string keys"
            )
    return episode
