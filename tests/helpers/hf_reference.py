"""Transformers as the reference: load a model directory, score token sequences.

Shared by the engine-vs-transformers tests under tests/entrypoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float64 log_softmax of the model's logits; row ``p``
    is the distribution of the token at position ``p + 1``."""
    logits = model(torch.tensor([token_ids])).logits[0]
    return logits.double().log_softmax(-1)


def cpu_llm(path: str | Path, **kwargs: Any):
    """An engine ``LLM`` on the CPU platform, float32 and a short context by default."""
    from engine import LLM

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 128)
    return LLM(str(path), device="cpu", **kwargs)
