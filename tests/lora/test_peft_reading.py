"""Reading PEFT adapters: every module's scaling equals the one PEFT's own layer uses
(rank / alpha patterns, rsLoRA), and what cannot be served is refused from the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.lora.peft import PEFTConfig, check_adapter, read_adapter
from tests.helpers.lora_models import (
    ALL_TARGETS,
    build_llama_base,
    load_peft_model,
    make_peft_adapter,
)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return build_llama_base(tmp_path_factory.mktemp("lora-base"))


@pytest.mark.parametrize("kwargs", [
    {},
    {"use_rslora": True},
    {"rank_pattern": {"q_proj": 4, "layers.1.mlp.down_proj": 16},
     "alpha_pattern": {"down_proj": 8, "v_proj": 32}},
])
def test_scaling_and_matrices_are_what_peft_computes_with(base_dir, tmp_path, kwargs):
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "adapter", r=8, lora_alpha=16,
                                    target_modules=ALL_TARGETS, seed=3, **kwargs)
    adapter = read_adapter(str(adapter_dir), max_lora_rank=32)
    peft_model = load_peft_model(base_dir, adapter_dir)
    layers = {name.removeprefix("base_model.model."): module
              for name, module in peft_model.named_modules()
              if isinstance(getattr(module, "scaling", None), dict)}
    assert set(adapter.modules) == set(layers)
    for name, module in adapter.modules.items():
        layer = layers[name]
        assert module.scaling == pytest.approx(layer.scaling["default"], rel=1e-12), name
        assert module.lora_a.equal(layer.lora_A["default"].weight.detach()), name
        assert module.lora_b.equal(layer.lora_B["default"].weight.detach()), name


def write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                          "lora_alpha": 16, **fields}))
    return path


@pytest.mark.parametrize(("fields", "named"), [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["lm_head"]}, "lm_head"),
    ({"peft_type": "IA3"}, "not LoRA"),
    ({"r": "eight"}, "malformed"),
])
def test_configs_that_cannot_be_served_are_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ValueError, match=named):
        PEFTConfig.read(write_config(tmp_path / "a", **fields))


def test_missing_files_and_ranks_above_the_limit_are_refused(base_dir, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        check_adapter(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="adapter_config.json"):
        check_adapter(str(tmp_path))
    with pytest.raises(ValueError, match="adapter_model"):
        check_adapter(str(write_config(tmp_path / "no-weights")))
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "r16", r=16, lora_alpha=16,
                                    target_modules=["q_proj"], seed=1)
    assert check_adapter(str(adapter_dir), max_lora_rank=16).r == 16
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        check_adapter(str(adapter_dir), max_lora_rank=8)
