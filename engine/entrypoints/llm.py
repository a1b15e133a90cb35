"""The offline API, shaped like vLLM's ``LLM`` so users can switch by changing an import."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from engine.core.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchParams,
    eos_ids_of,
)
from engine.core.engine_args import EngineArgs
from engine.frontend.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.sampling_defaults import load_sampling_defaults
from engine.core.sampling_params import RequestOutputKind, SamplingParams
from engine.core.scheduler.stats import SpecDecodingStats
from engine.entrypoints.pooling_api import PoolingAPI, as_prompt_list
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM(PoolingAPI):
    """Generate from a model directory (or the embedded demo model) in this process.

    Every keyword of :class:`EngineArgs` is accepted, e.g. ``device``, ``dtype``,
    ``max_model_len``, ``enable_prefix_caching``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``block_size``, ``cpu_kvcache_space_gib``; ``runner="pooling"``
    (with ``convert``) serves an embedder / classifier through ``embed``, ``classify``,
    ``score``, ``reward`` and ``encode`` (:mod:`engine.entrypoints.pooling_api`).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        model_config = self.llm_engine.config.model
        self.sampling_defaults = load_sampling_defaults(
            model_config.model, model_config.generation_config
        )
        if note := self.sampling_defaults.describe():
            logger.info("%s (used when generate/chat get no sampling params)", note)
        # pause_generation / resume_generation, possibly from another thread than the
        # one running generate(): the lock serialises steps with pausing and aborting.
        self._engine_lock = threading.RLock()
        self._resumed = threading.Event()
        self._resumed.set()
        self._paused_by: int | None = None

    def shutdown(self) -> None:
        """Stop the engine: its worker processes (tensor / pipeline ranks) exit and
        their ports close. The object is unusable afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use when given no sampling params: the model's
        generation_config.json values (``generation_config="vllm"``: plain defaults)."""
        return self.sampling_defaults.sampling_params()

    # -- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.
        ``lora_request``: the adapter for every prompt, or one per prompt (None: the
        base model); needs ``enable_lora=True``."""
        return self._generate(as_prompt_list(prompts), sampling_params, use_tqdm, priority,
                              lora_request=lora_request)

    def _generate(
        self,
        prompt_list: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        loras = _broadcast_loras(lora_request, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(
                f"priority has {len(priority)} entries for {len(prompt_list)} prompts"
            )
        engine = self.llm_engine

        def submit(i: int, request_id: str) -> None:
            engine.add_request(request_id, prompt_list[i], params_list[i],
                               priority=priority[i] if priority else 0,
                               add_special_tokens=add_special_tokens,
                               lora_request=loras[i])

        return self._submit_and_run(submit, len(prompt_list), use_tqdm)

    def _submit_and_run(self, submit: Any, count: int, use_tqdm: bool) -> list[Any]:
        """Add ``count`` requests (``submit(i, request_id)``), run them all to completion
        and return their final outputs in order; on any error (a bad prompt, Ctrl-C) the
        requests already added are aborted, so none is left holding KV blocks."""
        engine = self.llm_engine
        request_ids: list[str] = []
        self._wait_until_resumed()
        try:
            with self._engine_lock:
                for i in range(count):
                    request_id = engine.next_request_id()
                    request_ids.append(request_id)  # first: a failed submit is aborted too
                    submit(i, request_id)
            return self._run_to_completion(request_ids, use_tqdm)
        except BaseException:
            with self._engine_lock:
                engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate. Messages may
        hold images (``image_url`` parts with data: / http(s): / file: URLs, ``image_pil``
        parts; vLLM's) for a vision-language model."""
        from engine.multimodal.chat import chat_prompt
        from engine.multimodal.media import connector_from_config

        conversations = _as_conversations(messages)
        connector = connector_from_config(self.llm_engine.config.model)
        prompts = [
            chat_prompt(
                self.llm_engine.processor,
                conversation,
                connector,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The rendered template already holds BOS and other special tokens.
        return self._generate(prompts, sampling_params, use_tqdm, add_special_tokens=False,
                              lora_request=lora_request)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (:mod:`engine.core.beam_search`): per prompt, the best
        ``params.beam_width`` sequences, best first. Each round submits every live beam of
        every prompt at once as a one-token request (the prefix cache shares the beams'
        common blocks) and steps the engine until all are done."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, not {type(params).__name__}")
        processor = self.llm_engine.processor
        eos_ids = eos_ids_of(processor)
        searches = []
        for prompt in as_prompt_list(prompts):
            _, token_ids = processor.parse_text_prompt(prompt, add_special_tokens=True)
            processor._validate_prompt(token_ids)
            searches.append(
                BeamSearchInstance(token_ids, params, eos_ids, processor.max_model_len))
        round_params = params.round_params()
        bar = _progress_bar(params.max_tokens) if use_tqdm else None
        try:
            while live := [s for s in searches if not s.done]:
                beams = [beam for s in live for beam in s.beams]
                outputs = self._generate([{"prompt_token_ids": b.tokens} for b in beams],
                                         round_params, use_tqdm=False,
                                         lora_request=lora_request)
                start = 0
                for search in live:
                    results = outputs[start: start + len(search.beams)]
                    start += len(search.beams)
                    search.advance([_one_position(o) for o in results])
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        tokenizer = self.get_tokenizer()
        return [s.finish(tokenizer) for s in searches]

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its first request (checked against the model on every
        rank; ValueError naming what does not fit)."""
        with self._engine_lock:
            return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (requests running under it finish with it)."""
        with self._engine_lock:
            return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        with self._engine_lock:
            return self.llm_engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (False while blocks are still in use)."""
        return self.llm_engine.client.reset_prefix_cache()

    # -- sleep mode and pausing (RL training loops) ---------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and the forward graphs over it) on every rank, e.g. while
        a trainer shares the device. Level 1 keeps the weights in host memory; level 2
        drops them (:meth:`wake_up` reloads them from the model directory). Needs
        ``enable_sleep_mode=True`` and no unfinished request; resets the prefix cache."""
        with self._engine_lock:
            self.llm_engine.client.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags``: "weights", "kv_cache", or both (None). Waking the
        weights first leaves room to update them before the KV cache is allocated."""
        with self._engine_lock:
            self.llm_engine.client.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.client.is_sleeping()

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating, e.g. for a weight update, with vLLM's modes for the requests
        in flight (a ``generate`` running in another thread):

        - ``"abort"``: abort them now (they finish with finish_reason "abort");
        - ``"wait"``: let them run to completion, then return;
        - ``"keep"``: freeze them where they are; they continue on resume.

        New ``generate`` calls from other threads wait until :meth:`resume_generation`
        (from the pausing thread itself they raise, as nothing could resume them).
        ``clear_cache`` resets the prefix cache once nothing holds blocks."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', not {mode!r}")
        engine = self.llm_engine
        with self._engine_lock:
            self._resumed.clear()
            self._paused_by = threading.get_ident()
            if mode == "abort":
                engine.client.abort_all_requests()
            elif mode == "keep":
                engine.client.pause_scheduling()
        if mode != "keep":
            while engine.has_unfinished_requests():  # generate() (elsewhere) drains them
                time.sleep(0.005)
            if clear_cache:
                self.reset_prefix_cache()

    def resume_generation(self) -> None:
        """Undo :meth:`pause_generation`: kept requests continue, held ones start."""
        with self._engine_lock:
            self.llm_engine.client.resume_scheduling()
            self._paused_by = None
            self._resumed.set()

    def is_paused(self) -> bool:
        return not self._resumed.is_set()

    def _wait_until_resumed(self) -> None:
        if self._resumed.is_set():
            return
        if self._paused_by == threading.get_ident():
            raise RuntimeError("generation is paused: call resume_generation() first")
        self._resumed.wait()

    # -- weight updates (RL training loops; engine.model_executor.weight_update) ----------
    # Each call needs no unfinished request (pause_generation or let them finish first),
    # swaps in a model built from the new tensors on every rank (a refused update leaves
    # the old weights serving) and resets the prefix cache. It may run while asleep: after
    # sleep(level=2) only the new model is ever held, and the weights are awake after it.
    def update_weights(self, path: str) -> None:
        """Load the checkpoint directory ``path`` (the running architecture, any weights)
        on every rank, each its tensor / pipeline shard."""
        with self._engine_lock:
            self.llm_engine.client.update_weights("update_weights", str(path))

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int) -> None:
        """Join a trainer's process group (the platform's backend: gloo on the CPU, NCCL
        on GPUs; never torch.distributed's default group): the trainer is rank 0 and
        hosts ``master_address:master_port``, engine rank ``i`` is ``rank_offset + i``.
        Blocks until every rank has joined (the trainer joins with
        ``engine.distributed.weight_sync.create_weight_sync_group(..., rank=0)``)."""
        with self._engine_lock:
            self.llm_engine.client.update_weights(
                "init_weight_update_group", master_address, int(master_port),
                int(rank_offset), int(world_size))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[Any],
                                        shapes: Sequence[Sequence[int]],
                                        packed: bool = False) -> None:
        """Receive the model's tensors (HF checkpoint names, full unsharded shapes) by
        broadcast from the trainer's rank 0 in this order; every rank loads its shard.
        ``packed``: the trainer sent them in byte buckets
        (``weight_sync.broadcast_named_tensors(..., packed=True)``), a few broadcasts
        instead of one per tensor."""
        with self._engine_lock:
            self.llm_engine.client.update_weights(
                "update_weights_from_distributed", list(names),
                [str(d).removeprefix("torch.") for d in dtypes],
                [[int(n) for n in shape] for shape in shapes], bool(packed))

    def update_weights_from_tensors(self, named_tensors: Sequence[tuple[str, Any]]) -> None:
        """Load tensors of a trainer in this process (HF checkpoint names), passed to
        every rank without a copy: shared memory on the CPU (the tensors move into it),
        CUDA IPC handles on GPUs, both through torch.multiprocessing's reductions."""
        from engine.core.dp_client import check_supported
        from engine.model_executor.weight_update import share_tensors

        check_supported(self.llm_engine.config, "update_weights_from_tensors")
        handles = share_tensors(named_tensors, self.llm_engine.config.parallel.world_size)
        with self._engine_lock:
            self.llm_engine.client.update_weights("update_weights_from_tensors", handles)

    def get_spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Draft and accepted token counts since the previous call (None when speculative
        decoding is off): call once before the rounds to measure, once after."""
        return self.llm_engine.get_spec_decoding_stats()

    # -- internals ------------------------------------------------------------------------
    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        try:
            while engine.has_unfinished_requests():
                with self._engine_lock:
                    outputs = engine.step()
                if not outputs and not self._resumed.is_set():
                    self._resumed.wait(0.01)  # paused with mode "keep": nothing runs
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in request_ids]


def _one_position(output: RequestOutput):
    """The logprobs of a one-token request's single generated position (None if it
    generated nothing)."""
    completion = output.outputs[0]
    return completion.logprobs[0] if completion.logprobs else None


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt, each asking only for its final output (offline
    calls return finished requests, so per-step outputs would be built for nothing; the
    caller's objects are left as they are)."""
    if isinstance(params, SamplingParams):
        return [_final_only(params)] * n
    params = [_final_only(p) for p in params]
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _broadcast_loras(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
                     ) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if isinstance(lora, (str, bytes)) or not isinstance(lora, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got "
                         f"{type(lora).__name__}")
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora requests for {n} prompts")
    return list(lora)


def _final_only(params: SamplingParams) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, not {type(params).__name__}")
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return params.clone(output_kind=RequestOutputKind.FINAL_ONLY)


def _as_conversations(messages: Messages | Sequence[Messages]) -> list[Messages]:
    if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
        return [list(messages)]  # type: ignore[list-item]
    if isinstance(messages, Sequence) and messages and all(isinstance(m, list) for m in messages):
        return [list(m) for m in messages]
    raise ValueError("messages must be a list of {'role', 'content'} dicts, or a list of such lists")


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=total < 2)
