"""Engine models against transformers, through the loader and the paged KV cache.

Each case builds a tiny random-weight HF model (fixed seed, float32), saves it as
safetensors, loads it with ``load_model``, runs a prompt (whole or in two chunks) and a
few single-token decode steps through the CPU attention backend's paged cache, and
compares every logit with transformers' own forward over the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from engine.core.interfaces import AttentionBatch
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.model_loader import load_model
from engine.plugins.cpu.attention import CPUAttentionBackend

CPU = torch.device("cpu")
BLOCK_SIZE = 4
ATOL = 1e-4

BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "attn_implementation": "eager",
}

CASES = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_mha_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
    ),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama_rope_linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "llama_rope_dynamic": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "llama_rope_llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            }
        },
    ),
    "mistral_window": (
        "MistralConfig",
        "MistralForCausalLM",
        {"num_key_value_heads": 1, "sliding_window": 6},
    ),
    "qwen2_bias_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 1,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_head_dim": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}


def build_hf_model(name: str) -> transformers.PreTrainedModel:
    config_name, model_name, extra = CASES[name]
    config = getattr(transformers, config_name)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in pname else noise * 2)
    return model


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """name -> (hf_model, directory), built lazily once per module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (model, path)
        return cache[name]

    return get


@dataclass
class PagedSequences:
    """Drives a model step by step over a paged cache, allocating blocks in order."""

    model: torch.nn.Module
    num_blocks: int = 64
    backend: CPUAttentionBackend = field(init=False)
    kv_caches: list[torch.Tensor] = field(init=False)
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    next_block: int = 1  # block 0 stays unused, like padding

    def __post_init__(self) -> None:
        self.backend = CPUAttentionBackend(block_size=BLOCK_SIZE, device=CPU)
        spec = self.model.kv_cache_spec()
        dtype = next(self.model.parameters()).dtype
        shape = self.backend.get_kv_cache_shape(
            self.num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_size
        )
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed new tokens per sequence id; logits [len, vocab] of every new token."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for seq_id, tokens in chunks.items():
            start = self.lengths.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.next_block)
                self.next_block += 1
            pos = list(range(start, end))
            ids += tokens
            positions += pos
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.lengths[seq_id] = end
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        batch = AttentionBatch(
            num_reqs=len(chunks),
            num_tokens=len(ids),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        metadata = self.backend.build_metadata(batch)
        with torch.no_grad(), set_forward_context(ForwardContext(metadata, self.kv_caches)):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()])))


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def load(path, dtype=torch.float32):
    return load_model(path, dtype, CPU, CPUAttentionBackend(block_size=BLOCK_SIZE, device=CPU))


PROMPT_LEN = 13  # not a multiple of the block size
NUM_DECODES = 4


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunks", [[PROMPT_LEN], [8, 5]], ids=["whole", "chunked"])
def test_prefill_and_decode_match_transformers(saved_models, name, chunks):
    hf_model, path = saved_models(name)
    tokens = torch.randint(
        0, 256, (PROMPT_LEN + NUM_DECODES,), generator=torch.Generator().manual_seed(7)
    ).tolist()
    expected = hf_logits(hf_model, tokens)
    model = load(path)
    runner = PagedSequences(model)
    got, start = [], 0
    for size in chunks:
        got.append(runner.step({0: tokens[start : start + size]})[0])
        start += size
    for t in tokens[PROMPT_LEN:]:
        got.append(runner.step({0: [t]})[0])
    got = torch.cat(got)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_mixed_batch_of_two_sequences(saved_models):
    """One sequence decodes while another prefills in the same step (Qwen2: windows)."""
    hf_model, path = saved_models("qwen2_bias_window")
    gen = torch.Generator().manual_seed(8)
    a = torch.randint(0, 256, (15,), generator=gen).tolist()
    b = torch.randint(0, 256, (11,), generator=gen).tolist()
    runner = PagedSequences(load(path))
    out_a = [runner.step({0: a[:9]})[0]]
    step = runner.step({0: [a[9]], 1: b[:6]})
    out_a.append(step[0])
    out_b = [step[1]]
    step = runner.step({1: b[6:], 0: a[10:]})  # both multi-token
    out_a.append(step[0])
    out_b.append(step[1])
    torch.testing.assert_close(torch.cat(out_a), hf_logits(hf_model, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(out_b), hf_logits(hf_model, b), atol=ATOL, rtol=0)


def test_kv_cache_spec_reports_shapes_and_windows(saved_models):
    _, path = saved_models("qwen2_bias_window")
    spec = load(path).kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size) == (2, 2, 16)
    assert spec.sliding_windows == (None, 5) and spec.sliding_window is None
    _, path = saved_models("qwen3_head_dim")
    model = load(path)
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (2, 2, 24)
    assert model.vocab_size == 256


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_float32(saved_models, dtype):
    """Reduced precision stays close to transformers' float32 logits and loads in dtype."""
    hf_model, path = saved_models("llama_gqa")
    tokens = list(range(3, 3 + 10))
    model = load(path, dtype)
    # every weight in dtype; the attention layers' fp8 KV cache scales stay float32
    assert all(p.dtype == dtype for name, p in model.named_parameters()
               if not name.endswith((".attn.k_scale", ".attn.v_scale")))
    got = PagedSequences(model).step({0: tokens})[0]
    expected = hf_logits(hf_model, tokens)
    assert got.dtype == torch.float32
    err = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err < 0.05 * scale, (err, scale)
    assert math.isfinite(err)
