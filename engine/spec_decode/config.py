"""Resolve ``--speculative-config`` against the target model, before any model loads.

Every way a speculative config can be wrong is caught here, with the reason: an unknown
method, K < 1, a draft directory that does not load, a draft whose vocabulary differs
from the target's (its token ids would mean other tokens), or a draft that is not
smaller than its target (it could never pay for itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine.core.config import SpeculativeConfig


def parse_speculative_config(value: dict[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
    """A SpeculativeConfig from vLLM's JSON (text or already parsed)."""
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"speculative_config must be a JSON object, got {type(value).__name__}"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens")
    try:
        return SpeculativeConfig(**value)
    except ValidationError as exc:  # one line per problem, without pydantic's frame
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ValueError(f"speculative_config: {problems}") from None


def _is_demo(path: Path) -> bool:
    from engine.assets import DEMO_MODEL_DIR

    try:
        return path.resolve() == DEMO_MODEL_DIR.resolve()
    except OSError:
        return False


def _default_draft(method: str, target_is_demo: bool) -> str:
    from engine.assets import DEMO_DRAFT_MODEL_DIR, DEMO_EAGLE_MODEL_DIR

    if not target_is_demo:
        raise ValueError(
            f"speculative method {method!r} needs a draft: set \"model\" to its directory "
            "(only the demo model has a shipped default draft)"
        )
    return str(DEMO_EAGLE_MODEL_DIR if method == "eagle" else DEMO_DRAFT_MODEL_DIR)


def estimated_num_params(hf_config: Any) -> int:
    """Parameters of a decoder-only model from its config: embeddings, attention, MLP.

    Counted from the config, not the files, so a quantized target and an unquantized
    draft compare by size of model rather than bytes on disk."""
    hidden = int(hf_config.hidden_size)
    layers = int(hf_config.num_hidden_layers)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    inter = int(getattr(hf_config, "intermediate_size", 4 * hidden))
    experts = int(getattr(hf_config, "num_local_experts", 0) or getattr(hf_config, "num_experts", 0) or 1)
    attention = hidden * head * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inter * experts
    return int(hf_config.vocab_size) * hidden + layers * (attention + mlp)


def resolve_speculative_config(
    value: dict[str, Any] | str | SpeculativeConfig, target_files: Any, *, is_demo_target: bool
) -> SpeculativeConfig:
    """The checked config with ``method`` set and ``model`` a local directory.

    ``target_files`` is the target's ``ModelFiles``; ``is_demo_target`` also holds when
    the target path is the shipped demo directory."""
    from engine.core.engine_args import resolve_model_source
    from engine.model_executor.model_loader import load_model_files
    from engine.model_executor.models.eagle_llama import is_eagle_checkpoint

    config = parse_speculative_config(value)
    if config.method == "ngram":
        return config
    is_demo_target = is_demo_target or _is_demo(Path(target_files.path))
    if config.model is None:
        if config.method is None:
            raise ValueError(
                "speculative_config needs a method (ngram, draft_model or eagle) or a model"
            )
        config.model = _default_draft(config.method, is_demo_target)
    path = resolve_model_source(config.model)
    try:
        draft = load_model_files(path)
    except ValueError as exc:
        raise ValueError(f"speculative draft {config.model!r}: {exc}") from None
    eagle = is_eagle_checkpoint(draft.weight_files) or "eagle" in draft.architecture.lower()
    if config.method is None:
        config.method = "eagle" if eagle else "draft_model"
    if config.method == "eagle" and not eagle:
        raise ValueError(
            f"speculative draft {path} is not an EAGLE head (no fc.weight in its "
            "checkpoint); use method 'draft_model' for an ordinary small model"
        )
    if config.method == "draft_model" and eagle:
        raise ValueError(f"speculative draft {path} is an EAGLE head: use method 'eagle'")
    _check_compatible(config.method, draft.hf_config, target_files.hf_config, path)
    config.model = str(path)
    return config


def _check_compatible(method: str, draft: Any, target: Any, path: str) -> None:
    if int(draft.vocab_size) != int(target.vocab_size):
        raise ValueError(
            f"speculative draft {path} has a vocabulary of {draft.vocab_size} tokens but the "
            f"target has {target.vocab_size}: draft and target must share one tokenizer"
        )
    if method == "eagle":
        if int(draft.hidden_size) != int(target.hidden_size):
            raise ValueError(
                f"EAGLE head {path} has hidden size {draft.hidden_size} but the target has "
                f"{target.hidden_size}: it reads the target's hidden states"
            )
        return
    draft_params, target_params = estimated_num_params(draft), estimated_num_params(target)
    if draft_params >= target_params:
        raise ValueError(
            f"speculative draft {path} (~{draft_params / 1e6:.1f}M parameters) is not smaller "
            f"than its target (~{target_params / 1e6:.1f}M): it cannot speed decoding up"
        )
