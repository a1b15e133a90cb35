"""compressed-tensors checkpoints of other shapes than the fixtures', and fused-shard loading.

Synthetic checkpoints: the float32 transformers models of :data:`refs.SHAPES` (a Qwen3
with hidden 384 / intermediate 1024 / 6 heads / 2 KV heads / head_dim 64 / vocab 1536, and
a Llama whose K of 160 and 288 is no multiple of 128) with every decoder linear quantized
by :mod:`tests.quantization.packers` (an implementation of each on-disk format written
from compressed-tensors 0.19's definitions). Reference: the same transformers model with
the dequantized weights, run in float32; the engine's logits at every prompt position must
agree within 1e-3 x max|logit| (measured: ~2e-6).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.quantization.reference import TorchQuantizedGemm
from tests.quantization import packers, refs

INT_CASES = [
    # shape, bits, group (None: per channel), symmetric
    ("qwen3-384", 4, 128, True),
    ("qwen3-384", 4, 128, False),
    ("qwen3-384", 4, None, True),
    ("qwen3-384", 8, None, True),
    ("llama-160", 4, 32, True),
    ("llama-160", 4, 32, False),
    ("llama-160", 4, None, False),
    ("llama-160", 8, 32, False),
]


def _int_args(bits: int, group: int | None, symmetric: bool) -> dict:
    return dict(num_bits=bits, type="int", symmetric=symmetric,
                strategy="channel" if group is None else "group", group_size=group)


@pytest.mark.parametrize(("shape", "bits", "group", "symmetric"), INT_CASES,
                         ids=[f"{s}-int{b}-{'g%d' % g if g else 'channel'}-{'sym' if y else 'asym'}"
                              for s, b, g, y in INT_CASES])
def test_pack_quantized_matches_dequantized_transformers(synthetic, shape, bits, group,
                                                         symmetric):
    """pack-quantized int4 / int8 (W4A16, W8A16): codes + 2^(bits-1) packed densely along K
    into int32, bf16 group / channel scales, asymmetric zero points packed along N."""
    label = f"int{bits}-{group}-{symmetric}"
    path, reference = synthetic(
        shape, label, lambda prefix, w: packers.quantize_ct_int(w, bits, group, symmetric),
        refs.ct_config("pack-quantized", _int_args(bits, group, symmetric)))
    names = refs.safetensor_names(path)
    assert ("model.layers.0.self_attn.k_proj.weight_zero_point" in names) == (not symmetric)
    refs.check_synthetic(path, shape, reference)


FP8_CASES = [("qwen3-384", "tensor"), ("qwen3-384", "channel"), ("qwen3-384", "block"),
             ("llama-160", "tensor"), ("llama-160", "channel")]


@pytest.mark.parametrize(("shape", "strategy"), FP8_CASES, ids=[f"{s}-{t}" for s, t in FP8_CASES])
def test_float_quantized_fp8_matches_dequantized_transformers(synthetic, shape, strategy):
    """float-quantized e4m3 weights (weight-only, FP8 W8A16) with per-tensor ``[1]``,
    per-channel ``[N, 1]`` and 128 x 128 block ``[N / 128, K / 128]`` bf16 scales. The
    Qwen3 block case has K = 384 (3 column blocks) and k/v projections of N = 128 (one
    row block each) inside the fused qkv layer; its down_proj has K = 1024 (8 blocks)."""
    weights = dict(num_bits=8, type="float", symmetric=True, strategy=strategy)
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    path, reference = synthetic(shape, f"fp8-{strategy}",
                                lambda prefix, w: packers.quantize_ct_fp8(w, strategy),
                                refs.ct_config("float-quantized", weights))
    if strategy == "block":
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            k_scale = f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale")
            down_scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
            assert (tuple(k_scale.shape), tuple(down_scale.shape)) == ((1, 3), (3, 8))
    refs.check_synthetic(path, shape, reference)


@pytest.mark.parametrize("shape", sorted(refs.SHAPES))
def test_nvfp4_weights_match_dequantized_transformers(synthetic, shape):
    """nvfp4-pack-quantized weights (NVFP4A16): two e2m1 codes a byte, fp8 scales per 16
    values, one float32 global scale per linear (so the fused q/k/v and gate/up shards
    each have their own), decompressed to bf16."""
    weights = dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                   group_size=16)
    path, reference = synthetic(shape, "nvfp4a16", lambda prefix, w: packers.quantize_ct_nvfp4(w),
                                refs.ct_config("nvfp4-pack-quantized", weights))
    refs.check_synthetic(path, shape, reference)


def test_config_groups_targets_and_ignore(synthetic, tmp_path):
    """Two config groups of different formats, selected by ``re:`` targets, and an
    ``ignore`` list leaving down_proj dense: each linear decodes with its own group's
    scheme and the ignored ones load as plain weights."""
    shape = "llama-160"
    int4 = _int_args(4, 32, False)
    fp8 = dict(num_bits=8, type="float", symmetric=True, strategy="channel")

    def quantize(prefix: str, w: torch.Tensor):
        if prefix.endswith("down_proj"):
            return {"weight": w.clone()}, w.clone()
        if ".self_attn." in prefix:
            return packers.quantize_ct_int(w, 4, 32, False)
        return packers.quantize_ct_fp8(w, "channel")

    qconfig = refs.ct_config("pack-quantized", int4, ignore=("lm_head", "re:.*down_proj$"))
    groups = qconfig["config_groups"]
    groups["group_0"]["targets"] = ["re:.*self_attn\\.(q|k|v|o)_proj$"]
    groups["group_1"] = json.loads(json.dumps(groups["group_0"]))
    groups["group_1"].update(format="float-quantized", targets=["re:.*mlp\\..*_proj$"],
                             weights={**groups["group_0"]["weights"], **fp8, "group_size": None})
    qconfig["format"] = "mixed-precision"
    path, reference = synthetic(shape, "mixed-groups", quantize, qconfig)
    model = refs.engine_model(path)
    assert refs.count_quantized_layers(model) == 6  # qkv, o, gate_up per layer; not down
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    tokens = refs.synthetic_prompt(shape)
    diff = refs.rel_diff(refs.engine_logits(model, tokens), refs.hf_logits(reference, tokens))
    assert diff <= 1e-3


# ----------------------------------------------------------------------------- fused shards


def _fp8_static_qkv_expected(tensors: dict, x: torch.Tensor, prefix: str,
                             input_scale_of: str | None = None) -> torch.Tensor:
    """q/k/v of ``x`` computed separately, each shard's own weight_scale and its own
    static input-scale QDQ (or shard ``input_scale_of``'s for all), float64 GEMMs."""
    outs = []
    for shard in "qkv":
        name = f"{prefix}.{shard}_proj"
        weight = tensors[f"{name}.weight"].double() * tensors[f"{name}.weight_scale"].double()
        scale = tensors[f"{prefix}.{input_scale_of or shard}_proj.input_scale"].float()
        xq = packers.qdq_activation(x, "fp8", "tensor", static_scale=scale)
        outs.append(xq.double() @ weight.t())
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("kernels", ["platform", "torch_reference"])
def test_fused_qkv_fp8_static_uses_each_shards_scales(tmp_path, kernels):
    """ct-fp8-static has a per-tensor weight_scale and input_scale for each of q, k and v.
    In the file the weight scales differ; the input scales are equal (q/k/v were calibrated
    on the same input), so a copy gives k and v their own input scales (x2, x0.5: exact in
    bf16). The fused qkv layer's output must equal the three projections dequantized and
    input-QDQ'd separately, each with its own scales (computed here, float64 GEMMs)."""
    src = refs.fixture_dir("ct-fp8-static")
    tensors = refs.read_tensors(src)
    prefix = "model.layers.0.self_attn"
    weight_scales = [float(tensors[f"{prefix}.{s}_proj.weight_scale"]) for s in "qkv"]
    assert len(set(weight_scales)) == 3, weight_scales
    input_scales = [float(tensors[f"{prefix}.{s}_proj.input_scale"]) for s in "qkv"]
    assert len(set(input_scales)) == 1, input_scales  # shared input: one calibrated scale

    copy = tmp_path / "ct-fp8-static-distinct-input-scales"
    copy.mkdir()
    shutil.copy(src / "config.json", copy / "config.json")
    changed = dict(tensors)
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn"
        changed[f"{p}.k_proj.input_scale"] = tensors[f"{p}.k_proj.input_scale"] * 2
        changed[f"{p}.v_proj.input_scale"] = tensors[f"{p}.v_proj.input_scale"] * 0.5
    save_file(changed, str(copy / "model.safetensors"), metadata={"format": "pt"})

    chosen = None if kernels == "platform" else [TorchQuantizedGemm]
    gen = torch.Generator().manual_seed(0)
    # inputs spanning the fp8 range of these scales (|x| / input_scale up to ~400)
    x = torch.randn(6, 256, generator=gen) * 1.2
    for path, values in ((src, tensors), (copy, changed)):
        model = refs.engine_model(path, kernels=chosen)
        layer = model.model.layers[0].self_attn.qkv_proj
        got = layer(x).double()
        want = _fp8_static_qkv_expected(values, x, prefix)
        assert refs.rel_diff(got, want) <= 1e-5, path.name
    # the copy discriminates: one input scale for every shard would be far off
    only_q = _fp8_static_qkv_expected(changed, x, prefix, input_scale_of="q")
    assert refs.rel_diff(only_q, want) > 1e-2


def test_fused_shard_scales_land_in_their_rows(tmp_path):
    """Per-channel scales and packed zero points of fused shards: a synthetic Qwen3
    checkpoint whose k_proj scales are all 4x q's and v's 0.25x (and asymmetric int4):
    the fused layer's three output slices each follow their own shard exactly."""
    shape = "qwen3-384"
    base = refs.base_model(shape)
    layer = base.model.layers[0].self_attn
    prefix = "model.layers.0.self_attn"
    tensors, deq = {}, {}
    for shard, factor in (("q", 1.0), ("k", 4.0), ("v", 0.25)):
        w = getattr(layer, f"{shard}_proj").weight.detach() * factor
        tensors[shard], deq[shard] = packers.quantize_ct_int(w, 4, 128, False)

    def quantize(name: str, w: torch.Tensor):
        for shard in "qkv":
            if name == f"{prefix}.{shard}_proj":
                return tensors[shard], deq[shard]
        return packers.quantize_ct_int(w, 4, 128, False)

    path, _ = refs.write_quantized_checkpoint(
        tmp_path / "ckpt", base, quantize,
        refs.ct_config("pack-quantized", _int_args(4, 128, False)))
    model = refs.engine_model(path)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(3))
    got = model.model.layers[0].self_attn.qkv_proj(x).double()
    want = torch.cat([x.double() @ deq[s].double().t() for s in "qkv"], dim=-1)
    assert refs.rel_diff(got, want) <= 1e-5
