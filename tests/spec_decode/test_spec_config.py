"""``speculative_config`` validation: every bad config fails with its reason before any
model loads; vLLM's spellings resolve to the same configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine.assets import DEMO_DRAFT_MODEL_DIR, DEMO_EAGLE_MODEL_DIR
from engine.core.engine_args import EngineArgs
from engine.spec_decode.config import parse_speculative_config, resolve_speculative_config

VOCAB = 64


def _save_llama(out: Path, *, vocab: int = VOCAB, hidden: int = 32, layers: int = 2,
                inter: int = 64) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-config")
    return {
        "target": _save_llama(root / "target", hidden=64, layers=2, inter=128),
        "draft": _save_llama(root / "draft", hidden=32, layers=1, inter=64),
        "other_vocab": _save_llama(root / "other-vocab", vocab=VOCAB * 2, hidden=32, layers=1),
        "bigger": _save_llama(root / "bigger", hidden=128, layers=3, inter=256),
    }


def resolve(target: Path | None, spec) -> object:
    """The resolved SpeculativeConfig of EngineArgs (target None: the demo model)."""
    args = EngineArgs(model=None if target is None else str(target), speculative_config=spec)
    return args.create_engine_config().speculative


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a model's weights start loading."""
    import engine.model_executor.model_loader as loader
    import engine.model_executor.worker as executor

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the speculative config was checked")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(executor, "load_model", refuse)


# -- bad configs ---------------------------------------------------------------------------
BAD_PLAIN = [
    ({"method": "foo", "num_speculative_tokens": 2}, "unknown speculative method 'foo'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
     "apply to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ('{"method": "ngram", "num_speculative_tokens": 2', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('"ngram"', "must be a JSON object"),
]


@pytest.mark.parametrize("spec, message", BAD_PLAIN)
def test_bad_config_is_refused_with_its_reason(models, spec, message):
    with pytest.raises(ValueError) as info:
        resolve(models["target"], spec)
    assert message in str(info.value)


def _bad_model_cases(models):
    return {
        "other_vocab": ({"method": "draft_model", "model": str(models["other_vocab"]),
                         "num_speculative_tokens": 2},
                        f"vocabulary of {2 * VOCAB} tokens but the target has {VOCAB}"),
        "bigger": ({"method": "draft_model", "model": str(models["bigger"]),
                    "num_speculative_tokens": 2}, "is not smaller than its target"),
        "bigger_inferred": ({"model": str(models["bigger"]), "num_speculative_tokens": 2},
                            "is not smaller than its target"),
        "same_model": ({"model": str(models["target"]), "num_speculative_tokens": 2},
                       "is not smaller than its target"),
        "eagle_not_eagle": ({"method": "eagle", "model": str(models["draft"]),
                             "num_speculative_tokens": 2}, "is not an EAGLE head"),
        "draft_model_is_eagle": ({"method": "draft_model", "model": str(DEMO_EAGLE_MODEL_DIR),
                                  "num_speculative_tokens": 2}, "use method 'eagle'"),
        "no_draft": ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft"),
        "no_eagle_head": ({"method": "eagle", "num_speculative_tokens": 2}, "needs a draft"),
        "no_method_no_model": ({"num_speculative_tokens": 2}, "needs a method"),
        "missing_dir": ({"method": "draft_model", "model": "/nonexistent/draft-dir",
                         "num_speculative_tokens": 2}, "does not exist"),
    }


@pytest.mark.parametrize("case", [
    "other_vocab", "bigger", "bigger_inferred", "same_model", "eagle_not_eagle",
    "draft_model_is_eagle", "no_draft", "no_eagle_head", "no_method_no_model", "missing_dir",
])
def test_bad_draft_is_refused_with_its_reason(models, case):
    spec, message = _bad_model_cases(models)[case]
    with pytest.raises(ValueError) as info:
        resolve(models["target"], spec)
    assert message in str(info.value)


@pytest.mark.parametrize("spec, message", [
    ({"method": "foo", "num_speculative_tokens": 2}, "unknown speculative method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ("not json", "not valid JSON"),
])
def test_llm_refuses_before_any_model_loads(models, no_model_loads, spec, message):
    from engine import LLM

    with pytest.raises(ValueError, match=message):
        LLM(str(models["target"]), device="cpu", speculative_config=spec)


@pytest.mark.parametrize("case", ["other_vocab", "bigger", "eagle_not_eagle", "no_draft"])
def test_llm_refuses_a_bad_draft_before_any_model_loads(models, no_model_loads, case):
    from engine import LLM

    spec, message = _bad_model_cases(models)[case]
    with pytest.raises(ValueError) as info:
        LLM(str(models["target"]), device="cpu", speculative_config=spec)
    assert message in str(info.value)


# -- good configs ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [
    {"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    {"model": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    {"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    json.dumps({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}),
])
def test_legacy_ngram_spelling_resolves_to_ngram(models, spec):
    config = resolve(models["target"], spec)
    assert config.method == "ngram" and config.model is None
    assert config.num_speculative_tokens == 3
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)


def test_ngram_lookup_bounds_default_and_fill_each_other(models):
    both = resolve(models["target"], {"method": "ngram", "num_speculative_tokens": 2})
    assert both.prompt_lookup_min == both.prompt_lookup_max >= 1
    only_min = resolve(models["target"], {"method": "ngram", "num_speculative_tokens": 2,
                                          "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    ranged = resolve(models["target"], {"method": "ngram", "num_speculative_tokens": 2,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert (ranged.prompt_lookup_min, ranged.prompt_lookup_max) == (1, 3)


def test_draft_model_resolves_its_directory_and_method(models):
    config = resolve(models["target"], {"model": str(models["draft"]),
                                        "num_speculative_tokens": 4})
    assert config.method == "draft_model"
    assert Path(config.model) == models["draft"]
    assert config.num_speculative_tokens == 4 and config.uses_draft_kv


def test_demo_target_without_model_uses_the_shipped_draft():
    config = resolve(None, {"method": "draft_model", "num_speculative_tokens": 2})
    assert Path(config.model).resolve() == DEMO_DRAFT_MODEL_DIR.resolve()
    eagle = resolve(None, {"method": "eagle", "num_speculative_tokens": 2})
    assert Path(eagle.model).resolve() == DEMO_EAGLE_MODEL_DIR.resolve()
    inferred = resolve(None, {"model": str(DEMO_EAGLE_MODEL_DIR), "num_speculative_tokens": 2})
    assert inferred.method == "eagle"


def test_demo_directory_given_explicitly_counts_as_the_demo_target():
    from engine.assets import DEMO_MODEL_DIR
    from engine.model_executor.model_loader import load_model_files

    config = resolve_speculative_config(
        {"method": "draft_model", "num_speculative_tokens": 2},
        load_model_files(DEMO_MODEL_DIR), is_demo_target=False,
    )
    assert Path(config.model).resolve() == DEMO_DRAFT_MODEL_DIR.resolve()


def test_parse_accepts_text_dicts_and_configs():
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    parsed = parse_speculative_config(text)
    assert parsed.method == "ngram"
    assert parse_speculative_config(parsed) is parsed
    assert parse_speculative_config(json.loads(text)).num_speculative_tokens == 2


# -- the command line ----------------------------------------------------------------------
def test_cli_generate_refuses_an_unknown_method():
    from engine.cli import main

    result = CliRunner().invoke(main, [
        "generate", "--speculative-config",
        '{"method": "foo", "num_speculative_tokens": 2}', "hi",
    ])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception  # not a crash
    assert "Traceback" not in result.output
    assert "unknown speculative method 'foo'" in result.output


@pytest.mark.parametrize("spec, message", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    ("{oops", "not valid JSON"),
])
def test_cli_generate_refuses_other_bad_configs(spec, message):
    from engine.cli import main

    result = CliRunner().invoke(main, ["generate", "--speculative-config", spec, "hi"])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception
    assert message in result.output
