"""Config snapshots stand for transformers' configs: every attribute reads the same as a
fresh ``AutoConfig`` of the directory, aliases and overrides behave as on the real
class, whatever JSON cannot hold comes from the real config, and composite configs or the
Transformers backend never get a snapshot."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
import transformers
from transformers import AutoConfig

from engine.model_executor.hf_config_snapshot import ConfigSnapshot, ConfigSnapshotStore
from engine.model_executor.model_loader import load_hf_config, load_model, load_model_files
from tests.helpers.engine_logits import prefill_logits

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"],
                                              dtype="bfloat16"),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True,
                                              sliding_window=16, max_window_layers=1),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                            architectures=["GPT2LMHeadModel"]),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=16,
                                                         sliding_window=8),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "phi3": lambda: transformers.Phi3Config(
        **SMALL, rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                               "long_factor": [2.0] * 8},
        original_max_position_embeddings=32),
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Snapshots of this test only (the built CPU kernels stay in the shared cache)."""
    from engine.model_executor import hf_config_snapshot

    root = tmp_path / "cache"
    monkeypatch.setattr(hf_config_snapshot, "cache_dirs", lambda kind: [root / kind])
    monkeypatch.delenv("ENGINE_CONFIG_SNAPSHOTS", raising=False)
    return root


def readable_values(config) -> dict:
    """Every public, non-method attribute of ``config`` (transformers' deprecation notes
    silenced), as a reference independent of the snapshot code."""
    log = logging.getLogger("transformers")
    level, values = log.level, {}
    log.setLevel(logging.ERROR)
    try:
        for name in dir(config):
            if name.startswith("__"):
                continue
            try:
                value = getattr(config, name)
            except Exception:  # noqa: BLE001, S112 (a property that refuses: not a value)
                continue
            if not callable(value):
                values[name] = value
    finally:
        log.setLevel(level)
    return values


def saved(tmp_path, family: str, name: str = "model"):
    path = tmp_path / name
    FAMILIES[family]().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_snapshot_reads_like_a_fresh_auto_config(tmp_path, family):
    path = saved(tmp_path, family)
    first = load_hf_config(path)
    assert not isinstance(first, ConfigSnapshot)  # the first load records
    snapshot = load_hf_config(path)
    assert isinstance(snapshot, ConfigSnapshot)
    reference = AutoConfig.from_pretrained(str(path))
    expected, got = readable_values(reference), readable_values(snapshot)
    for name, value in expected.items():
        if name == "per_layer_config":  # a view object: compared by what it reads below
            continue
        assert got.get(name, "<absent>") == value, name
    assert set(got) - {"per_layer_config"} <= set(expected)
    assert snapshot.get_text_config() is snapshot


def test_aliases_and_overrides_behave_as_on_the_real_class(tmp_path):
    path = saved(tmp_path, "gpt2")
    real = load_hf_config(path)
    snapshot = load_hf_config(path)
    for config in (real, snapshot):
        config.hidden_size = 48  # GPT-2's attribute_map: hidden_size -> n_embd
    assert snapshot.n_embd == real.n_embd == 48
    assert snapshot.hidden_size == real.hidden_size == 48
    # Whatever the snapshot defers to the real config sees the change too.
    assert snapshot.to_dict()["n_embd"] == 48
    assert snapshot.real_config().n_embd == 48


def test_deferred_values_and_methods_come_from_the_real_config(tmp_path):
    path = saved(tmp_path, "llama")
    real = load_hf_config(path)
    snapshot = load_hf_config(path)
    assert snapshot.__dict__["_snapshot_real"] is None  # nothing loaded yet
    assert type(snapshot.per_layer_config) is type(real.per_layer_config)
    assert snapshot.to_dict() == real.to_dict()
    with pytest.raises(AttributeError, match="no attribute 'not_a_config_field'"):
        _ = snapshot.not_a_config_field
    assert getattr(snapshot, "not_a_config_field", 7) == 7


def test_snapshot_pickles_without_its_real_config(tmp_path):
    path = saved(tmp_path, "mixtral")
    load_hf_config(path)
    snapshot = load_hf_config(path)
    snapshot.real_config()
    snapshot.num_experts_per_tok = 1
    clone = pickle.loads(pickle.dumps(snapshot))
    values = readable_values(snapshot)
    values.pop("per_layer_config")  # a view object, compared by identity
    assert {k: v for k, v in readable_values(clone).items() if k in values} == values
    assert clone.real_config().num_experts_per_tok == 1  # the change replays on a fresh load


def test_same_bytes_elsewhere_name_their_own_directory(tmp_path):
    first = saved(tmp_path, "llama", "a")
    load_hf_config(first)
    second = tmp_path / "b"
    second.mkdir()
    (second / "config.json").write_bytes((first / "config.json").read_bytes())
    snapshot = load_hf_config(second)
    assert isinstance(snapshot, ConfigSnapshot)
    assert snapshot._name_or_path == snapshot.name_or_path == str(second)


def test_composite_configs_are_never_snapshotted(tmp_path):
    path = tmp_path / "llava"
    transformers.LlavaConfig(text_config=transformers.LlamaConfig(**SMALL)).save_pretrained(path)
    load_hf_config(path)
    again = load_hf_config(path)
    assert not isinstance(again, ConfigSnapshot)
    assert isinstance(again, transformers.LlavaConfig)


def test_unreadable_entry_is_rebuilt(tmp_path, cache_dir):
    path = saved(tmp_path, "qwen2")
    load_hf_config(path)
    (entry,) = (cache_dir / "hf_configs").glob("*.json")
    entry.write_text("{not json")
    assert not isinstance(load_hf_config(path), ConfigSnapshot)
    json.loads(entry.read_text())  # written again, whole
    assert isinstance(load_hf_config(path), ConfigSnapshot)


def test_a_changed_config_is_a_new_key(tmp_path):
    path = saved(tmp_path, "llama")
    load_hf_config(path)
    raw = json.loads((path / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(raw))
    fresh = load_hf_config(path)
    assert not isinstance(fresh, ConfigSnapshot) and fresh.rms_norm_eps == 1e-3
    assert load_hf_config(path).rms_norm_eps == 1e-3


def test_switched_off_by_the_environment(tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("ENGINE_CONFIG_SNAPSHOTS", "0")
    path = saved(tmp_path, "llama")
    load_hf_config(path)
    assert not isinstance(load_hf_config(path), ConfigSnapshot)
    assert not (cache_dir / "hf_configs").exists()


def test_read_only_cache_falls_back_and_still_loads(tmp_path):
    path = saved(tmp_path, "llama")
    store = ConfigSnapshotStore([tmp_path / "file-not-dir" / "x"])
    (tmp_path / "file-not-dir").write_text("")
    config = AutoConfig.from_pretrained(str(path))
    assert store.save(path, config, lambda p: config) is False
    assert store.load(path, lambda p: config) is None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return model, path


def test_model_built_from_a_snapshot_matches_transformers(tiny_llama):
    reference, path = tiny_llama
    load_model_files(path)
    files = load_model_files(path)
    assert isinstance(files.hf_config, ConfigSnapshot)
    from engine.plugins.cpu.attention import CPUAttentionBackend

    model = load_model(files, torch.float32, torch.device("cpu"),
                       CPUAttentionBackend(block_size=4, device=torch.device("cpu")))
    tokens = [3, 17, 42, 5, 9, 11]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, tokens), expected, rtol=1e-4, atol=1e-4)


def test_transformers_backend_gets_the_real_config(tiny_llama):
    _, path = tiny_llama
    load_model_files(path)
    assert isinstance(load_model_files(path).hf_config, ConfigSnapshot)
    files = load_model_files(path, model_impl="transformers")
    assert files.impl == "transformers"
    assert isinstance(files.hf_config, transformers.LlamaConfig)


def test_overrides_go_onto_the_real_config(tiny_llama, tmp_path):
    """--hf-overrides changes transformers' own config, whose properties recompute from
    what it changes (Falcon's head_dim below); a snapshot's recorded values would not."""
    _, path = tiny_llama
    load_model_files(path)
    files = load_model_files(path, hf_overrides={"rms_norm_eps": 1e-3})
    assert isinstance(files.hf_config, transformers.LlamaConfig)
    assert files.hf_config.rms_norm_eps == 1e-3
    falcon = tmp_path / "falcon"
    transformers.FalconConfig(hidden_size=64, num_attention_heads=4).save_pretrained(falcon)
    load_hf_config(falcon)
    snapshot, real = load_hf_config(falcon), load_hf_config(falcon, snapshot=False)
    snapshot.hidden_size = real.hidden_size = 128
    assert real.head_dim == 32 and snapshot.head_dim == 16  # why overrides skip snapshots
