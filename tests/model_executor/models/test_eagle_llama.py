"""The EAGLE-1 Llama head against an independent transformers reference.

The reference is built from transformers' own ``LlamaDecoderLayer`` (input norm
replaced by identity) and rotary embedding in float64; the engine head runs in
float32 through the CPU attention backend's paged cache, under a forward context of
its own, and both go through the same (target) LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from engine.assets import DEMO_EAGLE_MODEL_DIR, DEMO_MODEL_DIR
from engine.core.interfaces import AttentionBatch
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.models.eagle_llama import EagleLlamaForCausalLM, is_eagle_checkpoint
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.registry import MODEL_REGISTRY
from engine.plugins.cpu.attention import CPUAttentionBackend

CPU = torch.device("cpu")
BLOCK_SIZE = 4
SEQ = 11  # spans three blocks, the last one partly filled


def small_config(**overrides: object) -> object:
    from transformers import LlamaConfig

    base = {
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    }
    cfg = LlamaConfig(**{**base, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


class ReferenceHead(nn.Module):
    """EAGLE-1 in transformers modules, with the authors' parameter names."""

    def __init__(self, config: object) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(getattr(config, "bias", False)))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed_tokens(ids), target_hidden], -1))[None]
        positions = torch.arange(len(ids))[None]
        rope = self.rotary(x, positions)
        n = len(ids)
        mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        return x[0]


@dataclass
class Fixture:
    """A random reference head, its checkpoint tensors and the target's LM head."""

    config: object
    reference: ReferenceHead
    lm_head: torch.Tensor  # [vocab, hidden] float64
    tensors: dict[str, torch.Tensor]  # the authors' layout, embedding included


def make_fixture(seed: int = 0, **overrides: object) -> Fixture:
    torch.manual_seed(seed)
    config = small_config(**overrides)
    ref = ReferenceHead(config).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(1.0 if "layernorm" in name else 0.0, 0.2 if p.ndim < 2 else 0.1)
    lm_head = torch.randn(config.vocab_size, config.hidden_size, dtype=torch.float64) * 0.3
    tensors = {k: v.detach().float().contiguous() for k, v in ref.state_dict().items()
               if not k.startswith("rotary")}
    return Fixture(config, ref, lm_head, tensors)


def engine_target(fx: Fixture) -> SimpleNamespace:
    """Stands in for a LlamaForCausalLM: what share_target reads (lm_head, embedding)."""
    cfg = fx.config
    lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=torch.float32, device=CPU)
    lm_head.weight.data.copy_(fx.lm_head)
    embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=torch.float32, device=CPU)
    embed.weight.data.copy_(fx.tensors["embed_tokens.weight"])
    return SimpleNamespace(lm_head=lm_head, model=SimpleNamespace(embed_tokens=embed))


def build_head(config: object) -> tuple[EagleLlamaForCausalLM, CPUAttentionBackend]:
    backend = CPUAttentionBackend(block_size=BLOCK_SIZE, device=CPU)
    ctx = ModelInitContext(dtype=torch.float32, device=CPU, attn_backend=backend)
    return EagleLlamaForCausalLM(config, ctx).eval(), backend


def paged_prefill(backend: CPUAttentionBackend, spec: ModelKVSpec, n: int, run: Callable) -> Any:
    """``run()`` (one prefill of ``n`` tokens) under a forward context with a fresh
    paged cache of ``spec``'s layers."""
    nblocks = -(-n // backend.block_size)
    shape = backend.get_kv_cache_shape(
        nblocks, backend.block_size, spec.num_kv_heads, spec.head_size
    )
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    batch = AttentionBatch(
        num_reqs=1, num_tokens=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(nblocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n,
    )
    with torch.no_grad(), set_forward_context(
        ForwardContext(backend.build_metadata(batch), caches)
    ):
        return run()


def head_prefill_logits(
    head: EagleLlamaForCausalLM, backend: CPUAttentionBackend, ids: torch.Tensor,
    target_hidden: torch.Tensor,
) -> torch.Tensor:
    """One prefill of the head through a fresh paged cache of its own."""
    n = len(ids)
    return paged_prefill(
        backend, head.kv_cache_spec(), n,
        lambda: head.compute_logits(head(ids, torch.arange(n), target_hidden)),
    )


def inputs(fx: Fixture) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, fx.config.vocab_size, (SEQ,), generator=gen)
    target_hidden = torch.randn(SEQ, fx.config.hidden_size, generator=gen, dtype=torch.float64)
    return ids, target_hidden


@torch.no_grad()
def reference_logits(fx: Fixture, ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
    return fx.reference(ids, target_hidden) @ fx.lm_head.T


def check_against_reference(fx: Fixture, weights: dict[str, torch.Tensor]) -> set[str]:
    head, backend = build_head(fx.config)
    loaded = head.load_weights(weights.items())
    head.share_target(engine_target(fx))
    ids, target_hidden = inputs(fx)
    got = head_prefill_logits(head, backend, ids, target_hidden.float())
    want = reference_logits(fx, ids, target_hidden)
    assert got.dtype == torch.float32 and got.shape == (SEQ, fx.config.vocab_size)
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    return loaded


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_hidden_layers": 2}, {"bias": True}],
    ids=["one_layer", "two_layers", "fc_bias"],
)
def test_matches_transformers_reference(overrides: dict) -> None:
    fx = make_fixture(**overrides)
    without_embed = {k: v for k, v in fx.tensors.items() if k != "embed_tokens.weight"}
    check_against_reference(fx, without_embed)


def test_two_layer_head_uses_its_own_cache_indices() -> None:
    head, _ = build_head(small_config(num_hidden_layers=2))
    assert [layer.self_attn.attn.layer_idx for layer in head.layers] == [0, 1]
    spec = head.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size) == (2, 2, 16)
    assert spec.sliding_windows == (None, None)


def test_missing_embedding_is_shared_from_target() -> None:
    fx = make_fixture()
    head, _ = build_head(fx.config)
    loaded = head.load_weights((k, v) for k, v in fx.tensors.items() if k != "embed_tokens.weight")
    assert "embed_tokens.weight" not in loaded and "fc.weight" in loaded
    target = engine_target(fx)
    head.share_target(target)
    assert head.embed_tokens is target.model.embed_tokens
    assert head.lm_head is target.lm_head


def test_vllm_layout_with_embedding_lm_head_and_input_norm() -> None:
    """``model.``-prefixed names; a stored lm_head and layer-0 input norm are ignored;
    the checkpoint's own embedding is kept over the target's."""
    fx = make_fixture()
    weights = {f"model.{k}": v for k, v in fx.tensors.items()}
    weights["lm_head.weight"] = torch.zeros(fx.config.vocab_size, fx.config.hidden_size)
    weights["model.layers.0.input_layernorm.weight"] = torch.zeros(fx.config.hidden_size)
    loaded = check_against_reference(fx, weights)
    assert "embed_tokens.weight" in loaded
    assert "layers.0.self_attn.qkv_proj.weight" in loaded
    head, _ = build_head(fx.config)
    head.load_weights(weights.items())
    target = engine_target(fx)
    head.share_target(target)
    assert head.embed_tokens is not target.model.embed_tokens


def test_compute_logits_needs_the_target() -> None:
    head, _ = build_head(small_config())
    with pytest.raises(RuntimeError, match="share_target"):
        head.compute_logits(torch.zeros(1, 64))


def test_incomplete_checkpoint_is_an_error() -> None:
    fx = make_fixture()
    head, _ = build_head(fx.config)
    with pytest.raises(ValueError, match="fc.weight"):
        head.load_weights((k, v) for k, v in fx.tensors.items() if k != "fc.weight")


@pytest.mark.parametrize("name", ["EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "EAGLEModel"])
def test_registry_resolves(name: str) -> None:
    assert MODEL_REGISTRY.resolve([name]) is EagleLlamaForCausalLM


def test_is_eagle_checkpoint(tmp_path: Path) -> None:
    fx = make_fixture()
    authors, vllm, plain = (tmp_path / f"{n}.safetensors" for n in ("authors", "vllm", "plain"))
    save_file(fx.tensors, str(authors))
    save_file({f"model.{k}": v for k, v in fx.tensors.items()}, str(vllm))
    save_file({"model.embed_tokens.weight": fx.tensors["embed_tokens.weight"]}, str(plain))
    assert is_eagle_checkpoint([authors]) and is_eagle_checkpoint([plain, vllm])
    assert not is_eagle_checkpoint([plain])
    assert not is_eagle_checkpoint([tmp_path / "pytorch_model.bin"])


SHIPPED_TEXT = (
    "The hacker ethic is the belief that information-sharing is a powerful positive good, "
    "and that it is an ethical duty of hackers to share their expertise by writing "
    "open-source code and facilitating access to information and to computing resources "
    "wherever possible."
)


@pytest.mark.skipif(
    not (DEMO_EAGLE_MODEL_DIR / "model.safetensors").is_file(), reason="no shipped head"
)
def test_shipped_demo_head_drafts_for_the_demo_model() -> None:
    """The committed asset: an EAGLE checkpoint by its tensors, resolved by its config,
    small, and its drafts agree with the demo model's own greedy choices."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from engine.model_executor.models.llama import LlamaForCausalLM

    weights = DEMO_EAGLE_MODEL_DIR / "model.safetensors"
    assert is_eagle_checkpoint([weights])
    assert sum(p.stat().st_size for p in DEMO_EAGLE_MODEL_DIR.iterdir()) < 4_000_000
    backend = CPUAttentionBackend(block_size=16, device=CPU)
    ctx = ModelInitContext(dtype=torch.float32, device=CPU, attn_backend=backend)
    target = LlamaForCausalLM(AutoConfig.from_pretrained(DEMO_MODEL_DIR), ctx).eval()
    target.load_weights(load_file(str(DEMO_MODEL_DIR / "model.safetensors")).items())
    config = AutoConfig.from_pretrained(DEMO_EAGLE_MODEL_DIR)
    head = MODEL_REGISTRY.resolve(config.architectures)(config, ctx).eval()
    loaded = head.load_weights(load_file(str(weights)).items())
    assert isinstance(head, EagleLlamaForCausalLM) and "embed_tokens.weight" not in loaded
    head.share_target(target)

    ids = torch.tensor(AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)(SHIPPED_TEXT)["input_ids"])
    n = len(ids)
    feats = paged_prefill(
        backend, target.kv_cache_spec(), n, lambda: target(ids, torch.arange(n))
    )
    want = target.compute_logits(feats[1:]).argmax(-1)
    drafted = head_prefill_logits(head, backend, ids[1:], feats[:-1]).argmax(-1)
    assert (drafted == want).float().mean() > 0.5  # 0.65 when shipped
