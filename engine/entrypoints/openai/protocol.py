"""Pydantic request/response models of the OpenAI-compatible API (plus vLLM's extras).

Requests accept unknown fields (the ``openai`` client and other tools send fields this
server does not use); the serving layer logs them as ignored, as vLLM does. Fields that
change what the model must do but are not implemented (legacy ``functions``, ``suffix``)
are rejected with a 400 by the serving layer, never ignored. Structured output
(``response_format``, vLLM's ``guided_*`` and ``structured_outputs``) is accepted by both
completions and chat; ``tools`` / ``tool_choice`` by chat.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integers the engine carries as int64 (msgpack): larger values are a 400, not a crash.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


# -- errors -------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    object: Literal["error"] = "error"
    error: ErrorInfo


# -- shared request fields ----------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class SamplingRequest(OpenAIBaseModel):
    """Fields common to completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: Int64 | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    prompt_logprobs: Int64 | None = None
    truncate_prompt_tokens: Int64 | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    # Structured output (see engine.structured_output.openai_fields): at most one source.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = False
    best_of: Int64 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        message.update(self.model_extra or {})
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template already holds BOS etc.


# -- responses ----------------------------------------------------------------------------
class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    # ToolCallDelta.to_openai() items: the first piece of a call carries id/type/name.
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# -- models -------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "engine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# -- tokenize / detokenize ----------------------------------------------------------------
class TokenizeRequest(OpenAIBaseModel):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
