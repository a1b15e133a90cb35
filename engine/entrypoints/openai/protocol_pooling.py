"""Pydantic models of the pooling routes: OpenAI's /v1/embeddings and vLLM's /pooling,
/classify, /score and /rerank (Jina's shape at /rerank and /v1/rerank, Cohere's at
/v2/rerank).

Requests follow the house rules of ``protocol`` (strict types, finite numbers, unknown
fields kept and logged as ignored, every range declared on its field), so a malformed
body is a 400 naming the field before any engine work starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from engine.entrypoints.openai.protocol import (
    INT64_MAX,
    Int64,
    NonEmptyStr,
    NonNegInt,
    OpenAIBaseModel,
    OpenAIRequestModel,
    PosInt,
    TokenIds,
    UsageInfo,
    _AS_INT,
    now_s,
)


def _input_shape(value: Any) -> str | None:
    """Which form an input takes, so that a bad one is reported against that form only."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    if isinstance(first, list):
        return "token_id_lists"
    return "token_ids" if isinstance(first, (int, float)) and not isinstance(first, bool) \
        else "texts"


def _text_shape(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "texts" if isinstance(value, list) else None


def _shaped(shape: Any, message: str, *forms: tuple[Any, str]) -> Any:
    """A union validated as the one form ``shape`` picks (a clear error, not one per form)."""
    return Annotated[Union[tuple(Annotated[form, Tag(tag)] for form, tag in forms)],
                     Discriminator(shape, custom_error_type="input_form",
                                   custom_error_message=message)]


_TEXT_LIST = Annotated[list[NonEmptyStr], Field(min_length=1)]
# One text, several texts, one prompt of token ids, or several of them; none may be empty.
PoolingInput = _shaped(
    _input_shape, "Input should be a string, a list of strings, a list of token ids or a list "
    "of lists of token ids", (NonEmptyStr, "text"), (_TEXT_LIST, "texts"),
    (TokenIds, "token_ids"), (Annotated[list[TokenIds], Field(min_length=1)], "token_id_lists"))
Texts = _shaped(_text_shape, "Input should be a string or a list of strings",
                (NonEmptyStr, "text"), (_TEXT_LIST, "texts"))
# vLLM's truncate_prompt_tokens: keep the last N tokens; -1: as many as the model takes.
Truncate = Annotated[int, Field(ge=-1, le=INT64_MAX,
                                description="Keep the prompt's last N tokens (N >= 1); -1: "
                                            "max_model_len. 0 is refused."), _AS_INT]
EncodingFormat = Literal["float", "base64"]  # base64: little-endian float32 bytes
# What /pooling may ask of a model ("score" needs a pair: /score).
PoolingRouteTask = Literal["embed", "classify", "reward", "encode"]


class PoolingRequestBase(OpenAIRequestModel):
    """What every pooling route takes besides its input."""

    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None
    priority: Int64 = 0
    user: str | None = None


class EmbeddingRequest(PoolingRequestBase):
    input: PoolingInput
    encoding_format: EncodingFormat = "float"
    dimensions: PosInt | None = Field(None, description="Matryoshka models only: the "
                                      "embedding is cut to this width, then normalized")
    normalize: bool | None = None  # vLLM: None is the model's default


class PoolingRequest(PoolingRequestBase):
    input: PoolingInput
    task: PoolingRouteTask | None = Field(None, description="Default: the model's own "
                                          "task (embed, classify or reward)")
    encoding_format: EncodingFormat = "float"
    dimensions: PosInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = None  # classify: softmax / sigmoid (default on)


class ClassificationRequest(PoolingRequestBase):
    input: PoolingInput
    use_activation: bool | None = None  # False: the raw logits


class ScoreRequest(PoolingRequestBase):
    """``text_1[i]`` against ``text_2[i]``, or one ``text_1`` against every ``text_2``."""

    text_1: Texts
    text_2: Texts
    use_activation: bool | None = None  # cross-encoders: sigmoid of the logit (default on)


class RerankDocument(OpenAIRequestModel):
    text: str


def _document_shape(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "object" if isinstance(value, dict) else None


Document = _shaped(_document_shape, 'A document should be a string or {"text": string}',
                   (NonEmptyStr, "text"), (RerankDocument, "object"))


class RerankRequest(PoolingRequestBase):
    query: NonEmptyStr
    documents: Annotated[list[Document], Field(min_length=1)]
    top_n: NonNegInt | None = Field(
        None, description="How many of the best documents to return; 0 or null: all")
    return_documents: bool = True
    use_activation: bool | None = None


# -- responses ----------------------------------------------------------------------------
class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64


class _ListResponse(OpenAIBaseModel):
    """What every pooling route's response shares (vLLM's shapes); ``data`` per route."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    usage: UsageInfo


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingData]


class PoolingData(OpenAIBaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: Any = Field(description="The pooled tensor as nested lists, or base64 of its "
                                  "flattened little-endian float32 values")


class PoolingResponse(_ListResponse):
    data: list[PoolingData]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]


class ScoreData(OpenAIBaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResultDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankResultDocument | None = None  # left out when return_documents is false
    relevance_score: float


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
