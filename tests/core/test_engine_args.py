"""EngineArgs: model source resolution and config validation."""

from __future__ import annotations

import pytest

from engine.core.engine_args import EngineArgs, resolve_model_source


def test_local_directory_is_used_as_is(llama_dir):
    assert resolve_model_source(str(llama_dir)) == str(llama_dir)


def test_unreachable_hub_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not a local directory.*hub"):
        resolve_model_source("some-org/not-cached-model")


def test_unknown_engine_argument_is_rejected():
    with pytest.raises(ValueError, match="unknown engine argument.*max_batch"):
        EngineArgs.from_kwargs(max_batch=3)


def test_config_errors_name_the_field(llama_dir):
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model=str(llama_dir), block_size=0).create_engine_config()
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(model=str(llama_dir), max_num_seqs=0).create_engine_config()


def test_vllm_v1_defaults(llama_dir):
    config = EngineArgs(model=str(llama_dir)).create_engine_config()
    assert config.cache.enable_prefix_caching and config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 8192
    assert config.model.dtype == "float32"  # "auto" = the checkpoint's dtype


def test_token_budget_follows_the_usage_context(llama_dir):
    """vLLM's CPU defaults: 2048 tokens a step behind an API server, bigger offline; an
    explicit budget wins either way, and without chunking a step still fits a prompt."""
    served = EngineArgs(model=str(llama_dir), usage_context="api_server")
    assert served.create_engine_config().scheduler.max_num_batched_tokens == 2048
    explicit = EngineArgs(model=str(llama_dir), usage_context="api_server",
                          max_num_batched_tokens=512)
    assert explicit.create_engine_config().scheduler.max_num_batched_tokens == 512
    whole = EngineArgs(model=str(llama_dir), usage_context="api_server",
                       enable_chunked_prefill=False).create_engine_config()
    assert whole.scheduler.max_num_batched_tokens == max(2048, whole.model.max_model_len)
    with pytest.raises(ValueError, match="usage_context 'web'"):
        EngineArgs(model=str(llama_dir), usage_context="web").create_engine_config()
