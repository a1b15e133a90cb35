"""Shared helpers of the quantization tests: the real fixtures and their references,
transformers reference models built from independently dequantized weights, synthetic
quantized checkpoints, and loading / scoring engine models.

No reference here goes through ``engine.quantization``: they are transformers (float32 or
float64) over weights (and input fake-quant) from :mod:`tests.quantization.packers`; only
:func:`engine_model` loads the engine's side.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.quantization import packers

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "quant-fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir()
                       if p.is_dir() and (p / "reference.safetensors").is_file())
NUM_PROMPTS = 4
BLOCK_SIZE = 16
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# ----------------------------------------------------------------------------- comparing


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def greedy_agrees(got: list[int], want: list[int], teacher_logits: torch.Tensor,
                  prompt_len: int, tie_tol: float) -> tuple[bool, str]:
    """Whether greedy tokens ``got`` equal ``want`` except at a near-tie: at the first
    mismatch i, in the engine's own teacher-forced logits over prompt + got (row
    ``prompt_len - 1 + i`` predicts token i), both the engine's token and the reference's
    must be within ``tie_tol * max|logit|`` of that row's top logit (a top-2 margin within
    the tolerance, whichever of the two the teacher-forced pass puts first)."""
    assert len(got) == len(want), (got, want)
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if mismatch is None:
        return True, "identical"
    row = teacher_logits[prompt_len - 1 + mismatch].double()
    top = float(row.max())
    limit = tie_tol * float(row.abs().max())
    gaps = top - float(row[got[mismatch]]), top - float(row[want[mismatch]])
    ok = max(gaps) <= limit
    return ok, (f"first mismatch at {mismatch}: engine {got[mismatch]} vs reference "
                f"{want[mismatch]}; below the top logit by {gaps[0]:.3g} and {gaps[1]:.3g} "
                f"(limit {limit:.3g})")


# ----------------------------------------------------------------------------- fixtures


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(fixture_dir(name) / "reference.safetensors"))


def prompts(name: str) -> list[list[int]]:
    ref = reference(name)
    return [ref[f"prompt{i}.input_ids"].tolist() for i in range(NUM_PROMPTS)]


def quant_config(path: Path) -> dict[str, Any] | None:
    return json.loads((Path(path) / "config.json").read_text()).get("quantization_config")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def decode_fixture_linear(name: str, tensors: dict[str, torch.Tensor], prefix: str
                          ) -> torch.Tensor:
    """float32 ``[N, K]`` of linear ``prefix`` of fixture ``name``, by the packers."""
    qc = quant_config(fixture_dir(name))
    own = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    method = qc["quant_method"]
    if method == "gptq":
        return packers.decode_gptq(own, qc["bits"])
    if method == "awq":
        return packers.decode_awq(own)
    (group,) = qc["config_groups"].values()
    return packers.decode_ct(own, group.get("format") or qc["format"], group["weights"])


# ----------------------------------------------------------------------------- transformers


class QDQLinear(torch.nn.Module):
    """``y = qdq(x) @ W.T`` with the activation fake-quant of :mod:`packers`, run in
    ``compute`` dtype (float32 like the fixtures' references, or float64)."""

    def __init__(self, weight: torch.Tensor, qdq: Callable[[torch.Tensor], torch.Tensor] | None,
                 compute: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.to(compute), requires_grad=False)
        self.qdq = qdq
        self.compute = compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute)
        if self.qdq is not None:
            x = self.qdq(x)
        return F.linear(x, self.weight)


def hf_model_from_config(config: Any, dtype: torch.dtype = torch.float32):
    import transformers

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cls = getattr(transformers, config.architectures[0])
    return cls(config).to(dtype).eval()


def fixture_hf_model(name: str, qdq: Callable | None = None,
                     compute: torch.dtype = torch.float32,
                     qdq_for: Callable[[str], Callable | None] | None = None):
    """transformers Llama with fixture ``name``'s weights, every linear dequantized by
    :mod:`packers` (and its inputs fake-quantized by ``qdq`` / ``qdq_for(prefix)``), all
    in ``compute`` dtype."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(fixture_dir(name))
    model = hf_model_from_config(config, compute)
    tensors = read_tensors(fixture_dir(name))
    plain = {k: v for k, v in tensors.items()
             if not any(f".{lin}." in k for lin in LINEARS)}
    missing, unexpected = model.load_state_dict({k: v.to(compute) for k, v in plain.items()},
                                                strict=False)
    assert not unexpected, unexpected
    for i, layer in enumerate(model.model.layers):
        for lin in LINEARS:
            prefix = f"model.layers.{i}.{lin}"
            weight = decode_fixture_linear(name, tensors, prefix)
            parent, attr = lin.split(".")
            act = qdq_for(prefix) if qdq_for is not None else qdq
            setattr(getattr(layer, parent), attr, QDQLinear(weight, act, compute))
    return model


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


@torch.no_grad()
def hf_greedy(model, tokens: list[int], steps: int) -> list[int]:
    """Plain argmax decoding by full forwards (no KV cache)."""
    seq = list(tokens)
    for _ in range(steps):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(tokens):]


def fixture_activation_qdq(name: str, tensors: dict[str, torch.Tensor] | None = None
                           ) -> Callable[[str], Callable | None]:
    """``qdq_for(prefix)``: the input fake-quant compressed-tensors applies to linear
    ``prefix`` of fixture ``name`` (None for weight-only schemes), by :mod:`packers`."""
    from functools import partial

    qc = quant_config(fixture_dir(name))
    acts = None
    if qc is not None and qc["quant_method"] == "compressed-tensors":
        (group,) = qc["config_groups"].values()
        acts = group.get("input_activations")
    if acts is None:
        return lambda prefix: None
    tensors = read_tensors(fixture_dir(name)) if tensors is None else tensors
    if acts["type"] == "float" and acts["num_bits"] == 4:
        return lambda prefix: partial(packers.qdq_nvfp4_activation,
                                      global_scale=tensors[f"{prefix}.input_global_scale"].float())
    encoding = "int8" if acts["type"] == "int" else "fp8"
    if acts["dynamic"]:
        return lambda prefix: partial(packers.qdq_activation, encoding=encoding,
                                      strategy=acts["strategy"],
                                      group=acts.get("group_size") or 128)
    return lambda prefix: partial(packers.qdq_activation, encoding=encoding, strategy="tensor",
                                  static_scale=tensors[f"{prefix}.input_scale"].float())


def ulp_probe(model, tokens: list[int], seeds: int = 2) -> float:
    """How far a transformers reference's logits move when every quantized linear's input
    is nudged by one float32 ulp (a random half of its elements, before the input
    fake-quant): the spread two correct float32 implementations that differ only in
    rounding order can show. max over ``seeds`` of rel_diff."""
    want = hf_logits(model, tokens)
    worst = 0.0
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)

        def nudge(module, args):
            x = args[0]
            up = torch.rand(x.shape, generator=gen) < 0.5
            return (torch.where(up, torch.nextafter(x, torch.full_like(x, float("inf"))), x),)

        hooks = [m.register_forward_pre_hook(nudge) for m in model.modules()
                 if isinstance(m, QDQLinear)]
        try:
            worst = max(worst, rel_diff(hf_logits(model, tokens), want))
        finally:
            for hook in hooks:
                hook.remove()
    return worst


# ----------------------------------------------------------------------------- engine


def cpu_platform():
    from engine.plugins.cpu.platform import CPUPlatform

    return CPUPlatform()


def engine_model(path: Path | str, *, quantization: str | None = None,
                 kernels: list | None = None, dtype: str = "float32"):
    """The engine model of ``path`` built by ``load_model`` as the CPU executor builds it
    (the platform's dense and quantized kernels and fused ops), or with ``kernels`` as
    the quantized-GEMM kernels."""
    from engine.model_executor.model_loader import load_model
    from engine.plugins.cpu.attention import CPUAttentionBackend

    platform = cpu_platform()
    device = torch.device("cpu")
    return load_model(
        str(path), dtype, device, CPUAttentionBackend(block_size=BLOCK_SIZE, device=device),
        quantization=quantization,
        dense_gemm_kernels=platform.dense_gemm_kernels(),
        quantized_gemm_kernels=platform.quantized_gemm_kernels() if kernels is None else kernels,
        fused_ops=platform.fused_ops(),
    )


def engine_logits(model, tokens: list[int]) -> torch.Tensor:
    from tests.helpers.engine_logits import prefill_logits

    return prefill_logits(model, tokens, block_size=BLOCK_SIZE)


def llm_model(llm):
    """The model inside an in-process ``LLM``."""
    return llm.llm_engine.client.core.executor.model


def greedy_params(steps: int = 16):
    from engine import SamplingParams

    return SamplingParams(max_tokens=steps, min_tokens=steps, temperature=0.0, ignore_eos=True)


# ----------------------------------------------------------------------------- synthetic


def tiny_hf_model(arch: str, seed: int, init_range: float = 0.05, **config: Any):
    """A random transformers model of ``arch`` (float32)."""
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    defaults = dict(num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, initializer_range=init_range,
                    bos_token_id=0, eos_token_id=1, pad_token_id=1)
    defaults.update(config)
    cfg = cfg_cls(**defaults)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    return getattr(transformers, arch)(cfg).float().eval()


def linear_prefixes(model) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"]


def write_quantized_checkpoint(out_dir: Path, model, quantize: Callable, qconfig: dict | None,
                               float_dtype: torch.dtype = torch.float32,
                               ) -> tuple[Path, Any]:
    """Save ``model`` to ``out_dir`` with every linear but lm_head replaced by the tensors
    ``quantize(prefix, weight) -> (tensors, dequantized)`` gives and ``qconfig`` as its
    ``quantization_config``; return the directory and a copy of ``model`` whose linears
    hold the dequantized weights (the reference)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reference_model = copy.deepcopy(model)
    modules = dict(reference_model.named_modules())
    state: dict[str, torch.Tensor] = {}
    prefixes = linear_prefixes(model)
    for name, tensor in model.state_dict().items():
        if any(name.startswith(p + ".") for p in prefixes):
            continue
        state[name] = tensor.detach().to(float_dtype).contiguous()
    for prefix in prefixes:
        weight = modules[prefix].weight.detach()
        tensors, deq = quantize(prefix, weight)
        assert deq.shape == weight.shape
        for key, value in tensors.items():
            state[f"{prefix}.{key}"] = value.contiguous()
        with torch.no_grad():
            modules[prefix].weight.copy_(deq)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = model.config.architectures
    config["dtype"] = str(float_dtype).removeprefix("torch.")
    if qconfig is not None:
        config["quantization_config"] = qconfig
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir, reference_model


def ct_config(fmt: str, weights: dict, input_activations: dict | None = None,
              ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    """A compressed-tensors quantization_config of one group targeting Linear (keys as
    compressed-tensors 0.19 writes them)."""
    base_args = dict(actorder=None, block_structure=None, dynamic=False, group_size=None,
                     observer="memoryless_minmax", observer_kwargs={}, scale_dtype=None,
                     strategy="tensor", symmetric=True, type="int", zp_dtype=None)
    group = {"format": fmt, "targets": ["Linear"], "output_activations": None,
             "weights": {**base_args, **weights},
             "input_activations": None if input_activations is None else
             {**base_args, "observer": None, **input_activations}}
    return {"config_groups": {"group_0": group}, "format": fmt, "ignore": list(ignore),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": "0.19.0"}


def safetensor_names(path: Path) -> list[str]:
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return list(f.keys())


# Other shapes than the fixtures': a Qwen3 (q/k norms, head_dim 64, K = 384 = 3 x 128) and
# a Llama whose K (160, 288) is no multiple of 128 (but of 32).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-384": ("Qwen3ForCausalLM", dict(hidden_size=384, intermediate_size=1024,
                                            num_attention_heads=6, num_key_value_heads=2,
                                            head_dim=64, vocab_size=1536)),
    "llama-160": ("LlamaForCausalLM", dict(hidden_size=160, intermediate_size=288,
                                           num_attention_heads=5, num_key_value_heads=1,
                                           head_dim=32, vocab_size=512)),
}
NUM_QUANTIZED_LAYERS = 8  # 2 decoder layers x (qkv_proj, o_proj, gate_up_proj, down_proj)
_BASE_MODELS: dict[str, Any] = {}


def base_model(shape: str):
    """The float32 transformers model of ``shape`` (built once; callers must not modify)."""
    if shape not in _BASE_MODELS:
        arch, config = SHAPES[shape]
        _BASE_MODELS[shape] = tiny_hf_model(arch, seed=0, init_range=0.05, **config)
    return _BASE_MODELS[shape]


def synthetic_prompt(shape: str, length: int = 24) -> list[int]:
    vocab = SHAPES[shape][1]["vocab_size"]
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(2, vocab, (length,), generator=gen).tolist()


def input_groups(prefix: str) -> str:
    """Linears reading the same input (q/k/v; gate/up) share a key: GPTQ's act-order
    permutation comes from that input's Hessian, so they get the same one."""
    for shared, members in (("qkv", ("q_proj", "k_proj", "v_proj")),
                            ("gate_up", ("gate_proj", "up_proj"))):
        for member in members:
            if prefix.endswith("." + member):
                return prefix[: -len(member)] + shared
    return prefix


def perm_for(prefix: str, k: int) -> torch.Tensor:
    """A random permutation of the K input features, the same for linears sharing an input."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(input_groups(prefix)))
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed))


def count_quantized_layers(model) -> int:
    return sum(1 for m in model.modules() if getattr(m, "quant_kernel", None) is not None)


def check_synthetic(path: Path, shape: str, reference_model, tol: float = 1e-3,
                    **engine_kwargs: Any) -> float:
    """Engine logits of checkpoint ``path`` at every position of a prompt vs transformers
    running the dequantized weights in float32: max |diff| <= tol * max |logit|. Also that
    every decoder linear loaded quantized, and that the quantization is visible (the
    reference differs from the float model by far more than tol), so the comparison would
    catch a wrong decoding."""
    tokens = synthetic_prompt(shape)
    model = engine_model(path, **engine_kwargs)
    assert count_quantized_layers(model) == NUM_QUANTIZED_LAYERS
    got = engine_logits(model, tokens)
    want = hf_logits(reference_model, tokens)
    diff = rel_diff(got, want)
    assert diff <= tol, f"engine vs dequantized transformers: {diff:.3g} > {tol:g}"
    effect = rel_diff(want, hf_logits(base_model(shape), tokens))
    assert effect >= 10 * tol, f"quantization changes the logits by only {effect:.3g}"
    return diff


ENGINE_LINEARS = {  # engine layer -> the checkpoint linears fused into it, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@torch.no_grad()
def replay_linears(engine, reference, tokens: list[int]) -> float:
    """Feed every engine linear (fused ones included) the input its checkpoint linears
    got inside the transformers ``reference`` on ``tokens`` (real activations, rounding
    ties included) and compare with the reference's outputs: max rel_diff over layers."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for name, module in reference.named_modules():
        if isinstance(module, (QDQLinear, torch.nn.Linear)) and name != "lm_head":
            hooks.append(module.register_forward_hook(
                lambda m, args, out, key=name: seen.__setitem__(key, (args[0][0], out[0]))))
    try:
        hf_logits(reference, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    worst = 0.0
    for i, layer in enumerate(engine.model.layers):
        for engine_name, parts in ENGINE_LINEARS.items():
            prefixes = [f"model.layers.{i}.{p}" for p in parts]
            x = seen[prefixes[0]][0].float()
            want = torch.cat([seen[p][1] for p in prefixes], dim=-1)
            got = layer.get_submodule(engine_name)(x)
            worst = max(worst, rel_diff(got, want))
    return worst


def load_hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))
