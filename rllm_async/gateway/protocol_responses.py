"""Request bodies of `POST /v1/responses` (the Responses API), as pydantic models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Tag, model_validator

from rllm_async.gateway.protocol import (
    FieldError,
    JSONSchemaFormat,
    ResponseFormat,
    StrictModel,
    type_discriminator,
)


class InputText(BaseModel):
    """A text part: `input_text`, or `output_text` in a reply the client sends back."""

    type: Literal["input_text", "output_text"]
    text: str


class ReasoningText(BaseModel):
    """A part of a reasoning item sent back: its text, or a summary of it."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class InputMessage(BaseModel):
    """A message item; fields clients echo back from a response (`id`, `status`) are ignored."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(p.text for p in content)


class FunctionCallItem(BaseModel):
    """A `function_call` output item sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A tool's result for the `function_call` with the same `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    @property
    def text(self) -> str:
        output = self.output
        return output if isinstance(output, str) else "".join(p.text for p in output)


class ReasoningItem(BaseModel):
    """A `reasoning` output item sent back: the `reasoning_content` of the assistant message after
    it, as on the chat path (its `reasoning_text` content, else its summary)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []

    @property
    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")],
    type_discriminator(
        {
            "message": "Message",
            "function_call": "FunctionCall",
            "function_call_output": "FunctionCallOutput",
            "reasoning": "Reasoning",
        },
        default="message",
    ),
]


class FunctionTool(StrictModel):
    """A function tool (built-in tools such as `web_search` are refused)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """`text.format`: chat's `response_format` (enforced on the vLLM engine, always checked)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None


class ResponseRequest(StrictModel):
    """`POST /v1/responses`: stateless (the whole conversation in `input`), function tools only."""

    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    # Accepted and ignored: hints for OpenAI's own storage, caching and abuse detection.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Accepted and ignored: limits and options of built-in tools and image inputs (both refused)
    # and OpenAI's access tiers; none changes what the policy samples.
    max_tool_calls: int | None = Field(default=None, ge=0)
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ResponseRequest:
        if self.previous_response_id is not None or self.conversation is not None:
            param = "previous_response_id" if self.previous_response_id else "conversation"
            raise FieldError(
                param, "is not supported: no response is stored; send the whole chat as `input`"
            )
        if self.background:
            raise FieldError("background", "is not supported: responses are answered in the call")
        if self.include:
            raise FieldError("include", "is not supported (only [])")
        if self.top_logprobs:
            raise FieldError("top_logprobs", "is not supported (only 0)")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and (fmt.type == "json_schema") != (fmt.name is not None):
            raise FieldError("text.format.name", "give it exactly when type is json_schema")
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return self
        names = {t.name for t in self.tools or ()}
        if not names:
            raise FieldError("tool_choice", "forcing a tool call needs `tools`")
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise FieldError("tool_choice", f"no tool named {choice.name!r} in `tools`")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools in chat-completions form, as the chat template takes them."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in self.tools
        ]

    @property
    def forced_tool(self) -> str | bool:
        """The function whose call is forced, True for any (`required`), False for none."""
        if isinstance(self.tool_choice, FunctionToolChoice):
            return self.tool_choice.name
        return self.tool_choice == "required"

    @property
    def template_kwargs(self) -> dict[str, Any]:
        effort = self.reasoning.effort if self.reasoning is not None else None
        return {} if effort is None else {"reasoning_effort": effort}

    @property
    def response_format(self) -> ResponseFormat | None:
        """`text.format` as chat's `response_format`, for the same check."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        schema = None
        if fmt.type == "json_schema":
            assert fmt.name is not None
            schema = JSONSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict
            )
        return ResponseFormat(type=fmt.type, json_schema=schema)
