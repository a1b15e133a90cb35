"""LoRA on the Transformers modeling backend (``model_impl="transformers"``): adapters
find their layers through the backend's own name mapping (its fused gate/up MLP), and the
output equals PEFT's."""

from __future__ import annotations

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, sampled_logprobs
from tests.helpers.lora_models import (
    ALL_TARGETS,
    build_llama_base,
    make_peft_adapter,
    peft_reference,
)

PROMPT = list(range(5, 45))
MAX_TOKENS = 8


def test_adapter_on_the_transformers_backend_equals_peft(tmp_path):
    base = build_llama_base(tmp_path / "base")
    adapter = make_peft_adapter(base, tmp_path / "a", r=8, lora_alpha=16, seed=5,
                                target_modules=ALL_TARGETS)
    ref = peft_reference(base, adapter, PROMPT, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(str(base), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8,
             model_impl="transformers", max_num_batched_tokens=16) as llm:
        [out] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False,
                             lora_request=LoRARequest("a", 1, str(adapter)))
    completion = out.outputs[0]
    assert_matches_reference(completion.token_ids, sampled_logprobs(completion), ref.tokens,
                             ref.logprobs)
