"""The hybrid KV cache end to end: a model interleaving sliding-window (window 8) and
full-attention layers runs with one block table per KV cache group. Reference:
transformers' greedy generation in float32 over prompts several windows long, with
prefix hits, chunked prefill, preemption, forward graphs and speculative decoding
happening; the sliding group's blocks are counted from the allocator."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _hf_greedy, _prompts, assert_greedy_equivalent
from tests.helpers.hf_reference import hf_logprobs, load_hf_model

WINDOW, BLOCK = 8, 4
MAX_TOKENS = 16
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "block_size": BLOCK}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from tests.helpers.hf_models import build_model_dir

    return build_model_dir(
        tmp_path_factory.mktemp("hybrid"), "qwen2", num_hidden_layers=4,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
        layer_types=LAYER_TYPES)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller hybrid model (one full, one sliding layer) with the same tokenizer."""
    from tests.helpers.hf_models import build_model_dir

    return build_model_dir(
        tmp_path_factory.mktemp("hybrid-draft"), "qwen2", num_hidden_layers=2, seed=1,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def hf_model(hybrid_dir):
    model = load_hf_model(hybrid_dir)
    assert model.config.layer_types == LAYER_TYPES
    return model


def _greedy(logprobs: int | None = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                          logprobs=logprobs)


def _check_against_hf(hf_model, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs):
        got = list(out.outputs[0].token_ids)
        want = _hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert_greedy_equivalent(hf_model, prompt, got, want)
        if got == want:
            ref = hf_logprobs(hf_model, prompt + want)[len(prompt) - 1 : -1]
            have = torch.tensor([out.outputs[0].logprobs[j][t].logprob
                                 for j, t in enumerate(got)])
            expected = ref.gather(1, torch.tensor(want)[:, None]).squeeze(1)
            torch.testing.assert_close(have, expected.float(), atol=2e-4, rtol=0)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_hybrid_model_matches_transformers(hybrid_dir, hf_model, eager):
    """Two groups (full, sliding); prompts up to ~5 windows; a shared prefix so the second
    round hits; chunks of 16 tokens; a pool small enough that requests get preempted."""
    shared = _prompts(hf_model.config.vocab_size, [30], seed=7)[0]
    prompts = _prompts(hf_model.config.vocab_size, [3, 11, 40], seed=5)
    prompts += [shared + p for p in _prompts(hf_model.config.vocab_size, [2, 9], seed=6)]
    with LLM(str(hybrid_dir), **ENGINE, enforce_eager=eager, max_num_batched_tokens=16,
             num_gpu_blocks_override=40, max_num_seqs=5) as llm:
        core = llm.llm_engine.client.core
        assert [g.kind for g in core.executor.kv_cache_layout.groups] == [
            "full", f"sliding_window({WINDOW})"]
        requests = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(requests, _greedy(), use_tqdm=False)
        second = llm.generate(requests, _greedy(), use_tqdm=False)  # prefix hits now
        scheduler = core.scheduler
        assert scheduler.num_preemptions_total > 0
        assert scheduler.kv_cache_manager.total_prefix_cache_stats.hits > 0
        kv = scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks  # nothing leaked
        if not eager:
            assert core.executor.runner.decode_graphs.captured_sizes
    _check_against_hf(hf_model, prompts, first)
    _check_against_hf(hf_model, prompts, second)


def test_sliding_group_holds_the_window_from_the_allocator(hybrid_dir):
    """At 4x the window the sliding group holds window / block_size + 1 blocks, the full
    group every block; the single-group fallback holds every block in both."""
    prompt = _prompts(200, [WINDOW], seed=1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3 * WINDOW, ignore_eos=True)
    for disable, expected_groups in ((False, 2), (True, 1)):
        with LLM(str(hybrid_dir), **ENGINE, disable_hybrid_kv_cache_manager=disable) as llm:
            engine = llm.llm_engine
            kv = engine.client.core.scheduler.kv_cache_manager
            assert kv.num_groups == expected_groups
            engine.add_request("r", {"prompt_token_ids": prompt}, params)
            held = []
            while engine.has_unfinished_requests():
                engine.step()
                if kv.holds_blocks("r"):
                    held.append(kv.num_blocks_held("r"))
            context = 4 * WINDOW - 1  # the last token is sampled, never written
            if expected_groups == 2:
                assert held[-1][0] == -(-context // BLOCK)
                assert max(h[1] for h in held) <= WINDOW // BLOCK + 1
            else:
                assert held[-1] == [-(-context // BLOCK)]


def test_hybrid_model_with_speculative_decoding(hybrid_dir, draft_dir, hf_model):
    """n-gram drafts (no draft KV) and a draft model (its cache on the full group's block
    ids) verified over the grouped cache give transformers' greedy tokens."""
    prompt = _prompts(hf_model.config.vocab_size, [12], seed=2)[0]
    prompts = [prompt * 3]  # repetitive: the n-gram proposer finds drafts
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
                 {"method": "draft_model", "model": str(draft_dir),
                  "num_speculative_tokens": 2}):
        with LLM(str(hybrid_dir), **ENGINE, speculative_config=spec) as llm:
            assert llm.llm_engine.client.core.executor.kv_cache_layout.num_groups == 2
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                                use_tqdm=False)
        _check_against_hf(hf_model, prompts, outs)


def test_kv_connector_runs_one_group(hybrid_dir, hf_model, tmp_path, caplog):
    config = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    prompts = _prompts(hf_model.config.vocab_size, [21], seed=4)
    with caplog.at_level(logging.INFO, logger="engine.model_executor.worker"):
        with LLM(str(hybrid_dir), **ENGINE, kv_transfer_config=config) as llm:
            assert llm.llm_engine.client.core.executor.kv_cache_layout.num_groups == 1
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                                use_tqdm=False)
    assert "one KV cache group (a KV connector" in caplog.text
    _check_against_hf(hf_model, prompts, outs)
