"""The weight-update routes of `engine serve --enable-weight-updates` against a real server
process: /update_weights from a directory, /init_weight_update_group +
/update_weights_from_distributed from a trainer process; 400 with an OpenAI-style error
body for bad input, 404 without the flag."""

from __future__ import annotations

import multiprocessing

import httpx
import pytest

from engine.model_executor.multiproc_executor import free_port
from tests.entrypoints.test_llm_equivalence import _hf_greedy
from tests.helpers.hf_reference import load_hf_model
from tests.helpers.weight_trainer import broadcast_checkpoint, specs

PROMPT = [5, 17, 42, 9, 33, 7, 8, 19, 10, 11, 12, 13, 14, 15, 16, 21, 18, 27, 20, 3]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dir_b(model_dir_factory):
    return model_dir_factory("llama-gqa", seed=1)


@pytest.fixture(scope="module")
def http(start_server):
    server = start_server("--enable-weight-updates", "--num-threads", "1")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _complete(http) -> str:
    response = http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _decoded_hf_greedy(path) -> str:
    from transformers import AutoTokenizer

    tokens = _hf_greedy(load_hf_model(path), PROMPT, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(str(path)).decode(tokens, skip_special_tokens=True)


def _error(response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    return error["message"]


def test_update_from_directory_changes_outputs(http, llama_dir, dir_b):
    before = _complete(http)
    assert before == _decoded_hf_greedy(llama_dir)
    ok = http.post("/update_weights", json={"path": str(dir_b)})
    assert ok.status_code == 200, ok.text
    assert _complete(http) == _decoded_hf_greedy(dir_b)  # the cached prompt too
    assert http.post("/update_weights", json={"path": str(llama_dir)}).status_code == 200
    assert _complete(http) == before


def test_bad_input_is_a_400(http, tmp_path, llama_dir):
    before = _complete(http)
    assert "does not exist" in _error(
        http.post("/update_weights", json={"path": str(tmp_path / "nope")}), 400)
    assert "path" in _error(http.post("/update_weights", json={}), 400)
    assert "path" in _error(http.post("/update_weights", json={"path": 3}), 400)
    assert "unknown dtype" in _error(http.post("/update_weights_from_distributed", json={
        "names": ["lm_head.weight"], "dtypes": ["float33"], "shapes": [[2, 2]]}), 400)
    assert "init_weight_update_group first" in _error(
        http.post("/update_weights_from_distributed", json={
            "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]]}), 400)
    assert "rank_offset" in _error(http.post("/init_weight_update_group", json={
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0,
        "world_size": 2}), 400)
    assert _complete(http) == before


def test_update_from_a_trainer_broadcast(http, dir_b, llama_dir):
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=broadcast_checkpoint, args=(port, 2, str(dir_b)), daemon=True)
    trainer.start()
    try:
        joined = http.post("/init_weight_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2})
        assert joined.status_code == 200, joined.text
        names, dtypes, shapes = specs(dir_b)
        done = http.post("/update_weights_from_distributed",
                         json={"names": names, "dtypes": dtypes, "shapes": shapes})
        assert done.status_code == 200, done.text
    finally:
        trainer.join(timeout=60)
    assert trainer.exitcode == 0
    assert _complete(http) == _decoded_hf_greedy(dir_b)
    assert http.post("/update_weights", json={"path": str(llama_dir)}).status_code == 200


def test_routes_are_off_without_the_flag(start_server):
    server = start_server("--num-threads", "1")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for route in ("/update_weights", "/init_weight_update_group",
                      "/update_weights_from_distributed"):
            assert c.post(route, json={"path": "x"}).status_code == 404
