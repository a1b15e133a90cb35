"""Which model implementation runs a checkpoint (vLLM's ``--model-impl``), and why the
Transformers backend refuses what it cannot run.

``auto``: the engine's native class when an architecture is registered, else the
Transformers backend; ``engine``: native only; ``transformers``: always the backend.
The backend runs a transformers decoder-only causal LM whose attention modules call
transformers' attention interface (``_supports_attention_backend``); it refuses
encoder-decoders / cross-attention, remote code, multimodal configs and mixers that are
not attention (state-space / linear-attention layers), each with the reason.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

MODEL_IMPLS = ("auto", "engine", "transformers")
BACKEND_NAME = "transformers"
# layer_types entries of layers the backend runs (attention over the paged cache).
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention",
                         "attention", None}


def check_model_impl(model_impl: str) -> str:
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    return model_impl


def text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return get() if get is not None else hf_config


def causal_lm_class(hf_config: Any) -> type:
    """transformers' causal LM class the config's ``architectures`` name (ValueError when
    they name none): as vLLM, an architecture the engine does not know must be a
    transformers class, not merely a config transformers can read."""
    import transformers
    from transformers import AutoModelForCausalLM

    causal = set(AutoModelForCausalLM._model_mapping.values())
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None) if name.isidentifier() else None
        if cls is not None and cls in causal:
            return cls
    model_type = getattr(hf_config, "model_type", "?")
    if not names:  # no architectures: the config type's causal LM
        try:
            return AutoModelForCausalLM._model_mapping[type(hf_config)]
        except KeyError:
            pass
    raise ValueError(
        f"{names or model_type} is not a causal LM class of transformers "
        f"{transformers.__version__} (model type {model_type!r}), so the Transformers "
        "backend cannot run it"
    )


def unsupported_reason(hf_config: Any) -> str | None:
    """Why the Transformers backend cannot run ``hf_config`` (None: it can)."""
    arch = ", ".join(getattr(hf_config, "architectures", None) or []) or hf_config.model_type
    if getattr(hf_config, "auto_map", None) or getattr(hf_config, "trust_remote_code", False):
        return (f"{arch} needs remote code (its config has an auto_map); the Transformers "
                "backend only runs model classes that ship with transformers")
    if getattr(hf_config, "is_encoder_decoder", False) or getattr(
            hf_config, "add_cross_attention", False):
        return (f"{arch} is an encoder-decoder / cross-attention model; the Transformers "
                "backend runs decoder-only causal LMs")
    sub_configs = getattr(hf_config, "sub_configs", None) or {}
    if any(key in sub_configs for key in ("vision_config", "audio_config", "speech_config")) \
            or getattr(hf_config, "vision_config", None) is not None:
        return (f"{arch} is a multimodal model; the Transformers backend runs text-only "
                "causal LMs")
    try:
        cls = causal_lm_class(hf_config)
    except ValueError as exc:
        return str(exc)
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"{cls.__name__} does not route its attention through transformers' "
                "attention interface (_supports_attention_backend is False), so the "
                "Transformers backend cannot put it on the paged KV cache")
    text = text_config(hf_config)
    other = sorted({str(t) for t in getattr(text, "layer_types", None) or []
                    if t not in ATTENTION_LAYER_TYPES})
    if other:
        return (f"{arch} has non-attention layers ({', '.join(other)}); the Transformers "
                "backend only runs attention decoders")
    return None


def check_backend_supports(hf_config: Any) -> None:
    why = unsupported_reason(hf_config)
    if why is not None:
        raise ValueError(why)


def native_architecture(architectures: list[str], registry: Any,
                        model_impl: str = "auto") -> str | None:
    """The architecture a registered (engine) class runs, or None when the Transformers
    backend does: ``model_impl`` ``engine`` always the former, ``transformers`` always the
    latter, ``auto`` the first registered one (the backend when none is)."""
    check_model_impl(model_impl)
    native = next((a for a in architectures if a in registry), None)
    if model_impl == "engine":
        return native or architectures[0]
    return native if model_impl == "auto" else None


def resolve_model_class(architectures: list[str], registry: Any, hf_config: Any,
                        model_impl: str = "auto") -> tuple[type, str, str]:
    """``(model class, architecture, impl)`` with impl ``"engine"`` or ``"transformers"``."""
    native = native_architecture(architectures, registry, model_impl)
    if native is not None:
        return registry.resolve(architectures), native, "engine"
    why = unsupported_reason(hf_config)
    if why is not None:
        if model_impl == "auto":
            raise ValueError(
                f"model architecture(s) {architectures} not supported natively; "
                f"supported: {', '.join(registry.supported_architectures()) or '(none)'}; "
                f"and the Transformers backend cannot run it: {why}")
        raise ValueError(f"model_impl='transformers': {why}")
    from engine.model_executor.models.transformers_backend.base import TransformersForCausalLM

    return TransformersForCausalLM, architectures[0], BACKEND_NAME


def implementation_of(model: Any) -> str:
    """What runs ``model``, for logs and reports: ``"engine"`` or
    ``"transformers (<transformers class>)"``."""
    if getattr(model, "implementation", "engine") == BACKEND_NAME:
        return f"{BACKEND_NAME} ({getattr(model, 'hf_class_name', '?')})"
    return "engine"


_SAME_FORWARD: dict[tuple[type, type], bool] = {}


def _forward_source(cls: type) -> str:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return ""


def same_forward_as(module: Any, reference: type) -> bool:
    """Whether ``module``'s class runs ``reference``'s forward, word for word (transformers'
    families copy Llama's modules verbatim; a variant differs in its source)."""
    key = (type(module), reference)
    if key not in _SAME_FORWARD:
        source = _forward_source(reference)
        _SAME_FORWARD[key] = bool(source) and _forward_source(type(module)) == source
    return _SAME_FORWARD[key]
