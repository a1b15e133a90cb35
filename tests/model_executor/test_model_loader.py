"""Model directory checks, dtype / length resolution and weight-loading errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.core.interfaces import AttentionBatch
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.model_loader import (
    get_max_model_len,
    load_model,
    load_model_files,
    read_generation_config,
    resolve_dtype,
)
from engine.plugins.cpu.attention import CPUAttentionBackend
from tests.helpers.engine_logits import prefill_logits as _prefill_logits

CPU = torch.device("cpu")


def tiny_config(**extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        **extra,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return model, path


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def backend():
    return CPUAttentionBackend(block_size=4, device=CPU)


def prefill_logits(model, tokens):
    return _prefill_logits(model, tokens, block_size=4)


# -- directory checks -----------------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model_files(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        load_model_files(tmp_path / "file")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model_files(tmp_path)


def test_no_safetensors(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model_files(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="only safetensors checkpoints are supported"):
        load_model_files(tmp_path)


def test_unknown_architecture(model_dir, tmp_path):
    path = copy_dir(model_dir[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM.*supported: .*LlamaForCausalLM"):
        load_model_files(path)


def test_model_files_and_generation_config(model_dir, tmp_path):
    files = load_model_files(model_dir[1])
    assert files.architecture == "LlamaForCausalLM"
    assert [f.name for f in files.weight_files] == ["model.safetensors"]
    assert files.eos_token_ids == (2,)  # from config.json
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9})
    )
    gen = read_generation_config(tmp_path)
    assert gen.eos_token_ids == (2, 7) and gen.temperature == 0.6 and gen.top_p == 0.9
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_generation_config(tmp_path).eos_token_ids == (5,)
    assert read_generation_config(tmp_path / "absent") is None


# -- loading -----------------------------------------------------------------------------
def test_sharded_checkpoint_loads_like_single_file(model_dir, tmp_path):
    hf_model, single = model_dir
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    files = load_model_files(tmp_path)
    assert len(files.weight_files) > 1
    tokens = [5, 9, 1, 33, 2, 60]
    sharded = prefill_logits(load_model(files, torch.float32, CPU, backend()), tokens)
    whole = prefill_logits(load_model(single, torch.float32, CPU, backend()), tokens)
    torch.testing.assert_close(sharded, whole, atol=0, rtol=0)
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(sharded, expected, atol=1e-5, rtol=0)


def test_sharded_index_naming_a_missing_shard(model_dir, tmp_path):
    model_dir[0].save_pretrained(tmp_path, max_shard_size="20KB")
    next(tmp_path.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_model_files(tmp_path)


def rewrite_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(model_dir, tmp_path):
    path = copy_dir(model_dir[1], tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight \(shards \['k'\]\)"
    ):
        load_model(path, "auto", CPU, backend())


def test_unexpected_tensor_is_named(model_dir, tmp_path):
    path = copy_dir(model_dir[1], tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="does not expect: model.extra.weight"):
        load_model(path, "auto", CPU, backend())


def test_wrong_shape_is_named(model_dir, tmp_path):
    path = copy_dir(model_dir[1], tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        load_model(path, "auto", CPU, backend())


def test_absent_lm_head_ties_to_embedding(model_dir, tmp_path):
    path = copy_dir(model_dir[1], tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    model = load_model(path, "auto", CPU, backend())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_quantized_config_without_quantized_tensors_is_a_clear_error(model_dir, tmp_path):
    """A config that declares AWQ over a plain checkpoint names the tensor it lacks."""
    path = copy_dir(model_dir[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 16,
                                  "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="qweight"):
        load_model(path, "auto", CPU, backend())


# -- dtype and length --------------------------------------------------------------------
def test_resolve_dtype():
    cfg = tiny_config()
    cfg.dtype = torch.bfloat16
    assert resolve_dtype(cfg, "auto") == torch.bfloat16
    assert resolve_dtype(cfg, "float") == torch.float32
    assert resolve_dtype(cfg, "half") == torch.float16
    assert resolve_dtype(cfg, torch.float16) == torch.float16
    cfg.dtype = None
    assert resolve_dtype(cfg, "auto") == torch.float32
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype(cfg, "int8")
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype(cfg, torch.float64)


def test_get_max_model_len():
    cfg = tiny_config()
    assert get_max_model_len(cfg, None) == 64
    assert get_max_model_len(cfg, 32) == 32
    with pytest.raises(ValueError, match="max_model_len 65 exceeds .* 64"):
        get_max_model_len(cfg, 65)
    with pytest.raises(ValueError, match="at least 1"):
        get_max_model_len(cfg, 0)
    scaled = tiny_config(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert get_max_model_len(scaled, None) == 256
