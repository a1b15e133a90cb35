"""``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's extra):
``n`` is the beam width, ``length_penalty`` and ``ignore_eos`` shape the scoring, and the
``n`` choices are the best beams, best first (:mod:`engine.core.beam_search`, run by
``AsyncLLM.beam_search``; the same bookkeeping as the offline ``LLM.beam_search``).

Not combinable with beam search (a 400 naming the field): ``stream`` (vLLM does not stream
beams either), structured outputs (including a forced ``tool_choice``), ``temperature``
> 0 (beams are deterministic here), ``prompt_logprobs`` and completions' ``max_tokens=0``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from engine.core.beam_search import BeamSearchParams
from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.errors import APIError, bad_request
from engine.entrypoints.openai.serving_base import GenerationJob, OpenAIServing


def beam_search_params(request: Any, job: GenerationJob) -> BeamSearchParams | None:
    """The request's beam search (None unless ``use_beam_search``); its sampling params
    (``job.params``, already validated) give beam width, max_tokens and ignore_eos."""
    if not getattr(request, "use_beam_search", False):
        return None
    if request.stream:
        raise bad_request("use_beam_search does not support stream=true", "stream")
    if job.params.structured_outputs is not None:
        raise bad_request("use_beam_search cannot be combined with structured outputs "
                          "(response_format, guided_*, structured_outputs, tool_choice)",
                          "use_beam_search")
    if request.temperature:
        raise bad_request("use_beam_search needs temperature 0 or unset (beams are "
                          f"deterministic), got {request.temperature}", "temperature")
    if request.prompt_logprobs is not None:
        raise bad_request("use_beam_search does not return prompt_logprobs",
                          "prompt_logprobs")
    if getattr(request, "max_tokens", None) == 0:
        raise bad_request("use_beam_search needs max_tokens >= 1", "max_tokens")
    params = job.params
    try:
        return BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens or 1,
            ignore_eos=params.ignore_eos, length_penalty=request.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output)
    except ValueError as exc:
        raise bad_request(str(exc), "length_penalty") from exc


async def collect_beam_search(serving: OpenAIServing, job: GenerationJob,
                              beam: BeamSearchParams) -> RequestOutput:
    """Run one prompt's beam search to its RequestOutput (``beam_width`` completions)."""
    final: RequestOutput | None = None
    lora, loras = job.lora_request, serving.state.loras
    if lora is not None and loras is not None:  # an adapter unloaded meanwhile: 404
        await loras.acquire(lora)
    try:
        generator = serving.engine.beam_search(
            job.prompt.token_ids, job.request_id, beam, priority=job.priority,
            cache_salt=job.cache_salt, lora_request=lora)
        async with contextlib.aclosing(generator):
            async for output in generator:
                final = output
    finally:
        if lora is not None and loras is not None:
            loras.release(lora)
    if final is None:
        raise APIError(500, f"beam search {job.request_id} ended without output")
    return final
