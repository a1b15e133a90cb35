"""User-facing results of a request, shaped like vLLM's so code written for it works here.

Per-position logprobs are ``dict[token_id, Logprob]``: the sampled (or prompt) token plus
the top-k alternatives. ``prompt_logprobs[0]`` is always None (the first prompt token has
no preceding context to score it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token in the full distribution
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later DELTA output of the same sample (merging for slow consumers)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()``) for TTFT / inter-token latency metrics."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    # Seconds between consecutive steps that gave the request tokens (one entry per step
    # after the first): the inter-token latency histogram observes each.
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What one request produced so far (or, for DELTA outputs, since the last one)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # A KV connector's parameters for the client (a disaggregated-prefill producer's:
    # where the prompt's KV waits for the decode instance), on the final output.
    kv_transfer_params: dict | None = None

    def add(self, later: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of this request into this one.

        ``aggregate`` (DELTA mode) appends the later deltas to the matching samples;
        otherwise (CUMULATIVE) the later sample replaces the earlier one.
        """
        by_index = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            current = by_index.get(completion.index)
            if current is None:
                self.outputs.append(completion)
                by_index[completion.index] = completion
            elif aggregate:
                current.add(completion)
            else:
                self.outputs[self.outputs.index(current)] = completion
                by_index[completion.index] = completion
        self.outputs.sort(key=lambda c: c.index)
        if later.prompt_logprobs is not None:
            if aggregate and self.prompt_logprobs is not None:
                self.prompt_logprobs = self.prompt_logprobs + later.prompt_logprobs
            else:
                self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        if later.kv_transfer_params is not None:
            self.kv_transfer_params = later.kv_transfer_params


# -- pooling ---------------------------------------------------------------------------------
@dataclass
class PoolingOutput:
    """A pooling request's raw result: a float32 tensor (``[hidden]`` for an embedding,
    ``[num_labels]`` for a classification, ``[tokens, ...]`` for ALL pooling)."""

    data: "torch.Tensor"  # noqa: F821 (torch is imported by whoever builds it)


@dataclass
class PoolingRequestOutput:
    """What one pooling request produced (vLLM's shape; ``outputs.data`` is the tensor)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # after the activation (softmax / sigmoid) unless it was turned off

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.reshape(-1).tolist()),
                   out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data.reshape(-1).tolist()),
                   out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
