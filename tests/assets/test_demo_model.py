"""The embedded demo models: loadable by default, English-like, equal to transformers."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine import LLM, SamplingParams
from engine.assets import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR, DEMO_MODEL_NAME
from engine.cli import main
from tests.helpers.hf_reference import load_hf_model

DICT_WORDS = Path("/usr/share/dict/words")
REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json", "README.md")


def test_demo_model_directories_are_complete_and_small():
    total = 0
    for model_dir in (DEMO_MODEL_DIR, DEMO_DRAFT_MODEL_DIR):
        for name in MODEL_FILES:
            assert (model_dir / name).is_file(), model_dir / name
        total += sum(f.stat().st_size for f in model_dir.iterdir())
    assert total < 36_000_000


@pytest.mark.skipif(not DICT_WORDS.exists(), reason="needs Debian's wamerican word list")
def test_generate_without_a_model_writes_english():
    result = CliRunner().invoke(main, ["generate", "The hacker", "--max-tokens", "40"])
    assert result.exit_code == 0, result.output
    continuation = result.output.removeprefix("The hacker")
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", continuation)]
    assert len(words) >= 10, continuation
    dictionary = {w.strip().lower() for w in DICT_WORDS.read_text(errors="ignore").split()}
    share = sum(w in dictionary for w in words) / len(words)
    assert share >= 0.7, (share, continuation)


@pytest.mark.parametrize("model_dir", [DEMO_MODEL_DIR, DEMO_DRAFT_MODEL_DIR], ids=["demo", "draft"])
def test_demo_greedy_equals_transformers_float32(model_dir):
    from tests.entrypoints.test_llm_equivalence import assert_greedy_equivalent

    hf = load_hf_model(model_dir)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256)
    tokenizer = llm.get_tokenizer()
    for text in ("The hacker", "Once upon a time", "def main():"):
        prompt = tokenizer(text).input_ids
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=24, min_tokens=24),
                           use_tqdm=False)[0]
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=24, min_new_tokens=24)[0, len(prompt):].tolist()
        assert_greedy_equivalent(hf, prompt, list(out.outputs[0].token_ids), want)


def test_default_model_is_the_demo_model():
    llm = LLM(device="cpu", max_model_len=128)
    assert llm.engine_args.resolved_model_path() == (str(DEMO_MODEL_DIR), DEMO_MODEL_NAME)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    assert out.outputs[0].text


def test_built_wheel_contains_the_model_files(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps",
         "-q", "-w", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for sub in ("demo", "demo-draft"):
        for name in MODEL_FILES:
            assert f"engine/assets/{sub}/{name}" in names
    # the CPU plugin's C kernels are built from these at run time
    from engine.plugins.cpu.kernel_build import HEADERS, SOURCES

    for name in (*SOURCES, *HEADERS):
        assert f"engine/plugins/cpu/csrc/{name}" in names
