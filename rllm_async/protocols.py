"""The protocols the loop, the backends and the rollout engines share, and the small value types
they exchange: `Backend` and `BackendFactory` (what a backend implements), `PolicyClient` and
`Tokenizer` (what rollouts sample from, whichever backend or engine serves them), `SamplingParams`,
`Completion` and `BackendError`. It lies below both `rllm_async.backends` and
`rllm_async.engines`, so that neither imports the other to reach it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from rllm_async.types import TrajectoryGroup

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rllm_async.config import Config, LossConfig


class BackendError(RuntimeError):
    """An engine or service behind a backend failed for good (a server gone, a refused start);
    the message names it and what to do. The CLI reports it and stops the run."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one completion."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # Where a backend queues requests (the local sampler), a higher value ranks as a later
    # arrival; evaluations running beside training use 1, so that rollouts go first for a while.
    priority: int = 0
    # A decoding constraint in vLLM's structured-outputs vocabulary, as JSON text
    # (`{"json": schema}`, `{"json_object": true}`); only a policy whose `constrains_decoding` is
    # true samples with one (the gateway's `response_format` on the vLLM engine).
    structured: str | None = None
    # The copies `updated` made, by their changes: a run's rollouts ask for the same few again and
    # again, every model call (not a field: no part of equality, hashing or the constructor).
    _copies: dict[tuple[Any, ...], SamplingParams] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def updated(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied, made once for each distinct `changes` (a hot path)."""
        if not changes:
            return self
        # The values' types too: max_tokens=4.0 must not come back as the copy made for 4.
        key = (*changes.items(), *map(type, changes.values()))
        try:
            return self._copies[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value (`stop` as a list): not kept
            key = ()
        if not changes.keys() <= _SAMPLING_FIELDS:
            unknown = changes.keys() - _SAMPLING_FIELDS
            raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
        get = changes.get
        copy = SamplingParams(
            get("temperature", self.temperature),
            get("top_p", self.top_p),
            get("max_tokens", self.max_tokens),
            tuple(get("stop", self.stop)),
            get("seed", self.seed),
            get("priority", self.priority),
            get("structured", self.structured),
        )
        if key:
            if len(self._copies) >= _MAX_COPIES:
                self._copies.clear()
            self._copies[key] = copy
        return copy


_MAX_COPIES = 1024  # distinct changes kept per SamplingParams
_SAMPLING_FIELDS = frozenset(
    ("temperature", "top_p", "max_tokens", "stop", "seed", "priority", "structured")
)


@dataclass(slots=True)
class Completion:
    """What the sampler produced: tokens, their logprobs and the policy version of each token."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"  # stop | length


class Tokenizer(Protocol):
    """Text <-> tokens and the chat template of a policy's model.

    A tokenizer may also expose what the reply parser (`rllm_async.rollout.reply_parser`) reads:
    `model_type` and `chat_template` (strings, to detect the model family) and
    `parse_response(text, prompt_ids, tools) -> dict | None` (its checkpoint's own parser).
    """

    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The chat's tokens; `template_kwargs` (`reasoning_effort`, `enable_thinking`, ...) are
        variables the template may read, and ones it does not read change nothing."""
        ...


class PolicyClient(Protocol):
    """Samples from the policy and tags every token with the version that produced it.

    `acquire()` returns the current version and keeps its weights alive until `release(version)`;
    `generate(..., version=v)` samples with those weights (`weight_update: pin`), and
    `version=None` samples with the newest weights (`weight_update: latest`). A client may also
    expose `max_context_tokens: int` (prompt + completion), which chat calls and the gateway check.
    """

    @property
    def tokenizer(self) -> Tokenizer: ...

    def acquire(self) -> int: ...

    def release(self, version: int) -> None: ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion: ...


@runtime_checkable
class Backend(Protocol):
    """Where the compute lives. The trainer owns the version counter and drives these calls.

    Gradients from successive `forward_backward` calls accumulate until `optim_step`; the loss is
    normalized by the whole optimizer step's totals, so the split into micro-batches is invisible.
    `save` writes the state as of the last `optim_step` (a run interrupted mid-step saves then);
    a backend that cannot, raises RuntimeError.
    """

    def policy(self) -> PolicyClient: ...

    async def forward_backward(
        self, groups: list[TrajectoryGroup], loss: LossConfig
    ) -> dict[str, float]: ...

    async def optim_step(self) -> dict[str, float]: ...

    async def on_policy_updated(self, version: int) -> None: ...

    async def save(self, path: Path) -> None: ...

    async def load(self, path: Path) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class RecomputesLogprobs(Protocol):
    """A backend that can take the ratio against its own old logprobs
    (`algorithm.loss.behaviour_logprobs: recomputed`). `forward_backward` at a batch's first
    optimizer step keeps its own logprobs as the old ones; `recompute_logprobs` keeps them for
    groups first trained after that step, and is called before it."""

    async def recompute_logprobs(self, groups: list[TrajectoryGroup]) -> None: ...


class BackendFactory(Protocol):
    """What the `rllm_async.backends` entry point names: a class (or object) that builds a backend.

    `options` validates the backend-specific keys of the `backend:` config section; an option the
    backend cannot honour is refused in `from_config` with an error naming what to use instead.
    `virtual_clock` asks the runner for an event loop whose clock is simulated. Optionally, for
    `rllm-async plan` on a recorded run, classmethods answering from its `backend:` options:
    `shares_device(options) -> bool | None` (generation and training on one device) and
    `decode_slots(options) -> int | None` (the most sequences decoded together); None: cannot tell.
    """

    options: ClassVar[type[BaseModel]]
    virtual_clock: ClassVar[bool]

    @classmethod
    def from_config(cls, config: Config) -> Backend: ...
