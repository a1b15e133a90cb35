"""When a request is done, checked after each token it accepts."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish the request if its last output token ends it; True if it did.

    Order: EOS (unless ``ignore_eos``), then ``stop_token_ids`` (``stop_reason`` = the
    token) -- neither before ``min_tokens`` output tokens -- then ``max_tokens`` and
    ``max_model_len`` (both LENGTH). A stop token that is also the last allowed token
    therefore reports STOP, as OpenAI clients expect. Stop strings are the front end's
    job (it sees text); it finishes the request through ``Scheduler.finish_requests``.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
