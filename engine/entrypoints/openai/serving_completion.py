"""``POST /v1/completions``: the legacy completions API (what lm-eval's local-completions uses).

Each prompt of the request becomes one engine request; its ``n`` samples are choices
``prompt_index * n + sample_index``.

``echo`` prepends the prompt text; with ``logprobs`` it also prepends the prompt tokens'
logprobs (computed by the engine as prompt_logprobs; the first is None: nothing precedes
it). ``max_tokens=0`` is allowed (lm-eval's loglikelihood sends it with echo): the engine
needs at least one generated token, so one is generated and dropped from the text, the
tokens, the logprobs and the usage; the finish reason is "length".

Structured output (``response_format``, ``guided_*``, ``structured_outputs``) constrains
every choice; a constraint the engine core fails on is a 400 (or an in-band error event
once streaming). The server's ``--structured-outputs-config`` fills what the request
leaves unset; a JSON schema compiled with keywords relaxed names them in the
``x-structured-output-relaxed`` response header (with ``strict``: a 400 instead).

``use_beam_search`` (with ``n``, ``length_penalty``): see serving_beam.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from engine.core.outputs import CompletionOutput, PositionLogprobs
from engine.core.sampling_params import RequestOutputKind
from engine.core.tokenizer import TokenDecoder
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
    now_s,
    random_id,
)
from engine.entrypoints.openai.serving_base import (
    SSE_DONE,
    EventStreamResponse,
    GenerationJob,
    OpenAIServing,
    PromptInput,
    clamp_logprob,
    gather_or_cancel,
    run_until_disconnect,
    sse,
    sse_error,
    structured_output_failure,
    token_text,
)
from engine.entrypoints.openai.serving_beam import beam_search_params, collect_beam_search
from engine.structured_output.enforcement import relaxed_keywords
from engine.structured_output.openai_fields import apply_server_defaults, relaxed_headers
from engine.structured_output.params import StructuredOutputsParams


def server_structured_outputs(params: StructuredOutputsParams | None,
                              engine: Any) -> StructuredOutputsParams | None:
    """A request's constraint with the server's ``--structured-outputs-config`` defaults."""
    config = getattr(getattr(engine, "config", None), "structured_outputs", None)
    return apply_server_defaults(params, config)


@dataclass
class _Options:
    """What shapes the choices of one completion request."""

    request_id: str
    created: int
    n: int
    echo: bool
    drop_generated: bool  # max_tokens=0: the one generated token is not returned
    num_logprobs: int | None
    return_prompt_logprobs: bool
    model: str = ""  # the response's ``model``: the base model's name or the adapter's


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, receive: Callable) -> Response:
        lora = self.check_model(request.model)
        await self.check_alive()
        self.log_ignored_fields(request, "/v1/completions")
        n = 1 if request.n is None else request.n
        if request.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != n:
            raise bad_request("best_of is not supported (leave it unset or equal to n)",
                              "best_of")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        self.check_logprobs_limit(request.logprobs, "logprobs")
        self.check_logprobs_limit(request.prompt_logprobs, "prompt_logprobs")
        options = _Options(
            request_id=random_id("cmpl"), created=now_s(), n=n, echo=bool(request.echo),
            drop_generated=request.max_tokens == 0, num_logprobs=request.logprobs,
            return_prompt_logprobs=request.prompt_logprobs is not None,
            model=self.response_model_name(lora),
        )
        prompt_logprobs = request.prompt_logprobs
        if options.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        structured = server_structured_outputs(self.structured_outputs(request), self.engine)
        relaxed = None
        jobs = []
        for i, prompt in enumerate(await self._prompts(request)):
            max_tokens = self.resolve_max_tokens(len(prompt.token_ids), request.max_tokens,
                                                 "max_tokens", minimum=0)
            params = self.sampling_params(request, max_tokens=max(max_tokens, 1),
                                          logprobs=request.logprobs,
                                          prompt_logprobs=prompt_logprobs, output_kind=kind,
                                          structured_outputs=structured)
            job = GenerationJob(i, f"{options.request_id}-{i}", prompt, params,
                                request.priority, request.cache_salt, lora_request=lora)
            if i == 0:  # one constraint for every prompt; the 400 is validate_job's
                relaxed = relaxed_keywords(params.structured_outputs)
            self.validate_job(job, request)
            jobs.append(job)
        beam = beam_search_params(request, jobs[0])  # use_beam_search; None: sampling
        headers = relaxed_headers(relaxed)
        self.metrics.observe_structured_output(relaxed)
        if options.echo:
            for job in jobs:
                if job.prompt.text is None:
                    job.prompt.text = self.decode(job.prompt.token_ids)
        if request.stream:
            stream_options = request.stream_options
            include_usage = bool(stream_options and stream_options.include_usage)
            continuous = bool(stream_options and stream_options.continuous_usage_stats)
            streamed = EventStreamResponse(self._stream(jobs, options, include_usage, continuous))
            streamed.headers.update(headers)
            return streamed
        work = (self.collect_all(jobs) if beam is None else
                gather_or_cancel([collect_beam_search(self, job, beam) for job in jobs]))
        outputs = await run_until_disconnect(work, receive)
        return JSONResponse(self._response(jobs, outputs, options).model_dump(mode="json"),
                            headers=headers)

    # -- prompts --------------------------------------------------------------------------
    async def _prompts(self, request: CompletionRequest) -> list[PromptInput]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        truncate = request.truncate_prompt_tokens
        result = []
        for item in items:
            if isinstance(item, str):
                prompt_input = PromptInput(await self.tokenize(item, request.add_special_tokens),
                                           item)
            else:
                prompt_input = PromptInput(list(item))
            if truncate is not None and truncate >= 1 and len(prompt_input.token_ids) > truncate:
                prompt_input = PromptInput(prompt_input.token_ids[-truncate:])
            result.append(prompt_input)
        return result

    # -- non-streaming --------------------------------------------------------------------
    def _response(self, jobs: list[GenerationJob], outputs: list, options: _Options
                  ) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        completion_tokens = 0
        for job, output in zip(jobs, outputs):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                if (failure := structured_output_failure(completion)) is not None:
                    raise failure
                choice, num_tokens = self._choice(job, completion, options, True, 0)
                if options.return_prompt_logprobs:
                    choice.prompt_logprobs = serialize_prompt_logprobs(job.prompt_logprobs)
                choices.append(choice)
                completion_tokens += num_tokens
        prompt_tokens = sum(len(job.prompt.token_ids) for job in jobs)
        transfer = next((o.kv_transfer_params for o in outputs
                         if getattr(o, "kv_transfer_params", None) is not None), None)
        return CompletionResponse(
            id=options.request_id, created=options.created, model=options.model,
            choices=choices, usage=UsageInfo(prompt_tokens=prompt_tokens,
                                             completion_tokens=completion_tokens,
                                             total_tokens=prompt_tokens + completion_tokens),
            kv_transfer_params=transfer)

    def _choice(self, job: GenerationJob, completion: CompletionOutput, options: _Options,
                with_echo: bool, text_offset: int) -> tuple[CompletionChoice, int]:
        """One choice (or one streamed piece of it) and its number of generated tokens."""
        if options.drop_generated:
            text, token_ids, positions = "", [], []
            finish = "length" if completion.finish_reason is not None else None
            stop_reason = None
        else:
            text, token_ids = completion.text, list(completion.token_ids)
            positions = list(completion.logprobs or [])
            finish, stop_reason = completion.finish_reason, completion.stop_reason
        if options.echo and with_echo:
            text = (job.prompt.text or "") + text
            prompt_ids = job.prompt.token_ids
            prompt_positions = list(job.prompt_logprobs[: len(prompt_ids)])
            prompt_positions += [None] * (len(prompt_ids) - len(prompt_positions))
            token_ids, positions = prompt_ids + token_ids, prompt_positions + positions
            num_generated = len(token_ids) - len(prompt_ids)
        else:
            num_generated = len(token_ids)
        logprobs = None
        if options.num_logprobs is not None:
            logprobs = completion_logprobs(token_ids, positions, options.num_logprobs,
                                           self.decoder, text_offset)
        index = job.index * options.n + completion.index
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=finish, stop_reason=stop_reason)
        return choice, num_generated

    # -- streaming ------------------------------------------------------------------------
    async def _stream(self, jobs: list[GenerationJob], options: _Options, include_usage: bool,
                      continuous_usage: bool) -> AsyncIterator[str]:
        prompt_tokens = sum(len(job.prompt.token_ids) for job in jobs)
        completion_tokens = 0
        started: set[int] = set()  # choices whose echo was sent
        offsets: dict[int, int] = {}  # text_offset of each choice's next logprob token

        def usage() -> UsageInfo:
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)

        try:
            async with contextlib.aclosing(self.stream_jobs(jobs)) as outputs:
                async for prompt_index, output in outputs:
                    job = jobs[prompt_index]
                    choices = []
                    for completion in output.outputs:
                        if (failure := structured_output_failure(completion)) is not None:
                            raise failure
                        index = prompt_index * options.n + completion.index
                        first = index not in started
                        choice, num_tokens = self._choice(job, completion, options, first,
                                                          offsets.get(index, 0))
                        completion_tokens += num_tokens
                        if (not choice.text and choice.finish_reason is None
                                and not (choice.logprobs and choice.logprobs.tokens)):
                            continue  # nothing to say yet (e.g. text held back)
                        started.add(index)
                        if choice.logprobs is not None and choice.logprobs.tokens:
                            last = choice.logprobs
                            offsets[index] = last.text_offset[-1] + len(last.tokens[-1])
                        if first and options.return_prompt_logprobs:
                            choice.prompt_logprobs = serialize_prompt_logprobs(
                                job.prompt_logprobs)
                        choices.append(choice)
                    if choices:
                        yield sse(CompletionStreamResponse(
                            id=options.request_id, created=options.created,
                            model=options.model, choices=choices,
                            usage=usage() if continuous_usage else None))
            if include_usage:
                yield sse(CompletionStreamResponse(
                    id=options.request_id, created=options.created, model=options.model,
                    choices=[], usage=usage()))
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse_error(exc)
        yield SSE_DONE


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None],
                        num_top: int, decoder: TokenDecoder | None,
                        text_offset: int = 0) -> CompletionLogProbs:
    """OpenAI's legacy logprobs: per token its text, logprob, the top ``num_top``
    alternatives plus the token itself, and its character offset (the running sum of the
    token texts, as vLLM computes it). A None position (the first prompt token) has no
    logprob."""
    result = CompletionLogProbs()
    offset = text_offset
    for token_id, position in zip(token_ids, positions):
        if position is None:
            text = token_text(None, token_id, decoder)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = position.get(token_id)
            text = token_text(chosen, token_id, decoder)
            result.token_logprobs.append(None if chosen is None else clamp_logprob(chosen.logprob))
            ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:num_top]
            if chosen is not None and all(token_id != tid for tid, _ in ranked):
                ranked.append((token_id, chosen))
            top: dict[str, float] = {}
            for tid, logprob in ranked:
                top.setdefault(token_text(logprob, tid, decoder), clamp_logprob(logprob.logprob))
            result.top_logprobs.append(top)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def serialize_prompt_logprobs(positions: list[PositionLogprobs | None]
                              ) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` field: per position ``{token_id: {logprob, rank,
    decoded_token}}`` (None for the first)."""
    return [
        None if position is None else {
            token_id: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                       "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in positions
    ]
