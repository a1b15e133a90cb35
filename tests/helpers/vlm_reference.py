"""Transformers as the reference for vision-language models: greedy continuations, the
near-tie check, and one prefill of an engine model's language part (shared by the
LLaVA and Qwen2-VL tests)."""

from __future__ import annotations

from typing import Any

import torch

# Per-token inputs transformers' VLMs take beside input_ids; a generated token is text.
_TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")


@torch.inference_mode()
def hf_greedy(model: Any, inputs: dict[str, torch.Tensor], max_tokens: int) -> list[int]:
    """transformers' greedy continuation (exactly ``max_tokens`` new token ids)."""
    out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=model.config.text_config.pad_token_id)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@torch.inference_mode()
def assert_greedy_equivalent(model: Any, inputs: dict[str, torch.Tensor], got: list[int],
                             want: list[int], tie: float = 1e-3) -> None:
    """``got == want`` up to a verified near-tie in transformers' distribution at the
    first difference."""
    for j, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        step = dict(inputs)
        extra = torch.tensor([want[:j]], dtype=torch.long)
        step["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        step["attention_mask"] = torch.ones_like(step["input_ids"])
        for key in _TOKEN_TYPE_KEYS:
            if key in inputs:
                step[key] = torch.cat([inputs[key], torch.zeros_like(extra)], dim=1)
        logprobs = model(**step).logits[0, -1].double().log_softmax(-1)
        top = logprobs.topk(2)
        gap = float(top.values[0] - top.values[1])
        assert gap < tie and g in top.indices.tolist(), (
            f"diverged at output {j}: engine {g}, transformers {w}, top-2 gap {gap:.2e}")
        return
    assert len(got) == len(want), (got, want)


def engine_prefill_logits(model: Any, embeds: torch.Tensor, ids: torch.Tensor,
                          positions: torch.Tensor, key_ends: Any = None) -> torch.Tensor:
    """An engine VLM's logits at every prompt position for ``inputs_embeds``: one
    prefill through a fresh one-block KV cache. ``key_ends``: the batch's
    ``key_ends_cpu`` (numpy int64 [T]; bidirectional image tokens), None for causal."""
    from engine.core.interfaces import AttentionBatch
    from engine.model_executor.forward_context import ForwardContext, set_forward_context

    backend = model.ctx.attn_backend
    spec = model.kv_cache_spec()
    n = len(ids)
    shape = backend.get_kv_cache_shape(1, backend.block_size, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    batch = AttentionBatch(
        num_reqs=1, num_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros((1, 1), dtype=torch.int32), slot_mapping=torch.arange(n),
        max_query_len=n, max_seq_len=n, key_ends_cpu=key_ends)
    with torch.no_grad(), set_forward_context(ForwardContext(backend.build_metadata(batch),
                                                             caches)):
        return model.compute_logits(model(ids, positions, inputs_embeds=embeds)).float()


def mm_request(prompt: str, images: list | None = None) -> dict[str, Any]:
    """An engine prompt: the text alone, or vLLM's dict with its images."""
    if not images:
        return {"prompt": prompt}
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def generated_ids(llm: Any, requests: list[Any], params: Any) -> list[list[int]]:
    """The engine's token ids for each request (one sample each)."""
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]


def check_greedy(model: Any, inputs: dict[str, torch.Tensor], got: list[int],
                 max_tokens: int) -> list[int]:
    """``got`` equals transformers' greedy continuation of ``inputs`` (up to a verified
    near-tie); returns transformers' tokens."""
    want = hf_greedy(model, inputs, max_tokens)
    assert_greedy_equivalent(model, inputs, got, want)
    return want
