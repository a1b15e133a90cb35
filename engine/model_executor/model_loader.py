"""Load a Hugging Face model directory (config.json + safetensors) into an engine model.

Steps: :func:`load_model_files` checks the directory and resolves the architecture
(clear errors for every way a directory can be unusable), :func:`resolve_dtype` and
:func:`get_max_model_len` turn user options into concrete values, and
:func:`load_model` builds the model directly on the target device in the target dtype
(parameters are allocated uninitialized, never randomly initialized) and streams the
checkpoint tensors into it one by one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.core.interfaces import (
    AttentionBackend,
    DenseGemmKernel,
    FusedMoEKernel,
    FusedOps,
    QuantizedGemmKernel,
)
from engine.model_executor.hf_config_snapshot import ConfigSnapshot
from engine.model_executor.layers.linear import pack_dense_weights
from engine.model_executor.layers.rotary import rope_scaling_from_config
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.registry import MODEL_REGISTRY, ModelRegistry
from engine.model_executor.models.transformers_backend.support import text_config
from engine.model_executor.weight_utils import safetensors_weights_iterator

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Config keys that bound the context length, as vLLM reads them.
_PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DEFAULT_MAX_MODEL_LEN = 2048  # when the config names no limit at all


@dataclass(frozen=True)
class GenerationDefaults:
    """The parts of ``generation_config.json`` the engine uses."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class ModelFiles:
    """A checked model directory."""

    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    model_cls: type[nn.Module]
    weight_files: list[Path]
    generation: GenerationDefaults | None
    # Which implementation runs it: "engine" (a registered class) or "transformers"
    # (the Transformers modeling backend, vLLM's --model-impl).
    impl: str = "engine"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: generation_config.json first, else config.json."""
        if self.generation is not None and self.generation.eos_token_ids:
            return self.generation.eos_token_ids
        return _as_id_tuple(getattr(self.hf_config, "eos_token_id", None))


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_generation_config(path: str | Path) -> GenerationDefaults | None:
    """``generation_config.json`` of a model directory, or None when it has none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object")  # noqa: TRY004 (bad file)
    return GenerationDefaults(
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        temperature=raw.get("temperature"),
        top_p=raw.get("top_p"),
        top_k=raw.get("top_k"),
        min_p=raw.get("min_p"),
        repetition_penalty=raw.get("repetition_penalty"),
        max_new_tokens=raw.get("max_new_tokens"),
        raw=raw,
    )


def load_hf_config(path: str | Path, *, snapshot: bool = True) -> Any:
    """The transformers config of a model directory (ValueError when unreadable): its
    stored snapshot when one was taken of the same ``config.json`` (``snapshot=False``:
    always transformers' own object), see engine.model_executor.hf_config_snapshot."""
    from engine.model_executor import hf_config_snapshot

    path = Path(path)
    use_snapshots = snapshot and hf_config_snapshot.snapshots_enabled()
    if use_snapshots:
        store = hf_config_snapshot.ConfigSnapshotStore()
        stored = store.load(path, _auto_config)
        if stored is not None:
            return stored
    config = _auto_config(path)
    if use_snapshots:
        store.save(path, config, _auto_config)
    return config


def _auto_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read the model config in {path}: {exc}") from exc


def _weight_files(path: Path) -> list[Path]:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that are missing: {missing}")
        return files
    if (path / "model.safetensors").is_file():  # transformers' single file: other
        return [path / "model.safetensors"]       # *.safetensors beside it are not weights
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    other = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth") for p in path.glob(ext))
    if other:
        raise ValueError(
            f"{path} holds {', '.join(other)} but no *.safetensors: only safetensors "
            "checkpoints are supported (convert with transformers' save_pretrained)"
        )
    raise ValueError(f"{path} has no *.safetensors weight files")


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> None:
    """vLLM's ``--hf-overrides``: set each key on the HF config (before the architecture
    is resolved, so ``architectures`` may be overridden too)."""
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"hf_overrides keys must be config attribute names, not {key!r}")
        setattr(hf_config, key, value)


def load_model_files(path: str | Path, registry: ModelRegistry = MODEL_REGISTRY,
                     hf_overrides: dict[str, Any] | None = None,
                     model_impl: str = "auto") -> ModelFiles:
    """Check a model directory and resolve its architecture to a model class
    (``hf_overrides`` applied to its config first). ``model_impl`` (vLLM's
    ``--model-impl``): ``auto`` the registered class, else the Transformers backend;
    ``engine`` registered classes only; ``transformers`` always the backend."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    weight_files = _weight_files(path)
    # Overrides go onto transformers' own config: its properties (Falcon's head_dim,
    # Jamba's layer types) recompute from what they change; a snapshot's would not.
    hf_config = load_hf_config(path, snapshot=not hf_overrides)
    apply_hf_overrides(hf_config, hf_overrides)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        raise ValueError(f"{path / 'config.json'} names no 'architectures'")
    from engine.model_executor.models.transformers_backend import resolve_model_class
    from engine.model_executor.models.transformers_backend.support import native_architecture

    if (isinstance(hf_config, ConfigSnapshot)
            and native_architecture(architectures, registry, model_impl) is None):
        # The Transformers backend builds transformers' own model from the config.
        hf_config = load_hf_config(path, snapshot=False)
    model_cls, architecture, impl = resolve_model_class(architectures, registry, hf_config,
                                                        model_impl)
    return ModelFiles(
        path=path,
        hf_config=hf_config,
        architecture=architecture,
        model_cls=model_cls,
        weight_files=weight_files,
        generation=read_generation_config(path),
        impl=impl,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_dtype(hf_config: Any, requested: str | torch.dtype = "auto") -> torch.dtype:
    """The compute dtype: ``auto`` = the checkpoint's ``dtype``/``torch_dtype``
    (float32 when absent); also ``float32``/``float``, ``bfloat16``, ``float16``/``half``."""
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if saved is None:
            return torch.float32
        dtype = saved if isinstance(saved, torch.dtype) else _DTYPES.get(str(saved))
        if dtype is None or dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the checkpoint's dtype {saved} is not supported; pass an explicit dtype "
                "(float32, bfloat16 or float16)"
            )
        return dtype
    elif requested in _DTYPES:
        dtype = _DTYPES[requested]
    else:
        raise ValueError(f"dtype {requested!r} is not supported; use auto, {', '.join(_DTYPES)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype {_dtype_name(dtype)} is not supported; use float32, bfloat16 or float16"
        )
    return dtype


def derived_max_model_len(hf_config: Any) -> tuple[int, str]:
    """The longest context the config allows and the key it came from (a
    vision-language model's from its language model's config)."""
    hf_config = text_config(hf_config)
    found = [
        (int(v), key)
        for key in _MAX_LEN_KEYS
        if isinstance(v := getattr(hf_config, key, None), (int, float)) and v > 0
    ]
    if not found:
        return DEFAULT_MAX_MODEL_LEN, "default"
    if getattr(hf_config, "model_type", None) in _PADDING_OFFSET_POSITIONS:
        # RoBERTa-style positions start after the padding index: the table's first
        # pad_token_id + 1 rows are never a token's position.
        offset = int(getattr(hf_config, "pad_token_id", 1) or 0) + 1
        found = [(n - offset, k) if k == "max_position_embeddings" else (n, k)
                 for n, k in found]
    length, key = min(found)
    if key == "max_position_embeddings":
        try:
            scaling = rope_scaling_from_config(hf_config)
        except ValueError:
            return length, key
        if scaling.max_positions != length:
            return scaling.max_positions, f"{key} x rope factor {scaling.factor:g}"
    return length, key


def get_max_model_len(hf_config: Any, requested: int | None = None) -> int:
    """``requested`` if the model allows it, the model's limit when None."""
    limit, source = derived_max_model_len(hf_config)
    if requested is None:
        return limit
    if requested < 1:
        raise ValueError(f"max_model_len must be at least 1, not {requested}")
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's maximum context of {limit} "
            f"tokens ({source}); lower max_model_len"
        )
    return requested


def finish_quantized_layers(
    net: nn.Module, plan: Any, kernels: list[type[QuantizedGemmKernel]]
) -> dict[str, int]:
    """Decode every quantized linear's loaded tensors and hand them to the first kernel
    that accepts the layer; how many layers each kernel took."""
    from engine.quantization.base import QuantizedLinearMethod

    taken: dict[str, int] = {}
    for name, module in net.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, QuantizedLinearMethod):
            continue
        try:
            kernel = method.finish_loading(module, kernels, plan.kernel_filter)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        taken[kernel.name] = taken.get(kernel.name, 0) + 1
    return taken


def load_model(
    model: str | Path | ModelFiles,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    *,
    quantization: str | None = None,
    dense_gemm_kernels: Sequence[type[DenseGemmKernel]] = (),
    quantized_gemm_kernels: Sequence[type[QuantizedGemmKernel]] = (),
    fused_ops: FusedOps | None = None,
    activation_dtype: torch.dtype | str | None = None,
    parallel: Any = None,
    fused_moe_kernels: Sequence[type[FusedMoEKernel]] = (),
    hf_overrides: dict[str, Any] | None = None,
    pooler_config: Any = None,
    model_impl: str = "auto",
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """Build the model for ``model`` (a directory or checked files) and load its weights
    (``weights``: HF-named tensors to load instead of the directory's, e.g. a trainer's
    update, :mod:`engine.model_executor.weight_update`).

    ``dtype`` is the weights' dtype, ``activation_dtype`` (None: the same) the one the
    model computes in. A quantized checkpoint (or ``quantization``, vLLM's
    ``--quantization``) loads through its format (:mod:`engine.quantization`), each
    quantized linear taking the first of ``quantized_gemm_kernels`` that accepts it.
    ``dense_gemm_kernels`` (the platform's, in preference order) then repack the
    unquantized linear weights they accept, once, for the platform's fastest GEMM;
    ``fused_ops`` replace the layers' norm / activation / rotary op chains. ``parallel``
    (an :class:`engine.distributed.ParallelState`): build and load only this rank's
    shard (its heads, its part of each matrix, its pipeline stage's layers).
    ``pooler_config`` (an :class:`engine.core.pooling_config.PoolerConfig`): build the
    model for pooling (a generating architecture through its pooling adapter)."""
    from engine.quantization import resolve_quantization

    files = (model if isinstance(model, ModelFiles)
             else load_model_files(model, hf_overrides=hf_overrides, model_impl=model_impl))
    hf_config = files.hf_config
    plan = resolve_quantization(hf_config, quantization)
    dtype = resolve_dtype(hf_config, dtype)
    compute = dtype if activation_dtype is None else resolve_dtype(hf_config, activation_dtype)
    ctx = ModelInitContext(
        dtype=compute,
        device=torch.device(device),
        attn_backend=attn_backend,
        quantization=plan,
        fused_ops=fused_ops,
        weight_dtype=dtype,
        parallel=parallel,
        moe_kernels=list(fused_moe_kernels),
        pooler_config=pooler_config,
        model_dir=files.path,
    )
    model_cls = files.model_cls
    if pooler_config is not None and files.impl != "engine":
        raise ValueError(f"{files.architecture}: pooling models are not supported by the "
                         "Transformers backend (model_impl='transformers')")
    if pooler_config is not None:
        from engine.model_executor.models.adapters import pooling_model_class

        model_cls = pooling_model_class(model_cls, files.architecture, pooler_config)
    if parallel is not None and parallel.pp_size > 1 and not getattr(
            files.model_cls, "supports_pipeline_parallel", False):
        raise ValueError(f"{files.architecture} does not support pipeline parallelism")
    with torch.no_grad():
        net = model_cls(hf_config, ctx)
        if weights is None:
            weights = safetensors_weights_iterator(files.weight_files, lazy=True)
        net.load_weights(weights)
        quantized = finish_quantized_layers(net, plan, list(quantized_gemm_kernels))
        for module in net.modules():  # derived weights (MLA's absorbed projections)
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
        packed = pack_dense_weights(net, list(dense_gemm_kernels))
    net.eval()
    net.requires_grad_(False)
    logger.info(
        "loaded %s (%s, %s implementation) from %s: %s weights, %s activations; %d linear "
        "weights repacked for the platform GEMM%s",
        files.architecture,
        model_cls.__name__,
        files.impl,
        files.path,
        _dtype_name(dtype),
        _dtype_name(compute),
        packed,
        "" if plan is None else f"; {plan.describe()}: " + ", ".join(
            f"{name} x{count}" for name, count in quantized.items()),
    )
    return net
