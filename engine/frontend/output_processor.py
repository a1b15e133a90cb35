"""EngineCoreOutputs -> user-facing RequestOutputs (the front end's output side).

Per child sequence, each step: append tokens and logprobs, detokenize incrementally, look
for stop strings in the new text, and record finish reasons. A stop string is found here,
not in the core, so the child is finished here and its id is returned in
``reqs_to_abort`` for the caller to forward to the core (which frees its KV blocks).

Per parent (a user request with ``n`` samples), one RequestOutput per step in which any
of its children changed:

* CUMULATIVE: every sample, with all text/tokens/logprobs so far.
* DELTA: only the samples that changed, with only what is new since the previous output
  (``index`` tells them apart); prompt logprobs ride on the first output.
* FINAL_ONLY: a single output with every sample once all of them have finished.

Streaming text holds back a possible stop-string prefix (see ``stop_strings``) and any
incomplete UTF-8 character (see ``detokenizer``); both are released at finish.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol


from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.core.engine_io import EngineCoreOutput, EngineCoreRequest
from engine.frontend.logprobs import chosen_logprob_sum, convert_logprobs
from engine.core.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from engine.frontend.processor import ProcessedRequest
from engine.core.request import FinishReason
from engine.core.scheduler.output import LogprobsLists, PooledData
from engine.core.sampling_params import RequestOutputKind, SamplingParams
from engine.frontend.stop_strings import StopStringMatcher
from engine.core.tokenizer import TokenDecoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputSink(Protocol):
    """Where a streamed request's outputs go (e.g. a RequestOutputCollector)."""

    def put_nowait(self, output: RequestOutput | BaseException) -> None: ...


@dataclass
class OutputProcessorResult:
    request_outputs: list[RequestOutput] = field(default_factory=list)  # those without a sink
    reqs_to_abort: list[str] = field(default_factory=list)  # child ids stopped by a stop string


class _ChildState:
    """Text, tokens and logprobs of one sample, and how much of them was already sent."""

    def __init__(
        self,
        index: int,
        request: EngineCoreRequest,
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase | None,
        decoder: TokenDecoder | None,
    ) -> None:
        self.index = index
        self.request_id = request.request_id
        self.params = params
        self.stop_ids = params.all_stop_token_ids | (
            {request.eos_token_id} if request.eos_token_id is not None else set()
        )
        detokenize = tokenizer is not None and params.detokenize
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            if detokenize
            else None
        )
        self.decoder = decoder if detokenize else None
        self.matcher = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop and detokenize
            else None
        )
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._min_tokens_text_end = 0  # stop strings must end after the min_tokens text
        self._sent_text = self._sent_tokens = self._sent_logprobs = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Apply one step's output; return True if a stop string finished this child.

        A step may bring several tokens (accepted speculative drafts): a stop string that
        ends inside them keeps only the tokens up to the one completing it, and their
        logprobs, exactly as if they had come one per step."""
        new_ids = output.new_token_ids
        num_before = len(self.token_ids)
        stop_hit, keep = False, len(new_ids)
        if self.detokenizer is not None:
            stop_hit, keep = self._update_text(new_ids, num_before, output.finish_reason)
        self.token_ids.extend(new_ids[:keep])
        if output.new_logprobs is not None and self.logprobs is not None:
            rows = _first_rows(output.new_logprobs, keep)
            self.logprobs.extend(convert_logprobs(rows, self.decoder))
            self.cumulative_logprob += chosen_logprob_sum(rows)
        if not stop_hit and output.finish_reason is not None:
            self.finish_reason = str(FinishReason(output.finish_reason))
            self.stop_reason = output.stop_reason
        return stop_hit

    def _update_text(
        self, new_ids: list[int], num_before: int, finish: int | None
    ) -> tuple[bool, int]:
        """Detokenize the new tokens and look for a stop string: (whether one finished
        the child, how many of the new tokens to keep)."""
        assert self.detokenizer is not None
        text_ids = new_ids
        if (
            finish == FinishReason.STOP
            and new_ids
            and new_ids[-1] in self.stop_ids
            and not self.params.include_stop_str_in_output
        ):
            text_ids = new_ids[:-1]  # the stop token is not part of the text
        start = len(self.text)
        ends: list[int] = []  # text length after each of text_ids
        in_min = max(self.params.min_tokens - num_before, 0)  # new tokens still inside min_tokens
        if in_min:
            self._detokenize(text_ids[:in_min], ends)
            self._min_tokens_text_end = len(self.text)
            text_ids = text_ids[in_min:]
        self._detokenize(text_ids, ends)
        if finish is not None:
            self.text += self.detokenizer.flush()
            if ends:
                ends[-1] = len(self.text)
        if self.matcher is None or num_before + len(new_ids) <= self.params.min_tokens:
            return False, len(new_ids)
        match = self.matcher.find(self.text, max(start, self._min_tokens_text_end))
        if match is None:
            return False, len(new_ids)
        self.text = self.text[: match.truncate_to]
        self.finish_reason = str(FinishReason.STOP)
        self.stop_reason = match.stop
        # The token whose text completes the match is the last one kept.
        keep = next((i + 1 for i, end in enumerate(ends) if end >= match.end), len(new_ids))
        return True, keep

    def _detokenize(self, ids: list[int], ends: list[int]) -> None:
        """Append ``ids``' text; record the text length after each (token by token only
        where a stop string may have to cut between them)."""
        if self.matcher is not None and len(ids) > 1:
            for token in ids:
                self.text += self.detokenizer.update([token])
                ends.append(len(self.text))
            return
        self.text += self.detokenizer.update(ids)
        ends.extend([len(self.text)] * len(ids))

    def abort(self) -> None:
        self.finish_reason = str(FinishReason.ABORT)

    def completion(self, delta: bool) -> CompletionOutput:
        visible = len(self.text)
        if self.matcher is not None:
            visible = max(self.matcher.stable_length(visible, self.finished), self._sent_text)
        if delta:
            text = self.text[self._sent_text : visible]
            token_ids = self.token_ids[self._sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self._sent_logprobs :]
        else:
            text = self.text[:visible]
            token_ids = list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self._sent_text, self._sent_tokens = visible, len(self.token_ids)
        self._sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def _first_rows(lists: LogprobsLists, n: int) -> LogprobsLists:
    if len(lists.ranks) <= n:
        return lists
    return LogprobsLists(lists.token_ids[:n], lists.logprobs[:n], lists.ranks[:n])


class _RequestState:
    """One user request: its samples, prompt logprobs, metrics and optional sink."""

    def __init__(
        self,
        processed: ProcessedRequest,
        tokenizer: PreTrainedTokenizerBase | None,
        decoder: TokenDecoder | None,
        sink: OutputSink | None,
    ) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.output_kind = processed.params.output_kind
        self.sink = sink
        self.children = [
            _ChildState(i, req, req.sampling_params, tokenizer, decoder)
            for i, req in enumerate(processed.child_requests)
        ]
        wants_prompt_logprobs = processed.params.prompt_logprobs is not None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if wants_prompt_logprobs else None
        )
        self.prompt_decoder = decoder if processed.params.detokenize else None
        self._sent_prompt_logprobs = 0
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None
        self.metrics = RequestMetrics(arrival_time=processed.arrival_time)
        # A pooling request: its result arrives with its (only) final output.
        self.is_pooling = processed.pooling_params is not None
        self.pooled: PooledData | None = None

    @property
    def finished(self) -> bool:
        return all(child.finished for child in self.children)

    def record(self, output: EngineCoreOutput, now: float) -> None:
        """Request-level bookkeeping for one child's step output."""
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(
                convert_logprobs(output.new_prompt_logprobs, self.prompt_decoder)
            )
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if output.pooling_output is not None:
            self.pooled = output.pooling_output
        if output.new_token_ids:
            metrics = self.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            elif now > metrics.last_token_time:  # the step's first child (n > 1 share it)
                metrics.inter_token_latencies.append(now - metrics.last_token_time)
            metrics.last_token_time = now
            metrics.num_generation_tokens += len(output.new_token_ids)

    def make_output(self, changed: set[int], now: float
                    ) -> RequestOutput | PoolingRequestOutput | None:
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now
        if self.is_pooling:
            return self._pooling_output() if finished else None
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            children, delta = self.children, False
        elif self.output_kind == RequestOutputKind.DELTA:
            children, delta = [c for c in self.children if c.index in changed], True
        else:
            children, delta = self.children, False
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(delta),
            outputs=[child.completion(delta) for child in children],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dataclasses.replace(self.metrics),
            kv_transfer_params=self.kv_transfer_params if finished else None,
        )

    def _pooling_output(self) -> PoolingRequestOutput:
        """The result as a float32 tensor (empty when the request was aborted)."""
        import numpy as np
        import torch

        pooled = self.pooled
        data = torch.empty(0) if pooled is None else torch.from_numpy(
            np.frombuffer(pooled.data, dtype=np.float32).reshape(pooled.shape).copy())
        return PoolingRequestOutput(
            request_id=self.request_id, outputs=PoolingOutput(data),
            prompt_token_ids=self.prompt_token_ids, finished=True, prompt=self.prompt,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _take_prompt_logprobs(self, delta: bool) -> list[PositionLogprobs | None] | None:
        if self.prompt_logprobs is None:
            return None
        start = self._sent_prompt_logprobs if delta else 0
        self._sent_prompt_logprobs = len(self.prompt_logprobs)
        if delta and start == len(self.prompt_logprobs):
            return None
        return self.prompt_logprobs[start:]


class OutputProcessor:
    """Tracks the front-end state of every live request (keyed by parent and child id)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.decoder = TokenDecoder(tokenizer) if tokenizer is not None else None
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, _ChildState]] = {}

    def add_request(self, processed: ProcessedRequest, queue: OutputSink | None = None) -> None:
        """Start tracking a request; with ``queue``, its outputs go there instead of the
        ``request_outputs`` list (the async server's streaming path)."""
        if processed.request_id in self._requests:
            raise ValueError(f"request id {processed.request_id!r} is already in use")
        clash = [cid for cid in processed.child_request_ids if cid in self._children]
        if clash:
            raise ValueError(f"request id(s) {clash} are already in use")
        state = _RequestState(processed, self.tokenizer, self.decoder, queue)
        self._requests[processed.request_id] = state
        for child in state.children:
            self._children[child.request_id] = (state, child)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorResult:
        """Apply one engine step's outputs; outputs for unknown (aborted) ids are ignored."""
        now = time.monotonic()
        result = OutputProcessorResult()
        changed: dict[str, tuple[_RequestState, set[int]]] = {}
        for output in outputs:
            entry = self._children.get(output.request_id)
            if entry is None:
                continue
            state, child = entry
            stop_hit = child.update(output)
            state.record(output, now)
            if child.finished:
                del self._children[child.request_id]
                if stop_hit and output.finish_reason is None:
                    result.reqs_to_abort.append(child.request_id)
            if output.new_token_ids or child.finished:
                changed.setdefault(state.request_id, (state, set()))[1].add(child.index)
        for state, indices in changed.values():
            self._emit(state, state.make_output(indices, now), result)
        return result

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Stop tracking these parent requests; return their unfinished child ids for the
        core. A request streaming to a sink gets a final output with reason "abort"."""
        child_ids: list[str] = []
        now = time.monotonic()
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is None:
                continue
            aborted = {c.index for c in state.children if not c.finished}
            for child in state.children:
                if not child.finished:
                    child.abort()
                    child_ids.append(child.request_id)
                    self._children.pop(child.request_id, None)
            output = state.make_output(aborted, now)
            self._requests.pop(request_id)
            if state.sink is not None and output is not None:
                state.sink.put_nowait(output)
        return child_ids

    def fail_requests(self, child_ids: list[str], error: BaseException) -> list[str]:
        """Some engine-core requests were lost (their data-parallel rank died): their
        parent requests stop, a streaming consumer gets ``error``; return the parents'
        other unfinished child ids (on other ranks) for the caller to abort."""
        others: list[str] = []
        lost = set(child_ids)
        for child_id in child_ids:
            entry = self._children.get(child_id)
            if entry is None:
                continue
            state = entry[0]
            self._requests.pop(state.request_id, None)
            for child in state.children:
                if self._children.pop(child.request_id, None) is not None \
                        and child.request_id not in lost:
                    others.append(child.request_id)
            if state.sink is not None:
                state.sink.put_nowait(error)
        return others

    def propagate_error(self, error: BaseException) -> None:
        """The engine died: wake every streaming consumer with the error."""
        for state in self._requests.values():
            if state.sink is not None:
                state.sink.put_nowait(error)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        """The ids of the requests being tracked (unfinished)."""
        return list(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def _emit(
        self, state: _RequestState, output: RequestOutput | None, result: OutputProcessorResult
    ) -> None:
        if state.finished:
            self._requests.pop(state.request_id, None)
        if output is None:
            return
        if state.sink is not None:
            state.sink.put_nowait(output)
        else:
            result.request_outputs.append(output)
