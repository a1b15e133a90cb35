"""Tiny base models and PEFT LoRA adapters built locally (no hub), and PEFT as the
reference for the engine's multi-LoRA serving.

Everything here is pytest-independent, runs on the CPU in float32 and is seeded:

- :func:`build_llama_base` / :func:`build_qwen2_base`: tiny random base models plus a
  tokenizer, saved with ``save_pretrained`` (the Qwen2 one has random q/k/v biases and
  MLP / KV-head shapes that differ from the Llama one, so an adapter made for one base
  does not fit the other).
- :func:`make_peft_adapter`: ``peft.get_peft_model`` + ``LoraConfig``, both ``lora_A``
  and ``lora_B`` randomized (PEFT zero-initializes B, which would make the adapter a
  no-op), saved with ``save_pretrained``.
- :func:`build_adapter_set`: the adapters the LoRA tests use (ranks 4 .. 32, subsets of
  targets, rsLoRA, rank / alpha patterns) and the ones the engine must refuse (DoRA,
  embed_tokens / lm_head targets, modules_to_save).
- :func:`peft_reference`: greedy generation with ``PeftModel`` (transformers, float32,
  eager attention) returning the tokens and each step's float64 log-softmax, in the shape
  of :func:`tests.helpers.hf_reference.hf_generate_with_logprobs` (so
  :func:`tests.helpers.hf_reference.assert_matches_reference` compares an engine output
  with it), plus the top-k logprobs per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.helpers.hf_models import build_model_dir

# Every projection of a Llama / Qwen2 decoder layer that the engine serves LoRA on.
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The Qwen2 base differs from the Llama base in the MLP width and the number of KV heads
# (k_proj / v_proj out features 16 instead of 32), so a Llama adapter on any of k, v,
# gate, up, down does not fit it.
QWEN2_OVERRIDES = {"intermediate_size": 96, "num_key_value_heads": 1}

# Entry of each delta W = scaling * B @ A: small next to the base weights (std 0.25),
# big enough that greedy outputs visibly change.
DEFAULT_DELTA_STD = 0.08


def build_llama_base(out_dir: str | Path, *, seed: int = 0) -> Path:
    """A tiny ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 KV heads - GQA,
    intermediate 128, vocab = the tokenizer's ~384, untied head) plus its tokenizer."""
    return build_model_dir(Path(out_dir), "llama-gqa", seed=seed)


def build_qwen2_base(out_dir: str | Path, *, seed: int = 1) -> Path:
    """A tiny ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 4 heads, 1 KV head, intermediate
    96) whose q/k/v biases are random (transformers initializes them to zero)."""
    out = build_model_dir(Path(out_dir), "qwen2", seed=seed, **QWEN2_OVERRIDES)
    _randomize_biases(out, seed=seed)
    return out


def _randomize_biases(model_dir: Path, seed: int, std: float = 0.25) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 1000)
    for name in sorted(tensors):
        if name.endswith(".bias"):
            t = tensors[name]
            tensors[name] = (torch.randn(t.shape, generator=gen) * std).to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def load_base(base_dir: str | Path) -> Any:
    """The base model in transformers: float32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int,
    lora_alpha: float,
    target_modules: Sequence[str] | str,
    seed: int,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    use_dora: bool = False,
    modules_to_save: Sequence[str] | None = None,
    bias: str = "none",
    delta_std: float = DEFAULT_DELTA_STD,
    base_model: Any = None,
) -> Path:
    """Build a PEFT LoRA adapter for the model in ``base_dir`` and save it to ``out_dir``.

    ``lora_A`` and ``lora_B`` (and ``lora_embedding_A`` / ``_B`` for an embedding target)
    are drawn from a seeded normal whose std is chosen per module from that module's own
    rank and scaling (so ``rank_pattern`` / ``alpha_pattern`` / rsLoRA are honoured) such
    that the entries of ``scaling * B @ A`` have std about ``delta_std``. A DoRA adapter's
    magnitude vector is perturbed too. ``modules_to_save`` copies are perturbed so they
    are not equal to the base. ``base_model``: an already loaded base (it is deep-copied,
    not modified). Returns ``out_dir``.
    """
    import copy

    from peft import LoraConfig, get_peft_model

    out = Path(out_dir)
    base = copy.deepcopy(base_model) if base_model is not None else load_base(base_dir)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str)
        else target_modules,
        lora_dropout=0.0,
        bias=bias,
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        use_dora=use_dora,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    for name, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
        pairs = []
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            pairs.append((module.lora_A["default"].weight, module.lora_B["default"].weight))
        if hasattr(module, "lora_embedding_A") and "default" in module.lora_embedding_A:
            pairs.append((module.lora_embedding_A["default"], module.lora_embedding_B["default"]))
        for a, b in pairs:
            rank = module.r["default"]
            scaling = module.scaling["default"]
            # entries of B @ A: sum over rank of products, std = sqrt(rank) * sa * sb
            s = math.sqrt(delta_std / (abs(scaling) * math.sqrt(rank)))
            a.copy_(torch.randn(a.shape, generator=gen) * s)
            b.copy_(torch.randn(b.shape, generator=gen) * s)
        if use_dora and hasattr(module, "lora_magnitude_vector") \
                and "default" in module.lora_magnitude_vector:
            mag = module.lora_magnitude_vector["default"].weight
            mag.mul_(1.0 + 0.2 * torch.randn(mag.shape, generator=gen))
        to_save = getattr(module, "modules_to_save", None)
        if isinstance(to_save, torch.nn.ModuleDict) and "default" in to_save:
            for p in to_save["default"].parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out


@dataclass
class AdapterSpec:
    """Arguments of :func:`make_peft_adapter` for one named adapter."""

    name: str
    r: int
    lora_alpha: float
    target_modules: list[str]
    seed: int
    kwargs: dict[str, Any] = field(default_factory=dict)


# Adapters the engine must serve (max_lora_rank >= 32).
GOOD_ADAPTERS = [
    AdapterSpec("r8_all", 8, 16, ALL_TARGETS, seed=11),
    AdapterSpec("r4_qv", 4, 8, ["q_proj", "v_proj"], seed=12),
    AdapterSpec("r16_down", 16, 32, ["down_proj"], seed=13),
    AdapterSpec("r32_all", 32, 16, ALL_TARGETS, seed=14),
    AdapterSpec("r8_attn_rslora", 8, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=15,
                kwargs={"use_rslora": True}),
    # per-module rank / alpha: q_proj rank 4, down_proj rank 16 alpha 8, the rest r=8 a=16
    AdapterSpec("r8_patterns", 8, 16, ALL_TARGETS, seed=16,
                kwargs={"rank_pattern": {"q_proj": 4, "down_proj": 16},
                        "alpha_pattern": {"down_proj": 8, "v_proj": 32}}),
    AdapterSpec("r16_mlp_rslora", 16, 16, ["gate_proj", "up_proj", "down_proj"], seed=17,
                kwargs={"use_rslora": True}),
]

# Adapters the engine must refuse with a ValueError, and what the message should name.
BAD_ADAPTERS = [
    (AdapterSpec("dora", 8, 16, ["q_proj", "v_proj"], seed=21, kwargs={"use_dora": True}),
     "dora"),
    (AdapterSpec("embed", 8, 16, ["embed_tokens", "q_proj"], seed=22), "embed_tokens"),
    (AdapterSpec("lm_head", 8, 16, ["lm_head", "q_proj"], seed=23), "lm_head"),
    (AdapterSpec("modules_to_save", 8, 16, ["q_proj"], seed=24,
                 kwargs={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (AdapterSpec("r64_all", 64, 64, ALL_TARGETS, seed=25), "rank"),
]


def build_adapter_set(base_dir: str | Path, out_root: str | Path,
                      specs: Sequence[AdapterSpec] = GOOD_ADAPTERS) -> dict[str, Path]:
    """Build each of ``specs`` for ``base_dir`` under ``out_root/<name>``; returns
    ``{name: dir}``. The base is loaded once."""
    base = load_base(base_dir)
    root = Path(out_root)
    return {
        s.name: make_peft_adapter(base_dir, root / s.name, r=s.r, lora_alpha=s.lora_alpha,
                                  target_modules=s.target_modules, seed=s.seed,
                                  base_model=base, **s.kwargs)
        for s in specs
    }


def load_peft_model(base_dir: str | Path, adapter_dir: str | Path | None,
                    merged: bool = False) -> Any:
    """The base in transformers with the adapter applied by ``PeftModel`` (float32, eager
    attention); ``merged``: folded into the weights (``merge_and_unload``).
    ``adapter_dir=None``: the plain base."""
    base = load_base(base_dir)
    if adapter_dir is None:
        return base
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    if merged:
        model = model.merge_and_unload().eval()
    return model


@dataclass
class Reference:
    """Greedy reference of one prompt: ``tokens`` (exactly ``max_tokens``; EOS masked
    like the engine's ``min_tokens``), ``logprobs`` float64 ``[max_tokens, vocab]``
    log-softmax of each step's raw logits, ``top_logprobs`` the ``k`` best
    ``{token: logprob}`` per step (empty without ``logprobs=k``)."""

    tokens: list[int]
    logprobs: torch.Tensor
    top_logprobs: list[dict[int, float]]


@torch.inference_mode()
def generate_reference(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                       logprobs: int | None = None) -> list[Reference]:
    """Greedy generation of an already loaded transformers / PEFT model (one prompt at a
    time, no padding) with per-step logprobs."""
    from tests.helpers.hf_reference import hf_generate_with_logprobs

    refs = []
    for prompt in prompts:
        tokens, lp = hf_generate_with_logprobs(model, list(prompt), max_tokens)
        top: list[dict[int, float]] = []
        if logprobs:
            for row in lp:
                v, i = row.topk(logprobs)
                top.append({int(t): float(x) for t, x in zip(i, v)})
        refs.append(Reference(tokens, lp, top))
    return refs


def peft_reference(base_dir: str | Path, adapter_dir: str | Path | None,
                   prompt_token_ids: Sequence[int] | Sequence[Sequence[int]],
                   max_tokens: int, logprobs: int | None = None,
                   merged: bool = False) -> Reference | list[Reference]:
    """PEFT's greedy reference for ``adapter_dir`` on ``base_dir`` (``None``: the base).

    ``prompt_token_ids``: one prompt (list of ints; returns one :class:`Reference`) or a
    list of prompts (returns a list). ``logprobs=k`` also fills ``top_logprobs``.
    """
    single = len(prompt_token_ids) > 0 and isinstance(prompt_token_ids[0], int)
    prompts = [prompt_token_ids] if single else prompt_token_ids
    model = load_peft_model(base_dir, adapter_dir, merged=merged)
    refs = generate_reference(model, prompts, max_tokens, logprobs)  # type: ignore[arg-type]
    return refs[0] if single else refs


def dequantized_copy(fixture: str, out_dir: str | Path) -> Path:
    """A plain float32 model directory with the weights of quantized fixture ``fixture``
    (tests/data/quant-fixtures) dequantized by :mod:`tests.quantization.packers` (its
    tokenizer copied): the base an adapter for that checkpoint is made on, and PEFT's
    reference base. Meant for weight-only fixtures, whose reference is exact in float32."""
    import shutil

    from transformers import AutoConfig

    from tests.quantization import refs

    src = refs.fixture_dir(fixture)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = refs.hf_model_from_config(AutoConfig.from_pretrained(src), torch.float32)
    tensors = refs.read_tensors(src)
    state = {k: v.float() for k, v in tensors.items()
             if not any(f".{lin}." in k for lin in refs.LINEARS)}
    for i in range(model.config.num_hidden_layers):
        for lin in refs.LINEARS:
            prefix = f"model.layers.{i}.{lin}"
            state[prefix + ".weight"] = refs.decode_fixture_linear(fixture, tensors, prefix)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing,
                                                                            unexpected)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out
