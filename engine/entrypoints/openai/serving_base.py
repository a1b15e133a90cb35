"""What the completion, chat and tokenize handlers share.

Every request is fully validated *before* a response starts (model name, lengths,
sampling parameters, and the engine's own Processor checks), so bad input always gets a
400 JSON body, even for ``stream: true``. Generation then runs through
``AsyncLLM.generate``; closing its iterator (a finished response, a client disconnect, a
server shutdown, a passed deadline) aborts the request in the engine core.

Also here: :class:`GenerationLimitsMiddleware` (the ``--max-num-waiting`` queue cap,
answered with a 429 and Retry-After, and the ``--request-timeout`` / ``x-request-timeout``
deadline) and :func:`watch_engine`, which notices a dead engine core and restarts it
(``--restart-engine-core``) or stops the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.responses import JSONResponse, StreamingResponse

from engine.core.core_protocol import describe_exception
from engine.core.errors import EngineDeadError, EngineSleepingError
from engine.core.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from engine.core.sampling_defaults import SAMPLING_FIELDS, SamplingDefaults
from engine.core.sampling_params import RequestOutputKind, SamplingParams
from engine.core.tokenizer import TokenDecoder
from engine.entrypoints.openai.errors import (
    APIError,
    bad_request,
    engine_dead,
    from_value_error,
    model_not_found,
)
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.protocol import SamplingRequest
from engine.lora.request import LoRARequest
from engine.structured_output.openai_fields import structured_outputs_from_request
from engine.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.entrypoints.openai.serving_lora import ServedLoRAs

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
_INLINE_TOKENIZE_CHARS = 4096  # longer texts are tokenized off the event loop
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
# Request fields that constrain the output, in the order a 400 names them.
_CONSTRAINT_FIELDS = ("structured_outputs", "response_format", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar", "guided_decoding_backend",
                      "tool_choice", "tools")
_STRUCTURED_OUTPUT_ERROR = "structured output error"  # the core's stop_reason prefix


@dataclass
class ServerSettings:
    """Server-level knobs (the engine's own options live in EngineArgs)."""

    served_model_name: str | None = None  # default: the engine's model name
    api_key: str | None = None
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_request_json_depth: int = 64  # deeper request bodies get a 400 before parsing
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask for
    max_logprobs: int = 20  # largest logprobs / top_logprobs / prompt_logprobs
    tool_call_parser: str = "hermes"  # reads tool calls in tool_choice "auto" outputs
    # Splits chat outputs into reasoning_content and content (None: no split).
    reasoning_parser: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # A dead engine core: start a fresh one up to this many times, then stop the server
    # with exit code 1 (vLLM's API server exits too) unless exit_on_engine_death is off.
    restart_engine_core: int = 0
    exit_on_engine_death: bool = True
    # Generation requests beyond max_num_seqs + max_num_waiting at once get a 429.
    max_num_waiting: int | None = None
    # Seconds a generation request may take (x-request-timeout overrides it) before its
    # work is aborted and it is answered with a 408.
    request_timeout: float | None = None
    # /v1/responses: how many stored responses (store: true) are kept in memory for
    # previous_response_id and GET /v1/responses/{id}; the least recently used go first.
    max_stored_responses: int = 1000
    # LoRA adapters served from startup (--lora-modules; ``engine serve`` has loaded them
    # into the engine already, the app adds any the engine lacks when it starts) and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    lora_modules: list[LoRARequest] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False


@dataclass
class ServerState:
    """What every handler of one app shares."""

    engine: Any  # AsyncLLM
    settings: ServerSettings
    metrics: ServerMetrics
    tokenize_pool: ThreadPoolExecutor | None = None
    in_flight: set[str] = field(default_factory=set)  # engine request ids now generating
    # The model's generation_config.json values fill the fields a request leaves unset.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    num_admitted: int = 0  # generation HTTP requests admitted and not yet answered
    # Set by run_server: stops uvicorn (the engine core died for good).
    stop_server: Callable[[], None] | None = None
    shutting_down: bool = False  # a shutdown has begun: a dead core is not restarted
    exit_code: int = 0  # what the server process exits with
    # The LoRA adapters a request's ``model`` may name (serving_lora); None: only the base.
    loras: ServedLoRAs | None = None

    async def abort_in_flight(self) -> int:
        """End every generating request (its response finishes with reason "abort")."""
        ids = list(self.in_flight)
        if ids:
            await self.engine.abort(ids)
        return len(ids)

    def admission_limit(self) -> int | None:
        """How many generation requests may be admitted at once (None: no limit)."""
        waiting = self.settings.max_num_waiting
        if waiting is None:
            return None
        return self.engine.config.scheduler.max_num_seqs + waiting


@dataclass
class PromptInput:
    """One prompt after tokenization; ``text`` is what ``echo`` returns."""

    token_ids: list[int]
    text: str | None = None


@dataclass
class GenerationJob:
    """One engine request (one prompt; its ``n`` samples fan out inside the engine)."""

    index: int  # position of the prompt in the request
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter the request named (None: base)
    # A prompt with images / videos, already processed (engine.multimodal.prompt
    # .MultiModalPrompt: ``prompt.token_ids`` are its expanded ids, for length checks and
    # usage); the engine takes it as it is instead of processing the images again.
    mm_prompt: Any = None

    def engine_prompt(self) -> Any:
        """What the engine is given: the token ids, or the processed multimodal prompt."""
        return self.prompt.token_ids if self.mm_prompt is None else self.mm_prompt


class OpenAIServing:
    """State and helpers shared by the endpoint handlers."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = engine = state.engine
        self.settings = state.settings
        self.metrics = state.metrics
        self.model_name = self.settings.served_model_name or engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.decoder = TokenDecoder(self.tokenizer) if self.tokenizer is not None else None
        self.tokenize_pool = state.tokenize_pool
        self.sampling_defaults = state.sampling_defaults

    # -- checks ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter ``name`` (a request's ``model``) names; None for the base model
        (or no name); the model-not-found 404 for anything else."""
        if not name or name == self.model_name:
            return None
        loras = self.state.loras
        if loras is None:
            raise model_not_found(name)
        return loras.resolve(name)

    def response_model_name(self, lora: LoRARequest | None) -> str:
        """What a response's ``model`` says: the adapter's name, else the base model's."""
        return self.model_name if lora is None else lora.lora_name

    async def check_alive(self) -> None:
        """A 503 at once when the engine core has died (or the engine was shut down)."""
        try:
            await self.engine.check_health()
        except EngineDeadError as exc:
            raise engine_dead(exc) from exc

    def log_ignored_fields(self, request: BaseModel, endpoint: str) -> None:
        extra = sorted(request.model_extra or ())
        if extra:
            logger.warning("%s: ignoring unsupported field(s) %s", endpoint, ", ".join(extra))

    def check_logprobs_limit(self, value: int | None, param: str) -> None:
        if value is None:
            return
        if value < 0:  # vLLM's -1 (the whole vocabulary) is not offered over HTTP
            raise bad_request(f"{param} must be >= 0, got {value}", param)
        if value > self.settings.max_logprobs:
            raise bad_request(
                f"{param}={value} exceeds this server's limit of {self.settings.max_logprobs}",
                param)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str,
                           minimum: int, prompt_param: str = "prompt") -> int:
        """Check the prompt and ``max_tokens`` against max_model_len and the server limit
        (vLLM's wording); return the effective max_tokens. ``prompt_param`` names the
        request field a too-long prompt came from (chat: ``messages``)."""
        limit = self.settings.max_tokens_limit
        if requested is not None:
            if requested < minimum:
                raise bad_request(f"{param} must be at least {minimum}, got {requested}", param)
            if limit is not None and requested > limit:
                raise bad_request(
                    f"{param}={requested} exceeds this server's limit of {limit} tokens", param)
        if prompt_len >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt_len} input tokens. Please reduce the length of the "
                "input messages.", prompt_param)
        room = self.max_model_len - prompt_len
        if requested is None:  # the room left, capped by the model's max_new_tokens
            default = self.sampling_defaults.max_tokens
            caps = [c for c in (room, limit, default) if c is not None and c > 0]
            return min(caps)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion.", param)
        return requested

    # -- building requests ----------------------------------------------------------------
    def structured_outputs(self, request: SamplingRequest) -> StructuredOutputsParams | None:
        """The request's output constraint (response_format, guided_*, structured_outputs,
        a forced tool_choice), validated now so a bad one is a 400 before any stream."""
        try:
            return structured_outputs_from_request(request)
        except ValueError as exc:
            raise from_value_error(exc, _constraint_param(request)) from exc

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer; send token ids instead", "prompt")
        if len(text) <= _INLINE_TOKENIZE_CHARS or self.tokenize_pool is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self.tokenize_pool,
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer to decode with")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def sampling_params(self, request: SamplingRequest, *, max_tokens: int,
                        logprobs: int | None, prompt_logprobs: int | None,
                        output_kind: RequestOutputKind,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """SamplingParams from the request's fields; bad values become 400s naming the field."""
        if request.priority and self.engine.config.scheduler.policy != "priority":
            raise bad_request(
                "priority is only supported with --scheduling-policy priority", "priority")
        n = 1 if request.n is None else request.n
        max_seqs = self.engine.config.scheduler.max_num_seqs
        if n > max_seqs:
            raise bad_request(f"n={n} exceeds this server's limit of {max_seqs} (max_num_seqs)",
                              "n")
        defaults = self.sampling_defaults
        options: dict[str, Any] = {
            "n": n,
            **{name: defaults.value(name, getattr(request, name)) for name in SAMPLING_FIELDS},
            "presence_penalty": request.presence_penalty or 0.0,
            "frequency_penalty": request.frequency_penalty or 0.0,
            "seed": request.seed,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "bad_words": request.bad_words,
            "ignore_eos": request.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": request.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": request.skip_special_tokens,
            "spaces_between_special_tokens": request.spaces_between_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "logit_bias": _logit_bias(request.logit_bias),
            "allowed_token_ids": request.allowed_token_ids,
            "truncate_prompt_tokens": request.truncate_prompt_tokens,
            "output_kind": output_kind,
            "structured_outputs": structured_outputs,
        }
        if request.kv_transfer_params is not None:
            options["extra_args"] = {"kv_transfer_params": request.kv_transfer_params}
        try:
            return SamplingParams(**options)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    def validate_job(self, job: GenerationJob, request: SamplingRequest | None = None) -> None:
        """Run the engine's own request checks now, so failures are 400s, not stream errors.
        With ``request``, a constraint no backend can compile names its field."""
        try:
            extra = {} if job.lora_request is None else {"lora_request": job.lora_request}
            self.engine.processor.process(
                job.request_id, job.prompt.token_ids, job.params,
                priority=job.priority, cache_salt=job.cache_salt, **extra)
        except ValueError as exc:
            param = None
            if request is not None and "structured output" in str(exc):
                param = _constraint_param(request)
            raise from_value_error(exc, param) from exc

    # -- running --------------------------------------------------------------------------
    async def iterate(self, job: GenerationJob) -> AsyncIterator[RequestOutput]:
        """The job's outputs; records metrics when it ends however it ends. Prompt
        logprobs are kept on ``job`` (in DELTA mode they arrive only once)."""
        reasons: dict[int, str] = {}
        last_metrics: RequestMetrics | None = None
        lora, loras = job.lora_request, self.state.loras
        extra: dict[str, Any] = {}
        if lora is not None:
            if loras is not None:  # an adapter unloaded meanwhile: model-not-found
                await loras.acquire(lora)
            extra["lora_request"] = lora
        try:
            generator = self.engine.generate(job.engine_prompt(), job.params, job.request_id,
                                             priority=job.priority, cache_salt=job.cache_salt,
                                             **extra)
        except BaseException:
            if lora is not None and loras is not None:
                loras.release(lora)
            raise
        self.state.in_flight.add(job.request_id)
        try:
            async with contextlib.aclosing(generator):
                async for output in generator:
                    if output.prompt_logprobs:
                        job.prompt_logprobs.extend(output.prompt_logprobs)
                    for completion in output.outputs:
                        if completion.finish_reason is not None:
                            reasons[completion.index] = completion.finish_reason
                    last_metrics = output.metrics
                    yield output
        finally:
            self.state.in_flight.discard(job.request_id)
            if lora is not None and loras is not None:
                loras.release(lora)
            n = job.params.n
            self.metrics.observe_request(last_metrics, len(job.prompt.token_ids),
                                         [reasons.get(i, "abort") for i in range(n)])

    async def collect(self, job: GenerationJob) -> RequestOutput:
        """Run a FINAL_ONLY job to its single output."""
        final: RequestOutput | None = None
        async with contextlib.aclosing(self.iterate(job)) as outputs:
            async for output in outputs:
                final = output
        if final is None:
            raise APIError(500, f"request {job.request_id} ended without output")
        return final

    async def collect_all(self, jobs: list[GenerationJob]) -> list[RequestOutput]:
        """Run every job concurrently; one failure cancels (aborts) the others."""
        return await gather_or_cancel([self.collect(job) for job in jobs])

    def stream_jobs(self, jobs: list[GenerationJob]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs from every job as they come."""
        if len(jobs) == 1:
            return _tag(0, self.iterate(jobs[0]))
        return merge_async_iterators([self.iterate(job) for job in jobs])


# -- helpers ------------------------------------------------------------------------------
def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias"
            ) from None
        if not -100.0 <= value <= 100.0:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                "logit_bias")
        result[token_id] = float(value)
    return result


def _constraint_param(request: SamplingRequest) -> str | None:
    """The request field that set the output constraint (the first, when several did)."""
    return next((name for name in _CONSTRAINT_FIELDS
                 if getattr(request, name, None) is not None), None)


def structured_output_failure(completion: CompletionOutput) -> APIError | None:
    """A 400 when the engine core ended a choice because its constraint failed (a grammar
    that would not compile, or one that rejected every token); else None."""
    reason = completion.stop_reason
    if (completion.finish_reason == "abort" and isinstance(reason, str)
            and reason.startswith(_STRUCTURED_OUTPUT_ERROR)):
        return bad_request(reason)
    return None


def clamp_logprob(value: float) -> float:
    return _MIN_LOGPROB if math.isnan(value) else max(value, _MIN_LOGPROB)


def token_text(logprob: Logprob | None, token_id: int, decoder: TokenDecoder | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decoder.decode_token(token_id) if decoder is not None else f"token_id:{token_id}"


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while generating to the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(exc)
    if isinstance(exc, EngineSleepingError):
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    logger.error("request failed: %s", describe_exception(exc), exc_info=exc)
    return APIError(500, f"Internal server error: {describe_exception(exc)}")


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(to_api_error(exc).body())


async def _tag(index: int, iterator: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    async with contextlib.aclosing(iterator):
        async for item in iterator:
            yield index, item


async def merge_async_iterators(
    iterators: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive; closing the merged iterator
    cancels (and so closes) every source."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(iterator):
                async for item in iterator:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, done))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(receive: Any) -> None:
    """Return when the client disconnects (the request body must be fully read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: Awaitable[T], receive: Any) -> T:
    """Await ``work``; if the client goes away first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client disconnected")
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


class EventStreamResponse(StreamingResponse):
    """An SSE response that always closes its body iterator, so a client disconnect (the
    stream task is cancelled) or a server shutdown aborts the requests behind it now,
    not whenever the generator is garbage-collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._source = content

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._source.aclose()  # type: ignore[attr-defined]


async def gather_or_cancel(coroutines: list[Any]) -> list[Any]:
    """Run the coroutines concurrently and return their results in order; the first
    failure (or a cancellation of the caller) cancels the rest, which aborts their
    requests in the engine, and waits for them to finish unwinding."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished tasks
        await asyncio.gather(*tasks, return_exceptions=True)


# -- overload and deadlines ---------------------------------------------------------------
# The routes that put work on the engine: generation, and pooling (engines started with
# --runner pooling) -- both admitted against the same limit, with the same deadline.
GENERATION_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses",
    "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank",
})
REQUEST_TIMEOUT_HEADER = b"x-request-timeout"
RETRY_AFTER_S = 1


def rate_limited(message: str, retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    """A 429 with an OpenAI-style body (type "RateLimitError", what the openai client
    raises for it) and a Retry-After header."""
    error = APIError(429, message, error_type="RateLimitError")
    return JSONResponse(error.body(), status_code=429,
                        headers={"Retry-After": str(retry_after_s)})


def request_timeout_s(headers: list[tuple[bytes, bytes]], default: float | None) -> float | None:
    """The request's deadline in seconds: its x-request-timeout header, else ``default``.
    A malformed header is a 400."""
    raw = dict(headers).get(REQUEST_TIMEOUT_HEADER)
    if raw is None:
        return default
    try:
        value = float(raw.decode("latin-1").strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise bad_request(f"The x-request-timeout header must be a positive number of seconds, "
                          f"got {raw.decode('latin-1')!r}", "x-request-timeout")
    return value


class GenerationLimitsMiddleware:
    """For the generation routes: a 429 (with Retry-After) while ``max_num_seqs +
    max_num_waiting`` requests are already admitted, and a deadline (x-request-timeout
    header, else ``request_timeout``) after which the request's work is cancelled, which
    aborts it in the engine core and frees its KV blocks. A request past its deadline gets
    a 408 or, once its stream has started, a final error event and ``[DONE]``."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        state = self.state
        try:
            timeout = request_timeout_s(scope["headers"], state.settings.request_timeout)
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        limit = state.admission_limit()
        if limit is not None and state.num_admitted >= limit:
            await rate_limited(
                f"The server is overloaded: {state.num_admitted} requests are running or "
                f"waiting (the limit is max_num_seqs + max_num_waiting = {limit}); retry later"
            )(scope, receive, send)
            return
        state.num_admitted += 1
        try:
            if timeout is None:
                await self.app(scope, receive, send)
            else:
                await self._with_deadline(scope, receive, send, timeout)
        finally:
            state.num_admitted -= 1

    async def _with_deadline(self, scope: dict, receive: Any, send: Any,
                             timeout: float) -> None:
        start: dict | None = None  # the response's start message, once sent
        done = False

        async def tracked_send(message: dict) -> None:
            nonlocal start, done
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done = True
            await send(message)

        with anyio.move_on_after(timeout) as deadline:
            await self.app(scope, receive, tracked_send)
        if not deadline.cancelled_caught or done:
            return
        logger.warning("%s: request passed its deadline of %g s; its work was aborted",
                       scope["path"], timeout)
        error = APIError(408, f"The request did not finish within its deadline of {timeout:g} s "
                              "(x-request-timeout / --request-timeout); its work was aborted")
        if start is None:
            await error.response()(scope, receive, send)
            return
        content_type = dict(start.get("headers", ())).get(b"content-type", b"")
        body = (sse(error.body()) + SSE_DONE).encode() if content_type.startswith(
            b"text/event-stream") else b""
        await send({"type": "http.response.body", "body": body, "more_body": False})


# -- engine-core death --------------------------------------------------------------------
WATCH_INTERVAL_S = 0.1
_DRAIN_S = 2.0  # how long in-flight requests get to send their errors before the exit


async def watch_engine(state: ServerState) -> None:
    """Notice a dead engine core within WATCH_INTERVAL_S (even with no request running):
    fail its in-flight requests, then restart it (``restart_engine_core`` times at most)
    or stop the server with exit code 1 (unless ``exit_on_engine_death`` is off: then
    every request keeps getting a 503)."""
    engine, settings = state.engine, state.settings
    if not hasattr(engine, "fail_in_flight"):  # a stand-in engine in a test: nothing to watch
        return
    restarts_left = settings.restart_engine_core
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        if state.shutting_down or engine.closed or not engine.errored:
            continue
        died = time.monotonic()
        error = engine.fail_in_flight()
        if error is None or state.shutting_down:
            continue
        if restarts_left > 0:
            restarts_left -= 1
            attempt = settings.restart_engine_core - restarts_left
            logger.error("Engine core died (%s); starting a fresh one (restart %d of %d); "
                         "in-flight requests got errors", error, attempt,
                         settings.restart_engine_core)
            try:
                pid = await engine.restart_core()
            except Exception as exc:  # noqa: BLE001 - EngineStartupError and the like
                error = exc
                logger.error("Could not restart the engine core: %s", describe_exception(exc))
            else:
                logger.info("Engine core restarted (pid %d) %.1f s after it died; serving "
                            "again", pid, time.monotonic() - died)
                continue
        if not settings.exit_on_engine_death:
            logger.error("Engine core died (%s); the server stays up and answers 503 "
                         "(exit on engine death is off)", error)
            return
        reason = (f"and all {settings.restart_engine_core} restart(s) are used"
                  if settings.restart_engine_core else "and --restart-engine-core is 0")
        logger.error("Engine core died (%s) %s: stopping the server with exit code 1",
                     error, reason)
        state.exit_code = 1
        drain_until = time.monotonic() + _DRAIN_S
        while state.in_flight and time.monotonic() < drain_until:
            await asyncio.sleep(0.02)
        if state.stop_server is not None:
            state.stop_server()
        else:
            logger.warning("No server to stop (the app is not run by run_server)")
        return
