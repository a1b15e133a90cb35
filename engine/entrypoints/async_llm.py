"""AsyncLLM: the asyncio front end the OpenAI server runs on.

Tokenization (``Processor``) and detokenization (``OutputProcessor``) run here, in the
server's process; the engine core steps in its own process behind an
:class:`AsyncMPClient`. One output-handler task (started on first use) pulls each step's
``EngineCoreOutputs``, turns them into ``RequestOutput``s, forwards stop-string aborts to
the core, and hands every output to its request's :class:`RequestOutputCollector`, which
``generate`` drains. A consumer that stops iterating (or whose task is cancelled: a client
disconnect) aborts its request in the core, freeing its KV blocks. ``encode`` does the
same for one pooling request (``--runner pooling``): one final output, no stream.

If the core dies, every in-flight ``generate`` raises :class:`EngineDeadError` and new
requests fail at once, until ``restart_core`` starts a fresh core (the server's
``--restart-engine-core``).

With ``data_parallel_size > 1`` the client is an :class:`~engine.core.dp_async_client.AsyncDPClient`
over one core per rank; under ``data_parallel_on_rank_failure="continue"`` a dead rank
fails only its own requests (a ``RankDeadError`` naming them) and the engine serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from engine.core.beam_search import BeamSearchInstance, BeamSearchParams, eos_ids_of
from engine.core.config import EngineConfig
from engine.core.core_protocol import EngineCoreStats, describe_exception
from engine.core.dp_async_client import start_async_client
from engine.core.dp_client import RankDeadError, check_supported
from engine.core.engine_args import EngineArgs
from engine.core.errors import EngineDeadError, EngineSleepingError
from engine.core.mp_client import STARTUP_TIMEOUT_S
from engine.core.outputs import PoolingRequestOutput, RequestOutput
from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import RequestOutputKind, SamplingParams
from engine.frontend.llm_engine import (
    adopt_max_model_len,
    build_processor,
    start_beside_processor,
)
from engine.frontend.output_collector import RequestOutputCollector
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import PromptType
from engine.lora.registry import AddedLoRAs
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Stream generations from an engine core running in another process."""

    def __init__(
        self, config: EngineConfig, *, startup_timeout_s: float = STARTUP_TIMEOUT_S,
        client: Any = None,
    ) -> None:
        """``client``: an asyncio core client over cores someone else started (the
        ``--api-server-count`` launcher's, over attached channels); such cores are not
        this engine's to restart. By default the engine starts its own."""
        self.config = config
        self.model_name = config.model.served_model_name or config.model.model
        self.max_model_len = config.scheduler.max_model_len
        self._startup_timeout_s = startup_timeout_s
        self.attached = client is not None
        if client is not None:
            self.processor, self.tokenizer = build_processor(config)
            self.client = client
        else:
            # Blocks until the core has loaded the model (or raises EngineStartupError);
            # with data parallelism, one core per rank behind an AsyncDPClient. The
            # tokenizer loads meanwhile.
            self.processor, self.tokenizer, self.client = start_beside_processor(
                config, lambda: start_async_client(config,
                                                   startup_timeout_s=startup_timeout_s))
        self.output_processor = OutputProcessor(self.tokenizer)
        # --max-model-len auto: the length the core resolved once the KV cache was sized.
        self.max_model_len = adopt_max_model_len(config, self.processor, self.client)
        self.num_core_restarts = 0
        self._handler: asyncio.Task | None = None
        self._handler_loop: asyncio.AbstractEventLoop | None = None
        self._error: EngineDeadError | None = None
        self._closed = False
        # Sleep mode and pause_generation (RL training loops).
        self.sleeping = False
        self.paused = False
        self._loras = AddedLoRAs()  # adapters the core has (engine.lora)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(args.create_engine_config(), **kwargs)

    # -- state ------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True once the core has died (it never comes back)."""
        if self._error is None and self.client.dead is None and self.client.exited():
            self._error = self._dead_error()
        return self._error is not None or self.client.dead is not None

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def closed(self) -> bool:
        """True once ``shutdown`` was called (a dead core alone does not close the engine)."""
        return self._closed

    @property
    def core_pid(self) -> int:
        """The process id of the current engine core (data parallelism: rank 0's)."""
        return self.client.pids[0]

    @property
    def core_pids(self) -> list[int]:
        """The process id of each engine core, by data-parallel rank."""
        return list(self.client.pids)

    async def check_health(self) -> None:
        """Raise EngineDeadError if the core has died or the engine was shut down."""
        self._check_usable()

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._error is not None:
            raise self._error
        self.client.check_alive()

    def _dead_error(self) -> EngineDeadError:
        try:
            self.client.check_alive()
        except EngineDeadError as error:
            return error
        return EngineDeadError("engine core is dead")

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they stream (DELTA: only new text each time).

        Raises ValueError for bad input, EngineDeadError if the core dies. Leaving the
        loop early (or cancelling the task) aborts the request in the core.
        ``lora_request``: run under this adapter (added to the core first if new).
        """
        self._ensure_output_handler()
        await self._admit()
        if lora_request is not None and self.processor.lora_enabled \
                and self._loras.needs_adding(lora_request):
            await self.add_lora(lora_request)
        processed = self.processor.process(
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            cache_salt=cache_salt,
            add_special_tokens=add_special_tokens,
            lora_request=lora_request,
        )
        collector = RequestOutputCollector(processed.params.output_kind)
        # Track before sending: outputs (or the core's death) can only find a known request.
        self.output_processor.add_request(processed, queue=collector)
        finished = False
        try:
            for child in processed.child_requests:
                await self.client.add_request(child)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_nowait([request_id])

    async def beam_search(
        self,
        prompt: PromptType,
        request_id: str,
        params: BeamSearchParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's beam search for one prompt (:mod:`engine.core.beam_search`, the same
        bookkeeping as ``LLM.beam_search``): yields one finished RequestOutput whose
        ``outputs`` are the best ``beam_width`` beams, best first (generated part only).

        Each round's beams run concurrently as one-token requests
        ``{request_id}-b{round}-{i}``; cancelling the consumer aborts them. Raises
        ValueError for bad input.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, not {type(params).__name__}")
        processor = self.processor
        text, token_ids = processor.parse_text_prompt(prompt, add_special_tokens)
        processor._validate_prompt(token_ids)
        search = BeamSearchInstance(token_ids, params, eos_ids_of(processor),
                                    processor.max_model_len)
        round_params = params.round_params()

        async def one_token(tokens: list[int], beam_request_id: str):
            final = None
            generator = self.generate({"prompt_token_ids": tokens}, round_params,
                                      beam_request_id, priority=priority, cache_salt=cache_salt,
                                      lora_request=lora_request)
            async with contextlib.aclosing(generator):
                async for output in generator:
                    final = output
            completion = final.outputs[0] if final is not None else None
            return completion.logprobs[0] if completion and completion.logprobs else None

        while not search.done:
            prefix = f"{request_id}-b{search.rounds}"
            tasks = [asyncio.ensure_future(one_token(beam.tokens, f"{prefix}-{i}"))
                     for i, beam in enumerate(search.beams)]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            search.advance(results)
        yield search.request_output(request_id, text, self.tokenizer)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        *,
        task: str,
        text_pair: str | None = None,
        prompt_name: str | None = None,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """Run one pooling request (``task``: embed, classify, score, reward, encode; a
        ``text_pair`` makes it a cross-encoder pair) to its single output.

        Raises ValueError for bad input or on a generating engine, EngineDeadError if the
        core dies. Cancelling the awaiting task aborts the request in the core. A request
        aborted by ``abort`` returns an output whose ``outputs.data`` is empty.
        """
        pooling = self.processor.pooling
        if pooling is None:
            raise ValueError(f"{task} needs a pooling model; this engine generates text "
                             "(start it with --runner pooling)")
        self._ensure_output_handler()
        await self._admit()
        processed = pooling.process(request_id, prompt, pooling_params, task,
                                    text_pair=text_pair, prompt_name=prompt_name,
                                    priority=priority)
        collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
        self.output_processor.add_request(processed, queue=collector)
        finished = False
        try:
            for child in processed.child_requests:
                await self.client.add_request(child)
            output = collector.get_nowait() or await collector.get()
            finished = True
            return output  # type: ignore[return-value]  # a pooling request's output
        finally:
            if not finished:
                self._abort_nowait([request_id])

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_nowait(ids)

    def _abort_nowait(self, request_ids: list[str]) -> None:
        child_ids = self.output_processor.abort_requests(request_ids)
        if not child_ids or self._closed:
            return
        try:
            self.client.abort_requests_nowait(child_ids)
        except EngineDeadError:
            pass  # the core is gone, and its requests with it

    # -- utilities --------------------------------------------------------------------------
    async def get_stats(self) -> EngineCoreStats:
        """The core's load now (gauges) and cumulative counters, for /metrics."""
        self._check_usable()
        return await self.client.get_stats()

    async def get_engine_stats(self) -> list[EngineCoreStats | None]:
        """Each engine core's stats, by data-parallel rank (None: a dead rank)."""
        self._check_usable()
        if hasattr(self.client, "get_engine_stats"):
            return await self.client.get_engine_stats()
        return [await self.client.get_stats()]

    async def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False while requests hold blocks."""
        self._check_usable()
        return await self.client.reset_prefix_cache()

    # -- sleep mode and pausing (RL training loops) ---------------------------------------
    async def _admit(self) -> None:
        """A new request waits while generation is paused and is refused while asleep."""
        while self.paused:
            await asyncio.sleep(0.01)
        if self.sleeping:
            raise EngineSleepingError("the engine is sleeping: wake it up (POST /wake_up) "
                                      "before sending requests")

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2) on every rank; see
        ``EngineCore.sleep`` (refused unless sleep mode is on and nothing is running)."""
        self._check_usable()
        await self.client.sleep(level)
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both)."""
        self._check_usable()
        await self.client.wake_up(tags)
        self.sleeping = await self.client.is_sleeping()

    async def is_sleeping(self) -> bool:
        self._check_usable()
        self.sleeping = await self.client.is_sleeping()
        return self.sleeping

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating (vLLM's modes for the requests in flight): ``"abort"`` aborts
        them (finish reason "abort"), ``"wait"`` returns once they have completed,
        ``"keep"`` freezes them in the scheduler until :meth:`resume_generation`. New
        requests wait until then. ``clear_cache`` resets the prefix cache once no
        request holds blocks (not with ``"keep"``)."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', not {mode!r}")
        self._check_usable()
        self.paused = True
        if mode == "abort":
            self._abort_nowait(self.output_processor.request_ids())
        elif mode == "keep":
            await self.client.pause_scheduling()
            return
        while self.output_processor.has_unfinished_requests():
            self._check_usable()
            await asyncio.sleep(0.005)
        if clear_cache:
            await self.client.reset_prefix_cache()

    async def resume_generation(self) -> None:
        """Undo :meth:`pause_generation`: kept requests continue, waiting ones start."""
        self._check_usable()
        await self.client.resume_scheduling()
        self.paused = False

    # -- weight updates (RL training loops; see LLM.update_weights) -----------------------
    async def update_weights(self, path: str) -> None:
        """Every rank loads its shard of checkpoint directory ``path``."""
        await self._update("update_weights", str(path))

    async def init_weight_update_group(self, master_address: str, master_port: int,
                                       rank_offset: int, world_size: int) -> None:
        """Join the trainer's process group (the trainer is rank 0)."""
        await self._update("init_weight_update_group", master_address, master_port,
                           rank_offset, world_size)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                              shapes: list[list[int]],
                                              packed: bool = False) -> None:
        """Receive the tensors by broadcast from the trainer's rank 0, in this order
        (``packed``: in byte buckets, see ``LLM.update_weights_from_distributed``)."""
        await self._update("update_weights_from_distributed", list(names),
                           [str(d).removeprefix("torch.") for d in dtypes],
                           [list(shape) for shape in shapes], bool(packed))

    async def update_weights_from_tensors(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Load tensors of a trainer in this process (shared memory / CUDA IPC)."""
        from engine.model_executor.weight_update import share_tensors

        check_supported(self.config, "update_weights_from_tensors")
        handles = share_tensors(named_tensors, self.config.parallel.world_size)
        await self._update("update_weights_from_tensors", handles)

    # -- LoRA adapters ----------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check the adapter on every rank and keep it loaded; ValueError naming what
        does not fit (missing files, DoRA, a rank above max_lora_rank, another base)."""
        self._check_usable()
        self._loras.needs_adding(lora_request)
        await self.client.call_utility("add_lora", lora_request)
        self._loras.added(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (requests running under it finish with it)."""
        self._check_usable()
        self._loras.removed(lora_id)
        return bool(await self.client.call_utility("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        self._check_usable()
        return set(await self.client.call_utility("list_loras"))

    async def _update(self, method: str, *args: Any) -> None:
        self._check_usable()
        await self.client.update_weights(method, *args)
        self.sleeping = await self.client.is_sleeping()  # an update wakes the weights

    # -- the output handler -----------------------------------------------------------------
    def _ensure_output_handler(self) -> None:
        self._check_usable()
        loop = asyncio.get_running_loop()
        if self._handler is not None and self._handler_loop is loop and not self._handler.done():
            return
        self._handler_loop = loop
        self._handler = loop.create_task(
            self._run_output_handler(), name="async-llm-output-handler"
        )

    async def _run_output_handler(self) -> None:
        client, output_processor = self.client, self.output_processor
        try:
            while True:
                try:
                    outputs = await client.get_output()
                except RankDeadError as error:  # one data-parallel rank; the others serve
                    others = output_processor.fail_requests(error.request_ids, error)
                    if others:
                        client.abort_requests_nowait(others)
                    continue
                result = output_processor.process_outputs(outputs.outputs)
                if result.reqs_to_abort:
                    client.abort_requests_nowait(result.reqs_to_abort)
        except EngineDeadError as error:
            self._fail(error)
        except Exception as exc:
            logger.exception("AsyncLLM output handler failed")
            self._fail(EngineDeadError(f"output handler failed: {describe_exception(exc)}"))

    def _fail(self, error: EngineDeadError) -> None:
        self._error = error
        self.output_processor.propagate_error(error)

    # -- core death and restart -------------------------------------------------------------
    def fail_in_flight(self) -> EngineDeadError | None:
        """If the core has died: make sure every in-flight request has its EngineDeadError
        now (the output handler may not have noticed yet, or may never run: no request was
        made) and return the error; None while the core lives."""
        if not self.errored:
            return None
        error = self._error or self.client.dead or self._dead_error()
        self._fail(error)  # idempotent: a collector keeps the first error
        return error

    async def restart_core(self) -> int:
        """Replace a dead core by a fresh one; return its pid.

        In-flight requests get their EngineDeadError first; requests made while the new
        core loads still fail with it (a 503), later ones are served by the new core.
        Raises EngineStartupError (the engine stays dead) if the new core cannot start,
        and RuntimeError on a live core.
        """
        error = self.fail_in_flight()
        if error is None:
            raise RuntimeError("the engine core is alive; refusing to restart it")
        if self.attached:
            raise error  # its cores belong to the launcher: they are not ours to restart
        if self._closed:
            raise error
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self._handler = None
        # Forget the dead core's requests: their consumers hold the error already.
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client.shutdown()  # reaps the old process, closes its sockets and run dir
        started = time.monotonic()
        client = await _in_thread(
            lambda: start_async_client(self.config, startup_timeout_s=self._startup_timeout_s)
        )
        if self._closed:  # shut down while the new core was loading
            client.shutdown()
            raise EngineDeadError("the engine has been shut down")
        self.client = client
        self._error = None
        self.sleeping = self.paused = False  # the new core is awake and scheduling
        self._loras = AddedLoRAs()  # the new core has none: added again when named
        self.num_core_restarts += 1
        logger.info(
            "engine core restarted in %.1f s (pid %d)", time.monotonic() - started, self.core_pid
        )
        return self.core_pid

    # -- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the core process; in-flight requests fail with EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self.output_processor.propagate_error(EngineDeadError("the engine has been shut down"))
        self.client.shutdown()


async def _in_thread(build: Any) -> Any:
    """Run the blocking ``build()`` in a daemon thread (not the loop's executor, so that a
    server stopping mid-restart does not wait for a model load); if the awaiting task is
    cancelled, whatever ``build`` returns later is shut down."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    cancelled = threading.Event()

    def deliver(result: Any, exc: BaseException | None) -> None:
        if future.done():
            if exc is None and hasattr(result, "shutdown"):
                result.shutdown()
            return
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)

    def run() -> None:
        try:
            result, exc = build(), None
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
            result, exc = None, error
        if cancelled.is_set() or loop.is_closed():
            if exc is None and hasattr(result, "shutdown"):
                result.shutdown()
            return
        try:
            loop.call_soon_threadsafe(deliver, result, exc)
        except RuntimeError:  # the loop closed meanwhile
            if exc is None and hasattr(result, "shutdown"):
                result.shutdown()

    threading.Thread(target=run, name="engine-core-restart", daemon=True).start()
    try:
        return await future
    except asyncio.CancelledError:
        cancelled.set()
        raise
