"""``engine generate``: text and JSON output equal the offline API's, errors are clean.

Reference: ``LLM.generate`` on the same model directory with the same sampling options.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from engine import SamplingParams
from engine.cli import main
from tests.helpers.hf_reference import cpu_llm


@pytest.fixture(scope="module")
def reference(llama_dir):
    return cpu_llm(llama_dir)


def _invoke(*args: str):
    return CliRunner().invoke(main, ["generate", *args, "--device", "cpu"])


def _assert_clean_error(result, needle: str) -> None:
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception  # not a crash
    assert "Traceback" not in result.output
    assert result.output.startswith("Error: ") and needle in result.output


def test_prints_prompt_and_completion(llama_dir, reference):
    result = _invoke("Hello", "--model", str(llama_dir), "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    want = reference.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5),
                              use_tqdm=False)[0].outputs[0]
    assert len(want.token_ids) == 5
    assert result.stdout == f"Hello{want.text}\n"


def test_json_output_has_token_ids(llama_dir, reference):
    result = _invoke("Hello", "--model", str(llama_dir), "--max-tokens", "5", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"] == str(llama_dir)
    [record] = doc["results"]
    want = reference.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5),
                              use_tqdm=False)[0]
    assert record["prompt"] == "Hello"
    assert record["prompt_token_ids"] == want.prompt_token_ids
    [sample] = record["outputs"]
    assert sample["token_ids"] == list(want.outputs[0].token_ids)
    assert sample["text"] == want.outputs[0].text
    assert (sample["index"], sample["finish_reason"]) == (0, "length")


def test_several_prompts_n_samples_and_stop(llama_dir, reference):
    args = ["--model", str(llama_dir), "--max-tokens", "6", "--n", "2", "--temperature", "1",
            "--seed", "3", "--ignore-eos", "--json"]
    result = _invoke("Hello", "Once upon a time", *args)
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["results"]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    wants = reference.generate(["Hello", "Once upon a time"], params, use_tqdm=False)
    assert [r["prompt"] for r in records] == ["Hello", "Once upon a time"]
    for record, want in zip(records, wants):
        assert [s["index"] for s in record["outputs"]] == [0, 1]
        assert [s["token_ids"] for s in record["outputs"]] == [
            list(c.token_ids) for c in want.outputs
        ]
    # --stop cuts the text where the string first occurs.
    text = records[0]["outputs"][0]["text"]
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1)
                if "\ufffd" not in text[i : i + 2])
    result = _invoke("Hello", *args, "--stop", stop, "--stop", "never-seen")
    first = json.loads(result.stdout)["results"][0]["outputs"][0]
    assert first["text"] == text[: text.index(stop)]
    assert first["finish_reason"] == "stop"


def test_plain_output_separates_samples(llama_dir):
    result = _invoke("Hi", "--model", str(llama_dir), "--max-tokens", "3", "--n", "2",
                     "--temperature", "1", "--seed", "0")
    assert result.exit_code == 0, result.output
    lines = result.stdout.split("---\n")
    assert len(lines) == 3 and lines[-1] == ""
    assert all(chunk.startswith("Hi") for chunk in lines[:2])


def test_missing_model_dir_is_a_clean_error(tmp_path):
    _assert_clean_error(_invoke("Hello", "--model", str(tmp_path / "nope")), "does not exist")


@pytest.mark.parametrize(
    "option, value, needle",
    [("--temperature", "-1", "temperature"), ("--max-tokens", "0", "max_tokens"),
     ("--top-p", "0", "top_p"), ("--max-model-len", "3", "maximum model length")],
)
def test_bad_options_are_clean_errors(llama_dir, option, value, needle):
    _assert_clean_error(_invoke("Hello world", "--model", str(llama_dir), option, value), needle)


@pytest.mark.slow  # a fresh interpreter importing torch: ~10 s on a busy machine
def test_console_entry_point_reports_errors_without_traceback(tmp_path):
    """The real process: `python -m engine.cli` exits 1 with one line on stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "Hello", "--model",
         str(tmp_path / "nope"), "--device", "cpu"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("Error: model directory")
    assert proc.stdout == ""
