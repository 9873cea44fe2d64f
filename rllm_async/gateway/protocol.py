"""Request bodies of chat and text completions, and what every API's request models share, as
pydantic models (with protocol_responses.py and protocol_anthropic.py, the source of the OpenAPI
document).

Each field of the `openai` package's `CompletionCreateParams` is implemented, accepted and ignored
(it changes nothing the policy samples or the trainer learns: `user`, `metadata`, `store`,
`service_tier`, `prompt_cache_key`, ...), or refused with a 400 naming it (docs/gateway.md lists
which). Unknown fields are refused too, as the OpenAI API does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, model_validator

MAX_N = 16
MAX_STOP = 4
MAX_SEED = 2**63 - 1


class FieldError(ValueError):
    """A model validator's error about one request field (`param` in the 400 the client gets)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def type_discriminator(tags: dict[str, str], default: str | None = None) -> Discriminator:
    """A union's discriminator on its members' `type` (`default` when missing): the tag named in
    `tags` (capitalized, so error locations leave it out), else the unknown type itself."""

    def tag(item: Any) -> str | None:
        kind = item.get("type", default) if isinstance(item, dict) else getattr(item, "type", None)
        return tags.get(kind, kind) if isinstance(kind, str) else None

    return Discriminator(tag)


class StrictModel(BaseModel):
    """A request model: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class TextPart(StrictModel):
    """A text content part; prompt-caching hints (`cache_control`, ...) change nothing here."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; fields clients echo back (`refusal`, `annotations`, ...) are ignored.
    An assistant message's `reasoning_content` (the reasoning a reply came back with) goes to the
    chat template, which may render it (Qwen3's does after the last user turn)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_chat(self) -> dict[str, Any]:
        """The message as workflows and chat templates see it (`developer` is a system turn)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        content = self.content
        out["content"] = (
            "".join(p.text for p in content) if isinstance(content, list) else content or ""
        )
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class FunctionSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(StrictModel):
    """`include_usage` adds a usage chunk; `include_obfuscation` (padding against length side
    channels) is accepted and ignored: chunks are never padded."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """`tool_choice` naming one function: its call is forced."""

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """`response_format`: enforced where the engine constrains decoding, always checked."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError(
                "response_format.json_schema", "give it exactly when type is json_schema"
            )
        return self


class SamplingFields(StrictModel):
    """What chat and text completions share."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    logit_bias: dict[str, int] | None = None

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise FieldError("stop", f"at most {MAX_STOP} non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise FieldError(name, "is not supported (only 0)")
        if self.logit_bias:
            # The policy's sampler cannot apply it, and the trainer's logprobs assume it did not.
            raise FieldError("logit_bias", "is not supported: the policy samples without biases")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None
    # Accepted and ignored: hints for OpenAI's own caching, abuse detection and verbosity.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _supported_tools(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise FieldError(
                "top_logprobs",
                "is not supported: the policy returns the sampled tokens' logprobs only",
            )
        if self.tool_choice in (None, "auto", "none"):
            return self
        names = {t.function.name for t in self.tools or ()}
        if not names:
            raise FieldError("tool_choice", "forcing a tool call needs `tools`")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in (
            names
        ):
            raise FieldError(
                "tool_choice", f"no tool named {self.tool_choice.function.name!r} in `tools`"
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forced_tool(self) -> str | bool:
        """The function whose call is forced, True for any (`required`), False for none."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice == "required"

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with (`chat_template_kwargs`, `reasoning_effort`)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a text prompt, or one prompt of token ids."""

    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _no_top_logprobs(self) -> CompletionRequest:
        if self.logprobs:
            raise FieldError(
                "logprobs", "> 0 is not supported: use logprobs=0 for the sampled tokens' logprobs"
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class OpenSessionRequest(StrictModel):
    """`POST /sessions` (standalone `serve` only); `task` names the episode's group for online
    training (see `RewardRequest`)."""

    ttl_s: float | None = Field(default=None, gt=0.0, le=86_400.0)
    task: str | None = Field(default=None, min_length=1, max_length=512)


class OpenChildRequest(StrictModel):
    """`POST /sessions/{id}/children`: a child session for a subagent of `role`, whose
    trajectory is grouped with the other trajectories of that role for the advantage."""

    role: str = Field(min_length=1, max_length=128)


class RewardRequest(StrictModel):
    """`POST /sessions/{id}/reward`: the episode's reward, a finite number; `task` names its group
    (instead of, or the same as, the key given when the session was opened). With `response_id`
    (the `id` of a chat completion, response or message of the session) it rewards that reply
    alone, added to the episode's reward, and the session stays open."""

    reward: float = Field(strict=True, allow_inf_nan=False)
    task: str | None = Field(default=None, min_length=1, max_length=512)
    response_id: str | None = Field(default=None, min_length=1, max_length=128)
