"""Speculative decoding end to end: it may change the speed, never the output.

Every method (n-gram prompt lookup, a draft model, an EAGLE head) runs the real engine
and is compared with the same engine without speculation -- not with transformers --
token for token for greedy requests (a difference is accepted only at a verified
near-tie of the non-speculative engine's own distribution; none is expected).

So that drafts really are accepted (and rejected), most tests use *cycle* models:
random-weight Llama / Qwen3 models rewired (``make_greedy_cycle``) so that greedy
decoding mostly walks a fixed cycle of byte tokens, then perturbed with small random
attention and MLP outputs and noisy embeddings, so that the attention, the KV cache and
every layer matter and about one step in five leaves the cycle. Prompts that repeat the
cycle make n-gram lookup match; a draft model that walks the exact cycle and an EAGLE
head built to predict "the cycle token after next" agree with the target most of the
time but not always. ``get_spec_decoding_stats()`` proves both happened. Plain random
models (``model_dir_factory``) with a smaller random draft and a random EAGLE head cover
the verification of drafts that are almost always wrong.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.assets import DEMO_EAGLE_MODEL_DIR
from tests.helpers.hf_models import build_model_dir, byte_token_ids
from tests.helpers.hf_reference import cpu_llm

# Distinct single-byte tokens the test tokenizer never merges (no two are adjacent in
# its training text), so text made of them tokenizes back to these byte tokens.
CYCLE = "QZXJWYGBMDFHLNRSUEIA"
PERTURB = 0.03  # scale of the random attention / MLP outputs added to a cycle model
EMBED_NOISE = 0.02  # noise on its one-hot embeddings and on its LM head
HEAD_SCALE = 0.125  # LM head scale: greedy unchanged, margins of ~4 nats (penalties bite)
K = 4  # speculative tokens of the cycle models' engines
MAX_MODEL_LEN = 192
METHODS = ["ngram", "draft_model", "eagle"]
EAGLE_DEMO = (DEMO_EAGLE_MODEL_DIR / "model.safetensors").is_file()


# -- model directories -------------------------------------------------------------------
def _tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = dict(load_file(str(file)))
    edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(file), metadata={"format": "pt"})


def build_cycle_model(out: Path, variant: str, *, eos: bool, perturb: bool, seed: int = 0,
                      **overrides: Any) -> Path:
    """A model whose greedy output walks CYCLE (and EOS after its last token when
    ``eos``; EOS is followed by the cycle's first token again)."""
    build_model_dir(out, variant, greedy_cycle=CYCLE, seed=seed, **overrides)
    tok = _tokenizer(out)
    last = len(CYCLE) - 1  # the one-hot slot of the cycle's last token

    def edit(w: dict[str, torch.Tensor]) -> None:
        head = w["lm_head.weight"]
        if eos:
            head[:, last] = 0.0
            head[tok.eos_token_id, last] = 4.0
        if perturb:
            gen = torch.Generator().manual_seed(1000 + seed)
            for name, tensor in w.items():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    w[name] = torch.randn(tensor.shape, generator=gen) * 0.25 * PERTURB
                elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    w[name] = tensor + torch.randn(tensor.shape, generator=gen) * EMBED_NOISE
        w["lm_head.weight"] = w["lm_head.weight"] * HEAD_SCALE

    _rewrite_weights(out, edit)
    return out


def build_eagle_head(out: Path, target: Path, *, crafted: bool, seed: int = 2) -> Path:
    """An EAGLE-1 head for ``target`` (safetensors ``fc.weight`` [H, 2H] + ``layers.0.*``
    without the input norm; embedding and LM head shared from the target).

    ``crafted``: ``fc`` copies the (one-hot) embedding of ``t_{i+1}`` and the layer adds
    only small random outputs, so through the target's LM head of a cycle model it
    predicts the cycle token after ``t_{i+1}``: the target's next token most of the time.
    Otherwise every weight is random."""
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target / "config.json").read_text())
    hidden = tcfg["hidden_size"]
    config = transformers.LlamaConfig(
        vocab_size=tcfg["vocab_size"], hidden_size=hidden, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.25,
        bos_token_id=tcfg["bos_token_id"], eos_token_id=tcfg["eos_token_id"],
        pad_token_id=tcfg.get("pad_token_id"), tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    layer = transformers.LlamaForCausalLM(config).model.layers[0]
    tensors = {
        f"layers.0.{k}": v.detach().clone().contiguous()
        for k, v in layer.state_dict().items()
        if not k.startswith("input_layernorm")
    }
    gen = torch.Generator().manual_seed(seed)
    if crafted:
        fc = torch.randn(hidden, 2 * hidden, generator=gen) * EMBED_NOISE
        fc[:, :hidden] += 8.0 * torch.eye(hidden)  # the embedding half, as a normed one-hot
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            tensors[name] = tensors[name] * PERTURB
    else:
        fc = torch.randn(hidden, 2 * hidden, generator=gen) * 0.25
    tensors["fc.weight"] = fc.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["EagleLlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    return out


class Zoo:
    """Model directories and engines, each built once for the module."""

    def __init__(self, tmp: Path, model_dir_factory) -> None:
        self.tmp = tmp
        self.factory = model_dir_factory
        self._dirs: dict[str, Path] = {}
        self._llms: dict[tuple, LLM] = {}

    # names: "demo"; "<arch>-random"; "<arch>-cycle"; "llama-eos" (a cycle with EOS)
    def target(self, name: str) -> Path | None:
        if name == "demo":
            return None
        if name not in self._dirs:
            arch, kind = name.split("-")
            variant = "llama-gqa" if arch == "llama" else arch
            if kind == "random":
                self._dirs[name] = self.factory(variant)
            else:
                self._dirs[name] = build_cycle_model(
                    self.tmp / name, variant, eos=kind == "eos", perturb=True
                )
        return self._dirs[name]

    def draft(self, name: str) -> Path:
        key = name + "/draft"
        if key not in self._dirs:
            if name.endswith("-random"):  # a smaller random Llama, same tokenizer
                self._dirs[key] = self.factory(
                    "llama-gqa", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    seed=1,
                )
            else:  # a one-layer model walking the exact cycle
                self._dirs[key] = build_cycle_model(
                    self.tmp / key.replace("/", "-"), "llama-gqa", eos=name.endswith("-eos"),
                    perturb=False, num_hidden_layers=1, intermediate_size=32,
                )
        return self._dirs[key]

    def eagle(self, name: str) -> Path:
        key = name + "/eagle"
        if key not in self._dirs:
            self._dirs[key] = build_eagle_head(
                self.tmp / key.replace("/", "-"), self.target(name),
                crafted=not name.endswith("-random"),
            )
        return self._dirs[key]

    def spec_config(self, name: str, method: str, k: int) -> dict[str, Any]:
        config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            config.update(prompt_lookup_min=2, prompt_lookup_max=4)
        elif name != "demo":  # the demo model's drafts are the shipped defaults
            config["model"] = str(self.draft(name) if method == "draft_model" else self.eagle(name))
        return config

    def llm(self, name: str, method: str | None = None, k: int = K,
            spec_extra: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
        key = (name, method, k, tuple(sorted((spec_extra or {}).items())),
               tuple(sorted(kwargs.items())))
        if key not in self._llms:
            spec = None if method is None else {**self.spec_config(name, method, k),
                                                **(spec_extra or {})}
            kwargs.setdefault("max_num_seqs", 16)
            kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
            if name == "demo":
                self._llms[key] = LLM(device="cpu", dtype="float32", speculative_config=spec,
                                      **kwargs)
            else:
                self._llms[key] = cpu_llm(self.target(name), speculative_config=spec, **kwargs)
        return self._llms[key]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, model_dir_factory):
    zoo = Zoo(tmp_path_factory.mktemp("spec_e2e"), model_dir_factory)
    yield zoo
    zoo._llms.clear()


@pytest.fixture(scope="module")
def cyc(zoo) -> list[int]:
    """CYCLE's byte token ids in the test tokenizer."""
    path = zoo.target("llama-cycle")
    tok = _tokenizer(path)
    ids = byte_token_ids(tok, CYCLE.encode())
    assert tok.encode(CYCLE, add_special_tokens=False) == ids  # no merges among them
    return ids


def cycle_prompt(cyc: list[int], start: int, reps: int = 2, *, eos: int | None = None) -> list[int]:
    """The cycle ``reps`` times (each time followed by ``eos`` if given), rotated so that
    its continuation starts at ``cyc[start]``."""
    unit = cyc + ([eos] if eos is not None else [])
    return unit[start:] + unit * reps + unit[:start]


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` distinct tokens: no n-gram repeats, so prompt lookup finds nothing."""
    return random.Random(seed).sample(range(5, vocab), n)


# -- checks ------------------------------------------------------------------------------
def run(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]):
    as_inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return llm.generate(as_inputs, params, use_tqdm=False)


def spec_stats(llm: LLM):
    stats = llm.get_spec_decoding_stats()
    assert stats is not None
    return stats


def assert_greedy_equivalent(base: LLM, prompt: list[int], got: list[int], want: list[int],
                             tie: float = 1e-3) -> None:
    """``got == want`` up to a verified near-tie of the non-speculative engine: where
    they first differ, both tokens are its top-2 and their logprobs within ``tie``."""
    for j, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        out = run(base, [prompt + want[:j]],
                  SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, ignore_eos=True))
        top = out[0].outputs[0].logprobs[0]
        ranked = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:2]
        gap = ranked[0][1].logprob - ranked[1][1].logprob
        assert gap < tie and g in dict(ranked), (
            f"diverged at output {j}: speculative {g}, plain {w}, top-2 gap {gap:.2e}\n"
            f"got  {got}\nwant {want}"
        )
        return
    assert len(got) == len(want), f"lengths differ\ngot  {got}\nwant {want}"


def assert_outputs_equal(base: LLM, got, want) -> None:
    """Greedy outputs (a list of RequestOutput each) agree request by request: tokens
    (up to a verified near-tie), and where tokens agree also text and finish reasons."""
    assert len(got) == len(want)
    for g_out, w_out in zip(got, want):
        assert g_out.prompt_token_ids == w_out.prompt_token_ids
        g, w = g_out.outputs[0], w_out.outputs[0]
        assert_greedy_equivalent(base, list(w_out.prompt_token_ids), list(g.token_ids),
                                 list(w.token_ids))
        if list(g.token_ids) == list(w.token_ids):
            assert (g.finish_reason, g.stop_reason, g.text) == (
                w.finish_reason, w.stop_reason, w.text)


def assert_drafts_used(stats, *, accepted: bool = True, rejected: bool = False) -> None:
    assert stats.num_draft_tokens > 0, f"no drafts were proposed: {stats}"
    if accepted:
        assert stats.num_accepted_tokens > 0, f"no draft was accepted: {stats}"
    if rejected:
        assert stats.num_accepted_tokens < stats.num_draft_tokens, f"nothing rejected: {stats}"


def core(llm: LLM):
    return llm.llm_engine.client.core


def assert_nothing_leaked(llm: LLM) -> None:
    scheduler = core(llm).scheduler
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert kv.num_free_blocks == kv.num_usable_blocks, (kv.num_free_blocks, kv.num_usable_blocks)
    assert not kv.group_managers[0].req_to_blocks


class StepRecorder:
    """Wraps the scheduler's ``schedule`` to see each step: per request id, (tokens
    scheduled, drafts scheduled)."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        scheduler = core(llm).scheduler
        original = scheduler.schedule
        self.steps: list[dict[str, tuple[int, int]]] = []

        def schedule():
            so = original()
            spec = so.scheduled_spec_decode_tokens
            self.steps.append(
                {r: (n, len(spec.get(r, ()))) for r, n in so.num_scheduled_tokens.items()}
            )
            return so

        monkeypatch.setattr(scheduler, "schedule", schedule)


# -- 1. greedy equals no speculation -----------------------------------------------------
DEMO_PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "Hello, my name is",
]


@pytest.mark.parametrize(
    "method",
    ["ngram", "draft_model",
     pytest.param("eagle", marks=pytest.mark.skipif(not EAGLE_DEMO, reason="no demo-eagle yet"))],
)
def test_demo_model_greedy_equals_no_speculation(zoo, method):
    base = zoo.llm("demo")
    llm = zoo.llm("demo", method, k=3)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    want = base.generate(DEMO_PROMPTS, params, use_tqdm=False)
    spec_stats(llm)
    got = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    stats = spec_stats(llm)
    assert_outputs_equal(base, got, want)
    assert_drafts_used(stats)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["random", "cycle"])
def test_random_models_greedy_equals_no_speculation(zoo, cyc, kind, arch, method):
    name = f"{arch}-{kind}"
    base = zoo.llm(name)
    llm = zoo.llm(name, method)
    vocab = len(_tokenizer(zoo.target(name)))
    rng = random.Random(7)
    motif = [rng.randrange(5, vocab) for _ in range(6)]
    prompts = [
        cycle_prompt(cyc, 0), cycle_prompt(cyc, 7, reps=1), cycle_prompt(cyc, 13, reps=3),
        motif * 5, random_prompt(9, vocab, 1), random_prompt(30, vocab, 2),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = run(base, prompts, params)
    spec_stats(llm)
    got = run(llm, prompts, params)
    stats = spec_stats(llm)
    assert_outputs_equal(base, got, want)
    if kind == "cycle":
        assert_drafts_used(stats, accepted=True, rejected=True)
    else:  # random weights: drafts are proposed (n-gram and the motif: some accepted)
        assert_drafts_used(stats, accepted=method == "ngram")


# -- 2. mixed batches --------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_with_and_without_drafts_and_chunked_prefill(zoo, cyc, method, monkeypatch):
    """One generate call: repetitive and non-repetitive prompts, max_tokens 1 and 2
    (never any draft), several lengths and a prompt longer than the token budget, whose
    chunks are prefilled while the others verify drafts."""
    name = "llama-cycle"
    vocab = len(_tokenizer(zoo.target(name)))
    base = zoo.llm(name)
    llm = zoo.llm(name, method, max_num_batched_tokens=32)
    long_prompt = cycle_prompt(cyc, 5, reps=5)  # 100 tokens > the budget of 32
    prompts = [
        cycle_prompt(cyc, 0), random_prompt(7, vocab, 3), cycle_prompt(cyc, 4, reps=1),
        random_prompt(13, vocab, 4), cycle_prompt(cyc, 11), random_prompt(3, vocab, 5),
        cycle_prompt(cyc, 2, reps=1)[:9], long_prompt,
    ]
    max_tokens = [30, 30, 1, 2, 25, 30, 2, 30]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    want = run(base, prompts, params)
    recorder = StepRecorder(llm, monkeypatch)
    spec_stats(llm)
    got = run(llm, prompts, params)
    stats = spec_stats(llm)
    assert_outputs_equal(base, got, want)
    assert [len(o.outputs[0].token_ids) for o in got] == max_tokens
    assert_drafts_used(stats, accepted=True, rejected=True)
    ids = [o.request_id for o in got]
    steps = recorder.steps
    # The requests that may emit at most 2 tokens never carried a draft.
    for i in (2, 3, 6):
        assert all(step.get(ids[i], (0, 0))[1] == 0 for step in steps), ids[i]
    # Some step verified drafts of one request while another decoded without drafts.
    assert any(
        any(d > 0 for _, d in step.values()) and any(n == 1 and d == 0 for n, d in step.values())
        for step in steps
    )
    # The long prompt came in several chunks, at least one of them beside a verification.
    long_id = ids[-1]
    chunks = [step[long_id][0] for step in steps if long_id in step and step[long_id][1] == 0]
    assert sum(n > 1 for n in chunks) >= 2, chunks
    assert any(
        long_id in step and step[long_id][0] > 1
        and any(d > 0 for r, (_, d) in step.items() if r != long_id)
        for step in steps
    )
    assert_nothing_leaked(llm)


def _eagle_backlog_case(zoo, cyc):
    """An EAGLE engine whose steps of 2+ requests draft nothing, four cycle prompts of
    which one runs on alone after the others finish, and plain decoding's outputs:
    (base, llm, prompts, params, want)."""
    name = "llama-cycle"
    base = zoo.llm(name)
    llm = zoo.llm(name, "eagle", spec_extra={"disable_by_batch_size": 2})
    prompts = [cycle_prompt(cyc, 0), cycle_prompt(cyc, 3), cycle_prompt(cyc, 7),
               cycle_prompt(cyc, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (60, 20, 20, 20)]
    return base, llm, prompts, params, run(base, prompts, params)


def _record_catch_ups(monkeypatch) -> list[int]:
    """Per EAGLE pass that took a backlog: the most positions a request caught up."""
    from engine.spec_decode.draft_model import EagleProposer

    caught_up: list[int] = []
    original = EagleProposer._with_backlog

    def recording(batch, backlog, counts, target_hidden):
        starts, hidden = original(batch, backlog, counts, target_hidden)
        caught_up.append(int((batch.starts - starts).max()))
        return starts, hidden

    monkeypatch.setattr(EagleProposer, "_with_backlog", staticmethod(recording))
    return caught_up


def test_eagle_head_catches_up_on_steps_that_drafted_nothing(zoo, cyc, monkeypatch):
    """Steps of 2+ requests draft nothing (disable_by_batch_size=2): the EAGLE head keeps
    their hidden states instead of a pass per step and runs over the backlog when the
    batch shrinks to one request (or the backlog reaches its limit). Greedy outputs
    equal no speculation, and the drafts after a catch-up are accepted as often as when
    the head ran every step."""
    from engine.spec_decode.draft_model import EagleProposer

    base, llm, prompts, params, want = _eagle_backlog_case(zoo, cyc)
    proposer = core(llm).executor.proposer
    flushed = _record_catch_ups(monkeypatch)
    results = {}
    for limit in (EagleProposer.max_deferred_positions, 8, 0):
        proposer.max_deferred_positions = limit
        flushed.clear()
        spec_stats(llm)
        got = run(llm, prompts, params)
        assert_outputs_equal(base, got, want)
        results[limit] = (spec_stats(llm), list(flushed))
        assert_nothing_leaked(llm)
    proposer.max_deferred_positions = EagleProposer.max_deferred_positions
    every_step, _ = results[0]
    assert_drafts_used(every_step, accepted=True)
    for limit in (EagleProposer.max_deferred_positions, 8):
        stats, catch_ups = results[limit]
        # ~19 decode steps of 4 requests deferred, caught up in passes of <= limit
        # positions per request.
        assert catch_ups and max(catch_ups) <= limit, (limit, catch_ups)
        assert sum(catch_ups) >= 15, (limit, catch_ups)
        assert stats.num_accepted_tokens >= 0.9 * every_step.num_accepted_tokens, (
            limit, stats, every_step)
    assert not results[0][1]  # limit 0: a pass every step, nothing held back


def test_eagle_head_drops_its_oldest_backlog_once_drafting_is_settled_off(zoo, cyc,
                                                                           monkeypatch):
    """While the governor has settled on plain steps, a backlog at its limit restarts at
    the step instead of forcing a catch-up pass (a pass that may never be used); the
    dropped positions only cost acceptance later. Greedy outputs equal no speculation,
    the head still drafts once the batch shrinks to one request, and nothing leaks."""
    from engine.core.scheduler import spec_governor
    from engine.spec_decode.draft_model import EagleProposer

    base, llm, prompts, params, want = _eagle_backlog_case(zoo, cyc)
    proposer = core(llm).executor.proposer
    passes = _record_catch_ups(monkeypatch)
    monkeypatch.setattr(spec_governor.SpeculationGovernor, "plain_settled",
                        lambda self, batch_size: batch_size >= 2)
    proposer.max_deferred_positions = 8
    before = proposer.dropped_positions
    try:
        spec_stats(llm)
        got = run(llm, prompts, params)
        stats = spec_stats(llm)
    finally:
        proposer.max_deferred_positions = EagleProposer.max_deferred_positions
    assert_outputs_equal(base, got, want)
    # ~19 steps of 4 requests at a limit of 8: each backlog restarted at least once
    assert proposer.dropped_positions - before >= 4 * 8, proposer.dropped_positions - before
    assert passes and max(passes) <= 8, passes  # what remained was caught up, no more
    assert_drafts_used(stats, accepted=True)
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("method", METHODS)
def test_max_model_len_reached_inside_a_run(zoo, cyc, method):
    """Requests that run into max_model_len (no max_tokens) while drafts are accepted
    stop at exactly max_model_len tokens, as without speculation."""
    name = "llama-cycle"
    base = zoo.llm(name, max_model_len=64)
    llm = zoo.llm(name, method, max_model_len=64)
    prompts = [cycle_prompt(cyc, 3)[:50], cycle_prompt(cyc, 0, reps=3)[:61],
               cycle_prompt(cyc, 1)[:40]]
    params = SamplingParams(temperature=0.0, max_tokens=None)
    want = run(base, prompts, params)
    spec_stats(llm)
    got = run(llm, prompts, params)
    assert_drafts_used(spec_stats(llm), accepted=True)
    assert_outputs_equal(base, got, want)
    for out in got:
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
        assert out.outputs[0].finish_reason == "length"
    assert_nothing_leaked(llm)


# -- 3. prefix caching and preemption ----------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_preemption_and_prefix_caching_while_speculating(zoo, cyc, method):
    """8 requests sharing a 40-token prefix in a KV cache of ~2 sequences (block 8):
    greedy outputs equal the roomy non-speculative run, requests were preempted and
    recomputed, the prefix cache hit, and afterwards every block is free."""
    name = "llama-cycle"
    vocab = len(_tokenizer(zoo.target(name)))
    base = zoo.llm(name)
    llm = zoo.llm(name, method, block_size=8, num_gpu_blocks_override=21, max_num_seqs=8,
                  max_model_len=96)
    prefix = cycle_prompt(cyc, 3)[:40]
    prompts = [prefix + random_prompt(2 + i, vocab, 10 + i) + cyc[:i] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = run(base, prompts, params)
    scheduler = core(llm).scheduler
    preempted = scheduler.num_preemptions_total
    hits = scheduler.kv_cache_manager.total_prefix_cache_stats.hits
    spec_stats(llm)
    got = run(llm, prompts, params)
    stats = spec_stats(llm)
    assert_outputs_equal(base, got, want)
    assert_drafts_used(stats, accepted=True)
    assert scheduler.num_preemptions_total > preempted
    assert scheduler.kv_cache_manager.total_prefix_cache_stats.hits > hits
    assert any(o.num_cached_tokens >= 32 for o in got)
    assert_nothing_leaked(llm)


# -- 4. sampling features keep their meaning ---------------------------------------------
def _features(cyc: list[int], eos: int) -> dict[str, tuple[str, list[int], SamplingParams]]:
    """feature -> (target, prompt, greedy params)."""
    g = dict(temperature=0.0)
    bad = CYCLE[5:7]  # two byte tokens: a multi-token bad word
    eos_prompt = cycle_prompt(cyc, 8, eos=eos)  # EOS is the 13th output token
    return {
        # mostly fresh context: the cycle tokens it emits get penalized on their return
        "repetition_penalty": ("llama-cycle", random_prompt(10, 300, 3) + cyc[:3],
                               SamplingParams(**g, max_tokens=48, repetition_penalty=2.0)),
        "frequency_penalty": ("llama-cycle", cycle_prompt(cyc, 2),
                              SamplingParams(**g, max_tokens=48, frequency_penalty=1.5)),
        "presence_penalty": ("llama-cycle", cycle_prompt(cyc, 4),
                             SamplingParams(**g, max_tokens=48, presence_penalty=1.8)),
        "bad_words": ("llama-cycle", cycle_prompt(cyc, 1),
                      SamplingParams(**g, max_tokens=40, bad_words=[bad, CYCLE[9:12]])),
        "logit_bias": ("llama-cycle", cycle_prompt(cyc, 0),
                       SamplingParams(**g, max_tokens=40,
                                      logit_bias={cyc[8]: -100.0, cyc[15]: 1.0})),
        "allowed_token_ids": ("llama-cycle", cycle_prompt(cyc, 0),
                              SamplingParams(**g, max_tokens=40, allowed_token_ids=cyc[:14])),
        "logprobs": ("llama-cycle", cycle_prompt(cyc, 6),
                     SamplingParams(**g, max_tokens=40, logprobs=3)),
        "stop_token_ids": ("llama-cycle", cycle_prompt(cyc, 0),
                           SamplingParams(**g, max_tokens=40, stop_token_ids=[cyc[11]])),
        "max_tokens_7": ("llama-cycle", cycle_prompt(cyc, 0), SamplingParams(**g, max_tokens=7)),
        "max_tokens_10": ("llama-cycle", cycle_prompt(cyc, 9), SamplingParams(**g, max_tokens=10)),
        "eos": ("llama-eos", eos_prompt, SamplingParams(**g, max_tokens=40)),
        "min_tokens": ("llama-eos", eos_prompt, SamplingParams(**g, max_tokens=40, min_tokens=30)),
        "ignore_eos": ("llama-eos", eos_prompt,
                       SamplingParams(**g, max_tokens=40, ignore_eos=True)),
    }


@pytest.fixture(scope="module")
def feature_runs(zoo, cyc):
    """feature -> {method or None: (RequestOutput, spec stats of its own generate call)},
    each feature's request run alone on every engine (computed on first use)."""
    eos = _tokenizer(zoo.target("llama-cycle")).eos_token_id
    features = _features(cyc, eos)
    cache: dict[tuple[str, str | None], tuple[Any, Any]] = {}

    def get(feature: str, method: str | None):
        if (feature, method) not in cache:
            name, prompt, params = features[feature]
            llm = zoo.llm(name, method)
            if method is not None:
                spec_stats(llm)
            out = run(llm, [prompt], params)[0]
            cache[feature, method] = (out, spec_stats(llm) if method else None)
        return cache[feature, method]

    get.features = features
    return get


FEATURES = ["repetition_penalty", "frequency_penalty", "presence_penalty", "bad_words",
            "logit_bias", "allowed_token_ids", "logprobs", "stop_token_ids", "max_tokens_7",
            "max_tokens_10", "eos", "min_tokens", "ignore_eos"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("feature", FEATURES)
def test_sampling_feature_with_speculation_equals_no_speculation(zoo, feature_runs, feature,
                                                                 method):
    name, prompt, params = feature_runs.features[feature]
    want, _ = feature_runs(feature, None)
    got, stats = feature_runs(feature, method)
    g, w = got.outputs[0], want.outputs[0]
    assert list(g.token_ids) == list(w.token_ids), f"\ngot  {g.token_ids}\nwant {w.token_ids}"
    assert g.text == w.text
    assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
    if params.logprobs is not None:
        assert len(g.logprobs) == len(g.token_ids) == len(w.logprobs)
        for j, (lp_g, lp_w) in enumerate(zip(g.logprobs, w.logprobs)):
            assert lp_g.keys() == lp_w.keys(), j
            for tok in lp_w:
                assert abs(lp_g[tok].logprob - lp_w[tok].logprob) < 1e-4, (j, tok)
                assert lp_g[tok].rank == lp_w[tok].rank, (j, tok)
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
    if feature.startswith("max_tokens") or feature == "ignore_eos":
        assert len(g.token_ids) == params.max_tokens and g.finish_reason == "length"
    assert_drafts_used(stats, accepted=True)


@pytest.mark.parametrize(
    "method,keep", [("ngram", False), ("draft_model", False), ("eagle", False), ("ngram", True)]
)
def test_stop_string_inside_an_accepted_run(zoo, cyc, method, keep):
    """A stop string completed by an accepted draft, with more accepted tokens after it in
    the same step: the output stops where the non-speculative one does -- same text,
    finish and stop reason, and the same token ids and logprobs (none past the token
    that completed the stop string)."""
    name = "llama-cycle"
    base = zoo.llm(name)
    llm = zoo.llm(name, method)
    prompt = cycle_prompt(cyc, 3)
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[CYCLE[12:14]],
                            include_stop_str_in_output=keep, logprobs=1)
    want = run(base, [prompt], params)[0].outputs[0]
    spec_stats(llm)
    got = run(llm, [prompt], params)[0].outputs[0]
    assert_drafts_used(spec_stats(llm), accepted=True)
    assert (want.finish_reason, want.stop_reason) == ("stop", CYCLE[12:14])
    assert (got.text, got.finish_reason, got.stop_reason) == (
        want.text, want.finish_reason, want.stop_reason)
    assert list(got.token_ids) == list(want.token_ids), (
        f"\ngot  {got.token_ids}\nwant {want.token_ids}")
    assert len(got.logprobs) == len(got.token_ids)


def test_sampling_features_change_the_output(zoo, feature_runs, cyc):
    """The features above are not vacuous: without them the plain output differs."""
    eos = _tokenizer(zoo.target("llama-cycle")).eos_token_id
    for feature, (name, prompt, params) in feature_runs.features.items():
        if feature in ("logprobs", "eos"):
            continue
        want, _ = feature_runs(feature, None)
        neutral = SamplingParams(temperature=0.0, max_tokens=params.max_tokens)
        other = run(zoo.llm(name), [prompt], neutral)[0].outputs[0]
        assert list(other.token_ids) != list(want.outputs[0].token_ids) or feature.startswith(
            "max_tokens"), feature
    out = feature_runs("stop_token_ids", None)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids[-1]) == ("stop", cyc[11], cyc[11])
    assert cyc[11] not in out.token_ids[:-1]
    out = feature_runs("eos", None)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids[-1]) == ("stop", None, eos)
    assert len(out.token_ids) < 30
    out = feature_runs("min_tokens", None)[0].outputs[0]
    assert len(out.token_ids) >= 30 and eos not in out.token_ids[:-1]
    out = feature_runs("ignore_eos", None)[0].outputs[0]
    assert len(out.token_ids) == 40 and eos in out.token_ids
    out = feature_runs("bad_words", None)[0].outputs[0]
    assert CYCLE[5:7] not in out.text and CYCLE[9:12] not in out.text


# -- 5. seeded sampling is reproducible ----------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_seeded_sampling_is_reproducible_and_batch_independent(zoo, cyc, method):
    name = "llama-cycle"
    vocab = len(_tokenizer(zoo.target(name)))
    llm = zoo.llm(name, method)
    prompt = cycle_prompt(cyc, 5)
    seeded = SamplingParams(temperature=0.15, seed=1234, max_tokens=32, ignore_eos=True)
    alone = run(llm, [prompt], seeded)[0].outputs[0].token_ids
    spec_stats(llm)
    again = run(llm, [prompt], seeded)[0].outputs[0].token_ids
    assert_drafts_used(spec_stats(llm))
    assert list(again) == list(alone)
    companions = [cycle_prompt(cyc, 0), random_prompt(11, vocab, 6), cycle_prompt(cyc, 9, reps=3)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=1.0, max_tokens=28, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=99, max_tokens=24),
    ]
    batches = [
        ([*companions, prompt], [*params, seeded], 3),
        ([prompt, *companions[::-1]], [seeded, *params[::-1]], 0),
    ]
    for prompts, ps, mine in batches:
        outs = run(llm, prompts, ps)
        assert list(outs[mine].outputs[0].token_ids) == list(alone)
    other_seed = run(llm, [prompt], seeded.clone(seed=4321))[0].outputs[0].token_ids
    assert list(other_seed) != list(alone)


# -- 6. n > 1, random sampling, random beside greedy ----------------------------------------
def test_n_samples_with_temperature_and_draft_model(zoo, cyc):
    name = "llama-cycle"
    vocab = len(_tokenizer(zoo.target(name)))
    llm = zoo.llm(name, "draft_model")
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    spec_stats(llm)
    outs = run(llm, [cycle_prompt(cyc, 0), cycle_prompt(cyc, 10, reps=1)], params)
    stats = spec_stats(llm)
    for out in outs:
        assert len(out.outputs) == 3
        for sample in out.outputs:
            assert len(sample.token_ids) == 24 and sample.finish_reason == "length"
            assert all(0 <= t < vocab for t in sample.token_ids)
        assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    assert_drafts_used(stats, accepted=True, rejected=True)
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("method", METHODS)
def test_random_and_greedy_requests_in_one_batch(zoo, cyc, method):
    """Unseeded random requests beside greedy ones: the greedy ones still equal the
    non-speculative run, the random ones produce valid tokens."""
    name = "llama-cycle"
    vocab = len(_tokenizer(zoo.target(name)))
    base = zoo.llm(name)
    llm = zoo.llm(name, method)
    prompts = [cycle_prompt(cyc, i) for i in (0, 3, 6, 9, 12, 15)]
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    randoms = [SamplingParams(temperature=t, max_tokens=30, ignore_eos=True, top_k=k)
               for t, k in ((1.0, 0), (0.5, 20), (1.3, 5))]
    params = [greedy, randoms[0], greedy, randoms[1], greedy, randoms[2]]
    want = run(base, prompts[::2], greedy)
    spec_stats(llm)
    got = run(llm, prompts, params)
    stats = spec_stats(llm)
    assert_outputs_equal(base, got[::2], want)
    for out in got[1::2]:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 30 and all(0 <= t < vocab for t in tokens)
    assert_drafts_used(stats, accepted=True)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_random_sampling_follows_the_target_distribution(zoo, cyc, method):
    """Speculative sampling emits tokens distributed as the target's: over 1000 seeded
    samples (deterministic, so never flaky), how often each output step follows the
    cycle, and the frequencies of the likeliest tokens at output 3, agree with the
    non-speculative engine's within ~3.5 standard errors, while drafts drawn from the
    draft's own distribution are both accepted and rejected."""
    name = "llama-cycle"
    n, steps = 1000, 6
    prompt = cycle_prompt(cyc, 5)
    params = [SamplingParams(temperature=0.2, seed=i, max_tokens=steps, ignore_eos=True)
              for i in range(n)]
    nxt = {cyc[i]: cyc[(i + 1) % len(cyc)] for i in range(len(cyc))}

    def sample(llm: LLM):
        seqs = [tuple(o.outputs[0].token_ids) for o in run(llm, [prompt] * n, params)]
        assert all(len(s) == steps for s in seqs)
        follow = sum(nxt.get(a) == b for s in seqs
                     for a, b in zip((prompt[-1],) + s[:-1], s)) / (n * steps)
        return follow, Counter(s[3] for s in seqs)

    base_follow, base_counts = sample(zoo.llm(name, max_num_seqs=64))
    llm = zoo.llm(name, method, max_num_seqs=64)
    spec_stats(llm)
    follow, counts = sample(llm)
    assert_drafts_used(spec_stats(llm), accepted=True, rejected=True)
    assert 0.1 < base_follow < 0.9  # a real mix: a skewed sampler would show
    assert abs(follow - base_follow) < 0.04, (follow, base_follow)
    for token, count in base_counts.most_common(3):
        assert abs(counts[token] - count) / n < 0.05, (token, counts[token], count)
