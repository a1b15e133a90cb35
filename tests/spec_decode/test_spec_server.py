"""The OpenAI-compatible server with n-gram speculation, driven by the ``openai`` client.

One real ``engine serve`` subprocess on the demo model (the OpenAI tests' ServerProcess:
127.0.0.1, a free port, /health) started with ``--speculative-config``; the reference is
the same demo model run in-process by ``LLM()`` without speculation. Greedy completions
and chat completions, streamed or not, must be the reference's text; logprobs must have
one entry per token even when one step emits several tokens; a stop string inside the
output cuts it there; ``/metrics`` must show the speculation counters. A bad
``--speculative-config`` must make ``engine serve`` fail fast with its reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.assets import DEMO_MODEL_DIR
from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess, _free_port

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
MAX_TOKENS = 40
# Repetitive prompts (prompt lookup matches) and one that is not.
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "Hello, my name is",
]
CHAT = [{"role": "user", "content": "Say: the cat sat on the mat, the cat sat on the mat, "
                                    "the cat sat on the mat."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("spec_server") / "server.log"
    server = ServerProcess(DEMO_MODEL_DIR, log, ["--speculative-config", json.dumps(SPEC),
                                                 "--max-num-seqs", "8"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        if server.core_pid is not None:
            server.assert_no_orphans()
    assert "Traceback" not in server.log(), server.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def reference():
    """The demo model in-process, no speculation."""
    return LLM(device="cpu", dtype="float32", max_model_len=256)


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kwargs)


@pytest.fixture(scope="module")
def want(reference):
    """prompt -> the reference's greedy CompletionOutput."""
    outs = reference.generate(PROMPTS, _greedy(), use_tqdm=False)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _sample(text: str, name: str, **labels: str) -> float | None:
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_completions_equal_no_speculation(client, want):
    reply = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                      temperature=0)
    by_index = sorted(reply.choices, key=lambda c: c.index)
    for prompt, choice in zip(PROMPTS, by_index):
        assert (choice.text, choice.finish_reason) == (want[prompt].text,
                                                       want[prompt].finish_reason), prompt
    assert reply.usage.completion_tokens == sum(len(w.token_ids) for w in want.values())
    for prompt in PROMPTS[:3]:
        chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompt,
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices
                  and c.choices[0].finish_reason]
        assert (text, finish) == (want[prompt].text, [want[prompt].finish_reason]), prompt


def test_chat_completions_equal_no_speculation(client, reference):
    ref = reference.chat(CHAT, _greedy(), use_tqdm=False)[0].outputs[0]
    reply = client.chat.completions.create(model=SERVED_NAME, messages=CHAT,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == ref.text
    assert reply.choices[0].finish_reason == ref.finish_reason
    assert reply.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=CHAT,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == [ref.finish_reason]


def test_completion_logprobs_one_entry_per_token(client, reference):
    prompt = PROMPTS[0]
    ref = reference.generate([prompt], _greedy(logprobs=2), use_tqdm=False)[0].outputs[0]
    choice = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=2).choices[0]
    lp = choice.logprobs
    n = len(ref.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text == ref.text
    for j, (got, entry) in enumerate(zip(lp.token_logprobs, ref.logprobs)):
        assert got == pytest.approx(entry[ref.token_ids[j]].logprob, abs=1e-4), j
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # Streamed: steps that accept drafts send several tokens in one chunk, each with its
    # own logprob entry.
    chunks = [c for c in client.completions.create(model=SERVED_NAME, prompt=prompt,
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   logprobs=2, stream=True) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens
    assert values == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert any(len(c.choices[0].logprobs.tokens) > 1 for c in chunks if c.choices[0].logprobs), (
        "no chunk carried more than one token: were drafts accepted?")


def test_stop_string_inside_the_output(client, want):
    prompt = PROMPTS[0]
    full = want[prompt].text
    # A stop string well inside the output: its first occurrence cuts the text.
    stop = full[12:16]
    assert len(stop) == 4 and len(full) > 20, full
    expected = full[: full.index(stop)]
    choice = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stop=[stop]).choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    chunks = [c for c in client.completions.create(model=SERVED_NAME, prompt=prompt,
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   stop=[stop], stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "stop"]


def test_metrics_show_speculation(server, client, want):
    client.completions.create(model=SERVED_NAME, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS,
                              temperature=0)
    text = _metrics(server)
    values = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        values[name] = _sample(text, f"engine:spec_decode_{name}_total", model_name=SERVED_NAME)
        assert values[name] is not None and values[name] > 0, (name, text[-3000:])
    assert values["num_accepted_tokens"] <= values["num_draft_tokens"]
    per_pos = [_sample(text, "engine:spec_decode_num_accepted_tokens_per_pos_total",
                       model_name=SERVED_NAME, position=str(i))
               for i in range(SPEC["num_speculative_tokens"])]
    assert all(v is not None for v in per_pos), per_pos
    assert per_pos[0] > 0 and per_pos == sorted(per_pos, reverse=True), per_pos
    assert sum(per_pos) == values["num_accepted_tokens"]
    assert _sample(text, "engine:spec_decode_num_accepted_tokens_per_pos_total",
                   position=str(SPEC["num_speculative_tokens"])) is None


@pytest.mark.parametrize("config,message", [
    ({"method": "foo", "num_speculative_tokens": 4}, "unknown speculative method 'foo'"),
    ({"method": "medusa", "num_speculative_tokens": 4}, "'medusa' is not supported"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "eagle", "model": "/nonexistent/head", "num_speculative_tokens": 2},
     "/nonexistent/head"),
    ("{not json", "not valid JSON"),
], ids=["unknown-method", "medusa", "no-k", "missing-draft", "bad-json"])
def test_bad_speculative_config_fails_fast(config, message):
    """``engine serve`` exits non-zero within seconds (no server, no hang), the reason
    on stderr and no traceback."""
    value = config if isinstance(config, str) else json.dumps(config)
    cmd = [sys.executable, "-m", "engine.cli", "serve", str(DEMO_MODEL_DIR), "--device", "cpu",
           "--port", str(_free_port()), "--speculative-config", value]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert elapsed < 30, elapsed
