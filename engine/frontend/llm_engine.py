"""LLMEngine: the synchronous front end (processor + core client + output processor).

Text in, RequestOutputs out. The offline ``LLM`` class drives it; the core behind
``client`` runs in this process here, or in another process for the server.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from engine.core.config import EngineConfig
from engine.core.engine_args import EngineArgs
from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine.frontend.output_processor import OutputProcessor
from engine.core.outputs import RequestOutput
from engine.frontend.processor import Processor
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler.stats import SpecDecodingStats
from engine.core.tokenizer import get_eos_token_ids, load_tokenizer
from engine.lora.registry import AddedLoRAs
from engine.lora.request import LoRARequest


class EngineCoreClient(Protocol):
    """How a front end reaches an engine core, wherever it runs."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs: ...

    def reset_prefix_cache(self) -> bool: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def is_sleeping(self) -> bool: ...

    def pause_scheduling(self) -> None: ...

    def abort_all_requests(self) -> int: ...

    def resume_scheduling(self) -> None: ...

    def update_weights(self, method: str, *args: Any) -> None: ...

    def call_utility(self, method: str, *args: Any) -> Any: ...

    def shutdown(self) -> None: ...


class InprocClient:
    """The engine core in this process: ``get_output`` runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.core.engine_core import EngineCore

        self.core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def pause_scheduling(self) -> None:
        self.core.pause_scheduling()

    def abort_all_requests(self) -> int:
        return self.core.abort_all_requests()

    def resume_scheduling(self) -> None:
        self.core.resume_scheduling()

    def update_weights(self, method: str, *args: Any) -> None:
        """One of the core's weight-update calls (``EngineCore.update_weights*``,
        ``init_weight_update_group``) by name."""
        getattr(self.core, method)(*args)

    def call_utility(self, method: str, *args: Any) -> Any:
        """One of the core's utilities (``EngineCoreProc.CORE_UTILITIES``) by name."""
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()


def _default_client(config: EngineConfig) -> EngineCoreClient:
    """The core in this process; with data parallelism one core process per rank (the
    ranks must step concurrently, so none of them runs in this process)."""
    if config.parallel.data_parallel_size > 1:
        from engine.core.dp_client import SyncDPClient

        return SyncDPClient.start(config)
    return InprocClient(config)


def build_processor(config: EngineConfig) -> tuple[Processor, Any]:
    """Tokenizer-side setup shared by the sync and async front ends."""
    from engine.model_executor.model_loader import load_model_files

    from engine.model_executor.models.transformers_backend.support import text_config

    files = load_model_files(config.model.model, hf_overrides=config.model.hf_overrides)
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    eos_id, extra_eos = get_eos_token_ids(tokenizer, list(files.eos_token_ids) or None)
    vocab_size = text_config(files.hf_config).vocab_size
    processor = Processor(
        tokenizer,
        max_model_len=config.scheduler.max_model_len,
        eos_token_id=eos_id,
        extra_eos_token_ids=extra_eos,
        vocab_size=vocab_size,
    )
    processor.lora_enabled = config.lora is not None
    processor.multimodal = build_multimodal_processor(config, files, tokenizer)
    if config.model.runner == "pooling":
        from engine.frontend.pooling_processor import PoolingModelInfo, PoolingProcessor

        info = PoolingModelInfo.of(config.model.pooler_config, files.hf_config, files.path)
        processor.pooling = PoolingProcessor(tokenizer, config.scheduler.max_model_len,
                                             vocab_size, info)
    return processor, tokenizer


def start_beside_processor(config: EngineConfig, start_client: Callable[[], Any]
                           ) -> tuple[Processor, Any, Any]:
    """``(processor, tokenizer, client)``: the front end's tokenizer side is built on a
    helper thread while ``start_client`` waits for an engine core *process* to load the
    model (its wait releases the GIL, so the two loads share the machine instead of
    adding up). Errors keep their order: the front end's own (a bad tokenizer or config)
    is raised even when the core failed too; a core started for a front end that failed
    is shut down."""
    with ThreadPoolExecutor(1, thread_name_prefix="engine-processor") as pool:
        job = pool.submit(build_processor, config)
        try:
            client = start_client()
        except BaseException:
            front_end_error = job.exception()
            if front_end_error is not None:
                raise front_end_error from None
            raise
        try:
            processor, tokenizer = job.result()
        except BaseException:
            client.shutdown()
            raise
    return processor, tokenizer, client


def build_multimodal_processor(config: EngineConfig, files: Any, tokenizer: Any) -> Any:
    """A vision-language model's image / video step for the front end (None: text)."""
    from engine.multimodal.processing import is_multimodal_config, processor_for
    from engine.multimodal.prompt import MultiModalInputProcessor

    if not is_multimodal_config(files.hf_config):
        return None
    if tokenizer is None:
        raise ValueError("a vision-language model needs its tokenizer (skip_tokenizer_init "
                         "is not supported for it)")
    mm_processor = processor_for(files.path, files.hf_config, tokenizer)
    scheduler = config.scheduler
    # A model that runs an item's tokens in one step: no item longer than a step's share.
    max_item_tokens = scheduler.max_chunk_tokens if scheduler.disable_chunked_mm_input else None
    return MultiModalInputProcessor(mm_processor, tokenizer, config.model.limit_mm_per_prompt,
                                    max_item_tokens)


def adopt_max_model_len(config: EngineConfig, processor: Processor, client: Any) -> int:
    """The max_model_len the engine core runs with (``--max-model-len auto`` is resolved
    after the workers sized the KV cache: an in-process core changed ``config``, a core
    process reports it when ready), set on the front end's config and processors."""
    ready = getattr(client, "ready", None)
    length = ready.max_model_len if ready is not None else config.scheduler.max_model_len
    config.scheduler.max_model_len = config.model.max_model_len = length
    processor.max_model_len = length
    if getattr(processor, "pooling", None) is not None:
        processor.pooling.max_model_len = length
    return length


class LLMEngine:
    """Add requests, step, collect RequestOutputs."""

    def __init__(self, config: EngineConfig, client: EngineCoreClient | None = None) -> None:
        self.config = config
        self.processor, self.tokenizer = build_processor(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        if client is None:
            client = _default_client(config)
        self.client = client
        adopt_max_model_len(config, self.processor, self.client)
        self._ids = itertools.count()
        self._spec_seen = SpecDecodingStats()  # a process-backed core's totals, last read
        self._loras = AddedLoRAs()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if lora_request is not None and self.processor.lora_enabled \
                and self._loras.needs_adding(lora_request):
            self.add_lora(lora_request)
        processed = self.processor.process(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time or time.monotonic(),
            priority=priority,
            add_special_tokens=add_special_tokens,
            lora_request=lora_request,
        )
        self.output_processor.add_request(processed)
        for child in processed.child_requests:
            self.client.add_request(child)

    def add_pooling_request(self, request_id: str, prompt: Any, params: Any, task: str,
                            *, text_pair: str | None = None, prompt_name: str | None = None,
                            priority: int = 0) -> None:
        """A pooling request (``--runner pooling``): see engine.frontend.pooling_processor."""
        pooling = self.processor.pooling
        if pooling is None:
            raise ValueError(f"{task} needs a pooling model; this engine generates "
                             "(start it with runner='pooling')")
        processed = pooling.process(request_id, prompt, params, task, text_pair=text_pair,
                                    prompt_name=prompt_name, priority=priority)
        self.output_processor.add_request(processed)
        for child in processed.child_requests:
            self.client.add_request(child)

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check the adapter on every rank and keep it loaded (ValueError: it does not
        fit the model, or LoRA is off)."""
        self._loras.needs_adding(lora_request)
        self.client.call_utility("add_lora", lora_request)
        self._loras.added(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self._loras.removed(lora_id)
        return bool(self.client.call_utility("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        return set(self.client.call_utility("list_loras"))

    def abort_request(self, request_ids: list[str]) -> None:
        child_ids = self.output_processor.abort_requests(request_ids)
        if child_ids:
            self.client.abort_requests(child_ids)

    def step(self) -> list[RequestOutput]:
        core_outputs = self.client.get_output()
        result = self.output_processor.process_outputs(core_outputs.outputs)
        if result.reqs_to_abort:
            self.client.abort_requests(result.reqs_to_abort)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding counts since the previous call, so a benchmark can take
        its measured rounds alone; None when speculative decoding is off.

        An in-process core's scheduler counts per interval and nothing else here reads
        them; a process-backed core reports totals, so the change since last time."""
        if self.config.speculative is None:
            return None
        core = getattr(self.client, "core", None)
        if core is not None:
            return core.get_stats().spec or SpecDecodingStats()
        totals = self.client.get_stats().spec_decoding_stats() or SpecDecodingStats()
        seen, self._spec_seen = self._spec_seen, totals
        per_pos = totals.num_accepted_tokens_per_pos
        seen_per_pos = seen.num_accepted_tokens_per_pos + [0] * len(per_pos)
        return SpecDecodingStats(
            num_drafts=totals.num_drafts - seen.num_drafts,
            num_draft_tokens=totals.num_draft_tokens - seen.num_draft_tokens,
            num_accepted_tokens=totals.num_accepted_tokens - seen.num_accepted_tokens,
            num_accepted_tokens_per_pos=[n - seen_per_pos[i] for i, n in enumerate(per_pos)],
        )

    def shutdown(self) -> None:
        self.client.shutdown()
