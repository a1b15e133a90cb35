"""``engine chat`` driven through stdin: the transcript is exactly what ``LLM.chat``
produces for the same history (greedy), and the loop exits cleanly.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine import SamplingParams
from engine.cli import main
from engine.cli.chat import _HELP
from tests.helpers.hf_reference import cpu_llm

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def reference(llama_dir):
    return cpu_llm(llama_dir)


def _chat(llama_dir, stdin: str, *args: str):
    return CliRunner().invoke(
        main,
        ["chat", "--model", str(llama_dir), "--device", "cpu", "--temperature", "0",
         "--max-tokens", str(MAX_TOKENS), *args],
        input=stdin,
    )


def _reply(llm, history: list[dict[str, str]]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.chat(history, params, use_tqdm=False)[0].outputs[0].text


def test_one_turn_then_exit(llama_dir, reference):
    result = _chat(llama_dir, "hi\n/exit\n")
    assert result.exit_code == 0, result.output
    reply = _reply(reference, [{"role": "user", "content": "hi"}])
    assert result.stdout == f"{_HELP}\nyou> hi\nassistant> {reply}\nyou> /exit\n"


def test_history_system_prompt_and_reset(llama_dir, reference):
    system = {"role": "system", "content": "Be brief."}
    result = _chat(llama_dir, "hi\nand more\n\n/reset\nhi\n", "--system", "Be brief.")
    assert result.exit_code == 0, result.output  # end of input ends the chat too
    first = [system, {"role": "user", "content": "hi"}]
    r1 = _reply(reference, first)
    r2 = _reply(reference, [*first, {"role": "assistant", "content": r1},
                            {"role": "user", "content": "and more"}])
    assert result.stdout == (
        f"{_HELP}\nyou> hi\nassistant> {r1}\nyou> and more\nassistant> {r2}\nyou> \n"
        f"you> /reset\nyou> hi\nassistant> {r1}\nyou> \n"
    )


def test_too_long_message_is_reported_and_the_chat_goes_on(llama_dir, reference):
    result = _chat(llama_dir, "word " * 80 + "\nhi\n/exit\n", "--max-model-len", "64")
    assert result.exit_code == 0, result.output
    assert "error: The prompt" in result.output and "maximum model length" in result.output
    reply = _reply(reference, [{"role": "user", "content": "hi"}])
    assert f"you> hi\nassistant> {reply}\nyou> /exit\n" in result.stdout


def test_missing_model_dir_is_a_clean_error(tmp_path):
    result = _chat(tmp_path / "nope", "hi\n")
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert "Error: model directory" in result.output and "does not exist" in result.output
