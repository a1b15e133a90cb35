"""``--kv-cache-dtype`` (vLLM's): validated in the config, passed by the CLI, resolved to
the cache tensors' dtype, and sized at one byte per value."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from engine.core.config import CacheConfig, EngineConfig
from engine.core.engine_args import EngineArgs
from engine.core.interfaces.attention import canonical_kv_cache_dtype, kv_cache_torch_dtype
from engine.core.kv_cache import kv_cache_block_bytes


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_the_config_takes_vllms_names_and_survives_the_core_process_handoff(llama_dir, name):
    config = EngineArgs(model=str(llama_dir), kv_cache_dtype=name).create_engine_config()
    assert config.cache.kv_cache_dtype == name
    assert EngineConfig.model_validate_json(config.model_dump_json()).cache == config.cache


def test_other_values_are_refused_naming_the_field(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model=str(llama_dir), kv_cache_dtype="int8").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="bfloat16")
    assert CacheConfig().kv_cache_dtype == "auto"


def test_names_resolve_to_torch_dtypes():
    assert canonical_kv_cache_dtype("fp8") == "fp8_e4m3"
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="not supported"):
        kv_cache_torch_dtype("fp4", torch.float32)


def test_an_fp8_block_costs_half_a_16_bit_one():
    args = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "num_layers": 7}
    fp8 = kv_cache_block_bytes(dtype_bytes=torch.float8_e4m3fn.itemsize, **args)
    assert 2 * fp8 == kv_cache_block_bytes(dtype_bytes=torch.bfloat16.itemsize, **args)


def test_the_cli_flag_reaches_engine_args(monkeypatch):
    import engine
    from engine.cli import main

    calls = []

    def fake_llm(**kwargs):
        calls.append(kwargs)
        raise ValueError("stub engine")

    monkeypatch.setattr(engine, "LLM", fake_llm)
    result = CliRunner().invoke(main, ["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"])
    assert "stub engine" in result.output, result.output
    assert calls[-1]["kv_cache_dtype"] == "fp8_e5m2"
    CliRunner().invoke(main, ["generate", "hi"])
    assert calls[-1]["kv_cache_dtype"] == "auto"
    result = CliRunner().invoke(main, ["generate", "hi", "--kv-cache-dtype", "int8"])
    assert result.exit_code == 2 and "'int8' is not one of" in result.output
