"""Quantized checkpoints through ``engine generate`` (CLI) and ``engine serve`` (OpenAI
completions), for a few representative fixtures (the LLM path covers all of them in
test_quant_fixtures.py).

- CLI: text prompts (the tokenizer adds BOS, so these are not the fixtures' prompts); the
  reference is transformers over the weights dequantized by :mod:`packers` (which
  reproduces the tools' own references, see test_quant_fixtures.py), greedy by full
  forwards from the prompt ids the CLI reports.
- serve: the fixtures' own prompt token ids, temperature 0, ``echo`` + ``logprobs``: the
  prompt log-probabilities must match the fixture reference's logits and the 16 generated
  tokens its greedy tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from engine.cli import main
from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess
from tests.quantization import refs

TIE_TOL = 1e-3  # the fixtures used here are exact schemes (see test_quant_fixtures.py)


@pytest.mark.parametrize("name", ["ct-w4a16-asym-g64", "awq-gemm-g64"])
def test_generate_cli_matches_independent_reference(name):
    path = refs.fixture_dir(name)
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog"]
    result = CliRunner().invoke(main, ["generate", *prompts, "--model", str(path), "--device",
                                       "cpu", "--dtype", "float32", "--max-tokens", "16",
                                       "--temperature", "0", "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["results"]
    assert [r["prompt"] for r in records] == prompts
    reference = refs.fixture_hf_model(name)
    engine = refs.engine_model(path)
    for record in records:
        ids = record["prompt_token_ids"]
        got = record["outputs"][0]["token_ids"]
        assert len(got) == 16
        want = refs.hf_greedy(reference, ids, 16)
        ok, why = refs.greedy_agrees(got, want, refs.engine_logits(engine, ids + got), len(ids),
                                     TIE_TOL)
        assert ok, f"{name} {record['prompt']!r}: {why}"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(refs.fixture_dir("base"))  # one tokenizer for all


@pytest.mark.parametrize(("name", "args"), [("ct-fp8-static", []),
                                           ("gptq-desc-act-g64", ["--quantization", "gptq"])])
def test_serve_completions_match_fixture_reference(name, args, tmp_path, tokenizer):
    """(--quantization naming the checkpoint's own format is accepted.)"""
    ref = refs.reference(name)
    server = ServerProcess(refs.fixture_dir(name), tmp_path / "server.log", args)
    try:
        server.wait_ready()
        for i in (2, 3):
            ids = ref[f"prompt{i}.input_ids"].tolist()
            body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "min_tokens": 16, "echo": True, "logprobs": 1}
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(ids) + 16
            # the prompt's log-probabilities: the reference logits' log_softmax
            logits = ref[f"prompt{i}.logits"].double()
            want_lp = logits.log_softmax(-1)
            expected = [float(want_lp[j - 1, ids[j]]) for j in range(1, len(ids))]
            bound = 2 * TIE_TOL * float(logits.abs().max())
            assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=bound)
            # the generated tokens: the reference's greedy tokens (compared as the strings
            # the server reports per token; at a mismatch, it must be a near-tie)
            want = ref[f"prompt{i}.greedy_tokens"].tolist()
            got_text = lp["tokens"][len(ids):]
            want_text = [tokenizer.decode([t]) for t in want]
            if got_text != want_text:
                first = next(k for k, (a, b) in enumerate(zip(got_text, want_text)) if a != b)
                engine = refs.engine_model(refs.fixture_dir(name))
                row = refs.engine_logits(engine, ids + want[:first])[-1].double()
                top = float(row.max())
                limit = TIE_TOL * float(row.abs().max())
                near = (top - row <= limit).nonzero().flatten().tolist()
                assert want[first] in near, (first, got_text, want_text)
                assert got_text[first] in {tokenizer.decode([t]) for t in near}, (first, got_text)
    finally:
        server.stop()
        server.assert_no_orphans()
    log = server.log()
    assert "Traceback" not in log, log

