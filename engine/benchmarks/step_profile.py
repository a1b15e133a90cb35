"""Where one decode step's time goes, stage by stage, at a given number of running requests.

The profiled step is the engine's own (``LLMEngine.step`` in-process), timed from the
outside: the scheduler, model runner and output processor methods that make up a step
are wrapped with timers for the duration of the profile only, and the model's
attention and linear modules get forward hooks, so nothing in the engine carries
profiling code. Stages::

    schedule       Scheduler.schedule
    prepare        runner: apply the scheduler's diffs, build step tensors + attention metadata
                   (or fill a forward graph's input buffers)
    graph          a decode forward replayed from its forward graph (model_executor.
                   decode_graphs): the whole forward, so attention / linear / other stay 0
                   for such steps; ``--enforce-eager`` splits them again
    attention      Attention layers (KV write + paged attention)
    linear         linear layers (GEMMs) of the decoder
    other          the rest of the forward (embedding, norms, rotary, activations, residuals)
    logits         LM head
    sample         sampler (and the runner's bookkeeping of sampled tokens)
    update         Scheduler.update_from_output
    output         OutputProcessor.process_outputs (detokenize, stop checks, RequestOutputs)

The step reported is the median of the profiled steps by wall time, with its own stage
split (so the stages add up to ``step_ms``); ``unaccounted`` is what no stage covers.

The memory floor (:class:`DecodeFloor`): a decode step must read every weight it
multiplies (all but the embedding table's unused rows) and every running request's KV
cache once, so at the memory read bandwidth measured just before (the same sum over a
buffer larger than the caches that ``engine bench`` reports) it cannot take less than
``bytes / bandwidth``. The ratio ``step_ms / floor_ms`` is how far the step is from it;
at batch 1 the weights dominate and the ratio is the decode GEMVs' and the step's
overheads together.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from engine.benchmarks.workload import Workload

STAGES = (
    "schedule", "prepare", "graph", "attention", "linear", "other", "logits", "sample",
    "propose", "update", "output",
)
OVERHEAD_STAGES = ("schedule", "prepare", "sample")  # what the <10% target is about


@dataclass(frozen=True)
class DecodeFloor:
    """The least time a decode step's memory traffic allows (module docstring)."""

    weight_bytes: int  # weights a step streams whole
    kv_bytes: int  # KV cache the running requests' attention reads
    read_gb_s: float  # memory read bandwidth measured beside the profile

    @property
    def floor_ms(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / (self.read_gb_s * 1e9) * 1e3

    def to_json(self) -> dict[str, Any]:
        return {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "read_gb_s": self.read_gb_s, "floor_ms": round(self.floor_ms, 6)}


def decode_floor(engine, num_running: int, context_len: int,
                 read_gb_s: float | None = None) -> DecodeFloor | None:
    """The floor of the in-process engine's decode step (None when its model is not in
    this process)."""
    from engine.benchmarks.report import memory_read_gb_s
    from engine.model_executor.kernel_report import streamed_weight_bytes

    worker = getattr(engine.client.core.executor, "worker", None)  # None: ranks elsewhere
    if worker is None:
        return None
    block_size = worker.config.cache.block_size
    kv_per_token = worker.kv_block_bytes() / block_size
    return DecodeFloor(
        weight_bytes=streamed_weight_bytes(worker.model),
        kv_bytes=int(kv_per_token * context_len * num_running),
        read_gb_s=memory_read_gb_s() if read_gb_s is None else read_gb_s,
    )


@dataclass
class StepProfile:
    num_running: int
    context_len: int  # tokens per request at the first profiled step
    step_ms: float  # wall time of the median step
    stage_ms: dict[str, float]  # that step's time per stage
    floor: DecodeFloor | None = None

    @property
    def floor_ratio(self) -> float | None:
        """The step's time over its memory floor."""
        return None if self.floor is None else self.step_ms / self.floor.floor_ms

    @property
    def overhead_share(self) -> float:
        """Scheduler + input preparation + sampling, as a share of the step."""
        return sum(self.stage_ms[s] for s in OVERHEAD_STAGES) / self.step_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "num_running": self.num_running,
            "context_len": self.context_len,
            "step_ms": round(self.step_ms, 3),
            "stage_ms": {k: round(v, 3) for k, v in self.stage_ms.items()},
            "overhead_share": round(self.overhead_share, 4),
            "floor": None if self.floor is None else self.floor.to_json(),
            "floor_ratio": None if self.floor_ratio is None else round(self.floor_ratio, 3),
        }


class _Clock:
    """Wall time per stage within one step; a nested stage's time leaves its parent's."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [stage, start, time taken by nested stages]

    def reset(self) -> None:
        self.totals.clear()
        self._stack.clear()

    def start(self, stage: str) -> None:
        self._stack.append([stage, time.perf_counter(), 0.0])

    def stop(self) -> None:
        stage, start, nested = self._stack.pop()
        took = time.perf_counter() - start
        self.totals[stage] += took - nested
        if self._stack:
            self._stack[-1][2] += took

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.start(stage)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()

        return timed


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Shadow ``obj.name`` with an instance attribute for the duration."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


def _module_stage(module) -> str | None:
    from engine.model_executor.layers.attention import Attention
    from engine.model_executor.layers.embedding import LMHead
    from engine.model_executor.layers.linear import LinearBase

    if isinstance(module, Attention):
        return "attention"
    if isinstance(module, LMHead):
        return "logits"
    if isinstance(module, LinearBase):
        return "linear"
    return None


@contextmanager
def _instrument(engine, clock: _Clock) -> Iterator[None]:
    """Time the step's stages into ``clock`` while the context is open."""
    core = engine.client.core
    runner = core.executor.runner
    methods = [
        (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "update_from_output", "update"),
        (engine.output_processor, "process_outputs", "output"),
        (runner, "_update_states", "prepare"),
        (runner, "_prepare_inputs", "prepare"),
        (runner, "_eager_inputs", "prepare"),
        (runner, "_forward", "other"),
        (runner, "_sample", "sample"),
        (runner, "_propose", "propose"),  # speculation's drafts for the next step
    ]
    if runner.decode_graphs is not None:
        methods.append((runner.decode_graphs, "forward", "graph"))
        methods.append((runner.decode_graphs, "_fill", "prepare"))
    with ExitStack() as stack:
        for obj, name, stage in methods:
            stack.enter_context(_patched(obj, name, clock.wrap(stage, getattr(obj, name))))
        for module in runner.model.modules():
            stage = _module_stage(module)
            if stage is None:
                continue
            pre = module.register_forward_pre_hook(lambda *_, s=stage: clock.start(s))
            post = module.register_forward_hook(lambda *_: clock.stop())
            stack.callback(pre.remove)
            stack.callback(post.remove)
        yield


def profile_decode_step(
    llm, workload: Workload, num_steps: int = 10, skip_steps: int = 3,
    read_gb_s: float | None = None,
) -> StepProfile:
    """Profile ``num_steps`` decode steps with ``workload.num_prompts`` requests running.

    Every prompt is prefilled first and ``skip_steps`` decode steps run unmeasured, so
    each profiled step is a pure decode step of the whole batch. ``read_gb_s``: the
    memory read bandwidth for the floor (None: measured after the profile).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    engine = llm.llm_engine
    if not hasattr(engine.client, "core"):
        raise ValueError("the step profile needs the in-process engine core")
    needed = skip_steps + num_steps + 2
    if workload.output_len < needed:
        workload = dataclasses.replace(workload, output_len=needed)
    params = workload.sampling_params()
    for prompt in workload.prompts():
        engine.add_request(engine.next_request_id(), prompt, params)
    scheduler = engine.client.core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()
    for _ in range(skip_steps):
        engine.step()
    context_len = workload.input_len + skip_steps + 1
    clock = _Clock()
    profiles: list[tuple[float, dict[str, float]]] = []
    with _instrument(engine, clock):
        for _ in range(num_steps):
            clock.reset()
            start = time.perf_counter()
            engine.step()
            step_ms = (time.perf_counter() - start) * 1e3
            stage_ms = {s: clock.totals.get(s, 0.0) * 1e3 for s in STAGES}
            stage_ms["unaccounted"] = max(0.0, step_ms - sum(stage_ms.values()))
            profiles.append((step_ms, stage_ms))
    while engine.has_unfinished_requests():
        engine.step()
    profiles.sort(key=lambda p: p[0])
    step_ms, stage_ms = profiles[len(profiles) // 2]  # the median step, whole
    floor = decode_floor(engine, workload.num_prompts, context_len, read_gb_s)
    return StepProfile(workload.num_prompts, context_len, step_ms, stage_ms, floor)
