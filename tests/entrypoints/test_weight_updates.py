"""Weight updates for RL loops (vLLM / OpenRLHF style): ``LLM.update_weights(path)``,
``init_weight_update_group`` + ``update_weights_from_distributed`` (a trainer process
broadcasting over gloo) and ``update_weights_from_tensors``. After each, greedy outputs
equal transformers' on the new weights, a prompt cached under the old ones included, on
one rank and under tensor parallelism; refused updates leave the old weights serving."""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.model_executor.multiproc_executor import free_port
from tests.entrypoints.test_llm_equivalence import _hf_greedy, assert_greedy_equivalent
from tests.helpers.hf_reference import cpu_llm, load_hf_model
from tests.helpers.weight_trainer import broadcast_checkpoint, checkpoint_tensors, specs

# 20 tokens: the first block (16) is cached by the prefix cache.
CACHED = [5, 17, 42, 9, 33, 7, 8, 19, 10, 11, 12, 13, 14, 15, 16, 21, 18, 27, 20, 3]
OTHER = [7, 7, 100, 3, 64, 9]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dir_a(llama_dir):
    return llama_dir


@pytest.fixture(scope="module")
def dir_b(model_dir_factory):
    return model_dir_factory("llama-gqa", seed=1)


@pytest.fixture(scope="module")
def refs(dir_a, dir_b):
    """Transformers' greedy tokens per (weights, prompt)."""
    out = {}
    for key, path in (("a", dir_a), ("b", dir_b)):
        hf = load_hf_model(path)
        out[key] = {"hf": hf, **{tuple(p): _hf_greedy(hf, p, MAX_TOKENS)
                                 for p in (CACHED, OTHER)}}
    return out


def _tokens(llm, prompt) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _assert_serves(llm, refs, key: str) -> None:
    for prompt in (CACHED, OTHER):
        assert_greedy_equivalent(refs[key]["hf"], prompt, _tokens(llm, prompt),
                                 refs[key][tuple(prompt)])


def _cached_blocks(llm) -> int:
    core = llm.llm_engine.client.core
    return len(core.scheduler.kv_cache_manager.block_pool.cached_blocks)


def _distributed_update(llm, path, tp: int, packed: bool = False) -> None:
    """A trainer process (rank 0) broadcasts ``path``'s tensors to the engine's ranks
    (``packed``: in byte buckets)."""
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=broadcast_checkpoint, args=(port, 1 + tp, str(path), 1, packed), daemon=True)
    trainer.start()
    try:
        llm.init_weight_update_group("127.0.0.1", port, 1, 1 + tp)
        llm.update_weights_from_distributed(*specs(path), packed=packed)
    finally:
        trainer.join(timeout=60)
    assert trainer.exitcode == 0


@pytest.fixture(scope="module")
def llm(dir_a):
    engine = cpu_llm(dir_a, enable_sleep_mode=True)
    yield engine
    engine.shutdown()


def test_update_from_directory_matches_transformers_including_cached_prompt(
        llm, dir_a, dir_b, refs):
    llm.update_weights(str(dir_a))
    _assert_serves(llm, refs, "a")
    assert _cached_blocks(llm)  # CACHED's first block, computed with A's weights
    llm.update_weights(str(dir_b))
    assert _cached_blocks(llm) == 0  # reset: no block of A's keys survives
    _assert_serves(llm, refs, "b")
    llm.update_weights(dir_a)  # a Path works too; and back
    _assert_serves(llm, refs, "a")


def test_refused_updates_keep_the_old_weights(llm, dir_a, model_dir_factory, refs, tmp_path):
    llm.update_weights(str(dir_a))
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(model_dir_factory("llama-mha")), "shape"),  # same class, other head count
        (str(model_dir_factory("qwen2")), "architecture"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.update_weights(path)
        _assert_serves(llm, refs, "a")
    with pytest.raises(ValueError, match="does not expect: model.bogus"):
        llm.update_weights_from_tensors([("model.bogus", refs["b"]["hf"].lm_head.weight)])
    _assert_serves(llm, refs, "a")


def test_refused_while_a_request_is_unfinished(llm, dir_b):
    engine = llm.llm_engine
    engine.add_request("busy", {"prompt_token_ids": OTHER},
                       SamplingParams(temperature=0.0, max_tokens=4))
    try:
        with pytest.raises(ValueError, match="unfinished"):
            llm.update_weights(str(dir_b))
    finally:
        engine.abort_request(["busy"])
        while engine.has_unfinished_requests():
            engine.step()


def test_update_from_tensors_of_a_colocated_trainer(llm, dir_a, refs):
    llm.update_weights(str(dir_a))
    llm.update_weights_from_tensors(list(refs["b"]["hf"].state_dict().items()))
    _assert_serves(llm, refs, "b")


def test_update_from_a_trainer_broadcast(llm, dir_a, dir_b, refs):
    llm.update_weights(str(dir_a))
    _tokens(llm, CACHED)
    _distributed_update(llm, dir_b, tp=1)
    _assert_serves(llm, refs, "b")
    _distributed_update(llm, dir_a, tp=1, packed=True)  # byte buckets, views on receipt
    _assert_serves(llm, refs, "a")
    with pytest.raises(ValueError, match="differ in length"):
        llm.update_weights_from_distributed(["a"], [], [[1]])
    with pytest.raises(ValueError, match="unknown dtype"):
        llm.update_weights_from_distributed(["a"], ["float33"], [[1]])


def test_sleep_update_wake_flows(llm, dir_a, dir_b, refs):
    llm.update_weights(str(dir_a))
    # level 2: the weights are dropped; the update loads B (nothing reloaded from A)
    llm.sleep(level=2)
    assert llm.llm_engine.client.core.executor.model is None
    llm.update_weights(str(dir_b))
    assert llm.is_sleeping()  # the KV cache still sleeps
    llm.wake_up()
    _assert_serves(llm, refs, "b")
    # level 1, then waking the weights first, as a colocated trainer does
    llm.sleep(level=1)
    llm.update_weights(str(dir_a))
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    _assert_serves(llm, refs, "a")
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.update_weights_from_tensors(checkpoint_tensors(dir_b))
    llm.wake_up(tags=["kv_cache"])
    _assert_serves(llm, refs, "b")


def test_tensor_parallel_updates(dir_a, dir_b, refs):
    engine = cpu_llm(dir_a, tensor_parallel_size=2)
    try:
        _tokens(engine, CACHED)
        engine.update_weights(str(dir_b))
        _assert_serves(engine, refs, "b")
        engine.update_weights_from_tensors(checkpoint_tensors(dir_a))
        _assert_serves(engine, refs, "a")
        _distributed_update(engine, dir_b, tp=2, packed=True)
        _assert_serves(engine, refs, "b")
        with pytest.raises(ValueError, match="rank 0: .*shape"):
            engine.update_weights_from_tensors(
                [(n, t[:-1] if n.endswith("o_proj.weight") else t)
                 for n, t in checkpoint_tensors(dir_a)])
        _assert_serves(engine, refs, "b")
    finally:
        engine.shutdown()


QUANT_FIXTURE = Path(__file__).resolve().parents[1] / "data" / "quant-fixtures" / "ct-w4a16-g64"


def _rescaled_copy(src: Path, dst: Path) -> Path:
    """``src`` with layer 0's int4 group scales x 0.7: other weights, the same format."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference*"))
    tensors = load_file(str(src / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.startswith("model.layers.0.") and name.endswith("weight_scale"):
            tensors[name] = tensor * 0.7
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_quantized_checkpoint_update_equals_a_fresh_engine(tmp_path):
    """A compressed-tensors int4 checkpoint: the update goes through the format's
    finish_loading and the platform's quantized kernel like a fresh load does."""
    new_dir = _rescaled_copy(QUANT_FIXTURE, tmp_path / "rescaled")
    fresh = cpu_llm(new_dir)
    try:
        want = _tokens(fresh, OTHER)
    finally:
        fresh.shutdown()
    engine = cpu_llm(QUANT_FIXTURE)
    try:
        before = _tokens(engine, OTHER)
        assert before != want
        engine.update_weights(str(new_dir))
        assert _tokens(engine, OTHER) == want
        with pytest.raises(ValueError, match="does not expect"):  # an unquantized one
            engine.update_weights(str(QUANT_FIXTURE.parent / "base"))
        assert _tokens(engine, OTHER) == want
    finally:
        engine.shutdown()
