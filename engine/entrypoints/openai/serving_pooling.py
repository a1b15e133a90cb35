"""``POST /v1/embeddings``, ``/pooling`` and ``/classify`` over ``AsyncLLM.encode``
(an engine started with ``--runner pooling``).

Each input of a request is one engine request; they run concurrently (so the engine
batches them) and the response lists them in input order, with usage counting the prompt
tokens. What can be checked up front is (the model name, whether the model does the task,
priority, the params' own ranges) before anything reaches the engine; the engine's own
checks (token ids in the vocabulary, the length against max_model_len, what
``dimensions`` may be) are 400s naming the field and, for a list, the item. A failure or
a client disconnect cancels the other requests of the HTTP request, which aborts them in
the engine core (no KV blocks are left behind).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi.responses import JSONResponse

from engine.core.outputs import PoolingRequestOutput
from engine.core.pooling_params import PoolingParams
from engine.entrypoints.openai.errors import APIError, bad_request
from engine.entrypoints.openai.protocol import UsageInfo, random_id
from engine.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
)
from engine.entrypoints.openai.serving_base import (
    OpenAIServing,
    ServerState,
    gather_or_cancel,
    run_until_disconnect,
)

# An engine ValueError about one of the request's options (not about an input item):
# the message starts with the option's name, or names matryoshka (``dimensions``).
_OPTION_ERROR = re.compile(
    r"^(dimensions|normalize|truncate_prompt_tokens|activation|use_activation|priority)\b")
_HTTP_NAMES = {"activation": "use_activation"}  # the request field of a PoolingParams one


@dataclass
class PoolingJob:
    """One engine request of an HTTP request."""

    prompt: str | list[int]
    task: str
    params: PoolingParams
    where: str  # the request field (and item) it came from, for error messages
    text_pair: str | None = None


class OpenAIServingPooling(OpenAIServing):
    """Shared by every pooling route; the handlers of the one-input routes."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        pooling = getattr(getattr(self.engine, "processor", None), "pooling", None)
        self.info = None if pooling is None else pooling.info
        self.labels = _id2label(self.engine.config.model) if self.info is not None else {}

    # -- checks ---------------------------------------------------------------------------
    def check_pooling(self, what: str) -> None:
        """A 400 on a generating engine (before its body is even read)."""
        if self.info is None:
            raise bad_request(f"The model `{self.model_name}` does not support {what}: it "
                              "generates text (serve a pooling model with --runner pooling)",
                              "model")

    def check_task(self, task: str, what: str, param: str = "model") -> None:
        self.check_pooling(what)
        assert self.info is not None
        if task not in self.info.tasks:
            raise bad_request(f"The model `{self.model_name}` does not support {what} (its "
                              f"tasks: {', '.join(self.info.tasks)})", param)

    def generation_refused(self) -> APIError:
        """What a pooling engine answers on the completion routes."""
        assert self.info is not None
        return bad_request(
            f"The model `{self.model_name}` is a pooling model ({self.info.config.task}; "
            "--runner pooling): it does not generate text. Use /v1/embeddings, /pooling, "
            "/classify, /score or /rerank", "model")

    async def start(self, request: Any, endpoint: str) -> None:
        """The checks every pooling route makes first."""
        self.check_model(request.model)
        await self.check_alive()
        self.log_ignored_fields(request, endpoint)
        if request.priority and self.engine.config.scheduler.policy != "priority":
            raise bad_request(
                "priority is only supported with --scheduling-policy priority", "priority")

    def pooling_params(self, **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except ValueError as exc:
            raise _option_error(exc) from exc

    # -- running --------------------------------------------------------------------------
    async def encode_all(self, request_id: str, jobs: list[PoolingJob], priority: int,
                         receive: Callable) -> list[PoolingRequestOutput]:
        """Run every job concurrently to its output; the first failure (or a client
        disconnect) cancels, and so aborts, the others."""
        return await run_until_disconnect(self._gather(request_id, jobs, priority), receive)

    async def _gather(self, request_id: str, jobs: list[PoolingJob], priority: int
                      ) -> list[PoolingRequestOutput]:
        return await gather_or_cancel([self._encode(f"{request_id}-{i}", job, priority)
                                       for i, job in enumerate(jobs)])

    async def _encode(self, request_id: str, job: PoolingJob, priority: int
                      ) -> PoolingRequestOutput:
        self.state.in_flight.add(request_id)  # a server shutdown aborts it
        outcome: str | None = "abort"
        output: PoolingRequestOutput | None = None
        try:
            output = await self.engine.encode(job.prompt, job.params, request_id,
                                              task=job.task, text_pair=job.text_pair,
                                              priority=priority)
            outcome = "stop" if output.outputs.data.numel() else "abort"
        except ValueError as exc:
            outcome = None  # refused: it never ran
            raise _input_error(exc, job.where) from exc
        finally:
            self.state.in_flight.discard(request_id)
            if outcome is not None and self.metrics is not None:
                tokens = len(output.prompt_token_ids) if output is not None else 0
                self.metrics.observe_request(None, tokens, [outcome])
        if outcome == "abort":
            raise APIError(503, "The request was aborted before it finished (the server is "
                                "shutting down)")
        return output

    # -- /v1/embeddings -------------------------------------------------------------------
    async def create_embedding(self, request: EmbeddingRequest, receive: Callable
                               ) -> JSONResponse:
        await self.start(request, "/v1/embeddings")
        self.check_task("embed", "embeddings")
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     dimensions=request.dimensions,
                                     normalize=request.normalize)
        jobs = input_jobs(request.input, "embed", params)
        request_id = random_id("embd")
        outputs = await self.encode_all(request_id, jobs, request.priority, receive)
        data = [EmbeddingData(index=i, embedding=encode_tensor(o.outputs.data,
                                                               request.encoding_format))
                for i, o in enumerate(outputs)]
        response = EmbeddingResponse(id=request_id, model=self.model_name, data=data,
                                     usage=usage(outputs))
        return JSONResponse(response.model_dump(mode="json"))

    # -- /pooling -------------------------------------------------------------------------
    async def create_pooling(self, request: PoolingRequest, receive: Callable) -> JSONResponse:
        await self.start(request, "/pooling")
        self.check_pooling("pooling")
        assert self.info is not None
        task = request.task or self.info.config.task
        self.check_task(task, f"the {task} task", "task")
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     dimensions=request.dimensions,
                                     normalize=request.normalize,
                                     use_activation=request.use_activation)
        request_id = random_id("pool")
        outputs = await self.encode_all(request_id, input_jobs(request.input, task, params),
                                        request.priority, receive)
        data = [PoolingData(index=i, data=encode_tensor(o.outputs.data,
                                                        request.encoding_format))
                for i, o in enumerate(outputs)]
        response = PoolingResponse(id=request_id, model=self.model_name, data=data,
                                   usage=usage(outputs))
        return JSONResponse(response.model_dump(mode="json"))

    # -- /classify ------------------------------------------------------------------------
    async def create_classify(self, request: ClassificationRequest, receive: Callable
                              ) -> JSONResponse:
        await self.start(request, "/classify")
        self.check_task("classify", "classification")
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     use_activation=request.use_activation)
        request_id = random_id("classify")
        outputs = await self.encode_all(request_id,
                                        input_jobs(request.input, "classify", params),
                                        request.priority, receive)
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.data.reshape(-1).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=self.labels.get(best, str(best)),
                                           probs=probs, num_classes=len(probs)))
        response = ClassificationResponse(id=request_id, model=self.model_name, data=data,
                                          usage=usage(outputs))
        return JSONResponse(response.model_dump(mode="json"))


# -- helpers ------------------------------------------------------------------------------
def input_jobs(value: str | list[Any], task: str, params: PoolingParams,
               field: str = "input") -> list[PoolingJob]:
    """One job per prompt of an ``input`` (a text, texts, token ids, lists of token ids)."""
    if isinstance(value, str) or all(isinstance(v, int) for v in value):
        return [PoolingJob(value, task, params, field)]
    return [PoolingJob(v, task, params, f"{field}[{i}]") for i, v in enumerate(value)]


def encode_tensor(data: torch.Tensor, encoding_format: str) -> list[Any] | str:
    """The tensor as (nested) float lists, or base64 of its flattened float32 values in
    little-endian order (what the ``openai`` client decodes)."""
    if encoding_format == "base64":
        raw = data.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4")
        return base64.b64encode(raw.tobytes()).decode("ascii")
    return data.tolist()


def usage(outputs: list[PoolingRequestOutput]) -> UsageInfo:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def _option_param(message: str) -> str | None:
    """The request option an engine ValueError is about, if any (else: about an input)."""
    match = _OPTION_ERROR.match(message)
    if match:
        return _HTTP_NAMES.get(match.group(1), match.group(1))
    return "dimensions" if "matryoshka" in message else None


def _option_error(exc: ValueError) -> APIError:
    return bad_request(str(exc), _option_param(str(exc)))


def _input_error(exc: ValueError, where: str) -> APIError:
    """A 400 for what the engine refused: an option (naming it) or one input item
    (naming the item of a list, e.g. ``input[2]``)."""
    message = str(exc)
    if (param := _option_param(message)) is not None:
        return bad_request(message, param)
    field = where.split("[", 1)[0]
    return bad_request(message if where == field else f"{where}: {message}", field)


def _id2label(model_config: Any) -> dict[int, str]:
    """The class names of the model's HF config (``id2label``, with --hf-overrides)."""
    from engine.model_executor.model_loader import apply_hf_overrides, load_hf_config

    overrides = model_config.hf_overrides
    config = load_hf_config(model_config.model, snapshot=not overrides)
    apply_hf_overrides(config, overrides)
    labels = getattr(config, "id2label", None) or {}
    return {int(index): str(label) for index, label in labels.items()}
