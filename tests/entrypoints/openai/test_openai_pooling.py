"""The pooling routes of the OpenAI-compatible server, end to end: real `engine serve
--runner pooling` subprocesses on small random-weight models (a sentence-transformers
Qwen3 embedder served as a matryoshka model, the same embedder without, and a Qwen3
cross-encoder), plus the tiny generating Llama, driven by the `openai` client and raw
httpx. Every answer is checked against the offline ``LLM`` on the same model (its
embed / classify / score), computed in this process while the servers start.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess
from tests.helpers.pooling_models import TEXTS, qwen3_model, save_hf, save_sentence_transformer

MAX_MODEL_LEN = 256  # conftest's ServerProcess serves with this
ATOL = 1e-5
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the quick brown fox", "a",
             "berlin is the capital of germany"]


@dataclass
class Setup:
    """The module's servers and the offline results they must reproduce."""

    embed: ServerProcess  # the embedder, --hf-overrides is_matryoshka
    plain: ServerProcess  # the same embedder, not matryoshka
    cross: ServerProcess  # the cross-encoder (one label)
    generate: ServerProcess  # the tiny generating Llama
    embeddings: torch.Tensor = field(init=False)  # LLM.embed(TEXTS)
    token_ids: list[list[int]] = field(init=False)  # the embedder's tokens of TEXTS
    embed_scores: list[float] = field(init=False)  # embedder LLM.score(QUERY, DOCUMENTS)
    cross_scores: list[float] = field(init=False)  # cross-encoder LLM.score(QUERY, DOCUMENTS)
    pair_scores: list[float] = field(init=False)  # cross LLM.score(TEXTS[:3], DOCUMENTS[:3])
    probs: list[list[float]] = field(init=False)  # cross-encoder LLM.classify(TEXTS)


def _offline(setup: Setup, embedder: Path, cross: Path) -> None:
    from engine import LLM

    kwargs = {"device": "cpu", "dtype": "float32", "runner": "pooling",
              "max_model_len": MAX_MODEL_LEN}
    with LLM(str(embedder), hf_overrides={"is_matryoshka": True}, **kwargs) as llm:
        outputs = llm.embed(TEXTS, use_tqdm=False)
        setup.embeddings = torch.tensor([o.outputs.embedding for o in outputs])
        setup.token_ids = [o.prompt_token_ids for o in outputs]
        setup.embed_scores = [o.outputs.score
                              for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    with LLM(str(cross), **kwargs) as llm:
        setup.cross_scores = [o.outputs.score
                              for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
        setup.pair_scores = [o.outputs.score
                             for o in llm.score(TEXTS[:3], DOCUMENTS[:3], use_tqdm=False)]
        setup.probs = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]


@pytest.fixture(scope="module")
def setup(llama_dir, tmp_path_factory):
    """Four servers started at once; the offline references are computed meanwhile."""
    root = tmp_path_factory.mktemp("pooling-models")
    model, tok = qwen3_model("embed", seed=3)
    embedder = save_sentence_transformer(save_hf(model, tok, root / "hf"), root / "st",
                                         "lasttoken")
    model, tok = qwen3_model("classify", num_labels=1, seed=4)
    cross = save_hf(model, tok, root / "cross")
    pooling = ["--runner", "pooling", "--enforce-eager"]
    specs = {"embed": (embedder, [*pooling, "--hf-overrides", '{"is_matryoshka": true}']),
             "plain": (embedder, pooling), "cross": (cross, pooling),
             "generate": (llama_dir, ["--enforce-eager"])}
    servers: dict[str, ServerProcess] = {}
    try:
        for name, (path, args) in specs.items():
            log_path = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
            servers[name] = ServerProcess(path, log_path, args)
        result = Setup(**servers)
        _offline(result, embedder, cross)
        for server in servers.values():
            server.wait_ready()
        yield result
    finally:
        for server in servers.values():
            server.stop()
    for server in servers.values():
        server.assert_no_orphans()
        assert "Traceback" not in server.log(), server.log()  # no unexpected errors


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, timeout=60)


def _ok(server: ServerProcess, path: str, body: dict) -> dict:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _assert_error(response: httpx.Response, status: int, param: str | None,
                  fragment: str = "") -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error", body
    error = body["error"]
    assert error["code"] == status and error["param"] == param, error
    assert fragment.lower() in error["message"].lower(), error


def _close(got: list[float] | list[list[float]], want: torch.Tensor | list) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.as_tensor(want, dtype=torch.float64), atol=ATOL, rtol=0)


# -- /v1/embeddings -----------------------------------------------------------------------
def test_embeddings_equal_offline_in_every_input_form(setup):
    client = _client(setup.embed)
    floats = client.embeddings.create(model=SERVED_NAME, input=TEXTS, encoding_format="float")
    assert floats.model == SERVED_NAME and floats.object == "list"
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert all(d.object == "embedding" for d in floats.data)
    _close([d.embedding for d in floats.data], setup.embeddings)
    tokens = sum(len(ids) for ids in setup.token_ids)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # The openai client asks for base64 by default and decodes the float32 bytes.
    packed = client.embeddings.create(model=SERVED_NAME, input=TEXTS)
    _close([d.embedding for d in packed.data], [d.embedding for d in floats.data])
    one = client.embeddings.create(model=SERVED_NAME, input=TEXTS[1], user="someone")
    _close([one.data[0].embedding], setup.embeddings[1:2])
    by_ids = client.embeddings.create(model=SERVED_NAME, input=setup.token_ids)
    _close([d.embedding for d in by_ids.data], setup.embeddings)
    single_ids = client.embeddings.create(model=SERVED_NAME, input=setup.token_ids[4])
    _close([single_ids.data[0].embedding], setup.embeddings[4:5])


def test_dimensions_truncate_then_normalize(setup):
    cut = _client(setup.embed).embeddings.create(model=SERVED_NAME, input=TEXTS, dimensions=16,
                                                 encoding_format="float")
    want = torch.nn.functional.normalize(setup.embeddings[:, :16].double(), dim=-1)
    assert all(len(d.embedding) == 16 for d in cut.data)
    _close([d.embedding for d in cut.data], want)
    _assert_error(_post(setup.plain, "/v1/embeddings", {"input": "x", "dimensions": 16}),
                  400, "dimensions", "matryoshka")
    _assert_error(_post(setup.embed, "/v1/embeddings", {"input": "x", "dimensions": 65}),
                  400, "dimensions", "exceeds")


def test_truncate_prompt_tokens_and_too_long_input(setup):
    long_text = " ".join(["word"] * (MAX_MODEL_LEN + 20))
    _assert_error(_post(setup.embed, "/v1/embeddings", {"input": long_text}), 400, "input",
                  "maximum context length")
    _assert_error(_post(setup.embed, "/v1/embeddings", {"input": ["ok", long_text]}), 400,
                  "input", "input[1]:")
    body = _ok(setup.embed, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 8})
    assert body["usage"]["prompt_tokens"] == 8
    body = _ok(setup.embed, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert body["usage"]["prompt_tokens"] == MAX_MODEL_LEN


VOCAB = 8192  # the demo tokenizer's (the embedder's vocabulary)
BAD_EMBEDDINGS = [  # body, param, a piece of the message
    ({"input": ""}, "input", "at least 1 character"),
    ({"input": []}, "input", "at least 1 item"),
    ({"input": ["ok", ""]}, "input", "at least 1 character"),
    ({"input": [[1, 2], []]}, "input", "at least 1 item"),
    ({"input": [5, VOCAB]}, "input", "outside the vocabulary"),
    ({"input": [[5], [VOCAB + 7]]}, "input", "input[1]: the input contains token id"),
    ({"input": [-1]}, "input", "greater than or equal to 0"),
    ({"input": {"text": "x"}}, "input", "a string, a list of strings"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    ({"input": "x", "normalize": "yes"}, "normalize", "boolean"),
    ({"input": "x", "priority": 1}, "priority", "--scheduling-policy priority"),
]


@pytest.mark.parametrize(("body", "param", "fragment"), BAD_EMBEDDINGS,
                         ids=[str(i) for i in range(len(BAD_EMBEDDINGS))])
def test_bad_embedding_requests_are_400s(setup, body, param, fragment):
    _assert_error(_post(setup.embed, "/v1/embeddings", body), 400, param, fragment)


def test_openai_client_raises_bad_request(setup):
    client = _client(setup.embed)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=SERVED_NAME, input=[""])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


# -- /pooling, /classify, /tokenize -------------------------------------------------------
def test_pooling_route(setup):
    body = _ok(setup.embed, "/pooling", {"input": TEXTS[:2]})  # the embedder's own task
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling"] * 2
    _close([d["data"] for d in body["data"]], setup.embeddings[:2])
    states = _ok(setup.embed, "/pooling", {"input": TEXTS[0], "task": "encode"})["data"][0]
    assert len(states["data"]) == len(setup.token_ids[0]) and len(states["data"][0]) == 64
    packed = _ok(setup.embed, "/pooling", {"input": TEXTS[0], "task": "encode",
                                           "encoding_format": "base64"})["data"][0]["data"]
    flat = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    _close(flat.tolist(), torch.tensor(states["data"]).reshape(-1))
    probs = _ok(setup.cross, "/pooling", {"input": TEXTS})  # the classifier's own task
    _close([d["data"] for d in probs["data"]], setup.probs)
    _assert_error(_post(setup.embed, "/pooling", {"input": "x", "task": "classify"}), 400,
                  "task", "does not support")
    _assert_error(_post(setup.cross, "/pooling", {"input": "x", "task": "reward"}), 400,
                  "task", "does not support")
    _assert_error(_post(setup.cross, "/pooling", {"input": "x", "task": "score"}), 400, "task")


def test_classify_probs_and_labels(setup):
    body = _ok(setup.cross, "/classify", {"input": TEXTS})
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["model"] == SERVED_NAME and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert {d["label"] for d in body["data"]} == {"LABEL_0"}  # the HF config's id2label
    assert {d["num_classes"] for d in body["data"]} == {1}
    _close([d["probs"] for d in body["data"]], setup.probs)
    assert body["usage"]["prompt_tokens"] > 0
    _assert_error(_post(setup.embed, "/classify", {"input": "x"}), 400, "model",
                  "does not support classification")


def test_tokenize_on_a_pooling_engine(setup):
    body = _ok(setup.embed, "/tokenize", {"prompt": TEXTS[0]})
    assert body["tokens"] == setup.token_ids[0] and body["count"] == len(body["tokens"])


# -- /score and /rerank -------------------------------------------------------------------
def test_score_one_against_many_and_pairwise(setup):
    body = _ok(setup.cross, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [(d["index"], d["object"]) for d in body["data"]] == [
        (i, "score") for i in range(len(DOCUMENTS))]
    _close([d["score"] for d in body["data"]], setup.cross_scores)
    assert body["usage"]["prompt_tokens"] > 0
    pairs = _ok(setup.cross, "/v1/score", {"text_1": TEXTS[:3], "text_2": DOCUMENTS[:3]})
    _close([d["score"] for d in pairs["data"]], setup.pair_scores)
    cosine = _ok(setup.embed, "/score", {"text_1": [QUERY], "text_2": DOCUMENTS})
    _close([d["score"] for d in cosine["data"]], setup.embed_scores)
    _assert_error(_post(setup.cross, "/score", {"text_1": TEXTS[:2], "text_2": DOCUMENTS}),
                  400, "text_2", "give one text_1")
    _assert_error(_post(setup.cross, "/score", {"text_1": "x", "text_2": []}), 400, "text_2")


def test_rerank_orders_like_offline_score(setup):
    want = sorted(range(len(DOCUMENTS)), key=lambda i: -setup.cross_scores[i])
    body = _ok(setup.cross, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert body["id"].startswith("rerank-") and body["model"] == SERVED_NAME
    assert [r["index"] for r in body["results"]] == want
    _close([r["relevance_score"] for r in body["results"]],
           [setup.cross_scores[i] for i in want])
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in want]
    assert body["usage"]["total_tokens"] > 0
    top = _ok(setup.cross, "/rerank", {"query": QUERY, "top_n": 2, "return_documents": False,
                                       "documents": [{"text": d} for d in DOCUMENTS]})
    assert [r["index"] for r in top["results"]] == want[:2]
    assert all("document" not in r for r in top["results"])
    cohere = _ok(setup.cross, "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                             "top_n": 0})
    assert [r["index"] for r in cohere["results"]] == want  # top_n 0: every document
    embedded = _ok(setup.embed, "/rerank", {"query": QUERY, "documents": DOCUMENTS})
    _close([r["relevance_score"] for r in embedded["results"]],
           sorted(setup.embed_scores, reverse=True))
    _assert_error(_post(setup.cross, "/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                                 "top_n": -1}), 400, "top_n")
    _assert_error(_post(setup.cross, "/rerank", {"query": QUERY, "documents": []}), 400,
                  "documents")
    _assert_error(_post(setup.embed, "/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                                 "use_activation": True}),
                  400, "use_activation", "cosine")


# -- what a model does not do -------------------------------------------------------------
def test_routes_a_model_does_not_serve_are_clear_400s(setup):
    _assert_error(_post(setup.cross, "/v1/embeddings", {"input": "x"}), 400, "model",
                  "does not support embeddings")
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/classify", {"input": "x"}),
                       ("/pooling", {"input": "x"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v2/rerank", {"query": "a", "documents": ["b"]})):
        _assert_error(_post(setup.generate, path, body), 400, "model", "generates text")
    with pytest.raises(openai.BadRequestError, match="does not support embeddings"):
        _client(setup.generate).embeddings.create(model=SERVED_NAME, input="x")
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/responses", {"input": "x"})):
        _assert_error(_post(setup.embed, path, body), 400, "model", "does not generate text")


def test_openapi_documents_the_routes_each_engine_serves(setup):
    pooling = httpx.get(setup.embed.url + "/openapi.json").json()
    posts = {path for path, ops in pooling["paths"].items() if "post" in ops}
    assert posts == {"/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score",
                     "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize"}
    ref = pooling["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["$ref"]
    assert pooling["components"]["schemas"][ref.rsplit("/", 1)[1]]["required"] == ["input"]
    generating = httpx.get(setup.generate.url + "/openapi.json").json()
    assert "/v1/embeddings" not in generating["paths"]


# -- cancellation -------------------------------------------------------------------------
def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        match = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def test_client_disconnect_aborts_every_input(setup):
    """A client that gives up on a large embedding request frees its engine requests."""
    url = setup.plain.url
    aborted_before = _metric(httpx.get(url + "/metrics").text, "engine:request_success_total",
                             finished_reason="abort")
    texts = [f"{i} " + " ".join(["word"] * 200) for i in range(256)]

    async def give_up() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=0.05)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url + "/v1/embeddings", json={"input": texts})

    asyncio.run(give_up())
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(url + "/metrics").text
        state = [_metric(text, f"engine:{name}") for name in
                 ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        aborted = _metric(text, "engine:request_success_total", finished_reason="abort")
        if (state == [0, 0, 0] and aborted > aborted_before) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state == [0, 0, 0]
    assert aborted > aborted_before
    # and the server serves on
    assert len(_ok(setup.plain, "/v1/embeddings", {"input": TEXTS})["data"]) == len(TEXTS)


def test_concurrent_requests_batch_and_stay_ordered(setup):
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=setup.plain.url, timeout=60) as client:
            responses = await asyncio.gather(*(
                client.post("/v1/embeddings", json={"input": TEXTS[i % len(TEXTS):]})
                for i in range(16)))
        return [json.loads(r.text) for r in responses]

    for i, body in enumerate(asyncio.run(run())):
        _close([d["embedding"] for d in body["data"]], setup.embeddings[i % len(TEXTS):])
