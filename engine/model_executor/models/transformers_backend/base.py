"""Any transformers decoder-only causal LM on the engine's paged attention.

:class:`TransformersForCausalLM` builds transformers' own ``*ForCausalLM`` class from the
HF config with its parameters on the meta device and its buffers on the real device (so
rotary ``inv_freq`` and the like are computed, not loaded), then swaps in the engine's
layers where they matter for speed and parallelism:

- every attention module gets an engine :class:`Attention` (its heads, KV heads, head
  size, scale, sliding window and soft-cap; its ``layer_idx`` as cache index) and the
  model's ``attn_implementation`` routes the module's q/k/v there
  (:mod:`.attention`);
- ``nn.Linear`` -> the engine's replicated / column / row parallel linears (:mod:`.linear`),
  the input embedding and the LM head -> ``VocabEmbedding`` / ``LMHead``;
- fused MoE experts -> the platform's fused-MoE kernel (:mod:`.moe`);
- Llama-style RMSNorms -> the engine's RMSNorm on the platform's kernel (:mod:`.norm`);
- Llama-style gated MLPs -> one gate/up GEMM and the fused activation (:mod:`.mlp`).

Everything else (other norms, rotary embeddings, activations, residual wiring) is
transformers' code, run on a flat token batch as one sequence of batch size 1.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import LMHead
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.transformers_backend import attention as attn_mod
from engine.model_executor.models.transformers_backend.linear import (
    HFColumnParallelLinear,
    HFVocabEmbedding,
    replace_linear,
)
from engine.model_executor.models.transformers_backend.support import (
    causal_lm_class,
    check_backend_supports,
    text_config,
)
from engine.model_executor.weight_utils import load_named_weights

logger = logging.getLogger(__name__)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with every parameter on the meta device (no memory, no init), while
    buffers are made where the surrounding device context says."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes transformers set on it
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, module)


class TransformersForCausalLM(nn.Module):
    """The engine's model contract (interface.py) around a transformers causal LM."""

    supports_pipeline_parallel = False
    implementation = "transformers"

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        check_backend_supports(hf_config)
        if ctx.parallel is not None and ctx.parallel.pp_size > 1:
            raise ValueError("the Transformers backend does not support pipeline parallelism")
        attn_mod.register_engine_attention()
        config = copy.deepcopy(hf_config)
        self.config = config
        self.text_config = text = text_config(config)
        self.ctx = ctx
        cls = causal_lm_class(config)
        self.hf_class_name = cls.__name__
        tp_size = 1 if ctx.tp is None else ctx.tp.world_size
        self.tp_plan = dict(getattr(text, "base_model_tp_plan", None) or {})
        if tp_size > 1 and not self.tp_plan:
            raise ValueError(f"{cls.__name__} has no base_model_tp_plan, so the Transformers "
                             "backend cannot shard it over tensor-parallel ranks")
        config._attn_implementation = attn_mod.ENGINE_ATTENTION
        with torch.device(ctx.device), parameters_on_meta():
            default = torch.get_default_dtype()
            torch.set_default_dtype(ctx.dtype)
            try:
                hf_model = cls._from_config(config, attn_implementation=attn_mod.ENGINE_ATTENTION,
                                            dtype=ctx.dtype)
            finally:
                torch.set_default_dtype(default)
        hf_model.eval()
        self._conversions = self._weight_conversions(hf_model)
        self._ignored_keys = [re.compile(p) for p in (
            getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        self.base_prefix = hf_model.base_model_prefix
        if not isinstance(getattr(hf_model, self.base_prefix, None), nn.Module):
            self.base_prefix = "model"  # classes whose prefix names a multimodal parent's
        base = hf_model.get_submodule(self.base_prefix)
        head = hf_model.get_output_embeddings()
        self.head_name = next((n for n, m in hf_model.named_children() if m is head), None)
        if self.head_name is None:
            raise ValueError(f"{cls.__name__} has no output embedding (LM head) the "
                             "Transformers backend can find")
        others = [n for n, _ in hf_model.named_children() if n not in (self.base_prefix,
                                                                        self.head_name)]
        if others:
            raise ValueError(f"{cls.__name__} has modules besides its base model and LM "
                             f"head ({', '.join(others)}) the Transformers backend cannot run")
        self.add_module(self.base_prefix, base)
        self.vocab_size = text.vocab_size
        self._replace_layers(head, tp_size)
        self._materialize(ctx)
        if self.tied and not getattr(self, self.head_name).tied:
            self._tie_head_to_hf_embedding()
        self._attention_layers(tp_size)
        self.activation_dtype = ctx.dtype
        self.logit_softcap = getattr(text, "final_logit_softcapping", None)
        self.logit_scale = getattr(text, "logit_scale", None)
        self.logits_scaling = getattr(text, "logits_scaling", None)
        from engine.model_executor.layers.linear import LinearBase
        from engine.model_executor.models.transformers_backend.moe import EngineExperts

        logger.info(
            "Transformers backend: %s (transformers' modeling code) with %d attention layers "
            "on %s, %d engine linear layers, %d MoE layers on the fused-MoE kernel",
            cls.__name__, self.num_layers, ctx.attn_backend.name,
            sum(isinstance(m, LinearBase) for m in self.modules()),
            sum(isinstance(m, EngineExperts) for m in self.modules()))

    # -- construction ------------------------------------------------------------------
    @property
    def base_model(self) -> nn.Module:
        return getattr(self, self.base_prefix)

    @staticmethod
    def _weight_conversions(hf_model: nn.Module) -> tuple[list, list]:
        """transformers 5's checkpoint conversions of this class: (renamings, converters)."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter
        except ImportError:  # an older transformers: checkpoints use the module names
            return [], []
        transforms = get_model_conversion_mapping(hf_model)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        return renamings, converters

    def _replace_layers(self, head: nn.Module, tp_size: int) -> None:
        ctx = self.ctx
        from engine.model_executor.models.transformers_backend.mlp import replace_mlps
        from engine.model_executor.models.transformers_backend.moe import replace_experts
        from engine.model_executor.models.transformers_backend.norm import replace_rms_norms

        replace_experts(self, ctx)
        replace_rms_norms(self, ctx)
        replace_mlps(self, ctx, self.tp_plan, self.base_prefix)
        embedding = self.base_model.get_input_embeddings()
        for name, module in list(self.named_modules()):
            if type(module) is nn.Linear:
                _set_module(self, name, replace_linear(module, name, ctx, self.tp_plan,
                                                       self.base_prefix))
            elif module is embedding and type(module) is nn.Embedding:
                new = HFVocabEmbedding(module.num_embeddings, module.embedding_dim,
                                       **ctx.matrix_dtypes, device=ctx.device,
                                       fused_ops=ctx.fused_ops, tp=ctx.tp)
                _set_module(self, name, new)
                embedding = new
        if type(head) is not nn.Linear:
            raise ValueError(f"the LM head is a {type(head).__name__}, not nn.Linear")
        lm_head = LMHead(head.out_features, head.in_features, bias=head.bias is not None,
                         **ctx.matrix_dtypes, device=ctx.device, tp=ctx.tp)
        self.tied = bool(getattr(self.text_config, "tie_word_embeddings", False))
        if self.tied and isinstance(embedding, HFVocabEmbedding):
            lm_head.tie_to(embedding)
        self.add_module(self.head_name, lm_head)

    def _materialize(self, ctx: ModelInitContext) -> None:
        """Allocate (uninitialized) every parameter still on the meta device."""
        for module in self.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta":
                    module._parameters[name] = nn.Parameter(
                        torch.empty_like(param, device=ctx.device), requires_grad=False)
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device.type == "meta":
                    raise ValueError(f"buffer {name} of {type(module).__name__} was not built "
                                     "on the device")

    def _tie_head_to_hf_embedding(self) -> None:
        """A tied head over an embedding transformers keeps (a scaled-embedding subclass):
        the head shares the embedding's (now allocated) matrix."""
        head = getattr(self, self.head_name)
        embedding = self.base_model.get_input_embeddings()
        weight = getattr(embedding, "weight", None)
        if head.tp is not None or weight is None or weight.shape != head.weight.shape:
            raise ValueError(f"cannot tie the LM head to {type(embedding).__name__} "
                             "(shape or tensor parallelism)")
        head.weight = weight
        head.tied = True

    def _attention_layers(self, tp_size: int) -> None:
        """One engine Attention per transformers attention module (cache index: its
        ``layer_idx``)."""
        text, ctx = self.text_config, self.ctx
        modules = [m for m in self.base_model.modules() if attn_mod.calls_attention_interface(m)]
        if not modules:
            raise ValueError(f"{self.hf_class_name} has no attention module that calls "
                             "transformers' attention interface")
        total_heads = text.num_attention_heads
        layer_types = list(getattr(text, "layer_types", None) or [])
        windows: dict[int, int | None] = {}
        chunks: dict[int, int | None] = {}
        shapes = set()
        for order, module in enumerate(modules):
            if isinstance(getattr(module, "sinks", None), nn.Parameter):
                raise ValueError(  # noqa: TRY004 (an unsupported model, not a bad argument)
                    f"{self.hf_class_name}: attention sinks (learned per-head logits) are "
                    "not supported by the Transformers backend")
            idx = getattr(module, "layer_idx", None)
            idx = order if idx is None else int(idx)
            if idx in windows:
                raise ValueError(f"two attention modules share layer index {idx}")
            sharded = tp_size > 1 and any(isinstance(m, HFColumnParallelLinear)
                                          for m in module.modules())
            num_heads, num_kv = self._heads(module, total_heads, tp_size if sharded else 1)
            head_dim = (getattr(module, "head_dim", None) or getattr(module, "head_size", None)
                        or getattr(text, "head_dim", None)
                        or text.hidden_size // text.num_attention_heads)
            qk_head_dim = getattr(module, "qk_head_dim", None) or head_dim
            scale = getattr(module, "scaling", None)
            scale = qk_head_dim**-0.5 if scale is None else float(scale)
            window = self._window(module, idx, layer_types)
            chunk = None
            if layer_types and idx < len(layer_types) and layer_types[idx] == "chunked_attention":
                chunk = getattr(text, "attention_chunk_size", None)
            softcap = (getattr(module, "attn_logit_softcapping", None)
                       or getattr(text, "attn_logit_softcapping", None))
            extra = {}
            if chunk is not None and _ATTENTION_TAKES_CHUNK:
                extra["attention_chunk_size"] = int(chunk)
            attn = Attention(num_heads, qk_head_dim, scale, num_kv, idx, ctx.attn_backend,
                             sliding_window=window, logits_soft_cap=softcap, **extra)
            if chunk is not None and not extra:
                _set_chunk(attn, chunk, ctx)
            attn_mod.attach(module, attn)
            windows[idx], chunks[idx] = window, chunk
            shapes.add((num_kv, qk_head_dim))
        if sorted(windows) != list(range(len(windows))):
            raise ValueError(f"attention layer indices {sorted(windows)} are not 0..n-1")
        if len(shapes) > 1:
            raise ValueError(f"attention layers differ in KV heads / head size {sorted(shapes)}; "
                             "the Transformers backend needs one KV cache shape")
        self.attn_layers = nn.ModuleList(attn_mod.attached(m) for m in sorted(
            modules, key=lambda m: attn_mod.attached(m).layer_idx))
        self.num_layers = len(windows)
        self.num_kv_heads, self.head_size = shapes.pop()
        self.sliding_windows = tuple(windows[i] for i in range(self.num_layers))
        self.attention_chunk_sizes = tuple(chunks[i] for i in range(self.num_layers))

    @staticmethod
    def _heads(module: nn.Module, total_heads: int, tp_size: int) -> tuple[int, int]:
        """This rank's query and KV heads of ``module`` (``tp_size`` 1: its projections are
        replicated). transformers' eager attention repeats KV heads by
        ``module.num_key_value_groups``, so a GQA module defines it; a module without it is
        multi-head."""
        num_heads = int(getattr(module, "num_heads", None) or total_heads)
        groups = int(getattr(module, "num_key_value_groups", None) or 1)
        if num_heads % groups:
            raise ValueError(f"{num_heads} heads do not group by {groups}")
        num_kv = num_heads // groups
        if tp_size > 1:
            for what, n in (("attention heads", num_heads), ("key/value heads", num_kv)):
                if n % tp_size:
                    raise ValueError(f"{n} {what} do not split over {tp_size} "
                                     "tensor-parallel ranks")
            num_heads, num_kv = num_heads // tp_size, num_kv // tp_size
        return num_heads, num_kv

    def _window(self, module: nn.Module, idx: int, layer_types: list) -> int | None:
        """The layer's sliding window: none where the module says it is not sliding or
        ``layer_types`` marks it full; else the module's own window, the config's."""
        text = self.text_config
        if getattr(module, "is_sliding", True) is False:
            return None
        window = getattr(module, "sliding_window", None)
        if layer_types and idx < len(layer_types):
            if layer_types[idx] != "sliding_attention":
                return None
            window = window or getattr(text, "sliding_window", None)
        elif not hasattr(module, "sliding_window"):
            window = getattr(text, "sliding_window", None)
        if isinstance(window, bool) or not window:
            return None
        return int(window)

    # -- the model contract ------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Any = None) -> torch.Tensor:
        out = self.base_model(input_ids=input_ids[None], position_ids=positions[None],
                              use_cache=False, return_dict=True)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = getattr(self, self.head_name)(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def kv_cache_spec(self) -> ModelKVSpec:
        chunks = self.attention_chunk_sizes if any(self.attention_chunk_sizes) else ()
        return ModelKVSpec(self.num_layers, self.num_kv_heads, self.head_size,
                           self.sliding_windows, attention_chunk_sizes=chunks)

    # -- weights -----------------------------------------------------------------------
    def _checkpoint_names(self, weights: Iterable[tuple[str, Any]]
                          ) -> Iterator[tuple[str, Any]]:
        """Checkpoint tensors under this model's parameter names (transformers 5's
        renamings applied; persistent buffers copied here, ignored keys dropped)."""
        from transformers.core_model_loading import apply_renamings

        from engine.model_executor.models.transformers_backend.moe import split_fused_experts

        renamings, _ = self._conversions
        buffers = dict(self.named_buffers())
        head_weight = f"{self.head_name}.weight"
        for name, tensor in weights:
            if renamings:
                name = apply_renamings(name, renamings)
            if not self._known(name) and not name.startswith(self.base_prefix + ".") \
                    and self._known(f"{self.base_prefix}.{name}"):
                name = f"{self.base_prefix}.{name}"  # a base-model checkpoint
            if self.tied and name == head_weight:
                continue
            per_expert = split_fused_experts(self, name, tensor)
            if per_expert is not None:
                yield from per_expert
                continue
            if name in buffers:
                from engine.model_executor.lazy_tensor import materialize

                buffers[name].copy_(materialize(tensor))
                continue
            if name not in self._param_names and (
                    any(p.search(name) for p in self._ignored_keys)
                    or "rotary_emb.inv_freq" in name):
                continue
            yield name, tensor

    def load_name_mapper(self) -> Any:
        """Checkpoint names -> ``(parameter, shard)`` where the module tree fuses what the
        checkpoint keeps apart (MLP gate / up, experts); also how LoRA adapters of those
        modules find their layer and shard (engine.lora.manager)."""
        from engine.model_executor.models.transformers_backend.mlp import fused_mlp_name_mapper
        from engine.model_executor.models.transformers_backend.moe import expert_name_mapper

        experts, mlps = expert_name_mapper(self), fused_mlp_name_mapper(self)
        return lambda name: experts(name) or mlps(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._param_names = {n for n, _ in self.named_parameters()}
        self._name_mapper = self.load_name_mapper()
        return load_named_weights(self, self._checkpoint_names(weights),
                                  name_mapper=self._name_mapper)

    def _known(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` has a parameter here (mapped or not)."""
        return name in self._param_names or self._name_mapper(name) is not None


_ATTENTION_TAKES_CHUNK = "attention_chunk_size" in inspect.signature(Attention).parameters


def _set_chunk(attn: Attention, chunk: int, ctx: ModelInitContext) -> None:
    """Chunked local attention (Llama 4) where the Attention layer takes no
    ``attention_chunk_size``: the layer's spec with it, and the kernel object for it."""
    import dataclasses

    spec = dataclasses.replace(attn.spec, attention_chunk_size=int(chunk))
    why = ctx.attn_backend.validate(spec, ctx.attn_backend.block_size)
    if why is not None:
        raise ValueError(f"attention backend {ctx.attn_backend.name!r} cannot run layer "
                         f"{attn.layer_idx}: {why}")
    attn.spec = spec
    attn.impl = ctx.attn_backend.make_impl(spec)
