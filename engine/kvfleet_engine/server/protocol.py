"""OpenAI-compatible request and response models (the subset kvfleet implements).

Requests forbid unknown fields, so a typo or a parameter we do not implement is a 400 naming
it rather than a silent no-op. Parameters that OpenAI defines but kvfleet cannot honour yet
(`logit_bias`, `tools`, `echo`, ...) are declared so the schema documents them, and are
rejected by `unsupported_fields` when a client sets them. Null for an optional field means its
default, for every field, as OpenAI's schema has it (null `n`, `stream`, `max_tokens`, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvfleet_engine.sampling import (
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
)

# --- requests --------------------------------------------------------------------------------


def _unicode_text(value: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"); no tokenizer can encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"must be valid Unicode text: a lone UTF-16 surrogate {value[exc.start]!r} at "
            f"character {exc.start}"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]  # every request string the server reads
NonNegInt = Annotated[int, Field(ge=0)]
# Every list a request may make long stops at its first bad element (fail_fast) and at its
# length cap: a 4 MiB body of a million bad elements made a million errors, each converted
# for the 400, and held the API process (and /health) for 7-33 s at up to 5.7 GB.
TokenIds = Annotated[list[NonNegInt], Field(min_length=1, fail_fast=True)]
# Engine requests one HTTP request may become (prompts times n): beyond it, one client's batch
# would hold the scheduler for everyone else; larger batches go in several requests. The
# prompts' list is capped at it here, n times the prompts by the server.
MAX_CHOICES_PER_REQUEST = 256
# OpenAI's own caps: 128 tools, 300 logit_bias entries.
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
MAX_CONTENT_PARTS = 4096

# Stop strings are searched for after every generated token, so their number and length bound
# the work of each token (OpenAI allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024
StopText = Annotated[
    str, Field(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_unicode_text)
]
# Each message goes through the chat template before anything counts its tokens.
MAX_MESSAGES = 4096


class RequestModel(BaseModel):
    """A JSON object of a request."""

    # JSON's own types: no "5" for 5, no 1.0 for token id 1, no "yes" for true (an int still
    # passes for a float), and no NaN or Infinity.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drops null from optional fields, which then take their defaults; a required field's
        null (or an unknown field's) stays, to be refused by name."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


class StreamOptions(RequestModel):
    include_usage: bool = False  # send one last chunk with token counts before [DONE]


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: Text | None = None  # accepted for compatibility; not used
    # not implemented: rejected when non-empty
    logit_bias: Annotated[dict[Text, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # kvfleet / vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    stop_token_ids: (
        Annotated[list[NonNegInt], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None
    ) = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int | None = Field(
        default=None,
        ge=-(2**31),
        le=2**31 - 1,
        description="Scheduling priority; lower runs first. Overrides the X-Priority header.",
    )


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_CHOICES_PER_REQUEST, fail_fast=True)]
        | TokenIds
        | Annotated[list[TokenIds], Field(max_length=MAX_CHOICES_PER_REQUEST, fail_fast=True)]
    ) = Field(description="A string, a list of strings, token ids, or a list of token-id lists.")
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # not implemented: rejected when true
    suffix: Text | None = None  # not implemented: rejected when set
    best_of: int | None = Field(default=None, ge=1, le=128)  # only best_of == n accepted


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)] | None
    ) = Field(default=None, validate_default=True)
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        # OpenAI's rule: only an assistant turn may come without content (its tool calls).
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise ValueError(f"is required in a {role} message")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # not implemented: rejected when set
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = (
        None
    )
    tool_choice: Text | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def unsupported_fields(request: SamplingFields) -> list[tuple[str, str]]:
    """(field, reason) for every declared-but-unimplemented parameter the client set."""
    found: list[tuple[str, str]] = []
    if request.logit_bias:
        found.append(("logit_bias", "is not supported"))
    if isinstance(request, CompletionRequest):
        if request.echo:
            found.append(("echo", "is not supported"))
        if request.suffix:
            found.append(("suffix", "is not supported"))
        if request.best_of is not None and request.best_of != request.n:
            found.append(("best_of", "must equal n (beam/best-of search is not supported)"))
    if isinstance(request, ChatCompletionRequest):
        if request.tools:
            found.append(("tools", "tool calling is not supported"))
        if request.tool_choice not in (None, "none"):
            found.append(("tool_choice", "tool calling is not supported"))
        if request.parallel_tool_calls:
            found.append(("parallel_tool_calls", "tool calling is not supported"))
        if request.response_format is not None and request.response_format != {"type": "text"}:
            found.append(("response_format", "only {'type': 'text'} is supported"))
        if request.top_logprobs and not request.logprobs:
            found.append(("top_logprobs", "requires logprobs=true"))
    if request.stream_options is not None and not request.stream:
        found.append(("stream_options", "is only allowed when stream=true"))
    return found


# --- responses -------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfleet"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
