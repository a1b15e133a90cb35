"""EAGLE-1 heads as they are published, loaded through ``speculative_config``.

The EAGLE authors save a head as a one-layer "LlamaForCausalLM": ``config.json`` says
``"architectures": ["LlamaForCausalLM"]``, ``num_hidden_layers: 1``, and the weights are
``fc.weight`` plus ``layers.0.*`` -- no ``model.`` prefix, no embedding, no LM head, no
layer-0 input norm. vLLM-style exports prefix the same tensors with ``model.`` and may
carry ``embed_tokens.weight``, an ``lm_head.weight`` (ignored: EAGLE-1 uses the
target's) and a layer-0 input norm (ignored). Only the ``fc`` tensor tells such a head
from a small Llama, so ``{"model": DIR}`` without a method must resolve to eagle.

The heads are random (torch + safetensors, fixed seed) for a random Llama target of the
same hidden size and vocabulary. Both layouts hold the *same* head (the prefixed one
carries a copy of the target's embedding), so besides greedy output equal to the target
alone they must propose the very same drafts, step by step; the loaded parameters are
checked against the file's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.helpers.hf_reference import cpu_llm
from tests.spec_decode.test_spec_decode_e2e import core, random_prompt, run, spec_stats

K = 3
INTERMEDIATE = 96
PROMPT_SEEDS = (1, 2, 3, 4)


def _target_config(target: Path) -> dict:
    return json.loads((target / "config.json").read_text())


def head_tensors(target: Path, *, hidden: int | None = None, seed: int = 0,
                 bias: bool = False) -> dict[str, torch.Tensor]:
    """A random EAGLE-1 head in the authors' names (``fc.*``, ``layers.0.*``)."""
    cfg = _target_config(target)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads if hidden else cfg.get("head_dim") or cfg["hidden_size"] // heads
    hidden = hidden or cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": rand(INTERMEDIATE, hidden),
        "layers.0.mlp.up_proj.weight": rand(INTERMEDIATE, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, INTERMEDIATE),
        "layers.0.post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
    }
    if bias:
        tensors["fc.bias"] = rand(hidden)
    return tensors


def write_head(out: Path, target: Path, tensors: dict[str, torch.Tensor], *,
               hidden: int | None = None, **config: object) -> Path:
    """``out``: the tensors and the authors' kind of config (a LlamaForCausalLM)."""
    cfg = _target_config(target)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    head_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden or cfg["hidden_size"], "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1, "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg.get("rope_theta", 10000.0),
        "vocab_size": cfg["vocab_size"], "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"], "hidden_act": "silu", "torch_dtype": "float32",
        "tie_word_embeddings": False, **config,
    }
    if "head_dim" in cfg and hidden is None:
        head_config["head_dim"] = cfg["head_dim"]
    (out / "config.json").write_text(json.dumps(head_config, indent=1))
    return out


def prefixed(tensors: dict[str, torch.Tensor], target: Path) -> dict[str, torch.Tensor]:
    """The vLLM-style layout of the same head: ``model.`` names, the target's embedding
    (a copy), a random LM head and layer-0 input norm (both must be ignored)."""
    target_weights = load_file(str(target / "model.safetensors"))
    embed = target_weights["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    gen = torch.Generator().manual_seed(99)
    out = {f"model.{k}": v for k, v in tensors.items()}
    out["model.embed_tokens.weight"] = embed.clone().contiguous()
    out["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen)
    out["model.layers.0.input_layernorm.weight"] = torch.randn(hidden, generator=gen)
    return out


@pytest.fixture(scope="module")
def target(model_dir_factory) -> Path:
    return model_dir_factory("llama-gqa")


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle_layouts")
    tensors = head_tensors(target)
    return {
        "authors": write_head(root / "authors", target, tensors),
        "prefixed": write_head(root / "prefixed", target, prefixed(tensors, target)),
    }


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    vocab = _target_config(target)["vocab_size"]
    motif = random_prompt(5, vocab, 9)
    return [random_prompt(8 + 3 * s, vocab, s) for s in PROMPT_SEEDS] + [motif * 4]


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(target, prompts):
    llm = cpu_llm(target, max_num_seqs=8)
    return run(llm, prompts, PARAMS)


class DraftRecorder:
    """Every draft the scheduler hands to the runner, per request, in step order."""

    def __init__(self, llm: LLM) -> None:
        scheduler = core(llm).scheduler
        original = scheduler.schedule
        self.drafts: dict[str, list[tuple[int, ...]]] = {}

        def schedule():
            so = original()
            for rid, drafts in so.scheduled_spec_decode_tokens.items():
                self.drafts.setdefault(rid, []).append(tuple(drafts))
            return so

        scheduler.schedule = schedule


def _spec_run(target: Path, spec: dict, prompts: list[list[int]]):
    llm = cpu_llm(target, max_num_seqs=8, speculative_config=spec)
    recorder = DraftRecorder(llm)
    spec_stats(llm)
    outs = run(llm, prompts, PARAMS)
    stats = spec_stats(llm)
    by_prompt = [recorder.drafts.get(o.request_id, []) for o in outs]
    return llm, outs, stats, by_prompt


@torch.inference_mode()
def weight_of(linear: torch.nn.Module) -> torch.Tensor:
    """``[out, in]`` weight of a loaded linear layer, read through its forward (the CPU
    kernels keep weights packed in their own layout)."""
    return linear(torch.eye(linear.in_features)).T.float()


def _proposer(llm: LLM):
    return core(llm).executor.proposer


@pytest.fixture(scope="module")
def runs(target, heads, prompts):
    """(layout, with method?) -> (llm, outputs, stats, drafts per prompt)."""
    cache = {}

    def get(layout: str, with_method: bool):
        if (layout, with_method) not in cache:
            spec = {"model": str(heads[layout]), "num_speculative_tokens": K}
            if with_method:
                spec["method"] = "eagle"
            cache[layout, with_method] = _spec_run(target, spec, prompts)
        return cache[layout, with_method]

    return get


@pytest.mark.parametrize("with_method", [True, False], ids=["method-eagle", "no-method"])
@pytest.mark.parametrize("layout", ["authors", "prefixed"])
def test_head_loads_and_greedy_equals_target(runs, plain, heads, layout, with_method):
    llm, outs, stats, drafts = runs(layout, with_method)
    spec = llm.llm_engine.config.speculative  # resolved: eagle, from the head's tensors
    assert spec.method == "eagle" and Path(spec.model) == heads[layout]
    assert type(_proposer(llm)).__name__ == "EagleProposer"
    for got, want in zip(outs, plain):
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        assert got.outputs[0].text == want.outputs[0].text
    assert stats.num_draft_tokens > 0 and all(drafts), stats


def test_both_layouts_load_the_same_head(runs, target, heads):
    """The prefixed layout's LM head and input norm are ignored and its embedding is the
    target's: both layouts propose the same drafts, and hold the file's tensors."""
    authors, prefixed_ = runs("authors", True), runs("prefixed", True)
    assert authors[3] == prefixed_[3]
    assert authors[2] == prefixed_[2]
    tensors = load_file(str(heads["authors"] / "model.safetensors"))
    hidden = tensors["fc.weight"].shape[0]
    layer_names = {  # the engine's fused layers -> the checkpoint's tensors
        "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "self_attn.o_proj": ["self_attn.o_proj"],
        "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
        "mlp.down_proj": ["mlp.down_proj"],
    }
    for llm, embed_loaded in ((authors[0], False), (prefixed_[0], True)):
        head = _proposer(llm).model
        torch.testing.assert_close(weight_of(head.fc_embed), tensors["fc.weight"][:, :hidden])
        torch.testing.assert_close(weight_of(head.fc_hidden), tensors["fc.weight"][:, hidden:])
        layer = head.layers[0]
        for ours, theirs in layer_names.items():
            want = torch.cat([tensors[f"layers.0.{n}.weight"] for n in theirs])
            torch.testing.assert_close(weight_of(layer.get_submodule(ours)), want)
        torch.testing.assert_close(layer.post_attention_layernorm.weight.float(),
                                   tensors["layers.0.post_attention_layernorm.weight"])
        target_model = core(llm).executor.model
        assert head.lm_head is target_model.lm_head
        assert head.embed_loaded is embed_loaded
        assert (head.embed_tokens is target_model.model.embed_tokens) is not embed_loaded


def test_head_with_fc_bias(target, tmp_path, prompts, plain):
    """A head whose ``fc`` has a bias (``"bias": true`` in its config) loads it."""
    tensors = head_tensors(target, seed=5, bias=True)
    path = write_head(tmp_path / "bias", target, tensors, bias=True)
    llm, outs, stats, _ = _spec_run(target, {"model": str(path), "num_speculative_tokens": K},
                                    prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(o.outputs[0].token_ids) for o in plain]
    assert stats.num_draft_tokens > 0
    head = _proposer(llm).model
    with torch.inference_mode():  # the bias is fc_embed's: what zero inputs return
        torch.testing.assert_close(head.fc_embed(torch.zeros(1, head.fc_embed.in_features))[0],
                                   tensors["fc.bias"])


@pytest.mark.parametrize("with_method", [True, False], ids=["method-eagle", "no-method"])
def test_head_of_another_hidden_size_is_refused_before_loading(target, tmp_path, with_method,
                                                               monkeypatch):
    hidden = _target_config(target)["hidden_size"] * 2
    path = write_head(tmp_path / "wide", target, head_tensors(target, hidden=hidden),
                      hidden=hidden)
    spec = {"model": str(path), "num_speculative_tokens": K}
    if with_method:
        spec["method"] = "eagle"

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    import engine.model_executor.model_loader as loader
    import engine.model_executor.worker as executor

    for module in (loader, executor):  # the draft's loader, the target's
        monkeypatch.setattr(module, "load_model", no_loading)
    with pytest.raises(ValueError, match=rf"hidden size {hidden}.*target has {hidden // 2}"):
        cpu_llm(target, speculative_config=spec)
