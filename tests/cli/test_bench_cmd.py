"""``engine bench``: every mode runs end to end on a tiny model and writes its JSON fields.

Timings are not asserted (a unit test is no place to measure speed); what is checked is
the workload (the reference prompt draw, reproduced by hand), the counts the benchmark
derives from the engine's outputs, and the shape of the report.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from click.testing import CliRunner

from engine.benchmarks.offline import prefix_prompts, run_latency, run_throughput
from engine.benchmarks.report import spec_decoding_json, spec_decoding_rows, speculative_text
from engine.benchmarks.workload import Workload
from engine.cli import main
from engine.core.scheduler.stats import SpecDecodingStats

SMALL = ["--kv-cache-space", "0.05", "--device", "cpu"]


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    result = CliRunner().invoke(main, ["bench", *args, *SMALL, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def _is_median_of(field: dict, n: int) -> bool:
    runs = field["runs"]
    return len(runs) == n and min(runs) <= field["median"] <= max(runs)


def test_workload_draws_the_reference_prompts():
    rng = random.Random(0)
    expected = [[rng.randrange(10, 16000) for _ in range(3)] for _ in range(2)]
    workload = Workload(num_prompts=2, input_len=3, output_len=5)
    assert workload.prompt_token_ids() == expected  # row-major, one generator
    assert workload.prompts()[1] == {"prompt_token_ids": expected[1]}
    params = workload.sampling_params()
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (0.0, 5, True)


@pytest.mark.parametrize("field", ["num_prompts", "input_len", "output_len"])
def test_workload_rejects_empty_sizes(field):
    with pytest.raises(ValueError, match=field):
        Workload(**{field: 0})


def test_prefix_prompts_share_exactly_the_prefix():
    first, second = prefix_prompts(random.Random(1), input_len=40, prefix_len=32, vocab_high=50)
    assert len(first) == len(second) == 40
    assert first[:32] == second[:32] and first[32] != second[32]
    with pytest.raises(ValueError, match="prefix_len"):
        prefix_prompts(random.Random(1), input_len=40, prefix_len=40, vocab_high=50)


def test_throughput(tmp_path, llama_dir):
    report = _bench(
        tmp_path, "throughput", "--model", str(llama_dir), "--num-prompts", "3",
        "--input-len", "8", "--output-len", "4", "--warmup", "1", "--repeats", "2",
    )
    assert report["mode"] == "throughput"
    assert report["settings"] == {"num_prompts": 3, "input_len": 8, "output_len": 4,
                                  "ignore_eos": True, "warmup": 1, "repeats": 2}
    results = report["results"]
    assert results["output_tokens"] == 3 * 4 and results["prompt_tokens"] == 3 * 8
    assert _is_median_of(results["output_tok_s"], 2) and _is_median_of(results["elapsed_s"], 2)
    assert results["output_tok_s"]["median"] > 0
    # What it ran on: the platform's ISA level and the kernel of every linear.
    from engine.plugins.cpu import kernel_build

    runtime = report["runtime"]
    assert runtime["platform"] == "cpu" and runtime["isa_level"] == kernel_build.select_level().name
    assert runtime["activation_dtype"] == report["activation_dtype"] == "float32"
    assert sum(runtime["gemm_kernels"].values()) == 2 * 4 + 1  # 2 layers x 4 linears + head
    assert report["environment"]["torch_threads"] >= 1
    assert report["environment"]["memory_read_gb_s"] > 0  # the bandwidth batch-1 decode had
    assert report["speculative_config"] is None and "spec_decoding" not in results


def test_latency(tmp_path, llama_dir):
    report = _bench(
        tmp_path, "latency", "--model", str(llama_dir), "--input-len", "8",
        "--output-len", "5", "--warmup", "0", "--repeats", "2",
    )
    results = report["results"]
    for name in ("ttft_ms", "decode_ms_per_token", "e2e_s"):
        assert _is_median_of(results[name], 2), name
        assert results[name]["median"] > 0


def test_latency_is_one_request(tmp_path, llama_dir):
    result = CliRunner().invoke(
        main, ["bench", "latency", "--model", str(llama_dir), "--num-prompts", "2", *SMALL]
    )
    assert result.exit_code != 0 and "one request" in result.output


def test_prefix(tmp_path, llama_dir):
    report = _bench(
        tmp_path, "prefix", "--model", str(llama_dir), "--input-len", "40",
        "--prefix-len", "32", "--warmup", "0", "--repeats", "1",
    )
    results = report["results"]
    assert results["num_cached_tokens"] == 32  # two full blocks of 16 reused
    assert (results["input_len"], results["prefix_len"]) == (40, 32)
    assert _is_median_of(results["ttft_cached_ms"], 1)
    assert _is_median_of(results["ttft_uncached_ms"], 1)
    expected = results["ttft_uncached_ms"]["median"] / results["ttft_cached_ms"]["median"]
    assert results["speedup"] == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("eager", [False, True])
def test_profile(tmp_path, llama_dir, eager):
    """Decode steps replay their forward graph (one stage); --enforce-eager splits the
    forward into attention, linear and the rest."""
    from engine.benchmarks.step_profile import STAGES

    report = _bench(
        tmp_path, "profile", "--model", str(llama_dir), "--num-prompts", "4",
        "--input-len", "8", "--steps", "2", "--warmup", "0",
        *(["--enforce-eager"] if eager else []),
    )
    results = report["results"]
    assert results["num_running"] == 4
    stages = results["stage_ms"]
    assert set(stages) == {*STAGES, "unaccounted"}
    assert all(ms >= 0 for ms in stages.values())
    if eager:
        assert stages["linear"] > 0 and stages["attention"] > 0 and stages["graph"] == 0
    else:
        assert stages["graph"] > 0 and stages["linear"] == stages["attention"] == 0
    # The stages partition the reported step (up to the rounding of each figure).
    assert sum(stages.values()) == pytest.approx(results["step_ms"], abs=0.01)
    assert 0 < results["overhead_share"] < 1
    _check_floor(results, llama_dir, report["runtime"]["weight_dtype"])
    assert results["floor"]["read_gb_s"] == report["environment"]["memory_read_gb_s"]


def _check_floor(results: dict, model_dir, weight_dtype: str) -> None:
    """The memory floor from the checkpoint itself: every tensor but the (untied)
    embedding, in the dtype the engine keeps weights in (and the attention layers' FP8
    KV scales, one float32 each for K and V), plus K and V of every layer for
    each running request's context, over the bandwidth the report measured."""
    import torch
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    itemsize = torch.empty((), dtype=getattr(torch, weight_dtype)).element_size()
    weights = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name == "model.embed_tokens.weight" and not config.get("tie_word_embeddings"):
                    continue
                weights += _numel(f.get_slice(name).get_shape()) * itemsize
    weights += 2 * 4 * config["num_hidden_layers"]  # each attention's float32 k / v scale
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_itemsize = itemsize  # the KV cache keeps the weights' dtype (kv-cache-dtype auto)
    kv = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * kv_itemsize
          * results["context_len"] * results["num_running"])
    floor = results["floor"]
    assert floor["weight_bytes"] == weights
    assert floor["kv_bytes"] == kv
    assert floor["floor_ms"] == pytest.approx((weights + kv) / floor["read_gb_s"] / 1e6, rel=1e-3)
    assert results["floor_ratio"] == pytest.approx(results["step_ms"] / floor["floor_ms"], rel=1e-2)


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def test_a_quantized_checkpoint_reports_its_scheme_size_and_layer_kernels(tmp_path):
    """The bench report says what ran: the checkpoint's scheme, its quantized weight
    bytes (the int4 layers' packed codes, not a bf16 size) and each layer type's kernel."""
    from tests.quantization.refs import FIXTURES

    run = ["--input-len", "4", "--output-len", "2", "--warmup", "0", "--repeats", "1"]
    (tmp_path / "base").mkdir()
    (tmp_path / "q").mkdir()
    base = _bench(tmp_path / "base", "latency", "--model", str(FIXTURES / "base"), *run)
    report = _bench(tmp_path / "q", "latency", "--model", str(FIXTURES / "ct-w4a16-g64"), *run)
    runtime, base_runtime = report["runtime"], base["runtime"]
    assert runtime["quantization"] == "compressed-tensors W4A16 (int4 g64) pack-quantized"
    assert not base_runtime["quantization"]
    # 4 of 9 linears' weights (all but the unquantized head and the embedding) shrink ~3.5x
    assert runtime["weights_mib"] < 0.6 * base_runtime["weights_mib"]
    layers = runtime["layer_kernels"]
    assert set(layers) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert layers[kind].startswith("cpu_qgemm") and layers[kind].endswith("pack-quantized]")
    assert layers["lm_head"].startswith("cpu_packed")


# -- speculative decoding figures ----------------------------------------------------------
SPEC = SpecDecodingStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=18,
                         num_accepted_tokens_per_pos=[9, 6, 3])


def test_spec_decoding_json_has_the_acceptance_figures():
    assert spec_decoding_json(SPEC) == {
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 18,
        "acceptance_rate": 0.6,
        "mean_acceptance_length": 2.8,  # 1 target token + 18 / 10 accepted per verification
        "num_accepted_tokens_per_pos": [9, 6, 3],
        "acceptance_rate_per_pos": [0.9, 0.6, 0.3],  # accepted at i / drafts
    }


def test_spec_decoding_rows_format_the_figures():
    rows = dict(spec_decoding_rows(spec_decoding_json(SPEC)))
    assert rows == {
        "draft / accepted tokens": "30 / 18 (10 drafts)",
        "acceptance rate": "60.0%",
        "mean acceptance length": "2.80 tokens per verification",
        "acceptance by position": "0: 90.0%, 1: 60.0%, 2: 30.0%",
    }
    assert spec_decoding_rows(None) == []  # off: no rows
    (row,) = spec_decoding_rows(spec_decoding_json(SpecDecodingStats()))
    assert "no drafts" in row[1]


def test_speculative_text_names_the_method():
    assert speculative_text(None) == "off"
    ngram = {"method": "ngram", "model": None, "num_speculative_tokens": 3,
             "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert speculative_text(ngram) == "ngram, 3 tokens per draft, n-gram 2-5"
    draft = {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}
    assert speculative_text(draft) == "draft_model, 4 tokens per draft, draft /m/draft"


class _SpecLLM:
    """An LLM stand-in whose engine drafted ``per_round`` in every generate call."""

    def __init__(self, per_round: SpecDecodingStats) -> None:
        self.per_round = per_round
        self.pending = SpecDecodingStats()

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        p = self.pending
        r = self.per_round
        self.pending = SpecDecodingStats(
            p.num_drafts + r.num_drafts, p.num_draft_tokens + r.num_draft_tokens,
            p.num_accepted_tokens + r.num_accepted_tokens,
            [a + b for a, b in zip(p.num_accepted_tokens_per_pos or [0] * 3,
                                   r.num_accepted_tokens_per_pos)])
        done = SimpleNamespace(token_ids=[1] * params.max_tokens)
        return [SimpleNamespace(outputs=[done]) for _ in prompts]

    def get_spec_decoding_stats(self) -> SpecDecodingStats:
        taken, self.pending = self.pending, SpecDecodingStats()
        return taken

    def reset_prefix_cache(self) -> bool:
        return True


def test_throughput_counts_the_measured_rounds_drafts_only():
    llm = _SpecLLM(SpecDecodingStats(5, 15, 9, [5, 3, 1]))
    workload = Workload(num_prompts=2, input_len=4, output_len=3)
    result = run_throughput(llm, workload, warmup=2, repeats=2)
    assert result.spec == SpecDecodingStats(10, 30, 18, [10, 6, 2])  # the 2 measured rounds
    assert result.to_json()["spec_decoding"]["acceptance_rate"] == 0.6


def test_every_round_computes_its_whole_prompts(llama_dir):
    """The rounds reuse the workload's prompts: without a reset the measured ones would
    find every full block in the prefix cache the warmup filled, timing a fraction of
    the prefill that a peer benchmark on fresh prompts does."""
    from engine import LLM

    workload = Workload(num_prompts=3, input_len=40, output_len=2, vocab_high=200)
    cached: list[int] = []
    with LLM(str(llama_dir), device="cpu", dtype="float32", block_size=8,
             max_model_len=64, kv_cache_memory_bytes=8 << 20) as llm:
        generate = llm.generate

        def recording_generate(*args, **kwargs):
            outputs = generate(*args, **kwargs)
            cached.extend(out.num_cached_tokens for out in outputs)
            return outputs

        llm.generate = recording_generate
        run_throughput(llm, workload, warmup=1, repeats=2)
        run_latency(llm, workload, warmup=1, repeats=1)
        assert llm.generate(workload.prompts()[:1], workload.sampling_params(),
                            use_tqdm=False)[0].num_cached_tokens == 32  # caching is on (not the last block)
    assert cached[:-1] == [0] * (3 * 3 + 2)


def test_bench_reports_spec_figures_from_the_engine(tmp_path, llama_dir, monkeypatch):
    """The CLI path: what ``LLM.get_spec_decoding_stats`` hands over after the measured
    rounds lands in the table and the JSON (stubbed: the engine itself drafts nothing)."""
    from engine.entrypoints.llm import LLM

    calls: list[int] = []

    def fake_stats(self) -> SpecDecodingStats:
        calls.append(1)
        return SPEC if len(calls) == 2 else SpecDecodingStats(1, 3, 0, [0, 0, 0])

    monkeypatch.setattr(LLM, "get_spec_decoding_stats", fake_stats)
    out = tmp_path / "result.json"
    run = CliRunner().invoke(main, [
        "bench", "latency", "--model", str(llama_dir), "--input-len", "4", "--output-len", "3",
        "--warmup", "1", "--repeats", "1", *SMALL, "--json", str(out)])
    assert run.exit_code == 0, run.output
    assert len(calls) == 2  # once before the measured round (drops the warmup's), once after
    assert json.loads(out.read_text())["results"]["spec_decoding"] == spec_decoding_json(SPEC)
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in run.output.splitlines()
                 if re.search(r"\S\s{2,}\S", line))
    assert table["acceptance by position"] == "0: 90.0%, 1: 60.0%, 2: 30.0%"
    assert table["acceptance rate"] == "60.0%"
    assert table["speculative decoding"] == "off"  # the engine's own config


@pytest.mark.parametrize("offloading", [False, True])
def test_prefix_revisited_after_a_working_set(tmp_path, llama_dir, offloading):
    """--working-set runs other prompts between the two: a KV cache smaller than them has
    evicted the prefix by the revisit, unless the KV offloading tier brings it back."""
    report = _bench(
        tmp_path, "prefix", "--model", str(llama_dir), "--input-len", "40",
        "--prefix-len", "32", "--warmup", "0", "--repeats", "1", "--working-set", "4",
        "--max-model-len", "64", "--kv-cache-memory", "64KiB",
        *(["--kv-offloading-size", "0.01"] if offloading else []),
    )
    assert report["settings"]["working_set"] == 4
    assert report["results"]["num_cached_tokens"] == (32 if offloading else 0)
