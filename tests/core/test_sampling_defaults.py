"""Sampling defaults from generation_config.json (vLLM's --generation-config), offline."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.core.sampling_defaults import NEUTRAL_VALUES, load_sampling_defaults

QWEN_STYLE = {  # what instruct models ship, plus fields that are not sampling defaults
    "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
    "repetition_penalty": 1.05, "max_new_tokens": 9, "eos_token_id": [2, 3],
}


def _write(directory, config) -> None:
    (directory / "generation_config.json").write_text(json.dumps(config))


def test_the_model_file_supplies_the_sampling_fields(tmp_path):
    _write(tmp_path, QWEN_STYLE)
    defaults = load_sampling_defaults(str(tmp_path))
    assert defaults.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                               "repetition_penalty": 1.05}
    assert defaults.max_tokens == 9
    assert "generation_config.json" in defaults.describe()


def test_request_values_win_then_the_model_then_neutral(tmp_path):
    _write(tmp_path, QWEN_STYLE)
    defaults = load_sampling_defaults(str(tmp_path))
    assert defaults.value("temperature", 0.0) == 0.0  # a request's explicit 0 is kept
    assert defaults.value("temperature", None) == 0.7
    assert defaults.value("min_p", None) == NEUTRAL_VALUES["min_p"]


def test_vllm_mode_a_directory_and_a_missing_file(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    _write(model, QWEN_STYLE)
    assert load_sampling_defaults(str(model), "vllm").values == {}
    other = tmp_path / "other"
    other.mkdir()
    _write(other, {"temperature": 0.2})
    assert load_sampling_defaults(str(model), str(other)).values == {"temperature": 0.2}
    assert load_sampling_defaults(str(other / "..")).describe() is None  # "auto", no file
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(str(model), str(tmp_path))
    with pytest.raises(ValueError, match="'auto', 'vllm' or a directory"):
        load_sampling_defaults(str(model), "greedy")


@pytest.fixture(scope="module")
def model_with_defaults(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-defaults") / "model"
    shutil.copytree(llama_dir, path)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    _write(path, {**config, "temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5})
    return path


def test_generate_without_params_uses_the_model_defaults(model_with_defaults):
    llm = LLM(str(model_with_defaults), device="cpu", dtype="float32", max_model_len=128)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.repetition_penalty, default.max_tokens) == (0.0, 1.3, 5)
    prompt = {"prompt_token_ids": [5, 17, 42, 9, 100, 7]}
    got = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    want = llm.generate(prompt, explicit, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) <= 5


def test_vllm_mode_keeps_the_plain_defaults(model_with_defaults):
    llm = LLM(str(model_with_defaults), device="cpu", dtype="float32", max_model_len=128,
              generation_config="vllm")
    default = llm.get_default_sampling_params()
    plain = SamplingParams()
    assert (default.temperature, default.max_tokens) == (plain.temperature, plain.max_tokens)


def test_a_bad_generation_config_fails_at_startup(llama_dir):
    with pytest.raises(ValueError, match="generation-config"):
        LLM(str(llama_dir), device="cpu", generation_config="/no/such/dir")
