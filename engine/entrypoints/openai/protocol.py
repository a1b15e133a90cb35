"""Pydantic request/response models of the OpenAI-compatible API (plus vLLM's extras).

Requests accept unknown fields (the ``openai`` client and other tools send fields this
server does not use); the serving layer logs them as ignored, as vLLM does. Known fields
are validated strictly (``false`` is not a token id, ``0`` is not a boolean, ``"2"`` and
``2.5`` are not integers; ``2.0`` is one, as JSON Schema counts), numbers must be
finite, and every range a field has is declared on the field, so the served OpenAPI
schema says what a request may hold and a value outside it is a 400 naming the field.
Fields that change what the model must do but are not implemented (legacy ``functions``,
``suffix``) are rejected with a 400 by the serving layer, never ignored. Structured output
(``response_format``, vLLM's ``guided_*`` and ``structured_outputs``) is accepted by both
completions and chat; ``tools`` / ``tool_choice`` by chat.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from engine.frontend.chat_template import ROLES


def _integral_number(value: Any) -> Any:
    """``2.0`` is an integer to JSON Schema (what the served OpenAPI document promises), so
    it is taken as 2; ``2.5``, ``true`` and ``"2"`` still fail strict validation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integers the engine carries as int64 (msgpack): larger values are a 400, not a crash.
INT64_MAX = 2**63 - 1
_AS_INT = BeforeValidator(_integral_number)  # after Field(): the bounds reach the schema
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX), _AS_INT]
NonNegInt = Annotated[int, Field(ge=0, le=INT64_MAX), _AS_INT]
PosInt = Annotated[int, Field(ge=1, le=INT64_MAX), _AS_INT]
# A token id. Its upper bound (the vocabulary size) belongs to the model: the server checks
# it and writes it into the OpenAPI schema it serves.
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), _AS_INT]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
UnitInterval = Annotated[float, Field(ge=0.0, le=1.0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # a token id as a JSON object key
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body (or a part of one): strict types, finite numbers, unknown fields kept
    (and logged as ignored)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


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
# Rules between fields, for the schema (the serving layer enforces them).
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
_ONE_PROMPT_MODE = {  # continue_final_message needs add_generation_prompt (default true) off
    "if": {"required": ["continue_final_message"],
           "properties": {"continue_final_message": {"const": True}}},
    "then": {"required": ["add_generation_prompt"],
             "properties": {"add_generation_prompt": {"const": False}}},
}
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
_TOOL_SCHEMA = {
    "type": "object", "required": ["function"],
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1},
                       "parameters": {"description": "A JSON Schema object"}}}},
}
_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"const": "function"}, "function": {
         "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "null"},
]}
# What response_format may be (documentation: engine.structured_output.openai_fields
# validates it).
_RESPONSE_FORMAT_SCHEMA = {"oneOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"],
     "properties": {"type": {"const": "json_schema"}, "json_schema": {
         "type": "object", "required": ["schema"],
         "description": "{name, schema, strict}: the output follows `schema`, a JSON Schema "
                        "(vLLM also takes its JSON text)",
         "properties": {"schema": {"type": "object"}},
     }}},
    {"type": "object", "required": ["type", "structures", "triggers"],
     "properties": {"type": {"const": "structural_tag"}, "structures": {"type": "array"},
                    "triggers": {"type": "array"}}},
]}


class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class SamplingRequest(OpenAIRequestModel):
    """Fields common to completions and chat completions (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(json_schema_extra={
        "allOf": [_STREAM_OPTIONS_NEED_STREAM]})

    model: str | None = None
    n: PosInt | None = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    # token id (a decimal string) -> bias added to its logit
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Int64 | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), _AS_INT] | None = None  # 0/-1: off
    min_p: UnitInterval | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    prompt_logprobs: NonNegInt | None = None
    truncate_prompt_tokens: PosInt | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    # Beam search (vLLM's): beam_width = n, choices best first (engine.core.beam_search).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Disaggregated prefill/decode (vLLM's): the KV connector's parameters, e.g.
    # {"do_remote_decode": true} to a producer, or what a producer returned to a consumer.
    kv_transfer_params: dict[str, Any] | None = None
    # Structured output (see engine.structured_output.openai_fields): at most one source.
    # (Not in the schema: a rule over six fields defeats the fuzzers that read it.)
    response_format: dict[str, Any] | None = Field(
        None, json_schema_extra={"anyOf": [_RESPONSE_FORMAT_SCHEMA, {"type": "null"}]})
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: Annotated[str, Field(pattern=r"\S")] | None = None  # not blank
    guided_decoding_backend: str | None = Field(None, json_schema_extra={"anyOf": [
        {"enum": ["auto", "xgrammar", "llguidance", "guidance"]}, {"type": "null"}]})


class CompletionRequest(SamplingRequest):
    # text, texts, token ids, or lists of token ids (several prompts); none may be empty
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: NonNegInt | None = 16  # 0: score the prompt only (echo + logprobs)
    logprobs: NonNegInt | None = None
    echo: bool | None = False
    best_of: PosInt | None = Field(None, description="Unset, or equal to n: extra samples "
                                   "are not generated and ranked")
    suffix: str | None = Field(None, description="Not supported: unset, null or empty",
                               json_schema_extra={"anyOf": [{"type": "string", "maxLength": 0},
                                                            {"type": "null"}]})
    add_special_tokens: bool = True


class ChatTextPart(OpenAIRequestModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIRequestModel):
    # data:image/...;base64,..., http(s):// (--allowed-media-domains) or file://
    # (--allowed-local-media-path); engine.multimodal.media reads it.
    url: NonEmptyStr
    detail: Literal["auto", "low", "high"] | None = None  # accepted; models choose sizes


class ChatImageURLPart(OpenAIRequestModel):
    """An image for a vision-language model (OpenAI's ``image_url``; the URL string alone
    is accepted too, as vLLM does)."""

    type: Literal["image_url"]
    image_url: ImageURL | NonEmptyStr


class ChatInputImagePart(OpenAIRequestModel):
    """The Responses API's spelling of an image part."""

    type: Literal["input_image"]
    image_url: ImageURL | NonEmptyStr


# A part of a message's content: text, or an image (engine.multimodal.chat).
ChatContentPart = Annotated[ChatTextPart | ChatImageURLPart | ChatInputImagePart,
                            Field(discriminator="type")]


class ChatMessageParam(OpenAIRequestModel):
    # Only an assistant message (one that made tool calls) may leave its content out.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"],
                 "properties": {"content": {"type": ["string", "array"]}}}})

    role: Literal[ROLES]  # type: ignore[valid-type]  # what the chat-template layer takes
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessageParam:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or parts)")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        message.update(self.model_extra or {})
        return message


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS, _ONE_PROMPT_MODE]})

    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_tokens: PosInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt | None = None
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra={
        "anyOf": [{"type": "array", "items": _TOOL_SCHEMA}, {"type": "null"}]})
    tool_choice: str | dict[str, Any] | None = Field(
        None, json_schema_extra=_TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None
    # The legacy function calling is not supported (use tools): only its "off" values pass.
    functions: list[dict[str, Any]] | None = Field(
        None, json_schema_extra={"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})
    function_call: str | dict[str, Any] | None = Field(
        None, json_schema_extra={"anyOf": [{"const": "none"}, {"type": "null"}]})
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
    # A KV connector's parameters for the next hop (the producer of a disaggregated pair:
    # where this prompt's KV waits); of the first prompt when there are several.
    kv_transfer_params: dict[str, Any] | None = None


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
    # --reasoning-parser: the reasoning part (``reasoning`` is vLLM's newer name, the same
    # value); None without a parser or when the output has no reasoning.
    reasoning_content: str | None = None
    reasoning: str | None = None
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
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser; ``reasoning``: same value
    reasoning: str | None = None
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
class TokenizeRequest(OpenAIRequestModel):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    # Exactly one of prompt / messages (the other absent or null), as the schema says.
    model_config = ConfigDict(json_schema_extra={"allOf": [_ONE_PROMPT_MODE], "oneOf": [
        {"required": ["prompt"],
         "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"],
         "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)] | None = None
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


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# -- probes -------------------------------------------------------------------------------
class HealthResponse(OpenAIBaseModel):
    status: Literal["ok"] = "ok"


class VersionResponse(OpenAIBaseModel):
    version: str
