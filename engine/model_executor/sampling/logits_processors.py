"""Logits processors: token whitelists, bans, additive biases and grammar bitmasks.

Each works in place on a float32 ``[N, V]`` logits tensor with one bulk tensor op;
masked tokens become ``-inf`` so every later stage (softmax, top-k/top-p, argmax)
treats them as impossible.
"""

from __future__ import annotations

import torch

from engine.model_executor.sampling.metadata import AllowedTokens, LogitBias, TokenPairs

_NEG_INF = float("-inf")


def apply_allowed_token_ids(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Mask every token outside each restricted row's whitelist."""
    num_rows = allowed.rows.numel()
    banned = torch.ones(num_rows, logits.shape[1], dtype=torch.bool, device=logits.device)
    banned[allowed.pair_index, allowed.tokens] = False
    logits[allowed.rows] = logits[allowed.rows].masked_fill_(banned, _NEG_INF)


def apply_banned_tokens(logits: torch.Tensor, pairs: TokenPairs) -> None:
    """Set ``logits[row, token] = -inf`` for each pair (bad words, min_tokens)."""
    value = torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device)
    logits.index_put_((pairs.rows, pairs.tokens), value)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """Add each request's ``logit_bias`` to its row."""
    logits.index_put_((bias.rows, bias.tokens), bias.values.to(logits.dtype), accumulate=True)


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 ``[N, ceil(V/32)]`` -> bool ``[N, V]`` (True = allowed).

    Token ``t`` is bit ``t % 32`` (least significant first) of word ``t // 32``, the
    layout xgrammar and vLLM use; a row of all ``-1`` words allows everything.
    """
    num_words = (vocab_size + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != num_words:
        raise ValueError(
            f"token bitmask must be int32 [N, {num_words}] for vocab_size={vocab_size}; "
            f"got {bitmask.dtype} {list(bitmask.shape)}"
        )
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]; sign extension is harmless
    return bits.reshape(bitmask.shape[0], num_words * 32)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask the tokens whose bit is 0 in a structured-output bitmask (one row per row)."""
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"token bitmask has {bitmask.shape[0]} rows but logits have {logits.shape[0]}"
        )
    allowed = unpack_token_bitmask(bitmask.to(logits.device), logits.shape[1])
    logits.masked_fill_(~allowed, _NEG_INF)
