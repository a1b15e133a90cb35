"""Shared builders for the sampler tests: a state with requests in chosen rows."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.core.sampling_params import SamplingParams
from engine.model_executor.sampling import SamplingState

CPU = torch.device("cpu")


def make_state(
    vocab_size: int,
    requests: dict[int, SamplingParams],
    max_num_reqs: int = 8,
    prompts: dict[int, list[int]] | None = None,
    outputs: dict[int, list[int]] | None = None,
    eos_token_id: int | None = None,
) -> SamplingState:
    """A state with ``requests[row]`` seated in ``row`` (prompt defaults to [0, 1])."""
    state = SamplingState(max_num_reqs, vocab_size, CPU)
    for row, params in requests.items():
        prompt = (prompts or {}).get(row, [0, 1])
        output = (outputs or {}).get(row, [])
        state.add_request(row, params, prompt, output, eos_token_id=eos_token_id)
    return state


def rows(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def softmax64(logits: list[float]) -> list[float]:
    """Plain-Python float64 softmax (-inf entries get probability 0)."""
    top = max(logits)
    exps = [math.exp(x - top) if x != float("-inf") else 0.0 for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def chi_square_critical(dof: int, alpha: float = 1e-3) -> float:
    """Upper critical value of the chi-square distribution (scipy when installed)."""
    try:
        from scipy.stats import chi2
    except ImportError:  # Wilson-Hilferty approximation, accurate to ~1% for dof >= 2
        z = 3.0902323061678132  # standard normal quantile at 1 - 1e-3
        if alpha != 1e-3:
            raise
        h = 2.0 / (9.0 * dof)
        return dof * (1.0 - h + z * math.sqrt(h)) ** 3
    return float(chi2.ppf(1.0 - alpha, dof))
