"""Request bodies of `POST /v1/messages` (the Anthropic Messages API), as pydantic models.

Content blocks ignore the fields clients echo back from a reply (`citations`, `caller`,
`cache_control`); the request itself refuses unknown fields, and each accepted field is
implemented or changes nothing the policy samples (docs/gateway.md lists which).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Tag, model_validator

from rllm_async.gateway.protocol import FieldError, StrictModel, type_discriminator

MAX_STOP_SEQUENCES = 16


class TextBlockParam(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(BaseModel):
    """A tool call of an earlier reply, sent back."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(BaseModel):
    """A tool's result for the `tool_use` with the id `tool_use_id` (text only)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        content = self.content
        return "".join(b.text for b in content) if isinstance(content, list) else content or ""


class ThinkingBlockParam(BaseModel):
    """Reasoning of an earlier reply, sent back: the assistant message's `reasoning_content`, as on
    the chat path (`redacted_thinking` has no text to give)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""


ContentBlock = Annotated[
    Annotated[TextBlockParam, Tag("Text")]
    | Annotated[ToolUseBlockParam, Tag("ToolUse")]
    | Annotated[ToolResultBlockParam, Tag("ToolResult")]
    | Annotated[ThinkingBlockParam, Tag("Thinking")],
    type_discriminator(
        {
            "text": "Text",
            "tool_use": "ToolUse",
            "tool_result": "ToolResult",
            "thinking": "Thinking",
            "redacted_thinking": "Thinking",
        }
    ),
]


class MessageParam(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(StrictModel):
    """A client tool (server tools such as `web_search_20250305` are refused)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        """The tool in chat-completions form, as the chat template takes it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(StrictModel):
    """`auto`, `any` (a call is forced), `tool` (the call of `name` is forced) or `none`."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_given(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise FieldError("tool_choice.name", "give it exactly when type is tool")
        return self


class ThinkingConfig(StrictModel):
    """Extended thinking: the model reasons as its chat template makes it, whatever this says."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class MessagesPrompt(StrictModel):
    """What a prompt is made of: the fields `POST /v1/messages` shares with `count_tokens`."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Accepted and ignored: hints for Anthropic's caching, speed and attribution; none changes
    # what the policy samples.
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _tool_choice(self) -> MessagesPrompt:
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return self
        names = {t.name for t in self.tools or ()}
        if not names:
            raise FieldError("tool_choice", "forcing a tool call needs `tools`")
        if choice.name is not None and choice.name not in names:
            raise FieldError("tool_choice", f"no tool named {choice.name!r} in `tools`")
        return self

    @property
    def system_text(self) -> str | None:
        system = self.system
        return "".join(b.text for b in system) if isinstance(system, list) else system

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        return [t.to_chat() for t in self.tools]

    @property
    def forced_tool(self) -> str | bool:
        """The tool whose call is forced, True for any (`any`), False for none."""
        choice = self.tool_choice
        if choice is None:
            return False
        return choice.name if choice.name is not None else choice.type == "any"


class CountTokensRequest(MessagesPrompt):
    """`POST /v1/messages/count_tokens`: the prompt a `messages` call would render."""


class MessagesRequest(MessagesPrompt):
    """`POST /v1/messages`: the whole conversation in `messages`, client tools only."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    stream: bool = False
    # Accepted and ignored: hints for Anthropic's abuse detection, capacity, region and cache
    # diagnostics; none changes what the policy samples.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> MessagesRequest:
        stops = self.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise FieldError("stop_sequences", f"at most {MAX_STOP_SEQUENCES} non-empty strings")
        if self.top_k is not None:
            # The policy's sampler cannot apply it, and the trainer's logprobs assume it did not.
            raise FieldError("top_k", "is not supported: the policy samples without a top-k cut")
        return self

    @property
    def parallel_tool_use(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)
