"""Request bodies the gateway accepts, as pydantic models (also the source of its OpenAPI document).

Unknown fields are refused with a 400, like the OpenAI API does; a few fields that change nothing
here (`user`, `metadata`, `store`, `parallel_tool_calls`, `service_tier`) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
MAX_STOP = 4
MAX_SEED = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; fields clients echo back (`refusal`, `annotations`, ...) are ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

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
        return out


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
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

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (only 0)")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _no_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise ValueError(
                "top_logprobs is not supported: the policy returns the sampled tokens' logprobs only"
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
            raise ValueError(
                "logprobs > 0 is not supported: use logprobs=0 for the sampled tokens' logprobs"
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class OpenSessionRequest(_Strict):
    """`POST /sessions` (standalone `serve` only)."""

    ttl_s: float | None = Field(default=None, gt=0.0, le=86_400.0)
