"""One rank's model, KV cache and runner: what every executor drives.

The single-process executor holds one :class:`Worker` in its own process; the
multi-process and Ray executors run one per rank (``engine.model_executor.worker_proc``).
A worker's life: ``load()`` (weights of its shard; returns how many KV blocks it could
hold), ``initialize_cache(num_blocks)`` (the engine-wide count: the smallest over the
ranks), then ``execute_model`` once per step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import msgspec
import torch

from engine.core.batch_invariance import set_batch_invariant
from engine.core.config import EngineConfig
from engine.core.interfaces import Platform
from engine.core.interfaces.attention import kv_cache_torch_dtype
from engine.core.kv_cache.groups import KVCacheLayout, build_kv_cache_layout
from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.model_executor import kernel_report
from engine.model_executor.model_loader import load_model
from engine.model_executor.model_runner import KVCacheSpec, ModelRunner
from engine.model_executor.models.transformers_backend.support import implementation_of
from engine.model_executor.state_cache import model_state_spec

logger = logging.getLogger(__name__)


def activation_dtype(config: EngineConfig, platform: Platform, dtype: torch.dtype) -> torch.dtype:
    """What the model computes in: the config's activation dtype, else for ``--dtype
    auto`` the platform's choice for these weights (recorded in the config), else the
    weights' own dtype."""
    model = config.model
    if model.activation_dtype is not None:
        return getattr(torch, model.activation_dtype)
    if not model.dtype_is_auto:
        return dtype
    activation = platform.activation_dtype(dtype)
    model.activation_dtype = str(activation).removeprefix("torch.")
    return activation


def load_platform_model(config: EngineConfig, platform: Platform, parallel: Any = None,
                        weights: Any = None) -> tuple[torch.nn.Module, Any]:
    """The model of ``config`` loaded for ``platform``: its dtypes checked, its linears on
    the platform's dense and quantized GEMM kernels, its layers on the platform's fused
    ops and attention backend (returned too). ``parallel``: this rank's shard only;
    ``weights``: HF-named tensors instead of the model directory's (a weight update)."""
    dtype = getattr(torch, config.model.dtype)
    activation = activation_dtype(config, platform, dtype)
    for wanted in {dtype, activation}:
        why = platform.check_dtype(wanted)
        if why:
            raise ValueError(why)
    # the platform's own backend, else a plugin's (engine_register_attention_backends)
    from engine.core.plugins import get_plugin_registry

    backend_cls = get_plugin_registry().select_attention_backend(
        platform, config.device.attention_backend)
    attn_backend = backend_cls(config.cache.block_size, platform.device())
    if config.cache.kv_cache_dtype != "auto":  # before the layers are made: they read it
        attn_backend.set_kv_cache_dtype(config.cache.kv_cache_dtype)
    model = load_model(
        config.model.model, dtype, platform.device(), attn_backend,
        quantization=config.model.quantization,
        dense_gemm_kernels=platform.dense_gemm_kernels(),
        quantized_gemm_kernels=platform.quantized_gemm_kernels(),
        fused_ops=platform.fused_ops(),
        activation_dtype=activation,
        parallel=parallel,
        fused_moe_kernels=platform.fused_moe_kernels(),
        hf_overrides=config.model.hf_overrides,
        model_impl=config.model.model_impl,
        pooler_config=config.model.pooler_config,
        weights=weights,
    )
    if config.model.batch_invariant:
        scheme = kernel_report.quantization_scheme(model)
        if scheme is not None:  # their GEMMs change schedule with the row count
            raise ValueError(f"batch-invariant mode covers unquantized weights; this model "
                             f"is quantized ({scheme})")
    return model, attn_backend


class Worker:
    """The model shard of one rank (``parallel`` None: the whole model, one rank)."""

    def __init__(self, config: EngineConfig, platform: Platform, parallel: Any = None,
                 num_threads: int | None = None) -> None:
        self.config = config
        # before any kernel is chosen: kernels read the process's mode
        set_batch_invariant(config.model.batch_invariant)
        self.num_threads = num_threads if num_threads is not None else config.device.num_threads
        self.platform = platform
        self.parallel = parallel
        self.layout = None if parallel is None else parallel.layout
        self.runner: ModelRunner | None = None
        self.proposer = None
        self.state_spec = None  # the model's state (Mamba) layers, set by load()
        self.lora_manager = None  # the model's LoRA adapters (engine.lora), set by load()

    @property
    def is_output_rank(self) -> bool:
        return self.layout is None or self.layout.is_output_rank

    def load(self) -> int:
        """Load this rank's weights (and a draft model); how many KV blocks fit here."""
        config, platform = self.config, self.platform
        platform.check_and_update_config(config)
        platform.init_worker(self.num_threads)
        platform.seed_everything(config.model.seed)
        dtype = getattr(torch, config.model.dtype)
        self.model, self.attn_backend = load_platform_model(config, platform, self.parallel)
        self._make_lora_manager()
        self.weights_bytes = kernel_report.weight_bytes(self.model)
        spec = self.model.kv_cache_spec()
        # The KV cache holds the model dtype (vLLM's "auto"): a bf16 checkpoint computed in
        # float32 keeps bf16 K/V, which the attention kernels widen as they read; or, with
        # --kv-cache-dtype fp8 / fp8_e5m2, one byte per value (a draft model's cache
        # stays in the model dtype).
        kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        from engine.spec_decode.factory import build_proposer

        self.proposer = build_proposer(
            config, platform, self.model, dtype, activation_dtype(config, platform, dtype)
        )
        # A draft's KV cache shares the block ids: every block costs both.
        self.draft_kv_spec = None if self.proposer is None else self.proposer.kv_cache_spec()
        self.kv_cache_layout = self._kv_cache_layout(spec)
        self.state_spec = self._check_state_layers()
        if self.state_spec is not None:  # one state slot per seat
            self.kv_cache_layout = dataclasses.replace(
                self.kv_cache_layout, num_state_slots=config.scheduler.max_num_seqs)
        # One cache tensor per layer of a group: with several groups a block id costs the
        # layers of one group, not of the whole model.
        self.kv_spec = KVCacheSpec(self.kv_cache_layout.group_size, spec.num_kv_heads,
                                   spec.head_size, kv_dtype, mla=spec.mla)
        self.full_kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_size,
                                        kv_dtype, mla=spec.mla)
        draft_model = getattr(self.proposer, "model", None)
        if draft_model is not None:  # each tensor once: an EAGLE head shares the target's
            self.weights_bytes = kernel_report.weight_bytes(
                torch.nn.ModuleList([self.model, draft_model]))
        if self.lora_manager is not None:  # the adapter slots sit beside the weights
            self.weights_bytes += self.lora_manager.nbytes
        self.activation_bytes = self.profile_activations()
        return self.kv_block_capacity()

    # -- memory profiling -----------------------------------------------------------------
    def _why_not_profiled(self) -> str | None:
        """Why this rank sizes its KV cache without a profile run (None: it profiles)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return "num_gpu_blocks_override fixes the block count"
        if cache.kv_cache_memory_bytes is not None:
            return "--kv-cache-memory gives its size"
        if not self.platform.kv_cache_needs_profile(cache):
            return f"platform {self.platform.name}: the KV cache size is given"
        if self.config.model.runner == "pooling":
            return "pooling models are sized analytically"
        if self.layout is not None and self.layout.pipeline_parallel_size > 1:
            return "pipeline stages are sized analytically"
        return None

    def profile_activations(self) -> int | None:
        """Peak activation bytes of one dummy step at ``max_num_batched_tokens`` tokens
        (the longest prompts max_model_len allows, the rest one token each, so the
        sampler runs ``min(max_num_seqs, tokens)`` rows), run by a throwaway runner over
        a one-block KV cache every request's table points into; None when not measured
        (the platform cannot, or this model kind is not profiled): the KV cache is then
        sized analytically. Never raises: a failure logs and falls back."""
        why_not = self.why_not_profiled = self._why_not_profiled()
        if why_not is not None:
            logger.debug("no memory profile run: %s", why_not)
            self.why_not_profiled = why_not
            return None
        import time

        start = time.perf_counter()
        runner = None
        try:
            runner = self._make_runner(num_blocks=1, max_model_len=None, profile=True)
            step = self._profile_step()
            peak = self.platform.profile_peak_bytes(lambda: runner.execute_model(step))
        except Exception as exc:  # noqa: BLE001 - profiling must never stop the engine
            logger.warning("memory profile run failed (%s: %s): the KV cache is sized "
                           "analytically", type(exc).__name__, exc)
            self.why_not_profiled = f"the profile run failed: {type(exc).__name__}"
            peak = None
        finally:
            if runner is not None:
                runner.free_kv_cache()
                if self.proposer is not None:  # the dummy requests leave no draft state
                    self.proposer.forget(set(runner.input_batch.req_id_to_row))
                runner = None
            gc.collect()
            self.platform.release_cached_memory()
        if peak is None:
            self.why_not_profiled = self.why_not_profiled or "not measurable here"
            logger.info("no peak memory from the profile run on %s: the KV cache is sized "
                        "analytically", self.platform.name)
        else:
            logger.debug("memory profile run: %.1f MiB peak activations in %.2f s",
                         peak / 2**20, time.perf_counter() - start)
        return peak

    def _profile_step(self) -> SchedulerOutput:
        """The dummy step: ``max_num_batched_tokens`` prompt tokens over
        ``min(max_num_seqs, tokens)`` new requests, the first ones as long as
        max_model_len allows (attention's peak), the rest one token each."""
        import numpy as np

        from engine.core.sampling_params import SamplingParams
        from engine.core.scheduler.output import CachedRequestData, NewRequestData

        sched, block_size = self.config.scheduler, self.config.cache.block_size
        spec = self.config.speculative
        lookahead = spec.num_speculative_tokens if spec is not None else 0
        longest = max(1, sched.max_model_len - 1 - lookahead)  # room for the sampled token
        tokens = sched.max_num_batched_tokens
        num_reqs = max(1, min(sched.max_num_seqs, tokens))
        lengths = [1] * num_reqs
        extra = tokens - num_reqs
        for i in range(num_reqs):
            if extra <= 0:
                break
            grow = min(extra, longest - 1)
            lengths[i] += grow
            extra -= grow
        rng = np.random.default_rng(0)
        vocab = int(self.model.vocab_size)
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=1)
        num_groups = self.kv_cache_layout.num_groups
        new_reqs = []
        for i, length in enumerate(lengths):
            table = [0] * -(-(length + 1 + lookahead) // block_size)
            new_reqs.append(NewRequestData(
                req_id=f"profile-{i}",
                prompt_token_ids=rng.integers(0, vocab, length).tolist(),
                output_token_ids=[],
                sampling_params=params,
                block_ids=tuple(list(table) for _ in range(num_groups)),
                num_computed_tokens=0,
                state_slot=i + 1 if self.state_spec is not None else None,
            ))
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in new_reqs},
            total_num_scheduled_tokens=sum(lengths),
        )

    def _make_lora_manager(self) -> None:
        """LoRA slots on the (new) model's linears; adapters known before are kept."""
        if self.config.lora is None:
            return
        from engine.lora.manager import LoRAManager

        known = {} if self.lora_manager is None else self.lora_manager.known
        dtype = activation_dtype(self.config, self.platform, getattr(torch, self.config.model.dtype))
        self.lora_manager = LoRAManager(self.model, self.config.lora, self.platform, dtype,
                                        self.platform.device())
        self.lora_manager.known.update(known)

    def add_lora(self, request: Any) -> dict[str, str] | None:
        """Check the adapter against this rank's model and cache it (errors as values:
        the front end raises the first rank's)."""
        from engine.lora.request import LoRARequest

        if self.lora_manager is None:
            return {"error": "LoRA is not enabled (start the engine with enable_lora=True)"}
        try:
            self.lora_manager.add(msgspec.convert(request, LoRARequest))
        except (ValueError, msgspec.ValidationError) as exc:
            return {"error": str(exc), "type": "ValueError"}
        return None

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove(int(lora_id))

    def list_loras(self) -> list[int]:
        return [] if self.lora_manager is None else self.lora_manager.list()

    def _kv_cache_layout(self, spec: Any) -> KVCacheLayout:
        """The model's KV cache groups (engine.core.kv_cache.groups): by attention kind,
        unless the hybrid manager is off or cannot run here (KV connectors and pipeline
        stages move or split one table per request; a draft model's cache needs group 0
        to be full attention); windows at least ``max_model_len`` long count as full."""
        config = self.config
        n = spec.num_layers
        max_len = config.scheduler.max_model_len
        windows = tuple(spec.sliding_windows) if len(spec.sliding_windows) == n else (None,) * n
        windows = tuple(None if w is not None and w >= max_len else w for w in windows)
        chunks = tuple(spec.attention_chunk_sizes) or (None,) * n
        chunks = tuple(None if c is not None and c >= max_len else c for c in chunks)
        why_not = None
        if config.cache.disable_hybrid_kv_cache_manager:
            why_not = "--disable-hybrid-kv-cache-manager"
        elif config.kv_transfer is not None:
            why_not = "a KV connector moves one block table per request"
        elif self.layout is not None and self.layout.pipeline_parallel_size > 1:
            why_not = "pipeline stages hold different layers"
        elif spec.mla:
            why_not = "MLA layers"
        layout = build_kv_cache_layout(windows, chunks, hybrid=why_not is None)
        if (layout.is_hybrid and self.draft_kv_spec is not None
                and layout.groups[0].is_windowed):
            why_not = "the draft model's cache needs a full-attention group"
            layout = build_kv_cache_layout(windows, chunks, hybrid=False)
        if why_not is not None and any(w is not None for w in windows + chunks):
            logger.info("one KV cache group (%s): sliding-window / chunked-local layers keep "
                        "every block", why_not)
        return layout

    def _check_state_layers(self) -> Any:
        """The model's state layers (engine.model_executor.state_cache), refusing what
        cannot keep a per-request state right; None: the model has none."""
        state_spec = model_state_spec(self.model)
        if state_spec is None:
            return None
        if self.proposer is not None:
            raise ValueError("speculative decoding is not supported for models with state "
                             "(Mamba) layers: a rejected draft would need its state rolled back")
        if self.config.kv_transfer is not None:
            raise ValueError("KV connectors move KV blocks, not the per-request state of "
                             "state (Mamba) layers: not supported for this model")
        return state_spec

    def state_bytes(self) -> int:
        """The state caches' bytes: every slot, the null slot included."""
        if getattr(self, "state_spec", None) is None:
            return 0
        return self.state_spec.bytes_per_slot() * (self.kv_cache_layout.num_state_slots + 1)

    def kv_block_bytes(self) -> int:
        block_size = self.config.cache.block_size
        block_bytes = self.kv_spec.block_bytes(block_size)
        if self.draft_kv_spec is not None:
            block_bytes += self.draft_kv_spec.block_bytes(block_size)
        return block_bytes

    def kv_cache_budget(self) -> int:
        """Bytes this rank's KV cache (and state caches) may take: ``--kv-cache-memory``
        when given, else the platform's rule from the weights and the profiled
        activations."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        else:
            budget = self.platform.kv_cache_budget(cache, self.weights_bytes,
                                                   getattr(self, "activation_bytes", None))
        self.kv_budget_bytes = int(budget)
        return self.kv_budget_bytes

    def memory_report(self) -> dict[str, Any]:
        """The sizing figures of this rank (the start-up log, benchmark reports)."""
        return {"weights_bytes": self.weights_bytes,
                "activation_bytes": getattr(self, "activation_bytes", None),
                "kv_budget_bytes": getattr(self, "kv_budget_bytes", None),
                "state_bytes": self.state_bytes()}

    def kv_block_capacity(self) -> int:
        """KV blocks this rank's memory budget holds (each rank holds only its heads and
        its stage's layers, so a block costs a rank 1/(tp x pp) of the whole)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        block_bytes = self.kv_block_bytes()
        state_bytes = self.state_bytes()  # the state layers' slots come off the budget
        budget = None
        if state_bytes:
            budget = self.kv_cache_budget() - state_bytes
            if budget < 0:
                raise ValueError(
                    f"the state caches of {self.kv_cache_layout.num_state_slots} requests "
                    f"need {state_bytes / 2**20:.1f} MiB, more than the KV cache budget; "
                    "lower max_num_seqs or raise the KV cache size")
        if block_bytes == 0:  # no KV layers (encoders, Mamba): blocks only count tokens
            sched = self.config.scheduler
            logger.info("%smemory: weights %.1f MiB, state caches %.1f MiB, no KV layers",
                        "" if self.layout is None else f"rank {self.layout.rank}: ",
                        self.weights_bytes / 2**20, state_bytes / 2**20)
            return -(-sched.max_model_len // cache.block_size) * sched.max_num_seqs + 1
        if budget is None:
            budget = self.kv_cache_budget()
        capacity = budget // block_bytes
        activations = getattr(self, "activation_bytes", None)
        logger.info(
            "%smemory: weights %.1f MiB, peak activations %s, KV cache %.1f MiB (%s): "
            "%d blocks of %d tokens",
            "" if self.layout is None else f"rank {self.layout.rank}: ",
            self.weights_bytes / 2**20,
            (f"not profiled ({getattr(self, 'why_not_profiled', None) or 'not measurable'})"
             if activations is None else f"{activations / 2**20:.1f} MiB"),
            budget / 2**20, self._budget_source(), capacity, cache.block_size)
        return capacity

    def _budget_source(self) -> str:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return "--kv-cache-memory"
        if self.platform.device().type != "cpu":
            return f"gpu_memory_utilization {cache.gpu_utilization}"
        if cache.gpu_memory_utilization is not None and not cache.cpu_kvcache_space_given():
            return f"{cache.gpu_memory_utilization} of RAM"
        return "cpu_kvcache_space_gib / ENGINE_CPU_KVCACHE_SPACE"

    def initialize_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """The runner and its KV cache of ``num_blocks``; ``max_model_len``: the engine's
        resolved length (``--max-model-len auto``), None: the config's."""
        config = self.config
        if max_model_len is not None and max_model_len != config.scheduler.max_model_len:
            config.scheduler.max_model_len = max_model_len
            config.model.max_model_len = max_model_len
        self.kv_connector = None
        if config.kv_transfer is not None:
            from engine.core.interfaces.kv_connector import KVConnectorRole
            from engine.kv_transfer.factory import make_connector

            self.kv_connector = make_connector(config, KVConnectorRole.WORKER)
        self.runner = self._make_runner(num_blocks)
        self.num_blocks = num_blocks
        logger.info(
            "%splatform %s, model implementation %s, attention %s, %.1f MiB weights, "
            "%d KV blocks of %d tokens",
            "" if self.layout is None else
            f"rank {self.layout.rank} (tp {self.layout.tp_rank}, pp {self.layout.pp_rank}): ",
            self.platform.name, implementation_of(self.model), self.attn_backend.name,
            self.weights_bytes / 2**20,
            num_blocks, config.cache.block_size,
        )
        if self.state_spec is not None:
            logger.info("%d state layers: %d state slots of %d bytes per request (%.1f MiB), "
                        "KV cache for %d attention layers", self.state_spec.num_layers,
                        self.kv_cache_layout.num_state_slots, self.state_spec.bytes_per_slot(),
                        self.state_bytes() / 2**20, self.kv_cache_layout.num_layers)
        if self.kv_cache_layout.num_groups > 1 or self.kv_cache_layout.is_hybrid:
            info = self.kv_cache_info()
            logger.info("%s; a block id costs %d of %d layers (%.0f%% of the memory of one "
                        "group for all layers)", self.kv_cache_layout.describe(),
                        info["layers_per_block"], info["num_layers"],
                        100 * info["block_bytes"] / max(1, info["one_group_block_bytes"]))

    def _graphs_cover_parallelism(self) -> bool:
        """Whether forward graphs can run this rank's decode steps: one rank always;
        tensor parallelism when the platform's capturer records its collectives. Stage
        hand-offs (pipeline) and the experts' exchange across data-parallel replicas run
        between forwards, which no capturer records: those ranks run eagerly."""
        layout = self.layout
        if layout is None or layout.global_world_size == 1:
            return True
        if layout.pipeline_parallel_size > 1 or layout.spans_data_parallel:
            return False
        capturer = self.platform.forward_graph_capturer()
        return capturer is not None and capturer.records_collectives

    def _make_runner(self, num_blocks: int, max_model_len: int | None = None,
                     profile: bool = False) -> ModelRunner:
        """A runner over a new KV cache of ``num_blocks``. ``profile``: the throwaway
        runner of the profile run (eager, no KV connector)."""
        config = self.config
        sched = config.scheduler
        eager = (profile or config.model.enforce_eager
                 or not self._graphs_cover_parallelism())
        runner_cls = ModelRunner
        if config.model.runner == "pooling":
            from engine.model_executor.pooling_runner import PoolingModelRunner

            runner_cls = PoolingModelRunner
        runner = runner_cls(
            self.model,
            self.attn_backend,
            self.platform,
            vocab_size=self.model.vocab_size,
            max_num_reqs=sched.max_num_seqs,
            max_model_len=max_model_len or sched.max_model_len,
            block_size=config.cache.block_size,
            enforce_eager=eager,
            proposer=self.proposer,
            parallel=self.parallel,
            kv_connector=None if profile else self.kv_connector,
            kv_cache_layout=self.kv_cache_layout,
            **({} if self.lora_manager is None else {"lora_manager": self.lora_manager}),
        )
        runner.allocate_kv_cache(self.kv_spec, num_blocks)
        return runner

    def kv_cache_info(self) -> dict[str, Any]:
        """The KV cache groups, what a block costs and what one group would have cost
        (benchmark reports and the startup log)."""
        layout, block_size = self.kv_cache_layout, self.config.cache.block_size
        return {
            "groups": [{"kind": g.kind, "num_layers": len(g.layer_indices)}
                       for g in layout.groups],
            "num_layers": layout.num_layers,
            "layers_per_block": layout.group_size,
            "block_bytes": self.kv_spec.block_bytes(block_size),
            "one_group_block_bytes": self.full_kv_spec.block_bytes(block_size),
            "num_state_layers": 0 if self.state_spec is None else self.state_spec.num_layers,
            "state_bytes_per_request": (0 if self.state_spec is None
                                        else self.state_spec.bytes_per_slot()),
            "state_slots": layout.num_state_slots,
        }

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None
    ) -> ModelRunnerOutput:
        self.platform.before_step()
        return self.runner.execute_model(scheduler_output, grammar_bitmask)

    # -- sleep mode (engine.core.engine_core.EngineCore.sleep) -------------------------------
    sleeping: frozenset[str] = frozenset()  # what sleeps: "weights", "kv_cache"
    sleep_level = 0

    def sleep(self, level: int) -> None:
        """Free the KV cache (and the forward graphs over it). Level 1 keeps the weights,
        in host memory (a device copies them there; on the CPU they already are); level 2
        drops them, and :meth:`wake_up` reloads them from the model directory."""
        if self.sleeping:
            raise RuntimeError("this worker is already asleep")
        self.runner.free_kv_cache()
        if level == 1:
            self._offload_weights()
        else:  # the runner, the model and a draft model go: wake_up builds them anew
            self.runner = None
            self.model = self.proposer = self.attn_backend = None
        self.sleep_level, self.sleeping = level, frozenset(("weights", "kv_cache"))
        gc.collect()
        self.platform.release_cached_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both): the weights first (a
        level-2 sleeper needs them before its KV cache)."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if "weights" in wanted and "weights" in self.sleeping:
            if self.sleep_level == 1:
                self._restore_weights()
            else:
                self._reload_weights()
            self.sleeping -= {"weights"}
        if "kv_cache" in wanted and "kv_cache" in self.sleeping:
            if self.runner is None:
                if self.model is None:
                    raise RuntimeError("wake the weights before the KV cache after a level-2 "
                                       "sleep (wake_up(tags=['weights']) first)")
                self.initialize_cache(self.num_blocks)  # a new runner, a new KV cache
            else:
                self.runner.allocate_kv_cache(self.kv_spec, self.num_blocks)
            self.sleeping -= {"kv_cache"}
        if not self.sleeping:
            self.sleep_level = 0

    def _sleep_modules(self) -> list[torch.nn.Module]:
        draft = getattr(self.proposer, "model", None)
        return [self.model] + ([draft] if draft is not None else [])

    def _offload_weights(self) -> None:
        """Level 1 on a device: every parameter and buffer copied to host memory and its
        device storage released (kernels' own derived tensors stay put)."""
        self._host_weights: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.platform.device().type == "cpu":
            return  # already in host memory
        seen: set[int] = set()
        for module in self._sleep_modules():
            for tensor in (*module.parameters(), *module.buffers()):
                if id(tensor) in seen or tensor.device.type == "cpu":
                    continue
                seen.add(id(tensor))
                self._host_weights.append((tensor, tensor.data.to("cpu")))
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def _restore_weights(self) -> None:
        device = self.platform.device()
        for tensor, host in self._host_weights:
            tensor.data = host.to(device)
        self._host_weights = []

    def _reload_weights(self) -> None:
        """Level 2: the model (and a draft model) loaded again from the model directory."""
        from engine.spec_decode.factory import build_proposer

        config, platform = self.config, self.platform
        dtype = getattr(torch, config.model.dtype)
        self.model, self.attn_backend = load_platform_model(config, platform, self.parallel)
        self.proposer = build_proposer(
            config, platform, self.model, dtype, activation_dtype(config, platform, dtype))

    # -- weight updates (engine.model_executor.weight_update) --------------------------------
    # A refused update answers {"error": message} instead of raising: a rank in a worker
    # process that raised would exit, and a bad path or name must not stop the engine.
    def update_weights(self, path: str) -> dict[str, str] | None:
        """This rank's shard of the checkpoint in ``path`` (same architecture) swapped in."""
        from engine.model_executor.weight_update import checkpoint_weights

        return self._swap_in(lambda: checkpoint_weights(self.config, path))

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int) -> dict[str, str] | None:
        """Join the trainer's group as rank ``rank_offset`` + this rank."""
        from engine.distributed.weight_sync import create_weight_sync_group

        rank = rank_offset + (0 if self.layout is None else self.layout.rank)
        try:
            self.weight_sync_group = create_weight_sync_group(
                master_address, master_port, rank, world_size,
                backend=self.platform.dist_backend)
        except (ValueError, RuntimeError) as exc:  # bad arguments, no trainer listening
            return {"error": f"cannot join the weight update group: {exc}",
                    "type": type(exc).__name__}
        return None

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], packed: bool = False
                                        ) -> dict[str, str] | None:
        """Receive every tensor by broadcast from the trainer (full HF tensors, in
        ``names`` order) and load this rank's shard of each; the rest is drained on error."""
        from engine.distributed.weight_sync import check_broadcast_specs
        from engine.model_executor.weight_update import BroadcastReceiver

        group = getattr(self, "weight_sync_group", None)
        if group is None:
            return {"error": "no weight update group: call init_weight_update_group first"}
        try:
            specs = check_broadcast_specs(names, dtypes, shapes)
        except ValueError as exc:
            return {"error": str(exc)}
        receiver = BroadcastReceiver(group, specs, self.platform.device(), packed)
        error = self._swap_in(lambda: receiver)
        if error is not None:
            try:
                receiver.drain()
            except Exception as exc:  # noqa: BLE001 - the trainer is gone: say so too
                error["error"] += f" (then receiving the rest failed: {exc})"
        return error

    def update_weights_from_tensors(self, handles: list[list[Any]]) -> dict[str, str] | None:
        """Load tensors a trainer in the front end's process shared (shared memory / CUDA
        IPC handles, engine.model_executor.weight_update.share_tensors)."""
        from engine.model_executor.weight_update import open_shared_tensors

        rank = 0 if self.layout is None else self.layout.rank
        return self._swap_in(lambda: open_shared_tensors(handles, rank))

    def _swap_in(self, weights: Any) -> dict[str, str] | None:
        """Build this rank's model from ``weights()`` beside the running one, then swap
        it in: a new runner (KV cache, forward graphs captured again) unless the KV cache
        sleeps, and a draft model built over it. Weights asleep are awake afterwards."""
        from engine.model_executor.weight_update import build_model
        from engine.spec_decode.factory import build_proposer

        config, platform = self.config, self.platform
        kv_awake = self.runner is not None and "kv_cache" not in self.sleeping
        if kv_awake:  # the old KV cache goes first: less memory while the new model loads
            self.runner.free_kv_cache()
        try:
            model, attn_backend = build_model(config, platform, self.parallel, weights())
        except Exception as exc:  # noqa: BLE001 - reported by the engine core; the old model serves on
            if kv_awake:
                self.runner.allocate_kv_cache(self.kv_spec, self.num_blocks)
            return {"error": str(exc), "type": type(exc).__name__}
        self.runner = None
        self.model = self.proposer = self.attn_backend = None
        self._host_weights = []
        gc.collect()
        self.model, self.attn_backend = model, attn_backend
        self._make_lora_manager()
        dtype = getattr(torch, config.model.dtype)
        self.proposer = build_proposer(
            config, platform, self.model, dtype, activation_dtype(config, platform, dtype))
        self.sleeping = self.sleeping - {"weights"}
        if "kv_cache" not in self.sleeping:
            self.initialize_cache(self.num_blocks)
            self.sleep_level = 0
        platform.release_cached_memory()
        return None

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def runtime_info(self) -> dict[str, Any]:
        """What this rank runs with (benchmark reports): platform, dtypes, attention
        backend, quantization and weight bytes, the GEMM kernel of every linear (counted,
        and per layer type), forward graphs, and the platform's own kernel_info (the
        CPU's ISA level)."""
        model = self.config.model
        layers = kernel_report.report(self.model)
        return {
            "platform": self.platform.name,
            "model_impl": implementation_of(self.model),
            "attention_backend": self.attn_backend.name,
            "weight_dtype": model.dtype,
            "quantization": layers["quantization"],
            "weights_mib": layers["weights_mib"],
            "activation_dtype": model.activation_dtype or model.dtype,
            "kv_cache_dtype": str(self.kv_spec.dtype).removeprefix("torch."),
            "kv_cache": self.kv_cache_info(),
            "gemm_kernels": layers["gemm_kernels"],
            "layer_kernels": layers["layer_kernels"],
            "forward_graphs": self.runner.decode_graphs is not None,
            # The decode batch sizes captured so far (those steps replay one C call each).
            "forward_graph_sizes": ([] if self.runner.decode_graphs is None
                                    else self.runner.decode_graphs.captured_sizes),
            "speculative": self._speculative_info(),
            **self.platform.kernel_info(),
        }

    def _speculative_info(self) -> dict[str, Any] | None:
        spec = self.config.speculative
        if spec is None:
            return None
        return {"method": spec.method, "model": spec.model,
                "num_speculative_tokens": spec.num_speculative_tokens,
                **self.proposer.runtime_info()}
