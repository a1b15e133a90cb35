"""Adapters on checkpoints that fuse projections themselves (Phi-3's ``qkv_proj`` and
``gate_up_proj``): PEFT adapts the fused module whole, the engine gives every shard of
its fused layer the same A and that shard's rows of B; outputs equal PEFT's."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.hf_models import build_model_dir
from tests.helpers.hf_reference import assert_matches_reference, sampled_logprobs
from tests.helpers.lora_models import make_peft_adapter, peft_reference

# Shorter than the tiny Phi-3's original_max_position_embeddings (32): longrope keeps the
# short factors in both implementations.
PROMPT = list(range(5, 21))
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3-lora")
    base = build_model_dir(root / "base", "phi3-longrope")
    adapter = make_peft_adapter(base, root / "fused", r=8, lora_alpha=16, seed=3,
                                target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                "down_proj"])
    return base, adapter


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fused_module_adapter_equals_peft(phi3, tp):
    base, adapter = phi3
    refs = [peft_reference(base, adapter, PROMPT, MAX_TOKENS),
            peft_reference(base, None, PROMPT, MAX_TOKENS)]
    assert refs[0].tokens != refs[1].tokens  # the adapter changes the output
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(str(base), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8,
             tensor_parallel_size=tp) as llm:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False,
                            lora_request=[LoRARequest("fused", 1, str(adapter)), None])
    for out, ref in zip(outs, refs):
        completion = out.outputs[0]
        assert_matches_reference(completion.token_ids, sampled_logprobs(completion),
                                 ref.tokens, ref.logprobs)
